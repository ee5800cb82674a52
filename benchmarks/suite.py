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
from dataclasses import dataclass, field

import torch

from benchmarks.micro import MICRO_MEASUREMENTS, MICRO_WORKLOAD, run_micro
from benchmarks.report import Record, full_error, short_error
from benchmarks.variants import (
    GRAPH_VARIANTS,
    VARIANTS,
    Case,
    Compiled,
    GraphStep,
    ManualGraph,
    device_time_per_call_us,
    make_variant,
    module_case,
    variant_modes,
)
from benchmarks.workloads import WORKLOADS, Setup, Workload

__all__ = [
    "EXPECTED_FAILURES",
    "ExpectedFailure",
    "Options",
    "Prepared",
    "Suite",
    "compare",
    "emulated_executor",
    "expected_failure",
    "free_memory",
    "prepare",
    "rare_gc",
    "time_per_call_us",
]

SETUP_CALLS = 3
MEMORY_CALLS = 3
MAX_ITERS_PER_REP = 5000

#: Variants in the order they are set up within a workload: reduce-overhead, cheap references, then the comparisons
#: this suite exists for. The microbenchmark, when asked for, runs before the workloads.
TASK_ORDER = (
    ("torch.compile(reduce-overhead)",),  # first: the module docstring says why
    ("eager", "manual-graph", "kernel-floor"),
    ("thunder+cudagraphex", "thunder+CUDAGraphTransform"),
    ("thunder+cudagraphex-step", "thunder+wholestep(unsafe)"),
    ("thunder", "thunder+cudagraphex(last)"),
    ("thunder+cudagraphex+PruneParameterChecks", "torch.compile"),
    ("thunder+torchcompile+cudagraphex", "thunder+torchcompile+cudagraphex-step"),
    ("thunder+torchcompile+wholestep(unsafe)",),
)

#: Rough seconds a task takes on an H200 host (compilation dominates), for the budget. Per workload: the cost of a
#: plain Thunder variant over all its modes; per variant: a multiple of it (the whole-step variants compile and run
#: the training step only). The run rescales these by what it sees.
_WORKLOAD_COST_S = {
    "mlp16x256-b8": 6,
    "nanogpt6-d256-t32-b1": 18,
    "nanogpt-thunder-tests": 14,
    "llama-decode": 10,
    "llama1b-4l-train": 40,
    "gpt2-124m": 36,
    "gpt12-d1024-b8-t512": 36,
}
_VARIANT_COST = {
    "eager": 0.25,
    "manual-graph": 0.3,
    "kernel-floor": 0.2,
    "thunder": 1.0,
    "thunder+CUDAGraphTransform": 1.0,
    "thunder+cudagraphex": 1.1,
    "thunder+cudagraphex(last)": 1.1,
    "thunder+cudagraphex+PruneParameterChecks": 1.1,
    "torch.compile": 1.5,
    "torch.compile(reduce-overhead)": 1.5,
    "thunder+torchcompile+cudagraphex": 2.0,
    "thunder+wholestep(unsafe)": 0.6,
    "thunder+cudagraphex-step": 0.9,
    "thunder+torchcompile+cudagraphex-step": 1.5,
    "thunder+torchcompile+wholestep(unsafe)": 1.1,
}
MICRO_COST_S = 15.0
#: Variants timed right after their setup instead of in the rounds: the rounds need a second case of the compiled
#: model, and a second train_bwd case of reduce-overhead's failed in CUDA-graph trees ("invalid device pointer", H200).
TIMED_AT_SETUP = frozenset({"torch.compile(reduce-overhead)"})


@dataclass(frozen=True)
class ExpectedFailure:
    """A known failure of one (workload, mode, variant): recorded with its reason, it does not fail the job."""

    workload: str
    mode: str
    variant: str
    #: Matches an error whose text (``"<type>: <message>"``) contains this.
    error: str
    #: One line: why it fails, and why that is not this suite's or cudagraphex's to fix.
    reason: str


#: Every failure the main job expects. Any other failure of a requested task (an error that is not a skip for time)
#: is unexpected and makes the job exit with status 1.
EXPECTED_FAILURES = (
    ExpectedFailure(
        "nanogpt6-d256-t32-b1",
        "train_bwd",
        "thunder+CUDAGraphTransform",
        "modified by an inplace operation",
        "Thunder 0.2.6's CUDAGraphTransform: a second train_bwd case of one compiled model (the timing rounds make "
        "one) fails autograd's version check",
    ),
)


