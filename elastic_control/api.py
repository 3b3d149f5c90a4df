"""The four verbs of elastic-control, as keyword-only library functions.

The CLI (cli.py) only parses flags and calls these; a Python user can call
them directly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ctr_foundation.atomic import replace_path
from ctr_foundation.errors import UsageError
from ctr_foundation.names import DATA_CONFIG_FILE, PLAN_FILE, SLOT_CONF_FILE, TOKEN_FILE
from elastic_control.backends import get_backend
from elastic_control.config import Resources, load_data_config, load_slot_conf
from elastic_control.console import done
from elastic_control.plan import Plan, load_plan, new_token

BACKENDS = ("auto", "local", "k8s")


def choose_backend(requested: str) -> tuple[str, str]:
    """(backend, reason). ``auto`` picks Kubernetes only when a cluster answers."""
    if requested not in BACKENDS:
        raise UsageError(f"--backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested != "auto":
        return requested, f"--backend {requested} was given"
    try:
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
    context, storage_class, access_mode, serving_replicas, max_retry,
    image_pull_policy, image_pull_secrets, pod_overlay). ``namespace`` defaults
    to the kubeconfig context's, else ``default``. Nothing in ``state_dir``
    changes unless every step succeeds.
    """
    slots = load_slot_conf(slot_conf)
    data_cfg = load_data_config(data_config)
    extra = dict(extra or {})
    if promotion_gate is not None:
        from elastic_control.evaluation.gate import GateRule

        extra["promotion_gate"] = GateRule.parse(promotion_gate).text  # a bad rule fails here, not in a pod
    kube = dict(kube or {})
    from elastic_control.kube.adaptor import use_context

    use_context(kube.get("context"))  # `auto` asks the cluster of --context
    chosen, reason = choose_backend(backend)
    state = Path(state_dir)
    from elastic_control.console import warn
    from elastic_control.kube.plan_checks import kube_plan_options
    from elastic_control.plan import DEFAULT_IMAGE, DEFAULT_NAMESPACE

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
        # Keep the token across re-renders: running components already hold it.
        old_token = state / TOKEN_FILE
        token = old_token.read_text().strip() if old_token.exists() else new_token()
        (staging / TOKEN_FILE).write_text(token + "\n")
        os.chmod(staging / TOKEN_FILE, 0o600)
        # Kubernetes manifests are always rendered, so users can read them and
        # `kubectl apply` them whatever the backend; the local backend adds its own plan.
        from elastic_control.backends.kube_backend import KubeBackend

        KubeBackend().render(plan, staging)
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


def apply(*, state_dir: str = ".elastic-ctr", dry_run: str | None = None) -> Plan:
    """``-a``: start everything ``-r`` rendered."""
    plan = load_plan(state_dir)
    get_backend(plan.backend).apply(plan, dry_run=dry_run)
    return plan


def logs(*, state_dir: str = ".elastic-ctr", follow: bool = False, components: list[str] | None = None) -> None:
    """``-l``: trainer 0's, the file server's and cube-transfer's logs."""
    plan = load_plan(state_dir)
    get_backend(plan.backend).logs(plan, follow=follow, components=components)


def configure_client(*, state_dir: str = ".elastic-ctr") -> Path:
    """``-c``: discover serving and the file server, write the client's config."""
    plan = load_plan(state_dir)
    return get_backend(plan.backend).configure_client(plan)


def status(*, state_dir: str = ".elastic-ctr") -> None:
    plan = load_plan(state_dir)
    get_backend(plan.backend).status(plan)


def delete(*, state_dir: str = ".elastic-ctr") -> None:
    plan = load_plan(state_dir)
    get_backend(plan.backend).delete(plan)
