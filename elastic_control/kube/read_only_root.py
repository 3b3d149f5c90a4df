"""Every container of every pod runs with a read-only root file system and a private, writable /tmp.

Applied to the rendered documents (render.finish_documents, before the user's pod overlay, which may
undo it for a container that must write elsewhere): `readOnlyRootFilesystem: true` in each container's
securityContext, an emptyDir volume `tmp` mounted at /tmp in each container, init containers too.
The image then cannot be changed from inside a pod (no dropped binaries, no edited code); what the
components write goes to their volumes (claims, emptyDirs) or to /tmp (Python's tempfile, Paddle's and
MLflow's scratch files). The pod harness runs containers this way (tests/pod_harness/container_entry.py).
"""

from __future__ import annotations

from elastic_control.kube.pod_overlay import pod_templates

TMP_VOLUME = "tmp"
TMP_PATH = "/tmp"


def read_only_root(doc: dict) -> None:
    for template in pod_templates(doc):
        spec = template["spec"]
        volumes = spec.setdefault("volumes", [])
        if not any(v.get("name") == TMP_VOLUME for v in volumes):
            volumes.append({"name": TMP_VOLUME, "emptyDir": {}})
        for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            c.setdefault("securityContext", {})["readOnlyRootFilesystem"] = True
            mounts = c.setdefault("volumeMounts", [])
            if not any(m.get("mountPath") == TMP_PATH for m in mounts):
                mounts.append({"name": TMP_VOLUME, "mountPath": TMP_PATH})
