"""Kubernetes backend: render manifests, apply them (Volcano job + built-in kinds), logs, discovery, status."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from ctr_foundation.errors import UsageError
from ctr_foundation.names import DATA_CONFIG_FILE, MANIFEST_DIR, TOKEN_FILE
from elastic_control.backends.base import Backend
from elastic_control.config import load_data_config
from elastic_control.console import console, done
from elastic_control.plan import Plan

LOG_COMPONENTS = ("trainer-0", "fileserver", "cube-transfer")


def expected_pods(plan: Plan) -> int:
    """Pods -a waits for: the job's pservers and trainers, MLflow, file server, cube shards, transfer, serving."""
    from elastic_control.kube.deploy import expected_pods as expected

    return expected(plan)


class KubeBackend(Backend):
    name = "k8s"

    def render(self, plan: Plan, staging: Path) -> list[Path]:
        from elastic_control.kube.options import KubeOptions
        from elastic_control.kube.render import RenderInputs, render_manifests

        inputs = RenderInputs(
            token=(staging / TOKEN_FILE).read_text().strip(),
            data_config=load_data_config(staging / DATA_CONFIG_FILE),
            service_type=plan.service_type,
            options=KubeOptions.from_json(plan.kube),
        )
        return render_manifests(plan, staging / MANIFEST_DIR, inputs)

    def apply(self, plan: Plan, *, dry_run: str | None = None) -> None:
        from elastic_control.kube.deploy import apply_plan

        apply_plan(plan, dry_run=dry_run)

    def submit_evaluation(self, plan: Plan, request, *, timeout: float, poll: float = 2.0) -> dict:
        """`eval submit`: render the evaluation's Volcano jobs into STATE/eval/RUN/, run them, return the metrics."""
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from elastic_control.kube.deploy import connect
        from elastic_control.kube.eval_job import render_eval_job
        from elastic_control.kube.eval_run import submit_eval_job
        from elastic_control.kube.options import KubeOptions
        from elastic_control.kube.render import RenderInputs

        connect(plan)
        inputs = RenderInputs(
            token=plan.token(),
            data_config=plan.data_config(),
            service_type=plan.service_type,
            options=KubeOptions.from_json(plan.kube),
        )
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
        from elastic_control.kube.deploy import connect

        connect(plan)
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
        from elastic_control.kube.deploy import connect

        connect(plan)
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
            serving_grpc_port=k.SERVING_GRPC_PORT,
        )
        done(f"client configured: {path}")
        return path

    def status(self, plan: Plan) -> None:
        from elastic_control.kube.deploy import connect

        connect(plan)
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
        from elastic_control.kube.deploy import delete_plan

        delete_plan(plan)
