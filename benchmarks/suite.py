"""The GPU run: every (workload, variant, mode), checked against eager, measured for memory, then timed.

``benchmarks/README.md`` ("What is measured", "Time") defines every field of a record; this module measures them.
Its invariants:

* Workloads run one after another; everything built for one is freed before the next. Within a workload, variants are
  set up in the order of ``TASK_ORDER``, each in all its modes before the next (a budget that runs out drops the least
  important; a skipped task is recorded with its reason), and kept until the workload is timed.
* Timing starts once every variant of the workload is set up: mode by mode, in rounds of one block of calls per
  variant, so that the VM's drift touches all variants alike.
* ``torch.compile(mode="reduce-overhead")`` is set up first, because it frees cuBLAS's workspaces when it records
  (``torch._inductor.cudagraph_trees.clear_cublas_manager``), and timed right after its setup (``TIMED_AT_SETUP``):
  interleaved timing makes a second case of each compiled model, and reduce-overhead's second ``train_bwd`` case
  failed in CUDA-graph trees ("invalid device pointer").
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
from collections.abc import Callable, Iterable, Sequence

import torch

from benchmarks.cases import Case
from benchmarks.measure import (
    MemoryBase,
    Options,
    Prepared,
    block_us,
    compare,
    free_memory,
    iters_per_block,
    prepare,
    rare_gc,
    time_per_call_us,
)
from benchmarks.micro import MICRO_MEASUREMENTS, MICRO_WORKLOAD, run_micro
from benchmarks.report import Record, full_error, short_error
from benchmarks.schedule import (
    MICRO_COST_S,
    SKIPPED_FOR_TIME,
    TASK_ORDER,
    TIMED_AT_SETUP,
    VARIANT_COST,
    WORKLOAD_COST_S,
    Budget,
    expected_failure,
)
from benchmarks.variants import (
    GRAPH_VARIANTS,
    VARIANTS,
    Compiled,
    GraphStep,
    ManualGraph,
    device_time_per_call_us,
    graph_executor,
    make_variant,
    variant_modes,
)
from benchmarks.workloads import WORKLOADS, Workload

__all__ = ["Suite"]

SETUP_CALLS = 3
MEMORY_CALLS = 3


class Suite:
    """Runs the GPU benchmarks (or, on ``device`` cpu, the same code with an emulating executor, for testing).

    Args:
        workloads, modes, variants: what to run (names from ``WORKLOADS``, ``MODES``, ``VARIANTS``).
        options: measurement options.
        micro: whether to run the host-overhead microbenchmark.
        progress: called with a short label after every finished (workload, variant, mode) or skipped one.
        log: called with human-readable progress lines (elapsed time per task, skips, errors).

    ``checkpoint`` (an attribute, by default a no-op) is called with the records so far after the microbenchmark and
    after each workload, for writing partial results.
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
        self.variants = tuple(v for v in VARIANTS if v in variants)
        self.options = options
        self.micro = micro
        self.progress = progress
        self.log = log
        self.budget = Budget(options.budget_s)
        self.records: list[Record] = []
        self.host_breakdown: dict | None = None
        self.seconds_per_workload: dict[str, float] = {w.name: 0.0 for w in self.workloads}
        self.broken: str | None = None
        self._prepared: dict[str, Prepared | BaseException] = {}
        #: The compiled objects of the current workload, in setup order, kept for interleaved timing.
        self._compiled: list[tuple[str, Compiled | ManualGraph]] = []
        self.graph_executor = graph_executor(self.device)
        self.checkpoint: Callable[[list[Record]], object] = lambda records: None

    # -- what runs -------------------------------------------------------------------------------------------------

    def modes_of(self, workload: Workload, variant: str | None = None) -> tuple[str, ...]:
        """The selected modes ``workload`` has, and of those, if ``variant`` is given, the ones it runs."""
        runs = variant_modes(variant) if variant else workload.modes
        return tuple(m for m in self.modes if m in workload.modes and m in runs)

    def num_measurements(self) -> int:
        """How many (workload, variant, mode) results the run will report (for a progress bar)."""
        tasks = sum(len(self.modes_of(w, v)) for w in self.workloads for v in self.variants)
        return tasks + (MICRO_MEASUREMENTS if self.micro else 0)

    def tasks(self) -> Iterable[tuple[str, Workload | None]]:
        """What runs, in order: ``("micro", None)``, then per workload its variants in ``TASK_ORDER``, each followed by
        ``("done", workload)``, where what the workload built is freed."""
        if self.micro:
            yield "micro", None
        for workload in self.workloads:
            if not self.modes_of(workload):
                continue
            for tier in TASK_ORDER:
                for variant in tier:
                    if variant in self.variants and self.modes_of(workload, variant):
                        yield variant, workload
            yield "done", workload

    # -- the run -------------------------------------------------------------------------------------------------------

    def run(self) -> list[Record]:
        for task, workload in self.tasks():
            if task == "micro":
                self._run_micro()
                self.checkpoint(self.records)
            elif task == "done":
                self._time_interleaved(workload)
                self._compiled.clear()
                self._prepared.clear()
                with contextlib.suppress(Exception):
                    torch._dynamo.reset()
                free_memory(self.device)
                self.checkpoint(self.records)
            else:
                self._run_task(workload, task)
        return self.records

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _skip(self, workload: Workload, variant: str, modes: Sequence[str], reason: str) -> None:
        for mode in modes:
            self.records.append(Record(workload.name, mode, variant, error=reason))
            self.progress(f"{workload.name} {variant} {mode}")

    def _run_task(self, workload: Workload, variant: str) -> None:
        """Measures ``variant`` on ``workload`` in every mode it runs (the module docstring)."""
        modes = self.modes_of(workload, variant)
        if self.broken:
            self._skip(workload, variant, modes, f"skipped: the CUDA context failed earlier ({self.broken})")
            return
        expected_s = WORKLOAD_COST_S.get(workload.name, 10) * VARIANT_COST.get(variant, 1.0)
        if not self.budget.fits(expected_s):
            reason = f"{SKIPPED_FOR_TIME} (--budget-s {self.options.budget_s:g})"
            self._skip(workload, variant, modes, reason)
            self.log(f"{workload.name} / {variant}: {reason}")
            return
        start = time.monotonic()
        prepared = self._prepare(workload)
        if isinstance(prepared, BaseException):
            self._skip(workload, variant, modes, f"building the workload failed: {short_error(prepared)}")
        else:
            self._run_variant(workload, variant, prepared)
        took = time.monotonic() - start
        self.budget.spent(expected_s, took)
        self.seconds_per_workload[workload.name] += took
        self.log(f"{workload.name} / {variant}: {len(modes)} mode(s) in {took:.1f} s")

    def _prepare(self, workload: Workload) -> Prepared | BaseException:
        """The workload's :class:`Prepared`, built on first use; an exception if building it failed."""
        if workload.name not in self._prepared:
            try:
                self._prepared[workload.name] = prepare(workload, self.modes, self.device)
            except Exception as e:  # noqa: BLE001 - recorded for every task of this workload
                self._prepared[workload.name] = e
                self.log(f"{workload.name}: building it failed:\n{full_error(e)}")
                self._check_health(e, f"{workload.name}: building it")
            free_memory(self.device)
        return self._prepared[workload.name]

    def _run_variant(self, workload: Workload, variant: str, prepared: Prepared) -> None:
        setup = prepared.setup
        compiled: Compiled | ManualGraph | None = None
        base = MemoryBase.now(self.device)
        try:
            compiled = make_variant(variant, setup.fresh_model, self.graph_executor)
        except Exception as e:  # noqa: BLE001 - recorded; the run goes on
            records = [Record(workload.name, mode, variant) for mode in self.modes_of(workload, variant)]
            self._failed(records, e, f"{workload.name} / {variant}: compiling it")
            for record in records:
                self.records.append(record)
                self.progress(f"{workload.name} {variant} {record.mode}")
            return
        for mode in self.modes_of(workload, variant):
            record = Record(workload.name, mode, variant)
            if self.broken or self.budget.overrun():
                record.error = (
                    f"skipped: the CUDA context failed earlier ({self.broken})" if self.broken else SKIPPED_FOR_TIME
                )
            else:
                self._measure(record, compiled, prepared, base)
            self.records.append(record)
        # Kept for timing. The graphs of the variants kept so far still run later, so cuBLAS's workspaces and the
        # allocator's cached blocks stay where they are until the workload is done.
        self._compiled.append((variant, compiled))
        del compiled
        gc.collect()

    def _measure(self, record: Record, compiled: Compiled | ManualGraph, prepared: Prepared, base: MemoryBase) -> None:
        """The measurements of the module docstring for one mode (kernel-floor: its GPU time instead)."""
        mode, setup = record.mode, prepared.setup
        case: Case | None = None
        notes: list[str] = []
        skips_before = _cudagraph_skips()
        try:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            # Warnings are collected while compiling and capturing (where graph fallbacks are reported), not while
            # timing, so that a warning repeated on every call costs what it costs users.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self._sync()
                start = time.perf_counter()
                with rare_gc():
                    case = compiled.case(mode, setup.args(mode), prepared.grad_out)
                    for _ in range(SETUP_CALLS):
                        case.call()
                    self._sync()
                setup_s = time.perf_counter() - start
                if record.variant != "kernel-floor":
                    record.setup_s = setup_s
                    got = case.collect()
                    record.correct, record.rel_err = compare(got, prepared.expected[mode], setup.dtype)
                    del got
            notes += _graph_warnings(caught)
            if record.variant == "kernel-floor":
                record.median_us = device_time_per_call_us(case.call, self.options.profile_calls)
                notes.append("GPU time (kernels, memcpy, memset) of the eager call, from torch.profiler")
            elif self.device.type == "cuda":
                setup_peak = torch.cuda.max_memory_allocated(self.device)
                setup_reserved = torch.cuda.max_memory_reserved(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                for _ in range(MEMORY_CALLS):
                    case.call()
                self._sync()
                steady_peak = torch.cuda.max_memory_allocated(self.device)
                record.steady_peak_mem_bytes = steady_peak - base.allocated
                record.peak_mem_bytes = max(setup_peak, steady_peak) - base.allocated
                reserved = max(setup_reserved, torch.cuda.max_memory_reserved(self.device))
                record.peak_reserved_bytes = reserved - base.reserved
            if record.variant in TIMED_AT_SETUP:
                record.median_us = time_per_call_us(case.call, self._sync, self.options)
            if record.variant == "torch.compile(reduce-overhead)" and _cudagraph_skips() > skips_before:
                notes.append("inductor skipped CUDA graphs for some graph (torch._dynamo counters: cudagraph_skips)")
            if record.variant in GRAPH_VARIANTS:
                notes.append(_cudagraphex_summary(compiled.fn))
            elif isinstance(compiled, GraphStep):
                notes.append(_cudagraphex_summary(compiled.step))
        except Exception as e:  # noqa: BLE001 - recorded; the run goes on
            self._failed([record], e, f"{record.workload} / {record.variant} / {record.mode}")
        finally:
            if case is not None:
                with contextlib.suppress(Exception):
                    case.close()
            del case
        record.note = "; ".join(n for n in notes if n) or None

    def _time_interleaved(self, workload: Workload) -> None:
        """Times the variants of ``workload`` set up without error, mode by mode, in rounds (the module docstring)."""
        prepared = self._prepared.get(workload.name)
        records = {(r.mode, r.variant): r for r in self.records if r.workload == workload.name}
        start = time.monotonic()
        for mode in self.modes_of(workload):
            running = [(variant, compiled) for variant, compiled in self._compiled if (mode, variant) in records]
            timed = [
                (variant, compiled, records[(mode, variant)])
                for variant, compiled in running
                if variant != "kernel-floor"
                and variant not in TIMED_AT_SETUP
                and records[(mode, variant)].error is None
            ]
            cases: dict[str, tuple[Case, int, Record]] = {}
            try:
                for variant, compiled, record in timed:
                    if self.broken:
                        break
                    try:
                        case = compiled.case(mode, prepared.setup.args(mode), prepared.grad_out)
                        cases[variant] = (case, iters_per_block(case.call, self._sync, self.options), record)
                    except Exception as e:  # noqa: BLE001 - recorded; the other variants go on
                        self._failed([record], e, f"{workload.name} / {variant} / {mode}: timing", "timing: ")
                times: dict[str, list[float]] = {variant: [] for variant in cases}
                for _ in range(max(1, self.options.reps)):
                    for variant, (case, iters, record) in cases.items():
                        if record.error is not None or self.broken:
                            continue
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
            for variant, _ in running:
                self.progress(f"{workload.name} {variant} {mode}")
        took = time.monotonic() - start
        self.seconds_per_workload[workload.name] += took
        self.log(f"{workload.name}: timed {len(self._compiled)} variant(s) interleaved in {took:.1f} s")

    def _failed(self, records: Sequence[Record], error: BaseException, where: str, prefix: str = "") -> None:
        """Records ``error`` (its first line) in ``records``, with the reason where :data:`EXPECTED_FAILURES` expects
        it; prints it (the whole traceback, unless it is expected); then checks the CUDA context."""
        text = f"{type(error).__name__}: {error}"
        for record in records:
            record.error = prefix + short_error(error)
            known = expected_failure(record.workload, record.mode, record.variant, text)
            record.expected_failure = known.reason if known else None
        if records and all(r.expected_failure for r in records):
            self.log(f"{where}: failed as expected ({records[0].expected_failure}): {short_error(error)}")
        else:
            self.log(f"{where}: failed:\n{full_error(error)}")
        self._check_health(error, where)

    def unexpected_failures(self) -> list[Record]:
        """The records of this run that failed unexpectedly: an error that is neither a skip for time nor in
        :data:`EXPECTED_FAILURES` (tasks skipped because the CUDA context failed count: they were not measured)."""
        return [
            r for r in self.records if r.error and not r.expected_failure and not r.error.startswith(SKIPPED_FOR_TIME)
        ]

    def _check_health(self, error: BaseException, where: str) -> None:
        """After an error in ``where``: if the CUDA context no longer works, every later task is skipped (their
        results would be errors anyway), and the run still writes what it has."""
        if self.device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(self.device)
            torch.ones(1, device=self.device).add_(1).item()
        except Exception as e:  # noqa: BLE001 - any failure here means the context is unusable
            self.broken = short_error(e)
            self.log(f"the CUDA context failed after {where}; skipping the rest of the run")

    def _run_micro(self) -> None:
        if self.broken or not self.budget.fits(MICRO_COST_S):
            reason = f"skipped: the CUDA context failed earlier ({self.broken})" if self.broken else SKIPPED_FOR_TIME
            self.records.append(Record(MICRO_WORKLOAD, "inference", "thunder call k=1", error=reason))
            for _ in range(MICRO_MEASUREMENTS):
                self.progress("micro skipped")
            return
        start = time.monotonic()
        records, breakdown = run_micro(
            self.graph_executor, self.device, self.options, self._sync, self.progress, self.log
        )
        self.records += records
        self.host_breakdown = breakdown
        took = time.monotonic() - start
        self.budget.spent(MICRO_COST_S, took)
        self.log(f"micro-100ops: {took:.1f} s")
        free_memory(self.device)


def _graph_warnings(caught: Sequence[warnings.WarningMessage]) -> list[str]:
    """Warnings that say a graph was not used (cudagraphex capture failures, graph budgets, cudagraph skips)."""
    seen = []
    for w in caught:
        text = str(w.message).splitlines()[0][:200] if str(w.message) else ""
        if "graph" in text.lower() and text not in seen:
            seen.append(text)
    return seen[:3]


def _cudagraph_skips() -> int:
    """How often inductor has fallen back from CUDA graphs in this process (reduce-overhead's silent failure)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # noqa: BLE001 - a diagnostic only
        return 0


def _cudagraphex_summary(fn) -> str:
    """One line of ``cudagraphex.explain(fn)``: of a Thunder function's regions and graphs, or a step graph's report."""
    from cudagraphex import explain

    try:
        report = explain(fn)
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        return f"explain() failed: {short_error(e)}"
    if not hasattr(report, "regions"):  # a step graph's report
        return "; ".join(line.strip() for line in str(report).splitlines())
    regions = report.regions
    replays = sum(r.replays for r in regions)
    given_back = sum(g.given_back_bytes for r in regions for g in r.graphs)
    text = (
        f"cudagraphex: {len(regions)} region(s), {report.num_graphs} graph(s), {replays} replay(s),"
        f" {report.pool_bytes / 2**20:.0f} MiB in pools, peak raised by {report.peak_added_bytes / 2**20:.0f} MiB,"
        f" {given_back / 2**20:.0f} MiB of saved tensors given back"
    )
    failed = [r.name for r in regions if r.disabled_reason]
    if failed:
        text += f", capture failed in {', '.join(failed)}"
    return text
