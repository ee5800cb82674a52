"""The correctness contract: with cudagraphex a program computes exactly what it computes without it.

One section per point of the contract. Each point has user-level scenarios, run on the CPU replay backend and on real
CUDA graphs, and one test that switches the point's protection off and shows the program going wrong.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings

import pytest
import thunder
import torch
from thunder.extend import OperatorExecutor, register_executor

from benchmarks.models import GPT, GPTConfig, conv_bn, mlp
from cudagraphex import CUDAGraphExecutor, StrictModeError, explain
from cudagraphex.capture import is_capturing
from cudagraphex.planning.static_inputs import InputKind
from cudagraphex.runtime.handout import sharing_one_version
from cudagraphex.runtime.liveness import Liveness
from tests.helpers import (
    assert_grads_close,
    emulated,
    errors_in_threads,
    jit,
    num_graphs,
    protection_off,
    regions,
    replays,
    twin,
)

# -- 1. outputs the caller holds are never overwritten --------------------------------------------------------------


def test_inference_loop_keeps_every_output(backend):
    model = mlp(4, 32).to(backend.device).eval()
    jm = jit(model, backend.executor)
    inputs = [torch.randn(8, 32, device=backend.device) for _ in range(6)]
    with torch.no_grad():
        outputs = [jm(x) for x in inputs]
        views = [out[0] for out in outputs]
        for x, out, view in zip(inputs, outputs, views, strict=True):
            torch.testing.assert_close(out, model(x))
            torch.testing.assert_close(view, model(x)[0])
    assert replays(jm, backend.executor) >= 3


class _Keeps(CUDAGraphExecutor):
    """Keeps the symbols whose name contains ``kept`` out of graphs."""

    def __init__(self, name: str, kept: str, **kwargs):
        super().__init__(name, **kwargs)
        self.kept = kept

    def can_fuse(self, bsym):
        return self.kept not in bsym.sym.name and super().can_fuse(bsym)


def passed_on_as_itself(x):
    return (x * 2 + 1).contiguous()  # contiguous of a contiguous tensor returns that tensor


def test_output_passed_on_as_itself_by_an_eager_op_is_not_the_graphs_own(backend):
    """The caller changes what it receives in place (metadata too); the graph's next output must not change."""
    ex = _Keeps(f"cudagraphex_eager_contiguous_{backend.name}", "contiguous", backend=backend.executor.options.backend)
    jf = jit(passed_on_as_itself, ex)
    for _ in range(4):
        x = torch.randn(4, 3, device=backend.device)
        out = jf(x)
        torch.testing.assert_close(out, passed_on_as_itself(x))
        out.t_()
        del out
    assert replays(jf, ex) >= 2


def read_by_an_eager_op_and_passed_on(x):
    y = x * 2 + 1
    v = torch.sin(y)  # eager: reads the first graph's output y
    return y.contiguous(), v * 2 + 1  # one graph; run eagerly, contiguous returns y itself


def test_graph_output_passed_on_by_a_region_running_eagerly_is_not_the_graphs_own(backend):
    ex = _Keeps(f"cudagraphex_eager_sin_{backend.name}", "sin", backend=backend.executor.options.backend)
    jf = jit(read_by_an_eager_op_and_passed_on, ex)
    for i in range(5):
        x = torch.randn(4, 3, device=backend.device)
        y, w = jf(x)
        for got, expected in zip((y, w), read_by_an_eager_op_and_passed_on(x), strict=True):
            torch.testing.assert_close(got, expected)
        if i == 1:
            # Kept: the first graph captures another instance, which the second region receives at a new address
            # and runs eagerly with once.
            kept = y
        else:
            y.t_()
    assert kept.shape == (4, 3)
    assert replays(jf, ex) >= 2


_declares_more = OperatorExecutor("cudagraphex_test_declares_more")
register_executor(_declares_more)
# Like flash attention's forward, whose cum_seq_q/cum_seq_k are declared tensors and are None outside varlen.
doubled_and_none = _declares_more.register_operator(
    "doubled_and_none",
    meta=lambda x: (thunder.TensorProxy(like=x), thunder.TensorProxy(like=x)),
    fn=lambda x: (x * 2, None),
)


