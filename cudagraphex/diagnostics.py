"""What cudagraphex captured, and why the rest was left out: :func:`explain` (a report) and :func:`inspect` (the
live regions and graphs, for tools and tests)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import thunder

from cudagraphex.planning.regions import Break
from cudagraphex.planning.static_inputs import InputKind
from cudagraphex.runtime import FunctionGraphs, GraphedRegion
from cudagraphex.runtime.liveness import Pool
from cudagraphex.step import StepGraph, StepReport

__all__ = ["GraphReport", "Inspection", "PoolReport", "RegionReport", "Report", "TraceReport", "explain", "inspect"]


@dataclass
class GraphReport:
    """One captured graph of a region."""

    #: Shapes of the inputs copied into the graph (the ones that vary between calls).
    input_shapes: dict[str, tuple[int, ...]]
    #: The caller's tensors the graph reads where they were at capture, instead of copying them.
    read_in_place: list[str]
    replays: int
    capture_ms: float
    #: Memory the capture added to its pool (reserved by the allocator).
    pool_bytes: int
    own_pool: bool
    #: How far the process's peak allocated memory (``torch.cuda.max_memory_allocated``) rose while the graph's input
    #: buffers were made and it was captured; 0 where that stayed below an earlier peak, and on the CPU backend.
    peak_added_bytes: int
    #: The saved tensors whose storages the capture gave back to the pool after their last read, for its own and
    #: later captures' allocations (a backward graph), and those storages' bytes.
    given_back: list[str] = field(default_factory=list)
    given_back_bytes: int = 0


@dataclass
class PoolReport:
    """One memory pool: the graphs of one compiled function on one device share one, a graph captured while it was
    busy gets its own."""

    device: str
    shared: bool
    graphs: int
    #: Memory the captures of its graphs added to it (reserved by the allocator).
    bytes: int


@dataclass
class RegionReport:
    """One region: a run of symbols that cudagraphex replaces with ``name``."""

    name: str
    phase: str
    device: str
    num_ops: int
    static_inputs: dict[str, str]
    #: Tensor inputs copied into a graph, or read in place by a graph captured while they stayed put (see ``graphs``).
    copied_inputs: list[str]
    #: Python values frozen into each graph (a new value needs a new graph).
    host_values: list[str]
    outputs: list[str]
    graphs: list[GraphReport]
    eager_calls: dict[str, int]
    copied_outputs: list[str]
    demoted_inputs: list[str]
    disabled_reason: str | None
    #: Bytes of saved tensors its eager runs (warm-up, calls inside a whole step) freed after their last read, in all.
    eager_freed_bytes: int = 0

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.graphs)


@dataclass
class TraceReport:
    """One trace cudagraphex processed (one per cache entry, and per forward/backward when the adapter is used)."""

    index: int
    label: str
    regions: list[RegionReport]
    breaks: list[Break]
    structural_breaks: int


@dataclass
class Report:
    """The report :func:`explain` returns: read it as text (``str(report)``) or as data (``report.to_dict()``)."""

    function: str
    traces: list[TraceReport] = field(default_factory=list)
    pools: list[PoolReport] = field(default_factory=list)
    #: Why there is no trace to report, when there is none.
    note: str = ""

    @property
    def regions(self) -> list[RegionReport]:
        return [r for t in self.traces for r in t.regions]

    @property
    def num_graphs(self) -> int:
        return sum(len(r.graphs) for r in self.regions)

    @property
    def pool_bytes(self) -> int:
        return sum(p.bytes for p in self.pools)

    @property
    def peak_added_bytes(self) -> int:
        """How far the captures raised the process's peak allocated memory, in all."""
        return sum(g.peak_added_bytes for r in self.regions for g in r.graphs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        summary = (
            f"{len(self.regions)} region(s), {self.num_graphs} graph(s), {_bytes(self.pool_bytes)} of graph memory,"
            f" peak raised by {_bytes(self.peak_added_bytes)}"
        )
        lines = [f"cudagraphex report for {self.function}: {summary}"]
        if self.note:
            lines.append(f"  {self.note}")
        for p in self.pools:
            kind = "shared" if p.shared else "own"
            lines.append(f"  pool on {p.device} ({kind}): {p.graphs} graph(s), {_bytes(p.bytes)}")
        for t in self.traces:
            lines.append(f"trace {t.index} ({t.label}): {len(t.regions)} region(s), {len(t.breaks)} break(s)")
            for r in t.regions:
                lines += _region_lines(r)
            if t.breaks:
                lines.append("  kept out of graphs:")
                lines += [f"    {b.symbol}{_at(b.source)}: {b.reason}" for b in t.breaks]
            if t.structural_breaks:
                lines.append(f"  (and {t.structural_breaks} symbol(s) that unpack inputs or return)")
        return "\n".join(lines)


def _names(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown}, ... ({len(names)} in all)" if len(names) > limit else shown or "none"


def _region_lines(r: RegionReport) -> list[str]:
    kinds = Counter(r.static_inputs.values())
    static = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    lines = [
        f"  {r.name} [{r.phase}, {r.device}]: {r.num_ops} ops, {len(r.graphs)} graph(s), {r.replays} replay(s)",
        f"    static inputs: {static or 'none'}" + (f": {_names(list(r.static_inputs))}" if static else ""),
        f"    copied or read in place: {_names(r.copied_inputs)}",
    ]
    if r.host_values:
        lines.append(f"    host values: {_names(r.host_values)}")
    for i, g in enumerate(r.graphs, 1):
        pool = ", own pool" if g.own_pool else ""
        in_place = f", reads in place: {_names(g.read_in_place)}" if g.read_in_place else ""
        lines.append(
            f"    graph {i}: inputs {g.input_shapes}{in_place}, {g.replays} replay(s), captured in {g.capture_ms:.1f}"
            f" ms, {_bytes(g.pool_bytes)}{pool}, peak raised by {_bytes(g.peak_added_bytes)}"
        )
        if g.given_back:
            lines.append(
                f"      gave back the memory of {len(g.given_back)} saved tensor(s) at their last read"
                f" ({_bytes(g.given_back_bytes)}): {_names(g.given_back)}"
            )
    if r.eager_calls:
        lines.append("    eager calls: " + ", ".join(f"{why} x{n}" for why, n in r.eager_calls.items()))
    if r.eager_freed_bytes:
        lines.append(f"    eager calls freed {_bytes(r.eager_freed_bytes)} of saved tensors at their last read, in all")
    if r.copied_outputs:
        lines.append(f"    returned as copies (kept by the caller across calls): {', '.join(r.copied_outputs)}")
    if r.demoted_inputs:
        lines.append(f"    demoted to copied inputs (their address changed): {', '.join(r.demoted_inputs)}")
    if r.disabled_reason:
        lines.append(f"    capture failed, runs eagerly: {r.disabled_reason}")
    return lines


def _at(source: str | None) -> str:
    return f" at {source}" if source else ""


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _region_report(region: GraphedRegion) -> RegionReport:
    info = region.info
    static = {n: k.value for n, k in zip(info.input_names, region.kinds, strict=True) if k.is_static}
    copied = [n for n, k in zip(info.input_names, region.kinds, strict=True) if k.is_copied]
    host_values = [n for n, k in zip(info.input_names, region.kinds, strict=True) if k is InputKind.HOST_VALUE]
    graphs = [
        GraphReport(
            input_shapes={info.input_names[c.index]: tuple(c.shape) for c in i.copied_inputs},
            read_in_place=[info.input_names[j] for j in i.read_in_place],
            replays=i.replays,
            capture_ms=i.capture_seconds * 1e3,
            pool_bytes=i.pool_bytes,
            own_pool=not i.pool.shared,
            peak_added_bytes=i.peak_added,
            given_back=[info.input_names[j] for j in i.given_back.positions] if i.given_back else [],
            given_back_bytes=i.given_back.nbytes if i.given_back else 0,
        )
        for i in region.instances
    ]
    return RegionReport(
        name=info.name,
        phase=info.phase,
        device=info.device,
        num_ops=info.num_ops,
        static_inputs=static,
        copied_inputs=copied,
        host_values=host_values,
        outputs=list(info.output_names),
        graphs=graphs,
        eager_calls=dict(region.eager_calls),
        copied_outputs=[n for n, c in zip(info.output_names, region.copy_output, strict=True) if c],
        demoted_inputs=list(region.demoted),
        disabled_reason=region.disabled_reason,
        eager_freed_bytes=region.eager_freed_bytes,
    )


@dataclass(frozen=True)
class Inspection:
    """The graphs behind a compiled function, live: read them, do not change them."""

    #: (label, executor name, graphs) of each Thunder function behind the compiled object, per cudagraphex executor.
    functions: tuple[tuple[str, str, FunctionGraphs], ...]

    def graphs(self, executor: str | None = None) -> list[FunctionGraphs]:
        """The graphs of every function, or of those compiled with the executor named ``executor``."""
        return [g for _, name, g in self.functions if executor is None or name == executor]

    def regions(self, executor: str | None = None, phase: str | None = None) -> list[GraphedRegion]:
        """The regions, in trace order; ``phase``: only ``"forward"``, ``"backward"`` or ``"computation"`` ones."""
        return [r for g in self.graphs(executor) for r in g.regions() if phase is None or r.info.phase == phase]

    def num_graphs(self, executor: str | None = None, phase: str | None = None) -> int:
        """Captured graphs of the regions :meth:`regions` selects."""
        return sum(len(r.instances) for r in self.regions(executor, phase))

    def replays(self, executor: str | None = None, phase: str | None = None) -> int:
        """Replays of the graphs of the regions :meth:`regions` selects."""
        return sum(i.replays for r in self.regions(executor, phase) for i in r.instances)


def inspect(fn: Any) -> Inspection:
    """The live regions and graphs cudagraphex built for ``fn`` (a ``thunder.jit``/``thunder.compile`` function or
    module, or a ``thunderfx`` object): regions, their captured instances, counters, memory and timings.

    Raises:
        TypeError: if ``fn`` was not compiled by Thunder.
    """
    return Inspection(tuple(_function_graphs(fn)))


def _function_graphs(fn: Any) -> Iterable[tuple[str, str, FunctionGraphs]]:
    """The (label, graphs) of every Thunder-compiled function behind ``fn``."""
    subgraph_infos = _thunderfx_partitions(fn)
    if subgraph_infos is not None:  # thunder.dynamo.thunderfx: one Thunder function per partition
        for i, info in enumerate(subgraph_infos):
            for j, compiled in enumerate(info.thunder_compiled_fns):
                for label, name, graphs in _function_graphs(compiled):
                    yield f"partition {i}.{j}: {label}", name, graphs
        return
    cd = thunder.compile_data(fn)
    if cd is None:
        raise TypeError(
            "cudagraphex.explain and cudagraphex.inspect take a function compiled by thunder.jit, thunder.compile or"
            f" thunderfx (explain also a graph_step step), got {type(fn).__name__}"
        )
    for name, graphs in getattr(cd, "_cudagraphex", {}).items():
        yield name, name, graphs


def explain(fn: Any) -> Report | StepReport:
    """What cudagraphex did for a compiled function: regions, graphs, replays, memory, and every break with its reason;
    for a :func:`~cudagraphex.graph_step` step, its :class:`~cudagraphex.StepReport`.

    Args:
        fn: a function or module compiled by ``thunder.jit`` or ``thunder.compile``, a ``thunderfx`` object, or a
            :class:`~cudagraphex.StepGraph`.

    Raises:
        TypeError: if ``fn`` was not compiled by Thunder.
    """
    if isinstance(fn, StepGraph):
        return fn.report()
    report = Report(function=getattr(fn, "__name__", type(fn).__name__))
    inspection = inspect(fn)
    for label, _, graphs in inspection.functions:
        for trace_label, breaks, regions in graphs.traces:
            report.traces.append(
                TraceReport(
                    index=len(report.traces),
                    label=f"{trace_label}, {label}",
                    regions=[_region_report(r) for r in regions],
                    breaks=[b for b in breaks if not b.structural],
                    structural_breaks=sum(b.structural for b in breaks),
                )
            )
    report.pools = [_pool_report(pool, device) for pool, device in _pools(inspection.regions())]
    if not report.traces:
        report.note = _why_no_trace(fn)
    return report


def _pools(regions: Iterable[GraphedRegion]) -> list[tuple[Pool, str]]:
    """The pools the instances of ``regions`` were captured into, each once, with its device."""
    seen: dict[int, tuple[Pool, str]] = {}
    for r in regions:
        for i in r.instances:
            seen.setdefault(id(i.pool), (i.pool, r.info.device))
    return list(seen.values())


def _pool_report(pool: Pool, device: str) -> PoolReport:
    return PoolReport(
        device=device,
        shared=pool.shared,
        graphs=len(pool.instances),
        bytes=sum(i.pool_bytes for i in pool.instances),
    )


def _thunderfx_partitions(fn: Any) -> list | None:
    """The partitions of a ``thunderfx`` object (each with its Thunder functions); None for anything else."""
    return getattr(getattr(fn, "_backend", None), "subgraph_infos", None)


def _why_no_trace(fn: Any) -> str:
    partitions = _thunderfx_partitions(fn)
    if partitions == [] or (partitions is None and thunder.cache_misses(fn) == 0):
        return "not called yet: cudagraphex plans a function's graphs when Thunder compiles its first call"
    return (
        "cudagraphex saw none of its traces: compile it with a cudagraphex executor (executors=[cudagraphex, ...]) or"
        " transforms=[cudagraphex.CUDAGraphTransform()]"
    )
