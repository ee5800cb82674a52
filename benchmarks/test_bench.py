"""pytest-benchmark versions of the GPU measurements: ``pytest benchmarks/`` on a machine with a CUDA GPU.

Parametrized over workloads x a subset of the variants x modes, with the main job's code. Each test checks its variant
against eager before timing it and fails if the results differ; pytest-benchmark times one call, synchronized, per
round. Without CUDA, everything is skipped.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.measure import compare, free_memory, prepare
from benchmarks.variants import make_variant, variant_modes
from benchmarks.workloads import WORKLOADS, transformers_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: The variants this suite times (the main job times them all): the references, the graph executors, the whole step.
BENCH_VARIANTS = (
    "eager",
    "manual-graph",
    "thunder",
    "thunder+CUDAGraphTransform",
    "thunder+cudagraphex",
    "thunder+cudagraphex-step",
)

#: Ordered so that one workload and one compiled variant serve consecutive tests.
CASES = [
    pytest.param(workload.name, variant, mode, id=f"{workload.name}-{variant}-{mode}")
    for workload in WORKLOADS.values()
    for variant in BENCH_VARIANTS
    for mode in workload.modes
    if mode in variant_modes(variant)
]

#: The workload and the compiled variant of the running test, kept for the next test and dropped on change.
_current: dict[str, object] = {}


def _get(workload: str, variant: str):
    device = torch.device("cuda", torch.cuda.current_device())
    if _current.get("workload") != workload:
        _current.clear()
        free_memory(device)
        _current.update(workload=workload, prepared=prepare(WORKLOADS[workload], WORKLOADS[workload].modes, device))
    if _current.get("variant") != variant:
        _current.pop("compiled", None)
        torch._dynamo.reset()
        free_memory(device)
        from cudagraphex import cudagraphex

        _current.update(
            variant=variant, compiled=make_variant(variant, _current["prepared"].setup.fresh_model, cudagraphex)
        )
    return _current["prepared"], _current["compiled"]


@pytest.fixture(scope="module", autouse=True)
def _release_at_end():
    yield
    _current.clear()
    free_memory(torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.parametrize(("workload", "variant", "mode"), CASES)
def test_bench(benchmark, workload: str, variant: str, mode: str) -> None:
    if WORKLOADS[workload].needs_transformers and not transformers_available():
        pytest.skip("transformers is not installed")
    prepared, compiled = _get(workload, variant)
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
