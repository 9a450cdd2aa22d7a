"""The ClusterParser contract and the plain job description it produces."""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import hostlist


class ClusterConfigError(ValueError):
    """A user-fixable problem with the job environment or the options.

    The message names the variable and its value; ``hint`` says how to fix it.
    """

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} HINT: {self.hint}"


@dataclass(frozen=True)
class JobInfo:
    """What the scheduler says about the job, as seen from one task.

    ``node_gpus[i]`` lists the GPU ids of ``nodes[i]`` as that node sees them. Schedulers
    that only describe the local node report the local list for every node.
    ``tasks_per_node`` counts the tasks a launcher started on each node (all 1 in the
    agent mode), or the allocated slots when ``tasks_launched`` is False (see tasks.py).
    """

    scheduler: str
    job_id: str
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    rank: int = 0
    local_rank: int = 0
    node_index: int = 0
    node_gpus: tuple[tuple[str, ...], ...] = field(default=())
    #: Where ``tasks_per_node`` came from, for error messages, e.g. "SLURM_STEP_TASKS_PER_NODE='2(x3)'".
    tasks_source: str = ""
    #: False when ``tasks_per_node`` counts allocated slots and no task launcher (srun,
    #: mpirun, jsrun, pbsdsh) said how many tasks it started, e.g. in a PBS job script.
    tasks_launched: bool = True
    #: The scheduler's slots per node (``tasks_per_node`` when the parser gives none); in
    #: the agent mode ``tasks_per_node`` is all 1 while this keeps the allocation.
    slots_per_node: tuple[int, ...] = field(default=())
    #: The component of a heterogeneous job each node belongs to (Slurm's het group, PBS's
    #: chunk); all 0 in a plain job.
    node_components: tuple[int, ...] = field(default=())
    #: Where the components came from, for messages, e.g. "SLURM_JOB_NODELIST_HET_GROUP_0..1".
    components_source: str = ""
    #: Ports the scheduler reserved for this step on every node (Slurm's ``srun
    #: --resv-ports``), in order; () when it reserved none.
    reserved_ports: tuple[int, ...] = ()
    #: Where they came from, e.g. "SLURM_STEP_RESV_PORTS='12003-12022'".
    reserved_ports_source: str = ""

    def __post_init__(self) -> None:
        if not self.node_gpus:
            object.__setattr__(self, "node_gpus", tuple(() for _ in self.nodes))
        if not self.slots_per_node:
            object.__setattr__(self, "slots_per_node", tuple(self.tasks_per_node))
        if not self.node_components:
            object.__setattr__(self, "node_components", tuple(0 for _ in self.nodes))

    @property
    def num_components(self) -> int:
        """1 in a plain job; the heterogeneous job's components otherwise."""
        return max(self.node_components, default=0) + 1

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_tasks(self) -> int:
        return sum(self.tasks_per_node)

    @property
    def node(self) -> str:
        """The node this task runs on."""
        return self.nodes[self.node_index]

    @property
    def gpus(self) -> tuple[str, ...]:
        """GPU ids visible on this task's node."""
        return self.node_gpus[self.node_index]


@dataclass(frozen=True)
class Tasks:
    """How many tasks run on each node and where this one is (the rule that fills it is
    in tasks.py)."""

    tasks_per_node: tuple[int, ...]
    rank: int
    local_rank: int
    node_index: int
    launched: bool
    source: str


