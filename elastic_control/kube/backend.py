"""Kubernetes backend: render manifests, apply them (Volcano job + built-in kinds), logs, discovery, status.

``KubeBackend.apply`` creates the objects and returns a ``KubeDeployment``,
the handle that waits for the pods, reports status, streams logs and deletes.

Importing this module does not load the kubernetes client (``kube.adaptor``, ~0.7 s): ``api`` imports it
for every deployment, local ones too, so the modules that talk to a cluster are imported in the methods.
"""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from ctr_foundation.names import DATA_CONFIG_FILE, MANIFEST_DIR, TOKEN_FILE
from elastic_control.backends import status as st
from elastic_control.backends.base import Backend, Deployment
from elastic_control.config import load_data_config
from elastic_control.console import console, done
from elastic_control.kube import constants as k
from elastic_control.kube.eval_job import render_eval_job
from elastic_control.kube.options import KubeOptions
from elastic_control.kube.render import RenderInputs, render_manifests
from elastic_control.plan import Plan

# The status words of `kube.status.component_rows` in the status document's terms.
_JOB_PHASES = {
    "Pending": st.STARTING,
    "Running": st.RUNNING,
    "Restarting": st.RESTARTING,
    "Completing": st.RUNNING,
    "Completed": st.COMPLETED,
    "Removed": st.COMPLETED,  # finished, then removed by its ttlSecondsAfterFinished (kube/status.py)
    "Failed": st.FAILED,
    "Aborting": st.FAILED,
    "Aborted": st.FAILED,
    "Terminating": st.STOPPED,
    "Terminated": st.STOPPED,
    "absent": st.MISSING,
}
_DEPLOYMENT_STATES = {"Ready": st.RUNNING, "Starting": st.STARTING}


def expected_pods(plan: Plan) -> int:
    """Pods -a waits for: the job's pservers and trainers, MLflow, file server, cube shards, transfer, serving."""
    # function-level: loads the kubernetes client (~0.7 s)
    from elastic_control.kube.deploy import expected_pods as expected

    return expected(plan)


class KubeDeployment(Deployment):
    """The objects of one plan in its namespace."""

    def wait(self, timeout: float | None = None) -> None:
        """Until every pod of the plan runs; explains what keeps pods from existing or starting (kube/deploy.py)."""
        # function-level: loads the kubernetes client (~0.7 s)
        from elastic_control.kube.deploy import wait_for_plan

        wait_for_plan(self.plan, timeout=timeout)

    def status(self, *, probe: bool = True) -> st.PipelineStatus:
        """The Volcano job and every Deployment of the instance, as the status document."""
        import time

        # function-level: loads the kubernetes client (~0.7 s)
        from elastic_control.kube.status import component_rows

        plan = self.plan
        rows = component_rows(plan.namespace, plan.job_name)
        components = []
        training: dict = {}
        for row in rows:
            if row.kind == "Job":
                phase = row.state.split(" ", 1)[0]
                state = _JOB_PHASES.get(phase, st.STARTING)
                training = {"state": state, "phase": phase, "detail": row.state, "ready": row.ready}
                if row.progress:
                    training["progress"] = row.progress
            else:
                state = _DEPLOYMENT_STATES.get(row.state, st.STARTING)
            components.append(
                st.ComponentStatus(
                    name=row.name, kind=row.component, state=state, ready=row.ready, detail=f"{row.kind} {row.state}"
                )
            )
        if all(c.state == st.MISSING for c in components):
            overall = "not deployed"
        elif all(c.state in (st.RUNNING, st.COMPLETED) for c in components):
            overall = st.RUNNING
        else:
            overall = st.STARTING
        status = st.PipelineStatus(
            backend="k8s",
            state_dir=str(plan.state_dir),
            target=f"elastic-ctr {plan.job_name} in namespace {plan.namespace}",
            state=overall,
            controller={"kind": "kubernetes", "namespace": plan.namespace, "job": plan.job_name},
            components=components,
            training=training,
            probed_at=time.time(),
        )
        if probe and overall != "not deployed":
            # function-level: loads the kubernetes client (~0.7 s)
            from elastic_control.kube.service_probe import probe_pipeline

            status.cube, status.serving = probe_pipeline(plan.namespace, plan.job_name, plan.resources.cube_shards)
            for c in components:
                if c.kind == "serving" and status.serving.get("version"):
                    c.version = status.serving["version"]
            if training.get("state") == st.FAILED:
                status.alerts.append(f"training failed: {training.get('detail')}")
            status.alerts += st.service_alerts(status)
        return status

    def stream_logs(
        self,
        *,
        components: list[str] | None = None,
        follow: bool = False,
        out: TextIO | None = None,
        tail: int | None = None,
        raw: bool = False,
    ) -> None:
        """The CLI's ``-l`` (kube/logs.py, the one owner): kept logs of earlier pods, a restarted container's
        previous log, then the current one (every line unless ``tail``)."""
        # function-level: loads the kubernetes client (~0.7 s)
        from elastic_control.kube.logs import stream_logs

        stream_logs(self.plan, components=components, follow=follow, tail=tail, raw=raw, out=out)

    def delete(self) -> list[str]:
        # function-level: loads the kubernetes client (~0.7 s)
        from elastic_control.kube.deploy import delete_plan

        return delete_plan(self.plan)


class KubeBackend(Backend):
    name = "k8s"

    def render(self, plan: Plan, staging: Path) -> list[Path]:
        inputs = RenderInputs(
            token=(staging / TOKEN_FILE).read_text().strip(),
            data_config=load_data_config(staging / DATA_CONFIG_FILE),
            service_type=plan.service_type,
            options=KubeOptions.from_json(plan.kube),
        )
        return render_manifests(plan, staging / MANIFEST_DIR, inputs)

    def apply(self, plan: Plan, *, dry_run: str | None = None) -> KubeDeployment | None:
        """Converge the cluster on the rendered manifests (kube/converge.py); the handle, None for a dry run."""
        # function-level: loads the kubernetes client (~0.7 s)
        from elastic_control.kube.deploy import apply_plan

        return KubeDeployment(plan) if apply_plan(plan, dry_run=dry_run) else None

    def attach(self, plan: Plan) -> KubeDeployment:
        """The handle on the plan's objects, after checking its context still points at its cluster."""
        # function-level: loads the kubernetes client (~0.7 s)
        from elastic_control.kube.deploy import connect

        connect(plan)
        return KubeDeployment(plan)

    def submit_evaluation(self, plan: Plan, request, *, timeout: float, poll: float = 2.0) -> dict:
        """`eval submit`: render the evaluation's Volcano jobs into STATE/eval/RUN/, run them, return the metrics."""
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        # function-level: loads the kubernetes client (~0.7 s)
        from elastic_control.kube.deploy import connect
        from elastic_control.kube.eval_run import submit_eval_job

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

    def configure_client(self, plan: Plan) -> Path:
        # function-level: loads the kubernetes client (~0.7 s)
        from elastic_control.kube.deploy import connect
        from elastic_control.kube.discover import configure_client

        connect(plan)
        path = configure_client(
            namespace=plan.namespace,
            serving_name=f"{plan.job_name}-serving",
            serving_port=k.SERVING_PORT,
            serving_grpc_port=k.SERVING_GRPC_PORT,
            fileserver_name=f"{plan.job_name}-fileserver",
            fileserver_port=k.FILESERVER_PORT,
            state_dir=plan.state_path,
            fallback_slot_conf=plan.slot_conf_text,
            token=plan.token(),
        )
        done(f"client configured: {path}")
        return path
