"""How a graph gets its inputs: static inputs read where they live, the caller's tensors read in place, and copied
inputs staged in buffers the graph owns.

Invariants
==========

What is static
    A graph reads and writes its *static* inputs at the addresses they had when it was captured: parameters and
    buffers, tensors that another graph of the same compiled function produced in its own memory or as a view of a
    static input (forward outputs saved for backward), tensors declared static, and trace inputs the graph writes in
    place (``regions.static_outputs`` and ``static_inputs.classify_inputs`` state the rule). Before every replay
    those addresses are compared with the current inputs in one C++ call, and a graph is never replayed against a
    moved static input: the region captures another instance for the new addresses, or demotes the input to a copied
    one (``GraphedRegion._on_moved``). Graphs hold the addresses of static inputs, not the tensors, so replacing a
    parameter frees the old one.

Copied inputs
    Every other tensor input is *copied*: one batched copy moves it into a buffer the graph owns, after one C++ check
    that each has the shape, strides, dtype and device it was captured with; if the graph writes that input in place,
    the buffer is copied back after the replay. Input buffers are never handed out (``handout``). An expanded input
    (a broadcast cotangent) gets a buffer without its expanded dims.

Read in place
    One exception spares the copy (a launch that costs more host time than the replay on a slow host): a tensor the
    caller passes in (an input of the trace, a cotangent) that is at the address it had at the warm-up when a graph is
    captured is *read in place* by that graph, like a static input: its address is compared, its layout is checked
    with the copied inputs', and the graph holds its address, not the tensor. Its first move demotes it to a copied
    input, and the graph captured then copies it wherever it is (one more graph, the only one after a move).

Inputs of no tensor
    A tensor that the trace declares but that is None at run time (flash attention's ``cum_seq_q`` outside varlen)
    passes through as None: an input is part of the graph's signature, an output is handed out as None. Dropout RNG
    state (``safety.RNG_STATE_PARAMETERS``) is where each run reads it: an eager run of a region gets it in host memory
    (a graph's output is copied there, which waits for the graph), a graph in device memory (host memory that an eager
    forward left is copied into a device buffer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

import torch

from cudagraphex._protections import PROTECTIONS
from cudagraphex.capture import expanded_dims

__all__ = ["input_buffer", "picker", "signature", "version_of"]


def signature(args: Sequence[Any]) -> tuple:
    """The input signature of a call: each tensor's shape, strides, dtype and device, each host value (or its type)."""
    keyed = PROTECTIONS["signature_guard"]
    return tuple(
        (a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a if keyed else None)
        for a in args
    )


def picker(indices: Sequence[int]) -> Callable[[Sequence[Any]], tuple]:
    """A function that picks the items at ``indices`` of a sequence, as a tuple (in C where it can)."""
    if len(indices) > 1:
        return itemgetter(*indices)
    if indices:
        only = indices[0]
        return lambda args: (args[only],)
    return lambda args: ()


def input_buffer(a: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """A buffer on ``device`` for copied input ``a``, the tensor the graph reads (``a``'s strides where they allow a
    buffer), and ``a``'s expanded dims.

    An expanded input (a broadcast cotangent, say) gets a buffer without the expanded dims, read through ``expand``.
    """
    expanded = expanded_dims(a)
    shape = [1 if d in expanded else n for d, n in enumerate(a.shape)]
    if overlaps(shape, a.stride()):
        buf = torch.empty(shape, dtype=a.dtype, device=device)
    else:  # the caller's layout, gaps included: a kernel that reads another layout may round differently
        buf = torch.empty_strided(shape, a.stride(), dtype=a.dtype, device=device)
    return buf, buf.expand(a.shape) if expanded else buf, expanded


def overlaps(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether two elements of a tensor laid out as ``shape`` and ``stride`` share memory."""
    dims = sorted((st, n) for n, st in zip(shape, stride, strict=True) if n > 1)
    reach = 0  # the largest offset reachable with the dims so far
    for st, n in dims:
        if st <= reach:
            return True
        reach += st * (n - 1)
    return False


def version_of(t: torch.Tensor | None) -> int | None:
    """``t``'s version counter, which each in-place op on it (or on a view of it) bumps; None for no tensor, or an
    inference tensor, which has no counter."""
    if t is None:
        return None
    try:
        return t._version
    except RuntimeError:
        return None
