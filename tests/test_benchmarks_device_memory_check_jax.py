"""benchmarks/device_memory_check.py: `--quick` on CPU, and its table's labels.

The script measures one real training step on the device beside the planner's
figures; on CPU there is no device peak, so its measured column must say so.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_memory_check.py"
CONFIGS = ("plain", "accumulation_4", "mixed_bfloat16", "rematerialize")


def _module():
    spec = importlib.util.spec_from_file_location("device_memory_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(figure, fresh):
    row = {"config": "plain", "batch": 8, "device_peak_bytes": 3 * 2**20,
           "host_max_rss_rise_bytes": 5 * 2**20, "compiled_total_bytes": 2 * 2**20,
           "by_layer_peak_bytes": 2**20, "plan_total_bytes": 2 * 2**20}
    header = {"date": "2026-12-02 00:00 UTC", "platform": "gpu", "device_kind": "H200",
              "device_figure": figure, "jax": "0.11.0", "keras": "3.15.1",
              "keras_tpu_mem": "0.1", "fresh_process_per_row": fresh,
              "model": {"seq": 16, "dim": 32, "heads": 2, "ffn": 64, "vocab": 100}}
    return {"header": header, "rows": [row]}


def test_markdown_shows_device_peak_only_when_the_device_measured_it():
    module = _module()
    device = module._markdown(_result("memory_stats()['peak_bytes_in_use']", True))
    assert "| device peak (MiB) |" in device
    assert "| plain | 8 | 3.00 | 2.00 | 1.00 | 2.00 |" in device
    host = module._markdown(_result("host: rise of the process's peak RSS", True))
    assert "host RSS rise (MiB, not device)" in host and "| plain | 8 | 5.00 |" in host
    mixed = _result("n/a: all rows ran in one process", False)
    mixed["rows"][0]["device_peak_bytes"] = mixed["rows"][0]["host_max_rss_rise_bytes"] = None
    shared = module._markdown(mixed)
    assert "| plain | 8 | n/a |" in shared and "all in one process" in shared


def test_unknown_config_is_refused():
    with pytest.raises(SystemExit):
        _module().main(["--configs", "plain,fp8"])


@pytest.mark.slow
def test_quick_runs_on_cpu_and_writes_json_and_markdown(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="jax",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "device_memory_check.json").read_text())
    header = result["header"]
    assert header["platform"] == "cpu" and header["jax"] and header["keras"]
    assert header["device_figure"].startswith("n/a")  # one process: no per-row peak
    assert sorted(r["config"] for r in result["rows"]) == sorted(CONFIGS)
    for row in result["rows"]:
        assert row["compiled_total_bytes"] > 0 and row["plan_total_bytes"] > 0
        assert 0 < row["by_layer_peak_bytes"] <= row["compiled_total_bytes"]
        assert row["device_peak_bytes"] is None  # CPU: memory_stats() is None
    rows = {r["config"]: r for r in result["rows"]}
    # The levers shrink the compiled step as they should.
    assert rows["accumulation_4"]["compiled_total_bytes"] < rows["plain"]["compiled_total_bytes"]
    assert rows["rematerialize"]["by_layer_peak_bytes"] < rows["plain"]["by_layer_peak_bytes"]
    markdown = (tmp_path / "device_memory_check.md").read_text()
    assert header["date"] in markdown and f"jax {header['jax']}" in markdown
    for config in CONFIGS:
        assert f"| {config} | 16 | n/a |" in markdown
