"""Legacy and ecosystem entry points (fusion_pass with num_static_inputs, the transform adapter, use_cudagraphs, the
plugin, ThunderFX) and the package's version."""

from __future__ import annotations

import gc
import inspect
import logging
import warnings
import weakref

import pytest
import thunder
import torch
from thunder.core.trace import TraceTag
from thunder.extend import get_executor

import cudagraphex
import cudagraphex.compat.legacy
from benchmarks.models import GPT, GPTConfig, mlp
from cudagraphex import CUDAGraphExecutor, CUDAGraphTransform, explain
from cudagraphex.compat.legacy import CUDAGraphsPlugin
from cudagraphex.planning.static_inputs import InputKind
from cudagraphex.runtime import FunctionGraphs
from tests.helpers import assert_grads_close, emulated, twin


def transform_for(backend, **kwargs) -> CUDAGraphTransform:
    return CUDAGraphTransform(backend=backend.name, **kwargs)


def transform_graphs(jfn, transform: CUDAGraphTransform) -> FunctionGraphs:
    (found,) = cudagraphex.inspect(jfn).graphs(transform.executor.name)
    return found


def cuda_graph_symbols(trace) -> list[str]:
    return [b.sym.name for b in trace.bound_symbols if b.sym.name.startswith("CUDAGraph")]


# -- fusion_pass(trace, num_static_inputs) ------------------------------------------------------------------------------


def test_fusion_pass_keeps_the_legacy_signature():
    params = inspect.signature(CUDAGraphExecutor.fusion_pass).parameters
    assert list(params) == ["self", "trace", "num_static_inputs"]
    assert params["num_static_inputs"].default is None


def backward_trace_of_plain_thunder():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    jm = thunder.jit(model)
    jm(torch.randn(3, 4, requires_grad=True)).sum().backward()
    trace = thunder.last_backward_traces(jm)[-1]
    assert TraceTag.BACKWARD in trace.tags
    return trace


def test_num_static_inputs_maps_saved_tensors_by_identity():
    trace = backward_trace_of_plain_thunder()
    saved = [p.name for p in trace.args[0][0]]
    ex = CUDAGraphExecutor("cudagraphex_legacy_map", backend="emulate")
    fused = ex.fusion_pass(trace, num_static_inputs=len(saved))
    (region,) = [fn for name, fn in fused.python_ctx().items() if name.startswith("CUDAGraph")]
    kinds = dict(zip(region.info.input_names, region.kinds, strict=True))
    # the cotangent comes first among the region's inputs: a prefix mask would have made it static
    first = region.info.input_names[0]
    assert first not in saved and kinds[first] is InputKind.CALLER
    for name in saved:
        if name in kinds:
            assert kinds[name].is_static, name


@pytest.mark.parametrize("bad", [-1, 2.0, True, 10_000])
def test_bad_num_static_inputs_raise(bad):
    trace = backward_trace_of_plain_thunder()
    with pytest.raises(ValueError, match="num_static_inputs"):
        CUDAGraphExecutor("cudagraphex_legacy_bad", backend="emulate").fusion_pass(trace, num_static_inputs=bad)


def test_num_static_inputs_on_a_forward_trace_raises():
    jf = thunder.jit(lambda x: x.sin() * 2)
    jf(torch.randn(3))
    with pytest.raises(ValueError, match="backward traces"):
        emulated.fusion_pass(thunder.last_traces(jf)[-1], num_static_inputs=0)


# -- the drop-in transform ----------------------------------------------------------------------------------------------


class NoTanh(CUDAGraphTransform):
    def can_fuse(self, bsym):
        return "tanh" not in bsym.sym.name and super().can_fuse(bsym)


def steps_beside_eager(
    transform, model, backend, caplog, *, keep: str, alternate: bool = False
) -> tuple[list[str], list[int]]:
    """Five training steps beside eager, keeping every step's input or output (``keep``) so that each lands at a new
    address: the INFO messages that say an input changed address, and the graphs of each region. ``alternate``: the
    batch alternates between two tensors instead of being made afresh."""
    reference = twin(model)
    jm = thunder.jit(model, transforms=[transform])
    # One cotangent for every call: one that autograd makes afresh lands wherever the allocator puts it, and a graph
    # that read it in place would demote it when it moves.
    grad = torch.randn(4, 16, device=backend.device)
    batches = [torch.randn(4, 16, device=backend.device) for _ in range(2)] if alternate else []
    kept = []
    with caplog.at_level(logging.INFO, logger="cudagraphex"):
        for step in range(5):
            x = batches[step % 2] if alternate else torch.randn(4, 16, device=backend.device)
            out, ref = jm(x), reference(x)
            torch.testing.assert_close(out, ref)
            out.backward(grad)
            ref.backward(grad)
            assert_grads_close(model, reference)
            model.zero_grad()
            reference.zero_grad()
            kept.append(x if keep == "inputs" else out)
            del out
    demotions = [r.getMessage() for r in caplog.records if "changed address" in r.getMessage()]
    return demotions, [len(r.instances) for r in transform_graphs(jm, transform).regions()]


