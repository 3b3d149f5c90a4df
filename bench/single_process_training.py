"""Single-process Paddle: the trainers' net with the defaults, trained in one process without a parameter server.

    .venv/bin/python bench/single_process_training.py DATA_CONFIG SLOT_CONF [--epochs N]

Builds the net a trainer builds (training/model.py, the default hyperparameters) and trains it with
Paddle's own Adam on every parameter, the rows too, in this process: no sparse pull or push, no dense
pull, no barrier. Batches of the default size are fed as the trainer feeds them (parsed ahead in a thread,
every slot's keys as one LoD tensor, the defaults' per-key inputs, here all ones), over every hour of the
window, ``--epochs`` times, in file order. Prints one JSON line: ``{"examples_per_sec", "examples",
"seconds", "keys", "mean_log_loss"}``, the seconds those of the training loop alone (the hours are parsed
before it).

The keys are renumbered 0..K-1 for the net's local table, which has the 1,024 rows the parameter-server
net declares (its pservers ignore the count); data with more distinct keys is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow  # noqa: F401  (before paddle)

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import numpy as np  # noqa: E402

from elastic_control.config.data_config import load_data_config  # noqa: E402
from elastic_control.config.slot_conf import load_slot_conf  # noqa: E402
from elastic_control.data.line_batch import batch_keys  # noqa: E402
from elastic_control.data.readers import HourlyData  # noqa: E402
from elastic_control.training.feeding import feed_keys, prefetch, rebatch  # noqa: E402
from elastic_control.training.model import EXECUTOR_FLAGS, build_training_net  # noqa: E402
from elastic_control.training.settings import Hyperparameters, RoleSettings  # noqa: E402

LOCAL_TABLE_ROWS = 1024  # model.build_training_net's sparse_embedding size


def local_table(paddle):
    """A stand-in for ``paddle.static.nn.sparse_embedding``: the same lookup op on a table in this process.

    Paddle's sparse_embedding declares its table a SelectedRows variable that only the pservers fill; this
    one is a plain parameter of LOCAL_TABLE_ROWS rows, looked up by the same ``lookup_table`` op, whose
    gradient stays sparse (the rows of the batch) for the optimizer."""
    from paddle.base.layer_helper import LayerHelper

    def embedding(input, size, param_attr=None, dtype="float32", **_):
        helper = LayerHelper("sparse_embedding", param_attr=param_attr)
        table = helper.create_parameter(attr=helper.param_attr, shape=[LOCAL_TABLE_ROWS, size[1]], dtype=dtype)
        out = helper.create_variable_for_type_inference(dtype)
        helper.append_op(
            type="lookup_table",
            inputs={"Ids": input, "W": table},
            outputs={"Out": out},
            attrs={"is_sparse": True, "is_distributed": False, "remote_prefetch": False, "padding_idx": -1},
        )
        return out

    return embedding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data_config", type=Path)
    ap.add_argument("slot_conf", type=Path)
    ap.add_argument("--epochs", type=int, default=2, help="passes over the window's hours (default 2)")
    args = ap.parse_args()
    config = load_data_config(str(args.data_config), {})
    hyper = Hyperparameters()
    settings = RoleSettings(
        role="TRAINER",
        pserver_endpoints="127.0.0.1:0",
        trainers=1,
        trainer_id=0,
        pod_ip="127.0.0.1",
        port=0,
        data_config=config,
        slot_conf=load_slot_conf(args.slot_conf),
        model_path="",
        hyper=hyper,
    )
    spec = settings.model_spec()
    data = HourlyData(config)
    chunks = [chunk for part in data.partitions() for chunk in data.iter_batches(part)]
    distinct = np.unique(np.concatenate([batch_keys(c, spec.slots, spec.sparse_dim)[0] for c in chunks]))
    if len(distinct) > LOCAL_TABLE_ROWS:
        raise SystemExit(f"{len(distinct)} distinct keys: the local table has {LOCAL_TABLE_ROWS} rows")

    import paddle

    paddle.enable_static()
    paddle.set_flags(EXECUTOR_FLAGS)  # as the trainers run
    paddle.static.nn.sparse_embedding = local_table(paddle)
    net = build_training_net(paddle, spec)
    paddle.optimizer.Adam(spec.learning_rate).minimize(net.loss)
    place = paddle.CPUPlace()
    exe = paddle.static.Executor(place)
    exe.run(paddle.static.default_startup_program())
    main_program = paddle.static.default_main_program()

    def ones(keys):
        return np.ones(len(keys), np.float32)

    def feeds():
        for _ in range(args.epochs):
            for batch in rebatch(chunks, hyper.batch_size):
                keys, lengths = batch_keys(batch, spec.slots, spec.sparse_dim)
                rows = np.searchsorted(distinct, keys).astype(np.uint64)
                labels = batch.clicks.astype(np.float32).reshape(-1, 1)
                yield (
                    len(batch),
                    feed_keys(
                        paddle,
                        rows,
                        lengths,
                        labels,
                        place,
                        l2_scale=ones if net.uses_l2 else None,
                        rate_factors=ones if spec.uses_decay else None,
                        wide_prior=SimpleNamespace(anchors=ones, weights=ones) if spec.uses_wide_prior else None,
                    ),
                )

    examples, loss_sum = 0, 0.0
    started = time.perf_counter()
    for n, feed in prefetch(feeds()):
        loss, _ = exe.run(main_program, feed=feed, fetch_list=[net.log_loss, net.prob])
        examples += n
        loss_sum += float(np.array(loss)) * n
    seconds = time.perf_counter() - started
    print(
        json.dumps(
            {
                "examples_per_sec": examples / seconds,
                "examples": examples,
                "seconds": seconds,
                "keys": len(distinct),
                "mean_log_loss": loss_sum / examples,
            }
        )
    )


if __name__ == "__main__":
    main()
