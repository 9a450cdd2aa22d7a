"""The agent-to-child contract: the plan file, TF_CONFIG only when it fits, the readers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_parsers import JobInfo
from keras_distrib import contract
from keras_distrib.launcher.children import OutputFilter, child_env, spawn
from keras_distrib.plan import build_plan
from keras_distrib.strategies import cluster

pytestmark = pytest.mark.unit


def job_of(nodes: int) -> JobInfo:
    return JobInfo("slurm", "4242", tuple(f"node{i:05d}" for i in range(nodes)), (1,) * nodes,
                   node_gpus=tuple(("0",) for _ in range(nodes)))


def env_for(nodes: int, layout: str, task: tuple[str, int], tmp_path: Path) -> dict[str, str]:
    """What the agent gives one child of an N-node job (the agent's own code path)."""
    plan = build_plan(job_of(nodes), layout)
    data = plan.to_json()
    path = contract.write_plan_file(json.dumps(data), str(tmp_path))
    variables = contract.child_variables(path, task, "node00000", layout, "grpc", 60.0,
                                         contract.tf_config_json(data["cluster"], *task))
    proc = plan.find(*task)
    return child_env({"PATH": "/usr/bin", "TF_CONFIG": "stale"}, variables, proc)


@pytest.mark.parametrize("layout", ["ps-per-node", "worker-per-gpu", "allreduce"])
@pytest.mark.parametrize("nodes", [1, 3, 700, 10_000])
def test_cluster_reads_the_plan_file_at_any_size(nodes: int, layout: str, tmp_path: Path) -> None:
    task = ("worker", 1 if nodes > 1 else 0)
    env = env_for(nodes, layout, task, tmp_path)
    # Every variable must pass exec: Linux refuses a NAME=value string over 128 KiB.
    assert max(len(k) + len(v) + 2 for k, v in env.items()) <= 131_072
    info = cluster(env)
    assert (info.job, info.index, info.layout) == (*task, layout)
    assert info.num_workers == (nodes if layout != "worker-per-gpu" else nodes)
    assert contract.read_task(env) == task
    assert contract.read_tf_cluster(env) == info.plan.cluster_spec()
    if "TF_CONFIG" in env:
        assert json.loads(env["TF_CONFIG"]) == {"cluster": info.plan.cluster_spec(), "task": {"type": task[0], "index": task[1]}}
    else:
        assert nodes == 10_000  # the legacy variable goes only where it cannot fit


def test_tf_config_is_set_exactly_while_it_fits(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    fits = "x" * contract.TF_CONFIG_LIMIT
    assert contract.child_variables(path, ("ps", 0), "n", "allreduce", "grpc", 1, fits)["TF_CONFIG"] == fits
    assert "TF_CONFIG" not in contract.child_variables(path, ("ps", 0), "n", "allreduce", "grpc", 1, fits + "x")


def test_hand_written_tf_config_still_works() -> None:
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}})}
    info = cluster(env)
    assert (info.job, info.index, info.num_workers, info.layout) == ("worker", 1, 2, "allreduce")


def test_plan_file_is_private_and_removed(tmp_path: Path) -> None:
    path = contract.write_plan_file('{"a": 1}', str(tmp_path))
    assert json.loads(path.read_text()) == {"a": 1}
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    contract.remove_plan_file(path)
    assert not path.parent.exists()


def test_log_level_quiet_by_default_but_user_and_verbose_win(tmp_path: Path) -> None:
    proc = build_plan(job_of(1), "allreduce").processes[0]
    assert child_env({}, {}, proc)["TF_CPP_MIN_LOG_LEVEL"] == "2"
    assert child_env({"TF_CPP_MIN_LOG_LEVEL": "0"}, {}, proc)["TF_CPP_MIN_LOG_LEVEL"] == "0"
    assert "TF_CPP_MIN_LOG_LEVEL" not in child_env({}, {}, proc, verbose=True)


# Lines measured from a TF 2.21 server start with TF_CPP_MIN_LOG_LEVEL=2 (CPU-only machine).
BANNERS = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    b"I0000 00:00:1795434093.039909    8520 port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results.\n",
    b"I0000 00:00:1795434093.040208    8520 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.\n",
]
CUINIT = b"E0000 00:00:1795434096.468493    8520 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n"
PORT_ERROR = b"E0000 00:00:1795434096.468493    8520 server_chttp2.cc:40] Failed to add port to server\n"


def shown(output: OutputFilter, lines: list[bytes]) -> list[bytes]:
    return [s for line in lines for s in output.feed(line)] + output.flush()


