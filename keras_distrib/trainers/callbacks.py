"""Callback handling: Keras' own CallbackList and ProgbarLogger, and quiet non-chief workers."""

from __future__ import annotations

import os
from typing import Any, Sequence

from . import _private_apis as private


def resolve_verbose(verbose: Any) -> int:
    """Keras' rule: "auto" means 1."""
    return 1 if verbose == "auto" else int(verbose)


def callback_list(callbacks: Sequence[Any] | None, model: Any, *, epochs: int, steps: int | None,
                  verbose: int, show: bool) -> Any:
    """A ``keras.callbacks.CallbackList`` with History and (when shown) Keras' ProgbarLogger,
    exactly as ``model.fit`` builds it; ``show=False`` (non-chief workers) means no bar."""
    import keras

    verbose = verbose if show else 0
    return keras.callbacks.CallbackList(
        list(callbacks or []), add_history=True, add_progbar=verbose != 0, model=model,
        epochs=epochs, steps=steps, verbose=verbose,
    )


def needs_batch_logs(callbacks: Any) -> bool:
    """True if someone reads per-batch logs: a callback overriding a batch hook, or a bar."""
    import keras

    base = keras.callbacks.Callback
    hooks = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end",
             "on_test_batch_end")
    for cb in callbacks.callbacks:
        if isinstance(cb, keras.callbacks.ProgbarLogger):
            if cb.verbose in (1, "auto"):
                return True
            continue
        if any(getattr(type(cb), h, None) is not getattr(base, h) for h in hooks):
            return True
    return False


def redirect_writers(callbacks: Sequence[Any], tmpdir: str) -> None:
    """Point file-writing callbacks of a non-chief worker into ``tmpdir``."""
    import keras

    for i, cb in enumerate(callbacks):
        sub = os.path.join(tmpdir, f"cb{i}")
        if isinstance(cb, keras.callbacks.ModelCheckpoint):
            cb.filepath = os.path.join(sub, os.path.basename(str(cb.filepath)))
        elif isinstance(cb, keras.callbacks.CSVLogger):
            cb.filename = os.path.join(sub, os.path.basename(str(cb.filename)))
        elif isinstance(cb, keras.callbacks.TensorBoard):
            cb.log_dir = sub
            private.redirect_tensorboard(cb, sub)
        elif isinstance(cb, keras.callbacks.BackupAndRestore):
            cb.backup_dir = sub
        else:
            continue
        os.makedirs(sub, exist_ok=True)


def _stateful_attributes(callback: Any) -> tuple[str, ...]:
    """What a Keras callback remembers from earlier epochs and resets in on_train_begin."""
    import keras

    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        return ("best",)
    if isinstance(callback, keras.callbacks.EarlyStopping):
        return ("best", "wait", "best_epoch")
    if isinstance(callback, keras.callbacks.ReduceLROnPlateau):
        return ("best", "wait", "cooldown_counter")
    if isinstance(callback, keras.callbacks.History):
        return ("epoch", "history")
    return ()


def with_history(callbacks: Sequence[Any] | None) -> list[Any]:
    """The user's callbacks and, last, the History ``fit`` returns (unless they pass one): its
    epochs are saved with a checkpoint, so a resumed fit (or a finished one run again) returns
    every epoch's logs, as one uninterrupted ``model.fit`` would."""
    import keras

    out = list(callbacks or [])
    if not any(isinstance(cb, keras.callbacks.History) for cb in out):
        out.append(keras.callbacks.History())
    return out


def _plain(value: Any) -> Any:
    """JSON: a number (numpy scalars and tensors too), None, or lists and dicts of them (History's)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return float(value)


def _restored(attr: str, value: Any) -> Any:
    if attr == "best" or value is None:
        return value
    if attr == "epoch" and isinstance(value, list):  # History's epochs done
        return [int(v) for v in value]
    return value if isinstance(value, dict) else int(value)


def callback_state(callbacks: Sequence[Any]) -> list[dict[str, Any]]:
    """Resume state of ModelCheckpoint (best), EarlyStopping and ReduceLROnPlateau (best, wait...), History (its epochs)."""
    out = []
    for index, cb in enumerate(callbacks):
        attrs = _stateful_attributes(cb)
        if attrs:
            out.append({"index": index, "class": type(cb).__name__, **{a: _plain(getattr(cb, a, None)) for a in attrs}})
    return out


def restore_callback_state(callbacks: Sequence[Any], saved: Any) -> None:
    """Put `callback_state`'s record back (call after ``on_train_begin``, which resets it).

    A record is matched by position and class in the ``callbacks`` list, so a changed list
    restores only the callbacks still in the same place.
    """
    for entry in saved or []:
        index = entry.get("index", -1)
        if not 0 <= index < len(callbacks) or type(callbacks[index]).__name__ != entry.get("class"):
            continue
        cb = callbacks[index]
        for attr in _stateful_attributes(cb):
            if attr in entry:
                setattr(cb, attr, _restored(attr, entry[attr]))
        if entry.get("class") == "History" and getattr(cb, "model", None) is not None:
            cb.model.history = cb  # Keras sets it at an epoch's end: a finished fit's rerun has none


def continue_csv_logs(callbacks: Sequence[Any], first_epoch: int) -> list[str]:
    """On a resume, make every ``CSVLogger`` continue its file instead of emptying it.

    Keras' CSVLogger opens its file with mode ``w`` in ``on_train_begin`` unless
    ``append=True``, so a resumed (or finished and rerun) job lost the rows of every epoch
    before the checkpoint. Here each file keeps its header and the rows of the epochs
    before ``first_epoch`` (rows written after the checkpoint, by a run that died before
    its next one, are dropped: those epochs run again), and the callback appends for this
    one ``fit``. Returns the files continued.
    """
    import keras

    continued = []
    for cb in callbacks:
        if not isinstance(cb, keras.callbacks.CSVLogger):
            continue
        _keep_rows_before(str(cb.filename), cb.sep, first_epoch)
        _append_once(cb)
        continued.append(str(cb.filename))
    return continued


def _keep_rows_before(path: str, separator: str, first_epoch: int) -> None:
    import csv

    try:
        with open(path, newline="") as fh:
            rows = list(csv.reader(fh, delimiter=separator))
    except FileNotFoundError:
        return
    if not rows or not rows[0] or rows[0][0] != "epoch":
        return  # not a CSVLogger file (or empty): appended to as it is

    def before(row: list[str]) -> bool:
        try:
            return int(row[0]) < first_epoch
        except (IndexError, ValueError):
            return False

    kept = [rows[0]] + [row for row in rows[1:] if before(row)]
    if len(kept) == len(rows):
        return
    tmp = f"{path}.keras_distrib.tmp"
    with open(tmp, "w", newline="") as fh:
        csv.writer(fh, delimiter=separator, lineterminator="\r\n").writerows(kept)
    os.replace(tmp, path)


def _append_once(cb: Any) -> None:
    """``cb.append = True`` for the next ``on_train_begin`` only (a later fit keeps the user's choice)."""
    user_choice = cb.append
    begin = cb.on_train_begin
    cb.append = True

    def on_train_begin(logs: Any = None) -> None:
        try:
            begin(logs)
        finally:
            cb.append = user_choice
            del cb.on_train_begin

    cb.on_train_begin = on_train_begin
