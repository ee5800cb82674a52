"""Results: the record of one measurement, and the JSON and Markdown files written from a list of them.

Records are plain mappings here (``Record.to_dict()`` makes one), so the writers work on results read back from JSON.
Times in the table are also shown as ratios to two references of the same workload and mode:
``manual-graph`` (the practical limit) and ``thunder+CUDAGraphTransform`` (Thunder's own CUDA-graph transform).
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

__all__ = [
    "REFERENCES",
    "SKIPPED_FOR_TIME",
    "Record",
    "commit",
    "full_error",
    "host_breakdown_text",
    "markdown_table",
    "merged",
    "results_basename",
    "short_error",
    "versions",
    "write_results",
]

#: How the error of a task skipped for the time budget starts (not a failure: ``--merge`` measures it later).
SKIPPED_FOR_TIME = "skipped: over the time budget"


def short_error(e: BaseException) -> str:
    """The first line of ``e``, after its type: what a record's ``error`` holds."""
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(e).__name__}: {first}"[:240]


def full_error(e: BaseException) -> str:
    """The whole traceback of ``e``, with its chained exceptions, as Python prints it."""
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip()


#: The variants times are divided by, with the column titles of their ratios.
REFERENCES = {"manual-graph": "x manual-graph", "thunder+CUDAGraphTransform": "x CUDAGraphTransform"}

_MODE_ORDER = ("inference", "train_step")


@dataclasses.dataclass
class Record:
    """One (workload, mode, variant) measurement. ``error`` is set, and the numbers may be None, when it failed."""

    workload: str
    mode: str
    variant: str
    median_us: float | None = None
    peak_mem_bytes: int | None = None
    #: Like ``peak_mem_bytes``, for memory reserved by the caching allocator (graph pools hold freed blocks there).
    peak_reserved_bytes: int | None = None
    #: The peak of allocated memory over steady-state calls alone (after the setup's warm-up and captures, before the
    #: correctness check), from the same base as ``peak_mem_bytes``.
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

    found = {"python": platform.python_version(), "torch": torch.__version__}
    found["thunder"] = getattr(thunder, "__version__", "unknown")
    found["cudagraphex"] = cudagraphex.__version__  # imported from the tree, installed or not
    try:
        found["transformers"] = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        found["transformers"] = "not installed"
    return found


def commit() -> str:
    """The git commit of the code measured: the environment variable ``CUDAGRAPHEX_COMMIT`` when set (a copy of the
    tree, as on the GPU machine, may carry a stale ``.git``), else ``git rev-parse HEAD`` here, else "unknown"."""
    if os.environ.get("CUDAGRAPHEX_COMMIT"):
        return os.environ["CUDAGRAPHEX_COMMIT"]
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            check=False,
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def results_basename(date: str, gpu: str) -> str:
    """The file name, without suffix, of a run's results: ``<date>-<gpu>``, ``"NVIDIA H200"`` as ``nvidia-h200``."""
    return f"{date}-{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-') or 'unknown'}"


def _ratio(records: Sequence[Mapping[str, Any]], record: Mapping[str, Any], reference: str) -> float | None:
    """``record``'s time divided by that of variant ``reference`` in the same workload and mode; None if either
    time is missing."""
    if record.get("median_us") is None:
        return None
    for other in records:
        if (
            other["variant"] == reference
            and other["workload"] == record["workload"]
            and other["mode"] == record["mode"]
            and other.get("median_us")
        ):
            return record["median_us"] / other["median_us"]
    return None