plus_one = _declares_more.register_operator(
    "plus_one", meta=lambda x, maybe: thunder.TensorProxy(like=x), fn=lambda x, maybe: x + 1
)


@pytest.mark.parametrize("produced_in_a_graph", [True, False])
@pytest.mark.parametrize("keep_outputs", [False, True])
def test_tensor_that_is_none_at_run_time_passes_through_graphs(backend, keep_outputs, produced_in_a_graph):
    def f(x):
        doubled, nothing = doubled_and_none(x.sin())
        cosine = doubled.cos()
        host = cosine.sum().item()  # a graph break: the second graph reads the first one's None output
        return (plus_one(cosine, nothing) * 2).exp() * host, nothing

    def expected(x):
        cosine = (x.sin() * 2).cos()
        return ((cosine + 1) * 2).exp() * cosine.sum()

    ex = backend.executor
    if not produced_in_a_graph:  # the second graph then copies the None in, after an eager warm-up
        ex = _Keeps(f"cudagraphex_no_doubled_{backend.name}", "doubled_and_none", backend=backend.name)
    jf = thunder.jit(f, executors=[ex, _declares_more, *thunder.get_default_executors()])
    kept = []
    for _ in range(4):
        x = torch.randn(8, device=backend.device)
        out, nothing = jf(x)
        torch.testing.assert_close(out, expected(x))
        assert nothing is None
        if keep_outputs:
            kept.append((x, out))
    for x, out in kept:
        torch.testing.assert_close(out, expected(x))
    first, second = regions(jf, ex)
    assert ("nothing" in first.info.output_names) is produced_in_a_graph and "nothing" in second.info.input_names
    assert first.disabled_reason is None and second.disabled_reason is None
    assert replays(jf, ex) >= 4


def held_outputs_survive(ex) -> bool:
    model = mlp(2, 16).eval()
    jm = jit(model, ex)
    x1, x2, x3 = (torch.randn(4, 16) for _ in range(3))
    with torch.no_grad():
        jm(x1)  # warm-up
        y1 = jm(x1)  # captured and replayed
        y2 = jm(x2)
        y3 = jm(x3)
        return all(torch.equal(y, model(x)) for y, x in ((y1, x1), (y2, x2), (y3, x3)))


def test_output_protection_bites():
    assert held_outputs_survive(emulated)
    with protection_off("output_liveness"):
        assert not held_outputs_survive(emulated)


# -- 2. tensors saved for backward are never overwritten before their backward ---------------------------------------


@pytest.mark.parametrize("order", ["same", "reverse"])
def test_two_forwards_then_two_backwards(backend, order):
    model = mlp(3, 16).to(backend.device)
    reference = twin(model)
    jm = jit(model, backend.executor)
    for _ in range(3):
        a, b = (torch.randn(4, 16, device=backend.device) for _ in range(2))
        la, lb = jm(a).square().mean(), jm(b).square().mean()
        ra, rb = reference(a).square().mean(), reference(b).square().mean()
        for loss in (la, lb) if order == "same" else (lb, la):
            loss.backward()
        ra.backward()
        rb.backward()
        assert_grads_close(model, reference)
        model.zero_grad()
        reference.zero_grad()


