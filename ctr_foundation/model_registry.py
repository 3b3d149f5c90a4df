"""MLflow model registry aliases of the pipeline's registered versions (MLflow 3 aliases, not stages).

Trainer 0 registers every pass as a version of ``elastic-ctr`` (tag ``pass``: the pass name) and points
``candidate`` at it; cube-transfer points ``champion`` at the version of the pass it has just made the active
cube version, the one serving answers with. An alias names one version at a time, so each move also
takes it off the previous version. ``models:/elastic-ctr@champion`` is then what serves.

cube-transfer loads neither MLflow nor the project's other packages (its image and memory stay small), so
this module talks to the tracking server's REST API with ``requests``, off the rollout's path: a slow or
unreachable MLflow never delays a rollout (``AliasSetter`` runs in its own thread, newest request first).
"""

from __future__ import annotations

import logging
import threading
import time

import requests

REGISTERED_MODEL = "elastic-ctr"
PASS_TAG = "pass"  # the version's pass name (training/tracking.py sets it)
CANDIDATE = "candidate"  # the newest registered version
CHAMPION = "champion"  # the version of the active cube version: what serving answers with
CHALLENGER = "challenger"  # the version an A/B split (a canary) serves beside the champion
ALIASES = (CANDIDATE, CHAMPION, CHALLENGER)
MODELS_SCHEME = "models:/"
log = logging.getLogger("ctr_foundation.model_registry")


class RegistryError(Exception):
    """The tracking server refused or did not answer."""


def is_server_uri(tracking_uri: str | None) -> bool:
    return bool(tracking_uri) and tracking_uri.startswith(("http://", "https://"))


def version_of_pass(
    tracking_uri: str, pass_name: str, *, model: str = REGISTERED_MODEL, timeout: float = 10.0
) -> str | None:
    """The newest registered version of ``model`` whose ``pass`` tag is ``pass_name``; None when there is none."""
    answer = _call(
        "GET",
        tracking_uri,
        "model-versions/search",
        params={"filter": f"name='{model}' and tag.{PASS_TAG}='{pass_name}'", "max_results": 100},
        timeout=timeout,
    )
    versions = [int(v["version"]) for v in answer.get("model_versions", [])]
    return str(max(versions)) if versions else None


def set_alias(
    tracking_uri: str, alias: str, version: str, *, model: str = REGISTERED_MODEL, timeout: float = 10.0
) -> None:
    _call(
        "POST",
        tracking_uri,
        "registered-models/alias",
        json={"name": model, "alias": alias, "version": str(version)},
        timeout=timeout,
    )


def alias_version(tracking_uri: str, alias: str, *, model: str = REGISTERED_MODEL, timeout: float = 10.0) -> str | None:
    """The version ``alias`` points at, None when it points nowhere."""
    try:
        answer = _call(
            "GET", tracking_uri, "registered-models/alias", params={"name": model, "alias": alias}, timeout=timeout
        )
    except RegistryError as e:
        if "RESOURCE_DOES_NOT_EXIST" in str(e) or "INVALID_PARAMETER_VALUE" in str(e):
            return None
        raise
    return str(answer["model_version"]["version"])


def is_model_uri(text: str | None) -> bool:
    return bool(text) and text.startswith(MODELS_SCHEME)


def pass_of_model_uri(tracking_uri: str | None, uri: str, *, timeout: float = 10.0) -> str:
    """The pass name (the ``pass`` tag) of ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``."""
    rest = uri[len(MODELS_SCHEME) :]
    name, at, alias = rest.partition("@")
    if not at:
        name, slash, alias = rest.rpartition("/")
        if not slash or not alias.isdigit():
            raise RegistryError(f"{uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    if not name or not alias:
        raise RegistryError(f"{uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    if not is_server_uri(tracking_uri):
        raise RegistryError(f"{uri} needs an MLflow tracking server (set MLFLOW_TRACKING_URI to http[s]://...)")
    if at:
        answer = _call(
            "GET", tracking_uri, "registered-models/alias", params={"name": name, "alias": alias}, timeout=timeout
        )
    else:
        answer = _call(
            "GET", tracking_uri, "model-versions/get", params={"name": name, "version": alias}, timeout=timeout
        )
    mv = answer.get("model_version") or {}
    tags = {t.get("key"): t.get("value") for t in mv.get("tags") or []}
    if not tags.get(PASS_TAG):
        raise RegistryError(f"{uri} is version {mv.get('version')} of {name}, which has no {PASS_TAG} tag")
    return tags[PASS_TAG]


def _call(method: str, tracking_uri: str, path: str, *, timeout: float, **kwargs) -> dict:
    url = f"{tracking_uri.rstrip('/')}/api/2.0/mlflow/{path}"
    try:
        r = requests.request(method, url, timeout=timeout, **kwargs)
    except requests.RequestException as e:
        raise RegistryError(f"MLflow at {tracking_uri} is unreachable: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        try:
            body = r.json()
            reason = f"{body.get('error_code', '')}: {body.get('message', '')}"
        except ValueError:
            reason = r.text.strip()[:300]
        raise RegistryError(f"MLflow at {tracking_uri} answered HTTP {r.status_code} to {path}: {reason}")
    return r.json() if r.content else {}


class AliasSetter:
    """Points an alias at the version of a pass, in a thread of its own; the newest request wins.

    The pass may not be registered yet when it is asked for (trainer 0 registers a pass after writing it,
    and cube-transfer may be quicker): the version is looked up again, backing off, for ``patience``
    seconds. ``wait`` blocks until the queue is done (for --once runs and tests).
    """

    def __init__(self, tracking_uri: str, alias: str, *, patience: float = 600.0, poll: float = 2.0):
        self.tracking_uri, self.alias = tracking_uri, alias
        self.patience, self.poll = patience, poll
        self.last: dict | None = None  # {"pass", "version", "at"} of the last alias set
        self.last_error: str | None = None
        self._wanted: str | None = None
        self._cond = threading.Condition()
        self._busy = False
        threading.Thread(target=self._run, name=f"mlflow-alias-{alias}", daemon=True).start()

    def point_at(self, pass_name: str) -> None:
        with self._cond:
            self._wanted = pass_name
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._wanted is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._wanted is None:
                    self._cond.wait()
                pass_name, self._wanted, self._busy = self._wanted, None, True
            try:
                self._point(pass_name)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _point(self, pass_name: str) -> None:
        deadline, delay = time.monotonic() + self.patience, self.poll
        while True:
            if self._wanted is not None:  # a newer pass was asked for meanwhile: it wins
                return
            try:
                version = version_of_pass(self.tracking_uri, pass_name)
                if version is not None:
                    set_alias(self.tracking_uri, self.alias, version)
                    self.last, self.last_error = {"pass": pass_name, "version": version, "at": time.time()}, None
                    log.info("MLflow: %s@%s -> version %s (%s)", REGISTERED_MODEL, self.alias, version, pass_name)
                    return
                reason = f"no registered version of {REGISTERED_MODEL} has tag {PASS_TAG}={pass_name} yet"
            except RegistryError as e:
                reason = str(e)
            if time.monotonic() + delay > deadline:
                self.last_error = f"{self.alias} not set on {pass_name}: {reason}"
                log.warning("MLflow: %s (gave up after %.0fs)", self.last_error, self.patience)
                return
            time.sleep(delay)
            delay = min(delay * 2, 30.0)
