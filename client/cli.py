"""``ctr-client`` / ``python -m client``: predict, upload, health. Only click code lives here."""

from __future__ import annotations

import json
import sys

import click

from client.api import check_health, resolve_client_settings, serving_client, upload_configs
from client.lines import UNKNOWN_SLOT_CHOICES, RefusedLines, known_slots, predict_file_lines
from ctr_foundation.cli_runner import run_cli
from ctr_foundation.env_vars import STATE_DIR
from ctr_foundation.errors import ElasticControlError, UsageError

CONTEXT = {"help_option_names": ["-h", "--help"]}


def _state_dir(ctx: click.Context, given: str | None) -> str:
    if given:
        return given
    parent = ctx.find_root().obj
    if isinstance(parent, dict) and parent.get("state_dir"):
        return parent["state_dir"]
    return STATE_DIR.get()


_state_option = click.option(
    "--state-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="State folder holding client.json (default: $ELASTIC_CTR_STATE_DIR or .elastic-ctr).",
)
_serving_option = click.option("--serving", "serving_url", default=None, help="Serving URL (overrides client.json).")
_grpc_option = click.option(
    "--grpc", "serving_grpc", default=None, help="Serving's gRPC HOST:PORT (overrides client.json's serving_grpc)."
)
_transport_option = click.option(
    "--transport",
    type=click.Choice(["http", "grpc"]),
    default="http",
    show_default=True,
    help="Talk to serving over HTTP (/v1/predict) or gRPC (Prediction.Predict).",
)
_fileserver_option = click.option(
    "--fileserver", "fileserver_url", default=None, help="File server URL (overrides client.json)."
)


