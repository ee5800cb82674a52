"""Batch-size buckets (``graph_step(..., capture_sizes=...)``): a padded call returns what the unpadded call does.

Each test compares a step's result with the same function run as is on the call's rows alone. Padding changes the
batch a matrix product sees, which may change the last bits of a result: the comparisons use torch's default float32
tolerance. Where the step's rows are not independent, padding is refused with a reason, and the call runs as is.
"""

from __future__ import annotations

import contextlib
import random
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.backends.cuda import SDPAParams

from benchmarks.models import mlp
from cudagraphex import StrictModeError, explain, graph_step
from tests.helpers import jit, protection_off


def _serving(backend, make=None):
    torch.manual_seed(0)
    model = (make or (lambda: mlp(2, 16)))().to(backend.device).eval()
    compiled = jit(model, backend.executor)

    def serve(x):
        with torch.no_grad():
            return compiled(x).softmax(-1)

    return model, serve


def _rows(backend, n, width=16):
    return torch.randn(n, width, device=backend.device)


def test_padded_calls_equal_unpadded_calls_with_one_graph_per_size(backend):
    model, serve = _serving(backend)
    step = graph_step(serve, capture_sizes=[1, 2, 4, 8], backend=backend.name)
    step.prepare(_rows(backend, 3))
    assert explain(step).replays == 4  # each size's capturing call
    rng = random.Random(0)
    sizes = [rng.randint(1, 8) for _ in range(40)]
    for n in sizes:
        x = _rows(backend, n)
        got = step(x)
        with torch.no_grad():
            want = model(x).softmax(-1)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
    report = explain(step)
    assert report.graphs == 4
    assert report.replays == 4 + 40
    padded = [n for n in sizes if n not in (1, 2, 4, 8)]
    assert report.padded_calls == len(padded)
    assert report.real_rows == sum(padded)
    assert report.padded_rows == sum({3: 4, 5: 8, 6: 8, 7: 8}[n] - n for n in padded)


def test_padded_calls_under_inference_mode_equal_unpadded_calls(backend):
    """Under inference mode composite ops (linear, layer_norm) reach the row check undecomposed; it checks their
    decompositions, so padding is allowed as it is with autograd on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16)).to(backend.device)
    compiled = jit(model, backend.executor)
    step = graph_step(lambda x: compiled(x).softmax(-1), capture_sizes=[2, 4, 8], backend=backend.name)
    with torch.inference_mode():
        step.prepare(_rows(backend, 8))
        for n in (3, 5, 8, 1, 7, 2, 6):
            x = _rows(backend, n)
            torch.testing.assert_close(step(x), model(x).softmax(-1))
    report = explain(step)
    assert report.not_padded == {} and report.padded_calls == 5, str(report)


def test_a_process_that_ran_torch_compile_pads_under_inference_mode(backend):
    """The row check enters itself again for each composite op under inference mode; the call stays watched."""
    torch.compile(lambda x: x + 1, backend="eager")(_rows(backend, 2))
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).to(backend.device)
    compiled = jit(model, backend.executor)
    step = graph_step(lambda x: compiled(x).tanh(), capture_sizes=[4], backend=backend.name)
    with torch.inference_mode():
        step.prepare(_rows(backend, 4))
        x = _rows(backend, 3)
        torch.testing.assert_close(step(x), model(x).tanh())
    report = explain(step)
    assert report.not_padded == {} and report.padded_calls == 1, str(report)


def test_without_prepare_a_size_is_captured_from_calls_of_that_size(backend):
    model, serve = _serving(backend)
    step = graph_step(serve, capture_sizes=[4], backend=backend.name)
    x2 = _rows(backend, 2)
    with torch.no_grad():
        want = model(x2).softmax(-1)
    torch.testing.assert_close(step(x2), want)  # no graph of size 4 yet: runs as is
    assert explain(step).plain_calls == {"no graph to pad into yet": 1}
    for _ in range(3):
        step(_rows(backend, 4))
    torch.testing.assert_close(step(x2), want)
    assert explain(step).padded_calls == 1


def test_a_call_is_padded_only_into_a_graph_of_its_arguments_memory_layout(backend):
    """The layout of a result follows its arguments' (an elementwise op keeps a transposed input's layout); a call
    padded into a graph captured from a differently laid out argument would get another layout, and a view that
    fails on its own argument would succeed on the graph's buffer. Such a call runs as is."""

    def fn(x):
        return x * 2 + 1

    step = graph_step(fn, capture_sizes=[4], backend=backend.name)
    step.prepare(torch.randn(4, 6, device=backend.device))
    transposed = torch.randn(6, 3, device=backend.device).t()
    strided = torch.randn(3, 12, device=backend.device)[:, ::2]
    for x in (transposed, strided, torch.randn(3, 6, device=backend.device)):
        got = step(x)
        want = fn(x)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want)
    report = explain(step)
    assert report.padded_calls == 1 and report.plain_calls["no graph to pad into yet"] == 2, str(report)


