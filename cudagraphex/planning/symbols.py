"""What a bound symbol does, as the planner needs to know it: where it runs, what it reads, writes and may alias.

Every answer looks through a symbol without an executor into its decomposition (the ops Thunder lowers it to), and
treats an executor's op or a fusion as reading all its arguments and possibly aliasing them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

import thunder.torch as ltorch
from thunder.core import prims
from thunder.core.proxies import Proxy, TensorProxy, variableify
from thunder.core.symbol import BoundSymbol, BoundSymbolTag
from thunder.core.trace import TraceCtx, from_trace, get_tracectx, tracectx
from thunder.executors.torchex import ex as torch_executor

from cudagraphex.planning.safety import is_inplace_write, rng_state_args

__all__ = [
    "count_ops",
    "decompose_metadata_reads",
    "device_of",
    "flat_proxies",
    "input_aliases",
    "rng_state_inputs",
    "source_line",
    "with_decompositions",
    "writes_in_place",
]


def _view_symbol_ids() -> frozenset:
    """Ids of symbols whose output may share memory with an input, in both their torch-level and lowered forms."""
    view_prims = {
        prims.PrimIDs.BROADCAST_IN_DIM,
        prims.PrimIDs.RESHAPE,
        prims.PrimIDs.SLICE,
        prims.PrimIDs.SQUEEZE,
        prims.PrimIDs.TRANSPOSE,
        prims.PrimIDs.UNFOLD,
        prims.PrimIDs.VIEW,
        prims.PrimIDs.SHALLOW_COPY,
        prims.PrimIDs.UPDATE_ALIASES,
        prims.PrimIDs.BITCAST,
        prims.PrimIDs.REAL,
        prims.PrimIDs.IMAG,
        prims.PrimIDs.STRIDE_ORDER,
        prims.PrimIDs.CONVERT_ELEMENT_TYPE,
        prims.PrimIDs.DEVICE_PUT,
    }
    ids = set(view_prims) | {s.id for s in ltorch._syms_returning_views | ltorch._syms_that_may_return_views}
    for sym_id in list(ids):
        impl = torch_executor.implmap.get(sym_id)
        if impl is not None and impl.symbol is not None:
            ids.add(impl.symbol.id)
    # The torch executor's own operations that return views, which a lowered trace calls (``permute`` lowers
    # ``prims.transpose``, and has no symbol of its own in the map above).
    ids |= {torch_executor.opmap[name].id for name in _TORCH_VIEW_FUNCTIONS if name in torch_executor.opmap}
    return frozenset(ids)


#: torch functions and methods that may return a view of (or the very) input tensor.
_TORCH_VIEW_FUNCTIONS = frozenset(
    [
        "__getitem__",
        "as_strided",
        "broadcast_to",
        "chunk",
        "contiguous",
        "detach",
        "diagonal",
        "dsplit",
        "expand",
        "expand_as",
        "flatten",
        "hsplit",
        "imag",
        "movedim",
        "moveaxis",
        "narrow",
        "permute",
        "ravel",
        "real",
        "reshape",
        "reshape_as",
        "select",
        "shallow_copy",
        "split",
        "split_with_sizes",
        "squeeze",
        "swapaxes",
        "swapdims",
        "t",
        "tensor_split",
        "to",
        "torch_slice_prim_impl",
        "transpose",
        "unbind",
        "unflatten",
        "unfold",
        "unsafe_split",
        "unsafe_split_with_sizes",
        "unsqueeze",
        "view",
        "view_as",
        "view_as_complex",
        "view_as_real",
        "vsplit",
    ]
)


_VIEW_IDS = _view_symbol_ids()


def source_line(bsym: BoundSymbol) -> str | None:
    """``file:line`` of the user's code that produced ``bsym``, when Thunder recorded it."""
    if bsym.source_filename is None:
        return None
    line = getattr(bsym.source_positions, "lineno", None)
    return f"{bsym.source_filename}:{line}" if line is not None else bsym.source_filename


def device_of(bsym: BoundSymbol) -> str | None:
    for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs):
        if isinstance(p, TensorProxy):
            return p.device.device_str()
    return None


