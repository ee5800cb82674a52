"""The checks a replay's fast path runs in C++, shared by region graphs and step graphs.

Invariants
==========

Layout
    A guard made by :func:`layout_guard` accepts tensors exactly when each has the dtype, device, shape, strides,
    ``requires_grad`` and dispatch keys of the tensor at its position when the guard was made (TorchDynamo's
    ``TensorGuards``, every size and stride static). A rejected call never replays a graph: it takes the slow path.

Addresses
    :func:`addresses_equal` compares the data pointers of the tensors at given positions with recorded ones, in one
    C++ call. A graph holds addresses, not tensors: a tensor at a recorded address is the memory the graph reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._C._dynamo.guards import TensorGuards

__all__ = ["addresses_equal", "layout_guard"]

#: ``addresses_equal(tensors, ptrs, indices)``: whether ``tensors[i].data_ptr() == ptrs[i]`` for every ``i`` in
#: ``indices``.
addresses_equal = torch._C._tensors_data_ptrs_at_indices_equal


def layout_guard(tensors: Sequence[torch.Tensor]) -> TensorGuards | None:
    """A guard of the layout of ``tensors`` (None for none): ``guard.check(*others)`` in one C++ call."""
    if not tensors:
        return None
    return TensorGuards(
        *tensors,
        dynamic_dims_sizes=[list(t.shape) for t in tensors],
        dynamic_dims_strides=[list(t.stride()) for t in tensors],
    )
