"""Synthetic click logs from a planted model, so the best achievable AUC is known.

Each slot draws feasigns from its own Zipf-distributed vocabulary (feasigns
are 64-bit hashes, so half are above 2**63); every feasign has a weight, and
clicks are drawn from the true probability sigmoid(bias + weights +
interactions). Beside every ``part-N`` the generator writes ``truth-N`` with
each line's true probability, so the Bayes-optimal AUC of any split is
``auc(true_prob, click)``. Everything is deterministic for a given seed.

Two planted models:

- ``interactions=0``, the original one: a few slot pairs interact through
  low-rank factors. Why its defaults (measured on 6 slots, 100k training
  lines, 25k held out): the earlier ones (interaction factors N(0, 0.8),
  weight scale 0.5, vocab 500) put most of the signal in three rank-2
  cross-slot products; a scikit-learn logistic regression on one-hot
  feasigns then reached 0.731 against a Bayes-optimal 0.858, and one with
  every slot-pair cross feature only 0.820, so no model could come within
  0.03 of Bayes at the sizes the tests use. With interaction factors
  N(0, 0.4), weight scale 0.7 and 50 feasigns per slot, one-hot logistic
  regression gets within ~0.02 of Bayes. The weights' scale is per slot, so
  many slots make the data nearly separable (26 slots: Bayes 0.92, logistic
  regression 0.006 below it).
- ``interactions=STRENGTH > 0``, the interaction model, where a deep model
  beats logistic regression: the same weights rescaled so the first-order
  logit has standard deviation ``MAIN_STD`` whatever the number of slots,
  plus a factorisation-machine term, sum over pairs of ``FM_SLOTS`` slots of
  <v_a, v_b> (v the planted embeddings of the line's feasigns), scaled to
  standard deviation STRENGTH, and the bias set for a 0.2 CTR. The embeddings
  are centred so the term has no first-order part logistic regression could
  pick up. Measured (4 hours x 25k lines, hours 0-2 trained, hour 3 scored,
  seed 7) at STRENGTH 0.7: on 26 slots Bayes 0.829, logistic regression
  0.783, DeepFM (Adam 0.001, no L2, embedding 11, 256x256, hourly passes)
  0.817; on 8 slots Bayes 0.821, logistic regression 0.780, DeepFM 0.815.
  What it took to be learnable from ~75k lines: with 50 feasigns per slot,
  rank-4 embeddings on every slot pair, that DeepFM overfitted in its first
  epochs and stayed at logistic regression's AUC (0.71 against Bayes 0.79);
  fewer feasigns (10), rank 1 and 6 interacting slots brought it within
  0.012 of Bayes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctr_foundation.atomic import atomic_write_text
from elastic_control.data.hourly_writer import hour_dir, hour_slots, split_hour, write_folder
from elastic_control.metrics import auc as auc_of

TRUTH_PREFIX = "truth-"
# How many features a slot has in one line: usually one, sometimes none or two.
FEATURES_PER_SLOT = (0, 1, 2)
FEATURES_PER_SLOT_P = (0.08, 0.84, 0.08)


def stable_feasign(*parts) -> int:
    """A stable unsigned 64-bit hash of ``parts`` (same value on every machine and run)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class PlantedModel:
    slots: tuple[int, ...]
    feasigns: tuple[np.ndarray, ...]  # per slot: uint64[vocab]
    popularity: tuple[np.ndarray, ...]  # per slot: Zipf probabilities over the vocabulary
    weights: tuple[np.ndarray, ...]  # per slot: float64[vocab]
    interactions: tuple[tuple[int, int, np.ndarray, np.ndarray], ...]  # (slot pos a, slot pos b, U_a, V_b)
    bias: float
    # The factorisation-machine term: per slot float64[vocab, rank] (empty without --interactions), and the
    # factor that gives the term the requested standard deviation.
    embeddings: tuple[np.ndarray, ...] = ()
    fm_scale: float = 0.0


