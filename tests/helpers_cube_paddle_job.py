"""A short real PaddlePaddle 2.6.2 parameter-server run that saves a pass folder.

Used by the cube tests (run as a script, one process per role) to get a REAL
saved sparse table: SparseAccessor, sparse Adam, embedding dim 8 (34 text
columns per line), 64-bit keys including values above 2**63. Modeled on
../shared/examples/paddle_ps_probe.py. Environment: the standard fleet role
variables plus OUT (the pass folder to write) and SEED.
"""

import json
import os

import pyarrow  # noqa: F401  (before paddle, or paddle breaks pyarrow's zlib)

import numpy as np
import paddle
import paddle.distributed.fleet as fleet

paddle.enable_static()
fleet.init(is_collective=False)

SLOTS, EMB = 3, 8
OUT = os.environ["OUT"]
SEED = int(os.environ.get("SEED", "7"))

ids = [paddle.static.data(name=f"s{i}", shape=[-1, 1], dtype="int64", lod_level=1) for i in range(SLOTS)]
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
h = paddle.static.nn.fc(paddle.concat(pooled, axis=1), 1)
loss = paddle.mean(paddle.nn.functional.binary_cross_entropy_with_logits(h, label))
strategy = fleet.DistributedStrategy()
strategy.a_sync = True
fleet.distributed_optimizer(paddle.optimizer.Adam(0.05), strategy).minimize(loss)

if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
else:
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(paddle.static.default_startup_program())
    fleet.init_worker()
    rng = np.random.default_rng(SEED)
    # A fixed vocabulary of full 64-bit feasigns (half of them above 2**63),
    # fed to Paddle as the int64 with the same bits.
    vocab = rng.integers(0, 2**64 - 1, size=600, dtype=np.uint64, endpoint=True)
    for _step in range(40):
        pick = vocab[rng.integers(0, len(vocab), size=(64, SLOTS))]
        feed = {
            f"s{i}": paddle.base.create_lod_tensor(pick[:, i : i + 1].view(np.int64), [[1] * 64], paddle.CPUPlace())
            for i in range(SLOTS)
        }
        feed["label"] = (pick[:, :1] % np.uint64(2) == 0).astype("float32")
        exe.run(paddle.static.default_main_program(), feed=feed, fetch_list=[loss])
    fleet.save_persistables(exe, os.path.join(OUT, "sparse"))
    meta = {
        "pass": os.path.basename(OUT.rstrip("/")),
        "slots": list(range(SLOTS)),
        "embedding_dim": EMB,
        "sparse_dim": None,
        "sparse_layout": {"accessor": "SparseAccessor", "optimizer": "adam"},
        "vocab_size": int(len(vocab)),
    }
    with open(os.path.join(OUT, "meta.json"), "w") as f:
        json.dump(meta, f)
    fleet.stop_worker()
