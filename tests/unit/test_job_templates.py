"""The job scripts in scripts/: golden copies, shell syntax, and what they actually run.

A template change must be deliberate: the test compares each one with its copy in
tests/unit/golden/. After an intended change, rewrite the copies and review the diff:

    KERAS_DISTRIB_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_job_templates.py

The templates are also run with bash against stub ``srun``/``pbsdsh``/``qrsh`` commands
that record their argv, to prove that SCRIPT and its arguments pass through unchanged,
that $PYTHON is honoured and that the job keeps the launcher's exit code.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE_VAR = "KERAS_DISTRIB_UPDATE_GOLDEN"
BASH = shutil.which("bash")


@dataclass(frozen=True)
class Template:
    path: str          # relative to the repository
    module: str        # entry module the agents run
    layout: str
    directive: str     # scheduler directive prefix

    @property
    def file(self) -> Path:
        return REPO / self.path

    @property
    def golden(self) -> Path:
        return GOLDEN / Path(self.path).name


TEMPLATES = [
    Template("scripts/sbatch/ps-per-node.sbatch", "keras_distrib.slurm", "ps-per-node", "#SBATCH"),
    Template("scripts/sbatch/worker-per-gpu.sbatch", "keras_distrib.slurm", "worker-per-gpu", "#SBATCH"),
    Template("scripts/sbatch/allreduce.sbatch", "keras_distrib.slurm", "allreduce", "#SBATCH"),
    Template("scripts/sbatch/jax.sbatch", "keras_distrib.slurm", "jax", "#SBATCH"),
    Template("scripts/sbatch/elastic.sbatch", "keras_distrib.slurm", '"$LAYOUT"', "#SBATCH"),
    Template("scripts/sbatch/ps-on-cpu-nodes.sbatch", "keras_distrib.slurm", "ps-per-node", "#SBATCH"),
    Template("scripts/sbatch/tuner.sbatch", "keras_distrib.slurm", "tuner", "#SBATCH"),
    Template("scripts/pbs/ps-per-node.pbs", "keras_distrib.pbs", "ps-per-node", "#PBS"),
    Template("scripts/sge/ps-per-node.sge", "keras_distrib.sge", "ps-per-node", "#$"),
    Template("scripts/pbs/elastic.pbs", "keras_distrib.pbs", '"$LAYOUT"', "#PBS"),
]
SLURM = [t for t in TEMPLATES if t.module == "keras_distrib.slurm"]
IDS = [Path(t.path).name for t in TEMPLATES]
needs_bash = pytest.mark.skipif(BASH is None, reason="bash is not installed")


def commands(text: str) -> list[str]:
    """The script's non-comment lines, with backslash continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("template", TEMPLATES, ids=IDS)
def test_matches_golden_copy(template: Template) -> None:
    text = template.file.read_text()
    if os.environ.get(UPDATE_VAR) == "1":
        GOLDEN.mkdir(exist_ok=True)
        template.golden.write_text(text)
        pytest.skip(f"{UPDATE_VAR}=1: rewrote {template.golden.relative_to(REPO)}")
    assert template.golden.is_file(), f"no golden copy; run with {UPDATE_VAR}=1 to create it"
    assert text == template.golden.read_text(), (
        f"{template.path} differs from {template.golden.relative_to(REPO)}; if the change is intended, "
        f"rerun with {UPDATE_VAR}=1 and review the diff"
    )


def test_every_golden_copy_has_a_template() -> None:
    assert sorted(p.name for p in GOLDEN.iterdir()) == sorted(IDS + [Path(t.path).name for t in CONTAINERS])


