"""The job plan: which TensorFlow process runs where, on which port, with which GPUs.

Pure and deterministic: every task of a job computes the same plan from the same job
description, without talking to the others. Never imports TensorFlow.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from cluster_parsers import ClusterConfigError, JobInfo

# Derived ports live below Linux's ephemeral range (32768-60999) so outgoing
# connections of other programs cannot take them first.
PORT_RANGE_START = 20000
PORT_BLOCK = 20          # ports reserved per job and host
PORT_BLOCKS = 500        # 20000 .. 29999
# When the job-id block is taken on a node (another job whose id is equal modulo
# PORT_BLOCKS), agent 0 moves the job to the first of these many other blocks that is
# free on every node; the stride spreads neighbouring job ids' fallbacks apart.
FALLBACK_BLOCKS = 7
# k * FALLBACK_STRIDE modulo PORT_BLOCKS for k = 1..FALLBACK_BLOCKS: distinct, and none
# within 50 blocks of the job's own (the blocks of the job ids just before and after it).
FALLBACK_STRIDE = 223
MIN_PORT, MAX_PORT = 1024, 65535

CHIEF, PS, WORKER = "chief", "ps", "worker"
#: A KerasTuner trial worker (layout tuner); that layout's chief runs KerasTuner's oracle.
TUNER = "tuner"
TUNER_LAYOUT = "tuner"
# Keras 3 on the JAX backend with keras.distribution: every process runs SCRIPT.
JAX_LAYOUTS = ("jax", "jax-per-gpu")
#: The layout of a heterogeneous job (`component_roles`).
HETEROGENEOUS_LAYOUT = "ps-per-node"

# What the nodes of one component of a heterogeneous job run: the chief and the workers
# (with their GPUs), or parameter servers only. A plain job's nodes run both.
WORKERS_ROLE, PS_ROLE, BOTH_ROLES = "workers", "ps", "both"
COMPONENT_ROLES = (WORKERS_ROLE, PS_ROLE)


@dataclass(frozen=True)
class Process:
    """One TensorFlow task of the plan."""

    node: str
    node_index: int
    job: str
    index: int
    host: str
    port: int
    gpus: tuple[str, ...]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"


@dataclass(frozen=True)
class Plan:
    """The whole job: its processes and the ClusterSpec they form."""

    scheduler: str
    job_id: str
    nodes: tuple[str, ...]
    layout: str
    protocol: str
    processes: tuple[Process, ...]
    #: The role of each component of a heterogeneous job (`component_roles`); () in a plain job.
    roles: tuple[str, ...] = ()
    #: Where the ports came from (`choose_port_base`), for --plan.
    ports_source: str = field(default="", compare=False)
    #: The first ports of the other blocks this plan may move to, in order, when its own are
    #: taken on a node (`fallback_bases`); () when the ports were given (--port-base, reserved).
    port_fallbacks: tuple[int, ...] = field(default=(), compare=False)
    #: Layout tuner: trial workers per node given by --tuners-per-node (None: one per GPU).
    tuners_per_node: int | None = None
    #: The Keras backend of a parameter-server layout (`PS_BACKENDS`): on tensorflow the workers
    #: are TF servers that run the chief's closures; on jax every worker runs SCRIPT, trains with
    #: JAX and pushes to the ps tasks (trainers/jax_ps).
    backend: str = "tensorflow"

    def cluster_spec(self) -> dict[str, list[str]]:
        spec: dict[str, list[str]] = {}
        for proc in sorted(self.processes, key=lambda p: (_JOB_ORDER[p.job], p.index)):
            spec.setdefault(proc.job, []).append(proc.address)
        return spec

    def tf_config(self, proc: Process) -> dict[str, Any]:
        return {"cluster": self.cluster_spec(), "task": {"type": proc.job, "index": proc.index}}

    def on_node(self, node_index: int) -> list[Process]:
        return [p for p in self.processes if p.node_index == node_index]

    def find(self, job: str, index: int) -> Process:
        for proc in self.processes:
            if proc.job == job and proc.index == index:
                return proc
        raise KeyError(f"{job}:{index}")

    def control_port(self) -> int:
        """The agents' control port: one past the highest plan port on the first node's host."""
        port = self._highest_first_host_port + 1
        if port > MAX_PORT:
            raise ClusterConfigError(
                f"the agents' control port {port} is above {MAX_PORT}.", "pass a lower --port-base."
            )
        return port

    @cached_property
    def _highest_first_host_port(self) -> int:
        # Cached: a scan of every process, asked several times per agent (the plan is frozen).
        first_host = self.processes[0].host
        return max(p.port for p in self.processes if p.host == first_host)

    @property
    def every_process_runs_script(self) -> bool:
        """Synchronous layouts (allreduce, jax) and the tuner: the job ends when every process has."""
        return self.layout in ("allreduce", TUNER_LAYOUT) or self.layout in JAX_LAYOUTS

    @property
    def is_jax(self) -> bool:
        """Keras 3 on JAX with keras.distribution (jax, jax-per-gpu)."""
        return self.layout in JAX_LAYOUTS

    @property
    def script_runners(self) -> list[Process]:
        """The processes that run the user's script (the chief, or every process of a synchronous layout)."""
        return [p for p in self.processes if self.runs_script(p)]

    def listeners(self) -> list[Process]:
        """The processes that listen on their plan port once up: the TF servers (the JAX
        processes, from keras_distrib.distribution()), or the tuner's oracle (from tuner.search())."""
        if self.layout == TUNER_LAYOUT:
            return [self.processes[0]]
        return [p for p in self.processes if p.job != CHIEF]

    def speaks_for_itself(self, proc: Process) -> bool:
        """Whether ``proc``'s output is shown; else it goes only to its log file unless it fails
        on its own: one all-reduce worker speaks for all, the tuner's oracle for its trials."""
        return not ((self.layout == "allreduce" and proc.job != CHIEF and proc.index != 0) or proc.job == TUNER)

    def restarts_on_error(self, proc: Process) -> bool:
        """Whether ``proc``'s SCRIPT failing is a fault to restart, not SCRIPT's own end: a
        worker of a ps layout on JAX (its error is a lost ps or connection; the budget bounds
        a SCRIPT that fails every time)."""
        return self.backend == "jax" and proc.job == WORKER

    def ends_script(self, proc: Process) -> bool:
        """Whether ``proc``'s SCRIPT ending ends the job's SCRIPT: the chief of a ps layout (on
        JAX its workers run SCRIPT only to serve the chief's fits; they are stopped with the job)."""
        return proc.job == CHIEF and not self.every_process_runs_script

    def runs_keras_on_jax(self, proc: Process) -> bool:
        """Whether ``proc`` runs Keras on JAX: every process of a jax layout, the chief and the
        workers of a ps layout whose backend is jax (its ps tasks are TensorFlow servers)."""
        return self.is_jax or (self.backend == "jax" and self.runs_script(proc))

    def runs_script(self, proc: Process) -> bool:
        """Whether ``proc`` (one of this plan's) runs the user's script: O(1), not a scan."""
        return proc.job == CHIEF or self.every_process_runs_script or (self.backend == "jax" and proc.job == WORKER)

    def to_json(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler,
            "job_id": self.job_id,
            "nodes": list(self.nodes),
            "layout": self.layout,
            "cluster": self.cluster_spec(),
            "processes": [
                {"node": p.node, "job": p.job, "index": p.index, "address": p.address, "gpus": list(p.gpus)}
                for p in self.processes
            ],
            "component_roles": list(self.roles),
            "tuners_per_node": self.tuners_per_node,
            "backend": self.backend,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], protocol: str = "grpc") -> Plan:
        nodes = tuple(data["nodes"])
        procs = []
        for p in data["processes"]:
            host, port = p["address"].rsplit(":", 1)
            procs.append(Process(p["node"], nodes.index(p["node"]), p["job"], p["index"], host, int(port), tuple(p["gpus"])))
        return cls(data["scheduler"], data["job_id"], nodes, data["layout"], protocol, tuple(procs),
                   tuple(data.get("component_roles", ())), tuners_per_node=data.get("tuners_per_node"),
                   backend=data.get("backend", "tensorflow"))


