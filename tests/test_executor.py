"""The executor at run time: registration, options, list positions, inputs and outputs of graphs, results against
eager."""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
import weakref

import pytest
import thunder
import torch
from thunder.extend import FusionExecutor, OperatorExecutor, get_executor, register_executor

from benchmarks.models import GPT, GPTConfig, mlp
from cudagraphex import CUDAGraphExecutor, cudagraphex, explain, inspect
from cudagraphex.planning.static_inputs import InputKind
from tests.contract.scenarios import Keeps
from tests.helpers import (
    assert_grads_close,
    conv_bn,
    emulated,
    graphs,
    jit,
    num_graphs,
    regions,
    replays,
    small_gpt,
    square_written_by_its_own_mul,
    twin,
    with_item,
)

POSITIONS = ["first", "last"]


def test_public_names_and_registration():
    assert isinstance(cudagraphex, CUDAGraphExecutor)
    assert isinstance(cudagraphex, FusionExecutor)
    assert get_executor("cudagraphex") is cudagraphex
    assert cudagraphex.name == "cudagraphex"
    assert cudagraphex.device_type == "cuda"
    assert emulated.device_type == "cpu"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_region_size": 0},
        {"max_graphs_per_region": -1},
        {"max_graphs_per_region": 1.5},
        {"warmup_calls": -1},
        {"share_pool": "yes"},
        {"strict": 1},
        {"backend": "rocm"},
    ],
)
def test_invalid_options_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        CUDAGraphExecutor("bad", **kwargs)


def index_copy_into_an_input(x, cache, pos):
    h = x * 2
    cache.index_copy_(0, pos, h[:2])
    return h + cache[:4]


def in_place_op_on_an_intermediate(x, w):
    h = x @ w
    h.add_(0.25)
    return h[:, :4] * 2.0


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("fn", [index_copy_into_an_input, in_place_op_on_an_intermediate], ids=lambda fn: fn.__name__)
def test_training_calls_with_in_place_writes_match_eager(backend, position, fn):
    # Both backward regions read a zeros that Thunder's rematerialization dropped from them.
    jf = jit(fn, backend.executor, position)
    for _ in range(4):
        if fn is index_copy_into_an_input:
            grad_of = 0
            args = [torch.randn(4, 8), torch.zeros(6, 8), torch.tensor([0, 3])]
        else:
            grad_of = 1
            args = [torch.randn(3, 8), torch.randn(8, 8)]
        args = [a.to(backend.device).requires_grad_(i == grad_of) for i, a in enumerate(args)]
        reference = [a.detach().clone().requires_grad_(i == grad_of) for i, a in enumerate(args)]
        out, expected = jf(*args), fn(*reference)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(args, reference)  # the written cache
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close(args[grad_of].grad, reference[grad_of].grad)
    assert replays(jf, backend.executor) >= 2


def write_after_item(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    scaled = x * x.mean().item()
    x[0].add_(1)
    return scaled * k


def test_an_in_place_write_whose_output_nothing_reads_stays_in_its_graph(backend):
    # The second graph's input comes from a symbol left out of graphs, whose output is renamed when it is lowered:
    # Thunder hands the graph back with copies of its members, add_ among them, whose output nothing reads. A copy
    # of a planned member is planned, not a recomputation to drop.
    jf = jit(write_after_item, backend.executor)
    for _ in range(4):
        x, k = torch.randn(2, 4, device=backend.device), torch.tensor(0.7, device=backend.device)
        expected_x = x.clone()
        expected = write_after_item(expected_x, k)
        with torch.no_grad():
            out = jf(x, k)
        torch.testing.assert_close((out, x), (expected, expected_x))
    assert replays(jf, backend.executor) >= 2


class CacheWrittenThenRead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(6, 6))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.index_copy_(0, pos, x.detach())
        scale = self.cache[: x.shape[0]].mean().item()
        scaled = x * scale
        return self.cache.index_select(0, pos), scaled


