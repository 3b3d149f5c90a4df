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
from elastic_control.data.line_batch import LineBatch, batch_slot_keys, concat_batches, slice_batch
from elastic_control.training.model import (
    LABEL_INPUT,
    slot_anchor_input_name,
    slot_anchor_weight_input_name,
    slot_input_name,
    slot_l2_input_name,
    slot_rate_input_name,
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
) -> dict:
    """Feed dict: one int64 LoD tensor per slot (padding rule of sample.slot_keys) and the click labels.

    With ``l2_scale`` (keys -> float32 per key), also each key's L2 scale as a float LoD
    tensor beside its slot's keys (``slot_l2_input_name``), the input of the training net's L2 terms.
    With ``admission`` (training/admission.py), also each slot's 0/1 admission mask, same LoD.
    With ``rate_factors`` (keys -> float32 per key, training/rate_decay.py), also each key's decay-rule
    rate factor (``slot_rate_input_name``), same LoD.
    With ``wide_prior`` (training/wide_prior.py), also each key's anchor and its weight, same LoD.
    """
    per_slot = list(batch_slot_keys(batch, slots, sparse_dim))
    labels = batch.clicks.astype(np.float32).reshape(-1, 1)
    return feed_slot_keys(paddle, per_slot, labels, slots, place, l2_scale, admission, rate_factors, wide_prior)


def feed_slot_keys(
    paddle, per_slot, labels, slots, place, l2_scale=None, admission=None, rate_factors=None, wide_prior=None
) -> dict:
    """make_feed from each slot's (keys, lengths) and the labels: see there."""
    core = paddle.base.core
    feed = {}
    per_key = [
        (fn, name)
        for fn, name in (
            (l2_scale, slot_l2_input_name),
            (rate_factors, slot_rate_input_name),
            (wide_prior.anchors if wide_prior else None, slot_anchor_input_name),
            (wide_prior.weights if wide_prior else None, slot_anchor_weight_input_name),
        )
        if fn
    ]
    if per_key:  # looked up once for the whole batch (one search per table, not one per slot)
        ends = np.cumsum([len(keys) for keys, _ in per_slot])
        every_key = np.concatenate([keys for keys, _ in per_slot]) if per_slot else np.zeros(0, np.uint64)
        per_key = [(np.split(np.asarray(fn(every_key), dtype=np.float32), ends[:-1]), name) for fn, name in per_key]
    for i, (slot, (keys, lengths)) in enumerate(zip(slots, per_slot, strict=True)):
        lod = [lengths.tolist()]
        t = core.LoDTensor()
        t.set(keys_to_paddle_ids(keys).reshape(-1, 1), place)
        t.set_recursive_sequence_lengths(lod)
        feed[slot_input_name(slot)] = t
        for values, name in per_key:
            w = core.LoDTensor()
            w.set(values[i].reshape(-1, 1), place)
            w.set_recursive_sequence_lengths(lod)
            feed[name(slot)] = w
        if admission is not None:
            from elastic_control.training.admission import mask_input_name

            m = core.LoDTensor()
            m.set(admission.values(keys), place)
            m.set_recursive_sequence_lengths(lod)
            feed[mask_input_name(slot)] = m
    feed[LABEL_INPUT] = labels
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
