"""Host reads that cudagraphex leaves out of graphs, kept out of the fusions of the executors after it.

Every ``item`` of a trace that cudagraphex has graphed around reads a tensor a graph returned. A fusion executor after
cudagraphex would fuse it with the ops that use the number, in a fusion that takes the tensor as an input; Inductor
compiles ``item`` of a float64 input into the number it read at compile time (torch 2.11; pytorch/pytorch#196198),
so such a fusion returns the first call's number on every call. The ``item`` is therefore bound to an operator of its
own, which no fusion executor claims; the ops that use the number may still be fused, with the number as an input.
"""

from __future__ import annotations

from collections.abc import Iterable

from thunder import torch as ltorch
from thunder.core.symbol import BoundSymbol
from thunder.extend import OperatorExecutor

from cudagraphex.planning.safety import HOST_READS

__all__ = ["unfused_host_reads"]

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
