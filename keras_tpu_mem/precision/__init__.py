"""bfloat16 mixed precision for models that already exist.

Keras applies a dtype policy only to layers built after
`keras.config.set_dtype_policy`, so a model that is already built (or loaded
from a checkpoint) has no drop-in path to bfloat16, and under a global
`mixed_bfloat16` policy the last layer emits bfloat16 logits unless someone
remembers `dtype="float32"`. This package gives three tools:

* `MixedBFloat16`, a `fit` callback: bfloat16 compute with float32 variables
  for the training it is attached to; the layers that produce the model's
  outputs stay float32; the model is handed back in its own policies at the
  end of `fit`.
* `to_mixed_bfloat16(model)`: a new model with the same policy assignment,
  built into its config (it saves and loads as such), and the same weights bit
  for bit; `enable_mixed_bfloat16()` sets the global policy for models built
  afterwards.
* `precision_report(model)`: which layer computes in which dtype, with the
  risky spots flagged.

Why the output layers get a bfloat16 *backward* (see `MixedBFloat16`,
`exact_output_gradients`): a float32 output layer fed by bfloat16 activations
keeps a float32 copy of its input for its weight gradient and produces a
float32 gradient of that input, both alive at the start of the backward pass,
which is where activation memory peaks. Our output layers compute their
forward pass in float32 (logits and loss are float32 values) and their
backward pass in bfloat16, like every hidden layer, which removes both copies.
That is also the arithmetic of a TPU, whose matrix unit multiplies float32
operands as bfloat16 with float32 accumulation by default
(cloud.google.com/tpu/docs/bfloat16).

The package: `policies` (which layer gets which policy), `output` (the output
layers' float32 forward, bfloat16 backward), `callback` (`MixedBFloat16`),
`convert` (`to_mixed_bfloat16`, `enable_mixed_bfloat16`), `report`
(`precision_report`) and `notice` (`device_notice`, what bfloat16 means on the
devices that run).
"""

from keras_tpu_mem.precision.callback import MixedBFloat16
from keras_tpu_mem.precision.convert import enable_mixed_bfloat16, to_mixed_bfloat16
from keras_tpu_mem.precision.notice import device_notice
from keras_tpu_mem.precision.report import PrecisionReport, PrecisionRow, precision_report

__all__ = [
    "MixedBFloat16",
    "PrecisionReport",
    "PrecisionRow",
    "device_notice",
    "enable_mixed_bfloat16",
    "precision_report",
    "to_mixed_bfloat16",
]
