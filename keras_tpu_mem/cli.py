"""The `keras-tpu-mem` command line.

Arguments are parsed before any framework is imported: `--help` and usage
errors answer at once, without TensorFlow's (or JAX's) start-up time and log
lines. A command that needs the framework loads it after parsing, with the
framework's native start-up logging kept out of the command's own output.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

# Native log levels the CLI sets when the user has not: TensorFlow's C++ logging
# prints INFO lines (oneDNN, CPU features, CUDA stubs) and, on a machine without
# a GPU, an ERROR about cuInit that is noise for this tool. "3" keeps only
# FATAL; real failures still surface as Python exceptions, which the CLI reports.
_QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def _frameworks_loaded() -> bool:
    return any(name in sys.modules for name in ("keras", "tensorflow", "jax"))


def quiet_framework_env(environ=None) -> bool:
    """Sets the quiet log levels of `_QUIET_ENV` that the user has not set.

    Only in the CLI's own process, and only before a framework is imported
    (afterwards the variables would change nothing and only leak into a host
    process such as a test runner). A value the user set is never overridden.

    Returns:
        True when the CLI took over the frameworks' native logging (nothing in
        `_QUIET_ENV` was set by the user), i.e. when start-up noise may be held
        back; False when the user asked for their own levels.
    """
    environ = os.environ if environ is None else environ
    if environ is os.environ and _frameworks_loaded():
        return False
    user_set = [name for name in _QUIET_ENV if name in environ]
    for name, value in _QUIET_ENV.items():
        environ.setdefault(name, value)
    return not user_set


@contextlib.contextmanager
def _native_stderr_held():
    """Holds what is written to file descriptor 2 meanwhile; replays it if the block fails.

    TensorFlow's shared libraries log a few lines through absl *before* its
    logging is initialised ("All log messages before absl::InitializeLog() ...",
    oneDNN and CUDA-stub notices); those ignore TF_CPP_MIN_LOG_LEVEL, so the only
    way to keep them out of the CLI's output is to catch the file descriptor
    while the framework loads. If loading fails, what was held is written out:
    it may explain why.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (closed, or an unusual host)
        yield
        return
    held = tempfile.TemporaryFile()
    ok = False
    try:
        os.dup2(held.fileno(), 2)
        yield
        ok = True
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if not ok:
            held.seek(0)
            sys.stderr.write(held.read().decode("utf-8", errors="replace"))
            sys.stderr.flush()
        held.close()


def load_framework(quiet: bool) -> None:
    """Imports Keras (and with it its backend), holding back native start-up noise if `quiet`."""
    if "keras" in sys.modules:
        return
    with _native_stderr_held() if quiet else contextlib.nullcontext():
        import keras  # noqa: F401  (imports the backend: TensorFlow by default)


def _devices(args: argparse.Namespace) -> int:
    from keras_tpu_mem.strategy import TPUStrategyWrapper

    wrapper = TPUStrategyWrapper(args.tpu, logical_cpus=args.logical_cpus)
    print(wrapper.describe())
    return 0


def _report(args: argparse.Namespace) -> int:
    from keras_tpu_mem.report import write_report

    try:
        report = write_report(args.logdir, charts=not args.no_charts)
    except ImportError as err:  # matplotlib is an optional dependency
        print(f"keras-tpu-mem report: error: {err}", file=sys.stderr)
        return 2
    print(report.text)
    return 0


class _CompileProgress:
    """`plan`'s progress callback: one line per XLA compile on stderr, with its time.

    Compiling a large model's train step takes minutes on a CPU (BERT-Large:
    about 50 s per compile); these lines say what is going on and how long each
    compile took, on stderr so that stdout stays the plan itself.
    """

    def __init__(self):
        self._started = None

    @staticmethod
    def say(text):
        print(f"keras-tpu-mem plan: {text}", file=sys.stderr, flush=True)

    def __call__(self, done: int, total: int, batch_size: int | None) -> None:
        now = time.perf_counter()
        if done and self._started is not None:
            self.say(f"[{done}/{total}] compiled in {now - self._started:.1f} s")
        if batch_size is not None:
            self.say(f"[{done + 1}/{total}] compiling the train step with XLA at "
                      f"batch {batch_size} ...")
        self._started = now


