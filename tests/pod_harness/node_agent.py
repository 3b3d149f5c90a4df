"""The node of the pod harness: Service proxy (kube-proxy) and prober (the kubelet's), in one process.

Runs in the node namespace (``python node_agent.py STATE STATUS [DNS_IP]``). The harness
writes STATE (JSON, replaced atomically) with the Services and the pods;
this process:

- listens on every Service's cluster IP and port and forwards each accepted
  connection to one endpoint, round-robin: a pod the Service selects that is
  ready and not terminating; when there is none, a terminating pod that is still
  ready ("serving"), as kube-proxy does since Kubernetes 1.28 (KEP-1669); with
  ``publishNotReadyAddresses``: any pod that runs. On the Service port's
  ``targetPort`` (a number, or a container port's name). No endpoint: the
  connection is closed at once.
  Connections are forwarded whole (as kube-proxy's conntrack entries are), so an
  open keep-alive connection stays with its pod; new ones follow readiness.
- runs every container's readiness, liveness and startup probes (httpGet and
  tcpSocket against the pod IP, as the kubelet does from the node; exec inside
  the container through the prefix the cluster gives, as its user; with their
  initialDelay, period, timeout and thresholds);
- writes STATUS (JSON, atomically) with each container's probe results;
- answers the cluster's DNS (UDP, on network.DNS_IP:53, the pods' nameserver), as
  CoreDNS's kubernetes plugin does: ``NAME.NS.svc.DOMAIN`` is a Service's cluster
  IP; for a headless Service (``clusterIP: None``, and the one Volcano's svc plugin
  makes per job) the IPs of its endpoints, and ``HOSTNAME.NAME.NS.svc.DOMAIN`` the
  IP of an endpoint pod with that hostname and ``subdomain: NAME``. A headless
  Service's endpoints are its ready pods (all running ones with
  ``publishNotReadyAddresses``), so such a name resolves only while its pod is
  ready. A records only; any other name is NXDOMAIN (no upstream resolver), another
  type of a known name an empty answer. The short forms (``NAME``, ``NAME.NS``...)
  are the pods' resolvers' work: their resolv.conf has the search list and ndots:5;
- enforces the namespace's NetworkPolicies (ingress) on Service traffic, as the
  CNI would: a connection from a pod (or client) the policies of the chosen
  endpoint do not admit on its target port is closed at once (a real CNI drops
  it, so a real client waits for its timeout instead). Here, not in the pod's
  namespace: the proxied connection comes from the node, which the pods' own
  rules (nftables, network.set_ingress, for direct pod-IP connections) admit.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import os
import struct
import sys
import time

DNS_PORT = 53
DNS_TTL = 5  # seconds, CoreDNS's kubernetes plugin's default
TYPE_A, CLASS_IN = 1, 1
RCODE_NXDOMAIN, RCODE_FORMERR = 3, 1


def container_ready(container: dict, status: dict | None) -> bool:
    """A running container is ready when its readiness probe (if any) last succeeded."""
    if not container.get("running"):
        return False
    if not container.get("readinessProbe"):
        startup = status or {}
        return not container.get("startupProbe") or startup.get("started", False)
    return bool(status and status.get("generation") == container["generation"] and status.get("ready"))


def pod_ready(pod: dict, statuses: dict) -> bool:
    """Ready: every container ready, the pod not terminating (what Endpoints and `-a` count)."""
    if pod.get("terminating") or not pod.get("containers"):
        return False
    mine = statuses.get(pod["name"], {})
    return all(container_ready(c, mine.get(c["name"])) for c in pod["containers"])


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def admitted_ports(policies: list[dict], pod: dict, source_labels: dict | None) -> set[int] | None:
    """The ports of ``pod`` (agent view) that the ingress policies admit from a source; None: every port.

    ``source_labels`` None is a source that is no pod of the namespace. Only what the
    project renders is understood (podSelector matchLabels, from podSelector, ports by
    name or number); anything else fails loudly rather than being enforced wrongly.
    """
    chosen = []
    for spec in policies:
        selector = spec["podSelector"]
        if set(selector) - {"matchLabels"} or spec.get("policyTypes") != ["Ingress"]:
            raise ValueError(f"the harness enforces matchLabels ingress policies only, not {spec}")
        if all(pod["labels"].get(k) == v for k, v in selector.get("matchLabels", {}).items()):
            chosen.append(spec)
    if not chosen:
        return None
    allowed: set[int] = set()
    for spec in chosen:
        for rule in spec.get("ingress", []):
            peers = rule.get("from")
            if peers is not None:
                if any(set(peer) != {"podSelector"} for peer in peers):
                    raise ValueError(f"the harness enforces podSelector peers only, not {peers}")
                if source_labels is None or not any(
                    all(source_labels.get(k) == v for k, v in peer["podSelector"].get("matchLabels", {}).items())
                    for peer in peers
                ):
                    continue
            if "ports" not in rule:
                return None
            for entry in rule["ports"]:
                port = entry["port"]
                number = pod["ports"].get(port) if isinstance(port, str) and not port.isdigit() else int(port)
                if number is not None:
                    allowed.add(number)
    return allowed


def published(service: dict, pods: list[dict], statuses: dict) -> list[dict]:
    """The pods an endpoints controller lists as ``service``'s addresses: selected, with an IP, ready (or
    running, with ``publishNotReadyAddresses``)."""
    out = []
    for pod in pods:
        if not pod.get("ip") or not selects(service["selector"], pod["labels"]):
            continue
        if service.get("publishNotReadyAddresses"):
            if not pod.get("terminating") and any(c.get("running") for c in pod["containers"]):
                out.append(pod)
        elif pod_ready(pod, statuses):
            out.append(pod)
    return out


def dns_records(state: dict, statuses: dict) -> dict[str, list[str]]:
    """Every A record of the cluster's DNS: fully qualified name (lower case, no final dot) -> IPs."""
    ns, domain = state.get("namespace", "default"), state.get("domain", "cluster.local")
    records: dict[str, list[str]] = {}
    for service in state["services"]:
        fqdn = f"{service['name']}.{ns}.svc.{domain}".lower()
        if service.get("ip"):
            records[fqdn] = [service["ip"]]
            continue
        endpoints = published(service, state["pods"], statuses)
        if endpoints:
            records[fqdn] = [p["ip"] for p in endpoints]
        for pod in endpoints:
            if pod.get("hostname") and pod.get("subdomain") == service["name"]:
                records[f"{pod['hostname']}.{fqdn}".lower()] = [pod["ip"]]
    return records


