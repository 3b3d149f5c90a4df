"""Free loopback ports, chosen at runtime, and who holds a port that is in use.

Ports are drawn from below the kernel's ephemeral range: a port from the
ephemeral range can be taken, between planning and starting, as the local
port of some unrelated outgoing connection.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

from ctr_foundation.names import LOOPBACK

_FALLBACK_RANGE = (20000, 32000)


def _candidate_range() -> tuple[int, int]:
    try:
        lo, _hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return _FALLBACK_RANGE
    # Stay clear of well-known ports and of the ephemeral range.
    top = min(lo - 1, 65535)
    return (10000, top) if top > 12000 else _FALLBACK_RANGE


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """True if a TCP socket can bind ``host:port`` right now (and nobody listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def free_ports(
    count: int,
    *,
    host: str = LOOPBACK,
    exclude: set[int] | None = None,
    rng: random.Random | None = None,
    width: int = 1,
) -> list[int]:
    """``count`` distinct ports that are free now, probed by binding each one.

    With ``width`` > 1 each returned port P starts a block P..P+width-1 that is
    free as a whole and overlaps no other block (pserver 0 also listens on its
    port + 1 for the trainers' barrier service).
    """
    rng = rng or random.SystemRandom()
    lo, hi = _candidate_range()
    taken = set(exclude or ())
    out: list[int] = []
    for _ in range(count * 200 + 1000):
        if len(out) == count:
            return out
        port = rng.randint(lo, hi - width + 1)
        block = range(port, port + width)
        if any(p in taken for p in block):
            continue
        if all(port_is_free(p, host) for p in block):
            out.append(port)
            taken.update(block)
        else:
            taken.add(port)
    if len(out) == count:
        return out
    raise OSError(f"could not find {count} free TCP ports on {host} in {lo}-{hi}")


def port_owner(port: int) -> str:
    """A short description of the process listening on ``port``, or '' if unknown."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                proc = psutil.Process(conn.pid)
                cmd = " ".join(proc.cmdline()[:4])
                return f"pid {conn.pid}: {cmd}"
    except Exception:  # noqa: BLE001 - psutil may lack permission; the port number alone still helps
        return ""
    return ""


def wait_tcp(port: int, host: str = LOOPBACK, timeout: float = 0.2) -> bool:
    """True if something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
