"""Hourly click-log partitions: which hours are ready, which files are this trainer's, and their lines.

Layout: ``{HDFS_ADDRESS}{DATASET_PATH}/YYYYMMDD/HH/part-*`` (text, plain or
.gz; or Parquet) and an hour is complete when ``donefile`` exists in it.
Offline, a missing hour is skipped with a warning; online (ONLINE=1) the
reader waits for its donefile, and keeps going after END_DATE_HR.

With ``PASS_MINUTES=M`` the same holds for sub-hour slots: folders
``YYYYMMDD/HHMM`` (MM a multiple of M), each with its own donefile, one pass
each; the window START_DATE_HR..END_DATE_HR covers every slot of its hours.

With ``PASS_HOURS=N`` a pass covers N consecutive hourly folders (from START_DATE_HR, the last group
ending at END_DATE_HR): its partition lists the files of its ready hours as paths relative to the dataset
root. Offline a missing hour is skipped with a warning (a group with no ready hour is no pass); online the
reader waits for every hour of the group before the pass starts.

Parquet files (DATA_FORMAT=parquet, ``PARQUET_COLUMNS``): one row per sample, columns ``click`` (0/1),
``feasigns`` (list<uint64>) and ``slots`` (list<int>) of equal length, optional ``show`` (default 1); and,
for dense slots, optional ``values`` (list<double>) with ``value_slots`` (list<int64>), both or neither,
of equal length in a row: the Parquet form of the text format's value tokens ``value:slot``
(ctr_foundation/dense_features.py). A row with a bad click/show or unequal feasigns/slots is a bad line;
a file whose values break these rules is a DataError (a writer's bug, not a stray line).
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime as dt
import functools
import gzip
import io
import itertools
import mmap
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from ctr_foundation import native_memory
from ctr_foundation.errors import DataError
from elastic_control.config.data_config import DataConfig, format_slot, slot_path
from elastic_control.console import warn
from elastic_control.data import byte_scan
from elastic_control.data.filesystems import DataLocation, open_location
from elastic_control.data.line_batch import (
    BadLine,
    LineBatch,
    TextChunk,
    concat_batches,
    parse_chunk,
    parse_lines,
    parse_text,
    slice_batch,
)

HOUR_DONEFILE = "donefile"
DEFAULT_CHUNK_LINES = 4096
# Threads that parse a file's chunks (the compiled parse releases the GIL): one per core this process may
# run on, as pyarrow's readers use.
READER_THREADS = len(os.sched_getaffinity(0))
# Do not judge the bad-line fraction on a handful of lines.
MIN_LINES_FOR_EARLY_CHECK = 10_000


@dataclass(frozen=True)
class HourPartition:
    hour: dt.datetime  # the start of the slot: an hour, or a PASS_MINUTES slot
    location: DataLocation
    files: tuple[str, ...]
    minutes: int | None = None  # PASS_MINUTES of the layout (None: hourly folders)
    end: dt.datetime | None = None  # PASS_HOURS: the last hour of the pass (None: the pass is one slot)

    @property
    def last(self) -> dt.datetime:
        """The pass's last slot: what names it (``pass-YYYYMMDD-HH``) and ends its window."""
        return self.end or self.hour

    @property
    def name(self) -> str:
        first = format_slot(self.hour, self.minutes)
        return first if self.last == self.hour else f"{first}..{format_slot(self.last, self.minutes)}"


@dataclass
class BadLineCounter:
    """Counts lines and malformed lines; fails once the bad fraction passes the limit."""

    max_fraction: float
    total: int = 0
    bad: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, good: int, bad_lines: list[BadLine], where: str) -> None:
        self.total += good + len(bad_lines)
        self.bad += len(bad_lines)
        for b in bad_lines[: max(0, 3 - len(self.examples))]:
            self.examples.append(f"{where}: {b.reason}: {b.line[:80]!r}")
        if self.total >= MIN_LINES_FOR_EARLY_CHECK:
            self.check(where)

    @property
    def fraction(self) -> float:
        return self.bad / self.total if self.total else 0.0

    def check(self, where: str) -> None:
        if self.bad and self.fraction > self.max_fraction:
            raise DataError(
                f"{where}: {self.bad} of {self.total} lines are malformed ({self.fraction:.2%}), above "
                f"MAX_BAD_LINE_FRACTION={self.max_fraction:g}; first: {'; '.join(self.examples)}"
            )


