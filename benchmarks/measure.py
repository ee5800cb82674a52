"""How a call is measured: its results against eager's, its time per call, and the memory around it.

``benchmarks/README.md`` ("What is measured") defines the fields these fill.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from benchmarks.cases import module_case
from benchmarks.workloads import Setup, Workload

MAX_ITERS_PER_REP = 5000


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


def compare(
    got: Sequence[torch.Tensor | None], expected: Sequence[torch.Tensor | None], dtype: torch.dtype
) -> tuple[bool, float]:
    """Whether ``got`` matches eager's ``expected`` (relative errors at most 1e-3 in fp32, 5e-2 in other ``dtype``s);
    and the largest relative error.

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
    return worst <= (1e-3 if dtype == torch.float32 else 5e-2), worst


def iters_per_block(call: Callable[[], None], sync: Callable[[], None], options: Options) -> int:
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


def block_us(call: Callable[[], None], iters: int, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    return (time.perf_counter() - start) / iters * 1e6


def time_per_call_us(call: Callable[[], None], sync: Callable[[], None], options: Options) -> float:
    """The median over ``options.reps`` synchronized blocks of calls of the wall time per call, in microseconds."""
    iters = iters_per_block(call, sync, options)
    return statistics.median(block_us(call, iters, sync) for _ in range(max(1, options.reps)))


@dataclass
class Prepared:
    """A workload built once per run, with eager's results for each mode (the correctness reference)."""

    setup: Setup
    modes: tuple[str, ...]
    #: The cotangent ``train_step`` backpropagates: 1 for a scalar loss, a fixed random tensor for other outputs.
    grad_out: torch.Tensor | None
    expected: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)


def prepare(workload: Workload, modes: Sequence[str], device: torch.device) -> Prepared:
    """Builds ``workload`` on ``device`` and runs eager once per mode in ``modes`` (those it supports) for the
    reference results. Raises whatever building or running raises."""
    setup = workload.build(device, False)
    modes = tuple(m for m in modes if m in workload.modes)
    model = setup.fresh_model()
    grad_out = None
    if "train_step" in modes:
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


def memory_now(device: torch.device) -> tuple[int, int]:
    """Bytes allocated and reserved on ``device`` now (zeros off CUDA)."""
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


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


def free_memory(device: torch.device) -> None:
    """Collects garbage and, on a GPU, releases cuBLAS's workspaces (one per stream that ran a matmul) and hands the
    allocator's cached blocks back; never raises (the suite's health check reports a failed CUDA context)."""
    gc.collect()
    if device.type == "cuda":
        with contextlib.suppress(Exception):  # a failed context raises here too; the suite reports it
            torch.cuda.synchronize(device)
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
