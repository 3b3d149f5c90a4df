"""Model families: what the dense part computes from the pooled cube rows.

Every family reads the same input, ``emb_concat`` [batch, slots * row_width]:
for each slot (slot.conf order) the SUM of the rows of its keys. A row is the
sparse table's pulled value, ``[embed_w] + embedx_w`` (Paddle's SparseAccessor),
so its columns are what cube serves. Families differ only in what they make of
those columns, and all of it is built here, inside the dense program, so
serving, offline evaluation, the promotion gate and shadow scoring stay
generic (look up, pool, run the dense program):

- ``dnn`` (the original): the whole row is the slot's embedding; MLP.
- ``wide_deep``: column 0 (embed_w) is a per-key weight summed into the logit
  (logistic regression on the same keys), columns 1.. feed the MLP.
- ``deepfm``: as wide_deep, plus factorisation-machine interactions between the
  slots' pooled embeddings (columns 1..).
- ``dcn``: as wide_deep, plus a DCN-v2 cross network (low-rank) on the
  concatenated embeddings beside the MLP.

Sum pooling is linear, so the pooled column 0 of a slot is the sum of its keys'
wide weights, and the wide sum over slots is exactly logistic regression.

Parameter names are fixed (``fc0.w``, ``cross0.u``, ...) because the training
program and the inference program are built separately and share them by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic_control.config.data_config import MODEL_FAMILIES

FAMILIES = MODEL_FAMILIES
# Families whose row column 0 is a per-key wide (logistic regression) weight.
WIDE_FAMILIES = ("wide_deep", "deepfm", "dcn")


@dataclass(frozen=True)
class FamilySpec:
    """The dense part's shape; everything the builders below need."""

    family: str
    num_slots: int
    row_width: int
    hidden: tuple[int, ...]
    cross_layers: int = 2
    cross_rank: int = 16
    dense_l2: float = 0.0  # L2 (weight decay) on the dense weights, applied by the optimizer
    dense_features: int = 0  # standardised dense slots after the pooled rows (ctr_foundation/dense_features.py)

    @property
    def has_wide(self) -> bool:
        return self.family in WIDE_FAMILIES

    @property
    def embedding_width(self) -> int:
        """Columns of a row that form the slot's embedding (the rest is the wide weight)."""
        return self.row_width - 1 if self.has_wide else self.row_width


