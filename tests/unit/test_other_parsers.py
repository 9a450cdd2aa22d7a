"""PBS, SGE, LSF and static parsers, and ranks taken from an MPI launcher."""

from __future__ import annotations

from pathlib import Path

import pytest
from _unit_helpers import FIXTURES, fixture_env

from cluster_parsers import ClusterConfigError, JobInfo, LsfParser, PbsParser, SgeParser, StaticParser
from cluster_parsers.tasks import LAUNCHERS, mpi_rank

# Host names that cannot be the machine running the tests, so host-name matching is decided by HOSTNAME.
PBS_NODES = ("cn07", "cn03", "cn05")  # PBS_NODEFILE order, not sorted


def placed(job: JobInfo) -> tuple[int, int, int]:
    return job.rank, job.node_index, job.local_rank


# --- PBS ------------------------------------------------------------------------------


def test_pbs_job_script() -> None:
    job = PbsParser(fixture_env("pbs_job")).parse()
    assert (job.scheduler, job.job_id) == ("pbs", "1234.server")
    assert job.nodes == PBS_NODES
    assert job.tasks_per_node == (4, 4, 2)  # one nodefile line per slot
    assert placed(job) == (0, 0, 0)
    assert not job.tasks_launched  # the job script itself, no task launcher
    assert "PBS_NODEFILE" in job.tasks_source


