"""The main job: ``python -m benchmarks [--workloads ...] [--modes ...] [--variants ...] [--micro] [--quick] ...``.

On a GPU it runs the benchmarks, prints a table, and writes ``<out>/<date>-<gpu>.json`` and ``.md``. Without
one it says so and prints cudagraphex's capture plan for each workload instead. Every failure is printed with its
whole traceback, and the last line says which tasks (or capture plans) failed unexpectedly.

Exit status: 0 when nothing failed unexpectedly (failures listed in ``benchmarks.schedule.EXPECTED_FAILURES`` and tasks
skipped for the time budget do not count); 1 when a task or a capture plan failed unexpectedly; 2 for a usage error,
such as an unknown name in ``--workloads``, ``--modes`` or ``--variants``.
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

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _names(kind: str, choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"no {kind} given")
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {', '.join(repr(n) for n in unknown)} (choose from: {', '.join(choices)})"
            )
        return names

    return parse


def _fill(text: str, **kwargs: str) -> str:
    """``text`` wrapped for ``--help``, never breaking a name (``mlp16x256-b8``) across lines."""
    return textwrap.fill(text, 78, break_on_hyphens=False, break_long_words=False, **kwargs)


def _help_epilog() -> str:
    """The names ``--workloads``, ``--modes`` and ``--variants`` take, the expected failures and the exit status."""
    from benchmarks.schedule import EXPECTED_FAILURES
    from benchmarks.variants import STEP_VARIANTS, VARIANTS, variant_modes
    from benchmarks.workloads import MODES, WORKLOADS

    def paragraph(text: str, indent: str = "") -> str:
        return _fill(text, initial_indent=indent, subsequent_indent=indent + "  ")

    parts = [paragraph(f"workloads: {', '.join(WORKLOADS)}"), paragraph(f"modes: {', '.join(MODES)}")]
    limited: dict[tuple[str, ...], list[str]] = {}
    for variant in STEP_VARIANTS:
        limited.setdefault(variant_modes(variant), []).append(variant)
    only = "; ".join(f"{' and '.join(modes)} only: {', '.join(names)}" for modes, names in limited.items())
    parts.append(paragraph(f"variants: {', '.join(VARIANTS)} ({only})"))
    parts.append("expected failures (recorded with their reason; they do not fail the job):")
    parts += [
        paragraph(f"{f.workload} / {f.mode} / {f.variant}, an error with {f.error!r}: {f.reason}", "  ")
        for f in EXPECTED_FAILURES
    ]
    parts.append(
        paragraph(
            "exit status: 0 when nothing failed unexpectedly; 1 when a task (a workload, mode and variant, or the "
            "microbenchmark) or, without a GPU, a capture plan failed unexpectedly; 2 for a usage error."
        )
    )
    return "\n".join(parts)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line; exits with status 2 and a message naming the bad value on an unknown name."""
    from benchmarks.variants import VARIANTS
    from benchmarks.workloads import MODES, WORKLOADS

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=_fill(
            "Benchmarks of cudagraphex against eager, Thunder, CUDAGraphTransform, torch.compile and hand-captured "
            "CUDA graphs. Without a GPU, prints the capture plan instead."
        ),
        epilog=_help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workloads", type=_names("workload", list(WORKLOADS)), help="comma-separated (names below); default all"
    )
    parser.add_argument("--modes", type=_names("mode", MODES), help="comma-separated (names below); default all")
    parser.add_argument(
        "--variants", type=_names("variant", VARIANTS), help="comma-separated (names below); default all"
    )
    parser.add_argument(
        "--micro",
        action="store_true",
        help="run the host-overhead microbenchmark (alone, unless --workloads is given too); a run without "
        "--workloads/--modes/--variants includes it",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results directory (default {DEFAULT_OUT})")
    parser.add_argument(
        "--reps", type=int, default=None, help="timed repetitions per measurement (default 15, quick 3)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer and shorter repetitions")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the records of an existing results file of the same date and GPU that this run does not redo "
        "(to complete a run whose budget ran out)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="wall-time budget in seconds for all measurements; tasks that would not fit are recorded as skipped "
        "(0: no budget; default 450)",
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
    from benchmarks.report import host_breakdown_text, markdown_table, write_results
    from benchmarks.suite import Suite
    from benchmarks.variants import VARIANTS

    options = Options(
        reps=args.reps or (3 if args.quick else Options.reps),
        quick=args.quick,
        budget_s=args.budget_s,
    )
    suite = Suite(
        args.workloads if args.run_workloads else [],
        args.modes,
        args.variants,
        options,
        micro=args.run_micro,
        device=device,
    )
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

    def write(records: Sequence[Any]) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Path]]:
        rows = [dict(r.to_dict(), run=started) for r in records]
        meta = _meta(args, suite, gpu, started, time.monotonic() - start)
        if args.merge:
            rows, meta = _merged(rows, meta, args.out)
        return rows, meta, write_results(rows, meta, args.out, VARIANTS)

    # A crash that takes the CUDA context down (it aborts the process) keeps the workloads written before it.
    suite.checkpoint = write
    records = suite.run()
    elapsed = time.monotonic() - start
    rows, _, paths = write(records)
    print()
    print(markdown_table(rows, VARIANTS))
    if suite.host_breakdown:
        print("\nHost cost of a replay (micro-100ops):")
        print(host_breakdown_text(suite.host_breakdown))
    print("\nTime per workload: " + ", ".join(f"{k} {v:.0f} s" for k, v in suite.seconds_per_workload.items()))
    skipped: dict[str, list[str]] = {}
    for r in records:
        if (r.error or "").startswith("skipped") and r.variant not in skipped.setdefault(r.workload, []):
            skipped[r.workload].append(r.variant)
    skipped = {w: v for w, v in skipped.items() if v}
    if skipped:
        print("Skipped for time; to measure them and merge them into these results:")
        for workload, variants in skipped.items():
            if workload == "micro-100ops":
                print("  python -m benchmarks --merge --micro")
            else:
                print(f"  python -m benchmarks --merge --workloads {workload} --variants '{','.join(variants)}'")
    written = ", ".join(p.name for p in paths.values())
    print(f"Total {elapsed:.0f} s. Results in {args.out}: {written}")
    unexpected = suite.unexpected_failures()
    expected = sum(1 for r in records if r.error and r.expected_failure)
    print(_failure_summary(unexpected, expected), flush=True)
    return 1 if unexpected else 0


