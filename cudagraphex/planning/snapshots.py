"""Snapshots of the tensors in-place ops write, taken before the write for the backward to read.

In a joint forward-backward trace, Thunder's autodiff (0.2.6) reads a forward tensor in the backward by its name,
meaning its value when it was computed, and saves the tensor itself: ``v = x.square(); v.mul_(x)`` becomes
``v2 = update_aliases(v); m = mul(v2, x); copy_(m, v2)``, and the backward reads ``v2`` for ``x``'s gradient after
``copy_`` wrote ``x ** 3`` there. Eager autograd gives that gradient ``original_self``, the value before the write.

Eager clones only ``original_self``: a tensor of the written memory that any other op saved, or that the in-place op
saved as another argument (``v.mul_(v)``), makes it refuse the backward. In the trace, a read is of ``original_self``
where the first write reaching the tensor's memory after its definition is ``copy_`` into that very name, and the
symbols between read that memory once (Thunder gives the in-place op a new name for it right before it). Where the
backward reads any other tensor of a written memory, Thunder's behaviour is kept for all of that memory. Eager may
still refuse where Thunder's backward recomputes a tensor eager saves (``sqrt``'s result, written later); the copy
then gives what Thunder gives where its rematerialization recomputes the written tensor.

Invariant: after :func:`with_snapshots`, a symbol after the trace's first ``get_grad`` (the backward) that reads such an
``original_self`` ``P`` defined by a region member reads instead ``clone(P)``, a member of the same region right after
the one defining ``P``; the region returns the clone, and ``P`` only while something else still reads it. The return,
``get_grad``, ``update_aliases``, ``del`` and in-place writes keep reading ``P``: they refer to the tensor itself.
A trace without such a read is left as it is.

A ``P`` defined outside graphs keeps Thunder's behaviour: a clone there is read by the backward alone, so Thunder's
split would move it into the backward, after the write; only a region, whose other outputs the forward needs, keeps it
in the forward. The clone is cudagraphex's, not the program's: a ``can_fuse`` override does not keep it out, since
leaving it out would change the gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import thunder.torch as ltorch
from thunder.core import prims
from thunder.core.proxies import TensorProxy, Variable, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, tracectx

from cudagraphex.planning.safety import TRANSPARENT, is_inplace_write
from cudagraphex.planning.symbols import input_aliases, rng_state_inputs, writes_in_place

if TYPE_CHECKING:
    from cudagraphex.planning.regions import RegionSpec

__all__ = ["with_snapshots"]

#: Symbols that refer to a tensor itself rather than to its value when it was computed.
_READ_AS_IT_IS = frozenset({prims.PrimIDs.RETURN, prims.PrimIDs.GET_GRAD, prims.PrimIDs.UPDATE_ALIASES}) | TRANSPARENT


def _members(item: RegionSpec | BoundSymbol) -> Sequence[BoundSymbol]:
    return (item,) if isinstance(item, BoundSymbol) else item.bound_symbols


def _wants_value_when_computed(bsym: BoundSymbol) -> bool:
    return bsym.sym.id not in _READ_AS_IT_IS and bsym.sym.name != "update_aliases" and not writes_in_place(bsym)


def _stale_reads(flat: Sequence[BoundSymbol]) -> dict[int, set[str]]:
    """For each backward symbol of ``flat`` (by position), the tensors it reads that need a snapshot (see the top of
    this module)."""
    start = next((k for k, b in enumerate(flat) if b.sym.id == prims.PrimIDs.GET_GRAD), None)
    if start is None or not any(map(writes_in_place, flat)):
        return {}
    written, aliases = input_aliases(list(flat), None)
    writes = [(k, written[id(b)]) for k, b in enumerate(flat) if id(b) in written]
    defined: dict[str, int] = {}
    for k, b in enumerate(flat):
        for p in b.flat_proxy_outs:
            defined.setdefault(p.name, k)

    def roots(name: str) -> frozenset[str]:
        return aliases.get(name, frozenset({name}))

    def written_as_self(name: str, d: int, w: int) -> bool:
        """Whether the write at ``w`` is ``copy_`` into ``name`` itself, and the symbols between ``name``'s definition
        at ``d`` and it read that memory once: the in-place op's ``self``, which eager saves as ``original_self``."""
        if not is_inplace_write(flat[w]) or flat[w].args[1].name != name:
            return False
        reads = [p for b in flat[d + 1 : w] for p in b.flat_proxy_args if isinstance(p, TensorProxy)]
        return sum(1 for p in reads if roots(p.name) & roots(name)) == 1

    stale: dict[int, set[str]] = {}
    refused: set[str] = set()  # memory written after an op saved a tensor of it: eager refuses the backward
    for k in range(start, len(flat)):
        if not _wants_value_when_computed(flat[k]):
            continue
        for p in flat[k].flat_proxy_args:
            d = defined.get(p.name)
            if not isinstance(p, TensorProxy) or d is None:
                continue
            first = next((w for w, reached in writes if d < w < k and reached & roots(p.name)), None)
            if first is None:
                continue
            if written_as_self(p.name, d, first):
                stale.setdefault(k, set()).add(p.name)
            else:
                refused |= roots(p.name)
    found = {k: {n for n in names if not roots(n) & refused} for k, names in stale.items()}
    return {k: names for k, names in found.items() if names}


