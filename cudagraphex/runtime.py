"""Capture and replay of the regions of one compiled function.

Invariants
==========

What is static
    A graph reads and writes its *static* inputs at the addresses they had when it was captured: parameters and
    buffers, tensors that another graph of the same compiled function produced in its own memory or as a view of a
    static input (forward outputs saved for backward), tensors declared static, and trace inputs the graph writes in
    place (``regions.static_outputs`` and ``static_inputs.classify_inputs`` state the rule). Before every replay those addresses are
    compared with the current inputs in one C++ call, and a graph is never replayed against a moved static input: the
    runtime captures another instance for the new addresses, or demotes the input to a copied one (see ``_on_moved``).
    Graphs hold the addresses of static inputs, not the tensors, so replacing a parameter frees the old one.
    Every other tensor input is *copied*: one batched copy moves it into a buffer the graph owns, after one C++ check
    that each has the shape, strides, dtype and device it was captured with; if the graph writes that input in place,
    the buffer is copied back after the replay. Input buffers are never handed out (see "Who owns which memory").
    One exception spares the copy (a launch that costs more host time than the replay on a slow host): a tensor the
    caller passes in (an input of the trace, a cotangent) that is at the address it had at the warm-up when a graph is
    captured is *read in place* by that graph, like a static input: its address is compared, its layout is checked
    with the copied inputs', and the graph holds its address, not the tensor. Its first move demotes it to a copied
    input, and the graph captured then copies it wherever it is (one more graph, the only one after a move).
    A tensor that the trace declares but that is None at run time (flash attention's ``cum_seq_q`` outside varlen)
    passes through as None: an input is part of the graph's signature, an output is handed out as None.
    Dropout RNG state (``safety.RNG_STATE_PARAMETERS``) is where each run reads it: an eager run of a region gets it in
    host memory (a graph's output is copied there, which waits for the graph), a graph in device memory (host memory
    that an eager forward left is copied into a device buffer).

Who owns which memory
    Graph memory (intermediates and outputs) lives in a pool. The graphs of one compiled function on one device share
    a pool and are captured on one stream in call order, so a later graph reuses the memory of an earlier graph's
    intermediates. Instances captured because the shared pool was busy (see below) get a pool of their own.
    A graph keeps its outputs alive; those tensors are its *anchors*. An output the trace returns (a forward output,
    a gradient) is never handed out as its anchor, because the caller may change its metadata (autograd sets
    ``grad_fn`` on a forward output): it is handed out as a new tensor aliasing the anchor's storage (no copy), or as a
    copy once the caller was seen to hold it across calls. Outputs that share a storage share a version counter, as in
    eager, so that autograd sees an in-place write to one through the others: they are aliased with
    ``anchor.detach()``, and their copies are made to share one. An output alone on its storage is aliased with the
    cheaper ``anchor.data``, whose version counter is its own (the anchor's, which nothing reads, does not follow it).
    An output the trace does not return (a tensor saved for backward, an intermediate that a later symbol reads) is
    handed out as the anchor itself, which Thunder's code only reads, passes on and saves; that spares an alias per
    output and replay. An output that aliases an input (the input itself, a view, a ``detach``) is handed out as the
    same alias of the caller's tensor, made as eager makes it (its base, version counter and ``requires_grad`` follow
    the input), also where the graph read a copy of the input; a capture whose input buffer cannot keep the caller's
    layout fails rather than hand out an alias of the buffer. How each output is handed out is decided once per instance (``_Instance.plan_handout``).
    Input buffers are ordinary allocations owned by the graph. Everything is owned by the compiled function, through
    its compile data, and is freed with it.

When a graph may be replayed
    A replay writes every storage the graph allocated during capture, and may write storages that graphs captured
    later in the same pool took from its freed intermediates. It may run only when each of those storages is
    referenced by anchors alone: no output the caller holds, no tensor saved for a pending backward, no gradient kept
    in ``.grad``. The check is one sum of storage use counts against a precomputed baseline, and, for anchors handed
    out as themselves (a holder of one does not raise its storage's use count), one sum of their Python reference
    counts, which holders in C++ raise too. When it fails, nothing is
    overwritten: held outputs that the caller receives switch to copy-on-return, and the call replays another instance
    whose storages are free, captures one in a pool of its own, or runs eagerly.

Capture
    The first call for a given input signature runs eagerly; it is the warm-up (lazy initialisation, compilation of
    inner fusions). A later call captures and then replays, so every call applies its side effects exactly once.
    A capture that fails leaves the process as it was (RNG state restored, current stream unchanged) and the region
    runs eagerly from then on, with one warning. The number of instances per region is bounded; past the bound new
    signatures run eagerly, with one warning. While a whole step (``cudagraphex.step``) warms up or is captured,
    regions run their symbols as plain code: the step's graph holds them.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch
from torch._C._dynamo.guards import TensorGuards

from cudagraphex import capture as _backends
from cudagraphex._protections import PROTECTIONS
from cudagraphex.capture import (
    CaptureFailed,
    CudaBackend,
    EmulatedBackend,
    EmulatedGraph,
    expanded_dims,
    unexpand,
)
from cudagraphex.static_inputs import InputKind

__all__ = [
    "FunctionGraphs",
    "GraphOptions",
    "GraphedRegion",
    "ParameterMovedError",
    "RegionInfo",
    "StrictModeError",
]

logger = logging.getLogger("cudagraphex")

_use_count = torch._C._storage_Use_Count
_ptrs_equal = torch._C._tensors_data_ptrs_at_indices_equal


class StrictModeError(RuntimeError):
    """Raised in strict mode where cudagraphex would otherwise run a region eagerly."""


class ParameterMovedError(RuntimeError):
    """A parameter moved in a function compiled with :class:`~cudagraphex.PruneParameterChecks`."""


@dataclass(frozen=True)
class GraphOptions:
    """Options of a :class:`~cudagraphex.CUDAGraphExecutor`; validated on construction."""

    min_region_size: int = 2
    max_graphs_per_region: int = 8
    warmup_calls: int = 1
    share_pool: bool = True
    strict: bool = False
    backend: str = "cuda"

    def __post_init__(self) -> None:
        for name in ("min_region_size", "max_graphs_per_region"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.warmup_calls, int) or isinstance(self.warmup_calls, bool) or self.warmup_calls < 0:
            raise ValueError(f"warmup_calls must be an int >= 0, got {self.warmup_calls!r}")
        for name in ("share_pool", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")  # noqa: TRY004 (contract)
        if self.backend not in ("cuda", "emulate"):
            raise ValueError(f"backend must be 'cuda' or 'emulate', got {self.backend!r}")


@dataclass
class RegionInfo:
    """What a region is, for diagnostics."""

    name: str
    phase: str
    device: str
    num_ops: int
    input_names: list[str]
    output_names: list[str]
    returned: frozenset[str]
    mutated: frozenset[str]


class _Pool:
    """A memory pool and the instances captured into it, in capture order."""

    def __init__(self, handle: Any, shared: bool) -> None:
        self.handle = handle
        self.shared = shared
        self.instances: list[_Instance] = []

    def register(self, instance: _Instance) -> None:
        # A replay of an earlier instance may write memory this one took from the earlier one's intermediates.
        for earlier in self.instances:
            earlier.watch(instance)
        instance.watch(instance)
        self.instances.append(instance)


class FunctionGraphs:
    """All graphs of one compiled function: its pools and its regions, grouped by the trace they came from."""

    def __init__(self, backend: CudaBackend | EmulatedBackend, options: GraphOptions) -> None:
        self.backend = backend
        self.options = options
        self._shared_pools: dict[torch.device, _Pool] = {}
        #: One entry per trace cudagraphex processed: (label, plan breaks, regions).
        self.traces: list[tuple[str, list, list[GraphedRegion]]] = []
        #: Names of tensors that graphs of the last forward trace produced (for a following backward trace).
        self.forward_graph_outputs: frozenset[str] = frozenset()
        #: Every fusion built for this function, by its unique name (owned by the executor module).
        self.fusions: dict[str, Any] = {}
        #: Set when the function was compiled with PruneParameterChecks: a moved parameter is then an error.
        self.parameters_trusted = False
        #: ``id`` of every anchor handed out as itself: a region running eagerly never passes one on to its caller.
        self.direct_anchors: set[int] = set()

    def next_fusion_id(self) -> int:
        """A number unique within this compiled function, so fusion names never collide across its traces."""
        return len(self.fusions)

    def pool(self, device: torch.device, *, private: bool) -> _Pool:
        if private or not self.options.share_pool:
            return _Pool(self.backend.new_pool(device), shared=False)
        pool = self._shared_pools.get(device)
        if pool is None:
            pool = self._shared_pools[device] = _Pool(self.backend.new_pool(device), shared=True)
        return pool

    def regions(self) -> list[GraphedRegion]:
        return [r for _, _, regions in self.traces for r in regions]


def _signature(args: Sequence[Any]) -> tuple:
    keyed = PROTECTIONS["signature_guard"]
    return tuple(
        (a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a if keyed else None)
        for a in args
    )


def _picker(indices: Sequence[int]) -> Callable[[Sequence[Any]], tuple]:
    """A function that picks the items at ``indices`` of a sequence, as a tuple (in C where it can)."""
    if len(indices) > 1:
        return itemgetter(*indices)
    if indices:
        only = indices[0]
        return lambda args: (args[only],)
    return lambda args: ()


def _input_buffer(a: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """A buffer on ``device`` for copied input ``a``, the tensor the graph reads (``a``'s strides where they allow a
    buffer), and ``a``'s expanded dims.

    An expanded input (a broadcast cotangent, say) gets a buffer without the expanded dims, read through ``expand``.
    """
    expanded = expanded_dims(a)
    shape = [1 if d in expanded else n for d, n in enumerate(a.shape)]
    if _overlaps(shape, a.stride()):
        buf = torch.empty(shape, dtype=a.dtype, device=device)
    else:  # the caller's layout, gaps included: a kernel that reads another layout may round differently
        buf = torch.empty_strided(shape, a.stride(), dtype=a.dtype, device=device)
    return buf, buf.expand(a.shape) if expanded else buf, expanded


def _overlaps(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether two elements of a tensor laid out as ``shape`` and ``stride`` share memory."""
    dims = sorted((st, n) for n, st in zip(shape, stride, strict=True) if n > 1)
    reach = 0  # the largest offset reachable with the dims so far
    for st, n in dims:
        if st <= reach:
            return True
        reach += st * (n - 1)
    return False


