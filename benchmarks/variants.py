"""The variants: how each one compiles a model, and how it runs one call of each mode.

A variant turns a model into a :class:`~benchmarks.cases.Case` per mode; ``benchmarks.cases`` says what a call of
each mode runs, the same for every variant, and what the correctness check compares.

The whole-step variants (:data:`STEP_VARIANTS`) run ``train_step``; those through ``graph_step`` run ``inference`` too
(:func:`variant_modes`).

``manual-graph`` captures by hand, as the PyTorch CUDA-graph documentation shows (warm-up on a side stream, then
``torch.cuda.graph``):

* ``inference``: the no-grad forward in one graph; a call copies the inputs into the graph's input buffers and replays.
* ``train_fwd``: ``torch.cuda.make_graphed_callables`` on the model, which captures a forward graph and a backward
  graph and joins them to autograd; a call replays the forward graph through that autograd function.
* ``train_bwd``: the forward runs once, eagerly; ``torch.autograd.grad(out, params, grad_out, retain_graph=True)`` is
  captured, and a call replays it (the gradients land in the graph's output buffers).
* ``train_step``: the whole step, optimizer included, in one graph ("whole-network capture", :func:`_graphed_step_case`).
  The gradients are None when it is captured, so the captured backward allocates them from the graph's pool, the
  captured ``opt.step()`` reads them there, and the captured ``zero_grad`` only drops Python references: every replay
  writes the gradients afresh and updates the parameters and the optimizer state in place, which is what a call of
  the other variants does.

``thunder+wholestep(unsafe)`` captures the same step the same way, on ``thunder.jit(model)``: nothing checks that a
replay is still valid (no prologue runs), so it is the floor of whole-step capture of a Thunder step.
``thunder+torchcompile+wholestep(unsafe)`` does the same with Thunder's torch.compile executor.
``thunder+cudagraphex-step`` and ``thunder+torchcompile+cudagraphex-step`` run the step (in ``inference``, the no-grad
forward) through ``cudagraphex.graph_step``, which captures it whole after warm-up calls and replays it behind guards.

``kernel-floor`` is not a way to run the model: the runner profiles the eager case and sums its GPU time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from benchmarks.cases import (
    Case,
    StepStart,
    check_mode,
    copy_of,
    make_optimizer,
    module_case,
    no_op,
    params_of,
    train_step,
)
from benchmarks.workloads import MODES

__all__ = [
    "GRAPH_VARIANTS",
    "STEP_VARIANTS",
    "VARIANTS",
    "Compiled",
    "CompiledPerPhase",
    "GraphStep",
    "ManualGraph",
    "WholeStep",
    "compile_variant",
    "device_time_per_call_us",
    "graph_backend",
    "graph_executor",
    "make_variant",
    "thunder_options",
    "variant_modes",
]

VARIANTS = (
    "eager",
    "thunder",
    "thunder+CUDAGraphTransform",
    "thunder+cudagraphex",
    "thunder+cudagraphex(last)",
    "thunder+cudagraphex+PruneParameterChecks",
    "thunder+torchcompile+cudagraphex",
    "torch.compile",
    "torch.compile(reduce-overhead)",
    "manual-graph",
    "thunder+wholestep(unsafe)",
    "thunder+torchcompile+wholestep(unsafe)",
    "thunder+cudagraphex-step",
    "thunder+torchcompile+cudagraphex-step",
    "kernel-floor",
)
#: Variants that capture the whole training step (and, through ``graph_step``, the whole inference call).
STEP_VARIANTS = (
    "thunder+wholestep(unsafe)",
    "thunder+torchcompile+wholestep(unsafe)",
    "thunder+cudagraphex-step",
    "thunder+torchcompile+cudagraphex-step",
)
#: Variants whose calls go through cudagraphex's regions (their notes report its regions and graphs). The ``-step``
#: variants replay one step graph instead.
GRAPH_VARIANTS = (
    "thunder+cudagraphex",
    "thunder+cudagraphex(last)",
    "thunder+cudagraphex+PruneParameterChecks",
    "thunder+torchcompile+cudagraphex",
)


#: The executor the benchmarks use on the CPU: cudagraphex with its CPU replay backend.
EMULATED_EXECUTOR = "cudagraphex_bench_cpu"


def graph_backend(device: torch.device) -> str:
    """cudagraphex's capture backend on ``device``: CUDA graphs on a GPU; on the CPU (the suite's own tests, the
    capture plan) the CPU replay backend."""
    return "cuda" if device.type == "cuda" else "emulate"


def graph_executor(device: torch.device):
    """The cudagraphex executor with :func:`graph_backend`'s backend for ``device`` (registered on first use)."""
    from thunder.extend import get_executor, register_executor

    import cudagraphex

    if graph_backend(device) == "cuda":
        return cudagraphex.cudagraphex
    executor = get_executor(EMULATED_EXECUTOR)
    if executor is None:
        executor = cudagraphex.CUDAGraphExecutor(EMULATED_EXECUTOR, backend="emulate")
        register_executor(executor)
    return executor


