"""Contract point 1: outputs the caller holds are never overwritten."""

from __future__ import annotations

import pytest
import thunder
import torch
from thunder.extend import OperatorExecutor, register_executor

from benchmarks.models import mlp
from cudagraphex import explain
from tests.contract.scenarios import Keeps, held_outputs_survive
from tests.helpers import assert_grads_close, emulated, jit, protection_off, regions, replays, twin


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


def passed_on_as_itself(x):
    return (x * 2 + 1).contiguous()  # contiguous of a contiguous tensor returns that tensor


def test_output_passed_on_as_itself_by_an_eager_op_is_not_the_graphs_own(backend):
    """The caller changes what it receives in place (metadata too); the graph's next output must not change."""
    ex = Keeps(f"cudagraphex_eager_contiguous_{backend.name}", "contiguous", backend=backend.executor.options.backend)
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
    ex = Keeps(f"cudagraphex_eager_sin_{backend.name}", "sin", backend=backend.executor.options.backend)
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
        ex = Keeps(f"cudagraphex_no_doubled_{backend.name}", "doubled_and_none", backend=backend.name)
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


def test_a_training_output_held_across_later_calls_leaves_the_backward_reading_saved_tensors_in_place(backend):
    """The held output makes the forward run eagerly once, then capture a graph of its own, whose saved tensors the
    backward gets at new addresses from then on: the backward captures a graph that reads them there, rather than
    copying them in at every call."""
    torch.manual_seed(0)
    model = mlp(2, 16).to(backend.device)
    reference = twin(model)
    jm = jit(model, backend.executor)
    x = torch.randn(4, 16, device=backend.device)  # one input tensor: a caller's tensor that moves is copied by design

    def call() -> torch.Tensor:
        out = jm(x)
        out.sum().backward()
        reference(x).sum().backward()
        return out

    for _ in range(3):
        call()
    held = call()
    expected = held.detach().clone()
    for _ in range(4):
        call()
    torch.testing.assert_close(held, expected)
    assert_grads_close(model, reference)
    forward, backward = explain(jm).regions
    assert (forward.phase, len(forward.graphs), backward.phase, len(backward.graphs)) == ("forward", 2, "backward", 2)
    assert backward.demoted_inputs == [] and backward.graphs[-1].replays >= 1


def test_output_protection_bites():
    assert held_outputs_survive(emulated)
    with protection_off("output_liveness"):
        assert not held_outputs_survive(emulated)
