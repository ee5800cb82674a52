"""A whole step's arguments and results (see ``cudagraphex.step.graph``): how a call's arguments are keyed and staged in
the graph's buffers, what is written back, and how results are handed out.

Invariants
==========
An argument buffer is private to one graph and never shares memory with another buffer, an argument or the state: a
call whose arguments share memory with each other or with the state is not replayed (``shared_storage``). A result is
always a new tensor, so a later replay never overwrites what a caller keeps; a step whose results share memory with
its arguments, its state or each other is not captured (``output_problem``), so a copy never separates them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cudagraphex.runtime.handout import alias_kind, view_of
from cudagraphex.step.state import is_tensor

__all__ = [
    "argument_problem",
    "changed_buffers",
    "handed_out",
    "host_values",
    "on_arguments",
    "output_problem",
    "shared_storage",
    "signature",
    "storages",
    "unhashable_argument",
    "write_back",
]


def handed_out(outputs: list[torch.Tensor | None], spec: Any) -> Any:
    """The step's result: a new copy of each output tensor, so that a later replay never overwrites what the caller
    keeps."""
    with torch.no_grad():
        return pytree.tree_unflatten([None if o is None else o.clone() for o in outputs], spec)


def on_arguments(out: Any, buffers: list[torch.Tensor], args: tuple) -> Any:
    """``out`` with each tensor that views an argument buffer made the same view of the caller's argument (the step
    ran on ``buffers``, which stand for ``args``)."""
    sources = {buf.untyped_storage().data_ptr(): (buf, arg) for buf, arg in zip(buffers, args, strict=True)}

    def rebased(o: Any) -> Any:
        if not is_tensor(o) or o.untyped_storage().data_ptr() not in sources:
            return o
        buf, arg = sources[o.untyped_storage().data_ptr()]
        offset = o.storage_offset() * o.element_size() - buf.storage_offset() * buf.element_size()
        return view_of(arg, (o.dtype, o.shape, o.stride(), offset, alias_kind(o, buf)))

    return pytree.tree_map(rebased, out)


def write_back(args: tuple, buffers: list[torch.Tensor], written: list[int]) -> None:
    """Copies what the step wrote into its argument buffers (indices ``written``) into the caller's arguments."""
    if written:
        with torch.no_grad():
            torch._foreach_copy_([args[i] for i in written], [buffers[i] for i in written])


def changed_buffers(buffers: list[torch.Tensor], before: list[torch.Tensor], written: list[int]) -> list[int]:
    """``written`` (the argument buffers whose version counters a step's capture bumped) with every buffer whose values
    differ from ``before`` (its copy from before the step's first run). Version counters alone miss writes: Inductor's
    kernels inside a call that records autograd (Thunder's torch.compile executor in training) write an argument
    without bumping its counter. Values are compared bit by bit (a NaN equals itself); a write that leaves every bit
    as it was in that first run is not seen."""
    changed = {i for i, (buf, old) in enumerate(zip(buffers, before, strict=True)) if not _same_bits(buf, old)}
    return sorted(changed.union(written))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def storages(tensors: Iterable[torch.Tensor | None]) -> frozenset[int]:
    return frozenset(p for t in tensors if t is not None and (p := t.untyped_storage().data_ptr()) != 0)


def shared_storage(args: Iterable[torch.Tensor], state_storages: frozenset[int]) -> bool:
    """Whether an argument shares memory with another or with the state: the argument buffers would break that
    sharing (a write through one would not be seen through the other)."""
    seen: set[int] = set()
    for a in args:
        ptr = a.untyped_storage().data_ptr()
        if ptr == 0:
            continue
        if ptr in seen or ptr in state_storages:
            return True
        seen.add(ptr)
    return False


def output_problem(flat_out: list, known: list) -> str | None:
    """Why the step's results cannot be handed out as new tensors (None if they can): a Python value, which a graph
    would freeze, or a tensor that shares memory with an argument, the state (``known``) or another result, which
    copies would separate from it."""
    ids = {id(t) for t in known if t is not None}
    known_storages = storages(t for t in known if is_tensor(t))
    seen: set[int] = set()
    for o in flat_out:
        if o is None:
            continue
        if not is_tensor(o):
            return f"the step returns a {type(o).__name__}, which a graph would freeze"
        if id(o) in ids:
            return "the step returns one of its arguments or state tensors, not a new tensor"
        storage = o.untyped_storage().data_ptr()
        if storage == 0:
            continue
        if storage in known_storages:
            return "the step returns a view of one of its arguments or state tensors, which a copy would separate"
        if storage in seen:
            return "the step returns tensors that share memory, which copies would separate"
        seen.add(storage)
    return None


def signature(flat: list, spec: Any) -> tuple:
    return (
        str(spec),
        tuple((t.shape, t.stride(), t.dtype, t.device) if is_tensor(t) else (type(t), t) for t in flat),
    )


def host_values(flat: list) -> tuple:
    return tuple(None if is_tensor(a) else (type(a), a) for a in flat)


def unhashable_argument(flat: list) -> str | None:
    """Why no graph can be kept for the call ``flat``: a Python argument that cannot key one (graphs are kept per
    argument value)."""
    for a in flat:
        if not is_tensor(a):
            try:
                hash(a)
            except TypeError:
                return f"a Python argument of type {type(a).__name__} is not hashable, and graphs are kept per value"
    return None


def argument_problem(flat: list) -> str | None:
    for a in flat:
        if is_tensor(a) and a.requires_grad:
            return "an argument requires grad (its gradient would not reach it through a graph's input buffer)"
    return None
