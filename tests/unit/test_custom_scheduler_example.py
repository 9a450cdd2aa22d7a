"""The "writing your own parser" example of docs/schedulers.md (examples/custom_scheduler.py) really works."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
from _unit_helpers import REPO, install_plugin, run_cli
from docs_blocks import docs_block

from cluster_parsers import ClusterConfigError, ClusterParser
from keras_distrib.plan import build_plan

EXAMPLE = REPO / "examples" / "custom_scheduler.py"
ACME_ENV = {"ACME_JOB_ID": "42", "ACME_NODES": "gpu[01-03]", "ACME_NODE_RANK": "2", "ACME_GPUS": "2,3"}


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("custom_scheduler", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_is_short() -> None:
    code = [line for line in EXAMPLE.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(code) <= 45


def test_example_parser_plans_the_job(example: ModuleType) -> None:
    cls = example.AcmeParser
    assert issubclass(cls, ClusterParser) and cls.name == "acme"
    parser = cls(ACME_ENV)
    assert parser.is_present() and not cls({}).is_present()
    job = parser.parse()
    assert (job.node, job.rank, job.gpus) == ("gpu03", 2, ("2", "3"))
    plan = build_plan(job).to_json()
    assert (plan["scheduler"], plan["job_id"], plan["nodes"]) == ("acme", "42", ["gpu01", "gpu02", "gpu03"])
    assert [len(plan["cluster"][j]) for j in ("chief", "ps", "worker")] == [1, 3, 3]
    assert [p["gpus"] for p in plan["processes"] if p["job"] == "worker"] == [["2", "3"]] * 3


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, "ACME_JOB_ID"),
        ({"ACME_JOB_ID": "42"}, "ACME_NODES"),
        ({**ACME_ENV, "ACME_NODES": "gpu[03-01]"}, "ACME_NODES='gpu[03-01]'"),
        ({**ACME_ENV, "ACME_NODE_RANK": "two"}, "ACME_NODE_RANK='two'"),
        ({**ACME_ENV, "ACME_NODE_RANK": "3"}, "rank 3"),
    ],
)
def test_example_parser_bad_input(example: ModuleType, env: dict[str, str], named: str) -> None:
    with pytest.raises(ClusterConfigError, match=named.replace("[", r"\[")):
        example.AcmeParser(env).parse()


def test_example_registered_through_the_entry_point(tmp_path: Path) -> None:
    site = install_plugin(tmp_path, "acme-keras-distrib", {"custom_scheduler": EXAMPLE.read_text()},
                          {"acme": "custom_scheduler:AcmeParser"})
    result = run_cli(ACME_ENV, "--plan", "--format", "json", pythonpath=(str(site),))
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["scheduler"], plan["nodes"]) == ("acme", ["gpu01", "gpu02", "gpu03"])


def test_docs_show_the_tested_example() -> None:
    """The page's code block is the example file's code, so the documentation is tested."""
    code = EXAMPLE.read_text()
    assert docs_block("scheduler-plugin") == code[code.index("from cluster_parsers"):]
