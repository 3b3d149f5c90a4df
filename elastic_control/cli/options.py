"""Options shared by several commands, declared once."""

from __future__ import annotations

import re

import click

from ctr_foundation.env_vars import STATE_DIR


def _state_dir_fallback(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """A subcommand without its own --state-dir uses the group's (`elastic-control --state-dir X status`)."""
    if value is not None:
        return value
    parent = ctx.find_object(dict) or {}
    return parent.get("state_dir") or STATE_DIR.get()


state_dir_option = click.option(
    "--state-dir",
    default=None,
    show_default=".elastic-ctr or $ELASTIC_CTR_STATE_DIR",
    callback=_state_dir_fallback,
    type=click.Path(file_okay=False),
    help="State folder: rendered plan and manifests, local runtime, logs.",
)


def positive_int(lo: int, hi: int) -> click.IntRange:
    return click.IntRange(lo, hi)


def kube_render_options(func):
    """The Kubernetes options of -r (kept in the plan; `elastic_control.kube.options` validates them)."""
    options = [
        click.option(
            "--context",
            default=None,
            help="kubeconfig context to target (default: the current one); recorded in the plan, and -a, -l, -c, "
            "status and delete refuse to act if it points at another cluster later.",
        ),
        click.option(
            "--storage-class",
            default=None,
            help="StorageClass of the claims (default: the cluster's default class; `kubectl get storageclass`).",
        ),
        click.option(
            "--access-mode",
            type=click.Choice(["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"]),
            default="ReadWriteMany",
            show_default=True,
            help="Access mode of the shared claim (passes, data); ReadWriteOnce schedules every pod that mounts it "
            "onto one node (for classes without ReadWriteMany: EKS gp3, GKE standard, AKS disk, kind, k3s).",
        ),
        click.option(
            "--serving-replicas",
            type=int,
            default=None,
            help="Serving pods behind the serving Service (1-64) [default: 2: one restarts, the other answers].",
        ),
        click.option(
            "--network-policy/--no-network-policy",
            default=True,
            show_default=True,
            help="Render NetworkPolicies: only the instance's own pods reach its pods, except serving's ports "
            "(and the file server's when --service-type exposes it). Label another pod "
            "app.kubernetes.io/instance=JOB, or use `kubectl port-forward`, to reach MLflow or the file server.",
        ),
        click.option(
            "--max-retry",
            type=int,
            default=None,
            help="Restarts of the training job before it is marked Failed, over its whole life (0-10000) "
            "[default: 3; 100 with ONLINE=1].",
        ),
        click.option(
            "--image-pull-policy",
            type=click.Choice(["Always", "IfNotPresent", "Never"]),
            default=None,
            help="[default: Always for :latest or no tag, else IfNotPresent].",
        ),
        click.option(
            "--image-pull-secret",
            "image_pull_secrets",
            multiple=True,
            metavar="SECRET",
            help="Secret (docker-registry) the pods pull the image with; repeatable.",
        ),
        click.option(
            "--data-secret",
            "data_secrets",
            multiple=True,
            metavar="SECRET",
            help="Secret whose keys become environment variables of the pods that read data (pservers, trainers, "
            "cube-transfer, evaluation): AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for s3://; "
            "repeatable.",
        ),
        click.option(
            "--job-ttl",
            default=None,
            metavar="DURATION",
            help="How long the finished training job and its pods (with their logs) stay before Volcano removes "
            "them: seconds, 90m, 24h, 7d, or never [default: 24h]; -a does not run a removed job again.",
        ),
        click.option(
            "--job-progress/--no-job-progress",
            default=True,
            show_default=True,
            help="Trainer 0 publishes pass progress as the job's annotation elastic-ctr/progress, which `status` "
            "shows: -a creates a ServiceAccount, Role and RoleBinding for it (rights the `edit` ClusterRole lacks; "
            "without them, pass --no-job-progress).",
        ),
        click.option(
            "--prometheus-operator/--no-prometheus-operator",
            default=None,
            help="Render ServiceMonitors (serving, cube) and a PrometheusRule with the alerts instead of the alerts' "
            "ConfigMap [default: when the cluster serves monitoring.coreos.com/v1].",
        ),
        click.option(
            "--monitoring-label",
            "monitoring_labels",
            multiple=True,
            metavar="KEY=VALUE",
            help="Label the ServiceMonitors and the PrometheusRule carry besides the project's: what the cluster's "
            "Prometheus selects them by (kube-prometheus-stack: release=RELEASE); repeatable.",
        ),
        click.option(
            "--pod-overlay",
            type=click.Path(dir_okay=False),
            default=None,
            help="YAML merged into every pod: nodeSelector, tolerations, affinity, labels, annotations, "
            "priorityClassName.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


class Duration(click.ParamType):
    """A duration as ``kubectl logs --since`` takes it: ``90s``, ``10m``, ``1h30m``, ``2d``, or plain seconds."""

    name = "duration"
    UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    _PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, (int, float)):
            seconds = float(value)
        else:
            text = str(value).strip().lower()
            try:
                seconds = float(text)
            except ValueError:
                parts = self._PART.findall(text)
                if not parts or "".join(n + u for n, u in parts) != text:
                    self.fail(f"{value!r} is not a duration: use e.g. 30s, 10m, 1h30m or 2d", param, ctx)
                seconds = sum(float(n) * self.UNITS[u] for n, u in parts)
        if seconds <= 0:
            self.fail(f"{value!r} is not a positive duration", param, ctx)
        return seconds


DURATION = Duration()
