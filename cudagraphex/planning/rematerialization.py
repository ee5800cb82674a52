"""Thunder's rematerialization around the graphs: kept from recomputing across in-place writes, and undone where it
would add unfused kernels to the graphs.

Rematerialization, which every fusion pass after cudagraphex's runs (Thunder's default executors include torch.compile
executors of single ops), makes a producer fusion stop returning some tensors saved for backward and a consumer fusion
recompute them from others (the *cut*). It does not look at in-place writes (Thunder 0.2.6): a consumer that
recomputes a tensor from memory written in place after the tensor was computed reads the written values, and one that
recomputes an in-place write runs it again. Such outputs of a region (:func:`not_recomputable`) are never recomputed:

* the symbols outside graphs that read one read it through an operator of cudagraphex's that returns its arguments
  (:func:`rematerialization_barrier`), which no fusion executor claims, so no fusion consumes it from the region (but
  for the return, ``get_grad`` and in-place writes: :func:`behind_barriers`);
* a later region that reads one refuses to recompute it (:func:`refused_rematerialization`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Iterable, Sequence

from thunder.core import prims
from thunder.core.proxies import TensorProxy, Variable, variableify
from thunder.core.symbol import BoundSymbol
from thunder.extend import OperatorExecutor

from cudagraphex.planning.regions import RegionSpec
from cudagraphex.planning.symbols import input_aliases, writes_in_place

__all__ = ["behind_barriers", "not_recomputable", "refused_rematerialization", "rematerialization_barrier"]

# Not registered: its one operator carries its own callable, and no executors list names it.
_executor = OperatorExecutor("cudagraphex_rematerialization")


def _barrier_meta(*tensors: TensorProxy) -> tuple[TensorProxy, ...]:
    return tuple(TensorProxy(like=t) for t in tensors)


def _barrier(*tensors: object) -> tuple[object, ...]:
    return tensors


_barrier_symbol = _executor.register_operator("cudagraphex_barrier", meta=_barrier_meta, fn=_barrier)


def rematerialization_barrier(tensors: Sequence[TensorProxy]) -> tuple[BoundSymbol, dict[Variable, TensorProxy]]:
    """A symbol that returns ``tensors`` themselves under new names (call it inside a trace context), and the map from
    each old name to its new one, for the symbols after it to read them through it."""
    renamed = _barrier_meta(*tensors)
    bsym = _barrier_symbol.bind(*tensors, output=renamed)
    return bsym, {variableify(old): new for old, new in zip(tensors, renamed, strict=True)}


#: Symbols that Thunder finds the forward's outputs by, by name: the return, and in a joint trace ``get_grad``.
_READ_AS_THEY_ARE = frozenset({prims.PrimIDs.RETURN, prims.PrimIDs.GET_GRAD})


def behind_barriers(
    bsyms: Sequence[BoundSymbol], not_recomputable: dict[int, frozenset[str]], is_region: Callable[[BoundSymbol], bool]
) -> list[BoundSymbol]:
    """``bsyms`` (a trace's symbols; ``not_recomputable`` by the position of each region's fusion) with a
    :func:`rematerialization_barrier` after each region whose not-recomputable outputs a later symbol reads, and those
    symbols reading them through it. Regions, the return and ``get_grad`` read them as they are, and so do in-place
    writes: a fusion whose only work is a write returns nothing anyone reads, and Thunder's dead-code elimination would
    drop it (its rematerialization refuses such a consumer with an error). Call it inside a trace context."""
    behind = [not is_region(b) and b.sym.id not in _READ_AS_THEY_ARE and not writes_in_place(b) for b in bsyms]
    reads_after: list[set[str]] = [set() for _ in range(len(bsyms) + 1)]
    for k in range(len(bsyms) - 1, -1, -1):
        reads_after[k] = reads_after[k + 1] | ({p.name for p in bsyms[k].flat_proxy_args} if behind[k] else set())
    result: list[BoundSymbol] = []
    swap: dict[Variable, TensorProxy] = {}
    for k, bsym in enumerate(bsyms):
        if not is_region(bsym):
            result.append(bsym.from_bsym_swap_proxies(swap) if behind[k] else bsym)
            continue
        result.append(bsym)
        names = not_recomputable.get(k, frozenset()) & reads_after[k + 1]
        if names:
            barrier, renamed = rematerialization_barrier([p for p in bsym.flat_proxy_outs if p.name in names])
            result.append(barrier)
            swap.update(renamed)
    return result


def not_recomputable(sequence: Sequence[RegionSpec | BoundSymbol]) -> dict[int, frozenset[str]]:
    """For each region of ``sequence`` (a planned trace, by index), the names of its outputs that a recomputation from
    what the region computes them from would get wrong: those an in-place write computes, or computes from, and those
    computed from memory that a write of a later symbol, in the region or after it, may reach (views followed); also
    those computed from such outputs of an earlier region. Thunder rematerializes one producer and consumer pair after
    the other, so a fusion that reads a region which recomputed an earlier region's outputs may recompute them too."""
    flat = [b for item in sequence for b in (item.bound_symbols if isinstance(item, RegionSpec) else (item,))]
    written, aliases = input_aliases(flat, None)
    # The memory written by the symbols after each position of ``flat``.
    later: list[frozenset[str]] = [frozenset()] * (len(flat) + 1)
    for k in range(len(flat) - 1, -1, -1):
        later[k] = later[k + 1] | written.get(id(flat[k]), frozenset())
    position = {id(b): k for k, b in enumerate(flat)}
    found: dict[int, frozenset[str]] = {}
    inherited: set[str] = set()
    for index, item in enumerate(sequence):
        if isinstance(item, RegionSpec):
            wrong = _wrongly_recomputed(item, position, later, aliases, inherited) & {p.name for p in item.outputs}
            if wrong:
                found[index] = frozenset(wrong)
                inherited |= wrong
    return found


