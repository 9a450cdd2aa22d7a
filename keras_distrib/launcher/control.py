"""The agents' control channel: newline-delimited JSON over one TCP port on the first node.

Agent 0 (on the chief's node) listens; every other agent connects once at start-up.
Through it the agents form the job (a barrier that names missing nodes), share
interface addresses, report a failed or finished process, and receive the order to stop.

Only the job's own agents get in: on each connection agent 0 sends a fresh nonce and
the agent answers with HMAC-SHA256(job secret, nonce + hello) (``job_secret``: a 0600
file in the submit directory, or ``KERAS_DISTRIB_SECRET``). A stranger, a port scan,
garbage, an oversized line or a sender too slow to authenticate is logged in one line
and dropped; one event-loop thread serves every connection, so none of them can stall
the job. Both ends send a heartbeat every ``heartbeat_timeout / 6`` seconds; a peer
silent for ``heartbeat_timeout`` (a dead node keeps no socket open to close) is lost.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import resource
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .messages import Beat, Elsewhere, Hello, Nonce, PeerGone, PeerJoined, PeerSilent, Refused, to_wire

#: A control message as JSON (messages.py types them; this module moves them).
Message = dict[str, Any]

SECRET_VAR = "KERAS_DISTRIB_SECRET"
SECRET_DIR = ".keras_distrib"
# Longest control line accepted; a hello is ~100 bytes, the host map ~40 bytes per node.
MAX_MESSAGE = 4 << 20
# A connection must authenticate within this time (a slow or stuck sender is dropped).
HANDSHAKE_TIMEOUT = 10.0
# How long a send to one peer may block before that peer counts as lost.
SEND_TIMEOUT = 10.0
DEFAULT_HEARTBEAT_TIMEOUT = 30.0
# How long a connected agent waits for agent 0's nonce before it reconnects.
GREETING_TIMEOUT = 60.0
# Listen backlog: thousands of agents connect at once (the kernel caps it at somaxconn).
BACKLOG = 65535


@dataclass(frozen=True)
class Received:
    """A message an authenticated agent sent (a decoded JSON object, not yet read as a kind)."""

    agent: int
    message: Message


#: What the server reports to its listener: a message, a peer that disconnected (``PeerGone``),
#: one silent past the heartbeat timeout (``PeerSilent``), or one that connected once the job
#: ran (``PeerJoined``: it was dropped and is back).
PeerReport = Received | PeerGone | PeerSilent | PeerJoined


class ControlError(RuntimeError):
    """The job could not form, or an agent was lost."""


def encode(message: Message) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def proof(secret: bytes, nonce: str, hello: Message) -> str:
    """The HMAC an agent sends to prove it knows the job secret."""
    body = json.dumps(hello, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, nonce.encode() + body, hashlib.sha256).hexdigest()


def job_secret(scheduler: str, job_id: str, environ: dict[str, str] | os._Environ[str], directory: Path | None = None) -> tuple[bytes, Path | None]:
    """The per-job secret and the file holding it (None when it came from the environment).

    ``KERAS_DISTRIB_SECRET`` wins (a job script may export one, the scheduler passes it
    to the job's tasks only). Otherwise the first agent to get there creates
    ``SUBMIT_DIR/.keras_distrib/secret-SCHEDULER-JOBID`` (directory 0700, file 0600,
    written then hard-linked so no agent reads half a secret) and the others read it:
    the submit directory must be shared by the nodes, as the script already is.
    """
    if environ.get(SECRET_VAR):
        return environ[SECRET_VAR].encode(), None
    folder = (directory or Path.cwd()) / SECRET_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"secret-{scheduler}-{''.join(c if c.isalnum() else '_' for c in job_id)}"
    if not path.exists():
        tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another agent won the race: use its secret
        finally:
            tmp.unlink()
    return path.read_bytes().strip(), path


def raise_open_files_limit(wanted: int) -> None:
    """Agent 0 holds one socket per agent: lift the soft limit toward the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def first_few(names: Iterable[str], limit: int = 10) -> str:
    """'a, b, c' or 'a, b, ... and 990 more (1000 in all)': messages stay short at any size."""
    names = list(names)
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])}, ... and {len(names) - limit} more ({len(names)} in all)"


@dataclass
class _Connection:
    sock: socket.socket
    peer: str
    nonce: str
    deadline: float
    buffer: bytearray = field(default_factory=bytearray)
    agent: int | None = None
    last_seen: float = 0.0


