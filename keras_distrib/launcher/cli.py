"""Command line shared by ``python -m keras_distrib[.slurm|.pbs|.sge|.lsf|.local]``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from cluster_parsers import FORCE_VAR, ClusterConfigError, ClusterParser, JobInfo, detect, get_parser

from .options import LAYOUTS, PORT_BASE_VAR, Options, check_backend, load_config, ps_backend, validate
from ..contract import KERAS_BACKEND_VAR, plan_json
from ..logs import configure_launcher
from ..plan import Plan, build_plan, check_task_counts, component_roles, split_components, tasks_mode

logger = logging.getLogger(__name__)


def arg_parser(prog: str, local: bool = False) -> argparse.ArgumentParser:
    """Flags common to every entry point; ``local`` adds --nodes/--gpus-per-node."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Plan and launch distributed Keras/TensorFlow training on the job's nodes.",
        epilog="With no SCRIPT, runs the cluster check. Options may also come from --config FILE (YAML).",
    )
    p.add_argument("--plan", action="store_true", help="print the plan and exit (imports no TensorFlow)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="--plan output format")
    p.add_argument("--check", action="store_true", help="start the servers and check every task answers")
    p.add_argument("--config", metavar="FILE", help="YAML file setting any option below")
    p.add_argument("--layout", choices=LAYOUTS, default=None, help="process layout (default ps-per-node; jax when KERAS_BACKEND=jax)")
    p.add_argument("--port-base", type=int, default=None, help=f"first port (default derived from the job id; env {PORT_BASE_VAR})")
    p.add_argument("--protocol", default=None, help="TF server protocol (default grpc)")
    p.add_argument("--interface", default=None, help="network interface whose IPv4 address peers use, e.g. ib0")
    p.add_argument("--startup-timeout", type=float, default=None, help="seconds to wait for all peers (default 180)")
    p.add_argument("--shutdown-grace", type=float, default=None, help="seconds between SIGTERM and SIGKILL at the end (default 3)")
    if not local:
        p.add_argument("--scheduler", default=None, help="read this scheduler's variables (default: auto-detect; env KERAS_DISTRIB_SCHEDULER)")
    p.add_argument("--verbose", action="store_true", default=None,
                   help="show TensorFlow's start-up logs and every allreduce worker's output")
    p.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="seconds of silence after which a node counts as lost (default 30)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="restarts of dead processes allowed per job before it fails (default 3; 0: fail fast)")
    p.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds without progress (a stopped process, a SCRIPT that counts no step) after which "
                        "the stuck process is named, its stacks kept, and it is restarted (default 300; 0: off)")
    p.add_argument("--requeue", action="store_true", default=None,
                   help="after a preemption/time-limit checkpoint, requeue the job (scontrol requeue, qrerun, brequeue)")
    p.add_argument("--min-nodes", type=int, default=None, metavar="M",
                   help="when a node other than the first is lost and at least M nodes remain, go on on them from "
                        "the last checkpoint (default: stop, or requeue with --requeue)")
    p.add_argument("--max-nodes", type=int, default=None, metavar="N",
                   help="with --min-nodes: nodes that come back rejoin up to N nodes (default: the job's size)")
    if not local:
        p.add_argument("--join", action="store_true",
                       help="start this node's agent for a running elastic job (same options as its agents); it "
                            "joins at the job's next checkpoint: srun --jobid=JOBID -N1 -w NODE --overlap ... --join")
    p.add_argument("--exit-code-file", default=None, metavar="FILE",
                   help="the first agent writes the job's exit code here (job scripts whose step it ends, e.g. elastic.sbatch)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="every process's full output goes to DIR/SCHEDULER-JOBID/JOB-INDEX.log "
                        "(default ./keras_distrib-logs: the job's working directory, beside the job's output file, e.g. the templates' keras-distrib-JOBID.out)")
    p.add_argument("--checkpoint-every", default=None, metavar="INTERVAL",
                   help="mid-epoch checkpoints of fit(checkpoint_dir=...): 500steps, 90s, 5min or epoch (default 120s)")
    p.add_argument("--require-gpus", action="store_true", default=None,
                   help="stop the job (exit 2) when a process the plan gives GPUs sees fewer (a TensorFlow without "
                        "CUDA, no driver, a wrong CUDA_VISIBLE_DEVICES); default: one warning line, and it trains on the CPU")
    p.add_argument("--component-roles", default=None, metavar="ROLES",
                   help="a heterogeneous job (sbatch -N2 : -N1): what each component's nodes run, 'workers' or 'ps', "
                        "e.g. workers,ps (default: the first component computes, the others hold the parameter servers)")
    p.add_argument("--component-sizes", default=None, metavar="SIZES",
                   help="split the job's nodes, in order, into components of these sizes, e.g. 2,1 (a PBS select of "
                        "two chunks, an LSF compound -R), whose roles --component-roles gives")
    p.add_argument("--tuners-per-node", type=int, default=None, metavar="N",
                   help="layout tuner: KerasTuner trial workers per node, the node's GPUs dealt out among them "
                        "(default: one per GPU, one on a node without GPUs)")
    if local:
        p.add_argument("--nodes", type=int, default=2, help="number of emulated nodes (default 2)")
        p.add_argument("--gpus-per-node", default="", help="comma-separated GPU ids each emulated node reports")
        p.add_argument("--ps-nodes", type=int, default=0, metavar="N",
                       help="emulate a heterogeneous job: the last N nodes hold only parameter servers (default 0)")
        p.add_argument("--no-isolation", dest="isolate", action="store_false", default=None,
                       help="share this machine's network (default: a private loopback-only network; "
                            "needed if SCRIPT downloads data)")
    p.add_argument("script", nargs="?", metavar="SCRIPT", help="training script run by the chief (or every allreduce worker)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for SCRIPT")
    return p