def _wrongly_recomputed(
    region: RegionSpec,
    position: dict[int, int],
    later: Sequence[frozenset[str]],
    aliases: dict[str, frozenset[str]],
    inherited: Collection[str],
) -> set[str]:
    """The names of the tensors ``region`` computes that a recomputation would get wrong (:func:`not_recomputable`).
    A recomputation starts from the region's inputs or its outputs (which, where wrong, are kept), so a tensor is wrong
    where its member writes in place, reads written memory, or reads a wrong tensor the region does not return: one it
    computes, or an input that is an earlier region's wrong output (``inherited``)."""
    returned = {p.name for p in region.outputs}
    wrong: set[str] = {p.name for p in region.inputs if p.name in inherited}
    for bsym in region.bound_symbols:  # in trace order: what a member reads is decided before the member
        written_after = later[position[id(bsym)] + 1]
        reads = [p.name for p in bsym.flat_proxy_args if isinstance(p, TensorProxy)]
        if (
            writes_in_place(bsym)
            or any(name in wrong and name not in returned for name in reads)
            or any(aliases.get(name, frozenset({name})) & written_after for name in reads)
        ):
            wrong.update(p.name for p in bsym.flat_proxy_outs)
    return wrong


def refused_rematerialization(
    planned: RegionSpec,
    members: list[BoundSymbol],
    inputs: list[TensorProxy],
    outputs: list[TensorProxy],
    earlier: Collection[RegionSpec],
    fused: Callable[[BoundSymbol], bool],
    removed: Collection[RegionSpec] = (),
) -> tuple[list[BoundSymbol], list[TensorProxy], list[TensorProxy]]:
    """The members, inputs and outputs of a region that Thunder's rematerialization handed back changed, with the
    changes undone where the recomputation it asks for would not be fused.

    Rematerialization makes a producer graph stop returning some tensors saved for backward, return others (the
    *cut*) instead, and makes the consumer graph recompute the first from the second. That saves memory at almost no
    cost where a fusion executor fuses the recomputed ops; inside a graph whose ops each run their own kernel it adds
    those kernels to every backward pass (measured on a 12-layer GPT in bf16 without nvFuser: 434 more kernels and 29%
    more GPU time per training step).

    Args:
        planned: the region as planned (or last built).
        members, inputs, outputs: the region as the rematerializing pass handed it back.
        earlier: the regions before this one in its trace, as last built: the producers it may read from.
        fused: whether an executor that lowers the region fuses a bound symbol into a larger kernel.
        removed: the regions before this one that Thunder's dead-code elimination removed from the trace, as last
            built: a consumer may recompute from their members.

    As a producer, the region keeps its planned outputs, and returns no cut, unless every op computing the tensors it
    stopped returning is fused and none of them is :attr:`~RegionSpec.not_recomputable`: a graph output nobody reads
    would hold its memory for as long as the graph lives. As a consumer, it drops each recomputed op whose
    result an earlier region returns (again), and the ops only those fed. Thunder hands regions back in trace order, so
    every producer has decided before its consumers; a producer that Thunder's dead-code elimination removed is not in
    ``earlier``, and what it computed stays recomputed. A fusion of another executor that recomputes from a refused
    producer's cut is not supported (it would read a tensor that no longer exists); executors after cudagraphex only
    form fusions of what it left out.

    Raises:
        RuntimeError: if the rebuilt region would read a tensor that no earlier region returns.
    """
    returned = {p.name for p in outputs}
    dropped = {p.name for p in planned.outputs} - returned
    known = (*members, *planned.bound_symbols)
    computing = [b for b in known if any(p.name in dropped for p in b.flat_proxy_outs)]
    if dropped and (not all(map(fused, computing)) or dropped & planned.not_recomputable):
        outputs = list(planned.outputs)
    recomputable = [*(b for spec in removed for b in spec.bound_symbols), *planned.bound_symbols]
    members = _restore_lost_members(recomputable, members, {p.name for p in inputs}, outputs)
    # A kept recomputation may read what an earlier graph returns though neither version of this region read it.
    candidates = (*inputs, *planned.inputs, *(p for spec in earlier for p in spec.outputs))
    planned_members = {_identity(b) for b in planned.bound_symbols}
    if all(_identity(b) in planned_members for b in members):
        members = _in_planned_order(members, planned.bound_symbols)
        return members, _inputs_read(members, candidates), outputs

    produced_earlier = {p.name for spec in earlier for b in spec.bound_symbols for p in b.flat_proxy_outs}
    available = {p.name for spec in earlier for p in spec.outputs}
    available |= {p.name for p in inputs if p.name not in produced_earlier}
    needed = {p.name for p in outputs}
    kept: list[BoundSymbol] = []
    for bsym in reversed(members):
        wanted = {p.name for p in bsym.flat_proxy_outs} & needed
        if _identity(bsym) not in planned_members and wanted <= available:
            continue
        kept.append(bsym)
        needed |= {p.name for p in bsym.flat_proxy_args}
    kept = _in_planned_order(kept[::-1], planned.bound_symbols)
    produced = {p.name for b in kept for p in b.flat_proxy_outs}
    missing = sorted(needed - produced - available)
    if missing:
        raise RuntimeError(
            f"cudagraphex: after rematerialization a graph would read {missing}, which no earlier graph returns"
        )
    return kept, _inputs_read(kept, candidates), outputs


