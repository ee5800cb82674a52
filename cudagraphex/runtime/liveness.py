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

Baselines
    Both baselines are taken once, when nothing but the instance's own structures references its outputs, and those
    structures never change afterwards: a new reference to an anchor from cudagraphex itself would read as a holder.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch

from cudagraphex._protections import PROTECTIONS

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

    def register(self, instance: Instance) -> None:
        # A replay of an earlier instance may write memory this one took from the earlier one's intermediates.
        for earlier in self.instances:
            earlier.liveness.watch(instance.liveness)
        instance.liveness.watch(instance.liveness)
        self.instances.append(instance)


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
        # Storages whose liveness gates this instance's replays: (cdata, baseline, owner instance, group).
        self.watched: list[tuple[int, int, Instance, int]] = []
        self.watch_cdata: list[int] = []
        self.watch_baseline = 0
        #: Instances (this one among them) whose anchors handed out as themselves gate this instance's replays.
        self.watch_direct: list[Liveness] = []

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

    def free(self) -> bool:
        """Whether no storage this instance's replay writes is referenced by anything but anchors."""
        if sum(map(_use_count, self.watch_cdata)) == self.watch_baseline and (
            not self.watch_direct or all(other.direct_unreferenced() for other in self.watch_direct)
        ):
            return True
        return not PROTECTIONS["output_liveness"]

    def held(self) -> list[tuple[Instance, int]]:
        """The (instance, output group) pairs whose storage someone still references."""
        pairs = [(owner, g) for cd, base, owner, g in self.watched if _use_count(cd) > base]
        for other in self.watch_direct:
            if not other.direct_unreferenced():
                pairs += [(other.owner, g) for g in sorted(set(other.direct_group))]
        return pairs
