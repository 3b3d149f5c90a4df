"""Validating rendered manifests against real schemas (shared by the kube and CLI tests).

Built-in kinds: kubernetes_validate (strict). The Volcano Job: jsonschema against
the CRD's openAPIV3Schema, made strict (additionalProperties: false wherever
properties are declared) so a misspelt field fails instead of being ignored.
ServiceMonitor and PrometheusRule: the same, against the Prometheus Operator's CRDs (tests/data/crds/).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[1]
# Tests that validate a Volcano job carry the ``needs_volcano_schemas`` marker (conftest.py).
VOLCANO_JOB_CRD = REPO.parent / "shared" / "schemas" / "volcano" / "batch.volcano.sh_jobs.yaml"
K8S_VERSION = kubernetes_validate.latest_version()  # the newest release the installed package knows


def make_strict(schema):
    """A copy where every object that declares properties refuses undeclared ones."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.lru_cache(maxsize=1)
def strict_volcano_job_schema() -> dict:
    crd = yaml.safe_load(VOLCANO_JOB_CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return make_strict(version["schema"]["openAPIV3Schema"])


def validate_volcano_job(doc: dict) -> None:
    jsonschema.Draft4Validator(strict_volcano_job_schema()).validate(doc)


def validate_builtin(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# The Prometheus Operator's CRDs, copied unmodified into the repo (tests/data/crds/README.md names the release):
# unlike the Volcano ones they are not in the shared schemas folder, and the repo has to carry what it validates.
MONITORING_CRDS = {
    "ServiceMonitor": REPO / "tests" / "data" / "crds" / "monitoring.coreos.com_servicemonitors.yaml",
    "PrometheusRule": REPO / "tests" / "data" / "crds" / "monitoring.coreos.com_prometheusrules.yaml",
}


@functools.cache
def strict_crd_schema(path: Path, api_version: str) -> dict:
    """The openAPIV3Schema the CRD at ``path`` serves for ``api_version`` (group/version), made strict."""
    crd = yaml.safe_load(path.read_text())
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group, f"{path.name} defines {crd['spec']['group']}, not {group}"
    served = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    if not served:
        raise LookupError(f"{path.name} serves no version {version}")
    return make_strict(served[0]["schema"]["openAPIV3Schema"])


def validate_monitoring(doc: dict) -> None:
    crd = MONITORING_CRDS[doc["kind"]]  # a kind we have no CRD for is a KeyError, never a pass
    jsonschema.Draft4Validator(strict_crd_schema(crd, doc["apiVersion"])).validate(doc)


def validate_manifest(doc: dict) -> None:
    if doc["apiVersion"].startswith("batch.volcano.sh/"):
        validate_volcano_job(doc)
    elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
        validate_monitoring(doc)
    else:
        validate_builtin(doc)