def expected_failure(workload: str, mode: str, variant: str, error: str) -> ExpectedFailure | None:
    """The entry of :data:`EXPECTED_FAILURES` that ``error`` (the text of a failure of that task) matches, if any."""
    for known in EXPECTED_FAILURES:
        if (known.workload, known.mode, known.variant) == (workload, mode, variant) and known.error in error:
            return known
    return None


@dataclass(frozen=True)
class Options:
    """How long to measure. ``budget_s`` (0: none) bounds the wall time of all tasks together."""

    reps: int = 15
    quick: bool = False
    budget_s: float = 450.0

    @property
    def warmup_calls(self) -> int:
        return 1 if self.quick else 3

    @property
    def rep_target_s(self) -> float:
        return 0.02 if self.quick else 0.05

    @property
    def profile_calls(self) -> int:
        return 5 if self.quick else 10


def tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype == torch.float32 else 5e-2


def compare(
    got: Sequence[torch.Tensor | None], expected: Sequence[torch.Tensor | None], dtype: torch.dtype
) -> tuple[bool, float]:
    """Whether ``got`` matches eager's ``expected`` within the tolerance of ``dtype``; and the largest relative error.

    The relative error of a tensor is ``|got - expected| / (|expected| + 1e-6 sqrt(n))`` (Frobenius norms), which
    judges a whole gradient at once instead of its smallest elements. A missing tensor, a shape mismatch or a
    non-finite value is never correct.
    """
    if len(got) != len(expected):
        return False, float("inf")
    worst = 0.0
    for g, e in zip(got, expected, strict=True):
        if g is None or e is None:
            if g is not e:
                return False, float("inf")
            continue
        if g.shape != e.shape:
            return False, float("inf")
        g, e = g.detach().double(), e.detach().double()
        if not bool(torch.isfinite(g).all()):
            return False, float("inf")
        floor = 1e-6 * max(1, e.numel()) ** 0.5
        worst = max(worst, float((g - e).norm() / (e.norm() + floor)))
    return worst <= tolerance(dtype), worst


def _iters_per_block(call: Callable[[], None], sync: Callable[[], None], options: Options) -> int:
    """Warms ``call`` up, then how many calls make a block of about ``options.rep_target_s``, from the fastest of
    three timed calls: a whole-step variant may still capture at one of them, and a block sized by a capture would
    hold one call, which times a call's latency (host and device in turn) instead of its throughput."""
    for _ in range(options.warmup_calls):
        call()
    single = float("inf")
    for _ in range(3):
        sync()
        start = time.perf_counter()
        call()
        sync()
        single = min(single, time.perf_counter() - start)
    return max(1, min(MAX_ITERS_PER_REP, int(options.rep_target_s / max(single, 1e-7))))


def _block_us(call: Callable[[], None], iters: int, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    return (time.perf_counter() - start) / iters * 1e6


def time_per_call_us(call: Callable[[], None], sync: Callable[[], None], options: Options) -> float:
    """The median over ``options.reps`` synchronized blocks of calls of the wall time per call, in microseconds."""
    iters = _iters_per_block(call, sync, options)
    return statistics.median(_block_us(call, iters, sync) for _ in range(max(1, options.reps)))


#: How a task skipped for the time budget starts its error (not a failure: ``--merge`` measures it later).
SKIPPED_FOR_TIME = "skipped: over the time budget"


class Budget:
    """Decides whether a task still fits in the time left, from its expected cost scaled by how the run is going."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s
        self.start = time.monotonic()
        self._expected = 0.0
        self._actual = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def scale(self) -> float:
        if self._expected < 10.0:
            return 1.0
        return min(4.0, max(0.5, self._actual / self._expected))

    def fits(self, expected_s: float) -> bool:
        return self.total_s <= 0 or self.elapsed() + expected_s * self.scale() <= self.total_s

    def overrun(self) -> bool:
        """Past the budget by more than a grace period: stop even inside a task (between modes)."""
        return self.total_s > 0 and self.elapsed() > self.total_s + 30.0

    def spent(self, expected_s: float, actual_s: float) -> None:
        self._expected += expected_s
        self._actual += actual_s


@dataclass
class Prepared:
    """A workload built once per run, with eager's results for each mode (the correctness reference)."""

    setup: Setup
    modes: tuple[str, ...]
    #: The cotangent training modes backpropagate: 1 for a scalar loss, a fixed random tensor for other outputs.
    grad_out: torch.Tensor | None
    expected: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)


