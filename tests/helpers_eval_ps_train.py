"""Test fixture script: a short real parameter-server run that writes a pass folder.

Run by tests/helpers_eval.py as one pserver and one trainer process (roles
from the standard Paddle variables). It trains the DESIGN model shape
(sum-pooled sparse embeddings per slot, concatenated, an MLP, a click
probability) in Paddle's default programs with ``a_sync``, and trainer 0
writes the pass_format layout: ``dense/inference.*`` from a separate inference
program, ``sparse/`` through ``fleet.save_persistables``, ``meta.json`` and
``golden.jsonl`` scored by the training program itself after the export.

It exists so evaluation can be tested on a real pass before the training
engineer's ``elastic-control train`` lands; it is not product code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import pyarrow  # noqa: F401  (import before paddle, or paddle breaks pyarrow's zlib)

import numpy as np
import paddle
import paddle.distributed.fleet as fleet

from ctr_foundation.sample import keys_to_paddle_ids, parse_sample_line, slot_keys

parser = argparse.ArgumentParser()
parser.add_argument("--data", required=True)
parser.add_argument("--golden", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--slots", required=True)
parser.add_argument("--emb", type=int, default=9)
parser.add_argument("--hidden", default="32,32")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch", type=int, default=128)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--shuffle-labels", action="store_true")
parser.add_argument("--sparse-dim", type=int, default=0)
parser.add_argument("--window", default="20200101/00,20200101/00")
args = parser.parse_args()

SLOTS = [int(s) for s in args.slots.split(",")]
EMB = args.emb
HIDDEN = [int(h) for h in args.hidden.split(",") if h]
SPARSE_DIM = args.sparse_dim or None

paddle.enable_static()
paddle.seed(args.seed)
fleet.init(is_collective=False)


def dense(x):
    h = x
    for i, width in enumerate(HIDDEN):
        h = paddle.static.nn.fc(
            h,
            width,
            activation="relu",
            weight_attr=paddle.ParamAttr(name=f"fc{i}.w"),
            bias_attr=paddle.ParamAttr(name=f"fc{i}.b"),
        )
    return paddle.static.nn.fc(
        h, 1, weight_attr=paddle.ParamAttr(name="out.w"), bias_attr=paddle.ParamAttr(name="out.b")
    )


ids = [paddle.static.data(name=f"slot{s}", shape=[-1, 1], dtype="int64", lod_level=1) for s in SLOTS]
label = paddle.static.data(name="label", shape=[-1, 1], dtype="float32")
pooled = [
    paddle.static.nn.sequence_lod.sequence_pool(
        paddle.static.nn.sparse_embedding(
            input=x, size=[1024, EMB], param_attr=paddle.ParamAttr(name="SparseFeatFactors")
        ),
        pool_type="sum",
    )
    for x in ids
]
logit = dense(paddle.concat(pooled, axis=1))
prob_train = paddle.nn.functional.sigmoid(logit)
loss = paddle.mean(paddle.nn.functional.binary_cross_entropy_with_logits(logit, label))
strategy = fleet.DistributedStrategy()
strategy.a_sync = True
fleet.distributed_optimizer(paddle.optimizer.Adam(args.lr), strategy).minimize(loss)

infer, infer_start = paddle.static.Program(), paddle.static.Program()
with paddle.static.program_guard(infer, infer_start):
    emb_concat = paddle.static.data(name="emb_concat", shape=[-1, len(SLOTS) * EMB], dtype="float32")
    prob = paddle.nn.functional.sigmoid(dense(emb_concat))


def feed_for(lines, labels=None):
    samples = [parse_sample_line(ln) for ln in lines]
    per = [slot_keys(s, SLOTS, SPARSE_DIM) for s in samples]
    feed = {}
    for j, s in enumerate(SLOTS):
        flat = np.concatenate([p[j] for p in per])
        lens = [len(p[j]) for p in per]
        feed[f"slot{s}"] = paddle.base.create_lod_tensor(
            keys_to_paddle_ids(flat).reshape(-1, 1), [lens], paddle.CPUPlace()
        )
    y = np.array([s.click for s in samples] if labels is None else labels, dtype="float32").reshape(-1, 1)
    feed["label"] = y
    return feed


if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
else:
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(paddle.static.default_startup_program())
    fleet.init_worker()
    with open(args.data) as f:
        lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    labels = np.array([parse_sample_line(ln).click for ln in lines])
    rng = np.random.default_rng(args.seed)
    if args.shuffle_labels:
        labels = rng.permutation(labels)
    main = paddle.static.default_main_program()
    for _epoch in range(args.epochs):
        order = rng.permutation(len(lines))
        for b in range(0, len(order), args.batch):
            idx = order[b : b + args.batch]
            exe.run(main, feed=feed_for([lines[i] for i in idx], labels[idx]), fetch_list=[loss])
    # Let the asynchronous communicator push the last gradients before the export.
    time.sleep(3)
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    fleet.save_persistables(exe, os.path.join(out, "sparse"))
    paddle.static.save_inference_model(
        os.path.join(out, "dense", "inference"), [emb_concat], [prob], exe, program=infer
    )
    # Golden: the training program's own probabilities right after the export, one batch.
    with open(args.golden) as f:
        golden_lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    (probs,) = exe.run(main, feed=feed_for(golden_lines), fetch_list=[prob_train])
    with open(os.path.join(out, "golden.jsonl"), "w") as f:
        for line, p in zip(golden_lines, np.asarray(probs).reshape(-1), strict=True):
            f.write(json.dumps({"line": line, "prob": float(p)}) + "\n")
    start, end = args.window.split(",")
    meta = {
        "pass": os.path.basename(out.rstrip("/")),
        "slots": SLOTS,
        "embedding_dim": EMB,
        "sparse_dim": SPARSE_DIM,
        "sparse_layout": {"accessor": "SparseAccessor", "optimizer": "adam", "embedding_dim": EMB},
        "window": {"start": start, "end": end},
        "dense_input": "emb_concat",
        "metrics": {},
        "trainers": 1,
        "pservers": 1,
        "created_at": time.time(),
        "fixture": True,
        "shuffled_labels": bool(args.shuffle_labels),
    }
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f)
    fleet.stop_worker()
