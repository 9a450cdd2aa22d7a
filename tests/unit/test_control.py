"""The control channel: formation, the job secret, a fuzzing client, heartbeats."""

from __future__ import annotations

import json
import os
import queue
import random
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from keras_distrib.launcher import control
from keras_distrib.launcher.messages import Hello, PeerGone, PeerJoined, PeerSilent

pytestmark = pytest.mark.unit
SECRET = b"s3cret"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Job:
    """A control server plus ``agents`` real clients, formed; messages land in ``inbox``."""

    def __init__(self, agents: int, heartbeat_timeout: float = 30.0) -> None:
        self.port = free_port()
        self.logs: list[str] = []
        self.server = control.ControlServer(self.port, agents, SECRET, bind="127.0.0.1", log=self.logs.append,
                                            heartbeat_timeout=heartbeat_timeout)
        self.clients: dict[int, control.ControlClient] = {}

        def join(agent: int) -> None:
            self.clients[agent] = control.ControlClient("127.0.0.1", self.port, {"agent": agent, "node": f"n{agent}"},
                                                        10, SECRET, heartbeat_timeout)

        threads = [threading.Thread(target=join, args=(a,)) for a in range(1, agents + 1)]
        for t in threads:
            t.start()
        self.hellos = self.server.gather(10, {a: f"n{a}" for a in range(1, agents + 1)})
        for t in threads:
            t.join()
        self.inbox: queue.SimpleQueue[tuple[int, object]] = queue.SimpleQueue()
        self.server.listen(self.inbox.put)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.server.close()


def test_agents_form_and_messages_flow_both_ways() -> None:
    job = Job(3)
    try:
        assert sorted(job.hellos) == [1, 2, 3] and job.hellos[2].node == "n2"
        job.server.broadcast({"start": {"hosts": {"n1": "10.0.0.1"}}})
        assert all(c.receive() == {"start": {"hosts": {"n1": "10.0.0.1"}}} for c in job.clients.values())
        job.clients[2].send({"done": 2, "code": 0})
        assert job.inbox.get(timeout=5) == control.Received(2, {"done": 2, "code": 0})
    finally:
        job.close()


def test_missing_agents_are_named_first_few_with_the_count() -> None:
    port = free_port()
    server = control.ControlServer(port, 500, SECRET, bind="127.0.0.1", log=lambda _l: None)
    try:
        with pytest.raises(control.ControlError) as err:
            server.gather(0.5, {a: f"node{a:04d}" for a in range(1, 501)})
    finally:
        server.close()
    text = str(err.value)
    assert "node0001, node0002" in text and "and 490 more (500 in all)" in text and "node0500" not in text


def test_wrong_secret_is_refused_with_a_reason() -> None:
    port = free_port()
    logs: list[str] = []
    server = control.ControlServer(port, 1, SECRET, bind="127.0.0.1", log=logs.append)
    try:
        client = control.ControlClient("127.0.0.1", port, {"agent": 1, "node": "n1"}, 5, b"guess")
        with pytest.raises(control.ControlError, match="refused this agent: failed authentication"):
            client.receive()
        with pytest.raises(control.ControlError):
            server.gather(0.3, {1: "n1"})
    finally:
        server.close()
    assert len(logs) == 1 and "failed authentication" in logs[0]