class ControlServer:
    """Agent 0's end: accepts and authenticates the other agents, then relays messages.

    One background thread runs a selector over the listening socket and every
    connection. ``log`` receives one line per refused or dropped connection.
    """

    def __init__(
        self,
        port: int,
        expected: int,
        secret: bytes,
        bind: str = "",
        log: Callable[[str], None] = print,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        valid_agents: Iterable[int] | None = None,
        job: str = "",
    ) -> None:
        """``job``: this job's tag (`job_tag`), sent with every greeting."""
        self.expected = expected
        self.job = job
        self.port = port
        self.secret = secret
        self.log = log
        self.heartbeat_timeout = heartbeat_timeout
        self.valid_agents = set(valid_agents) if valid_agents is not None else set(range(1, expected + 1))
        raise_open_files_limit(expected + 256)
        self._bind = bind
        self._listeners = [socket.create_server((bind, port), backlog=BACKLOG)]
        self._listeners[0].setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listeners[0], selectors.EVENT_READ)
        self._peers: dict[int, _Connection] = {}
        self._hellos: dict[int, Hello] = {}
        self._changed = threading.Condition()
        self._send_lock = threading.Lock()
        self._on_report: Callable[[PeerReport], None] | None = None
        self._held: list[PeerReport] = []
        self._silenced: list[int] = []  # agents lost to silence, in order
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="control-server", daemon=True)
        self._thread.start()

    # -- the public side -------------------------------------------------------------

    def gather(self, timeout: float, names: dict[int, str]) -> dict[int, Hello]:
        """Wait until every other agent said hello; name the missing ones on timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self._hellos) < self.expected:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(names) - set(self._hellos))
                    raise ControlError(
                        f"agents on {first_few(names[m] for m in missing)} did not connect to this node's "
                        f"control port {self.port} within {timeout:.0f} s"
                    )
                self._changed.wait(min(remaining, 1.0))
            return dict(self._hellos)

    def also_listen(self, port: int) -> None:
        """Accept agents on ``port`` too (the control port of the block the job moved to).

        Raises OSError when ``port`` is taken.
        """
        listener = socket.create_server((self._bind, port), backlog=BACKLOG)
        listener.setblocking(False)
        self._listeners.append(listener)
        self._selector.register(listener, selectors.EVENT_READ)

    def listen(self, on_report: Callable[[PeerReport], None]) -> None:
        """Report each agent's messages, disconnection, silence and return (``PeerReport``)."""
        with self._changed:
            self._on_report = on_report
            held, self._held = self._held, []
        for report in held:
            on_report(report)

    def broadcast(self, message: Message) -> None:
        """Send ``message`` to every connected agent (encoded once)."""
        data = encode(message)
        for agent, conn in list(self._peers.items()):
            self._send(agent, conn, data)

    def wait_until_alone(self, timeout: float) -> tuple[int, ...]:
        """Wait until every agent has disconnected, at most ``timeout`` s.

        Returns the agents that did not disconnect: still connected at the deadline, or lost to
        silence meanwhile (a node cut off); empty when every agent left by closing its end.
        """
        silent_before = len(self._silenced)
        deadline = time.monotonic() + timeout
        while self._peers and time.monotonic() < deadline:
            time.sleep(0.05)
        return tuple(sorted(set(self._peers) | set(self._silenced[silent_before:])))

    def close(self) -> None:
        if self._closed.is_set():  # closed already (by its channel)
            return
        self._closed.set()
        self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            if key.data is not None and key.data.agent is None:  # every stranger gets its line
                self._drop(key.data, "had not authenticated when the job ended")
        for conn in list(self._peers.values()):
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.sock.close()
        for listener in self._listeners:
            listener.close()
        self._selector.close()

    # -- the event loop ----------------------------------------------------------------

    def _serve(self) -> None:
        beat = encode(to_wire(Beat()))
        interval = self.heartbeat_timeout / 6
        next_beat = time.monotonic() + interval
        next_expiry = time.monotonic() + 0.5
        while not self._closed.is_set():
            for key, _ in self._selector.select(timeout=min(interval, 0.5)):
                if key.data is None:  # a listening socket
                    self._accept(key.fileobj)
                else:
                    self._read(key.data)
            now = time.monotonic()
            if now >= next_expiry:  # a scan of every connection: not on every event
                next_expiry = now + 0.5
                self._expire(now)
            if now >= next_beat:
                next_beat = now + interval
                for agent, conn in list(self._peers.items()):
                    self._send(agent, conn, beat)

    def _accept(self, listener: Any) -> None:
        for _ in range(1024):  # drain the backlog in bursts, then serve the others
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: refuse, do not die
                self.log(f"control port {self.port}: cannot accept a connection ({exc.strerror})")
                return
            sock.settimeout(SEND_TIMEOUT)
            conn = _Connection(sock, f"{address[0]}:{address[1]}", secrets.token_hex(16), time.monotonic() + HANDSHAKE_TIMEOUT)
            try:
                sock.sendall(encode(to_wire(Nonce(conn.nonce, self.job))))
            except OSError:  # a port scan: gone before the greeting (one line, as for the others)
                sock.close()
                self.log(f"control port {self.port}: connection from {conn.peer} closed the connection "
                         "before authenticating; closed it")
                continue
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Connection) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn, "closed the connection before authenticating" if conn.agent is None else None)
            return
        conn.last_seen = time.monotonic()
        conn.buffer += chunk
        while (end := conn.buffer.find(b"\n")) >= 0:
            line = bytes(conn.buffer[:end])
            del conn.buffer[: end + 1]
            if not self._handle_line(conn, line):
                return
        if len(conn.buffer) > MAX_MESSAGE:
            self._drop(conn, f"sent a line over {MAX_MESSAGE} bytes")

    def _handle_line(self, conn: _Connection, line: bytes) -> bool:
        """Process one complete line; False once the connection was dropped."""
        if len(line) > MAX_MESSAGE:
            self._drop(conn, f"sent a line over {MAX_MESSAGE} bytes")
            return False
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            self._drop(conn, "sent something that is not a control message")
            return False
        if conn.agent is None and Elsewhere.KEY in message:  # another job's agent, looking for its own agent 0
            self._unregister(conn)
            self.log(f"control port {self.port}: {conn.peer} is an agent of another job ({message[Elsewhere.KEY]!s:.80}) "
                     "that looked here for its first node's agent (its ports and ours come from blocks that "
                     "coincide); closed it")
            return False
        if conn.agent is None:
            return self._authenticate(conn, message)
        if Beat.KEY not in message:
            self._deliver(Received(conn.agent, message))
        return True

    def _authenticate(self, conn: _Connection, hello: Message) -> bool:
        claimed = hello.pop("auth", None)
        agent = hello.get("agent")
        if not isinstance(claimed, str) or not hmac.compare_digest(claimed, proof(self.secret, conn.nonce, hello)):
            self._refuse(conn, "failed authentication (wrong or missing job secret)")
            return False
        if not isinstance(agent, int) or agent not in self.valid_agents:
            self._refuse(conn, f"claims agent id {agent!r}, which this job does not have")
            return False
        if agent in self._peers:
            self._refuse(conn, f"claims agent id {agent}, which is already connected")
            return False
        free = hello.get("free")
        known = Hello(agent, str(hello.get("node")), hello.get("ip"), hello.get("plan"),
                      [b for b in free if isinstance(b, int)] if isinstance(free, list) else None)
        conn.agent = agent
        self._peers[agent] = conn
        with self._changed:
            running = self._on_report is not None
            self._hellos[agent] = known
            self._changed.notify_all()
        if running:  # the job formed long ago: a dropped agent is back (agent.py decides)
            self._deliver(PeerJoined(agent, known))
        return True

    def _refuse(self, conn: _Connection, reason: str) -> None:
        try:
            conn.sock.sendall(encode(to_wire(Refused(reason))))
        except OSError:
            pass
        self._drop(conn, reason)

    def _expire(self, now: float) -> None:
        for key in list(self._selector.get_map().values()):
            conn = key.data
            if conn is None:
                continue
            if conn.agent is None and now > conn.deadline:
                self._drop(conn, f"did not authenticate within {HANDSHAKE_TIMEOUT:.0f} s")
            elif conn.agent is not None and now - conn.last_seen > self.heartbeat_timeout:
                self._lose(conn, now - conn.last_seen)

    def _lose(self, conn: _Connection, silent_for: float) -> None:
        agent = conn.agent
        self._unregister(conn)
        if agent is not None and self._peers.get(agent) is conn:
            del self._peers[agent]
            self._silenced.append(agent)
            self._deliver(PeerSilent(agent, round(silent_for, 1)))

    def _drop(self, conn: _Connection, reason: str | None) -> None:
        """Close ``conn``; a stranger gets one log line, a known agent a None message."""
        agent = conn.agent
        self._unregister(conn)
        if agent is None:
            self.log(f"control port {self.port}: connection from {conn.peer} {reason}; closed it")
        elif self._peers.get(agent) is conn:
            del self._peers[agent]
            if reason:
                self.log(f"control port {self.port}: agent {agent} ({conn.peer}) {reason}; closed it")
            self._deliver(PeerGone(agent))

    def _unregister(self, conn: _Connection) -> None:
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _send(self, agent: int, conn: _Connection, data: bytes) -> None:
        try:
            with self._send_lock:
                conn.sock.sendall(data)
        except OSError:
            # A peer that cannot take a few bytes within SEND_TIMEOUT is as good as gone;
            # the event loop reports it when it reads the closed socket.
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _deliver(self, report: PeerReport) -> None:
        with self._changed:
            callback = self._on_report
            if callback is None:
                self._held.append(report)
                return
        callback(report)


