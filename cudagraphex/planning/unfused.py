"""Symbols that cudagraphex leaves out of graphs, kept out of the fusions of the executors after it.

Host reads. Every ``item`` of a trace that cudagraphex has graphed around reads a tensor a graph returned. A fusion
executor after cudagraphex would fuse it with the ops that use the number, in a fusion that takes the tensor as an
input; Inductor compiles ``item`` of a float64 input into the number it read at compile time (torch 2.11;
pytorch/pytorch#196198), so such a fusion returns the first call's number on every call. The ``item`` is therefore
bound to an operator of its own, which no fusion executor claims; the ops that use the number may still be fused, with
the number as an input.

In-place writes. A write left out of graphs (into a tensor made outside graphs on every call) often stands alone
between two regions, and a fusion executor after cudagraphex would fuse it alone: a fusion whose only work is a write
returns nothing anyone reads, which Thunder's rematerialization refuses with an error ("The consumer has no outputs")
and its dead-code elimination may drop. Each such write is lowered by the operator executors after cudagraphex
instead, as Thunder lowers writes when no fusion executor is listed: the values it writes may be fused, the ``copy_``
that writes them is not (no fusion executor claims the torch executor's ``copy_``). Not in a joint trace: Thunder's
split (0.2.6) moves a ``copy_`` into a view of a tensor the forward made, after its last read, into the backward, where
it is lost; fused, such a write fails loudly instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from thunder import torch as ltorch
from thunder.core import prims
from thunder.core.proxies import variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, from_trace
from thunder.executors.passes import _transform_for_operator_executor_execution
from thunder.extend import Executor, OperatorExecutor, get_always_executors

from cudagraphex.planning.regions import is_joint
from cudagraphex.planning.safety import HOST_READS
from cudagraphex.planning.symbols import flat_proxies, writes_in_place

__all__ = ["unfused_host_reads", "unfused_writes"]

# Not registered: its one operator carries its own callable, and no executors list names it.
_executor = OperatorExecutor("cudagraphex_host_reads")


def _item(a):
    return a.item()


_read_item = _executor.register_operator("cudagraphex_item", like=ltorch.item, fn=_item)


def unfused_host_reads(bsyms: Iterable[BoundSymbol]) -> list[BoundSymbol]:
    """``bsyms`` with each ``item`` bound to an operator that no fusion executor fuses (its source line kept)."""
    return [_unfused(b) if b.sym.id in HOST_READS else b for b in bsyms]


def _unfused(bsym: BoundSymbol) -> BoundSymbol:
    bound = _read_item.bind(*bsym.args, output=bsym.output, **bsym.kwargs)
    return bound.from_bsym(
        header=bsym.header, source_filename=bsym.source_filename, source_positions=bsym.source_positions
    )


def unfused_writes(
    bsyms: Sequence[BoundSymbol],
    is_region: Callable[[BoundSymbol], bool],
    executors: Sequence[Executor],
    trace: TraceCtx,
) -> list[BoundSymbol]:
    """``bsyms`` (what becomes of ``trace``'s symbols) with each in-place write outside a region lowered by the
    operator executors among ``executors``, so that no fusion executor's fusion holds the write itself; unchanged in a
    joint trace."""
    if is_joint(trace):
        return list(bsyms)
    operators = [ex for ex in (*executors, *get_always_executors()) if isinstance(ex, OperatorExecutor)]
    lowered: list[BoundSymbol] = []
    for bsym in bsyms:
        if is_region(bsym) or not writes_in_place(bsym):
            lowered.append(bsym)
            continue
        alone = from_trace(trace)
        alone.bound_symbols = [bsym, prims.python_return.bind(bsym.output, output=None)]
        *written, returned = _transform_for_operator_executor_execution(alone, operators).bound_symbols
        # The lowering renames the write's outputs; the symbols after it read them by their names.
        renamed = zip(flat_proxies(returned.args[0]), flat_proxies(bsym.output), strict=True)
        names_back = {variableify(new): old for new, old in renamed if new.name != old.name}
        lowered.extend(b.from_bsym_swap_proxies(names_back) for b in written)
    return lowered
