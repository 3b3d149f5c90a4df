"""Render the Kubernetes manifests: Jinja2 templates in ``templates/`` -> plain YAML files.

One function does the rendering (``render_manifests``) with ``StrictUndefined``
so a missing value fails loudly; every rendered document is parsed back and
re-emitted as plain block YAML a person can read and ``kubectl apply``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import yaml

from ctr_foundation import env_vars as ev
from ctr_foundation.atomic import atomic_write_text
from ctr_foundation.env_vars import TEMPLATE_DIR
from ctr_foundation.errors import ConfigError, UsageError
from elastic_control.catalogue import CREDENTIAL_KEYS, ClusterDns, Component, Paths, build_catalogue
from elastic_control.config import DataConfig
from elastic_control.kube import constants as k
from elastic_control.kube.options import KubeOptions
from elastic_control.kube.pod_overlay import apply_pod_overlay
from elastic_control.kube.read_only_root import read_only_root
from elastic_control.kube.volcano_rules import volcano_job_problems

# templates/ at the top of the repository; the wheel ships it as elastic_control/templates (setup.py).
_INSTALLED_TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
DEFAULT_TEMPLATE_DIR = (
    _INSTALLED_TEMPLATES if _INSTALLED_TEMPLATES.is_dir() else Path(__file__).resolve().parents[2] / "templates"
)


def template_dir() -> Path:
    return Path(TEMPLATE_DIR.get() or DEFAULT_TEMPLATE_DIR)


# (file written into STATE/manifests/, template). Numbered in apply order:
# config and storage first, then what the others connect to.
MANIFEST_FILES = (
    ("00-shared.yaml", "shared.yaml.j2"),
    ("05-network-policy.yaml", "network_policy.yaml.j2"),
    ("10-mlflow.yaml", "mlflow.yaml.j2"),
    ("20-fileserver.yaml", "fileserver.yaml.j2"),
    ("30-cube.yaml", "cube.yaml.j2"),
    ("40-cube-transfer.yaml", "cube_transfer.yaml.j2"),
    ("50-serving.yaml", "serving.yaml.j2"),
    ("51-serving-alerts.yaml", "serving_alerts.yaml.j2"),
    ("60-training-job.yaml", "training_job.yaml.j2"),
)
SECRET_FILES = {"00-shared.yaml"}  # hold the token: readable by the owner only

# Requests/limits of the pods -u/-m do not size (they are per trainer/pserver).
SIZES = {
    "small_cpu": "500m",
    "small_memory": "1Gi",
    "cube_cpu": "1",
    "cube_memory": "4Gi",
    "serving_cpu": "2",
    "serving_memory": "4Gi",
    "shared_storage": "50Gi",
    "fileserver_storage": "20Gi",
    "mlflow_storage": "5Gi",
    "init_cpu": "100m",
    "init_memory": "128Mi",
}
# libyaml's C loader/dumper when present: manifests are parsed and re-emitted on every -r.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
HEADER = "# Rendered by `elastic-control -r` from the template {template}; apply with `elastic-control -a`.\n"


@dataclass(frozen=True)
class RenderInputs:
    """Everything the templates need that is not in the plan itself."""

    token: str
    data_config: DataConfig
    service_type: str = "ClusterIP"
    options: KubeOptions = field(default_factory=KubeOptions)


def validate_job_name(name: str) -> None:
    """Job names become pod host names (JOB-TASK-I) and Service names: DNS-1035 labels."""
    import re

    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 40:
        raise UsageError(
            f"job name {name!r} must start with a letter, use only lower-case letters, digits and "
            "'-', and be at most 40 characters (pod names JOB-TASK-I must fit 63)"
        )


def validate_namespace(namespace: str) -> None:
    import re

    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", namespace) or len(namespace) > 63:
        raise UsageError(
            f"--namespace {namespace!r} is not a valid namespace name (lower-case letters, digits, "
            "'-', at most 63 characters)"
        )


def _config_line(key: str, value: str) -> str:
    """One ``export KEY=...`` line that the pods' parser reads back as exactly ``value``."""
    if ("$" in value or '"' in value) and "'" not in value:
        return f"export {key}='{value}'\n"  # single quotes: nothing is expanded again
    return f'export {key}="{value}"\n'


