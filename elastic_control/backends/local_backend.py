"""Local backend: the whole pipeline as supervised processes on this machine.

-r plans every component on free loopback ports (local/components.json);
-a starts a detached supervisor (elastic_control.local.supervisor); -l, -c,
status and delete read what it records in the state folder.
"""

from __future__ import annotations

from pathlib import Path

from ctr_foundation.atomic import atomic_write_text
from ctr_foundation.errors import ComponentError, UsageError
from ctr_foundation.names import DATA_CONFIG_FILE, REMOTE_SLOT_CONF, StateFolder
from ctr_foundation.records import ClientConfig
from elastic_control.backends.base import Backend
from elastic_control.config import load_data_config
from elastic_control.console import done, info
from elastic_control.local import lifecycle
from elastic_control.local.components import (
    FILESERVER,
    SERVING,
    local_data_config,
    plan_components,
    resolve_model_path,
)
from elastic_control.local.spec import load_local_plan, save_local_plan
from elastic_control.plan import Plan


class LocalBackend(Backend):
    name = "local"

    def render(self, plan: Plan, staging: Path) -> list[Path]:
        """Plan every component on free ports into ``staging/local/``; nothing starts."""
        from elastic_control.local import runtime as rt

        final = StateFolder.of(plan.state_dir)
        running = rt.supervisor_info(final)
        if running.alive:
            # New ports under a running pipeline would point -c, -l and status at the wrong processes.
            raise UsageError(
                f"the pipeline in {final.state}/ is running (supervisor pid {running.pid}); stop it with "
                "`elastic-control delete` before -r, or render into another --state-dir"
            )
        cfg = load_data_config(staging / DATA_CONFIG_FILE)
        base = Path.cwd()
        model_path = resolve_model_path(cfg, final, base)
        local_plan = plan_components(
            plan, final, model_path=model_path, max_job_restarts=int(plan.extra.get("max_job_restarts", 3))
        )
        staged = StateFolder(staging)
        staged.local_dir.mkdir(parents=True, exist_ok=True)
        components, data_config = staged.components_file, staged.local_data_config
        save_local_plan(local_plan, components)
        atomic_write_text(
            data_config, local_data_config(cfg, hdfs_address=plan.hdfs_address, model_path=model_path, base=base)
        )
        return [components, data_config]

    def apply(self, plan: Plan, *, dry_run: str | None = None) -> None:
        layout = StateFolder.of(plan.state_dir)
        if dry_run:
            local_plan = load_local_plan(layout.components_file)
            info(f"would start {len(local_plan.components)} local processes (nothing started: --dry-run):")
            for c in local_plan.components:
                info(f"  {c.name:<16} port {c.port or '-':<6} {' '.join(c.argv)}")
            return
        lifecycle.apply(layout)

    def logs(self, plan: Plan, *, follow: bool = False, components: list[str] | None = None) -> None:
        from elastic_control.local.logs_view import show_logs

        show_logs(StateFolder.of(plan.state_dir), follow=follow, components=components)

    def configure_client(self, plan: Plan) -> Path:
        """Write STATE/client.json for the local serving, with slot.conf fetched from the file server."""
        from ctr_foundation.fileserver_client import FileServerClient
        from elastic_control.local import runtime as rt

        layout = StateFolder.of(plan.state_dir)
        local_plan = load_local_plan(layout.components_file)
        if not rt.supervisor_info(layout).alive:
            raise UsageError(f"the pipeline in {layout.state}/ is not running: run `elastic-control -a` first")
        fileserver_url = f"http://127.0.0.1:{local_plan.by_name(FILESERVER).port}"
        serving_url = f"http://127.0.0.1:{local_plan.by_name(SERVING).port}"
        try:
            # config/ is readable only with the deployment's token (docs/contracts.md, "HTTP rules").
            fs = FileServerClient(fileserver_url, token=plan.token(), timeout=10)
            text = fs.get_bytes(REMOTE_SLOT_CONF).decode("utf-8")
        except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
            raise ComponentError(
                f"could not fetch slot.conf from the file server at {fileserver_url}: {e}; see `elastic-control status`"
            ) from e
        from elastic_control.config import parse_slot_conf

        slots = parse_slot_conf(text, f"{fileserver_url}/files/config/slot.conf")
        slot_path = layout.client_slot_conf
        atomic_write_text(slot_path, text)
        ClientConfig(serving_url, fileserver_url, str(slot_path), tuple(slots.slots)).save(layout.client_config)
        done(f"client configured: {layout.client_config} (serving {serving_url}, file server {fileserver_url})")
        state_flag = "" if str(plan.state_dir) in (".elastic-ctr", "") else f" --state-dir {plan.state_dir}"
        info(
            f"next: elastic-control predict{state_flag} FILE   (one slot-format line per example, "
            "prints one click probability per line)"
        )
        return layout.client_config

    def status(self, plan: Plan) -> None:
        from elastic_control.local.status_view import collect_status, print_status

        print_status(collect_status(StateFolder.of(plan.state_dir)))

    def delete(self, plan: Plan) -> None:
        layout = StateFolder.of(plan.state_dir)
        stopped = lifecycle.delete(layout)
        if stopped:
            done(f"stopped {', '.join(stopped)}; data, models and logs are kept in {layout.state}/")
        else:
            done(f"nothing was running in {layout.state}/; data, models and logs are kept")
