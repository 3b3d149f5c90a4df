"""The CTR network: per-slot sum-pooled sparse embeddings, concat, the family's dense part (families.py), sigmoid.

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
from elastic_control.training.families import FamilySpec, dense_logit, dense_param_names

SPARSE_TABLE_NAME = "SparseFeatFactors"
DEFAULT_EMBEDDING_DIM = 9
DEFAULT_HIDDEN = (128, 64)  # the original's 400-400-400 overfits small passes (settings.py)
LABEL_INPUT = "click"
# How a trainer's executor runs the training program (paddle.set_flags, before the first run). Each step
# runs a few hundred small ops: run in order on the calling thread, they cost less than handed to the
# executor's worker threads and waited for (3-8% more examples/s, 1 or 2 trainers). No garbage collection
# inside a run: its work queue's thread spins between a step's ops (about a fifth of a core a trainer, perf:
# ThreadPoolTempl::WorkerLoop), a core the other trainer and the pserver need; a step's temporaries stay
# allocated until the next run of the program reuses them.
EXECUTOR_FLAGS = {"FLAGS_new_executor_serial_run": True, "FLAGS_eager_delete_tensor_gb": -1.0}
# embedx_w starts uniform in +-INITIAL_RANGE; embed_w starts at 0 (the accessor's zero_init). 0.05, not
# 0.01: the deep part learns interactions through products of embeddings and MLP weights, and from rows
# near zero it sat on a plateau (held-out loss flat for epochs 5-9 of the first pass) that a run left by
# chance or not at all: on the synthetic interaction data six of seven runs of the defaults ended at or near
# logistic regression's level (0.7737-0.7860, Bayes-optimal 0.8201). At 0.05 and 0.1 six runs of six
# reached 0.811-0.813; the Criteo split, Frappe, the small Criteo logs and three other synthetic data sets
# unchanged within run-to-run noise (CHANGELOG.md "Embeddings that start off the plateau").
INITIAL_RANGE = 0.05


# The net's inputs. Every slot's keys of a batch are one LoD tensor, slot after slot (len(slots) x batch
# sequences: slot 0's lines, then slot 1's, ...), looked up and pooled by one op each; the per-key inputs
# below are plain [keys, 1] float tensors in the same order. One tensor per slot and per-key input (8
# slots: 24 tensors and 8 lookups, pools and decay products a batch) cost a fifth of the trainers' time.
KEYS_INPUT = "slot_keys"
KEY_RATE_INPUT = "key_rate"  # per key: its rate factor under the ``decay`` rule (see ``decayed_rows``)
KEY_L2_INPUT = "key_l2"  # per key: 1 / its count in the trainer's share of the pass (the count-scaled L2)
KEY_ANCHOR_INPUT = "key_anchor"  # per key: the wide weight its L2 pulls toward (training/wide_prior.py)
KEY_ANCHOR_WEIGHT_INPUT = "key_anchor_weight"  # per key: the strength of that pull
DENSE_VALUES_INPUT = "dense_values"  # [batch, dense slots]: the standardised dense slots (DenseNorm.apply)


@dataclass(frozen=True)
class ModelSpec:
    slots: tuple[int, ...]
    embedding_dim: int = DEFAULT_EMBEDDING_DIM  # the row width: embed_w + embedx_w(d-1)
    hidden: tuple[int, ...] = DEFAULT_HIDDEN
    learning_rate: float = 1e-3
    sparse_dim: int | None = None
    sparse_learning_rate: float = 0.02
    family: str = "dnn"
    wide_learning_rate: float = 0.02  # embed_w's rule (the wide weight in the wide families)
    sparse_optimizer: str = "adam"  # embedx_w's rule: adam | adagrad | decay (SPARSE_RULES)
    wide_optimizer: str = "adam"  # embed_w's rule
    decay_sightings: float = 30.0  # the decay rule: a key's rate halves after 3x this many sightings
    l2_embedding: float = 0.0  # count-scaled L2 strength on embedx_w (the whole row for dnn); see build_training_net
    l2_wide: float = 0.0  # the same on embed_w (wide families)
    cross_layers: int = 2
    cross_rank: int = 16
    dense_l2: float = 0.0  # weight decay of the dense weights
    # The wide prior: a key's wide-weight L2 pulls toward its weight at the pass start, with l2_wide plus
    # this much per occurrence trained in earlier passes (training/wide_prior.py); 0: toward 0.
    wide_prior: float = 0.0
    # Dense slots (slot.conf ``SLOT dense``): their standardised values join the dense part's input
    # after the pooled rows (ctr_foundation/dense_features.py).
    dense_slots: tuple[int, ...] = ()

    @property
    def uses_wide_prior(self) -> bool:
        return bool(self.wide_prior and self.l2_wide and self.family_spec.has_wide)

    @property
    def uses_decay(self) -> bool:
        """A part of the rows learns with the ``decay`` rule, so the trainers feed per-key rate factors."""
        return DECAY_RULE in (self.sparse_optimizer, self.wide_optimizer)

    @property
    def family_spec(self) -> FamilySpec:
        return FamilySpec(
            self.family,
            len(self.slots),
            self.embedding_dim,
            self.hidden,
            self.cross_layers,
            self.cross_rank,
            self.dense_l2,
            len(self.dense_slots),
        )

    def to_json(self) -> dict:
        return {
            "family": self.family,
            "slots": list(self.slots),
            "embedding_dim": self.embedding_dim,
            "hidden": list(self.hidden),
            "learning_rate": self.learning_rate,
            "sparse_learning_rate": self.sparse_learning_rate,
            "wide_learning_rate": self.wide_learning_rate,
            "sparse_optimizer": self.sparse_optimizer,
            "wide_optimizer": self.wide_optimizer,
            **({"decay_sightings": self.decay_sightings} if self.uses_decay else {}),
            "l2_embedding": self.l2_embedding,
            "l2_wide": self.l2_wide,
            **({"wide_prior": self.wide_prior} if self.uses_wide_prior else {}),
            "dense_l2": self.dense_l2,
            "sparse_dim": self.sparse_dim,
            **({"dense_slots": list(self.dense_slots)} if self.dense_slots else {}),
            **({"cross_layers": self.cross_layers, "cross_rank": self.cross_rank} if self.family == "dcn" else {}),
        }


@dataclass
class TrainingNet:
    """Handles on the variables of the built training net."""

    keys: object  # KEYS_INPUT
    label: object
    prob: object
    loss: object
    infer_program: object
    infer_input: object
    infer_prob: object
    rows: object  # every slot's looked-up rows, slot after slot (after the admission mask): the trainer's lookups
    dense_param_names: list[str] = field(default_factory=list)
    log_loss: object = None  # the data term of ``loss`` (without the L2 terms)
    l2_input: object = None  # KEY_L2_INPUT (None without L2)
    rate_input: object = None  # KEY_RATE_INPUT (None without the decay rule)
    anchor_inputs: tuple | None = None  # (KEY_ANCHOR_INPUT, KEY_ANCHOR_WEIGHT_INPUT) with the wide prior
    dense_input: object = None  # DENSE_VALUES_INPUT (None without dense slots)

    @property
    def uses_l2(self) -> bool:
        return self.l2_input is not None

    @property
    def uses_decay(self) -> bool:
        return self.rate_input is not None


def decayed_rows(paddle, emb, factor):
    """The rows unchanged forward, their gradient times ``factor`` (one value per looked-up key, or one for all).

    The ``decay`` rule's pserver side is plain SGD (``w -= rate * gradient``), so scaling a key's
    gradient here scales its step: the trainers give each key the rate factor
    ``1 / sqrt(1 + sightings / decay_sightings)``, a per-key rate that decays as the key is seen
    (Adagrad's schedule) but whose first steps are the full rate, not a jump. Paddle 2.6.2's own
    rules cannot do that: Adam's step does not decay, and its Adagrad rule's first steps are plain
    SGD at the full rate (CHANGELOG.md, "The decay rule").
    """
    held = emb * (1.0 - factor)
    held.stop_gradient = True
    return emb * factor + held


def _l2_of_rows(paddle, emb, scale, spec: ModelSpec, anchor=None):
    """Sum over the batch's looked-up rows of the count-scaled L2 terms (embed_w and embedx_w apart).

    ``anchor``: (values, weights) per row with the wide prior: embed_w's term is then
    ``weight * (embed_w - value)^2 * scale`` (the weight includes l2_wide), else ``l2_wide * embed_w^2 * scale``.
    """
    terms = []
    wide = spec.family_spec.has_wide
    if wide and anchor is not None:
        values, weights = anchor
        terms.append(paddle.sum(paddle.square(emb[:, 0:1] - values) * scale * weights))
    elif wide and spec.l2_wide:
        terms.append(spec.l2_wide * paddle.sum(paddle.square(emb[:, 0:1]) * scale))
    if spec.l2_embedding:
        cols = emb[:, 1:] if wide else emb
        terms.append(spec.l2_embedding * paddle.sum(paddle.sum(paddle.square(cols), axis=1, keepdim=True) * scale))
    return terms


def pooled_by_line(paddle, rows, slots: int, dim: int):
    """Sum-pool KEYS_INPUT-ordered rows (one LoD sequence per slot and line, slot after slot) into
    ``[batch, slots * dim]``: each line's pooled slots side by side in slot.conf order (DENSE_INPUT's layout)."""
    pooled = paddle.static.nn.sequence_lod.sequence_pool(rows, pool_type="sum")  # [slots * batch, dim]
    return paddle.reshape(paddle.transpose(paddle.reshape(pooled, [slots, -1, dim]), [1, 0, 2]), [-1, slots * dim])


def build_training_net(paddle, spec: ModelSpec, *, embedding_hook=None) -> TrainingNet:
    """Build the training net in the default programs and the dense inference program beside it.

    ``embedding_hook(rows) -> rows`` rewrites the looked-up rows (every slot's, in KEYS_INPUT's order)
    before pooling (feature admission's mask, training/admission.py); the L2 terms below see the rewritten
    rows, so a key the mask holds back gets no gradient from them either.

    The loss is the mean log loss of the batch plus, with ``l2_wide``/``l2_embedding`` set, a
    count-scaled L2 on the looked-up rows: each occurrence of key k adds
    ``lambda * |row part|^2 * scale_k / batch`` where the feed gives scale_k = 1 / (k's count in this
    trainer's share of the pass). Over one epoch every key is then pulled toward 0 with the same
    strength ``lambda / batch`` whatever its frequency: logistic regression's L2 (scikit-learn's
    C = 1 / (2 * lambda)), where a per-occurrence L2 would barely touch the rare keys that overfit.
    """
    keys = paddle.static.data(name=KEYS_INPUT, shape=[-1, 1], dtype="int64", lod_level=1)
    label = paddle.static.data(name=LABEL_INPUT, shape=[-1, 1], dtype="float32")

    def per_key(name):
        return paddle.static.data(name=name, shape=[-1, 1], dtype="float32")

    uses_l2 = bool(spec.l2_embedding or (spec.l2_wide and spec.family_spec.has_wide))
    l2_input = per_key(KEY_L2_INPUT) if uses_l2 else None
    rate_input = per_key(KEY_RATE_INPUT) if spec.uses_decay else None
    anchor = (per_key(KEY_ANCHOR_INPUT), per_key(KEY_ANCHOR_WEIGHT_INPUT)) if spec.uses_wide_prior else None
    init = paddle.nn.initializer.Uniform(-INITIAL_RANGE, INITIAL_RANGE)
    rows = paddle.static.nn.sparse_embedding(
        input=keys,
        size=[1024, spec.embedding_dim],
        param_attr=paddle.ParamAttr(name=SPARSE_TABLE_NAME, initializer=init),
    )
    if embedding_hook is not None:
        rows = embedding_hook(rows)
    # Paddle's push multiplies the rows' gradients by the ids' LoD sequence count, meant as the batch size
    # (FleetWrapper::PushSparseFromTensorAsync undoes the mean loss): here that count is slots x batch, so
    # the rows' gradients are divided by the slot count to push what one lookup per slot pushed. Before
    # the L2 terms and with the decay rule's factors: a key's whole gradient.
    per_slot = 1.0 / len(spec.slots)
    if rate_input is not None:
        trained = decayed_rows(paddle, rows, rate_input * per_slot)
    elif len(spec.slots) > 1:
        trained = decayed_rows(paddle, rows, per_slot)
    else:
        trained = rows
    n, d = len(spec.slots), spec.embedding_dim
    family = spec.family_spec
    pooled = pooled_by_line(paddle, trained, n, d)
    dense_input = None
    if spec.dense_slots:
        dense_input = paddle.static.data(name=DENSE_VALUES_INPUT, shape=[-1, len(spec.dense_slots)], dtype="float32")
        pooled = paddle.concat([pooled, dense_input], axis=1)
    logit = dense_logit(paddle, pooled, family)
    prob = paddle.nn.functional.sigmoid(logit)
    log_loss = paddle.mean(paddle.nn.functional.binary_cross_entropy_with_logits(logit, label))
    loss = log_loss
    l2_terms = _l2_of_rows(paddle, trained, l2_input, spec, anchor) if uses_l2 else []
    if l2_terms:
        batch = paddle.cast(paddle.shape(label)[0], "float32")
        loss = log_loss + paddle.add_n(l2_terms) / batch

    infer, infer_startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(infer, infer_startup):
        # The pooled rows, then the standardised dense slots: serving's one input.
        emb_concat = paddle.static.data(name=DENSE_INPUT, shape=[-1, n * d + len(spec.dense_slots)], dtype="float32")
        infer_prob = paddle.nn.functional.sigmoid(dense_logit(paddle, emb_concat, family))
    return TrainingNet(
        keys,
        label,
        prob,
        loss,
        infer,
        emb_concat,
        infer_prob,
        rows,
        dense_param_names(family),
        log_loss,
        l2_input,
        rate_input,
        anchor,
        dense_input,
    )


# Shards of the sparse table per pserver. Paddle's default (1000 in all) writes 1000 files per save and makes
# every pass export take tens of seconds. Fewer is faster at every step too: a pserver hands each pull and
# push to every one of its shards' task threads, even shards the request has no key in, and waits for them
# all. With 16 shards on one pserver, two trainers made it switch context 250,000 times a second (4,000
# with 2 shards), and examples/s rose 13-23% with 1 trainer and 15-16% with 2 once it had 2 (CHANGELOG.md,
# "Two table shards a pserver"). More than one per pserver keeps a second core busy there.
SHARDS_PER_PSERVER = 2


def table_shards(pservers: int) -> int:
    """The sparse table's shards (Paddle's ``shard_num``, a save's part files) for a job of ``pservers``."""
    return SHARDS_PER_PSERVER * pservers


SPARSE_ACCESSOR = "SparseAccessor"
# The sparse optimizer rules the trainer can pin -> (Paddle's rule, its parameter block = the
# pass_format.SparseLayout name of the saved columns). ``decay`` is plain SGD on the pservers with
# the per-key rate factors the trainers feed (``decayed_rows``).
DECAY_RULE = "decay"
SPARSE_RULES = {
    "adam": ("SparseAdamSGDRule", "adam"),
    "adagrad": ("SparseAdaGradSGDRule", "adagrad"),
    DECAY_RULE: ("SparseNaiveSGDRule", "naive"),
}


def saved_rule(rule: str) -> str:
    """The pass_format.SparseLayout name of the columns a rule saves."""
    return SPARSE_RULES[rule][1]


def make_strategy(fleet, spec: ModelSpec, *, shards: int, accessor: dict | None = None):
    """Fully asynchronous parameter-server training (the original's setting), table layout pinned.

    The accessor and the sparse optimizer rules decide the saved table's columns
    (pass_format.SparseLayout), so they are set explicitly, not left to defaults.
    embed_w (the wide weight of the wide families) and embedx_w have a rule each.
    ``accessor`` adds accessor settings (``{"ctr_accessor_param.delta_threshold": ...}``: the
    incremental export's, training/delta_export.py).
    """
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = True
    prefix = f"table_parameters.{SPARSE_TABLE_NAME}"
    config = {
        f"{prefix}.table_class": "MemorySparseTable",
        f"{prefix}.shard_num": shards,
        f"{prefix}.accessor.accessor_class": SPARSE_ACCESSOR,
    }
    for part, rule, rate in (
        ("embed", spec.wide_optimizer, spec.wide_learning_rate),
        ("embedx", spec.sparse_optimizer, spec.sparse_learning_rate),
    ):
        # Embeddings get few updates each (a key is in few batches): they learn
        # with their own, larger rate than the dense tower's Adam.
        paddle_rule, block = SPARSE_RULES[rule]
        config[f"{prefix}.accessor.{part}_sgd_param.name"] = paddle_rule
        config[f"{prefix}.accessor.{part}_sgd_param.{block}.learning_rate"] = rate
        # The same start as the Adam rule's (which takes the initializer's range); adagrad's own default is 1e-4.
        config[f"{prefix}.accessor.{part}_sgd_param.{block}.initial_range"] = INITIAL_RANGE
    config.update({f"{prefix}.accessor.{k}": v for k, v in (accessor or {}).items()})
    strategy.sparse_table_configs = {SPARSE_TABLE_NAME: config}
    return strategy
