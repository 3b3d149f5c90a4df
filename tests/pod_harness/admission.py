"""Pod Security "restricted" (the Pod Security Standards, v1.33), as the admission controller checks it.

The harness refuses to run a pod that breaks it, as a namespace labelled
``pod-security.kubernetes.io/enforce: restricted`` does; the static test runs the
same check over every pod template of every rendered manifest.
"""

from __future__ import annotations

RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}


def all_containers(spec: dict) -> list[tuple[str, dict]]:
    return [(kind, c) for kind in ("initContainers", "containers", "ephemeralContainers") for c in spec.get(kind) or []]


def restricted_violations(spec: dict) -> list[str]:
    """Every rule of the baseline and restricted levels that pod ``spec`` breaks."""
    problems: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            problems.append(f"{flag}=true")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            problems.append(f"unsafe sysctl {sysctl.get('name')}")
    for volume in spec.get("volumes") or []:
        kinds = [key for key in volume if key != "name"]
        if not kinds or kinds[0] not in RESTRICTED_VOLUME_TYPES:
            problems.append(f"volume {volume.get('name')!r} uses {kinds[0] if kinds else 'nothing'}")
    if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        problems.append("pod seccompProfile Unconfined")
    if pod_sc.get("runAsUser") == 0:
        problems.append("pod runAsUser=0")
    if pod_sc.get("runAsNonRoot") is False:
        problems.append("pod runAsNonRoot=false")
    problems += _selinux_and_apparmor("pod", pod_sc)
    for kind, c in all_containers(spec):
        where = f"{kind[:-1]} {c.get('name')!r}"
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{where}: capabilities must drop ALL")
        extra = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if extra:
            problems.append(f"{where}: adds capabilities {sorted(extra)}")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            problems.append(f"{where}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser") == 0:
            problems.append(f"{where}: runAsUser=0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{where}: seccompProfile must be RuntimeDefault or Localhost (pod or container)")
        if sc.get("procMount") not in (None, "Default"):
            problems.append(f"{where}: procMount {sc['procMount']}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                problems.append(f"{where}: hostPort {port['hostPort']}")
        problems += _selinux_and_apparmor(where, sc)
    return problems


def _selinux_and_apparmor(where: str, sc: dict) -> list[str]:
    """Baseline: SELinux type one of the container types, no user or role; AppArmor not Unconfined."""
    problems = []
    se = sc.get("seLinuxOptions") or {}
    if se.get("type") not in (None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"):
        problems.append(f"{where}: seLinuxOptions.type {se['type']}")
    for field in ("user", "role"):
        if se.get(field):
            problems.append(f"{where}: seLinuxOptions.{field} must not be set")
    if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        problems.append(f"{where}: AppArmor profile Unconfined")
    return problems