def prepare(workload: Workload, modes: Sequence[str], device: torch.device) -> Prepared:
    """Builds ``workload`` on ``device`` and runs eager once per mode in ``modes`` (those it supports) for the
    reference results. Raises whatever building or running raises."""
    setup = workload.build(device, False)
    modes = tuple(m for m in modes if m in workload.modes)
    model = setup.fresh_model()
    grad_out = None
    if any(m != "inference" for m in modes):
        torch.manual_seed(1)
        out = model(*setup.train_args)
        grad_out = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
        del out
    prepared = Prepared(setup, modes, grad_out)
    for mode in modes:
        case = module_case(model, model, mode, setup.args(mode), grad_out)
        prepared.expected[mode] = case.collect()
        case.close()
    return prepared


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
        self.graph_executor = _graph_executor(self.device)
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
        expected_s = _WORKLOAD_COST_S.get(workload.name, 10) * _VARIANT_COST.get(variant, 1.0)
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
        base = _MemoryBase.now(self.device)
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

    def _measure(self, record: Record, compiled: Compiled | ManualGraph, prepared: Prepared, base: _MemoryBase) -> None:
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
                        cases[variant] = (case, _iters_per_block(case.call, self._sync, self.options), record)
                    except Exception as e:  # noqa: BLE001 - recorded; the other variants go on
                        self._failed([record], e, f"{workload.name} / {variant} / {mode}: timing", "timing: ")
                times: dict[str, list[float]] = {variant: [] for variant in cases}
                for _ in range(max(1, self.options.reps)):
                    for variant, (case, iters, record) in cases.items():
                        if record.error is not None or self.broken:
                            continue
                        try:
                            times[variant].append(_block_us(case.call, iters, self._sync))
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


@dataclass(frozen=True)
class _MemoryBase:
    """Bytes allocated and reserved on a device at one moment (zeros off CUDA)."""

    allocated: int
    reserved: int

    @staticmethod
    def now(device: torch.device) -> _MemoryBase:
        if device.type != "cuda":
            return _MemoryBase(0, 0)
        return _MemoryBase(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


@contextlib.contextmanager
def rare_gc():
    """Collects garbage rarely while compiling: Thunder's tracing allocates millions of short-lived objects and the
    default thresholds make the collector a sizeable part of compile time. Timing runs with the default thresholds,
    so that garbage cycles holding GPU memory are freed as usual."""
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], 100_000), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.collect()


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
    text = (
        f"cudagraphex: {len(regions)} region(s), {report.num_graphs} graph(s), {replays} replay(s),"
        f" {report.pool_bytes / 2**20:.0f} MiB in pools, peak raised by {report.peak_added_bytes / 2**20:.0f} MiB"
    )
    failed = [r.name for r in regions if r.disabled_reason]
    if failed:
        text += f", capture failed in {', '.join(failed)}"
    return text


def _graph_executor(device: torch.device):
    """cudagraphex on a GPU; on the CPU (testing the suite itself) an executor with the emulated replay backend."""
    if device.type == "cuda":
        from cudagraphex import cudagraphex

        return cudagraphex
    return emulated_executor("cudagraphex_bench_emulate")


def emulated_executor(name: str):
    """The CPU-replay cudagraphex executor registered as ``name`` (created and registered on first use)."""
    from thunder.extend import get_executor, register_executor

    from cudagraphex import CUDAGraphExecutor

    existing = get_executor(name)
    if existing is not None:
        return existing
    executor = CUDAGraphExecutor(name, backend="emulate")
    register_executor(executor)
    return executor


def free_memory(device: torch.device) -> None:
    """Collects garbage and, on a GPU, releases cuBLAS's workspaces and hands the allocator's cached blocks back;
    never raises (a failed CUDA context is reported by the suite's health check).

    cuBLAS keeps a workspace per stream, and every capture on a side stream adds one. ``torch.compile(mode=
    "reduce-overhead")`` releases them all when it records, which made its peak memory negative (about -380 MiB on the
    H200). Released before every variant, each variant's peak includes the workspaces it uses itself."""
    gc.collect()
    if device.type == "cuda":
        with contextlib.suppress(Exception):  # a failed context raises here too; _check_health reports it
            torch.cuda.synchronize(device)
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