DEFAULT_VOCAB = 50  # feasigns per slot; see the module docstring for why not more
# The interaction model (any --interactions > 0); the module docstring says why these values.
DEFAULT_INTERACTIONS = 0.7  # `data synth` and the demo
MAIN_STD = 1.3  # logit standard deviation of the first-order part
FM_RANK = 1
FM_SLOTS = 6  # slots with planted embeddings; every pair of them interacts
INTERACTION_VOCAB = 10  # feasigns per slot


def default_vocab(interactions: float) -> int:
    """Feasigns per slot when none is asked for: the interaction model's or the original model's."""
    return INTERACTION_VOCAB if interactions > 0 else DEFAULT_VOCAB


_CALIBRATION_LINES = 20_000


def build_planted_model(
    slots: Sequence[int],
    seed: int,
    *,
    vocab: int | None = None,
    zipf: float = 1.1,
    weight_scale: float = 0.7,
    cross_pairs: int = 3,
    cross_rank: int = 2,
    cross_scale: float = 0.4,
    base_ctr: float = 0.2,
    interactions: float = 0.0,
    main_std: float = MAIN_STD,
    fm_rank: int = FM_RANK,
    fm_slots: int = FM_SLOTS,
) -> PlantedModel:
    """The ground truth for ``slots``; deterministic in ``seed``.

    ``interactions`` 0 is the original model (first-order weights of ``weight_scale`` per slot plus
    ``cross_pairs`` low-rank products). ``interactions`` > 0 is the interaction model: the same weights
    rescaled so the first-order part has logit standard deviation ``main_std`` whatever the number of
    slots, plus a factorisation-machine term over every pair of slots with standard deviation
    ``interactions``, and the bias set so the mean CTR is ``base_ctr``.
    """
    rng = np.random.default_rng([seed, 1])
    slots = tuple(slots)
    vocab = vocab or default_vocab(interactions)
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    pop = ranks**-zipf
    pop /= pop.sum()
    feas = tuple(np.array([stable_feasign("synth", seed, s, i) for i in range(vocab)], dtype=np.uint64) for s in slots)
    # Some slots matter more than others, as in real logs.
    scales = weight_scale * rng.uniform(0.3, 1.5, size=len(slots))
    weights = tuple(rng.normal(0.0, sc, size=vocab) for sc in scales)
    bias = float(np.log(base_ctr / (1 - base_ctr)))
    if interactions > 0:
        return _interaction_model(
            PlantedModel(slots, feas, (pop,) * len(slots), weights, (), bias),
            seed,
            strength=interactions,
            main_std=main_std,
            rank=fm_rank,
            n_slots=fm_slots,
            base_ctr=base_ctr,
        )
    pairs = []
    if len(slots) >= 2:
        for _ in range(cross_pairs):
            a, b = rng.choice(len(slots), size=2, replace=False)
            pairs.append(
                (
                    int(a),
                    int(b),
                    rng.normal(0, cross_scale, size=(vocab, cross_rank)),
                    rng.normal(0, cross_scale, size=(vocab, cross_rank)),
                )
            )
    return PlantedModel(slots, feas, (pop,) * len(slots), weights, tuple(pairs), bias)


def _interaction_model(
    base: PlantedModel, seed: int, *, strength: float, main_std: float, rank: int, n_slots: int, base_ctr: float
) -> PlantedModel:
    """``base``'s weights rescaled, plus planted embeddings whose pairwise inner products are the interactions.

    Each slot's embeddings are centred on their popularity-weighted mean, so the interaction term has
    (nearly) no first-order part: no per-feasign weight, which is all logistic regression can learn,
    explains any of it. The scales are measured on a calibration sample from its own random stream
    (the lines themselves are drawn as before, so a seed's lines only change through the model).
    """
    rng = np.random.default_rng([seed, 3])
    emb_scales = rng.uniform(0.3, 1.5, size=len(base.slots))  # some slot pairs interact more than others
    interacting = set(rng.choice(len(base.slots), size=min(n_slots, len(base.slots)), replace=False).tolist())
    embeddings = []
    for j, (pop, w, sc) in enumerate(zip(base.popularity, base.weights, emb_scales, strict=True)):
        e = rng.normal(0.0, sc, size=(len(w), rank)) if j in interacting else np.zeros((len(w), rank))
        embeddings.append(e - pop @ e)
    model = dataclasses.replace(base, embeddings=tuple(embeddings), fm_scale=1.0, bias=0.0)
    first, pairwise = _logit_parts(model, _CALIBRATION_LINES, np.random.default_rng([seed, 4]))[:2]
    w_factor = main_std / max(float(first.std()), 1e-12)
    fm_scale = strength / max(float(pairwise.std()), 1e-12)
    logit = w_factor * first + fm_scale * pairwise
    return dataclasses.replace(
        model,
        weights=tuple(w * w_factor for w in base.weights),
        fm_scale=fm_scale,
        bias=_bias_for_ctr(logit, base_ctr),
    )


