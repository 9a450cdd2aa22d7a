"""Keras preprocessing layers that hold a lookup table, under the parameter-server strategy.

``StringLookup``, ``IntegerLookup`` and ``TextVectorization`` keep their vocabulary in a
``tf.lookup.StaticHashTable``. Created under ``ParameterServerStrategy.scope()`` (in the
``model_fn`` given to `keras_distrib.trainers.placement.build`), TensorFlow makes it a
``DistributedTable``: one copy per worker, and a traced step looks up the copy of the
worker it runs on (the trainer keeps that working inside its guarded steps, see
`_private_apis.call_time_captures_in_outer_function`). A table created outside the scope
stays on the chief: training still works, but every step of every worker then looks up
on the chief, one network round trip per step. ``Hashing`` and ``Discretization`` hold
no table.
"""

from __future__ import annotations

import logging
from typing import Any

from . import _private_apis as private

logger = logging.getLogger(__name__)


def tables_on_this_process(model: Any) -> list[str]:
    """Names of ``model``'s layers whose lookup table is not a per-worker copy."""
    names = []
    for layer in private.sublayers(model):
        table = getattr(layer, "lookup_table", None)
        if table is not None and not getattr(table, "is_distributed_table", False):
            names.append(layer.name)
    return names


def warn_tables_on_the_chief(model: Any) -> None:
    """One line when a lookup layer's table was created outside the strategy's scope."""
    names = tables_on_this_process(model)
    if names:
        tables = "the lookup table of layer" if len(names) == 1 else "the lookup tables of layers"
        logger.warning(f"{tables} {', '.join(names)} {'was' if len(names) == 1 else 'were'} created outside "
                       "strategy.scope(): on the chief, where every step of every worker looks them up. HINT: create "
                       "(and adapt) the layers inside the model_fn given to "
                       "keras_distrib.trainers.placement.build(model_fn, strategy).")