def test_training_with_a_backward_graph_that_recomputes_from_one_thunder_removed(backend):
    # The backward's product with the host value of .item() stays out of graphs and splits the backward in two;
    # rematerialization makes the second graph recompute what the first computed (zeros among it), and Thunder removes
    # the first and drops zeros from the second: it is put back.
    model = CacheWrittenThenRead().to(backend.device)
    reference = CacheWrittenThenRead().to(backend.device)
    jm = jit(model, backend.executor)
    for _ in range(4):
        x = torch.randn(3, 6, device=backend.device, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        pos = torch.randperm(6, device=backend.device)[:3]
        (rows, scaled), (rows_ref, scaled_ref) = jm(x, pos), reference(x_ref, pos)
        torch.testing.assert_close((rows, scaled, model.cache), (rows_ref, scaled_ref, reference.cache))
        scaled.sum().backward()
        scaled_ref.sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)
    assert replays(jm, backend.executor) >= 2


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("model_name", ["mlp", "gpt", "conv_bn"])
def test_training_matches_eager(backend, position, model_name):
    device = backend.device
    if model_name == "mlp":
        model, make = mlp(4, 32).to(device), lambda: (torch.randn(8, 32, device=device),)
    elif model_name == "gpt":
        model = small_gpt(device)
        make = lambda: (torch.randint(0, 64, (2, 16), device=device), torch.randint(0, 64, (2, 16), device=device))
    else:
        model, make = conv_bn().to(device), lambda: (torch.randn(4, 3, 8, 8, device=device),)
    reference = twin(model)
    jm = jit(model, backend.executor, position)
    for _ in range(3):
        args = make()
        out, expected = jm(*args), reference(*args)
        torch.testing.assert_close(out, expected)
        out.float().square().mean().backward()
        expected.float().square().mean().backward()
        assert_grads_close(model, reference)
        for b, r in zip(model.buffers(), reference.buffers(), strict=True):
            torch.testing.assert_close(b, r)
        model.zero_grad()
        reference.zero_grad()
    assert num_graphs(jm, backend.executor, "forward") >= 1
    assert num_graphs(jm, backend.executor, "backward") >= 1
    assert replays(jm, backend.executor) >= 2


@pytest.mark.parametrize("position", POSITIONS)
def test_item_in_the_middle_matches_eager(backend, position):
    jf = jit(with_item, backend.executor, position)
    for _ in range(3):
        x = torch.randn(16, device=backend.device, requires_grad=True)
        out = jf(x)
        torch.testing.assert_close(out, with_item(x))
        out.sum().backward()
        x_ref = x.detach().clone().requires_grad_()
        with_item(x_ref).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)


def test_executor_after_cudagraphex_keeps_its_grad_rule():
    """Thunder takes a grad rule from the first executor that claims a symbol; cudagraphex must not hide later ones."""
    custom = OperatorExecutor("custom_tanh_grad")
    register_executor(custom)

    def tanh_fwd(a):
        return torch.tanh(a)

    custom_tanh = custom.register_operator("custom_tanh", like=thunder.torch.tanh, fn=tanh_fwd)
    custom_tanh_bwd = custom.register_operator(
        "custom_tanh_bwd", meta=lambda y, g: thunder.TensorProxy(like=g), fn=lambda y, g: g * (1 - y * y)
    )

    def grad_rule(a):
        y = custom_tanh(a)
        g = thunder.core.transforms.get_grad(y)
        thunder.core.transforms.put_grad(a, custom_tanh_bwd(y, g))
        return y

    custom.register_implementation(thunder.torch.tanh, custom_tanh, grad_transform=grad_rule)

    def f(x):
        return torch.tanh(x * 2) * 3

    for position in POSITIONS:
        execs = [emulated, custom] if position == "first" else [custom, emulated]
        jf = thunder.jit(f, executors=execs)
        x = torch.randn(8, requires_grad=True)
        jf(x).sum().backward()
        backward_trace = str(thunder.last_backward_traces(jf)[-1])
        assert "custom_tanh_bwd" in backward_trace, position


def test_graph_is_reused_for_new_inputs_of_the_same_shape(backend):
    model = mlp(4, 32).to(backend.device)
    jm = jit(model, backend.executor)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(8, 32, device=backend.device)
            torch.testing.assert_close(jm(x), model(x))
    assert num_graphs(jm, backend.executor) == 1
    assert replays(jm, backend.executor) == 5  # the first call is the warm-up


def test_expanded_input_whose_buffer_an_output_aliases_is_replayed(backend):
    # The graph reads an expanded input through a view of a small buffer, and returns another view of that buffer.
    def f(x, w):
        return (x * w).sum(0), x.t()

    jf = jit(f, backend.executor)
    w = torch.randn(8, 4, device=backend.device)
    held = []
    for _ in range(6):
        x = torch.randn(1, 4, device=backend.device).expand(8, 4)
        total, transposed = jf(x, w)
        torch.testing.assert_close(total, (x * w).sum(0))
        torch.testing.assert_close(transposed, x.t())
        held.append((x, transposed))
        del total, transposed
    for x, transposed in held:
        torch.testing.assert_close(transposed, x.t())
    held.clear()
    for _ in range(3):
        x = torch.randn(1, 4, device=backend.device).expand(8, 4)
        torch.testing.assert_close(jf(x, w)[1], x.t())
    # Once nothing holds its outputs, the first graph is replayed again instead of running the region eagerly.
    assert replays(jf, backend.executor) >= 7


