"""What keeps a step from being captured, and bad input: the step runs as is, with its reason, or raises."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import thunder
import torch
from torch import nn

import cudagraphex
from benchmarks.models import mlp
from cudagraphex import StrictModeError, explain, graph_step
from tests.helpers import BACKENDS
from tests.step.twins import Pair, run_calls

# -- what is not captured ----------------------------------------------------------------------------------------------


def test_a_step_that_reads_a_value_on_the_host_is_not_captured(backend):
    pair = Pair(backend)
    inner = pair.steps[0]

    def step(x, y):
        loss = inner(x, y)
        if loss.item() > 1e9:  # a host sync: a graph cannot replay this decision
            raise AssertionError
        return loss

    pair.step = graph_step(step, modules=[pair.models[0]], optimizers=[pair.opts[0]], backend=backend.name)
    with pytest.warns(UserWarning, match="reads a device value on the host"):
        run_calls(pair, 5)
    report = explain(pair.step)
    assert report.captures == 0
    assert "reads a device value" in report.not_captured


def test_strict_mode_raises_instead(backend):
    pair = Pair(backend, strict=True)
    inner = pair.steps[0]
    pair.step = graph_step(
        lambda x, y: (inner(x, y), float(inner(x, y))),
        modules=[pair.models[0]],
        optimizers=[pair.opts[0]],
        backend=backend.name,
        strict=True,
    )
    with pytest.raises(StrictModeError, match="not captured"):
        for _ in range(4):
            pair.step(*pair.batch())


def test_a_python_value_returned_keeps_the_step_from_being_captured(backend):
    pair = Pair(backend)
    inner = pair.steps[0]
    pair.steps = [lambda x, y: (inner(x, y), 3), pair.steps[1]]
    pair.step = graph_step(pair.steps[0], modules=[pair.models[0]], optimizers=[pair.opts[0]], backend=backend.name)
    reference = pair.steps[1]
    pair.steps[1] = lambda x, y: (reference(x, y), 3)
    with pytest.warns(UserWarning, match="returns a int"):
        run_calls(pair, 5)
    assert explain(pair.step).replays == 0


@pytest.mark.parametrize("returns", ["a view of its argument", "a view of its state", "two views of one tensor"])
def test_results_that_share_memory_keep_the_step_from_being_captured(backend, returns):
    """Copies of such results would not share memory as the step's own results do: the step runs as is, and what it
    returns shares memory as it does without graph_step, the call that tried the capture included."""
    model = nn.Linear(4, 4).to(backend.device)

    def step(x):
        with torch.no_grad():
            x.mul_(2)  # written in place: the caller sees the write on every call
            h = model(x)
        if returns == "a view of its argument":
            return h, x[0]
        if returns == "a view of its state":
            return h, model.weight.detach()[0]
        return h, h[0]

    stepped = graph_step(step, modules=[model], warmup_calls=1, backend=backend.name)

    def call():
        x = torch.ones(2, 4, device=backend.device)
        return x, *stepped(x)

    with pytest.warns(UserWarning, match="share memory|view of one of its arguments or state"):
        calls = [call() for _ in range(4)]
    for x, h, view in calls:
        assert torch.equal(x, torch.full_like(x, 2))
        shared = {"a view of its argument": x, "a view of its state": model.weight, "two views of one tensor": h}
        assert view.untyped_storage().data_ptr() == shared[returns].untyped_storage().data_ptr()
    report = explain(stepped)
    assert report.replays == 0 and report.plain_calls == {"warm-up": 1, "not captured": 3}


def test_an_argument_that_requires_grad_is_not_captured(backend):
    pair = Pair(backend)
    with pytest.warns(UserWarning, match="requires grad"):
        run_calls(pair, 4, inputs_require_grad=True)
    assert explain(pair.step).replays == 0


def test_an_unhashable_python_argument_runs_the_step_as_is(backend):
    @dataclasses.dataclass  # eq=True: not hashable
    class Options:
        scale: float

    pair = Pair(backend)
    inner, reference = pair.steps
    pair.step = graph_step(
        lambda x, y, options: inner(x * options.scale, y),
        modules=[pair.models[0]],
        optimizers=[pair.opts[0]],
        backend=backend.name,
    )
    pair.steps = [pair.step, lambda x, y, options: reference(x * options.scale, y)]
    with pytest.warns(UserWarning, match="type Options is not hashable"):
        pair.call(*pair.batch(), Options(0.5), seed=0)
    for i in range(1, 5):
        pair.call(*pair.batch(), Options(0.5), seed=i)
    report = explain(pair.step)
    assert report.replays == 0 and report.plain_calls == {"not captured": 5}

    bucketed = graph_step(lambda x, options: x * options.scale, backend=backend.name, capture_sizes=[4])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same reason, warned once per step
        for rows in (4, 3, 4, 3, 4, 3):
            x = torch.randn(rows, 2, device=backend.device)
            torch.testing.assert_close(bucketed(x, Options(2.0)), x * 2.0)
    assert explain(bucketed).replays == 0

    strict = graph_step(lambda x, options: x * options.scale, backend=backend.name, strict=True)
    with pytest.raises(StrictModeError, match="not hashable"):
        strict(torch.ones(2, device=backend.device), Options(2.0))


@pytest.mark.cuda
def test_a_non_capturable_optimizer_is_not_captured():
    model = mlp(2, 16).cuda()
    jm = thunder.jit(model)
    opt = torch.optim.AdamW(model.parameters(), capturable=False)

    def step(x):
        opt.zero_grad()
        jm(x).sum().backward()
        opt.step()

    stepped = graph_step(step, modules=[model], optimizers=[opt])
    with pytest.warns(UserWarning, match="CPU tensor"):
        [stepped(torch.randn(4, 16, device="cuda")) for _ in range(4)]
    assert explain(stepped).captures == 0


@pytest.mark.cuda
def test_a_failed_capture_runs_the_step_as_is():
    pair = Pair(BACKENDS["cuda"])
    inner = pair.steps[0]

    def step(x, y):
        loss = inner(x, y)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not permitted while a stream captures: the capture fails
        return loss

    pair.steps[0] = step
    pair.step = graph_step(step, modules=[pair.models[0]], optimizers=[pair.opts[0]])
    with pytest.warns(UserWarning, match="capturing the step failed"):
        run_calls(pair, 6)  # compares every call, the one whose capture failed included
    report = explain(pair.step)
    assert report.captures == 0 and report.replays == 0
    assert "capturing the step failed" in report.not_captured


@pytest.mark.cuda
def test_a_step_captures_after_its_only_earlier_capture_failed():
    """The failed capture was the only graph in the step's pool; the caching allocator keeps that pool until its
    memory is freed and refuses a capture into it, so the next capture takes a new pool."""
    weight = torch.randn(16, 16, device="cuda")

    def fn(x):
        y = (x @ weight).tanh()
        if x.shape[0] == 3 and torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # fails the capture of the 3-row signature alone
        return y * 2

    step = graph_step(fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (3, 3, 3, 4, 4, 4, 4):
            x = torch.randn(rows, 16, device="cuda")
            torch.testing.assert_close(step(x), (x @ weight).tanh() * 2)
    failed = [str(w.message) for w in caught if "capturing the step failed" in str(w.message)]
    assert len(failed) == 1 and "use_count" not in failed[0], failed
    report = explain(step)
    assert report.captures == 1 and report.replays >= 1 and report.not_captured is None, report


# -- bad input ---------------------------------------------------------------------------------------------------------


def test_bad_options_raise():
    with pytest.raises(TypeError, match="fn must be callable, got str"):
        graph_step("step")
    with pytest.raises(TypeError, match="modules"):
        graph_step(lambda: None, modules=[object()])
    with pytest.raises(TypeError, match="optimizers"):
        graph_step(lambda: None, optimizers=[object()])
    with pytest.raises(TypeError, match="modules must be a Module or an iterable of them, got int"):
        graph_step(lambda: None, modules=3)
    with pytest.raises(ValueError, match="capture_sizes must be a non-empty list of positive ints, got 4"):
        graph_step(lambda: None, capture_sizes=4)
    with pytest.raises(ValueError, match="max_graphs"):
        graph_step(lambda: None, max_graphs=0)
    with pytest.raises(ValueError, match="warmup_calls"):
        graph_step(lambda: None, warmup_calls=0)
    with pytest.raises(ValueError, match="backend"):
        graph_step(lambda: None, backend="tpu")
    assert cudagraphex.graph_step is graph_step