def _plan(args: argparse.Namespace) -> int:
    from keras_tpu_mem import backends
    from keras_tpu_mem.planning.model_factory import load_model_factory
    from keras_tpu_mem.planning.planner import plan
    from keras_tpu_mem.shapes import shapes_only

    progress = _CompileProgress()
    # Shapes only where the compile takes such a model: JAX, or TensorFlow's plan of the
    # JAX lowering (`--compiler tpu`); TensorFlow's own compile needs the values.
    deferred = args.compiler == "tpu" or backends.current("plan").compiled.compiles_deferred()
    progress.say(f"building the model from {args.model}"
                 + (" (shapes only: no weight is allocated) ..." if deferred else " ..."))
    with shapes_only() if deferred else contextlib.nullcontext():
        model = load_model_factory(args.model)()
    sample_batch = None
    if args.sample_batch is not None:
        progress.say(f"reading one batch from {args.sample_batch} ...")
        sample_batch = load_model_factory(args.sample_batch, "--sample-batch")()
    planned = plan(model, args.global_batch, device=args.device, sample_batch=sample_batch,
                   accumulation_steps=args.accumulation_steps, precision=args.precision,
                   headroom=args.headroom, compile_batches=args.compile_batches,
                   search=args.search, progress=progress, compiler=args.compiler,
                   mesh=args.mesh)
    print(planned)
    if args.by_layer:
        from keras_tpu_mem.planning.by_layer_text import whole_table_text

        progress.say("compiling the step once more for its memory by layer ...")
        print()
        print(whole_table_text(model, planned))
    return 0


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def checkpoints_table(directory: str, now: float | None = None) -> str:
    """What `keras-tpu-mem checkpoints DIR` prints: one row per complete checkpoint of a
    `ResumableCheckpoint` directory (the one a restart resumes from marked), oldest
    first, and a line for each folder a restart would skip."""
    from keras_tpu_mem.devices.units import format_bytes
    from keras_tpu_mem.resume.store import is_remote, scan

    # A remote directory (gs://) is read through the backend's file API.
    if not is_remote(directory) and not os.path.isdir(directory):
        raise ValueError(f"{directory!r} is not a directory.")
    found, skipped = scan(directory)
    now = time.time() if now is None else now
    lines = [f"{directory}: {len(found)} complete checkpoint(s)"]
    if found:
        rows = [("update", "epoch", "batch", "size", "age", "")]
        for index, info in enumerate(found):
            rows.append((str(info.update), str(info.epoch + 1), str(info.batch),
                         format_bytes(info.size_bytes), _age(now - info.saved_at),
                         "<- a restart resumes here" if index == len(found) - 1 else ""))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        for row in rows:
            lines.append("  ".join(cell.rjust(width) for cell, width in zip(row, widths))
                         + ("  " + row[5] if row[5] else ""))
        lines.append("(epoch counts from 1, as fit prints it; batch is where the epoch "
                     "resumes, 0 at its start)")
    lines += [f"skipped: {message}" for message in skipped]
    return "\n".join(lines)


def _checkpoints(args) -> int:
    print(checkpoints_table(args.directory))
    return 0


def _batch_list(text: str) -> list[int]:
    """argparse type of --compile-batches: a usage error, before any framework loads."""
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated ints >= 1 such as 1,4; got {text!r}")
    return batches


def _mesh_spec(text: str) -> dict:
    """argparse type of --mesh: `batch=4,model=4` -> {"batch": 4, "model": 4}."""
    mesh = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        if not sep or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"must be AXIS=SIZE pairs such as batch=4,model=4; got {text!r}")
        mesh[name.strip()] = int(size)
    return mesh