def test_banners_hidden_errors_kept_and_verbose_shows_all() -> None:
    lines = [*BANNERS, CUINIT, b"Epoch 1/3\n", PORT_ERROR]
    assert shown(OutputFilter(), lines) == [b"Epoch 1/3\n", PORT_ERROR]
    assert shown(OutputFilter(has_gpus=True), lines) == [CUINIT, b"Epoch 1/3\n", PORT_ERROR]
    assert shown(OutputFilter(banners=True), lines) == lines


def test_ctrl_c_traceback_becomes_one_line_other_tracebacks_stay() -> None:
    interrupted = [b"Traceback (most recent call last):\n", b'  File "x.py", line 3, in <module>\n',
                   b"    time.sleep(9)\n", b"KeyboardInterrupt\n"]
    assert shown(OutputFilter(), [b"a\n", *interrupted, b"b\n"]) == [b"a\n", b"interrupted (KeyboardInterrupt)\n", b"b\n"]
    failing = interrupted[:3] + [b"ValueError: bad\n"]
    assert shown(OutputFilter(), failing) == failing
    assert shown(OutputFilter(), failing[:2]) == failing[:2]  # an unfinished traceback is flushed
    # Seen with Ctrl-C inside Keras: a frame without its source line leaves a blank line.
    blank = interrupted[:2] + [b'  File "base.py", line 120, in _after_train_epoch\n', b"    def f(self):\n", b"\n",
                               b"KeyboardInterrupt\n"]
    assert shown(OutputFilter(), blank) == [b"interrupted (KeyboardInterrupt)\n"]


def test_quiet_child_shows_nothing_but_keeps_its_tail() -> None:
    output = OutputFilter(quiet=True)
    assert shown(output, [f"line {i}\n".encode() for i in range(100)]) == []
    assert list(output.tail)[-1] == b"line 99\n" and len(output.tail) < 100


def _spawned_output(python_code: str, tmp_path: Path, **filter_args: bool) -> tuple[bytes, int]:
    """Run ``python -c CODE`` through the agent's spawn(), return its shown output and exit code."""
    import io
    import queue

    proc = build_plan(job_of(1), "allreduce").processes[0]
    sink, done = io.BytesIO(), queue.SimpleQueue()
    spawn(proc, [sys.executable, "-c", python_code], dict(os.environ), True, lambda c, code: done.put(code),
          out=sink, output=OutputFilter(**filter_args))
    code = done.get(timeout=60)
    return sink.getvalue(), code


def test_children_start_with_default_signal_dispositions(tmp_path: Path) -> None:
    """A launcher started with `&` from a script ignores SIGINT; its children must not."""
    code = "print([l for l in open('/proc/self/status') if l.startswith(('SigIgn', 'SigBlk'))])"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    try:
        out, rc = _spawned_output(code, tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    assert rc == 0
    fields = dict(part.split(":\\t") for part in out.decode().split("] ", 1)[1].strip("[]\n").replace("'", "").replace("\\n", "").split(", "))
    ignored, blocked = int(fields["SigIgn"], 16), int(fields["SigBlk"], 16)
    for sig in (signal.SIGINT, signal.SIGTERM):
        assert not ignored & (1 << (sig - 1)), f"{sig.name} ignored in the child"
        assert not blocked & (1 << (sig - 1)), f"{sig.name} blocked in the child"


def test_a_quiet_child_that_fails_shows_its_last_lines(tmp_path: Path) -> None:
    out, rc = _spawned_output("import sys; print('hidden 1'); print('the reason'); sys.exit(3)", tmp_path, quiet=True)
    assert rc == 3
    text = out.decode()
    assert "failed with exit code 3; its last lines:" in text and text.rstrip().endswith("the reason")
    out, rc = _spawned_output("print('fine')", tmp_path, quiet=True)
    assert (out, rc) == (b"", 0)


def test_a_child_on_one_cpu_gets_two_interop_threads() -> None:
    # One inter-op thread deadlocks the ps layouts (no step in 300 s under taskset -c 1).
    proc = build_plan(job_of(1), "ps-per-node").processes[0]
    assert child_env({}, {}, proc, cpus=1)["TF_NUM_INTEROP_THREADS"] == "2"
    assert child_env({"TF_NUM_INTEROP_THREADS": "8"}, {}, proc, cpus=1)["TF_NUM_INTEROP_THREADS"] == "8"
    assert "TF_NUM_INTEROP_THREADS" not in child_env({}, {}, proc, cpus=2)