def resolve_options(args: argparse.Namespace, environ: Mapping[str, str]) -> Options:
    """Defaults < --config file < KERAS_DISTRIB_PORT_BASE < command-line flags."""
    options = Options()
    config = load_config(args.config) if args.config else {}
    if args.config:
        options = options.merged(config)
    if args.layout is None and "layout" not in config and environ.get(KERAS_BACKEND_VAR) == "jax":
        # Keras on JAX cannot use the TensorFlow layouts: the jax layout is the one that works.
        logger.info("KERAS_BACKEND=jax and no --layout given: using --layout jax.")
        options = options.merged({"layout": "jax"})
    env_port = environ.get(PORT_BASE_VAR)
    if env_port:
        try:
            options = options.merged({"port_base": int(env_port)})
        except ValueError:
            raise ClusterConfigError(f"{PORT_BASE_VAR}={env_port!r} is not an integer.", f"unset it or set e.g. {PORT_BASE_VAR}=23000.") from None
    flags = {k: getattr(args, k, None) for k in ("layout", "port_base", "protocol", "interface", "startup_timeout", "shutdown_grace", "scheduler", "verbose", "heartbeat_timeout", "max_restarts", "requeue", "min_nodes", "max_nodes", "exit_code_file", "checkpoint_every", "log_dir", "hang_timeout", "require_gpus", "component_roles", "component_sizes", "tuners_per_node")}
    flags["isolate"] = getattr(args, "isolate", None)
    return validate(options.merged(flags))


def choose_parser(entry: str | None, options: Options, args: argparse.Namespace, environ: Mapping[str, str]) -> ClusterParser:
    """The parser named by the entry point, --scheduler, KERAS_DISTRIB_SCHEDULER or --config, else detected."""
    chosen = options.scheduler
    forced = environ.get(FORCE_VAR)
    if entry and chosen is None and forced and forced != entry:
        raise ClusterConfigError(
            f"{FORCE_VAR}={forced!r}, but python -m keras_distrib.{entry} reads {entry}'s variables.",
            f"unset {FORCE_VAR}, or run python -m keras_distrib (which honours it).",
        )
    if chosen is None:
        return get_parser(entry, environ) if entry else detect(environ)
    source = "--scheduler" if args.scheduler else f"scheduler in --config {args.config!r}"
    if entry and chosen != entry:
        raise ClusterConfigError(
            f"{source} is {chosen!r}, but python -m keras_distrib.{entry} reads {entry}'s variables.",
            f"drop the scheduler option, or run python -m keras_distrib --scheduler {chosen}.",
        )
    if not entry and not args.scheduler and environ.get(FORCE_VAR):
        chosen = environ[FORCE_VAR]  # defaults < --config < the environment < flags
    return get_parser(chosen, environ)


