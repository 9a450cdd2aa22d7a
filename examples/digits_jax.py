"""Train an MLP on scikit-learn's digits with Keras 3 on JAX and plain ``model.fit``.

    python -m keras_distrib.local --nodes 2 --layout jax examples/digits_jax.py    # distributed
    KERAS_BACKEND=jax python examples/digits_jax.py --single-process               # baseline

On the jax layout every process runs this script: ``keras_distrib.distribution()``
joins the job and sets a DataParallel over all devices; ``model.fit`` gets a batched,
seeded ``tf.data.Dataset`` (the global batch) and trains synchronously. Every process
saves (a collective on JAX); only process 0 writes to the given path and prints. ``--json`` prints one JSON line with the results.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from digits_distrib import load, make_model


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="global batch: examples per optimizer update")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--single-process", action="store_true", help="plain Keras on one process (the baseline)")
    p.add_argument("--save", default=None, help="write the trained model here (.keras), from process 0")
    p.add_argument("--json", action="store_true", help="print results as one JSON line")
    p.add_argument("--verbose", type=int, default=2)
    args = p.parse_args(argv)

    import keras
    import tensorflow as tf

    is_chief, writable = True, str
    if not args.single_process:
        import keras_distrib

        keras_distrib.distribution()  # before the model: Keras places variables at creation
        is_chief, writable = keras_distrib.cluster().is_chief, keras_distrib.chief_path
    keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test = load(args.seed)
    # The same seed on every process: each takes its slice of the same global batches.
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=args.seed)
    train = train.batch(args.batch_size)
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.batch_size)
    model = make_model()
    callbacks = [keras.callbacks.CSVLogger(writable(args.save + ".csv"))] if args.save else []
    start = time.perf_counter()
    history = model.fit(train, epochs=args.epochs, validation_data=test, callbacks=callbacks,
                        verbose=args.verbose if is_chief else 0)
    seconds = time.perf_counter() - start
    result = {
        "test_accuracy": float(history.history["val_accuracy"][-1]),
        "steps_per_sec": args.epochs * len(x_train) / args.batch_size / seconds,
    }
    if args.save:  # a collective on JAX: every process saves, process 0 to args.save
        model.save(writable(args.save))
    if args.json and is_chief:
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