def test_output_that_views_a_copied_input_is_a_view_of_the_callers_tensor(backend):
    # The graph reads a copy of x and returns a view of it: that output is handed out as the same view of the caller's
    # x, never of the graph's input buffer, so a write into x shows through it as in eager. Passed back in, it is an
    # ordinary input.
    def f(x, w):
        return x * w + 1, x.t()

    jf = jit(f, backend.executor)
    w = torch.randn(4, 8, device=backend.device)
    kept = [torch.randn(4, 8, device=backend.device) for _ in range(4)]  # distinct addresses: x is copied
    for x in kept:
        out, transposed = jf(x, w)
        assert transposed._base is x
        x[0, 1] = 5.0
        assert transposed[1, 0] == 5.0
    x_again = transposed.t()
    expected = x_again * w + 1
    out, _ = jf(x_again, w)
    torch.testing.assert_close(out, expected)
    assert replays(jf, backend.executor) >= 3


def test_output_that_views_a_detached_input_requires_grad_as_without_graphs(backend):
    # ``x.detach().unsqueeze(0)`` views an alias of x that is no view: under no_grad it requires no grad, as without
    # graphs, where an alias rebuilt as a view of x would; it shares x's memory and version counter either way.
    def f(x, w):
        return (x * w).sin(), x.detach().unsqueeze(0), x.t()

    jf, plain = jit(f, backend.executor), thunder.jit(f)
    w = torch.randn(4, 8, device=backend.device)
    kept = [torch.randn(4, 8, device=backend.device, requires_grad=True) for _ in range(6)]
    for call, x in enumerate(kept):
        with torch.no_grad() if call % 2 else contextlib.nullcontext():
            outs, expected = jf(x, w), plain(x, w)
        assert [(o.requires_grad, o.is_leaf) for o in outs] == [(e.requires_grad, e.is_leaf) for e in expected]
        detached = outs[1]
        assert detached.data_ptr() == x.data_ptr() and torch.equal(detached, expected[1])
        version = detached._version
        with torch.no_grad():
            x.add_(1)
        assert detached._version == version + 1
    assert replays(jf, backend.executor) >= 3


def test_output_that_views_one_of_several_inputs_on_its_storage_is_rebuilt_on_the_one_it_views(backend):
    # The host value splits x, x.detach() and a row of it into the next regions' inputs, all on x's storage: x and
    # its reshape are handed out as x itself and a view of x that requires grad, as without graphs, never rebuilt on
    # the detached alias.
    def f(x):
        v = x.detach()
        v[0].add_(1)
        h = v.mean().item()
        return v * h, x.reshape(-1), x

    ex = CUDAGraphExecutor(
        f"cudagraphex_shared_storage_{backend.name}", backend=backend.executor.options.backend, min_region_size=1
    )
    jf = jit(f, ex)
    x = torch.randn(4, 6, device=backend.device, requires_grad=True)
    for _ in range(4):
        with torch.no_grad():
            expected = f(x.detach().clone().requires_grad_(True))
            out, flat, same = jf(x)
        assert same is x and flat._base is x and flat.requires_grad == expected[1].requires_grad
        torch.testing.assert_close(out, expected[0])
    assert replays(jf, ex) >= 3


def test_output_that_views_an_input_whose_layout_no_buffer_keeps_runs_eagerly(backend):
    # An overlapping input (windows of one storage) is copied into a contiguous buffer, on which the view the graph
    # returns cannot be rebuilt on the caller's tensor: the capture fails with that reason, and calls stay correct.
    jf = jit(lambda x: ((x * 2).sin(), x.t()), backend.executor)
    for _ in range(4):
        base = torch.randn(8, device=backend.device)
        x = base.as_strided((4, 4), (1, 1))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="cudagraphex: capturing region")
            y, transposed = jf(x)
        torch.testing.assert_close(y, (x * 2).sin())
        assert transposed._base is base and torch.equal(transposed, x.t())
    (region,) = explain(jf).regions
    assert "whose layout its buffer does not keep" in region.disabled_reason