def _bias_for_ctr(logit: np.ndarray, ctr: float) -> float:
    """The bias b with mean(sigmoid(b + logit)) = ctr (bisection: the mean is increasing in b)."""
    lo, hi = -30.0, 30.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(mid + logit)))) < ctr:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _logit_parts(model: PlantedModel, n: int, rng: np.random.Generator):
    """(bias + first-order + low-rank cross part, factorisation-machine part before ``fm_scale``, chosen
    feasigns per slot) of ``n`` drawn lines; the feasigns are (line index, vocabulary index) pairs."""
    first = np.full(n, model.bias)
    chosen = []
    for j in range(len(model.slots)):
        counts = rng.choice(FEATURES_PER_SLOT, size=n, p=FEATURES_PER_SLOT_P)
        line_of = np.repeat(np.arange(n), counts)
        idx = rng.choice(len(model.weights[j]), size=len(line_of), p=model.popularity[j])
        np.add.at(first, line_of, model.weights[j][idx])
        chosen.append((line_of, idx))
    for a, b, u, v in model.interactions:
        ua = np.zeros((n, u.shape[1]))
        vb = np.zeros((n, v.shape[1]))
        np.add.at(ua, chosen[a][0], u[chosen[a][1]])
        np.add.at(vb, chosen[b][0], v[chosen[b][1]])
        first += (ua * vb).sum(axis=1)
    pairwise = np.zeros(n)
    if model.embeddings:
        # sum over slot pairs a < b of <E_a, E_b>, E_s the sum of slot s's embeddings in the line:
        # (|sum_s E_s|^2 - sum_s |E_s|^2) / 2, which leaves out pairs within one slot.
        total = np.zeros((n, model.embeddings[0].shape[1]))
        squares = np.zeros(n)
        for (line_of, idx), e in zip(chosen, model.embeddings, strict=True):
            per_slot = np.zeros_like(total)
            np.add.at(per_slot, line_of, e[idx])
            total += per_slot
            squares += (per_slot**2).sum(axis=1)
        pairwise = 0.5 * ((total**2).sum(axis=1) - squares)
    return first, pairwise, chosen