def pod_data_config(data_config: DataConfig, hdfs_address: str, model_path: str) -> str:
    """data.config as the pods see it: already expanded (the pods lack the user's environment),
    with -hd applied, MODEL_PATH pointing at the shared volume, and credentials read from the
    pod's environment (a Secret) instead of written out."""
    values = dict(data_config.values)
    values["HDFS_ADDRESS"] = hdfs_address
    values["MODEL_PATH"] = model_path
    lines = ["# data.config as validated by `elastic-control -r` (expanded; MODEL_PATH on the shared volume)\n"]
    for key, value in values.items():
        if key in CREDENTIAL_KEYS:
            if value:
                # Expanded from the pod's environment, which takes it from the Secret JOB-credentials.
                lines.append(f'export {key}="${{{key}:-}}"\n')
            continue
        lines.append(_config_line(key, value))
    return "".join(lines)


def pod_model_path(data_config: DataConfig) -> str:
    """Where pods write and read passes: the shared claim.

    A remote MODEL_PATH (hdfs://, s3://) is refused: trainers write passes with
    Paddle's local savers and cube-transfer builds from a folder, so passes need
    a filesystem path; copy them out of the claim if they must land elsewhere.
    """
    if data_config.model_path and "://" in data_config.model_path:
        raise UsageError(
            f"MODEL_PATH {data_config.model_path!r} in {data_config.source} is remote: passes are written by "
            "Paddle's local savers and read by cube-transfer from a folder, so on Kubernetes they live on the "
            f"shared claim ({k.POD_MODEL_PATH}); remove MODEL_PATH (or make it a local path) and copy passes out "
            "of the claim if they must also land there"
        )
    return k.POD_MODEL_PATH


def mlflow_allowed_hosts(job: str, namespace: str) -> str:
    """Host headers the MLflow server accepts: its Service names (short, namespaced, FQDN with any
    cluster domain), with and without the port, plus what MLflow allows by default (localhost for
    `kubectl port-forward`, private IPs for pod addresses)."""
    svc = f"{job}-mlflow"
    names = [svc, f"{svc}.{namespace}", f"{svc}.{namespace}.svc"]
    hosts = [h for name in names for h in (name, f"{name}:{k.MLFLOW_PORT}")]
    hosts.append(f"{svc}.{namespace}.svc.*")  # svc.cluster.local, or another cluster domain, any port
    hosts += ["localhost", "localhost:*", "127.0.0.1", "127.0.0.1:*", "10.*", "192.168.*"]
    hosts += [f"172.{i}.*" for i in range(16, 32)]
    return ",".join(hosts)


def cluster_addressing(plan, model_path: str) -> ClusterDns:
    """The catalogue's addressing in the plan's cluster: Services, fixed ports, the pods' volumes."""
    paths = Paths(
        slot_conf=f"{k.CONFIG_MOUNT}/slot.conf",
        data_config=f"{k.CONFIG_MOUNT}/data.config",
        model_path=model_path,
        fileserver_root=k.FILESERVER_ROOT,
        mlflow_dir=k.MLFLOW_DATA_DIR,
        transfer_cube_root=k.TRANSFER_CUBE_ROOT,  # on the shared claim: builds and the journal survive a restart
        shard_dirs=[k.CUBE_DATA_DIR] * plan.resources.cube_shards,  # each cube pod's own emptyDir
        kept_logs=k.KEPT_LOGS,
    )
    return ClusterDns(plan.job_name, paths, mlflow_allowed_hosts=mlflow_allowed_hosts(plan.job_name, plan.namespace))


