"""Contract point 7: a failed capture leaves the process healthy."""

from __future__ import annotations

import gc
import warnings

import pytest
import thunder
import torch

from cudagraphex import CUDAGraphExecutor, StrictModeError
from cudagraphex.capture import SharedPool
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


def fragile_then_more(x):
    a = fragile_triple(x.sin()) * 2
    total = a.sum().item()  # splits the trace: the region after it captures into the same pool
    return x.cos() * 3 + a, total


def test_a_region_captures_after_the_first_capture_of_its_pool_failed(backend):
    """The failed capture was the pool's only graph. On CUDA the caching allocator keeps that pool until its memory
    is freed and refuses a capture into it, so the next region captures into a new pool."""
    jf = thunder.jit(fragile_then_more, executors=[backend.executor, fragile, *thunder.get_default_executors()])
    x = torch.randn(16, device=backend.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            out, total = jf(x)
            torch.testing.assert_close(out, x.cos() * 3 + x.sin() * 6)
            assert total == pytest.approx(float((x.sin() * 6).sum()), rel=1e-5)
    fragile_region, after = regions(jf, backend.executor)
    failed = [str(w.message) for w in caught if "failed" in str(w.message)]
    assert len(failed) == 1 and f"capturing region {fragile_region.name} failed" in failed[0], failed
    assert fragile_region.disabled_reason is not None
    assert after.disabled_reason is None and len(after.instances) == 1


def test_a_shared_pool_takes_a_new_id_while_no_graph_captured_into_it_is_alive():
    ids = iter(range(100))
    pool = SharedPool(lambda: next(ids))
    first = pool.for_capture()
    assert pool.for_capture() != first  # the capture into ``first`` failed: no graph holds it

    class Graph:
        pass

    graph, held = Graph(), pool.for_capture()
    pool.captured(graph, held)
    assert pool.for_capture() == held
    del graph
    gc.collect()
    renewed = pool.for_capture()
    assert renewed != held
    late = Graph()
    pool.captured(late, held)  # captured into the old id, which it holds alone: not the new one's holder
    assert pool.for_capture() != renewed
