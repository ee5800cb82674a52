"""When a graph may be replayed without overwriting memory someone still uses.

Invariants
==========

Pools
    Graph memory (intermediates and outputs) lives in a pool. The graphs of one compiled function on one device share
    a pool and are captured on one stream in call order, so a later graph reuses the memory of an earlier graph's
    intermediates. Instances captured because the shared pool was busy get a pool of their own. Input buffers are
    ordinary allocations owned by the graph. Everything is owned by the compiled function, through its compile data,
    and is freed with it.

When a graph may be replayed
    A replay writes every storage the graph allocated during capture, and may write storages that graphs captured
    later in the same pool took from its freed intermediates. It may run only when each of those storages is
    referenced by anchors alone: no output the caller holds, no tensor saved for a pending backward, no gradient kept
    in ``.grad``. The check is one sum of storage use counts against a precomputed baseline, and, for anchors handed
    out as themselves (a holder of one does not raise its storage's use count), one sum of their Python reference
    counts, which holders in C++ raise too. When it fails, nothing is overwritten: held outputs that the caller
    receives switch to copy-on-return, and the call replays another instance whose storages are free, captures one in
    a pool of its own, or runs eagerly (``GraphedRegion._on_held``).

Given-back anchors
    A backward graph may give the memory of saved anchors back to the pool during its capture (``release``). Every
    graph captured into the pool after that may write those blocks, so its replay also waits until each given-back
    anchor is referenced by our structures alone (its count at the owner's baseline).

Baselines
    Both baselines are taken once, when nothing but the instance's own structures references its outputs, and those
    structures never change afterwards: a new reference to an anchor from cudagraphex itself would read as a holder.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from cudagraphex._protections import PROTECTIONS
from cudagraphex.runtime.release import refs

if TYPE_CHECKING:
    from cudagraphex.runtime.handout import Handout
    from cudagraphex.runtime.instance import Instance

__all__ = ["Liveness", "Pool"]

_use_count = torch._C._storage_Use_Count


class Pool:
    """A memory pool and the instances captured into it, in capture order."""

    def __init__(self, handle: Any, shared: bool) -> None:
        self.handle = handle
        self.shared = shared
        self.instances: list[Instance] = []
        #: Anchors handed out as themselves, by ``id``: (their instance's liveness, position among its direct anchors).
        self._anchors: dict[int, tuple[Liveness, int]] = {}
        #: Anchors whose memory a capture gave back to this pool, in the order they were given back (an ordered set).
        self.given_back: dict[tuple[Liveness, int], None] = {}

    def register(self, instance: Instance) -> None:
        # A replay of an earlier instance may write memory this one took from the earlier one's intermediates.
        for earlier in self.instances:
            earlier.liveness.watch(instance.liveness)
        instance.liveness.watch(instance.liveness)
        # ... and this one may write the memory of every anchor given back before it.
        own = instance.given_back.anchors if instance.given_back else []
        instance.liveness.watch_given_back([a for a in self.given_back if a not in own])
        self.note_given_back(own)
        if instance.emulated:  # the CPU replay backend overwrites what a real replay may overwrite
            instance.graph.overwrites = [*own, *instance.liveness.watch_back]
        self.instances.append(instance)
        for k, anchor in enumerate(instance.liveness.direct):
            self._anchors[id(anchor)] = (instance.liveness, k)

    def note_given_back(self, anchors: list[tuple[Liveness, int] | None]) -> None:
        self.given_back.update((a, None) for a in anchors if a is not None)

    def unsafe_for_capture(self, args: Sequence[object]) -> bool:
        """Whether a capture for ``args`` may take memory that is still in use: memory given back to this pool whose
        anchor ``args`` hold, or that something still references (a backward still to run, say). A capture allocates
        from the pool's free blocks, and its first replay follows at once."""
        if not self.given_back:
            return False
        return any(self.anchor_of(a) in self.given_back for a in args) or any(
            refs(owner.direct, (k,))[0] != owner.direct_refs[k] for owner, k in self.given_back
        )

    def anchor_of(self, tensor: object) -> tuple[Liveness, int] | None:
        """The (liveness, position) of ``tensor`` if it is an anchor handed out as itself by a graph of this pool."""
        found = self._anchors.get(id(tensor))
        return found if found is not None and found[0].direct[found[1]] is tensor else None


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
        self._group_size = [len(members) for members in handout.group_members]
        # Storages whose liveness gates this instance's replays: (cdata, baseline, owner instance, group).
        self.watched: list[tuple[int, int, Instance, int]] = []
        self.watch_cdata: list[int] = []
        self.watch_baseline = 0
        #: Instances (this one among them) whose anchors handed out as themselves gate this instance's replays.
        self.watch_direct: list[Liveness] = []
        #: Given-back anchors this instance's replay may overwrite, and the sum of their baseline counts.
        self.watch_back: list[tuple[Liveness, int]] = []
        self.watch_back_baseline = 0

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

    def watch_given_back(self, anchors: list[tuple[Liveness, int]]) -> None:
        """Makes the given-back ``anchors`` gate this instance's replays."""
        self.watch_back += anchors
        self.watch_back_baseline += sum(owner.direct_refs[k] for owner, k in anchors)

    def alone_on_storage(self, k: int) -> bool:
        """Whether direct anchor ``k`` is the only tensor on its storage (no other output, no alias anyone holds)."""
        g = self.direct_group[k]
        return self._group_size[g] == 1 and _use_count(self.group_cdata[g]) == self.group_baseline[g]

    def _given_back_unreferenced(self) -> bool:
        return sum(refs(owner.direct, (k,))[0] for owner, k in self.watch_back) == self.watch_back_baseline

    def free(self) -> bool:
        """Whether no storage this instance's replay writes is referenced by anything but anchors."""
        if (
            sum(map(_use_count, self.watch_cdata)) == self.watch_baseline
            and (not self.watch_direct or all(other.direct_unreferenced() for other in self.watch_direct))
            and (not self.watch_back or self._given_back_unreferenced())
        ):
            return True
        return not PROTECTIONS["output_liveness"]

    def held(self) -> list[tuple[Instance, int]]:
        """The (instance, output group) pairs whose storage someone still references."""
        pairs = [(owner, g) for cd, base, owner, g in self.watched if _use_count(cd) > base]
        for other in self.watch_direct:
            if not other.direct_unreferenced():
                pairs += [(other.owner, g) for g in sorted(set(other.direct_group))]
        for owner, k in self.watch_back:
            if refs(owner.direct, (k,))[0] != owner.direct_refs[k]:
                pairs.append((owner.owner, owner.direct_group[k]))
        return pairs
