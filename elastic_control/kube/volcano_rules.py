"""The checks Volcano's admission webhook makes on a Job that its CRD schema cannot express.

Run on every rendered training job (so ``-r`` fails instead of ``-a``) and
in the tests. Mirrors pkg/webhooks/admission/jobs/validate of Volcano.
"""

from __future__ import annotations

import re

from elastic_control.kube.constants import MAX_NAME_LENGTH

# Events and actions a user's policy may name (internal ones such as
# OutOfSync or CommandIssued are in the CRD enum but refused by the webhook).
ALLOWED_POLICY_EVENTS = frozenset(
    {"*", "PodPending", "PodRunning", "PodFailed", "PodEvicted", "Unknown", "TaskCompleted", "TaskFailed"}
)
ALLOWED_POLICY_ACTIONS = frozenset(
    {"AbortJob", "RestartJob", "RestartTask", "RestartPod", "TerminateJob", "CompleteJob", "ResumeJob"}
)
REGISTERED_PLUGINS = frozenset({"env", "svc", "ssh", "tensorflow", "pytorch", "mpi", "ray", "hcclrank"})
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def volcano_job_problems(job: dict) -> list[str]:
    """Every rule of Volcano's job webhook that ``job`` breaks (empty when admissible)."""
    problems: list[str] = []
    name = job.get("metadata", {}).get("name", "")
    spec = job.get("spec", {})
    tasks = spec.get("tasks") or []
    if not tasks:
        problems.append("a job needs at least one task")
    total = 0
    seen: set[str] = set()
    for task in tasks:
        tname = task.get("name", "")
        replicas = task.get("replicas", 1)
        total += replicas
        if replicas < 0:
            problems.append(f"task {tname!r}: replicas {replicas} is negative")
        if tname in seen:
            problems.append(f"task name {tname!r} is used twice; task names must be unique")
        seen.add(tname)
        if not _DNS_LABEL.match(tname or "-"):
            problems.append(f"task name {tname!r} is not a DNS label (lower-case letters, digits, '-')")
        if task.get("minAvailable", 0) > replicas:
            problems.append(f"task {tname!r}: minAvailable {task['minAvailable']} is above its replicas {replicas}")
        # Volcano names pods JOB-TASK-INDEX; the svc plugin makes them host names.
        longest = f"{name}-{tname}-{max(replicas - 1, 0)}"
        if len(longest) > MAX_NAME_LENGTH:
            problems.append(
                f"pod name {longest!r} is {len(longest)} characters; Kubernetes allows "
                f"{MAX_NAME_LENGTH} (use a shorter job name)"
            )
        problems += _policy_problems(task.get("policies") or [], f"task {tname!r}")
    min_available = spec.get("minAvailable", 0)
    if min_available < 0:
        problems.append(f"minAvailable {min_available} is negative")
    if min_available > total:
        problems.append(f"minAvailable {min_available} is above the sum of task replicas {total}")
    if spec.get("maxRetry", 0) < 0:
        problems.append(f"maxRetry {spec['maxRetry']} is negative")
    for plugin in spec.get("plugins") or {}:
        if plugin not in REGISTERED_PLUGINS:
            problems.append(
                f"plugin {plugin!r} is not registered in Volcano (known: {', '.join(sorted(REGISTERED_PLUGINS))})"
            )
    problems += _policy_problems(spec.get("policies") or [], "job")
    if not _DNS_LABEL.match(name or "-") or len(name) > MAX_NAME_LENGTH:
        problems.append(f"job name {name!r} is not a DNS label of at most {MAX_NAME_LENGTH} characters")
    return problems


def _policy_problems(policies: list[dict], where: str) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    codes: set[int] = set()
    for policy in policies:
        code = policy.get("exitCode")
        if code is not None:
            if code == 0:
                problems.append(f"{where}: exitCode 0 is not an error code")
            if code in codes:
                problems.append(f"{where}: exitCode {code} appears twice")
            codes.add(code)
        events = list(policy.get("events") or []) + ([policy["event"]] if policy.get("event") else [])
        action = policy.get("action")
        if events and policy.get("exitCode") is not None:
            problems.append(f"{where}: a policy must not name both an event and an exitCode")
        if not events and policy.get("exitCode") is None:
            problems.append(f"{where}: a policy needs an event or an exitCode")
        for event in events:
            if event not in ALLOWED_POLICY_EVENTS:
                problems.append(
                    f"{where}: policy event {event!r} is not allowed "
                    f"(allowed: {', '.join(sorted(ALLOWED_POLICY_EVENTS))})"
                )
            if event in seen:
                problems.append(f"{where}: policy event {event!r} appears twice")
            seen.add(event)
        if action not in ALLOWED_POLICY_ACTIONS:
            problems.append(
                f"{where}: policy action {action!r} is not allowed "
                f"(allowed: {', '.join(sorted(ALLOWED_POLICY_ACTIONS))})"
            )
    if "*" in seen and len(seen) > 1:
        problems.append(f"{where}: the '*' event must stand alone")
    return problems
