"""Contract point 3: in-place updates of inputs are visible and applied exactly once per call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cudagraphex.planning.static_inputs import InputKind
from tests.contract.scenarios import accumulate
from tests.helpers import conv_bn, emulated, jit, protection_off, regions, replays, twin


def test_input_written_in_place_and_returned_is_returned_as_itself(backend):
    """``s.mul_(0.5); return s`` returns the caller's tensor itself, as eager and Thunder do, with its autograd state."""

    def f(s):
        s.mul_(0.5)
        return s

    jf = jit(f, backend.executor)
    s = torch.randn(4, device=backend.device)
    x = torch.randn(4, device=backend.device, requires_grad=True)
    s0, x0 = s.clone(), x.detach().clone()
    for _ in range(4):
        assert jf(s) is s
        with torch.no_grad():
            assert jf(x) is x
    assert x.requires_grad
    torch.testing.assert_close((s, x.detach()), (s0 / 16, x0 / 16))
    assert replays(jf, backend.executor) >= 2


class _CountsInABuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(4))

    def forward(self, x):
        self.calls.add_(1)
        return self.calls * x  # saves the buffer for x's gradient


def test_write_into_a_saved_buffer_reaches_autograd(backend):
    """A replay writes the buffer a pending backward saved: autograd refuses that backward, as in eager (a graph's
    writes bump version counters as eager's in-place ops do)."""
    model = _CountsInABuffer().to(backend.device)
    jm = jit(model, backend.executor)
    for _ in range(4):
        first = jm(torch.ones(4, device=backend.device, requires_grad=True)).sum()
        jm(torch.ones(4, device=backend.device, requires_grad=True))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            first.backward()
    assert replays(jm, backend.executor) >= 2


def test_inplace_update_of_an_input_is_applied_once_per_call(backend):
    jf = jit(accumulate, backend.executor)
    buf = torch.zeros(4, device=backend.device)
    expected = torch.zeros(4, device=backend.device)
    for i in range(5):
        x = torch.full((4,), float(i + 1), device=backend.device)
        out = jf(buf, x)
        expected += x
        torch.testing.assert_close(buf, expected)
        torch.testing.assert_close(out, x * 2 + expected.sum())
    assert replays(jf, backend.executor) >= 3


def test_batchnorm_running_statistics(backend):
    model = conv_bn().to(backend.device).train()
    reference = twin(model)
    jm = jit(model, backend.executor)
    for _ in range(5):
        x = torch.randn(4, 3, 8, 8, device=backend.device)
        torch.testing.assert_close(jm(x), reference(x))
        for (name, b), r in zip(model.named_buffers(), reference.buffers(), strict=True):
            torch.testing.assert_close(b, r, msg=lambda m, name=name: f"{name}: {m}")
    assert replays(jm, backend.executor) >= 3


class KVDecoder(torch.nn.Module):
    """One-token decode steps that write keys and values into static caches with ``index_copy_``."""

    def __init__(self, dim=16, max_len=12):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.register_buffer("k_cache", torch.zeros(1, max_len, dim))
        self.register_buffer("v_cache", torch.zeros(1, max_len, dim))

    def forward(self, x, pos, mask):
        self.k_cache.index_copy_(1, pos, self.k(x))
        self.v_cache.index_copy_(1, pos, self.v(x))
        scores = (self.q(x) @ self.k_cache.transpose(1, 2)) / 4 + mask
        return scores.softmax(-1) @ self.v_cache


def test_decode_loop_with_a_kv_cache(backend):
    model = KVDecoder().to(backend.device)
    reference = twin(model)
    jm = jit(model, backend.executor)
    outs = []
    with torch.no_grad():
        for step in range(8):
            x = torch.randn(1, 1, 16, device=backend.device)
            pos = torch.tensor([step], device=backend.device)
            mask = torch.full((1, 1, 12), float("-inf"), device=backend.device)
            mask[..., : step + 1] = 0
            outs.append(jm(x, pos, mask))
            torch.testing.assert_close(outs[-1], reference(x, pos, mask))
            torch.testing.assert_close(model.k_cache, reference.k_cache)
    assert replays(jm, backend.executor) >= 5


def cache_passed_as_argument_stays_correct(ex) -> bool:
    def write(cache, pos, value):
        cache.index_copy_(0, pos, value * 2)
        return cache.sum(0) + 1

    jf = jit(write, ex)
    cache = torch.zeros(6, 3)
    expected = torch.zeros(6, 3)
    for step in range(6):
        value = torch.randn(1, 3)
        jf(cache, torch.tensor([step]), value)
        expected[step] = value[0] * 2
    return torch.equal(cache, expected)


def counter_is_applied_once(ex) -> bool:
    def bump(counter, x):
        counter.add_(1)
        return x + counter

    jf = jit(bump, ex)
    counter = torch.zeros(())
    for _ in range(4):
        jf(counter, torch.ones(2))
    return counter.item() == 4


