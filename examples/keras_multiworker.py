"""A Keras script with tf.distribute.MultiWorkerMirroredStrategy, as in IDRIS's TensorFlow recipe.

It reads nothing of dplaunch: the strategy finds the cluster and this worker's index in TF_CONFIG,
which `dplaunch launch` sets for every worker:

    dplaunch launch examples/keras_multiworker.py --gpus 2 -- --steps 4 --out weights/

The global batch stays the same whatever the number of workers: each replica gets its share and
the strategy averages the gradients, so 2 workers train exactly as 1 worker on the whole batch.
"""

import argparse
import json
import os

# Keras 3 (TensorFlow >= 2.16's default) fails in model.fit under MultiWorkerMirroredStrategy
# ("Attempt to convert a value (PerReplica…)", keras-team/keras#20585); tf_keras, Keras 2, does not
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH = 8
FEATURES = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", help="directory for this worker's final weights (.npz)")
    args = parser.parse_args()

    # launch.timeout_minutes: a worker that stops taking part fails the collective, not hangs it
    timeout_s = float(os.environ.get("DPLAUNCH_TIMEOUT_MINUTES", "30")) * 60
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=timeout_s
        )
    )
    worker = strategy.cluster_resolver.task_id
    print(f"worker {worker}: {strategy.num_replicas_in_sync} replicas in sync", flush=True)

    # the same data and the same first weights on every worker (and in a 1-worker run)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * args.steps, FEATURES)).astype("float32")
    y = (x @ np.arange(1, FEATURES + 1, dtype="float32") + 0.5)[:, None]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.Input(shape=(FEATURES,)),
                tf.keras.layers.Dense(8, activation="tanh", kernel_initializer=_seeded(1)),
                tf.keras.layers.Dense(1, kernel_initializer=_seeded(2)),
            ]
        )
        model.compile(optimizer=tf.keras.optimizers.SGD(learning_rate=0.05), loss="mse")
    start = model.get_weights()
    history = model.fit(dataset, epochs=1, steps_per_epoch=args.steps, verbose=0, shuffle=False)
    print(f"worker {worker}: loss {history.history['loss'][-1]:.6f}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        weights = {f"w{i}": w for i, w in enumerate(model.get_weights())}
        weights |= {f"start_w{i}": w for i, w in enumerate(start)}
        np.savez(os.path.join(args.out, f"worker-{worker}.npz"), **weights)
        report = {"worker": worker, "replicas": strategy.num_replicas_in_sync}
        print("REPORT " + json.dumps(report), flush=True)


def _seeded(seed: int) -> tf.keras.initializers.Initializer:
    return tf.keras.initializers.GlorotUniform(seed=seed)


if __name__ == "__main__":
    main()
