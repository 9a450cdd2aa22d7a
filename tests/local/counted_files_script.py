"""Training script for a worker killed in a counted epoch of files (ps layouts).

argv: WORKDIR EPOCHS. Writes uneven TFRecord files of example ids, trains on them as a
`FileSource` with ``cache=True`` (exact epochs: the first counts each worker's batches, the
later ones run unguarded closures up to each shard's last few), and writes ``started-E``
in WORKDIR when epoch E begins. The chief prints one JSON line: the examples seen and their
id-sum per epoch, and the step counter.
"""

import json
import os
import sys

import keras_distrib
import keras_distrib.trainers
from keras_distrib import data as kd

strategy = keras_distrib.strategy()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from id_metrics import Count, IdSum  # noqa: E402  (this script's directory)

workdir, epochs = sys.argv[1], int(sys.argv[2])
SIZES = [125, 325, 42, 508, 3, 220, 160]  # 7 uneven files, dealt whole to the workers
N = sum(SIZES)


class Started(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        open(os.path.join(workdir, f"started-{epoch}"), "w").close()


paths = []
for j, size in enumerate(SIZES):
    paths.append(os.path.join(workdir, f"ids-{j}.tfrecord"))
    if not os.path.exists(paths[-1]):  # a restarted chief finds them written
        with tf.io.TFRecordWriter(paths[-1] + ".partial") as w:
            for i in range(sum(SIZES[:j]), sum(SIZES[:j + 1])):
                w.write(tf.train.Example(features=tf.train.Features(feature={
                    "id": tf.train.Feature(float_list=tf.train.FloatList(value=[i]))})).SerializeToString())
        os.replace(paths[-1] + ".partial", paths[-1])


def parse_batch(records):
    v = tf.io.parse_example(records, {"id": tf.io.FixedLenFeature([1], tf.float32)})["id"]
    return v / N, v[:, 0]


with strategy.scope():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse", metrics=[Count(), IdSum()])
source = kd.FileSource(paths, parse_batch=parse_batch, num_examples=N, cache=True)
history = keras_distrib.fit(model, source, epochs=epochs, batch_size=2, steps_per_execution=10, verbose=2,
                            callbacks=[Started()])
step = int(keras_distrib.trainers.trainer_for(model).global_step.numpy())
print(json.dumps({"step": step, "count": history.history["count"], "idsum": history.history["idsum"],
                  "n": N}), flush=True)
