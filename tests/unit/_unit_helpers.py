"""Helpers shared by the unit tests: recorded environments, the CLI, throwaway plugins."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def fixture_env(name: str, **overrides: str) -> dict[str, str]:
    """The environment recorded in ``fixtures/NAME.json``; ``{fixtures}`` becomes the folder."""
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    env = {k: v.replace("{fixtures}", str(FIXTURES)) for k, v in data["env"].items()}
    env.update(overrides)
    return env


def clean_env(env: Mapping[str, str], pythonpath: tuple[str, ...] = ()) -> dict[str, str]:
    """Only ``env`` plus what Python needs: no scheduler variable of the machine running the tests."""
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8", "HOME": os.environ.get("HOME", "/tmp")}
    base["PYTHONPATH"] = os.pathsep.join((*pythonpath, str(REPO)))
    return {**base, **env}


def run_cli(
    env: Mapping[str, str], *args: str, module: str = "keras_distrib", pythonpath: tuple[str, ...] = (),
    python_flags: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` in a clean environment holding only ``env``."""
    return subprocess.run(
        [sys.executable, *python_flags, "-m", module, *args],
        env=clean_env(env, pythonpath), cwd=REPO, capture_output=True, text=True, timeout=120,
    )


def _write_dist_info(target: Path, dist: str, modules: Mapping[str, str], entry_points: Mapping[str, str]) -> None:
    """What an installer leaves behind, for interpreters without setuptools."""
    for module, source in modules.items():
        (target / f"{module}.py").write_text(source)
    info = target / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[cluster_parsers]\n{lines}")


def install_plugin(
    workdir: Path, dist: str, modules: Mapping[str, str], entry_points: Mapping[str, str]
) -> Path:
    """Build and install a distribution declaring ``[project.entry-points.cluster_parsers]``.

    ``modules`` maps module names to source; returns the ``--target`` folder to put on sys.path.
    """
    src, target = workdir / "src", workdir / "site"
    src.mkdir(parents=True)
    target.mkdir()
    if importlib.util.find_spec("setuptools") is None:  # Python >= 3.12 venvs come without it
        _write_dist_info(target, dist, modules, entry_points)
        return target
    for module, source in modules.items():
        (src / f"{module}.py").write_text(source)
    eps = "\n".join(f'{name} = "{value}"' for name, value in entry_points.items())
    (src / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "0.1"

        [tool.setuptools]
        py-modules = {json.dumps(sorted(modules))}

        [project.entry-points.cluster_parsers]
        """) + eps + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(target), str(src)],
        check=True, capture_output=True, timeout=120,
    )
    return target