def _model_spec(text: str) -> str:
    """argparse type of --model: checks the MODULE:FUNCTION form without importing it."""
    module, sep, function = text.rpartition(":")
    if not sep or not module or not function.isidentifier():
        raise argparse.ArgumentTypeError(
            "must be MODULE:FUNCTION, e.g. examples.bert_memory:build_model or "
            f"path/to/file.py:build_model; got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    from keras_tpu_mem.devices.tpu_slices import KNOWN_SLICES

    parser = argparse.ArgumentParser(
        prog="keras-tpu-mem",
        description="Memory tools for training Keras 3 models on TPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    devices = sub.add_parser("devices", help="show the strategy, replicas and memory found")
    devices.add_argument("--tpu", default=None, help="TPU name, grpc address or 'local'")
    devices.add_argument("--logical-cpus", type=int, default=None,
                         help="without TPU/GPU, mirror over N logical CPUs")
    devices.set_defaults(func=_devices)
    report = sub.add_parser(
        "report", help="charts (PNG) and a summary table from HBMMonitor/ThroughputMonitor logs"
    )
    report.add_argument("logdir", help="the log_dir given to the monitors (or a folder above)")
    report.add_argument("--no-charts", action="store_true",
                        help="print the table only, write no PNG")
    report.set_defaults(func=_report)
    plan = sub.add_parser(
        "plan", help="per-replica memory plan from XLA's compile of the train step"
    )
    plan.add_argument("--model", required=True, type=_model_spec,
                      help="MODULE:FUNCTION (or path/file.py:FUNCTION) returning a compiled "
                           "keras.Model")
    plan.add_argument("--global-batch", "--batch", dest="global_batch", type=int,
                      required=True, help="examples per step over all replicas")
    plan.add_argument("--device", default="v3-8",
                      help="a TPU slice, compiled by XLA:TPU where libtpu is installed "
                           "(pip install \"keras-tpu-mem[tpu-plan]\"; no TPU needed): "
                           + ", ".join(KNOWN_SLICES)
                           + "; or a memory size such as 12GiB / 16GB-4 (default: v3-8)")
    plan.add_argument("--compiler", default="auto", choices=("auto", "tpu", "host"),
                      help="auto: XLA:TPU for a TPU slice when libtpu loads, else the "
                           "host's XLA:CPU; tpu: XLA:TPU or an error; host: XLA:CPU")
    plan.add_argument("--mesh", type=_mesh_spec, default=None,
                      help="axis sizes of the slice's mesh, e.g. batch=4,model=4 "
                           "(default: the batch axis over every device)")
    plan.add_argument("--sample-batch", type=_model_spec, default=None,
                      help="MODULE:FUNCTION (or path/file.py:FUNCTION) returning one batch "
                           "as fit takes it, (x, y), of any size: its shapes past the batch "
                           "axis and dtypes define the step's inputs (models with unknown "
                           "sequence lengths)")
    plan.add_argument("--accumulation-steps", type=int, default=None,
                      help="micro-batches per replica step")
    plan.add_argument("--precision", default=None,
                      help="float32 or mixed_bfloat16 (default: as the model is)")
    plan.add_argument("--headroom", type=float, default=0.10,
                      help="fraction of memory kept free (default: 0.10)")
    plan.add_argument("--compile-batches", type=_batch_list, default=None,
                      help="comma-separated batches to compile, e.g. 1,2 (default: 32,64)")
    plan.add_argument("--search", action="store_true",
                      help="also search the levers (accumulation, bf16, rematerialisation), "
                           "compiling each candidate; recommends the cheapest that fits")
    plan.add_argument("--by-layer", action="store_true",
                      help="after the plan, print its memory by Keras layer: every row "
                           "(weights, optimizer slots, saved activations, at the peak)")
    plan.set_defaults(func=_plan)
    checkpoints = sub.add_parser(
        "checkpoints", help="list what a ResumableCheckpoint directory holds "
                            "(update, epoch, batch, size, age)")
    checkpoints.add_argument("directory", help="the directory given to ResumableCheckpoint")
    checkpoints.set_defaults(func=_checkpoints, framework=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # --help and usage errors end here, framework-free
    except SystemExit as done:
        # argparse has printed the help or the usage error; give its status back
        # like every other outcome (0 for --help, 2 for a usage error).
        return done.code if isinstance(done.code, int) else 2
    quiet = quiet_framework_env()
    try:
        # Every command but `checkpoints` (JSON files) reaches Keras (report reads the
        # monitors' log format from keras_tpu_mem.monitoring, which imports it), so
        # load it here, once, with its start-up noise held back.
        if getattr(args, "framework", True):
            load_framework(quiet)
        return args.func(args)
    except (ValueError, TypeError, RuntimeError, ImportError) as err:
        print(f"keras-tpu-mem {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
