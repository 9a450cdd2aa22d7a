"""Every process's full output is kept in a file of the job's log directory (issue 24, section 6)."""

from __future__ import annotations

import io
import os
import queue
import sys
from pathlib import Path

import pytest

from cluster_parsers import ClusterConfigError, JobInfo
from keras_distrib.launcher.launch import job_log_dir
from keras_distrib.launcher.children import OutputFilter, spawn
from keras_distrib.launcher.options import Options
from keras_distrib.launcher.workers import log_file_name
from keras_distrib.plan import build_plan

pytestmark = pytest.mark.unit


def job(scheduler: str = "slurm", job_id: str = "4242") -> JobInfo:
    return JobInfo(scheduler, job_id, ("n1", "n2"), (1, 1))


def test_default_is_beside_the_jobs_own_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert job_log_dir(Options(), job()) == tmp_path / "keras_distrib-logs" / "slurm-4242"
    assert job_log_dir(Options(), job("pbs", "77.server/x")) == tmp_path / "keras_distrib-logs" / "pbs-77.server_x"
    assert job_log_dir(Options(log_dir=str(tmp_path / "mine")), job("lsf", "9")) == tmp_path / "mine" / "lsf-9"
    assert (tmp_path / "mine" / "lsf-9").is_dir()


def test_a_directory_that_cannot_be_made_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ClusterConfigError, match=r"log-dir .*cannot create .*HINT: pass --log-dir") as info:
        job_log_dir(Options(log_dir=str(tmp_path / "file")), job())
    assert "\n" not in str(info.value)


def test_the_file_gets_every_line_the_console_does_not(tmp_path: Path) -> None:
    """A quiet process (allreduce worker > 0): nothing on the console, everything in its file."""
    proc = build_plan(job(), "allreduce").processes[1]
    code = ("import sys\nprint('I0000 00:00:1.0    1 port.cc:153] oneDNN banner')\nprint('user print on worker 1')\n"
            "print('partial', end='')\n")
    sink, done = io.BytesIO(), queue.SimpleQueue()
    log_path = tmp_path / log_file_name(proc)
    spawn(proc, [sys.executable, "-c", code], dict(os.environ), True, lambda c, rc: done.put(rc), out=sink,
          output=OutputFilter(quiet=True), log=open(log_path, "ab"))
    assert done.get(timeout=60) == 0
    assert sink.getvalue() == b""
    assert log_path.name == "worker-1.log"
    assert log_path.read_text().splitlines() == [
        "I0000 00:00:1.0    1 port.cc:153] oneDNN banner", "user print on worker 1", "partial",
        "--- worker:1 on n2 ended with exit code 0"]