def row_layout(family: str, row_width: int) -> dict:
    """meta.json ``row_layout``: what each column of a cube row (and of a pooled slot) means."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    if family in WIDE_FAMILIES:
        columns = [
            {"name": "wide", "offset": 0, "width": 1, "use": "summed over slots into the logit"},
            {"name": "embedding", "offset": 1, "width": row_width - 1, "use": _EMBEDDING_USE[family]},
        ]
    else:
        columns = [{"name": "embedding", "offset": 0, "width": row_width, "use": _EMBEDDING_USE[family]}]
    return {
        "width": row_width,
        "columns": columns,
        "pooling": "sum",
        "dense_input": "slot-major: slot i's pooled row at [i * width, (i + 1) * width)",
        "source": "[embed_w] + embedx_w of Paddle's SparseAccessor",
    }


_EMBEDDING_USE = {
    "dnn": "MLP input",
    "wide_deep": "MLP input",
    "deepfm": "MLP input and factorisation-machine interactions",
    "dcn": "MLP and cross-network input",
}


def _weight_attr(paddle, name, init, spec: FamilySpec):
    regularizer = paddle.regularizer.L2Decay(spec.dense_l2) if spec.dense_l2 else None
    return paddle.ParamAttr(name=name, initializer=init, regularizer=regularizer)


def _fc(paddle, x, width, name, spec: FamilySpec, *, activation=None, std=None):
    fan_in = x.shape[-1]
    init = paddle.nn.initializer.Normal(std=std if std is not None else 1.0 / math.sqrt(fan_in))
    return paddle.static.nn.fc(
        x,
        width,
        activation=activation,
        weight_attr=_weight_attr(paddle, f"{name}.w", init, spec),
        bias_attr=paddle.ParamAttr(name=f"{name}.b", initializer=paddle.nn.initializer.Constant(0.0)),
    )


def _mlp(paddle, x, spec: FamilySpec):
    h = x
    for i, width in enumerate(spec.hidden):
        h = _fc(paddle, h, width, f"fc{i}", spec, activation="relu")
    return h


# The output layer starts small so that the first logits are the bias (the base rate's log-odds):
# a model that starts calibrated spends its first steps on ranking, not on finding the mean.
OUTPUT_INIT_STD = 0.01


def dense_logit(paddle, x, spec: FamilySpec, *, bias_init: float = 0.0):
    """The family's logit [batch, 1] from ``x`` [batch, num_slots * row_width + dense_features]: the pooled
    rows, then the standardised dense slots, which join the embeddings as MLP and cross-network input."""
    s, w = spec.num_slots, spec.row_width
    dense = None
    if spec.dense_features:
        dense = x[:, s * w :]
        x = x[:, : s * w]
    if spec.has_wide:
        rows = paddle.reshape(x, [-1, s, w])
        wide = paddle.sum(rows[:, :, 0], axis=1, keepdim=True)
        emb = rows[:, :, 1:]  # [batch, slots, k]
        flat = paddle.reshape(emb, [-1, s * (w - 1)])
    else:
        wide, emb, flat = None, None, x
    if dense is not None:
        flat = paddle.concat([flat, dense], axis=1)
    parts = [_mlp(paddle, flat, spec)] if spec.hidden else []
    if spec.family == "dcn":
        parts.append(_cross_network(paddle, flat, spec))
    head = paddle.concat(parts, axis=1) if len(parts) > 1 else (parts[0] if parts else flat)
    logit = paddle.static.nn.fc(
        head,
        1,
        weight_attr=_weight_attr(paddle, "logit.w", paddle.nn.initializer.Normal(std=OUTPUT_INIT_STD), spec),
        bias_attr=paddle.ParamAttr(name="logit.b", initializer=paddle.nn.initializer.Constant(bias_init)),
    )
    if wide is not None:
        logit = logit + wide
    if spec.family == "deepfm":
        logit = logit + _fm_interactions(paddle, emb)
    return logit


def _fm_interactions(paddle, emb):
    """Sum over slot pairs i<j of <v_i, v_j>: 0.5 * sum_k ((sum_i v_ik)^2 - sum_i v_ik^2)."""
    summed = paddle.sum(emb, axis=1)
    return 0.5 * paddle.sum(summed * summed - paddle.sum(emb * emb, axis=1), axis=1, keepdim=True)


def _cross_network(paddle, x0, spec: FamilySpec):
    """DCN-v2 cross layers, low rank: x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l."""
    xl = x0
    d = x0.shape[-1]
    for i in range(spec.cross_layers):
        low = paddle.static.nn.fc(
            xl,
            spec.cross_rank,
            weight_attr=_weight_attr(paddle, f"cross{i}.v", paddle.nn.initializer.Normal(std=1.0 / math.sqrt(d)), spec),
            bias_attr=False,
        )
        up = _fc(paddle, low, d, f"cross{i}.u", spec, std=1.0 / math.sqrt(spec.cross_rank))
        xl = x0 * up + xl
    return xl


def dense_param_names(spec: FamilySpec) -> list[str]:
    """Every dense parameter of the family, in a fixed order (export checks, resume)."""
    names = []
    for i in range(len(spec.hidden)):
        names += [f"fc{i}.w", f"fc{i}.b"]
    if spec.family == "dcn":
        for i in range(spec.cross_layers):
            names += [f"cross{i}.v", f"cross{i}.u.w", f"cross{i}.u.b"]
    return names + ["logit.w", "logit.b"]
