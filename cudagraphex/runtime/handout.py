"""How a graph's outputs reach the caller.

Invariants
==========

Anchors
    A graph keeps its outputs alive; those tensors are its *anchors*, grouped by storage. An output the trace returns
    (a forward output, a gradient) is never handed out as its anchor, because the caller may change its metadata
    (autograd sets ``grad_fn`` on a forward output): it is handed out as a new tensor aliasing the anchor's storage (no
    copy), or as a copy once the caller was seen to hold it across calls (``copy_output``).

Version counters
    Outputs that share a storage share a version counter, as in eager, so that autograd sees an in-place write to one
    through the others: they are aliased with ``anchor.detach()``, and their copies are made to share one. An output
    alone on its storage is aliased with the cheaper ``anchor.data``, whose version counter is its own (the anchor's,
    which nothing reads, does not follow it).

Outputs the caller never sees
    An output the trace does not return (a tensor saved for backward, an intermediate that a later symbol reads) is
    handed out as the anchor itself, which Thunder's code only reads, passes on and saves; that spares an alias per
    output and replay. ``liveness`` counts the references to these anchors.

Outputs that alias an input
    An output that aliases an input (the input itself, a view, a ``detach``, a view of a ``detach``) is handed out as
    the same alias of the caller's tensor, made as eager makes it (its version counter follows the input; its base and
    ``requires_grad`` too unless a ``detach`` lies between them), also where the graph read a copy of the input; a
    capture whose input buffer cannot keep the caller's layout fails rather than hand out an alias of the buffer.
    Where several inputs share its storage (``x``, ``x.detach()``), it is rebuilt on the one it is, else on the one
    whose view base it shares.

One tensor at several positions
    One tensor returned at several positions (``shallow_copy`` lowers to the tensor itself) is handed out as one
    tensor, as the region returns it: autograd then sums the cotangents of those positions in the same order.

How each output is handed out is decided once per instance (:meth:`Handout.plan`), again whenever the region switches
an output to copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cudagraphex.capture import CaptureFailed

__all__ = ["Handout", "alias_kind", "sharing_one_version", "view_of"]


class Handout:
    """The outputs of one captured graph and how each is handed out; :meth:`outputs` hands them out after a replay."""

    def __init__(
        self,
        outputs: Sequence[torch.Tensor | None],
        args: Sequence[torch.Tensor],
        read: dict[int, torch.Tensor],
        output_names: Sequence[str],
        input_names: Sequence[str],
        returned: frozenset[str],
    ) -> None:
        """Splits the captured ``outputs`` into borrowed ones (views of an input) and anchors grouped by storage.

        ``read`` maps each tensor input to the tensor the graph read (the caller's, or its buffer). Raises
        :class:`CaptureFailed` where a buffer's layout differs from the caller's tensor's, so that an output viewing
        that input cannot be rebuilt on the caller's tensor.
        """
        sources: dict[int, list[int]] = {}
        for i, t in read.items():
            sources.setdefault(t.untyped_storage().data_ptr(), []).append(i)
        self.borrowed: list[tuple[int, tuple | None] | None] = []
        self.anchors: list[torch.Tensor | None] = []
        self.group_of: list[int] = []
        self.group_cdata: list[int] = []
        group_index: dict[int, int] = {}
        first_position: dict[int, int] = {}
        #: (output index, index of the first position of the same tensor)
        self.repeated = [
            (i, first_position.setdefault(id(out), i))
            for i, out in enumerate(outputs)
            if out is not None and first_position.setdefault(id(out), i) != i
        ]
        for out in outputs:
            if out is None:  # declared a tensor, None at run time (flash attention's cum_seq_q outside varlen)
                self.borrowed.append(None)
                self.anchors.append(None)
                self.group_of.append(-1)
                continue
            storage = out.untyped_storage()
            on_storage = sources.get(storage.data_ptr())
            if on_storage is not None:
                source = _closest_input(out, on_storage, read)
                seen = read[source]
                if out is seen:  # an in-place op returns its input itself, and so does the handed-out output
                    self.borrowed.append((source, None))
                elif seen.stride() != args[source].stride():
                    raise CaptureFailed(
                        f"output {output_names[len(self.borrowed)]} views input {input_names[source]}, whose layout"
                        " its buffer does not keep"
                    )
                else:
                    offset = out.storage_offset() * out.element_size() - seen.storage_offset() * seen.element_size()
                    self.borrowed.append((source, (out.dtype, out.shape, out.stride(), offset, alias_kind(out, seen))))
                self.anchors.append(None)
                self.group_of.append(-1)
                continue
            g = group_index.setdefault(storage.data_ptr(), len(group_index))
            if g == len(self.group_cdata):
                self.group_cdata.append(storage._cdata)
            self.borrowed.append(None)
            self.anchors.append(out)
            self.group_of.append(g)
        groups = range(len(self.group_cdata))
        self.group_members = [[i for i, g in enumerate(self.group_of) if g == k] for k in groups]
        is_returned = [name in returned for name in output_names]
        self.group_returned = [any(is_returned[i] for i in m) for m in self.group_members]
        # Handed out as themselves: anchors of storages no returned output shares (saved for backward, intermediates).
        direct = [i for i, a in enumerate(self.anchors) if a is not None and not self.group_returned[self.group_of[i]]]
        self.direct = [self.anchors[i] for i in direct]
        self.direct_group = [self.group_of[i] for i in direct]
        self.template: list[torch.Tensor | None] = [None] * len(self.anchors)
        for i in direct:
            self.template[i] = self.anchors[i]

    def plan(self, copy_output: Sequence[bool]) -> None:
        """Decides how each output that is not handed out as its anchor is handed out (``copy_output``: the outputs
        the caller was seen to keep across calls, handed out as copies)."""
        #: (output index, anchor): handed out as ``anchor.data`` (the output alone uses its storage)
        self.unshared: list[tuple[int, torch.Tensor]] = []
        #: (output index, anchor): handed out as ``anchor.detach()`` (outputs that share a storage share its version
        #: counter)
        self.detached: list[tuple[int, torch.Tensor]] = []
        #: (output index, input index, (dtype, size, stride, byte offset, alias kind)): an alias of the caller's input
        #: (the input itself where the meta is None)
        self.aliased = [(i, b[0], b[1]) for i, b in enumerate(self.borrowed) if b is not None]
        #: (output index, anchor): handed out as ``anchor.clone()``
        self.cloned: list[tuple[int, torch.Tensor]] = []
        #: (an anchor of the storage, its members' (output index, anchor, (size, stride, offset))): one storage copy,
        #: its members sharing one version counter
        self.storage_copies: list[tuple[torch.Tensor, list[tuple[int, torch.Tensor, tuple]]]] = []
        for g, members in enumerate(self.group_members):
            if not self.group_returned[g]:
                continue
            if not any(copy_output[i] for i in members):
                aliases = self.unshared if len(members) == 1 else self.detached
                aliases += [(i, self.anchors[i]) for i in members]
            elif len(members) == 1:
                self.cloned.append((members[0], self.anchors[members[0]]))
            else:
                metas = [(i, a, (a.shape, a.stride(), a.storage_offset())) for i in members for a in [self.anchors[i]]]
                self.storage_copies.append((self.anchors[members[0]], metas))
        self.rebuilt = bool(self.aliased or self.cloned or self.storage_copies)

    def outputs(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """The outputs of a replay with inputs ``args``, as the plan hands them out."""
        out = self.template.copy()
        for i, anchor in self.unshared:
            out[i] = anchor.data
        for i, anchor in self.detached:
            out[i] = anchor.detach()
        if self.rebuilt:
            for i, source, meta in self.aliased:
                out[i] = args[source] if meta is None else view_of(args[source], meta)
            for i, anchor in self.cloned:
                out[i] = anchor.clone()
            for anchor, members in self.storage_copies:
                for i, tensor in sharing_one_version(anchor.untyped_storage().clone(), members):
                    out[i] = tensor
        for i, first in self.repeated:
            out[i] = out[first]
        return out


def _closest_input(out: torch.Tensor, candidates: list[int], read: dict[int, torch.Tensor]) -> int:
    """The input among ``candidates`` (inputs on ``out``'s storage: a tensor, its ``detach``, their views) that ``out``
    is, else the one whose autograd view base ``out`` shares, else the first: an alias rebuilt on it is what eager
    hands out (a view of a ``detach`` would lose ``requires_grad`` and the base)."""
    for i in candidates:
        if out is read[i]:
            return i
    for i in candidates:
        if alias_kind(out, read[i]) == "view":
            return i
    return candidates[0]


def alias_kind(out: torch.Tensor, seen: torch.Tensor) -> str:
    """How ``out``, which shares ``seen``'s storage, aliases it: ``"view"`` where its view base is ``seen``'s (autograd
    follows ``seen``), ``"detached view"`` where it views an alias that is no view (``seen.detach().unsqueeze(0)``),
    ``"alias"`` where it is no view itself (``detach``)."""
    if not out._is_view():
        return "alias"
    return "view" if out._base is (seen._base if seen._is_view() else seen) else "detached view"


def view_of(source: torch.Tensor, meta: tuple) -> torch.Tensor:
    """An alias of ``source`` laid out as ``meta`` (dtype, size, stride, byte offset from ``source``'s first element,
    :func:`alias_kind`), made as eager makes it, in the caller's grad mode. A view's base is ``source``'s and it
    requires grad where ``source`` does; a detached view views a detached alias of ``source``, and neither it nor an
    alias that is no view requires grad. All share ``source``'s version counter. Another dtype goes through a flat view
    of the whole storage, which raises (never guesses) where that storage's size or the offset is not a multiple of the
    new item size."""
    dtype, size, stride, byte_offset, kind = meta
    if kind != "view":
        source = source.detach()
    start = source.storage_offset() * source.element_size() + byte_offset
    if dtype == source.dtype:
        alias = source.as_strided(size, stride, start // source.element_size())
    else:
        whole = source.untyped_storage().nbytes() // source.element_size()
        flat = source.as_strided((whole,), (1,), 0).view(dtype)
        if start % flat.element_size():
            raise RuntimeError(f"cudagraphex: a {dtype} view at byte {start} of a {source.dtype} input is misaligned")
        alias = flat.as_strided(size, stride, start // flat.element_size())
    return alias.detach() if kind == "alias" else alias


def sharing_one_version(storage: torch.UntypedStorage, members: list[tuple[int, torch.Tensor, tuple]]) -> list:
    """(output index, new tensor on ``storage`` laid out as the member) per member, all with one version counter, as
    outputs sharing a storage have in eager. They are not views: ``detach`` shares the counter, ``set_`` the layout
    (its version bump lands on the new counter, which nothing has read yet). The empty byte tensor takes any dtype."""
    empty = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return [
        (i, empty.view(member.dtype).detach().set_(storage, offset, size, stride))
        for i, member, (size, stride, offset) in members
    ]
