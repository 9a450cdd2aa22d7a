"""pytest-xdist's LoadScope scheduling, grouped by a function of ours and recovering from a
crashed worker.

xdist 3.8's ``LoadScopeScheduling.remove_node`` puts a crashed worker's whole workload back on
the queue, its finished units too. A finished unit is later sent as an empty batch, which never
reports back, so the run stalls with idle workers (pytest-xdist issues 1323, 1327 and 1378).
Here only the units with tests left go back, less the test the worker died in (xdist has
reported it as failed already), and a worker is never left holding a single test: an xdist
worker runs a test only once it holds the next one or has been told to shut down.
"""

from __future__ import annotations

from typing import Any, Callable

from xdist.scheduler import LoadScopeScheduling


def recovering_scheduler(split: Callable[[str], str]) -> type[LoadScopeScheduling]:
    """A LoadScope scheduler whose work units are ``split(nodeid)``."""

    class RecoveringScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return split(nodeid)

        def remove_node(self, node: Any) -> str | None:
            workload = self.assigned_work.get(node, {})
            crashed = next((nodeid for unit in workload.values() for nodeid, done in unit.items() if not done),
                           None)
            if crashed is None:
                return super().remove_node(node)
            del self.assigned_work[node]
            workload[split(crashed)][crashed] = True
            for scope, unit in workload.items():
                if not all(unit.values()):
                    self.workqueue[scope] = unit
            for other in list(self.assigned_work):
                self._reschedule(other)
            return crashed

        def _reschedule(self, node: Any) -> None:
            super()._reschedule(node)
            while not node.shutting_down and self._pending_of(self.assigned_work[node]) < 2:
                if not self.workqueue:
                    node.shutdown()
                    return
                self._assign_work_unit(node)

    return RecoveringScopeScheduling
