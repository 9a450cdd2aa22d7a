"""Reference tables generated from the code: the command line, the config keys, the contract.

Nothing here is written twice: the flags come from ``keras_distrib.launcher.cli.arg_parser``
(the parser the launcher runs), the config keys and defaults from the ``Options`` dataclass
(which the config validation also reads), the environment contract from ``contract.VARIABLES``. None of these imports TensorFlow.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _cell(text: str) -> str:
    return text.replace("|", r"\|").replace("\n", " ")


def cli_options() -> str:
    """Every flag of ``python -m keras_distrib[.slurm|...]`` and of local mode, one row each."""
    from keras_distrib.launcher.cli import arg_parser
    from keras_distrib.launcher.options import Options

    keys = {f.name for f in fields(Options)}
    cluster = arg_parser("python -m keras_distrib")
    local = arg_parser("python -m keras_distrib.local", local=True)
    local_only = {a.dest for a in local._actions} - {a.dest for a in cluster._actions}
    rows = ["| flag | config key | where | meaning |", "|---|---|---|---|"]
    seen: set[str] = set()
    for action in [*cluster._actions, *local._actions]:
        if isinstance(action, argparse._HelpAction) or action.dest in seen:
            continue
        seen.add(action.dest)
        if action.option_strings:
            flag = ", ".join(action.option_strings)
            if action.nargs != 0:
                metavar = action.metavar or (("{" + ",".join(action.choices) + "}") if action.choices else action.dest.upper())
                flag += f" {metavar}"
        else:
            flag = action.metavar or action.dest
        key = action.dest.replace("_", "-") if action.dest in keys else ""
        where = "local mode only" if action.dest in local_only else "cluster only" if action.dest == "scheduler" else "all"
        rows.append(f"| `{flag}` | {f'`{key}`' if key else ''} | {where} | {_cell(action.help or '')} |")
    return "\n".join(rows)


def config_keys() -> str:
    """The keys of a ``--config FILE``, with their types and defaults (the ``Options`` fields)."""
    from keras_distrib.launcher.options import LAYOUTS, Options, _describe, json_scalar

    hints = typing.get_type_hints(Options)
    rows = ["| key | value | default |", "|---|---|---|"]
    for f in fields(Options):
        default = f.default if f.default is not MISSING else None
        shown = "(none)" if default is None else json_scalar(default)
        kind = "one of " + ", ".join(f"`{v}`" for v in LAYOUTS) if f.name == "layout" else _describe(hints[f.name])
        rows.append(f"| `{f.name.replace('_', '-')}` | {kind} | `{shown}` |")
    return "\n".join(rows)


def contract_table() -> str:
    """The variables a child may get: ``contract.VARIABLES``, the table ``child_env`` is checked against."""
    from keras_distrib.contract import VARIABLES

    rows = ["| variable | what it holds |", "|---|---|"]
    rows += [f"| `{name}` | {_cell(text)} |" for name, text in VARIABLES.items()]
    return "\n".join(rows)


def schedulers() -> str:
    """The built-in parsers in detection order: entry point, what detects them, how to start agents."""
    from cluster_parsers.registry import BUILTIN_PARSERS
    def requeue(cls: type) -> str:
        if cls.reschedule_exit_code is not None:
            return f"exit code {cls.reschedule_exit_code} ({cls.name.upper()} reschedules the job)"
        if cls.requeue_command is None:
            return "nothing (no requeue)"
        return f"`{' '.join(cls.requeue_command)} ${cls.job_id_vars[0]}`"

    def ends(cls: type) -> str:
        if cls.end_command is None:
            return "nothing"
        ids = f"${cls.job_id_vars[0]}" + (f".${cls.step_id_var}" if cls.step_id_var else "")
        return f"`{' '.join(cls.end_command)} {ids}`"

    rows = ["| scheduler | entry point | detected by | one agent per node | `--requeue` runs | a lost node without `--requeue` runs |",
            "|---|---|---|---|---|---|"]
    for cls in BUILTIN_PARSERS:
        module = REPO / "keras_distrib" / f"{cls.name}.py"
        entry = f"`python -m keras_distrib.{cls.name}`" if module.exists() else "`python -m keras_distrib`"
        detected = ", ".join(f"`{v}`" for v in cls.detect_vars)
        rows.append(f"| `{cls.name}` | {entry} | {detected} | {_cell(cls.agent_launch_hint)} | "
                    f"{requeue(cls)} | {ends(cls)} |")
    return "\n".join(rows)


def public_api() -> str:
    """A mkdocstrings block for every name ``import keras_distrib`` offers (its lazy table)."""
    from keras_distrib import _LAZY

    return "\n\n".join(f"::: {module}.{attr}" for module, attr in _LAZY.values())


GENERATORS = {"cli-options": cli_options, "config-keys": config_keys, "contract": contract_table,
              "schedulers": schedulers, "public-api": public_api}
