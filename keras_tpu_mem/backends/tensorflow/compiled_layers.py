"""Memory by Keras layer on TensorFlow: XLA's `HloProto` buffer assignment, read by `op_name`.

`compiled.compile_step(..., dump=True)` returns the optimized module's serialized
`HloProto` (its instructions with `op_name` metadata, the logical buffers with their
defining instructions, the allocations and the heap simulator's trace of the
temporaries) and the step function's captures. Each buffer is attributed to a row:

* an entry parameter: the batch's leaves come first ("inputs"), then the function's
  captured variables in order: a weight's layer, a slot's layer, "optimizer" (a
  pulled step's accumulator: its weight's layer);
* any other instruction by its `op_name`, e.g. `sequential/wide/MatMul` (forward) or
  `gradient_tape/sequential/wide/MatMul_1` (backward): the deepest scope that names a
  layer (TensorFlow may suffix a reused name scope, `wide_1`: an exact name first,
  then the name without the suffix); otherwise by its fused computation, then its
  operands.

The peak: XLA's heap simulator replays the temporaries' allocations and frees; the
buffers live at its largest point, plus every parameter, result and constant (live
for the whole step), are `at_peak`, so the rows sum to `peak_bytes` and the compiled
total exceeds it by the packing of the temporaries (`slack_bytes`). A row's
`saved_activations` are its forward temporaries that an instruction of the backward
pass (`gradient_tape/...`) reads.

Contract: `keras_tpu_mem.backends.contracts.CompiledLayers`.
"""

from __future__ import annotations

import re

from keras_tpu_mem.backends import layer_owners
from keras_tpu_mem.backends.layer_owners import INPUTS, UNATTRIBUTED
from keras_tpu_mem.backends.tensorflow.compiled import _hlo_proto_class

_SAVED, _PEAK = 2, 3
_ALLOC, _FREE, _SHARE = 0, 1, 2
_SUFFIX = re.compile(r"_\d+$")


def require() -> None:
    """Nothing: TensorFlow's compile gives the `HloProto` with its buffer assignment."""


class _Attributor:
    def __init__(self, module, names, param_rows):
        self.by_id, self.by_name, self.computations = {}, {}, {}
        for computation in module.computations:
            self.computations[computation.id] = computation
            for inst in computation.instructions:
                self.by_id[inst.id] = inst
                self.by_name[inst.name] = inst
        self.entry = module.entry_computation_id
        self.names, self.param_rows, self.memo = names, param_rows, {}
        self.users, self.scopes, self.suffixed = {}, {}, False
        for inst in self.by_id.values():
            for operand in inst.operand_ids:
                self.users.setdefault(operand, []).append(inst)

    def calibrate(self, weight_paths):
        """Learns each layer's name scope from the instructions that read its weights.

        TensorFlow uniquifies name scopes inside the step's graph: a layer `dense` may
        run under `dense_1` and the layer `dense_1` under `dense_1_2`. The scope of the
        instruction reading a layer's weight names that layer (and its enclosing
        scopes its parents)."""
        self.scopes, self.suffixed = {}, False
        for inst in list(self.by_id.values()):
            if inst.opcode != "parameter" or inst.id not in weight_paths:
                continue
            path = weight_paths[inst.id].split("/")
            for op_name in self._reader_names(inst):
                tokens = [t for t in op_name.split("/") if t]
                if tokens[:1] == ["gradient_tape"]:
                    continue
                at = next((j for j in range(len(tokens) - 1, -1, -1)
                           if _SUFFIX.sub("", tokens[j]) == path[-1] or tokens[j] == path[-1]),
                          None)
                if at is None:
                    continue
                for depth in range(len(path)):
                    j = at - depth
                    if j < 0:
                        break
                    self.scopes.setdefault(tokens[j], "/".join(path[:len(path) - depth]))
                    self.suffixed |= tokens[j] != path[len(path) - 1 - depth]

    def _reader_names(self, inst):
        """The op_names of the instructions that read `inst`: a reader's own, or, for a
        `call`/fusion without one, those inside it that read the parameter."""
        for user in self.users.get(inst.id, ()):
            if user.metadata.op_name:
                yield user.metadata.op_name
            else:
                for inner in self.inner(user):
                    if inner.metadata.op_name:
                        yield inner.metadata.op_name

    def layer_of(self, op_name: str):
        scopes = [s for s in op_name.split("/") if s]
        for i in range(len(scopes) - 1, -1, -1):
            if scopes[i] in self.scopes:
                return self.scopes[scopes[i]]
            stripped = _SUFFIX.sub("", scopes[i])
            for name in ((stripped, scopes[i]) if self.suffixed else (scopes[i], stripped)):
                if name in self.names:
                    return self.names[name][0]
        return None

    def inner(self, inst, depth: int = 4):
        """The instructions of the computations `inst` calls, nested calls included
        (TensorFlow 2.19's XLA:CPU wraps a fusion in a `call` whose own op_name is
        empty; the names live one computation further in)."""
        for cid in inst.called_computation_ids:
            for inner in self.computations[cid].instructions:
                yield inner
                if depth > 1:
                    yield from self.inner(inner, depth - 1)

    def is_backward(self, inst) -> bool:
        if inst.metadata.op_name.startswith("gradient_tape/"):
            return True
        return any(inner.metadata.op_name.startswith("gradient_tape/")
                   for inner in self.inner(inst))

    def __call__(self, inst, seen=()):
        if inst.id in self.memo:
            return self.memo[inst.id]
        found = self._resolve(inst, seen + (inst.id,))
        if found[0] != UNATTRIBUTED or not seen:
            self.memo[inst.id] = found
        return found

    def _resolve(self, inst, seen):
        if inst.opcode == "parameter" and inst.id in self.param_rows:
            return self.param_rows[inst.id], "param"
        layer = self.layer_of(inst.metadata.op_name)
        if layer is not None:
            return layer, "backward" if self.is_backward(inst) else "forward"
        for inner in reversed(list(self.inner(inst))):
            layer = self.layer_of(inner.metadata.op_name)
            if layer is not None:
                return layer, "backward" if self.is_backward(inst) else "forward"
        for operand in inst.operand_ids:
            if operand in seen or operand not in self.by_id:
                continue
            row, kind = self(self.by_id[operand], seen)
            if row != UNATTRIBUTED:
                return row, kind
        return UNATTRIBUTED, "other"


