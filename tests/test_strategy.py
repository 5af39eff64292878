import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import keras_tpu_mem as ktm
from keras_tpu_mem.backends.tensorflow.cluster import configure_logical_cpus, resolve_tpu_address


@pytest.fixture(scope="module")
def wrapper():
    return ktm.TPUStrategyWrapper(logical_cpus=2)


@pytest.mark.slow
def test_fresh_process_prints_cpu_2():
    code = (
        "import keras_tpu_mem as ktm; w = ktm.TPUStrategyWrapper(logical_cpus=2); "
        "print(w.kind, w.num_replicas)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"KERAS_BACKEND": "tensorflow",
                                          "TF_CPP_MIN_LOG_LEVEL": "3", "PATH": ""})
    assert out.stdout.strip().splitlines()[-1] == "CPU 2"
    assert "MirroredStrategy with 2 replica(s)" in out.stderr


def test_cpu_fallback_without_logical_cpus():
    w = ktm.TPUStrategyWrapper()
    assert w.kind == "CPU"
    assert w.num_replicas == 1
    assert w.strategy is tf.distribute.get_strategy()
    assert w.hbm_bytes_per_replica is None
    assert "no GPU" in w.reason


def test_logical_cpu_mirroring(wrapper):
    assert isinstance(wrapper.strategy, tf.distribute.MirroredStrategy)
    assert wrapper.kind == "CPU"
    assert wrapper.num_replicas == 2
    assert wrapper.device_name == "CPU"
    assert wrapper.replica_devices() == ["CPU:0", "CPU:1"]


def test_logical_cpus_too_late_raises_clear_error():
    # The session already runs with 2 logical CPUs: asking for 3 must explain.
    with pytest.raises(RuntimeError, match="logical_cpus=3 needs TensorFlow uninitialised"):
        configure_logical_cpus(3)
    configure_logical_cpus(2)  # the layout that is there: a no-op


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "2"])
def test_logical_cpus_bad_values(bad):
    with pytest.raises((TypeError, ValueError), match="logical_cpus"):
        ktm.TPUStrategyWrapper(logical_cpus=bad)


def test_batch_arithmetic(wrapper):
    assert wrapper.global_batch_size(16) == 32
    assert wrapper.per_replica_batch_size(64) == 32
    assert wrapper.per_replica_batch_size(30) == 15  # 30 does split over 2 replicas
    with pytest.raises(ValueError, match=r"Global batch 31 .* 2 replicas") as err:
        wrapper.per_replica_batch_size(31)
    assert "30" in str(err.value) and "32" in str(err.value)


@pytest.mark.parametrize("bad", [0, -4, 3.0, None, True])
def test_batch_arithmetic_bad_input(wrapper, bad):
    with pytest.raises((TypeError, ValueError), match="global_batch"):
        wrapper.per_replica_batch_size(bad)
    with pytest.raises((TypeError, ValueError), match="per_replica"):
        wrapper.global_batch_size(bad)


def test_distribute_static_shapes_and_drop_remainder(wrapper):
    x = np.arange(200 * 3, dtype="float32").reshape(200, 3)
    y = np.arange(200, dtype="int32")
    ds = wrapper.distribute(tf.data.Dataset.from_tensor_slices((x, y)), 64)
    assert ds.element_spec[0].shape.as_list() == [64, 3]
    batches = list(ds)
    assert len(batches) == 3  # 200 // 64, the remainder of 8 dropped
    assert all(b[0].shape[0] == 64 for b in batches)
    np.testing.assert_array_equal(batches[1][1].numpy(), y[64:128])

    keep = wrapper.distribute((x, y), 64, drop_remainder=False)
    assert keep.element_spec[0].shape.as_list() == [None, 3]
    assert [b[0].shape[0] for b in keep] == [64, 64, 64, 8]


def test_distribute_bad_input(wrapper):
    with pytest.raises(ValueError, match="Global batch 63"):
        wrapper.distribute((np.zeros((8, 2)),), 63)
    with pytest.raises(TypeError, match="`dataset` must be"):
        wrapper.distribute(object(), 64)
    with pytest.raises(TypeError, match="drop_remainder"):
        wrapper.distribute((np.zeros((8, 2)),), 64, drop_remainder="yes")


