"""Turn parsed line batches into Paddle feeds, parsing ahead in a background thread.

Parsing (numpy, releases the GIL for most of its work) overlaps with
``exe.run`` (C++, releases the GIL), so one trainer process keeps both of its
jobs busy without the copies a multi-process reader would need.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

import numpy as np

from ctr_foundation.sample import keys_to_paddle_ids
from elastic_control.data.line_batch import LineBatch, batch_dense, batch_keys, concat_batches, slice_batch
from elastic_control.training.model import (
    DENSE_VALUES_INPUT,
    KEY_ANCHOR_INPUT,
    KEY_ANCHOR_WEIGHT_INPUT,
    KEY_L2_INPUT,
    KEY_RATE_INPUT,
    KEYS_INPUT,
    LABEL_INPUT,
)

_END = object()


def make_feed(
    paddle,
    batch: LineBatch,
    slots,
    sparse_dim: int | None,
    place,
    l2_scale=None,
    admission=None,
    rate_factors=None,
    wide_prior=None,
    dense_norm=None,
) -> dict:
    """Feed dict: every slot's keys as one int64 LoD tensor (model.KEYS_INPUT: slot after slot, one
    sequence per line, padding rule of sample.slot_keys) and the click labels; with ``dense_norm``
    (dense_features.DenseNorm) the batch's dense slots, standardised (model.DENSE_VALUES_INPUT).

    The per-key inputs, one float32 [keys, 1] array each in the keys' order:
    with ``l2_scale`` (keys -> float32 per key), each key's L2 scale (KEY_L2_INPUT), the input of the
    training net's L2 terms; with ``admission`` (training/admission.py), the 0/1 admission mask; with
    ``rate_factors`` (keys -> float32 per key, training/rate_decay.py), each key's decay-rule rate factor
    (KEY_RATE_INPUT); with ``wide_prior`` (training/wide_prior.py), each key's anchor and its weight.
    """
    keys, lengths = batch_keys(batch, slots, sparse_dim)
    labels = batch.clicks.astype(np.float32).reshape(-1, 1)
    feed = feed_keys(paddle, keys, lengths, labels, place, l2_scale, admission, rate_factors, wide_prior)
    if dense_norm is not None:
        feed[DENSE_VALUES_INPUT] = dense_norm.apply(batch_dense(batch, dense_norm.slots))
    return feed


def feed_keys(
    paddle, keys, lengths, labels, place, l2_scale=None, admission=None, rate_factors=None, wide_prior=None
) -> dict:
    """make_feed from every slot's keys, slot after slot, with their lengths (``line_batch.batch_keys``);
    ``labels`` None for a lookup, which reads no labels."""
    t = paddle.base.core.LoDTensor()
    t.set(keys_to_paddle_ids(keys).reshape(-1, 1), place)
    t.set_recursive_sequence_lengths([lengths.tolist()])
    feed = {KEYS_INPUT: t}
    if labels is not None:
        feed[LABEL_INPUT] = labels
    per_key = [
        (fn, name)
        for fn, name in (
            (l2_scale, KEY_L2_INPUT),
            (rate_factors, KEY_RATE_INPUT),
            (wide_prior.anchors if wide_prior else None, KEY_ANCHOR_INPUT),
            (wide_prior.weights if wide_prior else None, KEY_ANCHOR_WEIGHT_INPUT),
        )
        if fn
    ]
    if per_key:
        # Each of these is a pure function of the key, found in a table of up to millions of keys:
        # searching a batch's distinct keys once, in sorted order, costs less than half of searching
        # every occurrence in line order (CHANGELOG.md, "Each batch's distinct keys searched once"), and
        # the defaults' four share that one search (CHANGELOG.md, "One search per batch for the per-key inputs").
        distinct, where = np.unique(np.asarray(keys, dtype=np.uint64), return_inverse=True)
        # Read-only: the per-key functions that search the pass's counts (KeyCounts.index) then search
        # it once for all of them.
        distinct.flags.writeable = False
        for fn, name in per_key:
            feed[name] = np.asarray(fn(distinct), dtype=np.float32)[where].reshape(-1, 1)
    if admission is not None:
        # function-level: admission imports pyarrow (key_state); the trainer imports it before paddle
        from elastic_control.training.admission import MASK_INPUT

        feed[MASK_INPUT] = admission.values(keys)
    return feed


def rebatch(batches: Iterable[LineBatch], batch_size: int) -> Iterator[LineBatch]:
    """Re-cut a stream of parsed chunks into batches of exactly ``batch_size`` lines (the last may be short)."""
    pending: list[LineBatch] = []
    have = 0
    for b in batches:
        pending.append(b)
        have += len(b)
        if have < batch_size:
            continue
        merged = concat_batches(pending)
        start = 0
        while len(merged) - start >= batch_size:
            yield slice_batch(merged, start, start + batch_size)
            start += batch_size
        rest = slice_batch(merged, start, len(merged))
        pending, have = ([rest], len(rest)) if len(rest) else ([], 0)
    if have:
        yield concat_batches(pending)


def prefetch(iterator: Iterable, depth: int = 4) -> Iterator:
    """Run ``iterator`` in a background thread, ``depth`` items ahead; re-raises its errors here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work():
        try:
            for item in iterator:
                if stop.is_set():
                    return
                q.put(item)
            q.put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            q.put(e)

    thread = threading.Thread(target=work, name="prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.05)
