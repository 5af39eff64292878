"""The `keras-tpu-mem` command line."""

from __future__ import annotations

import argparse
import sys


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


def _plan(args: argparse.Namespace) -> int:
    from keras_tpu_mem.planning import load_model_factory, plan

    model = load_model_factory(args.model)()
    compile_batches = None
    if args.compile_batches:
        try:
            compile_batches = [int(b) for b in args.compile_batches.split(",") if b.strip()]
        except ValueError as err:
            raise ValueError("--compile-batches must be comma-separated ints such as 1,2; "
                             f"got {args.compile_batches!r}.") from err
    print(plan(model, args.global_batch, device=args.device,
               accumulation_steps=args.accumulation_steps, precision=args.precision,
               headroom=args.headroom, compile_batches=compile_batches))
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    plan.add_argument("--model", required=True,
                      help="MODULE:FUNCTION (or path/file.py:FUNCTION) returning a compiled "
                           "keras.Model")
    plan.add_argument("--global-batch", type=int, required=True,
                      help="examples per step over all replicas")
    plan.add_argument("--device", default="v3-8",
                      help="TPU type such as v3-8, v4-32, v5litepod-16, or a size such "
                           "as 12GiB / 16GB-4 (default: v3-8)")
    plan.add_argument("--accumulation-steps", type=int, default=None,
                      help="micro-batches per replica step")
    plan.add_argument("--precision", default=None,
                      help="float32 or mixed_bfloat16 (default: as the model is)")
    plan.add_argument("--headroom", type=float, default=0.10,
                      help="fraction of memory kept free (default: 0.10)")
    plan.add_argument("--compile-batches", default=None,
                      help="comma-separated batches to compile, e.g. 1,2 (default: 32,64)")
    plan.set_defaults(func=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError) as err:
        print(f"keras-tpu-mem {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