def test_transform_demotes_a_moving_declared_input_with_one_info_log(caplog, backend):
    # tanh runs eagerly; its output, returned and saved for backward, is declared static and moves with every step.
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()).to(backend.device)
    demotions, graphs = steps_beside_eager(NoTanh(backend=backend.name), model, backend, caplog, keep="outputs")
    assert len(demotions) == 1 and "(declared static) changed address" in demotions[0]
    assert graphs == [2]


def test_transform_copies_a_batch_that_moved_before_the_first_backward_capture_into_later_graphs_too(caplog, backend):
    # The batch, saved for backward, alternates between two tensors. The first backward graph finds it away from where
    # its warm-up saw it and copies it; the second (the tanh output moved) finds it back there. Read in place, it
    # would miss at the next call, and a third graph be captured.
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()).to(backend.device)
    transform = NoTanh(backend=backend.name)
    demotions, graphs = steps_beside_eager(transform, model, backend, caplog, keep="outputs", alternate=True)
    assert len(demotions) == 1 and "(declared static) changed address" in demotions[0]
    assert graphs == [2]


def test_transform_does_not_declare_a_saved_batch_static(caplog, backend):
    # Declared static, the batch saved for backward would be read in place by the first backward graph, then demoted
    # with a second graph when the next batch lands elsewhere.
    model = mlp(3, 16).to(backend.device)
    assert steps_beside_eager(transform_for(backend), model, backend, caplog, keep="inputs") == ([], [1, 1])


def test_transform_accepts_share_mem_pool_and_a_can_fuse_override():
    for share in (True, False):
        transform = NoTanh(share_mem_pool=share, backend="emulate")
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2), torch.nn.ReLU())
        jm = thunder.jit(model, transforms=[transform])
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(3, 4)
                torch.testing.assert_close(jm(x), model(x))
        graphs = transform_graphs(jm, transform)
        breaks = [b for _, bs, _ in graphs.traces for b in bs]
        assert any(b.reason == "excluded by NoTanh.can_fuse" for b in breaks)
        assert graphs.options.share_pool is share


def test_transform_options_are_checked_under_their_own_names():
    with pytest.raises(ValueError, match="share_mem_pool must be a bool, got 'yes'"):
        CUDAGraphTransform(share_mem_pool="yes")
    with pytest.raises(TypeError, match="takes share_mem_pool"):
        CUDAGraphTransform(share_pool=False)
    with pytest.raises(ValueError, match="min_region_size"):
        CUDAGraphTransform(min_region_size=0)


def test_forward_without_backward_then_a_new_shape():
    """Thunder's transform fails here with "called on augmented forward twice without backward in between"."""

    def f(x):
        return (x > 0).float() * 3 + x.detach().sin()

    transform = CUDAGraphTransform(backend="emulate")
    jf = thunder.jit(f, transforms=[transform])
    for shape in ((4,), (4,), (6,), (6,), (4,)):
        x = torch.randn(shape, requires_grad=True)
        torch.testing.assert_close(jf(x), f(x))


def test_thunder_nanogpt_inference_one_graph_reused(backend):
    if backend.name == "cuda":
        config, batch = GPTConfig(n_layer=4, n_head=6, n_embd=768, block_size=512, vocab_size=50304), (4, 64)
    else:
        config, batch = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64), (2, 16)
    model = GPT(config).to(backend.device).requires_grad_(False).eval()
    transform = transform_for(backend)
    jm = thunder.jit(model, transforms=[transform], disable_torch_autograd=True)
    for _ in range(3):
        idx = torch.randint(0, config.vocab_size, batch, device=backend.device)
        torch.testing.assert_close(jm(idx), model(idx))
    (region,) = transform_graphs(jm, transform).regions()
    assert len(region.instances) == 1
    assert len(transform.cuda_graph_runner.cuda_graph_cache) == 1
    assert len(cuda_graph_symbols(thunder.last_traces(jm)[-1])) == 1


