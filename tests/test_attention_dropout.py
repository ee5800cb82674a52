"""Attention dropout under CUDA graphs, through every phase order a training loop produces (contract point 4).

sdpa's memory-efficient kernel returns its dropout RNG state (philox seed and offset) in host memory when it runs
eagerly and in device memory when it is captured, and its backward reads that state through a host pointer when it
runs eagerly and through a device pointer when it is captured. A forward replayed from a graph and a backward run
eagerly (a warm-up, a fallback) must still agree, and neither may read the other's memory.

The probe: with q = k = 0 every attention weight is 1/T before dropout, and with v the identity the output is the
dropped attention matrix itself, so the output shows the forward's mask, and dv = out^T @ grad_out holds exactly when
the backward used the same mask.
"""

from __future__ import annotations

import copy

import pytest
import thunder
import torch
import torch.nn.functional as F

from cudagraphex import cudagraphex, explain
from tests.helpers import assert_grads_close

pytestmark = pytest.mark.cuda

P = 0.5


class Attention(torch.nn.Module):
    """sdpa with dropout while training; the multiplication keeps the forward and the backward at two ops each."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=P if self.training else 0.0) * 2.0


def probe(t: int = 16, batch: int = 2, heads: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.zeros(batch, heads, t, t, device="cuda", requires_grad=True)
    k = torch.zeros(batch, heads, t, t, device="cuda", requires_grad=True)
    v = torch.eye(t, device="cuda").expand(batch, heads, t, t).clone().requires_grad_()
    return q, k, v


def check_backward(out: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor) -> None:
    """The backward used the forward's mask: out = 2 * dropped attention, so dv = dropped^T @ (2 grad_out)."""
    torch.testing.assert_close(v.grad, out.detach().transpose(-1, -2) @ grad_out)


def check_forward(out: torch.Tensor, training: bool) -> torch.Tensor:
    """Dropout keeps about 1 - P of the weights and scales them by 1 / (1 - P); without it every weight is 1/T."""
    t = out.shape[-1]
    kept = out.detach() != 0
    if training:
        assert 0.35 < kept.float().mean().item() < 0.65
        torch.testing.assert_close(out.detach()[kept], torch.full_like(out.detach()[kept], 2.0 / t / (1 - P)))
    else:
        torch.testing.assert_close(out.detach(), torch.full_like(out.detach(), 2.0 / t))
    return kept


def train_call(jm, t: int = 16) -> torch.Tensor:
    """A checked training call on fresh inputs; returns the mask of the weights dropout kept."""
    return train_call_on(jm, *probe(t)).detach() != 0


def train_call_on(
    jm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor | None = None
) -> torch.Tensor:
    """A checked training call (``v.grad`` reset first, so that inputs may be kept across calls); returns the output.
    ``grad_out`` is the backward's cotangent, a fresh random one by default."""
    v.grad = None
    out = jm(q, k, v)
    check_forward(out, training=True)
    grad_out = torch.randn_like(out) if grad_out is None else grad_out
    out.backward(grad_out)
    check_backward(out, v, grad_out)
    return out


def eval_call(jm, t: int = 16) -> None:
    with torch.no_grad():
        check_forward(jm(*probe(t)), training=False)


def jitted() -> tuple[Attention, thunder.ThunderModule]:
    model = Attention()
    return model, thunder.jit(model, executors=[cudagraphex, *thunder.get_default_executors()])


def test_training_loop_draws_fresh_masks_that_the_backward_reuses():
    _, jm = jitted()
    masks = [train_call(jm) for _ in range(6)]
    assert all(not torch.equal(masks[i], masks[i + 1]) for i in range(len(masks) - 1))
    report = explain(jm)
    assert report.num_graphs >= 2 and sum(r.replays for r in report.regions) >= 4


@pytest.mark.parametrize("order", ["same", "reverse"])
def test_two_forwards_then_two_backwards(order):
    _, jm = jitted()
    for _ in range(4):
        calls = []
        for _ in range(2):
            q, k, v = probe()
            out = jm(q, k, v)
            check_forward(out, training=True)
            calls.append((out, v, torch.randn_like(out)))
        for out, v, grad_out in calls if order == "same" else reversed(calls):
            out.backward(grad_out)
            check_backward(out, v, grad_out)
        del calls


def test_train_eval_no_grad_switches_and_a_new_shape_after_a_switch():
    model, jm = jitted()
    for _ in range(3):
        train_call(jm)
    model.eval()
    for _ in range(3):
        eval_call(jm)
    model.train()
    for _ in range(3):
        train_call(jm)
    model.eval()
    eval_call(jm, t=32)  # a new shape right after a switch
    model.train()
    for _ in range(3):
        train_call(jm, t=32)
        train_call(jm)
    with torch.no_grad():  # dropout in training mode without autograd: a forward whose state nothing reads
        check_forward(jm(*probe()), training=True)
    train_call(jm)


