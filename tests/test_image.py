"""The container image, built from the Dockerfile and run as a cluster runs it.

The session fixture ``image`` (conftest.py, helpers_image.py) builds ``elastic-ctr:VERSION`` once per
test run with scripts/build-image.sh (podman;
the bootstrapped base and the layers stay in podman's store, so a run whose Dockerfile and
requirements are unchanged rebuilds only ElasticCTR's own files, in seconds). Every check starts the
real container with the restricted security context the pods get: uid/gid 10001, a read-only root
with a tmpfs /tmp, all capabilities dropped, no-new-privileges, no network, the runc runtime.

Without podman every test here is skipped with the reason "podman not available".
"""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers_image import UID, Image

REPO = Path(__file__).resolve().parents[1]
# Product packages, as setup.cfg's find: includes them.
PACKAGES = ("ctr_foundation", "elastic_control", "cube", "client")


def _console_scripts() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return {ln.split("=", 1)[0].strip() for ln in lines if ln.strip()}


def _manifest_commands() -> set[str]:
    """Every program a manifest starts: the first word of each template's `command:`, every component's
    console script in the catalogue and every `exec PROGRAM` in the shell entries the renderer builds
    (wherever the templates live)."""
    sources = [p for p in REPO.rglob("*.j2") if not {".venv", "tests", "build"} & set(p.relative_to(REPO).parts)]
    sources += list((REPO / "elastic_control").rglob("*.py"))
    found: set[str] = set()
    for path in sources:
        text = path.read_text()
        found.update(re.findall(r'command:\s*\[\s*"([^"]+)"', text))
        found.update(re.findall(r'command:\s*\n\s*-\s*"([^"]+)"', text))
        found.update(re.findall(r'\bscript="([^"]+)"', text))  # the component catalogue's console scripts
        if path.suffix == ".j2" or "kube" in path.parts:
            found.update(re.findall(r"\bexec ([a-z][\w.-]*)", text))
    return found


