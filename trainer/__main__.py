"""``python -m trainer``: keel's commands that need no training run.

    python -m trainer export CKPT OUT [--max-shard-size BYTES] [--dtype bfloat16]

``export`` writes the task weights of a checkpoint (any strategy, any world size) as ``trainer.export_weights``
does: OUT a folder (or a path without a suffix) gets Hugging Face's sharded safetensors layout, ``OUT.safetensors``
one safetensors file, any other suffix (``.pt``) one plain state-dict file. Without a process group; the source is
read one output shard at a time. Other tools: ``python -m trainer.doctor`` (a machine or cluster before a run, and
the goodput of a job) and ``python -m trainer.memory`` (the memory plan).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _size(text: str) -> int:
    """Bytes from ``5000000000``, ``5GB`` or ``500MB`` (powers of ten, as Hugging Face counts shard sizes)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            number = upper[: -len(unit)].strip()
            try:
                value = float(number) * factor
            except ValueError:
                break
            if value >= 1:
                return int(value)
    if upper.isdigit() and int(upper) > 0:
        return int(upper)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes (5000000000) or 5GB, 500MB")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export = commands.add_parser(
        "export", help="a checkpoint's weights as safetensors (a Hugging Face folder or one file) or a .pt file"
    )
    export.add_argument("ckpt", help="the checkpoint (a save folder, local or on object storage) or weights file")
    export.add_argument("out", help="a folder (Hugging Face's layout), FILE.safetensors, or FILE.pt")
    export.add_argument(
        "--max-shard-size", type=_size, default=5 * 10**9, help="most bytes a shard holds (default: 5GB)"
    )
    export.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating-point tensors to this dtype")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from trainer.checkpoint.files import CheckpointError, CheckpointSaveError
    from trainer.checkpoint.hf import export_weights

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        export_weights(
            args.ckpt,
            args.out,
            max_shard_size=args.max_shard_size,
            dtype=_DTYPES[args.dtype] if args.dtype else None,
        )
    except (CheckpointError, CheckpointSaveError, ValueError) as exc:
        print(f"python -m trainer export: {exc}", file=sys.stderr)  # noqa: T201
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
