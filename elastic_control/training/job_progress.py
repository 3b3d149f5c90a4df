"""Trainer 0 in a pod of the Volcano job publishes its pass's progress as the job's annotation.

MODEL_PATH/.progress.json sits on the shared claim, which the operator's machine cannot read; the annotation
``elastic-ctr/progress`` (the same document, as JSON) is what `status` on the Kubernetes backend shows, and what
`kubectl get vcjob JOB -o yaml` shows too. The trainers' pods carry the token of the account
JOB-training-progress, whose Role may get and patch that one job and nothing else (templates/training_job.yaml.j2).

The pod finds its job from its host name, JOB-trainer-INDEX: Volcano names the job's pods JOB-TASK-INDEX and
its svc plugin makes that the host name (the Paddle endpoint lists rely on the same names); its namespace
from the service-account mount. Outside such a pod (locally, the pod harness: no token) nothing is published.

Beside the pass in progress the document lists the job's complete passes (``passes``: each one's name, the
end of its window and its held-out log loss, the last MAX_PASSES of the donefile): `tune` with a Kubernetes
plan follows a candidate's job through it and prunes the candidate on those losses (tuning/kube_worker.py),
since the donefile itself is on the claim.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from pathlib import Path

from ctr_foundation import env_vars as ev
from ctr_foundation.errors import ClusterUnavailableError
from elastic_control.kube.constants import (
    PROGRESS_ANNOTATION,
    VOLCANO_JOB_GROUP,
    VOLCANO_JOB_PLURAL,
    VOLCANO_JOB_VERSION,
)

ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Often enough for people watching `status`, rare enough that a hundred jobs do not load the API server.
PATCH_EVERY = 15.0
# After a failed patch (API server away, Role missing): training goes on, the next try waits this long.
QUIET_AFTER_FAILURE = 60.0
MERGE_PATCH = "application/merge-patch+json"
# Complete passes the annotation lists (about 80 bytes each): a search's pruner needs the first few, people
# the last; Kubernetes caps all of an object's annotations at 256 KiB together.
MAX_PASSES = 48


def job_of_host(hostname: str) -> str | None:
    m = re.fullmatch(r"(.+)-trainer-\d+", hostname)
    return m.group(1) if m else None


class JobProgressAnnotator:
    """Called with PassProgress's document; patches it onto the job at most every ``every`` seconds."""

    def __init__(self, api, namespace: str, job: str, *, every: float = PATCH_EVERY):
        self.api, self.namespace, self.job, self.every = api, namespace, job, every
        self._sent = float("-inf")
        self._quiet_until = float("-inf")
        self.passes: list[dict] = []
        self._last: dict | None = None

    @classmethod
    def in_pod(cls, hostname: str | None = None, account_dir: Path = ACCOUNT_DIR) -> JobProgressAnnotator | None:
        """The annotator of this pod's job; None outside a trainer pod that carries a token."""
        job = job_of_host(hostname or socket.gethostname())
        if job is None or not ev.KUBERNETES_SERVICE_HOST.get() or not (account_dir / "token").is_file():
            return None
        # function-level: the kubernetes client (about a second of imports), in a trainer pod only
        from elastic_control.kube.adaptor import custom

        namespace = (account_dir / "namespace").read_text().strip()
        try:
            api = custom()  # the project's one client: in-cluster here (KUBERNETES_SERVICE_HOST)
        except ClusterUnavailableError as e:  # progress is for people: training goes on without it
            print(f"no progress annotation on job {namespace}/{job}: {e}", file=sys.stderr, flush=True)
            return None
        return cls(api, namespace, job)

    def passes_done(self, entries) -> None:
        """The donefile's complete passes (DonefileEntry); sent at once with the last progress document."""
        self.passes = [e.summary() for e in list(entries)[-MAX_PASSES:]]
        if self._last is not None:
            self(self._last, force=True)

    def __call__(self, doc: dict, *, force: bool = False) -> None:
        self._last = doc
        now = time.monotonic()
        if now < self._quiet_until or (not force and now - self._sent < self.every):
            return
        self._sent = now
        doc = {**doc, "passes": self.passes} if self.passes else doc
        body = {"metadata": {"annotations": {PROGRESS_ANNOTATION: json.dumps(doc, sort_keys=True)}}}
        try:
            self.api.patch_namespaced_custom_object(
                VOLCANO_JOB_GROUP,
                VOLCANO_JOB_VERSION,
                self.namespace,
                VOLCANO_JOB_PLURAL,
                self.job,
                body,
                _content_type=MERGE_PATCH,
                _request_timeout=5,
            )
        except Exception as e:  # noqa: BLE001 -- progress is for people: never fail a pass over it
            self._quiet_until = now + QUIET_AFTER_FAILURE
            reason = getattr(e, "reason", None) or type(e).__name__
            print(
                f"progress annotation on job {self.namespace}/{self.job} not written ({reason}); "
                f"trying again in {QUIET_AFTER_FAILURE:.0f}s",
                file=sys.stderr,
                flush=True,
            )
