"""The SGE job template (scripts/sge/ps-per-node.sge) on a real 3-host Son of Grid Engine cluster.

Jobs go through ``qsub`` in the head namespace exactly as a user would submit them; the
template starts one agent per host with ``qrsh -inherit``. SGE picks the job's master host
(the chief's host, first line of PE_HOSTFILE) itself, so the tests read the hosts from the
output instead of assuming n1. TensorFlow takes seconds to import per process on a small
machine: few jobs, generous timeouts, no timed assertions.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from sge_cluster import PE_NAME, SgeTestCluster

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "scripts" / "sge" / "ps-per-node.sge"
DIGITS = REPO / "examples" / "digits_distrib.py"
NODES = ["n1", "n2", "n3"]
TIMEOUT = 600  # per job, a hang bound: seven TensorFlow processes share two (busy) cores
# TensorFlow's C++ start-up chatter, prefixed by the launcher.
NOISE = re.compile(r"^\[[^\]]+\] ([IWE]\d{4} |WARNING: All log messages)")
PREFIX = re.compile(r"^\[(n\d) ([a-z]+(?::\d+)?)\] ")

# Debian's SGE runs jobs as login shells (PATH reset): the template's PYTHON hook
# points at this wrapper so jobs use the test's interpreter.
PYTHON_WRAPPER = f"""#!/bin/sh
exec {sys.executable} "$@"
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A submit directory (the filesystem is shared by all hosts) with the python wrapper."""
    path = tmp_path_factory.mktemp("sge-jobs")
    wrapper = path / "python"
    wrapper.write_text(PYTHON_WRAPPER)
    wrapper.chmod(0o755)
    return path


def submit(cluster: SgeTestCluster, work: Path, name: str, args: list[str]) -> tuple[int, Path]:
    """qsub the template (3 slots of PE mpi: one host each) with the script args; return (job, output)."""
    out = work / f"{name}.out"
    p = cluster.head(["qsub", "-terse", "-o", str(out), str(TEMPLATE), *args], cwd=work,
                     env={"PYTHON": str(work / "python")}, timeout=60)
    assert p.returncode == 0, p.stderr + p.stdout
    return int(p.stdout.strip()), out


def meaningful(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip() and not NOISE.match(line)]


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "keras_distrib: error:" in line]


def roles(lines: list[str]) -> dict[str, str]:
    """Each task (chief:0, ps:1, worker:2 ...) and the host its output lines came from."""
    found = {}
    for line in lines:
        if m := PREFIX.match(line):
            if m.group(2) != "agent":
                found[m.group(2)] = m.group(1)
    return found


def assert_nothing_left(cluster: SgeTestCluster, wait: float = 15) -> None:
    """No launcher or training process and no listening port but sge_execd's on any host.

    The execd may still be reaping the job's tasks for a moment after qstat lost the job.
    """
    procs, ports = cluster.leftovers(r"keras_distrib|digits_distrib", wait)
    assert procs == [], f"processes left behind: {procs}"
    assert ports == {n: [] for n in NODES}, "listening ports left behind"


def wait_for_line(path: Path, pattern: str, timeout: float) -> bool:
    rx = re.compile(pattern, re.M)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and rx.search(path.read_text(errors="replace")):
            return True
        time.sleep(0.5)
    return False


def task_pid(cluster: SgeTestCluster, task: str) -> tuple[int, str]:
    """(pid, host) of the keras_distrib.servers process that runs ``task`` (e.g. worker:1)."""
    needle = f"KERAS_DISTRIB_TASK={task}".encode()
    hosts = {os.stat(f"/run/netns/{cluster.prefix}-{n}").st_ino: n for n in NODES}
    for entry in cluster.processes_matching(r"-m keras_distrib\.servers"):
        pid = int(entry.split()[0])
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid, hosts[os.stat(f"/proc/{pid}/ns/net").st_ino]
        except (OSError, KeyError):
            continue
    raise AssertionError(f"no {task} server process in the cluster")


def test_cluster_has_three_exec_hosts_and_the_pe(sge_cluster: SgeTestCluster) -> None:
    hosts = sge_cluster.exec_hosts()
    assert sorted(hosts) == NODES and "-" not in hosts.values(), hosts
    assert sge_cluster.queue_states() == {n: "" for n in NODES}
    pe = dict(line.split(None, 1) for line in sge_cluster.qconf("-sp", PE_NAME).splitlines())
    assert (pe["allocation_rule"], pe["control_slaves"]) == ("$round_robin", "TRUE")


def test_pe_job_spans_hosts_with_qrsh_inherit(sge_cluster: SgeTestCluster, tmp_path: Path) -> None:
    """The plumbing the template relies on: PE_HOSTFILE over 3 hosts, qrsh -inherit on each."""
    script = """#!/bin/sh
#$ -S /bin/sh
cat "$PE_HOSTFILE"
for h in $(awk '{ print $1 }' "$PE_HOSTFILE"); do
    qrsh -inherit "$h" 'echo task on $(hostname) job $JOB_ID' < /dev/null
