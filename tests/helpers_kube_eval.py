"""Volcano's job controller and the kubelet, played for evaluation jobs in FakeKubeAPI.

``VolcanoEvalController`` is passed as ``FakeKubeAPI(on_volcano_job=...)``.
For every job it runs each pod through ``run_pod(pod) -> (exit_code, log
lines)`` (in parallel, like pods on nodes), marks the pods Succeeded or
Failed, and applies the job's policies as Volcano does for the ones the
evaluation uses: a failed pod of a task with ``PodFailed -> RestartTask``
deletes every pod of that task and creates them again (new uids, counted in
``status.retryCount``) until ``maxRetry``; then the job is Failed. A job whose
pods all succeeded is Completed.

``local_pod_runner`` runs a pod's real container command (``/bin/sh -c
ENTRY``) as a local process: the pod's mount points are mapped to local
folders, VC_TASK_INDEX comes from the pod's task index (as Volcano's env
plugin sets it), and the container's plain env values are passed on.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers_kube_api import VOLCANO, now


class VolcanoEvalController:
    def __init__(self, run_pod, *, fail_first=(), kill_after: float = 1.0):
        self.run_pod = run_pod
        self.fail_first = set(fail_first)  # (task, index) whose first attempt is killed (a lost worker)
        self.kill_after = kill_after
        self.threads: list[threading.Thread] = []
        self.attempts: dict[tuple[str, str, int], int] = {}
        self.errors: list[BaseException] = []
        self.created: list[tuple[str, dict]] = []

    def __call__(self, api, ns, job):
        # What the other jobs' phases were when this one was created (ordering checks).
        self.created.append(
            (
                job["metadata"]["name"],
                {
                    j["metadata"]["name"]: j["status"]["state"]["phase"]
                    for j in api.items(VOLCANO, "jobs", ns)
                    if j is not job
                },
            )
        )
        thread = threading.Thread(target=self._drive, args=(api, ns, job["metadata"]["name"]), daemon=True)
        self.threads.append(thread)
        thread.start()

    def _drive(self, api, ns, name):
        try:
            while not self._round(api, ns, name):
                pass
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            self.errors.append(e)

    def _round(self, api, ns, name) -> bool:
        """Run the job's live pods once; True when the job reached a final phase."""
        with api.lock:
            job = api.get(VOLCANO, "jobs", ns, name)
            if job is None:
                return True
            pods = [p for p in api.pods(ns, **{"volcano.sh/job-name": name}) if p["status"]["phase"] == "Running"]
        with cf.ThreadPoolExecutor(max_workers=max(1, len(pods))) as pool:
            results = list(pool.map(self._attempt, [name] * len(pods), pods))
        failed_tasks = set()
        with api.lock:
            job = api.get(VOLCANO, "jobs", ns, name)
            if job is None:
                return True
            for pod, (code, lines) in zip(pods, results, strict=True):
                api.logs[pod["metadata"]["uid"]] = lines
                pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
                for status in pod["status"].get("containerStatuses", []):
                    status["ready"] = False
                    status["state"] = {
                        "terminated": {
                            "exitCode": code,
                            "reason": "Completed" if code == 0 else "Error",
                            "startedAt": now(),
                            "finishedAt": now(),
                        }
                    }
                if code != 0:
                    failed_tasks.add(pod["metadata"]["labels"]["volcano.sh/task-spec"])
            status = job["status"]
            if not failed_tasks:
                status.update(state={"phase": "Completed"}, running=0, succeeded=len(pods))
                return True
            retry = int(status.get("retryCount", 0))
            tasks = {t["name"]: t for t in job["spec"]["tasks"]}
            restartable = all(
                any(
                    p.get("event") == "PodFailed" and p.get("action") == "RestartTask"
                    for p in tasks[t].get("policies", [])
                )
                for t in failed_tasks
            )
            if not restartable or retry >= job["spec"].get("maxRetry", 3):
                status.update(state={"phase": "Failed"}, running=0, failed=len(failed_tasks))
                return True
            # RestartTask: every pod of the task goes, finished ones too, and is created again.
            status.update(state={"phase": "Running"}, retryCount=retry + 1)
            for task_name in failed_tasks:
                task = tasks[task_name]
                for pod in api.pods(ns, **{"volcano.sh/job-name": name, "volcano.sh/task-spec": task_name}):
                    api.store.pop(("v1", "pods", ns, pod["metadata"]["name"]), None)
                for i in range(task.get("replicas", 1)):
                    api._volcano_pod(ns, name, task, i, log=[])
            return False

    def _attempt(self, job_name, pod):
        labels = pod["metadata"]["labels"]
        key = (job_name, labels["volcano.sh/task-spec"], int(labels["volcano.sh/task-index"]))
        self.attempts[key] = self.attempts.get(key, 0) + 1
        lost = key[1:] in self.fail_first and self.attempts[key] == 1
        return self.run_pod(pod, kill_after=self.kill_after if lost else None)

    def join(self, timeout: float = 10.0) -> None:
        for thread in self.threads:
            thread.join(timeout)
        if self.errors:
            raise self.errors[0]


def local_pod_runner(mounts: dict[str, Path], *, env_overrides: dict[str, str] | None = None, timeout: float = 240):
    """run_pod for VolcanoEvalController: the pod's real shell line as a local process."""

    def local_path(text: str) -> str:
        for pod_path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            text = text.replace(pod_path, str(local))
        return text

    def run(pod, kill_after=None):
        container = pod["spec"]["containers"][0]
        assert container["command"][:2] == ["/bin/sh", "-c"], container["command"]
        entry = local_path(container["command"][2])
        env = dict(os.environ)
        env.update({e["name"]: local_path(e["value"]) for e in container.get("env", []) if "value" in e})
        env.update(env_overrides or {})
        env["VC_TASK_INDEX"] = pod["metadata"]["labels"]["volcano.sh/task-index"]  # the env plugin's variable
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        proc = subprocess.Popen(
            ["/bin/sh", "-c", entry], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        if kill_after is not None:  # a worker lost mid-share (OOM kill, node gone)
            time.sleep(kill_after)
            proc.kill()
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        return code, output.splitlines()

    return run


def deployment_objects(api, job="elastic-ctr", ns="default"):
    """What `-a` leaves behind that the evaluation pods mount."""
    api._put(
        "v1",
        "configmaps",
        ns,
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{job}-config"},
            "data": {"data.config": "", "slot.conf": ""},
        },
    )
    api._put(
        "v1",
        "persistentvolumeclaims",
        ns,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": f"{job}-shared"},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
            "status": {"phase": "Bound"},
        },
    )
