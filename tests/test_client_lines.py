"""`ctr-client predict` line by line: a bad line fails only itself, named by its input line number; a slot
that is not in slot.conf is refused (or warned about); --json for scripts; exit code 3 when lines were refused."""

from __future__ import annotations

import json

import pytest
import requests
from helpers_serving import serving_in_thread

from client.api import BatchRefused, ServingClient
from client.cli import main
from client.lines import EXIT_REFUSED_LINES, KnownSlots, line_problem, predict_file_lines
from ctr_foundation.slot_grammar import bad_token
from elastic_control.serving.instances import InstanceError, parse_instances
from elastic_control.serving.versions import ModelDirSource

GOOD = ["1 0 11:1 12:2 13:3", "1 1 21:1 22:2", "1 0 31:1", "1 0 41:1 42:4", "1 1 51:2"]
MALFORMED = "1 0 5:1 oops"


class StrictServing:
    """Serving's own request checks (instances.parse_instances) in front of a fixed answer: a request with
    one bad instance is refused whole, as serving refuses it; counts the requests. ``refused``: lines it
    refuses besides, as a serving with a rule the client cannot check would."""

    def __init__(self, refused=()):
        self.requests = 0
        self.refused = set(refused)

    def predict_instances(self, instances, *, routing_key=None):
        self.requests += 1
        try:
            parse_instances(instances)
            for i, inst in enumerate(instances):
                if inst["line"] in self.refused:
                    raise InstanceError(f"instance {i}: refused by this serving")
        except InstanceError as e:
            raise BatchRefused(f"serving refused the batch (HTTP 400): {e}", str(e)) from e
        probs = [0.01 * len(inst["line"]) for inst in instances]
        return {"predictions": probs, "request_id": f"r{self.requests}", "model_version": "v1", "arm": "control"}


def test_one_refused_line_among_batches_fails_alone_and_is_numbered_from_the_input():
    # A line that passes the client's own format check but that serving refuses: the refused batch is
    # halved until the line stands alone.
    serving = StrictServing(refused=["1 0 7:7"])
    lines = [GOOD[0], "", GOOD[1], "1 0 7:7", GOOD[2], GOOD[3], "", GOOD[4]]
    got = list(predict_file_lines(serving, lines, batch_size=4))
    assert [r.line for r in got] == [1, 3, 4, 5, 6, 8]
    bad = [r for r in got if not r.ok]
    assert [r.line for r in bad] == [4] and "refused by this serving" in bad[0].error
    assert not bad[0].error.startswith("instance")
    for r in got:
        if r.ok:
            assert r.probability == pytest.approx(0.01 * len(lines[r.line - 1]))
            assert r.request_id and r.index is not None and r.model_version == "v1"
    assert serving.requests <= 2 + 2 * 2  # two batches; the refused one halved down to its bad line


def test_local_checks_name_the_line_and_the_slot():
    serving = StrictServing()
    slots = KnownSlots(frozenset(range(1, 40)), "slot.conf /x/slot.conf")
    lines = [*GOOD[:2], MALFORMED, "1 0 123:77", "1 0 " + "1" * 23 + ":39", GOOD[2]]
    got = {r.line: r for r in predict_file_lines(serving, lines, slots=slots)}
    assert [n for n, r in got.items() if r.ok] == [1, 2, 6]
    assert bad_token("oops") in got[3].error
    assert got[4].error.startswith("slot 77 is not in slot.conf /x/slot.conf: slots 1, 2, 3")
    assert "serving would ignore its features (pass --unknown-slots warn" in got[4].error
    assert got[5].error == (
        f"feature '{'1' * 23}:39': feasign {'1' * 23} is above 2**64-1 (the largest unsigned 64-bit integer, "
        "18446744073709551615)"
    )
    warned = list(predict_file_lines(serving, ["1 0 123:77"], slots=slots, unknown_slots="warn"))
    assert warned[0].ok and warned[0].warning.startswith("slot 77 is not in slot.conf")


def test_predict_lines_raises_naming_the_input_line():
    with pytest.raises(Exception, match=r"input line 3: .*ASCII digits"):
        list(_Lines().predict_lines(["", GOOD[0], "1 0 \u00b2:1"], batch_size=64))


class _Lines(StrictServing):
    from client.api import _LinePredictor

    predict_lines = _LinePredictor.predict_lines


# ---- the command, against real serving ------------------------------------------------------------------


