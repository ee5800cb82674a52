"""Results: the record of one measurement, and the JSON and Markdown files written from a list of them.

Records are plain mappings here (``Record.to_dict()`` makes one), so the writers work on results read back from JSON.
The table also shows each time as ratios to two references of the same workload and mode: ``manual-graph`` (the
practical limit) and ``thunder+CUDAGraphTransform`` (Thunder's own CUDA-graph transform).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import subprocess
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: How the error of a task skipped for the time budget starts (not a failure: ``--merge`` measures it later).
SKIPPED_FOR_TIME = "skipped: over the time budget"
#: The variants times are divided by, with the column titles of their ratios.
REFERENCES = {"manual-graph": "x manual-graph", "thunder+CUDAGraphTransform": "x CUDAGraphTransform"}
_HOST_COSTS = {
    "cudagraphex_overhead_per_region_us": "cudagraphex host cost per region (region call - graph.replay, k=1)",
    "per_region_read_in_place_us": "the same, its input read in place (no copy)",
    "per_copied_input_us": "per copied input (slope over k)",
    "per_returned_output_us": "per returned output (the 100-output region over the 1-output one)",
    "thunder_glue_us": "Thunder prologue/epilogue + glue (thunder call - region call, k=1)",
}


def short_error(e: BaseException) -> str:
    """The first line of ``e``, after its type: what a record's ``error`` holds."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:240]


def full_error(e: BaseException) -> str:
    """The whole traceback of ``e``, with its chained exceptions, as Python prints it."""
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()


@dataclasses.dataclass
class Record:
    """One (workload, mode, variant) measurement. ``error`` is set, and the numbers may be None, when it failed.

    ``benchmarks/README.md`` ("What is measured") defines each field."""

    workload: str
    mode: str
    variant: str
    median_us: float | None = None
    peak_mem_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    steady_peak_mem_bytes: int | None = None
    setup_s: float | None = None
    correct: bool | None = None
    error: str | None = None
    #: Largest relative error (norm of the difference over norm of eager's) among the compared tensors.
    rel_err: float | None = None
    #: Extra facts: cudagraphex's regions and graphs, graph-related warnings.
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def versions() -> dict[str, str]:
    """The versions a run measures: Python, torch, Thunder, cudagraphex (as imported) and transformers."""
    from importlib import metadata

    import thunder
    import torch

    import cudagraphex

    try:
        transformers = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers = "not installed"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "thunder": getattr(thunder, "__version__", "unknown"),
        "cudagraphex": cudagraphex.__version__,
        "transformers": transformers,
    }


