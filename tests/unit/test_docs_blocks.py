"""Every code block of the documentation is run by a test, or says why it cannot be.

The marker rules are in tests/docs_blocks.py. The blocks that need no TensorFlow run here;
the training scripts run in tests/local (test_examples_local.py, test_jax_layout.py) and the
file recipe in tests/unit/test_data.py.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from _unit_helpers import REPO, fixture_env, run_cli
from docs_blocks import all_blocks, command_lines, docs_block, pages

from keras_distrib.launcher.options import Options, load_config, validate

BLOCKS = all_blocks()


def test_every_block_is_run_or_says_why() -> None:
    unmarked = [b.where() for b in BLOCKS if b.kind is None]
    assert not unmarked, ("code blocks without a '<!-- run: ID -->' or '<!-- not-run: REASON -->' "
                          f"line before them: {unmarked}")
    vague = [b.where() for b in BLOCKS if b.kind == "not-run" and len(b.value) < 12]
    assert not vague, f"say why these blocks cannot run: {vague}"


def test_each_run_id_is_unique_and_run_by_a_test() -> None:
    ids = [b.value for b in BLOCKS if b.kind == "run"]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    tests = "\n".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py"))
    unused = [i for i in ids if not re.search(rf"(docs_block|command_lines)\(\s*\"{re.escape(i)}\"", tests)]
    assert not unused, f"no test calls docs_block() for these blocks: {unused}"


def test_repeated_blocks_equal_their_original() -> None:
    for block in (b for b in BLOCKS if b.kind == "same-as"):
        assert block.code == docs_block(block.value), f"{block.where()} differs from the block '{block.value}'"


def test_file_blocks_equal_their_file() -> None:
    for block in (b for b in BLOCKS if b.kind == "file"):
        assert block.code == (REPO / block.value).read_text(), f"{block.where()} differs from {block.value}"


def test_config_example_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "launch.yaml"
    path.write_text(docs_block("config-example"))
    values = load_config(str(path))
    options = validate(Options().merged(values))
    assert (options.layout, options.interface, options.max_restarts, options.requeue) == ("allreduce", "ib0", 5, True)


def test_hosts_file_example_plans_a_job(tmp_path: Path) -> None:
    path = tmp_path / "hosts.yaml"
    path.write_text(docs_block("hosts-file"))
    out = run_cli({"KERAS_DISTRIB_HOSTS_FILE": str(path), "KERAS_DISTRIB_RANK": "1"}, "--plan", "--format", "json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert (plan["scheduler"], plan["job_id"], plan["nodes"]) == ("static", "demo", ["node-a", "node-b"])
    gpus = {p["node"]: p["gpus"] for p in plan["processes"] if p["job"] == "worker"}
    assert gpus == {"node-a": ["0", "1"], "node-b": ["2", "3"]}


def test_entry_point_block_registers_the_example_parser() -> None:
    toml = tomllib.loads(docs_block("scheduler-entry-point"))
    assert toml["project"]["entry-points"]["cluster_parsers"] == {"acme": "custom_scheduler:AcmeParser"}


def test_make_demo_runs_the_first_local_job() -> None:
    """`make demo` (the block make-demo) runs the command of first-local-job, which tests/local runs."""
    assert command_lines("make-demo") == [["make", "demo"]]
    recipe = re.search(r"^demo:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert recipe.replace("$(PY)", "python").split() == command_lines("first-local-job")[0]


def test_readme_is_a_front_door() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "\nmake demo\n" in readme and "\nmake test\n" in readme  # .ci/run runs `make test`
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert all((REPO / link).exists() for link in links), links
    site_pages = {p.relative_to(REPO).as_posix() for p in pages() if p.parent != REPO and p.name != "README.md"}
    assert not site_pages - set(links), f"pages the README does not link: {sorted(site_pages - set(links))}"


def test_every_page_is_in_the_nav() -> None:
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)

    def walk(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [p for v in nav.values() for p in walk(v)]
        return [p for v in nav for p in walk(v)] if isinstance(nav, list) else []
    in_nav = set(walk(config["nav"]))
    on_disk = {p.relative_to(REPO / "docs").as_posix() for p in pages() if p.name != "README.md"}
    assert on_disk - {"README.md"} == in_nav


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in pages()])
def test_lists_start_after_a_blank_line(page: str) -> None:
    """Python-Markdown (MkDocs) reads a list glued to the line above as part of that paragraph."""
    lines = (REPO / page).read_text().splitlines()
    fence = False
    for i, line in enumerate(lines[1:], 1):
        fence ^= line.lstrip().startswith("```")
        prev = lines[i - 1]
        if not fence and re.match(r"(- |\d+\. )", line) and prev.strip() and not re.match(r"(\s*- |\s*\d+\. |\s)", prev):
            raise AssertionError(f"{page}:{i + 1}: a list right after {prev!r}: put a blank line between")


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in pages()])
def test_python_blocks_compile(page: str) -> None:
    for block in (b for b in BLOCKS if b.page == page and b.lang == "python"):
        compile(block.code, block.where(), "exec")


def test_heterogeneous_plan_example_is_what_plan_prints() -> None:
    out = run_cli(fixture_env("slurm_het_batch"), "--plan")
    assert out.returncode == 0, out.stderr
    assert out.stdout == docs_block("het-plan")
