"""Whole-step graphs compute what running the step does: patterns of steps, outputs, random draws, in-place
updates, threads."""

from __future__ import annotations

import pytest
import thunder
import torch
from torch import nn

from benchmarks.models import GPT, GPTConfig, mlp
from cudagraphex import StepReport, explain, graph_step
from tests.helpers import errors_in_threads, jit, num_graphs
from tests.step.twins import Pair, optimizer_for, replays_of

# -- what the step computes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["zero_first", "zero_last", "accumulate", "micro_batches"])
def test_step_patterns_match_thunder_and_replay(backend, pattern):
    pair = Pair(backend, pattern=pattern)
    for i in range(8):
        if backend.name == "cuda":  # the peak before the capturing call is what is allocated then
            torch.cuda.reset_peak_memory_stats()
        pair.call(*pair.batch(), seed=i)
    report = explain(pair.step)
    assert isinstance(report, StepReport)
    assert report.replays >= 4, report
    assert report.not_captured is None
    assert "peak raised by" in str(report)
    if backend.name == "cuda":  # the capture's argument buffers and pool come on top of what is allocated before it
        assert report.pool_bytes > 0 and report.peak_added_bytes > 0
    else:  # the CPU has no allocator statistics
        assert report.peak_added_bytes == 0


def test_a_gpt_step_matches_thunder(backend):
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    # SGD: Adam's first updates are about lr times the sign of each gradient, and the gradients of attention's key bias
    # are rounding noise, whose sign differs between Thunder's traces with and without cudagraphex.
    pair = Pair(backend, make_model=lambda: GPT(config), pattern="zero_first", adam=False)
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
    assert replays_of(pair.step) >= 2
    # Inside the step the Thunder regions run as plain code: they capture no graphs of their own, and the backward
    # frees saved tensors after their last read as it goes (on the CPU backend, overwrites them with NaN).
    assert num_graphs(pair.compiled[0], backend.executor) == 0
    assert sum(r.eager_freed_bytes for r in explain(pair.compiled[0]).regions if r.phase == "backward") > 0


def test_torch_compiled_code_in_the_step_stays_compiled(backend):
    compiled_calls = []

    def counting_backend(gm, example_inputs):
        def run(*args):
            compiled_calls.append(1)
            return gm(*args)

        return run

    model = mlp(2, 16).to(backend.device)
    forward = torch.compile(model, backend=counting_backend, fullgraph=True)
    opt = optimizer_for(model.parameters(), backend, adam=False)

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
    pair = Pair(backend)
    kept = [pair.call(*pair.batch(), seed=i) for i in range(6)]
    for got, want in kept:
        pair.check(got, want)
    assert replays_of(pair.step) >= 2


def test_dropout_draws_fresh_values_on_every_replay(backend):
    def make():
        return nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 16))

    pair = Pair(backend, make_model=make)
    x, y = pair.batch()
    losses = [pair.call(x, y, seed=i)[0] for i in range(8)]
    assert replays_of(pair.step) >= 4
    # The same batch gives a different loss each call: the masks are drawn afresh (the parameters change too, but
    # far less than a new mask changes the loss).
    assert len({round(float(v), 6) for v in losses[-4:]}) == 4


def test_batchnorm_running_statistics_follow_every_step(backend):
    def make():
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 16))

    pair = Pair(backend, make_model=make)
    for i in range(6):
        pair.call(*pair.batch(), seed=i)  # compares the buffers too: running mean, variance, batch count
    assert replays_of(pair.step) >= 2


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

    pair = Pair(backend)
    _with_arguments(pair, accumulate)
    totals = [torch.zeros((), device=backend.device) for _ in range(2)]
    counts = [torch.zeros((), dtype=torch.int64, device=backend.device) for _ in range(2)]
    for i in range(6):
        x, y = pair.batch()
        _run_both(pair, i, (x, y, totals[0], counts[0]), (x, y, totals[1], counts[1]))
        pair.check(totals[0], totals[1])
        assert int(counts[0]) == i + 1
    assert replays_of(pair.step) >= 2


def test_an_argument_the_step_only_reads_is_not_written_back(backend):
    """Not even where it holds a NaN, which is unequal to itself, or is strided: a write-back bumps the argument's
    version counter, and an autograd graph of the caller's that saved the argument then fails in its backward."""
    step = graph_step(lambda x: x * 2, warmup_calls=1, backend=backend.name)
    weight = torch.ones((), device=backend.device, requires_grad=True)
    for _ in range(4):
        x = torch.randn(3, 2, device=backend.device)[:, 0]
        x[0] = float("nan")
        saved_x = (x * weight).sum()
        torch.testing.assert_close(step(x), x * 2, equal_nan=True)
        saved_x.backward()
    assert explain(step).replays >= 2


class _DoublesItsArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        s.add_(s.detach())
        return self.linear(x).cos()


@pytest.mark.parametrize("position", ["first", "last"])
def test_an_argument_a_fusion_writes_in_training_is_updated_once_per_call(backend, position):
    # Inside a call that records autograd, Thunder's torch.compile executor writes s in place in an Inductor kernel
    # without bumping its version counter, so the step cannot find the arguments it writes by version counters alone.
    from thunder.executors.torch_compile import torch_compile_ex

    torch.manual_seed(0)
    model = _DoublesItsArgument().to(backend.device)
    rest = [torch_compile_ex, *thunder.get_default_executors()]
    compiled = thunder.jit(
        model, executors=[backend.executor, *rest] if position == "first" else [*rest, backend.executor]
    )

    def train(x, s):
        out = compiled(x, s)
        out.sum().backward()
        return out.detach()

    step = graph_step(train, modules=[model], warmup_calls=1, backend=backend.name)
    for _ in range(4):
        x, s = torch.randn(3, 6, device=backend.device), torch.randn(6, device=backend.device)
        expected = 2 * s
        step(x, s)
        torch.testing.assert_close(s, expected)
    assert explain(step).replays >= 2


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

    pair = Pair(backend)
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
    pair = Pair(backend)
    _with_arguments(pair, lambda loss, scale: loss * scale)
    for i in range(16):
        x, y = pair.batch()
        scale = 1.0 if i % 2 else 2.0
        _run_both(pair, i, (x, y, scale), (x, y, scale))
    report = explain(pair.step)
    assert report.captures == 2  # one graph per value, each replayed while the other is in use
    assert report.replays >= 8


def test_two_threads_each_with_its_own_step(backend):
    """The step draws no random numbers, and the threads draw their batches on the CPU: while one thread captures,
    PyTorch refuses a random op on the device in any other thread (the device's generator is the process's)."""

    def worker(seed):
        generator = torch.Generator().manual_seed(seed)
        pair = Pair(backend, adam=False)
        for _ in range(6):
            pair.call(*pair.batch(generator=generator), seed=None)
        assert replays_of(pair.step) >= 2, "not replayed"

    assert errors_in_threads(worker) == []