def _ordered(records: Sequence[Mapping[str, Any]], variants: Sequence[str]) -> list[Mapping[str, Any]]:
    workloads = list(dict.fromkeys(r["workload"] for r in records))

    def key(r: Mapping[str, Any]) -> tuple:
        mode = _MODE_ORDER.index(r["mode"]) if r["mode"] in _MODE_ORDER else len(_MODE_ORDER)
        variant = variants.index(r["variant"]) if r["variant"] in variants else len(variants)
        return workloads.index(r["workload"]), mode, variant, r["variant"]

    return sorted(records, key=key)


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _mib(size: int | None) -> str:
    return _num(None if size is None else size / 2**20, ".0f")


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def markdown_table(records: Sequence[Mapping[str, Any]], variants: Sequence[str] = ()) -> str:
    """A Markdown table of ``records``, grouped by workload and mode, variants in the order of ``variants``."""
    columns = [
        "workload",
        "mode",
        "variant",
        "median µs",
        *REFERENCES.values(),
        "peak MiB",
        "steady peak MiB",
        "reserved MiB",
        "setup s",
        "correct",
    ]
    lines = ["| " + " | ".join([*columns, "error"]) + " |", "|" + "---|" * (len(columns) + 1)]
    for r in _ordered(records, variants):
        ratios = [_num(_ratio(records, r, ref), ".2f") for ref in REFERENCES]
        correct = r.get("correct")
        cells = [
            r["workload"],
            r["mode"],
            r["variant"],
            _num(r.get("median_us"), ".1f"),
            *ratios,
            _mib(r.get("peak_mem_bytes")),
            _mib(r.get("steady_peak_mem_bytes")),
            _mib(r.get("peak_reserved_bytes")),
            _num(r.get("setup_s"), ".2f"),
            "–" if correct is None else ("yes" if correct else "NO"),
            _cell(r.get("error") or ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _markdown_document(records: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], variants: Sequence[str]) -> str:
    lines = [f"# cudagraphex benchmarks: {meta.get('gpu', '?')}, {meta.get('date', '?')}", ""]
    runs = meta.get("runs", [])
    # Each run records the versions it ran with; a file of one setup names them once, above the runs.
    setups = [
        _versions_text(run.get("versions") or (meta.get("versions") if len(runs) == 1 else None) or {}) for run in runs
    ]
    shared = setups[0] if setups and setups[0] and setups.count(setups[0]) == len(setups) else None
    if shared:
        lines += [shared, ""]
    if runs:
        lines.append("Runs whose records this file holds:")
        lines.append("")
        for run, setup in zip(runs, setups, strict=True):
            options = run.get("options", {})
            text = (
                f"- {run.get('started', '?')}, code {str(run.get('cudagraphex_commit', '?'))[:12]}: "
                f"{', '.join(options.get('workloads', [])) or 'no workloads'}"
                f"{' and the microbenchmark' if options.get('micro') else ''}; modes {', '.join(options.get('modes', []))}"
                f"; {len(options.get('variants', []))} variant(s); budget {options.get('budget_s', '?')} s, took "
                f"{run.get('elapsed_s', '?')} s"
            )
            if not shared:
                text += f"; {setup or 'versions not recorded'}"
            if run.get("cuda_context_failed"):
                text += f"; the CUDA context failed: {run['cuda_context_failed']}"
            lines.append(text)
        lines.append("")
    if meta.get("note"):
        lines += [f"Note: {meta['note']}", ""]
    lines += [markdown_table(records, variants), ""]
    breakdown = meta.get("host_breakdown")
    if breakdown:
        lines += ["## Host cost of a replay (micro-100ops)", "", host_breakdown_text(breakdown), ""]
    return "\n".join(lines)


def _versions_text(versions: Mapping[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in versions.items())


def host_breakdown_text(breakdown: Mapping[str, Any]) -> str:
    """The derived costs of the microbenchmark (host time), one per line."""
    labels = {
        "cudagraphex_overhead_per_region_us": "cudagraphex host cost per region (region call - graph.replay, k=1)",
        "per_region_read_in_place_us": "the same, its input read in place (no copy)",
        "per_copied_input_us": "per copied input (slope over k)",
        "per_returned_output_us": "per returned output (the 100-output region over the 1-output one)",
        "thunder_glue_us": "Thunder prologue/epilogue + glue (thunder call - region call, k=1)",
    }
    lines = [f"- {label}: {_num(breakdown.get(key), '.2f')} µs" for key, label in labels.items()]
    if breakdown.get("error"):
        lines.append(f"- error: {breakdown['error']}")
    return "\n".join(lines)


def write_results(
    records: Sequence[Mapping[str, Any]],
    meta: Mapping[str, Any],
    out_dir: Path,
    variants: Sequence[str] = (),
) -> dict[str, Path]:
    """Writes ``<date>-<gpu>.json`` and ``.md`` into ``out_dir`` (created if needed); returns their paths by suffix.

    ``meta`` must hold ``date`` and ``gpu``. The JSON is ``{"meta": meta, "records": records}``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / results_basename(meta["date"], meta["gpu"])
    paths = {"json": base.with_suffix(".json"), "md": base.with_suffix(".md")}
    payload = {"meta": dict(meta), "records": [dict(r) for r in records]}
    paths["json"].write_text(json.dumps(payload, indent=2, default=str) + "\n")
    paths["md"].write_text(_markdown_document(records, meta, variants))
    return paths


def merged(
    rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``rows`` and ``meta`` with what the existing results file of the same name holds and ``rows`` does not redo:
    its other records, and its runs that still hold a record (a record names its run by its start time; a file with a
    record that names none keeps every run). A record skipped in ``rows`` does not replace a measured one."""
    path = (out_dir / results_basename(meta["date"], meta["gpu"])).with_suffix(".json")
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
    # A file written by one setup names its versions once, in its meta; its runs keep them when they are merged.
    file_versions = old_meta.get("versions")
    earlier = [
        {"versions": file_versions, **r} if file_versions and "versions" not in r else r
        for r in old_meta.get("runs", [])
        if r.get("started") != this_run and (None in holders or r.get("started") in holders)
    ]
    meta = dict(meta, runs=earlier + meta["runs"])
    meta["host_breakdown"] = meta.get("host_breakdown") or old_meta.get("host_breakdown")
    return records, meta
