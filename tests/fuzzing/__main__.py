"""``python -m tests.fuzzing``: see :mod:`tests.fuzzing`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

import tests.fuzzing
from tests.fuzzing.batch import run_batch
from tests.fuzzing.compare import Failure
from tests.fuzzing.generate import generate
from tests.fuzzing.programs import Program
from tests.fuzzing.shrink import shrink
from tests.fuzzing.side_by_side import side_by_side
from tests.fuzzing.world import BACKENDS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzzing", description=tests.fuzzing.__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="emulate")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--seed", type=int, action="append", help="check these seeds (repeatable) instead")
    parser.add_argument("--workers", type=int, default=1, help="processes (on CUDA, each with a context of its own)")
    parser.add_argument(
        "--deadline",
        type=float,
        metavar="SECONDS",
        help="check no seed whose turn comes later than this after the start",
    )
    parser.add_argument("--show", type=int, metavar="SEED", help="print the program of this seed and exit")
    parser.add_argument("--shrink", action="store_true", help="shrink each failing program before printing it")
    parser.add_argument("--brief", action="store_true", help="one line per failure, without the program")
    parser.add_argument(
        "--steps",
        choices=["calls", "whole", "bucketed"],
        default="calls",
        help="calls as they are; each call with its backward as one step through graph_step; or a serving step"
        " through graph_step with batch-size buckets",
    )
    parser.add_argument(
        "--fuser",
        action="store_true",
        help="with Thunder's torch.compile executor in both compiled functions (Inductor compiles: seconds a program)",
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="run each --seed in every world triage compares and print, step by step, how far each departs from plain"
        " Thunder",
    )
    args = parser.parse_args(argv)
    if args.backend == "cuda" and not torch.cuda.is_available():
        parser.error("--backend cuda needs a CUDA GPU")
    if args.show is not None:
        print(_program(args.show, args).describe())
        return 0
    if args.side_by_side:
        if not args.seed:
            parser.error("--side-by-side needs --seed")
        for seed in args.seed:
            side_by_side(_program(seed, args), args.backend)
        return 0
    seeds = args.seed or range(args.start, args.start + args.count)

    def on_failure(f: Failure) -> None:
        if args.shrink:
            f = shrink(f, args.backend)
        print(f.report(full=not args.brief), flush=True)

    result = run_batch(
        seeds, args.backend, args.workers, on_failure, steps=args.steps, fuser=args.fuser, deadline_s=args.deadline
    )
    print(result.summary())
    return 1 if result.counted else 0


def _program(seed: int, args: argparse.Namespace) -> Program:
    """The program of ``seed`` as the options ask for it (``--fuser``, ``--steps``)."""
    program = generate(seed).with_fuser() if args.fuser else generate(seed)
    if args.steps == "whole":
        return program.as_whole_steps()
    if args.steps == "bucketed":
        return program.as_bucketed_steps() or program
    return program


if __name__ == "__main__":
    sys.exit(main())
