"""Keras preprocessing layers that hold a lookup table, inside the model, in every layout (issue 29 §4).

ParameterServerStrategy turns each table created under its scope into a per-worker copy
(``DistributedTable``) that a traced function reaches through a call-time capture; the
trainer's guarded steps (``tf.cond``) used to leave that capture unfed on the worker
(``You must feed a value for placeholder tensor '.../string_lookup/None_Lookup/Placeholder'``).

One job per layout (2 workers; ps-per-node stands for worker-per-gpu: same trainer and
strategy) trains one model with a branch per layer kind: StringLookup (given vocabulary,
and adapted with tf-idf), IntegerLookup (adapted, one-hot), TextVectorization (adapted),
Hashing, each with a Normalization adapted in ``make_model`` beside it (the issue's model).
Each branch has its own token input, its own output and its own label, which only its
token tells: each output must learn its task (its accuracy), so each lookup must work.
The model validates, evaluates, and predicts on the workers exactly what it computes on
this process for every output (the workers' copies hold the same tables), and its saved
``.keras`` file must reload in a plain process with the same predictions. One model, not
one per kind: the same checks for a fifth of the traces. In the ps layout the opt-in
modes (``ps_local_steps``, ``ps_stale_reads``) run a StringLookup too, and a table created
outside the scope (it stays on the chief) trains with one warning line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from trainer_cluster import REPO, last_json_line, run_script_cluster

pytestmark = pytest.mark.local

SCRIPT = r'''
import json, os, sys, time
import numpy as np
import keras, tensorflow as tf
import keras_distrib
from keras_distrib.trainers import placement

out = sys.argv[1]
strategy = keras_distrib.strategy()
rng = np.random.default_rng(0)
N = 403  # does not divide by the batch (16) x workers
KINDS = ["string", "string_tfidf", "integer", "text", "hashing"]
WORDS = np.array([f"w{i}" for i in range(8)])
tokens = {kind: rng.integers(0, 8, N) for kind in KINDS}  # independent: a branch cannot lean on another
number = rng.normal(size=(N, 1)).astype("float32")
text = np.array([" ".join([WORDS[t], WORDS[(t + 3) % 8], "filler"]) for t in tokens["text"]])
x = {kind: WORDS[t].reshape(-1, 1) for kind, t in tokens.items()}
x["integer"] = (tokens["integer"] * 10 + 7).astype("int64").reshape(-1, 1)
x["text"] = text.reshape(-1, 1)
x["num"] = number
y = {kind: (t % 2).astype("int32") for kind, t in tokens.items()}  # only the kind's token tells its class


def branch(kind, raw):
    if kind == "string":
        h = keras.layers.StringLookup(vocabulary=list(WORDS), name="string_lookup")(raw)
        return keras.layers.Flatten()(keras.layers.Embedding(10, 8)(h))
    if kind == "string_tfidf":
        lookup = keras.layers.StringLookup(output_mode="tf_idf", name="string_tfidf_lookup")
        lookup.adapt(x[kind])
        return lookup(raw)
    if kind == "integer":
        lookup = keras.layers.IntegerLookup(output_mode="one_hot", name="integer_lookup")
        lookup.adapt(x[kind])
        return lookup(raw)
    if kind == "text":
        vec = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=3, name="text_lookup")
        vec.adapt(text)
        return keras.layers.Flatten()(keras.layers.Embedding(20, 8)(vec(keras.layers.Reshape(())(raw))))
    h = keras.layers.Hashing(num_bins=64, name="hashing_lookup")(raw)
    return keras.layers.Flatten()(keras.layers.Embedding(64, 8)(h))


def make_model(kinds=KINDS):
    raws = {kind: keras.Input((1,), dtype="int64" if kind == "integer" else "string", name=kind) for kind in kinds}
    num = keras.Input((1,), name="num")
    norm = keras.layers.Normalization()
    norm.adapt(number)
    normed = norm(num)
    outputs = {}
    for kind in kinds:
        h = keras.layers.Concatenate()([branch(kind, raws[kind]), normed])
        h = keras.layers.Dense(16, activation="relu")(h)
        outputs[kind] = keras.layers.Dense(2, activation="softmax", name=kind + "_out")(h)
    model = keras.Model({**raws, "num": num}, outputs)
    model.compile(keras.optimizers.Adam(0.03), {k: "sparse_categorical_crossentropy" for k in kinds},
                  metrics={k: ["accuracy"] for k in kinds})
    return model


def worker_tables(model):
    # {lookup layer: class name of its table} (DistributedTable under the ps strategy);
    # TextVectorization holds its table in an inner StringLookup.
    tables = {}
    for layer in model.layers:
        holder = getattr(layer, "_lookup_layer", layer)
        if getattr(holder, "lookup_table", None) is not None:
            tables[layer.name] = type(holder.lookup_table).__name__
    return tables


def outputs_of(prediction):
    # {kind: array}: a dict of outputs, named after their keys (Keras returns them so).
    return {kind: np.asarray(prediction[kind]) for kind in KINDS}


results = {}
t0 = time.monotonic()
keras.utils.set_random_seed(1)
model = placement.build(make_model, strategy)
hist = keras_distrib.fit(model, (x, y), epochs=4, batch_size=16, validation_data=(x, y), verbose=0, strategy=strategy)
ev = keras_distrib.evaluate(model, (x, y), batch_size=16, strategy=strategy, return_dict=True)
pred = outputs_of(keras_distrib.predict(model, x, batch_size=16, strategy=strategy))
here = outputs_of(model({k: tf.constant(v) for k, v in x.items()}, training=False))
path = os.path.join(out, f"lookups-{json.loads(os.environ['TF_CONFIG'])['task']['index']}.keras")
model.save(path)
np.savez(path + ".npz", **{"x_" + k: v for k, v in x.items()}, **{"here_" + k: v for k, v in here.items()})
results["all"] = {"history": hist.history, "eval": ev, "tables": worker_tables(model),
                  "predict_max_diff": {k: float(np.max(np.abs(pred[k] - here[k]))) for k in KINDS},
                  "rows": {k: len(pred[k]) for k in KINDS}, "saved": path, "seconds": time.monotonic() - t0}
if strategy.__class__.__name__.startswith("ParameterServer"):
    # The opt-in ps modes run a lookup inside their own conds.
    for option in ("ps_local_steps", "ps_stale_reads"):
        model = placement.build(lambda: make_model(["string"]), strategy)
        t1 = time.monotonic()
        h = keras_distrib.fit(model, ({"string": x["string"], "num": number}, {"string": y["string"]}), epochs=2,
                              batch_size=16, verbose=0, strategy=strategy, **{option: True})
        results[option] = {"history": h.history, "seconds": time.monotonic() - t1}
    # A table created outside the scope stays on the chief: it trains, with one warning line.
    outside = keras.layers.StringLookup(vocabulary=list(WORDS), name="outside_lookup")

    def make_outside():
        raw, num = keras.Input((1,), dtype="string", name="tok"), keras.Input((1,), name="num")
        h = keras.layers.Flatten()(keras.layers.Embedding(10, 8)(outside(raw)))
        h = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([h, num]))
        model = keras.Model({"tok": raw, "num": num}, keras.layers.Dense(2, activation="softmax")(h))
        model.compile(keras.optimizers.Adam(0.03), "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    t1 = time.monotonic()
    h = keras_distrib.fit(placement.build(make_outside, strategy), ({"tok": x["string"], "num": number}, y["string"]),
                          epochs=3, batch_size=16, verbose=0, strategy=strategy)
    results["outside"] = {"history": h.history, "seconds": time.monotonic() - t1}
print(json.dumps(results), flush=True)
'''


KINDS = ["string", "string_tfidf", "integer", "text", "hashing"]


@pytest.mark.parametrize("layout", ["ps-per-node", "allreduce"])
def test_lookup_layers_train_predict_and_save_in_every_layout(tmp_path: Path, layout: str) -> None:
    script = tmp_path / "lookups.py"
    script.write_text(SCRIPT)
    procs = run_script_cluster(script, [str(tmp_path)], num_workers=2, num_ps=1 if layout != "allreduce" else 0,
                               layout=layout, timeout=1500)
    failed = [p for p in procs if p.returncode != 0]
    assert not failed, "\n----\n".join(p.stderr[-4000:] for p in failed)
    results = last_json_line(procs[0].stdout)
    print({key: round(value.get("seconds", 0), 1) for key, value in results.items()})
    r = results["all"]
    want_table = "DistributedTable" if layout != "allreduce" else "StaticHashTable"
    # Hashing holds no table; every other kind one, a per-worker copy under the ps strategy.
    assert r["tables"] == {kind + "_lookup": want_table for kind in KINDS if kind != "hashing"}, r["tables"]
    for kind in KINDS:
        assert r["rows"][kind] == 403, (kind, r["rows"])
        # The workers' copies of the table give what the table on this process gives.
        assert r["predict_max_diff"][kind] < 1e-5, (kind, r["predict_max_diff"])
        # The class is only in the kind's own token: learning it needs that lookup to work.
        assert r["history"][f"val_{kind}_accuracy"][-1] > 0.95, (kind, r["history"])
        assert r["eval"][f"{kind}_accuracy"] > 0.95, (kind, r["eval"])
    check_reload([r["saved"]])
    if layout != "allreduce":
        for option in ("ps_local_steps", "ps_stale_reads"):
            history = results[option]["history"]
            accuracy = [values for key, values in history.items() if key.endswith("accuracy")]
            assert len(accuracy) == 1 and accuracy[0][-1] > 0.9, (option, history)
        assert results["outside"]["history"]["accuracy"][-1] > 0.9, results["outside"]
        warnings = [line for line in procs[0].stderr.splitlines() if "created outside strategy.scope()" in line]
        assert len(warnings) == 1 and "layer outside_lookup was" in warnings[0] and "HINT: " in warnings[0], warnings
    else:
        assert "created outside strategy.scope()" not in procs[0].stderr


RELOAD = r'''
import json, sys
import numpy as np, keras, tensorflow as tf
diffs = {}
for path in sys.argv[1:]:
    arrays = np.load(path + ".npz")
    model = keras.saving.load_model(path)
    x = {k[2:]: tf.constant(v) for k, v in arrays.items() if k.startswith("x_")}
    pred = model(x, training=False)
    for k in arrays:
        if k.startswith("here_"):
            diffs[f"{path}:{k[5:]}"] = float(np.max(np.abs(np.asarray(pred[k[5:]]) - arrays[k])))
print(json.dumps(diffs), flush=True)
'''


def check_reload(paths: list[str]) -> None:
    """The saved models, in a plain process, predict what the trained ones did."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_DISTRIB_LAYOUT")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", RELOAD, *paths], capture_output=True, text=True, env=env,
                          timeout=300, cwd=str(REPO))
    assert done.returncode == 0, done.stderr[-4000:]
    diffs = last_json_line(done.stdout)
    assert max(diffs.values()) < 1e-5, diffs
