"""The variants: how each one compiles a model, and how it runs one call of each mode.

A variant turns a model into a :class:`Case` per mode. ``Case.call`` runs one call and drops what it returns (a
caller that keeps outputs would make graph runtimes copy them); ``Case.collect`` runs one call (two in
``train_step``) and returns copies of what the correctness check compares with eager: the output for ``inference`` and
``train_fwd``, the parameter gradients for ``train_bwd``; for ``train_step``, see below.

Per-mode work is the same for every variant:

* ``inference``: ``model(*args)`` under ``torch.no_grad``.
* ``train_fwd``: ``model(*args)`` with autograd recording; the output and its graph are dropped.
* ``train_bwd``: the forward runs once when the case is made; each call is
  ``torch.autograd.grad(out, params, grad_out, retain_graph=True)``, which returns the gradients instead of
  accumulating them into ``.grad``, so every call does the same work.
* ``train_step``: ``out = model(*args)``, ``out.backward(grad_out)``, ``opt.step()``,
  ``opt.zero_grad(set_to_none=True)``, with the case's own AdamW (:func:`make_optimizer`, :func:`train_step`).
  ``collect`` starts from the state the case started from (:meth:`_StepStart.collect`), so that every variant
  compares the same step: the output, the gradients (as AdamW's first moments) and the output after the step.

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
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks.workloads import MODES

__all__ = [
    "GRAPH_VARIANTS",
    "STEP_VARIANTS",
    "VARIANTS",
    "Case",
    "Compiled",
    "CompiledPerPhase",
    "GraphStep",
    "ManualGraph",
    "WholeStep",
    "compile_variant",
    "device_time_per_call_us",
    "make_optimizer",
    "make_variant",
    "module_case",
    "thunder_options",
    "train_step",
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


def _no_op() -> None:
    return None


def variant_modes(name: str) -> tuple[str, ...]:
    """The modes variant ``name`` runs (where a workload has them): ``inference`` and ``train_step`` for a variant
    through ``graph_step``, ``train_step`` for the other whole-step variants, every mode otherwise."""
    if name not in STEP_VARIANTS:
        return MODES
    return ("inference", "train_step") if name.endswith("-step") else ("train_step",)


def _only(mode: str, modes: tuple[str, ...]) -> None:
    if mode not in modes:
        raise ValueError(f"mode {mode!r} is not applicable: this variant runs {', '.join(modes)} only")


def _backward_only_case(out: torch.Tensor, params: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
    """``train_bwd``: each call replays the backward of the one forward that produced ``out``."""
    held = {"out": out}

    def grads() -> tuple[torch.Tensor | None, ...]:
        return torch.autograd.grad(held["out"], params, grad_out, retain_graph=True, allow_unused=True)

    def call() -> None:
        grads()

    return Case(call, lambda: [_copy(g) for g in grads()], held.clear)


@dataclass
class Case:
    """One variant in one mode, ready to run. Call :attr:`close` when done, to free what the case holds."""

    call: Callable[[], None]
    collect: Callable[[], list[torch.Tensor | None]]
    close: Callable[[], None] = field(default=_no_op)


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _params(module: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def module_case(
    fn: Callable[..., torch.Tensor],
    module: nn.Module,
    mode: str,
    args: Sequence[torch.Tensor],
    grad_out: torch.Tensor | None,
    before_call: Callable[[], None] = _no_op,
) -> Case:
    """The case of mode ``mode`` for ``fn``, a callable with the signature of ``module`` that uses its parameters.

    ``before_call`` runs before every call of ``fn`` (``torch.compiler.cudagraph_mark_step_begin`` for
    reduce-overhead). Training modes need ``grad_out``, the cotangent of the output. ``train_bwd`` runs the forward
    once, here.
    """
    params = _params(module)

    if mode == "inference":

        def forward() -> torch.Tensor:
            before_call()
            with torch.no_grad():
                return fn(*args)

        def call() -> None:
            forward()

        return Case(call, lambda: [_copy(forward())])

    if mode == "train_fwd":

        def call() -> None:
            before_call()
            fn(*args)

        def collect() -> list[torch.Tensor | None]:
            before_call()
            return [_copy(fn(*args))]

        return Case(call, collect)

    if mode == "train_bwd":
        before_call()
        return _backward_only_case(fn(*args), params, grad_out)

    if mode == "train_step":
        opt = make_optimizer(params)
        step = train_step(fn, opt, grad_out, before_call)
        return _StepStart(params, opt).case(lambda: step(*args))

    raise ValueError(f"unknown mode {mode!r}")


def make_optimizer(params: Sequence[torch.nn.Parameter]) -> torch.optim.AdamW:
    """The optimizer of a ``train_step`` case: ``AdamW(params, lr=1e-3, capturable=True, foreach=True)`` on CUDA
    (capturable: its step counter stays on the device, which graph capture needs). AdamW is capturable on CUDA only; on
    the CPU (the suite's own tests) it is the fused AdamW, whose step counter is a tensor too, so that there as well a
    step reads no value back to the host."""
    if any(p.is_cuda for p in params):
        return torch.optim.AdamW(params, lr=1e-3, capturable=True, foreach=True)
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def train_step(
    fn: Callable[..., torch.Tensor],
    opt: torch.optim.Optimizer,
    grad_out: torch.Tensor | None,
    before_call: Callable[[], None] = _no_op,
) -> Callable[..., torch.Tensor]:
    """The ``train_step`` call of every variant: ``step(*args)`` runs ``before_call()``, ``out = fn(*args)``,
    ``out.backward(grad_out)``, ``opt.step()``, ``opt.zero_grad(set_to_none=True)``, and returns ``out``.

    The gradients are None between calls, so each call's backward allocates them afresh; whole-step graphs capture
    this same function (the captured ``zero_grad`` drops the references to gradients the graph's pool holds).
    """

    def train_step_call(*args: torch.Tensor) -> torch.Tensor:
        before_call()
        out = fn(*args)
        out.backward(grad_out)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    return train_step_call


class _StepStart:
    """The state a ``train_step`` case starts from: its parameters (copied to the host when the case is made) and its
    optimizer's state, all zeros (a fresh AdamW's state, once it exists)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
        self.params = params
        self.opt = opt
        # On the host: the copy would otherwise count in the variant's peak GPU memory.
        self.values = [p.detach().to("cpu", copy=True) for p in params]

    def collect(self, step: Callable[[], torch.Tensor]) -> list[torch.Tensor | None]:
        """Puts the parameters and the optimizer state back to the start, in place (graphs keep their addresses), runs
        ``step`` twice, and returns copies of: the first call's output; every parameter's first moment after it
        (``exp_avg``, which one step from zero state makes (1 - beta1) x the gradient); the second call's output,
        computed with the parameters the first call's optimizer step made.

        The parameters are not compared directly: AdamW's first update is about ``lr`` in every element whatever its
        gradient (``lr * g / (|g| + eps)``), so where the gradient is rounding noise (an attention's key bias, whose
        gradient is zero in exact arithmetic) variants differ by up to ``2 * lr``; the output after the step does not
        depend on those elements."""
        with torch.no_grad():
            for p, value in zip(self.params, self.values, strict=True):
                p.copy_(value)
            for state in self.opt.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
        first = _copy(step())
        state = self.opt.state
        moments = [_copy(state[p]["exp_avg"]) if p in state else None for p in self.params]
        return [first, *moments, _copy(step())]

    def case(self, step: Callable[[], torch.Tensor], close: Callable[[], None] = _no_op) -> Case:
        """The case whose calls run ``step`` and whose :meth:`collect` starts from this state."""

        def call() -> None:
            step()

        return Case(call, lambda: self.collect(step), close)


class Compiled:
    """A model compiled by one variant; :meth:`case` makes the case of a mode (the compiled object is reused)."""

    def __init__(self, module: nn.Module, fn: Callable, before_call: Callable[[], None] = _no_op) -> None:
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
    params = _params(module)
    opt = make_optimizer(params)
    start = _StepStart(params, opt)
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
        _only(mode, ("train_step",))
        return _graphed_step_case(self.fn, self.module, args, grad_out)


class GraphStep(CompiledPerPhase):
    """The ``-step`` variants: :func:`train_step` (in ``inference``, the no-grad forward) of a Thunder-compiled module
    run through ``cudagraphex.graph_step``, which runs the first calls as they are, then captures the whole call once
    and replays it while its guards hold. Every case makes a new step graph; :attr:`step` is that of the open case (for
    its report). On the CPU it uses cudagraphex's emulating backend."""

    def __init__(self, module: nn.Module, make: Callable[[nn.Module], Callable]) -> None:
        super().__init__(module, make)
        self.step = None

    def case(self, mode: str, args: Sequence[torch.Tensor], grad_out: torch.Tensor | None) -> Case:
        import cudagraphex

        _only(mode, ("inference", "train_step"))
        fn = self.fn_for(mode)
        backend = {} if any(p.is_cuda for p in self.module.parameters()) else {"backend": "emulate"}

        def close() -> None:
            if self.step is step:  # the graph's pool (and the optimizer state) go with the case
                self.step = None

        if mode == "inference":

            def forward(*a: torch.Tensor) -> torch.Tensor:
                with torch.no_grad():
                    return fn(*a)

            step = self.step = cudagraphex.graph_step(forward, modules=[self.module], **backend)
            return Case(lambda: step(*args), lambda: [_copy(step(*args))], close)
        params = _params(self.module)
        opt = make_optimizer(params)
        start = _StepStart(params, opt)
        step = cudagraphex.graph_step(train_step(fn, opt, grad_out), modules=[self.module], optimizers=[opt], **backend)
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
        params = _params(module)
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
                return [_copy(out)]

            return Case(replay, collect, kept.clear)

        if mode == "train_fwd":
            graphed = torch.cuda.make_graphed_callables(module, tuple(static_args))

            def call() -> None:
                graphed(*args)

            return Case(call, lambda: [_copy(graphed(*args))], kept.clear)

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
                return [_copy(g) for g in static_grads]

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