def test_retain_graph_and_a_second_backward(backend):
    model = mlp(3, 16).to(backend.device)
    reference = twin(model)
    jm = jit(model, backend.executor)
    for _ in range(3):
        x = torch.randn(4, 16, device=backend.device)
        loss, ref = jm(x).square().mean(), reference(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        ref.backward(retain_graph=True)
        ref.backward()
        assert_grads_close(model, reference)
        model.zero_grad()
        reference.zero_grad()


def test_siamese_network(backend):
    encoder = mlp(3, 16).to(backend.device)
    reference = twin(encoder)
    je = jit(encoder, backend.executor)
    for _ in range(4):
        a, b = (torch.randn(8, 16, device=backend.device) for _ in range(2))
        loss = torch.nn.functional.cosine_similarity(je(a), je(b)).mean()
        ref = torch.nn.functional.cosine_similarity(reference(a), reference(b)).mean()
        torch.testing.assert_close(loss, ref)
        loss.backward()
        ref.backward()
        assert_grads_close(encoder, reference)
        encoder.zero_grad()
        reference.zero_grad()


def two_forward_grads_match(ex) -> bool:
    model = mlp(2, 16)
    reference = twin(model)
    jm = jit(model, ex)
    ok = True
    for _ in range(3):
        a, b = torch.randn(4, 16), torch.randn(4, 16)
        try:
            (jm(a).square().mean() + jm(b).square().mean()).backward()
        except RuntimeError as e:  # the emulation bumps version counters, so autograd may notice the overwrite
            assert "modified by an inplace operation" in str(e)
            return False
        (reference(a).square().mean() + reference(b).square().mean()).backward()
        ok &= all(torch.allclose(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters()))
        model.zero_grad()
        reference.zero_grad()
    return ok


def test_saved_tensor_protection_bites():
    assert two_forward_grads_match(emulated)
    with protection_off("output_liveness"):
        assert not two_forward_grads_match(emulated)


def test_saved_tensors_are_handed_out_as_their_anchors():
    jm = jit(mlp(2, 16), emulated)
    x = torch.randn(4, 16)  # one input: a new one on each call could move after the capture read it in place
    for _ in range(3):
        jm(x).square().mean().backward()
    (forward,) = regions(jm, emulated, "forward")
    (inst,) = forward.instances
    names = forward.info.output_names
    handed_as_anchor = {names[i] for i, t in enumerate(inst.handout.template) if t is not None}
    assert handed_as_anchor and handed_as_anchor.isdisjoint(forward.info.returned)
    assert {names[i] for i, _ in inst.handout.unshared + inst.handout.detached} == set(forward.info.returned)


def scatter_rows(x, index):
    return torch.zeros(6, 3, device=x.device).index_copy(0, index, x) * 2


@pytest.mark.parametrize("position", ["first", "last"])
def test_input_a_backward_reads_only_for_its_shape_is_not_saved(backend, position):
    """The gradient of index_copy's source is ``expand_as(g, source)``, which reads only the source's shape: written in
    place after the forward, the source does not fail the backward, as in eager and in Thunder without graphs."""
    jf = jit(scatter_rows, backend.executor, position)
    index = torch.tensor([0, 2, 5], device=backend.device)
    for _ in range(4):
        x = torch.randn(3, 3, device=backend.device, requires_grad=True)
        out = jf(x, index)
        with torch.no_grad():
            x.zero_()
        out.sum().backward()
        torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    assert replays(jf, backend.executor) >= 2


@pytest.mark.parametrize("kept", [False, True], ids=["released", "kept_across_calls"])
def test_outputs_sharing_a_storage_share_a_version_counter(backend, kept):
    """An in-place write to one returned output reaches autograd through another on its storage, as in eager, whether
    the outputs are aliases of the graph's or (kept across calls) copies."""

    def f(x):
        y = x * 2 + 1
        return y, y.view(-1)

    jf = jit(f, backend.executor)
    x = torch.randn(4, 4, device=backend.device)
    w = torch.ones(16, device=backend.device, requires_grad=True)
    held = []
    for _ in range(5):
        y, flat = jf(x)
        loss = (flat * w).sum()  # saves flat for w's gradient
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        if kept:
            held.append((y, flat))
        del y, flat, loss  # unless kept, released before the next call, which then replays and aliases again
    (region,) = regions(jf, backend.executor)
    inst = region.instances[-1]
    assert (len(inst.handout.storage_copies), len(inst.handout.detached)) == ((1, 0) if kept else (0, 2))
    assert not inst.handout.unshared and inst.replays >= 2


class _ReturnsAViewOfItsWeight(torch.nn.Module):
    """Returns ``self.weight.view(view_arg)`` beside a computed output: a region output that aliases a parameter."""

    def __init__(self, view_arg):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.view_arg = view_arg

    def forward(self, x):
        return x * 2 + 1, self.weight.view(self.view_arg)


def test_output_that_views_a_parameter_shares_its_version_counter(backend):
    """As in eager: an in-place update of the parameter reaches autograd through the returned view."""
    model = _ReturnsAViewOfItsWeight(-1).to(backend.device)
    jm = jit(model, backend.executor)
    x = torch.randn(4, 4, device=backend.device)
    v = torch.ones(16, device=backend.device, requires_grad=True)
    for _ in range(4):
        with torch.no_grad():
            y, weight_view = jm(x)
        loss = (weight_view * v).sum()  # saves weight_view for v's gradient
        with torch.no_grad():
            model.weight.mul_(0.5)
        # Eager and Thunder say "a view was created in no_grad mode and its base ... has been modified inplace"; the
        # region's eager warm-up call leads to "modified by an inplace operation". Either way autograd refuses.
        with pytest.raises(RuntimeError, match="inplace"):
            loss.backward()
        with torch.no_grad():
            assert torch.equal(weight_view, model.weight.view(-1))  # the parameter's memory, after the update
        del y, weight_view, loss
    (region,) = regions(jm, backend.executor)
    (inst,) = region.instances
    assert len(inst.handout.aliased) == 1 and inst.replays >= 2


def test_output_that_views_a_parameter_as_another_dtype_keeps_that_dtype(backend):
    model = _ReturnsAViewOfItsWeight(torch.int32).to(backend.device)
    jm = jit(model, backend.executor)
    x = torch.randn(4, 4, device=backend.device)
    for _ in range(4):
        with torch.no_grad():
            _, bits = jm(x)
        assert bits.dtype == torch.int32 and torch.equal(bits, model.weight.detach().view(torch.int32))
        del bits
    (region,) = regions(jm, backend.executor)
    (inst,) = region.instances
    assert len(inst.handout.aliased) == 1 and inst.replays >= 2


class _ReturnsItsWeightTransposed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return torch.tanh(x @ self.w), self.w.t()


def test_output_that_views_a_parameter_under_no_grad_is_a_view_of_it(backend):
    """As in eager: the view requires grad, its base is the parameter, and autograd refuses an in-place write into it
    under grad mode (a view created in no_grad mode)."""
    model = _ReturnsItsWeightTransposed().to(backend.device)
    jm = jit(model, backend.executor)
    for _ in range(4):
        with torch.no_grad():
            y, wt = jm(torch.randn(2, 8, device=backend.device))
        assert wt.requires_grad and wt._base is model.w
        with pytest.raises(RuntimeError, match="no_grad mode"):
            wt.add_(1)
        del y, wt
    assert replays(jm, backend.executor) >= 2


def test_output_that_detaches_an_input_is_a_detached_alias_of_it(backend):
    """``detach`` of a tensor an op outside graphs produced: as in eager, the caller may write into the result (a view
    would be refused as an output of Thunder's autograd function), and it shares memory with that tensor."""
    ex = _Keeps(
        f"cudagraphex_eager_add_{backend.name}", "add", backend=backend.executor.options.backend, min_region_size=1
    )
    jf = jit(lambda x, k: ((x.square() + k).detach(),), ex)
    for _ in range(4):
        x = torch.randn(4, 2, device=backend.device, requires_grad=True)
        (out,) = jf(x, torch.tensor(2.0, device=backend.device))
        assert not out._is_view()
        out.add_(1)
        torch.testing.assert_close(out, x.detach().square() + 3)
        del out
    assert replays(jf, ex) >= 2


def test_output_that_views_a_new_input_sees_later_writes_into_it(backend):
    """The graph copies each new input into its buffer; an output that views the input is still a view of the caller's
    tensor, as in eager, not of that buffer."""
    jf = jit(lambda x: ((x * 2).sin(), x[0]), backend.executor)
    for _ in range(4):
        x = torch.randn(3, 4, device=backend.device)
        y, row = jf(x)
        x[0].fill_(7.0)
        assert row._base is x and torch.equal(row, torch.full((4,), 7.0, device=backend.device))
        del y, row
    assert replays(jf, backend.executor) >= 2


def test_copies_of_outputs_of_several_dtypes_on_one_storage():
    """The copy path rebuilds members of any dtype, even one whose item size does not divide the storage's size (a
    float64 view of two of three float32s; Thunder 0.2.6 cannot trace one, so the helper is called directly)."""
    storage = torch.arange(3, dtype=torch.float32).untyped_storage()
    members = [(0, torch.empty(3), ((3,), (1,), 0)), (1, torch.empty(1, dtype=torch.float64), ((1,), (1,), 0))]
    rebuilt = dict(sharing_one_version(storage, members))
    assert torch.equal(rebuilt[0], torch.arange(3.0)) and rebuilt[1].dtype == torch.float64
    assert rebuilt[1].data_ptr() == rebuilt[0].data_ptr()
    version = rebuilt[1]._version
    rebuilt[0].add_(1)
    assert rebuilt[1]._version > version  # one version counter


def test_one_tensor_returned_at_several_positions_is_handed_out_as_one(backend):
    def f(x):
        v = torch.maximum(x.detach(), x * 2)
        w = v[:, :]  # Thunder returns v itself here
        return w, v, w

    x = torch.randn(4, 6, device=backend.device, requires_grad=True)
    jf, reference = jit(f, backend.executor), thunder.jit(f)
    for _ in range(4):
        got, want = jf(x), reference(x)
        # The same tensor at the same positions: autograd sums the cotangents of one tensor in one order.
        assert [[g is h for h in got] for g in got] == [[w is v for v in want] for w in want]
        torch.autograd.grad(got, x, [torch.ones_like(t) for t in got])
    assert replays(jf, backend.executor) >= 2


def test_an_output_alone_on_its_storage_is_handed_out_as_a_new_alias(backend):
    """Its own tensor: metadata the caller sets on it never reaches the graph's."""
    jf = jit(lambda x: x * 2 + 1, backend.executor)
    x = torch.randn(4, 4, device=backend.device)
    for _ in range(4):  # warm-up, capture, replays
        out = jf(x)
        torch.testing.assert_close(out, x * 2 + 1)
        out.requires_grad_()
        del out  # released before the next call, so that it replays and hands out an alias again
    (region,) = regions(jf, backend.executor)
    (inst,) = region.instances
    ((_, anchor),) = inst.handout.unshared
    out = jf(x)
    assert out is not anchor and out.data_ptr() == anchor.data_ptr() and not out.requires_grad
    assert not anchor.requires_grad and not inst.handout.detached and inst.replays >= 3


def test_saved_anchor_liveness_bites(monkeypatch):
    """Storage use counts do not see a saved tensor handed out as its anchor: its own reference counts must."""
    assert two_forward_grads_match(emulated)
    monkeypatch.setattr(Liveness, "direct_unreferenced", lambda self: True)
    assert not two_forward_grads_match(emulated)


def test_saved_tensors_kept_only_by_an_autograd_node_survive(backend):
    """A tensor that only C++ holds (an autograd node that saved it) still counts as referenced."""
    jm = jit(mlp(2, 16).to(backend.device), backend.executor)
    w = torch.ones((), device=backend.device, requires_grad=True)
    stash, kept = [], []
    for _ in range(4):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: stash.append(t), lambda _: None):
            jm(torch.randn(4, 16, device=backend.device))
        with torch.enable_grad():
            kept += [(w * t, t.clone()) for t in stash]  # MulBackward saves t for the gradient of w
        stash.clear()
    assert len(kept) > 4
    for product, snapshot in kept:
        (grad,) = torch.autograd.grad(product, w, torch.ones_like(product))
        torch.testing.assert_close(grad, snapshot.sum())


