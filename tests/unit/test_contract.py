"""The agent-to-child contract: the plan file, TF_CONFIG only when it fits, the readers."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from cluster_parsers import JobInfo
from keras_distrib import contract
from keras_distrib.launcher.children import OutputFilter, SharedErrors, spawn
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
    return contract.child_env({"PATH": "/usr/bin", "TF_CONFIG": "stale"}, plan, plan.find(*task), path,
                              startup_timeout=60.0)


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
    plan = build_plan(job_of(1), "allreduce")
    proc = plan.processes[0]
    overhead = len(contract.tf_config_json("", proc.job, proc.index))
    fits = '"' + "x" * (contract.TF_CONFIG_LIMIT - overhead - 2) + '"'
    env = contract.child_env({}, plan, proc, tmp_path / "plan.json", startup_timeout=1, cluster_json=fits)
    assert len(env["TF_CONFIG"]) == contract.TF_CONFIG_LIMIT
    too_big = fits[:-1] + 'x"'
    assert "TF_CONFIG" not in contract.child_env({}, plan, proc, tmp_path / "plan.json", startup_timeout=1,
                                                 cluster_json=too_big)


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
    plan = build_plan(job_of(1), "allreduce")

    def env(base: dict[str, str], **kwargs: bool) -> dict[str, str]:
        return contract.child_env(base, plan, proc, tmp_path / "plan.json", startup_timeout=1, **kwargs)

    assert env({})["TF_CPP_MIN_LOG_LEVEL"] == "2"
    assert env({"TF_CPP_MIN_LOG_LEVEL": "0"})["TF_CPP_MIN_LOG_LEVEL"] == "0"
    assert "TF_CPP_MIN_LOG_LEVEL" not in env({}, verbose=True)
    # --verbose also raises keras_distrib's own log level in the child, unless the user chose one.
    assert env({}, verbose=True)["KERAS_DISTRIB_LOG_LEVEL"] == "DEBUG"
    assert env({"KERAS_DISTRIB_LOG_LEVEL": "WARNING"}, verbose=True)["KERAS_DISTRIB_LOG_LEVEL"] == "WARNING"
    assert "KERAS_DISTRIB_LOG_LEVEL" not in env({})


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


def test_our_own_hinted_error_is_shown_as_its_line_alone() -> None:
    frames = [b"Traceback (most recent call last):\n", b'  File "train.py", line 9, in <module>\n',
              b"    keras_distrib.fit(model, gen, epochs=2)\n"]
    mistake = b"keras_distrib.data.base.InputError: x: a Python generator cannot be sharded. HINT: use a PyDataset.\n"
    assert shown(OutputFilter(), [b"a\n", *frames, mistake, b"b\n"]) == [b"a\n", mistake, b"b\n"]
    assert shown(OutputFilter(quiet=True), [*frames, mistake]) == []
    # Without a HINT (a bug of ours, or a chained error) the traceback stays whole.
    bug = b"keras_distrib.trainers._common.TrainerError: unexpected state\n"
    assert shown(OutputFilter(), [*frames, bug]) == [*frames, bug]


def test_the_same_error_from_several_processes_is_one_traceback_and_a_line_each() -> None:
    """Issue 30: one failure, one story (the log files keep every traceback)."""
    frames = [b"Traceback (most recent call last):\n", b'  File "train.py", line 9, in <module>\n', b"    open(p)\n"]
    error = b"FileNotFoundError: [Errno 2] No such file or directory: 'data.csv'\n"
    shared = SharedErrors()
    first, second, third = (OutputFilter(name=n, shared=shared) for n in ("worker:0", "worker:1", "worker:2"))
    assert shown(first, [*frames, error]) == [*frames, error]
    same = (b"the same error as worker:0 (its traceback is shown; this one is in the log directory): "
            b"FileNotFoundError: [Errno 2] No such file or directory: 'data.csv'\n")
    assert shown(second, [b"a\n", *frames, error]) == [b"a\n", same]
    other = b"ValueError: another cause\n"
    assert shown(third, [*frames, other]) == [*frames, other]  # another error stays whole
    assert shown(first, [*frames, error]) == [*frames, error]  # the same process again (a restart) too
    quiet = OutputFilter(name="worker:3", shared=shared, quiet=True)
    assert shown(quiet, [*frames, error]) == [] and quiet.repeats_an_error() == "worker:0"


def test_a_warning_every_process_repeats_is_shown_once() -> None:
    warning = [b"/venv/keras/src/trainer.py:82: UserWarning: The model does not have any trainable weights.\n",
               b"  warnings.warn(\n"]
    shared = SharedErrors()
    first, second = OutputFilter(name="jax:0", shared=shared), OutputFilter(name="jax:1", shared=shared)
    assert shown(first, [*warning, b"Epoch 1/2\n"]) == [*warning, b"Epoch 1/2\n"]
    assert shown(second, [*warning, b"Epoch 1/2\n"]) == [b"Epoch 1/2\n"]
    assert shown(first, warning) == warning  # the same process repeating itself is its own business


def test_our_own_warning_every_process_repeats_is_shown_once_per_agent() -> None:
    """A script's line and a server's bare one with the same text count as one (our own
    error lines too)."""
    text = b"the scheduler gave this process 2 GPU(s) but TensorFlow sees 0: ...\n"
    shared = SharedErrors()
    server, script, other = (OutputFilter(name=n, shared=shared) for n in ("worker:0", "chief:0", "worker:1"))
    assert shown(server, [b"warning: " + text]) == [b"warning: " + text]
    assert shown(script, [b"keras_distrib: warning: " + text, b"Epoch 1/2\n"]) == [b"Epoch 1/2\n"]
    assert shown(other, [b"warning: " + text]) == []
    another = b"keras_distrib: warning: something else\n"
    assert shown(other, [another]) == [another]
    assert shown(OutputFilter(), [b"warning: " + text] * 2) == [b"warning: " + text] * 2  # no agent: all kept
    assert shown(server, [b"error: " + text]) == [b"error: " + text]
    assert shown(other, [b"error: " + text]) == []


def test_a_quiet_child_first_with_a_warning_leaves_it_to_the_one_that_speaks() -> None:
    """All-reduce workers above 0 are quiet; whichever process prints first, worker 0 shows
    the line every process repeats (a quiet one must not claim it)."""
    for text in (b"keras_distrib: warning: the scheduler gave this process 2 GPU(s) but TensorFlow sees 0\n",
                 b"/venv/keras/src/trainer.py:82: UserWarning: no trainable weights.\n"):
        shared = SharedErrors()
        quiet, speaker = OutputFilter(name="worker:1", shared=shared, quiet=True), OutputFilter(name="worker:0", shared=shared)
        assert shown(quiet, [text]) == []
        assert shown(speaker, [text]) == [text]


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


def test_a_child_on_one_cpu_gets_two_interop_threads(tmp_path: Path) -> None:
    # One inter-op thread deadlocks the ps layouts (no step in 300 s under taskset -c 1).
    plan = build_plan(job_of(1), "ps-per-node")
    proc = plan.processes[0]

    def env(base: dict[str, str], cpus: int) -> dict[str, str]:
        return contract.child_env(base, plan, proc, tmp_path / "plan.json", startup_timeout=1, cpus=cpus)

    assert env({}, 1)["TF_NUM_INTEROP_THREADS"] == "2"
    assert env({"TF_NUM_INTEROP_THREADS": "8"}, 1)["TF_NUM_INTEROP_THREADS"] == "8"
    assert "TF_NUM_INTEROP_THREADS" not in env({}, 2)


# -- one contract: one builder, one table, no other spelling ------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "launcher-internals.md"
PACKAGE = Path(__file__).resolve().parents[2] / "keras_distrib"


def every_child_env(tmp_path: Path) -> list[tuple[str, dict[str, str]]]:
    """child_env over a grid: every layout, every process kind, each option on and off."""
    cases = []
    for layout in ("ps-per-node", "worker-per-gpu", "allreduce", "jax", "jax-per-gpu", "tuner"):
        for gpus in ((), ("0", "1")):
            for hosts in (None, {"node00000": "10.0.0.1", "node00001": "10.0.0.2", "node00002": "10.0.0.3"}):
                job = JobInfo("slurm", "7", ("node00000", "node00001", "node00002"), (1, 1, 1),
                              node_gpus=(gpus,) * 3)
                plan = build_plan(job, layout, hosts=hosts)
                for proc in plan.processes:
                    for extra in ({}, {"verbose": True, "checkpoint_every": "50steps", "interface": "ib0", "cpus": 1,
                                   "require_gpus": True}):
                        env = contract.child_env({"PATH": "/bin"}, plan, proc, tmp_path / "plan.json",
                                                 startup_timeout=5.0, **extra)
                        cases.append((f"{layout} {proc.name} {extra}", env))
    return cases


def test_child_env_sets_exactly_the_variables_of_the_table(tmp_path: Path) -> None:
    produced: set[str] = set()
    for case, env in every_child_env(tmp_path):
        names = set(env) - {"PATH"}
        assert names <= set(contract.VARIABLES), (case, names - set(contract.VARIABLES))
        produced |= names
    assert produced == set(contract.VARIABLES)  # no row of the table is dead


def test_the_documented_table_is_the_contract_table() -> None:
    section = DOC.read_text().split("## What a child process gets", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = {}
    for row in rows:
        name, text = row.strip("| ").split(" | ", 1)
        documented[name.strip("`")] = text.rstrip(" |")
    assert documented == contract.VARIABLES


def _string_literals(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module except docstrings (the prose may name a variable)."""
    import ast

    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_other_module_spells_a_contract_variable() -> None:
    import re

    pattern = re.compile(r"\b(" + "|".join(map(re.escape, contract.VARIABLES)) + r")\b")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "contract.py":
            continue
        for line, text in _string_literals(path):
            # A name used as a key: use contract's constant (messages to users may name one).
            if pattern.fullmatch(text):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {text[:60]!r}")
    assert not found, "\n".join(found)


