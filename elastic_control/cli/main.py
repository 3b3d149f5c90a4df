"""The elastic-control command line: the original script's flags plus subcommands.

Only click code lives here; the work is done by keyword-only functions in
``elastic_control.api`` and the subsystems' own command modules.
"""

from __future__ import annotations

import importlib

import click

from ctr_foundation.cli_runner import run_cli
from ctr_foundation.env_vars import DEBUG
from ctr_foundation.errors import ElasticControlError
from elastic_control import __version__
from elastic_control.cli.options import DURATION, kube_render_options, state_dir_option
from elastic_control.config.resources import RANGES, Resources

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

# Subcommands live in their subsystem's module and are imported on first use,
# so `elastic-control -h` stays fast and one broken subsystem cannot break the rest.
LAZY_COMMANDS = {
    "status": ("elastic_control.cli.lifecycle", "status"),
    "delete": ("elastic_control.cli.lifecycle", "delete"),
    "demo": ("elastic_control.demo.cli", "demo_command"),
    "data": ("elastic_control.data.cli", "data_group"),
    "train": ("elastic_control.training.cli", "train_command"),
    "role": ("elastic_control.training.cli", "role_command"),
    "eval": ("elastic_control.evaluation.cli", "eval_command"),
    "serve": ("elastic_control.serving.cli", "serve_command"),
    "ab-report": ("elastic_control.serving.ab_report", "ab_report_command"),
    "fileserver": ("elastic_control.fileserver.cli", "fileserver_command"),
    "predict": ("client.cli", "predict_command"),
    "supervise": ("elastic_control.local.cli", "supervise_command"),
    "tune": ("elastic_control.tuning.cli", "tune_command"),
    "history": ("elastic_control.cli.rollouts", "history_command"),
    "rollback": ("elastic_control.cli.rollouts", "rollback_command"),
    "canary": ("elastic_control.cli.rollouts", "canary_command"),
}
HIDDEN = {"role", "supervise"}


# The verbs of the original script, as flags of the one command; `-r -h` shows only -r's options.
VERBS = {  # parameter name: (flag, what it does, its options)
    "do_render": (
        "-r",
        "Validate the flags, slot.conf and data.config, then render the plan and the Kubernetes manifests into "
        "the state folder (nothing starts; `kubectl apply -f STATE/manifests` works too). The backend is chosen "
        "here: Kubernetes when a cluster answers (--backend auto), else local processes.",
        ("cpu", "mem", "trainers", "pservers", "cube_shards", "datafile", "slot_conf", "hdfs_address", "verbose",
         "backend", "namespace", "image", "queue", "job_name", "service_type", "promotion_gate", "context",
         "storage_class", "access_mode", "serving_replicas", "network_policy", "max_retry", "image_pull_policy",
         "image_pull_secrets", "data_secrets", "job_ttl", "job_progress", "prometheus_operator", "monitoring_labels",
         "pod_overlay", "state_dir"),
    ),
    "do_apply": (
        "-a",
        "Start everything -r rendered (training, cube, serving, the file server, MLflow) where -r planned it, "
        "and wait until every component is up.",
        ("dry_run", "state_dir"),
    ),
    "do_log": (
        "-l",
        "Show the logs of the COMPONENTs named, each line prefixed with its component (default: trainer-0, "
        "fileserver and cube-transfer). Components are the names `elastic-control status` lists: trainer-N, "
        "pserver-N, cube-server-N, cube-agent-N, cube-transfer, serving, fileserver, mlflow (and, locally, "
        "supervisor).",
        ("tail", "since", "follow", "raw", "state_dir"),
    ),
    "do_client": (
        "-c",
        "Configure the client: find serving and the file server, fetch slot.conf, and write STATE/client.json "
        "for `elastic-control predict`.",
        ("state_dir",),
    ),
}  # fmt: skip
VERB_EXAMPLES = {
    "do_render": "elastic-control -r -u 4 -m 20 -t 2 -p 2 -b 5 -s examples/slot.conf -f examples/data.config",
    "do_apply": "elastic-control -a; elastic-control -a --dry-run",
    "do_log": "elastic-control -l trainer-1 --tail 5; elastic-control -l serving cube-server-0 --since 10m --follow",
    "do_client": "elastic-control -c",
}
LOG_COMPONENTS = "elastic_control.log_components"  # ctx.meta key: the COMPONENTs given after -l


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *(n for n in LAZY_COMMANDS if n not in HIDDEN)])

    def get_command(self, ctx, name):
        if name in LAZY_COMMANDS:
            module, attr = LAZY_COMMANDS[name]
            try:
                return getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                if DEBUG.get():
                    raise
                return _unavailable(name, e)
        return super().get_command(ctx, name)