def container_run(component: Component, secret_refs: dict[str, tuple[str, str]]) -> dict:
    """A catalogue entry as a container's ``command``, ``env`` and ``ports``.

    Secrets become Secret references (``secret_refs``: variable -> (Secret, key)), a pod field a field
    reference; values only the entry shell can know are exported by ``/bin/sh -c`` before it runs the script.
    """
    env = []
    for e in component.env:
        if e.shell:
            continue
        if e.secret:
            secret, key = secret_refs[e.name]
            env.append({"name": e.name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
        elif e.pod_field:
            env.append({"name": e.name, "valueFrom": {"fieldRef": {"fieldPath": e.pod_field}}})
        else:
            env.append({"name": e.name, "value": e.value})
    exports = " ".join(f'{e.name}="{e.value}"' for e in component.env if e.shell)
    command = ["/bin/sh", "-c", f"export {exports}; exec {shlex.join(component.argv)}"] if exports else component.argv
    return {
        "command": command,
        "env": env,
        "ports": [{"name": name, "containerPort": port} for name, port in component.ports],
    }


def config_checksum(token: str, *parts: dict) -> str:
    """A checksum of what pods read from the ConfigMap and Secrets, keyed with the token.

    It sits in pod templates, which people without access to Secrets can read;
    keyed, it says "changed" without letting anyone test guesses of a password.
    """
    message = json.dumps(parts, sort_keys=True).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()[:20]


def spec_hash(doc: dict) -> str:
    """The hash of a rendered object as -a applies it (its own hash annotation left out)."""
    import copy

    body = copy.deepcopy(doc)
    (body.get("metadata", {}).get("annotations") or {}).pop(k.SPEC_HASH_ANNOTATION, None)
    if body.get("metadata", {}).get("annotations") == {}:
        del body["metadata"]["annotations"]
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:20]


def annotate_spec_hash(doc: dict) -> dict:
    doc["metadata"].setdefault("annotations", {})[k.SPEC_HASH_ANNOTATION] = spec_hash(doc)
    return doc


def build_context(plan, inputs: RenderInputs, *, model_path: str | None = None) -> dict:
    """The template values for ``plan``; every name a template uses comes from here.

    ``model_path``: where the pods write passes, if not the plan's (a tuning candidate's own folder)."""
    job, res = plan.job_name, plan.resources
    validate_job_name(job)
    validate_namespace(plan.namespace)
    if inputs.service_type not in k.SERVICE_TYPES:
        raise UsageError(f"service type {inputs.service_type!r} is not one of {', '.join(k.SERVICE_TYPES)}")
    options = inputs.options
    data_config_text = pod_data_config(inputs.data_config, plan.hdfs_address, pod_model_path(inputs.data_config))
    model_path = model_path or pod_model_path(inputs.data_config)
    hdfs_ugi = inputs.data_config.hdfs_ugi
    catalogue = build_catalogue(
        plan, cluster_addressing(plan, model_path), credentials=CREDENTIAL_KEYS if hdfs_ugi else ()
    )
    secret_refs = {ev.TOKEN.name: (f"{job}-token", "token"), "HDFS_UGI": (f"{job}-credentials", "HDFS_UGI")}
    return {
        "k": k,
        "job": job,
        "namespace": plan.namespace,
        "image": plan.image,
        "queue": plan.queue,
        "max_retry": options.max_retry,
        "job_ttl": options.job_ttl,
        "job_progress": options.job_progress,
        "monitoring_labels": options.monitoring_labels,
        "prometheus_operator": options.prometheus_operator,
        "serving_replicas": options.serving_replicas,
        "network_policy": options.network_policy,
        "storage_class": options.storage_class,
        "shared_access_mode": options.shared_access_mode,
        "image_pull_policy": options.image_pull_policy,
        "image_pull_secrets": list(options.image_pull_secrets),
        "data_secrets": list(options.data_secrets),
        "pservers": res.pservers,
        "trainers": res.trainers,
        "cpu": str(res.cpu),
        "memory": f"{res.mem}Gi",
        "token": inputs.token,
        "service_type": inputs.service_type,
        "slot_conf_text": plan.slot_conf_text,
        "data_config_text": data_config_text,
        "hdfs_ugi_secret": hdfs_ugi,
        "credentials_name": f"{job}-credentials",
        "config_checksum": config_checksum(
            inputs.token,
            {"slot.conf": plan.slot_conf_text, "data.config": data_config_text},
            {"token": inputs.token, "HDFS_UGI": hdfs_ugi},
        ),
        "model_path": model_path,
        "configmap_name": f"{job}-config",
        "secret_name": f"{job}-token",
        "shared_pvc_name": f"{job}-shared",
        "mlflow_name": f"{job}-mlflow",
        "fileserver_name": f"{job}-fileserver",
        "transfer_name": f"{job}-cube-transfer",
        "serving_name": f"{job}-serving",
        "mlflow_url": f"http://{job}-mlflow:{k.MLFLOW_PORT}",
        "fileserver_url": f"http://{job}-fileserver:{k.FILESERVER_PORT}",
        "cube_shards": catalogue.shards,
        "containers": {c.name: container_run(c, secret_refs) for c in catalogue.components},
        "ports": {c.name: [list(p) for p in c.ports] for c in catalogue.components},
        **SIZES,
    }


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.policies["json.dumps_kwargs"] = {"sort_keys": False}  # containers' fields in the order Kubernetes lists them
    return env


def finish_documents(docs: list[dict], options: KubeOptions) -> list[dict]:
    """Read-only root file systems (kube/read_only_root.py), the user's pod overlay merged into every pod,
    Deployments' rendered replicas recorded, then each object's spec-hash annotation (what -a compares)."""
    for doc in docs:
        read_only_root(doc)
        apply_pod_overlay(doc, options.pod_overlay)
        if doc["kind"] == "Deployment":
            doc["metadata"].setdefault("annotations", {})[k.REPLICAS_ANNOTATION] = str(doc["spec"].get("replicas", 1))
        annotate_spec_hash(doc)
    return docs


def render_documents(plan, inputs: RenderInputs) -> dict[str, list[dict]]:
    """{manifest file name: its documents}, rendered, parsed, finished and checked."""
    context = build_context(plan, inputs)
    env = _environment()
    rendered: dict[str, list[dict]] = {}
    for filename, template in MANIFEST_FILES:
        try:
            text = env.get_template(template).render(**context)
        except jinja2.TemplateNotFound as e:
            raise ConfigError(
                f"template {e.name} is missing from {template_dir()} (set ELASTIC_CTR_TEMPLATE_DIR)"
            ) from e
        except jinja2.UndefinedError as e:  # a template bug, never a user's: say where
            raise ConfigError(f"template {template} uses an undefined value: {e}") from e
        docs = finish_documents([d for d in yaml.load_all(text, Loader=_Loader) if d], inputs.options)
        rendered[filename] = docs
        for doc in docs:
            if doc.get("kind") == k.VOLCANO_JOB_KIND and doc["apiVersion"].startswith(k.VOLCANO_JOB_GROUP):
                problems = volcano_job_problems(doc)
                if problems:
                    raise UsageError("Volcano would refuse the training job: " + "; ".join(problems))
    return rendered


def render_manifests(plan, out_dir: str | Path, inputs: RenderInputs) -> list[Path]:
    """Write every manifest of ``plan`` into ``out_dir`` as plain YAML; returns the files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for (filename, template), docs in zip(MANIFEST_FILES, render_documents(plan, inputs).values(), strict=True):
        text = HEADER.format(template=template) + yaml.dump_all(
            docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096
        )
        path = out_dir / filename
        atomic_write_text(path, text)
        # The temp file behind atomic writes is private; only the token's file should stay so.
        os.chmod(path, 0o600 if filename in SECRET_FILES else 0o644)
        written.append(path)
    return written


def load_manifests(manifest_dir: str | Path) -> list[dict]:
    """Every document of the rendered manifests, in apply order."""
    manifest_dir = Path(manifest_dir)
    if not manifest_dir.is_dir():
        raise UsageError(f"no manifests in {manifest_dir}: run `elastic-control -r ...` first")
    docs: list[dict] = []
    for path in sorted(manifest_dir.glob("*.yaml")):
        try:
            docs += [d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d]
        except yaml.YAMLError as e:
            raise UsageError(f"{path} is not valid YAML ({e}); run -r again") from e
    return docs
