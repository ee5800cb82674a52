"""Which bound symbols may be captured into a CUDA graph.

A symbol is graph-safe when replaying the kernels it launched at capture time computes, on every later call, what
running the symbol would compute. That rules out symbols that talk to the host (unpacking inputs, returning,
freeing names, reading a device value into Python, Thunder's host-side RNG state), collectives, symbols whose inputs
or outputs are not tensors on the graph's device, and symbols whose outputs have data-dependent shapes.

:func:`unsafe_reason` answers with a human-readable reason, or ``None`` for a graph-safe symbol.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import thunder.distributed.prims as dist_prims
from thunder.core import prims
from thunder.core.proxies import Proxy, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.executors.torchex import ex as torch_executor

from cudagraphex._protections import PROTECTIONS

__all__ = [
    "HOST_READS",
    "NEVER_CAPTURED",
    "RNG_STATE_PARAMETERS",
    "TRANSPARENT",
    "is_inplace_write",
    "rng_state_args",
    "unsafe_reason",
]


def _with_torch_lowerings(ids: Iterable, reason: str) -> dict:
    """Maps each symbol id, and the id of the torch executor's implementation of it, to ``reason``."""
    out = {}
    for sym_id in ids:
        out[sym_id] = reason
        impl = torch_executor.implmap.get(sym_id)
        if impl is not None and impl.symbol is not None:
            out[impl.symbol.id] = reason
    return out


#: Thunder's symbols that unpack a trace's inputs.
UNPACKS = frozenset(p for p in prims.PrimIDs if p.name.startswith("UNPACK_"))

#: ``item`` in each of its lowerings: reads a device value into a Python number.
HOST_READS = frozenset(_with_torch_lowerings([prims.PrimIDs.ITEM, "torch.Tensor.item"], ""))

#: Symbol ids that never enter a graph, with the reason recorded for them.
NEVER_CAPTURED: dict = {
    **{p: "unpacks the trace's inputs on the host" for p in UNPACKS},
    prims.PrimIDs.RETURN: "returns from the trace",
    prims.PrimIDs.GET_GRAD: "marks where the backward pass starts",
    "clear_mutable_collection": "empties a Python collection",
    **dict.fromkeys(HOST_READS, "reads a device value on the host"),
    **_with_torch_lowerings(
        [prims.PrimIDs.GET_AND_UPDATE_RNG_STATE],
        "reads and advances the host-side RNG state",
    ),
    **_with_torch_lowerings(list(dist_prims.PrimIDs), "is a distributed communication op"),
    **{
        name: "has an output shape that depends on tensor values"
        for name in (
            "torch.nonzero",
            "torch.Tensor.nonzero",
            "torch.masked_select",
            "torch.unique",
            "torch.argwhere",
        )
    },
}

#: Symbols that are never captured but do not split a region: they move behind the graph that spans them.
TRANSPARENT = frozenset({prims.PrimIDs.DEL, prims.PrimIDs.COMMENT})


#: ``prims.copy_(src, dst)`` and its torch-executor lowering: Thunder's form of every in-place op. (The torch-level
#: ``Tensor.copy_(dst, src)`` takes its arguments the other way round; it is seen through its subsymbols.)
_COPY_IDS = frozenset(_with_torch_lowerings([prims.PrimIDs.COPY_], ""))


def is_inplace_write(bsym: BoundSymbol) -> bool:
    """True for ``prims.copy_(src, dst)``, which writes ``bsym.args[1]``, in any of its lowerings."""
    return bsym.sym.id in _COPY_IDS


#: Symbols that read the dropout RNG state (philox seed and offset) an attention forward returned, by the names of
#: those parameters. The forward returns that state in host memory when it runs eagerly and in device memory when it
#: is captured; the backward reads it through a host pointer when it runs eagerly and through a device pointer when it
#: is captured (ATen's ``attention_backward.cu``), and a device pointer read on the host crashes the process. The
#: runtime hands each run of a region the state where that run reads it.
RNG_STATE_PARAMETERS: dict[str, tuple[str, ...]] = {
    "sdpaex_scaled_dot_product_efficient_attention_backward": ("philox_seed", "philox_offset"),
    "sdpafx_scaled_dot_product_efficient_attention_backward": ("philox_seed", "philox_offset"),
}


def rng_state_args(bsym: BoundSymbol) -> list[TensorProxy]:
    """The tensors ``bsym`` (or a symbol it calls) reads as dropout RNG state (see :data:`RNG_STATE_PARAMETERS`)."""
    names = RNG_STATE_PARAMETERS.get(bsym.sym.name)
    if names is None:
        return [p for sub in bsym.subsymbols for p in rng_state_args(sub)]
    bound = inspect.signature(bsym.sym.meta).bind(*bsym.args, **bsym.kwargs).arguments
    return [bound[n] for n in names if isinstance(bound.get(n), TensorProxy)]


def _tensor_problem(p: Proxy, device_type: str, role: str) -> str | None:
    if not isinstance(p, TensorProxy):
        if not PROTECTIONS["host_values_stay_out"]:
            return None
        return f"{role} a host value ({p.name}: {type(p).__name__}) that a graph would freeze at capture time"
    if p.device.type != device_type:
        return f"{role} a tensor on {p.device.device_str()} ({p.name}), not on a {device_type} device"
    return None


def unsafe_reason(bsym: BoundSymbol, device_type: str = "cuda") -> str | None:
    """Why ``bsym`` must stay out of a graph whose tensors live on ``device_type``; ``None`` if it may be captured.

    A symbol the executors have not lowered yet, or a fusion, is graph-safe only if all its subsymbols are, since
    those are what will run. An already lowered operator is judged by its own inputs and outputs.
    """
    reason = NEVER_CAPTURED.get(bsym.sym.id)
    if reason is not None:
        return reason
    if bsym.sym.id in TRANSPARENT:
        return "only frees Python names"
    for p in bsym.flat_proxy_args:
        if (problem := _tensor_problem(p, device_type, "uses")) is not None:
            return problem
    for p in bsym.flat_proxy_outs:
        if (problem := _tensor_problem(p, device_type, "produces")) is not None:
            return problem
    if bsym.sym.executor is None or bsym.sym.is_fusion:
        for sub in bsym.subsymbols:
            if (reason := unsafe_reason(sub, device_type)) is not None:
                return f"calls {sub.sym.name}, which {reason}"
    return None
