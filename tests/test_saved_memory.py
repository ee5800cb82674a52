"""Saved tensors give their memory back at their last read inside a backward graph's capture (``runtime.release``).

The CPU replay backend frees nothing: after every replay of a graph that may reuse that memory it overwrites the
given-back tensors with NaN, so a replay at the wrong time shows as a wrong gradient or a changed tensor.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from contextlib import nullcontext

import pytest
import thunder
import torch
from thunder.extend import register_executor

from benchmarks.models import mlp
from cudagraphex import CUDAGraphExecutor, cudagraphex, explain
from cudagraphex.runtime.release import read_after_call
from tests.helpers import BACKENDS, assert_grads_close, jit, protection_off, twin


def _backward_graphs(jm) -> list:
    return [g for r in explain(jm).regions if r.phase == "backward" for g in r.graphs]


def _backward_graph(jm):
    """The one backward graph of ``jm``."""
    graphs = _backward_graphs(jm)
    assert len(graphs) == 1, str(explain(jm))
    return graphs[0]


def _fresh(n: int, make) -> list[torch.Tensor]:
    """``n`` inputs made up front and all alive, so that no two calls see one at the same address. A caller's tensor
    at the same address on the warm-up and the capturing call is read in place, and when it moves later (the CPU
    allocator may or may not hand its memory out again) the region captures one more graph, which these tests count.
    For the same reason the tests pass each backward one cotangent for all calls instead of one autograd makes afresh."""
    return [make() for _ in range(n)]


def test_a_backward_graph_gives_back_the_saved_tensors_it_reads_last(backend):
    model = mlp(3, 64).to(backend.device)
    reference = twin(model)
    jm = jit(model, backend.executor)
    cotangent = torch.randn(8, 64, device=backend.device)
    for x in _fresh(4, lambda: torch.randn(8, 64, device=backend.device)):
        jm(x).backward(cotangent)
        reference(x).backward(cotangent)
        assert_grads_close(model, reference)
        model.zero_grad()
        reference.zero_grad()
    graph = _backward_graph(jm)
    assert graph.given_back and graph.given_back_bytes > 0
    assert graph.replays == 3
    assert "gave back the memory of" in str(explain(jm))


def test_an_output_in_given_back_memory_is_not_handed_out_as_a_view_of_the_saved_tensor(backend):
    """A backward graph's capture may put an output (here a bias's gradient) in the memory a saved tensor gave back,
    at that tensor's address; it is still its own tensor, not an alias of the saved one."""
    model = mlp(3, 64).to(backend.device)
    reference = twin(model)
    jm = jit(model, backend.executor)
    cotangent = torch.randn(8, 64, device=backend.device)
    for x in _fresh(4, lambda: torch.randn(8, 64, device=backend.device)):
        jm(x).backward(cotangent)
        reference(x).backward(cotangent)
        assert_grads_close(model, reference)
        for name, p in model.named_parameters():
            nbytes = p.grad.untyped_storage().nbytes()
            assert nbytes == p.grad.numel() * p.grad.element_size(), f"{name}'s gradient lives in {nbytes} bytes"
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert _backward_graph(jm).given_back


def test_a_broadcast_gradient_in_given_back_memory_keeps_its_values(backend):
    """The gradient of ``mean(0)`` broadcasts one row (stride 0); Inductor's backward puts it in memory a saved tensor
    gave back, which the CPU replay backend overwrites around the outputs living there."""
    from thunder.executors.torch_compile import torch_compile_ex

    def f(x):
        return torch.sigmoid(x.mean(0))

    jf = thunder.jit(f, executors=[backend.executor, torch_compile_ex, *thunder.get_default_executors()])
    for x in _fresh(4, lambda: torch.randn(3, 4, device=backend.device, requires_grad=True)):
        jf(x).sum().backward()
        expected = x.detach().clone().requires_grad_()
        f(expected).sum().backward()
        torch.testing.assert_close(x.grad, expected.grad)
    assert any(g.given_back for g in _backward_graphs(jf))


def test_a_gpt_backward_with_many_inputs_gives_back_saved_memory(backend):
    """The backward region of a GPT takes dozens of inputs; how many references the call itself holds on each depends
    on their number."""
    *_, jm = _gpt_steps_beside_eager(backend, backend.executor)
    graph = _backward_graph(jm)
    assert len(graph.given_back) >= 20