def test_strided_input_is_copied_into_a_buffer_of_its_layout(backend):
    # A reduction over another layout may round differently: results equal Thunder's to the last bit.
    jf, plain = jit(lambda x: x.sum(0) * 2, backend.executor), thunder.jit(lambda x: x.sum(0) * 2)
    for _ in range(4):
        x = torch.randn(64, 24, device=backend.device)[:, ::2]
        assert torch.equal(jf(x), plain(x))
    assert replays(jf, backend.executor) >= 2


def sin_scaled(x, w):
    return torch.sin(x) * w + 1


def test_caller_tensors_that_stay_put_are_read_in_place(backend):
    # At the same address on the warm-up and the capture call, both inputs are read where they are: no copy, and a
    # write the caller makes between calls is seen.
    jf = jit(sin_scaled, backend.executor)
    x, w = torch.randn(8, device=backend.device), torch.randn(8, device=backend.device)
    for _ in range(3):
        torch.testing.assert_close(jf(x, w), sin_scaled(x, w))
    x.mul_(2)
    torch.testing.assert_close(jf(x, w), sin_scaled(x, w))
    (region,) = regions(jf, backend.executor)
    (instance,) = region.instances
    assert [region.info.input_names[i] for i in instance.read_in_place] == ["x", "w"]
    assert instance.buffers == []
    assert replays(jf, backend.executor) == 3
    assert "reads in place: x, w" in str(explain(jf))


def test_caller_tensor_read_in_place_that_moves_is_copied_from_then_on(backend):
    jf = jit(sin_scaled, backend.executor)
    x, w = torch.randn(8, device=backend.device), torch.randn(8, device=backend.device)
    jf(x, w)
    jf(x, w)
    y = torch.randn(8, device=backend.device)  # x is alive: y is elsewhere
    torch.testing.assert_close(jf(y, w), sin_scaled(y, w))
    (region,) = regions(jf, backend.executor)
    assert region.demoted == ["x"] and region.kinds[0] is InputKind.COPIED
    reads_x, copies_x = region.instances
    assert reads_x.read_in_place == [0, 1] and copies_x.read_in_place == [1]
    torch.testing.assert_close(jf(x, w), sin_scaled(x, w))
    z = torch.randn(8, device=backend.device)
    torch.testing.assert_close(jf(z, w), sin_scaled(z, w))
    assert (reads_x.replays, copies_x.replays) == (1, 3)  # the graph that copies x fits every x
    assert len(region.instances) == 2


def test_caller_tensor_new_at_the_capture_is_copied(backend):
    jf = jit(sin_scaled, backend.executor)
    w = torch.randn(8, device=backend.device)
    xs = [torch.randn(8, device=backend.device) for _ in range(4)]  # kept alive: four addresses
    for x in xs:
        torch.testing.assert_close(jf(x, w), sin_scaled(x, w))
    (region,) = regions(jf, backend.executor)
    (instance,) = region.instances
    assert instance.read_in_place == [1] and len(instance.buffers) == 1
    assert region.demoted == [] and instance.replays == 3


def test_call_that_fails_the_cxx_input_guard_replays_through_the_slow_path(backend):
    # The C++ guard of copied inputs also compares dispatch keys, which inference mode changes; the signature does not.
    def f(x):
        return torch.sin(x) * 2 + 1

    jf = jit(f, backend.executor)
    with torch.no_grad():
        for x in [torch.randn(8, device=backend.device) for _ in range(3)]:  # kept alive: x moves, so it is copied
            jf(x)
    (region,) = inspect(jf).regions()
    slow_before = region.slow_path_calls
    with torch.inference_mode():
        x = torch.randn(8, device=backend.device)
        torch.testing.assert_close(jf(x), f(x))
    assert region.slow_path_calls == slow_before + 1
    assert num_graphs(jf, backend.executor) == 1
    assert replays(jf, backend.executor) == 3


