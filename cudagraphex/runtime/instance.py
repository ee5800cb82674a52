"""One captured graph of a region: its guards, its capture, and its replay.

Invariants
==========

Guards
    An instance is replayed only for calls whose tensor inputs (copied, read in place, static) have the dtype, shape,
    strides, device, ``requires_grad`` and dispatch keys they had at capture (one C++ ``TensorGuards`` call), whose
    host values equal the captured ones, and whose static inputs (and tensors read in place) are at the captured
    addresses (one C++ compare). A call that fails them goes to the region's slow path.

Replay
    A replay copies the copied inputs into the instance's buffers (one batched copy), replays the graph, bumps the
    version counters of the static inputs whose counters its capture moved (as eager's in-place ops do, so that
    autograd sees the writes; one the trace only may write keeps its counter), copies back the buffers of copied
    inputs it may write (bumping the counters of those its capture wrote), and hands out the outputs (``handout``).
    The region checks ``liveness`` before it replays.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from cudagraphex._protections import PROTECTIONS
from cudagraphex.capture import CaptureFailed, EmulatedGraph, unexpand
from cudagraphex.planning.static_inputs import InputKind
from cudagraphex.runtime.guards import addresses_equal, layout_guard
from cudagraphex.runtime.handout import Handout
from cudagraphex.runtime.liveness import Liveness, Pool
from cudagraphex.runtime.release import GivenBack, Storage, giving_back
from cudagraphex.runtime.staging import input_buffer, picker, version_of

if TYPE_CHECKING:
    from cudagraphex.runtime.region import GraphedRegion

__all__ = ["CopiedInput", "Instance"]


class CopiedInput(NamedTuple):
    """An input a graph copies into its buffer on every replay: where it is among the region's inputs, and the layout
    it had at capture (which the guard holds it to)."""

    index: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class Instance:
    """One captured graph of a region, for one input signature and one set of static addresses."""

    def __init__(
        self,
        region: GraphedRegion,
        key: tuple,
        args: Sequence[torch.Tensor],
        pool: Pool,
        read_in_place: frozenset[int] = frozenset(),
        give_back: dict[int, Storage] | None = None,
    ) -> None:
        """Captures the region for ``args`` into ``pool``, giving back the storages of ``give_back``
        (``release.give_back_candidates``) at the last read of their inputs. Raises
        :class:`~cudagraphex.capture.CaptureFailed` where the capture fails."""
        # A tensor input that is None at run time (flash attention's cum_seq_q outside varlen) is a host value here.
        kinds = [InputKind.HOST_VALUE if a is None else kind for kind, a in zip(region.kinds, args, strict=True)]
        # Dropout RNG state that an eager run left in host memory is copied to the device, where a graph reads it.
        for i in region.rng_state_idx:
            if args[i] is not None and args[i].device != region.device:
                kinds[i] = InputKind.COPIED
                read_in_place -= {i}
        n = len(args)
        self.region = region
        self.key = key
        self.pool = pool
        #: Caller's tensors this graph reads where they were at capture (see ``staging``).
        self.read_in_place = sorted(read_in_place)
        self.static = [i for i in range(n) if kinds[i].is_static or i in read_in_place]
        self.static_ptrs: list[int | None] = [None] * n
        for i in self.static:
            self.static_ptrs[i] = args[i].data_ptr()
        copied = [i for i in range(n) if kinds[i].is_copied and i not in read_in_place]
        self.values = [(i, args[i]) for i in range(n) if kinds[i] is InputKind.HOST_VALUE]
        self.copied_inputs = [CopiedInput(i, args[i].shape, args[i].stride(), args[i].dtype) for i in copied]
        # Nothing upstream checks strides, and a static address may hold another tensor than at capture (a saved
        # tensor of an eager forward, in recycled memory), so every tensor input's layout is checked: each tensor at
        # its first position (``TensorGuards`` refuses one tensor at two, a tied weight say), the others by identity.
        first: dict[int, int] = {}
        for i in copied + self.static:
            first.setdefault(id(args[i]), i)
        guarded = list(first.values())
        self.same_tensor = [(i, first[id(args[i])]) for i in copied + self.static if first[id(args[i])] != i]
        self.guard = layout_guard([args[i] for i in guarded])
        self.pick_guarded = picker(guarded)
        self.num_copied = len(copied)
        self.pick_copied = picker(copied)
        #: Whether the guarded tensors start with the copied inputs, so that a fitting call's copied inputs are those.
        self.copied_lead = guarded[: len(copied)] == copied
        region.backend.prepare(region.device)
        peak_before = region.backend.peak_allocated_bytes(region.device)
        graph_args = list(args)
        #: Per copied input, the buffer the graph reads it from, and the dims along which it is expanded (its buffer
        #: holds one element along each).
        self.buffers: list[torch.Tensor] = []
        self.expanded_dims: list[tuple[int, ...]] = []
        for i in copied:
            buf, graph_args[i], expanded = input_buffer(args[i], region.device)
            buf.copy_(unexpand(args[i], expanded))
            self.buffers.append(buf)
            self.expanded_dims.append(expanded)
        self.any_expanded = any(self.expanded_dims)
        copied_back = [(i, buf) for i, buf in zip(copied, self.buffers, strict=True) if i in region.mutated_idx]
        versions = {i: version_of(args[i]) for i in self.static if i in region.mutated_idx}
        buffer_versions = [version_of(buf) for _, buf in copied_back]

        before = region.backend.reserved_bytes(region.device)
        start = time.perf_counter()
        give_back = give_back or {}
        pool_id = pool.ids.for_capture()
        with giving_back(region.backend.release, give_back, args) as given:
            try:
                self.graph, outputs = region.backend.capture(
                    region.fn,
                    graph_args,
                    pool=pool_id,
                    device=region.device,
                    static=self.static,
                    mutated=sorted(region.mutated_idx),
                )
            except CaptureFailed:
                # The memory given back is the pool's now.
                pool.note_given_back([(give_back[cd].owner, give_back[cd].group) for cd in given])
                raise
        pool.ids.captured(self.graph, pool_id)
        #: Static inputs the capture wrote: the ops it records bump the counters of what they write, as eager's do,
        #: and one the trace only may write (an alias it cannot rule out) keeps its counter. Each replay bumps them
        #: again, so that autograd sees the writes.
        self.written_in_place = [i for i, v in versions.items() if version_of(args[i]) != v]
        #: Per copied input the trace may write: its position, its buffer, and whether the capture wrote the buffer.
        #: Every replay copies the buffer back; only a written one bumps the input's counter.
        self.copy_back = [
            (i, buf, version_of(buf) != v) for (i, buf), v in zip(copied_back, buffer_versions, strict=True)
        ]
        #: The storages this capture gave back, and when a replay may overwrite them again (None: it gave none back).
        self.given_back = GivenBack(give_back, given, args, region.backend.own_storage_refs) if given else None
        #: Per tensor input, the tensor the graph read: the caller's tensor (static, read in place) or its buffer. An
        #: input whose memory was given back is left out: an output the capture allocated in that memory has its
        #: address without being a view of it (a region returns no view of an input it reads last).
        released = set(self.given_back.positions) if self.given_back else set()
        read = {i: graph_args[i] for i in self.static + copied if i not in released}
        # The views of input buffers in graph_args (expanded inputs) must not count in the liveness baselines below.
        del graph_args
        self.emulated = isinstance(self.graph, EmulatedGraph)
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = region.backend.reserved_bytes(region.device) - before
        #: How far the process's peak allocated memory rose while the input buffers were made and the graph captured.
        self.peak_added = max(0, region.backend.peak_allocated_bytes(region.device) - peak_before)
        self.replays = 0
        info = region.info
        self.handout = Handout(outputs, args, read, info.output_names, info.input_names, info.returned)
        self.handout.plan(region.copy_output)
        del outputs, read
        region.graphs.direct_anchors.update(id(a) for a in self.handout.direct)
        # Taken while nothing but anchors and input buffers references the output storages, and once every structure
        # of ours that references an anchor handed out as itself exists (those structures never change).
        self.liveness = Liveness(self, self.handout)

    def fitting_copied_inputs(self, args: Sequence[Any]) -> tuple[torch.Tensor, ...] | None:
        """The copied inputs of ``args`` if ``args`` have the layout of this instance's tensor inputs, its host values
        and its static addresses; None otherwise. Reads no protection switch: the slow path, which a None sends the
        call to, does."""
        guarded = self.pick_guarded(args)
        if self.guard is not None and not self.guard.check(*guarded):
            return None
        for i, j in self.same_tensor:
            if args[i] is not args[j]:
                return None
        for i, value in self.values:
            if args[i] != value:
                return None
        if self.static and not addresses_equal(list(args), self.static_ptrs, self.static):
            return None
        if self.copied_lead:  # the whole tuple itself when all are copied
            return guarded[: self.num_copied]
        return self.pick_copied(args)

    def statics_match(self, args: Sequence[torch.Tensor]) -> bool:
        if not self.static or not PROTECTIONS["static_address_guard"]:
            return True
        return addresses_equal(list(args), self.static_ptrs, self.static)

    def moved(self, args: Sequence[torch.Tensor]) -> list[int]:
        return [i for i in self.static if args[i].data_ptr() != self.static_ptrs[i]]

    def copy_in(self, copied: Sequence[torch.Tensor]) -> None:
        """Copies ``copied`` into the buffers the graph reads them from: one ``copy_`` for one input, one
        ``torch._foreach_copy_`` for more."""
        if self.any_expanded:
            copied = [unexpand(a, dims) for a, dims in zip(copied, self.expanded_dims, strict=True)]
        if len(self.buffers) == 1:  # a third cheaper than a foreach of one on the CPU host, as cheap on the H200 host
            self.buffers[0].copy_(copied[0])
        elif self.buffers:
            torch._foreach_copy_(self.buffers, copied)

    def replay(self, args: Sequence[torch.Tensor], copied: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Copies ``copied`` (the copied inputs of ``args``) into the graph, replays it and hands out its outputs."""
        self.copy_in(copied)
        if self.emulated:
            with self.given_back.overwritten_at_release(args) if self.given_back else contextlib.nullcontext():
                self.graph.replay(args)
        else:
            self.graph.replay()
            if self.written_in_place:  # as eager's in-place ops do, so that autograd sees the writes
                torch.autograd.graph.increment_version([args[i] for i in self.written_in_place])
        if self.copy_back and PROTECTIONS["copy_back_mutated_inputs"]:
            targets = [args[i] if written else args[i].data for i, _, written in self.copy_back]
            torch._foreach_copy_(targets, [buf for _, buf, _ in self.copy_back])
        self.replays += 1
        return self.handout.outputs(args)
