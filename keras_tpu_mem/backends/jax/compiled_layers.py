"""Memory by Keras layer on JAX: XLA's buffer assignment and live ranges, read by `op_name`.

`compiled.compile_step(..., dump=True)` has XLA write three texts of the optimized
module (`_compat.jax.compile_with_dump`): the HLO with each instruction's metadata,
the buffer assignment (every logical buffer, its size and defining instruction) and
the live ranges (the instruction sequence, each buffer's first and last step, and the
buffers live at the peak). Here each buffer is attributed to a row:

* an entry parameter named `state[i][j]` is the j-th variable of the state `fit`
  passes (trainable, non-trainable, optimizer, metrics): its layer (a weight), the
  layer of the weight an optimizer slot tracks, the "optimizer" row (its other
  state) or "unattributed" (metric state); `data[...]` is the "inputs" row;
* any other instruction by its `op_name`, e.g. `jit(train_step)/jvp(wide)/dot_general`
  (forward) or `.../transpose(jvp(wide))/select_n` (backward): the deepest scope that
  names a layer of the model;
* an instruction whose `op_name` names no layer (copies, bitcasts, the loss, the
  optimizer's update) by its fused computation, then by its operands, so a copy of a
  weight or the new value of a slot counts to that layer.

A row's `saved_activations` are its forward buffers (`jvp(...)` without `transpose`)
whose last use is a backward instruction: what the forward pass keeps for the
gradient, read from the uses rather than from one step where "the backward pass
starts" (XLA schedules backward instructions that need no forward value early). Its
`at_peak` are its buffers in the live-range dump's peak list, so the rows sum to
XLA's peak exactly, with buffers that share one place in the buffer assignment (an
instruction that writes over its operand) counted once.

Contract: `keras_tpu_mem.backends.contracts.CompiledLayers`.
"""

from __future__ import annotations

import re

from keras_tpu_mem.backends import layer_owners
from keras_tpu_mem.backends.layer_owners import INPUTS, UNATTRIBUTED

_WEIGHTS, _OPTIMIZER, _SAVED, _PEAK = 0, 1, 2, 3

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_STATE = re.compile(r"^state\[(\d+)\]\[(\d+)\]$")
_ACCUMULATOR = re.compile(r"^accumulators\[(\d+)\]$")
_VALUE = re.compile(r"<\d+ ([\w.\-]+(?:\{[\d,]*\})?) @\d+> \(size=(\d+),")
_RANGE = re.compile(r"^\s+([\w.\-]+)(\{[\d,]*\}):(\d+)-(\d+)\s*$")
_PEAK_LINE = re.compile(r"^\s+([\w.\-]+)(\{[\d,]*\}): (\d+) bytes")
_SEQUENCE = re.compile(r"^\s+(\d+):([\w.\-]+)\s*$")


def _key(name: str, index: str = "{}") -> str:
    return name if index in ("", "{}") else name + index


# ------------------------------------------------------------------- the texts
_OPCODE = re.compile(r"(?:^|\s)([a-z][a-z\-]*)\(")
_TUPLE_INDEX = re.compile(r"\bindex=(\d+)")
_BODY = re.compile(r"body=%?([\w.\-]+)")


def _parse_hlo(text: str):
    """`{instruction: (op_name, operands, calls, computation)}`, `{computation: [names]}`
    and `{instruction: (opcode, tuple index, while body), ("root", computation): root}`."""
    instructions, computations, current, shape = {}, {}, None, {}
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and " = " not in line:
            current = head.group(2)
            computations[current] = []
            continue
        match = _INSTRUCTION.match(line)
        if not match or current is None:
            continue
        name, rest = match.groups()
        op_name = _OP_NAME.search(rest)
        body = rest.split(", metadata=")[0]
        calls = _CALLS.search(body)
        operands = re.findall(r"%([\w.\-]+)", body)
        instructions[name] = (op_name.group(1) if op_name else "", operands,
                              calls.group(1) if calls else None, current)
        opcode, index, body_of = (_OPCODE.search(body), _TUPLE_INDEX.search(body),
                                  _BODY.search(body))
        shape[name] = (opcode.group(1) if opcode else "", int(index.group(1)) if index else None,
                       body_of.group(1) if body_of else None)
        computations[current].append(name)
        if line.lstrip().startswith("ROOT"):
            shape[("root", current)] = name
    return instructions, computations, shape


