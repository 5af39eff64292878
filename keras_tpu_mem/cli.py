"""The `keras-tpu-mem` command line."""

from __future__ import annotations

import argparse
import sys


def _devices(args: argparse.Namespace) -> int:
    from keras_tpu_mem.strategy import TPUStrategyWrapper

    wrapper = TPUStrategyWrapper(args.tpu, logical_cpus=args.logical_cpus)
    print(wrapper.describe())
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
