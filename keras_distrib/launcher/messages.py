"""Every message kind of the launcher, and its fields: one module, frozen dataclasses.

Two families:

* **Control messages** travel between agents on the authenticated control channel
  (control.py: newline-delimited JSON, HMAC handshake, size limit, heartbeats). Each kind
  is one JSON object whose first key names it, e.g. ``{"stop": 0}`` or ``{"died":
  "ps:0", "label": "ps:0 on n2", "code": -9}``; ``encode``/``decode`` convert. The channel's
  own kinds (``Nonce``, ``Refused``, ``Hello``, ``Beat``) are used by control.py itself,
  the job's kinds (``Start`` ... ``Done``) by the agent.
* **Events** are what an agent's loop handles, posted by its children's pumps, the control
  channel, signal handlers and timers (never sent over the network).

A new kind (the hang watchdog's progress report, an elastic re-forming order) is a new
dataclass here, registered in ``_WIRE`` when it travels.
"""

from __future__ import annotations

import signal
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ..plan import Process
    from .children import Child


class MessageError(ValueError):
    """A control line that is no known message kind, or lacks a field."""


# -- control messages -----------------------------------------------------------------


@dataclass(frozen=True)
class Nonce:
    """Agent 0's greeting on each new connection: prove the job secret over this nonce.

    ``job``: which job this agent 0 runs (`job_tag`), so an agent of another job that
    tried this port while looking for its own agent 0 goes on looking.
    """

    KEY: ClassVar[str] = "nonce"
    nonce: str
    job: str = ""


@dataclass(frozen=True)
class Elsewhere:
    """An agent -> another job's agent 0, which greeted it: not my job (``job``); closing."""

    KEY: ClassVar[str] = "elsewhere"
    job: str


@dataclass(frozen=True)
class Refused:
    """Agent 0 refused this connection (wrong secret, unknown or duplicate agent id)."""

    KEY: ClassVar[str] = "refused"
    reason: str


@dataclass(frozen=True)
class Hello:
    """An agent's first message: who it is and the digest of the plan it computed.

    On the wire it also carries ``auth``, the HMAC over the nonce and these fields.
    """

    KEY: ClassVar[str] = "agent"
    agent: int
    node: str
    ip: str | None = None
    plan: str | None = None
    #: The port blocks (first ports) of the plan's and its fallbacks whose ports are free for
    #: this agent's processes on its node; None when the plan's ports are fixed.
    free: list[int] | None = None


@dataclass(frozen=True)
class Beat:
    """Heartbeat, both ways, every heartbeat_timeout / 6 seconds; never delivered to the agent."""

    KEY: ClassVar[str] = "beat"


@dataclass(frozen=True)
class Start:
    """Agent 0 -> all: every agent connected and agreed on the plan: start the processes.

    ``hosts``: the interface address of each node (with --interface), which replaces the
    node names in the plan; ``ports``: the first port of the block agent 0 moved the job
    to (its own was taken on a node); ``generation``: the plan's generation (0 at start-up).
    ``nodes``: an elastic re-forming (generation > 0): the nodes the job goes on on, in
    plan order; every agent restarts its processes from the plan re-formed on them, and
    an agent whose node is not among them stops.
    """

    KEY: ClassVar[str] = "start"
    hosts: dict[str, str] | None = None
    generation: int = 0
    nodes: tuple[str, ...] | None = None
    ports: int | None = None


@dataclass(frozen=True)
class Stop:
    """Agent 0 -> all: the job is over; stop every process."""

    KEY: ClassVar[str] = "stop"
    code: int


@dataclass(frozen=True)
class Restart:
    """Agent 0 -> all: kill and start again these processes (``job:index``) where they run."""

    KEY: ClassVar[str] = "restart"
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Failed:
    """An agent -> agent 0: the job cannot go on (a process failed, or ended after a signal)."""

    KEY: ClassVar[str] = "failed"
    reason: str
    code: int
    # The failed process's name when its error was a lost connection, which a restart may cure.
    restartable: str = ""


@dataclass(frozen=True)
class Died:
    """An agent -> agent 0: a process died and restarts are allowed: agent 0 decides.

    ``generation``: the plan generation the process belonged to; agent 0 drops a report
    of an older one (its process was replaced by a re-forming).
    """

    KEY: ClassVar[str] = "died"
    name: str
    label: str
    code: int
    generation: int = 0


@dataclass(frozen=True)
class Done:
    """An agent -> agent 0: every SCRIPT of this agent ended, with this exit code (in ``generation``)."""

    KEY: ClassVar[str] = "done"
    agent: int
    code: int
    generation: int = 0


@dataclass(frozen=True)
class Stuck:
    """An agent -> agent 0: a process is stuck (hang watchdog) and restarts are allowed: agent 0 decides.

    ``what`` is the naming line's rest (``made no progress for 120 s (state: stopped) ...``);
    ``seen``: the restarts the sender had carried out, so a report from before a restart
    that already replaced the process is dropped.
    """

    KEY: ClassVar[str] = "stuck"
    name: str
    label: str
    what: str
    seen: int = 0


JobMessage = Start | Stop | Restart | Failed | Died | Done | Stuck
ControlMessage = Nonce | Elsewhere | Refused | Hello | Beat | JobMessage
_WIRE: dict[str, type[Any]] = {cls.KEY: cls for cls in (Nonce, Elsewhere, Refused, Beat, Start, Stop, Restart, Failed, Died, Done, Stuck)}


