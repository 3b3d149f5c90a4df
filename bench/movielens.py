"""MovieLens 100K as hourly click logs: a public log with user-item interactions, for the training benchmark.

The ratings are GroupLens's MovieLens 100K (F. Maxwell Harper and Joseph A. Konstan, "The MovieLens Datasets:
History and Context", ACM TiiS 5(4), 2015; https://grouplens.org/datasets/movielens/100k/), in the atomic
files that the `recbole` wheel on PyPI bundles (`recbole/dataset_example/ml-100k/`): the registry is the one
place these machines can download from. Nothing of it is stored in the project: the wheel is fetched with
pip into a cache folder the first time.

As click logs, as CTR papers use MovieLens: a rating of 4 or 5 is a click (55% of ratings), any other rating
a shown, unclicked item. The 100,000 ratings, in an order drawn with seed 1 (the ratings' own time order puts
users the model has never seen in the last hour), are five hours of 20,000 lines: four to train, the fifth to
score. Ten slots: 1 user, 2 movie, 3 age (decade), 4 gender, 5 occupation, 6 zip code's first two digits,
7 release year's first three digits (the decade), 8 genres (one feasign each, several a line), 9 weekday and
10 hour of the rating.
"""

from __future__ import annotations

import datetime as dt
import random
import subprocess
import sys
import zipfile
from pathlib import Path

from elastic_control.data.hourly_writer import write_hour

WHEEL = "recbole==1.2.0"
FOLDER = "recbole/dataset_example/ml-100k/"
HOURS = 5
SLOTS = tuple(range(1, 11))
CACHE = Path.home() / ".cache" / "elastic-ctr-bench"


def ratings_folder(cache: Path = CACHE) -> Path:
    """The ml-100k atomic files, extracted from the recbole wheel (downloaded by pip once, then cached)."""
    target = cache / "ml-100k"
    if (target / "ml-100k.inter").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("recbole-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(cache), WHEEL], check=True
        )
        wheels = sorted(cache.glob("recbole-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as wheel:
        for name in ("ml-100k.inter", "ml-100k.user", "ml-100k.item"):
            (cache / "part").mkdir(exist_ok=True)
            (cache / "part" / name).write_bytes(wheel.read(FOLDER + name))
    (cache / "part").rename(target)  # whole or absent: a run killed mid-extraction extracts again
    return target


def _rows(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text(encoding="latin-1").splitlines()[1:] if line]


def write_hours(out: Path, start: dt.datetime, *, seed: int = 1, cache: Path = CACHE) -> Path:
    """The five hours from ``start``, written as `data` writes hours (part files, then the donefile)."""
    source = ratings_folder(cache)
    users = {r[0]: r for r in _rows(source / "ml-100k.user")}
    movies = {r[0]: r for r in _rows(source / "ml-100k.item")}
    ratings = _rows(source / "ml-100k.inter")
    random.Random(seed).shuffle(ratings)
    feasigns: dict[tuple[int, str], int] = {}

    def token(slot: int, value: str) -> str:
        return f"{feasigns.setdefault((slot, value), len(feasigns) + 1)}:{slot}"

    per_hour = len(ratings) // HOURS
    for h in range(HOURS):
        lines = []
        for user, movie, rating, stamp in ratings[h * per_hour : (h + 1) * per_hour]:
            u, m = users[user], movies[movie]
            when = dt.datetime.fromtimestamp(float(stamp), dt.timezone.utc)
            tokens = [token(1, user), token(2, movie), token(3, str(int(u[1]) // 10)), token(4, u[2])]
            tokens += [token(5, u[3]), token(6, u[4][:2]), token(7, m[2][:3] if len(m) > 2 else "?")]
            tokens += [token(8, g) for g in (m[3].split() if len(m) > 3 else [])] or [token(8, "none")]
            tokens += [token(9, str(when.weekday())), token(10, str(when.hour))]
            lines.append(f"1 {int(float(rating) >= 4)} " + " ".join(tokens))
        write_hour(out, start + dt.timedelta(hours=h), lines)
    return out
