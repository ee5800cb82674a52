"""Whether a step's rows are independent: the check behind padding a call up to a capture size.

Invariants
==========

What padding relies on
    A padded call replays the graph captured at a larger batch size on the call's rows plus rows left in the graph's
    input buffers, and hands out the call's rows of each output. That equals running the step on the call's rows
    alone when (1) each output row depends only on the same row of the arguments, (2) the step writes no tensor that
    outlives the call (its state, its arguments) and draws no random numbers, and (3) the step runs the same ops for
    every batch size up to the capture size: it does not branch on its batch size. :class:`RowCheck` checks (1) and
    (2), op by op, on a call at the capture size; (3) is the caller's promise, as for vLLM's capture sizes.

How rows are tracked
    Every tensor argument carries the batch along dim 0; its other dims are the same for every call padded into one
    graph (``cudagraphex.step.buckets``), so they do not come from the batch. A tensor that carries the batch is
    ``Rows(axis, inner)``: dim ``axis`` holds it in blocks of ``inner``, one block per row (a view that flattens (B, T)
    into B*T keeps inner T). Tensors that existed before the call (parameters, buffers, caches) and tensors computed
    from them alone carry no rows. A tensor given a size by the step (a factory such as ``zeros`` or ``arange``,
    ``expand``, ``repeat``) whose dim is a multiple of the batch size may have taken that size from the batch: it is
    ``Maybe(axes)`` until an elementwise op lines it up with a batch axis (it carries rows) or with a dim of a tensor
    that carries rows elsewhere (it does not). Ops on meta or fake tensors alone (a compiler's work on shapes) hold no
    rows and are not tracked.


What refuses padding (the first such op is the reason)
    An op that mixes rows: a reduction, contraction, sort, scan, index or slice along the batch axis, a view that
    splits it, batch norm in training. A write in place to a tensor that existed before the call. A random op. A value
    of a row read on the host. An op the check does not know, applied to a tensor that carries rows or may; a tensor
    whose origin the check did not see; ``torch.compile``'d code the call runs (``cudagraphex.step.compiled_code``); an
    output that only may carry rows, or that carries them off dim 0.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary
from typing_extensions import Self

from cudagraphex.step.compiled_code import CompiledCodeWatch
from cudagraphex.step.layouts import (
    Maybe,
    Refused,
    Rows,
    dim_set,
    elementwise,
    moved_axis,
    named,
    reduced,
    refuse,
    reshaped,
)

__all__ = ["RowCheck", "on_shapes_only"]


@functools.cache
def _composite(func: torch._ops.OpOverload) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
    except RuntimeError:  # a TorchScript operator (``prim::device``), which the dispatcher does not hold
        return False


def on_shapes_only(args: Any, kwargs: Any) -> bool:
    """Whether an op gets tensors and all are meta or fake: a compiler's work on shapes (Thunder's SDPA checker
    queries fake tensors while a first call compiles), which runs no kernel and through which no row flows."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.is_meta or isinstance(t, FakeTensor) for t in tensors)


aten = torch.ops.aten
_VIEWS = {aten.view, aten._unsafe_view, aten.reshape}
_SAME = {
    aten._to_copy,
    aten.alias,
    aten.detach,
    aten.zeros_like,
    aten.ones_like,
    aten.empty_like,
    aten.full_like,
    aten.fill_,
    aten.zero_,
    aten.contiguous,
    aten.clone,
    aten._conj,
    aten.resolve_conj,
    aten.resolve_neg,
}
_REDUCTIONS = {
    aten.sum,
    aten.mean,
    aten.amax,
    aten.amin,
    aten.max,
    aten.min,
    aten.argmax,
    aten.argmin,
    aten.var,
    aten.std,
    aten.var_mean,
    aten.std_mean,
    aten.prod,
    aten.logsumexp,
    aten.linalg_vector_norm,
    aten.any,
    aten.all,
}
_ALONG_DIM = {aten._softmax, aten._log_softmax, aten.softmax, aten.log_softmax, aten.cumsum, aten.cumprod, aten.sort}
_LIFTS = {aten.lift_fresh, aten.lift_fresh_copy}
_METADATA = {aten.sym_size, aten.sym_numel, aten.sym_stride, aten.sym_storage_offset}
_FACTORIES_OF = {aten.new_zeros, aten.new_ones, aten.new_empty, aten.new_full, aten.new_empty_strided}
_SIZED = {aten.expand, aten.repeat, *_FACTORIES_OF}
_ATTENTION = {
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
}