def local_job(nodes: int, gpus_per_node: str, job_id: str, ps_nodes: int = 0) -> JobInfo:
    """N emulated nodes on this machine; the last ``ps_nodes`` of them a second component (a
    heterogeneous job's parameter-server nodes, without GPUs)."""
    if nodes < 1:
        raise ClusterConfigError(f"--nodes={nodes} must be at least 1.", "e.g. --nodes 2.")
    if not 0 <= ps_nodes < nodes:
        raise ClusterConfigError(f"--ps-nodes={ps_nodes} must be at least 0 and below --nodes={nodes}.",
                                 "e.g. --nodes 3 --ps-nodes 1: two worker nodes and one parameter-server node.")
    gpus = tuple(g for g in gpus_per_node.split(",") if g)
    names = tuple(f"local{i}" for i in range(nodes))
    components = tuple(int(i >= nodes - ps_nodes) for i in range(nodes))
    return JobInfo("local", job_id, names, (1,) * nodes, node_gpus=tuple(() if c else gpus for c in components),
                   node_components=components,
                   components_source=f"--nodes {nodes} --ps-nodes {ps_nodes}" if ps_nodes else "")


def check_min_nodes(options: Options, job: JobInfo, mode: str | None = None, check: bool = False) -> None:
    """--min-nodes: no more than the job's nodes; to launch (``mode`` given), an agent per node and a SCRIPT."""
    m = options.min_nodes
    if m is None:
        if options.max_nodes is not None:
            raise ClusterConfigError(f"max-nodes={options.max_nodes} does nothing without --min-nodes.",
                                     "add --min-nodes M (the job goes on on M nodes or more), or drop --max-nodes.")
        return
    top = options.max_nodes
    if top is not None and not m <= top <= job.num_nodes:
        raise ClusterConfigError(f"max-nodes={top} is not between min-nodes={m} and the job's {job.num_nodes} node(s).",
                                 f"pass --max-nodes {job.num_nodes} or less (nodes that come back rejoin up to it), "
                                 f"and at least --min-nodes.")
    if m > job.num_nodes:
        raise ClusterConfigError(f"min-nodes={m} is more than the job's {job.num_nodes} node(s).",
                                 f"pass --min-nodes {max(1, job.num_nodes - 1)} or less (the job goes on while that "
                                 "many nodes are left).")
    if mode is None:
        return
    if check:
        raise ClusterConfigError("--min-nodes does nothing with the cluster check (--check, or no SCRIPT).",
                                 "drop --min-nodes, or give the training SCRIPT to run.")
    if mode != "agent":
        raise ClusterConfigError("--min-nodes needs one agent per node; the job starts one task per process.",
                                 "start one task per node (e.g. srun --ntasks-per-node=1), or drop --min-nodes.")


def check_join(options: Options, job: JobInfo) -> None:
    """--join: an elastic job (--min-nodes), on a node other than the first (its agent leads the job)."""
    if options.min_nodes is None:
        raise ClusterConfigError("--join takes a node into a running elastic job, and this one has no --min-nodes.",
                                 "give the same options as the job's agents (--min-nodes M included), plus --join.")
    if job.node_index == 0:
        raise ClusterConfigError(f"--join on {job.node}, the job's first node: its agent leads the job and "
                                 "cannot join it.", "start the joining agent on another of the job's nodes (-w NODE).")