@needs_bash
@pytest.mark.parametrize("template", TEMPLATES, ids=IDS)
def test_shell_syntax(template: Template) -> None:
    p = subprocess.run([BASH, "-n", str(template.file)], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    assert template.file.read_text().startswith("#!/bin/bash\n")


@pytest.mark.parametrize("template", TEMPLATES, ids=IDS)
def test_structure(template: Template) -> None:
    text = template.file.read_text()
    lines = text.splitlines()
    active = [line for line in lines if line.startswith(template.directive + " ")]
    disabled = [line for line in lines if line.startswith("#" + template.directive + " ")]
    assert active, f"no active {template.directive} resource line"
    assert disabled, f"no commented-out {template.directive} example line"
    assert any("#" in line[len(template.directive):] for line in active), "explain the resource lines"
    # The launch: the right entry module and layout, the user's arguments passed through.
    launch = [c for c in commands(text) if f"-m {template.module} --layout {template.layout}" in c]
    assert len(launch) == 1, f"expected one launch of {template.module} --layout {template.layout}"
    assert '"$@"' in launch[0]
    assert "${PYTHON:-" in text, "the PYTHON variable must choose the interpreter"


@pytest.mark.parametrize("template", SLURM, ids=[Path(t.path).name for t in SLURM])
def test_slurm_specifics(template: Template) -> None:
    text = template.file.read_text()
    srun = [c for c in commands(text) if c.startswith("srun ")]
    assert len(srun) == 1 and "--ntasks-per-node=1" in srun[0].split()
    assert "#SBATCH --ntasks-per-node=1" in text
    preempt = [line for line in text.splitlines() if "--signal=" in line]
    assert preempt == ["#SBATCH --signal=B:USR1@120"], "the time-limit warning goes to the batch shell"
    assert any(line.startswith("#SBATCH --requeue ") for line in text.splitlines())
    before = text[: text.index(preempt[0])]
    assert "SIGUSR1" in before.split("#SBATCH --output")[-1], "the preemption line needs its explanation"
    trap = """trap 'usr1=1; [ -n "$srun_pid" ] && kill -USR1 "$srun_pid" 2>/dev/null' USR1"""
    # Set before srun starts: a warning that came between the two killed the batch shell.
    assert trap in text and text.index(trap) < text.index("\nsrun ")


# -- running the templates against stub launchers --------------------------------------------

RECORDER = textwrap.dedent(
    """\
    #!/bin/bash
    # Stub: append "name<TAB>arg<TAB>arg..." to $RECORD in one write, then exit $STUB_RC.
    line=$(printf '\\t%s' "$@")
    printf '%s%s\\n' "{name}" "$line" >> "$RECORD"
    exit "${{STUB_RC:-0}}"
    """
)
ARGS = ["train.py", "--epochs", "3", "--note", "two words"]


def stub(bindir: Path, name: str, body: str | None = None) -> Path:
    path = bindir / name
    path.write_text(body if body is not None else RECORDER.format(name=name))
    path.chmod(0o755)
    return path


def run_template(template: Template, tmp_path: Path, env: dict[str, str], args: list[str], rc: int) -> tuple[int, list[list[str]], str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    record = tmp_path / "record.txt"
    record.write_text("")
    for name in ("srun", "pbsdsh", "qrsh", "mypython"):
        if not (bindir / name).exists():  # a test's own stub stays
            stub(bindir, name)
    full_env = {
        "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(tmp_path),
        "RECORD": str(record),
        "STUB_RC": str(rc),
        "PYTHON": str(bindir / "mypython"),
        **env,
    }
    p = subprocess.run([BASH, str(template.file), *args], env=full_env, cwd=tmp_path, capture_output=True, text=True, timeout=30, check=False)
    calls = [line.split("\t") for line in record.read_text().splitlines()]
    return p.returncode, calls, p.stderr


HETEROGENEOUS = next(t for t in TEMPLATES if t.path.endswith("ps-on-cpu-nodes.sbatch"))
HOMOGENEOUS_SLURM = [t for t in SLURM if t is not HETEROGENEOUS]


@needs_bash
@pytest.mark.parametrize("rc", [0, 3])
def test_the_heterogeneous_template_starts_an_agent_on_each_component_with_its_cpus(tmp_path: Path, rc: int) -> None:
    env = {"SLURM_CPUS_PER_TASK_HET_GROUP_0": "8", "SLURM_CPUS_PER_TASK_HET_GROUP_1": "2"}
    code, calls, err = run_template(HETEROGENEOUS, tmp_path, env, ARGS, rc)
    assert code == rc, err
    agent = [str(tmp_path / "bin" / "mypython"), "-m", "keras_distrib.slurm", "--layout", "ps-per-node", "--requeue",
             *ARGS]
    assert calls == [["srun", "--ntasks-per-node=1", "--cpus-per-task=8", *agent,
                      ":", "--ntasks-per-node=1", "--cpus-per-task=2", *agent]]
    text = HETEROGENEOUS.file.read_text()
    assert text.index("#SBATCH --nodes=2") < text.index("#SBATCH hetjob\n") < text.index("#SBATCH --nodes=1")


@needs_bash
@pytest.mark.parametrize("template", HOMOGENEOUS_SLURM, ids=[Path(t.path).name for t in HOMOGENEOUS_SLURM])
@pytest.mark.parametrize("rc", [0, 3])
def test_sbatch_runs_srun_with_the_arguments(template: Template, tmp_path: Path, rc: int) -> None:
    env = {"SLURM_JOB_NUM_NODES": "3", "SLURM_CPUS_PER_TASK": "2"}
    code, calls, err = run_template(template, tmp_path, env, ARGS, rc)
    assert code == rc, err
    python = str(tmp_path / "bin" / "mypython")
    if template.layout == '"$LAYOUT"':  # elastic.sbatch: its defaults
        assert calls == [[
            "srun", "--no-kill", "--kill-on-bad-exit=0", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1",
            "--cpus-per-task=2", python, "-m", "keras_distrib.slurm", "--layout", "ps-per-node", "--min-nodes", "2",
            "--requeue", "--exit-code-file", "keras_distrib-logs/slurm-0.exit-code", *ARGS,
        ]]
        return
    assert calls == [[
        "srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--cpus-per-task=2",
        python, "-m", "keras_distrib.slurm", "--layout", template.layout, "--requeue", *ARGS,
    ]]


ELASTIC = next(t for t in TEMPLATES if t.path.endswith("elastic.sbatch"))
# Stub srun as after a dropped node: the first agent wrote the job's code, then ended the step.
SRUN_ENDED_BY_THE_FIRST_AGENT = textwrap.dedent(
    """\
    #!/bin/bash
    line=$(printf '\\t%s' "$@")
    printf '%s%s\\n' srun "$line" >> "$RECORD"
    for ((i = 1; i <= $#; i++)); do
        if [ "${!i}" = --exit-code-file ]; then j=$((i + 1)); mkdir -p "$(dirname "${!j}")"; echo "$JOB_CODE" > "${!j}"; fi
    done
    exit 143
    """
)


@needs_bash
@pytest.mark.parametrize("job_code", ["0", "3"])
def test_elastic_reports_the_first_agents_code_and_takes_layout_and_minimum(tmp_path: Path, job_code: str) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub(bindir, "srun", SRUN_ENDED_BY_THE_FIRST_AGENT)
    (tmp_path / "keras_distrib-logs").mkdir()
    (tmp_path / "keras_distrib-logs" / "slurm-42.exit-code").write_text("9\n")  # a previous run's (requeued job)
    env = {"SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_ID": "42", "LAYOUT": "allreduce", "MIN_NODES": "2",
           "JOB_CODE": job_code}
    code, calls, err = run_template(ELASTIC, tmp_path, env, ARGS, 0)
    assert code == int(job_code), err
    launch = calls[0][calls[0].index("-m"):]
    assert launch == ["-m", "keras_distrib.slurm", "--layout", "allreduce", "--min-nodes", "2", "--requeue",
                      "--exit-code-file", "keras_distrib-logs/slurm-42.exit-code", *ARGS]


SRUN_WAITING_FOR_USR1 = textwrap.dedent(
    """\
    #!/bin/bash
    # Stub srun: like the agents after a time-limit warning, save and exit with 75.
    trap 'echo USR1 >> "$RECORD"; exit 75' USR1
    echo started >> "$RECORD"
    for _ in $(seq 300); do sleep 0.1; done
    exit 1
    """
)


@needs_bash
@pytest.mark.parametrize("template", SLURM, ids=[Path(t.path).name for t in SLURM])
def test_sbatch_passes_the_time_limit_warning_to_srun(template: Template, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub(bindir, "srun", SRUN_WAITING_FOR_USR1)
    record = tmp_path / "record.txt"
    env = {"PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}", "RECORD": str(record), "SLURM_JOB_NUM_NODES": "2"}
    shell = subprocess.Popen([BASH, str(template.file), *ARGS], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (record.exists() and "started" in record.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert record.exists(), "the stub srun did not start within 60 s"
        shell.send_signal(signal.SIGUSR1)  # what --signal=B:USR1 does
        assert shell.wait(timeout=20) == 75  # srun's code, not the interrupted wait's
    finally:
        if shell.poll() is None:
            shell.kill()
    assert record.read_text().split() == ["started", "USR1"]


@needs_bash
@pytest.mark.parametrize("rc", [0, 3])
def test_pbs_runs_one_agent_per_node(tmp_path: Path, rc: int) -> None:
    template = next(t for t in TEMPLATES if t.module == "keras_distrib.pbs")
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("n1\nn1\nn2\nn2\nn3\nn3\n")  # one line per slot
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = {"PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(workdir)}
    code, calls, err = run_template(template, tmp_path, env, ARGS, rc)
    assert code == rc, err
    python = str(tmp_path / "bin" / "mypython")
    agent = [python, "-m", "keras_distrib.pbs", "--layout", "ps-per-node", "--requeue", *ARGS]
    remote = sorted(c for c in calls if c[0] == "pbsdsh")
    # The first node's agent is the job script itself; pbsdsh starts the other nodes' first slot.
    assert remote == [
        ["pbsdsh", "-n", vnode, "--", "/bin/bash", "-c", 'cd "$1" && shift && exec "$@"', "agent", str(workdir), *agent]
        for vnode in ("2", "4")
    ]
    assert [c for c in calls if c[0] == "mypython"] == [["mypython", *agent[1:]]]


@needs_bash
@pytest.mark.parametrize(("env", "layout", "minimum"), [({}, "ps-per-node", "2"),
                                                        ({"LAYOUT": "allreduce", "MIN_NODES": "1"}, "allreduce", "1")])
def test_pbs_elastic_runs_one_agent_per_node_with_the_minimum(tmp_path: Path, env: dict[str, str], layout: str,
                                                              minimum: str) -> None:
    template = next(t for t in TEMPLATES if t.path.endswith("elastic.pbs"))
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("n1\nn1\nn2\nn2\nn3\nn3\n")
    env = {"PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(tmp_path), **env}
    code, calls, err = run_template(template, tmp_path, env, ARGS, 3)
    assert code == 3, err  # agent 0's code is the job's
    agent = ["-m", "keras_distrib.pbs", "--layout", layout, "--min-nodes", minimum, "--requeue", *ARGS]
    assert [c[c.index("-m"):] for c in calls if "-m" in c] == [agent] * 3
    assert sorted(c[2] for c in calls if c[0] == "pbsdsh") == ["2", "4"]


@needs_bash
def test_pbs_takes_arguments_from_train_variable(tmp_path: Path) -> None:
    template = next(t for t in TEMPLATES if t.module == "keras_distrib.pbs")
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("n1\n")
    env = {"PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(tmp_path), "TRAIN": "train.py --epochs 3"}
    code, calls, err = run_template(template, tmp_path, env, [], 0)
    assert code == 0, err
    assert calls == [["mypython", "-m", "keras_distrib.pbs", "--layout", "ps-per-node", "--requeue", "train.py", "--epochs", "3"]]


@needs_bash
@pytest.mark.parametrize("rc", [0, 3])
def test_sge_runs_one_agent_per_host(tmp_path: Path, rc: int) -> None:
    template = next(t for t in TEMPLATES if t.module == "keras_distrib.sge")
    hostfile = tmp_path / "pe_hostfile"
    hostfile.write_text("n1 1 all.q@n1 UNDEFINED\nn2 1 all.q@n2 UNDEFINED\nn3 1 all.q@n3 UNDEFINED\n")
    code, calls, err = run_template(template, tmp_path, {"PE_HOSTFILE": str(hostfile)}, ["train.py", "--epochs", "3"], rc)
    assert code == rc, err
    python = str(tmp_path / "bin" / "mypython")
    assert sorted(calls) == [
        ["qrsh", "-inherit", "-V", host, python, "-m", "keras_distrib.sge", "--layout", "ps-per-node", "--requeue", "train.py", "--epochs", "3"]
        for host in ("n1", "n2", "n3")
    ]


# -- container templates: the agents inside the image, the trap and the requeue outside ----------

CONTAINERS = [Template(f"scripts/sbatch/{kind}.sbatch", "keras_distrib.slurm", '"$LAYOUT"', "#SBATCH")
              for kind in ("apptainer", "pyxis")]
# Stub srun whose agents saved a checkpoint and could not requeue (no scontrol inside): the
# first agent wrote 75 to the exit-code file, and the step ended with it.
SRUN_PREEMPTED_INSIDE = SRUN_ENDED_BY_THE_FIRST_AGENT.replace("exit 143", "exit 75")


@pytest.mark.parametrize("template", CONTAINERS, ids=lambda t: Path(t.path).name)
def test_container_template_matches_golden_copy(template: Template) -> None:
    test_matches_golden_copy(template)


@needs_bash
@pytest.mark.parametrize("template", CONTAINERS, ids=lambda t: Path(t.path).name)
def test_container_template_runs_the_agents_inside_the_image(template: Template, tmp_path: Path) -> None:
    env = {"SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_ID": "42", "IMAGE": "/images/tf.sif", "LAYOUT": "allreduce"}
    code, calls, err = run_template(template, tmp_path, env, ARGS, 0)
    assert code == 0, err
    python = str(tmp_path / "bin" / "mypython")
    tail = [python, "-m", "keras_distrib.slurm", "--layout", "allreduce", "--requeue",
            "--exit-code-file", "keras_distrib-logs/slurm-42.exit-code", *ARGS]
    head = ["srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--cpus-per-task=1"]
    if "apptainer" in template.path:
        assert calls == [[*head, "apptainer", "exec", "--nv", "--bind", str(tmp_path), "/images/tf.sif", *tail]]
    else:
        assert calls == [[*head, "--container-image=/images/tf.sif", f"--container-mounts={tmp_path}:{tmp_path}",
                          f"--container-workdir={tmp_path}", *tail]]


@needs_bash
@pytest.mark.parametrize("template", CONTAINERS, ids=lambda t: Path(t.path).name)
@pytest.mark.parametrize("requeue_rc", [0, 1])
def test_container_template_requeues_outside_when_the_agent_could_not(template: Template, tmp_path: Path,
                                                                      requeue_rc: int) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub(bindir, "srun", SRUN_PREEMPTED_INSIDE)
    stub(bindir, "scontrol", RECORDER.format(name="scontrol").replace('exit "${STUB_RC:-0}"', f"exit {requeue_rc}"))
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "42", "IMAGE": "img", "JOB_CODE": "75"}
    code, calls, err = run_template(template, tmp_path, env, ARGS, 0)
    assert ["scontrol", "requeue", "42"] in calls, calls
    if requeue_rc == 0:
        assert code == 0 and "requeued job 42" in err, err
    else:
        assert code == 75 and "resubmit the job" in err, err


@needs_bash
@pytest.mark.parametrize("template", CONTAINERS, ids=lambda t: Path(t.path).name)
def test_container_template_without_an_image_says_how_to_give_one(template: Template, tmp_path: Path) -> None:
    code, calls, err = run_template(template, tmp_path, {"SLURM_JOB_NUM_NODES": "2"}, ARGS, 0)
    assert code == 2 and calls == [] and "IMAGE is not set. HINT: IMAGE=" in err, err
