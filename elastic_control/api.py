"""The verbs of elastic-control, as keyword-only library functions.

The CLI (elastic_control/cli/) only parses flags and calls these; a Python
user can call them directly::

    from elastic_control import api
    plan = api.configure_resource(resources=Resources(trainers=2), slot_conf="slot.conf", data_config="data.config")
    pipeline = api.apply(state_dir=plan.state_dir)      # a Deployment handle, components up
    pipeline.status().serving["version"]                 # the status document, probed now
    pipeline.stream_logs(components=["trainer-0"])
    pipeline.delete()

``attach`` gives the same handle from another process.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ctr_foundation.atomic import replace_path
from ctr_foundation.errors import UsageError
from ctr_foundation.names import DATA_CONFIG_FILE, PLAN_FILE, SLOT_CONF_FILE, TOKEN_FILE, StateFolder
from elastic_control.backends.base import Backend, Deployment
from elastic_control.backends.status import PipelineStatus
from elastic_control.config import Resources, load_data_config, load_slot_conf
from elastic_control.console import done, warn
from elastic_control.evaluation.gate import GateRule
from elastic_control.kube.backend import KubeBackend
from elastic_control.kube.plan_checks import kube_plan_options
from elastic_control.local.backend import LocalBackend
from elastic_control.local.logs_view import TAIL, known_components, show_logs
from elastic_control.plan import DEFAULT_IMAGE, DEFAULT_NAMESPACE, Plan, load_plan, new_token

BACKENDS = ("auto", "local", "k8s")


def get_backend(name: str) -> Backend:
    """The backend implementation for a plan's backend name."""
    # Imported here: each backend pulls in what only it needs (the Kubernetes client, the supervisor).
    if name == "k8s":
        return KubeBackend()
    if name == "local":
        return LocalBackend()
    raise ValueError(f"unknown backend {name!r}")


def choose_backend(requested: str) -> tuple[str, str]:
    """(backend, reason). ``auto`` picks Kubernetes only when a cluster answers."""
    if requested not in BACKENDS:
        raise UsageError(f"--backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested != "auto":
        return requested, f"--backend {requested} was given"
    try:
        # function-level: loads the kubernetes client (~0.7 s)
        from elastic_control.kube.adaptor import detect_cluster
    except ImportError:  # pragma: no cover - the kube extra is always installed
        return "local", "the kubernetes client is not installed"
    ok, why = detect_cluster()
    return ("k8s", why) if ok else ("local", why)


def configure_resource(
    *,
    resources: Resources,
    slot_conf: str,
    data_config: str,
    hdfs_address: str = "",
    backend: str = "auto",
    namespace: str | None = None,
    image: str | None = None,
    state_dir: str = ".elastic-ctr",
    verbose: bool = False,
    queue: str = "default",
    job_name: str = "elastic-ctr",
    service_type: str = "ClusterIP",
    promotion_gate: str | None = None,
    extra: dict | None = None,
    kube: dict | None = None,
) -> Plan:
    """``-r``: validate everything, then render the plan and manifests into ``state_dir``.

    ``kube``: the Kubernetes options (keywords of ``kube.plan_checks.kube_plan_options``:
    context, storage_class, access_mode, serving_replicas, network_policy, max_retry,
    image_pull_policy, image_pull_secrets, data_secrets, pod_overlay). ``namespace`` defaults
    to the kubeconfig context's, else ``default``. Nothing in ``state_dir``
    changes unless every step succeeds.
    """
    slots = load_slot_conf(slot_conf)
    data_cfg = load_data_config(data_config)
    extra = dict(extra or {})
    if promotion_gate is not None:
        extra["promotion_gate"] = GateRule.parse(promotion_gate).text  # a bad rule fails here, not in a pod
    kube = dict(kube or {})
    # function-level: loads the kubernetes client (~0.7 s)
    from elastic_control.kube.adaptor import use_context

    use_context(kube.get("context"))  # `auto` asks the cluster of --context
    chosen, reason = choose_backend(backend)
    state = Path(state_dir)

    kube_options, context_namespace = kube_plan_options(
        backend=chosen,
        data_cfg=data_cfg,
        hdfs_address=hdfs_address or data_cfg.hdfs_address,
        image=image or DEFAULT_IMAGE,
        default_image=DEFAULT_IMAGE,
        job_name=job_name,
        **kube,
    )

    plan = Plan(
        backend=chosen,
        backend_reason=reason,
        resources=resources,
        slot_conf_text=slots.to_text(),
        data_config_path=str(Path(data_config).resolve()),
        hdfs_address=hdfs_address or data_cfg.hdfs_address,
        namespace=namespace or context_namespace or DEFAULT_NAMESPACE,
        image=image or DEFAULT_IMAGE,
        job_name=job_name,
        queue=queue,
        service_type=service_type,
        verbose=verbose,
        state_dir=str(state),
        extra=extra,
        kube=kube_options.to_json(),
    )

    created_state = not state.exists()
    state.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".render.", dir=state))
    ok = False
    try:
        (staging / SLOT_CONF_FILE).write_text(slots.to_text())
        shutil.copyfile(data_config, staging / DATA_CONFIG_FILE)
        # data.config may carry HDFS_UGI (user and password): only its owner reads the state folder's copy.
        os.chmod(staging / DATA_CONFIG_FILE, 0o600)
        # Keep the token across re-renders: running components already hold it.
        old_token = state / TOKEN_FILE
        token = old_token.read_text().strip() if old_token.exists() else new_token()
        (staging / TOKEN_FILE).write_text(token + "\n")
        os.chmod(staging / TOKEN_FILE, 0o600)
        # Kubernetes manifests are always rendered, so users can read them and
        # `kubectl apply` them whatever the backend; the local backend adds its own plan.
        get_backend("k8s").render(plan, staging)
        if chosen == "local":
            get_backend("local").render(plan, staging)
        (staging / PLAN_FILE).write_text(json.dumps(plan.to_json(), indent=2, sort_keys=True) + "\n")
        _swap_in(staging, state)
        ok = True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not ok and created_state:
            # A failed first -r leaves no state folder behind, not an empty one.
            shutil.rmtree(state, ignore_errors=True)
    done(f"rendered plan for the {chosen} backend into {state}/ ({reason})")
    for warning in kube_options.warnings:
        warn(warning)
    return plan


