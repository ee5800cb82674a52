"""Whole-step graphs are never replayed stale: each change of what a replay depends on is seen."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import thunder
import torch
from torch import nn

from cudagraphex import explain, graph_step
from tests.helpers import twin
from tests.step.twins import Pair, replays_of, run_calls

# -- what is guarded ---------------------------------------------------------------------------------------------------


def _set_grads_to_none(pair):
    for opt in pair.opts:
        opt.zero_grad(set_to_none=True)


def _move_a_parameter(pair):
    for m in pair.models:
        m[0].weight.data = m[0].weight.data.clone()


def _replace_a_parameter(pair):
    for m, opt in zip(pair.models, pair.opts, strict=True):
        new = nn.Parameter(m[2].bias.detach() * 0.5)
        m[2].bias = new
        opt.param_groups[0]["params"] = list(m.parameters())


def _halve_the_learning_rate(pair):
    for opt in pair.opts:
        opt.param_groups[0]["lr"] *= 0.5


def _reload_the_optimizer(pair):
    for opt in pair.opts:
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # the same values in new tensors


def _switch_to_eval(pair):
    for m in pair.models:
        m.eval()


def _register_a_buffer(pair):
    for m in pair.models:
        m[0].register_buffer("unused", torch.zeros(1, device=pair.backend.device))


def _add_a_param_group(pair):
    extra = nn.Linear(16, 16).to(pair.backend.device)
    for m, opt in zip(pair.models, pair.opts, strict=True):
        m.extra = twin(extra)
        opt.add_param_group({"params": list(m.extra.parameters()), "lr": 0.1})


@pytest.mark.parametrize(
    "change",
    [
        _set_grads_to_none,
        _move_a_parameter,
        _replace_a_parameter,
        _halve_the_learning_rate,
        _reload_the_optimizer,
        _switch_to_eval,
        _register_a_buffer,
        _add_a_param_group,
    ],
)
def test_a_change_of_state_between_steps_is_seen(backend, change):
    _check_a_change_is_seen(Pair(backend), change)


@pytest.mark.parametrize("change", [_replace_a_parameter, _halve_the_learning_rate, _add_a_param_group])
def test_one_module_and_one_optimizer_are_guarded_without_a_list(backend, change):
    _check_a_change_is_seen(Pair(backend, listed=False), change)


def _check_a_change_is_seen(pair, change):
    batches = [pair.batch() for _ in range(12)]
    for i in range(6):
        pair.call(*batches[i], seed=i)
    assert replays_of(pair.step) >= 1
    change(pair)
    before = _fresh_runs(pair.step)
    pair.call(*batches[6], seed=6)
    assert _fresh_runs(pair.step) == before + 1  # the old graph was not replayed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the budget warning, where a change needs more graphs than allowed
        for i in range(7, 12):
            pair.call(*batches[i], seed=i)


def _fresh_runs(step) -> int:
    """Calls that captured the step or ran it without its graph."""
    report = explain(step)
    return report.captures + sum(report.plain_calls.values())


class _SlicedLayers(nn.Module):
    """Calls the first ``n`` of its layers through a slice of its ``ModuleList``, as Hugging Face's Llama does: every
    forward registers the layers into a new container."""

    def __init__(self, n=2):
        super().__init__()
        self.n = n
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(n + 1))

    def forward(self, x):
        for layer in self.layers[: self.n]:
            x = torch.tanh(layer(x))
        return x


def test_a_model_that_registers_modules_while_it_runs_replays(backend):
    """Registrations outside the step's modules (a new ModuleList, built by every forward) do not invalidate its
    graph; under ``thunder.jit`` the forward is traced once and its compiled code run, in this step and in any other
    function of the process."""
    pair = Pair(backend, make_model=_SlicedLayers)
    run_calls(pair, 4)
    assert explain(pair.step).captures == 1
    run_calls(pair, 4, first_seed=4)
    assert replays_of(pair.step) == 5  # the capturing call and every call after it

    # A function compiled without a step graph, after one exists in the process.
    plain = thunder.jit(_SlicedLayers().to(backend.device))
    for _ in range(3):
        plain(torch.randn(4, 16, device=backend.device)).sum().backward()
    eager = _SlicedLayers().to(backend.device)
    model_step = graph_step(lambda x: eager(x).sum().backward(), modules=[eager], backend=backend.name)
    for _ in range(7):
        model_step(torch.randn(4, 16, device=backend.device))
    assert explain(model_step).plain_calls == {"warm-up": 3}
    assert replays_of(model_step) == 4  # the capturing call and every call after it


def test_the_autocast_dtype_of_each_device_keys_the_graphs_where_autocast_is_on():
    """A matmul under CPU autocast in bfloat16, then in float16 (CPU replay backend): each call gets a result of its
    own dtype. A disabled autocast context, which still sets the dtype, shares the graph of the calls without one."""
    weight = torch.randn(8, 8)
    step = graph_step(lambda x: x @ weight, backend="emulate")
    x = torch.randn(4, 8)
    for dtype in (torch.bfloat16, torch.float16):
        for _ in range(4):
            with torch.autocast("cpu", dtype=dtype):
                out = step(x)
            assert out.dtype == dtype
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # off a GPU, torch.autocast("cuda") says that CUDA is not available
        for disabled in (False, True, False, True):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=False) if disabled else contextlib.nullcontext():
                torch.testing.assert_close(step(x), x @ weight)
    assert explain(step).graphs == 3


def test_a_new_batch_shape_warms_up_and_captures_again(backend):
    pair = Pair(backend)
    for i in range(5):
        pair.call(*pair.batch(4), seed=i)
    for i in range(5):
        pair.call(*pair.batch(6), seed=10 + i)
    report = explain(pair.step)
    assert report.captures == 2
    assert report.replays >= 2


def test_past_max_graphs_the_step_runs_without_its_graph(backend):
    pair = Pair(backend, max_graphs=1)
    for i in range(4):
        pair.call(*pair.batch(4), seed=i)
    with pytest.warns(UserWarning, match="max_graphs=1"):
        run_calls(pair, 4, rows=6, first_seed=10)
    report = explain(pair.step)
    assert report.captures == 1
    assert report.plain_calls["not captured"] >= 1


def _lowered_every_step(pair):
    return [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) for opt in pair.opts]


def test_a_learning_rate_schedule_on_a_tensor_lr_replays_one_graph(backend):
    def adamw_with_tensor_lr(params, backend, adam):
        lr = torch.tensor(1e-2, device=backend.device)  # a scheduler fills it in place
        if backend.name == "cuda":
            return torch.optim.AdamW(params, lr=lr, capturable=True, foreach=True)
        return torch.optim.AdamW(params, lr=lr, fused=True)  # the CPU's AdamW that reads no value on the host

    pair = Pair(backend, optimizer=adamw_with_tensor_lr)
    schedulers = _lowered_every_step(pair)
    for i in range(8):
        pair.call(*pair.batch(), seed=i)  # the lowered learning rate reaches both
        for scheduler in schedulers:
            scheduler.step()
    report = explain(pair.step)
    assert report.captures == 1 and report.replays == 5


def test_a_learning_rate_schedule_on_a_float_lr_is_named_when_the_budget_runs_out(backend):
    pair = Pair(backend, adam=False, max_graphs=2)
    schedulers = _lowered_every_step(pair)

    def call(i):
        pair.call(*pair.batch(), seed=i)
        for scheduler in schedulers:
            scheduler.step()

    for i in range(5):  # warm-up, then a capture per learning rate
        call(i)
    with pytest.warns(
        UserWarning, match=r"max_graphs=2 times; last, param group 0's lr changed from .*lr=torch.tensor"
    ):
        call(5)
    assert explain(pair.step).captures == 2
