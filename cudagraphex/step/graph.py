"""Whole-step graphs: a training step (forward, backward, gradient accumulation, optimizer step) in one graph.

Invariants
==========

What a replay reads and writes
    A step graph reads and writes tensors at the addresses they had when it was captured. Those tensors are the
    step's *arguments*, copied into buffers the graph owns (one batched copy per call), and its *state*: the
    parameters and buffers of the ``modules`` it was given, the parameters of its ``optimizers``, their gradients and
    the optimizer state. Nothing of the step's Python runs at a replay.

What is guarded
    Before every replay, the state slots hold the same tensors as after the capture (identity), at the same
    addresses, with the same dtype, shape, strides and ``requires_grad`` (one C++ check each); gradients that were
    None are None. The arguments have the layout they were captured with; Python arguments are equal. Grad mode,
    autocast, the ``training`` flag of every module, each optimizer's ``param_groups`` (hyperparameters compared by
    value, tensors by identity) and its state entries are as at the capture; no parameter, buffer or submodule was
    registered since. The step keeps one graph per input signature, modes and set of slots that hold a tensor; a miss
    runs the slow path, which replays the graph of the call's signature where its guards hold, captures again (after
    warm-up calls where the signature is new; at most ``max_graphs`` captures in all), or runs ``fn`` as is with one
    logged reason. A stale graph is never replayed. Graphs share one memory pool: they run one at a time, and the
    outputs of each are copied out right after its replay.

Arguments
    Tensor arguments are copied into the graph's buffers before a replay; buffers the step writes in place are copied
    back into the caller's arguments after it. An argument that shares memory with another or with the state would
    lose that sharing in the buffers: such a call runs ``fn`` as is.

Slots keep their tensors
    A step that replaces the tensor in a slot (``zero_grad(set_to_none=True)`` before ``backward`` gives every
    parameter a new gradient; a module that rebinds a buffer) has the new value copied, inside the graph, into the
    tensor the slot held before, and the slot is given that tensor back. So a replay leaves every slot as it found
    it, and the graph stays valid for the next call. The only difference a caller can see: a gradient tensor kept
    from an earlier step is updated by the next one, where eager would leave it behind.

What is not captured
    A step that runs an op on a CPU tensor (a non-capturable optimizer, a CPU scalar tensor, Thunder's host-side RNG
    state) or reads a device value on the host (``.item()``) is not captured: the last warm-up call runs under a
    dispatch mode that finds such ops. Such a step, a failed capture, and a step past ``max_graphs`` run ``fn`` as is
    (its Thunder regions still replay their own graphs), with the reason in :meth:`StepGraph.report`, or raise
    :class:`~cudagraphex.StrictModeError` under ``strict=True``. Python side effects of ``fn`` other than the slots
    above (a counter, a list of losses) happen at the capture only.

What the caller gets back
    ``fn``'s return value, with each tensor a new copy of the graph's output (detached: the step consumed its
    autograd graph), so a tensor the caller keeps is never overwritten. ``fn`` may return tensors, None and
    containers of them; a Python value a graph would freeze keeps the step from being captured.
"""

from __future__ import annotations

import gc
import logging
import operator
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._dynamo.guards import TensorGuards
from torch.utils import _pytree as pytree

from cudagraphex import capture as _capture
from cudagraphex.runtime import StrictModeError
from cudagraphex.runtime.guards import addresses_equal, layout_guard
from cudagraphex.runtime.staging import picker
from cudagraphex.step_io import (
    argument_problem,
    handed_out,
    host_values,
    output_problem,
    shared_storage,
    signature,
    storages,
    write_back,
)
from cudagraphex.step_state import (
    HostWork,
    Slots,
    install_registration_hooks,
    is_tensor,
    keep_slots,
    same_hyperparameters,
    state_layout,
    unsettled,
)

__all__ = ["StepGraph", "StepReport", "graph_step"]