def _stranger(port: int, payload: bytes | None, hold: float = 0.0) -> None:
    """Connect, read the greeting, send ``payload`` (None: send nothing), wait, close."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        if payload:
            try:
                sock.sendall(payload)
            except OSError:
                pass  # the server may close an oversized sender before it finishes
        time.sleep(hold)


def test_fuzzing_client_neither_stops_nor_stalls_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "HANDSHAKE_TIMEOUT", 1.0)
    rng = random.Random(11)
    job = Job(2)
    try:
        port = job.port
        forged = {"agent": 1, "node": "n1", "auth": "0" * 64}
        attacks: list[tuple[bytes | None, float]] = [
            (None, 0.0),                                            # a port scan: connect, close
            (b"GET / HTTP/1.0\r\n\r\n", 0.2),                        # another protocol
            (bytes(rng.randrange(256) for _ in range(3000)) + b"\n", 0.2),  # random bytes
            (b"[1, 2, 3]\n", 0.2),                                   # JSON, not a message
            (json.dumps(forged).encode() + b"\n", 0.2),             # a forged agent
            (b"{" + b'"x": "' + b"a" * (control.MAX_MESSAGE + 10), 0.5),  # oversized, no newline
            (None, 2.5),                                            # a slow sender: says nothing
            (b'{"agent": 1', 2.5),                                  # half a hello, then silence
        ]
        threads = [threading.Thread(target=_stranger, args=(port, p, h)) for p, h in attacks]
        for t in threads:
            t.start()
        # The job goes on meanwhile: messages both ways, promptly.
        for round_ in range(5):
            job.clients[1].send({"progress": round_})
            assert job.inbox.get(timeout=5) == control.Received(1, {"progress": round_})
            job.server.broadcast({"tick": round_})
            assert job.clients[2].receive() == {"tick": round_}
        for t in threads:
            t.join(timeout=30)
        deadline = time.monotonic() + 10
        while len(job.logs) < len(attacks) and time.monotonic() < deadline:
            time.sleep(0.1)
        # One line per stranger, nothing about the real agents.
        assert len(job.logs) == len(attacks), job.logs
        assert all("connection from 127.0.0.1:" in line for line in job.logs), job.logs
        reasons = " | ".join(job.logs)
        for reason in ("closed the connection before authenticating", "not a control message",
                       "failed authentication", f"over {control.MAX_MESSAGE} bytes", "did not authenticate within 1 s"):
            assert reason in reasons
        job.clients[2].send({"done": 2, "code": 0})
        assert job.inbox.get(timeout=5) == control.Received(2, {"done": 2, "code": 0})
        assert job.inbox.empty()
    finally:
        job.close()


def test_a_port_scan_that_resets_gets_one_line_each() -> None:
    """Connections reset at once (SO_LINGER 0, as scanners do): whether the reset comes
    before the agent's greeting or after, each one is one log line (a real Slurm run lost
    the line of a scan whose reset broke the greeting)."""
    import socket
    import struct

    job = Job(2)
    try:
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", job.port), timeout=5)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        deadline = time.monotonic() + 10
        while len(job.logs) < 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        assert len(job.logs) == 20, job.logs
        assert all("closed the connection before authenticating" in line for line in job.logs), job.logs
    finally:
        job.close()


def test_a_stranger_still_connected_when_the_job_ends_gets_its_line() -> None:
    """A half-sent hello held open past the end of a short job: one line at close, as every
    other stranger gets (a real Slurm run ended before the handshake timeout and lost it)."""
    import socket

    job = Job(1)
    sock = socket.create_connection(("127.0.0.1", job.port), timeout=5)
    try:
        sock.sendall(b'{"agent": 1')
        time.sleep(0.5)
        assert job.logs == []
        job.close()
        assert len(job.logs) == 1 and "had not authenticated when the job ended; closed it" in job.logs[0], job.logs
    finally:
        sock.close()


def test_a_silent_agent_is_lost_within_the_heartbeat_timeout() -> None:
    """A dead node closes nothing: its agent just goes silent (here: it stops beating)."""
    job = Job(2, heartbeat_timeout=1.2)
    try:
        frozen = job.clients[2]
        frozen._closed.set()  # no more heartbeats, socket left open, as a powered-off node
        started = time.monotonic()
        report = job.inbox.get(timeout=10)
        assert isinstance(report, PeerSilent) and report.agent == 2
        assert time.monotonic() - started < 6
        # the live agent is not lost meanwhile
        time.sleep(1.5)
        assert job.inbox.empty()
    finally:
        job.close()


def test_a_client_notices_a_silent_first_node() -> None:
    """Agent 0's node dies: its socket stays open but no heartbeat comes."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        accepted: list[socket.socket] = []

        def serve() -> None:
            sock, _ = listener.accept()
            sock.sendall(control.encode({"nonce": "n"}))
            accepted.append(sock)

        threading.Thread(target=serve).start()
        client = control.ControlClient("127.0.0.1", port, {"agent": 1}, 5, SECRET, heartbeat_timeout=1.0)
        started = time.monotonic()
        assert client.receive() is None
        assert 0.5 < time.monotonic() - started < 6
        client.close()
        for sock in accepted:
            sock.close()


