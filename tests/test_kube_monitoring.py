"""Prometheus Operator objects (ServiceMonitors, a PrometheusRule) where the cluster serves monitoring.coreos.com/v1,
the alerts' ConfigMap elsewhere; the rules pass promtool; the training job's TTL and what -a and status make of a
job the TTL removed."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from helpers_kube import render_plan
from helpers_kube_api import MONITORING, VOLCANO, fake_cluster
from helpers_kube_schema import validate_manifest, validate_monitoring

from ctr_foundation.errors import UsageError
from elastic_control.backends import status as st
from elastic_control.kube import constants as k
from elastic_control.kube.backend import KubeBackend
from elastic_control.kube.render import load_manifests


def _docs(tmp_path, name="state", **kwargs):
    _, manifests = render_plan(tmp_path / name, cpu=4, mem=20, trainers=2, pservers=2, cube_shards=3, **kwargs)
    return load_manifests(manifests)


def _kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def _rules(docs) -> dict:
    """The alerting rules as Prometheus reads them, from whichever object carries them."""
    rule = _kind(docs, "PrometheusRule")
    if rule:
        return rule[0]["spec"]
    alerts = next(d for d in _kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-serving-alerts"))
    return yaml.safe_load(alerts["data"]["alerts.yml"])


@pytest.fixture()
def cluster(tmp_path, monkeypatch, request):
    with fake_cluster(tmp_path, monkeypatch, apply_timeout="30", **getattr(request, "param", {})) as api:
        yield api


# ---- rendering ------------------------------------------------------------------------------------------


def test_operator_objects_replace_the_configmap_and_validate(tmp_path):
    plain = _docs(tmp_path, "plain")
    docs = _docs(tmp_path, "operator", kube={"prometheus_operator": True})
    assert not _kind(plain, "ServiceMonitor") and not _kind(plain, "PrometheusRule")
    assert not any(d["metadata"]["name"] == "elastic-ctr-serving-alerts" for d in _kind(docs, "ConfigMap"))
    assert _rules(docs) == _rules(plain)  # one set of rules, whichever object carries it
    (rule,) = _kind(docs, "PrometheusRule")
    monitors = {d["metadata"]["name"]: d for d in _kind(docs, "ServiceMonitor")}
    assert sorted(monitors) == ["elastic-ctr-cube", "elastic-ctr-serving"]
    for doc in [rule, *monitors.values()]:
        assert doc["apiVersion"] == MONITORING
        validate_manifest(doc)
        assert doc["metadata"]["labels"][k.LABEL_INSTANCE] == "elastic-ctr"
    # Each ServiceMonitor finds its Services, and a port of that name on them: serving's http, every cube
    # shard's lookup port (not the agents' Services, which carry the same labels but no such port).
    services = _kind(docs, "Service")
    for name, want_port, want in (("elastic-ctr-serving", "http", 1), ("elastic-ctr-cube", "cube", 3)):
        spec = monitors[name]["spec"]
        (endpoint,) = spec["endpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["port"] == want_port
        assert spec["namespaceSelector"] == {"matchNames": ["default"]}
        selected = [
            s
            for s in services
            if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
            and want_port in [p["name"] for p in s["spec"]["ports"]]
        ]
        assert len(selected) == want, name
    assert monitors["elastic-ctr-cube"]["spec"]["targetLabels"] == [k.LABEL_SHARD]
    # Prometheus may reach the cube shards' metrics port through the instance's NetworkPolicies.
    (scrape,) = [p for p in _kind(docs, "NetworkPolicy") if p["metadata"]["name"] == "elastic-ctr-metrics-scrapers"]
    assert scrape["spec"]["ingress"][0]["from"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": k.PROMETHEUS_POD_LABELS}}
    ]
    assert scrape["spec"]["ingress"][0]["ports"] == [{"port": "cube"}]
    validate_manifest(scrape)
    no_policy = _docs(tmp_path, "no-policy", kube={"prometheus_operator": True, "network_policy": False})
    assert not _kind(no_policy, "NetworkPolicy") and len(_kind(no_policy, "ServiceMonitor")) == 2


def test_monitoring_labels_reach_the_operator_objects_only(tmp_path):
    """kube-prometheus-stack's Prometheus selects ServiceMonitors and PrometheusRules by ``release``:
    --monitoring-label adds such labels to those objects and to nothing else (selectors stay the project's)."""
    labels = ("release=kube-prometheus-stack", "team=ctr")
    docs = _docs(tmp_path, kube={"prometheus_operator": True, "monitoring_labels": labels})
    operator_objects = _kind(docs, "ServiceMonitor") + _kind(docs, "PrometheusRule")
    assert len(operator_objects) == 3
    for doc in operator_objects:
        assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert doc["metadata"]["labels"]["team"] == "ctr" and doc["metadata"]["labels"][k.LABEL_INSTANCE]
        validate_manifest(doc)
        assert "release" not in str(doc["spec"].get("selector", {}))
    others = [d for d in docs if d not in operator_objects]
    assert others and not any("release" in (d["metadata"].get("labels") or {}) for d in others)


@pytest.mark.parametrize(
    "label, why",
    [
        ("release", "is not KEY=VALUE"),
        ("app.kubernetes.io/name=x", "is set by elastic-control itself"),
        ("bad key=x", "is not a valid label key"),
        ("release=" + "x" * 64, "is not a valid label value"),
    ],
)
def test_bad_monitoring_labels_are_refused_naming_the_problem(tmp_path, label, why):
    with pytest.raises(UsageError, match=f"--monitoring-label '.*': .*{why}"):
        _docs(tmp_path, kube={"prometheus_operator": True, "monitoring_labels": (label,)})


def test_the_operator_crd_schemas_refuse_what_the_operator_would(tmp_path):
    """The real CRDs, made strict, catch a misspelt field, a bad duration, a wrong type and a missing field."""
    import copy

    import jsonschema

    docs = _docs(tmp_path, kube={"prometheus_operator": True})
    monitor, rule = _kind(docs, "ServiceMonitor")[0], _kind(docs, "PrometheusRule")[0]
    cases = [
        (monitor, lambda d: d["spec"]["endpoints"][0].update(intervall="30s"), "'intervall' was unexpected"),
        (monitor, lambda d: d["spec"]["endpoints"][0].update(scheme="ftp"), "'ftp' is not one of"),
        (monitor, lambda d: d["spec"].pop("selector"), "'selector' is a required property"),
        (rule, lambda d: d["spec"]["groups"][0]["rules"][0].update({"for": "ten minutes"}), "ten minutes"),
        (rule, lambda d: d["spec"]["groups"][0].update(limit="3"), "'3' is not of type 'integer'"),
        (rule, lambda d: d["spec"]["groups"][0]["rules"][0].pop("expr"), "'expr' is a required property"),
    ]
    for doc, spoil, message in cases:
        validate_monitoring(doc)
        bad = copy.deepcopy(doc)
        spoil(bad)
        with pytest.raises(jsonschema.ValidationError, match=re.escape(message)):
            validate_monitoring(bad)
    with pytest.raises(LookupError, match="serves no version v2"):  # refused, not validated loosely
        validate_monitoring({**rule, "apiVersion": "monitoring.coreos.com/v2"})


# ---- promtool --------------------------------------------------------------------------------------------


def _unit_tests() -> dict:
    """One `promtool test rules` case per alert: quiet before its `for`, firing with its labels after."""
    calibration = 'serving_alert{kind="calibration",arm="control",version="pass-1"}'
    coverage = 'serving_alert{kind="coverage",arm="challenger",version="pass-2",slot="7"}'
    return {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": calibration, "values": "1x30"},
                    {"series": coverage, "values": "0x5 1x30"},
                    {"series": 'serving_requests_total{code="200"}', "values": "0+100x30"},
                    {"series": 'serving_requests_total{code="503"}', "values": "0+10x30"},
                ],
                "alert_rule_test": [
                    {"eval_time": "5m", "alertname": "ElasticCtrCalibration", "exp_alerts": []},
                    {
                        "eval_time": "15m",
                        "alertname": "ElasticCtrCalibration",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "arm": "control", "version": "pass-1"},
                                "exp_annotations": {
                                    "summary": "arm control (pass-1): calibration outside serving's band",
                                    "description": "mean prediction / observed CTR of joined click feedback; "
                                    "see /v1/monitor",
                                },
                            }
                        ],
                    },
                    {"eval_time": "12m", "alertname": "ElasticCtrFeatureCoverage", "exp_alerts": []},
                    {
                        "eval_time": "20m",
                        "alertname": "ElasticCtrFeatureCoverage",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "arm": "challenger",
                                    "version": "pass-2",
                                    "slot": "7",
                                },
                                "exp_annotations": {
                                    "summary": "arm challenger (pass-2): slot 7 keys mostly unknown to cube"
                                },
                            }
                        ],
                    },
                    {"eval_time": "3m", "alertname": "ElasticCtrServingErrors", "exp_alerts": []},
                    {
                        "eval_time": "15m",
                        "alertname": "ElasticCtrServingErrors",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "critical"},
                                "exp_annotations": {"summary": "more than 1% of prediction requests fail (5xx)"},
                            }
                        ],
                    },
                ],
            }
        ],
    }