def _failure_summary(unexpected: Sequence[Any], expected: int) -> str:
    """The last line of a run: how many tasks failed unexpectedly, and which (grouped by workload and variant)."""
    also = f" ({expected} failed as expected)" if expected else ""
    if not unexpected:
        return f"No task failed unexpectedly{also}."
    modes: dict[tuple[str, str], list[str]] = {}
    for r in unexpected:
        modes.setdefault((r.workload, r.variant), []).append(r.mode)
    which = "; ".join(f"{w} / {v} ({', '.join(m)})" for (w, v), m in modes.items())
    return f"FAILED: {len(unexpected)} task(s) failed unexpectedly{also}: {which}"


def _meta(args: argparse.Namespace, suite: Any, gpu: str, started: str, elapsed_s: float) -> dict[str, Any]:
    """The results file's ``meta``: the machine, where the fields are defined, and ``runs``, one entry per invocation
    whose records the file holds (this one; ``--merge`` adds the earlier ones that still hold one)."""
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


def _merged(
    rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``rows`` plus the records of the existing results file of the same name that ``rows`` does not redo; ``meta``
    with the earlier runs that still hold a record (a record names its run by its start time; every earlier run is
    kept while a record of the file does not name one)."""
    import json

    from benchmarks.report import results_basename

    path = (out_dir / results_basename(meta["date"], meta["gpu"])).with_suffix(".json")
    if not path.exists():
        return rows, meta
    old = json.loads(path.read_text())

    def key(r: dict[str, Any]) -> tuple[str, str, str]:
        return r["workload"], r["mode"], r["variant"]

    redone = {key(r) for r in rows if not (r.get("error") or "").startswith("skipped")}
    kept = [r for r in old.get("records", []) if key(r) not in redone]
    kept_keys = {key(r) for r in kept}
    # A record skipped in this run does not replace an older one.
    fresh = [r for r in rows if key(r) in redone or key(r) not in kept_keys]
    merged = kept + fresh
    holders = {r.get("run") for r in merged}
    merged_meta = dict(meta)
    this_run = meta["runs"][-1]["started"]
    # A file written by one setup names its versions once, in its meta; its runs keep them when they are merged.
    file_versions = old.get("meta", {}).get("versions")
    earlier = [
        {"versions": file_versions, **r} if file_versions and "versions" not in r else r
        for r in old.get("meta", {}).get("runs", [])
        if r.get("started") != this_run and (None in holders or r.get("started") in holders)
    ]
    merged_meta["runs"] = earlier + meta["runs"]
    if not merged_meta.get("host_breakdown"):
        merged_meta["host_breakdown"] = old.get("meta", {}).get("host_breakdown")
    return merged, merged_meta


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the main job; returns the exit status."""
    args = parse_args(argv)
    # Thunder warns on import about an optional executor this suite does not use.
    warnings.filterwarnings("ignore", message="transformer_engine module not found")
    import torch

    if not torch.cuda.is_available():
        from benchmarks.plan import NO_GPU_MESSAGE, show_plan

        print(NO_GPU_MESSAGE, flush=True)
        if args.run_micro and not args.run_workloads:
            print("The microbenchmark times graph replays, so it needs a GPU too; nothing to show.")
            return 0
        if args.run_micro:
            print("(The microbenchmark needs a GPU; it is skipped.)")
        failed = show_plan(args.workloads, args.modes, out=lambda line: print(line, flush=True))
        if failed:
            print(f"\nFAILED: the capture plan of {len(failed)} workload(s) failed: {', '.join(failed)}", flush=True)
            return 1
        print(f"\nNo capture plan failed ({len(args.workloads)} workload(s)).", flush=True)
        return 0
    return _run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