_OMITTED_AT_DEFAULT = ("generation", "restartable")


def to_wire(message: ControlMessage) -> dict[str, Any]:
    """The JSON object of ``message``: its kind's key first (the wire format since 0.1)."""
    values = {f.name: getattr(message, f.name) for f in fields(message)}
    if isinstance(message, Beat):
        return {Beat.KEY: 1}
    if isinstance(message, Start):
        return {Start.KEY: {k: list(v) if k == "nodes" else v for k, v in values.items() if v is not None}}
    if isinstance(message, Restart):
        return {Restart.KEY: list(message.targets)}
    if isinstance(message, Hello):
        return values
    first, *rest = fields(message)
    # generation 0 and no restartable process are left out: the wire of a job that never
    # re-forms, or of a script's own error, is as before.
    return {message.KEY: values[first.name]} | {f.name: values[f.name] for f in rest
                                                 if not (f.name in _OMITTED_AT_DEFAULT and values[f.name] == f.default)}


def decode(raw: Any) -> ControlMessage:
    """The message a decoded JSON object holds; MessageError for anything else."""
    if not isinstance(raw, dict) or not raw:
        raise MessageError(f"not a control message: {raw!r:.80}")
    key = next(iter(raw))
    kind = _WIRE.get(key)
    if kind is None:
        raise MessageError(f"unknown control message {key!r}")
    try:
        if kind is Beat:
            return Beat()
        if kind is Start:
            body = raw[key]
            nodes = body.get("nodes")
            ports = body.get("ports")
            return Start(hosts=body.get("hosts"), generation=int(body.get("generation", 0)),
                         nodes=tuple(str(n) for n in nodes) if nodes else None,
                         ports=int(ports) if ports is not None else None)
        if kind is Restart:
            return Restart(tuple(str(t) for t in raw[key]))
        first, *rest = fields(kind)
        # A field with a default may be missing (a generation-0 report).
        return kind(raw[key], *(raw[f.name] if f.default is MISSING else raw.get(f.name, f.default)
                                for f in rest))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise MessageError(f"malformed {key!r} message ({exc!r:.80})") from None


# -- events: what an agent's loop handles ----------------------------------------------------


@dataclass(frozen=True)
class ChildExited:
    """A process of this node ended (its output drained)."""

    child: Child
    code: int


@dataclass(frozen=True)
class FromPeer:
    """A job message from another agent (from agent 0, for the others)."""

    agent: int
    message: JobMessage


@dataclass(frozen=True)
class PeerGone:
    """The connection to another agent ended (for the others: agent 0's)."""

    agent: int


@dataclass(frozen=True)
class PeerSilent:
    """Agent 0: an agent sent no heartbeat for ``seconds`` (node down, link cut)."""

    agent: int
    seconds: float


@dataclass(frozen=True)
class PeerJoined:
    """Agent 0: an agent not in the current generation connected again (its ``Hello``)."""

    agent: int
    hello: Hello


@dataclass(frozen=True)
class Rejoined:
    """A dropped agent reached agent 0 again: ``channel`` is its new connection (formation.Channel)."""

    channel: Any


@dataclass(frozen=True)
class RejoinFailed:
    """A dropped agent gave up reaching agent 0 (``reason``: why)."""

    reason: str


@dataclass(frozen=True)
class JoinDue:
    """Agent 0: time to look whether a checkpoint was written since a node came back."""


@dataclass(frozen=True)
class FailureDue:
    """Agent 0, --min-nodes: SCRIPT failed ``grace`` seconds ago in ``generation``; no node loss explained it
    (nor a restart: ``restarts``)."""

    reason: str
    code: int
    generation: int
    restartable: str = ""  # as in Failed
    restarts: int = 0  # the restarts ordered when it failed: one ordered since replaced what failed


@dataclass(frozen=True)
class SignalReceived:
    """SIGINT, SIGTERM, SIGUSR1 or SIGUSR2 reached this agent."""

    signum: int

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


@dataclass(frozen=True)
class StartupChecked:
    """Agent 0: the start-up watch is over; these servers never listened."""

    unreachable: tuple[Process, ...]


@dataclass(frozen=True)
class ScriptStopDeadline:
    """SCRIPT is still running SCRIPT_STOP_WAIT seconds after a forwarded SIGTERM/SIGINT."""


@dataclass(frozen=True)
class WorkersEndDeadline:
    """The chief's SCRIPT ended WORKERS_END_WAIT seconds ago and workers of a JAX ps layout still run it."""


@dataclass(frozen=True)
class Hung:
    """The hang watchdog found this node's ``child`` stuck; its stacks are kept (``stacks``: where)."""

    child: Child
    seconds: float
    state: str  # as /proc tells it: "stopped", "sleeping in futex_wait_queue", ...
    stacks: str


@dataclass(frozen=True)
class OrphanStopDeadline:
    """An agent without SCRIPT got no stop order within ORPHAN_STOP_WAIT seconds of a signal."""


Event = (ChildExited | FromPeer | PeerGone | PeerSilent | PeerJoined | Rejoined | RejoinFailed | JoinDue | FailureDue
         | SignalReceived | StartupChecked | ScriptStopDeadline | OrphanStopDeadline | Hung)
