"""Whole-step graphs (:func:`cudagraphex.graph_step`): a step replayed from one graph computes what running it does.

Every test runs the step twice in lock-step, through ``graph_step`` and as plain Thunder, from the same parameters and
seeds, and compares what a caller can observe after every call: the returned values, parameters, gradients (and which
are None), buffers and optimizer state. On the CPU replay backend the comparison is exact.

The points of the contract (``tests/contract/``) through the whole-step path:

1. Outputs the caller holds are never overwritten: ``test_outputs_the_caller_keeps_are_never_overwritten``.
2. Saved tensors: a step consumes its own autograd graph, and what it returns is detached; an argument that requires
   grad keeps the step from being captured (``test_an_argument_that_requires_grad_is_not_captured``).
3. In-place updates, applied once per call: ``test_an_argument_written_in_place_is_updated_once_per_call``,
   ``test_arguments_that_share_memory_are_not_copied_apart``, ``test_batchnorm_running_statistics_follow_every_step``,
   the optimizer state in every test.
4. Fresh random draws: ``test_dropout_draws_fresh_values_on_every_replay``.
5. Per-call host values: ``test_python_values_passed_to_the_step_key_its_graphs``, the learning rate in
   ``test_a_change_of_state_between_steps_is_seen``, ``test_a_step_that_reads_a_value_on_the_host_is_not_captured``.
6. New shapes and the graph budget: ``test_a_new_batch_shape_warms_up_and_captures_again``,
   ``test_past_max_graphs_the_step_runs_without_its_graph``.
7. A failed capture: ``test_a_failed_capture_runs_the_step_as_is`` (CUDA: the CPU backend's capture cannot fail).
8. Bad input and CPU work: ``test_bad_options_raise``, ``test_a_non_capturable_optimizer_is_not_captured``.
9. Threads: ``test_two_threads_each_with_its_own_step``.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import thunder
import torch
from torch import nn

import cudagraphex
from benchmarks.models import GPT, GPTConfig, mlp
from cudagraphex import StepReport, StrictModeError, explain, graph_step
from tests.helpers import BACKENDS, errors_in_threads, jit, num_graphs, twin


def _optimizer(params, backend, adam=True):
    if backend.name == "cuda" and adam:
        return torch.optim.AdamW(params, lr=1e-2, capturable=True, foreach=True)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)  # capturable optimizers need a GPU


class _Pair:
    """A model trained through ``graph_step`` and its twin trained by plain Thunder, with one step function each."""

    def __init__(
        self, backend, make_model=None, pattern="zero_first", adam=True, optimizer=None, listed=True, **options
    ):
        self.backend = backend
        model = (make_model or (lambda: mlp(2, 16)))().to(backend.device)
        self.models = [model, twin(model)]
        self.compiled = [jit(self.models[0], backend.executor), thunder.jit(self.models[1])]
        self.opts = [(optimizer or _optimizer)(m.parameters(), backend, adam) for m in self.models]
        self.steps = [self._step_fn(i, pattern) for i in range(2)]
        # ``listed=False`` passes the one module and the one optimizer as they are.
        modules, optimizers = ([self.models[0]], [self.opts[0]]) if listed else (self.models[0], self.opts[0])
        self.step = graph_step(self.steps[0], modules=modules, optimizers=optimizers, backend=backend.name, **options)

    def _step_fn(self, i, pattern):
        model, opt = self.compiled[i], self.opts[i]

        def loss_of(x, y):
            return ((model(x) - y) ** 2).mean()

        def step(x, y):
            if pattern == "zero_first":
                opt.zero_grad()
            if pattern == "micro_batches":
                opt.zero_grad()
                total = 0
                for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
                    loss = loss_of(xs, ys) / 2
                    loss.backward()
                    total = total + loss.detach()
                opt.step()
                return total
            loss = loss_of(x, y)
            loss.backward()
            if pattern != "accumulate":
                opt.step()
            if pattern == "zero_last":
                opt.zero_grad()
            return loss.detach()

        return step

    def batch(self, rows=4):
        return torch.randn(rows, 16, device=self.backend.device), torch.randn(rows, 16, device=self.backend.device)

    def call(self, *args, seed=0):
        """One call of each; returns both results after checking that they and the state agree."""
        torch.manual_seed(seed)
        got = self.step(*args)
        torch.manual_seed(seed)
        want = self.steps[1](*args)
        self.check(got, want)
        return got, want

    def check(self, got, want):
        close = _assert_close if self.backend.name == "cuda" else _assert_equal
        close(got, want)
        for p, q in zip(self.models[0].parameters(), self.models[1].parameters(), strict=True):
            close(p, q)
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                close(p.grad, q.grad)
        for b, c in zip(self.models[0].buffers(), self.models[1].buffers(), strict=True):
            close(b, c)
        for s, t in zip(self.opts[0].state.values(), self.opts[1].state.values(), strict=True):
            for k in s:
                close(s[k], t[k])


def _calls(pair, n, *, rows=4, first_seed=0, inputs_require_grad=False):
    for i in range(n):
        x, y = pair.batch(rows)
        pair.call(x.requires_grad_(inputs_require_grad), y, seed=first_seed + i)


def _assert_close(a, b):
    # Thunder's traces with and without cudagraphex order some reductions differently (and attention's backward is
    # not deterministic); Adam turns last-bit gradient differences into parameter differences of up to ~1e-4. A stale
    # replay misses a whole step: differences of the order of the learning rate (1e-2).
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def _assert_equal(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _replays(step) -> int:
    return explain(step).replays


# -- what the step computes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["zero_first", "zero_last", "accumulate", "micro_batches"])
def test_step_patterns_match_thunder_and_replay(backend, pattern):
    pair = _Pair(backend, pattern=pattern)
    for i in range(8):
        pair.call(*pair.batch(), seed=i)
    report = explain(pair.step)
    assert isinstance(report, StepReport)
    assert report.replays >= 4, report
    assert report.not_captured is None
    assert "peak raised by" in str(report)
    if backend.name == "cuda":  # the capture's argument buffers and pool come on top of what the warm-up used
        assert report.pool_bytes > 0 and report.peak_added_bytes > 0
    else:  # the CPU has no allocator statistics
        assert report.peak_added_bytes == 0


def test_a_gpt_step_matches_thunder(backend):
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    # SGD: Adam's first updates are about lr times the sign of each gradient, and the gradients of attention's key bias
    # are rounding noise, whose sign differs between Thunder's traces with and without cudagraphex.
    pair = _Pair(backend, make_model=lambda: GPT(config), pattern="zero_first", adam=False)
    pair.compiled[0] = jit(pair.models[0], backend.executor)

    def step_of(i):
        model, opt = pair.compiled[i], pair.opts[i]

        def step(idx, targets):
            opt.zero_grad()
            loss = model(idx, targets)
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    pair.steps = [step_of(0), step_of(1)]
    pair.step = graph_step(pair.steps[0], modules=[pair.models[0]], optimizers=[pair.opts[0]], backend=backend.name)
    for i in range(6):
        idx = torch.randint(0, 64, (2, 16), device=backend.device)
        pair.call(idx, torch.randint(0, 64, (2, 16), device=backend.device), seed=i)
    assert _replays(pair.step) >= 2
    # Inside the step the Thunder regions run as plain code: they capture no graphs of their own.
    assert num_graphs(pair.compiled[0], backend.executor) == 0


def test_torch_compiled_code_in_the_step_stays_compiled(backend):
    compiled_calls = []

    def counting_backend(gm, example_inputs):
        def run(*args):
            compiled_calls.append(1)
            return gm(*args)

        return run

    model = mlp(2, 16).to(backend.device)
    forward = torch.compile(model, backend=counting_backend, fullgraph=True)
    opt = _optimizer(model.parameters(), backend, adam=False)

    def step(x, y):
        opt.zero_grad()
        loss = ((forward(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    graphed = graph_step(step, modules=[model], optimizers=[opt], backend=backend.name)
    x, y = torch.randn(4, 16, device=backend.device), torch.randn(4, 16, device=backend.device)
    for _ in range(5):
        graphed(x, y)
    report = explain(graphed)
    assert report.captures == 1
    # fn runs at each capture; the CPU backend's replays (the capturing call's included) run it too.
    runs = sum(report.plain_calls.values()) + (report.replays if backend.name == "emulate" else report.captures)
    # The last warm-up looks for host work under a dispatch mode, under which Dynamo would disable compiled code for
    # good: the capture and every later run would run the module uncompiled.
    assert len(compiled_calls) == runs


def test_outputs_the_caller_keeps_are_never_overwritten(backend):
    pair = _Pair(backend)
    kept = [pair.call(*pair.batch(), seed=i) for i in range(6)]
    for got, want in kept:
        pair.check(got, want)
    assert _replays(pair.step) >= 2


def test_dropout_draws_fresh_values_on_every_replay(backend):
    def make():
        return nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 16))

    pair = _Pair(backend, make_model=make)
    x, y = pair.batch()
    losses = [pair.call(x, y, seed=i)[0] for i in range(8)]
    assert _replays(pair.step) >= 4
    # The same batch gives a different loss each call: the masks are drawn afresh (the parameters change too, but
    # far less than a new mask changes the loss).
    assert len({round(float(v), 6) for v in losses[-4:]}) == 4


def test_batchnorm_running_statistics_follow_every_step(backend):
    def make():
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 16))

    pair = _Pair(backend, make_model=make)
    for i in range(6):
        pair.call(*pair.batch(), seed=i)  # compares the buffers too: running mean, variance, batch count
    assert _replays(pair.step) >= 2


def _with_arguments(pair, extra):
    """Gives both step functions of ``pair`` the extra arguments ``extra(loss, *args)`` reads or writes."""
    inner = list(pair.steps)

    def step_of(i):
        def step(x, y, *args):
            loss = inner[i](x, y)
            return extra(loss, *args)

        return step

    pair.steps = [step_of(0), step_of(1)]
    pair.step = graph_step(
        pair.steps[0], modules=[pair.models[0]], optimizers=[pair.opts[0]], backend=pair.backend.name
    )


def _run_both(pair, seed, *args_of_each):
    torch.manual_seed(seed)
    got = pair.step(*args_of_each[0])
    torch.manual_seed(seed)
    want = pair.steps[1](*args_of_each[1])
    pair.check(got, want)


def test_an_argument_written_in_place_is_updated_once_per_call(backend):
    def accumulate(loss, total, calls):
        total.add_(loss)
        calls.add_(1)
        return loss

    pair = _Pair(backend)
    _with_arguments(pair, accumulate)
    totals = [torch.zeros((), device=backend.device) for _ in range(2)]
    counts = [torch.zeros((), dtype=torch.int64, device=backend.device) for _ in range(2)]
    for i in range(6):
        x, y = pair.batch()
        _run_both(pair, i, (x, y, totals[0], counts[0]), (x, y, totals[1], counts[1]))
        pair.check(totals[0], totals[1])
        assert int(counts[0]) == i + 1
    assert _replays(pair.step) >= 2


def test_a_step_called_under_inference_mode_replays_and_writes_its_arguments(backend):
    model = mlp(2, 16).to(backend.device)
    compiled = [jit(model, backend.executor), thunder.jit(model)]

    def decode(i):
        def step(x, cache):
            cache.add_(x.sum(0))  # a state the caller passes in, written in place
            return compiled[i](x + cache)

        return step

    step = graph_step(decode(0), modules=[model], backend=backend.name)
    with torch.inference_mode():
        caches = [torch.zeros(16, device=backend.device) for _ in range(2)]
        for _ in range(6):
            x = torch.randn(4, 16, device=backend.device)
            got, want = step(x, caches[0]), decode(1)(x, caches[1])
            torch.testing.assert_close(got, want)
            torch.testing.assert_close(caches[0], caches[1])
    assert explain(step).replays == 4  # the capturing call and the three after it


def test_arguments_that_share_memory_are_not_copied_apart(backend):
    def scale_twice(loss, a, b):
        a.add_(1)
        b.mul_(2)  # sees the write through a when both are one tensor
        return loss

    pair = _Pair(backend)
    _with_arguments(pair, scale_twice)
    shared = [torch.ones(3, device=backend.device) for _ in range(2)]

    def calls_with_one_tensor_twice():
        for i in range(4):
            x, y = pair.batch()
            _run_both(pair, i, (x, y, shared[0], shared[0]), (x, y, shared[1], shared[1]))
            pair.check(shared[0], shared[1])

    with pytest.warns(UserWarning, match="shares memory"):
        calls_with_one_tensor_twice()
    assert explain(pair.step).captures == 0
    for i in range(4, 8):  # apart, the same step is captured
        x, y = pair.batch()
        apart = [[torch.ones(3, device=backend.device) for _ in range(2)] for _ in range(2)]
        _run_both(pair, i, (x, y, *apart[0]), (x, y, *apart[1]))
        pair.check(apart[0], apart[1])
    assert explain(pair.step).replays >= 1
    calls_with_one_tensor_twice()  # runs as is, once more; the step's graph stays in use for other calls
    assert explain(pair.step).not_captured is None


def test_python_values_passed_to_the_step_key_its_graphs(backend):
    pair = _Pair(backend)
    _with_arguments(pair, lambda loss, scale: loss * scale)
    for i in range(16):
        x, y = pair.batch()
        scale = 1.0 if i % 2 else 2.0
        _run_both(pair, i, (x, y, scale), (x, y, scale))
    report = explain(pair.step)
    assert report.captures == 2  # one graph per value, each replayed while the other is in use
    assert report.replays >= 8


def test_two_threads_each_with_its_own_step(backend):
    def worker(seed):
        torch.manual_seed(seed)
        pair = _Pair(backend, adam=False)
        for i in range(6):
            pair.call(*pair.batch(), seed=seed * 100 + i)
        assert _replays(pair.step) >= 2, "not replayed"

    assert errors_in_threads(worker) == []


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
    _check_a_change_is_seen(_Pair(backend), change)


@pytest.mark.parametrize("change", [_replace_a_parameter, _halve_the_learning_rate, _add_a_param_group])
def test_one_module_and_one_optimizer_are_guarded_without_a_list(backend, change):
    _check_a_change_is_seen(_Pair(backend, listed=False), change)


def _check_a_change_is_seen(pair, change):
    batches = [pair.batch() for _ in range(12)]
    for i in range(6):
        pair.call(*batches[i], seed=i)
    assert _replays(pair.step) >= 1
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
    pair = _Pair(backend, make_model=_SlicedLayers)
    _calls(pair, 4)
    assert explain(pair.step).captures == 1
    _calls(pair, 4, first_seed=4)
    assert _replays(pair.step) == 5  # the capturing call and every call after it

    # A function compiled without a step graph, after one exists in the process.
    plain = thunder.jit(_SlicedLayers().to(backend.device))
    for _ in range(3):
        plain(torch.randn(4, 16, device=backend.device)).sum().backward()
    eager = _SlicedLayers().to(backend.device)
    model_step = graph_step(lambda x: eager(x).sum().backward(), modules=[eager], backend=backend.name)
    for _ in range(7):
        model_step(torch.randn(4, 16, device=backend.device))
    assert explain(model_step).plain_calls == {"warm-up": 3}
    assert _replays(model_step) == 4  # the capturing call and every call after it


def test_a_new_batch_shape_warms_up_and_captures_again(backend):
    pair = _Pair(backend)
    for i in range(5):
        pair.call(*pair.batch(4), seed=i)
    for i in range(5):
        pair.call(*pair.batch(6), seed=10 + i)
    report = explain(pair.step)
    assert report.captures == 2
    assert report.replays >= 2


def test_past_max_graphs_the_step_runs_without_its_graph(backend):
    pair = _Pair(backend, max_graphs=1)
    for i in range(4):
        pair.call(*pair.batch(4), seed=i)
    with pytest.warns(UserWarning, match="max_graphs=1"):
        _calls(pair, 4, rows=6, first_seed=10)
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

    pair = _Pair(backend, optimizer=adamw_with_tensor_lr)
    schedulers = _lowered_every_step(pair)
    for i in range(8):
        pair.call(*pair.batch(), seed=i)  # the lowered learning rate reaches both
        for scheduler in schedulers:
            scheduler.step()
    report = explain(pair.step)
    assert report.captures == 1 and report.replays == 5


def test_a_learning_rate_schedule_on_a_float_lr_is_named_when_the_budget_runs_out(backend):
    pair = _Pair(backend, adam=False, max_graphs=2)
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


# -- what is not captured ----------------------------------------------------------------------------------------------


def test_a_step_that_reads_a_value_on_the_host_is_not_captured(backend):
    pair = _Pair(backend)
    inner = pair.steps[0]

    def step(x, y):
        loss = inner(x, y)
        if loss.item() > 1e9:  # a host sync: a graph cannot replay this decision
            raise AssertionError
        return loss

    pair.step = graph_step(step, modules=[pair.models[0]], optimizers=[pair.opts[0]], backend=backend.name)
    with pytest.warns(UserWarning, match="reads a device value on the host"):
        _calls(pair, 5)
    report = explain(pair.step)
    assert report.captures == 0
    assert "reads a device value" in report.not_captured


def test_strict_mode_raises_instead(backend):
    pair = _Pair(backend, strict=True)
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
    pair = _Pair(backend)
    inner = pair.steps[0]
    pair.steps = [lambda x, y: (inner(x, y), 3), pair.steps[1]]
    pair.step = graph_step(pair.steps[0], modules=[pair.models[0]], optimizers=[pair.opts[0]], backend=backend.name)
    reference = pair.steps[1]
    pair.steps[1] = lambda x, y: (reference(x, y), 3)
    with pytest.warns(UserWarning, match="returns a int"):
        _calls(pair, 5)
    assert explain(pair.step).replays == 0


def test_an_argument_that_requires_grad_is_not_captured(backend):
    pair = _Pair(backend)
    with pytest.warns(UserWarning, match="requires grad"):
        _calls(pair, 4, inputs_require_grad=True)
    assert explain(pair.step).replays == 0


def test_an_unhashable_python_argument_runs_the_step_as_is(backend):
    @dataclasses.dataclass  # eq=True: not hashable
    class Options:
        scale: float

    pair = _Pair(backend)
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
    pair = _Pair(BACKENDS["cuda"])
    inner = pair.steps[0]

    def step(x, y):
        loss = inner(x, y)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not permitted while a stream captures: the capture fails
        return loss

    pair.steps[0] = step
    pair.step = graph_step(step, modules=[pair.models[0]], optimizers=[pair.opts[0]])
    with pytest.warns(UserWarning, match="capturing the step failed"):
        _calls(pair, 6)  # compares every call, the one whose capture failed included
    report = explain(pair.step)
    assert report.captures == 0 and report.replays == 0
    assert "capturing the step failed" in report.not_captured


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
