"""What Thunder's forward/backward split does to the symbols of a joint trace, and the region members it concerns.

Thunder 0.2.6 splits a joint trace after the fusion passes: the forward keeps what its outputs need and the in-place
writes into what it keeps; everything else, writes included, moves into the backward. A region moves as one symbol,
so a member can land in the other pass than Thunder would put it in on its own: those members are kept out of graphs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from thunder.core import prims
from thunder.core.symbol import BoundSymbol

from cudagraphex.planning.safety import TRANSPARENT, is_inplace_write
from cudagraphex.planning.symbols import flat_proxies

__all__ = ["ForwardPass", "forward_pass", "moved_write_feeders", "split_hazards"]


@dataclass(frozen=True)
class ForwardPass:
    """What the split keeps in the forward pass of a joint trace."""

    #: The names the forward returns: its outputs and arguments.
    outputs: frozenset[str]
    #: The symbols (by ``id``) it keeps: those the outputs need, and the in-place writes into what it keeps.
    members: frozenset[int]


def forward_pass(bsyms: Sequence[BoundSymbol]) -> ForwardPass | None:
    """The forward pass that the split keeps of the joint trace ``bsyms``; None for another trace."""
    ret = bsyms[-1] if bsyms else None
    if not any(b.sym.id == prims.PrimIDs.GET_GRAD for b in bsyms) or ret is None:
        return None
    out = ret.args[0]
    outputs = {p.name for p in (*flat_proxies(out.get("fw_flat_out")), *flat_proxies(out.get("flat_args")))}
    members = set()
    names = set(outputs)
    for b in reversed(bsyms):
        if b.sym.id in (prims.PrimIDs.RETURN, prims.PrimIDs.GET_GRAD) or b.sym.id in TRANSPARENT:
            continue
        if any(p.name in names for p in b.flat_proxy_outs) or b.sym.id == prims.PrimIDs.UNPACK_TRIVIAL:
            members.add(id(b))
            names |= {p.name for p in (*b.flat_proxy_args, *b.flat_proxy_outs)}
        elif is_inplace_write(b) and b.args[1].name in names:
            members.add(id(b))
            names |= {p.name for p in b.flat_proxy_args}
    return ForwardPass(frozenset(outputs), frozenset(members))


def split_hazards(forward: ForwardPass, sequence: Sequence[Any], is_region: Callable[[Any], bool]) -> dict[int, str]:
    """Forward in-place writes in regions that the split would move into the backward pass, by member ``id``
    (``sequence``: a planned joint trace, regions among its symbols)."""
    hazards = {}
    names = set(forward.outputs)
    for item in reversed(sequence):
        if is_region(item):
            outs, args, members = item.outputs, item.inputs, item.bound_symbols
        else:
            if item.sym.id in (prims.PrimIDs.RETURN, prims.PrimIDs.GET_GRAD) or item.sym.id in TRANSPARENT:
                continue
            outs, args, members = item.flat_proxy_outs, item.flat_proxy_args, [item]
        kept = any(p.name in names for p in outs) or (
            not is_region(item) and item.sym.id == prims.PrimIDs.UNPACK_TRIVIAL
        )
        if not kept and not is_region(item) and is_inplace_write(item):
            kept = item.args[1].name in names
        if kept:
            names |= {p.name for p in (*args, *outs)}
        elif is_region(item):
            for b in members:
                if id(b) in forward.members:
                    hazards[id(b)] = "is a forward in-place update that must run in the forward pass"
    return hazards


def moved_write_feeders(
    forward: ForwardPass, sequence: Sequence[Any], is_region: Callable[[Any], bool]
) -> dict[int, str]:
    """Region members whose results only in-place writes outside graphs that the split moves into the backward read
    (directly or through other such members), by ``id``. The split moves them with the writes, as it does without
    graphs; in a region they would stay in the forward, and a moved write would land in a tensor saved for backward
    (autograd then refuses a second backward through it)."""
    outside = [item for item in sequence if not is_region(item)]
    moved = {id(b) for b in outside if is_inplace_write(b) and id(b) not in forward.members}
    if not moved:
        return {}
    members = [b for item in sequence if is_region(item) for b in item.bound_symbols]
    readers: dict[str, set[int]] = defaultdict(set)
    for b in (*members, *outside):
        for p in b.flat_proxy_args:
            readers[p.name].add(id(b))
    feeding = set(moved)
    hazards = {}
    for b in reversed(members):
        outs = [p.name for p in b.flat_proxy_outs]
        if outs and all(readers[name] and readers[name] <= feeding for name in outs):
            feeding.add(id(b))
            hazards[id(b)] = "computes only what a write outside graphs writes, which Thunder moves into the backward"
    return hazards
