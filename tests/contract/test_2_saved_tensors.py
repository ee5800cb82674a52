"""Contract point 2: tensors saved for backward are never overwritten before their backward."""

from __future__ import annotations

import pytest
import thunder
import torch

from benchmarks.models import mlp
from cudagraphex.runtime.handout import sharing_one_version
from cudagraphex.runtime.liveness import Liveness
from tests.contract.scenarios import Keeps
from tests.helpers import assert_grads_close, emulated, jit, protection_off, regions, replays, twin


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
    ex = Keeps(
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