class ControlClient:
    """Every other agent's end: connects, proves the secret, keeps the heartbeat going."""

    def __init__(
        self,
        host: str,
        port: int,
        hello: Message,
        timeout: float,
        secret: bytes,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        refused_ends: bool = False,
        job: str = "",
        also_at: Sequence[int] = (),
    ) -> None:
        """``refused_ends``: a refused connection (nobody listens any more) fails at once, not at the deadline.

        ``job`` (`job_tag`) and ``also_at``: agent 0 may listen on ``port`` or on one of the
        ``also_at`` ports (the job moved to another port block); each is tried in turn until
        one greets with this ``job``. An agent 0 of another job is told so and left.
        """
        deadline = time.monotonic() + timeout
        ports = (port, *also_at)
        while True:
            refused = 0
            for candidate in ports:
                try:
                    greeting = self._greeted(host, candidate, deadline, job)
                except ConnectionRefusedError as exc:
                    refused += 1
                    failure: Exception = exc
                except ControlError as exc:  # another program holds this port: agent 0 is on another, if any
                    if not also_at:
                        raise
                    failure = exc
                except (OSError, ValueError) as exc:  # agent 0 may not listen yet: retry until the deadline
                    failure = exc
                else:
                    if greeting is not None:
                        self.port = candidate
                        break
                    failure = ControlError(f"another job's agent listens at {host}:{candidate}")
            else:
                if refused_ends and refused == len(ports):
                    raise ControlError(f"nothing listens at {host}:{port} any more (the job ended there)")
                if time.monotonic() > deadline:
                    where = f"{host}:{port}" + (f" (or ports {', '.join(map(str, also_at))})" if also_at else "")
                    raise ControlError(f"cannot reach the first node's agent at {where} within {timeout:.0f} s "
                                       f"({failure})") from None
                time.sleep(0.2)
                continue
            break
        self._sock.settimeout(heartbeat_timeout)
        self._lock = threading.Lock()
        self.heartbeat_timeout = heartbeat_timeout
        self.send({**hello, "auth": proof(secret, greeting[Nonce.KEY], hello)})
        self._closed = threading.Event()
        threading.Thread(target=self._beat, name="control-heartbeat", daemon=True).start()

    def _greeted(self, host: str, port: int, deadline: float, job: str) -> Message | None:
        """Connect to ``port``; agent 0's greeting, or None (and closed) when it runs another job."""
        self._sock = socket.create_connection((host, port), timeout=min(5.0, max(1.0, deadline - time.monotonic())))
        try:
            # Accepted by the kernel, maybe not yet by a busy agent 0: wait for its nonce
            # rather than reconnect (thousands of reconnects would only add to its load).
            self._sock.settimeout(max(1.0, min(GREETING_TIMEOUT, deadline - time.monotonic())))
            self._stream = self._sock.makefile("rb")
            greeting = json.loads(self._stream.readline(MAX_MESSAGE) or b"null")
            if not isinstance(greeting, dict) or not isinstance(greeting.get(Nonce.KEY), str):
                raise ControlError(f"{host}:{port} is not a keras_distrib agent (another program holds the port?)")
            if job and greeting.get("job", job) != job:
                self._sock.sendall(encode(to_wire(Elsewhere(job))))
                self._sock.close()
                return None
            return greeting
        except BaseException:
            self._sock.close()
            raise

    def _beat(self) -> None:
        while not self._closed.wait(self.heartbeat_timeout / 6):
            self.send(to_wire(Beat()))

    def receive(self) -> Message | None:
        """The next message from agent 0; None once it is gone or silent past the timeout.

        Raises ControlError when agent 0 refused this agent (wrong secret).
        """
        while True:
            try:
                line = self._stream.readline(MAX_MESSAGE)
                message = json.loads(line) if line else None
            except (OSError, ValueError):
                return None
            if message is None:
                return None
            if Refused.KEY in message:
                raise ControlError(f"the first node's agent refused this agent: {message[Refused.KEY]}")
            if Beat.KEY not in message:
                return message

    def send(self, message: Message) -> None:
        with self._lock:
            try:
                self._sock.sendall(encode(message))
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
