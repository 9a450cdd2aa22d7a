"""Train an MLP on scikit-learn's bundled digits data (real data, no download).

    python -m keras_distrib.local --nodes 2 examples/digits_distrib.py      # distributed
    python examples/digits_distrib.py --single-process                      # baseline

Works in every layout: the parameter-server chief (or every all-reduce worker) runs this
script. Prints one JSON line with the results (``--json``) for tests and benchmarks.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def load(seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """Digits scaled to [0, 1], split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.data / 16.0).astype("float32")
    y = d.target.astype("int32")
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def make_model(lr: float = 0.003) -> Any:
    import keras

    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(keras.optimizers.Adam(lr), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="examples per optimizer update")
    p.add_argument("--steps-per-execution", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--single-process", action="store_true", help="plain Keras baseline")
    p.add_argument("--ps-local-steps", action="store_true",
                   help="parameter server: K local steps per closure (opt-in, see the README)")
    p.add_argument("--save", default=None, help="write the trained model here (.keras)")
    p.add_argument("--json", action="store_true", help="print results as one JSON line")
    p.add_argument("--verbose", type=int, default=2)
    args = p.parse_args(argv)

    import keras

    keras.utils.set_random_seed(args.seed)
    x_train, x_test, y_train, y_test = load(args.seed)
    result: dict[str, Any] = {}
    if args.single_process:
        model = make_model()
        model.fit(x_train, y_train, epochs=args.epochs, batch_size=args.batch_size, verbose=args.verbose)
        result["test_accuracy"] = float(model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"])
        is_chief = True
    else:
        import keras_distrib
        from keras_distrib.trainers import placement, trainer_for

        strategy = keras_distrib.strategy()
        model = placement.build(make_model, strategy)
        history = keras_distrib.fit(
            model, (x_train, y_train), epochs=args.epochs, batch_size=args.batch_size,
            validation_data=(x_test, y_test), steps_per_execution=args.steps_per_execution,
            verbose=args.verbose, seed=args.seed, strategy=strategy,
            **({"ps_local_steps": True} if args.ps_local_steps else {}),
        )
        trainer = trainer_for(model, strategy)
        result["test_accuracy"] = float(history.history["val_accuracy"][-1])
        result["steps"] = int(trainer.global_step.numpy())
        result["steps_per_sec"] = float(trainer.epoch_stats[-1]["steps_per_sec"]) if trainer.epoch_stats else 0.0
        is_chief = getattr(trainer, "is_chief", True)
    if args.save and is_chief:
        model.save(args.save)
    if args.json:
        print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