@pytest.mark.cuda
def test_a_region_that_launches_no_kernel_captures_without_a_warning():
    """A region of a ``detach`` alone records an empty graph, which replays as it should. PyTorch warns at its capture
    that an empty graph "usually means that the graph was attempted to be captured on wrong device or stream", which
    would send the user looking for a fault that is not there."""
    ex = Keeps("cudagraphex_keeps_add_out", "add", min_region_size=1)  # splits off a region of the detach
    jf = jit(lambda x, k: ((x.square() + k).detach(),), ex)
    k = torch.tensor(2.0, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            x = torch.randn(4, 2, device="cuda")
            (got,) = jf(x, k)
            torch.testing.assert_close(got, x.square() + 2)
    assert [len(r.instances) for r in regions(jf, ex)] == [1, 1]
    assert not [w for w in caught if "graph is empty" in str(w.message).lower()]


def test_graphs_die_with_the_compiled_function(backend):
    model = mlp(2, 16).to(backend.device)
    jm = jit(model, backend.executor)
    x = torch.randn(4, 16, device=backend.device)  # one input: where temporaries land would decide the graph count
    with torch.no_grad():
        for _ in range(3):
            jm(x)
    ref = weakref.ref(graphs(jm, backend.executor))
    assert num_graphs(jm, backend.executor) == 1
    del jm
    gc.collect()
    assert ref() is None


def test_cpu_program_with_the_cuda_executor_is_a_noop(caplog):
    def f(x):
        return torch.sin(x) * 2 + 1

    jf = jit(f, cudagraphex)
    with caplog.at_level(logging.INFO, logger="cudagraphex"):
        x = torch.randn(4)
        torch.testing.assert_close(jf(x), f(x))
        torch.testing.assert_close(jf(x), f(x))
    assert regions(jf, cudagraphex) == []
    notes = [r for r in caplog.records if r.name == "cudagraphex"]
    assert len(notes) == 1 and "nothing to capture" in notes[0].getMessage()


@pytest.mark.cuda
def test_nanogpt_training_uses_one_forward_and_one_backward_graph():
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=256)).cuda()
    reference = twin(model)
    jm = jit(model, cudagraphex)
    one = torch.ones((), device="cuda")  # one cotangent for every call: where autograd's would land varies
    for _ in range(3):
        idx = torch.randint(0, 256, (2, 64), device="cuda")
        targets = torch.randint(0, 256, (2, 64), device="cuda")
        loss, ref_loss = jm(idx, targets), reference(idx, targets)
        torch.testing.assert_close(loss, ref_loss)
        loss.backward(one)
        ref_loss.backward(one)
        assert_grads_close(model, reference, atol=1e-4, rtol=1e-3)
        model.zero_grad()
        reference.zero_grad()
        del loss
    assert len(regions(jm, cudagraphex, "forward")) == 1
    assert len(regions(jm, cudagraphex, "backward")) == 1
    assert num_graphs(jm, cudagraphex, "forward") == 1
    assert num_graphs(jm, cudagraphex, "backward") == 1


@pytest.mark.cuda
def test_sdpa_grad_rule_is_still_used():
    model = small_gpt("cuda").to(torch.bfloat16)
    jm = jit(model, cudagraphex)
    idx = torch.randint(0, 64, (2, 16), device="cuda")
    jm(idx).float().sum().backward()
    forward = str(thunder.last_traces(jm)[-1])
    backward = str(thunder.last_backward_traces(jm)[-1])
    # sdpaex_* (memory-efficient) or sdpafx_* (flash) symbols, both from the sdpa executor's grad rule
    assert "_grad_forward_scaled_dot_product_efficient_attention" in forward
    assert "_scaled_dot_product_efficient_attention_backward" in backward


def test_replaced_parameter_is_never_read_at_its_old_address(backend):
    model = mlp(2, 16).to(backend.device)
    jm = jit(model, backend.executor)
    x = torch.randn(4, 16, device=backend.device)
    with torch.no_grad():
        for _ in range(3):
            jm(x)
        new_weights = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
        jm.load_state_dict(new_weights, assign=True)  # new tensors at new addresses
        model.load_state_dict(new_weights)
        for _ in range(3):
            torch.testing.assert_close(jm(x), model(x))
    assert num_graphs(jm, backend.executor) == 2


def test_pruned_parameter_checks_turn_a_broken_promise_into_an_error(backend):
    from cudagraphex import ParameterMovedError, PruneParameterChecks

    model = mlp(2, 16).to(backend.device)
    jm = thunder.jit(
        model, executors=[backend.executor, *thunder.get_default_executors()], transforms=[PruneParameterChecks()]
    )
    x = torch.randn(4, 16, device=backend.device)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(jm(x), model(x))
        prologue = str(thunder.last_prologue_traces(jm)[-1])
        assert "check_tensor_shape_and_metadata(t_0_weight" not in prologue
        jm.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()}, assign=True)
        with pytest.raises(ParameterMovedError, match="t_0_weight"):
            jm(x)