def _view_of(source: torch.Tensor, meta: tuple) -> torch.Tensor:
    """An alias of ``source`` laid out as ``meta`` (dtype, size, stride, byte offset from ``source``'s first element,
    whether it is a view), made as eager makes it, in the caller's grad mode. A view's base is ``source``'s and it
    requires grad where ``source`` does; an alias that is not a view (``detach``) requires no grad. Both share
    ``source``'s version counter. Another dtype goes through a flat view of the whole storage, which raises (never
    guesses) where that storage's size or the offset is not a multiple of the new item size."""
    dtype, size, stride, byte_offset, is_view = meta
    if not is_view:
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
    return alias if is_view else alias.detach()


def _sharing_one_version(storage: torch.UntypedStorage, members: list[tuple[int, torch.Tensor, tuple]]) -> list:
    """(output index, new tensor on ``storage`` laid out as the member) per member, all with one version counter, as
    outputs sharing a storage have in eager. They are not views: ``detach`` shares the counter, ``set_`` the layout
    (its version bump lands on the new counter, which nothing has read yet). The empty byte tensor takes any dtype."""
    empty = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return [
        (i, empty.view(member.dtype).detach().set_(storage, offset, size, stride))
        for i, member, (size, stride, offset) in members
    ]


class _Instance:
    """One captured graph of a region, for one input signature and one set of static addresses."""

    def __init__(
        self,
        region: GraphedRegion,
        key: tuple,
        args: Sequence[torch.Tensor],
        pool: _Pool,
        read_in_place: frozenset[int] = frozenset(),
    ) -> None:
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
        #: Caller's tensors this graph reads where they were at capture (see "What is static").
        self.read_in_place = sorted(read_in_place)
        self.static = [i for i in range(n) if kinds[i].is_static or i in read_in_place]
        self.static_ptrs: list[int | None] = [None] * n
        for i in self.static:
            self.static_ptrs[i] = args[i].data_ptr()
        copied = [i for i in range(n) if kinds[i].is_copied and i not in read_in_place]
        self.values = [(i, args[i]) for i in range(n) if kinds[i] is InputKind.HOST_VALUE]
        self.copied_meta = [(i, args[i].shape, args[i].stride(), args[i].dtype) for i in copied]
        # The layout of an input read in place is checked like a copied input's: nothing upstream checks strides.
        guarded = copied + self.read_in_place
        #: Checks in one C++ call that the copied inputs and those read in place have the dtype, shape, strides, device,
        #: requires_grad and dispatch keys they had at capture (a mismatch sends the call to the slow path).
        self.guard = (
            TensorGuards(
                *(args[i] for i in guarded),
                dynamic_dims_sizes=[list(args[i].shape) for i in guarded],
                dynamic_dims_strides=[list(args[i].stride()) for i in guarded],
            )
            if guarded
            else None
        )
        self.pick_guarded = _picker(guarded)
        self.num_copied = len(copied)
        self.pick_copied = _picker(copied)
        graph_args = list(args)
        #: Per copied input, the buffer the graph reads it from, and the dims along which it is expanded (its buffer
        #: holds one element along each).
        self.buffers: list[torch.Tensor] = []
        self.expanded_dims: list[tuple[int, ...]] = []
        for i in copied:
            buf, graph_args[i], expanded = _input_buffer(args[i], region.device)
            buf.copy_(unexpand(args[i], expanded))
            self.buffers.append(buf)
            self.expanded_dims.append(expanded)
        self.any_expanded = any(self.expanded_dims)
        self.copy_back = [(i, buf) for i, buf in zip(copied, self.buffers, strict=True) if i in region.mutated_idx]
        #: Inputs the graph writes where they are; the copy-back bumps the version counters of the others.
        self.written_in_place = [i for i in self.static if i in region.mutated_idx]

        before = region.backend.reserved_bytes(region.device)
        start = time.perf_counter()
        self.graph, outputs = region.backend.capture(
            region.fn,
            graph_args,
            pool=pool.handle,
            device=region.device,
            static=self.static,
            mutated=sorted(region.mutated_idx),
        )
        #: Per tensor input, the tensor the graph read: the caller's tensor (static, read in place) or its buffer.
        read = {i: graph_args[i] for i in self.static + copied}
        # The views of input buffers in graph_args (expanded inputs) must not count in the liveness baselines below.
        del graph_args
        self.emulated = isinstance(self.graph, EmulatedGraph)
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = region.backend.reserved_bytes(region.device) - before
        self.replays = 0
        self._adopt_outputs(outputs, args, read, region)
        del outputs, read
        # Taken while nothing but anchors and input buffers references the output storages, and once every structure
        # of ours that references an anchor handed out as itself exists (those structures never change).
        self.group_baseline = [_use_count(cd) for cd in self.group_cdata]
        region.graphs.direct_anchors.update(id(a) for a in self.direct)
        self.direct_baseline = self._direct_references()

        # Storages whose liveness gates this instance's replays: (cdata, baseline, owner instance, group).
        self.watched: list[tuple[int, int, _Instance, int]] = []
        self.watch_cdata: list[int] = []
        self.watch_baseline = 0
        #: Instances (this one among them) whose anchors handed out as themselves gate this instance's replays.
        self.watch_direct: list[_Instance] = []

    def _adopt_outputs(
        self,
        outputs: Sequence[torch.Tensor],
        args: Sequence[torch.Tensor],
        read: dict[int, torch.Tensor],
        region: GraphedRegion,
    ) -> None:
        """Splits the captured outputs into borrowed ones (views of an input) and anchors grouped by storage.

        An output on the storage of an input the graph read (a view of it) is handed out as that view of the caller's
        tensor, as in eager, also where the graph read a copy of it: the caller never sees an input buffer. Raises
        :class:`CaptureFailed` where a buffer's layout differs from the caller's tensor's, so that the view cannot be
        rebuilt on the caller's tensor.
        """
        sources = {t.untyped_storage().data_ptr(): i for i, t in read.items()}
        self.borrowed: list[tuple[int, tuple] | None] = []
        self.anchors: list[torch.Tensor | None] = []
        self.group_of: list[int] = []
        self.group_cdata: list[int] = []
        group_index: dict[int, int] = {}
        # One tensor returned at several positions (``shallow_copy`` lowers to the tensor itself) is handed out as one
        # tensor, as the region returns it: autograd then sums the cotangents of those positions in the same order.
        first_position: dict[int, int] = {}
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
            source = sources.get(storage.data_ptr())
            if source is not None:
                seen = read[source]
                if out is seen:  # an in-place op returns its input itself, and so does the handed-out output
                    self.borrowed.append((source, None))
                elif seen.stride() != args[source].stride():
                    raise CaptureFailed(
                        f"output {region.info.output_names[len(self.borrowed)]} views input"
                        f" {region.info.input_names[source]}, whose layout its buffer does not keep"
                    )
                else:
                    offset = out.storage_offset() * out.element_size() - seen.storage_offset() * seen.element_size()
                    meta = (out.dtype, out.shape, out.stride(), offset, out._is_view())
                    self.borrowed.append((source, meta))
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
        returned = [name in region.info.returned for name in region.info.output_names]
        self.group_returned = [any(returned[i] for i in m) for m in self.group_members]
        # Handed out as themselves: anchors of storages no returned output shares (saved for backward, intermediates).
        direct = [i for i, a in enumerate(self.anchors) if a is not None and not self.group_returned[self.group_of[i]]]
        self.direct = [self.anchors[i] for i in direct]
        self.direct_group = [self.group_of[i] for i in direct]
        self.template: list[torch.Tensor | None] = [None] * len(self.anchors)
        for i in direct:
            self.template[i] = self.anchors[i]
        self.plan_handout()

    def _direct_references(self) -> int:
        # A holder in C++ (an autograd node, ctx.save_for_backward) counts too: while C++ shares a tensor, torch keeps
        # a reference to its Python object (PyObject preservation).
        return sum(map(sys.getrefcount, self.direct))

    def direct_unreferenced(self) -> bool:
        """Whether nothing but this instance references the anchors it hands out as themselves."""
        return self._direct_references() == self.direct_baseline

    def plan_handout(self) -> None:
        """Decides how each output that is not handed out as its anchor is handed out, from the region's copies."""
        copy = self.region.copy_output
        #: (output index, anchor): handed out as ``anchor.data`` (the output alone uses its storage)
        self.unshared: list[tuple[int, torch.Tensor]] = []
        #: (output index, anchor): handed out as ``anchor.detach()`` (outputs that share a storage share its version
        #: counter)
        self.detached: list[tuple[int, torch.Tensor]] = []
        #: (output index, input index, (dtype, size, stride, byte offset, is a view)): an alias of the caller's input (the
        #: input itself where the meta is None)
        self.aliased = [(i, b[0], b[1]) for i, b in enumerate(self.borrowed) if b is not None]
        #: (output index, anchor): handed out as ``anchor.clone()``
        self.cloned: list[tuple[int, torch.Tensor]] = []
        #: (an anchor of the storage, its members' (output index, anchor, (size, stride, offset))): one storage copy,
        #: its members sharing one version counter
        self.storage_copies: list[tuple[torch.Tensor, list[tuple[int, torch.Tensor, tuple]]]] = []
        for g, members in enumerate(self.group_members):
            if not self.group_returned[g]:
                continue
            if not any(copy[i] for i in members):
                aliases = self.unshared if len(members) == 1 else self.detached
                aliases += [(i, self.anchors[i]) for i in members]
            elif len(members) == 1:
                self.cloned.append((members[0], self.anchors[members[0]]))
            else:
                metas = [(i, a, (a.shape, a.stride(), a.storage_offset())) for i in members for a in [self.anchors[i]]]
                self.storage_copies.append((self.anchors[members[0]], metas))
        self.rebuilt = bool(self.aliased or self.cloned or self.storage_copies)

    def watch(self, other: _Instance) -> None:
        for g, cd in enumerate(other.group_cdata):
            self.watched.append((cd, other.group_baseline[g], other, g))
            self.watch_cdata.append(cd)
            self.watch_baseline += other.group_baseline[g]
        if other.direct:
            self.watch_direct.append(other)

    def free(self) -> bool:
        """Whether no storage this instance's replay writes is referenced by anything but anchors."""
        if sum(map(_use_count, self.watch_cdata)) == self.watch_baseline and (
            not self.watch_direct or all(other.direct_unreferenced() for other in self.watch_direct)
        ):
            return True
        return not PROTECTIONS["output_liveness"]

    def held(self) -> list[tuple[_Instance, int]]:
        """The (instance, output group) pairs whose storage someone still references."""
        pairs = [(owner, g) for cd, base, owner, g in self.watched if _use_count(cd) > base]
        for other in self.watch_direct:
            if not other.direct_unreferenced():
                pairs += [(other, g) for g in sorted(set(other.direct_group))]
        return pairs

    def fitting_copied_inputs(self, args: Sequence[Any]) -> tuple[torch.Tensor, ...] | None:
        """The copied inputs of ``args`` if ``args`` have the layout of this instance's copied inputs and of those it
        reads in place, its host values and its static addresses; None otherwise. Reads no protection switch: the slow
        path, which a None sends the call to, does."""
        guarded = self.pick_guarded(args)
        if self.guard is not None and not self.guard.check(*guarded):
            return None
        for i, value in self.values:
            if args[i] != value:
                return None
        if self.static and not _ptrs_equal(list(args), self.static_ptrs, self.static):
            return None
        return guarded[: self.num_copied]  # the copied inputs come first (the whole tuple itself when all are copied)

    def statics_match(self, args: Sequence[torch.Tensor]) -> bool:
        if not self.static or not PROTECTIONS["static_address_guard"]:
            return True
        return _ptrs_equal(list(args), self.static_ptrs, self.static)

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
            self.graph.replay(args)
        else:
            self.graph.replay()
            if self.written_in_place:  # as eager's in-place ops do, so that autograd sees the writes
                torch.autograd.graph.increment_version([args[i] for i in self.written_in_place])
        if self.copy_back and PROTECTIONS["copy_back_mutated_inputs"]:
            torch._foreach_copy_([args[i] for i, _ in self.copy_back], [buf for _, buf in self.copy_back])
        self.replays += 1
        out = self.template.copy()
        for i, anchor in self.unshared:
            out[i] = anchor.data
        for i, anchor in self.detached:
            out[i] = anchor.detach()
        if self.rebuilt:
            self._rebuild_outputs(out, args)
        for i, first in self.repeated:
            out[i] = out[first]
        return out

    def _rebuild_outputs(self, out: list[torch.Tensor | None], args: Sequence[torch.Tensor]) -> None:
        for i, source, meta in self.aliased:
            out[i] = args[source] if meta is None else _view_of(args[source], meta)
        for i, anchor in self.cloned:
            out[i] = anchor.clone()
        for anchor, members in self.storage_copies:
            for i, tensor in _sharing_one_version(anchor.untyped_storage().clone(), members):
                out[i] = tensor


