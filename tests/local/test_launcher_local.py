"""The launcher's lifecycle in local mode: exit codes, cleanup, failures, signals, start-up."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launcher_utils import (
    alive,
    launcher_env,
    listening_ports,
    meaningful,
    processes_with_env,
    start_local,
    wait_for,
)

CHIEF_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import keras_distrib
    info = keras_distrib.cluster()
    print("role", info.job, info.index, "workers", info.num_workers, "ps", info.num_ps, flush=True)
    mode = sys.argv[1]
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    def note(signum, frame):
        with open(sys.argv[2], "a") as fh:
            fh.write(signal.Signals(signum).name + "\\n")
        if signum == signal.SIGTERM:
            sys.exit(7)
    signal.signal(signal.SIGUSR1, note)
    signal.signal(signal.SIGTERM, note)
    open(sys.argv[2] + ".ready", "w").close()
    print("waiting", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("launcher")
    (path / "chief.py").write_text(CHIEF_SCRIPT)
    return path


def plan_ports(workdir: Path, nodes: int, port_base: int) -> set[int]:
    out = subprocess.run(
        [sys.executable, "-m", "keras_distrib.local", "--nodes", str(nodes), "--port-base", str(port_base), "--plan", "--format", "json"],
        cwd=workdir, env=launcher_env(), capture_output=True, text=True, check=True,
    )
    return {int(p["address"].rsplit(":", 1)[1]) for p in json.loads(out.stdout)["processes"]}


def test_exit_code_output_prefix_and_cleanup(workdir: Path) -> None:
    ports = plan_ports(workdir, 2, 24100)
    proc = start_local(["--nodes", "2", "--port-base", "24100", "chief.py", "exit", "3"], workdir)
    out, _ = proc.communicate(timeout=120)
    lines = meaningful(out)
    assert proc.returncode == 3, out
    assert "[local0 chief:0] role chief 0 workers 2 ps 2" in lines
    assert any("chief:0 on local0 finished with exit code 3" in line for line in lines)
    assert not listening_ports() & ports, "a port of the job is still listening"


def test_killed_worker_stops_the_job_with_one_line(workdir: Path) -> None:
    proc = start_local(["--nodes", "2", "--port-base", "24200", "--max-restarts", "0", "chief.py", "wait", str(workdir / "unused")], workdir)
    try:
        tasks = ("chief:0", "ps:0", "ps:1", "worker:0", "worker:1")

        def children_now() -> dict[str, list[int]]:
            return {t: alive(processes_with_env("KERAS_DISTRIB_TASK", t, proc.pid)) for t in tasks}

        # The agent starts all five at once; wait until each has exec'd with its own env.
        assert wait_for(lambda: all(children_now().values()), 90), "the job's processes never all started"
        children = children_now()
        servers = children["worker:1"]
        assert len(servers) == 1
        killed_at = time.monotonic()
        subprocess.run(["kill", "-9", str(servers[0])], check=True)
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    errors = [line for line in meaningful(out) if "error:" in line]
    assert errors == ["[local0 agent] keras_distrib: error: worker:1 on local1 exited unexpectedly with signal 9 (SIGKILL); stopping the job."], out
    assert proc.returncode == 128 + 9
    assert took < 20
    assert not alive([pid for pids in children.values() for pid in pids])


def test_signals_are_forwarded_and_end_the_job(workdir: Path) -> None:
    notes = workdir / "signals.txt"
    proc = start_local(["--nodes", "1", "--port-base", "24300", "chief.py", "wait", str(notes)], workdir)
    try:
        assert wait_for(Path(f"{notes}.ready").exists, 90), "the chief never installed its handlers"
        # The servers ignore SIGUSR1 once their main() runs: wait until they listen.
        assert wait_for(lambda: plan_ports(workdir, 1, 24300) - {24300} <= listening_ports(proc.pid), 90)
        proc.send_signal(signal.SIGUSR1)
        assert wait_for(lambda: notes.exists() and "SIGUSR1" in notes.read_text(), 20)
        servers = alive(processes_with_env("KERAS_DISTRIB_TASK", "ps:0", proc.pid))
        assert servers, "SIGUSR1 must not kill the TF servers"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert notes.read_text().split() == ["SIGUSR1", "SIGTERM"]
    assert proc.returncode == 7, out
    assert not alive(servers)


def test_missing_agent_is_named_after_the_startup_timeout(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("job_id: '77'\nhosts: [localhost, ghost-node]\n")
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "keras_distrib", "--startup-timeout", "2", "--port-base", "24400", "--check"],
        cwd=tmp_path, env=launcher_env(KERAS_DISTRIB_HOSTS_FILE=str(hosts), KERAS_DISTRIB_RANK="0"),
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert "agents on ghost-node did not connect" in out.stderr and "HINT:" in out.stderr
    assert time.monotonic() - started < 30


def test_unreachable_first_node_is_named(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("job_id: '78'\nhosts: [localhost, other]\n")
    out = subprocess.run(
        [sys.executable, "-m", "keras_distrib", "--startup-timeout", "2", "--port-base", "24500", "--check"],
        cwd=tmp_path, env=launcher_env(KERAS_DISTRIB_HOSTS_FILE=str(hosts), KERAS_DISTRIB_RANK="1"),
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert "cannot reach the first node's agent at localhost:24503" in out.stderr


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--nodes", "2", "missing_script.py"], "SCRIPT 'missing_script.py' does not exist"),
        (["--nodes", "2", "--protocol", "grpc+verbs", "--check"], "GRPC_SERVER"),
        (["--nodes", "2", "--interface", "nosuch0", "--check"], "--interface 'nosuch0' does not exist"),
    ],
)
def test_bad_requests_fail_before_starting_anything(tmp_path: Path, args: list[str], expected: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "keras_distrib.local", *args],
        cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr and "HINT:" in out.stderr
    assert "Traceback" not in out.stderr
    assert "serving" not in out.stdout


def test_ctrl_c_works_when_the_launcher_inherited_ignore_sigint(tmp_path: Path) -> None:
    """`launcher &` from a script ignores SIGINT; the children must still get it (issue 14)."""
    (tmp_path / "long.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_distrib.local", "--nodes", "1", "--port-base", "24900", "long.py"],
        cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "started" in line:
                break
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + out
    assert proc.returncode == 130, out
    assert "[local0 chief:0] interrupted (KeyboardInterrupt)" in out and "Traceback" not in out
    assert "absl::InitializeLog" not in out and "oneDNN" not in out  # banners filtered


@pytest.mark.parametrize("log_dir", [None, "elsewhere/logs"])
def test_every_process_output_is_kept_in_the_log_dir(tmp_path: Path, log_dir: str | None) -> None:
    """allreduce worker 1 is quiet on the console, but its print is in its file (no TensorFlow: a plain script)."""
    (tmp_path / "hello.py").write_text(textwrap.dedent("""
        import os, sys
        print("print from", os.environ["KERAS_DISTRIB_TASK"])
        print("to stderr", file=sys.stderr)
    """))
    args = ["--nodes", "2", "--layout", "allreduce", *(["--log-dir", log_dir] if log_dir else []), "hello.py"]
    proc = start_local(args, tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    lines = meaningful(out)
    assert "[local0 worker:0] print from worker:0" in lines and not any("print from worker:1" in line for line in lines)
    folder = tmp_path / (log_dir or "keras_distrib-logs") / f"local-{proc.pid}"
    assert lines[-1] == f"[local0 agent] keras_distrib: the full output of every process is in {folder}", out
    for index in (0, 1):
        text = (folder / f"worker-{index}.log").read_text()
        assert f"print from worker:{index}\nto stderr\n" in text
        assert text.rstrip().endswith(f"--- worker:{index} on local{index} ended with exit code 0")
    assert "the full output of every process is in" in (folder / "agent-0.log").read_text()


UNPORTED = "import sys\nprint('trained alone', sys.argv[1:], flush=True)\n"
UNPORTED_LINE = "SCRIPT never called keras_distrib (strategy(), distribution(), cluster() or fit())"


@pytest.mark.parametrize("layout, what", [
    ("ps-per-node", "it trained in chief:0 alone while ps:0, worker:0, ps:1, worker:1 stayed idle"),
    ("allreduce", "each of the 2 processes ran it alone, on all the data, without the others"),
])
def test_a_script_that_never_calls_keras_distrib_is_named(workdir: Path, layout: str, what: str) -> None:
    """Issue 30: a single-process script launched unchanged ends well, with one line saying
    that the other processes were idle (or each worker trained alone) and a HINT."""
    (workdir / "unported.py").write_text(UNPORTED)
    proc = start_local(["--nodes", "2", "--layout", layout, "unported.py", "x"], workdir)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    lines = [line for line in meaningful(out) if UNPORTED_LINE in line]
    assert len(lines) == 1, out
    assert lines[0].startswith("[local0 agent] keras_distrib: warning: "), lines[0]
    assert what in lines[0] and "HINT: port it as docs/porting.md shows" in lines[0], lines[0]


def test_a_script_that_calls_keras_distrib_is_not_named(workdir: Path) -> None:
    proc = start_local(["--nodes", "2", "chief.py", "exit", "0"], workdir)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "[local0 chief:0] role chief 0 workers 2 ps 2" in out
    assert UNPORTED_LINE not in out


@pytest.mark.parametrize("layout, setup, framework", [
    ("ps-per-node", "strategy", "TensorFlow"),
    ("allreduce", "strategy", "TensorFlow"),
    ("jax", "distribution", "JAX"),
])
def test_gpus_planned_but_not_seen_are_one_line_or_exit_2(workdir: Path, layout: str, setup: str,
                                                          framework: str) -> None:
    """A GPU allocation (2 GPUs per node) on this machine, whose TensorFlow and JAX see none:
    the job says so in one line and trains on; --require-gpus stops it with exit code 2, no restart."""
    gpu_line = f"the scheduler gave this process 2 GPU(s) but {framework} sees 0"
    (workdir / f"gpu_{setup}.py").write_text(textwrap.dedent(
        f"""
        import keras_distrib
        keras_distrib.{setup}()
        print("trained", flush=True)
        """))
    base = ["--nodes", "2", "--gpus-per-node", "0,1", "--layout", layout]
    env = {"KERAS_BACKEND": "jax"} if framework == "JAX" else {}
    proc = start_local([*base, f"gpu_{setup}.py"], workdir, **env)
    out, _ = proc.communicate(timeout=180)
    lines = [line for line in meaningful(out) if gpu_line in line]
    assert proc.returncode == 0 and "trained" in out, out
    assert len(lines) == 1 and "warning: " in lines[0] and "HINT: " in lines[0], out
    proc = start_local([*base, "--require-gpus", "--max-restarts", "3", f"gpu_{setup}.py"], workdir, **env)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2, out
    assert any(gpu_line in line and "error: " in line for line in meaningful(out)), out
    assert "trained" not in out and "restarting" not in out, out
