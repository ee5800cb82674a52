"""Batch-size buckets for whole-step graphs: a call padded up to the next capture size (see ``cudagraphex.step.graph``).

Invariants
==========

Which calls are padded
    With ``capture_sizes``, every tensor argument of dim >= 1 carries the batch along dim 0, all with the same number
    of rows. A call whose rows equal a capture size is an ordinary call. A call with fewer rows than some capture size
    replays the graph of the next capture size, if :class:`~cudagraphex.step.rows.RowCheck` found that graph's step
    row-independent on its last warm-up call; otherwise it runs ``fn`` as is. A call with more rows than the largest
    size runs ``fn`` as is.

What a padded replay reads and hands out
    A call is padded only into a graph captured from arguments of the same memory layouts (``memory_layout``), so its
    results are laid out as the step lays them out for the call. The call's rows are copied into the first rows of the
    graph's argument buffers; the rows after them keep what an earlier call left (real data, so no padded row computes
    on garbage). Each output that carries the batch is handed out as a new copy of its first rows (``rows * inner``
    entries along dim 0); an output that carries none, whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cudagraphex.step.layouts import Rows
from cudagraphex.step.state import is_tensor

__all__ = ["batch_rows", "copy_rows", "handed_out_rows", "memory_layout", "rows_key", "sized_to", "validated_sizes"]


def validated_sizes(sizes: Sequence[int] | None) -> tuple[int, ...]:
    """``capture_sizes`` sorted; raises ValueError unless they are distinct positive ints."""
    if sizes is None:
        return ()
    values = list(sizes) if isinstance(sizes, Iterable) and not isinstance(sizes, str) else []
    if not values or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in values):
        raise ValueError(f"capture_sizes must be a non-empty list of positive ints, got {sizes!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"capture_sizes must be distinct, got {sizes!r}")
    return tuple(sorted(values))


def batch_rows(flat: list) -> int:
    """The call's number of rows: dim 0 of its tensor arguments (of dim >= 1). Raises ValueError if they disagree."""
    rows = {a.shape[0] for a in flat if is_tensor(a) and a.dim() > 0}
    if len(rows) != 1:
        shapes = [tuple(a.shape) for a in flat if is_tensor(a)]
        raise ValueError(
            "with capture_sizes, every tensor argument of dim >= 1 carries the batch along dim 0 with the same number"
            f" of rows; got arguments of shapes {shapes}"
        )
    return rows.pop()


def rows_key(flat: list, spec: Any, size: int) -> tuple:
    """What a call of any number of rows padded to ``size`` must share with the graph captured at ``size``: besides
    shapes past dim 0, dtypes and devices, each argument's memory layout (the order of its dims in memory and whether
    it is dense), on which the layout of the step's results and the validity of its views depend."""
    return (
        size,
        str(spec),
        # requires_grad: a gradient would not reach such an argument through the graph's buffer
        tuple(
            (a.dim(), tuple(a.shape[1:]), a.dtype, a.device, a.requires_grad, memory_layout(a))
            if is_tensor(a)
            else (type(a), a)
            for a in flat
        ),
    )


def memory_layout(t: torch.Tensor) -> tuple[tuple[int, ...], bool]:
    """The order of ``t``'s dims in memory, outermost first, and whether it covers its memory densely (as a
    contiguous or a permuted contiguous tensor does): the layout class that any number of rows shares."""
    order = tuple(sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True))
    expected = 1
    dense = True
    for d in reversed(order):
        if t.size(d) != 1 and t.stride(d) != expected:
            dense = False
        expected *= t.size(d)
    return order, dense


def copy_rows(buffers: list[torch.Tensor], args: Sequence[torch.Tensor], rows: int) -> None:
    """Copies the call's arguments into the first ``rows`` rows of the graph's buffers (0-dim arguments whole)."""
    with torch.no_grad():
        torch._foreach_copy_([b if b.dim() == 0 else b.narrow(0, 0, rows) for b in buffers], list(args))


def handed_out_rows(outputs: list[torch.Tensor | None], layouts: list[Rows | None], spec: Any, rows: int) -> Any:
    """The padded call's result: a new copy of each output's first rows, or of the whole output where it carries
    no rows."""
    with torch.no_grad():
        return pytree.tree_unflatten(
            [
                None if o is None else (o if lo is None else o.narrow(0, 0, rows * lo.inner)).clone()
                for o, lo in zip(outputs, layouts, strict=True)
            ],
            spec,
        )


def sized_to(flat: list, spec: Any, size: int) -> tuple[tuple, dict]:
    """Example arguments with ``size`` rows, their rows repeated or cut (for ``StepGraph.prepare``)."""
    rows = batch_rows(flat)
    sized = [
        a.index_select(0, torch.arange(size, device=a.device) % rows) if is_tensor(a) and a.dim() > 0 else a
        for a in flat
    ]
    return pytree.tree_unflatten(sized, spec)