def _parse_live(text: str):
    """The sequence `{instruction: step}`, `{buffer: (start, end)}` and the peak's
    `{buffer: bytes}`."""
    sequence, ranges, peak, in_peak = {}, {}, {}, False
    for line in text.splitlines():
        if "Live ranges at" in line and "(peak)" in line:
            in_peak = True
            continue
        if in_peak:
            match = _PEAK_LINE.match(line)
            if match:
                peak[_key(match.group(1), match.group(2))] = int(match.group(3))
                continue
            if line.strip():
                in_peak = False
        match = _SEQUENCE.match(line)
        if match:
            sequence.setdefault(match.group(2), int(match.group(1)))
            continue
        match = _RANGE.match(line)
        if match:
            ranges[_key(match.group(1), match.group(2))] = (int(match.group(3)),
                                                             int(match.group(4)))
    return sequence, ranges, peak


def _buffer_key(name: str) -> str:
    """The key of a logical buffer the buffer assignment names `name` or `name{k}`."""
    base, _, index = name.partition("{")
    return _key(base, "{" + index if index else "")


def _parse_sizes(text: str) -> dict:
    """`{buffer: bytes}` of every logical buffer in the buffer assignment."""
    return {_buffer_key(name): int(size) for name, size in _VALUE.findall(text)}


_SLOT = re.compile(r"<\d+ ([\w.\-]+(?:\{[\d,]*\})?) @\d+> \(size=(\d+),offset=(\d+)\)")
_ALLOCATION_INDEX = re.compile(r"^allocation (\d+):")


def _parse_places(text: str, shape: dict) -> tuple[dict, dict]:
    """From one read of the buffer assignment: `{buffer: (allocation, offset)}`, where it
    puts each logical buffer, and `{buffer: parameter}`, each buffer it places in an
    entry parameter's allocation (`allocation N: size S, parameter P, ...`) other than
    the parameter itself."""
    slots, parameter_allocations, allocation = {}, {}, None
    for line in text.splitlines():
        head = _ALLOCATION_INDEX.match(line)
        if head:
            allocation = int(head.group(1))
            if ", parameter " in line:
                parameter_allocations[allocation] = []
            continue
        for name, _size, offset in _SLOT.findall(line):
            buffer = _buffer_key(name)
            slots[buffer] = (allocation, int(offset))
            if allocation in parameter_allocations:
                parameter_allocations[allocation].append(buffer)
    homes = {}
    for members in parameter_allocations.values():
        params = [name for name in members
                  if shape.get(name.partition("{")[0], ("",))[0] == "parameter"]
        if len(params) == 1:
            homes.update({name: params[0] for name in members if name != params[0]})
    return slots, homes


def _one_per_slot(peak: dict, slots: dict) -> dict:
    """The peak's buffers, those that share one place counted once (the largest).
    XLA's live-range peak lists both the operand and the result of an instruction
    that writes over its operand (an elementwise fusion: Adam's slot update, a pulled
    step's accumulator), though the buffer assignment gives them one slice of one
    allocation: summed as listed, a pulled step's peak exceeded its compiled total."""
    kept, taken = {}, set()
    for buffer, size in sorted(peak.items(), key=lambda item: -item[1]):
        slot = slots.get(buffer)
        if slot is not None:
            if slot in taken:
                continue
            taken.add(slot)
        kept[buffer] = size
    return kept


_ALLOCATION = re.compile(r"^allocation \d+: size \d+,(?: color (\d+),)?")


def _on_chip_buffers(text: str) -> set:
    """The buffers of allocations in a memory space other than the device's main one
    (`allocation N: size S, color C, ...` with C != 0: XLA:TPU's VMEM and SMEM)."""
    buffers, color = set(), 0
    for line in text.splitlines():
        head = _ALLOCATION.match(line)
        if head:
            color = int(head.group(1) or 0)
            continue
        if color:
            buffers.update(_buffer_key(name) for name, _size in _VALUE.findall(line))
    return buffers


