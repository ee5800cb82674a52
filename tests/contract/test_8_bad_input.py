"""Contract point 8: bad input gets a clear error; CPU programs are left alone; mixed devices split."""

from __future__ import annotations

import pytest
import torch

from cudagraphex import CUDAGraphExecutor
from tests.helpers import BACKENDS, emulated, jit, regions


def test_mixed_device_regions_are_split():
    def f(x, m):
        a = x.sin() * 2
        b = (m + 1).exp()  # another device: never in the same graph
        return a.cos() + 1, b

    jf = jit(f, emulated)
    for _ in range(3):
        x = torch.randn(4)
        out, meta = jf(x, torch.empty(4, device="meta"))
        torch.testing.assert_close(out, (x.sin() * 2).cos() + 1)
        assert meta.device.type == "meta"
    for r in regions(jf, emulated):
        assert r.info.device == "cpu"


@pytest.mark.cuda
def test_cuda_and_cpu_ops_are_split():
    def f(x, y):
        a = (x * 2).sin() + 1
        b = (y * 2).cos() + 1  # y lives on the CPU
        return a, b

    cuda = BACKENDS["cuda"].executor
    jf = jit(f, cuda)
    for _ in range(3):
        x, y = torch.randn(4, device="cuda"), torch.randn(4)
        a, b = jf(x, y)
        torch.testing.assert_close(a, (x * 2).sin() + 1)
        torch.testing.assert_close(b, (y * 2).cos() + 1)
    assert [r.info.device for r in regions(jf, cuda)] == ["cuda:0"]


def test_option_validation_bites(monkeypatch):
    """Without validation at construction, a bad option fails late and obscurely instead of with a ValueError."""
    from cudagraphex.runtime import GraphOptions

    with pytest.raises(ValueError, match="backend"):
        CUDAGraphExecutor("cudagraphex_bad_backend", backend="rocm")
    monkeypatch.setattr(GraphOptions, "__post_init__", lambda self: None)
    with pytest.raises(Exception) as late:
        CUDAGraphExecutor("cudagraphex_bad_backend", backend="rocm")
    assert not isinstance(late.value, ValueError)
