"""The main job: ``python -m benchmarks [--workloads ...] [--modes ...] [--variants ...] [--micro] [--quick] ...``.

On a GPU it runs the benchmarks, prints a table, and writes ``<out>/<date>-<gpu>.json`` and ``.md``. Without one it
says so and prints cudagraphex's capture plan for each workload instead. Every failure is printed with its whole
traceback, and the last line says which tasks (or capture plans) failed.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import textwrap
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.cases import MODES
from benchmarks.variants import VARIANTS, variant_modes
from benchmarks.workloads import WORKLOADS

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
EXIT_STATUS = (
    "exit status: 0 when nothing failed (tasks skipped for the time budget do not count); 1 when a task (a workload, "
    "mode and variant, or the microbenchmark) failed or was skipped because the CUDA context failed, or, without a "
    "GPU, a capture plan failed; 2 for a usage error, such as an unknown name."
)


def _names(kind: str, choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = ", ".join(repr(n) for n in names if n not in choices)
        if unknown or not names:
            message = f"unknown {kind} {unknown} (choose from: {', '.join(choices)})" if unknown else f"no {kind} given"
            raise argparse.ArgumentTypeError(message)
        return names

    return parse


def _wrapped(line: str) -> str:
    """``line`` wrapped at 78 columns without breaking a name (``mlp16x256-b8``) across lines."""
    return textwrap.fill(line, 78, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line; exits with status 2 and a message naming the bad value on an unknown name."""
    only = ", ".join(v for v in VARIANTS if variant_modes(v) != MODES)
    names = (
        f"workloads: {', '.join(WORKLOADS)}",
        f"modes: {', '.join(MODES)}",
        f"variants: {', '.join(VARIANTS)} (train_step only: {only})",
        EXIT_STATUS,
    )
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmarks of cudagraphex against eager, Thunder, CUDAGraphTransform, torch.compile and\n"
        "hand-captured CUDA graphs. Without a GPU, prints the capture plan instead.",
        epilog="\n".join(_wrapped(line) for line in names),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workloads", type=_names("workload", list(WORKLOADS)), help="comma-separated; default all")
    parser.add_argument("--modes", type=_names("mode", MODES), help="comma-separated; default all")
    parser.add_argument("--variants", type=_names("variant", VARIANTS), help="comma-separated; default all")
    parser.add_argument(
        "--micro",
        action="store_true",
        help="run the host-overhead microbenchmark (alone, unless --workloads is given too); a run that selects "
        "no names includes it",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results directory (default {DEFAULT_OUT})")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds per measurement (default 15, quick 3)")
    parser.add_argument("--quick", action="store_true", help="fewer and shorter rounds")
    parser.add_argument(
        "--merge", action="store_true", help="keep the records of the same date's file that this run does not redo"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="seconds for all measurements; tasks that would not fit are recorded as skipped (0: none; default 450)",
    )
    args = parser.parse_args(argv)
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    selected = args.workloads is not None or args.modes is not None or args.variants is not None
    args.run_micro = args.micro or not selected
    args.run_workloads = not args.micro or args.workloads is not None
    args.workloads = args.workloads or list(WORKLOADS)
    args.modes = args.modes or list(MODES)
    args.variants = args.variants or list(VARIANTS)
    return args


