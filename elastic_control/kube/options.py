"""The Kubernetes options of a plan: what `-r` decided about the cluster, validated once.

Stored in ``plan.json`` under ``kube`` so that ``-a``, ``-l``, ``status`` and
``delete`` act on exactly what was rendered (the cluster it targets included).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from ctr_foundation.errors import ConfigError, UsageError

ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
MAX_RETRY_RANGE = (0, 10000)
SERVING_REPLICAS_RANGE = (1, 64)
DEFAULT_SERVING_REPLICAS = 2
DEFAULT_MAX_RETRY = 3
DEFAULT_MAX_RETRY_ONLINE = 100  # an ONLINE job runs for weeks: Volcano's maxRetry counts over its whole life
# Seconds a finished training job (and its pods, with their logs) stays before Volcano removes it: a day, as
# for the evaluation jobs. None: kept until deleted.
DEFAULT_JOB_TTL = 24 * 3600
MAX_JOB_TTL = 2**31 - 1  # ttlSecondsAfterFinished is an int32
_TTL_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_TTL = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
# What a pod overlay file may set, merged into every pod the plan renders.
OVERLAY_KEYS = ("nodeSelector", "tolerations", "affinity", "labels", "annotations", "priorityClassName")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


@dataclass(frozen=True)
class KubeOptions:
    """Cluster-side choices of a plan (everything here is plain JSON)."""

    context: str | None = None  # kubeconfig context; None: the current one (or in-cluster)
    cluster_server: str | None = None  # the API server that context pointed at when -r ran
    storage_class: str | None = None  # None: the cluster's default StorageClass
    shared_access_mode: str = "ReadWriteMany"  # of the claim JOB-shared (training + cube-transfer + eval)
    serving_replicas: int = DEFAULT_SERVING_REPLICAS
    # NetworkPolicies: only the instance's pods reach its pods, except serving's (and an exposed
    # file server's) ports (templates/network_policy.yaml.j2).
    network_policy: bool = True
    max_retry: int = DEFAULT_MAX_RETRY
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    # Secrets (the user's) whose keys become environment variables of every pod that reads data
    # (pservers, trainers, cube-transfer, evaluation): AWS_* for s3://, and the like.
    data_secrets: tuple[str, ...] = ()
    pod_overlay: dict = field(default_factory=dict)  # validated content of --pod-overlay
    job_ttl: int | None = DEFAULT_JOB_TTL  # the training job's ttlSecondsAfterFinished; None: never removed
    # Trainer 0 patches its pass progress onto the job: a ServiceAccount, Role and RoleBinding of its own
    # (templates/training_job.yaml.j2), which users limited to the `edit` ClusterRole cannot create.
    job_progress: bool = True
    # ServiceMonitors and a PrometheusRule instead of the alerts' ConfigMap (the cluster serves
    # monitoring.coreos.com/v1, found by -r, or --prometheus-operator)
    prometheus_operator: bool = False
    # Added to the ServiceMonitors' and the PrometheusRule's labels: what the cluster's Prometheus selects
    # them by (kube-prometheus-stack selects release=<its Helm release>).
    monitoring_labels: dict = field(default_factory=dict)
    warnings: tuple[str, ...] = ()  # what -r warned about; -a repeats it

    def to_json(self) -> dict:
        d = asdict(self)
        d["image_pull_secrets"] = list(self.image_pull_secrets)
        d["data_secrets"] = list(self.data_secrets)
        d["warnings"] = list(self.warnings)
        return d

    @classmethod
    def from_json(cls, d: dict | None) -> KubeOptions:
        d = dict(d or {})
        d["image_pull_secrets"] = tuple(d.get("image_pull_secrets") or ())
        d["data_secrets"] = tuple(d.get("data_secrets") or ())
        d["warnings"] = tuple(d.get("warnings") or ())
        known = set(cls.__dataclass_fields__)
        return cls(**{key: value for key, value in d.items() if key in known})

    def with_warnings(self, warnings: list[str]) -> KubeOptions:
        return replace(self, warnings=tuple(warnings))


def pull_policy_for(image: str, requested: str | None = None) -> str:
    """The pull policy that fits the image reference, unless one is requested.

    A digest (``@sha256:...``) never changes: IfNotPresent. ``:latest`` or no
    tag is mutable by convention: Always. Other tags (``:0.1.0``) are treated as
    releases, IfNotPresent, as Kubernetes itself defaults; pass
    ``--image-pull-policy Always`` for a tag you overwrite.
    """
    if requested is not None:
        if requested not in PULL_POLICIES:
            raise UsageError(f"--image-pull-policy {requested!r} is not one of {', '.join(PULL_POLICIES)}")
        return requested
    if "@" in image:
        return "IfNotPresent"
    last = image.rsplit("/", 1)[-1]
    tag = last.split(":", 1)[1] if ":" in last else ""
    return "Always" if tag in ("", "latest") else "IfNotPresent"


def load_pod_overlay(path: str | Path) -> dict:
    """The pod overlay file (YAML): nodeSelector, tolerations, affinity, labels, annotations, priorityClassName."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError("file not found (the --pod-overlay file)", path=str(path)) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot read the pod overlay: {first}", path=str(path)) from e
    return validate_pod_overlay(data, source=str(path))


