"""Per-epoch overhead of the parameter-server trainer on small epochs.

    python bench/epoch_overhead.py [--smoke] [--rounds 5] [--nodes 2]

One local job (ps-per-node, N emulated nodes), alternating inside it round by round:

1. Epoch time, exact epochs without ``steps_per_epoch``: A = closures in flight bounded
   by what the unfinished shards still need (`ParameterServerTrainer._window`, the
   default) vs B = a full window of 4 closures per worker until the epoch's end (the
   trainer before 2026-11-26), whose surplus closures find their shard finished and
   return empty. 403 examples in batches of 16 with validation: 26 steps per epoch.
2. A repeated ``keras_distrib.predict``: A = the predict chunk traced once per output
   structure (the default) vs B = traced again on every call (the trainer before).

Both are seconds (lower is better): a ratio below 1 is A's gain.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import Comparison, child_env, parser, print_table, save
from _jobs import free_port_base

SCRIPT = r'''
import json, sys, time
import numpy as np, keras, keras_distrib
from keras_distrib.trainers import trainer_for
from keras_distrib.trainers.ps import ParameterServerTrainer

rounds = int(sys.argv[1])
bounded = ParameterServerTrainer._window
def full(self, per_shard=None, done=None, k=None):
    return bounded(self)  # without the shards' sizes: the full window
rng = np.random.default_rng(0)
x = rng.normal(size=(403, 16)).astype("float32")
y = (x.sum(1) > 0).astype("int32")
strategy = keras_distrib.strategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
keras_distrib.fit(model, (x, y), epochs=1, batch_size=16, validation_data=(x, y), verbose=0)  # traced here
keras_distrib.predict(model, x, batch_size=16)
trainer = trainer_for(model)
out = {"epoch_bounded": [], "epoch_full": [], "predict_once": [], "predict_retraced": []}
for r in range(rounds):
    sides = [("epoch_bounded", bounded), ("epoch_full", full)]
    for name, window in (sides if r % 2 == 0 else sides[::-1]):
        ParameterServerTrainer._window = window
        t = time.perf_counter()
        keras_distrib.fit(model, (x, y), epochs=3, batch_size=16, validation_data=(x, y), verbose=0)
        out[name].append((time.perf_counter() - t) / 3)
    ParameterServerTrainer._window = bounded
    for name in (("predict_once", "predict_retraced") if r % 2 == 0 else ("predict_retraced", "predict_once")):
        if name == "predict_retraced":
            for key in [k for k in trainer._fns if isinstance(k, tuple) and k[0] == "predict"]:
                del trainer._fns[key]  # what every call did before: a new predict chunk
        t = time.perf_counter()
        keras_distrib.predict(model, x, batch_size=16)
        out[name].append(time.perf_counter() - t)
print("RESULT " + json.dumps(out), flush=True)
'''


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--nodes", type=int, default=None, help="emulated nodes (default 2; --smoke: 1)")
    args = p.parse_args()
    rounds = 1 if args.smoke else args.rounds
    args.nodes = args.nodes or (1 if args.smoke else 2)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "epoch_overhead_job.py"
        script.write_text(SCRIPT)
        proc = subprocess.run(
            [sys.executable, "-m", "keras_distrib.local", "--nodes", str(args.nodes),
             "--port-base", str(free_port_base(3 * args.nodes + 2)), str(script), str(rounds)],
            env=child_env(), cwd=tmp, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if "RESULT " in line]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the job failed with {proc.returncode}:\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1].split("RESULT ", 1)[1])
    epoch = Comparison("ps epoch, 26 steps + validation", "bounded in flight", "full window", "s",
                       a=out["epoch_bounded"], b=out["epoch_full"], target="(report) < 1")
    predict = Comparison("repeated predict, 403 rows", "traced once", "retraced", "s",
                         a=out["predict_once"], b=out["predict_retraced"], target="(report) < 1")
    print_table(f"Per-epoch overhead, ps-per-node, {args.nodes} emulated nodes, {rounds} round(s)", [epoch, predict])
    save("epoch_overhead", [epoch, predict], {"nodes": args.nodes}, args.out)


if __name__ == "__main__":
    main()
