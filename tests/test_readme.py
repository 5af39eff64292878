"""Every Python block of README.md and of the docs pages runs as pasted, from a folder outside
the repository.

Each block runs in its own interpreter (a reader pastes one block into a fresh
session), from an empty temporary folder (so a relative path into the
repository would fail), with the Keras TensorFlow backend. A block that sets
`os.environ["KERAS_BACKEND"] = "jax"` itself is a JAX block: it runs in the JAX
test process (`tests/test_readme_jax.py`), not here. A block that must not run
is marked right before its fence with `<!-- not-run: why -->`, and the reason
is required. The docs pages (`docs/*.md`) follow the same rules, except for the
fragments listed in `FRAGMENTS` (excerpts of a larger program, each with why).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: README.md first, then every docs page: the README's sections moved there keep running.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: The README is a front page; the manual is docs/.
README_MAX_LINES = 250

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*not-run:(.*?)-->\s*$")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")
_JAX_BLOCK = re.compile(r"""os\.environ\[["']KERAS_BACKEND["']\]\s*=\s*["']jax["']""")


class Block:
    def __init__(self, code: str, line: int, section: str, skip_reason: str | None,
                 page: str = "README.md"):
        # line: 1-based line of the opening fence, as an editor shows it
        self.code, self.line, self.section, self.skip_reason = code, line, section, skip_reason
        self.page = page  # relative to the repository root, e.g. "docs/pruning.md"

    @property
    def backend(self) -> str:
        return "jax" if _JAX_BLOCK.search(self.code) else "tensorflow"

    @property
    def slug(self) -> str:
        section = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-") or "top"
        # README blocks keep their plain section ids; a docs page's are prefixed with its name.
        return section if self.page == "README.md" else f"{Path(self.page).stem}-{section}"

    @property
    def fragment(self) -> str | None:
        """Why this block is a fragment that does not run (see FRAGMENTS), or None."""
        return next((why for (page, section), why in FRAGMENTS.items()
                     if self.page == page and self.section.startswith(section)), None)


def python_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The ```python blocks of a Markdown text, each with its section and not-run marker.

    A `<!-- not-run: ... -->` marker counts for the block whose fence follows it
    (blank lines between are allowed); a marker with no reason is an error, as
    is one that no Python block follows.
    """
    lines = text.splitlines()
    blocks, section, marker, i = [], "", None, 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            language = fence.group(1)
            start = i + 1
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            if i == len(lines):
                raise ValueError(f"{page} line {start}: a ``` fence that is never closed")
            if language == "python":
                blocks.append(Block("\n".join(lines[start:i]) + "\n", start, section,
                                    marker[1] if marker else None, page))
            elif marker:
                raise ValueError(f"{page} line {marker[0]}: a not-run marker before a "
                                 f"{language or 'plain'} block, not a Python block")
            marker = None
        elif (m := _MARKER.match(line)) is not None:
            reason = m.group(1).strip()
            if not reason:
                raise ValueError(f"{page} line {i + 1}: `<!-- not-run: -->` must say why "
                                 "the block does not run")
            marker = (i + 1, reason)
        elif line.strip():
            if marker:
                raise ValueError(f"{page} line {marker[0]}: a not-run marker must come "
                                 "right before the block it marks")
            if (h := _HEADING.match(line)) is not None:
                section = h.group(1)
        i += 1
    if marker:
        raise ValueError(f"{page} line {marker[0]}: a not-run marker with no block after it")
    return blocks


# The docs pages' own excerpts, written before their pages were tested: each uses names
# (`tpu`, `model`, `train`, ...) that the reader's program defines, so none runs as pasted.
# Keyed by (page, start of the section heading); each must still match a block
# (test_fragments_are_listed_and_still_there), and a new docs block runs unless marked.
FRAGMENTS = {
    ("docs/distillation.md", "Distillation"):
        "an excerpt: `tpu`, `train`, `build_student` and teacher.keras are the reader's",
    ("docs/jax.md", "keras-tpu-mem on JAX"):
        "an excerpt: `x_train`, `y_train` are the reader's; jax.devices() of a TPU VM",
    ("docs/jax.md", "Install"):
        "a Colab cell: `!pip install` is notebook syntax, not Python",
    ("docs/monitoring.md", "Memory and throughput monitoring"):
        "an excerpt: `tpu`, `train`, `model` are the reader's",
    ("docs/planning.md", "`batch_size_sweep("):
        "an excerpt: `x`, `y`, `keras`, `tf`, `ktm` come from the page's example script",
    ("docs/precision.md", "Mixed bfloat16"):
        "an excerpt: `model` and `ds` are the reader's",
    ("docs/precision.md", "`precision_report(model)`"):
        "an excerpt: `keras` and `ktm` are imported by the reader",
    ("docs/pruning.md", "Pruning"):
        "an excerpt: `tpu`, `build_model` and `train` are the reader's",
}


def _page_blocks(path: Path) -> list[Block]:
    return python_blocks(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())


ALL_BLOCKS = [b for page in PAGES for b in _page_blocks(page) if b.fragment is None]
FRAGMENT_BLOCKS = [b for page in PAGES for b in _page_blocks(page) if b.fragment is not None]
# Blocks marked not-run are illustrations (their reason is required by the parser and
# listed by test_not_run_blocks_say_why); every other TensorFlow block runs.
BLOCKS = [b for b in ALL_BLOCKS if b.backend == "tensorflow" and b.skip_reason is None]
NOT_RUN = [b for b in ALL_BLOCKS if b.skip_reason is not None]


def _ids(blocks):
    """Section slugs (a docs page's prefixed with its name), numbered within a section that has
    several blocks (stable under edits elsewhere in the page, unlike line numbers)."""
    seen, ids = {}, []
    for block in blocks:
        seen[block.slug] = seen.get(block.slug, 0) + 1
        ids.append(block.slug if seen[block.slug] == 1 else f"{block.slug}-{seen[block.slug]}")
    return ids

# What a block's output must show, beyond exiting 0: the claims its page makes about it
# (keyed by the page and the start of its section's heading).
EXPECTED = {
    ("README.md", "Quickstart"):
        [(r"validation accuracy: (0\.\d+)", lambda acc: float(acc) >= 0.95)],
    ("docs/planning.md", "Will it fit?"):
        [(r"fits: NO", None), (r"-> fits with accumulation_steps=2 ", None),
         (r"bf16 compute .* fits: yes", None)],
    ("docs/pruning.md", "Quick start: pruning"): [(r"total .* 80\.00%", None)],
}


def _run(code: str, cwd: Path, backend: str = "tensorflow") -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["KERAS_BACKEND"] = backend
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # The package under test is this checkout (also when it is not installed);
    # the block still runs from `cwd`, outside the repository.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    script = cwd / "block.py"
    script.write_text(code, encoding="utf-8")
    # The timeout only guards against a hang; nothing asserts on time.
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_readme_has_the_python_blocks_this_test_runs():
    sections = [b.section for b in BLOCKS]
    assert len(BLOCKS) >= 6, sections
    for name in ("Quickstart", "Gradient accumulation", "Will it fit?"):
        assert any(s.startswith(name) for s in sections), (name, sections)
    for page, section in EXPECTED:  # every output check has its block
        assert any(b.page == page and b.section.startswith(section) for b in BLOCKS), (
            page, section)


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, len(lines)
    assert "## The two commands" in lines  # .ci/run reads the test command from there


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    pages = [p.name for p in PAGES[1:] if p.name != "index.md"]
    assert pages, PAGES
    missing = [name for name in pages if f"]({name})" not in index]
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=_ids(BLOCKS))
def test_readme_block_runs_as_pasted(block, tmp_path):
    result = _run(block.code, tmp_path)
    assert result.returncode == 0, (
        f"{block.page} block at line {block.line} ({block.section}) failed:\n"
        f"{result.stderr[-4000:]}")
    # A block that feeds fit a tf.data pipeline passes shuffle=False (the pipeline
    # shuffles, or is stand-in data); Keras would otherwise warn that it ignores it.
    assert "`shuffle=True` was passed" not in result.stderr, block.section
    for (page, section), checks in EXPECTED.items():
        if block.page != page or not block.section.startswith(section):
            continue
        for pattern, check in checks:
            match = re.search(pattern, result.stdout)
            assert match, (f"{block.page} block at line {block.line}: {pattern!r} not in its "
                           f"output:\n{result.stdout[-3000:]}")
            if check is not None:
                assert check(*match.groups()), match.group(0)