def _in_planned_order(members: list[BoundSymbol], planned: Sequence[BoundSymbol]) -> list[BoundSymbol]:
    """``members`` with the planned ones in the order of ``planned``, and each recomputed one (not planned) as late as
    its first reader allows.

    Thunder's rematerialization sorts a consumer's symbols anew (a bottom-up topological sort), which moves, for
    instance, every weight gradient of a backward to its end, so that each layer's activation gradients stay alive
    until then (on a 4-layer GPT, 2.7 times the memory the backward allocated was live at its peak). ``members`` must be
    in an order in which each one follows those whose outputs it reads; where the two orders cannot be reconciled, it is
    kept."""
    positions: dict[tuple, list[int]] = {}
    for k, bsym in enumerate(planned):
        positions.setdefault(_identity(bsym), []).append(k)
    readers: dict[str, list[int]] = {}
    for i, bsym in enumerate(members):
        for p in bsym.flat_proxy_args:
            readers.setdefault(p.name, []).append(i)
    # Planned members keep their planned position; a recomputed one takes its first reader's (readers come later).
    key: list[tuple[float, int]] = [(float("inf"), 0)] * len(members)
    for i in range(len(members) - 1, -1, -1):
        found = positions.get(_identity(members[i]))
        if found:
            key[i] = (found.pop() if len(found) > 1 else found[0], 1)
        else:
            reads = [key[j][0] for p in members[i].flat_proxy_outs for j in readers.get(p.name, ()) if j > i]
            key[i] = (min(reads, default=float("inf")), 0)
    produced_by = {p.name: i for i, bsym in enumerate(members) for p in bsym.flat_proxy_outs}
    waiting = [
        {produced_by[p.name] for p in bsym.flat_proxy_args if produced_by.get(p.name, i) < i}
        for i, bsym in enumerate(members)
    ]
    successors = [
        {j for p in bsym.flat_proxy_outs for j in readers.get(p.name, ()) if j > i} for i, bsym in enumerate(members)
    ]
    # Planned members run in planned order, whatever their data says: an in-place write stays after earlier reads.
    chain = sorted((i for i in range(len(members)) if key[i][1]), key=lambda i: key[i])
    for a, b in itertools.pairwise(chain):
        waiting[b].add(a)
        successors[a].add(b)
    ready = [(key[i], i) for i, deps in enumerate(waiting) if not deps]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for j in successors[i]:
            waiting[j].discard(i)
            if not waiting[j]:
                heapq.heappush(ready, (key[j], j))
    return [members[i] for i in order] if len(order) == len(members) else members