def test_outputs_keep_their_rows_through_views_and_outputs_without_rows_come_whole(backend):
    weight = torch.randn(8, 8, device=backend.device)
    bias = torch.randn(5, device=backend.device)

    def fn(x):  # x: (B, 3, 8); flattened to (B*3, 8) and back
        flat = x.reshape(-1, 8) @ weight
        return flat, flat.view(x.shape[0], 3, 8).sum(1), bias * 2

    step = graph_step(fn, capture_sizes=[4], backend=backend.name)
    step.prepare(torch.randn(4, 3, 8, device=backend.device))
    x = torch.randn(3, 3, 8, device=backend.device)
    for got, want in zip(step(x), fn(x), strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
    assert explain(step).padded_calls == 1


class _Cache(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("kv", torch.zeros(8, 16))

    def forward(self, x):
        self.kv[: x.shape[0]] = x
        return x * 2


_NOT_INDEPENDENT = {
    "a reduction over the batch": (lambda x: x.sum(0), "reduction over the batch"),
    "a product that contracts the batch": (lambda x: x @ x.T, "matrix product"),
    "softmax over the batch": (lambda x: x.softmax(0), "along the batch axis"),
    "dropout": (lambda x: nn.functional.dropout(x, 0.5, training=True), "random"),
    "a host read of a row": (lambda x: x * x[0, 0].item(), "on the host"),
    "a tensor the check did not see made": (
        lambda x: x + torch.from_dlpack(np.ones(16, dtype=np.float32)).to(x.device),  # no op dispatched
        # on CUDA the host-to-device copy already keeps the step from being captured
        {"emulate": "unseen origin", "cuda": "CPU tensor"},
    ),
}


@pytest.mark.parametrize("case", list(_NOT_INDEPENDENT))
def test_rows_that_are_not_independent_are_not_padded(backend, case):
    fn, reason = _NOT_INDEPENDENT[case]
    reason = reason[backend.name] if isinstance(reason, dict) else reason
    step = graph_step(fn, capture_sizes=[4], backend=backend.name)
    if case == "a host read of a row" or reason == "CPU tensor":
        with pytest.warns(UserWarning, match=reason):
            step.prepare(_rows(backend, 4))
    else:
        step.prepare(_rows(backend, 4))
    x = _rows(backend, 3)
    torch.manual_seed(1)
    got = step(x)
    torch.manual_seed(1)
    want = fn(x)
    torch.testing.assert_close(got, want)
    report = explain(step)
    assert report.padded_calls == 0
    assert reason in report.not_padded[4], report.not_padded


@pytest.mark.parametrize("make", ["batchnorm_training", "cache_written_by_row"])
def test_a_step_that_writes_its_state_by_row_is_not_padded(backend, make):
    module = (nn.BatchNorm1d(16) if make == "batchnorm_training" else _Cache()).to(backend.device)
    twin = _Cache().to(backend.device) if make != "batchnorm_training" else nn.BatchNorm1d(16).to(backend.device)
    twin.load_state_dict(module.state_dict())

    def fn(x):
        with torch.no_grad():
            return module(x)

    step = graph_step(fn, modules=[module], capture_sizes=[4], backend=backend.name)
    example = _rows(backend, 4)
    step.prepare(example)
    with torch.no_grad():
        for _ in range(3):
            twin(example)
        x = _rows(backend, 3)
        torch.testing.assert_close(step(x), twin(x))
    for b, c in zip(module.buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b, c)
    report = explain(step)
    assert report.padded_calls == 0
    assert "in place" in report.not_padded[4]


def test_the_check_bites(backend):
    """Without the row check, a padded sum over the batch adds the padding rows in."""
    with protection_off("row_independence_check"):
        step = graph_step(lambda x: x.sum(0), capture_sizes=[4], backend=backend.name)
        step.prepare(_rows(backend, 4))
        x = _rows(backend, 3)
        assert explain(step).not_padded == {}
        assert not torch.allclose(step(x), x.sum(0))


def test_a_compilers_work_on_fake_tensors_during_the_check_does_not_refuse_padding(backend):
    """A step whose checked call compiles may query fake tensors: Thunder's SDPA checker on CUDA asks PyTorch which
    attention kernel fits fake copies of its inputs, whose checks dispatch ``prim::device``. No row flows there, and
    no kernel runs: neither the row check nor, on CUDA, the scan for host work counts it, whether the fakes sit on
    the step's device or on the CPU."""

    def fn(x):
        for device in (x.device, "cpu"):
            with FakeTensorMode():
                fake = torch.empty(1, 2, 4, 8, device=device)
            torch.backends.cuda.can_use_flash_attention(SDPAParams(fake, fake, fake, None, 0.0, True, False))
        return x * 2

    step = graph_step(fn, capture_sizes=[4], backend=backend.name)
    step.prepare(_rows(backend, 4))
    x = _rows(backend, 3)
    torch.testing.assert_close(step(x), x * 2)
    report = explain(step)
    assert report.not_padded == {}
    assert report.padded_calls == 1


def test_fake_tensors_alive_in_the_process_raise_no_warning_from_the_check(backend):
    """The check notes the memory of every tensor that exists before the call. Fake tensors that a compiler left alive
    have none, and reading a fake tensor's data pointer warns (and PyTorch says it will raise)."""
    with FakeTensorMode():
        left_by_a_compiler = torch.empty(4, 16, device=backend.device)
    step = graph_step(lambda x: x * 2, capture_sizes=[4], backend=backend.name)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*FakeTensor.*")
        step.prepare(_rows(backend, 4))
        x = _rows(backend, 3)
        torch.testing.assert_close(step(x), x * 2)
    assert explain(step).padded_calls == 1
    del left_by_a_compiler


def test_a_step_that_runs_torch_compiled_code_is_not_padded(backend):
    """Compiled code runs kernels the row check never sees, such as this sum over the batch written into a tensor the
    step keeps: padded, the call would add the padding rows to it."""
    total = torch.zeros(16, device=backend.device)

    @torch.compile(fullgraph=True)
    def accumulate(y):
        total.add_(y.sum(0))

    def fn(x):
        accumulate(x)
        return x * 2

    step = graph_step(fn, capture_sizes=[4], backend=backend.name)
    step.prepare(_rows(backend, 4))
    before, x = total.clone(), _rows(backend, 3)
    torch.testing.assert_close(step(x), x * 2)
    torch.testing.assert_close(total, before + x.sum(0))
    report = explain(step)
    assert "torch.compile'd code" in report.not_padded[4]
    assert report.padded_calls == 0


def test_a_process_that_ran_torch_compile_pads_a_step_that_runs_no_compiled_code(backend):
    doubled = torch.compile(lambda x: x * 2, backend="eager")
    doubled(_rows(backend, 2))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    step = graph_step(lambda x: (x * 2).tanh(), capture_sizes=[4], backend=backend.name)
    step.prepare(_rows(backend, 4))
    x = _rows(backend, 3)
    torch.testing.assert_close(step(x), (x * 2).tanh())
    assert explain(step).padded_calls == 1


@contextlib.contextmanager
def _another_profile_function():
    sys.setprofile(lambda frame, event, arg: None)
    try:
        yield
    finally:
        sys.setprofile(None)


def test_a_process_that_ran_torch_compile_is_not_padded_where_a_profiler_hides_compiled_code(backend):
    """Another profile function leaves the call unwatched: any torch.compile in the process then counts."""
    torch.compile(lambda x: x + 1, backend="eager")(_rows(backend, 2))
    step = graph_step(lambda x: (x * 2).tanh(), capture_sizes=[4], backend=backend.name)
    with _another_profile_function():
        step.prepare(_rows(backend, 4))  # its warm-up calls are checked
    step(_rows(backend, 3))
    assert "the process has run torch.compile" in explain(step).not_padded[4]


def test_a_step_that_compiles_the_first_graph_of_the_process_unwatched_is_not_padded(backend, monkeypatch):
    """Unwatched, the checked call is judged by the compiled graphs of the process after it too."""
    monkeypatch.setitem(torch._dynamo.utils.counters["stats"], "unique_graphs", 0)
    doubled = torch.compile(lambda x: x * 2, backend="eager")  # compiled in the checked call, the first
    step = graph_step(lambda x: doubled(x).tanh(), capture_sizes=[4], warmup_calls=1, backend=backend.name)
    with _another_profile_function():
        step.prepare(_rows(backend, 4))  # its warm-up calls are checked
    step(_rows(backend, 3))
    assert "the process has run torch.compile" in explain(step).not_padded[4]


def test_a_call_whose_argument_requires_grad_is_not_padded(backend):
    """Its gradient would not reach it through the graph's buffer: the call runs as is."""
    weight = torch.randn(16, 16, device=backend.device)

    def fn(x):
        return (x @ weight).tanh()

    step = graph_step(fn, capture_sizes=[4], backend=backend.name)
    step.prepare(_rows(backend, 4))
    x = _rows(backend, 3)
    x_step, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    step(x_step).sum().backward()
    fn(x_eager).sum().backward()
    torch.testing.assert_close(x_step.grad, x_eager.grad)
    assert explain(step).padded_calls == 0


def test_more_rows_than_the_largest_size_run_as_is(backend):
    model, serve = _serving(backend)
    step = graph_step(serve, capture_sizes=[2], backend=backend.name)
    x = _rows(backend, 5)
    with torch.no_grad():
        torch.testing.assert_close(step(x), model(x).softmax(-1))
    assert explain(step).plain_calls == {"more rows than the largest capture size": 1}


def test_strict_mode_raises_where_padding_is_refused(backend):
    step = graph_step(lambda x: x.sum(0), capture_sizes=[4], strict=True, backend=backend.name)
    step.prepare(_rows(backend, 4))
    with pytest.raises(StrictModeError, match="reduction over the batch"):
        step(_rows(backend, 3))


@pytest.mark.parametrize("sizes", [[], [0, 2], [2, 2], [1.5], "4", [True]])
def test_bad_capture_sizes_raise(sizes):
    with pytest.raises(ValueError, match="capture_sizes"):
        graph_step(lambda x: x, capture_sizes=sizes, backend="emulate")


def test_arguments_that_disagree_on_their_rows_raise():
    step = graph_step(lambda x, y: x + y, capture_sizes=[4], backend="emulate")
    with pytest.raises(ValueError, match="same number of rows"):
        step(torch.ones(3, 2), torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="no capture_sizes"):
        graph_step(lambda x: x, backend="emulate").prepare(torch.ones(2))
