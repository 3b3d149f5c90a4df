"""The compiled scan of a body of lines only (elastic_control/serving/body_scan.py) against JSON: what it
accepts decodes to the same lines, it accepts every body of the common shape, and a request made from it is
the one JSON makes (``predict_body``), errors included."""

from __future__ import annotations

import json

import numpy as np
import pytest

from elastic_control.serving.body_scan import body_lines, line_spans
from elastic_control.serving.instances import InstanceError, decode_json, predict_body, predict_request

PLAIN = "".join(chr(c) for c in range(32, 127) if chr(c) not in '"\\')


def _plain_line(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list(PLAIN), int(rng.integers(0, 40))))


def _body(lines: list[str], rng: np.random.Generator) -> bytes:
    """A body of lines with JSON whitespace of random kinds and lengths between every two tokens."""

    def ws() -> str:
        return "".join(rng.choice([" ", "\t", "\n", "\r"], int(rng.integers(0, 3))))

    items = [f'{ws()}{{{ws()}"line"{ws()}:{ws()}{json.dumps(line)}{ws()}}}{ws()}' for line in lines]
    return f'{ws()}{{{ws()}"instances"{ws()}:{ws()}[{",".join(items)}]{ws()}}}{ws()}'.encode()


def test_every_body_of_plain_lines_is_taken_and_gives_its_lines():
    rng = np.random.default_rng(5)
    for _ in range(500):
        lines = [_plain_line(rng) for _ in range(int(rng.integers(1, 6)))]
        body = _body(lines, rng)
        assert body_lines(body) == lines == [i["line"] for i in json.loads(body)["instances"]], body


def test_a_special_byte_is_found_wherever_it_falls_in_a_word():
    """The scan reads 8 bytes a step: a quote escaped, a backslash, a control or non-ASCII byte at every
    offset of a long line sends the body to JSON."""
    for special in ['\\"', "\\\\", "\\n", "\\u0001", "\u00e9", "\x7f"]:
        for at in range(40):
            line = "a" * at + special + "b" * 20
            body = ('{"instances": [{"line": "%s"}]}' % line).encode()  # noqa: UP031 - the escapes as they are
            assert body_lines(body) is None, body
    assert body_lines(('{"instances": [{"line": "%s"}]}' % ("~" * 41)).encode()) == ["~" * 41]  # noqa: UP031


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{}",
        b'{"instances": []}',
        b'{"instances": [{"line": "a"}], "routing_key": "u1"}',
        b'{"routing_key": "u1", "instances": [{"line": "a"}]}',
        b'{"instances": [{"line": "a", "x": 1}]}',
        b'{"instances": [{"slots": {"1": [5]}}]}',
        b'{"instances": [{"line": "a"},]}',
        b'{"instances": [{"line": "a"}]',
        b'{"instances": [{"line": "a"}]}}',
        b'{"instances": [{"line": "a"}]} x',
        b'{"instances": [{"line": "a}]}',
        b'{"instances": [{"line": 5}]}',
        b'{"instances": {"line": "a"}}',
        b'["instances"]',
        b'{"instances": [{"line": "a"} {"line": "b"}]}',
    ],
)
def test_any_other_body_goes_to_json_and_gets_json_s_answer(body):
    assert body_lines(body) is None
    try:
        want = predict_request(decode_json(body), defer_lines=True)
    except InstanceError as e:
        with pytest.raises(InstanceError) as got:
            predict_body(body)
        assert (str(got.value), got.value.status) == (str(e), e.status)
    else:
        assert predict_body(body) == want


def test_a_request_of_lines_is_the_one_json_makes():
    rng = np.random.default_rng(9)
    for n in (1, 2, 32, 300):
        body = _body([_plain_line(rng) for _ in range(n)], rng)
        assert predict_body(body) == predict_request(decode_json(body), defer_lines=True)


def test_the_kernel_refuses_spans_too_short_for_the_body():
    body = np.frombuffer(b'{"instances": [{"line": "a"}]}', np.uint8)
    words = np.frombuffer(body.tobytes(), np.uint64, count=len(body) // 8)
    with pytest.raises(ValueError, match="spans"):
        line_spans(body, words, np.empty(1, np.int64), np.empty(1, np.int64))
    spans = np.empty(len(body) // 11 + 1, np.int64), np.empty(len(body) // 11 + 1, np.int64)
    assert line_spans(body, words, *spans) == 1
    with pytest.raises(ValueError, match="words"):
        line_spans(body, words[:-1], *spans)