def test_not_run_blocks_say_why_and_are_few():
    # Over README.md and every docs page together: the bound the README alone had.
    assert len(NOT_RUN) <= 2, [(b.page, b.line, b.section) for b in NOT_RUN]
    assert all(len(b.skip_reason) >= 20 for b in NOT_RUN), [b.skip_reason for b in NOT_RUN]


def test_fragments_are_listed_and_still_there():
    # One block per entry: a renamed section or a removed excerpt shows here, and a new
    # docs block is not a fragment by accident.
    keys = [(b.page, next(s for p, s in FRAGMENTS if p == b.page and b.section.startswith(s)))
            for b in FRAGMENT_BLOCKS]
    assert sorted(keys) == sorted(FRAGMENTS), (keys, list(FRAGMENTS))
    assert all(b.skip_reason is None for b in FRAGMENT_BLOCKS)  # not also marked not-run
    assert all(len(why) >= 20 for why in FRAGMENTS.values())


# ----------------------------------------------------- the extraction itself
def test_extraction_finds_python_blocks_with_their_sections_and_markers():
    text = "\n".join([
        "# Title", "", "## First", "```python", "a = 1", "```", "```bash", "ls", "```",
        "## Second", "<!-- not-run: needs a TPU -->", "", "```python", "b = 2", "```",
    ])
    blocks = python_blocks(text)
    assert [(b.code, b.section, b.skip_reason) for b in blocks] == [
        ("a = 1\n", "First", None), ("b = 2\n", "Second", "needs a TPU")]
    assert blocks[0].line == 4  # the line of its opening fence
    assert {b.page for b in blocks} == {"README.md"}
    assert python_blocks(text, "docs/x.md")[1].slug == "x-second"


@pytest.mark.parametrize("text, message", [
    ("<!-- not-run: -->\n```python\nx\n```", "must say why"),
    ("<!-- not-run:   -->\n```python\nx\n```", "must say why"),
    ("<!-- not-run: slow -->\nsome prose\n```python\nx\n```", "right before"),
    ("<!-- not-run: slow -->\n```bash\nls\n```", "not a Python block"),
    ("```python\nx = 1\n", "never closed"),
    ("text\n<!-- not-run: slow -->\n", "no block after it"),
])
def test_extraction_refuses_bad_markers(text, message):
    with pytest.raises(ValueError, match=message):
        python_blocks(text)
