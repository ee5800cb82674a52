"""How a trace is cut into regions that become graphs.

A region is a longest run of consecutive graph-safe bound symbols on one device and in one phase (forward or
backward). Runs keep the trace's order, so capturing never reorders side effects or random draws. ``del`` and comments
never enter a graph but do not split a run: they move behind the graph. Every other symbol left out records a
:class:`Break` with its reason and the user's source line. A symbol that takes a tensor only for its metadata
(``expand_as(t, x)``) enters a region as its decomposition where the region's lowering would decompose it, so that the
graph does not take that tensor (Thunder would save it for backward). A run whose results nothing reads (it only writes
tensors nothing reads later) is left out as well: Thunder's rematerialization, which every fusion pass after cudagraphex
runs, refuses a fusion without outputs that reads another fusion's ("The consumer has no outputs").

Three hazards can only be seen once runs exist, so forming regions iterates until none is left:

- an in-place write (``copy_``) into a region input that cannot be kept static (a tensor an eager symbol produces
  anew on every call) would land in the graph's private copy of it; the write is kept out of the graph;
- in a joint forward-backward trace Thunder keeps a ``copy_`` into a forward tensor in the forward pass, but a region
  that holds it moves to the backward pass unless one of its outputs is needed by the forward; such a write is kept
  out of the graph too;
- in a joint trace Thunder moves a write outside graphs that the forward does not need into the backward pass, and
  what only that write reads with it; a region would keep the latter in the forward, so it is kept out of the graph
  (:mod:`~cudagraphex.planning.split`).

In a joint trace, a region that defines a tensor an in-place op then writes, and whose value before the write the
backward reads, also returns a copy of it taken before the write (:mod:`~cudagraphex.planning.snapshots`).

Regions can change after they are planned: every fusion executor after cudagraphex runs Thunder's rematerialization
on the whole trace, which treats a forward and a backward graph like two fusions (see
:func:`~cudagraphex.planning.rematerialization.refused_rematerialization`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceTag

from cudagraphex.planning.safety import TRANSPARENT, UNPACKS, rng_state_args
from cudagraphex.planning.snapshots import with_snapshots
from cudagraphex.planning.split import forward_pass, moved_write_feeders, split_hazards
from cudagraphex.planning.static_inputs import classify_inputs, static_names
from cudagraphex.planning.symbols import (
    count_ops,
    decompose_metadata_reads,
    device_of,
    flat_proxies,
    input_aliases,
    rng_state_inputs,
    source_line,
)

__all__ = [
    "Break",
    "Plan",
    "RegionSpec",
    "is_joint",
    "plan_regions",
    "static_outputs",
    "trace_kind",
]

_STRUCTURAL = UNPACKS | {prims.PrimIDs.RETURN, "clear_mutable_collection"}


@dataclass(frozen=True)
class Break:
    """A symbol kept out of every graph."""

    symbol: str
    reason: str
    source: str | None
    #: Unpacking, returning and clearing collections: part of every trace's frame, not worth a user's attention.
    structural: bool = False


@dataclass
class RegionSpec:
    """A run of graph-safe symbols, with what the runtime needs to know about its inputs and outputs."""

    bound_symbols: list[BoundSymbol]
    inputs: list[TensorProxy]
    outputs: list[TensorProxy]
    device: str
    #: "forward", "backward" or "computation" (a trace without backward).
    phase: str
    #: Outputs whose tensor object may reach the caller of the compiled function: forward outputs and gradients, and
    #: the tensors that a symbol outside graphs may pass on to one as themselves (``contiguous``, an in-place op).
    returned: frozenset[str] = frozenset()
    #: Inputs the region may write in place.
    mutated: frozenset[str] = frozenset()
    #: Inputs the region writes in place that are inputs of the whole trace (or alias one through update_aliases).
    mutated_trace_inputs: frozenset[str] = frozenset()
    #: Inputs the caller passes in: inputs of the whole trace (in a backward, also the ones saved from them) and
    #: cotangents.
    caller_inputs: frozenset[str] = frozenset()
    #: For each member that writes in place (by ``id``), the inputs its write may reach.
    written: dict[int, frozenset[str]] = field(default_factory=dict, repr=False)
    #: For each output that may share memory with inputs (a view of one), those inputs.
    aliases: dict[str, frozenset[str]] = field(default_factory=dict, repr=False)
    #: Inputs that members read as dropout RNG state (see :data:`~cudagraphex.planning.safety.RNG_STATE_PARAMETERS`).
    rng_state_inputs: frozenset[str] = frozenset()
    #: Backward inputs this region reads last: nothing after it in the trace reads them, and it neither writes nor
    #: returns them (candidates for giving their memory back at their last use, ``runtime.release``).
    last_read: frozenset[str] = frozenset()
    #: Outputs that a recomputation would get wrong (``planning.rematerialization.not_recomputable``).
    not_recomputable: frozenset[str] = frozenset()


@dataclass
class Plan:
    """A trace cut into regions: ``sequence`` is the new order of bound symbols, with regions in place of runs."""

    sequence: list[RegionSpec | BoundSymbol]
    breaks: list[Break] = field(default_factory=list)
    #: Outputs of the trace that are tensors its caller passed in, or may be views of one (a batch a forward saves for
    #: backward): they move with every call.
    caller_outputs: frozenset[str] = frozenset()

    @property
    def regions(self) -> list[RegionSpec]:
        return [item for item in self.sequence if isinstance(item, RegionSpec)]


def trace_kind(trace: TraceCtx) -> str:
    """ "backward", "forward" (Thunder's augmented forward), "forward+backward" (a joint trace, split at its first
    ``get_grad``) or "computation" (no backward)."""
    if TraceTag.BACKWARD in trace.tags:
        return "backward"
    if TraceTag.AUGMENTED_FORWARD in trace.tags:
        return "forward"
    if any(b.sym.id == prims.PrimIDs.GET_GRAD for b in trace.bound_symbols):
        return "forward+backward"
    return "computation"


def is_joint(trace: TraceCtx) -> bool:
    """Whether Thunder splits ``trace`` into a forward and a backward after the fusion passes: a joint trace, also one
    without ``get_grad`` (its caller's inputs require grad, its outputs do not), which :func:`trace_kind` calls
    "computation"."""
    ret = trace.bound_symbols[-1] if trace.bound_symbols else None
    return (
        ret is not None
        and ret.sym.id == prims.PrimIDs.RETURN
        and any(isinstance(a, dict) and "fw_flat_out" in a for a in ret.args)
    )


def _mark_last_reads(plan: Plan) -> None:
    """Sets each backward region's ``last_read`` (see :class:`RegionSpec`)."""
    read_later: set[str] = set()
    for item in reversed(plan.sequence):
        if isinstance(item, RegionSpec):
            if item.phase == "backward":
                own = item.mutated | {p.name for p in item.outputs}
                item.last_read = frozenset(
                    p.name
                    for p in item.inputs
                    if isinstance(p, TensorProxy) and p.name not in read_later and p.name not in own
                )
            read_later.update(p.name for p in item.inputs)
        elif item.sym.id != prims.PrimIDs.DEL:
            read_later.update(p.name for p in item.flat_proxy_args)


def _phases(trace: TraceCtx) -> Callable[[int], str]:
    kind = trace_kind(trace)
    if kind != "forward+backward":
        return lambda i: kind
    first_get_grad = next(i for i, b in enumerate(trace.bound_symbols) if b.sym.id == prims.PrimIDs.GET_GRAD)
    return lambda i: "forward" if i < first_get_grad else "backward"


def _returned_names(trace: TraceCtx) -> frozenset[str]:
    """Names of the tensors the caller receives: forward outputs, gradients and inputs, not saved tensors.

    A trace that returns dicts (Thunder's computation, joint and forward traces) returns what its caller receives in
    them; a forward trace returns its tensors saved for backward after them.
    """
    ret = trace.bound_symbols[-1] if trace.bound_symbols else None
    if ret is None or ret.sym.id != prims.PrimIDs.RETURN:
        return frozenset()
    names = set()
    dicts = [a for a in ret.args if isinstance(a, dict)]
    if dicts:
        for d in dicts:
            names.update(p.name for p in flat_proxies(list(d.values())))
    else:
        names.update(p.name for p in flat_proxies(ret.args))
    return frozenset(names)


def static_outputs(spec: RegionSpec, is_static: Callable[[str], bool]) -> frozenset[str]:
    """The outputs of ``spec`` that a later graph may read where they are: the region's own memory, and views of its
    inputs that are static by ``is_static`` (a view of a parameter). A view of a copied input is the caller's tensor,
    wherever the caller put it."""
    return frozenset(
        p.name for p in spec.outputs if all(is_static(name) for name in spec.aliases.get(p.name, frozenset()))
    )


class _Planner:
    def __init__(
        self,
        trace: TraceCtx,
        reason_of: Callable[[BoundSymbol], str | None],
        min_size: int,
        declared_static: Collection[str],
        graph_outputs: Collection[str],
        kept_whole: Callable[[BoundSymbol], bool],
    ):
        self.trace = trace
        self.kept_whole = kept_whole
        self.bsyms = list(trace.bound_symbols)
        self.reason_of = reason_of
        self.min_size = min_size
        self.declared_static = frozenset(declared_static)
        self.graph_outputs = frozenset(graph_outputs)
        self.phase_of = _phases(trace)
        self.returned = _returned_names(trace)
        self.producer: dict[str, tuple[int, BoundSymbol]] = {}
        self.consumers: dict[str, list[int]] = defaultdict(list)
        for i, b in enumerate(self.bsyms):
            for p in b.flat_proxy_outs:
                self.producer.setdefault(p.name, (i, b))
            if b.sym.id not in TRANSPARENT:
                for p in b.flat_proxy_args:
                    self.consumers[p.name].append(i)
        self.trace_outputs = {p.name for p in flat_proxies(trace.output)}
        _, self.aliases = input_aliases(self.bsyms, None)
        self.forward = forward_pass(self.bsyms)
        #: For each region member (by ``id``), the ``id`` of the symbol of the trace that it is or decomposes.
        self.origin: dict[int, int] = {}

    def plan(self) -> Plan:
        extra: dict[int, str] = {}
        while True:
            plan = self._form(extra)
            hazards = self._hazards(plan)
            if not hazards:
                plan.sequence = with_snapshots(plan.sequence, self.trace)
                self._mark_returned(plan)
                _mark_last_reads(plan)
                plan.caller_outputs = frozenset(n for n in self.trace_outputs if self._from_caller(n))
                return plan
            # A hazard of a member that decomposes a symbol of the trace keeps that symbol out.
            extra.update({self.origin.get(key, key): why for key, why in hazards.items()})

    def _mark_returned(self, plan: Plan) -> None:
        """Sets each region's ``returned``: its outputs that reach the trace's return through symbols outside graphs.

        Any such symbol may return an input as itself (``contiguous`` of a contiguous tensor, ``shallow_copy``, an
        in-place op), so its inputs count as returned wherever one of its outputs does. A graph hands out new tensors,
        so nothing reaches through one.
        """
        names = set(self.returned)
        for item in reversed(plan.sequence):
            if not isinstance(item, RegionSpec) and any(p.name in names for p in item.flat_proxy_outs):
                names.update(p.name for p in item.flat_proxy_args)
        for spec in plan.regions:
            spec.returned = frozenset(p.name for p in spec.outputs if p.name in names)

    def _form(self, extra: dict[int, str]) -> Plan:
        sequence: list = []
        breaks: list[Break] = []
        run: list[tuple[int, BoundSymbol]] = []
        run_device: str | None = None

        def close():
            nonlocal run, run_device
            if run:
                self._close_run(run, sequence, breaks)
            run, run_device = [], None

        for i, b in enumerate(self.bsyms):
            if b.sym.id in TRANSPARENT:
                if run:
                    run.append((i, b))
                else:
                    sequence.append(b)
                continue
            reason = extra.get(id(b)) or self.reason_of(b)
            if reason is not None:
                close()
                sequence.append(b)
                breaks.append(Break(b.sym.name, reason, source_line(b), b.sym.id in _STRUCTURAL))
                continue
            device = device_of(b)
            if run and (
                self.phase_of(i) != self.phase_of(run[0][0])
                or None not in (device, run_device)
                and device != run_device
            ):
                close()
            run_device = run_device or device
            run.append((i, b))
        close()
        return Plan(sequence, breaks)

    def _close_run(self, run: list[tuple[int, BoundSymbol]], sequence: list, breaks: list[Break]) -> None:
        ops = [(i, b) for i, b in run if b.sym.id not in TRANSPARENT]
        size = count_ops(b for _, b in ops)
        if size < self.min_size:
            reason = f"would form a graph of {size} op(s), fewer than min_region_size={self.min_size}"
            self._leave_out(run, ops, reason, sequence, breaks)
            return
        spec = self._spec(ops)
        if not spec.outputs:
            reason = "would form a graph whose results nothing reads (it writes tensors nothing reads later)"
            self._leave_out(run, ops, reason, sequence, breaks)
            return
        sequence.append(spec)
        produced_inside = {p.name for _, b in ops for p in b.flat_proxy_outs}
        for _, b in run:
            if b.sym.id in TRANSPARENT:
                kept = [p for p in b.flat_proxy_args if p.name not in produced_inside]
                if kept and b.sym.id == prims.PrimIDs.DEL:
                    sequence.append(prims.python_del.bind(*kept, output=None))

    @staticmethod
    def _leave_out(
        run: list[tuple[int, BoundSymbol]],
        ops: list[tuple[int, BoundSymbol]],
        reason: str,
        sequence: list,
        breaks: list[Break],
    ) -> None:
        sequence.extend(b for _, b in run)
        breaks.extend(Break(b.sym.name, reason, source_line(b)) for _, b in ops)

    def _spec(self, ops: list[tuple[int, BoundSymbol]]) -> RegionSpec:
        last = ops[-1][0]
        members: list[BoundSymbol] = []
        for _, b in ops:
            for member in decompose_metadata_reads([b], self.kept_whole):
                self.origin[id(member)] = id(b)
                members.append(member)
        produced: dict[str, TensorProxy] = {}
        inputs: dict[str, TensorProxy] = {}
        for b in members:
            for p in b.flat_proxy_args:
                if p.name not in produced and p.name not in inputs:
                    inputs[p.name] = p
            for p in b.flat_proxy_outs:
                produced.setdefault(p.name, p)
        outputs = [
            p
            for name, p in produced.items()
            if name in self.trace_outputs or any(c > last for c in self.consumers.get(name, ()))
        ]
        written, aliases = input_aliases(members, inputs)
        mutated = set().union(*written.values())
        return RegionSpec(
            bound_symbols=members,
            inputs=list(inputs.values()),
            outputs=outputs,
            device=device_of(ops[0][1]) or next(filter(None, map(device_of, (b for _, b in ops))), "cpu"),
            phase=self.phase_of(ops[0][0]),
            mutated=frozenset(mutated),
            mutated_trace_inputs=frozenset(n for n in mutated if self._root_is_trace_input(n)),
            caller_inputs=frozenset(n for n in inputs if self._from_caller(n)),
            written=written,
            aliases={p.name: aliases[p.name] for p in outputs if aliases.get(p.name)},
            rng_state_inputs=rng_state_inputs(members, inputs),
        )

    def _from_caller(self, name: str) -> bool:
        """Whether ``name`` is a tensor the caller passes in (an input of the trace, or a cotangent), or may be a view
        of one."""
        for root in self.aliases.get(name) or (name,):
            producer = self.producer.get(root)
            if producer is not None and producer[1].sym.id == prims.PrimIDs.GET_GRAD or self._root_is_trace_input(root):
                return True
        return False

    def _root_is_trace_input(self, name: str) -> bool:
        """Whether ``name`` is, possibly through update_aliases, an input of the trace."""
        while name in self.producer:
            _, b = self.producer[name]
            if b.sym.id in UNPACKS:
                return True
            if b.sym.id != prims.PrimIDs.UPDATE_ALIASES and b.sym.name != "update_aliases":
                return False
            position = [p.name for p in b.flat_proxy_outs].index(name)
            name = b.flat_proxy_args[position].name
        return True

    def _static_inputs(self, spec: RegionSpec, graph_outputs: Collection[str]) -> set[str]:
        """The inputs of ``spec`` that its graph will read where they are (the runtime's rule)."""
        kinds = classify_inputs(
            spec.inputs,
            graph_outputs=graph_outputs,
            declared_static=self.declared_static,
            mutated_trace_inputs=spec.mutated_trace_inputs,
        )
        return set(static_names(spec.inputs, kinds))

    def _hazards(self, plan: Plan) -> dict[int, str]:
        hazards: dict[int, str] = {}
        graph_outputs = set(self.graph_outputs)
        for spec in plan.regions:
            static = self._static_inputs(spec, graph_outputs)
            for name in sorted(spec.mutated - static):
                why = f"writes in place into {name}, which is produced outside the graph on every call"
                for b in spec.bound_symbols:
                    if name in spec.written.get(id(b), ()):
                        hazards[id(b)] = why
            graph_outputs |= static_outputs(spec, static.__contains__)
        if self.forward is not None:
            hazards.update(split_hazards(self.forward, plan.sequence, _is_region))
            hazards.update(moved_write_feeders(self.forward, plan.sequence, _is_region))
        hazards.update(_rng_state_hazards(plan))
        return hazards


def _is_region(item: object) -> bool:
    return isinstance(item, RegionSpec)


def _rng_state_hazards(plan: Plan) -> dict[int, str]:
    """Graph members that return dropout RNG state which a symbol outside graphs reads: a graph returns that state in
    device memory, where an eager reader would read it through a host pointer."""
    producers = {p.name: b for spec in plan.regions for b in spec.bound_symbols for p in b.flat_proxy_outs}
    hazards = {}
    for item in plan.sequence:
        if isinstance(item, RegionSpec):
            continue
        for p in rng_state_args(item):
            if p.name in producers:
                hazards[id(producers[p.name])] = f"returns dropout RNG state that {item.sym.name} reads outside graphs"
    return hazards


def plan_regions(
    trace: TraceCtx,
    reason_of: Callable[[BoundSymbol], str | None],
    *,
    min_size: int,
    declared_static: Collection[str] = (),
    graph_outputs: Collection[str] = (),
    kept_whole: Callable[[BoundSymbol], bool] = lambda bsym: False,
) -> Plan:
    """Cuts ``trace`` into regions.

    Args:
        trace: the trace to cut; it is not modified.
        reason_of: why a bound symbol must stay out of graphs, or ``None`` if it may be captured.
        min_size: runs with fewer ops stay eager.
        declared_static: names of tensors declared static (legacy ``num_static_inputs``).
        graph_outputs: names of tensors that graphs of earlier traces of the same function produced.
        kept_whole: whether the executors that lower the regions execute a bound symbol as it is. One they do not
            execute that takes a tensor only for its metadata enters a region as its decomposition (see
            :func:`decompose_metadata_reads`).
    """
    return _Planner(trace, reason_of, min_size, declared_static, graph_outputs, kept_whole).plan()
