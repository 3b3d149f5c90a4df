"""Validating rendered manifests against real schemas (shared by the kube and CLI tests).

Built-in kinds: kubernetes_validate (strict). The Volcano Job: jsonschema against
the CRD's openAPIV3Schema, made strict (additionalProperties: false wherever
properties are declared) so a misspelt field fails instead of being ignored.
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


def validate_manifest(doc: dict) -> None:
    if doc["apiVersion"].startswith("batch.volcano.sh/"):
        validate_volcano_job(doc)
    else:
        validate_builtin(doc)