def _identity(bsym: BoundSymbol) -> tuple:
    """What a member is across the copies Thunder makes of it when it renames a region's inputs: its symbol and the
    names of its outputs. A copy of a planned member is planned, even one whose outputs nothing reads (an in-place
    write)."""
    return bsym.sym.id, tuple(p.name for p in bsym.flat_proxy_outs)


def _inputs_read(members: list[BoundSymbol], candidates: Iterable[TensorProxy]) -> list[TensorProxy]:
    """The ``candidates`` that ``members`` read without producing them, once each, in ``candidates``' order."""
    produced = {p.name for b in members for p in b.flat_proxy_outs}
    read = {p.name for b in members for p in b.flat_proxy_args} - produced
    inputs: dict[str, TensorProxy] = {}
    for p in candidates:
        if p.name in read:
            inputs.setdefault(p.name, p)
    return list(inputs.values())


def _restore_lost_members(
    planned: list[BoundSymbol], members: list[BoundSymbol], inputs: Collection[str], outputs: Iterable[TensorProxy]
) -> list[BoundSymbol]:
    """``members`` with the ``planned`` symbols (in trace order) put back that produce what the region reads or
    returns but neither produces nor receives. Thunder's dead-code elimination drops a fusion's members that are not
    prims and have no subsymbols (``zeros`` in a backward), also from what a consumer recomputes from a producer it
    then removes; and it drops the members of a producer that computed outputs it stopped returning, which a refused
    rematerialization returns again. Each one put back goes right before the first member that reads what it
    produces."""
    produced = {p.name for b in members for p in b.flat_proxy_outs}
    wanted = {p.name for b in members for p in b.flat_proxy_args} | {p.name for p in outputs}
    missing = wanted - produced - set(inputs)
    present = {id(b) for b in members}
    lost: list[BoundSymbol] = []
    for bsym in reversed(planned):
        if id(bsym) not in present and any(p.name in missing for p in bsym.flat_proxy_outs):
            lost.append(bsym)
            missing |= {p.name for p in bsym.flat_proxy_args} - produced - set(inputs)
    restored = list(members)
    for bsym in lost:  # latest planned first, so an earlier one lands before the ones that read it
        outs = {p.name for p in bsym.flat_proxy_outs}
        at = next((i for i, b in enumerate(restored) if any(p.name in outs for p in b.flat_proxy_args)), len(restored))
        restored.insert(at, bsym)
    return restored