def flat_proxies(x) -> list[Proxy]:
    from thunder.core.pytree import tree_flatten

    return [p for p in tree_flatten(x)[0] if isinstance(p, Proxy)]


def _writes(bsym: BoundSymbol) -> list[BoundSymbol]:
    """The ``copy_`` symbols that run when ``bsym`` runs."""
    if is_inplace_write(bsym):
        return [bsym]
    if bsym.sym.executor is None or bsym.sym.is_fusion:
        return [w for sub in bsym.subsymbols for w in _writes(sub)]
    return []


def writes_in_place(bsym: BoundSymbol) -> bool:
    """Whether running ``bsym`` runs a ``copy_`` (itself, or inside a decomposition or another executor's fusion)."""
    return bool(_writes(bsym))


def _may_alias_input(bsym: BoundSymbol) -> bool:
    return (
        bsym.sym.id in _VIEW_IDS
        or bsym.sym.is_fusion
        or bsym.sym.executor is None
        and any(_may_alias_input(sub) for sub in bsym.subsymbols)
    )


def _reads_data(bsym: BoundSymbol) -> frozenset[str]:
    """Names of the tensors whose values ``bsym`` reads: the tensor arguments of the ops its decomposition runs, other
    than shape queries. An executor's op, a fusion and a symbol without decomposition read all their arguments."""
    if bsym.sym.id == prims.PrimIDs.SHAPE:
        return frozenset()
    if bsym.sym.executor is not None or bsym.sym.is_prim or bsym.sym.python_impl is not None or not bsym.subsymbols:
        return frozenset(p.name for p in bsym.flat_proxy_args if isinstance(p, TensorProxy))
    produced: set[str] = set()
    read: set[str] = set()
    for sub in bsym.subsymbols:
        read |= _reads_data(sub) - produced
        produced.update(p.name for p in sub.flat_proxy_outs)
    return frozenset(read)


def decompose_metadata_reads(
    bsyms: Iterable[BoundSymbol], kept_whole: Callable[[BoundSymbol], bool]
) -> list[BoundSymbol]:
    """``bsyms`` with each torch-level symbol that takes a tensor only for its metadata (``expand_as(t, x)``) and that
    no executor lowering the region keeps whole (``kept_whole``) replaced by its decomposition, as Thunder lowers it.

    A graph's inputs are what its members take, and Thunder saves every input of a backward graph for backward:
    a symbol kept whole for the lowering would take ``x`` from the caller, where Thunder without graphs saves nothing,
    and autograd would fail the backward once the caller writes into ``x`` in place. Symbols that write in place stay
    whole, so that a planned in-place write keeps its identity.
    """
    out: list[BoundSymbol] = []
    for bsym in bsyms:
        args = {p.name for p in bsym.flat_proxy_args if isinstance(p, TensorProxy)}
        if (
            bsym.sym.executor is None
            and not bsym.sym.is_prim
            and bsym.sym.python_impl is None
            and bsym.subsymbols
            and not _writes(bsym)
            and args - _reads_data(bsym)
            and _decomposition_produces_outputs(bsym)
            and not kept_whole(bsym)
        ):
            subs = list(bsym.subsymbols)
            if BoundSymbolTag.BACKWARD in bsym.tags:  # as Thunder tags the symbols it decomposes a backward one into
                subs = [sub.from_bsym(tags=sub.tags | {BoundSymbolTag.BACKWARD}) for sub in subs]
            out.extend(decompose_metadata_reads(subs, kept_whole))
        else:
            out.append(bsym)
    return out


def with_decompositions(trace: TraceCtx) -> TraceCtx:
    """``trace`` with each torch-level symbol that reads no tensor and was bound without its decomposition (Thunder's
    autodiff binds the ``ltorch.zeros`` of a gradient nothing flows into so) rebound with the decomposition it traces
    to, under its own output names.

    Thunder's dead-code elimination takes every non-primitive symbol without a decomposition for a no-op and drops it
    from the symbols of the fusion that holds it, and a fusion executor rebuilds its fusions from what is left
    (``update_fusion_call_ctx``): the rebuilt fusion reads a name nothing defines, or another tensor that its lowered
    code happens to give that name.
    """
    out = from_trace(trace)
    with tracectx(out):
        out.bound_symbols = [_with_decomposition(b) for b in trace.bound_symbols]
    return out