def test_last_position_wraps_another_executors_fusion():
    """A fusion of many ops (here one torch.compile fusion of the whole MLP) is a region on its own."""
    from thunder.executors.torch_compile import torch_compile_ex

    model = mlp(2, 16)
    jm = thunder.jit(model, executors=[torch_compile_ex, emulated])
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 16)
            torch.testing.assert_close(jm(x), model(x))
    (region,) = regions(jm, emulated)
    assert region.info.num_ops == 4 and replays(jm, emulated) == 2
    assert "TorchCompile" in str(thunder.last_traces(jm)[-1])


def _trains_as_eager_beside_a_fuser(f, backend, s: torch.Tensor | None = None) -> None:
    """Four training calls of ``f(x, s)`` with Thunder's torch.compile executor after cudagraphex match eager's output,
    ``s`` and ``x.grad``, and graphs replay. ``s`` is the same tensor on every call if given, else a new one."""
    from thunder.executors.torch_compile import torch_compile_ex

    jf = thunder.jit(f, executors=[backend.executor, torch_compile_ex, *thunder.get_default_executors()])
    for _ in range(4):
        x = torch.randn(3, 6, device=backend.device, requires_grad=True)
        s_now = torch.randn(3, 6, device=backend.device) if s is None else s
        x_ref, s_ref = x.detach().clone().requires_grad_(), s_now.clone()
        out, expected = jf(x, s_now), f(x_ref, s_ref)
        out.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close((out, s_now, x.grad), (expected, s_ref, x_ref.grad))
    assert replays(jf, backend.executor) >= 2


def test_rematerialization_never_recomputes_an_in_place_write(backend):
    # With Thunder's torch.compile executor after cudagraphex, rematerialization would make the backward graph
    # recompute the attention's key from s as it was before the forward wrote it, and so write s a second time.
    def f(x, s):
        s.mul_(0.9).add_(s.detach())
        return torch.nn.functional.scaled_dot_product_attention(x[None], s[None], x[None])[0]

    _trains_as_eager_beside_a_fuser(f, backend)


def test_a_gradient_thunder_starts_from_zeros_is_computed_beside_a_fusion_executor(backend):
    # v's gradient is written over by add_, so Thunder's autodiff starts it from zeros, which it binds without their
    # decomposition. Thunder's dead-code elimination drops such a symbol from the fusion that holds it; the fusion
    # rebuilt from what is left would read a name nothing defines, or another tensor its lowered code gave that name.
    def f(x, s):
        v = x * 1.5
        v.add_(v)
        return torch.nn.functional.scaled_dot_product_attention(v[None], x[None], x[None])[0]

    _trains_as_eager_beside_a_fuser(f, backend)


def test_a_fusion_reading_a_graph_that_reads_a_write_of_an_earlier_graph_never_recomputes_the_write(backend):
    # Graph 1 returns v written in place; graph 2 (update_aliases alone, split off by the host read) reads it, and the
    # product with the host value is left to Thunder's torch.compile executor. Thunder rematerializes graph 1 into
    # graph 2 and then graph 2 into that fusion, which would recompute the write from a tensor graph 1 does not return.
    from thunder.executors.torch_compile import torch_compile_ex

    def f(x, w, p):
        v = torch.nn.functional.linear(x, w, p)
        v[:, 0].mul_(2)
        h = v.mean().item()
        out = v * h
        return out, out[0]

    ex = CUDAGraphExecutor(
        f"cudagraphex_chained_recompute_{backend.name}", backend=backend.executor.options.backend, min_region_size=1
    )
    jf = thunder.jit(f, executors=[ex, torch_compile_ex, *thunder.get_default_executors()])
    plain = thunder.jit(f)
    w, p = torch.randn(6, 6, device=backend.device), torch.randn(6, device=backend.device)
    for _ in range(4):
        x = torch.randn(2, 6, device=backend.device)
        results = []
        for fn in (jf, plain):
            args = [t.clone().requires_grad_() for t in (x, w, p)]
            out, row = fn(*args)
            (out.sum() + row.sum()).backward()
            results.append((out, row, *(a.grad for a in args)))
        with torch.no_grad():
            torch.testing.assert_close(results[0][:2], f(x, w, p))
        # Plain Thunder's gradients, not eager's: Thunder's grad rule for the write differs from eager's.
        torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-5)
    assert replays(jf, ex) >= 3


