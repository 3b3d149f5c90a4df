"""The harness's network: one bridge, one network namespace and IP per pod, nothing on the host.

Layout (all names start with the run's prefix ``ectr-<pid>-<random>``, so parallel
runs never collide and a later run can remove what a killed one left):

- ``PREFIX-node``: holds the bridge ``br0`` with the node address 10.244.0.1/16,
  every Service's cluster IP (10.96.0.N/32) and the cluster DNS address
  10.96.0.10 (kube-dns's usual one); the node agent (Service proxy, prober and
  DNS server) runs here, as kube-proxy, the kubelet's prober and the DNS pods'
  Service would on a node.
- ``PREFIX-pN``: one per pod, ``eth0`` = a veth whose peer is a port of ``br0``,
  the pod IP 10.244.N.M/16, a default route via the node, and (``set_ingress``) an
  nftables input chain with what the NetworkPolicies admit from the other pods.

Traffic never leaves these namespaces (the host's namespace gets no interface,
no route and no address), so the fixed subnets of different runs cannot clash.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

POD_SUBNET = ipaddress.ip_network("10.244.0.0/16")
NODE_IP = "10.244.0.1"
SERVICE_SUBNET = ipaddress.ip_network("10.96.0.0/16")
DNS_IP = "10.96.0.10"  # the pods' nameserver (resolv.conf), answered by the node agent
NETNS_DIR = "/var/run/netns"
PREFIX_ROOT = "ectr-"
NFT_TABLE = "harness_policy"  # in each pod's namespace: its NetworkPolicies, for direct connections


def missing_requirements() -> str | None:
    """Why the harness cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "the pod harness needs root (network namespaces, bind mounts, dropping to the pods' uid)"
    for tool in ("ip", "unshare", "nsenter", "setpriv", "mount", "nft"):
        if shutil.which(tool) is None:
            return f"the pod harness needs `{tool}` (iproute2 / util-linux / nftables)"
    probe = f"{PREFIX_ROOT}probe-{os.getpid()}-{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_namespace_processes(netns: str) -> None:
    """SIGKILL whatever still runs in ``netns`` (only ever one of the harness's own namespaces)."""
    proc = run("ip", "netns", "pids", netns, check=False)
    for pid in proc.stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


def remove_stale_namespaces() -> list[str]:
    """Namespaces of earlier runs whose test process is gone (killed hard): remove them."""
    removed = []
    if not os.path.isdir(NETNS_DIR):
        return removed
    for name in os.listdir(NETNS_DIR):
        if not name.startswith(PREFIX_ROOT):
            continue
        parts = name.split("-")
        try:
            owner = int(parts[1])
        except (IndexError, ValueError):
            continue
        if pid_alive(owner):
            continue
        kill_namespace_processes(name)
        run("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


@dataclass
class Network:
    """The bridge namespace, the pods' namespaces and the addresses handed out."""

    prefix: str = field(default_factory=lambda: f"{PREFIX_ROOT}{os.getpid()}-{secrets.token_hex(2)}")
    namespaces: list[str] = field(default_factory=list)
    _next_pod: int = 2
    _next_port: int = 0
    _next_service: int = 1

    @property
    def node_ns(self) -> str:
        return f"{self.prefix}-node"

    def create(self) -> None:
        remove_stale_namespaces()
        self._add_ns(self.node_ns)
        ns = self.node_ns
        run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", ns, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", ns, "addr", "add", f"{NODE_IP}/{POD_SUBNET.prefixlen}", "dev", "br0")
        run("ip", "-n", ns, "link", "set", "br0", "up")
        run("ip", "-n", ns, "addr", "add", f"{DNS_IP}/32", "dev", "lo")

    def _add_ns(self, name: str) -> None:
        run("ip", "netns", "add", name)
        self.namespaces.append(name)

    def service_ip(self) -> str:
        """A new cluster IP, answered by the node agent in the node namespace."""
        ip = str(SERVICE_SUBNET.network_address + self._next_service)
        self._next_service += 1
        if ip == DNS_IP:
            return self.service_ip()
        run("ip", "-n", self.node_ns, "addr", "add", f"{ip}/32", "dev", "lo")
        return ip

    def next_pod_ip(self) -> str:
        ip = str(POD_SUBNET.network_address + self._next_pod)
        self._next_pod += 1
        return ip

    def add_pod(self, ip: str) -> str:
        """A new namespace with eth0 = ``ip`` on the bridge; returns the namespace's name."""
        port = f"p{self._next_port}"
        self._next_port += 1
        name = f"{self.prefix}-{port}"
        self._add_ns(name)
        run("ip", "link", "add", "name", port, "netns", self.node_ns, "type", "veth", "peer", "name", "eth0",
            "netns", name)  # fmt: skip
        run("ip", "-n", self.node_ns, "link", "set", port, "master", "br0", "up")
        run("ip", "-n", name, "link", "set", "lo", "up")
        run("ip", "-n", name, "addr", "add", f"{ip}/{POD_SUBNET.prefixlen}", "dev", "eth0")
        run("ip", "-n", name, "link", "set", "eth0", "up")
        run("ip", "-n", name, "route", "add", "default", "via", NODE_IP)
        return name

    def set_ingress(self, name: str, admitted: dict[str, set[int] | None] | None) -> None:
        """What namespace ``name`` accepts, as a CNI enforces NetworkPolicies on a pod's ingress: ``None``
        everything (no policy selects the pod); else new connections from the node (probes, the node
        agent's Service traffic, which it filters itself) and from each source IP in ``admitted`` (to its
        ports; None: any port), every other one dropped (so a refused client waits for its timeout, as
        with a real CNI). Replies to the pod's own connections pass (conntrack)."""
        lines = [f"table inet {NFT_TABLE}", f"delete table inet {NFT_TABLE}"]
        if admitted is not None:
            rules = ['iif "lo" accept', "ct state established,related accept", f"ip saddr {NODE_IP} accept"]
            for ip, ports in sorted(admitted.items()):
                if ports is None:
                    rules.append(f"ip saddr {ip} accept")
                elif ports:
                    listed = ", ".join(str(p) for p in sorted(ports))
                    rules.append(f"ip saddr {ip} meta l4proto {{ tcp, udp }} th dport {{ {listed} }} accept")
            rules.append("drop")
            lines += [
                f"table inet {NFT_TABLE} {{",
                "  chain ingress {",
                "    type filter hook input priority 0; policy accept;",
                *(f"    {r}" for r in rules),
                "  }",
                "}",
            ]
        proc = subprocess.run(
            ["ip", "netns", "exec", name, "nft", "-f", "-"],
            input="\n".join(lines) + "\n",
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 and os.path.exists(os.path.join(NETNS_DIR, name)):  # not a pod just gone
            raise RuntimeError(f"nft in {name} failed: {proc.stderr.strip()}")

    def remove_pod(self, name: str) -> None:
        kill_namespace_processes(name)
        run("ip", "netns", "del", name, check=False)  # its veth (and the bridge port) go with it
        if name in self.namespaces:
            self.namespaces.remove(name)

    def destroy(self) -> None:
        for name in reversed(list(self.namespaces)):
            kill_namespace_processes(name)
        for name in reversed(list(self.namespaces)):
            run("ip", "netns", "del", name, check=False)
        self.namespaces.clear()
