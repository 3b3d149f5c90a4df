"""Single-process emulation of the product's model on slot-format hours, to find fast what can beat LR.

    .venv/bin/python bench/emulate_model.py data=DATASET_PATH [model=wd|fm|deepfm|lr] [passes=hour|replay|all] \
        [epochs=N] [wopt=adam|adagrad] [wlr=..] [eopt=..] [slr=..] [l2w=..] [l2e=..] [dim=8] [hidden=128,64] \
        [dropout=0] [decay=1.0] [peer=1] [c0=1] [tr=1]

Not the product (no parameter server, one process, Paddle dygraph): the same model shape (a per-key wide
weight, sum-pooled embeddings per slot, an MLP and/or FM interactions, the bias at the base rate), the
count-scaled L2 of training/model.py (``l2 * |row|^2 / count-in-pass / batch`` per occurrence), lazy Adam or
standard Adagrad per parameter group (wide weights, embeddings, dense), or ``sgdcount``: plain SGD whose
per-key rate is divided by sqrt(1 + sightings * tr / c0), the product's ``decay`` rule (training/rate_decay.py;
the product's rates are these / 128: Paddle pushes summed, not averaged, sparse gradients), batch 128.
The last hour under
``data`` is the test hour; ``passes=hour`` trains hour by hour like the product's passes, ``passes=replay``
hour by hour with each pass over every hour so far, ``passes=all`` on all training hours pooled (what
scikit-learn's logistic regression sees). ``decay`` multiplies every rate by decay**epoch. ``peer=1`` also
fits scikit-learn's logistic regression (C=0.1) on the same one-hot keys and prints the difference. Prints the
test hour's AUC, log loss and calibration after every epoch. Figures: CHANGELOG.md, "Model quality
on the Criteo split".
"""

import sys
import time
from pathlib import Path

import pyarrow  # noqa: F401

import numpy as np
import paddle

from ctr_foundation.sample import parse_sample_line
from elastic_control.metrics import auc as roc_auc_score
from elastic_control.metrics import log_loss

paddle.set_device("cpu")
cfg = dict(  # noqa: C408
    model="wd",
    epochs=1,
    dim=8,
    hidden="128,64",
    bs=128,
    lr=1e-3,
    slr=0.01,
    wlr=0.01,
    l2w=2.0,
    l2e=2.0,
    dropout=0.0,
    seed=1,
    passes="hour",
    wopt="adam",
    eopt="adam",
    avg=0,
    data="",
    hours=5,
    decay=1.0,
    rare=0,
    peer=0,
    c0=1.0,
    tr=1,
)
for a in sys.argv[1:]:
    k, v = a.split("=", 1)
    if k not in cfg:
        sys.exit(f"unknown setting {k!r}; known: {', '.join(cfg)}")
    cfg[k] = type(cfg[k])(v) if not isinstance(cfg[k], str) else v
print(cfg, flush=True)
paddle.seed(cfg["seed"])
np.random.seed(cfg["seed"])

hours = []
vocab = {}
for h in range(cfg["hours"]):
    rows, ys = [], []
    d = Path(cfg["data"]) / "20200101" / f"{h:02d}"
    for p in sorted(d.glob("part-*")):
        for ln in p.read_text().splitlines():
            sample = parse_sample_line(ln)  # the grammar's one reader (value tokens of dense slots left out)
            ys.append(sample.click)
            rows.append(list(zip(sample.feasigns, sample.slots, strict=True)))
    hours.append((rows, np.array(ys, dtype="float32")))
SLOTS = sorted({s for h in hours for r in h[0][:2000] for _, s in r})
SI = {s: i for i, s in enumerate(SLOTS)}
S = len(SLOTS)
M = max(sum(1 for _, s in r if s == q) for h in hours for r in h[0][:5000] for q in SLOTS)
train_rows = [r for h in hours[:-1] for r in h[0]]
if cfg["rare"]:
    from collections import Counter

    cnt = Counter(k for r in train_rows for k, _ in r)


