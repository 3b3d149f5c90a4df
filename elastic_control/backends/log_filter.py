"""What ``-l`` leaves out: Paddle's internal glog/brpc chatter (the log files keep every line).

A trainer or pserver writes thousands of lines such as
``I1201 07:29:48.123456 12345 brpc_ps_client.cc:123] ...`` that say nothing
to a user. Informational and warning lines of that format are hidden; error
and fatal ones (``E…``/``F…``) are shown, as is everything else.
"""

from __future__ import annotations

import re

# glog: severity, MMDD, time, thread id, source file:line, "]".
_GLOG = re.compile(r"^[IW]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+[\w./+-]+:\d+\]")
_GLOG_PREAMBLE = "WARNING: Logging before InitGoogleLogging() is written to STDERR"


def is_paddle_noise(line: str) -> bool:
    """True for an informational or warning glog line of Paddle/brpc (what -l hides)."""
    text = line.lstrip()
    return bool(_GLOG.match(text)) or text.startswith(_GLOG_PREAMBLE)