# ------------------------------------------------------------- attribution
class _Attributor:
    """Row and kind (`param`, `forward`, `backward`, `other`) of each instruction."""

    def __init__(self, instructions, computations, shape, names, state_rows):
        self.instructions, self.computations, self.shape = instructions, computations, shape
        self.names, self.state_rows = names, state_rows
        self.memo = {}
        self.callers = {}  # while body -> the while instructions that run it
        for name, entry in shape.items():
            if isinstance(name, str) and entry[0] == "while" and entry[2]:
                self.callers.setdefault(entry[2], []).append(name)

    def layer_of(self, op_name: str):
        scopes = [s for s in re.sub(r"[\w\-]+\(", "", op_name).replace(")", "").split("/") if s]
        for i in range(len(scopes) - 1, -1, -1):
            candidates = self.names.get(scopes[i])
            if candidates:
                # Same name in two places: the path that matches most enclosing scopes.
                return max(candidates, key=lambda p: sum(s in scopes[:i] for s in
                                                         p.split("/")[:-1]))
        return None

    def is_backward(self, name: str) -> bool:
        """An instruction of the backward pass, or a fusion that holds one."""
        op_name, _, calls, _ = self.instructions.get(name, ("", (), None, None))
        if "transpose(" in op_name:
            return True
        return any("transpose(" in self.instructions[inner][0]
                   for inner in self.computations.get(calls, ()))

    def buffer(self, buffer: str):
        """The row and kind of a buffer `name` or `name{k}` (an element of a tuple)."""
        name, _, index = buffer.partition("{")
        index = index.rstrip("}")
        if index and "," not in index:
            element = self._element(name, int(index), ())
            if element is not None:
                return element
        return self(name)

    def _element(self, name, k, seen):
        """Element k of a tuple-shaped value: the loop state of a while (an accumulator,
        the operand its body's root tuple puts there), a tuple's operand, a
        get-tuple-element's source."""
        if name in seen or name not in self.instructions:
            return None
        seen = seen + (name,)
        opcode, index, body = self.shape.get(name, ("", None, None))
        operands = self.instructions[name][1]
        if opcode == "tuple" and k < len(operands):
            row = self(operands[k], seen)
            if row[0] != UNATTRIBUTED or self.shape.get(operands[k], ("",))[0] not in (
                    "get-tuple-element", "parameter"):
                return row
            return self._element_of(operands[k], seen)
        if opcode == "get-tuple-element" and operands and index is not None:
            return self._element(operands[0], index, seen)
        computation = body if opcode == "while" else (
            self.instructions[name][3] if opcode == "parameter" else None)
        root = self.shape.get(("root", computation))
        found = self._element(root, k, seen) if root is not None else None
        if opcode == "parameter" and (found is None or found[0] == UNATTRIBUTED):
            # State the loop passes through unchanged (the batch): what enters the loop.
            for caller in self.callers.get(computation, ()):
                operands = self.instructions[caller][1]
                if operands:
                    found = self._element(operands[0], k, seen)
                    if found is not None and found[0] != UNATTRIBUTED:
                        break
        return found

    def _element_of(self, name, seen):
        """A get-tuple-element (or parameter) that `__call__` left unattributed."""
        opcode, index, _ = self.shape.get(name, ("", None, None))
        operands = self.instructions[name][1]
        if opcode == "get-tuple-element" and operands and index is not None:
            return self._element(operands[0], index, seen) or (UNATTRIBUTED, "other")
        return UNATTRIBUTED, "other"

    def __call__(self, name: str, seen=()):
        if name in self.memo:
            return self.memo[name]
        found = self._resolve(name, seen + (name,))
        if found[0] != UNATTRIBUTED or not seen:
            self.memo[name] = found
        return found

    def _resolve(self, name, seen):
        entry = self.instructions.get(name)
        if entry is None:
            return UNATTRIBUTED, "other"
        op_name, operands, calls, _ = entry
        opcode, index, _ = self.shape.get(name, ("", None, None))
        if opcode == "get-tuple-element" and operands and index is not None:
            element = self._element(operands[0], index, seen)
            if element is not None and element[0] != UNATTRIBUTED:
                return element
        state = _STATE.match(op_name)
        if state:
            return self.state_rows.get((int(state.group(1)), int(state.group(2))),
                                       UNATTRIBUTED), "param"
        accumulator = _ACCUMULATOR.match(op_name)
        if accumulator:
            return self.state_rows.get(("accumulators", int(accumulator.group(1))),
                                       UNATTRIBUTED), "param"
        if op_name.startswith("data["):
            return INPUTS, "param"
        layer = self.layer_of(op_name)
        if layer is not None:
            return layer, "backward" if "transpose(" in op_name else (
                "forward" if "jvp(" in op_name else "other")
        if calls in self.computations:  # a fusion: what its instructions name
            for inner in reversed(self.computations[calls]):
                layer = self.layer_of(self.instructions[inner][0])
                if layer is not None:
                    inner_op = self.instructions[inner][0]
                    return layer, "backward" if "transpose(" in inner_op else (
                        "forward" if "jvp(" in inner_op else "other")
        for operand in operands:  # copies, bitcasts, the loss, the update
            if operand in seen or operand not in self.instructions:
                continue
            row, kind = self(operand, seen)
            if row != UNATTRIBUTED:
                return row, kind
        return UNATTRIBUTED, "other"


