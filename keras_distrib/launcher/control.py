"""The agents' control channel: newline-delimited JSON over one TCP port on the first node.

Agent 0 (on the chief's node) listens; every other agent connects once at start-up.
Through it the agents form the job (a barrier that names missing nodes), share
interface addresses, report a failed or finished process, and receive the order to stop.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

Message = dict[str, Any]


class ControlError(RuntimeError):
    """The job could not form, or an agent was lost."""


def _send(sock: socket.socket, message: Message) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _lines(sock: socket.socket) -> Any:
    """Yield decoded messages until the peer closes the connection."""
    with sock.makefile("rb") as stream:
        for line in stream:
            yield json.loads(line)


class ControlServer:
    """Agent 0's end: accepts the other agents, then relays messages both ways."""

    def __init__(self, port: int, expected: int, bind: str = "") -> None:
        self.expected = expected
        self._peers: dict[int, socket.socket] = {}
        self._hellos: dict[int, Message] = {}
        self._lock = threading.Lock()
        self._listener = socket.create_server((bind, port), reuse_port=False)
        self.port = port

    def gather(self, timeout: float, names: dict[int, str]) -> dict[int, Message]:
        """Wait until every other agent said hello; name the missing ones on timeout."""
        deadline = time.monotonic() + timeout
        while len(self._hellos) < self.expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(names) - set(self._hellos))
                raise ControlError(
                    f"agents on {', '.join(names[m] for m in missing)} did not connect to this node's "
                    f"control port {self.port} within {timeout:.0f} s"
                )
            self._listener.settimeout(min(remaining, 1.0))
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(10)
            try:
                hello = json.loads(sock.makefile("rb").readline())
            except (OSError, ValueError):
                sock.close()
                continue
            sock.settimeout(None)
            self._peers[hello["agent"]] = sock
            self._hellos[hello["agent"]] = hello
        return dict(self._hellos)

    def listen(self, on_message: Callable[[int, Message | None], None]) -> None:
        """Deliver each peer's messages (None when it disconnects) from background threads."""
        for agent, sock in self._peers.items():
            def read(agent: int = agent, sock: socket.socket = sock) -> None:
                try:
                    for message in _lines(sock):
                        on_message(agent, message)
                except (OSError, ValueError):
                    pass
                on_message(agent, None)

            threading.Thread(target=read, name=f"control-{agent}", daemon=True).start()

    def broadcast(self, message: Message) -> None:
        with self._lock:
            for sock in self._peers.values():
                try:
                    _send(sock, message)
                except OSError:
                    pass

    def close(self) -> None:
        for sock in self._peers.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._listener.close()


class ControlClient:
    """Every other agent's end."""

    def __init__(self, host: str, port: int, hello: Message, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last_error: OSError | None = None
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError as exc:  # agent 0 may not listen yet: retry until the deadline
                last_error = exc
                if time.monotonic() > deadline:
                    raise ControlError(
                        f"cannot reach the first node's agent at {host}:{port} within {timeout:.0f} s ({last_error})"
                    ) from None
                time.sleep(0.2)
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        _send(self._sock, hello)
        self._messages = _lines(self._sock)

    def receive(self) -> Message | None:
        """The next message from agent 0, or None once it is gone."""
        try:
            return next(self._messages)
        except (StopIteration, OSError, ValueError):
            return None

    def send(self, message: Message) -> None:
        with self._lock:
            try:
                _send(self._sock, message)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