@pytest.fixture(scope="module")
def serving(synth_world):
    with serving_in_thread(ModelDirSource(synth_world.models), grpc=True, workers=1) as srv:
        yield srv


def _run(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(["predict", *map(str, args)])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_predict_prints_every_good_line_and_one_error_per_bad_line(serving, synth_world, tmp_path, capsys, transport):
    lines = [
        "1 0 11:1 12:2 13:3 14:4",
        "1 1 21:1 22:2",
        MALFORMED,
        "1 0 31:1 32:3",
        "1 0 123:77",
        "1 1 41:1 " + "9" * 23 + ":2",
        "",
        "1 0 51:1 52:2",
    ]
    data = tmp_path / "lines.txt"
    data.write_text("\n".join(lines) + "\n")
    good = [0, 1, 3, 7]
    want = requests.post(
        serving.url + "/v1/predict", json={"instances": [{"line": lines[i]} for i in good]}, timeout=30
    ).json()["predictions"]
    where = ["--serving", serving.url] + (
        ["--grpc", serving.grpc_target, "--transport", "grpc"] if transport == "grpc" else []
    )
    code, out, err = _run(capsys, data, "--batch-size", 2, *where)
    assert code == EXIT_REFUSED_LINES == 3
    printed = out.splitlines()
    assert len(printed) == 7  # one per non-blank line; nan where a line was refused
    assert [float(printed[i]) for i in (0, 1, 3, 6)] == pytest.approx(want, abs=1e-6)
    assert [printed[i] for i in (2, 4, 5)] == ["nan"] * 3
    errors = [ln for ln in err.splitlines() if ln.startswith("ctr-client: line ")]
    assert [e.split(":")[1].strip() for e in errors] == ["line 3", "line 5", "line 6"]
    assert bad_token("oops") in errors[0]
    assert "slot 77 is not in the model serving answers with" in errors[1]
    assert f"feasign {'9' * 23} is above 2**64-1" in errors[2]
    assert err.strip().endswith("3 of 7 lines refused (line 3, 5, 6); every other line was predicted")

    code, out, _ = _run(capsys, data, "--json", "--unknown-slots", "warn", *where)
    rows = [json.loads(ln) for ln in out.splitlines()]
    assert code == 3 and [r["line"] for r in rows] == [1, 2, 3, 4, 5, 6, 8]
    assert {r["line"] for r in rows if "error" in r} == {3, 6}
    assert "probability" in rows[4] and rows[4]["warning"].startswith("slot 77 is not in")
    first = rows[0]
    assert first["probability"] == pytest.approx(want[0], abs=1e-6) and first["model_version"]
    assert first["request_id"] and first["index"] == 0  # what feedback refers to

    code, out, err = _run(capsys, data, "--on-error", "fail", "--slot-conf", synth_world.slot_conf, *where)
    assert code == 3 and len(out.splitlines()) == 3  # lines 1, 2, then line 3's nan
    assert err.strip().splitlines()[-1].startswith("ctr-client: error: line 3: ")

    clean = tmp_path / "clean.txt"
    clean.write_text("\n".join(lines[i] for i in good) + "\n")
    code, out, _ = _run(capsys, clean, *where)
    assert code == 0 and [float(x) for x in out.split()] == pytest.approx(want, abs=1e-6)


def test_serving_client_status_lists_the_slots_the_client_checks(serving, synth_world):
    status = ServingClient(serving.url).status()
    assert sorted(status["slots"]) == sorted(synth_world.slots)


@pytest.mark.parametrize(
    "line",
    [
        "1 0 7:\u0663",  # an Arabic-Indic digit: int() takes it, the grammar does not
        "1 00 5:1",  # click is 0 or 1
        f"{1 << 63} 1 5:1",  # show beyond int64
        "1 1 5:1234567890",  # a 10-digit slot
        "1 1 5:1\u00a07:2",  # a no-break space between fields
        "1 1 1e999:40",
    ],
)
def test_the_client_refuses_a_line_in_the_words_serving_would_use(line):
    # One grammar (ctr_foundation/slot_grammar.py): what serving refuses, the client refuses before sending it.
    with pytest.raises(InstanceError) as refused:
        parse_instances([{"line": line}])
    error, _ = line_problem(line, None)
    assert f"instance 0: {error}" == str(refused.value)
    serving = StrictServing()
    got = list(predict_file_lines(serving, [GOOD[0], line], batch_size=4))
    assert got[1].error == error and serving.requests == 1  # the bad line is never sent
