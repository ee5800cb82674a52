"""pytest-benchmark versions of the GPU measurements: ``pytest benchmarks/`` on a machine with a CUDA GPU.

Parametrized over workloads x a subset of the variants x modes, with the main job's code (``benchmarks.suite`` and
``benchmarks.variants``). Each test checks its variant against eager before timing it and fails if the results
differ; pytest-benchmark times one call, synchronized, per round. Without CUDA, everything is skipped.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.measure import Prepared, compare, free_memory, prepare
from benchmarks.variants import Compiled, ManualGraph, make_variant
from benchmarks.workloads import WORKLOADS, transformers_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: The variants this suite times (the main job times them all): the references and the two graph executors.
BENCH_VARIANTS = ("eager", "manual-graph", "thunder", "thunder+CUDAGraphTransform", "thunder+cudagraphex")

#: Ordered so that one workload and one compiled variant serve consecutive tests.
CASES = [
    pytest.param(workload.name, variant, mode, id=f"{workload.name}-{variant}-{mode}")
    for workload in WORKLOADS.values()
    for variant in BENCH_VARIANTS
    for mode in workload.modes
]


class _Current:
    """The workload and the compiled variant of the running test, kept for the next test and freed on change."""

    def __init__(self) -> None:
        self.workload: str | None = None
        self.prepared: Prepared | None = None
        self.variant: tuple[str, str] | None = None
        self.compiled: Compiled | ManualGraph | None = None

    def get(self, workload: str, variant: str) -> tuple[Prepared, Compiled | ManualGraph]:
        device = torch.device("cuda", torch.cuda.current_device())
        if self.workload != workload:
            self.release()
            self.prepared = prepare(WORKLOADS[workload], WORKLOADS[workload].modes, device)
            self.workload = workload
        if self.variant != (workload, variant):
            self.compiled = None
            torch._dynamo.reset()
            _free()
            from cudagraphex import cudagraphex

            self.compiled = make_variant(variant, self.prepared.setup.fresh_model, cudagraphex)
            self.variant = (workload, variant)
        return self.prepared, self.compiled

    def release(self) -> None:
        self.workload = self.prepared = self.variant = self.compiled = None
        _free()


def _free() -> None:
    free_memory(torch.device("cuda", torch.cuda.current_device()))


_current = _Current()


@pytest.fixture(scope="module", autouse=True)
def _release_at_end():
    yield
    _current.release()


@pytest.mark.parametrize(("workload", "variant", "mode"), CASES)
def test_bench(benchmark, workload: str, variant: str, mode: str) -> None:
    if WORKLOADS[workload].needs_transformers and not transformers_available():
        pytest.skip("transformers is not installed")
    prepared, compiled = _current.get(workload, variant)
    case = compiled.case(mode, prepared.setup.args(mode), prepared.grad_out)
    try:
        for _ in range(3):  # compilation, warm-up and capture
            case.call()
        correct, rel_err = compare(case.collect(), prepared.expected[mode], prepared.setup.dtype)
        benchmark.extra_info.update({"correct": correct, "rel_err": rel_err})
        assert correct, f"{variant} differs from eager in {mode}: relative error {rel_err:.3g}"

        def one_call() -> None:
            case.call()
            torch.cuda.synchronize()

        benchmark(one_call)
    finally:
        case.close()