def format_table(plan: Plan, job: JobInfo) -> str:
    """The human-readable plan."""
    rows = [("NODE", "JOB", "INDEX", "ADDRESS", "GPUS")]
    rows += [(p.node, p.job, str(p.index), p.address, ",".join(p.gpus) or "-") for p in plan.processes]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    head = (f"{plan.scheduler} job {plan.job_id}: layout {plan.layout}, {len(plan.nodes)} node(s), "
            f"{len(plan.processes)} process(es), protocol {plan.protocol}")
    if plan.roles:
        members = [",".join(n for n, c in zip(job.nodes, job.node_components) if c == i) for i in range(len(plan.roles))]
        head += "\nheterogeneous job (" + job.components_source + "): " + "; ".join(
            f"component {i} ({nodes}) runs {role}" for i, (nodes, role) in enumerate(zip(members, plan.roles)))
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([head, *table, f"ports: {plan.ports_source}"])


def run(argv: Sequence[str] | None, scheduler: str | None, prog: str, local: bool = False) -> int:
    """Parse, validate, then print the plan or launch it. Returns the exit code."""
    args = arg_parser(prog, local).parse_args(argv)
    env = os.environ
    configure_launcher(bool(args.verbose), env)  # before anything can fail: errors are log lines
    job: JobInfo | None = None
    try:
        options = resolve_options(args, env)
        configure_launcher(options.verbose, env)  # --config may say verbose: true
        if local:
            if options.scheduler is not None:
                raise ClusterConfigError(
                    f"scheduler={options.scheduler!r} in --config {args.config!r} does nothing in python -m keras_distrib.local.",
                    "remove the key, or run python -m keras_distrib on the cluster.",
                )
            parser: ClusterParser | None = None
            job = local_job(args.nodes, args.gpus_per_node, str(os.getpid()), args.ps_nodes)
            hosts = {n: "127.0.0.1" for n in job.nodes}
        else:
            parser = choose_parser(scheduler, options, args, env)
            job = parser.join_info() if args.join else parser.parse()
            hosts = None
        job = split_components(job, options.component_sizes)
        roles = component_roles(job, options.layout, options.component_roles)
        plan = build_plan(job, options.layout, options.port_base, options.protocol, hosts, roles,
                          options.tuners_per_node, ps_backend(options.layout, env))
        hint = parser.agent_launch_hint if parser else "use --nodes."
        check_min_nodes(options, job)
        if args.plan:
            check_task_counts(job, plan, hint)
            print(json.dumps(plan_json(plan)) if args.format == "json" else format_table(plan, job))
            return 0
        if args.script and not args.check:
            check_backend(options.layout, env)
        mode = tasks_mode(job, plan, hint)
        check_min_nodes(options, job, mode, bool(args.check or args.script is None))
        if getattr(args, "join", False):
            check_join(options, job)
    except ClusterConfigError as exc:
        # Every task of a step checks the same environment: rank 0 reports for all, so
        # `srun --ntasks-per-node=2` shows the error once instead of once per task.
        return report_error(exc, speaks=job is None or not job.tasks_launched or job.rank == 0)
    from .launch import LaunchSpec, launch  # TensorFlow-free, but only needed past this point

    spec = LaunchSpec(job, plan, options, mode, args.script, tuple(args.script_args or ()), args.check, local,
                      join=bool(getattr(args, "join", False)))
    try:
        return launch(spec)
    except ClusterConfigError as exc:
        # Checks of this machine (script path, --interface, protocol) can differ between
        # nodes: the first task on each node reports.
        return report_error(exc, speaks=not job.tasks_launched or job.local_rank == 0)


def report_error(exc: ClusterConfigError, speaks: bool) -> int:
    """Log the one-line error (if this task ``speaks`` for the others); exit code 2."""
    if speaks:
        logger.error(str(exc))
    return 2


def main(scheduler: str | None = None, prog: str = "python -m keras_distrib", local: bool = False) -> None:
    """Console entry point."""
    sys.exit(run(None, scheduler, prog, local))