def validate_pod_overlay(data, *, source: str = "pod overlay") -> dict:
    if not isinstance(data, dict):
        raise ConfigError(f"must be a mapping of {', '.join(OVERLAY_KEYS)}", path=source)
    unknown = [key for key in data if key not in OVERLAY_KEYS]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], OVERLAY_KEYS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (allowed: {', '.join(OVERLAY_KEYS)})"
        raise ConfigError(f"unknown key {unknown[0]!r}{hint}", path=source)
    for key in ("nodeSelector", "labels", "annotations"):
        value = data.get(key, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ConfigError(f"{key} must map names to strings", path=source)
        for name in value:
            if not isinstance(name, str) or not _LABEL_KEY.fullmatch(name):
                raise ConfigError(f"{key}: {name!r} is not a valid label/annotation key", path=source)
    for name in data.get("annotations", {}):
        if name.startswith("elastic-ctr/"):
            raise ConfigError(f"annotations: {name!r} is set by elastic-control itself; pick another key", path=source)
    for name, value in data.get("labels", {}).items():
        problem = _label_problem(name, value)
        if problem:
            raise ConfigError(f"labels: {problem}", path=source)
    tolerations = data.get("tolerations", [])
    if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
        raise ConfigError("tolerations must be a list of mappings (key, operator, value, effect)", path=source)
    if "affinity" in data and not isinstance(data["affinity"], dict):
        raise ConfigError("affinity must be a mapping (nodeAffinity, podAffinity, podAntiAffinity)", path=source)
    if "priorityClassName" in data and not (
        isinstance(data["priorityClassName"], str) and _DNS_SUBDOMAIN.fullmatch(data["priorityClassName"])
    ):
        raise ConfigError("priorityClassName must be a PriorityClass name", path=source)
    return data


def _label_problem(name: str, value: str) -> str | None:
    """Why ``name: value`` cannot be a label the user adds to the rendered objects (None: it can)."""
    if not _LABEL_KEY.fullmatch(name):
        return f"{name!r} is not a valid label key"
    if name.startswith(("app.kubernetes.io/", "volcano.sh/", "elastic-ctr/")):
        return f"{name!r} is set by elastic-control itself (selectors depend on it); pick another key"
    if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
        return f"value {value!r} of {name!r} is not a valid label value"
    return None


def parse_monitoring_labels(pairs) -> dict[str, str]:
    """--monitoring-label KEY=VALUE (repeatable): labels of the ServiceMonitors and the PrometheusRule, which
    a Prometheus selects them by (kube-prometheus-stack: ``release=<its Helm release>``)."""
    labels: dict[str, str] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition("=")
        problem = _label_problem(name, value) if sep else "it is not KEY=VALUE"
        if problem:
            raise UsageError(f"--monitoring-label {pair!r}: {problem}")
        labels[name] = value
    return labels


def validate_storage(storage_class: str | None, access_mode: str) -> None:
    if storage_class is not None and not (_DNS_SUBDOMAIN.fullmatch(storage_class) and len(storage_class) <= 253):
        raise UsageError(
            f"--storage-class {storage_class!r} is not a StorageClass name (see `kubectl get storageclass`)"
        )
    if access_mode not in ACCESS_MODES:
        raise UsageError(f"--access-mode {access_mode!r} is not one of {', '.join(ACCESS_MODES)}")


def parse_job_ttl(value: str | int | None) -> int | None:
    """--job-ttl: seconds (``3600``), a duration (``90m``, ``24h``, ``7d``, ``1d12h``) or ``never``."""
    if value is None:
        return DEFAULT_JOB_TTL
    text = str(value).strip().lower()
    if text == "never":
        return None
    if text.isdigit():
        seconds = int(text)
    else:
        match = _TTL.fullmatch(text)
        if not text or match is None:
            raise UsageError(f"--job-ttl {value!r} is not a duration: use seconds (3600), 90m, 24h, 7d or never")
        seconds = sum(int(n or 0) * _TTL_UNITS[u] for n, u in zip(match.groups(), "dhms", strict=True))
    if seconds > MAX_JOB_TTL:
        raise UsageError(f"--job-ttl {value!r} is above {MAX_JOB_TTL} seconds; use never to keep the job")
    return seconds


def check_range(flag: str, value: int, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    if not lo <= value <= hi:
        raise UsageError(f"{flag} {value} is out of range ({lo}-{hi})")


def build_kube_options(
    *,
    image: str,
    online: bool,
    target=None,
    storage_class: str | None = None,
    access_mode: str = "ReadWriteMany",
    serving_replicas: int | None = None,
    network_policy: bool = True,
    max_retry: int | None = None,
    image_pull_policy: str | None = None,
    image_pull_secrets: tuple[str, ...] | list[str] = (),
    data_secrets: tuple[str, ...] | list[str] = (),
    pod_overlay: str | None = None,
    job_ttl: str | int | None = None,
    job_progress: bool = True,
    prometheus_operator: bool = False,
    monitoring_labels: tuple[str, ...] | list[str] = (),
) -> KubeOptions:
    """Validate the flags; ``target`` is the cluster (elastic_control.kube.target.Target) the plan is for."""
    validate_storage(storage_class, access_mode)
    replicas = DEFAULT_SERVING_REPLICAS if serving_replicas is None else serving_replicas
    check_range("--serving-replicas", replicas, SERVING_REPLICAS_RANGE)
    retry = (DEFAULT_MAX_RETRY_ONLINE if online else DEFAULT_MAX_RETRY) if max_retry is None else max_retry
    check_range("--max-retry", retry, MAX_RETRY_RANGE)
    for flag, secrets in (("--image-pull-secret", image_pull_secrets), ("--data-secret", data_secrets)):
        for secret in secrets:
            if not (_DNS_SUBDOMAIN.fullmatch(secret) and len(secret) <= 253):
                raise UsageError(f"{flag} {secret!r} is not a Secret name")
    return KubeOptions(
        context=target.context if target else None,
        cluster_server=target.server if target else None,
        storage_class=storage_class,
        shared_access_mode=access_mode,
        serving_replicas=replicas,
        network_policy=bool(network_policy),
        max_retry=retry,
        image_pull_policy=pull_policy_for(image, image_pull_policy),
        image_pull_secrets=tuple(image_pull_secrets),
        data_secrets=tuple(data_secrets),
        pod_overlay=load_pod_overlay(pod_overlay) if pod_overlay else {},
        job_ttl=parse_job_ttl(job_ttl),
        job_progress=bool(job_progress),
        prometheus_operator=bool(prometheus_operator),
        monitoring_labels=parse_monitoring_labels(monitoring_labels),
    )