def idx(rows, grow):
    out = np.zeros((len(rows), S, M), dtype="int64")
    for i, r in enumerate(rows):
        fill = [0] * S
        for k, sl in r:
            j = SI[sl]
            m = fill[j]
            fill[j] += 1
            if m >= M:
                continue
            if cfg["rare"] and cnt.get(k, 0) < cfg["rare"]:
                k = ("rare", j)
            if grow:
                out[i, j, m] = vocab.setdefault(k, len(vocab) + 1)
            else:
                out[i, j, m] = vocab.get(k, 0)
    return out


X = [idx(h[0], i < len(hours) - 1) for i, h in enumerate(hours)]
Y = [h[1] for h in hours]
V = len(vocab) + 1
print("vocab", V, flush=True)


class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        init = paddle.nn.initializer.Uniform(-0.01, 0.01)
        self.w = paddle.nn.Embedding(
            V,
            1,
            sparse=True,
            padding_idx=0,
            weight_attr=paddle.ParamAttr(initializer=paddle.nn.initializer.Constant(0.0)),
        )
        self.e = paddle.nn.Embedding(
            V, cfg["dim"], sparse=True, padding_idx=0, weight_attr=paddle.ParamAttr(initializer=init)
        )
        hid = [int(x) for x in cfg["hidden"].split(",")] if cfg["hidden"] not in ("", "none") else []
        layers, n = [], S * cfg["dim"]
        for w in hid:
            layers += [paddle.nn.Linear(n, w), paddle.nn.ReLU()]
            if cfg["dropout"]:
                layers.append(paddle.nn.Dropout(cfg["dropout"]))
            n = w
        self.mlp = paddle.nn.Sequential(*layers) if layers else None
        self.out = paddle.nn.Linear(
            n, 1, weight_attr=paddle.ParamAttr(initializer=paddle.nn.initializer.Normal(std=0.01))
        )

    def forward(self, x, scale=None):
        w, e = self.w(x), self.e(x)
        if scale is not None:  # the product's per-key rate decay: gradient x scale, forward unchanged
            if cfg["wopt"] == "sgdcount":
                w = w * scale + (w * (1 - scale)).detach()
            if cfg["eopt"] == "sgdcount":
                e = e * scale + (e * (1 - scale)).detach()
        w = paddle.sum(w, axis=2)  # [b,S,1]
        e = paddle.sum(e, axis=2)  # [b,S,d]
        logit = paddle.sum(w, axis=[1, 2]).unsqueeze(-1)
        m = cfg["model"]
        if m in ("wd", "deepfm"):
            h = paddle.reshape(e, [-1, S * cfg["dim"]])
            if self.mlp is not None:
                h = self.mlp(h)
            logit = logit + self.out(h)
        else:
            logit = logit + self.out.bias
        if m in ("fm", "deepfm"):
            s = paddle.sum(e, axis=1)
            logit = logit + 0.5 * paddle.sum(s * s - paddle.sum(e * e, axis=1), axis=1, keepdim=True)
        return logit, w, e


net = Net()
base = float(np.mean(np.concatenate(Y[:-1])))
net.out.bias.set_value(np.array([np.log(base / (1 - base))], dtype="float32"))


def opt(name, params, lr):
    if name == "adam":
        return paddle.optimizer.Adam(lr, parameters=params, lazy_mode=True)
    if name == "adagrad":
        return paddle.optimizer.Adagrad(lr, parameters=params, initial_accumulator_value=1e-6)
    if name in ("sgd", "sgdcount"):
        return paddle.optimizer.SGD(lr, parameters=params)
    raise ValueError(name)


dense = [p for n, p in net.named_parameters() if not (n.startswith("w.") or n.startswith("e."))]
ow = opt(cfg["wopt"], [net.w.weight], cfg["wlr"])
oe = opt(cfg["eopt"], [net.e.weight], cfg["slr"])
od = paddle.optimizer.Adam(cfg["lr"], parameters=dense)