class VerbGroup(LazyGroup):
    """The command line of the original script: verb flags (-r, -a, -l, -c) and subcommands.

    Before click parses: names after -l that are not subcommands are its COMPONENTs (``-l trainer-1
    --tail 5``), and -h beside verb flags shows only those verbs' options.
    """

    def parse_args(self, ctx, args):
        args, given, components = self._split_components(ctx, list(args))
        ctx.meta[LOG_COMPONENTS] = components
        verbs = [v for v in VERBS if v in given]
        help_option = self.get_help_option(ctx)
        if verbs and help_option is not None and help_option.name in given:
            click.echo(self.verb_help(ctx, verbs))
            ctx.exit()
        return super().parse_args(ctx, args)

    def _split_components(self, ctx, args: list[str]) -> tuple[list[str], set[str], list[str]]:
        """(args without -l's COMPONENTs, the parameters given, the COMPONENTs)."""
        head, rest, given, components = [], args, set(), []
        commands = {*self.list_commands(ctx), *LAZY_COMMANDS}
        while True:
            try:
                opts, left, _ = self.make_parser(ctx).parse_args(args=list(rest))
            except click.UsageError:
                return args, given, []  # the real parse says what is wrong
            given |= set(opts)
            head += rest[: len(rest) - len(left)]
            if "do_log" in given and left and not left[0].startswith("-") and left[0] not in commands:
                components.append(left[0])
                rest = left[1:]
                continue
            return head + left, given, components

    def verb_help(self, ctx, verbs: list[str]) -> str:
        """Help on ``verbs`` only: what each does, its options, an example."""
        formatter = ctx.make_formatter()
        usage = " ".join(VERBS[v][0] for v in verbs) + " [OPTIONS]"
        formatter.write_usage(ctx.command_path, usage + (" [COMPONENT]..." if "do_log" in verbs else ""))
        for verb in verbs:
            flag, text, _ = VERBS[verb]
            formatter.write_paragraph()
            with formatter.indentation():
                formatter.write_text(f"{flag}: {text}")
        names = {name for v in verbs for name in VERBS[v][2]}
        help_option = self.get_help_option(ctx)
        records = [p.get_help_record(ctx) for p in self.get_params(ctx) if p.name in names or p is help_option]
        with formatter.section("Options"):
            formatter.write_dl([r for r in records if r is not None])
        formatter.write_paragraph()
        with formatter.indentation():
            formatter.write_text("Example: " + "; ".join(VERB_EXAMPLES[v] for v in verbs))
        return formatter.getvalue().rstrip("\n")