class GraphedRegion:
    """The callable that runs one region: replays a captured instance, captures one, or runs the region eagerly."""

    def __init__(
        self,
        fn: Callable,
        info: RegionInfo,
        kinds: Sequence[InputKind],
        graphs: FunctionGraphs,
        input_is_mutated: Sequence[bool],
        input_is_rng_state: Sequence[bool] = (),
    ) -> None:
        self.fn = fn
        self.info = info
        self.kinds = list(kinds)
        self.graphs = graphs
        self.backend = graphs.backend
        self.options = graphs.options
        self.device = torch.device(info.device)
        self.mutated_idx = {i for i, m in enumerate(input_is_mutated) if m}
        #: Inputs read as dropout RNG state: an eager run reads them in host memory, a graph in device memory.
        self.rng_state_idx = [i for i, r in enumerate(input_is_rng_state) if r]
        self.instances: list[_Instance] = []
        self.current: _Instance | None = None
        #: Outputs handed out as copies, because the caller was seen to keep them across calls.
        self.copy_output = [False] * len(info.output_names)
        self.disabled_reason: str | None = None
        self.eager_calls: Counter[str] = Counter()
        self.demoted: list[str] = []
        self._calls_per_key: Counter[tuple] = Counter()
        self._missed: Counter[tuple] = Counter()
        self._miss_streaks: dict[int, tuple[int, int]] = {}
        #: Per input signature, the addresses of the caller's tensors at its last warm-up call.
        self._warmup_addresses: dict[tuple, dict[int, int]] = {}
        self._warned_budget = False

    @property
    def name(self) -> str:
        return self.info.name

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        if _backends.step_depth:  # a whole step is warming up or being captured: it holds the graph
            self.eager_calls["inside a whole step"] += 1
            return self._plain(args)
        inst = self.current
        if inst is not None:
            copied = inst.fitting_copied_inputs(args)
            if copied is not None and inst.free():
                return inst.replay(args, copied)
        return self._dispatch(args)

    # -- the slow path ------------------------------------------------------------------------------------------------

    def _dispatch(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.disabled_reason is not None:
            return self._eager(args, "capture failed")
        key = _signature(args)
        candidates = [c for c in self.instances if c.key == key or not PROTECTIONS["signature_guard"]]
        matching = [c for c in candidates if c.statics_match(args)]
        for c in matching:
            if c.free():
                self.current = c
                return c.replay(args, c.pick_copied(args))
        if not candidates:
            self._calls_per_key[key] += 1
            if self._calls_per_key[key] <= self.options.warmup_calls:
                return self._warmup(args, key)
            why = "new input signature" if self.instances else "first capture"
            return self._capture(args, key, private=False, why=why)
        if matching:
            return self._on_held(args, key, matching[-1])
        return self._on_moved(args, key, candidates)

    def _on_held(self, args: Sequence[torch.Tensor], key: tuple, blocked: _Instance) -> list[torch.Tensor]:
        """Every instance for these inputs would overwrite a storage someone still references."""
        long_lived = False
        for owner, g in blocked.held():
            members, region = owner.group_members[g], owner.region
            if not owner.group_returned[g]:
                long_lived = True  # saved for a pending backward, say: it will not be released soon
            elif all(region.copy_output[i] for i in members):
                long_lived = True  # handed out before its outputs became copies, and still kept
            else:
                for i in members:
                    region.copy_output[i] = True
                for inst in region.instances:
                    inst.plan_handout()
                names = ", ".join(region.info.output_names[i] for i in members)
                logger.info(
                    "%s: output %s was still referenced at a later call; it is returned as a copy from now on",
                    region.name,
                    names,
                )
        if long_lived or self.options.strict:
            return self._capture(
                args,
                key,
                private=True,
                why="the shared pool holds tensors still in use",
            )
        return self._eager(args, "outputs still referenced")

    def _on_moved(self, args: Sequence[torch.Tensor], key: tuple, candidates: list[_Instance]) -> list[torch.Tensor]:
        """A static input is no longer at the address any instance was captured with.

        A parameter that moved, or a declared-static input (which the legacy API promised would not move), gets a new
        capture at once. A graph output or written input that moved is usually transient (its producer ran eagerly
        once): the call runs eagerly, the same addresses seen twice get a capture, and an input that misses on three
        calls in a row without a replay in between is demoted to a copied input.
        """
        moved = min((c.moved(args) for c in candidates), key=len)
        progress = sum(inst.replays for inst in self.instances)
        unresolved = []
        for i in moved:
            kind = self.kinds[i]
            if kind is InputKind.PARAMETER and self.graphs.parameters_trusted:
                raise ParameterMovedError(
                    f"cudagraphex: {self.info.input_names[i]} is a parameter or buffer of a function compiled with"
                    " PruneParameterChecks, which promised that parameters are not replaced, but it moved to a new"
                    " address; compile the function again after replacing parameters"
                )
            if kind in (InputKind.DECLARED, InputKind.CALLER):
                self._demote(i)
            elif kind in (InputKind.GRAPH_OUTPUT, InputKind.MUTATED):
                streak, seen_at = self._miss_streaks.get(i, (0, progress))
                streak = streak + 1 if seen_at == progress else 1
                self._miss_streaks[i] = (streak, progress)
                if streak >= 3:
                    self._demote(i)
                else:
                    unresolved.append(i)
        addresses = tuple(args[i].data_ptr() for i in unresolved)
        self._missed[addresses] += 1
        if unresolved and self._missed[addresses] < 2 and not self.options.strict:
            return self._eager(args, "static input moved")
        names = ", ".join(self.info.input_names[i] for i in moved)
        return self._capture(args, key, private=False, why=f"static input(s) moved: {names}")

    def _demote(self, i: int) -> None:
        name = self.info.input_names[i]
        if self.kinds[i] is InputKind.COPIED:
            return
        logger.info(
            "%s: %s (%s) changed address; it is copied into the graph from now on",
            self.name,
            name,
            self.kinds[i].value,
        )
        self.kinds[i] = InputKind.COPIED
        self.demoted.append(name)

    def _capture(self, args: Sequence[torch.Tensor], key: tuple, *, private: bool, why: str) -> list[torch.Tensor]:
        if len(self.instances) >= self.options.max_graphs_per_region:
            message = (
                f"cudagraphex: region {self.name} reached max_graphs_per_region={self.options.max_graphs_per_region};"
                f" calls that would need another graph ({why}) run eagerly"
            )
            if self.options.strict:
                raise StrictModeError(message)
            if not self._warned_budget:
                self._warned_budget = True
                warnings.warn(message, stacklevel=2)
            return self._eager(args, "graph budget exhausted")
        pool = self.graphs.pool(self.device, private=private)
        try:
            inst = _Instance(self, key, args, pool, self._unmoved_caller_tensors(args, key))
        except CaptureFailed as e:
            self.disabled_reason = str(e)
            message = f"cudagraphex: capturing region {self.name} failed ({e}); it runs eagerly from now on"
            if self.options.strict:
                raise StrictModeError(message) from e
            warnings.warn(message, stacklevel=2)
            return self._eager(args, "capture failed")
        pool.register(inst)
        self.instances.append(inst)
        self.current = inst
        logger.info(
            "%s: captured graph %d (%s) in %.1f ms%s",
            self.name,
            len(self.instances),
            why,
            inst.capture_seconds * 1e3,
            "" if pool.shared else ", in a pool of its own",
        )
        return inst.replay(args, inst.pick_copied(args))

    def _unmoved_caller_tensors(self, args: Sequence[torch.Tensor], key: tuple) -> frozenset[int]:
        """The caller's tensors that are where they were at this signature's warm-up: a new graph reads them in place.

        One the region writes is left out, so that a written input keeps the one path it has always had (a buffer
        and a copy-back); reading it in place would be correct too, but no workload measured needs it."""
        seen = self._warmup_addresses.get(key, {})
        return frozenset(
            i
            for i, address in seen.items()
            if self.kinds[i] is InputKind.CALLER and i not in self.mutated_idx and args[i].data_ptr() == address
        )

    def _warmup(self, args: Sequence[torch.Tensor], key: tuple) -> list[torch.Tensor]:
        """The eager warm-up call; also catches in-place writes the trace analysis missed, via version counters."""
        watched = [i for i in range(len(args)) if i not in self.mutated_idx and self.kinds[i].is_copied]
        before = {i: _version(args[i]) for i in watched}
        self._warmup_addresses[key] = {
            i: args[i].data_ptr()
            for i, kind in enumerate(self.kinds)
            if kind is InputKind.CALLER and isinstance(args[i], torch.Tensor)
        }
        out = self._eager(args, "warm-up")
        for i in watched:
            if before[i] is not None and _version(args[i]) != before[i]:
                logger.info(
                    "%s: the warm-up wrote into %s; it is copied back after replays",
                    self.name,
                    self.info.input_names[i],
                )
                self.mutated_idx.add(i)
        return out

    def _eager(self, args: Sequence[torch.Tensor], reason: str) -> list[torch.Tensor]:
        self.eager_calls[reason] += 1
        if reason not in ("warm-up",):
            logger.debug("%s: running eagerly (%s)", self.name, reason)
        if self.rng_state_idx:
            args = list(args)
            for i in self.rng_state_idx:
                if args[i] is not None and args[i].device.type != "cpu":  # a graph's output; waits for it
                    args[i] = args[i].cpu()
        return self._plain(args)

    def _plain(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = self.fn(*args)
        # An op may return its input as itself (contiguous): an anchor passed in must not be passed on to the caller.
        anchors = self.graphs.direct_anchors
        detached: dict[int, torch.Tensor] = {}  # one tensor at several positions stays one tensor
        return [detached.setdefault(id(o), o.detach()) if id(o) in anchors else o for o in out]


def _version(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None