def test_saved_tensors_kept_by_a_pack_hook_survive(backend):
    """A saved-tensor hook keeps the Python object, whose reference count the liveness check reads."""
    model = mlp(3, 16).to(backend.device)
    reference = twin(model)
    jm = jit(model, backend.executor)
    kept = []

    def pack(t):
        kept.append(t)
        return len(kept) - 1

    for _ in range(3):
        kept.clear()
        a, b = (torch.randn(4, 16, device=backend.device) for _ in range(2))
        with torch.autograd.graph.saved_tensors_hooks(pack, kept.__getitem__):
            loss = jm(a).square().mean() + jm(b).square().mean()
        loss.backward()
        (reference(a).square().mean() + reference(b).square().mean()).backward()
        assert_grads_close(model, reference)
        model.zero_grad()
        reference.zero_grad()


# -- 3. in-place updates of inputs are visible and applied exactly once per call -------------------------------------


def accumulate(buf, x):
    buf.add_(x)
    return x * 2 + buf.sum()


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
    assert kinds["src"] is InputKind.CALLER and kinds["dst"] is InputKind.MUTATED
    (instance,) = region.instances
    assert [region.info.input_names[c.index] for c in instance.copied_inputs] == [
        "src"
    ]  # moved since the warm-up: copied
    assert region.eager_calls == {"warm-up": 1}


