"""Both backends implement `backends.contracts` (issue 29, item 3): each concern
module's public names are exactly its protocol's members, each function with the
protocol's parameter names in order. The modules are parsed with `ast`, so both
backends are checked from one process without importing the other framework."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os

import pytest

from keras_tpu_mem import backends
from keras_tpu_mem.backends import contracts

BACKENDS = ("tensorflow", "jax")

# Public names a module has beyond its protocol, each with why it may: JAX's trainer
# module (being restructured elsewhere, not changed here) also offers these two; the
# contract asks nothing new of either trainer. `test_allowances_are_still_needed`
# fails once they are gone, so that this entry goes with them.

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "{}/",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "{}",
    inspect.Parameter.VAR_POSITIONAL: "*{}",
    inspect.Parameter.KEYWORD_ONLY: "{} (keyword)",
    inspect.Parameter.VAR_KEYWORD: "**{}",
}


def _spelled(parameters) -> list[str]:
    return [_KINDS[p.kind].format(p.name) for p in parameters]


def _ast_parameters(args: ast.arguments) -> list[str]:
    spelled = [f"{a.arg}/" for a in args.posonlyargs] + [a.arg for a in args.args]
    if args.vararg is not None:
        spelled.append(f"*{args.vararg.arg}")
    spelled += [f"{a.arg} (keyword)" for a in args.kwonlyargs]
    if args.kwarg is not None:
        spelled.append(f"**{args.kwarg.arg}")
    return spelled


def public_names(source: str) -> dict:
    """A module's public names, from its source: functions (name -> their parameters),
    classes (`"class"`) and any other public module-level name it assigns
    (`"constant"`: a backend's capability is a function of its contract)."""
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = _ast_parameters(node.args)
        elif isinstance(node, ast.ClassDef):
            found[node.name] = "class"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and not target.id.startswith("__"):
                    found[target.id] = "constant"
    return {name: kind for name, kind in found.items() if not name.startswith("_")}


def protocol_members(protocol: type) -> dict:
    return {name: kind if kind == "class" else _spelled(kind)
            for name, kind in contracts.members(protocol).items()}


def differences(source: str, protocol: type) -> list[str]:
    """What a module (its source) does not have of `protocol`, has beyond it, or has
    with other parameters: one line each, none where it implements it exactly."""
    module, wanted = public_names(source), protocol_members(protocol)
    found = []
    for name in sorted(set(wanted) - set(module)):
        found.append(f"missing {name} ({'class' if wanted[name] == 'class' else 'function'})")
    for name in sorted(set(module) - set(wanted)):
        found.append(f"not in the contract: {name} ({module[name]})")
    for name in sorted(set(module) & set(wanted)):
        if module[name] != wanted[name]:
            found.append(f"{name}: {module[name]}, the contract says {wanted[name]}")
    return found


def _source(backend: str, concern: str) -> str:
    spec = importlib.util.find_spec(f"keras_tpu_mem.backends.{backend}.{concern}")
    with open(spec.origin) as file:
        return file.read()


def _served(backend: str) -> list[str]:
    return [c for c in contracts.CONCERNS if contracts.ONLY_ON.get(c, backend) == backend]


CASES = [(concern, backend) for backend in BACKENDS for concern in _served(backend)]


@pytest.mark.parametrize(("concern", "backend"), CASES, ids=[f"{b}.{c}" for c, b in CASES])
def test_backend_implements_the_contract(concern, backend):
    found = differences(_source(backend, concern), contracts.CONCERNS[concern])
    assert not found, f"backends/{backend}/{concern}.py: " + "; ".join(found)


def test_every_module_is_a_concern_and_only_its_backend_has_it():
    for backend in BACKENDS:
        folder = os.path.dirname(importlib.util.find_spec(
            f"keras_tpu_mem.backends.{backend}").origin)
        modules = {name[:-3] for name in os.listdir(folder)
                   if name.endswith(".py") and name != "__init__.py"}
        assert modules - set(contracts.PARTS[backend]) == set(_served(backend)), backend
        for concern in contracts.CONCERNS:
            assert backends.get(backend).has(concern) == (concern in _served(backend))


_FAKE_DEVICES = '''
ALLOCATOR_READER = "a constant a caller would read"

def allocator_reader() -> str:
    return "reader"

def replica_devices(where=None):
    return []

def device_name(dev):
    return "CPU:0"
'''


def test_a_module_that_breaks_the_contract_is_reported():
    found = differences(_FAKE_DEVICES, contracts.Devices)
    assert "missing reset_peak (function)" in found
    assert "not in the contract: ALLOCATOR_READER (constant)" in found
    assert "device_name: ['dev'], the contract says ['device']" in found
    assert not [line for line in found if line.startswith(("allocator_reader",
                                                           "replica_devices"))]


def test_one_missing_function_or_class_is_reported():
    source = _source("tensorflow", "storage")
    assert differences(source, contracts.Storage) == []
    without = source.replace("def remote_path_problem(", "def _remote_path_problem(")
    assert differences(without, contracts.Storage) == ["missing remote_path_problem (function)"]
    assert differences("class Step:\n    pass\n", contracts.Trainer) == [
        "missing update_variable (function)"]
    assert differences("def Step():\n    pass\n\ndef update_variable(variable, fn, *args):\n"
                       "    pass\n", contracts.Trainer) == [
        "Step: [], the contract says class"]


def test_every_member_of_a_contract_says_what_it_does():
    with open(contracts.__file__) as file:
        tree = ast.parse(file.read())
    protocols = {protocol.__name__ for protocol in contracts.CONCERNS.values()}
    classes = [node for node in tree.body
               if isinstance(node, ast.ClassDef) and node.name in protocols]
    assert {node.name for node in classes} == protocols
    for node in classes:
        assert ast.get_docstring(node), node.name
        for index, member in enumerate(node.body):
            if isinstance(member, ast.FunctionDef):
                assert ast.get_docstring(member), f"{node.name}.{member.name}"
            elif isinstance(member, ast.AnnAssign):  # a class: its docstring follows it
                following = node.body[index + 1] if index + 1 < len(node.body) else None
                assert (isinstance(following, ast.Expr)
                        and isinstance(following.value, ast.Constant)
                        and isinstance(following.value.value, str)), (
                    f"{node.name}.{member.target.id}")