@click.command("predict", context_settings=CONTEXT)
@click.argument("input_file", type=click.File("r", encoding="utf-8"))
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(1, 10000), help="Lines per request.")
@click.option(
    "--retry-for",
    default=60.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds to keep retrying a batch while serving is unavailable.",
)
@click.option(
    "--on-error",
    type=click.Choice(["skip", "fail"]),
    default="skip",
    show_default=True,
    help="A bad line: skip: report it (stderr, or its JSON object), print nan in its place and go on; "
    "fail: stop at the first one.",
)
@click.option(
    "--unknown-slots",
    type=click.Choice(UNKNOWN_SLOT_CHOICES),
    default="refuse",
    show_default=True,
    help="A line using a slot that is not in slot.conf (serving would ignore its features): refuse it, "
    "or warn and score it.",
)
@click.option(
    "--slot-conf",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The slots lines may use [default: the slots of the model serving answers with, else the slot.conf "
    "`elastic-control -c` saved].",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='One JSON object per non-blank line: {"line": N, "probability": P, "request_id", "index", '
    '"model_version", "arm"} or {"line": N, "error": "..."} ("warning" beside a probability).',
)
@_transport_option
@_serving_option
@_grpc_option
@_state_option
@click.pass_context
def predict_command(
    ctx,
    input_file,
    batch_size,
    retry_for,
    on_error,
    unknown_slots,
    slot_conf,
    as_json,
    transport,
    serving_url,
    serving_grpc,
    state_dir,
):
    """Print one click probability per slot-format line of INPUT_FILE ('-' = stdin); blank lines are skipped.

    A bad line (not the slot format, a slot not in slot.conf, refused by serving) fails only itself: its
    error names its input line number. Exit codes: 0 every line predicted, 1 serving unavailable or
    another failure, 2 usage error, 3 some lines refused (the others were predicted).
    """
    config = resolve_client_settings(
        state_dir=_state_dir(ctx, state_dir), serving_url=serving_url, serving_grpc=serving_grpc
    )
    client = serving_client(config, transport=transport, retry_for=retry_for)
    slots = known_slots(config, slot_conf=slot_conf)
    if slots is None:
        click.echo(
            "ctr-client: warning: slots not checked: no slot.conf known (run `elastic-control -c` or pass --slot-conf)",
            err=True,
        )
    write = sys.stdout.write
    refused: list[int] = []
    total = 0
    for result in predict_file_lines(
        client, input_file, batch_size=batch_size, slots=slots, unknown_slots=unknown_slots
    ):
        total += 1
        if as_json:
            write(json.dumps(result.to_json()) + "\n")
        elif result.ok:
            write(f"{result.probability:.9g}\n")
        else:
            write("nan\n")
        if result.warning and not as_json:
            click.echo(f"ctr-client: warning: line {result.line}: {result.warning}", err=True)
        if not result.ok:
            refused.append(result.line)
            if not as_json:
                sys.stdout.flush()
                click.echo(f"ctr-client: line {result.line}: {result.error}", err=True)
            if on_error == "fail":
                sys.stdout.flush()
                raise RefusedLines(f"line {result.line}: {result.error} (--on-error fail: stopped there)")
    sys.stdout.flush()
    if refused:
        shown = ", ".join(map(str, refused[:10])) + (", ..." if len(refused) > 10 else "")
        raise RefusedLines(f"{len(refused)} of {total} lines refused (line {shown}); every other line was predicted")


@click.command("feedback", context_settings=CONTEXT)
@click.argument("events_file", type=click.File("r", encoding="utf-8"))
@_transport_option
@_serving_option
@_grpc_option
@_state_option
@click.pass_context
def feedback_command(ctx, events_file, transport, serving_url, serving_grpc, state_dir):
    """Send click outcomes: EVENTS_FILE ('-' = stdin) has one JSON object per line,
    {"request_id": ID, "index": I, "click": 0|1}; prints the join counts as JSON."""
    events = []
    for number, line in enumerate(events_file, start=1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{events_file.name}:{number}: not JSON ({e.msg})") from None
        if not isinstance(event, dict):
            raise UsageError(f"{events_file.name}:{number}: expected an object with request_id, index, click")
        events.append(event)
    config = resolve_client_settings(
        state_dir=_state_dir(ctx, state_dir), serving_url=serving_url, serving_grpc=serving_grpc
    )
    client = serving_client(config, transport=transport)
    totals = {"joined": 0, "unknown": 0, "duplicate": 0, "invalid": 0}
    for k in range(0, len(events), 10_000):
        for key, n in client.feedback(events[k : k + 10_000]).items():
            totals[key] = totals.get(key, 0) + n
    click.echo(json.dumps(totals))


@click.command("upload", context_settings=CONTEXT)
@click.option("-s", "--slot-conf", type=click.Path(exists=True, dir_okay=False), help="slot.conf to upload.")
@click.option("-f", "--data-config", type=click.Path(exists=True, dir_okay=False), help="data.config to upload.")
@_fileserver_option
@_state_option
@click.pass_context
def upload_command(ctx, slot_conf, data_config, fileserver_url, state_dir):
    """Validate and upload slot.conf / data.config to the file server (writes need the token)."""
    config = resolve_client_settings(state_dir=_state_dir(ctx, state_dir), fileserver_url=fileserver_url)
    for item in upload_configs(config, slot_conf=slot_conf, data_config=data_config):
        click.echo(f"uploaded {item['path']} ({item['size']} bytes, sha256 {item['sha256'][:12]}…)", err=True)


@click.command("health", context_settings=CONTEXT)
@_serving_option
@_fileserver_option
@_state_option
@click.pass_context
def health_command(ctx, serving_url, fileserver_url, state_dir):
    """Check serving and the file server; exit 1 if either is down."""
    config = resolve_client_settings(
        state_dir=_state_dir(ctx, state_dir), serving_url=serving_url, fileserver_url=fileserver_url
    )
    report = check_health(config)
    click.echo(json.dumps(report, indent=2, sort_keys=True))
    if any(isinstance(v, str) and v.startswith("error") for v in report.values()):
        raise ElasticControlError("; ".join(f"{k} {v}" for k, v in report.items() if isinstance(v, str)))


@click.group(context_settings=CONTEXT)
def cli():
    """The ElasticCTR client: predictions from serving, configs to the file server."""


cli.add_command(predict_command)
cli.add_command(feedback_command)
cli.add_command(upload_command)
cli.add_command(health_command)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: one-line errors, exit 2 for usage errors and 1 for failures."""
    run_cli(cli, "ctr-client", argv)
