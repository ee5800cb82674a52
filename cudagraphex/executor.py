"""The cudagraphex fusion executor: Thunder's execution transform hands it a trace, it returns the trace with its
graph-safe regions replaced by ``CUDAGraphN`` fusions that capture and replay CUDA graphs.

Placed first in the executors list, it claims every graph-safe symbol and lowers each region with the executors that
follow it, so their kernels (``torchcompile`` fusions, sdpa) run inside the graph. Placed last, it claims what the
executors before it left and wraps runs of their already-lowered symbols and fusions. It never reports that it can
execute a symbol to Thunder's autodiff, so the grad rules of the executors after it stay in force.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence

import torch
from thunder.core import prims
from thunder.core.codeutils import SigInfo
from thunder.core.compile_data import get_compile_data
from thunder.core.proxies import TensorProxy, unvariableify
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx
from thunder.executors.passes import (
    _transform_for_operator_executor_execution,
    del_last_used,
    transform_for_execution,
)
from thunder.extend import (
    Executor,
    FusionExecutor,
    OperatorExecutor,
    get_always_executors,
    register_executor,
)

from cudagraphex._protections import PROTECTIONS
from cudagraphex.capture import backend_for
from cudagraphex.compat.trusted_parameters import TRUSTED_ATTRIBUTE
from cudagraphex.planning.regions import RegionSpec, plan_regions, static_outputs, trace_kind
from cudagraphex.planning.rematerialization import behind_barriers, not_recomputable, refused_rematerialization
from cudagraphex.planning.safety import unsafe_reason
from cudagraphex.planning.static_inputs import classify_inputs, static_names
from cudagraphex.planning.symbols import count_ops, input_aliases, rng_state_inputs, with_decompositions
from cudagraphex.planning.unfused import unfused_host_reads, unfused_writes
from cudagraphex.runtime import FunctionGraphs, GraphedRegion, GraphOptions, RegionInfo
from cudagraphex.runtime.release import release_point

__all__ = ["CUDAGraphExecutor", "cudagraphex"]

logger = logging.getLogger("cudagraphex")

_FUSION_PREFIX = "CUDAGraph"
_ticks = itertools.count()


@dataclasses.dataclass
class _Fusion:
    """What is needed to rebuild a fusion when a later pass hands it back to :meth:`CUDAGraphExecutor.fuse`."""

    spec: RegionSpec
    bsym: BoundSymbol | None
    graph_outputs: frozenset[str]
    declared_static: frozenset[str]
    inner: tuple[Executor, ...]
    regions: list[GraphedRegion]
    #: The fusions before this one in its trace: a rebuilt fusion's inputs may be their rebuilt outputs.
    earlier: tuple[str, ...] = ()
    #: When it was last built or handed back; an earlier fusion not handed back since is no longer in the trace.
    tick: int = dataclasses.field(default_factory=lambda: next(_ticks))
    #: The outputs a later graph may read where they are (see :func:`~cudagraphex.planning.regions.static_outputs`).
    static_outputs: frozenset[str] = frozenset()


class CUDAGraphExecutor(FusionExecutor):
    """Captures the graph-safe regions of Thunder traces into CUDA graphs and replays them.

    Use it as ``thunder.jit(fn, executors=[cudagraphex, *thunder.get_default_executors()])``. Subclass it and
    override :meth:`can_fuse` to keep symbols out of graphs.

    Args:
        name: the name Thunder knows the executor by. Register a new instance yourself with
            ``thunder.extend.register_executor`` if you want to refer to it by name.
        min_region_size: regions with fewer ops run eagerly.
        max_graphs_per_region: at most this many graphs are captured for one region (for different input
            signatures, moved static inputs, or while earlier outputs are in use); past it those calls run eagerly.
        warmup_calls: eager calls of a region for a new input signature before it is captured.
        share_pool: whether the graphs of one compiled function share one memory pool per device.
        strict: raise :class:`~cudagraphex.StrictModeError` instead of running a region eagerly after a failed
            capture or past ``max_graphs_per_region``.
        backend: ``"cuda"``, or ``"emulate"``: the CPU replay backend, a testing and debugging mode that captures
            CPU tensors as if they were on a GPU and reproduces the memory semantics of replay.

    Raises:
        ValueError: for an invalid option.
    """

    def __init__(
        self,
        name: str = "cudagraphex",
        *,
        min_region_size: int = 2,
        max_graphs_per_region: int = 8,
        warmup_calls: int = 1,
        share_pool: bool = True,
        strict: bool = False,
        backend: str = "cuda",
    ) -> None:
        self.options = GraphOptions(
            min_region_size=min_region_size,
            max_graphs_per_region=max_graphs_per_region,
            warmup_calls=warmup_calls,
            share_pool=share_pool,
            strict=strict,
            backend=backend,
        )
        super().__init__(name, version=torch.__version__)
        self._backend = backend_for(backend)

    @property
    def device_type(self) -> str:
        """The device type whose tensors this executor captures: "cuda", or "cpu" for the emulated backend."""
        return self._backend.device_type

    # -- claiming ---------------------------------------------------------------------------------------------------

    def can_execute_or_fuse(self, bsym: BoundSymbol) -> bool:
        """Always False: Thunder's autodiff takes a grad rule from the first executor that answers True here, and
        cudagraphex has none of its own, so the executors after it keep theirs (sdpa's backward, for one)."""
        return False

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        """Whether ``bsym`` may be captured. Override to keep symbols out of graphs; call ``super().can_fuse``."""
        return unsafe_reason(bsym, self.device_type) is None

    def _reason_of(self, bsym: BoundSymbol) -> str | None:
        if self.can_fuse(bsym):
            return None
        return unsafe_reason(bsym, self.device_type) or f"excluded by {self._can_fuse_owner()}.can_fuse"

    def _can_fuse_owner(self) -> str:
        """The class whose ``can_fuse`` decides, named in the reasons of the symbols it keeps out."""
        return type(self).__name__

    # -- the fusion pass ----------------------------------------------------------------------------------------------

    def fusion_pass(self, trace: TraceCtx, num_static_inputs: int | None = None) -> TraceCtx:
        """Replaces the graph-safe regions of ``trace`` with ``CUDAGraphN`` fusions.

        Args:
            trace: an execution trace; Thunder passes the joint forward-backward trace (or the computation trace)
                here, the :class:`~cudagraphex.CUDAGraphTransform` adapter passes the forward and backward traces.
            num_static_inputs: legacy. For a backward trace, the first ``num_static_inputs`` tensors saved for
                backward are static, except those the forward got from its caller (a batch, or a view of one), which
                are read as the caller's tensors are. They are matched to each graph's inputs by name; one whose
                address changes between calls is demoted to a copied input.

        Raises:
            ValueError: if ``num_static_inputs`` is not a non-negative int no larger than the number of saved
                tensors, or ``trace`` is not a backward trace.
        """
        start = time.perf_counter()
        declared = _declared_static(trace, num_static_inputs)
        graphs = self._function_graphs()
        kind = trace_kind(trace)
        is_backward = kind == "backward"
        # A batch the forward saved moves with every call: declared static, it would cost a graph per move.
        declared -= graphs.forward_caller_outputs if is_backward else frozenset()
        earlier_outputs = graphs.forward_graph_outputs if is_backward else frozenset()
        inner = self._inner_executors()
        # Only a fusion pass after this one rematerializes (see planning/rematerialization) or rebuilds fusions.
        rematerialized = any(isinstance(ex, FusionExecutor) for ex in inner)
        if rematerialized:
            trace = with_decompositions(trace)
        plan = plan_regions(
            trace,
            self._reason_of,
            min_size=self.options.min_region_size,
            declared_static=declared,
            graph_outputs=earlier_outputs,
            kept_whole=_kept_whole_by(inner),
        )
        regions: list[GraphedRegion] = []
        graphs.traces.append((kind, plan.breaks, regions))
        if not plan.regions:
            logger.info(
                "cudagraphex: nothing to capture in this %s trace (no run of graph-safe symbols on a %s device)",
                kind,
                self.device_type,
            )

        graph_outputs = set(earlier_outputs)
        bsyms: list[BoundSymbol] = []
        earlier: list[str] = []
        wrong = not_recomputable(plan.sequence) if rematerialized else {}
        for index, item in enumerate(plan.sequence):
            if isinstance(item, RegionSpec):
                fusion = _Fusion(
                    dataclasses.replace(item, not_recomputable=wrong.get(index, frozenset())),
                    None,
                    frozenset(graph_outputs),
                    frozenset(declared),
                    inner,
                    regions,
                    tuple(earlier),
                )
                name = f"{_FUSION_PREFIX}{graphs.next_fusion_id()}"
                bsyms.append(self._build(name, fusion, graphs))
                graph_outputs.update(graphs.fusions[name].static_outputs)
                earlier.append(name)
            else:
                bsyms.append(item)
        if kind == "forward":
            graphs.forward_graph_outputs = frozenset(graph_outputs)
            graphs.forward_caller_outputs = plan.caller_outputs

        fused = from_trace(trace)

        def is_region(b: BoundSymbol) -> bool:
            return b.sym.executor is self and b.sym.is_fusion

        with tracectx(fused):
            if rematerialized:
                bsyms = unfused_writes(bsyms, is_region, inner, trace)
            fused.bound_symbols = behind_barriers(bsyms, wrong, is_region)
        # Symbols this executor claimed but left out of every graph go back to the executors after it, but for writes
        # and `item`, which their fusions would run wrongly (see planning/unfused).
        fused = _transform_for_operator_executor_execution(fused, inner)
        fused.bound_symbols = unfused_host_reads(fused.bound_symbols)
        elapsed = (time.perf_counter() - start) * 1e3
        fused.set_provenance(TraceProvenance(f"cudagraphex fusion (took {elapsed:.0f} milliseconds)"))
        return fused

    def fuse(self, region, fusion_counter: int) -> BoundSymbol:
        """Rebuilds fusion ``CUDAGraph<fusion_counter>`` from ``region`` (Thunder calls this after a later fusion
        pass, e.g. rematerialization, may have changed the fusion's symbols, inputs or outputs)."""
        graphs = self._function_graphs()
        name = f"{_FUSION_PREFIX}{fusion_counter}"
        fusion = graphs.fusions.get(name)
        if fusion is None:
            raise ValueError(f"{self.name} has no fusion named {name} in this compiled function")
        spec = fusion.spec
        # Thunder hands back every fusion of a trace in order; one that was not handed back before this one was
        # removed from the trace (rematerialization can leave a producer with nothing left to return).
        earlier = [graphs.fusions[n] for n in fusion.earlier if graphs.fusions[n].tick > fusion.tick]
        removed = [graphs.fusions[n].spec for n in fusion.earlier if graphs.fusions[n].tick <= fusion.tick]
        handed_back = [unvariableify(x) for x in region.outputs]
        members, inputs, outputs = refused_rematerialization(
            spec,
            list(region.bound_symbols),
            [unvariableify(x) for x in region.inputs],
            handed_back,
            [producer.spec for producer in earlier],
            _fused_by(fusion.inner),
            removed,
        )
        input_names = {p.name for p in inputs}
        output_names = {p.name for p in outputs}
        if len(members) != len(region.bound_symbols) or output_names != {p.name for p in handed_back}:
            logger.info("%s: keeps the tensors saved for backward it planned; rematerialization refused", name)
        unchanged = (
            input_names == {p.name for p in spec.inputs}
            and output_names == {p.name for p in spec.outputs}
            and len(members) == len(spec.bound_symbols)
            and all(a is b for a, b in zip(members, spec.bound_symbols, strict=True))
        )
        if unchanged:
            graphs.fusions[name] = dataclasses.replace(fusion, tick=next(_ticks))
            return fusion.bsym
        written, aliases = input_aliases(members, input_names)
        mutated = frozenset().union(*written.values())
        new_spec = dataclasses.replace(
            spec,
            bound_symbols=members,
            inputs=inputs,
            outputs=outputs,
            returned=spec.returned & output_names,
            mutated=mutated,
            mutated_trace_inputs=spec.mutated_trace_inputs & mutated,
            caller_inputs=spec.caller_inputs & input_names,
            written=written,
            aliases={name: aliases[name] for name in output_names if aliases.get(name)},
            rng_state_inputs=rng_state_inputs(members, input_names),
            last_read=spec.last_read & input_names,
        )
        # Rematerialization that is kept changes which forward outputs the backward reads: they stay static.
        graph_outputs = fusion.graph_outputs.union(*(producer.static_outputs for producer in earlier))
        rebuilt = dataclasses.replace(fusion, spec=new_spec, graph_outputs=graph_outputs, tick=next(_ticks))
        return self._build(name, rebuilt, graphs)

    def _build(self, name: str, fusion: _Fusion, graphs: FunctionGraphs) -> BoundSymbol:
        spec = fusion.spec
        fn = _region_callable(name, spec, fusion.inner)
        in_place = PROTECTIONS["mutated_inputs_stay_static"]
        kinds = classify_inputs(
            spec.inputs,
            graph_outputs=fusion.graph_outputs,
            declared_static=fusion.declared_static,
            mutated_trace_inputs=spec.mutated_trace_inputs if in_place else (),
            caller_inputs=spec.caller_inputs,
        )
        info = RegionInfo(
            name=name,
            phase=spec.phase,
            device=spec.device,
            num_ops=count_ops(spec.bound_symbols),
            input_names=[p.name for p in spec.inputs],
            output_names=[p.name for p in spec.outputs],
            returned=spec.returned,
            mutated=spec.mutated,
        )
        region = GraphedRegion(
            fn,
            info,
            kinds,
            graphs,
            [in_place and p.name in spec.mutated for p in spec.inputs],
            [p.name in spec.rng_state_inputs for p in spec.inputs],
            [p.name in spec.last_read for p in spec.inputs],
        )
        sym = Symbol(name, meta=None, is_fusion=True, executor=self)
        bsym = BoundSymbol(
            sym,
            tuple(spec.inputs),
            {},
            list(spec.outputs),
            spec.bound_symbols,
            _call_ctx={name: region},
        )
        old = graphs.fusions.get(name)
        if old is not None and old.bsym is not None:
            fusion.regions[:] = [region if r.name == name else r for r in fusion.regions]
        else:
            fusion.regions.append(region)
        static = static_names(spec.inputs, kinds)
        graphs.fusions[name] = dataclasses.replace(
            fusion, bsym=bsym, static_outputs=static_outputs(spec, static.__contains__)
        )
        return bsym

    # -- context ------------------------------------------------------------------------------------------------------

    def _inner_executors(self) -> tuple[Executor, ...]:
        """The executors after this one in the compiled function's list: they lower the symbols inside graphs."""
        cd = get_compile_data()
        executors = tuple(cd.executors_list) if cd is not None else ()
        if self not in executors:
            return tuple(get_always_executors())
        return executors[executors.index(self) + 1 :]

    def _function_graphs(self) -> FunctionGraphs:
        """The graphs of the function being compiled, kept on its compile data so that they die with it."""
        cd = get_compile_data()
        if cd is None:
            return FunctionGraphs(self._backend, self.options)
        states = cd.__dict__.setdefault("_cudagraphex", {})
        graphs = states.get(self.name)
        if graphs is None:
            graphs = states[self.name] = FunctionGraphs(self._backend, self.options)
            graphs.parameters_trusted = getattr(cd, TRUSTED_ATTRIBUTE, False)
        return graphs


def _declared_static(trace: TraceCtx, num_static_inputs: int | None) -> frozenset[str]:
    if num_static_inputs is None:
        return frozenset()
    if not isinstance(num_static_inputs, int) or isinstance(num_static_inputs, bool) or num_static_inputs < 0:
        raise ValueError(f"num_static_inputs must be a non-negative int, got {num_static_inputs!r}")
    if trace_kind(trace) != "backward":
        raise ValueError("num_static_inputs applies to backward traces (traces tagged TraceTag.BACKWARD) only")
    saved = [p for p in trace.args[0][0] if isinstance(p, TensorProxy)]
    if num_static_inputs > len(saved):
        raise ValueError(f"num_static_inputs={num_static_inputs} but the backward trace saves {len(saved)} tensors")
    return frozenset(p.name for p in saved[:num_static_inputs])


def _kept_whole_by(inner: Sequence[Executor]) -> Callable[[BoundSymbol], bool]:
    """Whether the executors in ``inner`` execute a bound symbol as it is, rather than its decomposition: an operator
    executor that implements it, or a fusion executor that fuses it."""
    operators = [ex for ex in inner if isinstance(ex, OperatorExecutor)]
    fused = _fused_by(inner)
    return lambda bsym: any(ex.can_execute(bsym) for ex in operators) or fused(bsym)


def _fused_by(inner: Sequence[Executor]) -> Callable[[BoundSymbol], bool]:
    """Whether one of the fusion executors in ``inner`` fuses a bound symbol into a larger kernel. An executor with
    ``required_ops`` (torch.compile's cross-entropy and cat executors) fuses only regions holding one of those."""
    fusers = [ex for ex in inner if isinstance(ex, FusionExecutor) and getattr(ex, "required_ops", None) is None]
    return lambda bsym: any(ex.can_fuse(bsym) for ex in fusers)


def _region_callable(name: str, spec: RegionSpec, inner: Sequence[Executor]):
    """The region as a Python function of its inputs, lowered with ``inner`` and freeing intermediates early, with a
    release point after the last read of each input it reads last (``runtime.release``)."""
    trace = TraceCtx(None)
    trace.args = list(spec.inputs)
    trace.kwargs = {}
    trace.names = {p.name for p in spec.inputs}
    with tracectx(trace):
        for p in spec.inputs:
            prims.unpack_trivial(p, name=p.name)
    trace.bound_symbols += list(spec.bound_symbols)
    trace.bound_symbols.append(prims.python_return.bind(list(spec.outputs), output=None))
    for bsym in spec.bound_symbols:
        for sub in (bsym, *bsym.subsymbols):
            for p in sub.flat_proxy_outs:
                trace.names.add(p.name)
    trace._siginfo = SigInfo(name)
    trace._siginfo.args = [(p.name, None) for p in spec.inputs]
    lowered = transform_for_execution(trace, inner)
    if spec.last_read:
        lowered = _with_release_points(lowered, spec.last_read)
    return del_last_used(lowered).python_callable()


_RELEASE_POINT = Symbol("cudagraphex_release_point", meta=None)


def _with_release_points(trace: TraceCtx, names: frozenset[str]) -> TraceCtx:
    """``trace`` with ``release_point(t)`` right after the last symbol that reads each input ``t`` of ``names``, or a
    tensor that may be a view of it."""
    bsyms = list(trace.bound_symbols)
    _, views = input_aliases(bsyms, names)
    last: dict[str, int] = {}
    for i, bsym in enumerate(bsyms):
        if bsym.sym.id not in (prims.PrimIDs.RETURN, prims.PrimIDs.UNPACK_TRIVIAL):
            for p in bsym.flat_proxy_args:
                for root in views.get(p.name, frozenset()) | ({p.name} & names):
                    last[root] = i
    proxies = {p.name: p for p in trace.args}
    for name, i in sorted(last.items(), key=lambda item: -item[1]):
        point = BoundSymbol(
            _RELEASE_POINT, (proxies[name],), {}, None, (), _call_ctx={_RELEASE_POINT.name: release_point}
        )
        bsyms.insert(i + 1, point)
    released = from_trace(trace)
    released.bound_symbols = bsyms
    return released


#: The executor instance Thunder knows as "cudagraphex".
cudagraphex = CUDAGraphExecutor()
register_executor(cudagraphex)
