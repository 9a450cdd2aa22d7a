"""Moving a job off a taken port block (mechanism-free: plain functions over a plan).

A job's ports come from its job id (`plan.derive_port_base`), so two jobs whose ids are
equal modulo 500 want the same block. Where the plan's ports are not fixed (no
--port-base, no ports reserved by the scheduler), every agent checks before anything
starts which of the plan's block and its fallbacks (`Plan.port_fallbacks`) are free for
its own processes on its node, claims each of them on its node (`claim_blocks`), and says
which in its hello. Agent 0 listens on the control port of the first block free for
itself, then picks the first block from there that is free on every node; the start
message tells the others where the job moved, and each agent keeps the claim of that block
for the job's life and drops the others.

A claim is a socket bound, without SO_REUSEADDR and without listening, to the block's last
port, which no process of a plan uses (`claim_port`). While one agent holds it, no other
socket can bind that port on that node (Linux lets two sockets share a port only when both
ask to), so two jobs that share a node can never both find the same block free there, even
when they start at the same moment; and a connection to it is refused at once.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping, Sequence

from ..plan import PORT_BLOCK, Plan
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


def claim_port(base: int) -> int:
    """The port that claims the block at ``base`` on a node: its last (a host's processes use
    at most the ports before it, `plan.build_plan`)."""
    return base + PORT_BLOCK - 1


class BlockClaims:
    """This agent's claims (`claim_port`) on the blocks free for its processes on its node."""

    def __init__(self, held: Mapping[int, socket.socket | None]) -> None:
        """``held``: each free block's claim (None: not claimed, e.g. an agent's own port there)."""
        self._held = dict(held)

    @classmethod
    def unclaimed(cls, bases: Iterable[int]) -> "BlockClaims":
        return cls({base: None for base in bases})

    @property
    def free(self) -> list[int]:
        """The free blocks, in the order they are tried."""
        return list(self._held)

    def keep(self, base: int) -> None:
        """Hold the claim of ``base`` (the job's block) only."""
        for other, sock in list(self._held.items()):
            if other != base and sock is not None:
                sock.close()
                self._held[other] = None

    def close(self) -> None:
        for sock in self._held.values():
            if sock is not None:
                sock.close()


def _claim(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # no SO_REUSEADDR: the port is this socket's alone
    try:
        sock.bind(("", port))
    except OSError:
        sock.close()
        return None
    return sock


def claim_blocks(plan: Plan, ports: Iterable[int], claim: bool = True) -> BlockClaims:
    """The plan's blocks (`blocks`) in which all of this agent's ``ports`` are free on this node,
    each claimed (``claim`` False: checked only, another job's claim included, for the agents
    that share a node in one job)."""
    wanted = list(ports)
    held: dict[int, socket.socket | None] = {}
    for base in blocks(plan):
        mine = [shifted(p, plan, base) for p in wanted]
        if any(taken_port(p) for p in mine):
            continue
        if claim_port(base) in mine:  # an agent's own process or control port takes it
            held[base] = None
        elif not claim:  # free unless another job's agent claimed it here
            if not taken_port(claim_port(base)):
                held[base] = None
        elif (sock := _claim(claim_port(base))) is not None:  # else another job's agent holds it here
            held[base] = sock
    return BlockClaims(held)


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
