"""The parser registry: a contract every registered parser keeps, detection, forcing, plugins."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from _unit_helpers import FIXTURES, install_plugin, run_cli

from cluster_parsers import (
    BUILTIN_PARSERS,
    FORCE_VAR,
    ClusterConfigError,
    ClusterParser,
    JobInfo,
    all_parsers,
    detect,
    get_parser,
)
from keras_distrib.plan import build_plan

# A minimal valid environment for each parser, as a non-first task, so placement is checked.
MINIMAL_ENVS: dict[str, dict[str, str]] = {
    "slurm": {"SLURM_JOB_ID": "3", "SLURM_STEP_NODELIST": "c[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
              "SLURM_PROCID": "1", "SLURM_NODEID": "1"},
    "pbs": {"PBS_JOBID": "3.srv", "PBS_NODEFILE": str(FIXTURES / "pbs_nodefile"), "PBS_VNODENUM": "5"},
    "sge": {"JOB_ID": "3", "PE_HOSTFILE": str(FIXTURES / "sge_pe_hostfile"), "PMI_RANK": "3"},
    "lsf": {"LSB_JOBID": "3", "LSB_MCPU_HOSTS": "hA 2 hB 2", "JSM_NAMESPACE_RANK": "3", "JSM_NAMESPACE_SIZE": "4"},
    "static": {"KERAS_DISTRIB_HOSTS_FILE": str(FIXTURES / "static_hosts.yaml"), "KERAS_DISTRIB_RANK": "1"},
}

PARSERS = all_parsers()


def minimal_env(cls: type[ClusterParser]) -> dict[str, str]:
    if cls.name not in MINIMAL_ENVS:
        pytest.skip(f"no minimal environment known for the plugin parser {cls.name!r}")
    return MINIMAL_ENVS[cls.name]


def test_builtins_have_minimal_envs() -> None:
    assert {cls.name for cls in BUILTIN_PARSERS} == set(MINIMAL_ENVS)


def test_detection_priority_is_explicit() -> None:
    assert [cls.name for cls in BUILTIN_PARSERS] == ["slurm", "lsf", "sge", "pbs", "static"]
    assert PARSERS[-len(BUILTIN_PARSERS):] == list(BUILTIN_PARSERS)  # plugins first, then built-ins


@pytest.mark.parametrize("cls", PARSERS, ids=lambda c: c.name)
class TestContract:
    def test_declares_name_and_detect_vars(self, cls: type[ClusterParser]) -> None:
        assert cls.name and cls.name == cls.name.strip().lower()
        assert cls.detect_vars and all(isinstance(v, str) and v for v in cls.detect_vars)
        assert cls.agent_launch_hint

    def test_absent_from_an_empty_environment(self, cls: type[ClusterParser]) -> None:
        assert cls({}).is_present() is False

    def test_parse_minimal_env(self, cls: type[ClusterParser]) -> None:
        env = minimal_env(cls)
        parser = cls(env)
        assert parser.is_present()
        assert type(detect(env)) is cls
        job = parser.parse()
        assert isinstance(job, JobInfo)
        assert job.scheduler == cls.name
        assert isinstance(job.job_id, str) and job.job_id
        assert job.nodes and all(isinstance(n, str) and n for n in job.nodes)
        assert len(set(job.nodes)) == len(job.nodes)
        assert len(job.tasks_per_node) == len(job.nodes) and all(t >= 1 for t in job.tasks_per_node)
        assert len(job.node_gpus) == len(job.nodes)
        assert all(isinstance(g, str) for gpus in job.node_gpus for g in gpus)
        assert 0 <= job.node_index < len(job.nodes)
        first = sum(job.tasks_per_node[: job.node_index])
        assert first <= job.rank < first + job.tasks_per_node[job.node_index]
        assert job.rank > 0 and job.local_rank == job.rank - first
        with pytest.raises(dataclasses.FrozenInstanceError):
            job.rank = 0  # type: ignore[misc]
        json.dumps(build_plan(job).to_json())

    def test_forced_by_name(self, cls: type[ClusterParser]) -> None:
        other = {"SLURM_JOB_ID": "1", "PBS_JOBID": "1.s"}  # variables of other schedulers
        assert type(detect({**other, FORCE_VAR: cls.name})) is cls
        assert type(get_parser(cls.name, {})) is cls


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SLURM_JOB_ID": "1", "PBS_JOBID": "1.s", "LSB_JOBID": "1", "KERAS_DISTRIB_HOSTS_FILE": "h"}, "slurm"),
        ({"LSB_JOBID": "1", "PBS_JOBID": "1.s", "PE_HOSTFILE": "f"}, "lsf"),
        ({"PE_HOSTFILE": "f", "PBS_JOBID": "1.s"}, "sge"),
        ({"PBS_JOBID": "1.s", "KERAS_DISTRIB_HOSTS_FILE": "h"}, "pbs"),
        ({"KERAS_DISTRIB_HOSTS_FILE": "h"}, "static"),
    ],
)
def test_detection_priority(env: dict[str, str], expected: str) -> None:
    assert detect(env).name == expected


def test_nothing_detected() -> None:
    with pytest.raises(ClusterConfigError) as err:
        detect({})
    assert "SLURM_JOB_ID" in err.value.message and FORCE_VAR in err.value.hint


def test_unknown_forced_name_lists_known_ones() -> None:
    with pytest.raises(ClusterConfigError) as err:
        detect({FORCE_VAR: "flux"})
    assert f"{FORCE_VAR}='flux'" in err.value.message
    for cls in PARSERS:
        assert cls.name in err.value.hint


# --- a third-party package adds a scheduler through the entry point --------------------

PLUGIN_SOURCE = '''
from cluster_parsers import ClusterParser, JobInfo


class FluxTestParser(ClusterParser):
    name = "fluxtest"
    detect_vars = ("FLUXTEST_JOB_ID",)

    def parse(self):
        nodes = tuple(self.env["FLUXTEST_NODES"].split())
        return JobInfo(self.name, self.env["FLUXTEST_JOB_ID"], nodes, (1,) * len(nodes))
'''

PLUGIN_ENV = {"FLUXTEST_JOB_ID": "f7", "FLUXTEST_NODES": "fa fb", "SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1"}


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_plugin(tmp_path_factory.mktemp("plugin"), "kd-fluxtest", {"kd_fluxtest": PLUGIN_SOURCE},
                          {"fluxtest": "kd_fluxtest:FluxTestParser"})


def test_plugin_is_detected_before_builtins(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "fluxtest" not in {cls.name for cls in all_parsers()}
    monkeypatch.syspath_prepend(str(plugin_site))
    assert [cls.name for cls in all_parsers()][0] == "fluxtest"
    parser = detect(PLUGIN_ENV)  # SLURM variables too: plugins come first
    assert parser.name == "fluxtest"
    assert parser.parse().nodes == ("fa", "fb")
    with pytest.raises(ClusterConfigError, match="fluxtest"):
        get_parser("nope")


def test_plugin_through_the_cli(plugin_site: Path) -> None:
    result = run_cli(PLUGIN_ENV, "--plan", "--format", "json", pythonpath=(str(plugin_site),))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["scheduler"], plan["job_id"], plan["nodes"]) == ("fluxtest", "f7", ["fa", "fb"])