def _gpt_steps_beside_eager(backend, executor):
    """Three training steps of a small GPT compiled with ``executor``, each beside its eager twin, whose gradients
    must match; yields the compiled model after each step."""
    from benchmarks.models import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=128)).to(backend.device)
    reference = twin(model)
    jm = jit(model, executor)
    one = torch.ones((), device=backend.device)
    for idx in _fresh(3, lambda: torch.randint(0, 128, (2, 32), device=backend.device)):
        jm(idx, idx).backward(one)
        reference(idx, idx).backward(one)
        assert_grads_close(model, reference, atol=1e-4, rtol=1e-4)
        model.zero_grad()
        reference.zero_grad()
        yield jm


def _square_of_a_view(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = (x @ w).view(2, 4, 8)
    return (y * y).sum()


def _three_steps_beside_eager(fn, rows: int, backend):
    """Three calls of ``fn(x, w)`` compiled, each with its backward, beside ``fn`` on a copy of ``w``, whose gradient
    must match; returns the compiled function's backward graph."""
    w = torch.randn(8, 8, device=backend.device, requires_grad=True)
    reference = w.detach().clone().requires_grad_()
    jf = jit(fn, backend.executor)
    one = torch.ones((), device=backend.device)
    for x in _fresh(3, lambda: torch.randn(rows, 8, device=backend.device)):
        jf(x, w).backward(one)
        fn(x, reference).backward(one)
        torch.testing.assert_close(w.grad, reference.grad)
    return _backward_graph(jf)


def test_a_saved_view_is_given_back_through_the_alias_thunder_saves(backend):
    """Thunder saves a detached alias of a saved tensor that is a view; its storage is given back all the same."""
    graph = _three_steps_beside_eager(_square_of_a_view, 8, backend)
    assert graph.given_back and graph.given_back_bytes > 0


def _softmax_used_twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = (x @ w).softmax(-1)
    b = torch.nn.functional.dropout(a, 0.0)  # the same tensor as ``a``: the backward takes it under two names
    return (a * b).sum() + (b @ w).sum()


def test_a_tensor_saved_under_two_names_is_given_back_after_both_are_read(backend):
    graph = _three_steps_beside_eager(_softmax_used_twice, 4, backend)
    assert len(graph.given_back) == 2 and graph.given_back_bytes == 4 * 8 * 4


def _retain_graph_grads_match(backend, executor=None) -> bool:
    """Two plain steps (the backward graph gives saved memory back), then two steps of two backwards each."""
    model = mlp(3, 16).to(backend.device)
    reference = twin(model)
    jm = jit(model, executor or backend.executor)
    cotangent = torch.randn(4, 16, device=backend.device)
    ok = True
    for step, x in enumerate(_fresh(4, lambda: torch.randn(4, 16, device=backend.device))):
        gc.collect()  # garbage of an earlier test holding a graph's output would make a replay wait
        out, ref = jm(x), reference(x)
        for last in (False, True) if step >= 2 else (True,):
            out.backward(cotangent, retain_graph=not last)
            ref.backward(cotangent, retain_graph=not last)
        # assert_close's float32 tolerances; a replay that read overwritten memory gives NaN
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        ok &= all(torch.allclose(p.grad, r.grad, rtol=1.3e-6, atol=1e-5) for p, r in pairs)
        del out, ref
        model.zero_grad()
        reference.zero_grad()
    return ok


def test_a_backward_that_retains_its_graph_reads_its_saved_tensors_intact(backend):
    assert _retain_graph_grads_match(backend)


def test_given_back_guard_bites_with_retain_graph():
    with protection_off("given_back_guard"):
        assert not _retain_graph_grads_match(BACKENDS["emulate"])


def _on(storage: torch.UntypedStorage, like: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Reads ``like``'s elements from ``storage`` when called (holding the storage, not the tensor)."""
    offset, size, stride, dtype = like.storage_offset(), like.shape, like.stride(), like.dtype
    return lambda: torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def _hooked_saved_tensors_intact(backend, executor=None, keep_storage: bool = False, hooked_from: int = 0) -> bool:
    """A saved-tensor hook keeps each saved tensor (or, with ``keep_storage``, only its storage) with a copy of its
    value, on the calls from ``hooked_from`` on; after the backward they must agree."""
    model = mlp(3, 16).to(backend.device)
    jm = jit(model, executor or backend.executor)
    kept: list[tuple[torch.Tensor | Callable[[], torch.Tensor], torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if keep_storage:
            kept.append((_on(t.untyped_storage(), t), t.detach().clone()))
        else:
            kept.append((t, t.detach().clone()))
        return t

    cotangent = torch.randn(4, 16, device=backend.device)
    ok = True
    for i, x in enumerate(_fresh(4, lambda: torch.randn(4, 16, device=backend.device))):
        kept.clear()
        gc.collect()  # as in _retain_graph_grads_match
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if i >= hooked_from else nullcontext():
            out = jm(x)
        out.backward(cotangent)
        del out
        ok &= all(torch.equal(t() if callable(t) else t, value) for t, value in kept)
    kept.clear()
    return ok


def test_saved_tensors_a_hook_keeps_are_not_given_back(backend):
    assert _hooked_saved_tensors_intact(backend)


# -- eager runs ------------------------------------------------------------------------------------------------------

#: Executors whose regions warm up for 100 calls: every call of these tests runs its regions eagerly.
_WARMING_UP = {
    name: CUDAGraphExecutor(f"cudagraphex_{name}_warming_up", backend=name, warmup_calls=100)
    for name in ("emulate", "cuda")
}
for _executor in _WARMING_UP.values():
    register_executor(_executor)


def test_an_eager_backward_frees_the_saved_tensors_it_reads_last(backend):
    """A plain backward frees each saved tensor after its last use; so does a backward region running eagerly (on the
    CPU backend it overwrites them with NaN instead, so a tensor freed too early shows in the gradients)."""
    freed = []
    for jm in _gpt_steps_beside_eager(backend, _WARMING_UP[backend.name]):
        report = explain(jm)
        freed.append(sum(r.eager_freed_bytes for r in report.regions if r.phase == "backward"))
    assert report.num_graphs == 0
    assert 0 < freed[0] and freed == [freed[0], 2 * freed[0], 3 * freed[0]], freed
    assert "eager calls freed" in str(report)


def test_an_eager_backward_that_retains_its_graph_frees_nothing(backend):
    assert _retain_graph_grads_match(backend, _WARMING_UP[backend.name])


def test_saved_tensors_a_hook_keeps_are_not_freed_by_an_eager_backward(backend):
    assert _hooked_saved_tensors_intact(backend, _WARMING_UP[backend.name])


#: How the backward runs: eagerly, or as graphs with the hook from the first call or only from after the capture.
_RUNS = {"eagerly": 0, "graphs": 0, "graphs hooked after the capture": 2}


@pytest.mark.parametrize("runs", list(_RUNS))
def test_a_saved_tensors_storage_a_hook_keeps_is_neither_given_back_nor_freed(backend, runs):
    """The hook holds the storage alone: the tensor's reference count is as if nothing held it."""
    executor = _WARMING_UP[backend.name] if runs == "eagerly" else backend.executor
    assert _hooked_saved_tensors_intact(backend, executor, keep_storage=True, hooked_from=_RUNS[runs])


@pytest.mark.parametrize("runs", list(_RUNS))
@pytest.mark.parametrize("keep_storage", [False, True])
def test_given_back_guard_bites_on_saved_tensors_a_hook_keeps(keep_storage, runs):
    executor = _WARMING_UP["emulate"] if runs == "eagerly" else BACKENDS["emulate"].executor
    with protection_off("given_back_guard"):
        assert not _hooked_saved_tensors_intact(BACKENDS["emulate"], executor, keep_storage, _RUNS[runs])


class _Recorder:
    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.read: set[str] | None = None

    def __call__(self, *args: object) -> int:
        self.read = read_after_call(sys._getframe(1), self.names)
        return 0


def _reads_b_again(region, a, b):
    out = region(a, b)
    c = [b]
    del a, b
    return out, c


def _branches(region, a, b):
    out = region(a, b)
    if out:
        return out
    del a, b
    return out


def test_the_callers_code_decides_which_arguments_it_reads_after_the_call():
    recorder = _Recorder(["a", "b"])
    _reads_b_again(recorder, 1, 2)
    assert recorder.read == {"b"}
    _branches(recorder, 1, 2)
    assert recorder.read == {"a", "b"}  # code that jumps may read anything again
    recorder.names = ["a", "not_a_local"]
    _reads_b_again(recorder, 1, 2)
    assert recorder.read == {"a", "not_a_local"}


@pytest.mark.cuda
def test_giving_saved_memory_back_shrinks_the_backward_graphs_memory():
    def backward_graph_memory(retain_graph: bool) -> tuple[int, int]:
        model = mlp(4, 1024).cuda()
        jm = jit(model, cudagraphex)
        x = torch.randn(512, 1024, device="cuda")
        for _ in range(3):
            loss = jm(x).square().mean()
            loss.backward(retain_graph=retain_graph)  # a graph kept for a second backward gives nothing back
            del loss
        graph = _backward_graph(jm)
        assert bool(graph.given_back) is not retain_graph
        return graph.pool_bytes, graph.given_back_bytes

    kept_bytes, _ = backward_graph_memory(retain_graph=True)
    given_bytes, given_back = backward_graph_memory(retain_graph=False)
    assert given_back > 0
    assert given_bytes < kept_bytes, (given_bytes, kept_bytes)


class _Breaking(torch.nn.Module):
    """Two graph-safe runs with a host read between them: the forward has two regions."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = mlp(2, 32), mlp(2, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        scale = 1.0 + (h.detach().abs().amax() > 1e9).float().item()  # a host read: keeps the graphs apart
        return self.second(h * scale)


def test_training_with_new_shapes_and_eval_calls_between_steps(backend):
    """Batch sizes change and eval calls whose outputs are kept run between steps: the backward graphs give saved
    memory back, and every graph captured later into the pool must wait for it."""
    model = _Breaking().to(backend.device)
    reference = twin(model)
    jm = jit(model, backend.executor)
    kept = []
    for batch in (8, 8, 8, 4, 4, 8, 4, 8):
        x = torch.randn(batch, 32, device=backend.device)
        loss, ref = jm(x).square().mean(), reference(x).square().mean()
        torch.testing.assert_close(loss, ref)
        with torch.no_grad():
            kept.append((jm(x), reference(x)))
        loss.backward()
        ref.backward()
        assert_grads_close(model, reference)
        model.zero_grad()
        reference.zero_grad()
    for got, want in kept:
        torch.testing.assert_close(got, want)
    assert sum(len(g.given_back) for g in _backward_graphs(jm)) > 0


@pytest.mark.cuda
def test_a_backward_reading_attention_rng_state_captures_on_the_call_after_its_warm_up():
    """An eager forward returns attention's dropout RNG state in host memory, a forward graph in device memory, so the
    backward's inputs change device between its warm-up and the next call; that call captures all the same, instead of
    warming up again beside the forward graph's saved tensors."""
    from benchmarks.models import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=64, block_size=64, vocab_size=128)).cuda()
    jm = jit(model, cudagraphex)
    idx = torch.randint(0, 128, (2, 64), device="cuda")
    for _ in range(2):
        jm(idx, idx).backward()
        model.zero_grad(set_to_none=True)
    (region,) = [r for r in explain(jm).regions if r.phase == "backward"]
    assert region.eager_calls == {"warm-up": 1} and len(region.graphs) == 1, str(explain(jm))


@pytest.mark.cuda
def test_region_graphs_train_within_a_twentieth_of_thunders_peak_memory():
    """The peak of allocated memory over a few training steps of a GPT, from before its model is built: region graphs
    at most 1.05x plain Thunder's.

    A first round of both variants builds the process-wide caches: cuBLAS's workspaces (32 MiB each on an H100) for
    each stream and thread that runs a matmul, the capture stream's among them. Whether this process had built them
    before depends on the tests it ran, and on a model this small they decide the verdict. Each measurement starts
    after a garbage collection: a compiled function's reference cycles keep its model alive until one runs."""
    import thunder

    from benchmarks.models import GPT, GPTConfig

    def peak(executors: list | None) -> tuple[int, str]:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=512)).cuda()
        jm = thunder.jit(model) if executors is None else thunder.jit(model, executors=executors)
        idx = torch.randint(0, 512, (8, 256), device="cuda")
        for _ in range(4):
            jm(idx, idx).backward()
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        used = torch.cuda.max_memory_allocated() - base
        report = "" if executors is None else str(explain(jm))
        del jm, model, idx
        return used, report

    graphed_executors = [cudagraphex, *thunder.get_default_executors()]
    peak(None), peak(graphed_executors)
    plain, _ = peak(None)
    graphed, report = peak(graphed_executors)
    assert graphed <= 1.05 * plain, (graphed / 2**20, plain / 2**20, report)