def dns_answer(query: bytes, records: dict[str, list[str]]) -> bytes | None:
    """The reply to one DNS query (None: not worth one). A records from ``records``; NXDOMAIN for an unknown
    name, an empty answer for another type of a known one."""
    if len(query) < 12:
        return None
    ident, flags, qdcount = struct.unpack("!HHH", query[:6])
    if flags & 0x8000:
        return None  # a response, not a query
    labels, at = [], 12
    try:
        while (length := query[at]) != 0:
            if length & 0xC0:
                raise IndexError("compression in a question")
            labels.append(query[at + 1 : at + 1 + length].decode("ascii", "replace"))
            at += 1 + length
        qtype, qclass = struct.unpack("!HH", query[at + 1 : at + 5])
    except (IndexError, struct.error):
        return struct.pack("!HHHHHH", ident, 0x8000 | RCODE_FORMERR, 0, 0, 0, 0)
    question = query[12 : at + 5]
    name = ".".join(labels).lower()
    ips = records.get(name)
    answers = b""
    if ips is not None and qtype == TYPE_A and qclass == CLASS_IN:
        for ip in ips:
            answers += struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, DNS_TTL, 4) + ipaddress.ip_address(ip).packed
    rcode = 0 if ips is not None else RCODE_NXDOMAIN
    # QR, the query's opcode and RD, AA (authoritative for the cluster domain), RA.
    reply_flags = 0x8000 | (flags & 0x7900) | 0x0400 | 0x0080 | rcode
    count = len(ips) if answers else 0
    return struct.pack("!HHHHHH", ident, reply_flags, 1 if qdcount else 0, count, 0, 0) + question + answers


class ClusterDNS(asyncio.DatagramProtocol):
    def __init__(self, agent: NodeAgent):
        self.agent = agent
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        reply = dns_answer(data, dns_records(self.agent.state, self.agent.statuses))
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


