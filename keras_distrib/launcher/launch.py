"""Launching this task's agent: what must hold on this machine first, then ``Agent.run``.

``launch`` validates what only this node can check (SCRIPT's path, the interface, the
protocol, free ports), makes the job's log directory, gives a local job its private
network, and runs the agent; its exit code is the task's.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from cluster_parsers import ClusterConfigError, JobInfo

from ..logs import NodeLogger
from .agent import Agent
from .interfaces import interface_ipv4
from .isolation import IsolationUnavailable, isolate_network
from .options import Options
from .portblocks import claim_blocks
from .prestart import require_free_ports, require_protocol
from .spec import LaunchSpec, identity_for

logger = logging.getLogger(__name__)


def isolate_local_job(node: str, wanted: bool) -> None:
    """Local mode: run the job in a private network (loopback only), or say why not."""
    log = NodeLogger(logger, node)
    if not wanted:
        log.warning("--no-isolation: the job's TF servers listen on every interface of this "
                    "machine while it runs, reachable (and usable) by anyone who can reach this machine.")
        return
    try:
        isolate_network()
    except IsolationUnavailable as exc:
        log.warning(f"cannot give the local job a private network ({exc.strerror}); its TF servers listen on every "
                    "interface of this machine while it runs, reachable by anyone who can reach it.")


#: Where every process's output goes by default: the job's working directory (beside the job's
#: output file, the Slurm templates' keras-distrib-JOBID.out; the PBS/SGE/LSF templates start
#: in the submit directory).
DEFAULT_LOG_DIR = "keras_distrib-logs"


def job_log_dir(options: Options, job: JobInfo) -> Path:
    """LOG_DIR/SCHEDULER-JOBID, made (all nodes of a job, and its requeued runs, share it)."""
    base = Path(options.log_dir or DEFAULT_LOG_DIR).expanduser()
    path = (base / f"{job.scheduler}-{''.join(c if c.isalnum() or c in '.-' else '_' for c in job.job_id)}").absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ClusterConfigError(
            f"log-dir {str(base)!r}: cannot create {path} ({exc.strerror}).",
            "pass --log-dir with a directory this job may write (shared by the nodes, like the working directory).",
        ) from None
    return path


def launch(spec: LaunchSpec) -> int:
    """Validate what needs this machine, then run this task's agent; its exit code."""
    job, options = spec.job, spec.options
    if spec.script is not None and not spec.check and not Path(spec.script).is_file():
        raise ClusterConfigError(
            f"SCRIPT {spec.script!r} does not exist (working directory {os.getcwd()}).",
            "give the training script's path, e.g. python -m keras_distrib.slurm train.py --epochs 3.",
        )
    if options.interface:
        interface_ipv4(options.interface, job.node)  # fail before starting anything
    require_protocol(options.protocol)
    spec = replace(spec, log_dir=spec.log_dir or job_log_dir(options, job))
    if spec.local:
        isolate_local_job(job.nodes[0], options.isolate)
    agent = Agent(spec, identity_for(job, spec.mode, spec.local))
    ports = {p.port: p.name for p in agent.my_processes()}
    if agent.identity.leader and agent.identity.num_agents > 1:
        ports[spec.plan.control_port()] = "the agents' control port"
    if not spec.plan.port_fallbacks:
        require_free_ports(ports, job.node)
        return agent.run().code
    claims = claim_blocks(spec.plan, ports, claim=spec.mode == "agent")  # per-role: a node's agents are one job
    try:
        if not claims.free:  # the job-id block and every fallback: name the first block's taken ports
            require_free_ports(ports, job.node, "Nor are they free in any fallback block (first ports "
                                                f"{', '.join(map(str, spec.plan.port_fallbacks))}).")
        return agent.run(claims).code
    finally:
        claims.close()
