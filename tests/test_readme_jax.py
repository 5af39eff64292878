"""The JAX blocks of README.md and the docs pages (those that set KERAS_BACKEND=jax themselves)
run as pasted."""

from __future__ import annotations

import pytest
from test_readme import ALL_BLOCKS, _ids, _run

JAX_BLOCKS = [b for b in ALL_BLOCKS if b.backend == "jax"]


def test_readme_has_a_jax_block():
    assert JAX_BLOCKS, "the README shows no JAX usage"


@pytest.mark.slow
@pytest.mark.parametrize("block", JAX_BLOCKS, ids=_ids(JAX_BLOCKS))
def test_readme_jax_block_runs_as_pasted(block, tmp_path):
    assert block.skip_reason is None, "JAX blocks are meant to run"
    result = _run(block.code, tmp_path, backend="jax")
    assert result.returncode == 0, (
        f"{block.page} block at line {block.line} ({block.section}) failed:\n"
        f"{result.stderr[-4000:]}")
    assert "validation accuracy" in result.stdout, result.stdout[-2000:]