def test_every_program_the_manifests_start_exists_and_starts(image):
    programs = _manifest_commands() | _console_scripts() | {"mlflow"}
    assert {"elastic-control", "cube-server", "cube-agent", "cube-transfer", "mlflow", "/bin/sh"} <= programs
    res = image.python(
        f"""
        import json, shutil, subprocess
        out = {{}}
        for name in {sorted(programs)!r}:
            path = shutil.which(name)
            if path is None:
                out[name] = "missing"
            elif name.startswith("/") or name in ("sh", "sleep", "mkdir", "cp"):
                out[name] = "ok"
            else:
                p = subprocess.run([name, "--help"], capture_output=True, text=True, timeout=120)
                out[name] = "ok" if p.returncode == 0 else f"exit {{p.returncode}}: {{p.stderr[-800:]}}"
        print(json.dumps(out))
        """
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert {k: v for k, v in results.items() if v != "ok"} == {}


def test_runtime_stack_imports_and_runs_as_the_non_root_user(image):
    res = image.python(
        """
        import os, pyarrow, mlflow, paddle, pyarrow.fs
        print(os.getuid(), os.getgid(), paddle.__version__, pyarrow.__version__, mlflow.__version__)
        """
    )
    assert res.returncode == 0, res.stderr[-3000:]
    uid, gid, paddle_version, *_ = res.stdout.split()
    assert (uid, gid, paddle_version) == (str(UID), str(UID), "2.6.2")


def _dev_only_distributions() -> list[str]:
    def names(path: Path) -> set[str]:
        out = set()
        for ln in path.read_text().splitlines():
            ln = ln.split("#", 1)[0].strip()
            if ln and not ln.startswith("-"):
                out.add(re.split(r"[<>=!~;\[ ]", ln, maxsplit=1)[0].lower())
        return out

    return sorted(names(REPO / "requirements-dev.txt") - names(REPO / "requirements.txt"))


def test_no_test_only_package_is_in_the_image(image):
    dev_only = _dev_only_distributions()
    assert {"pytest", "scikit-learn", "redis"} <= set(dev_only)
    res = image.python(
        f"""
        import importlib.util, json
        from importlib.metadata import distributions
        installed = {{(d.metadata["Name"] or "").lower().replace("_", "-") for d in distributions()}}
        present = [n for n in {dev_only!r} if n.replace("_", "-") in installed]
        modules = [m for m in ("pytest", "sklearn", "redis", "scipy") if importlib.util.find_spec(m)]
        print(json.dumps([present, modules]))
        """
    )
    assert res.returncode == 0, res.stderr[-3000:]
    present, modules = json.loads(res.stdout.strip().splitlines()[-1])
    assert present == [] and modules == []


def _product_modules() -> list[str]:
    modules = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if "__pycache__" in parts or parts[-1] == "__main__":
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules.append(".".join(parts))
    return modules


def test_every_product_module_imports_in_the_image(image):
    """A module importing a package only the test environment has (or a file the build left out)
    fails here, as it would in a pod."""
    modules = _product_modules()
    assert len(modules) > 50
    res = image.python(
        f"""
        import importlib, json, traceback
        import pyarrow  # before paddle in every process (zlib clash otherwise)
        failed = {{}}
        for name in {modules!r}:
            try:
                importlib.import_module(name)
            except BaseException as e:
                failed[name] = traceback.format_exception_only(type(e), e)[-1].strip()
        print(json.dumps(failed))
        """,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {}


def test_every_installed_file_is_readable_by_the_pods_user(image):
    res = image.python(
        """
        import json, os, sys
        bad = []
        roots = [sys.prefix, "/opt/hadoop", "/etc/ssl/certs", "/usr/lib/python3.11", "/usr/local/lib"]
        for root in roots:
            for d, dirs, files in os.walk(root):
                if not os.access(d, os.R_OK | os.X_OK):
                    bad.append(d)
                for f in files:
                    p = os.path.join(d, f)
                    if os.path.exists(p) and not os.access(p, os.R_OK):
                        bad.append(p)
        bin_dir = os.path.join(sys.prefix, "bin")
        scripts = [os.path.join(bin_dir, s) for s in os.listdir(bin_dir) if not s.lower().startswith("activate")]
        bad += [s for s in scripts if not os.access(s, os.X_OK)]
        print(json.dumps(bad[:50]))
        """
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []


def test_a_fresh_pod_loads_the_kernels_compiled_into_the_image(image):
    """Read-only root, an empty /tmp (as in a pod): every kernel comes from the image's seed, copied into
    NUMBA_CACHE_DIR, and none is compiled (a cache miss is a compile: 13.5 s of CPU for all of them)."""
    res = image.python(
        """
        import json, os, time
        t = time.process_time()
        from elastic_control.kube import kernel_cache
        names = kernel_cache.compile_all()
        kernels = kernel_cache.loaded_kernels()
        hits = sum(sum(k.stats.cache_hits.values()) for k in kernels)
        misses = sum(sum(k.stats.cache_misses.values()) for k in kernels)
        print(json.dumps([names, hits, misses, os.path.isdir(os.environ["NUMBA_CACHE_DIR"]), time.process_time() - t]))
        """
    )
    assert res.returncode == 0, res.stderr[-3000:]
    names, hits, misses, copied, cpu = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"elastic_control.data.byte_scan._scan", "cube.lookup_kernel.gather_answer"} <= set(names)
    assert copied and misses == 0 and hits >= len(names) // 2, (hits, misses, names)


def test_data_clients_the_docs_promise(image):
    """s3:// opens through pyarrow's S3 client; hdfs:// without the image's HDFS build is refused with a
    message saying how to build it (with Hadoop, the client must be there)."""
    res = image.python(
        """
        import json, os
        from ctr_foundation.errors import DataError
        from elastic_control.data.filesystems import open_location
        os.environ.update(AWS_REGION="us-east-1", AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y",
                          AWS_ENDPOINT_URL="http://127.0.0.1:9")
        s3 = open_location("s3://bucket/data")
        try:
            open_location("hdfs://namenode:8020/data")
            hdfs = "opened"
        except DataError as e:
            hdfs = str(e)
        print(json.dumps([type(s3.fs).__name__, s3.path, hdfs, os.path.exists("/opt/hadoop/pathing.jar")]))
        """
    )
    assert res.returncode == 0, res.stderr[-3000:]
    s3_fs, s3_path, hdfs, with_hadoop = json.loads(res.stdout.strip().splitlines()[-1])
    assert s3_path == "bucket/data" and s3_fs in ("S3FileSystem", "ArrowFSWrapper")
    if with_hadoop:
        assert "libhdfs" not in hdfs, hdfs  # the client loads; only the unreachable name node fails
    else:
        assert "HADOOP_VERSION" in hdfs, hdfs


def _work_volume(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o777)  # the pods' user writes here, as on an fsGroup volume
    (work / "slot.conf").write_text("".join(f"{s}\n" for s in range(1, 7)))
    (work / "data.config").write_text(
        "export START_DATE_HR=20191221/00\nexport END_DATE_HR=20191221/00\n"
        'export DATASET_PATH="/var/lib/elastic-ctr/data"\nexport MODEL_PATH="/var/lib/elastic-ctr/models"\n'
    )
    return work


TRAIN = (
    "elastic-control data synth --output data --hours 1 --lines-per-hour 1500 -s slot.conf"
    " && exec elastic-control train -f data.config -s slot.conf -t 1 -p 1 --timeout 600"
)


@pytest.mark.e2e
def test_training_runs_in_the_container_under_a_read_only_root(image, tmp_path):
    """Synthetic data and a whole training job (1 pserver, 1 trainer, as processes of the container)
    with only the volume and /tmp writable: anything written elsewhere fails the job."""
    work = _work_volume(tmp_path)
    res = image.run("/bin/sh", "-c", TRAIN, volumes=[(work, "/var/lib/elastic-ctr")], workdir="/var/lib/elastic-ctr")
    logs = "".join(p.read_text(errors="replace")[-2000:] for p in sorted((work / "models" / "logs").glob("*.log")))
    assert res.returncode == 0, f"{res.stderr[-3000:]}\n{logs}"
    assert res.stdout.strip().splitlines()[-1] == "pass-20191221-00"
    assert (work / "models" / "pass-20191221-00").is_dir()
    assert all(p.stat().st_uid == UID for p in (work / "models").rglob("*"))


def _memory_limits_apply(image: Image) -> str | None:
    """Why --memory cannot be enforced here, or None."""
    info = image.podman("info", "--format", "json", check=True)
    host = json.loads(info.stdout)["host"]
    if "memory" not in (host.get("cgroupControllers") or []):
        return f"the host's cgroups ({host.get('cgroupVersion')}) offer podman no memory controller"
    res = image.run("/bin/true", memory="64m")
    if res.returncode != 0:
        return f"podman run --memory fails here: {res.stderr.strip()[-300:]}"
    return None


def _training_roles(volume: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """{pserver-0, trainer-0: (argv, environment)} as the local backend starts them, on loopback, with the
    files on ``volume``."""
    from elastic_control.catalogue import Env, Loopback, Paths, training_job
    from elastic_control.local.components import job_ports

    paths = Paths(slot_conf=f"{volume}/slot.conf", data_config=f"{volume}/data.config", model_path=f"{volume}/models")
    roles = training_job(
        Loopback(job_ports(1, 1, [36100], [36110]), paths),
        pservers=1,
        trainers=1,
        env=[Env("MODEL_PATH", paths.model_path)],
    )
    return {c.name: ([c.script, *c.args], {e.name: e.value for e in c.env if e.value is not None}) for c in roles}


@pytest.mark.e2e
def test_a_trainer_over_its_memory_limit_is_oom_killed_with_137(image, tmp_path):
    """The trainer alone in a container limited to 200 MB (as in its pod; its pserver in a container of its
    own sharing the network namespace, as a pod's sidecar would): the kernel kills it, exit code 137."""
    why = _memory_limits_apply(image)
    if why:
        pytest.skip(why)
    volume = "/var/lib/elastic-ctr"
    work = _work_volume(tmp_path)
    mount = {"volumes": [(work, volume)], "workdir": volume}
    prepare = image.run(
        "elastic-control", "data", "synth", "--output", "data", "--hours", "1", "--lines-per-hour", "1500",
        "-s", "slot.conf", **mount,
    )  # fmt: skip
    assert prepare.returncode == 0, prepare.stderr[-2000:]
    roles = _training_roles(volume)
    pserver_argv, pserver_env = roles["pserver-0"]
    trainer_argv, trainer_env = roles["trainer-0"]
    name = f"elastic-ctr-oom-pserver-{os.getpid()}"
    trainer = f"elastic-ctr-oom-trainer-{os.getpid()}"
    start = image.run_args(env=pserver_env, **mount)
    start[start.index("--rm")] = "--detach"
    # --timeout: a run killed before its finally (a CI time-out, ^C twice) must not leave the detached
    # pserver running for hours; the test itself ends within its 600 s trainer time-out.
    image.podman(*start, "--name", name, "--timeout", "900", image.tag, *pserver_argv, check=True)
    try:
        args = image.run_args(env=trainer_env, memory="200m", **mount)
        args.remove("--rm")
        args[args.index("none")] = f"container:{name}"  # the pserver's network namespace: loopback shared
        res = image.podman(*args, "--name", trainer, image.tag, *trainer_argv, timeout=600)
        container_id = image.podman("inspect", "--format", "{{.Id}}", trainer).stdout.strip()
        state = json.loads(image.podman("inspect", "--format", "{{json .State}}", trainer).stdout or "{}")
    finally:
        # --ignore: without it podman 4.3 removes neither when one is missing (and exits 0).
        image.podman("rm", "--force", "--ignore", "--time", "2", trainer, name, timeout=60)
    assert res.returncode == 137, f"exit {res.returncode}: {res.stderr[-3000:]}"
    # The kernel's word that it was the memory cgroup's OOM killer, not another SIGKILL (conmon's OOMKilled
    # flag stays false on cgroup v1 hosts); without access to the kernel log, the exit code has to do.
    kernel = subprocess.run(["dmesg"], capture_output=True, text=True)
    if state.get("OOMKilled") is not True and kernel.returncode == 0 and container_id:
        kills = [ln for ln in kernel.stdout.splitlines() if "oom-kill" in ln and container_id in ln]
        assert kills, f"exit 137 without an OOM kill of {container_id} in the kernel log"