def predict(x):
    net.eval()
    out = []
    with paddle.no_grad():
        for i in range(0, len(x), 4096):
            out.append(paddle.nn.functional.sigmoid(net(paddle.to_tensor(x[i : i + 4096]))[0]).numpy()[:, 0])
    net.train()
    return np.concatenate(out)


def report(tag):
    p = predict(X[-1])
    y = Y[-1]
    a = roc_auc_score(y, p)
    vs = f" ({a - PEER:+.4f} vs LR)" if cfg["peer"] else ""
    print(f"{tag}: AUC {a:.4f}{vs} logloss {log_loss(y, p):.4f} cal {p.mean() / y.mean():.3f}", flush=True)
    return p


if cfg["peer"]:
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegression

    def onehot(x):
        rows = np.repeat(np.arange(len(x)), x.shape[1] * x.shape[2])
        cols = x.reshape(-1)
        keep = cols > 0
        return sp.csr_matrix((np.ones(keep.sum()), (rows[keep], cols[keep])), shape=(len(x), V))

    lr_model = LogisticRegression(C=0.1, max_iter=2000, solver="liblinear")
    lr_model.fit(onehot(np.concatenate(X[:-1])), np.concatenate(Y[:-1]))
    PEER = roc_auc_score(Y[-1], lr_model.predict_proba(onehot(X[-1]))[:, 1])
    print(f"peer: scikit-learn logistic regression C=0.1 AUC {PEER:.4f}", flush=True)

t0 = time.time()
bs = cfg["bs"]
if cfg["passes"] == "hour":
    sched = [[h] for h in range(len(X) - 1)]
elif cfg["passes"] == "replay":  # each hourly pass trains on every hour so far
    sched = [list(range(h + 1)) for h in range(len(X) - 1)]
else:
    sched = [list(range(len(X) - 1))]
lrs = (cfg["wlr"], cfg["slr"], cfg["lr"])
seen = np.zeros(V, dtype="float64")  # sightings before this epoch (sgdcount)
decayed = "sgdcount" in (cfg["wopt"], cfg["eopt"])
for pi, hs in enumerate(sched):
    x = np.concatenate([X[h] for h in hs])
    y = np.concatenate([Y[h] for h in hs])
    for ep in range(cfg["epochs"]):
        f = cfg["decay"] ** ep
        ow.set_lr(lrs[0] * f)
        oe.set_lr(lrs[1] * f)
        od.set_lr(lrs[2] * f)
        # count-scaled l2: counts in this pass
        cnt = np.bincount(x.ravel(), minlength=V).astype("float32")
        perm = np.random.permutation(len(x))
        for i in range(0, len(x), bs):
            b = perm[i : i + bs]
            xb = paddle.to_tensor(x[b])
            yb = paddle.to_tensor(y[b][:, None])
            scale = None
            if decayed:  # sightings so far: earlier epochs + this epoch's share seen, x trainers of the product
                n = seen[x[b]] + cnt[x[b]] * (i / len(x))
                factor = (1.0 / np.sqrt(1.0 + n * cfg["tr"] / cfg["c0"])).astype("float32")
                scale = paddle.to_tensor(factor)[:, :, :, None]
            logit, w, e = net(xb, scale)
            loss = paddle.nn.functional.binary_cross_entropy_with_logits(logit, yb)
            sc = paddle.to_tensor(1.0 / np.maximum(cnt[x[b]], 1))[:, :, :, None]
            reg = 0
            if cfg["l2w"]:
                wr = net.w(xb)
                reg = reg + cfg["l2w"] * paddle.sum(wr * wr * sc)
            if cfg["l2e"]:
                er = net.e(xb)
                reg = reg + cfg["l2e"] * paddle.sum(er * er * sc)
            loss = loss + reg / len(b)
            loss.backward()
            ow.step()
            oe.step()
            od.step()
            ow.clear_grad()
            oe.clear_grad()
            od.clear_grad()
        seen += cnt
        report(f"pass {pi} epoch {ep} ({time.time() - t0:.0f}s)")
