"""A whole step's arguments and results (see ``cudagraphex.step.graph``): how a call's arguments are keyed and staged in
the graph's buffers, what is written back, and how results are handed out.

Invariants
==========
An argument buffer is private to one graph and never shares memory with another buffer, an argument or the state: a
call whose arguments share memory with each other or with the state is not replayed (``shared_storage``). A result is
always a new tensor, so a later replay never overwrites what a caller keeps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cudagraphex.step.state import is_tensor

__all__ = [
    "argument_problem",
    "handed_out",
    "host_values",
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


def write_back(args: tuple, buffers: list[torch.Tensor], written: list[int]) -> None:
    """Copies what the step wrote into its argument buffers (indices ``written``) into the caller's arguments."""
    if written:
        with torch.no_grad():
            torch._foreach_copy_([args[i] for i in written], [buffers[i] for i in written])


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
    ids = {id(t) for t in known if t is not None}
    for o in flat_out:
        if o is not None and not is_tensor(o):
            return f"the step returns a {type(o).__name__}, which a graph would freeze"
        if o is not None and id(o) in ids:
            return "the step returns one of its arguments or state tensors, not a new tensor"
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