def test_written_input_that_moves_is_demoted_and_copied_back(backend):
    jf = jit(accumulate, backend.executor)
    for i in range(6):
        buf = torch.full((4,), float(i), device=backend.device)  # a new buffer every call
        x = torch.ones(4, device=backend.device)
        out = jf(buf, x)
        torch.testing.assert_close(buf, torch.full((4,), float(i + 1), device=backend.device))
        torch.testing.assert_close(out, x * 2 + buf.sum())


# -- 4. random ops draw fresh values on every replay; forward and backward agree ---------------------------------------


def test_dropout_is_fresh_and_forward_backward_agree(backend):
    def f(x):
        return torch.nn.functional.dropout(x * 1.0, p=0.5, training=True)

    jf = jit(f, backend.executor)
    masks = []
    for _ in range(5):
        x = torch.ones(64, 64, device=backend.device, requires_grad=True)
        y = jf(x)
        y.sum().backward()
        kept = y.detach() != 0
        torch.testing.assert_close(x.grad, kept.float() * 2)  # the backward used the forward's mask
        masks.append(kept)
    assert all(not torch.equal(masks[i], masks[i + 1]) for i in range(len(masks) - 1))
    assert replays(jf, backend.executor) >= 3


def random_draws(ex, seed=0):
    def f(x):
        noise = torch.randn_like(x)
        return x * 2 + noise, torch.multinomial(x.abs() + 0.1, 2)

    jf = thunder.jit(f) if ex is None else jit(f, ex)
    torch.manual_seed(seed)
    x = torch.rand(4, 8)
    return [jf(x) for _ in range(5)]