class HourlyData:
    """The hours of a DataConfig window and their files."""

    def __init__(
        self,
        config: DataConfig,
        *,
        wait_timeout: float | None = None,
        poll_seconds: float = 10.0,
        warn: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.config = config
        self.root = open_location(config.dataset_root, hdfs_ugi=config.hdfs_ugi)
        self.wait_timeout = wait_timeout
        self.poll_seconds = poll_seconds
        self.threads = READER_THREADS
        self._warn = warn or _default_warn
        self._sleep = sleep

    def hour_location(self, hour: dt.datetime) -> DataLocation:
        """The folder of an hour (or, with PASS_MINUTES, of the sub-hour slot starting at ``hour``)."""
        return self.root.join(*slot_path(hour, self.config.pass_minutes).split("/"))

    def _name(self, hour: dt.datetime) -> str:
        what = "slot" if self.config.pass_minutes else "hour"
        return f"{what} {format_slot(hour, self.config.pass_minutes)}"

    def is_ready(self, hour: dt.datetime) -> bool:
        loc = self.hour_location(hour)
        return bool(loc.fs.exists(f"{loc.path}/{HOUR_DONEFILE}"))

    def list_files(self, hour: dt.datetime) -> tuple[str, ...]:
        """Data files of an hour, sorted: part-* (text, .gz, or Parquet), never the donefile or hidden files."""
        loc = self.hour_location(hour)
        names = []
        for entry in loc.fs.ls(loc.path, detail=True):
            if entry.get("type") == "directory":
                continue
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if name == HOUR_DONEFILE or name.startswith((".", "_")):
                continue
            if name.startswith("part-") or name.endswith(".parquet"):
                names.append(name)
        return tuple(sorted(names))

    def schedule(self) -> Iterator[dt.datetime]:
        """START..END (every slot of those hours); online, continues past END one slot at a time."""
        if not self.config.online:
            yield from self.config.slots()
            return
        for i in itertools.count():
            yield self.config.start + i * self.config.step

    def partitions(self, *, after: dt.datetime | None = None) -> Iterator[HourPartition]:
        """Ready hours in order (strictly after ``after`` when resuming); waits online, skips offline.

        With PASS_HOURS=N, one partition per group of N hours (``after`` is then a group's last hour)."""
        if self.config.pass_hours > 1:
            yield from self._hour_groups(after)
            return
        for hour in self.schedule():
            if after is not None and hour <= after:
                continue
            if self._ready(hour, missing="skipped"):
                yield HourPartition(hour, self.hour_location(hour), self.list_files(hour), self.config.pass_minutes)

    def hours_before(self, part: HourPartition, hours: int) -> list[HourPartition]:
        """The ``hours`` hourly partitions just before ``part`` that are in the window and ready, oldest
        first (a training window's earlier hours; a missing one is left out, never waited for)."""
        out = []
        for back in range(hours, 0, -1):
            hour = part.hour - dt.timedelta(hours=back)
            if hour >= self.config.start and self.is_ready(hour):
                out.append(
                    HourPartition(hour, self.hour_location(hour), self.list_files(hour), self.config.pass_minutes)
                )
        return out

    def _ready(self, hour: dt.datetime, *, missing: str) -> bool:
        """Whether the hour (or slot) is there to read: online it waits for it; offline a missing one is
        warned about (``missing`` says what happens instead) and False."""
        if self.is_ready(hour):
            return True
        if not self.config.online:
            self._warn(
                f"{self._name(hour)} is missing (no {HOUR_DONEFILE} in {self.hour_location(hour).url}); {missing}"
            )
            return False
        self.wait_for(hour)
        return True

    def _hour_groups(self, after: dt.datetime | None) -> Iterator[HourPartition]:
        """PASS_HOURS: one partition per group of hours; online the groups go on past END_DATE_HR."""
        hour_step = dt.timedelta(hours=1)
        for first, last in self.config.pass_windows(endless=self.config.online):
            if after is not None:
                if last <= after:
                    continue
                # A resume inside a group (the last run's window ended there, e.g. END_DATE_HR moved on since)
                # trains the group's hours not yet trained, so none is skipped.
                first = max(first, after + hour_step)
            missing = f"the pass over {format_slot(first, None)}..{format_slot(last, None)} goes on without it"
            hours = [first + i * hour_step for i in range((last - first) // hour_step + 1)]
            ready = [h for h in hours if self._ready(h, missing=missing)]
            if ready:
                files = tuple(f"{slot_path(h, None)}/{name}" for h in ready for name in self.list_files(h))
                yield HourPartition(first, self.root, files, None, end=last)

    def wait_for(self, hour: dt.datetime) -> None:
        """Block until the hour's donefile exists; DataError after ``wait_timeout`` seconds."""
        started = time.monotonic()
        announced = False
        while not self.is_ready(hour):
            waited = time.monotonic() - started
            if self.wait_timeout is not None and waited >= self.wait_timeout:
                raise DataError(
                    f"{self._name(hour)}: no {HOUR_DONEFILE} in {self.hour_location(hour).url} "
                    f"after waiting {waited:.0f}s (ONLINE=1)"
                )
            if not announced:
                self._warn(f"waiting for {self._name(hour)} ({self.hour_location(hour).url}/{HOUR_DONEFILE})")
                announced = True
            pause = self.poll_seconds
            if self.wait_timeout is not None:
                pause = max(0.01, min(pause, self.wait_timeout - waited))
            self._sleep(pause)

    def iter_batches(
        self,
        part: HourPartition,
        *,
        trainer_id: int = 0,
        trainers: int = 1,
        counter: BadLineCounter | None = None,
        chunk_lines: int = DEFAULT_CHUNK_LINES,
    ) -> Iterator[LineBatch]:
        """This trainer's lines of an hour, parsed, in chunks; malformed lines counted in ``counter``.

        With at least as many files as trainers each trainer reads whole files
        (``files[id::trainers]``); otherwise every trainer reads every file and
        keeps every ``trainers``-th line, so small hours still split evenly.
        """
        counter = counter or BadLineCounter(self.config.max_bad_line_fraction)
        if len(part.files) >= trainers:
            files, stride = part.files[trainer_id::trainers], 1
        else:
            files, stride = part.files, trainers
        seen = 0  # lines across the hour's files, for the line-level split

        def chunks() -> Iterator[tuple[str, object]]:
            nonlocal seen
            for name in files:
                path = f"{part.location.path}/{name}"
                where = f"{part.location.url}/{name}"
                if self.config.data_format == "parquet":
                    file_chunks = iter_parquet_batches(part.location.fs, path, where, chunk_lines)
                else:
                    keep_heap_top()
                    file_chunks = read_text_chunks(part.location.fs, path, where, chunk_lines)
                for chunk in file_chunks:
                    if stride > 1:
                        chunk, seen = _take_stride(chunk, seen, trainer_id, stride)
                    yield where, chunk

        for where, (batch, bad) in _parse_ahead(chunks(), self.threads):
            counter.add(len(batch), bad, where)
            if len(batch):
                yield batch
        counter.check(f"hour {part.name}")


def _parse(chunk) -> tuple[LineBatch, list[BadLine]]:
    """A chunk of a file as a batch and its bad lines, whatever form the reading gave it."""
    if isinstance(chunk, TextChunk):
        return parse_chunk(chunk)
    if isinstance(chunk, bytes):
        return parse_text(chunk)
    if isinstance(chunk, list):
        return parse_lines(chunk)
    return chunk  # Parquet's, parsed as read


def _parse_ahead(chunks: Iterator[tuple[str, object]], threads: int) -> Iterator[tuple[str, tuple]]:
    """``(where, _parse(chunk))`` for each item of ``chunks``, in order, parsed by ``threads`` threads ahead of
    the caller: the compiled parse releases the GIL, so while the caller trains on one batch (or reads the
    file for the next chunks, in this thread) the next chunks are parsed on the other cores."""
    if threads <= 1:
        for where, chunk in chunks:
            yield where, _parse(chunk)
        return
    pool = _parse_pool(threads, os.getpid())
    pending: collections.deque = collections.deque()
    try:
        for where, chunk in chunks:
            pending.append((where, pool.submit(_parse, chunk)))
            if len(pending) > threads:
                where, parsed = pending.popleft()
                yield where, parsed.result()
        while pending:
            where, parsed = pending.popleft()
            yield where, parsed.result()
    finally:  # the caller stopped early (an error, a bad-line limit): the parses not started are dropped
        for _, parsed in pending:
            parsed.cancel()
        concurrent.futures.wait([parsed for _, parsed in pending])


@functools.cache
def _parse_pool(threads: int, pid: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's parsing threads, kept between files and hours (starting and joining them for each file
    cost 0.05-0.1 us a line of CPU on the synthetic lines, files of 12,500 lines). By process id: a forked
    child has none of its parent's threads, and gets threads of its own."""
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="reader-parse")


def _take_stride(chunk, seen: int, trainer_id: int, stride: int):
    """Keep the lines whose hour-wide index is trainer_id modulo stride."""
    if isinstance(chunk, TextChunk):
        chunk = chunk.data()
    if isinstance(chunk, bytes):
        lines = chunk.split(b"\n")
        if chunk.endswith(b"\n"):
            lines.pop()
        first = (trainer_id - seen) % stride
        kept = lines[first::stride]
        return (b"\n".join(kept) + b"\n" if kept else b""), seen + len(lines)
    if isinstance(chunk, list):
        n = len(chunk)
        first = (trainer_id - seen) % stride
        return chunk[first::stride], seen + n
    batch, bad = chunk
    n = len(batch)
    keep = [slice_batch(batch, i, i + 1) for i in range((trainer_id - seen) % stride, n, stride)]
    return (concat_batches(keep), bad if trainer_id == 0 else []), seen + n


def _default_warn(message: str) -> None:
    warn(message)


def open_text(fs, path: str) -> io.TextIOBase:
    """A text stream over a plain or gzip file on any filesystem."""
    raw = fs.open(path, "rb")
    if path.endswith(".gz"):
        raw = gzip.GzipFile(fileobj=raw)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="\n")


def iter_text_chunks(fs, path: str, where: str, chunk_lines: int) -> Iterator[list[str]]:
    """Lists of up to ``chunk_lines`` raw lines of a text file."""
    try:
        with open_text(fs, path) as f:
            while True:
                chunk = list(itertools.islice(f, chunk_lines))
                if not chunk:
                    return
                yield chunk
    except (OSError, EOFError) as e:
        raise DataError(f"{where}: cannot read: {e}") from e


# What glibc's allocator keeps at the top of its heap when memory is freed (M_TOP_PAD). A text chunk's parse
# allocates some 30 MB of numpy temporaries (4,096 Criteo lines) and frees them; with the default, after
# some allocation histories (smaller chunks first, say), the heap was trimmed after every chunk and faulted in
# again by the next, page by page: a page fault a line and a third of the parse's CPU (5.4-6.2 us a Criteo
# line against 3.7-4.0). Reusing buffers for the largest temporaries removed those faults but not the others
# (the blocks read, the results): the reader's lines per CPU second were 1.42-1.57M on the synthetic lines
# and 197-221k on Criteo lines without the pad, 1.29-1.43M / 200-214k with reused buffers, 1.69-1.84M /
# 231-248k with the pad, peak RSS the same (161-163 MB).
HEAP_TOP_PAD = 64 << 20
# The blocks read and the parse's arrays (4 MB and more a chunk) are allocated on the heap, where freed ones
# are reused, below this size: glibc's own upper bound for its sliding threshold, which setting the pad stops
# from sliding. Mapped afresh for each chunk, their pages were faulted in one by one: 0.06-0.1 faults and
# 0.25-0.7 us of system CPU a Criteo line, against none with this threshold.
HEAP_BLOCK_LIMIT = 32 << 20


@functools.cache
def keep_heap_top() -> None:
    """Keep ``HEAP_TOP_PAD`` bytes of freed heap for the next chunk, and serve blocks below ``HEAP_BLOCK_LIMIT``
    from the heap, once per process."""
    native_memory.keep_heap_top(HEAP_TOP_PAD)
    native_memory.allocate_from_heap_below(HEAP_BLOCK_LIMIT)


# Bytes read from a text file at a time (more when a chunk's lines do not fit); chunks are cut from them at
# line ends, the lines after the last chunk carried to the next read. 1, 4, 8 and 16 MB cost the reader the
# same CPU a line (4,096 lines of 8 slots are about 750 KB, of Criteo's 39 slots and values 4 MB).
READ_BLOCK_BYTES = 4 << 20


# A plain file with a descriptor (a local one) at least this large is mapped, not read: its chunks are parsed
# where the page cache holds them. Reading copied every byte once more (0.1-0.2 us of system CPU a Criteo
# line, in the thread that cuts the chunks, which the parsing threads wait on); mapped, the reader's CPU was
# 0.57 us a Criteo line against 0.67-0.69 read (same process, in turns).
MAP_MIN_BYTES = 1 << 20


def read_text_chunks(fs, path: str, where: str, chunk_lines: int) -> Iterator[TextChunk]:
    """The lines of a text file (plain or .gz), ``chunk_lines`` lines per chunk (the last chunk fewer), each
    chunk whole lines where they were read (a newline added to a last line without one), for
    ``line_batch.parse_chunk``: the lines ``iter_text_chunks`` gives, without a copy or a Python object per
    line. A local plain file is mapped (``MAP_MIN_BYTES``), the lines closer to its end than the parse reads
    past a chunk (``byte_scan.PADDING``) then read as any file's; otherwise each read goes into a buffer of
    its own. The chunks' parsed lines (``TextLines``) share the mapping or the buffer."""
    try:
        with fs.open(path, "rb") as raw, gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw as f:
            mapped = _mapped(raw) if f is raw else None
            if mapped is not None:
                start = 0
                while True:
                    end, lines, colons = byte_scan.chunk_end(
                        mapped, start, len(mapped) - byte_scan.PADDING, chunk_lines
                    )
                    if end < 0:
                        break
                    yield TextChunk(mapped, start, end, lines, colons)
                    start = end
                f.seek(start)
            yield from _read_text_chunks(f, chunk_lines)
    except (OSError, EOFError) as e:
        raise DataError(f"{where}: cannot read: {e}") from e


def _mapped(f) -> np.ndarray | None:
    """The bytes of the open file ``f`` mapped; None when it has no descriptor (HDFS, S3, memory)
    or fewer than ``MAP_MIN_BYTES``, or cannot be mapped."""
    try:
        descriptor = f.fileno()
        size = os.fstat(descriptor).st_size
        if size < max(MAP_MIN_BYTES, 2 * byte_scan.PADDING):
            return None
        # Copy-on-write (never written): a writable array, as a read's buffer is, so the kernels compiled for
        # one serve the other (a read-only array is another type to numba, another compile).
        return np.frombuffer(mmap.mmap(descriptor, size, access=mmap.ACCESS_COPY), np.uint8)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


def _read_text_chunks(f, chunk_lines: int) -> Iterator[TextChunk]:
    """``read_text_chunks`` of the rest of the open file ``f``, read a block at a time."""
    carry = np.zeros(0, np.uint8)  # the lines after the last chunk, fewer than chunk_lines
    eof = False
    while not eof:
        # At least as much new text as carried, so that a chunk larger than a block is copied
        # forward once or twice, not once per block.
        size = max(READ_BLOCK_BYTES, len(carry))
        buffer = np.empty(len(carry) + size + byte_scan.PADDING, np.uint8)
        buffer[: len(carry)] = carry
        got = _read_into(f, buffer[len(carry) : len(carry) + size])
        eof = got < size
        stop = len(carry) + got
        added = eof and stop > 0 and buffer[stop - 1] != 10
        if added:
            buffer[stop] = 10  # a last line without its newline: within the padding
            stop += 1
        start = 0
        while True:
            end, lines, colons = byte_scan.chunk_end(buffer, start, stop, chunk_lines)
            if end < 0:
                if eof and stop > start:
                    yield TextChunk(buffer, start, stop, lines, colons, added)
                break
            yield TextChunk(buffer, start, end, lines, colons, added and end == stop)
            start = end
        carry = buffer[start:stop]


def _read_into(f, view: np.ndarray) -> int:
    """Fill ``view`` from the file ``f``; fewer bytes only at its end."""
    got = 0
    while got < len(view):
        n = f.readinto(memoryview(view[got:]))
        if not n:
            break
        got += n
    return got


def iter_text_blocks(fs, path: str, where: str, chunk_lines: int) -> Iterator[bytes]:
    """``read_text_chunks`` as the file's bytes (a trainer's share of the lines of an hour with fewer files
    than trainers is taken from them)."""
    for chunk in read_text_chunks(fs, path, where, chunk_lines):
        data = chunk.data()
        yield data[:-1] if chunk.newline_added else data


# Parquet layout (feature-store style): one row per sample.
PARQUET_COLUMNS = {
    "show": "int64 (optional, default 1)",
    "click": "int (0/1)",
    "feasigns": "list<uint64>",
    "slots": "list<int>",
    "values": "list<double> (optional, with value_slots: dense slots' values)",
    "value_slots": "list<int64> (optional, with values: the slot of each value)",
}
# The value tokens' two columns: present together or not at all.
VALUE_COLUMNS = ("values", "value_slots")


def iter_parquet_batches(fs, path: str, where: str, chunk_lines: int) -> Iterator[tuple[LineBatch, list[BadLine]]]:
    """Batches of a Parquet file with columns click, feasigns, slots (optionally show; optionally values
    with value_slots, the dense slots' values)."""
    import pyarrow.parquet as pq

    try:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            names = set(pf.schema_arrow.names)
            missing = {"click", "feasigns", "slots"} - names
            if missing:
                raise DataError(f"{where}: Parquet columns {sorted(missing)} are missing (expected {PARQUET_COLUMNS})")
            value_cols = [c for c in VALUE_COLUMNS if c in names]
            if value_cols:
                _check_value_schema(pf.schema_arrow, where)
            cols = [c for c in ("show", "click", "feasigns", "slots") if c in names] + value_cols
            first_row = 0  # the file row of the record batch's first row, for error messages
            for rb in pf.iter_batches(batch_size=chunk_lines, columns=cols):
                yield _record_batch_to_lines(rb, where, first_row)
                first_row += rb.num_rows
    except (OSError, EOFError) as e:
        raise DataError(f"{where}: cannot read: {e}") from e


def _check_value_schema(schema, where: str) -> None:
    """values and value_slots: both present, lists of numbers and of integers."""
    import pyarrow as pa

    present = [c for c in VALUE_COLUMNS if c in schema.names]
    if len(present) == 1:
        (other,) = set(VALUE_COLUMNS) - set(present)
        raise DataError(
            f"{where}: Parquet column {present[0]!r} without {other!r}: a dense slot's values need both "
            f"(values {PARQUET_COLUMNS['values']}; value_slots {PARQUET_COLUMNS['value_slots']})"
        )
    # Integers are exact as float64 values; strings or decimals would need a parse of their own: refused.
    wanted = {
        "values": ("numbers (list<double>)", pa.types.is_floating, pa.types.is_integer),
        "value_slots": ("integers (list<int64>)", pa.types.is_integer),
    }
    for name, (what, *kinds) in wanted.items():
        t = schema.field(name).type
        is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
        if not is_list or not any(kind(t.value_type) for kind in kinds):
            raise DataError(f"{where}: Parquet column {name!r} is {t}, expected a list of {what}")


def _record_batch_to_lines(rb, where: str, first_row: int = 0) -> tuple[LineBatch, list[BadLine]]:
    import pyarrow as pa
    import pyarrow.compute as pc

    n = rb.num_rows
    click = rb.column("click")
    show = rb.column("show") if "show" in rb.schema.names else pa.array(np.ones(n, np.int64))
    feas, slots = rb.column("feasigns"), rb.column("slots")
    feas_len = pc.fill_null(pc.list_value_length(feas), -1).to_numpy(zero_copy_only=False)
    slot_len = pc.fill_null(pc.list_value_length(slots), -2).to_numpy(zero_copy_only=False)
    click_np = pc.fill_null(pc.cast(click, pa.int64()), -1).to_numpy(zero_copy_only=False)
    show_np = pc.fill_null(pc.cast(show, pa.int64()), -1).to_numpy(zero_copy_only=False)
    # Checked on every row, bad rows included, before the filter below renumbers them.
    value_cols = _value_columns(rb, where, first_row) if "values" in rb.schema.names else None
    ok = (feas_len == slot_len) & np.isin(click_np, (0, 1)) & (show_np >= 0)
    bad = [
        BadLine(int(i), f"row {int(i)}", "click must be 0/1, show >= 0, feasigns and slots of equal length")
        for i in np.flatnonzero(~ok)
    ]
    if not ok.all():
        rb = rb.filter(pa.array(ok))
        feas, slots = rb.column("feasigns"), rb.column("slots")
        click_np, show_np, feas_len = click_np[ok], show_np[ok], feas_len[ok]
    flat_feas = pc.list_flatten(feas).to_numpy(zero_copy_only=False)
    flat_slots = pc.list_flatten(slots).to_numpy(zero_copy_only=False)
    if flat_feas.dtype != np.uint64:
        if flat_feas.dtype.kind == "i" and (flat_feas < 0).any():
            raise DataError(f"{where}: feasigns must be unsigned 64-bit (uint64 column), found negative values")
        flat_feas = flat_feas.astype(np.uint64)
    lines = np.repeat(np.arange(len(click_np), dtype=np.int64), feas_len)
    batch = LineBatch(
        show_np.astype(np.int64), click_np.astype(np.int64), lines, flat_feas, flat_slots.astype(np.int64), None
    )
    if value_cols is not None:
        value_row, value_slots, values = value_cols
        # The values of the rows kept, each on its row's new line number (value_row is in row order).
        keep = ok[value_row]
        batch.value_line = (np.cumsum(ok) - 1)[value_row[keep]]
        batch.value_slots, batch.values = value_slots[keep], values[keep]
    return batch, bad


def _value_columns(rb, where: str, first_row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """values/value_slots of a record batch, flat: (row of each value, its slot, the value).

    A null list is an empty one (a row without dense values); one list longer than the other, a null
    inside a list, a non-finite value or a negative slot is a DataError naming the file row."""
    import pyarrow.compute as pc

    vals, vslots = rb.column("values"), rb.column("value_slots")
    val_len = pc.fill_null(pc.list_value_length(vals), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    slot_len = pc.fill_null(pc.list_value_length(vslots), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    unequal = np.flatnonzero(val_len != slot_len)
    if len(unequal):
        i = int(unequal[0])
        raise DataError(
            f"{where}: row {first_row + i}: {val_len[i]} values but {slot_len[i]} value_slots (one slot per value)"
        )
    flat_vals, flat_slots = pc.list_flatten(vals), pc.list_flatten(vslots)
    value_row = np.repeat(np.arange(rb.num_rows, dtype=np.int64), val_len)
    for name, flat in (("values", flat_vals), ("value_slots", flat_slots)):
        if flat.null_count:
            at = int(np.flatnonzero(~pc.is_valid(flat).to_numpy(zero_copy_only=False))[0])
            raise DataError(f"{where}: row {first_row + value_row[at]}: a null inside {name!r}")
    values = flat_vals.to_numpy(zero_copy_only=False).astype(np.float64)
    slots_np = flat_slots.to_numpy(zero_copy_only=False)
    not_finite = np.flatnonzero(~np.isfinite(values))
    if len(not_finite):
        at = int(not_finite[0])
        raise DataError(
            f"{where}: row {first_row + value_row[at]}: value {float(values[at])!r} in 'values' is not finite "
            "(a dense slot's value is a finite number)"
        )
    # A uint64 slot above 2**63 wraps negative here and is refused with the negative ones.
    slots_np = slots_np.astype(np.int64)
    negative = np.flatnonzero(slots_np < 0)
    if len(negative):
        at = int(negative[0])
        raise DataError(
            f"{where}: row {first_row + value_row[at]}: value slot {slots_np[at]} is negative (slots are >= 0)"
        )
    return value_row, slots_np, values