class ClusterParser(ABC):
    """Reads one scheduler's environment into a :class:`JobInfo`.

    Subclasses keep the environment-variable names they read as class data, so the
    mapping to the scheduler's documentation is visible in one place.
    """

    #: Registry name, also accepted by ``KERAS_DISTRIB_SCHEDULER``.
    name: str = ""
    #: Variables whose presence means "this scheduler launched us".
    detect_vars: tuple[str, ...] = ()
    #: How to start one agent task per node under this scheduler (shown in HINTs).
    agent_launch_hint: str = "start one keras_distrib agent per node."
    #: The variables holding the job id, the first one set wins.
    job_id_vars: tuple[str, ...] = ()
    #: The variable holding the step id, where the scheduler has steps inside a job.
    step_id_var: str | None = None
    #: The command that requeues the job, given its id (None: the scheduler has none).
    requeue_command: tuple[str, ...] | None = None
    #: The exit code that makes the scheduler run the job again itself (SGE: 99).
    reschedule_exit_code: int | None = None
    #: The command that ends the step (or job) given "JOB[.STEP]": what a lost node holds.
    end_command: tuple[str, ...] | None = None

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.env: Mapping[str, str] = os.environ if environ is None else environ

    def is_present(self) -> bool:
        """True when this scheduler's variables are in the environment."""
        return any(v in self.env for v in self.detect_vars)

    @abstractmethod
    def parse(self) -> JobInfo:
        """Describe the job; raise ClusterConfigError on malformed input."""

    def join_info(self) -> JobInfo:
        """The running job as its agents saw it (one per node), from a task started later on
        one of its nodes to join it (``--join``); this task is that node's agent."""
        raise ClusterConfigError(
            f"--join (a new agent for a running job) is not supported under {self.name}.",
            "on Slurm: srun --jobid=JOBID -N1 -w NODE --overlap python -m keras_distrib.slurm --join ...; "
            "elsewhere, use --requeue (docs/faults.md).",
        )

    # Helpers shared by parsers -------------------------------------------------

    #: The variable holding the ports the scheduler reserved for the step (None: it has none).
    reserved_ports_var: str | None = None

    def reserved_ports(self) -> tuple[tuple[int, ...], str]:
        """The ports the scheduler reserved for this step, and their source ((), "" if none)."""
        value = self.env.get(self.reserved_ports_var or "", "").strip()
        if not value:
            return (), ""
        return expand_ports(self.reserved_ports_var or "", value), f"{self.reserved_ports_var}={value!r}"

    def job_info(self, job_id: str, nodes: Sequence[str], slots: Sequence[int], tasks: Tasks,
                 gpus: tuple[str, ...]) -> JobInfo:
        """The JobInfo of nodes with ``slots``, placed by the launched-task rule (tasks.py),
        every node with the same ``gpus``."""
        ports, ports_source = self.reserved_ports()
        return JobInfo(
            scheduler=self.name,
            job_id=job_id,
            nodes=tuple(nodes),
            tasks_per_node=tasks.tasks_per_node,
            rank=tasks.rank,
            local_rank=tasks.local_rank,
            node_index=tasks.node_index,
            tasks_source=tasks.source,
            tasks_launched=tasks.launched,
            slots_per_node=tuple(slots),
            node_gpus=tuple(gpus for _ in nodes),
            reserved_ports=ports,
            reserved_ports_source=ports_source,
        )

    def require(self, *names: str, hint: str) -> tuple[str, str]:
        """Return ``(name, value)`` of the first of ``names`` that is set."""
        for name in names:
            value = self.env.get(name)
            if value:
                return name, value
        raise ClusterConfigError(
            f"{' / '.join(names)} is not set (scheduler {self.name}).", hint
        )

    def int_var(self, name: str, default: int | None = None, minimum: int | None = None) -> int:
        """Read an integer variable, with an error naming it when malformed or below ``minimum``."""
        raw = self.env.get(name)
        if raw is None or raw == "":
            if default is None:
                raise ClusterConfigError(
                    f"{name} is not set (scheduler {self.name}).",
                    f"run inside a {self.name} job, or set {name}.",
                )
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ClusterConfigError(
                f"{name}={raw!r} is not an integer.",
                f"{name} is set by {self.name}; unset it or give a whole number.",
            ) from None
        if minimum is not None and value < minimum:
            raise ClusterConfigError(
                f"{name}={raw!r} is below {minimum}.",
                f"{name} is set by {self.name}; unset it or give a whole number >= {minimum}.",
            )
        return value

    @staticmethod
    def check_index(var: str, index: int, count: int, list_var: str) -> None:
        """Refuse a node index outside the node list."""
        if not 0 <= index < count:
            raise ClusterConfigError(
                f"{var}={index} is outside {list_var} ({count} node(s)).",
                "the variable and the node list come from different jobs; run inside the job.",
            )


#: What a host name may hold: letters, digits, dots, dashes, underscores (RFC 952/1123 plus
#: the underscore some sites use). Anything else would end up inside "host:port" addresses.
HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
#: A GPU id as CUDA_VISIBLE_DEVICES accepts it: an index, or a GPU-/MIG- UUID.
GPU_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]*")
#: The most nodes or tasks per node a variable may describe (python-hostlist's own limit).
MAX_EXPANDED = 100_000


def check_host_names(source: str, hosts: list[str]) -> None:
    """Refuse host names that cannot be a machine's name."""
    for host in hosts:
        if not HOST_NAME.fullmatch(host):
            raise ClusterConfigError(
                f"{source} holds {host!r}, which is not a host name.",
                "host names use letters, digits, '.', '-' and '_' only; fix the list or the file.",
            )