class RowCheck(TorchDispatchMode):
    """Checks, while a call runs under it, that the call's rows are independent (module docstring).

    ``problem`` is None while they are, else the first reason they are not. After the call, :meth:`layout_of` says
    how each output carries the rows.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # as for the host-work scan; compiled code's results read as of unseen origin

    def __init__(self, args: Sequence[Any], batch: int) -> None:
        super().__init__()
        self.batch = batch
        self.problem: str | None = None
        self._known: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._args = {id(a) for a in args if isinstance(a, torch.Tensor)}
        self._compiled = CompiledCodeWatch()
        self._depth = 0
        # Strong references: nothing that existed before the call is freed during it, so no new tensor reuses its
        # address and reads as old. (type(): no __class__ lookup, which some proxies answer with a warning.)
        self._before = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
        self._before_ids = {id(t) for t in self._before}
        self._before_storages = {_storage(t) for t in self._before} - {None}
        self._arg_storages = {_storage(a) for a in args if isinstance(a, torch.Tensor)} - {None}

    def __enter__(self) -> Self:
        if not self._depth:  # the check enters itself again to look into composite ops
            self.problem = self._compiled.__enter__().found
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._depth -= 1
        if not self._depth:
            self._compiled.__exit__(*exc)
            self.problem = self._compiled.found or self.problem  # compiled code: the cause of what it made unseen

    def layout_of(self, t: torch.Tensor) -> Rows | None:
        """How output ``t`` carries the rows: ``Rows(0, inner)``, or None (it carries none). Refuses otherwise."""
        if self.problem is None:
            try:
                layout = self._layout(t)
                if isinstance(layout, Maybe):
                    raise Refused(f"an output of shape {tuple(t.shape)} has a size that may come from the batch")
                if isinstance(layout, Rows) and layout.axis != 0:
                    raise Refused(f"an output carries the batch along dim {layout.axis}, not 0")
                return layout
            except Refused as e:
                self.problem = str(e)
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.problem is not None or on_shapes_only(args, kwargs):
            return func(*args, **kwargs)
        if _composite(func):
            # Under inference mode composite ops (linear, layer_norm) reach the mode whole: checked as the ops they
            # decompose into, which is what reaches it with autograd on.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        try:
            inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if func.overloadpacket in _LIFTS:  # torch.tensor(data): made outside the dispatcher, from host data
                inputs = []
            layouts = [self._layout(t) for t in inputs]
            self._check_effects(func, args, kwargs, layouts)
        except Refused as e:
            self.problem = f"{e} ({func})"
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        try:
            if any(layouts) or not inputs or func.overloadpacket in _SIZED:
                self._record(func, args, kwargs, inputs, layouts, out)
            else:
                for t in pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t not in self._known:
                        self._known[t] = None
        except Refused as e:
            self.problem = f"{e} ({func})"
        return out

    # -- rules --------------------------------------------------------------------------------------------------------

    def _layout(self, t: torch.Tensor) -> Rows | Maybe | None:
        if t in self._known:
            return self._known[t]
        if id(t) in self._args:
            return Rows(0) if t.dim() > 0 else None
        storage = _storage(t)
        if id(t) in self._before_ids or storage in self._before_storages:
            if storage in self._arg_storages:
                raise Refused("a tensor shares memory with an argument")
            return None
        raise Refused("a tensor of unseen origin (compiled code?) is used")

    def _check_effects(self, func, args, kwargs, layouts) -> None:
        packet = func.overloadpacket
        if packet in _ATTENTION:
            dropout = named(func, args, kwargs).get("dropout_p", 0.0)
            if dropout:
                raise Refused("attention with dropout draws random numbers")
        elif torch.Tag.nondeterministic_seeded in func.tags:
            raise Refused("the step draws random numbers")
        if packet in (aten.native_batch_norm, aten._native_batch_norm_legit) and any(layouts) and args[5]:
            raise Refused("batch norm in training mixes rows")
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            target = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in pytree.tree_leaves(target):
                if isinstance(t, torch.Tensor) and (
                    id(t) in self._args or t not in self._known or _storage(t) in self._before_storages
                ):
                    raise Refused("the step writes a tensor that outlives the call in place (its state or an argument)")

    def _record(self, func, args, kwargs, inputs, layouts, out) -> None:
        packet = func.overloadpacket
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            if any(layouts) and packet not in _METADATA:
                raise Refused("an op turns rows into a host value")
            return
        written = (
            set() if packet in _LIFTS else {id(t) for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)}
        )
        written &= {id(t) for t in outs}
        results = self._rule(func, packet, args, kwargs, inputs, layouts, outs)
        for t, layout in zip(outs, results, strict=True):
            if id(t) in written and self._known.get(t) != layout:
                # Other views of its memory still have the old description.
                raise Refused("an in-place write changes which rows a tensor carries")
            self._known[t] = layout

    def _rule(self, func, packet, args, kwargs, inputs, layouts, outs) -> list:
        if not inputs or packet in _FACTORIES_OF:
            return [self._sized(t, None, None) for t in outs]
        if packet in (aten.expand, aten.repeat):
            return [self._sized(outs[0], inputs[0], layouts[0])]
        if torch.Tag.pointwise in func.tags or packet in _SAME or packet is aten.copy_ or packet is aten.masked_fill:
            return [elementwise(t, inputs, layouts) for t in outs]
        (layout, source), *rest = [(lo, t) for lo, t in zip(layouts, inputs, strict=True) if lo is not None] or [
            (None, None)
        ]
        if isinstance(layout, Maybe) and not rest:
            if packet is aten.embedding and source is args[1]:
                return [layout]
            try:
                moved = [moved_axis(packet, args, Rows(a), source, outs) for a in layout.axes]
            except Refused:
                moved = [None]
            if None not in moved:
                return [Maybe(frozenset(moved)) for _ in outs]
        if isinstance(layout, Maybe) or any(isinstance(lo, Maybe) for lo, _ in rest):
            raise Refused("a size that may come from the batch reaches an op that is not elementwise")
        if packet in _VIEWS:
            return [reshaped(layout, source, outs[0], self.batch)]
        if packet in _REDUCTIONS:
            return [reduced(func, args, kwargs, layout, source) for _ in outs]
        if packet in _ALONG_DIM:
            dim = dim_set(args[1] if len(args) > 1 else kwargs.get("dim", -1), source.dim())
            if layout.axis in dim:
                raise Refused("the step works along the batch axis")
            return [layout for _ in outs]
        axis = moved_axis(packet, args, layout, source, outs)
        if axis is not None:
            return [
                Rows(axis, layout.inner)
                if t.dim() > axis and t.shape[axis] == source.shape[layout.axis]
                else refuse("a slice along the batch axis")
                for t in outs
            ]
        return [self._other(func, args, inputs, layouts, t) for t in outs]

    def _sized(self, t: torch.Tensor, source, layout) -> Rows | Maybe | None:
        if layout is not None:
            if not isinstance(layout, Rows):
                raise Refused("a size that may come from the batch is expanded")
            offset = t.dim() - source.dim()
            if t.shape[layout.axis + offset] != source.shape[layout.axis]:
                raise Refused("the batch axis is repeated")
            return Rows(layout.axis + offset, layout.inner)
        shift = 0 if source is None else t.dim() - source.dim()
        known = (
            {d + shift for d in range(source.dim()) if source.shape[d] == t.shape[d + shift]}
            if source is not None
            else set()
        )
        axes = frozenset(d for d, s in enumerate(t.shape) if d not in known and s >= self.batch and s % self.batch == 0)
        return Maybe(axes) if axes and self.batch > 1 else None

    def _other(self, func, args, inputs, layouts, t) -> Rows | None:
        packet = func.overloadpacket
        carriers = [(lo, s) for lo, s in zip(layouts, inputs, strict=True) if lo is not None]
        if packet in (aten.mm, aten.addmm):
            lo, s = carriers[0]
            if len(carriers) == 1 and s is args[-2 if packet is aten.addmm else 0] and lo.axis == 0:
                return lo
            both = packet is aten.addmm and len(carriers) == 2 and carriers[0][1] is args[0]
            if both and carriers[1][1] is args[1] and carriers[0][0] == carriers[1][0] == Rows(0, lo.inner):
                return carriers[1][0]
            raise Refused("a matrix product contracts or mixes the batch")
        if packet in (aten.bmm, aten.baddbmm):
            a, b = args[-2], args[-1]
            la, lb = self._layout(a), self._layout(b)
            if packet is aten.baddbmm and self._layout(args[0]) not in (None, la):
                raise Refused("a batched matrix product adds a tensor whose rows lie elsewhere")
            if la is not None and la.axis == 0 and (lb == la or (lb is None and b.shape[0] == 1)):
                return la
            if la is not None and la.axis == 1 and lb is None:
                return la
            raise Refused("a batched matrix product contracts or mixes the batch")
        if packet is aten.embedding and layouts[0] is None:
            return layouts[1]
        if packet is aten.index_select and len(carriers) == 1:
            lo, s = carriers[0]
            dim = args[1] % args[0].dim()
            if s is args[2] and lo.axis == 0:
                return Rows(dim, lo.inner)
            if s is args[0] and lo.axis != dim:
                return lo
        if packet is aten.index and layouts[0] is None:
            indices = [i for i in args[1] if i is not None]
            if len(args[1]) == 1 and len(indices) == 1:
                return self._layout(indices[0])
        norms = (aten.native_layer_norm, aten._native_batch_norm_legit_no_training, aten.native_batch_norm)
        if packet in norms and len(carriers) == 1:
            lo, s = carriers[0]
            if s is args[0]:
                norm_start = s.dim() - len(args[1]) if packet is aten.native_layer_norm else None
                if (norm_start is None and lo.axis != 1) or (norm_start is not None and lo.axis < norm_start):
                    return lo if t.dim() == s.dim() else None
        if packet in (aten.cat, aten.stack):
            tensors = args[0]
            dim = args[1] if len(args) > 1 else 0
            los = [self._layout(x) for x in tensors]
            first = los[0]
            if first is not None and all(lo == first for lo in los):
                dim %= tensors[0].dim() + (packet is aten.stack)
                if packet is aten.cat and dim != first.axis:
                    return first
                if packet is aten.stack:
                    return Rows(first.axis + (dim <= first.axis), first.inner)
            raise Refused("a concatenation mixes tensors with and without the batch, or along it")
        if packet in _ATTENTION and isinstance(layouts[0], Rows) and layouts[0].axis == 0:
            q, bias = args[0], named(func, args, {}).get("attn_bias")
            bias_ok = (
                bias is None or self._layout(bias) == layouts[0] or (self._layout(bias) is None and bias.shape[0] == 1)
            )
            if bias_ok and all(self._layout(x) == layouts[0] for x in args[1:3]):
                return layouts[0] if t.dim() > 0 and t.shape[0] == q.shape[0] else None
        if packet in (aten.tril, aten.triu) and layouts[0] is not None and layouts[0].axis < args[0].dim() - 2:
            return layouts[0]
        raise Refused(f"an op the row check does not know ({packet.__name__}) gets a tensor that carries rows")


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s memory; None where it has none to share: a fake or meta tensor (whose data pointer is
    not read: reading a fake tensor's warns) or an empty one (address 0)."""
    try:
        if isinstance(t, FakeTensor) or t.is_meta:
            return None
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None
