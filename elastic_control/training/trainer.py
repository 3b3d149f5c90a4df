"""TRAINING_ROLE=TRAINER: train hour by hour; trainer 0 also exports each pass and tracks the run.

Per pass (one hour): every trainer trains on its share of the hour's files,
flushes its pending pushes and waits at a barrier; trainer 0 then exports the
pass while the others wait at a second barrier, so nothing changes the
parameters between the export and the golden scoring.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ctr_foundation.dense_features import DenseMoments, DenseNorm
from ctr_foundation.pass_format import load_pass, pass_name
from ctr_foundation.progress import PassProgress
from ctr_foundation.records import read_donefile
from elastic_control.config.data_config import format_hour, parse_slot
from elastic_control.data.line_batch import LineBatch, batch_dense, batch_keys, slice_batch
from elastic_control.data.readers import BadLineCounter, HourlyData, HourPartition
from elastic_control.metrics import RecentWindow, line_log_losses
from elastic_control.training.best_epoch import BestEpoch
from elastic_control.training.bias_refit import BIAS_REFIT_LINES, PredictionSums
from elastic_control.training.coordinator import CoordinatorClient, coordinator_endpoint
from elastic_control.training.feeding import feed_keys, make_feed, prefetch, rebatch
from elastic_control.training.job_progress import JobProgressAnnotator
from elastic_control.training.model import EXECUTOR_FLAGS, build_training_net, make_strategy, table_shards
from elastic_control.training.pass_stream import (
    Holdout,
    KeyCounts,
    ParsedShare,
    pass_batch_size,
    planned_epochs,
    shuffled,
    unjudged_pass,
    without_holdout,
)
from elastic_control.training.ps_params import PsParameters
from elastic_control.training.rate_decay import RateDecay
from elastic_control.training.run_params import run_params
from elastic_control.training.settings import RoleSettings
from elastic_control.training.trainer_export import export_pass
from elastic_control.training.wide_prior import WidePrior


@dataclass
class PassStats:
    examples: int = 0
    steps: int = 0
    loss_sum: float = 0.0
    bad_lines: int = 0
    lines: int = 0
    seconds: float = 0.0
    golden: list[LineBatch] = field(default_factory=list)  # trainer 0's held-out lines
    epochs: int = 0  # epochs run
    planned_epochs: int = 1
    batch_size: int = 0  # this pass's batch (pass_stream.pass_batch_size)
    context_lines: int = 0  # this trainer's lines of the window's earlier hours, trained in the first epoch
    holdout_losses: list[float] = field(default_factory=list)  # after each epoch, with the early stop
    judged: bool = True  # False: too few held-out lines for the early stop (pass_stream.unjudged_pass)
    best_epoch: int | None = None  # the early stop's lowest held-out loss (of the epochs scored)
    restored_epoch: int | None = None  # the epoch put back after a worse last one (training/best_epoch.py)
    # This trainer's predictions on a sample of its share after the pass's epochs (training/bias_refit.py)
    prediction_sums: dict = field(default_factory=dict)
    bias_shift: float | None = None  # what trainer 0 added to the logit bias after the pass (None: not refitted)


class Trainer:
    def __init__(self, settings: RoleSettings):
        self.s = settings
        self.rank = settings.trainer_id
        self.tracker = None
        self._job_progress = None
        if settings.is_chief:
            # function-level: imports mlflow and pyarrow (seconds), trainer 0 only, before paddle
            from elastic_control.training.tracking import Tracker

            self.tracker = Tracker(
                settings.model_path, run_name=f"train-{format_hour(settings.data_config.start)}", warn=self.log
            )
            self._job_progress = JobProgressAnnotator.in_pod()  # None outside the Volcano job's pods
            self._publish_passes()  # a restarted job's annotation lists the passes done before too
        import pyarrow  # noqa: F401  (before paddle)

        import paddle
        import paddle.distributed.fleet as fleet

        # function-level: imports pyarrow (admission, delta_export), which the role imports above, before paddle
        from elastic_control.training.incremental import Incremental

        self.paddle, self.fleet = paddle, fleet
        # Delta passes, admission, eviction (None when all are off: full passes as before).
        self.incremental = Incremental.for_role(settings.data_config, is_chief=settings.is_chief, log=self.log)
        self.sparse_shards = table_shards(settings.pservers)
        # The decay rule's per-key rates (training/rate_decay.py), None when no part of the rows uses it.
        self.rate_decay = None
        paddle.enable_static()
        paddle.set_flags(EXECUTOR_FLAGS)
        fleet.init(is_collective=False)
        self.spec = settings.model_spec()
        inc = self.incremental
        self.net = build_training_net(paddle, self.spec, embedding_hook=inc.embedding_hook(paddle) if inc else None)
        if self.net.uses_decay:
            self.rate_decay = RateDecay(self.spec.decay_sightings, settings.trainers)
        # The wide prior (training/wide_prior.py), None when off.
        self.wide_prior = None
        if self.spec.uses_wide_prior:
            self.wide_prior = WidePrior(self.spec.wide_prior, self.spec.l2_wide)
        strategy = make_strategy(fleet, self.spec, shards=self.sparse_shards, accessor=inc.accessor() if inc else None)
        optimizer = fleet.distributed_optimizer(paddle.optimizer.Adam(self.spec.learning_rate), strategy)
        optimizer.minimize(self.net.loss)
        self.main = paddle.static.default_main_program()
        # The training program's forward part alone: scores golden lines without pushing gradients.
        self.forward = self.main._prune([self.net.prob])
        # The lookups alone: the wide prior reads the keys' weights at each pass start.
        self.lookup = self.main._prune([self.net.rows]) if self.wide_prior else None
        self.place = paddle.CPUPlace()
        self.exe = paddle.static.Executor(self.place)
        self.ps = PsParameters(paddle, fleet, self.exe, self.place, self.net.dense_param_names)
        self.coord = CoordinatorClient(*coordinator_endpoint(settings.pserver_endpoints))
        self.global_step = 0
        self._best = None  # training/best_epoch.py, trainer 0 with the early stop
        # The step `auc` is a progressive-validation AUC: each batch is scored by the
        # model *before* its own update, over the last few thousand examples. It lags
        # the held-out AUC while the model still moves fast (and reads ~0.5 early in the
        # first pass, when all scores are nearly equal); a short window keeps the lag small.
        self.window = RecentWindow(4096)
        # The dense slots' standardisation (ctr_foundation/dense_features.py): trainer 0's, shared at start.
        self.dense_norm = None

    def log(self, message: str) -> None:
        print(f"[trainer {self.rank}] {message}", flush=True)

    # -- setup -------------------------------------------------------------------------------
    def start(self, hello: dict, first: HourPartition | None, data: HourlyData) -> None:
        self.exe.run(self.paddle.static.default_startup_program())
        # Before the last pass's dense parameters: a slot.conf whose dense slots that pass lacks fails here,
        # naming it, not in a shape mismatch.
        norm = self._chief_dense_norm(hello, first, data) if self.s.is_chief and self.spec.dense_slots else None
        if hello.get("last_pass") and self.s.is_chief:
            # init_worker pushes trainer 0's dense parameters to the servers: make them the last pass's.
            prefix = self.ps.load_dense_from_pass(hello["last_pass_dir"])
            self.log(f"loaded dense parameters from {prefix}")
        elif self.s.is_chief and first is not None:
            self._init_bias_at_base_rate(data, first)
        # init_worker: trainer 0 pushes its dense parameters, then every trainer pulls them. Paddle's
        # barrier in between is a no-op without Gloo, so the others wait for trainer 0 here (and take
        # its dense slots' standardisation from it).
        if self.s.is_chief:
            self.fleet.init_worker()
            self.coord.barrier("init/chief-pushed", self.rank, self.s.trainers, {"dense_norm": norm})
        else:
            got = self.coord.barrier("init/chief-pushed", self.rank, self.s.trainers)["0"] or {}
            norm = got.get("dense_norm")
            self.fleet.init_worker()
        if self.spec.dense_slots:
            self.dense_norm = DenseNorm.from_json(norm, "trainer 0's dense_norm")
            if self.dense_norm is None or self.dense_norm.slots != self.spec.dense_slots:
                raise RuntimeError(f"no standardisation for the dense slots {list(self.spec.dense_slots)}")
        self.ps.connect()
        if hello.get("last_pass"):
            self.log(f"resuming after {hello['last_pass']} (hours up to {hello['resume_after']} are done)")
            if self.incremental:
                self.incremental.resume(hello["last_pass_dir"])
        if self.tracker:
            self.tracker.log_params(run_params(self.s, self.spec, hello))

    def _init_bias_at_base_rate(self, data: HourlyData, part: HourPartition, lines: int = 20_000) -> None:
        """A fresh model starts at the first pass's base rate: logit bias = its log-odds.

        Estimated from up to ``lines`` of trainer 0's share of the first hour, before init_worker
        pushes trainer 0's dense parameters to the servers (so every trainer starts from it).
        """
        clicks = shows = 0
        for chunk in data.iter_batches(part, trainer_id=0, trainers=self.s.trainers, counter=BadLineCounter(1.0)):
            clicks += int(chunk.clicks.sum())
            shows += len(chunk)
            if shows >= lines:
                break
        if not shows:
            return
        rate = min(max((clicks + 0.5) / (shows + 1.0), 1e-4), 1 - 1e-4)
        bias = float(np.log(rate / (1 - rate)))
        tensor = self.paddle.static.global_scope().find_var("logit.b").get_tensor()
        tensor.set(np.full(np.array(tensor).shape, bias, np.float32), self.place)
        self.log(
            f"logit bias set to {bias:.4f}: the log-odds of the base rate {rate:.4f} ({shows} lines of {part.name})"
        )

    def _chief_dense_norm(self, hello: dict, first: HourPartition | None, data: HourlyData, lines: int = 100_000):
        """The dense slots' standardisation (JSON): a resumed model keeps its last pass's, a fresh one
        measures it on up to ``lines`` of trainer 0's share of its first pass (the others take it from
        trainer 0, so that every trainer feeds the same numbers)."""
        slots = self.spec.dense_slots
        if hello.get("last_pass"):
            norm = DenseNorm.from_json(load_pass(hello["last_pass_dir"]).meta.get("dense_norm"))
            if norm is None or norm.slots != slots:
                raise RuntimeError(
                    f"{hello['last_pass']} has no standardisation of the dense slots {list(slots)} "
                    "(was it trained with another slot.conf?)"
                )
            return norm.to_json()
        moments, seen = DenseMoments(slots), 0
        if first is not None:
            for chunk in data.iter_batches(first, trainer_id=0, trainers=self.s.trainers, counter=BadLineCounter(1.0)):
                moments.add(batch_dense(chunk, slots))
                seen += len(chunk)
                if seen >= lines:
                    break
        norm = moments.norm()
        self.log(
            "dense slots standardised on "
            + f"{seen} lines of {first.name if first else 'no pass'}: "
            + ", ".join(f"{s}: mean {m:.4g} std {d:.4g}" for s, m, d in zip(slots, norm.mean, norm.std, strict=True))
        )
        return norm.to_json()

    # -- training ----------------------------------------------------------------------------
    def run(self) -> None:
        data = HourlyData(
            self.s.data_config,
            wait_timeout=self.s.hyper.wait_timeout,
            poll_seconds=self.s.hyper.poll_seconds,
            warn=self.log,
        )
        hello = self.coord.hello()
        after = parse_slot(hello["resume_after"]) if hello.get("resume_after") else None
        partitions = data.partitions(after=after)
        first = next(partitions, None)
        self.start(hello, first, data)
        passes = 0
        for part in itertools.chain([first] if first else [], partitions):
            # The first pass of a model not resumed trains it from its initialisation.
            cold = passes == 0 and not hello.get("last_pass")
            stats = self.train_hour(data, part, cold=cold)
            if not self._epochs_end_at_a_barrier:
                self.ps.flush_pushes()  # else the last epoch's end flushed them
            everyone = self.coord.barrier(
                f"{part.name}/trained",
                self.rank,
                self.s.trainers,
                {
                    "examples": stats.examples,
                    "bad_lines": stats.bad_lines,
                    "lines": stats.lines,
                    "seconds": stats.seconds,
                    "prediction_sums": stats.prediction_sums,
                },
            )
            if self.s.is_chief and self.s.hyper.refit_bias is not False:
                stats.bias_shift = self._refit_bias(part, [d["prediction_sums"] for d in everyone.values()])
            published = export_pass(self, part, stats, everyone) if self.s.is_chief else None
            self._publish_passes()
            done = self.coord.barrier(f"{part.name}/exported", self.rank, self.s.trainers, {"pass_dir": published})
            if self.incremental and not self.s.is_chief:
                self.incremental.follow(done["0"]["pass_dir"])
            passes += 1
        self.log(f"finished: {passes} pass(es)")
        self.shutdown()

    def _publish_passes(self) -> None:
        """Trainer 0 in a Volcano job's pod: the complete passes onto the job's annotation (job_progress.py)."""
        if self._job_progress is not None and "://" not in self.s.model_path:
            self._job_progress.passes_done(read_donefile(self.s.model_path))

    def train_hour(self, data: HourlyData, part: HourPartition, *, cold: bool = False) -> PassStats:
        """Train on this trainer's share of one pass, for the pass's epochs; trainer 0 keeps its held-out lines.

        ``cold``: the pass starts the model from its initialisation (EPOCHS=auto then plans at least
        ``min_steps_first_pass`` steps).
        """
        h = self.s.hyper
        stats = PassStats()
        counter = BadLineCounter(self.s.data_config.max_bad_line_fraction)
        # Bad lines are counted (and checked) in the first read: the key count's, or the first epoch's.
        share = ParsedShare(
            lambda first: data.iter_batches(
                part,
                trainer_id=self.rank,
                trainers=self.s.trainers,
                counter=counter if first else BadLineCounter(1.0),
            )
        )
        need = max(h.holdout_lines, h.golden_lines) if self.s.is_chief else 0
        holdout = Holdout(need, h.golden_stride)
        started = time.monotonic()
        # The training window: the hours before this one, trained once more in this pass's first epoch.
        earlier = data.hours_before(part, self.s.window_hours - 1)
        context = (
            ParsedShare(
                lambda first: (
                    chunk
                    for p in earlier
                    for chunk in data.iter_batches(
                        p, trainer_id=self.rank, trainers=self.s.trainers, counter=BadLineCounter(1.0)
                    )
                )
            )
            if earlier
            else None
        )
        counts = share_lines = l2_scale = None
        context_lines = 0
        admits = bool(self.incremental and self.incremental.needs_pass_keys)
        if self.net.uses_l2 or self.rate_decay or admits:
            # Over every line the pass trains: the window's earlier hours too.
            counts, lines = self._count_keys(itertools.chain(context or (), share), part)
            context_lines = sum(len(chunk) for chunk in context) if context else 0  # replayed, not read again
            share_lines = lines - context_lines
            l2_scale = counts.inverse if self.net.uses_l2 else None
        elif context:
            context_lines = sum(len(chunk) for chunk in context)
            share_lines = sum(len(chunk) for chunk in share)
        if context:
            stats.context_lines = context_lines
            self.log(
                f"pass {part.name}: also {context_lines} lines of {', '.join(p.name for p in earlier)} "
                "in its first epoch (training window)"
            )
        if self.incremental:
            # Admission's own counts restart at each pass (they are the occurrences fed since the last
            # export), aligned with the pass's key counts.
            self.incremental.start_pass(counts if admits else None)
        # Smaller batches only in the first pass of a fresh model (pass_stream.pass_batch_size): a later
        # pass refines rows already trained, and small batches there measured no better on average.
        min_batches = h.min_batches_first_pass if cold else 0
        if min_batches and share_lines is None:
            share_lines = sum(len(chunk) for chunk in share)  # the first read, which later reads replay
        stats.batch_size = pass_batch_size(share_lines or 0, h.batch_size, min_batches)
        if stats.batch_size != h.batch_size:
            self.log(f"pass {part.name}: {share_lines} lines in this trainer's share: batches of {stats.batch_size}")
        if self.wide_prior:
            t = time.monotonic()
            known = self.wide_prior.start_pass(counts, self._wide_weights)
            self.log(f"pass {part.name}: wide prior on {known} keys seen before ({time.monotonic() - t:.1f}s)")
        best = self._best_epoch_for(part)
        epochs, epoch = 1, 0
        fixed = self.s.epochs if isinstance(self.s.epochs, int) else None
        self.progress = PassProgress(
            self.s.model_path, part.name, write=self.s.is_chief, epochs=fixed, sink=self._job_progress
        )
        self.progress.expect(share_lines=share_lines, batch_size=stats.batch_size)
        while epoch < epochs:
            epoch += 1
            epoch_started = time.monotonic()
            self.progress.start_epoch(epoch, epochs if epoch > 1 else None)
            if self.rate_decay:
                self.rate_decay.start_epoch(counts, share_lines + (context_lines if epoch == 1 else 0))
            steps = self._train_epoch(share, part, epoch, holdout, stats, l2_scale, context if epoch == 1 else None)
            if epoch == 1:
                self.progress.steps_per_epoch = steps
            if self.rate_decay:
                self.rate_decay.end_epoch()
            if epoch == 1:
                stats.bad_lines, stats.lines = counter.bad, counter.total
                # The plan counts steps of the full batch size, so a small pass cut into smaller batches
                # plans the same epochs as before (pass_stream.pass_batch_size): only each epoch's steps
                # are smaller.
                # The pass's own lines plan its epochs: the window's earlier hours are one epoch more, not
                # more epochs of every hour.
                own = share_lines / (share_lines + context_lines) if context_lines else 1.0
                epochs = planned_epochs(
                    self.s.epochs,
                    math.ceil(steps * own * stats.batch_size / h.batch_size),
                    min_steps=h.min_steps_per_pass,
                    first_pass_steps=h.min_steps_first_pass if cold else None,
                    max_epochs=h.max_epochs,
                )
                # Trainer 0 alone holds lines out: its count decides for every trainer (the plan below).
                if self.s.is_chief and unjudged_pass(
                    self.s.epochs, self.s.early_stop, holdout.count, h.min_holdout_to_stop
                ):
                    stats.judged, epochs = False, min(epochs, h.unjudged_pass_epochs)
                    self.log(
                        f"pass {part.name}: {holdout.count} held-out lines, fewer than {h.min_holdout_to_stop}: "
                        f"{epochs} epoch(s), not judged by them"
                    )
                stats.planned_epochs = epochs
            if not self._epochs_end_at_a_barrier:
                continue  # a fixed number of epochs: nothing to decide
            # Every trainer ends the epoch the same way: trainer 0 decides, from its own steps
            # (EPOCHS=auto) and its held-out lines (early stop), whether another epoch follows.
            self.ps.flush_pushes()
            plan = {"epochs": epochs, "judged": stats.judged} if self.s.is_chief and epoch == 1 else {}
            got = self.coord.barrier(f"{part.name}/epoch-{epoch}", self.rank, self.s.trainers, plan)["0"] or {}
            epochs = int(got.get("epochs", epochs))
            stats.judged = bool(got.get("judged", stats.judged))
            if not (self.s.early_stop and stats.judged):
                continue
            # Every trainer's pushes of the epoch are in: trainer 0 scores it (and copies or restores).
            decision = {}
            if best is not None and epochs > 1 and holdout.count and (epoch < epochs or best.enabled):
                self.ps.pull_dense()
                held_out = holdout.batch()  # concatenates the held-out chunks: once per scoring
                lines = line_log_losses(held_out.clicks, self.score(held_out))
                loss = float(lines.mean())
                stats.holdout_losses.append(loss)
                more = epoch < epochs
                seconds = time.monotonic() - epoch_started
                worse = best.after_epoch(epoch, loss, more=more, epoch_seconds=seconds, line_losses=lines)
                if worse and more:
                    decision["stop"] = True
                    self.log(f"pass {part.name}: early stop after epoch {epoch} (held-out log loss {loss:.5f})")
            got = self.coord.barrier(f"{part.name}/epoch-{epoch}/scored", self.rank, self.s.trainers, decision)["0"]
            if (got or {}).get("stop"):
                break
        if best is not None:
            stats.best_epoch, stats.restored_epoch = best.best_epoch, best.restored_epoch
            best.end_pass()
        if self.wide_prior:
            self.wide_prior.end_pass(counts)
        if h.refit_bias is not False:
            # The refit needs BIAS_REFIT_LINES lines of the pass in all (a click rate within ~1%), not from each
            # trainer: N trainers score a share of them each, so a second trainer halves this cost of a pass.
            stats.prediction_sums = self._prediction_sums(share, math.ceil(BIAS_REFIT_LINES / self.s.trainers))
        stats.epochs = epoch
        stats.seconds = time.monotonic() - started
        self.progress.finish(epoch)
        stats.golden = [holdout.batch()] if holdout.count else []
        rate = stats.examples / max(stats.seconds, 1e-9)
        self.log(
            f"pass {part.name}: {stats.examples} examples in {stats.steps} steps ({epoch} epoch(s)), "
            f"{rate:.0f} examples/s, {counter.bad} bad lines"
        )
        return stats

    @property
    def _epochs_end_at_a_barrier(self) -> bool:
        """Every epoch ends with a flush of the pushes and a barrier (EPOCHS=auto or the early stop decide
        there what follows), so the pass end needs no flush of its own: Paddle's sleeps at least 100 ms,
        a tenth of a small pass's epoch. (A restore after the last one pushes nothing asynchronously:
        loading the table and pushing the dense parameters both wait for the servers.)"""
        return self.s.epochs == "auto" or bool(self.s.early_stop)

    def _count_keys(self, share, part: HourPartition):
        """Count this trainer's keys over its share (the pass's first read, which the epochs then replay):
        (KeyCounts, lines), for the count-scaled L2's 1 / count per key, the decay rule's sightings and
        training admission's occurrences fed."""
        t = time.monotonic()
        counts, lines = KeyCounts(), 0
        for chunk in share:
            lines += len(chunk)
            counts.add(batch_keys(chunk, self.spec.slots, self.spec.sparse_dim)[0])
        self.log(f"pass {part.name}: {len(counts)} distinct keys counted in {time.monotonic() - t:.1f}s")
        return counts, lines

    def _best_epoch_for(self, part: HourPartition):
        """Trainer 0's BestEpoch for this pass, with the early stop; None elsewhere."""
        if not (self.s.is_chief and self.s.early_stop):
            return None
        if self._best is None:
            # function-level: delta_export imports pyarrow (the trainer module stays free of it: pyarrow before paddle)
            from elastic_control.training.delta_export import SAVE_ALL

            worker, table_id = self.ps.sparse_table()
            self._best = BestEpoch(
                save_table=lambda path: worker.save_one_model(table_id, str(path), SAVE_ALL),
                load_table=lambda path: worker.load_one_table(table_id, str(path), SAVE_ALL),
                get_dense=self.ps.dense_snapshot,
                set_dense=self.ps.push_dense,
                log=self.log,
                enabled=self.s.hyper.restore_best_epoch is not False,
                patience=self.s.hyper.early_stop_patience,
            )
        name = pass_name(part.last, minutes=bool(self.s.data_config.pass_minutes))
        # A hidden staging name: a job restarted after a crash removes it (resume.remove_stale_staging).
        self._best.start_pass(Path(self.s.model_path) / f".{name}-best-epoch.tmp")
        return self._best

    def _prediction_sums(self, share, lines: int) -> dict:
        """Sums of the current model's predictions over up to ``lines`` of this trainer's share (its first
        ones: the share is in file order, and any part of the hour will do), for ``bias_refit.shift``."""
        self.ps.pull_dense()
        sums = PredictionSums()
        for chunk in share:
            chunk = slice_batch(chunk, 0, min(len(chunk), lines - sums.n))
            if len(chunk):
                sums.add(chunk.clicks, self.score(chunk))
            if sums.n >= lines:
                break
        return sums.to_json()

    def _refit_bias(self, part: HourPartition, sums: list[dict]) -> float:
        """Trainer 0, every trainer waiting: move the logit bias so that the model's mean prediction on the
        pass's lines is their click rate (training/bias_refit.py); returns the shift."""
        total = PredictionSums.merged(sums)
        shift = total.shift()
        if shift:
            self.ps.pull_dense()  # every trainer's pushes of the pass are in (the barrier): start from them
            snapshot = self.ps.dense_snapshot()
            self.ps.push_dense({"logit.b": snapshot["logit.b"] + np.float32(shift)})
        self.log(
            f"pass {part.name}: mean prediction {total.mean_prediction:.4f} against click rate {total.click_rate:.4f} "
            f"on {total.n} lines: logit bias {shift:+.4f}"
        )
        return shift

    def _train_epoch(self, share, part, epoch, holdout, stats, l2_scale=None, context=None) -> int:
        """One epoch over this trainer's share of the pass (and ``context``, the window's earlier hours, shuffled
        in with it); the number of steps."""
        h = self.s.hyper
        seed = [self.rank, epoch, part.hour.toordinal() * 24 + part.hour.hour]
        if part.minutes:  # sub-hour passes: each slot of the hour its own order
            seed.append(part.hour.minute)
        rng = np.random.default_rng(seed)
        own = without_holdout(share, holdout, first_epoch=epoch == 1)
        lines = shuffled(itertools.chain(context, own) if context else own, h.shuffle_lines, rng)

        def feeds():
            mask = self.incremental.train_mask if self.incremental else None
            decay = self.rate_decay
            for b in rebatch(lines, stats.batch_size):
                feed = make_feed(
                    self.paddle,
                    b,
                    self.spec.slots,
                    self.spec.sparse_dim,
                    self.place,
                    l2_scale,
                    admission=mask,
                    rate_factors=decay.factors if decay else None,
                    wide_prior=self.wide_prior,
                    dense_norm=self.dense_norm,
                )
                if decay:  # the parse thread runs ahead of exe.run by a few batches: close enough
                    decay.fed(len(b))
                yield b, feed

        steps = 0
        last_log, last_examples = time.monotonic(), stats.examples
        for batch, feed in prefetch(feeds()):
            loss, prob = self.exe.run(self.main, feed=feed, fetch_list=[self.net.log_loss, self.net.prob])
            steps += 1
            stats.steps += 1
            if stats.steps % h.dense_pull_every == 0:
                self.ps.pull_dense()
            stats.examples += len(batch)
            stats.loss_sum += float(np.array(loss)) * len(batch)
            self.global_step += 1
            self.window.add(batch.clicks, np.array(prob))
            self.progress.step(stats.steps, stats.examples)
            if self.global_step % h.log_every == 0:
                now = time.monotonic()
                rate = (stats.examples - last_examples) / max(now - last_log, 1e-9)
                last_log, last_examples = now, stats.examples
                self._log_step(part, float(np.array(loss)), rate)
        return steps

    def _log_step(self, part: HourPartition, loss: float, rate: float) -> None:
        window_auc = self.window.auc()
        self.log(
            f"pass {part.name} step {self.global_step} loss {loss:.4f} auc {window_auc:.4f} examples/s {rate:.0f}"
            + self.progress.suffix()
        )
        if self.tracker:
            import psutil

            proc = psutil.Process()
            self.tracker.log_metrics(
                {
                    "loss": loss,
                    "auc": window_auc,
                    "examples_per_sec": rate,
                    "cpu_percent": proc.cpu_percent(None),
                    "memory_mb": proc.memory_info().rss / 2**20,
                },
                self.global_step,
            )

    def _wide_weights(self, keys: np.ndarray, chunk: int = 8192) -> np.ndarray:
        """embed_w of each key as the servers hold it now (forward lookups only: nothing is pushed)."""
        out = []
        for start in range(0, len(keys), chunk):
            part = np.asarray(keys[start : start + chunk], dtype=np.uint64)
            # The lookup program stops at the looked-up rows (before the pooling that needs every slot's
            # keys), so one slot's worth of keys, one per line, is all it reads.
            mask = self.incremental.mask if self.incremental else None
            feed = feed_keys(self.paddle, part, np.ones(len(part), np.int64), None, self.place, admission=mask)
            # The rows keep their LoD, which only return_numpy=False hands back.
            (rows,) = self.exe.run(self.lookup, feed=feed, fetch_list=[self.net.rows.name], return_numpy=False)
            out.append(np.array(rows)[: len(part), 0])
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def _forward_inputs(self) -> dict:
        """make_feed's per-key inputs for forward runs (scoring, lookups): the admission mask, and with the
        decay rule factors of 1 (they scale gradients only, the forward value is the same for any, but the
        forward programs still read them)."""
        ones = (lambda keys: np.ones(len(keys), np.float32)) if self.rate_decay else None
        return {
            "admission": self.incremental.mask if self.incremental else None,
            "rate_factors": ones,
            "dense_norm": self.dense_norm,
        }

    def score(self, batch: LineBatch) -> np.ndarray:
        """Probabilities from the training program's forward pass (no gradient push)."""
        feed = make_feed(
            self.paddle, batch, self.spec.slots, self.spec.sparse_dim, self.place, **self._forward_inputs()
        )
        (prob,) = self.exe.run(self.forward, feed=feed, fetch_list=[self.net.prob.name])
        return np.array(prob).ravel()

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop together: the others release their clients first, then trainer 0 stops the servers."""
        self.coord.barrier("end/trained", self.rank, self.s.trainers)
        if not self.s.is_chief:
            self.fleet.stop_worker()
            self.coord.finish(self.rank)
            self.coord.barrier("end/workers-stopped", self.rank, self.s.trainers)
            return
        self.coord.barrier("end/workers-stopped", self.rank, self.s.trainers)
        self.coord.finish(self.rank)
        self.fleet.fleet._runtime_handle._worker.stop_server()
        self.fleet.stop_worker()
        if self.tracker:
            self.tracker.finish()


def run_trainer(settings: RoleSettings) -> None:
    trainer = Trainer(settings)
    try:
        trainer.run()
    except BaseException:
        if trainer.tracker:
            trainer.tracker.finish("FAILED")
        raise