def test_inplace_protection_bites():
    assert cache_passed_as_argument_stays_correct(emulated)
    assert counter_is_applied_once(emulated)
    with protection_off("mutated_inputs_stay_static", "copy_back_mutated_inputs"):
        assert not cache_passed_as_argument_stays_correct(emulated)
    with protection_off("undo_capture_side_effects"):
        assert not counter_is_applied_once(emulated)


def test_graphs_of_calls_between_a_forward_and_its_backward_leave_the_tensors_it_saved_usable(backend):
    """A capture records writes and makes none, and a replay bumps the version counters of the inputs its capture
    wrote, as eager's in-place ops do, and of no other: here calls under ``no_grad`` warm up, capture and replay
    between a forward and its backward, and the trace shows ``out.sub_`` as a possible write of ``p``, which that
    backward saved."""

    def f(x, w, p):
        v = F.linear(x, w, p)
        out = F.layer_norm(v, v.shape[-1:], p, p)
        out.sub_(out.detach())
        return out

    device = backend.device
    w = (torch.randn(6, 6, device=device) / 6**0.5).requires_grad_()
    p = (torch.randn(6, device=device) * 0.5).requires_grad_()
    x = torch.randn(3, 6, device=device, requires_grad=True)
    ref_x, ref_w, ref_p = (t.detach().clone().requires_grad_() for t in (x, w, p))
    jf = jit(f, backend.executor)
    out = jf(x, w, p)
    with torch.no_grad():
        for _ in range(3):  # a warm-up, a capture, a replay
            jf(torch.randn(3, 6, device=device), w, p)
    (inference,) = regions(jf, backend.executor, "computation")
    assert len(inference.instances) == 1 and inference.instances[0].replays >= 1
    grad = torch.randn_like(out)
    out.backward(grad)
    f(ref_x, ref_w, ref_p).backward(grad)
    torch.testing.assert_close((x.grad, w.grad, p.grad), (ref_x.grad, ref_w.grad, ref_p.grad))


def test_a_copy_back_moves_no_version_counter_of_an_input_its_capture_did_not_write(backend):
    """The trace shows ``v.sub_`` as a possible write of ``x``, so a graph that copies ``x`` in copies its buffer back
    after each replay; the values are the same, and the version counter that a pending backward checks stays."""

    def f(x, w):
        v = F.layer_norm(x, (6,), w, w)
        v.sub_(v.detach())
        return v * x  # saves x

    device = backend.device
    w = torch.randn(6, device=device, requires_grad=True)
    jf = jit(f, backend.executor)
    kept = []
    with torch.no_grad():
        for _ in range(6):  # every call at a new address: x misses until it is demoted to a copied input
            kept.append(torch.randn(3, 6, device=device))
            jf(kept[-1], w)
    (inference,) = regions(jf, backend.executor, "computation")
    assert inference.kinds[inference.info.input_names.index("x")] is InputKind.COPIED
    x = torch.randn(3, 6, device=device)
    ref_w = w.detach().clone().requires_grad_()
    out = jf(x, w)
    with torch.no_grad():
        torch.testing.assert_close(jf(x, w), f(x, w))  # a replay whose copy-back writes x
    grad = torch.randn_like(out)
    out.backward(grad)
    f(x, ref_w).backward(grad)
    torch.testing.assert_close(w.grad, ref_w.grad)


def test_tensor_copy_writes_its_destination_not_its_source(backend):
    """``Tensor.copy_(dst, src)`` takes its arguments the other way round from Thunder's ``prims.copy_(src, dst)``."""

    def f(dst, src):
        dst.copy_(src[0] * 2)
        return src.sum() + 1

    jf = jit(f, backend.executor)
    dst = torch.zeros(3, device=backend.device)
    for src in [torch.randn(2, 3, device=backend.device) for _ in range(4)]:  # kept alive: a new address every call
        jf(dst, src)
        torch.testing.assert_close(dst, src[0] * 2)
    (region,) = regions(jf, backend.executor)
    kinds = dict(zip(region.info.input_names, region.kinds, strict=True))
    # src, the caller's tensor, moved since the warm-up: copied, by this graph and any later one
    assert kinds["src"] is InputKind.COPIED and kinds["dst"] is InputKind.MUTATED
    (instance,) = region.instances
    assert [region.info.input_names[c.index] for c in instance.copied_inputs] == ["src"]
    assert region.eager_calls == {"warm-up": 1}


def test_written_input_that_moves_is_demoted_and_copied_back(backend):
    jf = jit(accumulate, backend.executor)
    for i in range(6):
        buf = torch.full((4,), float(i), device=backend.device)  # a new buffer every call
        x = torch.ones(4, device=backend.device)
        out = jf(buf, x)
        torch.testing.assert_close(buf, torch.full((4,), float(i + 1), device=backend.device))
        torch.testing.assert_close(out, x * 2 + buf.sum())