def test_thunder_nanogpt_training_one_forward_one_backward_graph(backend):
    if backend.name == "cuda":
        config, batch = GPTConfig(n_layer=6, n_head=6, n_embd=768, block_size=512, vocab_size=50304), (4, 64)
    else:
        config, batch = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64), (2, 16)
    model = GPT(config).to(backend.device)
    reference = twin(model)
    transform = transform_for(backend)
    jm = thunder.jit(model, transforms=[transform])
    one = torch.ones((), device=backend.device)  # one cotangent for every call: where autograd's would land varies
    for _ in range(3):
        x = torch.randint(0, config.vocab_size, batch, device=backend.device)
        targets = torch.randint(0, config.vocab_size, batch, device=backend.device)
        loss, ref = jm(x, targets), reference(x, targets)
        torch.testing.assert_close(loss, ref)
        grads = torch.autograd.grad(loss, list(model.parameters()), one)
        ref_grads = torch.autograd.grad(ref, list(reference.parameters()), one)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-3)
        del loss, grads
    regions = transform_graphs(jm, transform).regions()
    assert [r.info.phase for r in regions] == ["forward", "backward"]
    assert all(len(r.instances) == 1 for r in regions)
    assert len(transform.cuda_graph_runner.cuda_graph_cache) == 2
    assert len(cuda_graph_symbols(thunder.last_traces(jm)[-1])) == 1
    assert len(cuda_graph_symbols(thunder.last_backward_traces(jm)[-1])) == 1


def test_transform_cuda_graph_cache_has_one_entry_per_graph_and_is_read_only():
    transform = CUDAGraphTransform(backend="emulate")
    cache = transform.cuda_graph_runner.cuda_graph_cache
    model = mlp(2, 16)
    jm = thunder.jit(model, transforms=[transform])

    def run(jm, shape):
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(shape)
                torch.testing.assert_close(jm(x), model(x))

    def captured(jm):
        return {
            (0, r.name, i): inst.graph
            for r in transform_graphs(jm, transform).regions()
            for i, inst in enumerate(r.instances)
        }

    assert len(cache) == 0
    run(jm, (4, 16))
    assert len(cache) == 1 and dict(cache) == captured(jm)
    for mutate in (
        lambda: cache.__setitem__((9, "CUDAGraph9", 0), None),
        lambda: cache.__delitem__(next(iter(cache))),
        lambda: cache.clear(),
        lambda: cache.pop(next(iter(cache))),
        lambda: setattr(transform.cuda_graph_runner, "cuda_graph_cache", {}),
        lambda: setattr(transform, "cuda_graph_runner", None),
    ):
        with pytest.raises((TypeError, AttributeError)):
            mutate()
    assert len(cache) == 1

    run(jm, (6, 16))  # a new input shape: Thunder traces again, and a second graph is captured
    graphs = captured(jm)
    assert len(graphs) == 2 and len({key[1] for key in graphs}) == 2
    assert len(cache) == 2 and dict(cache) == graphs and set(cache) == set(transform.cuda_graph_runner.cuda_graph_cache)
    del graphs

    # The transform holds its compiled functions' graphs weakly: they die with the function and leave the cache.
    alive = weakref.ref(transform_graphs(jm, transform))
    del jm
    gc.collect()
    assert alive() is None and len(cache) == 0 and list(cache) == []


def test_thunder_warmup_multinomial(backend):
    def f(weights):
        return torch.multinomial(weights, 2)

    jf = thunder.jit(f, transforms=[transform_for(backend)])
    weights = torch.tensor([0.0, 10.0, 3.0, 0.0], device=backend.device)
    for _ in range(3):
        assert set(jf(weights).tolist()) <= {1, 2}


def test_thunder_function_without_inputs(backend):
    device = backend.device

    def f():
        return torch.ones(5, 5, device=device) * 2 + 1

    transform = transform_for(backend)
    jf = thunder.jit(f, transforms=[transform])
    for _ in range(3):
        torch.testing.assert_close(jf(), f())
    assert len(cuda_graph_symbols(thunder.last_traces(jf)[-1])) == 1
    (region,) = transform_graphs(jf, transform).regions()
    assert region.info.input_names == [] and region.instances[0].replays == 2


# -- use_cudagraphs ---------------------------------------------------------------------------------------------------------


def test_jit_with_use_cudagraphs():
    def f(x):
        return x.sin() * 2 + 1

    on = cudagraphex.jit(f, use_cudagraphs=True)
    off = cudagraphex.jit(f, use_cudagraphs=False)
    assert cudagraphex.cudagraphex in thunder.compile_data(on).executors_list
    assert cudagraphex.cudagraphex not in thunder.compile_data(off).executors_list
    custom = cudagraphex.jit(f, use_cudagraphs=True, executors=[emulated])
    assert list(thunder.compile_data(custom).executors_list)[1:3] == [cudagraphex.cudagraphex, emulated]
    x = torch.randn(3)
    for jf in (on, off, custom):
        torch.testing.assert_close(jf(x), f(x))
    with pytest.raises(ValueError, match="use_cudagraphs"):
        cudagraphex.jit(f, use_cudagraphs="yes")