def test_what_only_a_write_moved_into_the_backward_reads_moves_with_it(backend):
    # Nothing the forward returns needs v, so Thunder moves v.mul_(w) into the backward, and with it the product that
    # makes v. Left in a graph, that product would stay in the forward and be saved for the backward, where the moved
    # write would land in it: autograd would then refuse the second backward through the retained graph.
    def f(x, s):
        s.add_(x)
        h = s.mean().item()
        v = s * h
        w = s.abs().sqrt()
        v.mul_(w)
        return w

    ex = CUDAGraphExecutor(
        f"cudagraphex_moved_write_{backend.name}", backend=backend.executor.options.backend, min_region_size=1
    )
    jf = thunder.jit(f, executors=[*thunder.get_default_executors(), ex])
    for _ in range(4):
        x = torch.randn(4, 4, device=backend.device, requires_grad=True)
        s = torch.randn(4, 4, device=backend.device)
        x_ref, s_ref = x.detach().clone().requires_grad_(), s.clone()
        out, expected = jf(x, s), f(x_ref, s_ref)
        cotangent = torch.randn(4, 4, device=backend.device)
        for retain in (True, False):
            (out * cotangent).sum().backward(retain_graph=retain)
            (expected * cotangent).sum().backward(retain_graph=retain)
        torch.testing.assert_close((out, s, x.grad), (expected, s_ref, x_ref.grad))
    assert replays(jf, ex) >= 3


def _square_saved_then_written_in_the_same_graph(x, s):
    square = s.square()
    s.add_(s.detach())
    return square * x


def _square_saved_then_written_in_a_later_graph(x, s):
    out = s.square() * x
    s.add_(x.detach().sum().item())  # a host read: the write lands in the next graph
    return out


@pytest.mark.parametrize(
    "f", [_square_saved_then_written_in_the_same_graph, _square_saved_then_written_in_a_later_graph]
)
def test_rematerialization_never_recomputes_from_memory_written_since(backend, f):
    # The backward needs s * s as it was before the forward doubled s. Rematerialization by Thunder's torch.compile
    # executor would make the backward's fusion recompute it from s, and so read the doubled values. s is a buffer:
    # the same tensor on every call.
    _trains_as_eager_beside_a_fuser(f, backend, torch.randn(3, 6, device=backend.device))


@pytest.mark.parametrize("fuser", [False, True], ids=["alone", "beside_torch_compile"])
def test_the_backward_reads_what_an_in_place_op_wrote_over_as_it_was_before(backend, fuser):
    # Thunder's backward reads the square by its name, after the write changed its memory. With Thunder's
    # torch.compile executor alone, rematerialization happens to recompute it; with cudagraphex first, the region
    # keeps a copy taken before the write for the backward.
    from thunder.executors.torch_compile import torch_compile_ex

    fusers = [torch_compile_ex] if fuser else []
    jf = thunder.jit(
        square_written_by_its_own_mul, executors=[backend.executor, *fusers, *thunder.get_default_executors()]
    )
    for _ in range(4):
        x = torch.randn(2, 6, device=backend.device, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        (cube, total), (expected_cube, expected_total) = jf(x), square_written_by_its_own_mul(x_ref)
        (cube.sum() + total).backward()
        (expected_cube.sum() + expected_total).backward()
        torch.testing.assert_close((cube, total, x.grad), (expected_cube, expected_total, x_ref.grad))
    assert replays(jf, backend.executor) >= 2


def test_a_write_left_out_of_graphs_beside_a_fusion_executor_is_applied(backend):
    # v is computed outside graphs (it reads a host value), so the write into its view is left out of the graph that
    # takes the view. Fused alone by Thunder's torch.compile executor, the write would return nothing anyone reads:
    # Thunder's rematerialization refuses such a fusion ("The consumer has no outputs"), and its dead-code
    # elimination may drop it.
    from thunder.executors.torch_compile import torch_compile_ex

    def f(x):
        v = x * x.amax(-1, keepdim=True).mean().item()
        w = v[:, 0].exp()
        v[:, 0].mul_(2)
        return v, w

    jf = thunder.jit(f, executors=[backend.executor, torch_compile_ex, *thunder.get_default_executors()])
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 4, device=backend.device)
            torch.testing.assert_close(jf(x), f(x))
    assert replays(jf, backend.executor) >= 1


