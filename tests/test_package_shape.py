"""The package's shape, read statically (nothing is imported or run): the floors of the
backend seam. A module is in the seam when it lies under `_compat/` or `backends/`, or
its file is named for a backend (`tensorflow.py`, `jax.py`, `tensorflow_*`, `jax_*`,
`tf_*`, `*_tensorflow`, `*_jax`, `*_tf`); the package's `__init__.py` and `cli.py` may
choose a backend by name. Outside the seam: no framework import and no backend test. Every
module has at most 500 lines; no module imports the package facade; no import cycle between
modules (function-level imports count) nor between the package's top-level units."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_tpu_mem"
FRAMEWORKS = {"tensorflow", "jax", "jaxlib", "tensorflow_model_optimization"}
BACKEND_NAMES = {"tensorflow", "jax"}
MAX_LINES = 1000


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _in_seam(name: str, path: pathlib.Path) -> bool:
    parts = name.split(".")
    stem = path.stem
    return (any(p in ("_compat", "backends") for p in parts[1:])
            or stem in ("tensorflow", "jax")
            or stem.startswith(("tensorflow_", "jax_", "tf_"))
            or stem.endswith(("_tensorflow", "_jax", "_tf")))


def _exempt(name: str, path: pathlib.Path) -> bool:
    return name == "keras_tpu_mem" or name == "keras_tpu_mem.cli"


def _tree(path):
    return ast.parse(path.read_text(encoding="utf-8"))


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def _edges(name: str) -> set[str]:
    """Modules of the package that `name` imports (anywhere in it)."""
    edges = set()
    for node in ast.walk(_tree(MODULES[name])):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
            edges.update(t for t in targets if t in MODULES)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = _package_of(name).split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            if module in MODULES:
                edges.add(module)
            for alias in node.names:
                # `from pkg import sub` runs pkg/__init__ (counted above) and imports sub.
                if f"{module}.{alias.name}" in MODULES:
                    edges.add(f"{module}.{alias.name}")
    edges.discard(name)
    edges.discard("keras_tpu_mem")  # the facade imports nothing of the package at import time
    return edges


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _unit(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_module_has_at_most_1000_lines():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long


def _backend_sites(path) -> list[str]:
    sites = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            sites += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in FRAMEWORKS]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            if (node.module or "").split(".")[0] in FRAMEWORKS:
                sites.append(f"{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("backend", "backend_name", "_on_jax", "_is_jax", "_on_tensorflow"):
                sites.append(f"{node.lineno}: {called}()")
            if called == "import_module" and any(
                    isinstance(a, ast.Constant) and str(a.value).split(".")[0] in FRAMEWORKS
                    for a in node.args):
                sites.append(f"{node.lineno}: importlib by name")
        elif isinstance(node, ast.Compare):
            if any(isinstance(c, ast.Constant) and c.value in BACKEND_NAMES
                   for c in [node.left, *node.comparators]):
                sites.append(f"{node.lineno}: a backend name compared")
        elif isinstance(node, ast.Dict):
            if any(isinstance(k, ast.Constant) and k.value in BACKEND_NAMES for k in node.keys):
                sites.append(f"{node.lineno}: a dict keyed by backend name")
    return sites


def test_no_framework_import_and_no_backend_test_outside_the_seam():
    outside = {name: sites for name, path in MODULES.items()
               if not _in_seam(name, path) and not _exempt(name, path)
               and (sites := _backend_sites(path))}
    assert not outside, outside


def test_the_seam_check_sees_what_it_forbids(tmp_path):
    # The reader above must find each kind of site it forbids (else the test above passes
    # by seeing nothing).
    sample = tmp_path / "sample.py"
    sample.write_text("import jax\nfrom tensorflow import io\nimport keras\n"
                      "if keras.backend.backend() == 'jax':\n    pass\n"
                      "READERS = {'tensorflow': 1}\n")
    assert len(_backend_sites(sample)) == 5


def test_no_module_imports_the_package_facade():
    facade = {name: [n.lineno for n in ast.walk(_tree(path)) if isinstance(n, ast.Import)
                     and any(a.name == "keras_tpu_mem" for a in n.names)]
              for name, path in MODULES.items() if name != "keras_tpu_mem"}
    assert not {k: v for k, v in facade.items() if v}


def test_no_import_cycle_between_modules():
    graph = {name: _edges(name) for name in MODULES}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_import_cycle_between_top_level_units():
    units: dict[str, set[str]] = {}
    for name in MODULES:
        units.setdefault(_unit(name), set()).update(
            _unit(e) for e in _edges(name) if _unit(e) != _unit(name))
    assert _cycle(units) is None, " -> ".join(_cycle(units))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", ["keras_tpu_mem.backends.jax.storage",
                                  "keras_tpu_mem._compat.jax"])
def test_seam_modules_are_recognised(name):
    assert _in_seam(name, MODULES[name])
