"""How a tensor carries a step's batch (its rows), and how ops move it: the rules behind ``RowCheck``.

A tensor carries the batch as ``Rows(axis, inner)`` (dim ``axis`` holds it in blocks of ``inner``, one block per row)
or may carry it, as ``Maybe(axes)``, where the step chose a size that is a multiple of the batch. Each rule here
returns where an op's output carries the batch, given where its inputs do, or raises :class:`Refused` with the reason
the op mixes rows. ``cudagraphex.step.rows`` states what the rules protect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

__all__ = [
    "Maybe",
    "Refused",
    "Rows",
    "dim_set",
    "elementwise",
    "moved_axis",
    "named",
    "reduced",
    "refuse",
    "reshaped",
]

aten = torch.ops.aten


@dataclass(frozen=True)
class Rows:
    """Dim ``axis`` holds the batch, ``inner`` consecutive entries per row."""

    axis: int
    inner: int = 1


@dataclass(frozen=True)
class Maybe:
    """A size the step chose, which may come from the batch: each of ``axes`` may hold it."""

    axes: frozenset[int]


class Refused(Exception):
    """Raised with the reason the rows are not independent."""


def refuse(reason: str) -> NoReturn:
    """Raises :class:`Refused` (for use inside an expression)."""
    raise Refused(reason)


def dim_set(dim: Any, ndim: int) -> set[int]:
    """``dim`` (an int, a list, or None or [] for all) as a set of non-negative dims of an ``ndim``-dim tensor."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return set(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    return {d % max(ndim, 1) for d in dim}


def elementwise(t: torch.Tensor, inputs, layouts) -> Rows | Maybe | None:
    """Elementwise with broadcasting: a batch axis must line up with every other one, and a size that may come from
    the batch is settled by what it lines up with."""
    rows: Rows | None = None
    fixed: set[int] = set()
    for s, lo in zip(inputs, layouts, strict=True):
        offset = t.dim() - s.dim()
        if isinstance(lo, Rows):
            here = Rows(lo.axis + offset, lo.inner)
            if rows is not None and here != rows:
                raise Refused("an elementwise op lines up the batch with another axis")
            rows = here
            fixed |= {d + offset for d in range(s.dim()) if d != lo.axis and s.shape[d] == t.shape[d + offset]}
    maybe: set[int] = set()
    for s, lo in zip(inputs, layouts, strict=True):
        if isinstance(lo, Maybe):
            offset = t.dim() - s.dim()
            for d in lo.axes:
                o = d + offset
                if rows is not None and o == rows.axis:
                    continue
                if o in fixed:
                    continue
                maybe.add(o)
    if rows is not None:
        if maybe:
            raise Refused("an elementwise op combines the batch with a size that may come from the batch elsewhere")
        return rows
    return Maybe(frozenset(maybe)) if maybe else None


def named(func, args, kwargs) -> dict[str, Any]:
    """The op's arguments by their schema names."""
    return dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs


def reduced(func, args, kwargs, layout: Rows, source: torch.Tensor) -> Rows:
    """Where a reduction of ``source`` keeps the batch; refuses one over it."""
    values = named(func, args, kwargs)
    over = dim_set(values.get("dim"), source.dim())
    if layout.axis in over:
        raise Refused("a reduction over the batch")
    if values.get("keepdim", False):
        return layout
    return Rows(layout.axis - sum(1 for d in over if d < layout.axis), layout.inner)


def reshaped(layout: Rows | None, source: torch.Tensor, t: torch.Tensor, batch: int) -> Rows | None:
    """Where view ``t`` of ``source`` holds the batch, whole rows in blocks; refuses a view that splits it."""
    if layout is None:
        return None
    lead = math.prod(source.shape[: layout.axis])
    per_row = source.shape[layout.axis] // batch * math.prod(source.shape[layout.axis + 1 :])
    for k in range(t.dim()):
        if math.prod(t.shape[:k]) != lead:
            continue
        size = t.shape[k]
        if size % batch == 0 and size // batch * math.prod(t.shape[k + 1 :]) == per_row:
            return Rows(k, size // batch)
    raise Refused("a view splits the batch axis")


def moved_axis(packet, args, layout: Rows, source: torch.Tensor, outs) -> int | None:
    """Where a view that moves, adds or removes dims puts the batch axis (None: not such a view)."""
    a, n = layout.axis, source.dim()
    if packet is aten.permute:
        return [d % n for d in args[1]].index(a)
    if packet is aten.transpose:
        d0, d1 = args[1] % n, args[2] % n
        return d1 if a == d0 else d0 if a == d1 else a
    if packet is aten.t:
        return 1 - a if n == 2 else a
    if packet is aten.unsqueeze:
        d = args[1] % (n + 1)
        return a + (d <= a)
    if packet is aten.squeeze:
        squeezed = dim_set(args[1] if len(args) > 1 else None, n)
        return a - sum(1 for d in squeezed if d < a and source.shape[d] == 1)
    if packet in (aten.slice, aten.narrow):
        dim = (args[1] if len(args) > 1 else 0) % n
        if dim == a and outs[0].shape[a] != source.shape[a]:
            raise Refused("a slice along the batch axis")
        return a
    if packet in (aten.select, aten.unbind):
        dim = (args[1] if len(args) > 1 else 0) % n
        if dim == a:
            raise Refused("a select along the batch axis")
        return a - (dim < a)
    if packet in (aten.split, aten.split_with_sizes, aten.chunk, aten.unsafe_split):
        dim = (args[2] if len(args) > 2 else 0) % n
        if dim == a:
            raise Refused("a split along the batch axis")
        return a
    if packet is aten.expand_copy or packet is aten.as_strided:
        raise Refused("a strided view of a tensor that carries rows")
    return None
