"""TRAINING_ROLE=PSERVER: serve the sparse table and dense parameters until the trainers finish, then exit.

Paddle's ``fleet.run_server()`` never returns by itself. Trainer 0 asks the
servers to stop once every trainer has finished (``stop_server``); as a
safety net each pserver also watches the coordinator and exits on its own a
short grace period after the job has finished.
"""

from __future__ import annotations

import os
import shutil
import time

from ctr_foundation.errors import ConfigError
from ctr_foundation.pass_format import SPARSE_DIR
from elastic_control.training.coordinator import Coordinator, CoordinatorClient, coordinator_endpoint
from elastic_control.training.model import build_training_net, make_strategy, table_shards
from elastic_control.training.resume import remove_stale_staging, resume_point
from elastic_control.training.settings import RoleSettings

# After the job finished, how long run_server may take to return before the process exits anyway.
EXIT_GRACE_SECONDS = 15.0


def _log(settings: RoleSettings, message: str) -> None:
    print(f"[pserver {_my_index(settings)}] {message}", flush=True)


def _my_index(settings: RoleSettings) -> int:
    me = f"{settings.pod_ip}:{settings.port}"
    endpoints = [e.strip() for e in settings.pserver_endpoints.split(",")]
    if me not in endpoints:
        raise ConfigError(
            f"this pserver's POD_IP:PADDLE_PORT {me} is not in PADDLE_PSERVERS_IP_PORT_LIST "
            f"{settings.pserver_endpoints}"
        )
    return endpoints.index(me)


def run_pserver(settings: RoleSettings) -> None:
    import multiprocessing

    index = _my_index(settings)
    start = resume_point(settings.model_path)
    if index == 0:
        removed = remove_stale_staging(settings.model_path)
        if removed:
            _log(settings, f"removed unfinished pass staging folders: {', '.join(removed)}")
    # fleet.run_server() holds the GIL while it serves, so the coordinator and the
    # exit guard cannot be threads of this process: they run in a child process.
    guard = multiprocessing.get_context("spawn").Process(
        target=guard_main,
        name=f"pserver-{index}-guard",
        daemon=True,
        args=(settings.pserver_endpoints, settings.trainers, index, start, os.getpid()),
    )
    guard.start()

    import pyarrow  # noqa: F401  (before paddle)

    import paddle
    import paddle.distributed.fleet as fleet

    # function-level: they import pyarrow (imported just above, before paddle, on purpose)
    from elastic_control.training import delta_export
    from elastic_control.training.admission import embedding_hook
    from elastic_control.training.table_files import table_parts

    paddle.enable_static()
    fleet.init(is_collective=False)
    spec = settings.model_spec()
    config = settings.data_config
    # The same program and table settings as the trainers' (admission adds its mask inputs).
    hook = embedding_hook(paddle) if config.admit_min_count else None
    net = build_training_net(paddle, spec, embedding_hook=hook)
    shards = table_shards(settings.pservers)
    strategy = make_strategy(fleet, spec, shards=shards, accessor=delta_export.accessor_overrides(config))
    fleet.distributed_optimizer(paddle.optimizer.Adam(spec.learning_rate), strategy).minimize(net.loss)
    saved_shards = len(table_parts(os.path.join(start["last_pass_dir"], SPARSE_DIR))) if start.get("last_pass") else 0
    if start.get("last_pass") and (config.incremental or saved_shards != shards):
        # Deltas (and pending keys) hold part of the table each, and a pass saved with another shard count
        # has this pserver's keys in other files: assemble its shards (Paddle loads only a table of as many).
        out = os.path.join(settings.model_path, f"{delta_export.RESUME_PREFIX}{start['last_pass']}-ps{index}")
        t = time.monotonic()
        delta_export.assemble_resume_table(
            start["last_pass_dir"],
            out,
            shards=shards,
            mine=delta_export.local_shards(index, settings.pservers, shards),
            log=lambda m: _log(settings, f"resuming: {m}"),
        )
        _log(settings, f"resuming: loading the whole table of {start['last_pass']} ({time.monotonic() - t:.1f}s)")
        try:
            fleet.init_server(out)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    elif start.get("last_pass"):
        sparse_dir = os.path.join(start["last_pass_dir"], SPARSE_DIR)
        _log(settings, f"resuming: loading the sparse table of {start['last_pass']} from {sparse_dir}")
        fleet.init_server(sparse_dir)
    else:
        fleet.init_server()
    _log(settings, f"serving on {settings.pod_ip}:{settings.port}")
    if exit_on_sigterm():
        _log(settings, "PID 1 of its container: SIGTERM ends it at once (exit code 15)")
    fleet.run_server()
    _log(settings, "stopped by trainer 0 after all trainers finished")
    # Trainer 0 stops the servers as soon as its reply to the last barrier arrives; the other trainers'
    # replies to the same barrier may still be in the coordinator's threads (pserver 0's guard), and ending
    # it at once lost one ("closed the connection during barrier"). A moment lets them go out.
    guard.join(1.0)
    guard.terminate()
    guard.join(5)


def exit_on_sigterm() -> bool:
    """As PID 1 (a container's process: the pod runs ``exec elastic-control role``), make SIGTERM end the
    process at once; returns whether it did. The kernel does not deliver a signal whose action is the
    default to PID 1 of a PID namespace, so without a handler the kubelet's SIGTERM is ignored and the pod
    waits out its grace period before SIGKILL. A Python handler would never run either: run_server() serves
    in C++ holding the GIL and does not return to the interpreter. libc's ``_exit`` is itself a valid,
    async-signal-safe handler (``void (int)``): the process exits at once with the signal's number, 15.
    Elsewhere (the local backend's process groups) SIGTERM keeps its default action."""
    import ctypes
    import signal

    if os.getpid() != 1:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGTERM, ctypes.cast(libc._exit, ctypes.c_void_p))
    return True


def guard_main(pserver_endpoints: str, trainers: int, index: int, hello: dict, parent_pid: int) -> None:
    """Child process of a pserver: pserver 0's hosts the coordinator; every guard ends its pserver
    a grace period after the job finished, in case stop_server did not reach it."""
    import signal

    host, port = coordinator_endpoint(pserver_endpoints)
    if index == 0:
        coordinator = Coordinator(trainers, hello=lambda: hello)
        coordinator.serve_in_thread("0.0.0.0" if host not in ("127.0.0.1", "localhost") else host, port)
        while not coordinator.wait_all_finished(timeout=1.0):
            if os.getppid() != parent_pid:  # the pserver died: nothing left to coordinate
                return
    else:
        client = CoordinatorClient(host, port, connect_timeout=30)
        seen = False
        while os.getppid() == parent_pid:
            time.sleep(2)
            try:
                if client.status().get("finished"):
                    break
                seen = True
            except Exception:  # noqa: BLE001 - any failure to reach pserver 0 means the same here
                if seen:  # pserver 0 went away after we had talked to it: the job is over
                    break
        else:
            return
    deadline = time.monotonic() + EXIT_GRACE_SECONDS
    while time.monotonic() < deadline:
        if os.getppid() != parent_pid:
            return
        time.sleep(0.2)
    print(f"[pserver {index}] the job finished but the server did not stop; ending it", flush=True)
    try:
        os.kill(parent_pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