def _with_decomposition(bsym: BoundSymbol) -> BoundSymbol:
    if (
        bsym.subsymbols
        or bsym.sym.is_prim
        or bsym.sym.is_fusion
        or bsym.sym.executor is not None
        or bsym.sym.meta is None
        or any(isinstance(p, TensorProxy) for p in bsym.flat_proxy_args)
    ):
        return bsym
    recorded: list[BoundSymbol] = []
    trace = get_tracectx()
    trace.push_scope(recorded)
    try:
        result = bsym.sym(*bsym.args, **bsym.kwargs)
    finally:
        trace.pop_scope()
    (traced,) = recorded
    renamed = {variableify(new): old for new, old in zip(flat_proxies(result), flat_proxies(bsym.output), strict=True)}
    return traced.from_bsym_swap_proxies(renamed).from_bsym(
        tags=set(bsym.tags),
        header=bsym.header,
        source_filename=bsym.source_filename,
        source_positions=bsym.source_positions,
    )


def _decomposition_produces_outputs(bsym: BoundSymbol) -> bool:
    """Whether every output of ``bsym`` is produced by its subsymbols or is one of its arguments (a decomposition may
    return an argument as itself)."""
    available = {p.name for p in bsym.flat_proxy_args}
    available.update(p.name for sub in bsym.subsymbols for p in sub.flat_proxy_outs)
    return all(p.name in available for p in bsym.flat_proxy_outs)


def count_ops(bsyms: Iterable[BoundSymbol]) -> int:
    """The ops a run of symbols executes: a fusion (another executor's) counts as the ops it fuses."""
    return sum((len(b.subsymbols) or 1) if b.sym.is_fusion else 1 for b in bsyms)


def input_aliases(
    members: list[BoundSymbol], inputs: Collection[str] | None
) -> tuple[dict[int, frozenset[str]], dict[str, frozenset[str]]]:
    """Which region inputs the members may reach through views: for each member (by id) that writes in place, the
    inputs whose memory the write may reach; for each tensor a member produces, the inputs whose memory it may share
    (none for memory the region allocates). With ``inputs`` None every tensor a view does not produce is a root: the
    roots then tell, over a whole trace, which tensors may share memory."""
    aliases: dict[str, frozenset[str]] = {}

    def roots(name: str) -> frozenset[str]:
        if name in aliases:
            return aliases[name]
        return frozenset({name}) if inputs is None or name in inputs else frozenset()

    def reached_by(bsym: BoundSymbol) -> frozenset[str]:
        """The inputs ``bsym``'s writes may reach; inside a fusion or a decomposition the views its own symbols make
        are followed too (a write there targets a name of its own, ``update_aliases``' output, say)."""
        if is_inplace_write(bsym):
            return roots(bsym.args[1].name)
        if not _writes(bsym):  # also what another executor's op (not a fusion) runs: it is not looked into
            return frozenset()
        reached = frozenset()
        for sub in bsym.subsymbols:
            reached |= reached_by(sub)
            note_aliases(sub)
        return reached

    def note_aliases(bsym: BoundSymbol) -> None:
        if _may_alias_input(bsym) or _writes(bsym):
            shared = frozenset().union(*(roots(p.name) for p in bsym.flat_proxy_args))
            for p in bsym.flat_proxy_outs:
                aliases[p.name] = shared

    written = {}
    for b in members:
        reached = reached_by(b)
        note_aliases(b)
        if reached:
            written[id(b)] = reached
    return written, aliases


def rng_state_inputs(members: Iterable[BoundSymbol], inputs: Collection[str]) -> frozenset[str]:
    """The ``inputs`` that ``members`` read as dropout RNG state."""
    return frozenset(p.name for b in members for p in rng_state_args(b) if p.name in inputs)