@pytest.mark.needs_promtool
@pytest.mark.parametrize("operator", [True, False], ids=["PrometheusRule", "ConfigMap"])
def test_promtool_checks_the_rules_and_their_unit_tests(tmp_path, operator):
    rules = _rules(_docs(tmp_path, kube={"prometheus_operator": operator}))
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    (tmp_path / "rules_test.yml").write_text(yaml.safe_dump(_unit_tests(), sort_keys=False))
    for argv in (["check", "rules", "rules.yml"], ["test", "rules", "rules_test.yml"]):
        out = subprocess.run(["promtool", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
    assert (
        "3 rules found"
        in subprocess.run(
            ["promtool", "check", "rules", "rules.yml"], cwd=tmp_path, capture_output=True, text=True
        ).stdout
    )


# ---- discovery and -a -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cluster", [{"prometheus_operator": True}], indirect=True)
def test_r_discovers_the_operator_and_a_applies_then_prunes_its_objects(cluster, tmp_path, capsys):
    docs = _docs(tmp_path)  # -r asks the cluster: it serves monitoring.coreos.com/v1
    assert len(_kind(docs, "ServiceMonitor")) == 2 and _kind(docs, "PrometheusRule")
    plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=2, cube_shards=3)
    KubeBackend().apply(plan).wait()
    assert cluster.get(MONITORING, "servicemonitors", "default", "elastic-ctr-cube")["spec"]["endpoints"]
    assert cluster.get(MONITORING, "prometheusrules", "default", "elastic-ctr-serving-alerts")
    capsys.readouterr()
    KubeBackend().apply(plan).wait()  # unchanged: nothing written
    assert "ServiceMonitor default/elastic-ctr-serving unchanged" in capsys.readouterr().err
    # --no-prometheus-operator: the ConfigMap comes back, the operator's objects are pruned
    plan, _ = render_plan(
        tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=2, cube_shards=3, kube={"prometheus_operator": False}
    )
    KubeBackend().apply(plan).wait()
    assert cluster.get(MONITORING, "servicemonitors", "default", "elastic-ctr-cube") is None
    assert cluster.get(MONITORING, "prometheusrules", "default", "elastic-ctr-serving-alerts") is None
    assert cluster.get("v1", "configmaps", "default", "elastic-ctr-serving-alerts")["data"]["alerts.yml"]
    assert "PrometheusRule default/elastic-ctr-serving-alerts pruned" in capsys.readouterr().err
    KubeBackend().attach(plan).delete()  # a cluster with the operator: delete lists its kinds too


def test_r_without_the_operator_keeps_the_configmap_and_delete_skips_its_kinds(cluster, tmp_path):
    docs = _docs(tmp_path)
    assert not _kind(docs, "ServiceMonitor") and _rules(docs)["groups"]
    plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=2, cube_shards=3)
    KubeBackend().apply(plan).wait()
    KubeBackend().attach(plan).delete()  # lists ServiceMonitors: 404 here, which means none


