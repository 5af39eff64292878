"""A fit whose host-RSS peak follows the batch size, run in a fresh process.

The host-RSS tests compare the peak of two batch sizes, each in its own
process so that neither inherits the other's high-water mark. The model is one
wide layer on a narrow input: at 4096 rows each Dense(8192) activation is
128 MiB, at 64 rows 2 MiB, while the weights are 0.6 M parameters. That keeps
the signal several times the spread of the RSS peak between identical runs
(about 30 MiB here: the frameworks' own start-up varies), which a model whose
activations are 16 MiB did not (it failed in CI once).

Run as `python host_rss_workload.py BACKEND BATCH LOG_DIR`; prints one
`RESULT {json}` line. `wide_model` and `wide_data` serve the batch-size sweep.
"""

import json
import os
import sys

#: Rows enough for 3 steps at the largest batch the tests use (4096).
ROWS = 16384
FEATURES = 64
WIDTH = 8192
#: What one Dense(WIDTH) float32 activation takes at `rows` rows, in bytes.
def activation_bytes(rows):
    return rows * WIDTH * 4


def wide_data():
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.random((ROWS, FEATURES), dtype=np.float32),
            rng.integers(0, 10, ROWS))


def wide_model(keras):
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(WIDTH, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def main():
    backend, batch, log_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ["KERAS_BACKEND"] = backend
    import keras
    import psutil

    import keras_tpu_mem.monitoring as mon

    x, y = wide_data()
    # No keras.utils.set_random_seed: it imports TensorFlow whenever TensorFlow is
    # installed (to seed it), and the JAX run asserts that nothing loads TensorFlow.
    # The RSS peak follows the shapes, not the weights' values.
    model = wide_model(keras)
    rss_before = psutil.Process().memory_info().rss
    hbm = mon.HBMMonitor(log_dir)
    history = model.fit(x, y, batch_size=batch, epochs=2, steps_per_epoch=2, verbose=0,
                        validation_data=(x[:512], y[:512]),
                        callbacks=[hbm, mon.ThroughputMonitor(log_dir)])
    print("RESULT " + json.dumps({"history": history.history, "rss_before": rss_before,
                                  "summary": hbm.summary,
                                  "tensorflow": "tensorflow" in sys.modules}))


if __name__ == "__main__":
    main()