done
"""
    out = tmp_path / "pe.out"
    job = sge_cluster.qsub(script, "-pe", PE_NAME, "6", "-j", "y", "-o", str(out), cwd=tmp_path)
    result = sge_cluster.wait_job(job, timeout=120)
    text = out.read_text()
    assert (result.exit_status, result.failed) == (0, "0"), text
    hostfile = [line.split() for line in text.splitlines() if "all.q@" in line]
    assert sorted(hostfile) == [[n, "2", f"all.q@{n}", "UNDEFINED"] for n in NODES], text
    tasks = sorted(line for line in text.splitlines() if line.startswith("task on"))
    assert tasks == [f"task on {n} job {job}" for n in NODES], text


def test_template_check_reports_every_task_ok(sge_cluster: SgeTestCluster, work: Path) -> None:
    t0 = time.monotonic()
    job, out = submit(sge_cluster, work, "check", [])
    result = sge_cluster.wait_job(job, timeout=TIMEOUT)
    print(f"\n--check job (qsub to accounting record): {time.monotonic() - t0:.1f} s")
    text = out.read_text(errors="replace")
    assert (result.exit_status, result.failed) == (0, "0"), text
    lines = meaningful(text)
    chief_host = roles(lines)["chief:0"]
    head = f"[{chief_host} chief:0] "
    assert f"{head}cluster check: sge job {job}, layout ps-per-node, 6 task(s)" in lines, text
    table = [line[len(head):].split() for line in lines if line.startswith(head + "n")]
    # NODE ROLE ADDRESS ... STATUS: one ps and one worker on every host, all OK.
    assert sorted((row[0], row[1].split(":")[0], row[2].split(":")[0], row[-1]) for row in table) == [
        (node, kind, node, "OK") for node in NODES for kind in ("ps", "worker")], text
    assert f"{head}6 OK, 0 FAILED" in lines, text
    assert error_lines(text) == []
    assert_nothing_left(sge_cluster)


def test_template_trains_digits_end_to_end(sge_cluster: SgeTestCluster, work: Path) -> None:
    model = work / "digits.keras"
    t0 = time.monotonic()
    job, out = submit(sge_cluster, work, "digits",
                      [str(DIGITS), "--epochs", "3", "--json", "--save", str(model)])
    result = sge_cluster.wait_job(job, timeout=TIMEOUT)
    print(f"\ndigits training job (qsub to accounting record): {time.monotonic() - t0:.1f} s")
    text = out.read_text(errors="replace")
    assert (result.exit_status, result.failed) == (0, "0"), text
    lines = meaningful(text)
    where = roles(lines)
    # One ps and one worker per host, the chief beside them on the job's master host.
    assert sorted(h for r, h in where.items() if r.startswith("ps:")) == NODES, where
    assert sorted(h for r, h in where.items() if r.startswith("worker:")) == NODES, where
    chief = f"[{where['chief:0']} chief:0] "
    summary = [json.loads(line[len(chief):]) for line in lines if line.startswith(chief + "{")]
    assert summary, text
    assert summary[-1]["test_accuracy"] > 0.8 and summary[-1]["steps"] > 0, summary
    assert model.exists()
    assert error_lines(text) == []
    assert_nothing_left(sge_cluster)


def test_killed_worker_is_named_and_fails_the_job(sge_cluster: SgeTestCluster, work: Path) -> None:
    # 500 epochs: minutes of training if nothing stopped the job.
    job, out = submit(sge_cluster, work, "killed", ["--max-restarts", "0", str(DIGITS), "--epochs", "500"])  # the fail-fast path
    try:
        assert wait_for_line(out, r"^\[n\d chief:0\] Epoch 2/", TIMEOUT), \
            out.read_text(errors="replace") if out.exists() else "no output"
        victim, host = task_pid(sge_cluster, "worker:1")
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        result = sge_cluster.wait_job(job, timeout=180)
        print(f"\nSIGKILL of worker:1 to the job's accounting record: {time.monotonic() - killed_at:.1f} s")
    finally:
        sge_cluster.head(["qdel", str(job)], timeout=30)
    text = out.read_text(errors="replace")
    assert result.exit_status != 0, text
    assert f"worker:1 on {host} exited unexpectedly with signal 9 (SIGKILL)" in "\n".join(error_lines(text)), text
    assert not any(re.match(r"^\[n\d chief:0\] Epoch 500/", line) for line in text.splitlines())
    assert_nothing_left(sge_cluster)


PARSE = """from cluster_parsers.sge import SgeParser
info = SgeParser().parse()
print("parsed", *info.nodes, info.rank, info.node_index, flush=True)
"""


def test_parser_accepts_a_qrsh_inherit_task(sge_cluster: SgeTestCluster, tmp_path: Path) -> None:
    """The SGE parser, run in each agent's real environment (qrsh -inherit -V, as the template)."""
    script = f"""#!/bin/bash
#$ -S /bin/bash
for h in $(awk '{{ print $1 }}' "$PE_HOSTFILE"); do
    qrsh -inherit -V "$h" {sys.executable} {tmp_path / "parse.py"} < /dev/null
done
"""
    out = tmp_path / "parse.out"
    (tmp_path / "parse.py").write_text(PARSE)
    job = sge_cluster.qsub(script, "-pe", PE_NAME, "3", "-V", "-j", "y", "-o", str(out), cwd=tmp_path)
    result = sge_cluster.wait_job(job, timeout=120)
    text = out.read_text()
    parsed = [line.split() for line in text.splitlines() if line.startswith("parsed")]
    assert result.exit_status == 0 and error_lines(text) == [], text
    # Each host finds itself in the job's host list: ranks 0, 1, 2 in PE_HOSTFILE order.
    assert sorted((row[-2], row[-1]) for row in parsed) == [("0", "0"), ("1", "1"), ("2", "2")], text
