"""The regions of one compiled function: the callable that runs a region, and what a compiled function owns.

Invariants
==========

Which instance runs a call
    A region keeps its captured instances (``instance``). A call replays the current instance when its guards hold
    and its liveness check passes (the fast path: one C++ guard call, one address compare, one liveness sum, the
    replay). Otherwise the slow path looks for another instance of the call's signature whose static inputs match and
    whose memory is free, reacts to held outputs (``_on_held``) or moved static inputs (``_on_moved``), or captures a
    new instance; past ``max_graphs_per_region`` instances, or after a failed capture, the region runs eagerly.

Capture
    The first call for a given input signature runs eagerly; it is the warm-up (lazy initialisation, compilation of
    inner fusions). A later call captures and then replays, so every call applies its side effects exactly once.
    A capture that fails leaves the process as it was (RNG state restored, current stream unchanged) and the region
    runs eagerly from then on, with one warning. The number of instances per region is bounded; past the bound new
    signatures run eagerly, with one warning. While a whole step (``cudagraphex.step``) warms up or is captured,
    regions run their symbols as plain code: the step's graph holds them.

Eager runs
    A backward region that runs its symbols as plain code frees each input it reads last at its release point where
    nothing but the call references it (``runtime.release``, "Eager runs"), so that its warm-up and a whole step's
    capture peak no higher than a plain backward, which frees saved tensors as it goes.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cudagraphex import capture as _backends
from cudagraphex._protections import PROTECTIONS
from cudagraphex.capture import CaptureFailed, CudaBackend, EmulatedBackend
from cudagraphex.planning.static_inputs import InputKind
from cudagraphex.runtime.instance import Instance
from cudagraphex.runtime.liveness import Pool
from cudagraphex.runtime.options import GraphOptions, ParameterMovedError, RegionInfo, StrictModeError
from cudagraphex.runtime.release import Storage, eager_candidates, give_back_candidates, giving_back
from cudagraphex.runtime.staging import signature, version_of

__all__ = ["FunctionGraphs", "GraphedRegion"]

logger = logging.getLogger("cudagraphex")


class FunctionGraphs:
    """All graphs of one compiled function: its pools and its regions, grouped by the trace they came from."""

    def __init__(self, backend: CudaBackend | EmulatedBackend, options: GraphOptions) -> None:
        self.backend = backend
        self.options = options
        self._shared_pools: dict[torch.device, Pool] = {}
        #: One entry per trace cudagraphex processed: (label, plan breaks, regions).
        self.traces: list[tuple[str, list, list[GraphedRegion]]] = []
        #: Names of tensors that graphs of the last forward trace produced (for a following backward trace).
        self.forward_graph_outputs: frozenset[str] = frozenset()
        #: Names of the last forward trace's outputs that are its caller's tensors or views of them (``Plan``).
        self.forward_caller_outputs: frozenset[str] = frozenset()
        #: Every fusion built for this function, by its unique name (owned by the executor module).
        self.fusions: dict[str, Any] = {}
        #: Set when the function was compiled with PruneParameterChecks: a moved parameter is then an error.
        self.parameters_trusted = False
        #: ``id`` of every anchor handed out as itself: a region running eagerly never passes one on to its caller.
        self.direct_anchors: set[int] = set()

    def next_fusion_id(self) -> int:
        """A number unique within this compiled function, so fusion names never collide across its traces."""
        return len(self.fusions)

    def pool(self, device: torch.device, *, private: bool) -> Pool:
        if private or not self.options.share_pool:
            return Pool(lambda: self.backend.new_pool(device), shared=False)
        pool = self._shared_pools.get(device)
        if pool is None:
            pool = self._shared_pools[device] = Pool(lambda: self.backend.new_pool(device), shared=True)
        return pool

    def regions(self) -> list[GraphedRegion]:
        return [r for _, _, regions in self.traces for r in regions]


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
        input_is_read_last: Sequence[bool] = (),
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
        #: Backward inputs the region reads last, whose memory a capture may give back (``release``).
        self.last_read_idx = [i for i, r in enumerate(input_is_read_last) if r]
        self.instances: list[Instance] = []
        self.current: Instance | None = None
        #: Outputs handed out as copies, because the caller was seen to keep them across calls.
        self.copy_output = [False] * len(info.output_names)
        self.disabled_reason: str | None = None
        self.eager_calls: Counter[str] = Counter()
        #: Bytes of input storages that eager runs freed after their last read (``runtime.release``, "Eager runs").
        self.eager_freed_bytes = 0
        #: Calls that missed the fast path (they replayed another instance, captured one, or ran eagerly).
        self.slow_path_calls = 0
        self.demoted: list[str] = []
        self._calls_per_key: Counter[tuple] = Counter()
        self._missed: Counter[tuple] = Counter()
        self._miss_streaks: dict[int, tuple[int, int]] = {}
        #: The addresses of the moved graph outputs and written inputs at the last call that missed.
        self._last_miss: tuple = ()
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
            if copied is not None and inst.liveness.free() and (inst.given_back is None or inst.given_back.allow(args)):
                return inst.replay(args, copied)
        return self._dispatch(args)

    # -- the slow path ------------------------------------------------------------------------------------------------

    def _dispatch(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.slow_path_calls += 1
        if self.disabled_reason is not None:
            return self._eager(args, "capture failed")
        key = signature(args)
        candidates = [c for c in self.instances if c.key == key or not PROTECTIONS["signature_guard"]]
        matching = [c for c in candidates if c.statics_match(args)]
        given_back_held = False
        for c in matching:
            if c.liveness.free():
                if c.given_back is None or c.given_back.allow(args):
                    self.current = c
                    return c.replay(args, c.pick_copied(args))
                given_back_held = True
        if not candidates:
            warm = self._warmup_key(key)
            twins = [c for c in self.instances if self._warmup_key(c.key) == warm] if self.rng_state_idx else []
            if twins and all(c.moved(args) for c in twins):
                # RNG state in host memory where these graphs took it in device memory: the forward ran eagerly this
                # call, and the tensors it saved moved with it. A transient miss, as a moved graph output is.
                return self._on_moved(args, key, twins)
            self._calls_per_key[warm] += 1
            if self._calls_per_key[warm] <= self.options.warmup_calls:
                return self._warmup(args, warm)
            why = "new input signature" if self.instances else "first capture"
            return self._capture(args, key, private=False, why=why)
        if given_back_held:
            why = "a saved tensor whose memory its graph gives back is referenced beyond the call"
            return self._capture(args, key, private=True, why=why)
        if matching:
            return self._on_held(args, key, matching[-1])
        return self._on_moved(args, key, candidates)

    def _on_held(self, args: Sequence[torch.Tensor], key: tuple, blocked: Instance) -> list[torch.Tensor]:
        """Every instance for these inputs would overwrite a storage someone still references."""
        long_lived = False
        for owner, g in blocked.liveness.held():
            members, region = owner.handout.group_members[g], owner.region
            if not owner.handout.group_returned[g]:
                long_lived = True  # saved for a pending backward, say: it will not be released soon
            elif all(region.copy_output[i] for i in members):
                long_lived = True  # handed out before its outputs became copies, and still kept
            else:
                for i in members:
                    region.copy_output[i] = True
                for inst in region.instances:
                    inst.handout.plan(region.copy_output)
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

    def _on_moved(self, args: Sequence[torch.Tensor], key: tuple, candidates: list[Instance]) -> list[torch.Tensor]:
        """A static input is no longer at the address any instance was captured with.

        A parameter that moved, or a declared-static input (which the legacy API promised would not move), gets a new
        capture at once. A graph output or written input that moved is usually transient (its producer ran eagerly
        once): the call runs eagerly, the same addresses seen twice get a capture, and an input that misses on three
        calls in a row without a replay in between is demoted to a copied input, unless it is where it was at the
        last miss: its producer settled there (a new graph of the forward, say), and a graph reads it in place.
        """
        moved = min((c.moved(args) for c in candidates), key=len)
        progress = sum(inst.replays for inst in self.instances)
        transient = tuple(
            args[i].data_ptr() for i in moved if self.kinds[i] in (InputKind.GRAPH_OUTPUT, InputKind.MUTATED)
        )
        settled, self._last_miss = bool(transient) and transient == self._last_miss, transient
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
                if settled:
                    self._miss_streaks.pop(i, None)
                    continue
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
        if pool.unsafe_for_capture(args):
            pool = self.graphs.pool(self.device, private=True)
        static = [i for i, kind in enumerate(self.kinds) if kind.is_static]
        give_back = give_back_candidates(self, args, pool, static)
        try:
            inst = Instance(self, key, args, pool, self._unmoved_caller_tensors(args, key), give_back)
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
            "%s: captured graph %d (%s) in %.1f ms, %.1f MiB of memory added, peak raised by %.1f MiB%s%s",
            self.name,
            len(self.instances),
            why,
            inst.capture_seconds * 1e3,
            inst.pool_bytes / 2**20,
            inst.peak_added / 2**20,
            f", {inst.given_back.nbytes / 2**20:.1f} MiB of saved tensors given back" if inst.given_back else "",
            "" if pool.shared else ", in a pool of its own",
        )
        return inst.replay(args, inst.pick_copied(args))

    def _unmoved_caller_tensors(self, args: Sequence[torch.Tensor], key: tuple) -> frozenset[int]:
        """The caller's tensors that are where they were at this signature's warm-up: a new graph reads them in place.

        One that moved since is copied from now on, into every later graph too: a tensor that alternates between two
        addresses would otherwise be read in place by a graph captured while it is back where it was, and miss on the
        next call. One the region writes is left out, so that a written input keeps the one path it has always had (a
        buffer and a copy-back); reading it in place would be correct too, but no workload measured needs it."""
        seen = self._warmup_addresses.get(self._warmup_key(key), {})
        unmoved = set()
        for i, address in seen.items():
            if self.kinds[i] is not InputKind.CALLER or i in self.mutated_idx:
                continue
            if args[i].data_ptr() == address:
                unmoved.add(i)
            else:
                self.kinds[i] = InputKind.COPIED
        return frozenset(unmoved)

    def _warmup_key(self, key: tuple) -> tuple:
        """The signature ``key`` as warm-ups count it: without the device of dropout RNG state, which an eager forward
        returns in host memory and a forward graph in device memory, so that the first call after the forward's
        capture captures the backward instead of warming it up again (beside the forward graph's saved tensors)."""
        if not self.rng_state_idx:
            return key
        rng = set(self.rng_state_idx)
        return tuple(k[:3] if i in rng and len(k) == 4 else k for i, k in enumerate(key))

    def _warmup(self, args: Sequence[torch.Tensor], key: tuple) -> list[torch.Tensor]:
        """The eager warm-up call; also catches in-place writes the trace analysis missed, via version counters."""
        watched = [i for i in range(len(args)) if i not in self.mutated_idx and self.kinds[i].is_copied]
        before = {i: version_of(args[i]) for i in watched}
        self._warmup_addresses[key] = {
            i: args[i].data_ptr()
            for i, kind in enumerate(self.kinds)
            if kind is InputKind.CALLER and isinstance(args[i], torch.Tensor)
        }
        out = self._eager(args, "warm-up")
        for i in watched:
            if before[i] is not None and version_of(args[i]) != before[i]:
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
        freed = eager_candidates(self, args)  # before a list of the arguments exists
        if self.rng_state_idx:
            args = list(args)
            for i in self.rng_state_idx:
                if args[i] is not None and args[i].device.type != "cpu":  # a graph's output; waits for it
                    args[i] = args[i].cpu()
        return self._plain(args, freed)

    def _plain(self, args: Sequence[torch.Tensor], freed: dict[int, Storage] | None = None) -> list[torch.Tensor]:
        """Runs the region's symbols, freeing the inputs it reads last where nothing else references them."""
        if freed is None:
            freed = eager_candidates(self, args)
        if freed:
            nbytes = {cdata: args[s.positions[0]].untyped_storage().nbytes() for cdata, s in freed.items()}
            with giving_back(self.backend.free, freed, args) as done:
                out = self.fn(*args)
            self.eager_freed_bytes += sum(nbytes[cdata] for cdata in done)
        else:
            out = self.fn(*args)
        # An op may return its input as itself (contiguous): an anchor passed in must not be passed on to the caller.
        anchors = self.graphs.direct_anchors
        detached: dict[int, torch.Tensor] = {}  # one tensor at several positions stays one tensor
        return [detached.setdefault(id(o), o.detach()) if id(o) in anchors else o for o in out]
