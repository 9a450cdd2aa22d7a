"""Keras preprocessing layers that hold a lookup table, inside the model, in every layout (issue 29 §4).

ParameterServerStrategy turns each table created under its scope into a per-worker copy
(``DistributedTable``) that a traced function reaches through a call-time capture; the
trainer's guarded steps (``tf.cond``) used to leave that capture unfed on the worker
(``You must feed a value for placeholder tensor '.../string_lookup/None_Lookup/Placeholder'``).

One job per layout (2 workers; ps-per-node stands for worker-per-gpu: same trainer and
strategy) runs every layer kind in one script: StringLookup (given vocabulary, and adapted
with tf-idf), IntegerLookup (adapted, one-hot), TextVectorization (adapted), Hashing, each
with a Normalization adapted in ``make_model`` beside it (the issue's model). Each must
learn a task that needs the lookup, validate, evaluate, and predict on the workers exactly
what the model computes on this process (the workers' copies hold the same table), and its
saved ``.keras`` file must reload in a plain process with the same predictions. In the ps
layout the opt-in modes (``ps_local_steps``, ``ps_stale_reads``) run a lookup too, and a
table created outside the scope (it stays on the chief) trains with one warning line.
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
WORDS = np.array([f"w{i}" for i in range(8)])
tokens = rng.integers(0, 8, N)
label = (tokens % 2).astype("int32")  # only the token tells the class: the lookup must work
number = rng.normal(size=(N, 1)).astype("float32")
text = np.array([" ".join([WORDS[t], WORDS[(t + 3) % 8], "filler"]) for t in tokens])
inputs = {
    "string": WORDS[tokens].reshape(-1, 1),
    "string_tfidf": WORDS[tokens].reshape(-1, 1),
    "integer": (tokens * 10 + 7).astype("int64").reshape(-1, 1),
    "text": text.reshape(-1, 1),
    "hashing": WORDS[tokens].reshape(-1, 1),
}


def make(kind):
    def make_model():
        raw = keras.Input((1,), dtype="int64" if kind == "integer" else "string", name="tok")
        num = keras.Input((1,), name="num")
        norm = keras.layers.Normalization()
        norm.adapt(number)
        if kind == "string":
            h = keras.layers.Embedding(10, 8)(keras.layers.StringLookup(vocabulary=list(WORDS))(raw))
            h = keras.layers.Flatten()(h)
        elif kind == "string_tfidf":
            lookup = keras.layers.StringLookup(output_mode="tf_idf")
            lookup.adapt(inputs[kind])
            h = lookup(raw)
        elif kind == "integer":
            lookup = keras.layers.IntegerLookup(output_mode="one_hot")
            lookup.adapt(inputs[kind])
            h = lookup(raw)
        elif kind == "text":
            vec = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=3)
            vec.adapt(text)
            h = keras.layers.Embedding(20, 8)(vec(keras.layers.Reshape(())(raw)))
            h = keras.layers.Flatten()(h)
        else:
            h = keras.layers.Embedding(64, 8)(keras.layers.Hashing(num_bins=64)(raw))
            h = keras.layers.Flatten()(h)
        h = keras.layers.Concatenate()([h, norm(num)])
        h = keras.layers.Dense(16, activation="relu")(h)
        model = keras.Model({"tok": raw, "num": num}, keras.layers.Dense(2, activation="softmax")(h))
        model.compile(keras.optimizers.Adam(0.03), "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model
    return make_model


def worker_tables(model):
    """Class names of the tables the model holds (DistributedTable under the ps strategy)."""
    names = set()
    for layer in model._flatten_layers():
        table = getattr(layer, "lookup_table", None)
        if table is not None:
            names.add(type(table).__name__)
    return sorted(names)


results = {}
for kind, tok in inputs.items():
    t0 = time.monotonic()
    keras.utils.set_random_seed(1)
    x = {"tok": tok, "num": number}
    model = placement.build(make(kind), strategy)
    hist = keras_distrib.fit(model, (x, label), epochs=4, batch_size=16, validation_data=(x, label),
                             verbose=0, strategy=strategy)
    ev = keras_distrib.evaluate(model, (x, label), batch_size=16, strategy=strategy, return_dict=True)
    pred = np.asarray(keras_distrib.predict(model, x, batch_size=16, strategy=strategy))
    here = np.asarray(model({"tok": tf.constant(tok), "num": tf.constant(number)}, training=False))
    path = os.path.join(out, f"{kind}-{json.loads(os.environ['TF_CONFIG'])['task']['index']}.keras")
    model.save(path)
    np.savez(path + ".npz", tok=tok, num=number, here=here)
    results[kind] = {"history": hist.history, "eval": ev, "tables": worker_tables(model),
                     "predict_max_diff": float(np.max(np.abs(pred - here))), "rows": len(pred),
                     "saved": path, "seconds": time.monotonic() - t0}
if strategy.__class__.__name__.startswith("ParameterServer"):
    # The opt-in ps modes run the same lookup inside their own conds.
    for option in ("ps_local_steps", "ps_stale_reads"):
        model = placement.build(make("string"), strategy)
        h = keras_distrib.fit(model, ({"tok": inputs["string"], "num": number}, label), epochs=2, batch_size=16,
                              verbose=0, strategy=strategy, **{option: True})
        results[option] = {"history": h.history}
    # A table created outside the scope stays on the chief: it trains, with one warning line.
    outside = keras.layers.StringLookup(vocabulary=list(WORDS), name="outside_lookup")

    def make_outside():
        raw, num = keras.Input((1,), dtype="string", name="tok"), keras.Input((1,), name="num")
        h = keras.layers.Flatten()(keras.layers.Embedding(10, 8)(outside(raw)))
        h = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([h, num]))
        model = keras.Model({"tok": raw, "num": num}, keras.layers.Dense(2, activation="softmax")(h))
        model.compile(keras.optimizers.Adam(0.03), "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    h = keras_distrib.fit(placement.build(make_outside, strategy), ({"tok": inputs["string"], "num": number}, label),
                          epochs=3, batch_size=16, verbose=0, strategy=strategy)
    results["outside"] = {"history": h.history}
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
    for kind in KINDS:
        r = results[kind]
        assert r["rows"] == 403, (kind, r["rows"])
        # The workers' copies of the table give what the table on this process gives.
        assert r["predict_max_diff"] < 1e-5, (kind, r["predict_max_diff"])
        # The class is only in the token: learning it needs the lookup to work.
        assert r["history"]["val_accuracy"][-1] > 0.95, (kind, r["history"])
        assert r["eval"]["accuracy"] > 0.95, (kind, r["eval"])
        if kind != "hashing":
            want = "DistributedTable" if layout != "allreduce" else "StaticHashTable"
            assert r["tables"] == [want], (kind, r["tables"])
    check_reload([results[kind]["saved"] for kind in KINDS])
    if layout != "allreduce":
        for option in ("ps_local_steps", "ps_stale_reads"):
            assert results[option]["history"]["accuracy"][-1] > 0.9, (option, results[option])
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
    pred = np.asarray(model({"tok": tf.constant(arrays["tok"]), "num": tf.constant(arrays["num"])}, training=False))
    diffs[path] = float(np.max(np.abs(pred - arrays["here"])))
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
