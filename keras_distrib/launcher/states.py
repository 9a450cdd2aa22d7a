"""The agent's states, its result, the numbered plan it runs and where its run is (agent.py, membership.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..plan import Plan


class State(Enum):
    """Where an agent is in the job's life."""

    FORMING = "forming"  # connecting to the other agents, agreeing on the plan
    RUNNING = "running"  # this node's processes run
    WAITING = "waiting"  # this node's SCRIPTs ended well; the other agents' have not (allreduce, jax)
    DRAINING = "draining"  # a SIGINT/SIGTERM was forwarded: waiting for SCRIPT to save and end
    STOPPED = "stopped"  # the exit code is decided; the processes are being stopped


#: The transitions ``_enter`` allows (a restart takes a waiting agent back to running; an
#: elastic re-forming takes a running or waiting one through FORMING to the next generation).
TRANSITIONS: dict[State, frozenset[State]] = {
    State.FORMING: frozenset({State.RUNNING, State.STOPPED}),
    State.RUNNING: frozenset({State.WAITING, State.DRAINING, State.FORMING, State.STOPPED}),
    State.WAITING: frozenset({State.RUNNING, State.DRAINING, State.FORMING, State.STOPPED}),
    State.DRAINING: frozenset({State.STOPPED}),
    State.STOPPED: frozenset(),
}


@dataclass(frozen=True)
class RunResult:
    """How the agent ended: its exit code, the line that said why (None: SCRIPT's own end)."""

    code: int
    reason: str | None = None
    restarts: int = 0
    lost_node: str | None = None  # the node that was lost, when that ended the job


@dataclass(frozen=True)
class Generation:
    """The plan the agents run, numbered: an elastic re-forming replaces it as a whole."""

    number: int
    plan: Plan


@dataclass
class RunStatus:
    """Where one agent's run is. Only the agent changes it; its ``_enter`` checks TRANSITIONS."""

    generation: Generation
    state: State = State.FORMING
    result: RunResult | None = None
    interrupted: int | None = None  # the SIGINT/SIGTERM being drained
    chief_code: int | None = None  # the chief's SCRIPT ended with it (ps layouts): the job's code
    done_agents: set[int] = field(default_factory=set)  # agent 0: agents whose SCRIPTs all ended well