def test_random_draws_match_thunder_without_graphs():
    plain, graphed = random_draws(None), random_draws(emulated)
    for (a, ia), (b, ib) in zip(plain, graphed, strict=True):
        assert torch.equal(a, b) and torch.equal(ia, ib)
    assert not torch.equal(graphed[2][0], graphed[3][0])  # replays draw fresh values


def test_rng_protection_bites():
    plain = random_draws(None)
    with protection_off("restore_rng_after_capture"):
        graphed = random_draws(emulated)
    assert not all(torch.equal(a, b) for (a, _), (b, _) in zip(plain, graphed, strict=True))


def test_multinomial_warmup_uses_real_values(backend):
    """Thunder's own test: static buffers must hold the real inputs before warm-up and capture."""

    def f(weights):
        return torch.multinomial(weights, 2)

    jf = jit(f, backend.executor, cache="no caching") if False else jit(f, backend.executor)
    weights = torch.tensor([0.0, 10.0, 3.0, 0.0], device=backend.device)
    for _ in range(4):
        out = jf(weights)
        assert set(out.tolist()) <= {1, 2}


# -- 5. per-call host values give the right result on every call --------------------------------------------------------


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


@pytest.mark.cuda
def test_cpu_scalar_tensor_changing_every_call():
    def f(x, scale):
        return (x * scale).cos() + scale

    jf = jit(f, BACKEND_CUDA().executor)
    for i in range(5):
        x = torch.randn(8, device="cuda")
        scale = torch.tensor(float(i) + 0.5)  # a CPU scalar tensor
        torch.testing.assert_close(jf(x, scale), f(x, scale))