def test_use_cudagraphs_shim():
    def f(x):
        return x.cos() - 1

    original = thunder.jit
    with pytest.raises(RuntimeError, match="use_cudagraphs"):
        thunder.jit(f, use_cudagraphs=True)
    shim = cudagraphex.install_use_cudagraphs_shim()
    try:
        for flag in (True, False):
            with pytest.warns(DeprecationWarning, match="cudagraphex"):
                jf = thunder.jit(f, use_cudagraphs=flag)
            assert (cudagraphex.cudagraphex in thunder.compile_data(jf).executors_list) is flag
            torch.testing.assert_close(jf(torch.ones(2)), f(torch.ones(2)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            thunder.jit(f)  # no keyword, no warning
    finally:
        shim.uninstall()
    assert thunder.jit is original
    with cudagraphex.install_use_cudagraphs_shim():
        assert thunder.jit is not original
    assert thunder.jit is original


# -- the plugin and ThunderFX -----------------------------------------------------------------------------------------------


def test_plugin_is_registered_and_adds_the_executor(backend):
    from thunder.core.recipe import Recipe

    from cudagraphex.compat.legacy import CUDAGraphsPlugin

    assert thunder.plugins.get_plugin("cudagraphex") is CUDAGraphsPlugin
    model = mlp(3, 16).to(backend.device)
    by_name = thunder.compile(model, recipe=Recipe(plugins=None), plugins="cudagraphex")
    assert cudagraphex.cudagraphex in thunder.compile_data(by_name).executors_list
    jm = thunder.compile(model, recipe=Recipe(plugins=None), plugins=CUDAGraphsPlugin(backend.executor))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 16, device=backend.device)
            torch.testing.assert_close(jm(x), model(x))
            torch.testing.assert_close(by_name(x), model(x))
    assert explain(jm).num_graphs == 1


def fuser_fallback_notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cudagraphex" and "nvFuser" in r.getMessage()]


def test_plugin_without_a_recipe_and_without_nvfuser(caplog, monkeypatch):
    """``thunder.compile(model, plugins="cudagraphex")`` as written: Thunder's default recipe would ask for nvFuser."""
    if get_executor("nvfuser") is not None:
        pytest.skip("nvFuser is installed: the default recipe uses it")
    monkeypatch.setattr(cudagraphex.compat.legacy, "_announced_fuser_fallback", False)
    model = mlp(3, 16)
    with caplog.at_level(logging.INFO, logger="cudagraphex"):
        jm = thunder.compile(model, plugins="cudagraphex")
        again = thunder.compile(model, plugins="cudagraphex")
    executors = list(thunder.compile_data(jm).executors_list)
    assert None not in executors and cudagraphex.cudagraphex in executors
    assert get_executor("torchcompile") in executors
    (note,) = fuser_fallback_notes(caplog)
    assert "torch.compile fuser" in note
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 16)
            torch.testing.assert_close(jm(x), model(x))
            torch.testing.assert_close(again(x), model(x))


def test_plugin_without_a_recipe_captures_and_replays():
    model = mlp(3, 16)
    jm = thunder.compile(model, plugins=CUDAGraphsPlugin(emulated))
    assert None not in thunder.compile_data(jm).executors_list
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 16)
            torch.testing.assert_close(jm(x), model(x))
    report = explain(jm)
    assert report.num_graphs == 1
    (region,) = report.regions
    assert region.replays == 3  # a warm-up call, then every call replays the graph (the capturing one too)


def test_plugin_without_a_recipe_and_without_any_fuser(caplog, monkeypatch):
    monkeypatch.setattr(cudagraphex.compat.legacy, "_announced_fuser_fallback", False)
    missing = {"nvfuser", "torchcompile"}
    monkeypatch.setattr(cudagraphex.compat.legacy, "get_executor", lambda n: None if n in missing else get_executor(n))
    model = mlp(3, 16)
    with caplog.at_level(logging.INFO, logger="cudagraphex"):
        jm = thunder.compile(model, plugins=CUDAGraphsPlugin(emulated))
    executors = list(thunder.compile_data(jm).executors_list)
    assert None not in executors and emulated in executors
    assert get_executor("torchcompile") not in executors
    (note,) = fuser_fallback_notes(caplog)
    assert "without a fuser" in note
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 16)
            torch.testing.assert_close(jm(x), model(x))
    assert explain(jm).num_graphs == 1


