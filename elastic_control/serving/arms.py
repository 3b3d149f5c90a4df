"""A/B traffic splits: arms with weights, and the stable hash that routes a request to one.

An arm is a name, a weight and a version: the arm without a version ("control" by default) serves
the active version (cube/current.json, followed as it changes); every other arm is a challenger
pinned to one cube version (a pass). A request's ``routing_key`` (e.g. a user id) picks its arm by a
stable hash: the first 8 bytes of BLAKE2b of the key, as a fraction of 2**64, falls into the arms'
cumulative weight ranges (challengers last, so shrinking them moves the fewest keys). The same key
always gets the same arm while the weights are unchanged, in every serving process. Requests
without a key are split at random with the same weights.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

CONTROL = "control"
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}", re.ASCII)
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)


class SplitError(ValueError):
    """A split that cannot be used; the message names the problem (-> HTTP 400 / exit 2)."""


@dataclass(frozen=True)
class Arm:
    name: str
    weight: float
    version: str | None  # None: the active version

    def to_json(self) -> dict:
        return {"name": self.name, "weight": self.weight, "version": self.version}


def route_point(routing_key: str) -> float:
    """The key's stable point in [0, 1)."""
    digest = hashlib.blake2b(routing_key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(frozen=True)
class Split:
    arms: tuple[Arm, ...]
    generation: int = 0

    def __post_init__(self):
        # challengers after the control arm: their ranges sit at the top of [0, 1)
        bounds, acc = [], 0.0
        total = sum(a.weight for a in self.arms)
        for a in self.arms:
            acc += a.weight / total
            bounds.append(acc)
        bounds[-1] = 1.0
        object.__setattr__(self, "_bounds", tuple(bounds))
        object.__setattr__(self, "_by_name", {a.name: a for a in self.arms})

    @classmethod
    def single(cls, generation: int = 0) -> Split:
        return cls((Arm(CONTROL, 1.0, None),), generation)

    @property
    def control(self) -> Arm:
        return next(a for a in self.arms if a.version is None)

    @property
    def challengers(self) -> list[Arm]:
        return [a for a in self.arms if a.version is not None]

    def arm(self, name: str) -> Arm | None:
        return self._by_name.get(name)

    def pick(self, routing_key: str | None, forced: str | None = None) -> Arm:
        """The arm of a request: the forced one if it exists, else by the key's hash (random without a key)."""
        if forced is not None:
            arm = self._by_name.get(forced)
            if arm is not None:
                return arm
        if len(self.arms) == 1:
            return self.arms[0]
        x = route_point(routing_key) if routing_key is not None else random.random()
        for arm, bound in zip(self.arms, self._bounds, strict=True):
            if x < bound:
                return arm
        return self.arms[-1]

    def weights(self) -> dict[str, float]:
        total = sum(a.weight for a in self.arms)
        return {a.name: a.weight / total for a in self.arms}

    def to_json(self) -> dict:
        return {"arms": [a.to_json() for a in self.arms], "generation": self.generation, "weights": self.weights()}


def make_split(arms: Sequence[Arm], generation: int = 0) -> Split:
    """Check arms (one control arm without a version, unique names and versions, weights >= 0, sum > 0)."""
    if not arms:
        raise SplitError("a split needs at least one arm")
    names = [a.name for a in arms]
    for a in arms:
        if not _NAME.fullmatch(a.name):
            raise SplitError(f"arm name {a.name!r}: use [a-z0-9_-], at most 32 characters")
        if a.version is not None and not _VERSION.fullmatch(a.version):
            raise SplitError(f"arm {a.name}: version {a.version!r} is not a version name (e.g. pass-20200101-05)")
        if not (isinstance(a.weight, (int, float)) and not isinstance(a.weight, bool) and 0 <= a.weight < 1e9):
            raise SplitError(f"arm {a.name}: weight {a.weight!r} must be a number >= 0")
    if len(set(names)) != len(names):
        raise SplitError(f"arm names must be unique, got {names}")
    controls = [a for a in arms if a.version is None]
    if len(controls) != 1:
        raise SplitError(
            'exactly one arm must follow the active version (no "version"); '
            f"got {len(controls)}: {[a.name for a in controls]}"
        )
    versions = [a.version for a in arms if a.version is not None]
    if len(set(versions)) != len(versions):
        raise SplitError(f"two arms pin the same version: {versions}")
    if sum(a.weight for a in arms) <= 0:
        raise SplitError("the weights add up to 0: no arm would get traffic")
    ordered = controls + [a for a in arms if a.version is not None]
    return Split(tuple(Arm(a.name, float(a.weight), a.version) for a in ordered), generation)


def split_from_json(obj: object, generation: int) -> Split:
    """``{"arms": [{"name", "weight", "version"?}, ...]}`` -> Split."""
    if not isinstance(obj, dict) or not isinstance(obj.get("arms"), list):
        raise SplitError('the body must be {"arms": [{"name": ..., "weight": ..., "version": ...}, ...]}')
    arms = []
    for i, a in enumerate(obj["arms"]):
        if not isinstance(a, dict) or not isinstance(a.get("name"), str) or "weight" not in a:
            raise SplitError(f'arm {i}: expected {{"name": str, "weight": number, "version": str (challengers)}}')
        version = a.get("version")
        if version is not None and not isinstance(version, str):
            raise SplitError(f"arm {a['name']}: version must be a string")
        arms.append(Arm(a["name"], a["weight"], version or None))
    return make_split(arms, generation)


MODELS_SCHEME = "models:/"
DEFAULT_MODEL_ARM_PERCENT = 10.0


def split_from_flag(text: str | None, generation: int = 0, resolve: Callable[[str], str] | None = None) -> Split:
    """``--split 'challenger=pass-20200101-05:10[,other=VERSION:W]'``: challengers' weights in percent.

    The control arm gets the rest (100 - their sum); ``control:W`` sets it explicitly instead. A VERSION
    may be an MLflow model URI (``models:/NAME@ALIAS`` or ``models:/NAME/N``), which ``resolve`` turns into
    the version's pass; an arm may also be just ``models:/NAME@ALIAS[:PERCENT]``: the arm is named after the
    alias (e.g. ``challenger``) and takes PERCENT (default 10) of the traffic.
    """
    if not text or not text.strip():
        return Split.single(generation)
    arms, control_weight = [], None
    for part in text.split(","):
        part = part.strip()
        if part.startswith(MODELS_SCHEME):
            uri, colon, w = part.rpartition(":")
            if not colon or not uri.startswith(MODELS_SCHEME) or uri == MODELS_SCHEME.rstrip("/"):
                uri, w = part, ""
            alias = uri.rpartition("@")[2] if "@" in uri else "challenger"
            part = f"{alias}={uri}:{w or format(DEFAULT_MODEL_ARM_PERCENT, 'g')}"
        name, eq, rest = part.partition("=")
        if not eq:
            cname, colon, w = part.partition(":")
            if colon and cname == CONTROL:
                control_weight = _weight(w, part)
                continue
            raise SplitError(f"split arm {part!r}: expected NAME=VERSION:WEIGHT (e.g. challenger=pass-20200101-05:10)")
        version, colon, w = rest.rpartition(":")
        if not colon or not version:
            raise SplitError(f"split arm {part!r}: expected NAME=VERSION:WEIGHT")
        version = version.strip()
        if version.startswith(MODELS_SCHEME):
            if resolve is None:
                raise SplitError(f"split arm {part!r}: a models:/ URI needs an MLflow tracking server to resolve it")
            try:
                version = resolve(version)
            except Exception as e:  # noqa: BLE001 - the registry's reason, as a usage error
                raise SplitError(f"split arm {part!r}: {e}") from e
        arms.append(Arm(name.strip(), _weight(w, part), version))
    challengers = sum(a.weight for a in arms)
    if control_weight is None:
        if challengers > 100:
            raise SplitError(f"the challengers' weights add up to {challengers:g}% (> 100%)")
        control_weight = 100.0 - challengers
    return make_split([Arm(CONTROL, control_weight, None), *arms], generation)


def _weight(text: str, part: str) -> float:
    try:
        w = float(text)
    except ValueError:
        raise SplitError(f"split arm {part!r}: weight {text!r} is not a number") from None
    if not 0 <= w <= 100:
        raise SplitError(f"split arm {part!r}: weight {w:g} must be in 0..100 (percent)")
    return w
