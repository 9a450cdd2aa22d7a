"""A YAML host file for machines with no scheduler (and for tests).

Example::

    job_id: demo          # optional; seeds the port range
    gpus: [0, 1]          # optional default for every host
    hosts:
      - node-a            # uses the default gpus
      - {name: node-b, gpus: [2, 3]}
"""

from __future__ import annotations

from typing import Any

import yaml

from ._slots import local_host_index
from .base import GPU_ID, ClusterConfigError, ClusterParser, JobInfo, check_host_names, node_of_rank
from .tasks import launched_tasks, launcher_counts

#: The most tasks per host a hosts file may ask for (a sanity bound, far above any machine).
MAX_TASKS_PER_NODE = 4096


def read_yaml(where: str, path: str) -> Any:
    """The YAML document at ``path``; any unreadable or malformed file is one ClusterConfigError
    that names ``where`` (also used for the launcher's --config file)."""
    try:
        with open(path, "rb") as fh:  # bytes: yaml reports undecodable input as a YAMLError
            return yaml.safe_load(fh)
    except OSError as exc:
        raise ClusterConfigError(f"{where} cannot be read ({exc.strerror}).", "check the path.") from None
    except ValueError as exc:  # a NUL byte in the path
        raise ClusterConfigError(f"{where} is not a usable path ({exc}).", "check the path.") from None
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
        raise ClusterConfigError(f"{where} is not valid YAML ({problem}).", "fix the file's syntax.") from None


class StaticParser(ClusterParser):
    """Hosts from the YAML file named by KERAS_DISTRIB_HOSTS_FILE."""

    name = "static"
    detect_vars = ("KERAS_DISTRIB_HOSTS_FILE",)
    agent_launch_hint = "start one agent per host (tasks_per_node: 1 in the hosts file)."

    hosts_file_var = "KERAS_DISTRIB_HOSTS_FILE"
    rank_var = "KERAS_DISTRIB_RANK"
    allowed_keys = ("job_id", "gpus", "hosts", "tasks_per_node")

    def parse(self) -> JobInfo:
        var, path = self.require(self.hosts_file_var, hint="set KERAS_DISTRIB_HOSTS_FILE=hosts.yaml.")
        where = f"{var}={path!r}"
        data = self._load(where, path)
        default_gpus = self._gpu_list(data.get("gpus", []), where, "gpus")
        nodes: list[str] = []
        node_gpus: list[tuple[str, ...]] = []
        for entry in data["hosts"]:
            if isinstance(entry, str):
                nodes.append(entry)
                node_gpus.append(default_gpus)
            elif isinstance(entry, dict) and isinstance(entry.get("name"), str) and set(entry) <= {"name", "gpus"}:
                nodes.append(entry["name"])
                node_gpus.append(self._gpu_list(entry.get("gpus", default_gpus), where, f"gpus of {entry['name']}"))
            else:
                raise ClusterConfigError(
                    f"{where}: host entry {entry!r} is neither a name nor {{name: ..., gpus: [...]}}.",
                    "list hosts as '- node1' or '- {name: node1, gpus: [0, 1]}'.",
                )
        check_host_names(where, nodes)
        if len(set(nodes)) != len(nodes):
            raise ClusterConfigError(f"{where} lists a host twice.", "list each host once; use tasks_per_node for more tasks.")
        per_node = data.get("tasks_per_node", 1)
        if isinstance(per_node, bool) or not isinstance(per_node, int) or not 1 <= per_node <= MAX_TASKS_PER_NODE:
            raise ClusterConfigError(
                f"{where}: tasks_per_node {per_node!r} is not a whole number from 1 to {MAX_TASKS_PER_NODE}.",
                "write e.g. 'tasks_per_node: 1' (one agent per host).",
            )
        job_id = data.get("job_id", "static")
        if isinstance(job_id, bool) or not isinstance(job_id, (str, int)) or not str(job_id).strip():
            raise ClusterConfigError(f"{where}: job_id {job_id!r} is not a name or number.", "write e.g. 'job_id: demo'.")
        tasks_per_node = tuple(per_node for _ in nodes)
        source = f"{where} tasks_per_node={per_node}"
        if launcher_counts(self.env) is not None:
            tasks = launched_tasks(self.env, nodes, tasks_per_node, source, self.agent_launch_hint)
            rank, local_rank, node_index, tasks_per_node, source = (
                tasks.rank, tasks.local_rank, tasks.node_index, tasks.tasks_per_node, tasks.source
            )
        elif self.env.get(self.rank_var):
            rank = self.int_var(self.rank_var, minimum=0)
            node_index, local_rank = node_of_rank(rank, tasks_per_node)
        else:
            node_index = local_host_index(nodes, self.env) or 0
            rank, local_rank = node_index * per_node, 0
        return JobInfo(
            scheduler=self.name,
            job_id=str(job_id),
            nodes=tuple(nodes),
            tasks_per_node=tasks_per_node,
            rank=rank,
            local_rank=local_rank,
            node_index=node_index,
            tasks_source=source,
            node_gpus=tuple(node_gpus),
        )

    def _load(self, where: str, path: str) -> dict[str, Any]:
        data = read_yaml(where, path)
        if not isinstance(data, dict) or not isinstance(data.get("hosts"), list) or not data["hosts"]:
            raise ClusterConfigError(f"{where} has no 'hosts' list.", "add 'hosts: [node1, node2]'.")
        unknown = sorted(str(k) for k in set(data) - set(self.allowed_keys))
        if unknown:
            raise ClusterConfigError(
                f"{where} has unknown key(s) {', '.join(unknown)}.",
                f"valid keys are {', '.join(self.allowed_keys)}.",
            )
        return data

    @staticmethod
    def _gpu_list(value: Any, where: str, key: str) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(
            isinstance(g, (int, str)) and not isinstance(g, bool) and GPU_ID.fullmatch(str(g).strip())
            for g in value
        ):
            raise ClusterConfigError(f"{where}: {key} {value!r} is not a list of GPU ids.", "write gpus: [0, 1].")
        return tuple(str(g).strip() for g in value)
