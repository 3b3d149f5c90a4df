"""-l hides Paddle's internal logging and keeps what ElasticCTR prints: lines taken from real pserver/trainer logs."""

from __future__ import annotations

import pytest

from elastic_control.training.log_filter import is_paddle_noise

NOISE = [
    "I1201 07:47:57.558550  2788 brpc_ps_server.cc:78] running server with rank id: 0, endpoint: 127.0.0.1:24526",
    "I1201 07:47:57.560570  2788 server.cpp:1107] Server[paddle::distributed::BrpcPsService] is serving on port=24526.",
    "I1201 07:48:35.342237  3618 memory_sparse_table.cc:438] MemorySparseTable save prefix success, path: /m/x.gz",
    "W1201 07:47:57.443174  2788 brpc_ps_client.cc:120] retry connect",
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    "[2026-12-01 07:47:56,658] [    INFO] distributed_strategy.py:214 - distributed strategy initialized",
    "/v/lib/python3.11/site-packages/paddle/distributed/fleet/base/role_maker.py:329: UserWarning: gloo is not "
    "initialized, will not communicator with other nodes",
    "  warnings.warn(self._err_init)",
    "fl-ps > coordinator address is null!",
    "new table_name: SparseFeatFactors",
    "adam_d2sum: False",
    "is_heter_ps_mode? False",
    "public get_the_one_send_context sparse:  SparseFeatFactors@GRAD ['SparseFeatFactors.block0'] [0, 9]",
    "idx, name, ctx: 0 SparseFeatFactors@GRAD varname: SparseFeatFactors@GRAD trainer_id: 0  table_id: 0",
    " table_id: 0",
    "communicator config: {'communicator_max_merge_var_num': '1'}",
]
KEPT = [
    "[trainer 0] pass 20191221/00: 1425 examples in 12 steps, 1045 examples/s, 0 bad lines",
    "[pserver 0] serving on 127.0.0.1:24526",
    "E1201 07:48:35.085958  2945 brpc_ps_client.cc:200] request to server 127.0.0.1:24526 failed",
    "F1201 07:48:35.085958  2945 table.cc:12] Check failed: accessor",
    "Traceback (most recent call last):",
    "[supervisor 2026-12-01 07:48:43] trainer-0 (pid 2791) exited with code 0",
    "2026-12-01 07:48:40,910 cube-transfer INFO cube version pass-20191221-00 active on 2 shards",
    "elastic-control: error: MODEL_PATH is not set",
    "/work/project/elastic_control/serving/app.py:12: UserWarning: something of ours",
]


@pytest.mark.parametrize("line", NOISE)
def test_paddle_noise_is_hidden(line):
    assert is_paddle_noise(line) and is_paddle_noise(line + "\n")


@pytest.mark.parametrize("line", KEPT)
def test_everything_else_is_kept(line):
    assert not is_paddle_noise(line)