class NodeAgent:
    def __init__(self, state_path: str, status_path: str, dns_ip: str | None = None):
        self.state_path, self.status_path, self.dns_ip = state_path, status_path, dns_ip
        self.state: dict = {"services": [], "pods": []}
        self.statuses: dict[str, dict[str, dict]] = {}  # pod -> container -> probe results
        self.listeners: dict[tuple[str, int], asyncio.AbstractServer] = {}
        self.probers: dict[tuple[str, str, int], asyncio.Task] = {}
        self.rr = itertools.count()
        self._mtime = 0.0

    # ---- state -------------------------------------------------------------------------------------
    def load_state(self) -> bool:
        try:
            mtime = os.stat(self.state_path).st_mtime_ns
        except FileNotFoundError:
            return False
        if mtime == self._mtime:
            return False
        with open(self.state_path) as f:
            self.state = json.load(f)
        self._mtime = mtime
        return True

    def write_status(self) -> None:
        tmp = f"{self.status_path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"time": time.time(), "pods": self.statuses}, f)
        os.replace(tmp, self.status_path)

    # ---- proxy -------------------------------------------------------------------------------------
    def endpoints(self, service: dict, port: dict) -> list[tuple[str, int]]:
        ready, serving_terminating = [], []
        for pod in self.state["pods"]:
            if not selects(service["selector"], pod["labels"]) or not pod.get("ip"):
                continue
            target = port["targetPort"]
            if isinstance(target, str) and not target.isdigit():
                target = pod["ports"].get(target)
                if target is None:
                    continue
            address = (pod["ip"], int(target))
            if service.get("publishNotReadyAddresses"):
                if any(c.get("running") for c in pod["containers"]):
                    ready.append(address)
            elif pod_ready(pod, self.statuses):
                ready.append(address)
            elif pod.get("terminating") and pod_ready({**pod, "terminating": False}, self.statuses):
                serving_terminating.append(address)
        return ready or serving_terminating

    def source_labels(self, ip: str | None) -> dict | None:
        """The labels of the pod (or harness client) at ``ip``; None for anything else."""
        for pod in [*self.state["pods"], *self.state.get("clients", [])]:
            if ip is not None and pod.get("ip") == ip:
                return pod["labels"]
        return None

    async def sync_listeners(self) -> None:
        wanted = {}
        for service in self.state["services"]:
            if not service.get("ip"):
                continue
            for port in service["ports"]:
                wanted[(service["ip"], port["port"])] = (service["name"], port["port"])
        for key in list(self.listeners):
            if key not in wanted:
                self.listeners.pop(key).close()
        for key, (name, port) in wanted.items():
            if key in self.listeners:
                continue

            async def handle(reader, writer, name=name, port=port):
                await self.forward(name, port, reader, writer)

            self.listeners[key] = await asyncio.start_server(handle, key[0], key[1], reuse_address=True)

    async def forward(self, service_name: str, port_number: int, reader, writer) -> None:
        service = next((s for s in self.state["services"] if s["name"] == service_name), None)
        port = next((p for p in (service or {}).get("ports", []) if p["port"] == port_number), None)
        candidates = self.endpoints(service, port) if service and port else []
        if not candidates:
            writer.transport.abort()  # as kube-proxy rejects a Service without endpoints
            return
        peer = writer.get_extra_info("peername")
        source = self.source_labels(peer[0] if peer else None)
        policies = self.state.get("policies", [])
        by_ip = {p["ip"]: p for p in self.state["pods"] if p.get("ip")}
        candidates = [
            (ip, target)
            for ip, target in candidates
            if (ports := admitted_ports(policies, by_ip[ip], source)) is None or target in ports
        ]
        if not candidates:
            writer.transport.abort()  # what the policies refuse (a CNI would drop it)
            return
        start = next(self.rr)
        for attempt in range(len(candidates)):
            ip, target = candidates[(start + attempt) % len(candidates)]
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(ip, target), 3)
                break
            except (OSError, asyncio.TimeoutError):
                continue
        else:
            writer.transport.abort()
            return

        async def pipe(src, dst):
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                try:
                    if dst.can_write_eof():
                        dst.write_eof()
                except OSError:
                    pass

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        for w in (writer, up_writer):
            w.close()

    # ---- probes ------------------------------------------------------------------------------------
    async def probe_once(self, pod: dict, container: dict, probe: dict) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            spec = probe["httpGet"]
            port = spec["port"]
            if isinstance(port, str) and not port.isdigit():
                port = pod["ports"][port]
            headers = "".join(f"{h['name']}: {h['value']}\r\n" for h in spec.get("httpHeaders", []))
            request = (
                f"GET {spec.get('path', '/')} HTTP/1.1\r\nHost: {pod['ip']}:{port}\r\n"
                f"User-Agent: kube-probe/1.33\r\nAccept: */*\r\nConnection: close\r\n{headers}\r\n"
            ).encode()
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(pod["ip"], int(port)), timeout)
                writer.write(request)
                line = await asyncio.wait_for(reader.readline(), timeout)
                writer.close()
                code = int(line.split()[1])
                return 200 <= code < 400
            except (OSError, asyncio.TimeoutError, ValueError, IndexError):
                return False
        if "tcpSocket" in probe:
            port = probe["tcpSocket"]["port"]
            if isinstance(port, str) and not port.isdigit():
                port = pod["ports"][port]
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(pod["ip"], int(port)), timeout)
                writer.close()
                return True
            except (OSError, asyncio.TimeoutError):
                return False
        if "exec" in probe:  # inside the container, as its user, through the runtime (the cluster's prefix)
            # The latest state's: the prefix appears once the container's process is found.
            now = next(
                (
                    c
                    for p in self.state["pods"]
                    if p["name"] == pod["name"]
                    for c in p["containers"]
                    if c["name"] == container["name"] and c["generation"] == container["generation"]
                ),
                container,
            )
            prefix = now.get("exec_prefix")
            if not prefix:
                return False
            try:
                proc = await asyncio.create_subprocess_exec(
                    *prefix,
                    *probe["exec"]["command"],
                    env=now.get("exec_env"),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
            except OSError:
                return False
            try:
                return await asyncio.wait_for(proc.wait(), timeout) == 0
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                return False
        raise ValueError(f"the harness runs httpGet, tcpSocket and exec probes only, not {sorted(probe)}")

    async def run_probes(self, pod: dict, container: dict) -> None:
        """One container generation's probes, as the kubelet runs them, until it stops running."""
        status = {"generation": container["generation"], "ready": False, "started": False, "live_failures": 0}
        self.statuses.setdefault(pod["name"], {})[container["name"]] = status
        startup, readiness, liveness = (container.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe"))
        began = time.monotonic()
        counts = {"startup": [0, 0], "readiness": [0, 0], "liveness": [0, 0]}  # [successes, failures] in a row
        last = {"startup": 0.0, "readiness": 0.0, "liveness": 0.0}
        status["started"] = startup is None
        while True:
            now = time.monotonic()
            for kind, probe in (("startup", startup), ("readiness", readiness), ("liveness", liveness)):
                if probe is None or (kind == "startup") == status["started"]:
                    continue  # the startup probe runs until it succeeds, the other two only after
                if now - began < float(probe.get("initialDelaySeconds", 0)):
                    continue
                if now - last[kind] < float(probe.get("periodSeconds", 10)):
                    continue
                last[kind] = now
                ok = await self.probe_once(pod, container, probe)
                row = counts[kind]
                row[0], row[1] = (row[0] + 1, 0) if ok else (0, row[1] + 1)
                if kind == "startup":
                    if row[0] >= int(probe.get("successThreshold", 1)):
                        status["started"] = True
                    elif row[1] >= int(probe.get("failureThreshold", 3)):
                        status["startup_failed"] = True
                elif kind == "readiness":
                    if row[0] >= int(probe.get("successThreshold", 1)):
                        status["ready"] = True
                    elif row[1] >= int(probe.get("failureThreshold", 3)):
                        status["ready"] = False
                else:
                    status["live_failures"] = row[1]
                    if row[1] >= int(probe.get("failureThreshold", 3)):
                        status["liveness_failed"] = True
            await asyncio.sleep(0.1)

    def sync_probers(self) -> None:
        wanted = set()
        for pod in self.state["pods"]:
            for container in pod["containers"]:
                if not container.get("running") or not pod.get("ip"):
                    continue
                key = (pod["name"], container["name"], container["generation"])
                wanted.add(key)
                if key not in self.probers:
                    self.probers[key] = asyncio.ensure_future(self.run_probes(pod, container))
        for key in list(self.probers):
            if key not in wanted:
                self.probers.pop(key).cancel()
        live_pods = {p["name"] for p in self.state["pods"]}
        for name in list(self.statuses):
            if name not in live_pods:
                del self.statuses[name]

    async def main(self) -> None:
        if self.dns_ip:
            await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: ClusterDNS(self), local_addr=(self.dns_ip, DNS_PORT)
            )
        while True:
            if self.load_state():
                await self.sync_listeners()
                self.sync_probers()
            self.write_status()
            await asyncio.sleep(0.1)


if __name__ == "__main__":
    asyncio.run(NodeAgent(*sys.argv[1:4]).main())
