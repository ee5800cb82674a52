"""Giving a saved tensor's memory back to its pool at its last use inside a backward graph's capture.

A forward graph's tensors saved for backward are its anchors: its replays write them, the backward reads them. Inside
the backward's capture, a saved tensor read for the last time is given back to the pool (its block is freed, the
tensor object keeps its address and loses its deleter), so later allocations of the same capture reuse the block, as
a plain backward reuses the memory of the saved tensors it has consumed. Every replay of that backward graph then
overwrites those anchors after reading them; the next forward replay writes them afresh.

Invariants
==========

What may be given back
    Input ``i`` of a backward region, read in place, when all of these hold at the capture:

    * the region reads it last: nothing after the region in the trace reads it, the region neither writes nor
      returns it (``RegionSpec.last_read``), and the caller's code does not load the local that holds it after the
      call (checked on the calling frame's bytecode);
    * it is a forward graph's anchor handed out as itself, captured into the same pool, alone on its storage, and
      not given back before;
    * nothing but the call references it: the backward runs with ``retain_graph=False``, its storage has no user
      beyond the anchor, and its Python reference count is that of our own structures plus the call path's (one
      local, its argument slots; measured once per process and number of arguments on a probe of the same shape,
      :func:`call_path_refs`).

When a graph that gave tensors back may replay
    Only under the same conditions, checked on every call (:class:`GivenBack`): ``retain_graph=False``, the same
    reference counts and storage use counts as at the capture. Otherwise the call takes another instance, or one
    captured in a pool of its own (``GraphedRegion``).

Who else may overwrite a given-back anchor
    Any graph captured later into the pool may take its block. Each such graph's replay therefore waits until the
    given-back anchors are referenced by our structures alone (``Liveness.watch_given_back``), and a graph that reads
    a given-back anchor is captured into a pool of its own, where no allocation can take the block it reads.

On the CPU replay backend nothing is freed; instead each replay of such a graph overwrites the anchors it may
overwrite with garbage (NaN, or an integer's minimum), so that a missed condition shows as a wrong result.
"""

from __future__ import annotations

import contextlib
import dis
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from cudagraphex._protections import PROTECTIONS

if TYPE_CHECKING:
    from cudagraphex.runtime.liveness import Liveness, Pool
    from cudagraphex.runtime.region import GraphedRegion

__all__ = ["GivenBack", "give_back_candidates", "giving_back", "poison", "release_point"]

_use_count = torch._C._storage_Use_Count
_state = threading.local()


def refs(seq: Sequence[object], positions: Sequence[int]) -> list[int]:
    """The reference counts of ``seq[i]`` for ``i`` in ``positions``. Every count this module compares is taken here,
    so that the temporary references of taking it cancel out."""
    return [sys.getrefcount(seq[i]) for i in positions]


def keeps_graph() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True``); True outside a backward."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


# -- the release points in a region's code ---------------------------------------------------------------------------


def release_point(tensor: torch.Tensor) -> None:
    """Called by a region's code right after its last read of an input it reads last; gives the tensor's memory back
    when the running capture was told to (:func:`giving_back`), and does nothing otherwise."""
    wanted = getattr(_state, "wanted", None)
    if wanted is None:
        return
    index, uses = wanted.pop(id(tensor), (None, 0))
    # A view of it still alive (one the trace analysis did not see) holds its storage: it keeps its memory.
    if index is not None and _use_count(tensor.untyped_storage()._cdata) == uses and _state.release(tensor):
        _state.done.append(index)


@contextlib.contextmanager
def giving_back(release, wanted: dict[int, tuple[int, int]]) -> Iterator[list[int]]:
    """While a capture runs: the release points give back the tensors of ``wanted`` (``id`` -> (input index, the use
    count of its storage when nothing but the tensor uses it)) with ``release``; yields the list of input indices
    given back, in order, which stays valid if the capture fails."""
    done: list[int] = []
    _state.wanted, _state.release, _state.done = dict(wanted), release, done
    try:
        yield done
    finally:
        _state.wanted = _state.release = _state.done = None


# -- the call path -------------------------------------------------------------------------------------------------


class _ProbeRegion:
    def __call__(self, *args: object) -> int:
        return refs(args, (0,))[0]


_call_path: dict[int, int] = {}


def call_path_refs(nargs: int) -> int:
    """The references an argument of a region called with ``nargs`` arguments has from the call alone: the caller's
    local that holds it and its argument slots, as Thunder's generated code calls a region (locals passed
    positionally), plus those of taking the count (:func:`refs`). The interpreter's share depends on the number of
    arguments (CPython 3.11 holds one fewer from 31 on), so it is measured once per number, on a probe of that shape."""
    if nargs not in _call_path:
        names = ", ".join(f"t{i}" for i in range(nargs))
        source = (
            f"def probe(saved, region):\n    {names}, = saved\n    saved.clear()\n"
            f"    out = region({names})\n    del {names}\n    return out\n"
        )
        namespace: dict[str, object] = {}
        exec(compile(source, "<cudagraphex call-path probe>", "exec"), namespace)  # noqa: S102 - generated above
        _call_path[nargs] = namespace["probe"]([object() for _ in range(nargs)], _ProbeRegion())
    return _call_path[nargs]