def test_job_secret_file_is_private_and_shared_by_racing_agents(tmp_path: Path) -> None:
    results: list[tuple[bytes, Path | None]] = []
    threads = [threading.Thread(target=lambda: results.append(control.job_secret("slurm", "42", {}, tmp_path)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secrets_seen = {r[0] for r in results}
    assert len(secrets_seen) == 1 and len(next(iter(secrets_seen))) == 64
    path = results[0][1]
    assert path is not None and path.parent.name == control.SECRET_DIR
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert sorted(os.listdir(path.parent)) == [path.name]  # no temporary file left behind
    assert control.job_secret("slurm", "43", {}, tmp_path)[0] != secrets_seen.pop()
    assert control.job_secret("slurm", "42", {control.SECRET_VAR: "given"}, tmp_path) == (b"given", None)


@pytest.mark.parametrize("count, expected", [(1, "a0"), (3, "a0, a1, a2"), (12, "a0, a1, a2, ... and 9 more (12 in all)")])
def test_first_few(count: int, expected: str) -> None:
    assert control.first_few((f"a{i}" for i in range(count)), limit=3) == expected


def test_an_agent_that_connects_again_is_delivered_as_joined_and_refused_while_still_held() -> None:
    job = Job(2)
    try:
        hello = {"agent": 2, "node": "n2", "plan": "abc"}
        again = control.ControlClient("127.0.0.1", job.port, hello, 10, SECRET)
        # agent 2's first connection is still held: the second one is refused, not joined
        with pytest.raises(control.ControlError, match="already connected"):
            again.receive()
        again.close()
        job.clients.pop(2).close()
        assert job.inbox.get(timeout=5) == PeerGone(2)  # the first connection ended
        back = control.ControlClient("127.0.0.1", job.port, hello, 10, SECRET)
        job.clients[2] = back
        assert job.inbox.get(timeout=5) == PeerJoined(2, Hello(2, "n2", None, "abc"))
        job.server.broadcast({"stop": 0})
        assert back.receive() == {"stop": 0}
    finally:
        job.close()


def test_a_client_that_may_not_wait_fails_at_once_when_nothing_listens() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(control.ControlError, match="nothing listens"):
        control.ControlClient("127.0.0.1", port, {"agent": 1, "node": "n1"}, 30, SECRET, refused_ends=True)
    assert time.monotonic() - started < 5


def test_agent_0_waits_for_the_other_agents_to_disconnect_after_a_stop_at_most_its_linger() -> None:
    """Agent 0 ending first could end the job script while an agent (one started with --join
    runs in a scheduler step of its own) still stops its processes: after broadcasting Stop,
    `LeaderChannel.close` waits for every agent to disconnect, but no longer than ``linger``,
    and returns the agents that did not (none here)."""
    from keras_distrib.launcher.formation import LeaderChannel
    from keras_distrib.launcher.messages import Stop

    job = Job(2)
    try:
        assert job.server.wait_until_alone(0.2) == (1, 2)  # both connected
        job.clients[1].close()
        threading.Timer(0.5, job.clients[2].close).start()
        channel = LeaderChannel(job.server, None, linger=10.0)
        channel.to_all(Stop(0))
        started = time.monotonic()
        assert channel.close() == ()
        assert 0.3 < time.monotonic() - started < 5.0  # waited for agent 2, not for the whole linger
    finally:
        job.close()


@pytest.mark.parametrize("agents, cut_off, linger, heartbeat", [
    (1, (1,), 0.5, 30.0),     # still connected when the linger ends (the heartbeat timeout is longer)
    (3, (2,), 4.0, 1.2),      # lost to silence during the linger (a node cut off as training ended)
    (3, (1, 3), 4.0, 1.2),    # two of three
])
def test_agents_that_do_not_acknowledge_the_stop_are_returned(
        agents: int, cut_off: tuple[int, ...], linger: float, heartbeat: float) -> None:
    """A node cut off as training ends closes nothing: its agent neither disconnects nor is
    noticed before the job ends. `LeaderChannel.close` names it, so agent 0 can say so and end
    the step instead of leaving srun waiting until the scheduler gives the node up."""
    from keras_distrib.launcher.formation import LeaderChannel
    from keras_distrib.launcher.messages import Stop

    job = Job(agents, heartbeat_timeout=heartbeat)
    try:
        for agent, client in job.clients.items():
            if agent in cut_off:
                client._closed.set()  # no more heartbeats, the socket left open: a cut link
            else:
                threading.Timer(0.3, client.close).start()
        channel = LeaderChannel(job.server, None, linger=linger)
        channel.to_all(Stop(0))
        started = time.monotonic()
        assert channel.close() == cut_off
        assert time.monotonic() - started < linger + 2.0  # at most the linger
    finally:
        job.close()
