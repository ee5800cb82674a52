"""Contract point 5: per-call host values give the right result on every call."""

from __future__ import annotations

import pytest
import thunder
import torch

from cudagraphex import CUDAGraphExecutor, explain
from tests.helpers import BACKENDS, emulated, jit, protection_off, replays


def scale_by_item(x):
    s = x.abs().max().item()
    return (x / s).sin() * s + 1


def host_values_follow_each_call(jf) -> bool:
    """Whether ``jf``, a compiled ``scale_by_item``, matches it for five inputs whose host value differs."""
    return all(torch.allclose(jf(x), scale_by_item(x)) for x in (torch.randn(8) * (i + 1) for i in range(5)))


def test_host_value_in_a_graph_is_keyed_on_its_value():
    """A ``can_fuse`` override may let a host value into a graph: each value then gets its own graph."""

    class Permissive(CUDAGraphExecutor):
        def can_fuse(self, bsym):
            return super().can_fuse(bsym) or bsym.sym.name not in ("item", "python_return", "unpack_trivial")

    ex = Permissive("cudagraphex_permissive", backend="emulate")
    jf = jit(scale_by_item, ex)
    assert host_values_follow_each_call(jf)
    (region,) = [r for r in explain(jf).regions if r.host_values]
    assert region.host_values and not set(region.host_values) & set(region.copied_inputs)
    assert f"host values: {region.host_values[0]}" in str(explain(jf))


def test_host_value_protection_bites():
    assert host_values_follow_each_call(jit(scale_by_item, emulated))
    with protection_off("host_values_stay_out", "signature_guard"):
        assert not host_values_follow_each_call(jit(scale_by_item, emulated))


def test_numbers_passed_as_inputs(backend):
    def f(x, alpha):
        return (x * alpha).sin() + alpha

    for cache in ("constant values", "symbolic values"):
        jf = jit(f, backend.executor, cache=cache)
        for i in range(4):
            x = torch.randn(8, device=backend.device)
            torch.testing.assert_close(jf(x, 0.5 * i), f(x, 0.5 * i))


def test_a_host_value_beside_a_fusion_executor_is_read_on_every_call(backend):
    """With Thunder's torch.compile executor after cudagraphex, ``item`` of what a graph returns stays out of its
    fusions: Inductor compiles ``item`` of a float64 input of a fusion into the number it read on the first call."""
    from thunder.executors.torch_compile import torch_compile_ex

    def f(x, w):
        h = x.sin().mean().item()
        return ((x * h) @ w).cos(), h

    jf = thunder.jit(f, executors=[backend.executor, torch_compile_ex, *thunder.get_default_executors()])
    w = torch.randn(6, 6, device=backend.device, dtype=torch.float64)
    for i in range(4):
        x = torch.randn(3, 6, device=backend.device, dtype=torch.float64) + i
        out, h = jf(x, w)
        expected, expected_h = f(x, w)
        assert h == pytest.approx(expected_h, rel=1e-6)
        torch.testing.assert_close(out, expected)
    assert replays(jf, backend.executor) >= 2
    assert "TorchCompile" in str(thunder.last_traces(jf)[-1])


@pytest.mark.cuda
def test_cpu_scalar_tensor_changing_every_call():
    def f(x, scale):
        return (x * scale).cos() + scale

    jf = jit(f, BACKENDS["cuda"].executor)
    for i in range(5):
        x = torch.randn(8, device="cuda")
        scale = torch.tensor(float(i) + 0.5)  # a CPU scalar tensor
        torch.testing.assert_close(jf(x, scale), f(x, scale))
