"""The CTR network (the original's): per-slot sum-pooled sparse embeddings, concat, MLP 400-400-400, sigmoid.

Two programs share the dense parameters by name:
- the training net, built in Paddle's DEFAULT main/startup programs (fleet's
  parameter-server passes rewrite them; a custom program_guard there fails
  with "Input id (N) is not in current rows table" in 2.6.2);
- the inference net of the dense part alone, whose single input is the
  concatenation, in slot.conf order, of the pooled embeddings
  (``pass_format.DENSE_INPUT``); that is what serving runs.

Import paddle only through this package's role modules: pyarrow (and mlflow)
must be imported first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ctr_foundation.pass_format import DENSE_INPUT

SPARSE_TABLE_NAME = "SparseFeatFactors"
DEFAULT_EMBEDDING_DIM = 9
DEFAULT_HIDDEN = (400, 400, 400)
LABEL_INPUT = "click"


def slot_input_name(slot: int) -> str:
    return f"slot_{slot}"


@dataclass(frozen=True)
class ModelSpec:
    slots: tuple[int, ...]
    embedding_dim: int = DEFAULT_EMBEDDING_DIM
    hidden: tuple[int, ...] = DEFAULT_HIDDEN
    learning_rate: float = 1e-3
    sparse_dim: int | None = None
    sparse_learning_rate: float = 0.02

    def to_json(self) -> dict:
        return {
            "slots": list(self.slots),
            "embedding_dim": self.embedding_dim,
            "hidden": list(self.hidden),
            "learning_rate": self.learning_rate,
            "sparse_learning_rate": self.sparse_learning_rate,
            "sparse_dim": self.sparse_dim,
        }


@dataclass
class TrainingNet:
    """Handles on the variables of the built training net."""

    slot_inputs: list
    label: object
    prob: object
    loss: object
    infer_program: object
    infer_input: object
    infer_prob: object
    dense_param_names: list[str] = field(default_factory=list)


def _dense_tower(paddle, x, hidden):
    """The MLP on the concatenated embeddings; parameter names are fixed so both programs share them."""
    import math

    h = x
    fan_in = x.shape[-1]
    for i, width in enumerate(hidden):
        init = paddle.nn.initializer.Normal(std=1.0 / math.sqrt(fan_in))
        h = paddle.static.nn.fc(
            h,
            width,
            activation="relu",
            weight_attr=paddle.ParamAttr(name=f"fc{i}.w", initializer=init),
            bias_attr=paddle.ParamAttr(name=f"fc{i}.b"),
        )
        fan_in = width
    init = paddle.nn.initializer.Normal(std=1.0 / math.sqrt(fan_in))
    return paddle.static.nn.fc(
        h, 1, weight_attr=paddle.ParamAttr(name="logit.w", initializer=init), bias_attr=paddle.ParamAttr(name="logit.b")
    )


def dense_param_names(hidden) -> list[str]:
    names = []
    for i in range(len(hidden)):
        names += [f"fc{i}.w", f"fc{i}.b"]
    return names + ["logit.w", "logit.b"]


def build_training_net(paddle, spec: ModelSpec, *, embedding_hook=None) -> TrainingNet:
    """Build the training net in the default programs and the dense inference program beside it.

    ``embedding_hook(slot, emb) -> emb`` rewrites each slot's looked-up embeddings before pooling
    (feature admission's mask, training/admission.py).
    """
    slot_inputs = [
        paddle.static.data(name=slot_input_name(s), shape=[-1, 1], dtype="int64", lod_level=1) for s in spec.slots
    ]
    label = paddle.static.data(name=LABEL_INPUT, shape=[-1, 1], dtype="float32")
    init = paddle.nn.initializer.Uniform(-0.01, 0.01)
    pooled = []
    for slot, x in zip(spec.slots, slot_inputs, strict=True):
        emb = paddle.static.nn.sparse_embedding(
            input=x,
            size=[1024, spec.embedding_dim],
            param_attr=paddle.ParamAttr(name=SPARSE_TABLE_NAME, initializer=init),
        )
        if embedding_hook is not None:
            emb = embedding_hook(slot, emb)
        pooled.append(paddle.static.nn.sequence_lod.sequence_pool(emb, pool_type="sum"))
    logit = _dense_tower(paddle, paddle.concat(pooled, axis=1), spec.hidden)
    prob = paddle.nn.functional.sigmoid(logit)
    loss = paddle.mean(paddle.nn.functional.binary_cross_entropy_with_logits(logit, label))

    infer, infer_startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(infer, infer_startup):
        emb_concat = paddle.static.data(
            name=DENSE_INPUT, shape=[-1, len(spec.slots) * spec.embedding_dim], dtype="float32"
        )
        infer_prob = paddle.nn.functional.sigmoid(_dense_tower(paddle, emb_concat, spec.hidden))
    return TrainingNet(slot_inputs, label, prob, loss, infer, emb_concat, infer_prob, dense_param_names(spec.hidden))


# Shards of the sparse table per pserver. Paddle's default (1000) writes 1000
# files per save and makes every pass export take tens of seconds.
SPARSE_SHARDS = 16
SPARSE_ACCESSOR = "SparseAccessor"
SPARSE_RULE = "SparseAdamSGDRule"


def make_strategy(fleet, *, sparse_learning_rate: float, shards: int = SPARSE_SHARDS, accessor: dict | None = None):
    """Fully asynchronous parameter-server training (the original's setting), table layout pinned.

    The accessor and the sparse optimizer rule decide the saved table's columns
    (pass_format.SparseLayout), so they are set explicitly, not left to defaults.
    ``accessor`` adds accessor settings (``{"ctr_accessor_param.delta_threshold": ...}``: the
    incremental export's, training/delta_export.py).
    """
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    prefix = f"table_parameters.{SPARSE_TABLE_NAME}"
    strategy.sparse_table_configs = {
        SPARSE_TABLE_NAME: {
            f"{prefix}.table_class": "MemorySparseTable",
            f"{prefix}.shard_num": shards,
            f"{prefix}.accessor.accessor_class": SPARSE_ACCESSOR,
            f"{prefix}.accessor.embed_sgd_param.name": SPARSE_RULE,
            f"{prefix}.accessor.embedx_sgd_param.name": SPARSE_RULE,
            # Embeddings get few updates each (a key is in few batches): they learn
            # with their own, larger rate than the dense tower's Adam.
            f"{prefix}.accessor.embed_sgd_param.adam.learning_rate": sparse_learning_rate,
            f"{prefix}.accessor.embedx_sgd_param.adam.learning_rate": sparse_learning_rate,
            **{f"{prefix}.accessor.{k}": v for k, v in (accessor or {}).items()},
        }
    }
    return strategy