def test_distribute_feeds_fit_under_mirrored(wrapper):
    import keras

    with wrapper.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(128, 3)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    history = model.fit(wrapper.distribute((x, y), 32), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_memory_info_and_describe(wrapper):
    readings = wrapper.memory_info()
    assert [r.device for r in readings] == ["CPU:0", "CPU:1"]
    assert all(r.shared for r in readings)
    assert all(r.capacity_bytes is None for r in readings)
    # oneDNN is on by default, so the CPU allocator is readable.
    tf.constant(np.ones((256, 256), "float32")) * 2.0
    assert wrapper.memory_info()[0].peak_bytes > 0
    assert all(r.source == "allocator" and not r.process_wide for r in wrapper.memory_info())
    text = wrapper.describe()
    assert "MirroredStrategy" in text and "replicas:  2" in text
    assert "shared host allocator" in text
    assert "memory source: allocator" in text
    assert repr(wrapper) == "TPUStrategyWrapper(kind='CPU', device='CPU', replicas=2)"


_ONEDNN_OFF_WRAPPER = """
import json, os
os.environ["KERAS_BACKEND"] = "tensorflow"
import keras_tpu_mem as ktm
import tensorflow as tf
w = ktm.TPUStrategyWrapper(logical_cpus=2)
before = w.memory_info()
held = tf.ones((64 * 2**20,), "float32") * 2.0   # 256 MiB kept alive
after = w.memory_info()
print("RESULT " + json.dumps({
    "before": [[r.device, r.current_bytes, r.peak_bytes, r.source, r.process_wide, r.shared]
               for r in before],
    "after": [r.current_bytes for r in after]}))
print("DESCRIBE " + json.dumps(w.describe()))
"""


@pytest.mark.slow
def test_memory_info_falls_back_to_host_rss_with_onednn_off():
    """TF_ENABLE_ONEDNN_OPTS=0 (AMD/AVX2's default): readings say they are host RSS."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", _ONEDNN_OFF_WRAPPER], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {ln.split(" ", 1)[0]: json.loads(ln.split(" ", 1)[1])
             for ln in done.stdout.splitlines() if ln.startswith(("RESULT ", "DESCRIBE "))}
    before = lines["RESULT"]["before"]
    assert [r[0] for r in before] == ["CPU:0", "CPU:1"]
    for _, current, peak, source, process_wide, shared in before:
        assert source == "host_rss" and process_wide and shared
        assert peak >= current > 50 * 2**20
    # The figures follow what the process holds: a 256 MiB tensor shows.
    assert lines["RESULT"]["after"][0] - before[0][1] > 200 * 2**20
    text = lines["DESCRIBE"]
    assert "memory source: host RSS" in text and "not HBM" in text
    assert "shared host allocator" not in text


class TestTPUResolution:
    """TPU resolution logic, checked without pretending a TPU exists."""

    def test_explicit_argument_wins_over_environment(self):
        env = {"TPU_NAME": "from-env", "COLAB_TPU_ADDR": "10.0.0.2:8470"}
        assert resolve_tpu_address("my-tpu", env, True)[0] == "my-tpu"
        assert resolve_tpu_address("local", env, False)[0] == "local"

    def test_tpu_name_before_colab(self):
        env = {"TPU_NAME": "node-1", "COLAB_TPU_ADDR": "10.0.0.2:8470"}
        address, reason = resolve_tpu_address(None, env, False)
        assert address == "node-1" and "TPU_NAME" in reason

    def test_colab_address_gets_grpc_prefix(self):
        address, reason = resolve_tpu_address(None, {"COLAB_TPU_ADDR": "10.0.0.2:8470"}, False)
        assert address == "grpc://10.0.0.2:8470" and "Colab" in reason

    def test_local_tpu_vm(self):
        assert resolve_tpu_address(None, {}, True) == ("local", "this machine is a TPU VM")
        assert resolve_tpu_address(None, {"TPU_ACCELERATOR_TYPE": "v4-8"})[0] == "local"

    def test_nothing_indicated(self):
        address, reason = resolve_tpu_address(None, {}, False)
        assert address is None and "no TPU named" in reason

    def test_bad_tpu_argument(self):
        with pytest.raises(TypeError, match="`tpu` must be None, 'local'"):
            resolve_tpu_address(8, {}, False)
        with pytest.raises(ValueError, match="empty string"):
            resolve_tpu_address("  ", {}, False)

    def test_unreachable_tpu_raises_instead_of_falling_back(self, monkeypatch):
        monkeypatch.setenv("TPU_NAME", "grpc://127.0.0.1:1")

        def refuse(*args, **kwargs):
            raise ValueError("no TPU here")

        monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", refuse)
        with pytest.raises(RuntimeError, match=r"A TPU was requested \(TPU_NAME="):
            ktm.TPUStrategyWrapper()


def test_jax_only_arguments_are_refused_on_tensorflow():
    with pytest.raises(TypeError, match="layout_map belong to the JAX backend"):
        ktm.TPUStrategyWrapper(layout_map=object())
