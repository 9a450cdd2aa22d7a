"""Search an MLP's hyperparameters on scikit-learn's digits with KerasTuner (no download).

    python -m keras_distrib.local --nodes 2 --layout tuner examples/digits_tuner.py   # distributed
    python examples/digits_tuner.py                                                   # one process

The script is KerasTuner's own, unchanged from single-machine use: with layout tuner the
launcher sets KERASTUNER_TUNER_ID, KERASTUNER_ORACLE_IP and KERASTUNER_ORACLE_PORT, so the
first node's first process runs the oracle and every other process runs trials. The search's
state lives in ``--directory`` (on a shared file system in a real job): a restarted or
requeued search resumes from it. The oracle's process prints the best trial at the end.
"""

from __future__ import annotations

import argparse
import json
import os


def build_model(hp):  # type: ignore[no-untyped-def]
    import keras

    model = keras.Sequential([keras.Input((64,))])
    for i in range(hp.Int("layers", 1, 2)):
        model.add(keras.layers.Dense(hp.Int(f"units_{i}", 16, 128, step=16), activation="relu"))
    model.add(keras.layers.Dense(10, activation="softmax"))
    lr = hp.Float("learning_rate", 1e-4, 3e-2, sampling="log")
    model.compile(keras.optimizers.Adam(lr), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main() -> None:
    import keras_tuner
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--directory", default="tuner-search", help="the search's state (shared by every process)")
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the best trial as one JSON line")
    p.add_argument("--summary", action="store_true",
                   help="every process prints KerasTuner's results summary, as a single-process script would "
                        "(a trial worker asks the oracle for it)")
    args = p.parse_args()

    d = load_digits()
    x_train, x_val, y_train, y_val = train_test_split((d.data / 16.0).astype("float32"), d.target, test_size=0.2,
                                                      random_state=0, stratify=d.target)
    tuner = keras_tuner.RandomSearch(build_model, objective="val_accuracy", max_trials=args.trials,
                                     seed=args.seed, directory=args.directory, project_name="digits")
    tuner.search(x_train, y_train, epochs=args.epochs, validation_data=(x_val, y_val), verbose=0)
    if args.summary:
        tuner.results_summary(num_trials=1)
    # After the search only the oracle holds the results: the trial workers have ended their part.
    if os.environ.get("KERASTUNER_TUNER_ID", "chief") == "chief":
        best = tuner.oracle.get_best_trials(1)[0]
        if args.json:
            import keras

            print(json.dumps({"best_score": best.score, "best_values": best.hyperparameters.values,
                              "trials": len(tuner.oracle.trials), "backend": keras.backend.backend()}))
        else:
            print(f"best val_accuracy {best.score:.4f} with {best.hyperparameters.values}")


if __name__ == "__main__":
    main()
