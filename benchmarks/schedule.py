"""What the main job runs: the order of its tasks, what each is expected to cost, the time budget, and the failures
it expects."""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = [
    "EXPECTED_FAILURES",
    "MICRO_COST_S",
    "SKIPPED_FOR_TIME",
    "TASK_ORDER",
    "TIMED_AT_SETUP",
    "VARIANT_COST",
    "WORKLOAD_COST_S",
    "Budget",
    "ExpectedFailure",
    "expected_failure",
]


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
WORKLOAD_COST_S = {
    "mlp16x256-b8": 6,
    "nanogpt6-d256-t32-b1": 18,
    "nanogpt-thunder-tests": 14,
    "llama-decode": 10,
    "llama1b-4l-train": 40,
    "gpt2-124m": 36,
    "gpt12-d1024-b8-t512": 36,
}


VARIANT_COST = {
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
