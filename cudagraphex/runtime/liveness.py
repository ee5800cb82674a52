"""When a graph may be replayed without overwriting memory someone still uses.

Invariants
==========

Pools
    Graph memory (intermediates and outputs) lives in a pool. The graphs of one compiled function on one device share
    a pool and are captured on one stream in call order, so a later graph reuses the memory of an earlier graph's
    intermediates. Instances captured because the shared pool was busy get a pool of their own. A pool whose captures
    all failed takes a new id (``SharedPool``). Input buffers are ordinary allocations owned by the graph. Everything
    is owned by the compiled function, through its compile data, and is freed with it.

When a graph may be replayed
    A replay writes every storage the graph allocated during capture, and may write storages that graphs captured
    later in the same pool took from its freed intermediates. It may run only when each of those storages is
    referenced by anchors alone: no output the caller holds, no tensor saved for a pending backward, no gradient kept
    in ``.grad``. The check is one sum of storage use counts against a precomputed baseline, and, for anchors handed
    out as themselves (a holder of one does not raise its storage's use count), one sum of their Python reference
    counts, which holders in C++ raise too. When it fails, nothing is overwritten: held outputs that the caller
    receives switch to copy-on-return, and the call replays another instance whose storages are free, captures one in
    a pool of its own, or runs eagerly (``GraphedRegion._on_held``).

Given-back storages
    A backward graph may give the memory of saved anchors back to the pool during its capture (``release``). Every
    graph captured into the pool after that may write those blocks, so its replay also waits until each given-back
    storage is used by our anchors alone (its use count and its anchors' reference counts at their baselines).

Baselines
    Both baselines are taken once, when nothing but the instance's own structures references its outputs, and those
    structures never change afterwards: a new reference to an anchor from cudagraphex itself would read as a holder.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from cudagraphex._protections import PROTECTIONS
from cudagraphex.capture import SharedPool
from cudagraphex.runtime.release import refs

if TYPE_CHECKING:
    from cudagraphex.runtime.handout import Handout
    from cudagraphex.runtime.instance import Instance

__all__ = ["Liveness", "Pool"]

_use_count = torch._C._storage_Use_Count


class Pool:
    """A memory pool and the instances captured into it, in capture order."""

    def __init__(self, new_id: Callable[[], Any], shared: bool) -> None:
        self.ids = SharedPool(new_id)
        self.shared = shared
        self.instances: list[Instance] = []
        #: Anchors handed out as themselves, by ``id``: (their instance's liveness, position among its direct anchors).
        self._anchors: dict[int, tuple[Liveness, int]] = {}
        #: The storages of those anchors, by ``_cdata``: (their instance's liveness, output group).
        self._groups: dict[int, tuple[Liveness, int]] = {}
        #: Output groups whose memory a capture gave back to this pool, in order (an ordered set).
        self.given_back: dict[tuple[Liveness, int], None] = {}

    def register(self, instance: Instance) -> None:
        # A replay of an earlier instance may write memory this one took from the earlier one's intermediates.
        for earlier in self.instances:
            earlier.liveness.watch(instance.liveness)
        instance.liveness.watch(instance.liveness)
        # ... and this one may write the memory given back before it.
        own = instance.given_back.groups if instance.given_back else []
        instance.liveness.watch_given_back([group for group in self.given_back if group not in own])
        self.note_given_back(own)
        if instance.emulated:  # the CPU replay backend overwrites what a real replay may overwrite
            instance.graph.overwrites = [*own, *instance.liveness.watch_back]
        self.instances.append(instance)
        liveness = instance.liveness
        for k, anchor in enumerate(liveness.direct):
            self._anchors[id(anchor)] = (liveness, k)
            self._groups[liveness.group_cdata[liveness.direct_group[k]]] = (liveness, liveness.direct_group[k])

    def note_given_back(self, groups: Sequence[tuple[Liveness, int]]) -> None:
        self.given_back.update((group, None) for group in groups)

    def unsafe_for_capture(self, args: Sequence[object]) -> bool:
        """Whether a capture for ``args`` may take memory that is still in use: memory given back to this pool that
        ``args`` hold, or that something still references (a backward still to run, say). A capture allocates from
        the pool's free blocks, and its first replay follows at once."""
        if not self.given_back:
            return False
        return any(self.group_of(a) in self.given_back for a in args) or not all(
            owner.group_unreferenced(g) for owner, g in self.given_back
        )

    def anchor_of(self, tensor: object) -> tuple[Liveness, int] | None:
        """The (liveness, position) of ``tensor`` if it is an anchor handed out as itself by a graph of this pool."""
        found = self._anchors.get(id(tensor))
        return found if found is not None and found[0].direct[found[1]] is tensor else None

    def group_of(self, tensor: object) -> tuple[Liveness, int] | None:
        """The (liveness, output group) whose storage ``tensor`` uses, if that is a storage of anchors handed out as
        themselves by a graph of this pool (``tensor`` may be one, or an alias of one)."""
        if not isinstance(tensor, torch.Tensor) or not self._groups:
            return None
        return self._groups.get(tensor.untyped_storage()._cdata)


