"""Registering passes in MLflow: against the default SQLite store and a real `mlflow server` process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ctr_foundation import pass_format
from ctr_foundation.records import GOLDEN_FILE


def _fake_pass(root: Path, name: str) -> Path:
    """A pass folder with the files registration logs (content is arbitrary bytes; nothing loads it)."""
    folder = root / name
    (folder / pass_format.DENSE_DIR).mkdir(parents=True)
    (folder / pass_format.DENSE_DIR / "inference.pdmodel").write_bytes(b"model-" + name.encode())
    (folder / pass_format.DENSE_DIR / "inference.pdiparams").write_bytes(os.urandom(4096))
    (folder / pass_format.SPARSE_DIR / "000").mkdir(parents=True)
    (folder / pass_format.SPARSE_DIR / "000" / "part-000-00000.gz").write_bytes(b"big table")
    (folder / pass_format.META_FILE).write_text(json.dumps({"pass": name}))
    (folder / GOLDEN_FILE).write_text('{"line": "1 0 5:1", "prob": 0.25}\n')
    return folder


def _register_two_passes(models: Path) -> tuple[str, list]:
    from mlflow.tracking import MlflowClient

    from elastic_control.training.tracking import REGISTERED_MODEL, Tracker

    errors = []
    tracker = Tracker(models, run_name="test", warn=errors.append)
    got = []
    for hour in ("00", "01"):
        name = f"pass-20191221-{hour}"
        folder = _fake_pass(models, name)
        got.append(
            tracker.register_pass(
                folder,
                pass_name=name,
                window={"start": f"20191221/{hour}", "end": f"20191221/{hour}"},
                metrics={"auc": 0.75, "examples": 10},
            )
        )
    tracker.finish()
    assert errors == [] and got == ["1", "2"]
    client = MlflowClient(tracking_uri=tracker.uri, registry_uri=tracker.uri)
    return tracker.run_id, sorted(
        client.search_model_versions(f"name='{REGISTERED_MODEL}'"), key=lambda v: int(v.version)
    )


def _check_versions(models: Path, tmp_path: Path, run_id: str, versions: list) -> None:
    import mlflow.artifacts

    assert [v.tags["pass"] for v in versions] == ["pass-20191221-00", "pass-20191221-01"]
    for v in versions:
        name = v.tags["pass"]
        assert v.run_id == run_id and v.tags["auc"] == "0.750000" and v.tags["window_end"].endswith(name[-2:])
        assert v.tags["pass_dir"] == str((models / name).resolve())
        assert v.source.endswith(f"/passes/{name}")
        # The version's files come back from the registry, byte for byte; the sparse table is not logged.
        out = Path(mlflow.artifacts.download_artifacts(artifact_uri=v.source, dst_path=str(tmp_path / name)))
        for rel in ("dense/inference.pdmodel", "dense/inference.pdiparams", "meta.json", "golden.jsonl"):
            assert (out / rel).read_bytes() == (models / name / rel).read_bytes(), rel
        assert not (out / "sparse").exists()


def test_register_pass_in_default_sqlite_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    models = tmp_path / "models"
    models.mkdir()
    run_id, versions = _register_two_passes(models)
    _check_versions(models, tmp_path / "download", run_id, versions)


@pytest.mark.e2e
def test_register_pass_against_a_real_mlflow_server(tmp_path, monkeypatch, mlflow_server):
    url, root = mlflow_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    models = tmp_path / "models"
    models.mkdir()
    run_id, versions = _register_two_passes(models)
    _check_versions(models, tmp_path / "download", run_id, versions)
    # MLflow 3 aliases, no stages: candidate is the newest registered pass.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url, registry_uri=url)
    assert client.get_model_version_by_alias("elastic-ctr", "candidate").tags["pass"] == "pass-20191221-01"
    assert all(v.current_stage == "None" for v in versions)
    # The artifacts went through the server into its own artifact store.
    assert list((root / "artifacts").rglob("inference.pdiparams"))