def _own_frames() -> frozenset[types.CodeType]:
    from cudagraphex.runtime.region import GraphedRegion

    return frozenset(
        getattr(GraphedRegion, name).__code__ for name in ("__call__", "_dispatch", "_on_held", "_on_moved", "_capture")
    )


def caller_frame() -> types.FrameType | None:
    """The frame that called the region whose slow path is running."""
    own = _own_frames()
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code in own or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame


def read_after_call(frame: types.FrameType, names: Sequence[str]) -> set[str]:
    """Which of the locals ``names`` the code of ``frame`` may load after the call it is making: all of them where
    that code jumps, or a name is not one of its locals."""
    code = frame.f_code
    local = set(code.co_varnames)
    if any(name not in local for name in names):
        return set(names)
    after = [ins for ins in dis.get_instructions(code) if ins.offset > frame.f_lasti]
    if any(ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs for ins in after):
        return set(names)
    read: set[str] = set()
    for name in names:
        for ins in after:
            values = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            if name not in values:
                continue
            if ins.opname.startswith(("DELETE_FAST", "STORE_FAST")) and len(values) == 1:
                break
            read.add(name)  # a load, or an instruction on several names that may load it
            break
    return read


# -- deciding at capture ---------------------------------------------------------------------------------------------


def give_back_candidates(
    region: GraphedRegion, args: Sequence[object], pool: Pool, static: Sequence[int]
) -> dict[int, tuple[int, int, int]]:
    """The inputs a capture of ``region`` for ``args`` into ``pool`` may give back (module docstring): ``id`` of the
    tensor -> (input index, its reference count now as :func:`refs` takes it, its storage's use count). Call it where
    nothing but the call references the arguments (no list of them)."""
    guarded = PROTECTIONS["given_back_guard"]
    if not region.last_read_idx or not pool.shared or (guarded and keeps_graph()):
        return {}
    frame = caller_frame()
    if frame is None:
        return {}
    positions = [i for i in region.last_read_idx if i in static and isinstance(args[i], torch.Tensor)]
    names = [region.info.input_names[i] for i in positions]
    later = read_after_call(frame, names)
    del frame
    # What a count taken by ``refs`` holds beyond our structures' references and the call's.
    call_only = call_path_refs(len(args)) - _refs_temps()
    found: dict[int, tuple[int, int, int]] = {}
    for i, name in zip(positions, names, strict=True):
        anchor = pool.anchor_of(args[i])
        if name in later or anchor is None or anchor in pool.given_back:
            continue
        liveness, k = anchor
        if sum(a is args[i] for a in args) != 1 or not liveness.alone_on_storage(k):
            continue
        count = refs(args, (i,))[0]
        if count == liveness.direct_refs[k] + call_only or not guarded:
            found[id(args[i])] = (i, count, _use_count(args[i].untyped_storage()._cdata))
    return found


_temps: list[int] = []


def _refs_temps() -> int:
    """What :func:`refs` adds to a count: the count of an object held by one local and one list, less those two."""
    if not _temps:
        held = object()
        _temps.append(refs([held], (0,))[0] - 2)
    return _temps[0]


class GivenBack:
    """The anchors one instance's capture gave back, and the check that its replay may overwrite them again."""

    def __init__(
        self,
        args: Sequence[torch.Tensor],
        candidates: dict[int, tuple[int, int, int]],
        done: Sequence[int],
        pool: Pool,
    ) -> None:
        counts = {i: count for i, count, _ in candidates.values()}
        self.indices = list(done)
        self.anchors = [pool.anchor_of(args[i]) for i in self.indices]
        self.counts = [counts[i] for i in self.indices]
        self.cdata = [args[i].untyped_storage()._cdata for i in self.indices]
        self.uses = [_use_count(cd) for cd in self.cdata]
        self.nbytes = sum(args[i].untyped_storage().nbytes() for i in self.indices)

    def allow(self, args: Sequence[torch.Tensor]) -> bool:
        """Whether this call may replay the graph: its given-back inputs are referenced by the call alone."""
        if not PROTECTIONS["given_back_guard"]:
            return True
        return (
            not keeps_graph()
            and refs(args, self.indices) == self.counts
            and [_use_count(cd) for cd in self.cdata] == self.uses
        )


def poison(anchors: Sequence[tuple[Liveness, int]]) -> None:
    """Overwrites ``anchors`` with garbage, as a replay that reuses their memory does (CPU replay backend)."""
    with torch.no_grad():
        for liveness, k in anchors:
            tensor = liveness.direct[k]
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.data.fill_(float("nan"))
            elif tensor.dtype != torch.bool:
                tensor.data.fill_(torch.iinfo(tensor.dtype).min)
