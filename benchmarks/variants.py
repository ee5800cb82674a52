"""The variants: how each compiles a model and makes the case of each mode (``benchmarks.cases``).

``VARIANTS`` is in order of importance: the suite sets them up in this order (reduce-overhead first:
``benchmarks.suite`` says why), so a time budget that runs out drops the last ones. ``manual-graph`` captures by hand,
as PyTorch's CUDA-graph documentation shows: the no-grad forward, or the whole ``train_step``, optimizer included
(:func:`_graphed_case`). ``+wholestep(unsafe)`` captures the same step of ``thunder.jit(model)`` with nothing that
checks a replay is valid: the floor of whole-step capture. ``-step`` variants run the mode's call through
``cudagraphex.graph_step``. ``+torchcompile`` adds Thunder's torch.compile executor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from benchmarks.cases import MODES, Case, StepStart, copy_of, make_optimizer, module_case, params_of, train_step

REDUCE_OVERHEAD = "torch.compile(reduce-overhead)"
VARIANTS = (
    "eager",
    "manual-graph",
    "thunder+cudagraphex",
    "thunder+CUDAGraphTransform",
    "thunder+cudagraphex-step",
    "thunder+wholestep(unsafe)",
    REDUCE_OVERHEAD,
    "thunder",
    "thunder+cudagraphex+PruneParameterChecks",
    "thunder+torchcompile+cudagraphex",
    "thunder+torchcompile+cudagraphex-step",
    "thunder+torchcompile+wholestep(unsafe)",
)
#: Variants that capture the whole training step (the ``-step`` ones, through ``graph_step``, the inference call too).
STEP_VARIANTS = tuple(v for v in VARIANTS if v.endswith(("-step", "+wholestep(unsafe)")))

#: The executor the benchmarks use on the CPU: cudagraphex with its CPU replay backend.
EMULATED_EXECUTOR = "cudagraphex_bench_cpu"


def graph_backend(device: torch.device) -> str:
    """cudagraphex's backend on ``device``: CUDA graphs on a GPU, the CPU replay backend on the CPU."""
    return "cuda" if device.type == "cuda" else "emulate"


def graph_executor(device: torch.device):
    """The cudagraphex executor with :func:`graph_backend`'s backend for ``device`` (registered on first use)."""
    from thunder.extend import get_executor, register_executor

    import cudagraphex

    if device.type == "cuda":
        return cudagraphex.cudagraphex
    executor = get_executor(EMULATED_EXECUTOR)
    if executor is None:
        executor = cudagraphex.CUDAGraphExecutor(EMULATED_EXECUTOR, backend="emulate")
        register_executor(executor)
    return executor


def variant_modes(name: str) -> tuple[str, ...]:
    """The modes variant ``name`` runs, where a workload has them: ``train_step`` only for ``+wholestep(unsafe)``."""
    return ("train_step",) if name.endswith("+wholestep(unsafe)") else MODES


def thunder_options(name: str, executor) -> dict:
    """``thunder.jit``'s options for Thunder variant ``name`` (its ``-step`` or ``+wholestep(unsafe)`` suffix aside):
    each ``+part`` adds an executor (cudagraphex first, then Thunder's torch.compile executor) or a transform.
    ``executor`` is the cudagraphex executor."""
    import thunder
    from thunder.executors.torch_compile import torch_compile_ex
    from thunder.transforms.cudagraph import CUDAGraphTransform

    import cudagraphex

    parts = name.removesuffix("-step").removesuffix("+wholestep(unsafe)").split("+")
    known = {"cudagraphex", "torchcompile", "CUDAGraphTransform", "PruneParameterChecks"}
    if parts[0] != "thunder" or not known.issuperset(parts[1:]):
        raise ValueError(f"variant {name!r} is not a Thunder variant")
    options: dict = {}
    fusers = [ex for part, ex in (("cudagraphex", executor), ("torchcompile", torch_compile_ex)) if part in parts]
    if fusers:
        options["executors"] = [*fusers, *thunder.get_default_executors()]
    transforms = [CUDAGraphTransform()] if "CUDAGraphTransform" in parts else []
    if "PruneParameterChecks" in parts:  # the opt-in for users who promise not to replace parameters
        transforms.append(cudagraphex.PruneParameterChecks())
    if transforms:
        options["transforms"] = transforms
    return options