class Liveness:
    """Whether the storages one instance's replay writes are referenced by anything but anchors."""

    def __init__(self, owner: Instance, handout: Handout) -> None:
        self.owner = owner
        self.group_cdata = handout.group_cdata
        self.group_baseline = [_use_count(cd) for cd in handout.group_cdata]
        #: The anchors handed out as themselves, and their output groups.
        self.direct = handout.direct
        self.direct_group = handout.direct_group
        self.direct_baseline = self._direct_references()
        #: Per direct anchor, its reference count (as ``release.refs`` takes it) when only our structures hold it.
        self.direct_refs = refs(self.direct, range(len(self.direct)))
        self._members: dict[int, list[int]] = {}
        for k, g in enumerate(self.direct_group):
            self._members.setdefault(g, []).append(k)
        # Storages whose liveness gates this instance's replays: (cdata, baseline, owner instance, group).
        self.watched: list[tuple[int, int, Instance, int]] = []
        self.watch_cdata: list[int] = []
        self.watch_baseline = 0
        #: Instances (this one among them) whose anchors handed out as themselves gate this instance's replays.
        self.watch_direct: list[Liveness] = []
        #: Given-back storages this instance's replay may overwrite: (owner's liveness, output group).
        self.watch_back: list[tuple[Liveness, int]] = []

    def _direct_references(self) -> int:
        # A holder in C++ (an autograd node, ctx.save_for_backward) counts too: while C++ shares a tensor, torch keeps
        # a reference to its Python object (PyObject preservation).
        return sum(map(sys.getrefcount, self.direct))

    def direct_unreferenced(self) -> bool:
        """Whether nothing but the instance references the anchors it hands out as themselves."""
        return self._direct_references() == self.direct_baseline

    def watch(self, other: Liveness) -> None:
        """Makes ``other``'s output storages gate this instance's replays."""
        for g, cd in enumerate(other.group_cdata):
            self.watched.append((cd, other.group_baseline[g], other.owner, g))
            self.watch_cdata.append(cd)
            self.watch_baseline += other.group_baseline[g]
        if other.direct:
            self.watch_direct.append(other)

    def watch_given_back(self, groups: list[tuple[Liveness, int]]) -> None:
        """Makes the given-back storages of ``groups`` gate this instance's replays."""
        self.watch_back += groups

    def members(self, g: int) -> list[int]:
        """The positions among the direct anchors of those in output group ``g``."""
        return self._members.get(g, [])

    def group_unreferenced(self, g: int) -> bool:
        """Whether only our structures reference the storage of direct group ``g``: no alias of it, no holder of its
        anchors."""
        return _use_count(self.group_cdata[g]) == self.group_baseline[g] and all(
            refs(self.direct, (k,))[0] == self.direct_refs[k] for k in self.members(g)
        )

    def free(self) -> bool:
        """Whether no storage this instance's replay writes is referenced by anything but anchors."""
        if (
            sum(map(_use_count, self.watch_cdata)) == self.watch_baseline
            and (not self.watch_direct or all(other.direct_unreferenced() for other in self.watch_direct))
            and (not self.watch_back or all(owner.group_unreferenced(g) for owner, g in self.watch_back))
        ):
            return True
        return not PROTECTIONS["output_liveness"]

    def held(self) -> list[tuple[Instance, int]]:
        """The (instance, output group) pairs whose storage someone still references."""
        pairs = [(owner, g) for cd, base, owner, g in self.watched if _use_count(cd) > base]
        for other in self.watch_direct:
            if not other.direct_unreferenced():
                pairs += [(other.owner, g) for g in sorted(set(other.direct_group))]
        pairs += [(owner.owner, g) for owner, g in self.watch_back if not owner.group_unreferenced(g)]
        return pairs
