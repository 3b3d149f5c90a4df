"""Coordinates of the Kubernetes objects ElasticCTR creates and reads.

Custom resources (Volcano) are addressed by group/version/plural, never by
string-building in the callers; ports and label keys are fixed here so the
templates, the backend and the tests agree.
"""

from __future__ import annotations

from ctr_foundation import names

# Volcano batch Job (the training job) and the scheduling Queue it runs in.
VOLCANO_JOB_GROUP = "batch.volcano.sh"
VOLCANO_JOB_VERSION = "v1alpha1"
VOLCANO_JOB_PLURAL = "jobs"
VOLCANO_JOB_KIND = "Job"
VOLCANO_JOB_CRD = f"{VOLCANO_JOB_PLURAL}.{VOLCANO_JOB_GROUP}"
VOLCANO_QUEUE_GROUP = "scheduling.volcano.sh"
VOLCANO_QUEUE_VERSION = "v1beta1"
VOLCANO_QUEUE_PLURAL = "queues"
VOLCANO_SCHEDULER = "volcano"
# A pinned release, never a moving `master` URL: what the hint installs must not change under the user.
VOLCANO_INSTALL_HINT = (
    "install Volcano from a pinned release, e.g. `kubectl apply -f "
    "https://raw.githubusercontent.com/volcano-sh/volcano/v1.11.0/installer/volcano-development.yaml`"
    " or `helm install volcano volcano-sh/volcano --version 1.11.0 -n volcano-system --create-namespace`"
)

# The Prometheus Operator's kinds: rendered instead of the alerts' ConfigMap when the cluster serves them.
MONITORING_GROUP = "monitoring.coreos.com"
MONITORING_VERSION = "v1"
SERVICE_MONITOR_KIND = "ServiceMonitor"
SERVICE_MONITOR_PLURAL = "servicemonitors"
PROMETHEUS_RULE_KIND = "PrometheusRule"
PROMETHEUS_RULE_PLURAL = "prometheusrules"
# The label the operator puts on its Prometheus pods: what the scrape NetworkPolicy lets in.
PROMETHEUS_POD_LABELS = {"app.kubernetes.io/name": "prometheus"}

# Labels Volcano puts on the pods of a job.
VOLCANO_JOB_NAME_LABEL = "volcano.sh/job-name"
VOLCANO_TASK_SPEC_LABEL = "volcano.sh/task-spec"
VOLCANO_TASK_INDEX_LABEL = "volcano.sh/task-index"

# Our labels (recommended Kubernetes labels).
LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_SHARD = "elastic-ctr/shard"
# Pods that mount the shared claim carry this label, so a ReadWriteOnce claim can pull them onto one node.
LABEL_SHARED_CLAIM = "elastic-ctr/shared-claim"
APP_NAME = "elastic-ctr"
MANAGED_BY = "elastic-control"  # value of app.kubernetes.io/managed-by, and the server-side-apply field manager

# Annotations -a reads back: the hash of what was applied (an object whose hash is unchanged is left
# alone; the Volcano job is recreated only when its hash changed), and, on pod templates, a keyed
# checksum of the ConfigMap and Secrets the pod reads (a config change rolls those pods).
SPEC_HASH_ANNOTATION = "elastic-ctr/spec-hash"
CONFIG_CHECKSUM_ANNOTATION = "elastic-ctr/config-checksum"
# A ConfigMap JOB-training-record that -a writes when it creates the training job (the job's spec hash): a
# finished job that its TTL removed is then told apart from one never created, so -a does not run it again
# and status shows it as done. Not rendered, never pruned; `delete` removes it with the rest.
TRAINING_RECORD_COMPONENT = "training-record"
TRAINING_RECORD_SUFFIX = "-training-record"
# On the Volcano job: trainer 0's pass progress (ctr_foundation/progress.py's document, as JSON), patched by
# the trainer through the service account JOB-training-progress (templates/training_job.yaml.j2); status shows it.
PROGRESS_ANNOTATION = "elastic-ctr/progress"
PROGRESS_ACCOUNT_SUFFIX = "-training-progress"
# On Deployments: replicas as rendered, so -a tells a changed plan from an HPA's or `kubectl scale`'s replicas.
REPLICAS_ANNOTATION = "elastic-ctr/replicas"

# Ports: owned by ctr_foundation.names; named here too because the templates read `k.*`.
PSERVER_PORT = names.PSERVER_PORT
TRAINER_PORT = names.TRAINER_PORT
FILESERVER_PORT = names.FILESERVER_PORT
CUBE_SERVER_PORT = names.CUBE_SERVER_PORT
CUBE_AGENT_PORT = names.CUBE_AGENT_PORT
CUBE_TRANSFER_PORT = names.CUBE_TRANSFER_PORT
SERVING_PORT = names.SERVING_PORT
SERVING_GRPC_PORT = names.SERVING_GRPC_PORT
MLFLOW_PORT = names.MLFLOW_PORT
COORDINATOR_PORT = names.PSERVER_PORT + names.COORDINATOR_PORT_OFFSET

# Paths inside every container.
CONFIG_MOUNT = "/etc/elastic-ctr"
SHARED_MOUNT = "/var/lib/elastic-ctr"
POD_MODEL_PATH = f"{SHARED_MOUNT}/models"
FILESERVER_ROOT = "/srv/elastic-ctr/files"
CUBE_DATA_DIR = "/var/lib/elastic-ctr-cube"  # per cube pod (emptyDir): the agent re-fetches versions
TRANSFER_CUBE_ROOT = f"{SHARED_MOUNT}/cube"  # cube-transfer's builds and journal, on the shared claim
KEPT_LOGS = f"{SHARED_MOUNT}/logs"  # the training pods' kept logs (ctr_foundation/log_keeper.py), on the claim
MLFLOW_DATA_DIR = "/var/lib/mlflow"

# Component names: the value of app.kubernetes.io/component and the suffix of object names.
COMPONENTS = (
    "config", "mlflow", "fileserver", "pserver", "trainer", "cube", "cube-transfer", "serving", "network-policy",
)  # fmt: skip
# Exit code of a configuration or usage error (ctr_foundation.errors.EXIT_USAGE): the job aborts at once,
# since restarting cannot fix a bad flag or config file.
CONFIG_ERROR_EXIT_CODE = 2
# Seconds a pod keeps serving after it was taken out of its Service (endpoints propagate to every
# node's proxy meanwhile), before it gets SIGTERM.
PRESTOP_SLEEP_SECONDS = 5
# A cube shard is one pod: while its replacement re-seeds (start, download, load: about 8 s for the
# test sizes here) kube-proxy keeps sending the shard's lookups to the terminating pod, which still
# answers (Kubernetes 1.28+ uses terminating endpoints that are still ready when no other exists).
CUBE_PRESTOP_SLEEP_SECONDS = 15
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")

# Longest a pod/host name may be: Volcano names pods JOB-TASK-INDEX and the svc
# plugin uses them as host names, which must be DNS labels.
MAX_NAME_LENGTH = 63