# -- XLA's CPU flag for the processes that run Keras on JAX -------------------------------------------


def _xla_flags(layout: str, backend: str, base: dict[str, str], jaxlib: str, monkeypatch: pytest.MonkeyPatch,
               tmp_path: Path, nodes: int = 3) -> dict[str, str | None]:
    monkeypatch.setattr(contract, "installed_jaxlib", lambda: jaxlib)
    names = tuple(f"node{i}" for i in range(nodes))
    plan = build_plan(JobInfo("slurm", "7", names, (1,) * nodes), layout, backend=backend)
    return {proc.name: contract.child_env(base, plan, proc, tmp_path / "plan.json", startup_timeout=5.0).get("XLA_FLAGS")
            for proc in plan.processes}


@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize("layout", ["ps-per-node", "worker-per-gpu"])
def test_a_ps_layout_on_jax_gives_the_flag_to_its_chief_and_workers_not_its_ps(
        layout: str, nodes: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    flags = _xla_flags(layout, "jax", {"PATH": "/bin"}, "0.10.2", monkeypatch, tmp_path, nodes)
    assert {name for name, value in flags.items() if value == contract.XLA_CPU_FLAG} == \
        {name for name in flags if not name.startswith("ps:")}
    assert all(flags[name] is None for name in flags if name.startswith("ps:"))
    assert sum(name.startswith("worker:") for name in flags) == nodes


@pytest.mark.parametrize("layout", ["jax", "jax-per-gpu"])
def test_every_process_of_a_jax_layout_gets_the_flag(layout: str, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    assert set(_xla_flags(layout, "tensorflow", {}, "0.10.7", monkeypatch, tmp_path).values()) == {contract.XLA_CPU_FLAG}


@pytest.mark.parametrize("layout", ["ps-per-node", "allreduce", "tuner"])
def test_tensorflow_processes_get_no_xla_flags(layout: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert set(_xla_flags(layout, "tensorflow", {}, "0.10.2", monkeypatch, tmp_path).values()) == {None}


@pytest.mark.parametrize("backend, expected", [("jax", {contract.XLA_CPU_FLAG}), ("torch", {None}),
                                               ("tensorflow", {None})])
def test_a_tuner_gives_the_flag_to_its_trials_only_on_jax(backend: str, expected: set[str | None],
                                                          monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    flags = _xla_flags("tuner", "tensorflow", {"KERAS_BACKEND": backend}, "0.10.2", monkeypatch, tmp_path)
    assert sorted(flags) == ["chief:0", "tuner:0", "tuner:1", "tuner:2"]  # the oracle, a trial worker per node
    assert set(flags.values()) == expected


@pytest.mark.parametrize("jaxlib", ["0.11.0", "0.9.2", ""])
def test_a_jaxlib_that_may_not_know_the_flag_gets_none(jaxlib: str, monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    base = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    assert set(_xla_flags("jax", "tensorflow", base, jaxlib, monkeypatch, tmp_path).values()) == \
        {"--xla_cpu_enable_fast_math=false"}


def test_the_users_xla_flags_are_kept_and_their_own_choice_wins(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    added = _xla_flags("jax", "tensorflow", {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}, "0.10.2",
                       monkeypatch, tmp_path)
    assert set(added.values()) == {f"--xla_cpu_enable_fast_math=false {contract.XLA_CPU_FLAG}"}
    own = "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"
    assert set(_xla_flags("ps-per-node", "jax", {"XLA_FLAGS": own}, "0.10.2", monkeypatch, tmp_path).values()) == {own}