_JOB_ORDER = {CHIEF: 0, PS: 1, WORKER: 2, TUNER: 3}


def node_roles(layout: str, node_index: int, gpus: Sequence[str],
               role: str = BOTH_ROLES, tuners: int | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """The (job, GPUs) of each process on one node, in start order: the rank->role rule.

    ``role``: what the node's component runs in a heterogeneous job (`component_roles`): a
    parameter-server node runs one ps and leaves its GPUs unused; a workers node runs no ps.
    ``tuners``: layout tuner's trial workers per node (None: one per GPU, or one).
    """
    if role == PS_ROLE:
        return [(PS, ())]
    if layout == TUNER_LAYOUT:
        return ([(CHIEF, ())] if node_index == 0 else []) + tuner_roles(gpus, tuners)
    chief = [(CHIEF, ())] if node_index == 0 and layout not in ("allreduce", *JAX_LAYOUTS) else []
    ps = [(PS, ())] if role == BOTH_ROLES else []
    if layout == "ps-per-node":
        return chief + ps + [(WORKER, tuple(gpus))]
    if layout == "worker-per-gpu":
        workers = [(WORKER, (g,)) for g in gpus] or [(WORKER, ())]
        return chief + ps + workers
    if layout in ("allreduce", "jax"):
        return [(WORKER, tuple(gpus))]
    if layout == "jax-per-gpu":
        return [(WORKER, (g,)) for g in gpus] or [(WORKER, ())]
    raise ClusterConfigError(f"layout={layout!r} is unknown.",
                             "use ps-per-node, worker-per-gpu, allreduce, jax, jax-per-gpu or tuner.")


def tuner_roles(gpus: Sequence[str], tuners: int | None) -> list[tuple[str, tuple[str, ...]]]:
    """A node's KerasTuner trial workers: one per GPU by default, or ``tuners`` that deal the GPUs out."""
    if tuners is None:
        return [(TUNER, (g,)) for g in gpus] or [(TUNER, ())]
    if gpus and tuners > len(gpus):
        raise ClusterConfigError(
            f"--tuners-per-node {tuners}, but the node has {len(gpus)} GPU(s) ({','.join(gpus)}): a trial worker "
            "would get none.",
            f"pass --tuners-per-node {len(gpus)} or less (each worker gets len(GPUs)/N of them), or leave it out "
            "for one worker per GPU.",
        )
    return [(TUNER, tuple(gpus[i::tuners])) for i in range(tuners)]


def split_components(job: JobInfo, sizes: str | None) -> JobInfo:
    """``job`` with its nodes, in order, split into components of ``sizes`` ("2,1",
    --component-sizes): for schedulers whose environment does not say which node came from
    which part of the request (a PBS ``select`` of two chunks, an LSF compound ``-R``).
    A job whose scheduler named its components (a Slurm heterogeneous job) keeps them."""
    if not sizes:
        return job
    counts = [int(n) for n in sizes.split(",") if n.strip().isdigit()]
    if len(counts) != len(sizes.split(",")) or len(counts) < 2 or min(counts) < 1 or sum(counts) != len(job.nodes):
        raise ClusterConfigError(
            f"--component-sizes {sizes!r} does not split the job's {len(job.nodes)} nodes into 2 or more parts "
            f"of at least 1 node ({job.tasks_source or 'the scheduler node list'}).",
            f"give the nodes of each part of the request, in the node list's order, adding up to {len(job.nodes)}, "
            f"e.g. --component-sizes {max(len(job.nodes) - 1, 1)},1.",
        )
    if job.num_components > 1:
        raise ClusterConfigError(
            f"--component-sizes {sizes!r}, but the scheduler already split this job into {job.num_components} "
            f"components ({job.components_source}).",
            "drop --component-sizes: the scheduler's components are used.",
        )
    components = tuple(c for c, n in enumerate(counts) for _ in range(n))
    return replace(job, node_components=components, components_source=f"--component-sizes {sizes}")


def component_roles(job: JobInfo, layout: str, wanted: str | None = None) -> tuple[str, ...]:
    """What each component of a heterogeneous job runs; () for a plain job.

    By default the first component computes (the chief and the workers, with their GPUs)
    and every other one holds the parameter servers, as in ``sbatch -N2 --gres=gpu:4 : -N1
    -p cpu``. ``wanted`` ("workers,ps,ps", --component-roles) names one role per component;
    the first component always computes, because the chief runs on the job's first node.
    """
    source = job.components_source or "the scheduler's node list"
    if job.num_components == 1:
        if wanted:
            raise ClusterConfigError(
                f"--component-roles {wanted!r}, but this job has one component "
                f"({source}).",
                "drop --component-roles, or submit a heterogeneous job (sbatch -N2 : -N1, docs/schedulers.md).",
            )
        return ()
    if layout != HETEROGENEOUS_LAYOUT:
        # worker-per-gpu: the number of workers per node follows its GPUs, which the agents
        # of the other components cannot see, so their plans would differ.
        raise ClusterConfigError(
            f"layout {layout} cannot run a heterogeneous job ({job.num_components} components, {source}): only "
            f"{HETEROGENEOUS_LAYOUT} puts its parameter servers on a component of their own.",
            f"use --layout {HETEROGENEOUS_LAYOUT} (one worker per node with all its GPUs), or submit a plain job for "
            f"layout {layout}.",
        )
    default = (WORKERS_ROLE,) + (PS_ROLE,) * (job.num_components - 1)
    roles = tuple(r.strip() for r in wanted.split(",")) if wanted else default
    if len(roles) != job.num_components or any(r not in COMPONENT_ROLES for r in roles) or roles[0] != WORKERS_ROLE \
            or PS_ROLE not in roles:
        raise ClusterConfigError(
            f"--component-roles {wanted!r} does not give the {job.num_components} "
            f"components of this job ({source}) one role each, the first 'workers' and at least one 'ps'.",
            f"write one of 'workers' or 'ps' per component, in the job's order, e.g. {','.join(default)}; put the "
            "GPU component first in the sbatch line (sbatch -N2 --gres=gpu:4 : -N1 -p cpu).",
        )
    return roles


def derive_port_base(job_id: str, override: int | None = None) -> int:
    """The first port of this job's block; all nodes agree because they share the job id."""
    if override is not None:
        if not MIN_PORT <= override <= MAX_PORT:
            raise ClusterConfigError(
                f"--port-base / KERAS_DISTRIB_PORT_BASE={override} is outside {MIN_PORT}-{MAX_PORT}.",
                f"pass --port-base (or KERAS_DISTRIB_PORT_BASE) between {MIN_PORT} and {MAX_PORT}.",
            )
        return override
    # isascii: str.isdigit() accepts '²', which int() refuses.
    number = int(job_id) if job_id.isascii() and job_id.isdigit() else zlib.crc32(job_id.encode())
    return PORT_RANGE_START + (number % PORT_BLOCKS) * PORT_BLOCK


#: Ports a plan needs on a host beyond its processes': the agents' control port, and the
#: cluster check's extra client (allreduce has no chief) one past it.
EXTRA_PORTS = 2


@dataclass(frozen=True)
class PortBlock:
    """The ports of a job's plan on each host: from ``base``, ``size`` of them (None: up to
    65535, as --port-base asks), and where they came from (`choose_port_base`)."""

    base: int
    size: int | None
    source: str
    fallbacks: tuple[int, ...] = ()


def fallback_bases(base: int) -> tuple[int, ...]:
    """The other blocks a job-id block ``base`` may move to, in the order agent 0 tries them."""
    index = (base - PORT_RANGE_START) // PORT_BLOCK
    return tuple(PORT_RANGE_START + (index + k * FALLBACK_STRIDE) % PORT_BLOCKS * PORT_BLOCK
                 for k in range(1, FALLBACK_BLOCKS + 1))


def choose_port_base(job: JobInfo, override: int | None, needed: int) -> PortBlock:
    """``override`` (--port-base); else the ports the scheduler reserved for the step when
    they hold the ``needed`` ones in a row; else the block derived from the job id."""
    if override is not None:
        return PortBlock(derive_port_base(job.job_id, override), None,
                         f"--port-base / KERAS_DISTRIB_PORT_BASE={override}")
    ports = job.reserved_ports
    in_a_row = next((i for i in range(1, len(ports)) if ports[i] != ports[i - 1] + 1), len(ports))
    if in_a_row >= needed:
        return PortBlock(ports[0], in_a_row, f"{job.reserved_ports_source}, reserved for this step by the scheduler")
    base = derive_port_base(job.job_id)
    fallbacks = fallback_bases(base)
    source = (f"the block derived from job id {job.job_id} ({base}-{base + PORT_BLOCK - 1}; "
              "taken on a node, the job moves to a fallback block)")
    if ports:
        source += (f"; {job.reserved_ports_source} holds {in_a_row} port(s) in a row, fewer than the {needed} "
                   f"this plan needs on a host (srun --resv-ports={needed} reserves them)")
    return PortBlock(base, PORT_BLOCK, source, fallbacks)


def build_plan(
    job: JobInfo,
    layout: str = "ps-per-node",
    port_base: int | None = None,
    protocol: str = "grpc",
    hosts: Mapping[str, str] | None = None,
    roles: tuple[str, ...] = (),
    tuners_per_node: int | None = None,
    backend: str = "tensorflow",
) -> Plan:
    """Plan every process of the job.

    ``hosts`` maps a node name to the address others use to reach it (an interface IP,
    or ``localhost`` in local mode); by default the node name itself. ``roles``: what each
    component of a heterogeneous job runs (`component_roles`). ``tuners_per_node``: layout
    tuner's trial workers per node (None: one per GPU). ``backend``: see `Plan.backend`.
    """
    node_role = [roles[c] if roles else BOTH_ROLES for c in job.node_components]
    _check_equal_gpus(job, layout, [r != PS_ROLE for r in node_role])
    placed = [(node_index, node, (hosts or {}).get(node, node), role, gpus)
              for node_index, node in enumerate(job.nodes)
              for role, gpus in node_roles(layout, node_index, job.node_gpus[node_index], node_role[node_index],
                                           tuners_per_node)]
    per_host = collections.Counter(host for _, _, host, _, _ in placed)
    block = choose_port_base(job, port_base, max(per_host.values(), default=0) + EXTRA_PORTS)
    next_slot: dict[str, int] = {}
    counters = {CHIEF: 0, PS: 0, WORKER: 0, TUNER: 0}
    processes = []
    for node_index, node, host, role, gpus in placed:
        slot = next_slot.get(host, 0)
        next_slot[host] = slot + 1
        port = block.base + slot
        if block.size is not None and slot >= block.size - 1:  # the last: the control port, or a block's claim
            raise ClusterConfigError(
                f"{host} needs more than the {block.size - 1} ports of {block.source}.",
                "pass --port-base (or KERAS_DISTRIB_PORT_BASE) with a free range for this job.",
            )
        if port > MAX_PORT:
            raise ClusterConfigError(
                f"--port-base / KERAS_DISTRIB_PORT_BASE={block.base} leaves no port for {role}:{counters[role]} on "
                f"{host} (needs {block.base}+{slot} > {MAX_PORT}).",
                f"pass a lower --port-base (or KERAS_DISTRIB_PORT_BASE), e.g. {PORT_RANGE_START}.",
            )
        processes.append(Process(node, node_index, role, counters[role], host, port, gpus))
        counters[role] += 1
    if roles and (not counters[PS] or not counters[WORKER]):
        missing = "parameter-server" if not counters[PS] else "workers"
        raise ClusterConfigError(
            f"none of the job's {len(job.nodes)} node(s) is left in a {missing} component "
            f"({', '.join(f'{n}={r}' for n, r in zip(job.nodes, node_role))}).",
            "the job needs a node in each component; resubmit it (or requeue: --requeue).",
        )
    return Plan(job.scheduler, job.job_id, job.nodes, layout, protocol, tuple(processes), roles, block.source,
                block.fallbacks, tuners_per_node, backend)


def moved_plan(plan: Plan, job: JobInfo, base: int) -> Plan:
    """``plan`` on the block at ``base`` (one of its `Plan.port_fallbacks`): the same processes
    on the same hosts, each port shifted by the same amount."""
    hosts = {p.node: p.host for p in plan.processes}
    moved = build_plan(job, plan.layout, base, plan.protocol, hosts, plan.roles, plan.tuners_per_node, plan.backend)
    first = plan.processes[0].port
    return replace(moved, ports_source=f"the block at {base}-{base + PORT_BLOCK - 1}: agent 0 moved the job there, "
                                       f"its job-id block at {first} being taken on a node")


def survivors_plan(plan: Plan, job: JobInfo, nodes: Sequence[str]) -> Plan:
    """The plan of the next generation: ``plan`` re-formed on ``nodes`` (a subset of its nodes, the first kept).

    Pure, so every agent computes the same one from the same order. Indices are renumbered
    (n1, n3 -> ps:0, ps:1); each host keeps its first ports, so the first node's ports (and
    the agents' control port, one past them) do not change.
    """
    if not nodes or nodes[0] != plan.nodes[0] or any(n not in plan.nodes for n in nodes):
        raise AssertionError(f"the survivors {list(nodes)} must be nodes of the plan {list(plan.nodes)}, the first kept")
    at = {n: i for i, n in enumerate(job.nodes)}  # the job's lists follow its own node order
    pick = lambda values: tuple(values[at[n]] for n in nodes)  # noqa: E731
    sub = replace(job, nodes=tuple(nodes), tasks_per_node=pick(job.tasks_per_node), node_gpus=pick(job.node_gpus),
                  slots_per_node=pick(job.slots_per_node), node_components=pick(job.node_components),
                  node_index=0, rank=0, local_rank=0)
    hosts = {p.node: p.host for p in plan.processes}
    # The first process holds the first node's first port: the base every generation shares.
    return build_plan(sub, plan.layout, plan.processes[0].port, plan.protocol, hosts, plan.roles,
                      plan.tuners_per_node, plan.backend)


def _check_equal_gpus(job: JobInfo, layout: str, computes: Sequence[bool]) -> None:
    """TensorFlow needs the same number of GPUs per worker in these layouts (``computes``:
    the nodes that run workers)."""
    if layout in ("worker-per-gpu", "jax-per-gpu", TUNER_LAYOUT):
        return
    counts = {node: len(g) for node, g, works in zip(job.nodes, job.node_gpus, computes) if works}
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{node}={n}" for node, n in counts.items())
        raise ClusterConfigError(
            f"GPU counts differ between nodes ({detail}); layout {layout} needs equal GPUs per worker.",
            "request the same GPUs on every node (e.g. --gpus-per-node=N) or use --layout "
            + ("jax-per-gpu." if layout in JAX_LAYOUTS else "worker-per-gpu."),
        )


def check_task_counts(job: JobInfo, plan: Plan, hint: str) -> None:
    """Refuse more started tasks on a node than the layout has processes there."""
    if not job.tasks_launched:
        return
    wanted = _processes_per_node(plan)
    for node, (tasks, procs) in enumerate(zip(job.tasks_per_node, wanted)):
        if tasks > procs:
            raise ClusterConfigError(
                f"{job.tasks_source or 'tasks per node'} starts {tasks} task(s) on {job.nodes[node]}, but layout "
                f"{plan.layout} runs only {procs} process(es) there.",
                hint,
            )


def tasks_mode(job: JobInfo, plan: Plan, hint: str) -> str:
    """'agent' (one task per node starts all its processes) or 'per-role' (one task per process).

    Raises when the started task counts match neither; ``hint`` is the scheduler's way
    to start one task per node.
    """
    check_task_counts(job, plan, hint)
    if not job.tasks_launched or all(t == 1 for t in job.tasks_per_node):
        return "agent"
    wanted = _processes_per_node(plan)
    if list(job.tasks_per_node) == wanted:
        return "per-role"
    node = next(i for i, (t, w) in enumerate(zip(job.tasks_per_node, wanted)) if t not in (1, w))
    raise ClusterConfigError(
        f"{job.tasks_source or 'tasks per node'} starts {job.tasks_per_node[node]} task(s) on {job.nodes[node]}; "
        f"layout {plan.layout} needs 1 (an agent per node) or {wanted[node]} (one task per process) there.",
        hint,
    )


def _processes_per_node(plan: Plan) -> list[int]:
    counts = [0] * len(plan.nodes)
    for proc in plan.processes:
        counts[proc.node_index] += 1
    return counts


def process_for_task(job: JobInfo, plan: Plan) -> Process:
    """In per-role mode, the process this task runs: the node's processes in local-rank order."""
    return plan.on_node(job.node_index)[job.local_rank]
