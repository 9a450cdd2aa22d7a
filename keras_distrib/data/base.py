"""The protocol every source honours, and the base class that gives the shared behaviour.

The trainers only ever call what `Source` declares: ``num_examples`` and ``batched`` to
count steps, ``epoch_elements`` for one epoch of one shard, ``finish_batches`` after
the pipeline batched it (`keras_distrib.data.pipeline`), ``shard_sizes`` where each
shard's size is fixed and known before the epoch, and ``on_epoch_begin`` /
``on_epoch_end`` around each training epoch (a Keras PyDataset's hooks). What only some
sources can do is asked, never inferred from their class: ``split`` (``validation_split``),
``count_unknown_size``, and the two forms a parameter-server hand-out cuts parts from,
``rows_in_memory`` and ``dataset_of_known_size``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from .policy import Order

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf


class InputError(ValueError):
    """An input keras_distrib cannot take, or takes only in another form; ends with a HINT."""


class Source(Protocol):
    """Something the trainers can split into per-worker datasets."""

    #: Number of elements (examples, or batches when ``batched``); None if unknown.
    num_examples: int | None
    #: True if elements are already batches (the trainer then does not batch again).
    batched: bool
    #: True if each shard yields the same number of elements every epoch, even where that
    #: number is unknown before the first (files dealt whole to workers): the trainers
    #: then count it in the first epoch that runs whole and rely on it from then on.
    same_shard_sizes_every_epoch: bool

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        """Shard ``index`` of ``num_shards``, in the source's own order (epoch 0)."""
        ...

    def epoch_elements(self, index: int, num_shards: int, order: Order) -> "tf.data.Dataset":
        """One epoch of shard ``index``, in the order ``order`` asks (or the source's own)."""
        ...

    def finish_batches(self, batches: "tf.data.Dataset") -> "tf.data.Dataset":
        """What the pipeline's batches become (identity unless the source parses batches)."""
        ...

    def shard_sizes(self, num_shards: int) -> list[int] | None:
        """Elements in each of ``num_shards`` shards of every epoch, where that is fixed and
        known before the epoch (the same every epoch); else None."""
        ...

    def on_epoch_begin(self, epoch: int) -> None:
        """Called by fit before each training epoch (in every process running the loop)."""
        ...

    def on_epoch_end(self, epoch: int) -> None:
        """Called by fit after each training epoch's steps."""
        ...

    def split(self, at: int) -> "tuple[Source, Source] | None":
        """(the first ``at`` examples, the rest), as Keras' ``validation_split`` cuts them;
        None where the source cannot be cut by rows."""
        ...

    def count_unknown_size(self) -> bool:
        """Learn ``num_examples`` by one pass where it is unknown and finite; True if counted."""
        ...

    def rows_in_memory(self) -> Any | None:
        """The unbatched arrays every worker may gather rows from by index; else None."""
        ...

    def dataset_of_known_size(self) -> "tf.data.Dataset | None":
        """The dataset, where it has a known size and no Python in its pipeline (it can be
        rebuilt in any process and cut by element); else None."""
        ...


class BaseSource:
    """Defaults for a `Source`: a per-shard shuffle by `Order`, batches used as they are."""

    num_examples: int | None = None
    batched: bool = False
    same_shard_sizes_every_epoch: ClassVar[bool] = False

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":  # pragma: no cover - abstract
        raise NotImplementedError

    def epoch_elements(self, index: int, num_shards: int, order: Order) -> "tf.data.Dataset":
        return order.apply(self.shard(index, num_shards), index)

    def finish_batches(self, batches: "tf.data.Dataset") -> "tf.data.Dataset":
        return batches

    def shard_sizes(self, num_shards: int) -> list[int] | None:
        return None

    def on_epoch_begin(self, epoch: int) -> None:
        pass

    def on_epoch_end(self, epoch: int) -> None:
        pass

    def split(self, at: int) -> "tuple[Source, Source] | None":
        return None

    def count_unknown_size(self) -> bool:
        return False

    def rows_in_memory(self) -> Any | None:
        return None

    def dataset_of_known_size(self) -> "tf.data.Dataset | None":
        return None


class CustomSource(BaseSource):
    """A user's own object with ``shard(index, num_shards)``, ``num_examples`` and ``batched``
    (the minimal source of earlier releases), given the rest of the protocol."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_examples = inner.num_examples
        self.batched = bool(getattr(inner, "batched", False))

    def shard(self, index: int, num_shards: int) -> "tf.data.Dataset":
        return self.inner.shard(index, num_shards)

    def finish_batches(self, batches: "tf.data.Dataset") -> "tf.data.Dataset":
        finish = getattr(self.inner, "finish_batches", None)
        return batches if finish is None else finish(batches)