def _swap_in(staging: Path, state: Path) -> None:
    """Move each rendered entry over its old copy; plan.json last, so a plan implies its files."""
    entries = sorted(staging.iterdir(), key=lambda p: p.name == PLAN_FILE)
    for entry in entries:
        replace_path(entry, state / entry.name)


def apply(*, state_dir: str = ".elastic-ctr", dry_run: str | None = None, wait: bool = True) -> Deployment | None:
    """``-a``: start everything ``-r`` rendered; with ``wait``, until every component is up.

    Returns the handle on the running pipeline (None for a dry run).
    """
    plan = load_plan(state_dir)
    deployment = get_backend(plan.backend).apply(plan, dry_run=dry_run)
    if deployment is not None and wait:
        deployment.wait()
    return deployment


def attach(*, state_dir: str = ".elastic-ctr") -> Deployment:
    """The handle on what ``-a`` started from ``state_dir`` (usable from any process)."""
    plan = load_plan(state_dir)
    return get_backend(plan.backend).attach(plan)


def logs(
    *,
    state_dir: str = ".elastic-ctr",
    follow: bool = False,
    components: list[str] | None = None,
    raw: bool = False,
    tail: int | None = None,
    since: float | None = None,
    out=None,
) -> None:
    """``-l``: the logs of ``components`` (default: trainer 0, the file server, cube-transfer).

    ``tail``: the last lines of each (default: 40 locally, 200 on Kubernetes; every line with ``since``);
    ``since``: only lines of the last ``since`` seconds; ``follow``: keep streaming. Paddle's glog lines
    only with ``raw``. A name the plan does not know is a UsageError that lists the names it knows.
    """
    deployment = attach(state_dir=state_dir)
    plan = deployment.plan
    if plan.backend == "k8s":
        # function-level: loads the kubernetes client (~0.7 s)
        from elastic_control.kube import logs as kube_logs

        known = list(kube_logs.plan_log_sources(plan))
        check_components(components, known)
        if tail is None and since is None:
            tail = kube_logs.DEFAULT_TAIL
        kube_logs.stream_logs(plan, components=components, follow=follow, tail=tail, since=since, raw=raw, out=out)
        return
    import time

    layout = StateFolder.of(plan.state_dir)
    check_components(components, known_components(layout))
    if tail is None:
        tail = None if since is not None else TAIL
    cutoff = None if since is None else time.time() - since
    show_logs(layout, components=components, follow=follow, tail=tail, since=cutoff, raw=raw, out=out)


def check_components(components: list[str] | None, known: list[str]) -> None:
    """A UsageError naming the first unknown component, the closest known name, and every known one."""
    import difflib

    for name in components or []:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UsageError(f"no component {name!r} in this plan{hint} (known: {', '.join(known)})")


def configure_client(*, state_dir: str = ".elastic-ctr") -> Path:
    """``-c``: discover serving and the file server, write the client's config."""
    plan = load_plan(state_dir)
    return get_backend(plan.backend).configure_client(plan)


def status(*, state_dir: str = ".elastic-ctr", probe: bool = True) -> PipelineStatus:
    """``status``: every component, training, cube, serving, rollouts and alerts, as one document."""
    return attach(state_dir=state_dir).status(probe=probe)


def delete(*, state_dir: str = ".elastic-ctr") -> list[str]:
    """``delete``: stop everything ``-a`` started; data, models and MLflow runs stay. Idempotent."""
    return attach(state_dir=state_dir).delete()


def submit_evaluation(*, state_dir: str = ".elastic-ctr", request, timeout: float, poll: float = 2.0) -> dict:
    """``eval submit``: evaluate a pass where the plan runs (a Volcano job, or local processes)."""
    plan = load_plan(state_dir)
    return get_backend(plan.backend).submit_evaluation(plan, request, timeout=timeout, poll=poll)
