"""`-r --promotion-gate RULE` reaches cube-transfer the same way on both backends."""

import json
import subprocess
import sys

import yaml
from helpers_kube import EXAMPLE_DATA_CONFIG, EXAMPLE_SLOT_CONF, render_plan
from helpers_kube_schema import validate_builtin

RULE = "auc_drop<=0.002,calibration=0.9..1.1"


def _transfer_env(manifests):
    (path,) = [p for p in manifests.iterdir() if "cube-transfer" in p.name]
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc["kind"] == "Deployment":
            validate_builtin(doc)
            return {e["name"]: e.get("value") for e in doc["spec"]["template"]["spec"]["containers"][0]["env"]}
    raise AssertionError("no cube-transfer Deployment rendered")


def test_gate_rule_is_set_in_the_manifest_and_the_local_plan(tmp_path):
    _, manifests = render_plan(tmp_path / "k8s", promotion_gate=RULE)
    assert _transfer_env(manifests)["ELASTIC_CTR_PROMOTION_GATE"] == RULE

    render_plan(tmp_path / "local", backend="local", promotion_gate=RULE)
    comps = json.loads((tmp_path / "local" / "local" / "components.json").read_text())
    text = json.dumps(comps)
    assert f'"ELASTIC_CTR_PROMOTION_GATE": "{RULE}"' in text


def test_no_gate_means_no_variable(tmp_path):
    _, manifests = render_plan(tmp_path / "k8s")
    assert "ELASTIC_CTR_PROMOTION_GATE" not in _transfer_env(manifests)


def test_a_bad_rule_fails_at_render_time_in_one_line(tmp_path):
    state = tmp_path / "state"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_control",
            "-r",
            "--backend",
            "local",
            "-s",
            str(EXAMPLE_SLOT_CONF),
            "-f",
            str(EXAMPLE_DATA_CONFIG),
            "--promotion-gate",
            "auc_drp<=0.002",
            "--state-dir",
            str(state),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "elastic-control: error: unknown gate rule 'auc_drp'; did you mean 'auc_drop'?"
    ]
    assert not state.exists()