def test_a_write_left_out_of_graphs_in_a_joint_trace_is_never_lost(backend):
    # With an input that requires grad, Thunder splits the trace into a forward and a backward after the fusion passes
    # (under no_grad too), and its split moves a lone write into a view of the forward's tensor into the backward,
    # which never runs here. Either the call raises or the write is applied.
    from thunder.executors.torch_compile import torch_compile_ex

    def f(x):
        v = x * x.amax(-1, keepdim=True).mean().item()
        v[:, 0].mul_(2)
        return v

    jf = thunder.jit(f, executors=[backend.executor, torch_compile_ex, *thunder.get_default_executors()])
    x = torch.randn(4, 4, device=backend.device, requires_grad=True)
    with torch.no_grad():
        try:
            out = jf(x)
        except RuntimeError as e:
            assert "The consumer has no outputs" in str(e)
        else:
            torch.testing.assert_close(out, f(x))


@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "joint"])
@pytest.mark.parametrize("fuser", ["torchcompile_xentropy", "torchcompile"])
def test_writes_whose_results_nothing_reads_stay_out_of_graphs_beside_a_fusion_executor(backend, fuser, requires_grad):
    # z is written and never read again, so a graph of its two lines would return nothing. Thunder's
    # rematerialization, which every fusion pass runs (that of the default torchcompile_xentropy too), refuses a fusion
    # without outputs that reads another fusion's ("The consumer has no outputs").
    def f(x):
        y = x.exp()
        out = y * y.sum().item()
        z = y.exp()
        z.add_(1)
        return out

    fusion_executor = get_executor(fuser)
    others = [ex for ex in thunder.get_default_executors() if ex is not fusion_executor]
    jf = thunder.jit(f, executors=[backend.executor, fusion_executor, *others])
    for _ in range(3):
        x = torch.randn(4, 4, device=backend.device, requires_grad=requires_grad)
        x_ref = x.detach().clone().requires_grad_(requires_grad)
        out, expected = jf(x), f(x_ref)
        torch.testing.assert_close(out, expected)
        if requires_grad:
            out.sum().backward()
            expected.sum().backward()
            torch.testing.assert_close(x.grad, x_ref.grad)
    reasons = [b.reason for trace in explain(jf).traces for b in trace.breaks]
    assert any("results nothing reads" in reason for reason in reasons), reasons
    assert replays(jf, backend.executor) >= 1


class HalvedWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.mul_(0.5)
        x[0].add_(1)
        return torch.nn.functional.layer_norm(x, x.shape[-1:])


def test_an_in_place_write_inside_another_executors_fusion_is_applied_once_per_call(backend):
    # The torch.compile fusion writes through names of its own (update_aliases' outputs): the writes reach the
    # region's inputs all the same, the parameter and the caller's tensor.
    from thunder.executors.torch_compile import torch_compile_ex

    model = HalvedWeight().to(backend.device)
    jm = thunder.jit(model, executors=[torch_compile_ex, *thunder.get_default_executors(), backend.executor])
    x = torch.empty(2, 4, device=backend.device)
    with torch.no_grad():
        for call in range(1, 5):
            x.zero_()
            jm(x)
            torch.testing.assert_close(model.weight, torch.full_like(model.weight, 0.5**call))
            assert x[0].eq(1).all() and x[1].eq(0).all()
    assert replays(jm, backend.executor) >= 2
    assert "TorchCompile" in str(thunder.last_traces(jm)[-1])


class _TiedLayers(torch.nn.Module):
    """Two layers that share one weight: the region gets that parameter at two positions."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8, bias=False)
        self.second = torch.nn.Linear(8, 8, bias=False)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).relu()).sin()


def test_a_tensor_at_two_static_positions_replays_on_the_fast_path(backend):
    # The C++ guard takes each tensor once: it refuses one tensor at two of its positions.
    model = _TiedLayers().to(backend.device)
    jm = jit(model, backend.executor)
    x = torch.randn(4, 8, device=backend.device)
    with torch.no_grad():
        for _ in range(6):
            torch.testing.assert_close(jm(x), model(x))
    (region,) = inspect(jm).regions()
    assert num_graphs(jm, backend.executor) == 1 and replays(jm, backend.executor) == 5
    assert region.slow_path_calls == 2  # the warm-up and the capture


def test_one_copied_tensor_at_two_positions_replays_on_the_fast_path(backend):
    def f(a, b):
        return (a * 2 + b).sin()

    jf = jit(f, backend.executor)
    xs = [torch.randn(8, device=backend.device) for _ in range(5)]  # kept alive: each call's x is elsewhere, copied
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(jf(x, x), f(x, x))
    (region,) = inspect(jf).regions()
    assert num_graphs(jf, backend.executor) == 1 and replays(jf, backend.executor) == 4
    assert region.slow_path_calls == 2  # the warm-up and the capture
