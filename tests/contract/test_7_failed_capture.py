"""Contract point 7: a failed capture leaves the process healthy."""

from __future__ import annotations

import warnings

import pytest
import thunder
import torch

from cudagraphex import CUDAGraphExecutor, StrictModeError
from tests.contract.scenarios import fragile, fragile_triple
from tests.helpers import emulated, protection_off, regions


def with_fragile_op(x):
    return fragile_triple(torch.rand_like(x) + x.sin()) * 2 + torch.rand_like(x)


def run_fragile(ex, device):
    torch.manual_seed(123)
    jf = thunder.jit(with_fragile_op, executors=[ex, fragile, *thunder.get_default_executors()])
    x = torch.randn(16, device=device)
    return jf, [jf(x) for _ in range(4)]


def test_failed_capture_falls_back_once_and_keeps_rng(backend):
    torch.manual_seed(123)
    x = torch.randn(16, device=backend.device)
    plain = thunder.jit(with_fragile_op, executors=[fragile, *thunder.get_default_executors()])
    expected = [plain(x) for _ in range(4)]
    after_plain = torch.rand(3, device=backend.device)
    stream = torch.cuda.current_stream() if backend.device == "cuda" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jf, got = run_fragile(backend.executor, backend.device)
    after_graphs = torch.rand(3, device=backend.device)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(after_plain, after_graphs)  # the RNG is where it would be without cudagraphex
    failed = [w for w in caught if "failed" in str(w.message)]
    assert len(failed) == 1 and "CUDAGraph" in str(failed[0].message)
    (region,) = regions(jf, backend.executor)
    assert region.disabled_reason is not None and region.eager_calls["capture failed"] == 3
    if stream is not None:
        assert torch.cuda.current_stream() == stream
        torch.cuda.synchronize()


def test_capture_failure_protection_bites():
    torch.manual_seed(123)
    x = torch.randn(16)
    plain = thunder.jit(with_fragile_op, executors=[fragile, *thunder.get_default_executors()])
    expected = [plain(x) for _ in range(4)]
    with protection_off("restore_rng_after_capture"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, got = run_fragile(emulated, "cpu")
    assert not all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_strict_mode_raises_instead_of_falling_back(backend):
    strict = CUDAGraphExecutor(f"cudagraphex_strict_{backend.name}", backend=backend.name, strict=True)
    jf = thunder.jit(with_fragile_op, executors=[strict, fragile, *thunder.get_default_executors()])
    x = torch.randn(16, device=backend.device)
    jf(x)
    with pytest.raises(StrictModeError, match="capturing region CUDAGraph"):
        jf(x)
