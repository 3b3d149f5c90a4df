"""The four documented invocations (-r, -a, -l, -c) as subprocesses, through the console script and
through `bash elastic-control.sh`, against the fake Kubernetes API; plus what users see when it fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers_kube_api import VOLCANO, FakeKubeAPI

from ctr_foundation.names import TOKEN_FILE

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPT = [str(REPO / ".venv" / "bin" / "elastic-control")]
SHIM = ["bash", str(REPO / "elastic-control.sh")]
DOCUMENTED_R = "-r -u 4 -m 20 -t 2 -p 2 -b 5 -s examples/slot.conf -f examples/data.config"


def run(entry, args, env, timeout=180):
    """Run from the repository (the documented paths are relative to it); never a traceback."""
    proc = subprocess.run([*entry, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    return proc


@pytest.fixture()
def kube_env(tmp_path):
    def make(**scenario):
        api = FakeKubeAPI(**scenario).__enter__()
        made.append(api)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_CTR_", "KUBERNETES_"))}
        env.update(
            KUBECONFIG=str(api.write_kubeconfig(tmp_path / f"kubeconfig-{len(made)}")),
            ELASTIC_CTR_STATE_DIR=str(tmp_path / f"state-{len(made)}"),
            ELASTIC_CTR_APPLY_TIMEOUT="60",
        )
        return api, env

    made: list[FakeKubeAPI] = []
    yield make
    for api in made:
        api.__exit__(None, None, None)


@pytest.mark.needs_venv
# The bash shim in the default suite (it and the console script both run elastic_control's main); both with -m slow.
@pytest.mark.parametrize(
    "entry",
    [pytest.param(CONSOLE_SCRIPT, marks=pytest.mark.slow, id="console-script"), pytest.param(SHIM, id="bash-shim")],
)
def test_the_four_documented_invocations(kube_env, entry):
    api, env = kube_env(recreate_trainer=True)
    state = Path(env["ELASTIC_CTR_STATE_DIR"])

    r = run(entry, [*DOCUMENTED_R.split(), "--backend", "k8s"], env)
    assert r.returncode == 0, r.stderr
    assert "rendered plan for the k8s backend" in r.stderr
    assert json.loads((state / "plan.json").read_text())["resources"] == {
        "cpu": 4,
        "mem": 20,
        "trainers": 2,
        "pservers": 2,
        "cube_shards": 5,
    }
    from elastic_control.kube.render import MANIFEST_FILES

    assert sorted(p.name for p in (state / "manifests").glob("*.yaml")) == sorted(f for f, _ in MANIFEST_FILES)

    r = run(entry, ["-a"], env)
    assert r.returncode == 0, r.stderr
    assert "Job default/elastic-ctr created" in r.stderr and "14/14 pods running" in r.stderr
    assert api.get(VOLCANO, "jobs", "default", "elastic-ctr")["spec"]["minAvailable"] == 4

    # --follow streams until interrupted, like `kubectl logs -f`; trainer 0's pod is recreated meanwhile.
    # As a terminal's Ctrl-C would reach it: a suite started in the background (`cmd &` in a script) ignores
    # SIGINT, and a child inherits that, so Python would never raise KeyboardInterrupt in it.
    follow = subprocess.Popen(
        [*entry, "-l", "--follow"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = follow.stdout.readline()
        lines.append(line)
        if "(stream ended: pod elastic-ctr-trainer-0 Succeeded; job Completed)" in line:
            break
    time.sleep(1)
    follow.send_signal(signal.SIGINT)
    out, err = follow.communicate(timeout=30)
    stdout = "".join(lines) + out
    assert follow.returncode == 130 and "Traceback" not in err, err
    assert "[trainer-0] (pod recreated: reattached to elastic-ctr-trainer-0)" in stdout
    assert stdout.index("step 20 loss 0.49") < stdout.index("training finished")
    assert "[elastic-ctr-fileserver-" in stdout and "[elastic-ctr-cube-transfer-" in stdout

    r = run(entry, ["-c"], env)
    assert r.returncode == 0, r.stderr
    assert "kubectl port-forward -n default svc/elastic-ctr-serving 8010:8010" in r.stderr
    client = json.loads((state / "client.json").read_text())
    assert client["serving_url"] == "http://127.0.0.1:8010" and len(client["slots"]) == 39


def test_auto_backend_says_which_and_why(kube_env):
    _, env = kube_env()
    r = run(CONSOLE_SCRIPT, [*DOCUMENTED_R.split(), "--backend", "auto"], env)
    assert r.returncode == 0 and "for the k8s backend" in r.stderr and "answered (Kubernetes v1.33.1)" in r.stderr


def test_unschedulable_job_through_the_cli(kube_env):
    _, env = kube_env(unschedulable=True)
    env["ELASTIC_CTR_APPLY_TIMEOUT"] = "2"
    assert run(CONSOLE_SCRIPT, [*DOCUMENTED_R.split(), "--backend", "k8s"], env).returncode == 0
    r = run(CONSOLE_SCRIPT, ["-a"], env)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("elastic-control: error: 10/14 pods running, not running after 2s: pod elastic-ctr-")
    assert "Insufficient cpu; lower -u (now 4), or add nodes" in last


def test_missing_volcano_through_the_cli(kube_env):
    api, env = kube_env(crd_installed=False)
    assert run(SHIM, [*DOCUMENTED_R.split(), "--backend", "k8s"], env).returncode == 0
    r = run(SHIM, ["-a"], env)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "elastic-control: error: Volcano is not installed: the CRD jobs.batch.volcano.sh does not exist; install "
        "Volcano from a pinned release, e.g. `kubectl apply -f https://raw.githubusercontent.com/volcano-sh/volcano/"
        "v1.11.0/installer/volcano-development.yaml` or `helm install volcano volcano-sh/volcano --version 1.11.0 "
        "-n volcano-system --create-namespace`"
    ]
    assert not [c for c in api.requests if c[0] == "POST"]


def _cli(*args) -> int:
    """``elastic-control ARGS`` in this process; its exit code."""
    from elastic_control.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return exit_info.value.code


def test_status_and_delete_subcommands_honour_the_group_state_dir(tmp_path, monkeypatch, capfd):
    """In-process through cli.main (subprocesses are covered above).

    `--state-dir X status` and `delete --state-dir X`.
    """
    from elastic_control.kube import adaptor

    state = str(tmp_path / "elsewhere")
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("ELASTIC_CTR_STATE_DIR", raising=False)
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "60")

    with FakeKubeAPI() as api:
        monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        adaptor.reset()
        assert _cli("--state-dir", state, *DOCUMENTED_R.split(), "--backend", "k8s") == 0
        assert _cli("--state-dir", state, "-a") == 0
        capfd.readouterr()
        assert _cli("--state-dir", state, "status") == 0
        assert "Running (running 4)" in capfd.readouterr().out
        assert _cli("delete", "--state-dir", state) == 0
        assert "Volcano job default/elastic-ctr deleted" in capfd.readouterr().err
        assert api.items(VOLCANO, "jobs") == []
    adaptor.reset()


@pytest.mark.parametrize("verb, deny", [(["status"], {"GET /deployments": 403}), (["delete"], {"DELETE /jobs": 403}),
                                        (["-l"], {"GET /pods": 401})])  # fmt: skip
def test_refused_api_calls_print_one_line(kube_env, verb, deny):
    api, env = kube_env(deny=deny)
    assert run(CONSOLE_SCRIPT, [*DOCUMENTED_R.split(), "--backend", "k8s"], env).returncode == 0
    r = run(CONSOLE_SCRIPT, verb, env)
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("elastic-control: error: the Kubernetes API server at http://127.0.0.1:")
    assert ("HTTP 401 Unauthorized" if "-l" in verb else "HTTP 403 Forbidden") in line


OPERATOR_TOKEN = "operator-test-token"


@pytest.fixture()
def kept_logs_fileserver(tmp_path):
    """A real file server serving an empty kept-logs folder, with the token -r keeps (pre-seeded below)."""
    from helpers_common import fileserver_in_thread

    with fileserver_in_thread(tmp_path / "files", token=OPERATOR_TOKEN, kept_logs=tmp_path / "kept") as url:
        yield url


def test_operator_commands_on_kubernetes(tmp_path, monkeypatch, capfd, kept_logs_fileserver):
    """In-process: `status -o json|yaml` and its exit codes, `-l COMPONENT --tail/--since`, unknown names."""
    import yaml

    from elastic_control.cli.exit_codes import EXIT_HEALTHY, EXIT_NOT_RUNNING, EXIT_USAGE_ERROR
    from elastic_control.kube import adaptor

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("ELASTIC_CTR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ELASTIC_CTR_APPLY_TIMEOUT", "60")

    (tmp_path / "state").mkdir()
    (tmp_path / "state" / TOKEN_FILE).write_text(OPERATOR_TOKEN + "\n")  # -r keeps a token it finds
    with FakeKubeAPI() as api:
        monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        adaptor.reset()
        assert _cli(*DOCUMENTED_R.split(), "--backend", "k8s") == 0
        assert _cli("-a") == 0
        capfd.readouterr()
        assert _cli("status", "-o", "json") == EXIT_HEALTHY
        doc = json.loads(capfd.readouterr().out)
        assert doc["backend"] == "k8s" and doc["health"] == "healthy", doc["health_reason"]
        assert _cli("status", "-o", "yaml") == EXIT_HEALTHY
        assert yaml.safe_load(capfd.readouterr().out)["health"] == "healthy"

        # The file server behind its Service: -l asks it for kept logs of earlier training pods (none yet).
        api.service_backends[("default", "elastic-ctr-fileserver", "http")] = kept_logs_fileserver
        assert _cli("-l", "trainer-1", "--tail", "1") == 0
        assert capfd.readouterr().out == "[elastic-ctr-trainer-1] elastic-ctr-trainer-1 working\n"
        assert _cli("-l", "cube-server-4", "serving", "pserver-1", "--tail", "1") == 0
        out = capfd.readouterr().out.splitlines()
        assert out[0] == "[elastic-ctr-cube-4-" + out[0].split("-", 4)[-1] and out[0].endswith(" working")
        assert out[1].startswith("[elastic-ctr-serving-") and out[2].startswith("[elastic-ctr-pserver-1]")
        assert _cli("-l", "trainer-0", "--since", "1h") == 0
        assert "step 20 loss 0.49" in capfd.readouterr().out
        log_queries = [q for m, p, q in api.requests if p.endswith("/log")]
        assert log_queries[-1].get("sinceSeconds") == "3600" and "tailLines" not in log_queries[-1]
        assert log_queries[0].get("tailLines") == "1"

        assert _cli("-l", "trainer-2") == EXIT_USAGE_ERROR
        err = capfd.readouterr().err
        assert "no component 'trainer-2' in this plan; did you mean 'trainer-1'?" in err
        assert "known: mlflow, fileserver, cube-server-0, cube-agent-0," in err and "trainer-1)" in err

        assert _cli("delete") == 0
        assert _cli("status", "--json") == EXIT_NOT_RUNNING
        assert json.loads(capfd.readouterr().out)["health"] == "not running"
    adaptor.reset()