class Compiled:
    """A model compiled by one variant; :meth:`case` makes the case of a mode."""

    def __init__(self, module: nn.Module, fn: Callable, before_call: Callable[[], None] = lambda: None) -> None:
        self.module = module
        self.fn = fn
        self.before_call = before_call
        #: What ``explain()`` reports on for this variant (the compiled function, or the open case's step).
        self.explained: object | None = None

    def case(self, mode: str, args: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
        return module_case(self.fn, self.module, mode, args, grad_out, self.before_call)


class CompiledPerPhase(Compiled):
    """A Thunder variant: one jitted function per phase (inference, training), made on first use on the same module.

    Thunder tries cache entries newest first, so an inference call after the training entry exists pays for a failing
    training prologue; and Thunder 0.2.6's ``CUDAGraphTransform`` fails when one function compiles both phases. Thunder
    compiles the phases separately either way, so this costs no extra compilation.
    """

    def __init__(self, module: nn.Module, make: Callable[[nn.Module], Callable]) -> None:
        super().__init__(module, None)
        self._make = make
        self._by_phase: dict[str, Callable] = {}

    def fn_for(self, mode: str) -> Callable:
        if mode not in self._by_phase:
            self._by_phase[mode] = self._make(self.module)
        self.fn = self.explained = self._by_phase[mode]
        return self.fn

    def case(self, mode: str, args: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
        self.fn_for(mode)
        return super().case(mode, args, grad_out)


class GraphStep(CompiledPerPhase):
    """The ``-step`` variants: the mode's call of a Thunder-compiled module through ``cudagraphex.graph_step``. Every
    case makes a new step graph, which goes with the case."""

    def case(self, mode: str, args: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
        import cudagraphex

        fn = self.fn_for(mode)
        backend = graph_backend(next(self.module.parameters()).device)
        if mode == "inference":

            def forward(*a: torch.Tensor) -> torch.Tensor:
                with torch.no_grad():
                    return fn(*a)

            step = cudagraphex.graph_step(forward, modules=[self.module], backend=backend)
            self.explained = step
            return Case(lambda: step(*args), lambda: [copy_of(step(*args))], self._forget(step))
        params = params_of(self.module)
        opt = make_optimizer(params)
        start = StepStart(params, opt)
        step = cudagraphex.graph_step(
            train_step(fn, opt, grad_out), modules=[self.module], optimizers=[opt], backend=backend
        )
        self.explained = step
        return start.case(lambda: step(*args), self._forget(step))

    def _forget(self, step) -> Callable[[], None]:
        def close() -> None:
            if self.explained is step:  # the graph's pool and the optimizer state go with the case
                self.explained = None

        return close


def _capture(fn: Callable[[], object], *, no_grad: bool) -> tuple[torch.cuda.CUDAGraph, object]:
    """The PyTorch CUDA-graph documentation's recipe: warm ``fn`` up on a side stream (lazy initialisation, cuBLAS
    workspaces, autograd's stream bookkeeping), then capture it on that stream; returns the graph and its result."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.set_grad_enabled(not no_grad):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream), torch.set_grad_enabled(not no_grad):
        out = fn()
    return graph, out


def _graphed_case(
    fn: Callable[..., torch.Tensor], module: nn.Module, mode: str, args: Sequence[torch.Tensor], grad_out
) -> Case:
    """The case of ``mode`` captured by hand (module docstring) from :func:`train_step` of ``fn`` (``module`` or a
    compiled form of it), or its no-grad forward; a call copies ``args`` into the input buffers and replays. Nothing
    checks that a replay is still valid."""
    static_args = [a.clone() for a in args]
    if mode == "train_step":
        params = params_of(module)
        opt = make_optimizer(params)
        start = StepStart(params, opt)
        step = train_step(fn, opt, grad_out)
        graph, out = _capture(lambda: step(*static_args), no_grad=False)
    else:
        start, opt = None, None
        graph, out = _capture(lambda: fn(*static_args), no_grad=True)
    # A graph holds addresses, not tensors: the case keeps the parameters, optimizer state and input buffers alive.
    kept: list[object] = [module, fn, opt, static_args]

    def replay() -> torch.Tensor:
        for static, a in zip(static_args, args, strict=True):
            static.copy_(a)
        graph.replay()
        return out

    if start is not None:
        return start.case(replay, kept.clear)
    return Case(replay, lambda: [copy_of(replay())], kept.clear)


class HandCaptured(Compiled):
    """``manual-graph`` (``module`` is a fresh copy of the model per case, eager) and the ``+wholestep(unsafe)``
    variants (``fn`` is the Thunder-compiled model): every case captures a new graph."""

    def __init__(self, fresh_model: Callable[[], nn.Module] | None, module: nn.Module, fn: Callable) -> None:
        super().__init__(module, fn)
        self.fresh_model = fresh_model

    def case(self, mode: str, args: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
        if self.fresh_model is None:
            return _graphed_case(self.fn, self.module, mode, args, grad_out)
        module = self.fresh_model()
        return _graphed_case(module, module, mode, args, grad_out)


def make_variant(name: str, fresh_model: Callable[[], nn.Module], executor) -> Compiled:
    """Variant ``name`` of the model ``fresh_model`` makes (an independent copy per call), ready to make cases from.
    ``executor`` is the cudagraphex executor (an emulating one on the CPU). Raises whatever compiling raises."""
    import thunder

    if name == "eager":
        module = fresh_model()
        return Compiled(module, module)
    if name == "manual-graph":
        return HandCaptured(fresh_model, None, None)
    if name == REDUCE_OVERHEAD:
        # The documented way to use CUDA-graph trees: mark the start of every step (every call of the model).
        module = fresh_model()
        compiled = torch.compile(module, mode="reduce-overhead")
        return Compiled(module, compiled, torch.compiler.cudagraph_mark_step_begin)
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}")

    def jit(module: nn.Module) -> Callable:  # new transform objects for every function
        return thunder.jit(module, **thunder_options(name, executor))

    module = fresh_model()
    if name.endswith("+wholestep(unsafe)"):
        return HandCaptured(None, module, jit(module))
    return (GraphStep if name.endswith("-step") else CompiledPerPhase)(module, jit)