def test_default_recipe_keeps_nvfuser_where_installed_and_without_the_plugin(caplog, capsys, monkeypatch):
    import thunder.recipes.base
    from thunder.core.recipe import Recipe

    monkeypatch.setattr(cudagraphex.compat.legacy, "_announced_fuser_fallback", False)
    model = mlp(1, 4)
    assert type(Recipe.get_for_model(model)) is cudagraphex.compat.legacy._DefaultRecipe

    without_plugin = Recipe.get_for_model(model)  # nvFuser is asked for, as by Thunder's own default recipe
    with caplog.at_level(logging.INFO, logger="cudagraphex"):
        executors = without_plugin.setup_executors()
    assert without_plugin.executor_names == ["nvfuser"] and executors == [get_executor("nvfuser")]
    capsys.readouterr()  # Thunder's installation hint where nvFuser is missing

    nvfuser = object()

    def installed(name):
        return nvfuser if name == "nvfuser" else get_executor(name)

    monkeypatch.setattr(cudagraphex.compat.legacy, "get_executor", installed)
    monkeypatch.setattr(thunder.recipes.base, "get_executor", installed)
    with_plugin = Recipe.get_for_model(model)
    with_plugin.add_plugins([CUDAGraphsPlugin()])
    with caplog.at_level(logging.INFO, logger="cudagraphex"):
        assert with_plugin.setup_executors() == [nvfuser]
    assert with_plugin.fuser == "nvfuser"
    assert fuser_fallback_notes(caplog) == []


@pytest.mark.cuda
def test_plugin_without_a_recipe_on_the_gpu():
    """``thunder.compile(model, plugins="cudagraphex")`` as written: nvFuser where installed, else torch.compile's."""
    model = mlp(3, 64).cuda()
    jm = thunder.compile(model, plugins="cudagraphex")
    fuser = get_executor("nvfuser") or get_executor("torchcompile")
    executors = list(thunder.compile_data(jm).executors_list)
    assert None not in executors and cudagraphex.cudagraphex in executors and fuser in executors
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(jm(x), model(x))
    assert explain(jm).num_graphs == 1


@pytest.mark.cuda
def test_plugin_with_thunders_base_recipe_and_torch_compile_fuser():
    """Thunder's default recipe wants nvFuser; with the torch.compile fuser cudagraphex wraps its fusions."""
    from thunder.recipes import BaseRecipe

    model = mlp(3, 64).cuda()
    jm = thunder.compile(model, recipe=BaseRecipe(fuser="torch.compile"), plugins="cudagraphex")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 64, device="cuda")
            torch.testing.assert_close(jm(x), model(x))
    assert explain(jm).num_graphs == 1


def test_thunderfx_gives_each_partition_its_own_graphs(backend):
    from thunder.dynamo import thunderfx

    torch._dynamo.reset()

    def f(x):
        y = (x.sin() * 2 + 1).cos()
        torch._dynamo.graph_break()
        return (y.exp() - 1).tanh() * 3

    compiled = thunderfx(f, executors=[backend.executor, *thunder.get_default_executors()])
    assert "not called yet" in str(explain(compiled))
    for _ in range(3):
        x = torch.randn(8, device=backend.device)
        torch.testing.assert_close(compiled(x), f(x))
    report = explain(compiled)
    assert len(report.traces) == 2 and all("partition" in t.label for t in report.traces)
    assert report.num_graphs == 2 and all(r.replays >= 1 for r in report.regions)


def test_the_version_is_the_packages():
    from importlib import metadata

    import cudagraphex

    assert cudagraphex.__version__ == metadata.version("cudagraphex")


def test_the_readmes_cpu_example_runs_as_written(capsys):
    """The README's CPU snippet is copied and pasted alone, so it must run by itself and replay a graph."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    after = readme.split("Without a GPU, the CPU replay backend", 1)[1]
    snippet = after.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(snippet, "README.md", "exec"), {})  # noqa: S102 - the README's own code
    report = capsys.readouterr().out
    # Warm-up, capture, replay: the two calls after warm-up replay. Whether a batch lands where the last one was is the
    # heap's choice; a tensor read in place that moves is demoted to a copied input and gets one more graph (DESIGN).
    region = re.search(r"CUDAGraph\d+ \[backward, cpu\]: \d+ ops, (\d+) graph\(s\), 2 replay\(s\)", report)
    assert region, report
    demoted = "demoted to copied inputs (their address changed)" in report
    assert region[1] == "1" or (region[1] == "2" and demoted), report
