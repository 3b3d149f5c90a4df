"""-c: find how serving and the file server are reached from here, fetch slot.conf, write client.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import requests

from ctr_foundation.atomic import atomic_write_text
from ctr_foundation.errors import ApplyError, ConfigError
from ctr_foundation.http_auth import auth_headers
from ctr_foundation.names import CLIENT_SLOT_CONF, REMOTE_SLOT_CONF, StateFolder
from ctr_foundation.records import ClientConfig
from elastic_control.config import parse_slot_conf
from elastic_control.console import info, warn
from elastic_control.kube import adaptor

SLOT_CONF_URL_PATH = f"/files/{REMOTE_SLOT_CONF}"


@dataclass(frozen=True)
class Endpoint:
    url: str
    how: str  # LoadBalancer / NodePort / port-forward
    port_forward: str | None = None  # the command to run first, when needed


def _node_address() -> str | None:
    """An address of a node: ExternalIP first, then InternalIP (NodePort services answer on every node)."""
    with adaptor.reachable("listing nodes"):
        try:
            nodes = adaptor.core().list_node().items
        except adaptor.ApiException as e:
            if e.status == 403:
                return None
            raise
    for wanted in ("ExternalIP", "InternalIP"):
        for node in nodes:
            for address in node.status.addresses or []:
                if address.type == wanted:
                    return address.address
    return None


def discover_service(namespace: str, name: str, port: int, *, scheme: str = "http") -> Endpoint:
    """How to reach Service ``name`` on ``port`` from outside the cluster."""
    with adaptor.reachable(f"reading Service {namespace}/{name}"):
        try:
            svc = adaptor.core().read_namespaced_service(name, namespace)
        except adaptor.ApiException as e:
            if e.status == 404:
                raise ApplyError(
                    "not found: run `elastic-control -a` first", kind="Service", namespace=namespace, name=name
                ) from e
            raise
    spec_port = next((p for p in svc.spec.ports or [] if p.port == port), (svc.spec.ports or [None])[0])
    if svc.spec.type == "LoadBalancer":
        for ingress in (svc.status.load_balancer.ingress or []) if svc.status and svc.status.load_balancer else []:
            host = ingress.ip or ingress.hostname
            if host:
                return Endpoint(f"{scheme}://{host}:{spec_port.port}", "LoadBalancer")
    if svc.spec.type in ("NodePort", "LoadBalancer") and spec_port is not None and spec_port.node_port:
        node = _node_address()
        if node:
            return Endpoint(f"{scheme}://{node}:{spec_port.node_port}", "NodePort")
    # Reachable only inside the cluster: tell the user the port-forward to run.
    command = f"kubectl port-forward -n {namespace} svc/{name} {port}:{port}"
    return Endpoint(f"{scheme}://127.0.0.1:{port}", "port-forward", command)


def fetch_slot_conf(fileserver_url: str, timeout: float = 5.0, token: str | None = None) -> str:
    """slot.conf as published on the file server (raises requests/ConfigError when unavailable).

    Reads outside cube/ need the deployment's token (docs/contracts.md, "HTTP rules").
    """
    resp = requests.get(fileserver_url.rstrip("/") + SLOT_CONF_URL_PATH, timeout=timeout, headers=auth_headers(token))
    resp.raise_for_status()
    text = resp.text
    parse_slot_conf(text, fileserver_url + SLOT_CONF_URL_PATH)
    return text


def configure_client(
    *,
    namespace: str,
    serving_name: str,
    serving_port: int,
    fileserver_name: str,
    fileserver_port: int,
    state_dir: Path,
    fallback_slot_conf: str,
    token: str | None = None,
    serving_grpc_port: int | None = None,
) -> Path:
    """Write STATE/client.json (docs/contracts.md) and the slot.conf it names; returns client.json's path."""
    serving = discover_service(namespace, serving_name, serving_port)
    files = discover_service(namespace, fileserver_name, fileserver_port)
    grpc = None
    if serving_grpc_port is not None:
        endpoint = discover_service(namespace, serving_name, serving_grpc_port, scheme="grpc")
        grpc = endpoint.url.split("://", 1)[1]
        if serving.port_forward and endpoint.port_forward:  # one port-forward for both of serving's ports
            serving = Endpoint(
                serving.url, serving.how, f"{serving.port_forward} {serving_grpc_port}:{serving_grpc_port}"
            )
    for what, endpoint in (("serving", serving), ("file server", files)):
        if endpoint.port_forward:
            info(f"{what} is only reachable inside the cluster; run: {endpoint.port_forward}")
        else:
            info(f"{what}: {endpoint.url} ({endpoint.how})")
    try:
        slot_text = fetch_slot_conf(files.url, token=token)
        source = files.url + SLOT_CONF_URL_PATH
    except (requests.RequestException, ConfigError) as e:
        reason = type(e).__name__ if isinstance(e, requests.ConnectionError) else f"{type(e).__name__}: {e}"
        warn(
            f"could not fetch slot.conf from {files.url}{SLOT_CONF_URL_PATH} ({reason}); "
            "using the copy in the state folder"
        )
        slot_text, source = fallback_slot_conf, "state folder"
    slots = parse_slot_conf(slot_text, source)
    slot_path = state_dir / CLIENT_SLOT_CONF
    atomic_write_text(slot_path, slot_text)
    path = StateFolder(state_dir).client_config
    ClientConfig(serving.url, files.url, str(slot_path.resolve()), tuple(slots.slots), serving_grpc=grpc).save(path)
    return path