def _unavailable(name: str, err: Exception) -> click.Command:
    @click.command(name, help=f"(unavailable: {err})", context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def cmd(args):
        raise ElasticControlError(f"the {name!r} command is unavailable in this installation: {err}")

    return cmd


def _range_help(name: str) -> str:
    lo, hi, _, what = RANGES[name]
    return f"{what[0].upper()}{what[1:]} ({lo}-{hi})."


@click.group(
    cls=VerbGroup,
    invoke_without_command=True,
    context_settings=CONTEXT,
    epilog="Example: elastic-control -r -u 4 -m 20 -t 2 -p 2 -b 5 -s examples/slot.conf "
    "-f examples/data.config; then -a, -l, -c. One verb's options only: elastic-control -r -h (or -a, -l, -c).",
)
@click.option(
    "-r",
    "--config_resource",
    "do_render",
    is_flag=True,
    help="Validate the flags and config files and render the plan and manifests.",
)
@click.option(
    "-a",
    "--apply",
    "do_apply",
    is_flag=True,
    help="Start everything -r rendered (training, cube, serving, file server, MLflow).",
)
@click.option(
    "-l",
    "--log",
    "do_log",
    is_flag=True,
    help="Show logs: of the COMPONENTs named after it (e.g. -l trainer-1 serving), else of trainer 0, "
    "the file server and cube-transfer.",
)
@click.option(
    "-c",
    "--config_client",
    "do_client",
    is_flag=True,
    help="Configure the client: find serving and the file server, fetch slot.conf.",
)
@click.option("-u", "--cpu", type=int, default=2, show_default=True, help=_range_help("cpu"))
@click.option("-m", "--mem", type=int, default=4, show_default=True, help=_range_help("mem"))
@click.option("-t", "--trainer", "trainers", type=int, default=2, show_default=True, help=_range_help("trainers"))
@click.option("-p", "--pserver", "pservers", type=int, default=2, show_default=True, help=_range_help("pservers"))
@click.option("-b", "--cube", "cube_shards", type=int, default=2, show_default=True, help=_range_help("cube_shards"))
@click.option(
    "-f", "--datafile", default="data.config", show_default=True, help="data.config: data location and window."
)
@click.option("-s", "--slot_conf", default="slot.conf", show_default=True, help="slot.conf: the slots to train on.")
@click.option("-hd", "--hdfs_address", default="", help="Overrides HDFS_ADDRESS of data.config.")
@click.option("-v", "--verbose", is_flag=True, help="More output.")
@click.option(
    "--backend",
    type=click.Choice(["auto", "local", "k8s"]),
    default="auto",
    show_default=True,
    help="Where to run: Kubernetes when a cluster answers (auto), or local processes.",
)
@click.option("--namespace", default=None, help="Kubernetes namespace [default: the context's, else default].")
@click.option("--image", default=None, help="Container image all pods run (default: elastic-ctr:VERSION).")
@click.option("--queue", default="default", show_default=True, help="Volcano queue.")
@click.option(
    "--job-name",
    default="elastic-ctr",
    show_default=True,
    help="Name of the training job; prefixes every Kubernetes object (app.kubernetes.io/instance).",
)
@click.option(
    "--service-type",
    type=click.Choice(["ClusterIP", "NodePort", "LoadBalancer"]),
    default="ClusterIP",
    show_default=True,
    help="How serving and the file server are exposed outside the cluster.",
)
@click.option(
    "--promotion-gate",
    "promotion_gate",
    default=None,
    metavar="RULE",
    help="With -r: cube-transfer rolls a pass out only if it passes RULE against the active one on the "
    "fresh hold-out hour, e.g. 'auc_drop<=0.002,calibration=0.9..1.1'.",
)
@click.option(
    "--dry-run",
    "dry_run",
    is_flag=False,
    flag_value="client",
    default=None,
    type=click.Choice(["client", "server"]),
    help="With -a: show what would be applied (server: ask the API server).",
)
@click.option(
    "--tail",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="With -l: the last N lines of each component [default: 40 locally, 200 on Kubernetes; every line "
    "with --since].",
)
@click.option(
    "--since",
    type=DURATION,
    default=None,
    metavar="DURATION",
    help="With -l: only lines newer than DURATION (e.g. 30s, 10m, 1h30m). Local log lines without a time "
    "of their own count as new until a later line that has one says otherwise.",
)
@click.option("--follow", is_flag=True, help="With -l: keep streaming new lines until Ctrl-C.")
@click.option(
    "--raw", is_flag=True, help="With -l: every line, Paddle's internal glog lines too (the log files keep them)."
)
@kube_render_options
@state_dir_option
@click.version_option(__version__, "--version")
@click.pass_context
def cli(
    ctx,
    do_render,
    do_apply,
    do_log,
    do_client,
    cpu,
    mem,
    trainers,
    pservers,
    cube_shards,
    datafile,
    slot_conf,
    hdfs_address,
    verbose,
    backend,
    namespace,
    image,
    queue,
    job_name,
    service_type,
    promotion_gate,
    dry_run,
    tail,
    since,
    follow,
    raw,
    context,
    storage_class,
    access_mode,
    serving_replicas,
    network_policy,
    max_retry,
    image_pull_policy,
    image_pull_secrets,
    data_secrets,
    job_ttl,
    job_progress,
    prometheus_operator,
    monitoring_labels,
    pod_overlay,
    state_dir,
):
    """ElasticCTR: train a CTR model on Paddle's parameter server, roll it out to cube, serve it."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"state_dir": state_dir, "verbose": verbose}
        return
    # function-level: keeps `elastic-control --help` fast (api loads both backends)
    from elastic_control import api

    verbs = [v for v in (do_render, do_apply, do_log, do_client) if v]
    if not verbs:
        click.echo(ctx.get_help())
        return
    if do_render:
        resources = Resources(cpu=cpu, mem=mem, trainers=trainers, pservers=pservers, cube_shards=cube_shards)
        api.configure_resource(
            resources=resources,
            slot_conf=slot_conf,
            data_config=datafile,
            hdfs_address=hdfs_address,
            backend=backend,
            namespace=namespace,
            image=image,
            state_dir=state_dir,
            verbose=verbose,
            queue=queue,
            job_name=job_name,
            service_type=service_type,
            promotion_gate=promotion_gate,
            kube={
                "context": context,
                "storage_class": storage_class,
                "access_mode": access_mode,
                "serving_replicas": serving_replicas,
                "network_policy": network_policy,
                "max_retry": max_retry,
                "image_pull_policy": image_pull_policy,
                "image_pull_secrets": tuple(image_pull_secrets),
                "data_secrets": tuple(data_secrets),
                "pod_overlay": pod_overlay,
                "job_ttl": job_ttl,
                "job_progress": job_progress,
                "prometheus_operator": prometheus_operator,
                "monitoring_labels": tuple(monitoring_labels),
            },
        )
    if do_apply:
        api.apply(state_dir=state_dir, dry_run=dry_run)
    if do_client:
        api.configure_client(state_dir=state_dir)
    if do_log:
        api.logs(
            state_dir=state_dir,
            components=ctx.meta.get(LOG_COMPONENTS) or None,
            tail=tail,
            since=since,
            follow=follow,
            raw=raw,
        )


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: run the CLI and turn errors into one-line messages and exit codes."""
    run_cli(cli, "elastic-control", argv)
