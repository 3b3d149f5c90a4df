"""What ``-l`` leaves out: Paddle's internal chatter (the log files keep every line).

A pserver or trainer writes lines that say nothing to a user of ElasticCTR:
glog/brpc lines of Paddle's C++ core (``I1201 07:29:48.123456 12345
brpc_ps_client.cc:123] ...``), the Python logger lines of ``paddle.distributed``
(``[2026-12-01 07:47:56,658] [    INFO] distributed_strategy.py:214 - ...``),
``UserWarning``s raised inside the paddle package, and the debugging prints
of Paddle 2.6.2's parameter-server setup (``fl-ps > ...``, ``new table_name:
...``, the send-context dumps). Error and fatal glog lines (``E…``/``F…``),
tracebacks and everything ElasticCTR itself prints are kept.
"""

from __future__ import annotations

import re

# glog: severity (informational or warning), MMDD, time, thread id, source file:line, "]".
_GLOG = re.compile(r"^[IW]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+[\w./+-]+:\d+\]")
# paddle.distributed's Python logger.
_PADDLE_LOGGER = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[\s*(?:DEBUG|INFO|WARNING)\] [\w.]+\.py:\d+ - ")
# A warning raised inside the paddle package, and the source line Python prints under it.
_PADDLE_WARNING = re.compile(r"/paddle/\S+\.py:\d+: \w*Warning: ")
_WARN_SOURCE = re.compile(r"^\s+warnings\.warn\(")
# Paddle 2.6.2's prints while it sets up the parameter server (the_one_ps.py, ps_optimizer.py, ...).
_PADDLE_PRINTS = (
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    "fl-ps > ",
    "new table_name: ",
    "new var: persist ",
    "adam_d2sum: ",
    "is_heter_ps_mode? ",
    "public get_the_one_send_context ",
    "communicator config: ",
    "create c2c connection done",
    "entering self._init_all_params()",
    "valid_optimizer_list= ",
    "meta_optimizer= ",
    "graph_optimizer= ",
    "idx, name, ctx: ",
    " table_id: ",
    " program_id: ",
    " is_tensor_table: ",
    " is_datanorm_table: ",
    "is_heter_ps_mode in distributed_ops_pass",
    "ShowClickEntry not configured",
    "debug zcb slots: ",
    "remote_optimize_vars: ",
    "paddle.static.default_startup_program: ",
)


def is_paddle_noise(line: str) -> bool:
    """True for a line of Paddle's internal logging that ``-l`` hides."""
    text = line.rstrip("\n")
    stripped = text.lstrip()
    return bool(
        _GLOG.match(stripped)
        or _PADDLE_LOGGER.match(stripped)
        or _PADDLE_WARNING.search(text)
        or _WARN_SOURCE.match(text)
        or text.startswith(_PADDLE_PRINTS)
    )
