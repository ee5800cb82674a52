"""Giving saved tensors' memory back to the pool at their last read inside a backward graph's capture.

A forward graph's tensors saved for backward are its anchors: its replays write them, the backward reads them. Inside
the backward's capture, once the tensors on an anchors' storage have been read for the last time, the storage is given
back to the pool (its block is freed, the tensors keep their address and the storage loses its deleter), so later
allocations of the same capture reuse the block, as a plain backward reuses the memory of the saved tensors it has
consumed. Every replay of that backward graph then overwrites the storage after reading it; the next forward replay
writes it afresh.

Invariants
==========

What may be given back
    The storage of one output group of a forward graph (``Storage``), when all of these hold at the capture:

    * every input of the region on it is read last by the region: nothing after the region in the trace reads it,
      the region neither writes nor returns it (``RegionSpec.last_read``), and the caller's code does not load the
      local that holds it after the call (checked on the calling frame's bytecode); each is read in place. A tensor
      passed under several names has a release point for each, and the storage goes back at the last of them;
    * the group's anchors were handed out as themselves by a graph of the same pool, and the storage was not given
      back before;
    * nothing but the call references it: the backward runs with ``retain_graph=False``; each anchor's reference count
      is our structures' plus, if the call passes it, the call path's; each alias passed (Thunder saves a detached
      alias of an anchor that is a view) has the call path's alone; the storage's use count is the anchors' and the
      aliases'; nothing holds the storage's Python object. The call path's share (the caller's local, its argument
      slots) is measured once per process and number of arguments on a probe of the same shape
      (:func:`call_path_refs`).

When a graph that gave memory back may replay
    Only under the same conditions, checked on every call (:class:`GivenBack`): ``retain_graph=False``, the same
    reference counts and use counts as at the capture, and as many holders of each storage's Python object.
    Otherwise the call takes another instance, or one captured in a pool of its own (``GraphedRegion``).

Who else may overwrite a given-back storage
    Any graph captured later into the pool may take its block. Each such graph's replay therefore waits until the
    storage is used by its anchors alone, at their baseline counts (``Liveness.watch_given_back``); a capture that
    reads a given-back storage, or happens while one is in use, goes to a pool of its own, where no allocation can
    take it.

On the CPU replay backend nothing is freed. Instead the capture places outputs it allocated in given-back memory, as
the caching allocator may, and each replay of such a graph overwrites the rest of the storages it may overwrite with
bytes 0xFF (NaN in every floating dtype), so that a missed condition shows as a wrong result.

Eager runs
    A backward region that runs its symbols as plain code (its warm-up, a call inside a whole step, a call that may not
    replay) frees the storage of an input at the same release points, as a plain backward ``del``s a saved tensor
    after its last use, when the conditions above hold for tensors of no graph: every tensor on the storage is one the
    region reads last and the caller does not load again, each has the call path's references alone, the storage's use
    count is theirs, and the backward does not retain its graph (:func:`eager_candidates`). On CUDA the storage is
    resized to 0 bytes, so that a read of it fails instead of reading reused memory; the CPU replay backend fills it
    with bytes 0xFF instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import sys
import threading
import types
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from cudagraphex._protections import PROTECTIONS
from cudagraphex.capture import overwrite_given_back

if TYPE_CHECKING:
    from cudagraphex.runtime.liveness import Liveness, Pool
    from cudagraphex.runtime.region import GraphedRegion

__all__ = [
    "GivenBack",
    "Storage",
    "eager_candidates",
    "give_back_candidates",
    "giving_back",
    "poison",
    "release_point",
]

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
    """Called by a region's code right after its last read of an input it reads last; gives the memory of the
    tensor's storage back once the running capture has passed the release points of every input on that storage, if
    it was told to (:func:`giving_back`). Does nothing otherwise."""
    wanted = getattr(_state, "wanted", None)
    if wanted is None:
        return
    cdata = wanted.get(id(tensor))
    if cdata is None:
        return
    storage = _state.storages[cdata]
    storage.pending -= 1
    # A view made inside the region and still alive (one the trace analysis did not see) uses the storage: it stays.
    if storage.pending == 0 and _use_count(cdata) == storage.uses and _state.release(tensor):
        _state.done.append(cdata)


@contextlib.contextmanager
def giving_back(release, storages: dict[int, Storage], args: Sequence[object]) -> Iterator[list[int]]:
    """While a capture runs: the release points give back the ``storages`` (by ``_cdata``, from
    :func:`give_back_candidates`) with ``release``; yields the list of the storages given back, in order, which
    stays valid if the capture fails."""
    done: list[int] = []
    for storage in storages.values():
        storage.pending = len(storage.positions)
    _state.wanted = {id(args[i]): cdata for cdata, storage in storages.items() for i in storage.positions}
    _state.storages, _state.release, _state.done = storages, release, done
    try:
        yield done
    finally:
        _state.wanted = _state.storages = _state.release = _state.done = None


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
        getattr(GraphedRegion, name).__code__
        for name in ("__call__", "_dispatch", "_on_held", "_on_moved", "_capture", "_warmup", "_eager", "_plain")
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
    return set(_loaded_after(frame.f_code, frame.f_lasti, tuple(names)))


@functools.lru_cache(maxsize=256)
def _loaded_after(code: types.CodeType, lasti: int, names: tuple[str, ...]) -> frozenset[str]:
    """:func:`read_after_call` for the call at ``lasti`` in ``code``; the first instruction after it that names a
    local decides: a store or delete of it alone means not read, anything else (a load, an instruction on several
    names) read. Cached: a backward calls each region from one place, once per step."""
    if any(name not in code.co_varnames for name in names):
        return frozenset(names)
    after = [ins for ins in dis.get_instructions(code) if ins.offset > lasti]
    if any(ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs for ins in after):
        return frozenset(names)
    pending, read = set(names), set()
    for ins in after:
        values = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
        hit = {v for v in values if isinstance(v, str) and v in pending}
        if not hit:
            continue
        pending -= hit
        if not (ins.opname.startswith(("DELETE_FAST", "STORE_FAST")) and len(values) == 1):
            read |= hit
        if not pending:
            break
    return frozenset(read)


# -- deciding at capture ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Storage:
    """A storage that a capture may give back (a forward graph's anchors: one output group), or that an eager run may
    free (no graph's: ``owner`` and ``group`` are None)."""

    owner: Liveness | None
    group: int | None
    #: The positions of the call's arguments on it (anchors, or Thunder's detached aliases of anchors that are views).
    positions: list[int]
    #: Their reference counts at the capture, as :func:`refs` takes them.
    counts: list[int]
    #: Its use count at the capture: the anchors' and the aliases' tensors.
    uses: int
    pending: int = 0


def _loaded_by_caller(region: GraphedRegion, groups: Iterable[list[int]]) -> set[str] | None:
    """The names of the inputs at the positions of ``groups`` that the region's caller may load after the call
    (:func:`read_after_call`); None where the calling frame is not found."""
    frame = caller_frame()
    if frame is None:
        return None
    names = region.info.input_names
    try:
        return read_after_call(frame, [names[i] for positions in groups for i in positions])
    finally:
        del frame


def _held_by_call(args: Sequence[object]) -> Callable[[int], int]:
    """The count :func:`refs` takes of ``args[i]`` while only the call references it: the call path's share once per
    position the tensor is passed at, the temporaries of taking the count once."""
    call, temps = call_path_refs(len(args)), _refs_temps()
    times = Counter(id(a) for a in args)
    return lambda i: (call - temps) * times[id(args[i])] + temps


def give_back_candidates(
    region: GraphedRegion, args: Sequence[object], pool: Pool, static: Sequence[int]
) -> dict[int, Storage]:
    """The storages a capture of ``region`` for ``args`` into ``pool`` may give back (module docstring), by their
    ``_cdata``. Call it where nothing but the call references the arguments (no list of them)."""
    guarded = PROTECTIONS["given_back_guard"]
    if not region.last_read_idx or not pool.shared or (guarded and keeps_graph()):
        return {}
    on: dict[tuple[Liveness, int], list[int]] = {}
    for i in range(len(args)):
        group = pool.group_of(args[i])
        if group is not None and group not in pool.given_back:
            on.setdefault(group, []).append(i)
    if not on:
        return {}
    later = _loaded_by_caller(region, on.values())
    if later is None:
        return {}
    names = region.info.input_names
    last = set(region.last_read_idx) & set(static)
    # A count taken by ``refs``: an alias's is the call path's; an anchor's adds our structures' (its baseline, which
    # holds the temporaries of taking a count once more).
    held = _held_by_call(args)
    found: dict[int, Storage] = {}
    for (owner, g), positions in on.items():
        if any(i not in last or names[i] in later for i in positions):
            continue
        counts = refs(args, positions)
        expected = []
        passed: dict[int, bool] = {}
        for i in positions:
            anchor = pool.anchor_of(args[i])
            passed[id(args[i])] = anchor is None
            expected.append(held(i) if anchor is None else held(i) + anchor[0].direct_refs[anchor[1]] - _refs_temps())
        aliases = sum(passed.values())
        others_free = all(
            refs(owner.direct, (k,))[0] == owner.direct_refs[k]
            for k in owner.members(g)
            if id(owner.direct[k]) not in passed
        )
        uses = _use_count(owner.group_cdata[g])
        unheld = storage_unheld(args[positions[0]])
        if not guarded or (counts == expected and others_free and uses == owner.group_baseline[g] + aliases and unheld):
            found[owner.group_cdata[g]] = Storage(owner, g, positions, counts, uses)
    return found


def eager_candidates(region: GraphedRegion, args: Sequence[object]) -> dict[int, Storage]:
    """The storages an eager run of ``region`` on ``args`` may free at their release points ("Eager runs" in the module
    docstring), by their ``_cdata``. Call it where nothing but the call references the arguments (no list of them)."""
    guarded = PROTECTIONS["given_back_guard"]
    if not region.last_read_idx or (guarded and keeps_graph()):
        return {}
    on: dict[int, list[int]] = {}
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            on.setdefault(arg.untyped_storage()._cdata, []).append(i)
    last = set(region.last_read_idx)
    on = {cdata: positions for cdata, positions in on.items() if last.issuperset(positions)}
    if not on:
        return {}
    later = _loaded_by_caller(region, on.values())
    if later is None:
        return {}
    names = region.info.input_names
    held = _held_by_call(args)
    found: dict[int, Storage] = {}
    for cdata, positions in on.items():
        if any(names[i] in later for i in positions):
            continue
        counts = refs(args, positions)
        expected = [held(i) for i in positions]
        # The tensors passed, and the storage's Python object (made above), which nothing else may hold either.
        uses = len({id(args[i]) for i in positions}) + _storage_object()[0]
        if not guarded or (counts == expected and _use_count(cdata) == uses and storage_unheld(args[positions[0]])):
            found[cdata] = Storage(None, None, positions, counts, uses)
    return found


def storage_unheld(tensor: torch.Tensor) -> bool:
    """Whether nothing holds the Python object of ``tensor``'s storage (a saved-tensor hook may keep the storage alone,
    which neither the tensor's reference count nor the storage's use count shows)."""
    return sys.getrefcount(tensor.untyped_storage()) == _storage_object()[1]


_storage_probe: list[tuple[int, int]] = []


def _storage_object() -> tuple[int, int]:
    """What a storage's Python object adds to its use count once made (it lives on with the storage), and its
    reference count, as ``sys.getrefcount(t.untyped_storage())`` takes it, while nothing holds it."""
    if not _storage_probe:
        t = torch.empty(1)
        count = sys.getrefcount(t.untyped_storage())
        _storage_probe.append((_use_count(t.untyped_storage()._cdata) - 1, count))
    return _storage_probe[0]


_temps: list[int] = []


def _refs_temps() -> int:
    """What :func:`refs` adds to a count: the count of an object held by one local and one list, less those two."""
    if not _temps:
        held = object()
        _temps.append(refs([held], (0,))[0] - 2)
    return _temps[0]


class GivenBack:
    """The storages one instance's capture gave back, and the check that its replay may overwrite them again."""

    def __init__(
        self,
        storages: dict[int, Storage],
        done: Sequence[int],
        args: Sequence[torch.Tensor],
        own_refs: Callable[[torch.UntypedStorage], int],
    ) -> None:
        given = [storages[cdata] for cdata in done]
        self._storages = {cdata: storages[cdata] for cdata in done}
        #: (owner's liveness, output group) of each storage given back.
        self.groups = [(s.owner, s.group) for s in given]
        self.positions = [i for s in given for i in s.positions]
        self.counts = [c for s in given for c in s.counts]
        self.cdata = list(done)
        self.uses = [s.uses for s in given]
        #: The owners' anchors on them that this call does not pass: nothing may hold them either.
        passed = {id(args[i]) for i in self.positions}
        self.others = [
            (s.owner, k) for s in given for k in s.owner.members(s.group) if id(s.owner.direct[k]) not in passed
        ]
        self.nbytes = sum(args[s.positions[0]].untyped_storage().nbytes() for s in given)
        #: The storages' Python objects, and their reference counts less the capture machinery's (``own_refs``) as
        #: :meth:`_storage_refs` takes them: a holder of the storage alone shows in no tensor count or use count.
        self._storage_objects = [args[s.positions[0]].untyped_storage() for s in given]
        self._own_refs = own_refs
        self.storage_refs = self._storage_refs()

    def _storage_refs(self) -> list[int]:
        return [sys.getrefcount(o) - self._own_refs(o) for o in self._storage_objects]

    def allow(self, args: Sequence[torch.Tensor]) -> bool:
        """Whether this call may replay the graph: the memory it gave back is referenced by the call alone."""
        if not PROTECTIONS["given_back_guard"]:
            return True
        return (
            not keeps_graph()
            and refs(args, self.positions) == self.counts
            and [_use_count(cd) for cd in self.cdata] == self.uses
            and all(refs(owner.direct, (k,))[0] == owner.direct_refs[k] for owner, k in self.others)
            and self._storage_refs() == self.storage_refs
        )

    def overwritten_at_release(self, args: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager:
        """While an emulated replay runs: each storage given back is overwritten at its release point, as the
        allocations after it in a real replay may overwrite it."""
        return giving_back(_overwrite, self._storages, args)


def _overwrite(tensor: torch.Tensor) -> bool:
    overwrite_given_back(tensor.untyped_storage())
    return True


def poison(groups: Sequence[tuple[Liveness, int]]) -> None:
    """Overwrites the storages of ``groups`` as a replay that reuses their memory does (CPU replay backend)."""
    for owner, g in groups:
        overwrite_given_back(owner.direct[owner.members(g)[0]].untyped_storage())