def BACKEND_CUDA():
    from tests.helpers import BACKENDS

    return BACKENDS["cuda"]


# -- 6. new shapes, dtypes and strides get their own graph, bounded in number -------------------------------------------


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


# -- 7. a failed capture leaves the process healthy -----------------------------------------------------------------------

_fragile = OperatorExecutor("cudagraphex_test_fragile")
register_executor(_fragile)


def _fails_under_capture(x):
    if is_capturing():
        if x.is_cuda:
            torch.cuda.synchronize()  # not permitted while the stream captures
        raise torch.OutOfMemoryError("simulated out of memory during capture")
    return x * 3


fragile_triple = _fragile.register_operator("fragile_triple", like=thunder.torch.neg, fn=_fails_under_capture)


def with_fragile_op(x):
    return fragile_triple(torch.rand_like(x) + x.sin()) * 2 + torch.rand_like(x)


def run_fragile(ex, device):
    torch.manual_seed(123)
    jf = thunder.jit(with_fragile_op, executors=[ex, _fragile, *thunder.get_default_executors()])
    x = torch.randn(16, device=device)
    return jf, [jf(x) for _ in range(4)]


def test_failed_capture_falls_back_once_and_keeps_rng(backend):
    torch.manual_seed(123)
    x = torch.randn(16, device=backend.device)
    plain = thunder.jit(with_fragile_op, executors=[_fragile, *thunder.get_default_executors()])
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
    plain = thunder.jit(with_fragile_op, executors=[_fragile, *thunder.get_default_executors()])
    expected = [plain(x) for _ in range(4)]
    with protection_off("restore_rng_after_capture"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, got = run_fragile(emulated, "cpu")
    assert not all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_strict_mode_raises_instead_of_falling_back(backend):
    strict = CUDAGraphExecutor(f"cudagraphex_strict_{backend.name}", backend=backend.name, strict=True)
    jf = thunder.jit(with_fragile_op, executors=[strict, _fragile, *thunder.get_default_executors()])
    x = torch.randn(16, device=backend.device)
    jf(x)
    with pytest.raises(StrictModeError, match="capturing region CUDAGraph"):
        jf(x)


# -- 8. bad input gets a clear error; CPU programs are left alone; mixed devices split -----------------------------------


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

    cuda = BACKEND_CUDA().executor
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


# -- 9. threads ---------------------------------------------------------------------------------------------------------


def test_two_threads_each_with_its_own_function(backend):
    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        model = mlp(4, 32).to(backend.device).eval()
        jm = jit(model, backend.executor)
        with torch.no_grad():
            for _ in range(20):
                x = torch.randn(8, 32, generator=g).to(backend.device)
                out = jm(x)
                assert torch.allclose(out, model(x), atol=1e-5), "wrong result"

    assert errors_in_threads(worker) == []


@pytest.mark.cuda
def test_capture_does_not_break_another_threads_kernels():
    stop = threading.Event()
    errors = []

    def busy():
        a = torch.randn(256, 256, device="cuda")
        expected = (a @ a).sum().item()
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    b = a @ a
                    stream.synchronize()  # the thread's own stream: a device-wide sync would end any capture
                    if not torch.isclose(b.sum(), torch.tensor(expected, device="cuda"), rtol=1e-4):
                        errors.append("wrong result")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        cuda = BACKEND_CUDA().executor
        for width in (32, 48, 64, 80):
            model = mlp(3, width).cuda().eval()
            jm = jit(model, cuda)
            with torch.no_grad():
                for _ in range(4):
                    x = torch.randn(8, width, device="cuda")
                    torch.testing.assert_close(jm(x), model(x))
    finally:
        stop.set()
        thread.join()
    assert errors == []


_slow = OperatorExecutor("cudagraphex_test_slow")
register_executor(_slow)


def _slow_under_capture(x):
    if is_capturing():
        time.sleep(0.4)  # keeps this thread's capture open while the other thread runs
    return x + 1


slow_increment = _slow.register_operator("slow_increment", like=thunder.torch.neg, fn=_slow_under_capture)


def capture_in_one_thread_breaks_the_other(ex) -> bool:
    """Thread A captures a slow region while thread B runs, eagerly, an op that fails under capture."""

    def a_fn(x):
        return slow_increment(x.sin() * 2) * 3

    def b_fn(x):
        return fragile_triple(x.cos() + 1)

    ja = thunder.jit(a_fn, executors=[ex, _slow, *thunder.get_default_executors()])
    jb = thunder.jit(b_fn, executors=[_fragile, *thunder.get_default_executors()])
    x = torch.randn(8)
    ja(x)  # warm-up: the next call captures
    jb(x)
    errors, started = [], threading.Event()

    def b_loop():
        started.set()
        deadline = time.perf_counter() + 0.6
        while time.perf_counter() < deadline:
            try:
                jb(x)
            except torch.OutOfMemoryError as e:
                errors.append(e)
                return

    thread = threading.Thread(target=b_loop)
    thread.start()
    started.wait()
    ja(x)
    thread.join()
    return bool(errors)


def test_thread_local_capture_bites(monkeypatch):
    """The replay backend's analogue of capture_error_mode="thread_local": only the capturing thread is capturing."""
    import types

    import cudagraphex.capture

    assert not capture_in_one_thread_breaks_the_other(emulated)
    monkeypatch.setattr(cudagraphex.capture, "_capturing", types.SimpleNamespace(active=False))  # one for all threads
    assert capture_in_one_thread_breaks_the_other(emulated)


# -- the randomized check ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_randomized_against_eager(backend, seed):
    """Interleaves new shapes, held outputs, out-of-order backwards and in-place inputs, and compares with eager."""
    rng = torch.Generator().manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)).to(backend.device)
    reference = twin(model)
    jm = jit(model, backend.executor)
    jacc = jit(accumulate, backend.executor)
    buf, ref_buf = torch.zeros(4, device=backend.device), torch.zeros(4, device=backend.device)
    held, pending = [], []
    steps = 40 if backend.name == "cuda" else 16
    for _ in range(steps):
        action = int(torch.randint(0, 5, (), generator=rng))
        batch, length = (
            int(torch.randint(1, 3, (), generator=rng)),
            int(torch.randint(8, 17, (), generator=rng)) // 8 * 8,
        )
        idx = torch.randint(0, 64, (batch, length), generator=rng).to(backend.device)
        if action == 0:  # inference, output kept
            with torch.no_grad():
                out = jm(idx)
                torch.testing.assert_close(out, reference(idx))
                held.append((out, out.clone()))
        elif action in (1, 2):  # a forward whose backward runs later, maybe out of order
            pending.append((jm(idx).square().mean(), reference(idx).square().mean()))
            if len(pending) > 2 or action == 2:
                loss, ref = pending.pop(int(torch.randint(0, len(pending), (), generator=rng)))
                torch.testing.assert_close(loss, ref)
                loss.backward()
                ref.backward()
                assert_grads_close(model, reference, atol=1e-5, rtol=1e-4)
        elif action == 3:
            x = torch.randn(4, generator=rng).to(backend.device)
            torch.testing.assert_close(jacc(buf, x), accumulate(ref_buf, x))
            torch.testing.assert_close(buf, ref_buf)
        else:
            model.zero_grad()
            reference.zero_grad()
        for out, snapshot in held:
            assert torch.equal(out, snapshot)
    for loss, ref in pending:
        loss.backward()
        ref.backward()
    assert_grads_close(model, reference, atol=1e-5, rtol=1e-4)


def test_info_logs_name_captures_and_fallbacks(caplog):
    with caplog.at_level(logging.INFO, logger="cudagraphex"):
        assert held_outputs_survive(emulated)
    messages = [r.getMessage() for r in caplog.records if r.name == "cudagraphex"]
    assert any("captured graph 1" in m for m in messages)
    assert any("returned as a copy from now on" in m for m in messages)
