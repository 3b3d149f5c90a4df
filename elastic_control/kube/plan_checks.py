"""What `-r` checks about a plan meant for Kubernetes: options, the target cluster, paths pods can reach.

Everything here runs before anything is written; problems a user must fix are
UsageErrors, things that would fail later on the cluster are warnings that name
the fix (printed by -r, kept in the plan and repeated by -a).
"""

from __future__ import annotations

from ctr_foundation.errors import ClusterUnavailableError
from elastic_control.config import DataConfig
from elastic_control.kube import constants as k
from elastic_control.kube.options import KubeOptions, build_kube_options
from elastic_control.kube.target import Target, resolve_target

REMOTE_SCHEMES = ("hdfs", "viewfs", "s3", "s3a", "gs", "gcs", "abfs", "az", "http", "https")
HDFS_SCHEMES = ("hdfs", "viewfs")
S3_SCHEMES = ("s3", "s3a")


def dataset_root(data_cfg: DataConfig, hdfs_address: str) -> str:
    if hdfs_address:
        return hdfs_address.rstrip("/") + "/" + data_cfg.dataset_path.lstrip("/")
    return data_cfg.dataset_path


def path_warnings(
    data_cfg: DataConfig, *, hdfs_address: str, job_name: str, data_secrets: tuple[str, ...] = ()
) -> list[str]:
    """Why pods would not find the data, and how to fix it (empty when they will)."""
    root = dataset_root(data_cfg, hdfs_address)
    scheme = root.split("://", 1)[0].lower() if "://" in root else ""
    if scheme in HDFS_SCHEMES:
        return [
            f"DATASET_PATH {root} is on HDFS: the pods' image needs a Java runtime and libhdfs for it "
            "(build it with `docker build --build-arg HADOOP_VERSION=3.3.6 ...`, see the Dockerfile)"
        ]
    if scheme in S3_SCHEMES and not data_secrets:
        return [
            f"DATASET_PATH {root} is on S3: the pods that read it get no AWS_* variables unless you give them "
            "some: create a Secret (`kubectl create secret generic s3-data --from-literal=AWS_ACCESS_KEY_ID=... "
            "--from-literal=AWS_SECRET_ACCESS_KEY=... [--from-literal=AWS_ENDPOINT_URL=...]`) and pass "
            "--data-secret s3-data to -r, unless the namespace's default ServiceAccount or the nodes' role "
            "grants access (IRSA, EKS Pod Identity)"
        ]
    if scheme and scheme != "file":
        return []  # reachable with the credentials of --data-secret (or the pods' identity)
    path = root[len("file://") :] if scheme == "file" else root
    if path.startswith(k.SHARED_MOUNT.rstrip("/") + "/"):
        return []
    return [
        f"DATASET_PATH {root} is a path on this machine, which pods cannot read: put the hours on HDFS or S3 "
        f"(DATASET_PATH=hdfs://... or s3://...), or copy them onto the claim {job_name}-shared and set DATASET_PATH "
        f"under {k.SHARED_MOUNT}/ (e.g. {k.SHARED_MOUNT}/data); then run -r again"
    ]


def image_warnings(image: str, default_image: str) -> list[str]:
    if image != default_image:
        return []
    return [
        f"the default image {default_image} exists only where it was built: build it (`docker build -t "
        f"REGISTRY/{default_image} .`), push it where the nodes pull from and pass --image REGISTRY/{default_image} "
        f"(on kind: `kind load docker-image {default_image}`)"
    ]


def kube_plan_options(
    *,
    backend: str,
    data_cfg: DataConfig,
    hdfs_address: str,
    image: str,
    default_image: str,
    job_name: str,
    **flags,
) -> tuple[KubeOptions, str | None]:
    """Validated KubeOptions (with warnings when the plan is for Kubernetes) and the context's namespace."""
    context = flags.pop("context", None)
    try:
        target = resolve_target(context)
    except ClusterUnavailableError:
        # An unreadable kubeconfig matters only when the plan targets a cluster.
        if backend == "k8s" or context:
            raise
        target = Target(None, None, None)
    operator, operator_warning = flags.pop("prometheus_operator", None), None
    if operator is None:
        operator, operator_warning = discover_prometheus_operator(backend, target)
    options = build_kube_options(
        image=image, online=data_cfg.online, target=target, prometheus_operator=operator, **flags
    )
    warnings: list[str] = [operator_warning] if operator_warning else []
    if backend == "k8s":
        warnings += path_warnings(
            data_cfg, hdfs_address=hdfs_address, job_name=job_name, data_secrets=options.data_secrets
        )
        warnings += image_warnings(image, default_image)
    return options.with_warnings(warnings), target.namespace


def discover_prometheus_operator(backend: str, target: Target) -> tuple[bool, str | None]:
    """(render the operator's objects?, a warning): whether the plan's cluster serves ServiceMonitor and
    PrometheusRule under monitoring.coreos.com/v1, as charts check ``.Capabilities.APIVersions``."""
    if backend != "k8s" or target.server is None:
        return False, None  # no cluster to ask: the alerts' ConfigMap, which any Prometheus can load
    # function-level: loads the kubernetes client (~0.7 s), needed only when a cluster is asked
    from elastic_control.kube import adaptor

    try:
        served = adaptor.served_resources(k.MONITORING_GROUP, k.MONITORING_VERSION)
    except ClusterUnavailableError as e:
        return False, (
            f"could not ask the cluster whether it serves {k.MONITORING_GROUP}/{k.MONITORING_VERSION} ({e}); the "
            "alerts are rendered as a ConfigMap: pass --prometheus-operator to -r for ServiceMonitors and a "
            "PrometheusRule"
        )
    wanted = {k.SERVICE_MONITOR_PLURAL, k.PROMETHEUS_RULE_PLURAL}
    return served is not None and wanted <= served, None


def describe_target(options: KubeOptions) -> str:
    return Target(options.context, options.cluster_server, None).describe()
