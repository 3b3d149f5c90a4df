"""Every prediction answered, remembered for a bounded join window, so click feedback can find it.

``PredictionLog.record`` gives each answered request its ``request_id`` (a per-process prefix and a
sequence number in fixed-width hex) and keeps its probabilities, arm and version in preallocated
ring buffers: memory is fixed by ``capacity`` (instances) and ``max_requests``, whatever the
traffic. ``join`` takes feedback events ``(request_id, index, click)``: an event joins when its
request is still in the rings and younger than the join window, the index is one of that request's
instances and that instance has no click yet; it then hands (arm, version, probability, click) to
the monitor. Everything else is counted by reason (unknown: never made, or overwritten/expired;
duplicate; invalid).

Memory: the rings are ``REQUEST_BYTES`` per request slot (sequence, time, start: 8 bytes each; size, arm:
4 each) plus ``INSTANCE_BYTES`` per instance slot (a float32 probability and a click flag), allocated
once; ``ring_bytes`` states the total (``DEFAULT_RING_BYTES`` at the defaults, 42,000,000 bytes), and
the only other growth is one small (arm, version) entry per distinct version served. The kernel commits
the pages as they are first written, so RSS reaches the bound only once the rings have wrapped.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

ID_DIGITS = 12  # hex digits of the sequence number: fixed width, so answers of one request have one length
DEFAULT_CAPACITY = 2_000_000  # instances
DEFAULT_MAX_REQUESTS = 1_000_000
REQUEST_BYTES = 8 + 8 + 8 + 4 + 4  # _req_seq, _req_time, _req_start, _req_n, _req_arm
INSTANCE_BYTES = 4 + 1  # _probs, _clicked


def ring_bytes(capacity: int = DEFAULT_CAPACITY, max_requests: int = DEFAULT_MAX_REQUESTS) -> int:
    """Bytes of the rings of a log with that capacity (instances) and ``max_requests``: its memory bound."""
    return capacity * INSTANCE_BYTES + max_requests * REQUEST_BYTES


DEFAULT_RING_BYTES = ring_bytes()


@dataclass(frozen=True)
class JoinResult:
    joined: int
    unknown: int
    duplicate: int
    invalid: int

    def to_json(self) -> dict:
        return {"joined": self.joined, "unknown": self.unknown, "duplicate": self.duplicate, "invalid": self.invalid}


class PredictionLog:
    def __init__(
        self, *, window_s: float = 900.0, capacity: int = DEFAULT_CAPACITY, max_requests: int = DEFAULT_MAX_REQUESTS
    ):
        if capacity < 1 or max_requests < 1:
            raise ValueError("the prediction log needs room for at least one request")
        self.window_s = window_s
        self.capacity = capacity
        self.max_requests = max_requests
        self.prefix = f"{os.getpid() & 0xFFFF:04x}{secrets.token_hex(4)}"
        self._lock = threading.Lock()
        self._next_seq = 0
        self._next_slot = 0  # next free position in the probability ring
        self._req_seq = np.full(max_requests, -1, np.int64)
        self._req_time = np.zeros(max_requests, np.float64)
        self._req_start = np.zeros(max_requests, np.int64)  # absolute position of the first instance
        self._req_n = np.zeros(max_requests, np.int32)
        self._req_arm = np.zeros(max_requests, np.int32)
        self._probs = np.zeros(capacity, np.float32)
        self._clicked = np.zeros(capacity, bool)  # feedback already joined for that instance
        self._arms: list[tuple[str, str]] = []  # (arm, version) by id
        self._arm_ids: dict[tuple[str, str], int] = {}
        self.counts = {"joined": 0, "unknown": 0, "duplicate": 0, "invalid": 0}
        self.ring_bytes = sum(
            a.nbytes for a in (self._req_seq, self._req_time, self._req_start, self._req_n, self._req_arm)
        ) + sum(a.nbytes for a in (self._probs, self._clicked))

    def _arm_id(self, arm: str, version: str) -> int:
        key = (arm, version)
        i = self._arm_ids.get(key)
        if i is None:
            i = self._arm_ids[key] = len(self._arms)
            self._arms.append(key)
        return i

    def record(self, arm: str, version: str, probabilities: np.ndarray, now: float | None = None) -> str:
        """Remember one answered request; returns its request id."""
        n = len(probabilities)
        now = time.time() if now is None else now
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            r = seq % self.max_requests
            start = self._next_slot
            self._next_slot += n
            self._req_seq[r] = seq
            self._req_time[r] = now
            self._req_start[r] = start
            self._req_n[r] = n
            self._req_arm[r] = self._arm_id(arm, version)
            if n <= self.capacity:
                lo = start % self.capacity
                if lo + n <= self.capacity:
                    self._probs[lo : lo + n] = probabilities
                    self._clicked[lo : lo + n] = False
                else:
                    at = np.arange(start, start + n) % self.capacity
                    self._probs[at] = probabilities
                    self._clicked[at] = False
            else:  # a request larger than the whole ring cannot be joined later
                self._req_seq[r] = -1
        return f"{self.prefix}{seq:0{ID_DIGITS}x}"

    def record_batch(self, arm: str, version: str, probabilities: np.ndarray, sizes: Sequence[int]) -> list[str]:
        """Remember the consecutive requests of one scored batch (``sizes`` instances each); their ids."""
        total = len(probabilities)
        if total > self.capacity or len(sizes) > self.max_requests:
            now = time.time()
            out, at = [], 0
            for n in sizes:
                out.append(self.record(arm, version, probabilities[at : at + n], now))
                at += n
            return out
        now = time.time()
        with self._lock:
            arm_id = self._arm_id(arm, version)
            first_seq, start = self._next_seq, self._next_slot
            self._next_seq += len(sizes)
            self._next_slot += total
            lo = start % self.capacity
            if lo + total <= self.capacity:
                self._probs[lo : lo + total] = probabilities
                self._clicked[lo : lo + total] = False
            else:
                at = np.arange(start, start + total) % self.capacity
                self._probs[at] = probabilities
                self._clicked[at] = False
            starts = start + np.concatenate(([0], np.cumsum(sizes[:-1], dtype=np.int64))) if len(sizes) > 1 else [start]
            seqs = np.arange(first_seq, first_seq + len(sizes))
            r = seqs % self.max_requests
            self._req_seq[r] = seqs
            self._req_time[r] = now
            self._req_start[r] = starts
            self._req_n[r] = sizes
            self._req_arm[r] = arm_id
        prefix = self.prefix
        return [f"{prefix}{seq:0{ID_DIGITS}x}" for seq in range(first_seq, first_seq + len(sizes))]

    def join(
        self,
        events: Sequence[tuple[object, object, object]],
        observe: Callable[[str, str, np.ndarray, np.ndarray], None],
        now: float | None = None,
    ) -> JoinResult:
        """Join ``(request_id, index, click)`` events; ``observe(arm, version, probs, clicks)`` per arm."""
        now = time.time() if now is None else now
        joined: dict[int, tuple[list, list]] = {}
        unknown = duplicate = invalid = 0
        with self._lock:
            oldest_slot = self._next_slot - self.capacity
            for request_id, index, click in events:
                seq = self._seq_of(request_id)
                if isinstance(click, bool) or click not in (0, 1) or isinstance(index, bool):
                    invalid += 1
                    continue
                if not isinstance(index, int) or index < 0:
                    invalid += 1
                    continue
                if seq is None:
                    unknown += 1
                    continue
                r = seq % self.max_requests
                if self._req_seq[r] != seq or now - self._req_time[r] > self.window_s:
                    unknown += 1
                    continue
                if index >= self._req_n[r]:
                    invalid += 1
                    continue
                pos = int(self._req_start[r]) + index
                if pos < oldest_slot:  # its probabilities were overwritten by newer requests
                    unknown += 1
                    continue
                at = pos % self.capacity
                if self._clicked[at]:
                    duplicate += 1
                    continue
                self._clicked[at] = True
                probs, clicks = joined.setdefault(int(self._req_arm[r]), ([], []))
                probs.append(float(self._probs[at]))
                clicks.append(int(click))
            arms = list(self._arms)
            total = sum(len(p) for p, _ in joined.values())
            for name, k in (("joined", total), ("unknown", unknown), ("duplicate", duplicate), ("invalid", invalid)):
                self.counts[name] += k
        for arm_id, (probs, clicks) in joined.items():
            arm, version = arms[arm_id]
            observe(arm, version, np.asarray(probs, np.float64), np.asarray(clicks, np.int64))
        return JoinResult(total, unknown, duplicate, invalid)

    def _seq_of(self, request_id: object) -> int | None:
        if not isinstance(request_id, str) or len(request_id) != len(self.prefix) + ID_DIGITS:
            return None
        if not request_id.startswith(self.prefix):
            return None
        tail = request_id[len(self.prefix) :]
        if not (tail.isascii() and all(c in "0123456789abcdef" for c in tail)):
            return None
        seq = int(tail, 16)
        return seq if seq < self._next_seq else None

    def snapshot(self) -> dict:
        with self._lock:
            return {
                **self.counts,
                "window_seconds": self.window_s,
                "capacity_instances": self.capacity,
                "capacity_requests": self.max_requests,
                "requests_recorded": self._next_seq,
                "ring_bytes": self.ring_bytes,
            }
