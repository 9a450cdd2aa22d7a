"""The one rule for "how many tasks did the launcher start, and which one am I".

Every scheduler parser describes its allocation as nodes and *slots* per node (what the
scheduler granted). Whether tasks were started, how many and which one this is comes
from the task launcher, read here once for every scheduler:

- no launcher variable: nothing was started yet (a job script); the counts are slots;
- the launcher's size equals the slots: one task per slot, placed in slot order;
- the launcher's size equals the node count (and its local size, when given, is 1):
  the agent mode, one task per host (``mpirun --map-by ppr:1:node``, ``jsrun -r1 -a1``);
- the launcher's local size ``k`` with ``size == k * nodes``: ``k`` tasks on every node;
- anything else is refused with the scheduler's hint for one task per node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ._slots import local_host_index
from .base import ClusterConfigError, Tasks, node_of_rank


@dataclass(frozen=True)
class LauncherVars:
    """The variable names one task launcher sets in every task it starts."""

    launcher: str
    rank: str
    size: str = ""
    local_rank: str = ""
    local_size: str = ""


#: Task launchers, most specific first: jsrun also sets Open MPI's variables (Spectrum MPI),
#: and Open MPI's mpirun also sets PMIX_RANK.
LAUNCHERS: tuple[LauncherVars, ...] = (
    # IBM jsrun (Summit/Sierra/Lassen): JSM_NAMESPACE_* for each task.
    LauncherVars("jsrun", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE"),
    # Open MPI's mpirun / prterun (Open MPI docs, "Environment variables set for MPI processes").
    LauncherVars("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    # MVAPICH2's mpirun_rsh / mpiexec.
    LauncherVars("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    # A PMIx server (srun --mpi=pmix, prterun) exports only the rank as a variable.
    LauncherVars("PMIx", "PMIX_RANK", "", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    # MPICH / Intel MPI Hydra (PMI-1/PMI-2), and srun --mpi=pmi2.
    LauncherVars("PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


@dataclass(frozen=True)
class LauncherCounts:
    """What the task launcher told this task."""

    names: LauncherVars
    rank: int
    size: int | None
    local_rank: int | None
    local_size: int | None

    def describe(self) -> str:
        if self.size is None:
            return f"{self.names.rank}={self.rank}"
        return f"{self.names.size}={self.size}"


def _count(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    if not name or not env.get(name):
        return None
    raw = env[name]
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ClusterConfigError(
            f"{name}={raw!r} is not a whole number >= {minimum}.",
            f"{name} is set by the task launcher; unset it or start the job with the launcher.",
        )
    return value


def launcher_counts(env: Mapping[str, str]) -> LauncherCounts | None:
    """Rank, size and local rank/size from the first launcher whose rank variable is set."""
    for names in LAUNCHERS:
        rank = _count(env, names.rank, 0)
        if rank is None:
            continue
        size = _count(env, names.size, 1)
        if size is not None and rank >= size:
            raise ClusterConfigError(
                f"{names.rank}={rank} is not below {names.size}={size}.",
                f"these variables are set by {names.launcher}; unset stale copies.",
            )
        return LauncherCounts(names, rank, size, _count(env, names.local_rank, 0), _count(env, names.local_size, 1))
    return None


def place_slot(rank: int, slot_hosts: Sequence[str], nodes: Sequence[str], var: str) -> tuple[int, int]:
    """(node index, local rank) of the task on slot ``rank`` of a per-slot host list."""
    if not 0 <= rank < len(slot_hosts):
        raise ClusterConfigError(
            f"rank {rank} is outside the {len(slot_hosts)} slot(s) listed in {var}.",
            "the rank variable and the host file come from different jobs.",
        )
    host = slot_hosts[rank]
    return nodes.index(host), sum(1 for h in slot_hosts[:rank] if h == host)


def launched_tasks(
    env: Mapping[str, str],
    nodes: Sequence[str],
    slots: Sequence[int],
    source: str,
    agent_hint: str,
    *,
    slot_hosts: Sequence[str] | None = None,
    this_node: int | None = None,
    slot_rank: int | None = None,
) -> Tasks:
    """Apply the rule of this module.

    ``slots`` are the scheduler's slots per node, described by ``source`` in messages;
    ``slot_hosts`` (one host per line of the scheduler's file) places ``slot_rank``, which
    numbers those lines even when they interleave hosts; a launcher's ranks instead fill
    each node's slots before the next node's (Open MPI's mpirun(1) mapping by slot, jsrun's
    resource sets host by host); ``this_node`` is the scheduler's word for this task's
    node when no launcher ran (PBS_NODENUM); ``slot_rank`` is a scheduler's own slot index
    for this task (PBS_VNODENUM), which does not say how many tasks were started.
    """
    launcher = launcher_counts(env)
    total = sum(slots)
    host_index = local_host_index(nodes, env)

    def per_slot(rank: int, origin: str, by_line: bool = False) -> tuple[int, int]:
        if by_line and slot_hosts is not None:
            return place_slot(rank, slot_hosts, nodes, origin)
        if not 0 <= rank < total:
            raise ClusterConfigError(
                f"{origin} is outside the {total} slot(s) of {source}.",
                "the rank variable and the host list come from different jobs.",
            )
        return node_of_rank(rank, slots)

    if launcher is None:
        if slot_rank is not None:
            node_index, local_rank = per_slot(slot_rank, source, by_line=True)
            return Tasks(tuple(slots), slot_rank, local_rank, node_index, False, source)
        node_index = this_node if this_node is not None else host_index or 0
        return Tasks(tuple(slots), sum(slots[:node_index]), 0, node_index, False, source)

    rank, size, local_size = launcher.rank, launcher.size, launcher.local_size
    origin = f"{launcher.names.rank}={rank}"
    if size is None or (size == total and local_size in (None, *slots)):
        node_index, local_rank = per_slot(rank, origin)
        return Tasks(tuple(slots), rank, local_rank, node_index, True, source)
    if size == len(nodes) and local_size in (None, 1):
        # The agent mode: the launcher started one task on each host. The host name,
        # when it is in the list, says which; otherwise hosts are taken in rank order.
        node_index = host_index if host_index is not None else rank
        return Tasks((1,) * len(nodes), rank, 0, node_index, True, f"{launcher.describe()} (one task per node)")
    if local_size is not None and size == local_size * len(nodes):
        node_index, local_rank = divmod(rank, local_size)
        if launcher.local_rank is not None:
            local_rank = launcher.local_rank
        described = f"{launcher.describe()}, {launcher.names.local_size}={local_size}"
        return Tasks((local_size,) * len(nodes), rank, local_rank, node_index, True, described)
    local = f", {launcher.names.local_size}={local_size}" if local_size is not None else ""
    raise ClusterConfigError(
        f"{launcher.describe()}{local} fits neither the {total} slot(s) nor the {len(nodes)} node(s) of {source}.",
        agent_hint,
    )


def mpi_rank(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(global rank, local rank) from a task launcher, when one set them."""
    launcher = launcher_counts(env)
    if launcher is None:
        return None
    return launcher.rank, launcher.local_rank or 0
