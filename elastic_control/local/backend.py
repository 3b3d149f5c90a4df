"""Local backend: the whole pipeline as supervised processes on this machine.

-r plans every component on free loopback ports (local/components.json) after
checking that the data window has something to train on (under a running
pipeline, planned components keep their ports); -a starts a detached
supervisor (elastic_control.local.supervisor), or converges the running one on
the plan (local/converge.py), and returns a LocalDeployment,
the handle -l, status and delete also use (LocalBackend.attach).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ctr_foundation.atomic import atomic_write_json, atomic_write_text
from ctr_foundation.env_vars import MLFLOW_TRACKING_URI
from ctr_foundation.errors import ComponentError, UsageError
from ctr_foundation.fileserver_client import FileServerClient
from ctr_foundation.names import DATA_CONFIG_FILE, REMOTE_SLOT_CONF, StateFolder
from ctr_foundation.records import ClientConfig
from elastic_control.backends.base import Backend
from elastic_control.config import load_data_config, parse_slot_conf
from elastic_control.config.data_config import parse_data_config
from elastic_control.console import done, info
from elastic_control.data.window import check_data_window
from elastic_control.local import lifecycle
from elastic_control.local import runtime as rt
from elastic_control.local.components import (
    FILESERVER,
    MLFLOW,
    SERVING,
    credentials_of,
    elastic_control_argv,
    local_data_config,
    plan_components,
    resolve_model_path,
    training_window,
)
from elastic_control.local.deployment import LocalDeployment
from elastic_control.local.spec import load_local_plan, save_local_plan
from elastic_control.plan import Plan


class LocalBackend(Backend):
    name = "local"

    def render(self, plan: Plan, staging: Path) -> list[Path]:
        """Plan every component on free ports into ``staging/local/``; nothing starts.

        Refuses an offline data window without a single complete hour (it would train nothing).
        """
        final = StateFolder.of(plan.state_dir)
        # Under a running pipeline every planned component keeps its ports (-c, -l and status stay right,
        # and -a restarts only what the new plan changes: local/converge.py).
        keep = None
        if rt.supervisor_info(final).alive and final.components_file.exists():
            keep = {c.name: c.all_ports for c in load_local_plan(final.components_file).components}
        cfg = load_data_config(staging / DATA_CONFIG_FILE)
        base = Path.cwd()
        model_path = resolve_model_path(cfg, final, base)
        text = local_data_config(cfg, hdfs_address=plan.hdfs_address, model_path=model_path, base=base)
        # What the components will read (absolute paths, -hd applied), named as the user's file in errors.
        resolved = parse_data_config(text, source=plan.data_config_path, env={})
        check_data_window(resolved)
        credentials = credentials_of(cfg)
        local_plan = plan_components(
            plan,
            final,
            model_path=model_path,
            max_job_restarts=int(plan.extra.get("max_job_restarts", 3)),
            window=training_window(resolved),
            credentials=sorted(credentials),
            keep_ports=keep,
        )
        # local/ also holds the running supervisor's lock, runtime.json and rollouts.json: under a running
        # pipeline the plan's files are replaced one by one in it (each atomically), not the folder.
        staged = final if keep is not None else StateFolder(staging)
        staged.local_dir.mkdir(parents=True, exist_ok=True)
        components, data_config = staged.components_file, staged.local_data_config
        atomic_write_text(data_config, text)
        written = [data_config]
        if credentials:  # handed to the components by the supervisor, as the token (mode 0600)
            atomic_write_json(staged.credentials_file, credentials)
            os.chmod(staged.credentials_file, 0o600)
            written.append(staged.credentials_file)
        else:
            staged.credentials_file.unlink(missing_ok=True)
        save_local_plan(local_plan, components)  # last: a plan implies its files
        return [components, *written]

    def apply(self, plan: Plan, *, dry_run: str | None = None) -> LocalDeployment | None:
        layout = StateFolder.of(plan.state_dir)
        if rt.supervisor_info(layout).alive:
            lifecycle.converge(layout, dry_run=bool(dry_run))
            return None if dry_run else LocalDeployment(plan, ready=True)
        if dry_run:
            local_plan = load_local_plan(layout.components_file)
            info(f"would start {len(local_plan.components)} local processes (nothing started: --dry-run):")
            for c in local_plan.components:
                info(f"  {c.name:<16} port {c.port or '-':<6} {' '.join(c.argv)}")
            return None
        return LocalDeployment(plan, supervisor=lifecycle.start(layout))

    def attach(self, plan: Plan) -> LocalDeployment:
        load_local_plan(StateFolder.of(plan.state_dir).components_file)  # a clear error if -r did not plan locally
        return LocalDeployment(plan)

    def configure_client(self, plan: Plan) -> Path:
        """Write STATE/client.json for the local serving, with slot.conf fetched from the file server."""
        layout = StateFolder.of(plan.state_dir)
        local_plan = load_local_plan(layout.components_file)
        if not rt.supervisor_info(layout).alive:
            raise UsageError(f"the pipeline in {layout.state}/ is not running: run `elastic-control -a` first")
        fileserver_url = f"http://127.0.0.1:{local_plan.by_name(FILESERVER).port}"
        serving = local_plan.by_name(SERVING)
        serving_url = f"http://127.0.0.1:{serving.port}"
        serving_grpc = f"127.0.0.1:{serving.extra_ports[0]}" if serving.extra_ports else None
        try:
            # config/ is readable only with the deployment's token (docs/contracts.md, "HTTP rules").
            fs = FileServerClient(fileserver_url, token=plan.token(), timeout=10)
            text = fs.get_bytes(REMOTE_SLOT_CONF).decode("utf-8")
        except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
            raise ComponentError(
                f"could not fetch slot.conf from the file server at {fileserver_url}: {e}; see `elastic-control status`"
            ) from e

        slots = parse_slot_conf(text, f"{fileserver_url}/files/config/slot.conf")
        slot_path = layout.client_slot_conf
        atomic_write_text(slot_path, text)
        ClientConfig(serving_url, fileserver_url, str(slot_path), tuple(slots.slots), serving_grpc).save(
            layout.client_config
        )
        grpc_text = f", gRPC {serving_grpc}" if serving_grpc else ""
        done(
            f"client configured: {layout.client_config} (serving {serving_url}{grpc_text}, "
            f"file server {fileserver_url})"
        )
        state_flag = "" if str(plan.state_dir) in (".elastic-ctr", "") else f" --state-dir {plan.state_dir}"
        info(
            f"next: elastic-control predict{state_flag} FILE   (one slot-format line per example, "
            "prints one click probability per line)"
        )
        return layout.client_config

    def submit_evaluation(self, plan: Plan, request, *, timeout: float, poll: float = 2.0) -> dict:
        """`eval submit` locally: the cluster job's worker + merge as one `elastic-control eval` process.

        It reads the plan's data.config and MODEL_PATH, keeps its partials in
        STATE/eval/RUN/partials (a resubmission reuses complete shares), writes
        metrics.json, scored.parquet and plots to STATE/eval/RUN/out and records
        the run in the pipeline's MLflow while it runs (else the store in MODEL_PATH).
        """
        layout = StateFolder.of(plan.state_dir)
        local_plan = load_local_plan(layout.components_file)

        def pass_dir(name: str | None) -> str | None:
            if not name:
                return None
            path = Path(name) if os.path.isabs(name) else Path(local_plan.model_path or "") / name
            if not path.is_dir():
                raise UsageError(
                    f"the local backend evaluates the passes of its MODEL_PATH {local_plan.model_path}: "
                    f"no pass {name!r} there (looked for {path})"
                )
            return str(path)

        run = request.run_name()
        folder = layout.state / "eval" / run
        argv = elastic_control_argv(
            "eval",
            "--model",
            pass_dir(request.model),
            "-f",
            str(layout.local_data_config),
            "--workers",
            str(request.workers),
            "--ndcg-k",
            str(request.ndcg_k),
            "--partial-out",
            str(folder / "partials"),
            "--output",
            str(folder / "out"),
            "--json",
        )
        for flag, value in (
            ("--baseline", pass_dir(request.baseline)),
            ("--group-slot", request.group_slot),
            ("--start", request.start),
            ("--end", request.end),
        ):
            if value is not None:
                argv += [flag, str(value)]
        env = dict(os.environ)
        if rt.supervisor_info(layout).alive:
            env[MLFLOW_TRACKING_URI.name] = f"http://127.0.0.1:{local_plan.by_name(MLFLOW).port}"
        info(f"evaluation {run}: {request.workers} worker process(es) on {local_plan.model_path}")
        try:
            proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ComponentError(
                f"the evaluation did not finish within {timeout:g}s (partials kept in {folder})"
            ) from e
        if proc.returncode != 0:
            raise ComponentError(f"the evaluation failed (exit code {proc.returncode}); its messages are above")
        metrics = None
        # The metrics document is one JSON line; MLflow may print its run links after it.
        for line in reversed(proc.stdout.splitlines()):
            try:
                found = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(found, dict) and "model" in found:
                metrics = found
                break
        if metrics is None:
            raise ComponentError(f"the evaluation printed no metrics document: {proc.stdout[-300:]!r}")
        done(f"metrics.json, scored.parquet and plots are in {folder / 'out'}")
        return metrics