def commit() -> str:
    """The git commit measured: ``CUDAGRAPHEX_COMMIT`` when set (a copied tree, as on the GPU machine, may carry a
    stale ``.git``), else ``git rev-parse HEAD``, else "unknown"."""
    if os.environ.get("CUDAGRAPHEX_COMMIT"):
        return os.environ["CUDAGRAPHEX_COMMIT"]
    try:
        git = ["git", "rev-parse", "HEAD"]
        done = subprocess.run(git, check=False, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def results_path(out_dir: Path, meta: Mapping[str, Any]) -> Path:
    """``<out_dir>/<date>-<gpu>.json``, ``"NVIDIA H200"`` written ``nvidia-h200``."""
    gpu = re.sub(r"[^a-z0-9]+", "-", meta["gpu"].lower()).strip("-") or "unknown"
    return out_dir / f"{meta['date']}-{gpu}.json"


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _mib(size: int | None) -> str:
    return _num(None if size is None else size / 2**20, ".0f")


def markdown_table(records: Sequence[Mapping[str, Any]], variants: Sequence[str] = ()) -> str:
    """A Markdown table of ``records``, by workload (in order of appearance), mode, then variant in ``variants``'s
    order."""
    times = {(r["workload"], r["mode"], r["variant"]): r.get("median_us") for r in records}
    workloads = list(dict.fromkeys(r["workload"] for r in records))

    def order(r: Mapping[str, Any]) -> tuple:
        variant = variants.index(r["variant"]) if r["variant"] in variants else len(variants)
        return workloads.index(r["workload"]), r["mode"] != "inference", r["mode"], variant, r["variant"]

    columns = ["workload", "mode", "variant", "median µs", *REFERENCES.values(), "peak MiB", "steady peak MiB"]
    columns += ["reserved MiB", "setup s", "correct", "error"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in sorted(records, key=order):
        own = r.get("median_us")
        ratios = [times.get((r["workload"], r["mode"], ref)) for ref in REFERENCES]
        correct = r.get("correct")
        cells = [
            r["workload"],
            r["mode"],
            r["variant"],
            _num(own, ".1f"),
            *(_num(own / ref if own and ref else None, ".2f") for ref in ratios),
            _mib(r.get("peak_mem_bytes")),
            _mib(r.get("steady_peak_mem_bytes")),
            _mib(r.get("peak_reserved_bytes")),
            _num(r.get("setup_s"), ".2f"),
            "–" if correct is None else ("yes" if correct else "NO"),
            (r.get("error") or "").replace("|", "/").replace("\n", " "),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def host_breakdown_text(breakdown: Mapping[str, Any]) -> str:
    """The derived costs of the microbenchmark (host time), one per line."""
    lines = [f"- {label}: {_num(breakdown.get(key), '.2f')} µs" for key, label in _HOST_COSTS.items()]
    return "\n".join(lines + ([f"- error: {breakdown['error']}"] if breakdown.get("error") else []))


def _run_line(run: Mapping[str, Any], with_versions: bool) -> str:
    options = run.get("options", {})
    text = (
        f"- {run.get('started', '?')}, code {str(run.get('cudagraphex_commit', '?'))[:12]}: "
        f"{', '.join(options.get('workloads', [])) or 'no workloads'}"
        f"{' and the microbenchmark' if options.get('micro') else ''}; modes {', '.join(options.get('modes', []))}"
        f"; {len(options.get('variants', []))} variant(s); budget {options.get('budget_s', '?')} s, took "
        f"{run.get('elapsed_s', '?')} s"
    )
    if with_versions:
        found = run.get("versions")
        text += "; " + (", ".join(f"{k} {v}" for k, v in found.items()) if found else "versions not recorded")
    if run.get("cuda_context_failed"):
        text += f"; the CUDA context failed: {run['cuda_context_failed']}"
    return text


def _markdown_document(records: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], variants: Sequence[str]) -> str:
    lines = [f"# cudagraphex benchmarks: {meta.get('gpu', '?')}, {meta.get('date', '?')}", ""]
    runs = meta.get("runs", [])
    setups = [run.get("versions") for run in runs]
    # A file of one setup names its versions once, above the runs; otherwise each run names its own.
    shared = setups[0] if setups and setups[0] and all(s == setups[0] for s in setups) else None
    if shared:
        lines += [", ".join(f"{k} {v}" for k, v in shared.items()), ""]
    if runs:
        lines += ["Runs whose records this file holds:", "", *(_run_line(r, not shared) for r in runs), ""]
    if meta.get("note"):
        lines += [f"Note: {meta['note']}", ""]
    lines += [markdown_table(records, variants), ""]
    if meta.get("host_breakdown"):
        lines += ["## Host cost of a replay (micro-100ops)", "", host_breakdown_text(meta["host_breakdown"]), ""]
    return "\n".join(lines)


def write_results(
    records: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], out_dir: Path, variants: Sequence[str] = ()
) -> dict[str, Path]:
    """Writes ``{"meta": meta, "records": records}`` to :func:`results_path` and the Markdown table beside it, with
    suffix ``.md`` (``out_dir`` is created if needed); returns both paths by suffix. ``meta`` holds ``date`` and
    ``gpu``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": results_path(out_dir, meta), "md": results_path(out_dir, meta).with_suffix(".md")}
    paths["json"].write_text(json.dumps({"meta": dict(meta), "records": list(records)}, indent=2, default=str) + "\n")
    paths["md"].write_text(_markdown_document(records, meta, variants))
    return paths


def merged(
    rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``rows`` and ``meta`` with what the existing results file of the same name holds and ``rows`` does not redo:
    its other records, and its runs that still hold a record (a record names its run by its start time; a file with a
    record that names none keeps every run). A record skipped in ``rows`` does not replace a measured one."""
    path = results_path(out_dir, meta)
    if not path.exists():
        return rows, meta
    old = json.loads(path.read_text())
    old_meta = old.get("meta", {})

    def key(r: Mapping[str, Any]) -> tuple[str, str, str]:
        return r["workload"], r["mode"], r["variant"]

    redone = {key(r) for r in rows if not (r.get("error") or "").startswith("skipped")}
    kept = [r for r in old.get("records", []) if key(r) not in redone]
    kept_keys = {key(r) for r in kept}
    records = kept + [r for r in rows if key(r) in redone or key(r) not in kept_keys]
    holders = {r.get("run") for r in records}
    this_run = meta["runs"][-1]["started"]
    # A file written by one setup may name its versions once, in its meta; its runs keep them when merged.
    file_versions = old_meta.get("versions")
    earlier = [
        {"versions": file_versions, **r} if file_versions and "versions" not in r else r
        for r in old_meta.get("runs", [])
        if r.get("started") != this_run and (None in holders or r.get("started") in holders)
    ]
    meta = dict(meta, runs=earlier + meta["runs"])
    meta["host_breakdown"] = meta.get("host_breakdown") or old_meta.get("host_breakdown")
    return records, meta
