"""What one launch is given (`LaunchSpec`, frozen) and which agent this task is (`identity_for`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster_parsers import JobInfo, node_of_rank

from ..plan import Plan
from .formation import Identity
from .options import Options


@dataclass(frozen=True)
class LaunchSpec:
    """Everything one launch is given: the job, its plan and options, and what to run."""

    job: JobInfo
    plan: Plan
    options: Options
    mode: str = "agent"  # or "per-role": one task per process
    script: str | None = None
    script_args: tuple[str, ...] = ()
    check: bool = False  # run the cluster check instead of SCRIPT (also when script is None)
    local: bool = False
    log_dir: Path | None = None  # this job's directory of per-process output files (launch makes it)
    join: bool = False  # a new agent for a running elastic job (--join): it joins at the next checkpoint

    @property
    def runs_check(self) -> bool:
        return self.check or self.script is None


def identity_for(job: JobInfo, mode: str, local: bool) -> Identity:
    """Agent identity: node index in agent mode, global rank in per-role mode."""
    if local:
        return Identity(0, 1, job.nodes[0], {0: job.nodes[0]}, local=True)
    if mode == "per-role":
        names = {r: job.nodes[node_of_rank(r, job.tasks_per_node)[0]] for r in range(job.num_tasks)}
        return Identity(job.rank, job.num_tasks, job.node, names)
    return Identity(job.node_index, job.num_nodes, job.node, dict(enumerate(job.nodes)))
