"""Validating rendered manifests against real schemas (shared by the kube and CLI tests).

Built-in kinds: kubernetes_validate (strict). The Volcano Job: jsonschema against
the CRD's openAPIV3Schema, made strict (additionalProperties: false wherever
properties are declared) so a misspelt field fails instead of being ignored.
ServiceMonitor and PrometheusRule: minimal strict schemas of their documented fields.
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


# The Prometheus Operator's kinds: their CRDs are not in the shared schemas folder, so these are minimal strict
# schemas written from the operator's documented fields (API reference, monitoring.coreos.com/v1): what we
# render must be among them, spelt right, with the documented types and duration format.
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_STRING_LIST = {"type": "array", "items": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": _STRINGS,
        "annotations": _STRINGS,
    },
    "additionalProperties": False,
}


def _object(kind: str, spec: dict) -> dict:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


_ENDPOINT = {
    "type": "object",
    "properties": {
        "port": {"type": "string"},
        "targetPort": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "path": {"type": "string"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "params": {"type": "object", "additionalProperties": _STRING_LIST},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "honorTimestamps": {"type": "boolean"},
        "relabelings": {"type": "array", "items": {"type": "object"}},
        "metricRelabelings": {"type": "array", "items": {"type": "object"}},
    },
    "additionalProperties": False,
}
_RULE = {
    "type": "object",
    "required": ["expr"],
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "for": _DURATION,
        "keep_firing_for": _DURATION,
        "labels": _STRINGS,
        "annotations": _STRINGS,
    },
    "additionalProperties": False,
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
}
MONITORING_SCHEMAS = {
    "ServiceMonitor": _object(
        "ServiceMonitor",
        {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "properties": {"matchLabels": _STRINGS, "matchExpressions": {"type": "array"}},
                    "additionalProperties": False,
                },
                "namespaceSelector": {
                    "type": "object",
                    "properties": {"any": {"type": "boolean"}, "matchNames": _STRING_LIST},
                    "additionalProperties": False,
                },
                "jobLabel": {"type": "string"},
                "targetLabels": _STRING_LIST,
                "podTargetLabels": _STRING_LIST,
                "sampleLimit": {"type": "integer", "minimum": 0},
                "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
            },
            "additionalProperties": False,
        },
    ),
    "PrometheusRule": _object(
        "PrometheusRule",
        {
            "type": "object",
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _DURATION,
                            "limit": {"type": "integer"},
                            "rules": {"type": "array", "items": _RULE},
                        },
                        "additionalProperties": False,
                    },
                }
            },
            "additionalProperties": False,
        },
    ),
}


def validate_monitoring(doc: dict) -> None:
    jsonschema.Draft7Validator(MONITORING_SCHEMAS[doc["kind"]]).validate(doc)


def validate_manifest(doc: dict) -> None:
    if doc["apiVersion"].startswith("batch.volcano.sh/"):
        validate_volcano_job(doc)
    elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
        validate_monitoring(doc)
    else:
        validate_builtin(doc)
