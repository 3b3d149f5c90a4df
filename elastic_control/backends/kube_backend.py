"""Kubernetes backend: render manifests, apply them (Volcano job + built-in kinds), logs, discovery, status."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from ctr_foundation.env_vars import APPLY_TIMEOUT
from ctr_foundation.errors import ApplyError, UsageError
from ctr_foundation.names import DATA_CONFIG_FILE, MANIFEST_DIR, TOKEN_FILE
from elastic_control.backends.base import Backend
from elastic_control.config import load_data_config
from elastic_control.console import console, done, failed, info
from elastic_control.plan import Plan

LOG_COMPONENTS = ("trainer-0", "fileserver", "cube-transfer")


def expected_pods(plan: Plan) -> int:
    """Pods -a waits for: the job's pservers and trainers, MLflow, file server, cube shards, transfer, serving."""
    r = plan.resources
    return r.pservers + r.trainers + 1 + 1 + r.cube_shards + 1 + 1


class KubeBackend(Backend):
    name = "k8s"

    def render(self, plan: Plan, staging: Path) -> list[Path]:
        from elastic_control.kube.render import RenderInputs, render_manifests

        inputs = RenderInputs(
            token=(staging / TOKEN_FILE).read_text().strip(),
            data_config=load_data_config(staging / DATA_CONFIG_FILE),
            service_type=plan.service_type,
        )
        return render_manifests(plan, staging / MANIFEST_DIR, inputs)

    def apply(self, plan: Plan, *, dry_run: str | None = None) -> None:
        from elastic_control.kube import constants as k
        from elastic_control.kube.objects import apply_typed, apply_volcano_job, describe, is_volcano_job
        from elastic_control.kube.preflight import preflight
        from elastic_control.kube.render import load_manifests

        if dry_run not in (None, "client", "server"):
            raise UsageError(f"--dry-run {dry_run!r} must be client or server")
        docs = load_manifests(plan.state_path / MANIFEST_DIR)
        if dry_run == "client":
            for doc in docs:
                sys.stdout.write(f"{describe(doc)} (would be created or replaced)\n")
            info(f"dry run: nothing sent to the cluster; the manifests are in {plan.state_path / MANIFEST_DIR}/")
            return
        preflight(namespace=plan.namespace, queue=plan.queue)
        done(f"preflight: namespace {plan.namespace}, Volcano ({k.VOLCANO_JOB_CRD}), queue {plan.queue} Open")
        for doc in docs:
            result = (apply_volcano_job if is_volcano_job(doc) else apply_typed)(doc, dry_run=dry_run == "server")
            done(f"{describe(doc)} would be {result} (server dry run)" if dry_run else f"{describe(doc)} {result}")
        if dry_run == "server":
            return
        self._wait(plan)

    def _wait(self, plan: Plan) -> None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from elastic_control.kube import constants as k
        from elastic_control.kube.pods import explain_pod, fatal_reason, pod_events, wait_for_pods

        expected, timeout = expected_pods(plan), APPLY_TIMEOUT.get()
        selector = f"{k.LABEL_INSTANCE}={plan.job_name}"
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            task = progress.add_task("pods starting", total=expected)
            ok, count = wait_for_pods(
                plan.namespace,
                selector,
                expected,
                timeout=timeout,
                on_progress=lambda c: progress.update(task, completed=c.started),
            )
        if ok:
            done(
                f"{count.started}/{expected} pods running in namespace {plan.namespace}; "
                "follow training with `elastic-control -l --follow`"
            )
            return
        r = plan.resources
        reasons = [
            explain_pod(p, pod_events(plan.namespace, p.metadata.name), cpu=r.cpu, mem=r.mem)
            for p in sorted(count.stuck, key=lambda p: (fatal_reason(p) is None, p.metadata.name))
        ]
        missing = expected - count.started - len(count.stuck)
        if missing > 0:
            reasons.append(f"{missing} pod(s) not created yet")
        for reason in reasons[1:]:
            failed(reason)
        why = "a pod cannot start" if any(fatal_reason(p) for p in count.stuck) else f"not running after {timeout:g}s"
        raise ApplyError(f"{count.started}/{expected} pods running, {why}: {reasons[0] if reasons else 'unknown'}")

    def submit_evaluation(self, plan: Plan, request, *, timeout: float, poll: float = 2.0) -> dict:
        """`eval submit`: render the evaluation's Volcano jobs into STATE/eval/RUN/, run them, return the metrics."""
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from elastic_control.kube.eval_job import render_eval_job
        from elastic_control.kube.eval_run import submit_eval_job
        from elastic_control.kube.render import RenderInputs

        inputs = RenderInputs(token=plan.token(), data_config=plan.data_config(), service_type=plan.service_type)
        files = render_eval_job(plan, inputs, request, plan.state_path)
        done(f"rendered {files.workers_path} and {files.merge_path}")
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} shares"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("evaluation workers", total=request.workers)
            metrics = submit_eval_job(
                files,
                namespace=plan.namespace,
                queue=plan.queue,
                deployment=plan.job_name,
                timeout=timeout,
                poll=poll,
                progress=lambda message: bar.console.print(f"[green]✓[/green] {message}"),
                warning=lambda message: bar.console.print(f"[yellow]![/yellow] {message}"),
                on_workers=lambda p: bar.update(
                    task, completed=p.succeeded, description=f"evaluation workers ({p.phase}, {p.running} running)"
                ),
            )
        done(
            f"merged: metrics.json, scored.parquet and plots are in {files.output} on the claim "
            f"{plan.job_name}-shared; the merge logged the run to MLflow ({plan.job_name}-mlflow)"
        )
        return metrics

    def logs(self, plan: Plan, *, follow: bool = False, components: list[str] | None = None) -> None:
        from elastic_control.kube.logs import LogPrinter, follow_logs, log_sources, print_logs

        sources = log_sources(plan.job_name)
        wanted = components or list(LOG_COMPONENTS)
        unknown = [c for c in wanted if c not in sources]
        if unknown:
            raise UsageError(f"unknown log component(s) {', '.join(unknown)} (known: {', '.join(sources)})")
        printer = LogPrinter()
        if not follow:
            for name in wanted:
                print_logs(plan.namespace, sources[name], printer)
            return
        stop = threading.Event()
        errors: list[BaseException] = []

        def run(source):
            try:
                follow_logs(plan.namespace, source, printer, stop=stop)
            except BaseException as e:  # noqa: BLE001 - surfaced in the main thread below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(sources[n],), daemon=True, name=f"log-{n}") for n in wanted]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2)
        except KeyboardInterrupt:
            stop.set()
            raise
        if errors:
            raise errors[0]

    def configure_client(self, plan: Plan) -> Path:
        from elastic_control.kube import constants as k
        from elastic_control.kube.discover import configure_client

        path = configure_client(
            namespace=plan.namespace,
            serving_name=f"{plan.job_name}-serving",
            serving_port=k.SERVING_PORT,
            fileserver_name=f"{plan.job_name}-fileserver",
            fileserver_port=k.FILESERVER_PORT,
            state_dir=plan.state_path,
            fallback_slot_conf=plan.slot_conf_text,
            token=plan.token(),
        )
        done(f"client configured: {path}")
        return path

    def status(self, plan: Plan) -> None:
        from rich.console import Console
        from rich.table import Table

        from elastic_control.kube.status import component_rows

        rows = component_rows(plan.namespace, plan.job_name)
        table = Table(title=f"elastic-ctr {plan.job_name} in namespace {plan.namespace}")
        for column in ("component", "kind", "name", "ready", "state"):
            table.add_column(column)
        for row in rows:
            table.add_row(row.component, row.kind, row.name, row.ready, row.state)
        Console(file=sys.stdout, width=120).print(table)

    def delete(self, plan: Plan) -> None:
        from elastic_control.kube.objects import delete_labelled, delete_volcano_job

        if delete_volcano_job(plan.job_name, plan.namespace, wait=120.0):
            done(f"Volcano job {plan.namespace}/{plan.job_name} deleted")
        for what in delete_labelled(plan.namespace, plan.job_name):
            done(f"{what} deleted")
        info(
            f"persistent volume claims (models, files, MLflow runs) are kept; remove them with "
            f"`kubectl delete pvc -n {plan.namespace} -l app.kubernetes.io/instance={plan.job_name}`"
        )
