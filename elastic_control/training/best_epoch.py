"""The early stop keeps a pass's best epoch, not the one after it.

The early stop can only see that an epoch made the held-out log loss worse once that epoch has run, so
without a copy the pass would export the worse model (on a 5,000-line pass one such epoch took
calibration from 0.83 to 0.50). Trainer 0 therefore keeps a copy of the best epoch so far whenever
another epoch follows: the pservers save the whole sparse table under MODEL_PATH (a hidden
``.pass-NAME-best-epoch.tmp`` folder, which a restarted job removes as stale staging) and the dense
parameters stay in trainer 0's memory. An epoch worse than the best puts the copy back (the pservers
load the table, trainer 0 pushes the dense parameters) and ends the pass.

Every key of the pass is in the table after the first epoch (later epochs read the same lines), so
loading the copy overwrites every row those epochs changed. What stays from the discarded epoch: the
dense optimizer's moments on the pservers and the decay rule's sighting counts (training/rate_decay.py).

Because the best epoch can be put back, one worse epoch need not end the pass: ``patience`` worse
epochs after the best do (default 2; a first pass's held-out loss can rise for an epoch and fall below
its best after the next).

An epoch no better than the best counts as a whole worse epoch only when it is worse beyond the
held-out set's noise: its per-line losses minus the best epoch's on the same lines (a paired difference)
average more than WORSE_BY_STANDARD_ERRORS standard errors above zero. Within the noise it counts
NOISY_EPOCH_WEIGHT (half) of one, so a pass ends after ``patience`` clearly worse epochs or twice as many
noisy ones. Why: a small pass holds out few lines (every 20th of trainer 0's share: 125 lines of a
5,000-line hour), and a rise of 0.002 on them for two epochs ended a pass whose fourth epoch would have
been its best (the two-pass log's test AUC 0.7389 instead of 0.7490-0.7515). A real blow-up (0.4716 ->
0.4932 on 150 lines) is many standard errors, and without a copy it still ends the pass at once. Noisy
epochs are not free either: counted as nothing, a 6,000-line first pass overfit for ten epochs "within
the noise" of 150 lines before one was clearly worse.

A copy costs one save of the whole table per epoch (about 1 s per 100k keys here). Only passes with
several epochs pay it, and when SLOW_COPIES_IN_A_ROW saves in a row each take longer than
SLOW_COPY_FACTOR times the epoch they follow (and than MIN_COPY_SECONDS), trainer 0 stops taking copies
for the rest of the job (logged): a large online table with small passes keeps the plain early stop.
One slow save is not enough: Paddle's save forks a shell and a gzip per shard file, so on a loaded
machine a single save of a 19k-key table took 5.2 s where it takes 0.4 s when quiet, while the epochs
slowed far less. Turning copies off on such a spike left the rest of the job exporting (and, for the
last planned epoch, not even scoring) epochs that made the held-out loss worse.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# A save costs about a second however small the table (measured here), and small passes are the ones
# whose epochs are short: only copies slower than this and than the epoch they follow turn copies off.
MIN_COPY_SECONDS = 5.0
# How far above the best epoch's held-out losses (in standard errors of the paired mean difference) an
# epoch must be to count as worse: one-sided, about 2% of epochs that are really no different.
WORSE_BY_STANDARD_ERRORS = 2.0
# What an epoch no better than the best, but within the noise, counts toward the patience.
NOISY_EPOCH_WEIGHT = 0.5
# How much slower than its epoch a save must be, and how many times in a row, before copies go off.
SLOW_COPY_FACTOR = 2.0
SLOW_COPIES_IN_A_ROW = 2


class BestEpoch:
    """Trainer 0's record of a pass's best epoch by held-out log loss, and its copy of that model."""

    def __init__(
        self,
        *,
        save_table: Callable[[Path], None],
        load_table: Callable[[Path], None],
        get_dense: Callable[[], dict[str, np.ndarray]],
        set_dense: Callable[[dict[str, np.ndarray]], None],
        log: Callable[[str], None],
        enabled: bool = True,
        patience: int = 1,
    ):
        self.directory: Path | None = None
        self._save_table, self._load_table = save_table, load_table
        self._get_dense, self._set_dense = get_dense, set_dense
        self._log = log
        self.patience = max(int(patience), 1)  # what the epochs after the best add up to when a pass ends
        self.enabled = enabled  # for the whole job: off once copies keep costing more than their epochs
        self._slow_in_a_row = 0  # consecutive slow saves, across passes
        self.start_pass(None)

    def start_pass(self, directory: Path | None) -> None:
        """A pass begins; its copy (if one is taken) goes to ``directory``."""
        self.directory = Path(directory) if directory else None
        self.best_loss: float | None = None
        self.best_epoch: int | None = None
        self._best_lines: np.ndarray | None = None  # the best epoch's per-line held-out losses
        self._worse = 0.0  # epochs since the best: 1 each when worse beyond the noise, NOISY_EPOCH_WEIGHT within
        self._copy_epoch: int | None = None  # the epoch the copy holds, if it holds the best one
        self._dense: dict[str, np.ndarray] = {}
        self.restored_epoch: int | None = None
        self.copy_seconds = 0.0
        self.copies = 0

    def after_epoch(
        self, epoch: int, loss: float, *, more: bool, epoch_seconds: float, line_losses: np.ndarray | None = None
    ) -> bool:
        """Record ``epoch``'s held-out loss; True when the pass should end here.

        ``more``: another epoch is planned. A better epoch is copied when one follows. Epochs no better
        end the pass once they add up to ``patience``: 1 each when worse beyond the noise of
        ``line_losses`` (the per-line losses whose mean is ``loss``; without them every such epoch is),
        NOISY_EPOCH_WEIGHT within it; one beyond the noise ends it at once when there is no copy to go
        back to. A pass that ends on an epoch no better than the best puts the copy of the best back.
        """
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss, self.best_epoch, self._worse = loss, epoch, 0.0
            self._best_lines = None if line_losses is None else np.asarray(line_losses, np.float64)
            self._copy_epoch = None  # the copy, if any, is of an older epoch now
            if more and self.enabled and self.directory is not None:
                self._take_copy(epoch, epoch_seconds)
            return False
        can_restore = self._copy_epoch is not None
        clearly = self._clearly_worse(line_losses)
        self._worse += 1.0 if clearly else NOISY_EPOCH_WEIGHT
        if more and self._worse < self.patience and (can_restore or not clearly):
            if not clearly:
                self._log(
                    f"epoch {epoch}'s held-out log loss {loss:.5f} is no better than epoch {self.best_epoch}'s "
                    f"{self.best_loss:.5f}, within the noise of its {len(line_losses)} lines: going on"
                )
            return False  # the best one is kept (or the epoch is as good as it): try another
        if can_restore:
            t = time.monotonic()
            self._load_table(self.directory)
            self._set_dense(self._dense)
            self.restored_epoch = self._copy_epoch
            self._log(
                f"epoch {epoch}'s held-out log loss {loss:.5f} is no better than epoch {self._copy_epoch}'s "
                f"{self.best_loss:.5f}: restored epoch {self._copy_epoch}'s model ({time.monotonic() - t:.1f}s)"
            )
        return True

    def _clearly_worse(self, line_losses: np.ndarray | None) -> bool:
        """The paired mean difference to the best epoch's per-line losses is above the noise."""
        best = self._best_lines
        if line_losses is None or best is None or len(best) != len(line_losses) or len(best) < 2:
            return True
        diff = np.asarray(line_losses, np.float64) - best
        se = diff.std(ddof=1) / np.sqrt(len(diff))
        return bool(diff.mean() > WORSE_BY_STANDARD_ERRORS * se)

    def _take_copy(self, epoch: int, epoch_seconds: float) -> None:
        t = time.monotonic()
        shutil.rmtree(self.directory, ignore_errors=True)
        self._save_table(self.directory)
        self._dense = {k: v.copy() for k, v in self._get_dense().items()}
        self._copy_epoch = epoch
        seconds = time.monotonic() - t
        self.copy_seconds += seconds
        self.copies += 1
        slow = seconds > max(SLOW_COPY_FACTOR * epoch_seconds, MIN_COPY_SECONDS)
        self._slow_in_a_row = self._slow_in_a_row + 1 if slow else 0
        if not slow:
            return
        if self._slow_in_a_row < SLOW_COPIES_IN_A_ROW:
            self._log(
                f"copying the table took {seconds:.1f}s, more than {SLOW_COPY_FACTOR:g}x the epoch "
                f"({epoch_seconds:.1f}s); copies go off if the next one is as slow"
            )
            return
        self.enabled = False
        self._log(
            f"copying the table took {seconds:.1f}s, more than {SLOW_COPY_FACTOR:g}x the epoch "
            f"({epoch_seconds:.1f}s), {self._slow_in_a_row} copies in a row: no more copies of best epochs "
            "in this job (the early stop keeps the last epoch instead)"
        )

    def end_pass(self) -> None:
        """The pass is over: remove its copy."""
        if self.copies:
            self._log(
                f"best epoch {self.best_epoch} (held-out log loss {self.best_loss:.5f}); "
                f"{self.copies} copies of the table took {self.copy_seconds:.1f}s"
            )
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
        self._dense = {}
        self._copy_epoch = None
        self._best_lines = None