def layer_rows(model, texts: dict, device_shape):
    """Rows `{row: [weights, optimizer, saved_activations, at_peak]}` and the peak bytes."""
    rows, variable_rows, names = layer_owners.rows_at_rest(model, device_shape)
    state = (model.trainable_variables, model.non_trainable_variables,
             model.optimizer.variables, model.metrics_variables)
    state_rows = {(i, j): variable_rows.get(id(v), UNATTRIBUTED)
                  for i, variables in enumerate(state) for j, v in enumerate(variables)}
    # A pulled step's accumulators: the rows of the trainable weights they sum for.
    state_rows.update({("accumulators", j): variable_rows.get(id(v), UNATTRIBUTED)
                       for j, v in enumerate(model.trainable_variables)})

    instructions, computations, shape = _parse_hlo(texts["hlo"])
    sequence, ranges, peak = _parse_live(texts["live"])
    sizes = _parse_sizes(texts["buffers"])
    # XLA:TPU also assigns on-chip memories (VMEM, SMEM: allocations with a "color");
    # the compiled total, like the device's capacity, is HBM only.
    on_chip = _on_chip_buffers(texts["buffers"])
    slots, homes = _parse_places(texts["buffers"], shape)
    peak = _one_per_slot({buffer: size for buffer, size in peak.items()
                          if buffer not in on_chip}, slots)
    attribute = _Attributor(instructions, computations, shape, names, state_rows)

    _state_as_laid_out(rows, state_rows, instructions, shape, sizes)
    for buffer, size in peak.items():
        row = attribute.buffer(buffer)[0]
        if row == UNATTRIBUTED and buffer in homes:
            # Written into a donated parameter's buffer with nothing that names its
            # owner (a pulled step's zeroed accumulators): the new value of that state.
            row = attribute.buffer(homes[buffer])[0]
        rows[row][_PEAK] += size
    # Kept for the gradient: a forward buffer of the layer whose last use is an
    # instruction of the backward pass (`transpose(...)`). Read from the uses, not from
    # one "backward starts here" step: XLA schedules backward ops that need no
    # forward value (broadcasts of constants) before the forward pass ends.
    at_step = {step: inst for inst, step in sequence.items()}
    for buffer, (_, last) in ranges.items():
        user = at_step.get(last)
        if user is None or not attribute.is_backward(user):
            continue
        row, kind = attribute.buffer(buffer)
        if kind == "forward" and buffer not in on_chip:
            rows[row][_SAVED] += sizes.get(buffer, 0)
    return rows, sum(peak.values())


def _state_as_laid_out(rows, state_rows, instructions, shape, sizes) -> None:
    """Weights and optimizer slots at rest as XLA allocates them: the entry parameter
    `state[i][j]`'s buffer (on TPU padded to its tiles: a (129, 129) float32 kernel takes
    139,264 bytes, not 66,564), where the dump names every one; else the shapes' bytes
    stay."""
    laid_out = {}
    for name, (op_name, *_rest) in instructions.items():
        state = _STATE.match(op_name)
        if state and shape.get(name, ("",))[0] == "parameter" and _key(name) in sizes:
            laid_out[(int(state.group(1)), int(state.group(2)))] = sizes[_key(name)]
    columns = {0: _WEIGHTS, 1: _WEIGHTS, 2: _OPTIMIZER}  # trainable, non-trainable, slots
    wanted = [key for key in state_rows if key[0] in columns]
    if not wanted or any(key not in laid_out for key in wanted):
        return
    for row in rows.values():
        row[_WEIGHTS] = row[_OPTIMIZER] = 0
    for key in wanted:
        rows[state_rows[key]][columns[key[0]]] += laid_out[key]


def require() -> None:
    """Nothing: JAX reads the attribution from XLA's dump."""
