"""The GPU run: every (workload, variant, mode), measured for memory, checked against eager, then timed.

``benchmarks/README.md`` ("What is measured", "Time") defines every field of a record; this module measures them.
Its invariants:

* Workloads run one after another; everything built for one is freed before the next. Within a workload, variants are
  set up one after another, each in all its modes, and kept until the workload is timed. A variant starts only while
  the time spent plus the longest variant so far fits in the budget; one that does not is recorded as skipped.
* ``torch.compile(mode="reduce-overhead")`` is set up first, because it frees cuBLAS's workspaces when it records
  (``torch._inductor.cudagraph_trees.clear_cublas_manager``), which would break graphs captured before it; and it is
  timed right after its setup, with the one case it was checked with. The others follow in ``VARIANTS`` order.
* Timing starts once every variant of the workload is set up: mode by mode, in rounds of one block of calls per
  variant, so that the VM's drift touches all variants alike.
* Between the variants of a workload neither cuBLAS's workspaces nor the allocator's cached blocks are released: the
  graphs set up so far run again later, and releasing them there ended in "illegal memory access" errors. A variant's
  peak therefore leaves out a workspace that a variant set up before it allocated.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from benchmarks.cases import Case
from benchmarks.measure import (
    Options,
    Prepared,
    block_us,
    compare,
    free_memory,
    iters_per_block,
    memory_now,
    prepare,
    rare_gc,
    time_per_call_us,
)
from benchmarks.micro import MICRO_MEASUREMENTS, MICRO_WORKLOAD, run_micro
from benchmarks.report import SKIPPED_FOR_TIME, Record, full_error, short_error
from benchmarks.variants import REDUCE_OVERHEAD, VARIANTS, graph_executor, make_variant, variant_modes
from benchmarks.workloads import WORKLOADS, Workload

SETUP_CALLS = 3
MEMORY_CALLS = 3


class Suite:
    """Runs the GPU benchmarks (or, on ``device`` cpu, the same code with cudagraphex's CPU replay backend): the
    ``workloads``, ``modes`` and ``variants`` named, after the host-overhead microbenchmark if ``micro``.

    ``progress`` is called with a short label after every finished or skipped (workload, variant, mode); ``log`` with
    lines for people (time per task, skips, tracebacks); ``checkpoint`` (an attribute, by default a no-op) with the
    records so far after the microbenchmark and after each workload, for writing partial results.
    """

    def __init__(
        self,
        workloads: Sequence[str],
        modes: Sequence[str],
        variants: Sequence[str],
        options: Options,
        *,
        micro: bool = False,
        device: torch.device | None = None,
        progress: Callable[[str], None] = lambda label: None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.workloads = [WORKLOADS[w] for w in workloads]
        self.modes = tuple(modes)
        order = (REDUCE_OVERHEAD, *(v for v in VARIANTS if v != REDUCE_OVERHEAD))
        self.variants = tuple(v for v in order if v in variants)
        self.options, self.micro, self.progress, self.log = options, micro, progress, log
        self.records: list[Record] = []
        self.host_breakdown: dict | None = None
        self.seconds_per_workload: dict[str, float] = {w.name: 0.0 for w in self.workloads}
        #: Why the CUDA context stopped working, once it has (every later task is skipped).
        self.broken: str | None = None
        self.graph_executor = graph_executor(self.device)
        self.checkpoint: Callable[[list[Record]], object] = lambda records: None
        self._start = time.monotonic()
        self._longest_s = 0.0

    def modes_of(self, workload: Workload, variant: str | None = None) -> tuple[str, ...]:
        """The selected modes ``workload`` has, and of those, if ``variant`` is given, the ones it runs."""
        runs = variant_modes(variant) if variant else workload.modes
        return tuple(m for m in self.modes if m in workload.modes and m in runs)

    def num_measurements(self) -> int:
        """How many results the run will report (for a progress count)."""
        tasks = sum(len(self.modes_of(w, v)) for w in self.workloads for v in self.variants)
        return tasks + (MICRO_MEASUREMENTS if self.micro else 0)

    def run(self) -> list[Record]:
        if self.micro:
            self._run_micro()
            self.checkpoint(self.records)
        for workload in self.workloads:
            if self.modes_of(workload):
                self._run_workload(workload)
                self.checkpoint(self.records)
        return self.records

    def failures(self) -> list[Record]:
        """The records that failed: an error other than a skip for time (a skip after the CUDA context failed counts:
        it was not measured)."""
        return [r for r in self.records if r.error and not r.error.startswith(SKIPPED_FOR_TIME)]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _skip_reason(self, *, budget: bool = True) -> str | None:
        if self.broken:
            return f"skipped: the CUDA context failed earlier ({self.broken})"
        limit = self.options.budget_s
        if budget and limit > 0 and time.monotonic() - self._start + self._longest_s > limit:
            return f"{SKIPPED_FOR_TIME} (--budget-s {limit:g})"
        return None

    def _add(self, record: Record) -> None:
        self.records.append(record)
        self.progress(f"{record.workload} {record.variant} {record.mode}")

    def _run_workload(self, workload: Workload) -> None:
        compiled: list[tuple[str, object]] = []
        prepared: Prepared | None = None
        failure = ""
        try:
            prepared = prepare(workload, self.modes, self.device)
        except Exception as e:  # noqa: BLE001 - recorded for every task of this workload
            self._failed([], e, f"{workload.name}: building it")
            failure = f"building the workload failed: {short_error(e)}"
        free_memory(self.device)
        for variant in self.variants:
            modes = self.modes_of(workload, variant)
            reason = self._skip_reason() if prepared is not None else failure
            if modes and reason:
                self.log(f"{workload.name} / {variant}: {reason}")
                for mode in modes:
                    self._add(Record(workload.name, mode, variant, error=reason))
            elif modes:
                start = time.monotonic()
                kept = self._run_variant(workload, variant, modes, prepared)
                if kept is not None:
                    compiled.append((variant, kept))
                took = time.monotonic() - start
                self._longest_s = max(self._longest_s, took)
                self.seconds_per_workload[workload.name] += took
                self.log(f"{workload.name} / {variant}: {len(modes)} mode(s) in {took:.1f} s")
        if prepared is not None:
            self._time_interleaved(workload, prepared, compiled)
        compiled.clear()
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
        free_memory(self.device)

    def _run_variant(self, workload: Workload, variant: str, modes: Sequence[str], prepared: Prepared):
        """Sets ``variant`` up and measures it in ``modes``; returns the compiled variant (None if compiling failed)."""
        base = memory_now(self.device)
        records = [Record(workload.name, mode, variant) for mode in modes]
        try:
            compiled = make_variant(variant, prepared.setup.fresh_model, self.graph_executor)
        except Exception as e:  # noqa: BLE001 - recorded; the run goes on
            self._failed(records, e, f"{workload.name} / {variant}: compiling it")
            compiled = None
        for record in records:
            if compiled is not None:
                record.error = record.error or self._skip_reason(budget=False)
                if not record.error:
                    self._measure(record, compiled, prepared, base)
            self._add(record)
        gc.collect()
        return compiled

    def _measure(self, record: Record, compiled, prepared: Prepared, base: tuple[int, int]) -> None:
        """Setup time, peak memory and correctness of one mode (the module docstring); reduce-overhead's time too.
        The peaks are read before the correctness check, whose copies are not the variant's memory."""
        case: Case | None = None
        notes: list[str] = []
        skips = _cudagraph_skips()
        cuda = self.device.type == "cuda"
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            # Warnings are collected while compiling and capturing (where graph fallbacks are reported), not while
            # timing, so that a warning repeated on every call costs what it costs users.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self._sync()
                start = time.perf_counter()
                with rare_gc():
                    case = compiled.case(record.mode, prepared.setup.args(record.mode), prepared.grad_out)
                    for _ in range(SETUP_CALLS):
                        case.call()
                    self._sync()
                record.setup_s = time.perf_counter() - start
                if cuda:
                    setup_peak = torch.cuda.max_memory_allocated(self.device)
                    setup_reserved = torch.cuda.max_memory_reserved(self.device)
                    torch.cuda.reset_peak_memory_stats(self.device)
                    for _ in range(MEMORY_CALLS):
                        case.call()
                    self._sync()
                    steady_peak = torch.cuda.max_memory_allocated(self.device)
                    record.steady_peak_mem_bytes = steady_peak - base[0]
                    record.peak_mem_bytes = max(setup_peak, steady_peak) - base[0]
                    reserved = max(setup_reserved, torch.cuda.max_memory_reserved(self.device))
                    record.peak_reserved_bytes = reserved - base[1]
                expected = prepared.expected[record.mode]
                record.correct, record.rel_err = compare(case.collect(), expected, prepared.setup.dtype)
            # The first three distinct warnings that say a graph was not used (capture failures, graph budgets).
            texts = [str(w.message).splitlines()[0][:200] for w in caught if str(w.message)]
            notes += list(dict.fromkeys(t for t in texts if "graph" in t.lower()))[:3]
            if record.variant == REDUCE_OVERHEAD:
                record.median_us = time_per_call_us(case.call, self._sync, self.options)
                if _cudagraph_skips() > skips:
                    notes.append(
                        "inductor skipped CUDA graphs for some graph (torch._dynamo counters: cudagraph_skips)"
                    )
            if "cudagraphex" in record.variant and compiled.explained is not None:
                notes.append(_cudagraphex_summary(compiled.explained))
        except Exception as e:  # noqa: BLE001 - recorded; the run goes on
            self._failed([record], e, f"{record.workload} / {record.variant} / {record.mode}")
        finally:
            if case is not None:
                with contextlib.suppress(Exception):
                    case.close()
            del case
        record.note = "; ".join(notes) or None

    def _time_interleaved(self, workload: Workload, prepared: Prepared, compiled: list[tuple[str, object]]) -> None:
        """Times the variants set up without error, mode by mode, in rounds (the module docstring)."""
        records = {(r.mode, r.variant): r for r in self.records if r.workload == workload.name}
        start = time.monotonic()
        for mode in self.modes_of(workload):
            cases: dict[str, tuple[Case, int, Record]] = {}
            times: dict[str, list[float]] = {}
            try:
                for variant, variant_compiled in compiled:
                    record = records.get((mode, variant))
                    if record is None or record.error or variant == REDUCE_OVERHEAD or self.broken:
                        continue
                    try:
                        case = variant_compiled.case(mode, prepared.setup.args(mode), prepared.grad_out)
                        cases[variant] = (case, iters_per_block(case.call, self._sync, self.options), record)
                        times[variant] = []
                    except Exception as e:  # noqa: BLE001 - recorded; the other variants go on
                        self._failed([record], e, f"{workload.name} / {variant} / {mode}: timing", "timing: ")
                for _ in range(max(1, self.options.reps)):
                    for variant, (case, iters, record) in cases.items():
                        if record.error is None and not self.broken:
                            try:
                                times[variant].append(block_us(case.call, iters, self._sync))
                            except Exception as e:  # noqa: BLE001 - recorded; the other variants go on
                                self._failed([record], e, f"{workload.name} / {variant} / {mode}: timing", "timing: ")
                for variant, (_, _, record) in cases.items():
                    if record.error is None and times[variant]:
                        record.median_us = statistics.median(times[variant])
            finally:
                for case, _, _ in cases.values():
                    with contextlib.suppress(Exception):
                        case.close()
                cases.clear()
        took = time.monotonic() - start
        self.seconds_per_workload[workload.name] += took
        self.log(f"{workload.name}: timed {len(compiled)} variant(s) interleaved in {took:.1f} s")

    def _failed(self, records: Sequence[Record], error: BaseException, where: str, prefix: str = "") -> None:
        """Records the first line of ``error`` in ``records``, logs its whole traceback, then checks the CUDA
        context: if it no longer works, every later task is skipped, and the run still writes what it has."""
        for record in records:
            record.error = prefix + short_error(error)
        self.log(f"{where}: failed:\n{full_error(error)}")
        if self.device.type != "cuda" or self.broken:
            return
        try:
            torch.cuda.synchronize(self.device)
            torch.ones(1, device=self.device).add_(1).item()
        except Exception as e:  # noqa: BLE001 - any failure here means the context is unusable
            self.broken = short_error(e)
            self.log(f"the CUDA context failed after {where}; skipping the rest of the run")

    def _run_micro(self) -> None:
        reason = self._skip_reason()
        if reason:
            self.records.append(Record(MICRO_WORKLOAD, "inference", "thunder call k=1", error=reason))
            for _ in range(MICRO_MEASUREMENTS):
                self.progress("micro skipped")
            return
        start = time.monotonic()
        records, self.host_breakdown = run_micro(self.graph_executor, self.device, self.options, self._sync, self.log)
        self.records += records
        for record in records:
            self.progress(f"{MICRO_WORKLOAD} {record.variant}")
        self.log(f"{MICRO_WORKLOAD}: {time.monotonic() - start:.1f} s")
        free_memory(self.device)


def _cudagraph_skips() -> int:
    """How often inductor has fallen back from CUDA graphs in this process (reduce-overhead's silent failure)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def _cudagraphex_summary(explained: object) -> str:
    """``cudagraphex.explain()`` in one line: a Thunder function's regions and graphs, or a step graph's report."""
    from cudagraphex import explain

    try:
        report = explain(explained)
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        return f"explain() failed: {short_error(e)}"
    if not hasattr(report, "regions"):  # a step graph's report
        return "; ".join(line.strip() for line in str(report).splitlines())
    regions = report.regions
    given_back = sum(g.given_back_bytes for r in regions for g in r.graphs)
    failed = ", ".join(r.name for r in regions if r.disabled_reason)
    return (
        f"cudagraphex: {len(regions)} region(s), {report.num_graphs} graph(s), {sum(r.replays for r in regions)}"
        f" replay(s), {report.pool_bytes / 2**20:.0f} MiB in pools, peak raised by"
        f" {report.peak_added_bytes / 2**20:.0f} MiB, {given_back / 2**20:.0f} MiB of saved tensors given back"
        + (f", capture failed in {failed}" if failed else "")
    )