def sample_lines(model: PlantedModel, n: int, rng: np.random.Generator) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``n`` slot-format lines, their true click probabilities and the drawn clicks."""
    first, pairwise, chosen = _logit_parts(model, n, rng)
    logit = first + model.fm_scale * pairwise
    tokens: list[list[str]] = [[] for _ in range(n)]
    for j, slot in enumerate(model.slots):
        line_of, idx = chosen[j]
        for line, f in zip(line_of.tolist(), model.feasigns[j][idx].tolist(), strict=True):
            tokens[line].append(f"{f}:{slot}")
    prob = 1.0 / (1.0 + np.exp(-logit))
    clicks = (rng.random(n) < prob).astype(np.int64)
    lines = [f"1 {c} " + " ".join(t) if t else f"1 {c}" for c, t in zip(clicks.tolist(), tokens, strict=True)]
    return lines, prob, clicks


def generate(
    output: str | Path,
    *,
    slots: Sequence[int],
    hours: int,
    lines_per_hour: int,
    seed: int,
    start: dt.datetime,
    parts: int = 2,
    compress: bool = False,
    progress: Callable[[int], None] | None = None,
    minutes: int | None = None,
    drift: float = 0.0,
    **model_options,
) -> dict:
    """Write ``hours`` hours of synthetic data under ``output``; return a summary with the Bayes-optimal AUC.

    ``minutes`` (PASS_MINUTES) spreads each hour over sub-hour folders ``YYYYMMDD/HHMM``. ``drift`` makes
    the vocabulary move (what feature eviction is for): every slot (hour, or sub-hour slot) the Zipf
    popularity ranks shift by ``drift`` feasigns along a stream of feasigns, ``vocab`` of them live at a
    time: fresh feasigns enter at the tail and become frequent, and the head's feasigns retire (never seen
    again), so the set of feasigns ever seen keeps growing as in live click logs.
    """
    window = int(model_options.get("vocab") or default_vocab(model_options.get("interactions", 0.0)))
    if drift:  # room for every feasign that enters the window during the run
        total_slots = hours * len(hour_slots(start, minutes))
        model_options = {**model_options, "vocab": window + int(np.ceil(total_slots * drift)) + 1}
    model = build_planted_model(slots, seed, **model_options)
    all_prob, all_click = [], []
    index = 0
    for h in range(hours):
        hour = start + dt.timedelta(hours=h)
        rng = np.random.default_rng([seed, 2, h])
        starts = hour_slots(hour, minutes)
        if drift:
            chunks = []
            for i in range(len(starts)):
                moved = _drifted(model, int((index + i) * drift), window)
                n = len(split_hour(list(range(lines_per_hour)), minutes)[i])
                chunks.append(sample_lines(moved, n, rng))
            lines = [ln for c in chunks for ln in c[0]]
            prob = np.concatenate([c[1] for c in chunks])
            clicks = np.concatenate([c[2] for c in chunks])
        else:
            lines, prob, clicks = sample_lines(model, lines_per_hour, rng)
        offset = 0
        for slot, chunk in zip(starts, split_hour(lines, minutes), strict=True):
            folder = hour_dir(output, slot, minutes)
            folder.mkdir(parents=True, exist_ok=True)
            p_chunk = prob[offset : offset + len(chunk)]
            offset += len(chunk)
            # Truth files first: the folder's donefile (written by write_folder) seals everything.
            for i in range(parts):
                atomic_write_text(folder / f"{TRUTH_PREFIX}{i:05d}", "".join(f"{p:.9f}\n" for p in p_chunk[i::parts]))
            write_folder(folder, chunk, parts=parts, compress=compress)
        index += len(starts)
        all_prob.append(prob)
        all_click.append(clicks)
        if progress:
            progress(1)
    prob, clicks = np.concatenate(all_prob), np.concatenate(all_click)
    return {
        "hours": hours,
        "lines": int(len(prob)),
        "ctr": float(clicks.mean()),
        "bayes_auc": float(auc_of(clicks, prob)),
        "interactions": float(model_options.get("interactions", 0.0)),
        "start": f"{start:%Y%m%d/%H}",
    }


def _drifted(model: PlantedModel, shift: int, window: int) -> PlantedModel:
    """The planted model with ``window`` live feasigns per slot starting at ``shift``: rank r is feasign
    ``shift + r`` (Zipf over the window); feasigns before ``shift`` have retired, those after it are unborn."""
    popularity = []
    for p in model.popularity:
        z = p[:window] / p[:window].sum()  # p is Zipf over ranks: its first entries are Zipf over the window
        moved = np.zeros_like(p)
        moved[shift : shift + window] = z
        popularity.append(moved)
    return dataclasses.replace(model, popularity=tuple(popularity))


def read_truth(hour_folder: str | Path) -> tuple[list[str], np.ndarray]:
    """(lines, true probabilities) of one generated hour, aligned, in part order."""
    folder = Path(hour_folder)
    lines: list[str] = []
    probs: list[float] = []
    for part in sorted(folder.glob("part-*")):
        import gzip

        opener = gzip.open if part.name.endswith(".gz") else open
        with opener(part, "rt", encoding="utf-8") as f:
            lines.extend(ln.rstrip("\n") for ln in f if ln.strip())
        suffix = part.name[len("part-") :].removesuffix(".gz")
        probs.extend(float(x) for x in (folder / f"{TRUTH_PREFIX}{suffix}").read_text().split())
    if len(lines) != len(probs):
        raise ValueError(f"{folder}: {len(lines)} lines but {len(probs)} true probabilities")
    return lines, np.array(probs)
