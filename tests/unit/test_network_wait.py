"""keras_distrib/network.py `wait_reachable`: a poll that ends when its caller has ended.

An agent's start-up watch (launcher/agent.py `_watch_startup`) polled in its own thread until
the start-up timeout, long after its agent had returned; in the unit tests such threads were
still in ``getaddrinfo`` when a test process crashed with a segmentation fault."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from keras_distrib.network import wait_reachable

pytestmark = pytest.mark.unit


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed once returned: nobody listens


def test_a_set_stop_ends_the_poll_and_names_what_never_listened() -> None:
    stop = threading.Event()
    address = closed_port()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    assert wait_reachable([address], timeout=60.0, stop=stop) == [address]
    assert time.monotonic() - started < 30.0  # the stop, not the 60 s timeout, ended it


def test_without_a_stop_the_timeout_ends_it_and_a_listener_is_found() -> None:
    address = closed_port()
    assert wait_reachable([address], timeout=0.5) == [address]
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        listening = f"127.0.0.1:{server.getsockname()[1]}"
        assert wait_reachable([listening, address], timeout=0.5) == [address]