def _clone_of(p: TensorProxy, trace: TraceCtx) -> BoundSymbol:
    """``clone(p)`` under a new name of ``trace``, bound with its decomposition."""
    recorded: list[BoundSymbol] = []
    with tracectx(trace):
        trace.push_scope(recorded)
        try:
            ltorch.clone(p)
        finally:
            trace.pop_scope()
    (bsym,) = recorded
    return bsym


def with_snapshots(sequence: list[RegionSpec | BoundSymbol], trace: TraceCtx) -> list[RegionSpec | BoundSymbol]:
    """``sequence`` (a planned joint trace, regions in place of runs) with the snapshots described at the top of this
    module; ``sequence`` itself when none is needed. New names are taken from ``trace``."""
    owner = [(index, b) for index, item in enumerate(sequence) for b in _members(item)]
    stale = _stale_reads([b for _, b in owner])
    in_regions = {id(b) for index, b in owner if not isinstance(sequence[index], BoundSymbol)}
    definer: dict[str, BoundSymbol] = {}
    for _, b in owner:
        for p in b.flat_proxy_outs:
            definer.setdefault(p.name, b)
    names = {name for found in stale.values() for name in found if id(definer[name]) in in_regions}
    if not names:
        return sequence
    proxies = {p.name: p for _, b in owner for p in b.flat_proxy_args if p.name in names}
    clones = {name: _clone_of(proxies[name], trace) for name in sorted(names)}
    swaps: dict[int, dict[Variable, TensorProxy]] = {}
    for k, found in stale.items():
        if found & names:
            swaps[id(owner[k][1])] = {variableify(proxies[n]): clones[n].output for n in found & names}

    def redirected(bsym: BoundSymbol) -> BoundSymbol:
        swap = swaps.get(id(bsym))
        return bsym.from_bsym_swap_proxies(swap, skip_output=True) if swap else bsym

    result: list[RegionSpec | BoundSymbol] = []
    for item in sequence:
        if isinstance(item, BoundSymbol):
            result.append(redirected(item))
            continue
        members: list[BoundSymbol] = []
        added: list[TensorProxy] = []
        for b in item.bound_symbols:
            members.append(redirected(b))
            for name, clone in clones.items():  # right after the member defining what it copies
                if definer[name] is b:
                    members.append(clone)
                    added.append(clone.output)
        changed = added or any(id(b) in swaps for b in item.bound_symbols)
        result.append(_respecified(item, members, [*item.outputs, *added]) if changed else item)
    return _without_unread_outputs(result, names)


def _respecified(spec: RegionSpec, members: list[BoundSymbol], outputs: list[TensorProxy]) -> RegionSpec:
    """``spec`` with new members and outputs, and what depends on them computed anew (as ``regions`` plans a region)."""
    produced: set[str] = set()
    inputs: dict[str, TensorProxy] = {}
    for b in members:
        for p in b.flat_proxy_args:
            if p.name not in produced:
                inputs.setdefault(p.name, p)
        produced.update(p.name for p in b.flat_proxy_outs)
    written, aliases = input_aliases(members, inputs)
    mutated = frozenset().union(*written.values())
    return dataclasses.replace(
        spec,
        bound_symbols=members,
        inputs=list(inputs.values()),
        outputs=outputs,
        mutated=mutated,
        mutated_trace_inputs=spec.mutated_trace_inputs & mutated,
        caller_inputs=spec.caller_inputs & frozenset(inputs),
        written=written,
        aliases={p.name: aliases[p.name] for p in outputs if aliases.get(p.name)},
        rng_state_inputs=rng_state_inputs(members, inputs),
    )


def _without_unread_outputs(
    sequence: list[RegionSpec | BoundSymbol], names: set[str]
) -> list[RegionSpec | BoundSymbol]:
    """``sequence`` with the outputs among ``names`` that nothing after their region reads any more dropped: a graph
    output nobody reads holds its memory as long as the graph lives."""
    read_later: set[str] = set()
    result = list(sequence)
    for index in range(len(result) - 1, -1, -1):
        item = result[index]
        if isinstance(item, BoundSymbol):
            if item.sym.id not in TRANSPARENT:
                read_later.update(p.name for p in item.flat_proxy_args)
            continue
        unread = {p.name for p in item.outputs if p.name in names and p.name not in read_later}
        if unread:
            outputs = [p for p in item.outputs if p.name not in unread]
            result[index] = _respecified(item, item.bound_symbols, outputs)
        read_later.update(p.name for p in item.inputs)
    return result