logger = logging.getLogger("cudagraphex")


@dataclass
class StepReport:
    """What :func:`graph_step` did: read it as text (``str(report)``) or as data."""

    function: str
    captures: int = 0
    replays: int = 0
    #: Calls that ran ``fn`` as is, by reason (warm-up included).
    plain_calls: dict[str, int] = field(default_factory=dict)
    capture_ms: float = 0.0
    pool_bytes: int = 0
    #: Why the step is not replayed (None while it is).
    not_captured: str | None = None

    def __str__(self) -> str:
        head = (
            f"cudagraphex step report for {self.function}: {self.captures} capture(s), {self.replays} replay(s),"
            f" last capture {self.capture_ms:.1f} ms, {self.pool_bytes / 2**20:.1f} MiB of graph memory"
        )
        lines = [head]
        if self.plain_calls:
            lines.append(
                "  calls without the step graph: " + ", ".join(f"{k} x{n}" for k, n in self.plain_calls.items())
            )
        if self.not_captured:
            lines.append(f"  not captured: {self.not_captured}")
        return "\n".join(lines)


class _Graph:
    """One captured step: the graph, its argument buffers, the guards of its state, and its outputs."""

    def __init__(self) -> None:
        self.graph: Any = None
        self.spec: Any = None
        self.host_values: tuple = ()
        self.modes: tuple = ()
        self.buffers: list[torch.Tensor] = []
        #: Indices of the buffers the step writes in place: copied back into the caller's arguments after a replay.
        self.written: list[int] = []
        self.arg_guard: TensorGuards | None = None
        self.pick_args: Callable = lambda flat: ()
        self.slots: list[torch.Tensor | None] = []
        self.state_guard: TensorGuards | None = None
        self.state_idx: list[int] = []
        self.state_ptrs: list[int | None] = []
        self.state_storages: frozenset[int] = frozenset()
        self.ptr_idx: list[int] = []
        self.hyperparameters: list = []
        self.outputs: list[torch.Tensor | None] = []
        self.out_spec: Any = None
        self.replay_args: list[Any] = []


