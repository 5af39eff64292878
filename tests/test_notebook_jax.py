"""examples/colab_tpu.ipynb runs top to bottom on a CPU runtime (it falls back and says so)."""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

# Subprocess-heavy (minutes): CI runs it on the newest line only (pyproject: markers).
pytestmark = pytest.mark.slow

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "examples" / "colab_tpu.ipynb"


def _outputs(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(str(output.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def test_colab_notebook_runs_on_cpu(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel inherits this process's environment: 8 host devices, NPROC=16.
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(_outputs(cell) for cell in notebook.cells if cell.cell_type == "code")
    assert "falling back to 8 host CPU devices" in text
    assert "backend jax" in text
    accuracy = float(re.search(r"validation accuracy (\d\.\d+)", text).group(1))
    assert accuracy > 0.9
    peaks = re.search(r"peak memory per epoch \(GiB\): \[(.*)\]", text).group(1)
    assert all(float(v) > 0 for v in peaks.split(","))
    updates = int(re.search(r"optimizer updates: (\d+)", text).group(1))
    assert updates == 12 * (1437 // 128)     # one update per global batch, 12 epochs
    assert (tmp_path / "logs").is_dir()
    pruned = re.search(r"pruned: kernel sparsity (\d\.\d+), validation accuracy (\d\.\d+)", text)
    assert abs(float(pruned.group(1)) - 0.8) <= 0.01
    assert float(pruned.group(2)) > 0.9
    student = float(re.search(r"student: \d+ parameters .* validation accuracy (\d\.\d+)",
                              text).group(1))
    assert student > 0.85
    # The disconnected run resumed from its newest checkpoint, mid-epoch, on the weights
    # of the run never stopped (the same devices, the same order of every sum).
    saved = re.search(r"disconnected at update 29; checkpoints at updates \[([\d, ]+)\]", text)
    resumed = re.search(r"resumed at update (\d+): epoch (\d+), batch (\d+)", text)
    # (at least: a save still writing when the list was read is not in it)
    assert int(resumed.group(1)) >= max(int(u) for u in saved.group(1).split(","))
    assert int(resumed.group(3)) > 0
    assert re.search(r"max \|resumed - never stopped\| over the weights: 0\.0$", text, re.M)
