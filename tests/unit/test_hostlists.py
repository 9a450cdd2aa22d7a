"""Slurm hostlists and tasks-per-node strings: valid tables, and invalid input naming the variable."""

from __future__ import annotations

import pytest

from cluster_parsers import ClusterConfigError, SlurmParser
from cluster_parsers.base import expand_hosts, expand_tasks_per_node

HOSTLISTS = [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[01-03]", ["n01", "n02", "n03"]),  # zero padding kept
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # padding across a digit boundary
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),  # several bracket groups
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),  # suffix
    ("gpu[1-2].cluster.org", ["gpu1.cluster.org", "gpu2.cluster.org"]),
    ("n[1-2,5,7-8]", ["n1", "n2", "n5", "n7", "n8"]),
    ("n3,n1,n2", ["n3", "n1", "n2"]),  # scheduler order kept, never sorted
    ("n[3,1,2]", ["n3", "n1", "n2"]),
    ("gpu[2-3],cpu[01-02]", ["gpu2", "gpu3", "cpu01", "cpu02"]),
    ("login-a,r[10-11]c[9-10]", ["login-a", "r10c9", "r10c10", "r11c9", "r11c10"]),
]

BAD_HOSTLISTS = ["n[1-", "n[3-1]", "n[]", "n[a-b]", "n[1-2]]", ""]

TASKS = [
    ("1", 1, [1]),
    ("2(x3)", 3, [2, 2, 2]),
    ("2(x3),1", 4, [2, 2, 2, 1]),
    ("3,2(x2)", 3, [3, 2, 2]),
    ("1(x2),4,2(x2)", 5, [1, 1, 4, 2, 2]),
    ("1(x10000)", 10000, [1] * 10000),
]

BAD_TASKS = [
    ("2(x", 1),  # unbalanced
    ("(x3)", 3),  # no count
    ("a", 1),
    ("2,,1", 2),
    ("-1", 1),
    ("2(x3)", 4),  # three nodes described, four in the node list
    ("2(x3),1", 3),
    ("0", 1),  # a node with no task
    ("2(x0)", 1),
]


@pytest.mark.parametrize(("value", "expected"), HOSTLISTS)
def test_expand_hosts(value: str, expected: list[str]) -> None:
    assert expand_hosts("SLURM_STEP_NODELIST", value) == expected


@pytest.mark.parametrize(("value", "expected"), HOSTLISTS)
def test_slurm_parser_uses_the_hostlist_order(value: str, expected: list[str]) -> None:
    env = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": value, "SLURMD_NODENAME": expected[-1]}
    job = SlurmParser(env).parse()
    assert job.nodes == tuple(expected)
    assert job.tasks_per_node == (1,) * len(expected)
    assert job.node_index == len(expected) - 1


@pytest.mark.parametrize("value", BAD_HOSTLISTS)
def test_bad_hostlist_names_variable_and_value(value: str) -> None:
    with pytest.raises(ClusterConfigError) as err:
        expand_hosts("SLURM_STEP_NODELIST", value)
    assert f"SLURM_STEP_NODELIST={value!r}" in err.value.message
    assert err.value.hint


@pytest.mark.parametrize(("value", "num_nodes", "expected"), TASKS)
def test_expand_tasks_per_node(value: str, num_nodes: int, expected: list[int]) -> None:
    assert expand_tasks_per_node("SLURM_STEP_TASKS_PER_NODE", value, num_nodes, "SLURM_STEP_NODELIST") == expected


@pytest.mark.parametrize(("value", "num_nodes"), BAD_TASKS)
def test_bad_tasks_per_node_names_variable_and_value(value: str, num_nodes: int) -> None:
    with pytest.raises(ClusterConfigError) as err:
        expand_tasks_per_node("SLURM_STEP_TASKS_PER_NODE", value, num_nodes, "SLURM_STEP_NODELIST")
    assert f"SLURM_STEP_TASKS_PER_NODE={value!r}" in err.value.message
    assert err.value.hint


def test_tasks_length_mismatch_names_both_variables() -> None:
    with pytest.raises(ClusterConfigError, match="SLURM_STEP_NODELIST has 4") as err:
        expand_tasks_per_node("SLURM_STEP_TASKS_PER_NODE", "2(x3)", 4, "SLURM_STEP_NODELIST")
    assert "3 node(s)" in err.value.message