def layer_rows(model, texts: dict, device_shape):
    """Rows `{row: [weights, optimizer, saved_activations, at_peak]}` and the peak bytes."""
    proto = _hlo_proto_class()()
    proto.ParseFromString(texts["proto"])
    rows, variable_rows, names = layer_owners.rows_at_rest(model, device_shape)
    handles, weights = {}, {id(v) for v in model.weights}
    weight_handles = set()
    for variable in (list(model.weights) + list(model.optimizer.variables)
                     + list(model.metrics_variables)):
        handle = getattr(getattr(variable, "value", None), "handle", None)
        if handle is not None:
            handles[id(handle)] = variable_rows.get(id(variable), UNATTRIBUTED)
            if id(variable) in weights:
                weight_handles.add(id(handle))
    # A pulled step's accumulators: the rows of the trainable weights they sum for.
    for accumulator, weight in zip(texts.get("accumulators", ()), model.trainable_weights):
        handle = getattr(accumulator, "handle", None)
        if handle is not None:
            handles[id(handle)] = variable_rows.get(id(weight), UNATTRIBUTED)
    number_rows = {}
    for number in range(texts["leaves"]):
        number_rows[number] = INPUTS
    for k, capture in enumerate(texts["captures"]):
        number_rows[texts["leaves"] + k] = handles.get(id(capture), UNATTRIBUTED)
    entry = next(c for c in proto.hlo_module.computations
                 if c.id == proto.hlo_module.entry_computation_id)
    param_rows = {inst.id: number_rows.get(inst.parameter_number, UNATTRIBUTED)
                  for inst in entry.instructions if inst.opcode == "parameter"}
    attribute = _Attributor(proto.hlo_module, names, param_rows)
    weight_numbers = {texts["leaves"] + k for k, c in enumerate(texts["captures"])
                      if id(c) in weight_handles}
    attribute.calibrate({inst.id: param_rows[inst.id] for inst in entry.instructions
                         if inst.opcode == "parameter" and inst.parameter_number
                         in weight_numbers and param_rows[inst.id] in rows})
    assignment = proto.buffer_assignment
    buffers = {b.id: b for b in assignment.logical_buffers}

    def row_of(buffer_id):
        inst = attribute.by_id.get(buffers[buffer_id].defined_at.instruction_id)
        return attribute(inst) if inst is not None else (UNATTRIBUTED, "other")

    aliased = {(int(e.parameter_number), tuple(e.parameter_shape_index))
               for e in proto.hlo_module.input_output_alias.entries}
    peak = 0
    for alloc in assignment.buffer_allocations:
        size = int(alloc.size)
        if alloc.is_thread_local:
            continue
        if alloc.is_entry_computation_parameter:
            row = number_rows.get(int(alloc.parameter_number), UNATTRIBUTED)
            copies = 1
            if alloc.maybe_live_out and not (
                    getattr(alloc, "is_parameter_aliased_with_output", False)
                    or (int(alloc.parameter_number), tuple(alloc.parameter_shape_index))
                    in aliased):
                copies = 2  # counted as an argument and as a result
        elif alloc.maybe_live_out or alloc.is_constant:
            largest = max(alloc.assigned, key=lambda a: a.size, default=None)
            row = row_of(largest.logical_buffer_id)[0] if largest else UNATTRIBUTED
            copies = 1
        else:
            continue  # temporaries: from the heap simulator below
        rows[row][_PEAK] += copies * size
        peak += copies * size

    for trace in assignment.heap_simulator_traces:
        live, top, at_top = {}, 0, {}
        for event in trace.events:
            if event.kind == _ALLOC:
                live[event.buffer_id] = int(buffers[event.buffer_id].size)
            elif event.kind == _SHARE:
                live[event.buffer_id] = 0  # shares the memory of another buffer
            elif event.kind == _FREE:
                live.pop(event.buffer_id, None)
            total = sum(live.values())
            if total > top:
                top, at_top = total, dict(live)
        for buffer_id, size in at_top.items():
            rows[row_of(buffer_id)[0]][_PEAK] += size
        peak += top

    # Kept for the gradient: forward buffers read by a backward instruction.
    users = attribute.users
    for buffer in buffers.values():
        inst = attribute.by_id.get(buffer.defined_at.instruction_id)
        if inst is None or inst.opcode == "parameter":
            continue
        row, kind = attribute(inst)
        if kind == "forward" and any(attribute.is_backward(u) for u in users.get(inst.id, ())):
            rows[row][_SAVED] += int(buffer.size)
    return rows, peak