@pytest.mark.parametrize(
    ("rank_env", "expected"),
    [
        ({"PBS_VNODENUM": "5"}, (5, 1, 1)),  # pbsdsh task on slot 5: second slot of cn03
        ({"PBS_VNODENUM": "", "PBS_TASKNUM": "9"}, (8, 2, 0)),  # PBS_TASKNUM is 1-based
        ({"PBS_VNODENUM": "", "PBS_TASKNUM": "", "PBS_NODENUM": "2"}, (8, 2, 0)),
        ({"PBS_VNODENUM": "", "PBS_TASKNUM": "", "PBS_NODENUM": "", "HOSTNAME": "cn03"}, (4, 1, 0)),
        ({"PBS_VNODENUM": "", "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (9, 2, 1)),
    ],
)
def test_pbs_rank_sources(rank_env: dict[str, str], expected: tuple[int, int, int]) -> None:
    assert placed(PbsParser(fixture_env("pbs_job", **rank_env)).parse()) == expected


def test_pbs_mpi_launch_counts_as_launched_tasks() -> None:
    env = fixture_env("pbs_job", PBS_VNODENUM="", PMI_RANK="3")
    assert PbsParser(env).parse().tasks_launched


def test_pbs_gpus_from_cuda_visible_devices() -> None:
    job = PbsParser(fixture_env("pbs_job", CUDA_VISIBLE_DEVICES="2,3")).parse()
    assert job.node_gpus == (("2", "3"),) * 3


# --- SGE ------------------------------------------------------------------------------


def test_sge_pe_hostfile() -> None:
    job = SgeParser(fixture_env("sge_job")).parse()
    assert (job.scheduler, job.job_id) == ("sge", "77")
    assert (job.nodes, job.tasks_per_node) == (("n1", "n2", "n3"), (2, 2, 2))
    assert not job.tasks_launched


@pytest.mark.parametrize(
    ("rank_env", "expected"),
    [
        ({"HOSTNAME": "n2"}, (2, 1, 0)),  # qrsh -inherit n2 ...: placed by host name
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (5, 2, 1)),
        ({"PMI_RANK": "3"}, (3, 1, 1)),
    ],
)
def test_sge_rank_sources(rank_env: dict[str, str], expected: tuple[int, int, int]) -> None:
    assert placed(SgeParser(fixture_env("sge_job", **rank_env)).parse()) == expected


@pytest.mark.parametrize(
    ("gpu_env", "expected"),
    [({"CUDA_VISIBLE_DEVICES": "2,3"}, ("2", "3")), ({"SGE_HGR_gpu": "1 3"}, ("1", "3")), ({}, ())],
)
def test_sge_gpus(gpu_env: dict[str, str], expected: tuple[str, ...]) -> None:
    assert SgeParser(fixture_env("sge_job", **gpu_env)).parse().gpus == expected


@pytest.mark.parametrize(
    ("env", "present"),
    [
        ({"SGE_ROOT": "/var/lib/gridengine"}, False),  # a submit host outside any job
        ({"SGE_ROOT": "/var/lib/gridengine", "JOB_ID": "1"}, True),
        ({"PE_HOSTFILE": "/tmp/x"}, True),
    ],
)
def test_sge_detection(env: dict[str, str], present: bool) -> None:
    assert SgeParser(env).is_present() is present


# --- LSF ------------------------------------------------------------------------------


def test_lsf_mcpu_hosts() -> None:
    job = LsfParser(fixture_env("lsf_mcpu")).parse()
    assert (job.scheduler, job.job_id) == ("lsf", "5150")
    assert (job.nodes, job.tasks_per_node) == (("hostA", "hostB"), (4, 4))
    assert not job.tasks_launched


def test_lsf_jsrun_task() -> None:
    job = LsfParser(fixture_env("lsf_jsrun")).parse()
    assert (job.nodes, job.tasks_per_node) == (("hostA", "hostB"), (4, 4))
    assert placed(job) == (5, 1, 1)
    assert job.tasks_launched
    assert job.gpus == ("0", "1")


def test_lsf_hostfile_wins_over_mcpu_hosts(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("hostC\nhostC\nhostA\n")
    env = fixture_env("lsf_mcpu", LSB_DJOB_HOSTFILE=str(hostfile))
    assert LsfParser(env).parse().nodes == ("hostC", "hostA")


@pytest.mark.parametrize(
    ("rank_env", "expected"),
    [({"HOSTNAME": "hostB"}, (4, 1, 0)), ({"PMIX_RANK": "6"}, (6, 1, 2))],
)
def test_lsf_rank_sources(rank_env: dict[str, str], expected: tuple[int, int, int]) -> None:
    assert placed(LsfParser(fixture_env("lsf_mcpu", **rank_env)).parse()) == expected


# --- static ---------------------------------------------------------------------------


def test_static_hosts_file() -> None:
    job = StaticParser({"KERAS_DISTRIB_HOSTS_FILE": str(FIXTURES / "static_hosts.yaml")}).parse()
    assert (job.scheduler, job.job_id) == ("static", "demo")
    assert (job.nodes, job.tasks_per_node) == (("ws-alpha", "ws-beta"), (1, 1))
    assert job.node_gpus == (("0", "1"), ("2", "3"))  # default list, then the host's own


@pytest.mark.parametrize(
    ("rank_env", "expected"),
    [({"KERAS_DISTRIB_RANK": "1"}, (1, 1, 0)), ({"PMI_RANK": "1"}, (1, 1, 0)), ({"HOSTNAME": "ws-beta"}, (1, 1, 0))],
)
def test_static_rank_sources(rank_env: dict[str, str], expected: tuple[int, int, int]) -> None:
    env = {"KERAS_DISTRIB_HOSTS_FILE": str(FIXTURES / "static_hosts.yaml"), **rank_env}
    assert placed(StaticParser(env).parse()) == expected


def test_static_minimal_file(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yaml"
    path.write_text("hosts: [a1, a2, a3]\ntasks_per_node: 2\n")
    job = StaticParser({"KERAS_DISTRIB_HOSTS_FILE": str(path)}).parse()
    assert (job.job_id, job.nodes, job.tasks_per_node, job.node_gpus) == ("static", ("a1", "a2", "a3"), (2, 2, 2), ((),) * 3)


# --- MPI rank variables ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OMPI_COMM_WORLD_RANK": "7", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}, (7, 3)),
        ({"OMPI_COMM_WORLD_RANK": "7", "PMIX_RANK": "7"}, (7, 0)),  # Open MPI sets both
        ({"PMIX_RANK": "4", "MPI_LOCALRANKID": "1"}, (4, 1)),
        ({"PMI_RANK": "2", "MPI_LOCALRANKID": "0"}, (2, 0)),  # MPICH / Intel MPI
        ({"PMIX_RANK": "4", "PMI_RANK": "9"}, (4, 0)),
        ({}, None),
    ],
)
def test_mpi_rank(env: dict[str, str], expected: tuple[int, int] | None) -> None:
    assert mpi_rank(env) == expected


@pytest.mark.parametrize("env", [{"PMI_RANK": "x"}, {"OMPI_COMM_WORLD_RANK": "-1"}, {"PMI_RANK": "3", "PMI_SIZE": "2"}])
def test_malformed_launcher_variables_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(ClusterConfigError, match=next(iter(env))):
        mpi_rank(env)


def test_jsrun_then_open_mpi_are_read_first() -> None:
    # jsrun (Spectrum MPI) also sets OMPI_COMM_WORLD_*; mpirun also sets PMIX_RANK.
    assert [v.rank for v in LAUNCHERS[:2]] == ["JSM_NAMESPACE_RANK", "OMPI_COMM_WORLD_RANK"]


# --- bad input ------------------------------------------------------------------------


def bad_files(tmp_path: Path) -> dict[str, Path]:
    files = {"empty": tmp_path / "empty", "sge_bad": tmp_path / "sge_bad", "yaml_bad": tmp_path / "bad.yaml",
             "yaml_key": tmp_path / "key.yaml", "yaml_entry": tmp_path / "entry.yaml", "yaml_nohosts": tmp_path / "nohosts.yaml"}
    files["empty"].write_text("\n# nothing\n")
    files["sge_bad"].write_text("n1 two all.q@n1 UNDEFINED\n")
    files["yaml_bad"].write_text("hosts: [a, b\n")
    files["yaml_key"].write_text("hosts: [a]\nnodes: 2\n")
    files["yaml_entry"].write_text("hosts: [{gpus: [0]}]\n")
    files["yaml_nohosts"].write_text("job_id: 1\n")
    return files


STATIC = "KERAS_DISTRIB_HOSTS_FILE"
BAD = [
    # (parser, env, text the message must contain); {name} is a file from bad_files, {dir} tmp_path
    (PbsParser, {"PBS_JOBID": "1.s"}, "PBS_NODEFILE is not set"),
    (PbsParser, {"PBS_JOBID": "1.s", "PBS_NODEFILE": "{dir}/missing"}, "PBS_NODEFILE='{dir}/missing' cannot be read"),
    (PbsParser, {"PBS_JOBID": "1.s", "PBS_NODEFILE": "{dir}"}, "PBS_NODEFILE='{dir}' cannot be read"),
    (PbsParser, {"PBS_JOBID": "1.s", "PBS_NODEFILE": "{empty}"}, "PBS_NODEFILE='{empty}' is empty"),
    (PbsParser, {"PBS_JOBID": "1.s", "PBS_NODEFILE": str(FIXTURES / "pbs_nodefile"), "PBS_VNODENUM": "10"}, "PBS_NODEFILE"),
    (PbsParser, {"PBS_JOBID": "1.s", "PBS_NODEFILE": str(FIXTURES / "pbs_nodefile"), "PBS_VNODENUM": "a"}, "PBS_VNODENUM='a'"),
    (SgeParser, {"JOB_ID": "7"}, "PE_HOSTFILE is not set"),
    (SgeParser, {"JOB_ID": "7", "PE_HOSTFILE": "{dir}/missing"}, "PE_HOSTFILE='{dir}/missing' cannot be read"),
    (SgeParser, {"JOB_ID": "7", "PE_HOSTFILE": "{sge_bad}"}, "PE_HOSTFILE='{sge_bad}' has a malformed line"),
    (SgeParser, {"JOB_ID": "7", "PE_HOSTFILE": str(FIXTURES / "sge_pe_hostfile"), "NSLOTS": "8"}, "NSLOTS=8"),
    (SgeParser, {"JOB_ID": "7", "PE_HOSTFILE": str(FIXTURES / "sge_pe_hostfile"), "PMI_RANK": "6"}, "PMI_RANK=6"),
    (LsfParser, {"LSB_JOBID": "1"}, "LSB_MCPU_HOSTS"),
    (LsfParser, {"LSB_JOBID": "1", "LSB_MCPU_HOSTS": "hostA four"}, "LSB_MCPU_HOSTS='hostA four'"),
    (LsfParser, {"LSB_JOBID": "1", "LSB_DJOB_HOSTFILE": "{dir}/missing"}, "LSB_DJOB_HOSTFILE='{dir}/missing'"),
    (LsfParser, {"LSB_JOBID": "1", "LSB_MCPU_HOSTS": "a 2", "JSM_NAMESPACE_RANK": "0", "JSM_NAMESPACE_SIZE": "4"},
     "JSM_NAMESPACE_SIZE=4"),
    (StaticParser, {}, f"{STATIC} is not set"),
    (StaticParser, {STATIC: "{dir}/missing"}, f"{STATIC}='{{dir}}/missing' cannot be read"),
    (StaticParser, {STATIC: "{yaml_bad}"}, "is not valid YAML"),
    (StaticParser, {STATIC: "{yaml_key}"}, "unknown key(s) nodes"),
    (StaticParser, {STATIC: "{yaml_entry}"}, "host entry"),
    (StaticParser, {STATIC: "{yaml_nohosts}"}, "no 'hosts' list"),
    (StaticParser, {STATIC: str(FIXTURES / "static_hosts.yaml"), "KERAS_DISTRIB_RANK": "2"}, "rank 2"),
]


@pytest.mark.parametrize(("parser", "env", "named"), BAD, ids=lambda v: v.name if isinstance(v, type) else None)
def test_bad_input_names_variable(tmp_path: Path, parser: type, env: dict[str, str], named: str) -> None:
    names = {k: str(v) for k, v in bad_files(tmp_path).items()} | {"dir": str(tmp_path)}
    env = {k: v.format(**names) for k, v in env.items()}
    with pytest.raises(ClusterConfigError) as err:
        parser(env).parse()
    assert named.format(**names) in err.value.message
    assert err.value.hint
