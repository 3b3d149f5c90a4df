"""The client library and ctr-client command line (the model-backed paths are in test_serving.py)."""

from __future__ import annotations

import json
import subprocess

import pytest
import requests
from helpers_common import PYTHON, REPO, fileserver_in_thread, free_port

from client.api import (
    REMOTE_DATA_CONFIG,
    REMOTE_SLOT_CONF,
    GrpcServingClient,
    PredictionError,
    ServingClient,
    resolve_client_settings,
    upload_configs,
)
from client.cli import main
from ctr_foundation.errors import ConfigError, UsageError


@pytest.fixture
def state(tmp_path, monkeypatch):
    for var in ("ELASTIC_CTR_TOKEN", "ELASTIC_CTR_SERVING_URL", "ELASTIC_CTR_FILESERVER_URL"):
        monkeypatch.delenv(var, raising=False)
    d = tmp_path / "state"
    d.mkdir()
    (d / "token").write_text("t0ken\n")
    return d


def test_config_from_client_json_flags_win(state):
    (state / "client.json").write_text(
        json.dumps(
            {
                "serving_url": "http://a:8010",
                "fileserver_url": "http://b:8080",
                "slot_conf": "/x/slot.conf",
                "slots": [1, 2],
            }
        )
    )
    c = resolve_client_settings(state_dir=state)
    assert (c.serving_url, c.fileserver_url, c.slots, c.token) == ("http://a:8010", "http://b:8080", (1, 2), "t0ken")
    assert resolve_client_settings(state_dir=state, serving_url="http://c:1").serving_url == "http://c:1"
    (state / "client.json").write_text("{oops")
    with pytest.raises(ConfigError, match="client.json.*invalid JSON"):
        resolve_client_settings(state_dir=state)


def test_upload_validates_then_uploads_with_the_state_token(state, tmp_path):
    slot_conf = tmp_path / "slot.conf"
    slot_conf.write_text("1\n2\n# c\n3\n")
    data_config = REPO / "examples" / "data.config"
    with fileserver_in_thread(tmp_path / "fs", token="t0ken") as url:
        cfg = resolve_client_settings(state_dir=state, fileserver_url=url)
        done = upload_configs(cfg, slot_conf=str(slot_conf), data_config=str(data_config))
        assert [d["path"] for d in done] == [REMOTE_SLOT_CONF, REMOTE_DATA_CONFIG]
        # config/ (data.config carries credentials) is readable only with the token.
        assert requests.get(f"{url}/files/{REMOTE_DATA_CONFIG}").status_code == 401
        auth = {"Authorization": "Bearer t0ken"}
        assert requests.get(f"{url}/files/{REMOTE_SLOT_CONF}", headers=auth).text == slot_conf.read_text()
        from ctr_foundation.fileserver_client import FileServerClient

        assert FileServerClient(url, token=cfg.token).get_bytes(REMOTE_SLOT_CONF).decode() == slot_conf.read_text()
        bad = tmp_path / "bad.conf"
        bad.write_text("1\n1\n")
        with pytest.raises(ConfigError):
            upload_configs(cfg, slot_conf=str(bad))
        with pytest.raises(UsageError, match="nothing to upload"):
            upload_configs(cfg)


def test_predict_gives_up_after_the_retry_window_with_a_clear_error():
    c = ServingClient(f"http://127.0.0.1:{free_port()}", retry_for=0.3)
    with pytest.raises(Exception, match="batch starting at input line 3: serving .* unavailable"):
        list(c.predict_lines(["", "", "1 0 1:1"]))
    assert c.retries >= 1


def test_grpc_slots_instances_send_dense_numbers_in_their_own_map():
    """Unsigned integers (or digit strings) stay feasigns; any other number is a dense slot's value
    (serving decides by the model's slot kinds, as for HTTP): floats, negatives, decimal strings."""
    c = GrpcServingClient(f"127.0.0.1:{free_port()}")  # no call is made: the channel connects lazily
    try:
        inst = c._instance({"slots": {"1": [5, "7"], "40": 2.5, "41": [-3], "42": [7], "43": [], "44": "1e-3"}})
        assert {k: list(v.feasigns) for k, v in inst.slots.slots.items()} == {1: [5, 7], 42: [7], 43: []}
        assert dict(inst.slots.dense) == {40: 2.5, 41: -3.0, 44: 1e-3}
        for bad, words in (({"40": [1.5, 2.5]}, "a dense slot takes one number, got 2"), ({"40": True}, "True")):
            with pytest.raises(PredictionError, match=words):
                c._instance({"slots": bad})
    finally:
        c.close()


def test_cli_errors_are_one_line_with_exit_codes(state, capsys):
    with pytest.raises(SystemExit) as e:
        main(["predict", "-", "--state-dir", str(state)])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == "ctr-client: error: no serving address: run `elastic-control -c` first, or pass --serving URL"
    )
    with pytest.raises(SystemExit) as e:
        main(["predict", "/no/such/file", "--serving", "http://127.0.0.1:1"])
    assert e.value.code == 2


def test_health_reports_each_component(state, tmp_path, capsys):
    with fileserver_in_thread(tmp_path / "fs") as url:
        with pytest.raises(SystemExit) as e:
            main(["health", "--state-dir", str(state), "--fileserver", url])
        assert e.value.code == 0
        report = json.loads(capsys.readouterr().out)
        assert report == {"fileserver": {"status": "ok"}, "serving": "not configured", "serving_grpc": "not configured"}
        with pytest.raises(SystemExit) as e:
            main(
                [
                    "health",
                    "--state-dir",
                    str(state),
                    "--fileserver",
                    url,
                    "--serving",
                    f"http://127.0.0.1:{free_port()}",
                ]
            )
        assert e.value.code == 1


def test_entry_points_python_m_client_and_elastic_control_predict():
    out = subprocess.run([PYTHON, "-m", "client", "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "predict" in out.stdout and "upload" in out.stdout
    out = subprocess.run(
        [PYTHON, "-m", "elastic_control", "predict", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0 and "--batch-size" in out.stdout