def _run_gpu(args: argparse.Namespace, device: Any = None) -> int:
    """Runs the benchmarks, prints the table, writes the results. ``device`` is for testing this on the CPU."""
    import torch

    from benchmarks.measure import Options
    from benchmarks.report import SKIPPED_FOR_TIME, host_breakdown_text, markdown_table, merged, write_results
    from benchmarks.suite import Suite

    options = Options(reps=args.reps or (3 if args.quick else Options.reps), quick=args.quick, budget_s=args.budget_s)
    workloads = args.workloads if args.run_workloads else []
    suite = Suite(workloads, args.modes, args.variants, options, micro=args.run_micro, device=device)
    gpu = torch.cuda.get_device_name(suite.device) if suite.device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"{gpu}: {len(suite.workloads)} workload(s), {len(suite.variants)} variant(s), modes {', '.join(args.modes)}"
        f"{', and the microbenchmark' if args.run_micro else ''}; budget {args.budget_s:g} s",
        flush=True,
    )
    total, done = suite.num_measurements(), 0

    def progress(label: str) -> None:
        nonlocal done
        done += 1
        print(f"[{done}/{total}] {label}", file=sys.stderr, flush=True)

    suite.progress, suite.log = progress, lambda line: print(line, file=sys.stderr, flush=True)
    start = time.monotonic()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    def write(records: Sequence[Any]) -> tuple[list[dict[str, Any]], dict[str, Path]]:
        rows = [dict(r.to_dict(), run=started) for r in records]
        meta = _meta(args, suite, gpu, started, time.monotonic() - start)
        if args.merge:
            rows, meta = merged(rows, meta, args.out)
        return rows, write_results(rows, meta, args.out, VARIANTS)

    # A crash that takes the CUDA context down (it aborts the process) keeps the workloads written before it.
    suite.checkpoint = write
    records = suite.run()
    rows, paths = write(records)
    print(f"\n{markdown_table(rows, VARIANTS)}")
    if suite.host_breakdown:
        print(f"\nHost cost of a replay (micro-100ops):\n{host_breakdown_text(suite.host_breakdown)}")
    print("\nTime per workload: " + ", ".join(f"{k} {v:.0f} s" for k, v in suite.seconds_per_workload.items()))
    skipped: dict[str, list[str]] = {}
    for r in records:
        if (r.error or "").startswith(SKIPPED_FOR_TIME):
            skipped.setdefault(r.workload, []).append(r.variant)
    if skipped:
        print("Skipped for time; to measure them and merge them into these results:")
        for workload, variants in skipped.items():
            names = ",".join(dict.fromkeys(variants))
            what = "--micro" if workload == "micro-100ops" else f"--workloads {workload} --variants '{names}'"
            print(f"  python -m benchmarks --merge {what}")
    print(f"Total {time.monotonic() - start:.0f} s. Results in {args.out}: {', '.join(p.name for p in paths.values())}")
    failed: dict[tuple[str, str], list[str]] = {}
    for r in suite.failures():
        failed.setdefault((r.workload, r.variant), []).append(r.mode)
    which = "; ".join(f"{w} / {v} ({', '.join(m)})" for (w, v), m in failed.items())
    count = sum(map(len, failed.values()))
    print(f"FAILED: {count} task(s) failed: {which}" if failed else "No task failed.", flush=True)
    return 1 if failed else 0


def _meta(args: argparse.Namespace, suite: Any, gpu: str, started: str, elapsed_s: float) -> dict[str, Any]:
    """The results file's ``meta``: the machine and ``runs``, one entry per invocation whose records the file holds
    (this one; ``--merge`` adds the earlier ones that still hold one)."""
    import torch

    from benchmarks.report import commit, versions

    options = suite.options
    run = {
        "started": started,
        "cudagraphex_commit": commit(),
        "versions": versions(),
        "options": {
            "workloads": [w.name for w in suite.workloads],
            "modes": list(args.modes),
            "variants": list(suite.variants),
            "micro": args.run_micro,
            "reps": options.reps,
            "quick": options.quick,
            "budget_s": options.budget_s,
            "warmup_calls": options.warmup_calls,
            "rep_target_s": options.rep_target_s,
        },
        "seconds_per_workload": {k: round(v, 1) for k, v in suite.seconds_per_workload.items()},
        "elapsed_s": round(elapsed_s, 1),
        "cuda_context_failed": suite.broken,
    }
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "device": str(suite.device),
        "cuda": torch.version.cuda,
        "runs": [run],
        "host_breakdown": suite.host_breakdown,
        "definitions": "benchmarks/README.md, What is measured",
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the main job; returns the exit status."""
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="transformer_engine module not found")  # Thunder's, on import
    import torch

    if torch.cuda.is_available():
        return _run_gpu(args)
    from benchmarks.plan import show_plan

    print("No CUDA GPU: replaying CUDA graphs needs one; showing the capture plan instead.", flush=True)
    if args.run_micro:
        print("(The microbenchmark times graph replays, so it needs a GPU too; it is skipped.)")
    if not args.run_workloads:
        return 0
    failed = show_plan(args.workloads, args.modes, out=lambda line: print(line, flush=True))
    if failed:
        print(f"\nFAILED: the capture plan of {len(failed)} workload(s) failed: {', '.join(failed)}", flush=True)
        return 1
    print(f"\nNo capture plan failed ({len(args.workloads)} workload(s)).", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
