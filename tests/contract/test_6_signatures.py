"""Contract point 6: new shapes, dtypes and strides get their own graph, bounded in number."""

from __future__ import annotations

import warnings

import torch

from benchmarks.models import mlp
from cudagraphex import CUDAGraphExecutor
from tests.helpers import BACKENDS, emulated, jit, num_graphs, protection_off


def test_variable_batch_size_and_going_back(backend):
    model = mlp(3, 16).to(backend.device).eval()
    jm = jit(model, backend.executor)
    with torch.no_grad():
        for batch in (4, 8, 4, 8, 2, 4, 8):
            for _ in range(2):
                x = torch.randn(batch, 16, device=backend.device)
                torch.testing.assert_close(jm(x), model(x))
    # one trace per shape, one graph per trace; going back to a shape reuses its graph
    assert num_graphs(jm, backend.executor) == 3


def strided_calls(ex):
    def f(x):
        return x.sin() * 2 + 1

    jf = jit(f, ex)
    base = torch.randn(6, 6)
    results = []
    for x in (base, base, base.t(), base.t(), base, base.t()):
        out = jf(x)
        results.append(out.stride() == f(x).stride() and torch.equal(out, f(x)))
    return jf, results


def test_a_new_stride_gets_its_own_graph():
    jf, results = strided_calls(emulated)
    assert all(results)
    assert num_graphs(jf, emulated) == 2


def test_signature_protection_bites():
    with protection_off("signature_guard"):
        _, results = strided_calls(emulated)
    assert not all(results)


class _Square(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).sin()


def transposed_parameter_calls(backend) -> tuple[object, list[bool]]:
    """Three calls, then the parameter's data replaced by its transpose (the same address, other strides, the shape
    Thunder's prologue checks), then three more: whether each result is eager's."""
    model = _Square().to(backend.device)
    jm = jit(model, backend.executor)
    x = torch.randn(4, 6, device=backend.device)
    results = []
    with torch.no_grad():
        for transpose in (False, True):
            if transpose:
                address = model.w.data_ptr()
                model.w.data = model.w.data.t()
                assert model.w.data_ptr() == address
            for _ in range(3):
                results.append(torch.allclose(jm(x), model(x)))
    return jm, results


def test_a_static_input_with_new_strides_at_its_address_gets_its_own_graph(backend):
    jm, results = transposed_parameter_calls(backend)
    assert all(results)
    assert num_graphs(jm, backend.executor) == 2


def test_signature_protection_bites_for_a_static_input():
    with protection_off("signature_guard"):
        _, results = transposed_parameter_calls(BACKENDS["emulate"])
    assert results[:3] == [True] * 3 and not all(results[3:])


def test_graph_budget_warns_once_and_runs_eagerly(backend):
    ex = backend.executor
    limited = CUDAGraphExecutor(f"cudagraphex_budget_{ex.name}", backend=backend.name, max_graphs_per_region=2)

    def f(x):
        return x.sin() * 2 + 1

    jf = jit(f, limited)
    base = torch.randn(8, 8, device=backend.device)
    wide, tall = torch.randn(8, 16, device=backend.device), torch.randn(16, 8, device=backend.device)
    layouts = [base, base.t(), wide[:, ::2], tall[::2]]  # one shape, four strides
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for x in layouts:
                torch.testing.assert_close(jf(x), f(x))
    budget = [w for w in caught if "max_graphs_per_region=2" in str(w.message)]
    assert len(budget) == 1
    assert num_graphs(jf, limited) == 2
