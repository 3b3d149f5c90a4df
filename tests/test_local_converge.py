"""-a on a running local pipeline converges it: only what the plan changes is stopped, started or restarted.

Small real child processes under the real supervisor (helpers_local.simple_plan).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
from helpers_local import simple_plan, supervised_layout, wait_until

from elastic_control.local import lifecycle
from elastic_control.local import runtime as rt
from elastic_control.local.ports import free_ports
from elastic_control.local.spec import LocalPlan, save_local_plan

pytestmark = pytest.mark.e2e


@pytest.fixture
def layout(tmp_path):
    with supervised_layout(tmp_path) as lay:
        yield lay


def pids(layout) -> dict:
    return {n: c["pid"] for n, c in rt.read_runtime(layout)["components"].items()}


def job_done(layout) -> bool:
    return (rt.read_runtime(layout).get("job") or {}).get("state") == rt.J_COMPLETED


def with_components(plan: LocalPlan, components) -> LocalPlan:
    return dataclasses.replace(plan, components=list(components))


def test_unchanged_plan_is_a_no_op(layout, capsys):
    simple_plan(layout, steps=5)
    record = lifecycle.apply(layout, show_progress=False)
    wait_until(lambda: job_done(layout), timeout=30, what="the job completed")
    before = pids(layout)
    changes = lifecycle.converge(layout)
    assert changes and all(c.action == "unchanged" for c in changes)
    out = capsys.readouterr()
    assert "nothing to do" in (out.out + out.err).replace("\n", " ")
    after = rt.read_runtime(layout)
    assert after["supervisor"]["pid"] == record["supervisor"]["pid"] and after["generation"] == 0
    assert pids(layout) == before and after["job"]["state"] == rt.J_COMPLETED


def test_new_changed_and_removed_services_only_them_and_the_job_is_left_alone(layout):
    plan = simple_plan(layout, steps=5)
    lifecycle.apply(layout, show_progress=False)
    wait_until(lambda: job_done(layout), timeout=30, what="the job completed")
    before = pids(layout)
    job_before = rt.read_runtime(layout)["job"]
    svc0, svc1, *members = plan.components
    (port,) = free_ports(1, exclude=set(svc0.all_ports + svc1.all_ports))
    extra = dataclasses.replace(svc1, name="svc-2", port=port, argv=[*svc1.argv[:-1], str(port)], after=["svc-0"])
    changed = dataclasses.replace(svc1, env={"SOMETHING": "new"})
    save_local_plan(with_components(plan, [svc0, changed, extra, *members]), layout.components_file)
    changes = {c.name: c.action for c in lifecycle.converge(layout)}
    assert changes == {"svc-0": "unchanged", "svc-1": "updated", "svc-2": "created",
                       "pserver-0": "unchanged", "trainer-0": "unchanged", "trainer-1": "unchanged"}  # fmt: skip
    record = rt.read_runtime(layout)
    now = pids(layout)
    assert now["svc-0"] == before["svc-0"] and now["svc-1"] != before["svc-1"]
    assert record["components"]["svc-2"]["state"] == rt.C_RUNNING
    assert record["job"]["state"] == rt.J_COMPLETED and record["job"]["attempt"] == job_before["attempt"]
    assert record["generation"] == 1
    # svc-2 removed again: pruned, its process gone; a second -a is a no-op.
    gone = now["svc-2"]
    save_local_plan(with_components(plan, [svc0, changed, *members]), layout.components_file)
    changes = {c.name: c.action for c in lifecycle.converge(layout)}
    assert changes["svc-2"].startswith("pruned") and changes["svc-1"] == "unchanged"
    assert "svc-2" not in rt.read_runtime(layout)["components"]
    wait_until(lambda: not _alive(gone), timeout=10, what="svc-2 stopped")
    assert all(c.action == "unchanged" for c in lifecycle.converge(layout))


def test_a_changed_job_member_restarts_the_job_and_a_changed_config_file_the_components_naming_it(layout):
    plan = simple_plan(layout, steps=5)
    lifecycle.apply(layout, show_progress=False)
    wait_until(lambda: job_done(layout), timeout=30, what="the job completed")
    attempt = rt.read_runtime(layout)["job"]["attempt"]
    components = [
        dataclasses.replace(c, env={**c.env, "STEPS": "8"}) if c.name == "trainer-1" else c for c in plan.components
    ]
    save_local_plan(with_components(plan, components), layout.components_file)
    changes = {c.name: c.action for c in lifecycle.converge(layout)}
    assert changes["trainer-1"] == "updated" and changes["svc-0"] == "unchanged"
    wait_until(lambda: job_done(layout), timeout=30, what="the job completed again")
    job = rt.read_runtime(layout)["job"]
    assert job["attempt"] == attempt + 1 and any(h["event"] == "plan changed" for h in job["history"])
    # A component naming data.config is restarted when that file's content changes.
    names = {c.name: c for c in components}
    svc0 = dataclasses.replace(names["svc-0"], env={"DATA_CONFIG": str(layout.local_data_config)})
    save_local_plan(with_components(plan, [svc0, *components[1:]]), layout.components_file)
    lifecycle.converge(layout)
    before = pids(layout)["svc-0"]
    layout.local_data_config.write_text('export START_DATE_HR="20200102/00"\n')
    changes = {c.name: c.action for c in lifecycle.converge(layout)}
    assert changes["svc-0"] == "updated" and changes["svc-1"] == "unchanged"
    assert pids(layout)["svc-0"] != before


def _alive(pid) -> bool:
    from helpers_local import alive

    return alive(pid)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
