"""Packaging and tooling: the wheel carries templates/ and renders every manifest from it; the tree is ruff-clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
from helpers_kube import EXAMPLE_DATA_CONFIG, EXAMPLE_SLOT_CONF, FIXED_TOKEN, REPO, render_plan

RUFF = Path(sys.executable).with_name("ruff")


@pytest.mark.needs_ruff
@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_passes_on_the_whole_tree(args):
    r = subprocess.run([str(RUFF), *args], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


RENDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import elastic_control
    from elastic_control import api
    from elastic_control.config import Resources

    assert "site-packages" in elastic_control.__file__, elastic_control.__file__  # the wheel, not the tree
    state = Path(sys.argv[1])
    state.mkdir()
    (state / "token").write_text(sys.argv[4] + "\\n")
    api.configure_resource(
        resources=Resources(cpu=4, mem=20, trainers=2, pservers=2, cube_shards=5),
        slot_conf=sys.argv[2], data_config=sys.argv[3], backend="k8s", state_dir=str(state),
    )
    """
)


def test_wheel_installed_without_the_source_tree_renders_the_same_manifests(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("elastic_ctr-*.whl")
    # templates/ at the top of the tree ships inside the package.
    with zipfile.ZipFile(wheel) as z:
        shipped = {Path(n).name for n in z.namelist() if n.startswith("elastic_control/templates/")}
    assert shipped == {p.name for p in (REPO / "templates").glob("*.j2")}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    vpy = venv / "bin" / "python"
    # Third-party dependencies come from this environment's site-packages (a path entry: its editable
    # install of the checkout is not activated); the project itself only from the wheel.
    site = Path(
        subprocess.check_output(
            [vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    shutil.copy(EXAMPLE_SLOT_CONF, work / "slot.conf")
    shutil.copy(EXAMPLE_DATA_CONFIG, work / "data.config")
    (work / "render.py").write_text(RENDER)
    r = subprocess.run(
        [vpy, "render.py", str(work / "state"), "slot.conf", "data.config", FIXED_TOKEN],
        cwd=work,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr
    _, checkout = render_plan(tmp_path / "checkout-state")
    wheel_manifests = work / "state" / "manifests"
    names = sorted(p.name for p in checkout.iterdir())
    assert names and names == sorted(p.name for p in wheel_manifests.iterdir())
    for name in names:
        assert (wheel_manifests / name).read_text() == (checkout / name).read_text(), name
