"""Merge a user's pod overlay (node selectors, tolerations, affinity, labels...) into every pod.

The overlay comes from ``-r --pod-overlay FILE`` (validated by ``options.validate_pod_overlay``)
and is applied to every pod template a plan renders: Deployments, the training
job's tasks and the evaluation jobs. Lists are appended, mappings merged; what
the manifests set themselves (our labels, the shared-claim affinity) is kept.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator


def pod_templates(doc: dict) -> Iterator[dict]:
    """Every pod template of a rendered object (``{"metadata", "spec"}`` dicts), in place."""
    kind = doc.get("kind")
    spec = doc.get("spec") or {}
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet") and "template" in spec:
        yield spec["template"]
    elif kind == "Job" and doc.get("apiVersion", "").startswith("batch.volcano.sh/"):
        for task in spec.get("tasks") or []:
            yield task["template"]


def _merge(ours, theirs):
    """Deep merge: mappings key by key, lists appended, scalars from ``theirs``."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        merged = dict(ours)
        for key, value in theirs.items():
            merged[key] = _merge(ours[key], value) if key in ours else copy.deepcopy(value)
        return merged
    if isinstance(ours, list) and isinstance(theirs, list):
        return ours + copy.deepcopy(theirs)
    return copy.deepcopy(theirs)


def apply_pod_overlay(doc: dict, overlay: dict) -> dict:
    """``doc`` with ``overlay`` merged into each of its pod templates (``doc`` is changed and returned)."""
    if not overlay:
        return doc
    for template in pod_templates(doc):
        meta = template.setdefault("metadata", {})
        if overlay.get("labels"):
            meta["labels"] = {**overlay["labels"], **meta.get("labels", {})}
        if overlay.get("annotations"):
            meta["annotations"] = {**overlay["annotations"], **meta.get("annotations", {})}
        spec = template["spec"]
        if overlay.get("nodeSelector"):
            spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **overlay["nodeSelector"]}
        if overlay.get("tolerations"):
            spec["tolerations"] = spec.get("tolerations", []) + copy.deepcopy(overlay["tolerations"])
        if overlay.get("affinity"):
            spec["affinity"] = _merge(spec.get("affinity", {}), overlay["affinity"])
        if overlay.get("priorityClassName"):
            spec["priorityClassName"] = overlay["priorityClassName"]
    return doc