def test_backward_that_runs_eagerly_after_a_replayed_forward():
    # A forward replayed while the backward of an earlier one is pending, then the backwards in reverse: the later
    # backward region may run eagerly against the state of a replayed forward.
    _, jm = jitted()
    for _ in range(3):
        train_call(jm)
    pending = []
    for _ in range(3):
        q, k, v = probe()
        out = jm(q, k, v)
        pending.append((out, v, torch.randn_like(out)))
    for out, v, grad_out in reversed(pending):
        out.backward(grad_out)
        check_backward(out, v, grad_out)


def test_a_backward_after_a_forward_run_eagerly_for_a_held_output_captures_no_new_graph():
    # An output held into the next call makes that call's forward run eagerly, which returns the RNG state in host
    # memory: its backward is a transient miss (the saved tensors moved too), not a new signature worth a graph. The
    # same q, k, v and cotangent every call: fresh ones may land elsewhere while the held output keeps memory in use,
    # and a moved caller input costs a graph of its own.
    _, jm = jitted()
    q, k, v = probe()
    grad_out = torch.randn_like(v)

    for _ in range(3):
        train_call_on(jm, q, k, v, grad_out)
    held = train_call_on(jm, q, k, v, grad_out)
    train_call_on(jm, q, k, v, grad_out)  # its forward runs eagerly: ``held`` references the graph's output
    del held
    for _ in range(3):
        train_call_on(jm, q, k, v, grad_out)
    report = explain(jm)
    (backward,) = [r for r in report.regions if r.phase == "backward"]
    assert len(backward.graphs) == 1 and backward.eager_calls.get("static input moved") == 1
    assert sum(len(r.graphs) for r in report.regions) == 2


def test_an_output_held_through_later_calls_leaves_the_backward_reading_saved_tensors_in_place():
    # Held through every later call, the output makes the forward run eagerly once, then capture a graph of its own;
    # the backward misses twice (the eager forward's saved tensors, then the new graph's) and captures a graph that
    # reads the new graph's saved tensors where they are, rather than copying them in from then on. One cotangent, as
    # above.
    _, jm = jitted()
    q, k, v = probe()
    grad_out = torch.randn_like(v)

    for _ in range(3):
        train_call_on(jm, q, k, v, grad_out)
    held = train_call_on(jm, q, k, v, grad_out)
    kept = held.detach().clone()
    for _ in range(4):
        train_call_on(jm, q, k, v, grad_out)
    torch.testing.assert_close(held.detach(), kept)
    report = explain(jm)
    (forward,) = [r for r in report.regions if r.phase == "forward"]
    (backward,) = [r for r in report.regions if r.phase == "backward"]
    assert len(forward.graphs) == 2 and len(backward.graphs) == 2 and backward.demoted_inputs == []


def thunder_nanogpt(dropout: float):
    from thunder.tests.nanogpt_model import GPT, GPTConfig

    config = GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=4, n_embd=64, dropout=dropout, bias=True)
    return GPT(config).cuda()


def train_eval_train(jm, model, steps: int = 3) -> None:
    def batch(t=32):
        return torch.randint(0, 256, (2, t), device="cuda"), torch.randint(0, 256, (2, t), device="cuda")

    for t in (32, 16):  # the second pass: a new shape after the switches
        for _ in range(steps):
            _, loss = jm(*batch(t))
            assert torch.isfinite(loss)
            loss.backward()
        model.eval()
        with torch.no_grad():
            for _ in range(steps):
                logits, _ = jm(*batch(t))
                assert torch.isfinite(logits).all()
        model.train()
        for _ in range(steps):
            _, loss = jm(*batch(t))
            loss.backward()


def test_thunder_nanogpt_with_attention_dropout_through_train_eval_switches():
    torch.manual_seed(0)
    model = thunder_nanogpt(dropout=0.1)
    jm = thunder.jit(model, executors=[cudagraphex, *thunder.get_default_executors()])
    train_eval_train(jm, model)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert explain(jm).num_graphs >= 2


def test_thunder_nanogpt_without_dropout_matches_plain_thunder_through_the_same_switches():
    torch.manual_seed(0)
    model = thunder_nanogpt(dropout=0.0)
    reference = copy.deepcopy(model)
    jm = thunder.jit(model, executors=[cudagraphex, *thunder.get_default_executors()])
    jref = thunder.jit(reference)
    torch.manual_seed(1)
    train_eval_train(jm, model)
    torch.manual_seed(1)
    train_eval_train(jref, reference)
    assert_grads_close(model, reference, atol=1e-4, rtol=1e-4)