def _blanks_as_commas(value: str) -> str:
    """``a, b[1, 3]  c`` -> ``a,b[1,3],c``: blanks separate hosts outside brackets."""
    out: list[str] = []
    depth = 0
    for char in value.strip():
        depth += (char == "[") - (char == "]")
        if char.isspace():
            if depth == 0 and out and out[-1] != ",":
                out.append(",")
        elif char == "," and out and out[-1] == ",":
            continue
        else:
            out.append(char)
    return "".join(out)


def expand_hosts(var: str, value: str) -> list[str]:
    """Expand a hostlist such as ``r[1-2]n[01-02]`` in the scheduler's order.

    Blanks separate hosts like commas (``alpha, host[5-9]``), as Slurm's own hostlist does.
    """
    compact = _blanks_as_commas(value)
    try:
        hosts = hostlist.expand_hostlist(compact, sort=False)
    except hostlist.BadHostlist as exc:
        raise ClusterConfigError(
            f"{var}={value!r} is not a valid hostlist ({exc}).",
            "use Slurm's syntax, e.g. n[01-04],gpu[1,3]; ranges must ascend.",
        ) from None
    if not hosts:
        raise ClusterConfigError(f"{var}={value!r} names no host.", f"set {var} to the job's nodes.")
    check_host_names(f"{var}={value!r}", hosts)
    return hosts


def expand_tasks_per_node(var: str, value: str, num_nodes: int, nodes_var: str) -> list[int]:
    """Expand Slurm's compressed ``2(x3),1`` into one count per node."""
    repeats = [int(n) for n in re.findall(r"\(x(\d+)\)", value)]
    if sum(repeats) > MAX_EXPANDED:
        raise ClusterConfigError(
            f"{var}={value!r} describes more than {MAX_EXPANDED} nodes.", "expected a list like 2(x3),1."
        )
    try:
        counts = hostlist.parse_slurm_tasks_per_node(value)
    except (hostlist.BadHostlist, ValueError) as exc:
        raise ClusterConfigError(
            f"{var}={value!r} is malformed ({exc}).", "expected a list like 2(x3),1."
        ) from None
    if len(counts) != num_nodes:
        raise ClusterConfigError(
            f"{var}={value!r} describes {len(counts)} node(s) but {nodes_var} has {num_nodes}.",
            f"{var} and {nodes_var} must come from the same job or step; unset stale copies.",
        )
    if any(c < 1 for c in counts):
        raise ClusterConfigError(f"{var}={value!r} has a node with no task.", "each node needs >= 1 task.")
    return counts


def split_gpu_ids(var: str, value: str) -> tuple[str, ...]:
    """Split ``2,3`` into ids kept exactly as given (never renumbered)."""
    value = value.strip()
    if value in ("", "NoDevFiles"):
        return ()
    ids = tuple(part.strip() for part in value.split(","))
    if not all(GPU_ID.fullmatch(i) for i in ids):
        raise ClusterConfigError(
            f"{var}={value!r} is not a list of GPU ids.", "expected ids like 0,1 or 2,3 (or GPU-/MIG- UUIDs)."
        )
    return ids


def expand_ports(var: str, value: str) -> tuple[int, ...]:
    """``12000-12003,12010`` -> the ports, in order; refused when malformed or out of range."""
    ports: list[int] = []
    for part in value.replace(" ", "").split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or int(high or low) < int(low) \
                or int(high or low) - int(low) > 65535:
            raise ClusterConfigError(f"{var}={value!r} is not a list of port ranges.", "expected e.g. 12000-12019.")
        ports += range(int(low), int(high or low) + 1)
    if not all(1 <= p <= 65535 for p in ports):
        raise ClusterConfigError(f"{var}={value!r} holds a port outside 1-65535.", "expected e.g. 12000-12019.")
    return tuple(ports)


def node_of_rank(rank: int, tasks_per_node: tuple[int, ...] | list[int]) -> tuple[int, int]:
    """(node index, local rank) of a global rank under block distribution."""
    start = 0
    for index, count in enumerate(tasks_per_node):
        if rank < start + count:
            return index, rank - start
        start += count
    raise ClusterConfigError(
        f"rank {rank} is outside the job's {start} task(s).",
        "the rank variables and the host list come from different jobs.",
    )
