"""Moving a job off a taken port block (mechanism-free: plain functions over a plan).

A job's ports come from its job id (`plan.derive_port_base`), so two jobs whose ids are
equal modulo 500 want the same block. Where the plan's ports are not fixed (no
--port-base, no ports reserved by the scheduler), every agent checks before anything
starts which of the plan's block and its fallbacks (`Plan.port_fallbacks`) are free for
its own processes on its node, and says so in its hello. Agent 0 listens on the control
port of the first block free for itself (holding a block's control port is what claims
the block: two jobs cannot both hold it), then picks the first block from there that is
free on every node, and the start message tells the others where the job moved.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..plan import Plan
from .messages import Hello
from .prestart import taken_port


def job_tag(plan: Plan) -> str:
    """The job's name in the agents' greetings: agents of two jobs tell each other apart by it."""
    return f"{plan.scheduler}-{plan.job_id}"


def blocks(plan: Plan) -> tuple[int, ...]:
    """The first port of the plan's block and of each fallback, in the order they are tried."""
    return (plan.processes[0].port, *plan.port_fallbacks)


def shifted(port: int, plan: Plan, base: int) -> int:
    """``port`` of ``plan`` in the block at ``base`` (every port moves by the same amount)."""
    return port - plan.processes[0].port + base


def control_ports(plan: Plan) -> tuple[int, ...]:
    """Agent 0's control port in each of the plan's blocks, in order."""
    port = plan.control_port()
    return tuple(shifted(port, plan, base) for base in blocks(plan))


def free_blocks(plan: Plan, ports: Iterable[int]) -> list[int]:
    """The plan's blocks (`blocks`) in which all of this agent's ``ports`` are free on this node."""
    wanted = list(ports)
    return [base for base in blocks(plan) if not any(taken_port(shifted(p, plan, base)) for p in wanted)]


def block_for_all(plan: Plan, claimed: int, mine: Sequence[int], hellos: Mapping[int, Hello]) -> list[int]:
    """The blocks from ``claimed`` (the one whose control port agent 0 holds) on that are free
    on every node (``mine``: agent 0's own free blocks; each hello's ``free``), in order.

    Blocks before ``claimed`` are out: another job holds their control port.
    """
    order = blocks(plan)
    candidates = [b for b in order[order.index(claimed):] if b in mine]
    for hello in hellos.values():
        if hello.free is not None:
            candidates = [b for b in candidates if b in hello.free]
    return candidates


def taken_on(plan: Plan, base: int, mine: Sequence[int], me: str, hellos: Mapping[int, Hello]) -> list[str]:
    """The nodes on which the block at ``base`` is not free."""
    nodes = [me] if base not in mine else []
    return nodes + [h.node for h in hellos.values() if h.free is not None and base not in h.free]