def variant_modes(name: str) -> tuple[str, ...]:
    """The modes variant ``name`` runs (where a workload has them): ``inference`` and ``train_step`` for a variant
    through ``graph_step``, ``train_step`` for the other whole-step variants, every mode otherwise."""
    if name not in STEP_VARIANTS:
        return MODES
    return ("inference", "train_step") if name.endswith("-step") else ("train_step",)


class Compiled:
    """A model compiled by one variant; :meth:`case` makes the case of a mode (the compiled object is reused)."""

    def __init__(self, module: nn.Module, fn: Callable, before_call: Callable[[], None] = no_op) -> None:
        self.module = module
        self.fn = fn
        self.before_call = before_call

    def case(self, mode: str, args: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
        return module_case(self.fn, self.module, mode, args, grad_out, self.before_call)


class CompiledPerPhase(Compiled):
    """A Thunder variant: one jitted function per phase (inference, training), made lazily on the same module.

    Thunder tries the cache entries of a jitted function newest first, and a call whose entry is not the newest first
    runs the prologues of the newer ones until one passes; an inference call made after the training entry exists pays
    for a failing training prologue (in an interleaved run on the H200, cudagraphex compiled once took 1.33x the time
    of the transform, compiled per phase, in MLP inference; compiled per phase, 0.81x in the next run). Thunder's
    ``CUDAGraphTransform`` (0.2.6) cannot serve both phases anyway: it takes every optimized computation trace for an
    augmented forward, the no-grad one included, so compiling the training trace after the inference one fails ("called
    on augmented forward twice without backward in between"). Thunder compiles inference and training traces
    separately either way, so this costs no extra compilation.
    """

    def __init__(self, module: nn.Module, make: Callable[[nn.Module], Callable]) -> None:
        super().__init__(module, None)
        self._make = make
        self._by_phase: dict[str, Callable] = {}

    def fn_for(self, mode: str) -> Callable:
        """The jitted function of ``mode``'s phase (made on first use); it becomes :attr:`fn`."""
        phase = "inference" if mode == "inference" else "training"
        if phase not in self._by_phase:
            self._by_phase[phase] = self._make(self.module)
        self.fn = self._by_phase[phase]
        return self.fn

    def case(self, mode: str, args: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
        self.fn_for(mode)
        return super().case(mode, args, grad_out)


def thunder_options(name: str, graph_executor) -> dict:
    """The options of ``thunder.jit`` for Thunder variant ``name``, without its ``-step`` or ``+wholestep(unsafe)``
    suffix (new transform objects on every call). ``+torchcompile`` adds Thunder's torch.compile executor."""
    import thunder

    defaults = list(thunder.get_default_executors())
    if name == "thunder":
        return {}
    if name == "thunder+CUDAGraphTransform":
        from thunder.transforms.cudagraph import CUDAGraphTransform

        return {"transforms": [CUDAGraphTransform()]}
    if name == "thunder+cudagraphex":
        return {"executors": [graph_executor, *defaults]}
    if name == "thunder+cudagraphex(last)":
        return {"executors": [*defaults, graph_executor]}
    if name == "thunder+cudagraphex+PruneParameterChecks":
        # The opt-in for users who promise not to replace parameters (see cudagraphex.PruneParameterChecks).
        from cudagraphex import PruneParameterChecks

        return {"executors": [graph_executor, *defaults], "transforms": [PruneParameterChecks()]}
    if name in ("thunder+torchcompile", "thunder+torchcompile+cudagraphex"):
        from thunder.executors.torch_compile import torch_compile_ex

        graphs = [graph_executor] if name.endswith("+cudagraphex") else []
        return {"executors": [*graphs, torch_compile_ex, *defaults]}
    raise ValueError(f"variant {name!r} is not a Thunder variant")


def compile_variant(name: str, module: nn.Module, graph_executor) -> Compiled:
    """Compiles ``module`` the way variant ``name`` does (not manual-graph or kernel-floor, see :class:`ManualGraph`).

    ``graph_executor`` is the cudagraphex executor to use: ``cudagraphex`` on a GPU, an emulating one on the CPU.
    Raises whatever compiling raises (the runner records it).
    """
    import thunder

    if name == "eager":
        return Compiled(module, module)
    if name.endswith("+wholestep(unsafe)"):
        options = thunder_options(name.removesuffix("+wholestep(unsafe)"), graph_executor)
        return WholeStep(module, thunder.jit(module, **options))
    if name in STEP_VARIANTS:
        options = thunder_options(name.removesuffix("-step"), graph_executor)
        return GraphStep(module, lambda m: thunder.jit(m, **options))
    if name.startswith("thunder"):
        return CompiledPerPhase(module, lambda m: thunder.jit(m, **thunder_options(name, graph_executor)))
    if name == "torch.compile":
        return Compiled(module, torch.compile(module))
    if name == "torch.compile(reduce-overhead)":
        # The documented way to use CUDA-graph trees: mark the start of every step (every call of the model).
        return Compiled(module, torch.compile(module, mode="reduce-overhead"), torch.compiler.cudagraph_mark_step_begin)
    raise ValueError(f"variant {name!r} is not a compiled variant")


def _capture(fn: Callable[[], object], *, no_grad: bool, stream: torch.cuda.Stream | None = None):
    """Warms ``fn`` up on a side stream, then captures it into a new graph; returns (graph, what the capture returned).

    This is the recipe of the PyTorch CUDA-graph documentation: warm-up iterations on a side stream (lazy
    initialisation, cuBLAS workspaces, autograd's stream bookkeeping), then ``torch.cuda.graph`` on that stream.
    """
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.set_grad_enabled(not no_grad):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream), torch.set_grad_enabled(not no_grad):
        out = fn()
    return graph, out


def _graphed_step_case(
    fn: Callable[..., torch.Tensor], module: nn.Module, args: Sequence[torch.Tensor], grad_out: torch.Tensor | None
) -> Case:
    """``train_step`` captured by hand: :func:`train_step` of ``fn`` (``module`` or a compiled form of it) on input
    buffers, warmed up and captured whole into one graph by :func:`_capture`; a call copies the inputs into the buffers
    and replays. Nothing checks that a replay is still valid."""
    params = params_of(module)
    opt = make_optimizer(params)
    start = StepStart(params, opt)
    static_args = [a.clone() for a in args]
    step = train_step(fn, opt, grad_out)
    graph, out = _capture(lambda: step(*static_args), no_grad=False)
    # A graph holds addresses, not tensors: the case keeps the parameters, the optimizer state and the input buffers.
    kept: list[object] = [module, fn, opt, static_args]

    def replay() -> torch.Tensor:
        for static, a in zip(static_args, args, strict=True):
            static.copy_(a)
        graph.replay()
        return out

    return start.case(replay, kept.clear)


class WholeStep(Compiled):
    """The ``wholestep(unsafe)`` variants: ``train_step`` of the Thunder-compiled model captured by hand into one
    graph, as manual-graph captures eager's (:func:`_graphed_step_case`). Every case captures a new graph of the same
    module."""

    def case(self, mode: str, args: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
        check_mode(mode, ("train_step",))
        return _graphed_step_case(self.fn, self.module, args, grad_out)


class GraphStep(CompiledPerPhase):
    """The ``-step`` variants: :func:`train_step` (in ``inference``, the no-grad forward) of a Thunder-compiled module
    run through ``cudagraphex.graph_step``, which runs the first calls as they are, then captures the whole call once
    and replays it while its guards hold. Every case makes a new step graph; :attr:`step` is that of the open case (for
    its report)."""

    def __init__(self, module: nn.Module, make: Callable[[nn.Module], Callable]) -> None:
        super().__init__(module, make)
        self.step = None

    def case(self, mode: str, args: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
        import cudagraphex

        check_mode(mode, ("inference", "train_step"))
        fn = self.fn_for(mode)
        backend = graph_backend(next(self.module.parameters()).device)

        def close() -> None:
            if self.step is step:  # the graph's pool (and the optimizer state) go with the case
                self.step = None

        if mode == "inference":

            def forward(*a: torch.Tensor) -> torch.Tensor:
                with torch.no_grad():
                    return fn(*a)

            step = self.step = cudagraphex.graph_step(forward, modules=[self.module], backend=backend)
            return Case(lambda: step(*args), lambda: [copy_of(step(*args))], close)
        params = params_of(self.module)
        opt = make_optimizer(params)
        start = StepStart(params, opt)
        step = cudagraphex.graph_step(
            train_step(fn, opt, grad_out), modules=[self.module], optimizers=[opt], backend=backend
        )
        self.step = step
        return start.case(lambda: step(*args), close)


class ManualGraph:
    """The ``manual-graph`` variant: each mode captures a fresh copy of the model by hand (module docstring)."""

    def __init__(self, fresh_model: Callable[[], nn.Module]) -> None:
        self.fresh_model = fresh_model

    def case(self, mode: str, args: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
        module = self.fresh_model()
        if mode == "train_step":
            return _graphed_step_case(module, module, args, grad_out)
        params = params_of(module)
        static_args = [a.clone() for a in args]
        # A graph holds addresses, not tensors: the case keeps the module (parameters), the input buffers and the
        # forward's autograd graph (its saved tensors) alive until it is closed.
        kept: list[object] = [module, static_args]

        def copy_inputs() -> None:
            for static, a in zip(static_args, args, strict=True):
                static.copy_(a)

        if mode == "inference":
            graph, out = _capture(lambda: module(*static_args), no_grad=True)

            def replay() -> None:
                copy_inputs()
                graph.replay()

            def collect() -> list[torch.Tensor | None]:
                replay()
                return [copy_of(out)]

            return Case(replay, collect, kept.clear)

        if mode == "train_fwd":
            graphed = torch.cuda.make_graphed_callables(module, tuple(static_args))

            def call() -> None:
                graphed(*args)

            return Case(call, lambda: [copy_of(graphed(*args))], kept.clear)

        if mode == "train_bwd":
            # Autograd runs a backward op on the stream of its forward op: the forward runs (once, eagerly) on the
            # stream the backward is then captured on.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                out = module(*static_args)

            def grads() -> tuple[torch.Tensor | None, ...]:
                return torch.autograd.grad(out, params, grad_out, retain_graph=True, allow_unused=True)

            graph, static_grads = _capture(grads, no_grad=False, stream=stream)
            kept.append(out)

            def collect_grads() -> list[torch.Tensor | None]:
                graph.replay()
                return [copy_of(g) for g in static_grads]

            return Case(graph.replay, collect_grads, kept.clear)

        raise ValueError(f"unknown mode {mode!r}")


def make_variant(name: str, fresh_model: Callable[[], nn.Module], graph_executor) -> Compiled | ManualGraph:
    """Variant ``name`` ready to make cases from: hand-captured for manual-graph, the eager model for kernel-floor (the
    runner profiles it), compiled by :func:`compile_variant` otherwise. ``fresh_model`` makes an independent copy of
    the workload's model. Raises whatever compiling raises."""
    if name == "manual-graph":
        return ManualGraph(fresh_model)
    if name == "kernel-floor":
        module = fresh_model()
        return Compiled(module, module)
    return compile_variant(name, fresh_model(), graph_executor)


def device_time_per_call_us(call: Callable[[], None], calls: int) -> float:
    """The GPU time of one ``call``: kernels, memcpys and memsets recorded by ``torch.profiler`` over ``calls`` calls,
    summed and divided by ``calls``. Raises RuntimeError if the profiler saw no GPU activity (no CUPTI, say)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    total_us = 0.0
    seen = 0
    for event in prof.events():
        # GPU-side user annotations span kernels that are counted on their own.
        if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        total_us += event.time_range.elapsed_us()
        seen += 1
    if not seen:
        raise RuntimeError("the profiler recorded no GPU activity (is CUPTI available?)")
    return total_us / calls