# ---- the training job's TTL --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, ttl", [(None, 86400), ("never", None), ("90m", 5400), ("3600", 3600), ("7d", 604800), ("0", 0)]
)
def test_job_ttl(tmp_path, flag, ttl):
    kube = {} if flag is None else {"job_ttl": flag}
    (job,) = [d for d in _docs(tmp_path, kube=kube) if d["apiVersion"] == VOLCANO]
    assert job["spec"].get("ttlSecondsAfterFinished") == ttl
    for task in job["spec"]["tasks"]:
        for container in task["template"]["spec"]["containers"]:
            assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


@pytest.mark.parametrize("flag", ["1h1d", "soon", "-5", "9999999999"])
def test_bad_job_ttl_is_refused_naming_the_accepted_forms(tmp_path, flag):
    with pytest.raises(UsageError, match=r"--job-ttl .*(seconds \(3600\), 90m, 24h, 7d or never|use never)"):
        _docs(tmp_path, kube={"job_ttl": flag})


def test_a_job_its_ttl_removed_is_not_run_again_and_status_says_it_finished(cluster, tmp_path, capsys):
    from elastic_control.kube import objects as ob

    plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=2, pservers=2, cube_shards=2)
    KubeBackend().apply(plan).wait()
    job = cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")
    record = cluster.get("v1", "configmaps", "default", "elastic-ctr-training-record")
    assert record["data"]["spec-hash"] == job["metadata"]["annotations"][k.SPEC_HASH_ANNOTATION]
    assert record["data"]["ttl-seconds-after-finished"] == "86400"
    ob.delete_volcano_job("elastic-ctr", "default", wait=30)  # what Volcano's TTL does once the job finished
    cluster.requests.clear()
    capsys.readouterr()
    KubeBackend().apply(plan)
    assert not [p for m, p, _ in cluster.requests if m == "POST" and "/jobs" in p]
    assert "Job default/elastic-ctr kept removed" in capsys.readouterr().err
    status = KubeBackend().attach(plan).status(probe=False)
    (training,) = [c for c in status.components if c.kind == "training"]
    assert training.state == st.COMPLETED and "Removed" in training.detail
    # A changed plan is a new job: created again.
    plan, _ = render_plan(tmp_path / "state", cpu=4, mem=20, trainers=3, pservers=2, cube_shards=2)
    KubeBackend().apply(plan)
    assert cluster.get(VOLCANO, "jobs", "default", "elastic-ctr")["spec"]["minAvailable"] == 5
    # delete removes the record with the rest
    KubeBackend().attach(plan).delete()
    assert cluster.get("v1", "configmaps", "default", "elastic-ctr-training-record") is None
