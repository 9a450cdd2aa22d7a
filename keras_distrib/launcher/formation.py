"""Forming the job (mechanism): connect the agents, agree on the plan, open their channel.

Every agent builds the plan itself (it is deterministic); agent 0 compares their digests
and sends only what it alone knows (the interface addresses), so the start message stays
small at any job size. The result is a ``Channel`` (typed messages over control.py) and
the plan every agent now holds: the only place where a plan is rebuilt from the job.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cluster_parsers import ClusterConfigError, JobInfo

from ..plan import PORT_BLOCK, Plan, build_plan, moved_plan
from . import control, portblocks
from .interfaces import interface_ipv4
from .messages import (
    Event, FromPeer, Hello, JobMessage, MessageError, PeerGone, Start, Stop, decode, to_wire,
)
from .options import Options

#: Beyond --shutdown-grace, how long agent 0 waits at the end for the other agents to
#: disconnect (`LeaderChannel.close`).
LINGER_MARGIN_S = 10.0

logger = logging.getLogger(__name__)


def plan_digest(plan: Plan) -> str:
    """A short fingerprint of the plan, so agents can check they agree without sending it.

    In a heterogeneous job each component's agents see only their own GPUs, and a node's
    GPU ids concern only its own agent (the plan's cluster does not hold them): they are
    left out there.
    """
    data = plan.to_json()
    if plan.roles:
        data["processes"] = [{k: v for k, v in p.items() if k != "gpus"} for p in data["processes"]]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Identity:
    """Who this agent is within the job."""

    agent_id: int
    num_agents: int
    node: str
    agent_nodes: Mapping[int, str]
    local: bool = False

    @property
    def leader(self) -> bool:
        """Agent 0: decides for the job (restarts, the end, requeue)."""
        return self.agent_id == 0


class Channel(Protocol):
    """What the agent's policy sends; the agents' own messages arrive as events."""

    #: Seconds `close` waits for the other agents to disconnect after agent 0's Stop (0 elsewhere).
    linger: float

    def to_leader(self, message: JobMessage) -> None:
        """To agent 0 (nothing on agent 0 itself)."""

    def to_all(self, message: JobMessage) -> None:
        """From agent 0 to every other agent (nothing elsewhere)."""

    def close(self) -> tuple[int, ...]:
        """End the connection(s) at the end of the job.

        Returns the agents that did not acknowledge agent 0's Stop by disconnecting within the
        linger (their node cut off or frozen): empty on every other agent.
        """


class SoloChannel:
    """A job of one agent: nobody to talk to."""

    linger = 0.0

    def to_leader(self, message: JobMessage) -> None:
        pass

    def to_all(self, message: JobMessage) -> None:
        pass

    def close(self) -> tuple[int, ...]:
        return ()


class LeaderChannel:
    """Agent 0's end: the control server; the job secret file goes with it."""

    def __init__(self, server: control.ControlServer, secret_file: Path | None, linger: float = 0.0) -> None:
        self.server = server
        self.secret_file = secret_file
        self.linger = linger
        self._stopped_all = False

    def to_leader(self, message: JobMessage) -> None:
        pass

    def to_all(self, message: JobMessage) -> None:
        self._stopped_all = self._stopped_all or isinstance(message, Stop)
        self.server.broadcast(to_wire(message))

    def close(self) -> tuple[int, ...]:
        unacknowledged: tuple[int, ...] = ()
        if self._stopped_all:
            # Each agent told to stop ends its processes, then disconnects. Agent 0 ending
            # first can end the job script, and the scheduler then cancels what still runs:
            # an agent started with --join, in a step of its own, ended "Terminated" (143).
            unacknowledged = self.server.wait_until_alone(self.linger)
        self.server.close()
        if self.secret_file is not None:
            self.secret_file.unlink(missing_ok=True)  # the job is over: nobody needs it
        return unacknowledged


class FollowerChannel:
    """Every other agent's end: the control client, relayed as events by a thread."""

    linger = 0.0

    def __init__(self, client: control.ControlClient, post: Callable[[Event], None]) -> None:
        self.client = client
        self._post = post
        threading.Thread(target=self._relay, name="control-relay", daemon=True).start()

    def _relay(self) -> None:
        try:
            while (raw := self.client.receive()) is not None:
                event = peer_event(control.Received(0, raw))
                if event is not None:
                    self._post(event)
        except control.ControlError as exc:  # refused: e.g. agent 0 still holds this agent's old connection
            logger.debug(f"control channel: {exc}")
        self._post(PeerGone(0))

    def to_leader(self, message: JobMessage) -> None:
        self.client.send(to_wire(message))

    def to_all(self, message: JobMessage) -> None:
        pass

    def close(self) -> tuple[int, ...]:
        self.client.close()
        return ()


def peer_event(report: control.PeerReport) -> Event | None:
    """The agent's event for what the control server reported (None: an unknown kind, logged)."""
    if not isinstance(report, control.Received):
        return report  # PeerGone, PeerSilent, PeerJoined: events as they are
    try:
        message = decode(report.message)
    except MessageError as exc:  # an authenticated agent of another version: say so, go on
        logger.warning(f"agent {report.agent} sent {exc}; ignored")
        return None
    if isinstance(message, JobMessage):
        return FromPeer(report.agent, message)
    return None


def readdressed(job: JobInfo, plan: Plan, hosts: Mapping[str, str]) -> Plan:
    """The same plan with the nodes reached at ``hosts`` (interface addresses)."""
    return build_plan(job, plan.layout, plan.processes[0].port, plan.protocol, hosts, plan.roles,
                      plan.tuners_per_node, plan.backend)


def form_job(
    identity: Identity,
    job: JobInfo,
    plan: Plan,
    options: Options,
    post: Callable[[Event], None],
    log: Any = logger,
    claims: portblocks.BlockClaims | None = None,
) -> tuple[Channel, Plan]:
    """Connect and authenticate the agents; check that all computed the same plan.

    ``claims``: the plan's port blocks free for this agent's processes, claimed on its node
    (`portblocks.claim_blocks`; None when the plan's ports are fixed); the job's block's
    claim is kept, the others dropped. Returns the channel and the plan to run (moved to
    another port block where the plan's is taken on a node, readdressed with --interface).
    Raises ControlError naming what is missing.
    """
    my_ip = interface_ipv4(options.interface, identity.node) if options.interface else None
    free = claims.free if claims is not None else []
    if identity.num_agents == 1:
        if claims is not None and free:
            claims.keep(free[0])
            if free[0] != plan.processes[0].port:
                plan = _moved(job, plan, free[0], [identity.node], log)
        return SoloChannel(), readdressed(job, plan, {n: my_ip for n in plan.nodes}) if my_ip else plan
    try:
        secret, secret_file = control.job_secret(plan.scheduler, plan.job_id, os.environ)
    except OSError as exc:
        raise control.ControlError(
            f"cannot create the job secret in {Path.cwd() / control.SECRET_DIR} ({exc.strerror}); "
            f"run from a writable directory shared by the nodes, or export {control.SECRET_VAR}=<random string> "
            "in the job script"
        ) from None
    if identity.leader:
        channel, plan = _lead(identity, job, plan, options, post, log, free, secret, secret_file, my_ip)
        if claims is not None:
            claims.keep(plan.processes[0].port)
        return channel, plan
    # None: this agent did not check (its ports are fixed, or no claims were made): it restricts no block
    offered = list(free) if plan.port_fallbacks and claims is not None else None
    hello = Hello(identity.agent_id, identity.node, my_ip, plan_digest(plan), offered)
    first, ports = plan.processes[0].node, portblocks.control_ports(plan)
    client = control.ControlClient(first, ports[0], to_wire(hello), options.startup_timeout, secret,
                                   options.heartbeat_timeout, job=portblocks.job_tag(plan), also_at=ports[1:])
    raw = client.receive()
    try:
        message = decode(raw) if raw is not None else None
    except MessageError:
        message = None
    if not isinstance(message, Start):
        client.close()
        raise control.ControlError(f"the agent on {first} went away before the job started")
    if message.ports is not None:
        plan = moved_plan(plan, job, message.ports)
    if claims is not None:
        claims.keep(plan.processes[0].port)
    if message.hosts:
        plan = readdressed(job, plan, message.hosts)
    return FollowerChannel(client, post), plan


def _lead(identity: Identity, job: JobInfo, plan: Plan, options: Options, post: Callable[[Event], None], log: Any,
          free: Sequence[int], secret: bytes, secret_file: Path | None, my_ip: str | None) -> tuple[Channel, Plan]:
    """Agent 0's side of `form_job`: listen, gather the hellos, move the plan if need be, send the start."""
    others = {a: n for a, n in identity.agent_nodes.items() if a != 0}
    server, claimed = _claim_control_port(plan, free or [plan.processes[0].port], others, secret, options, log)
    channel = LeaderChannel(server, secret_file, linger=options.shutdown_grace + LINGER_MARGIN_S)
    try:
        hellos = server.gather(options.startup_timeout, others)
        digest = plan_digest(plan)
        differ = sorted(a for a, h in hellos.items() if h.plan != digest)
        if differ:
            raise control.ControlError(
                f"the plan computed on {control.first_few(others[a] for a in differ)} differs from this node's "
                "(different options or job variables on those nodes?)"
            )
        # No claims (ports fixed, or no checks made here): the plan's own block.
        base = (_block_for_all(plan, claimed, free, identity.node, hellos, server) if plan.port_fallbacks and free
                else plan.processes[0].port)
    except (control.ControlError, ClusterConfigError):
        channel.close()
        raise
    moved_to = base if base != plan.processes[0].port else None
    if moved_to is not None:
        plan = _moved(job, plan, moved_to, portblocks.taken_on(plan, plan.processes[0].port, free, identity.node,
                                                               hellos), log)
    hosts = {h.node: h.ip for h in hellos.values()} | {identity.node: my_ip} if my_ip else None
    if hosts:
        plan = readdressed(job, plan, hosts)
    channel.to_all(Start(hosts=hosts, ports=moved_to))

    def deliver(report: control.PeerReport) -> None:
        event = peer_event(report)
        if event is not None:
            post(event)

    server.listen(deliver)
    return channel, plan


def _claim_control_port(plan: Plan, free: Sequence[int], others: dict[int, str], secret: bytes, options: Options,
                        log: Any) -> tuple[control.ControlServer, int]:
    """Listen on the control port of the first of ``free`` blocks that is still free; the
    server and that block (holding its control port claims it)."""
    error: OSError | None = None
    for base in free:
        port = portblocks.shifted(plan.control_port(), plan, base)
        try:
            server = control.ControlServer(port, len(others), secret, log=log.info,
                                           heartbeat_timeout=options.heartbeat_timeout, valid_agents=others,
                                           job=portblocks.job_tag(plan))
        except OSError as exc:  # taken since the check: another job's agent 0 got there first
            error = exc
            continue
        return server, base
    raise control.ControlError(f"cannot listen on the agents' control port {plan.control_port()} "
                               f"or on any fallback ({error.strerror if error else 'none free'})")


def _block_for_all(plan: Plan, claimed: int, free: Sequence[int], me: str, hellos: Mapping[int, Hello],
                   server: control.ControlServer) -> int:
    """The first block from ``claimed`` on that is free on every node; agent 0 also listens on
    its control port, so that port claims it and agents that rejoin find agent 0 there."""
    for base in portblocks.block_for_all(plan, claimed, free, hellos):
        if base == claimed:
            return base
        try:
            server.also_listen(portblocks.shifted(plan.control_port(), plan, base))
        except OSError:
            continue
        return base
    first = plan.processes[0].port
    where = "; ".join(f"{base}-{base + PORT_BLOCK - 1} on {control.first_few(portblocks.taken_on(plan, base, free, me, hellos))}"
                      for base in portblocks.blocks(plan))
    raise ClusterConfigError(
        f"no port block is free on every node of the job: taken are {where}.",
        f"pass --port-base with a range free on the job's nodes (ss -ltnp shows who listens), "
        f"e.g. --port-base {first + 10000}.",
    )


def _moved(job: JobInfo, plan: Plan, base: int, taken: Sequence[str], log: Any) -> Plan:
    first = plan.processes[0].port
    log.warning(f"ports {first}-{first + PORT_BLOCK - 1} (the block of job id {plan.job_id}) are taken on "
                f"{control.first_few(taken)} (another job whose id is equal modulo 500?); the job uses "
                f"{base}-{base + PORT_BLOCK - 1} instead.")
    return moved_plan(plan, job, base)


def rejoin_job(
    identity: Identity,
    plan: Plan,
    options: Options,
    post: Callable[[Event], None],
    timeout: float,
) -> Channel:
    """A dropped agent (not agent 0) connects to agent 0 again; the order to start comes later, as an event.

    ``plan``: the plan the job formed on (agent 0 checks the digest, as at start-up).
    Raises ControlError when agent 0 is not reached within ``timeout`` or no longer listens.
    """
    my_ip = interface_ipv4(options.interface, identity.node) if options.interface else None
    secret, _ = control.job_secret(plan.scheduler, plan.job_id, os.environ)
    hello = Hello(identity.agent_id, identity.node, my_ip, plan_digest(plan))
    ports = portblocks.control_ports(plan)
    client = control.ControlClient(plan.processes[0].node, ports[0], to_wire(hello), timeout, secret,
                                   options.heartbeat_timeout, refused_ends=True, job=portblocks.job_tag(plan),
                                   also_at=ports[1:])
    return FollowerChannel(client, post)