class StepGraph:
    """A training step captured whole into one CUDA graph; see :func:`graph_step`."""

    def __init__(
        self,
        fn: Callable,
        modules: Iterable[torch.nn.Module],
        optimizers: Iterable[torch.optim.Optimizer],
        *,
        warmup_calls: int,
        max_graphs: int,
        strict: bool,
        backend: str,
    ) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.modules = list(modules)
        self.optimizers = list(optimizers)
        for m in self.modules:
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"modules must be torch.nn.Module objects, got {type(m).__name__}")
        for o in self.optimizers:
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(f"optimizers must be torch.optim.Optimizer objects, got {type(o).__name__}")
        for name, value, low in (("warmup_calls", warmup_calls, 1), ("max_graphs", max_graphs, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(strict, bool):
            raise ValueError(f"strict must be a bool, got {strict!r}")  # noqa: TRY004 (contract)
        if backend not in ("cuda", "emulate"):
            raise ValueError(f"backend must be 'cuda' or 'emulate', got {backend!r}")
        install_registration_hooks()
        self.warmup_calls = warmup_calls
        self.max_graphs = max_graphs
        self.strict = strict
        self.emulated = backend == "emulate"
        self.device_type = "cpu" if self.emulated else "cuda"
        self._slots = Slots(self.modules, self.optimizers)
        self._current: _Graph | None = None
        self._graphs: dict[tuple, _Graph] = {}
        self._pool: Any = None
        self._warmups: Counter[tuple] = Counter()
        self._refused: dict[tuple, str] = {}
        self._report = StepReport(self.__name__)
        self._warned = False

    # -- calls --------------------------------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graph = self._current
        if graph is not None:
            flat, spec = pytree.tree_flatten((args, kwargs))
            if self._fits(graph, flat, spec):
                return self._replay(graph, flat)
        return self._slow(args, kwargs)

    def report(self) -> StepReport:
        """Captures, replays, calls that ran ``fn`` as is (by reason), capture time and memory of the step."""
        return self._report

    def _fits(self, graph: _Graph, flat: list, spec: Any) -> bool:
        slots = self._slots
        if (
            slots.stale()
            or spec != graph.spec
            or host_values(flat) != graph.host_values
            or slots.modes() != graph.modes
        ):
            return False
        args = graph.pick_args(flat)
        if graph.arg_guard is not None and not graph.arg_guard.check(*args):
            return False
        if shared_storage(args, graph.state_storages):
            return False
        current = slots.tensors()
        if not all(map(operator.is_, current, graph.slots)):
            return False
        present = [current[i] for i in graph.state_idx]
        if graph.state_guard is not None and not graph.state_guard.check(*present):
            return False
        if present and not addresses_equal(present, graph.state_ptrs, graph.ptr_idx):
            return False
        return same_hyperparameters(slots.hyperparameters(), graph.hyperparameters)

    def _replay(self, graph: _Graph, flat: list) -> Any:
        args = graph.pick_args(flat)
        if len(graph.buffers) == 1:
            graph.buffers[0].copy_(args[0])
        elif graph.buffers:
            torch._foreach_copy_(graph.buffers, list(args))
        if self.emulated:
            self._run_emulated(graph)
        else:
            graph.graph.replay()
        self._report.replays += 1
        write_back(args, graph.buffers, graph.written)
        return handed_out(graph.outputs, graph.out_spec)

    def _slow(self, args: tuple, kwargs: dict) -> Any:
        self._slots = slots = Slots(self.modules, self.optimizers)
        flat, spec = pytree.tree_flatten((args, kwargs))
        state = slots.tensors()
        key = (signature(flat, spec), slots.modes(), state_layout(state))
        if key not in self._refused and (problem := argument_problem(flat)) is not None:
            self._refuse(key, problem)
        if key in self._refused:
            return self._plain(args, kwargs, "not captured", inside_step=False)
        tensor_args = [a for a in flat if is_tensor(a)]
        if shared_storage(tensor_args, storages(state)):
            self._refuse(None, "an argument shares memory with another argument or with the step's state")
            return self._plain(args, kwargs, "arguments share memory", inside_step=False)
        known = self._graphs.get(key)
        if known is not None and self._fits(known, flat, spec):
            self._current = known
            return self._replay(known, flat)
        self._warmups[key] += 1
        if self._warmups[key] < self.warmup_calls:
            return self._plain(args, kwargs, "warm-up")
        if self._warmups[key] == self.warmup_calls:
            scan = HostWork(self.device_type)
            with scan:
                out = self._plain(args, kwargs, "warm-up")
            if scan.found is not None:
                self._refuse(key, f"the step {scan.found}")
            return out
        if self._report.captures >= self.max_graphs:
            self._refuse(key, f"it was captured max_graphs={self.max_graphs} times")
            return self._plain(args, kwargs, "not captured", inside_step=False)
        graph, out, problem = self._capture(flat, spec, key)
        if problem is not None:
            self._refuse(key, problem)
        if out is _NOT_RUN:
            return self._plain(args, kwargs, "not captured", inside_step=False)
        self._current = graph
        if graph is None:
            self._graphs.pop(key, None)
        else:
            self._graphs[key] = graph
        return out

    def _plain(self, args: tuple, kwargs: dict, reason: str, *, inside_step: bool = True) -> Any:
        """Runs ``fn`` as is. Inside a step (warm-up), its regions run as plain code; outside it they replay their
        graphs."""
        self._report.plain_calls[reason] = self._report.plain_calls.get(reason, 0) + 1
        if not inside_step:
            return self.fn(*args, **kwargs)
        with _capture.whole_step():
            return self.fn(*args, **kwargs)

    def _refuse(self, key: tuple | None, reason: str) -> None:
        """Runs calls of input signature ``key`` (of this call only, for None) without the step graph from now on."""
        message = f"cudagraphex: step {self.__name__} is not captured: {reason}; it runs without the step graph"
        if self.strict:
            raise StrictModeError(message)
        if key is not None:
            self._refused[key] = reason
            self._report.not_captured = reason
        if not self._warned:
            self._warned = True
            warnings.warn(message, stacklevel=4)
        else:
            logger.info("%s", message)

    # -- capture ------------------------------------------------------------------------------------------------------

    def _capture(self, flat: list, spec: Any, key: tuple) -> tuple[_Graph | None, Any, str | None]:
        """Captures the step for the call ``flat`` and runs it once. Returns the graph (None where the state it leaves
        behind is not the state it was captured from: the next call captures again), the call's result (``_NOT_RUN``
        where the call's device work has not run), and why the step cannot be captured (None if it can)."""
        slots = self._slots
        graph = _Graph()
        tensor_idx = [i for i, a in enumerate(flat) if is_tensor(a)]
        graph.pick_args = picker(tensor_idx)
        graph.buffers = [
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
            for a in map(flat.__getitem__, tensor_idx)
        ]
        for buf, i in zip(graph.buffers, tensor_idx, strict=True):
            buf.copy_(flat[i])
        graph.arg_guard = layout_guard([flat[i] for i in tensor_idx])
        versions = [buf._version for buf in graph.buffers]
        call_flat = list(flat)
        for buf, i in zip(graph.buffers, tensor_idx, strict=True):
            call_flat[i] = buf
        call_args, call_kwargs = pytree.tree_unflatten(call_flat, spec)
        graph.replay_args = [call_args, call_kwargs]
        before = slots.tensors()
        hyperparameters = slots.hyperparameters()

        start = time.perf_counter()
        reserved = 0 if self.emulated else torch.cuda.memory_reserved()
        if self.emulated:
            out = self._run_emulated_capture(graph, before)
        else:
            try:
                out = self._run_cuda_capture(graph, before)
            except _NotCapturable as e:
                return None, _NOT_RUN, str(e)
        self._report.captures += 1
        self._report.capture_ms = (time.perf_counter() - start) * 1e3
        added = 0 if self.emulated else torch.cuda.memory_reserved() - reserved
        self._report.pool_bytes += added

        flat_out, graph.out_spec = pytree.tree_flatten(out)
        problem = output_problem(flat_out, [*before, *flat, *graph.buffers])
        if problem is not None:  # the emulated capture ran the step; a CUDA capture only recorded it
            return None, out if self.emulated else _NOT_RUN, problem
        graph.outputs = [None if o is None else o.detach() for o in flat_out]
        graph.written = [i for i, (buf, v) in enumerate(zip(graph.buffers, versions, strict=True)) if buf._version != v]

        after = slots.tensors()
        graph.slots = after
        graph.hyperparameters = hyperparameters
        graph.spec, graph.host_values, graph.modes = spec, host_values(flat), key[1]
        graph.state_idx = [i for i, t in enumerate(after) if t is not None]
        present = [after[i] for i in graph.state_idx]
        graph.state_ptrs = [t.data_ptr() for t in present]
        graph.ptr_idx = list(range(len(present)))
        graph.state_storages = storages(present)
        graph.state_guard = layout_guard(present)
        moved = unsettled(before, after)
        self._report.not_captured = None
        logger.info(
            "step %s: captured in %.1f ms, %.1f MiB of memory added (capture %d)%s",
            self.__name__,
            self._report.capture_ms,
            added / 2**20,
            self._report.captures,
            f"; its state moved ({moved}), so the next call captures again" if moved else "",
        )
        if not self.emulated:
            graph.graph.replay()
            self._report.replays += 1
        write_back(graph.pick_args(flat), graph.buffers, graph.written)
        return None if moved else graph, handed_out(graph.outputs, graph.out_spec), None

    def _run_cuda_capture(self, graph: _Graph, before: list) -> Any:
        device = torch.device("cuda", torch.cuda.current_device())
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        cuda_graph = torch.cuda.CUDAGraph()
        rng_state = torch.cuda.get_rng_state(device)
        gc_enabled = gc.isenabled()
        with _capture._capture_lock:
            stream = _capture.capture_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            gc.disable()
            try:
                with torch.cuda.stream(stream), _capture.whole_step():
                    cuda_graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                    try:
                        out = self.fn(*graph.replay_args[0], **graph.replay_args[1])
                        keep_slots(self._slots, before)
                    finally:
                        cuda_graph.capture_end()
            except BaseException as e:
                _capture._reset_generator(stream, rng_state, device)
                keep_slots(self._slots, before, restore=True)
                raise _NotCapturable(f"capturing the step failed ({type(e).__name__}: {e})") from e
            finally:
                if gc_enabled:
                    gc.enable()
            torch.cuda.current_stream(device).wait_stream(stream)
        graph.graph = cuda_graph
        return out

    def _run_emulated_capture(self, graph: _Graph, before: list) -> Any:
        with _capture.whole_step():
            out = self.fn(*graph.replay_args[0], **graph.replay_args[1])
            keep_slots(self._slots, before)
        graph.graph = "emulated"
        return out

    def _run_emulated(self, graph: _Graph) -> None:
        """A replay on the CPU: runs the step again on the argument buffers and writes its results where a graph
        would: the slots' tensors and the output tensors."""
        with _capture.whole_step():
            out = self.fn(*graph.replay_args[0], **graph.replay_args[1])
            keep_slots(self._slots, graph.slots)
        with torch.no_grad():
            for target, fresh in zip(graph.outputs, pytree.tree_leaves(out), strict=True):
                if target is not None:
                    target.copy_(fresh)


class _NotCapturable(Exception):
    pass


#: The result of a call whose device work has not run (a failed CUDA capture).
_NOT_RUN = object()


def graph_step(
    fn: Callable,
    *,
    modules: Iterable[torch.nn.Module] = (),
    optimizers: Iterable[torch.optim.Optimizer] = (),
    warmup_calls: int = 2,
    max_graphs: int = 4,
    strict: bool = False,
    backend: str = "cuda",
) -> StepGraph:
    """Captures a whole training step into one CUDA graph and replays it.

    ``fn(*batch)`` is the step: forward through Thunder-compiled (or plain) modules, ``backward``, gradient
    accumulation over micro-batches, and optionally a capturable optimizer's ``step`` and ``zero_grad``. The first
    ``warmup_calls`` calls for a new input signature run ``fn`` as is; the next captures the step and replays it, and
    later calls replay it while the guards hold (see the module docstring for what is guarded and what a replay
    changes). Thunder regions inside ``fn`` run as plain code inside the step graph.

    Args:
        fn: the step, called with the step's arguments (tensors are copied into the graph's buffers).
        modules: modules whose parameters and buffers the step reads or writes.
        optimizers: optimizers the step steps; use ``capturable=True`` (``foreach`` or ``fused``).
        warmup_calls: calls per input signature before a capture (the last one also checks for host work).
        max_graphs: captures in all; past it the step runs ``fn`` as is.
        strict: raise :class:`~cudagraphex.StrictModeError` instead of running ``fn`` without the step graph.
        backend: ``"cuda"``, or ``"emulate"``: the CPU replay backend, which reruns ``fn`` and keeps the slots.

    Raises:
        TypeError: for a module or optimizer of the wrong type.
        ValueError: for an invalid option.
    """
    return StepGraph(
        fn,
        modules,
        optimizers,
        warmup_calls=warmup_calls,
        max_graphs=max_graphs,
        strict=strict,
        backend=backend,
    )
