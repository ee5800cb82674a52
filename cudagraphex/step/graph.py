"""Whole-step graphs: a training step (forward, backward, gradient accumulation, optimizer step) in one graph.

Invariants
==========

What a replay reads and writes
    A step graph reads and writes tensors at the addresses they had when it was captured. Those tensors are the
    step's *arguments*, copied into buffers the graph owns (one batched copy per call), and its *state*: the
    parameters and buffers of the ``modules`` it was given, the parameters of its ``optimizers``, their gradients and
    the optimizer state. Nothing of the step's Python runs at a replay. Any other tensor the step reaches (a global,
    a closure, an attribute of a Python argument such as a KV cache object) is read and written where it was at the
    capture, unguarded: a step that must see such a tensor replaced keeps it as a buffer of one of its ``modules``.

What is guarded
    Before every replay, the state slots hold the same tensors as after the capture (identity), at the same addresses,
    with the same dtype, shape, strides and ``requires_grad`` (one C++ check each); gradients that were None are None.
    The arguments have the layout they were captured with; Python arguments are equal. Grad mode, autocast, the
    ``training`` flag of every module, each optimizer's ``param_groups`` (hyperparameters compared by value, tensors by
    identity) and its state entries are as at the capture; no parameter, buffer or submodule was registered in the
    modules' trees since. The step keeps one graph per input signature, modes and set of slots that hold a tensor; a
    miss runs the slow path, which replays the graph of the call's signature where its guards hold, captures again
    (after warm-up calls where the signature is new; at most ``max_graphs`` captures in all), or runs ``fn`` as is with
    one logged reason (so does a call with a Python argument that is not hashable: graphs are kept per value). A stale
    graph is never replayed. Graphs share one memory pool: they run one at a time, and the outputs of each are copied
    out right after its replay.

Arguments
    Tensor arguments are copied into the graph's buffers before a replay; buffers the step writes in place are copied
    back into the caller's arguments after it: those whose version counters the capture bumped, or whose values the
    step's first run on the buffers changed (``io.changed_buffers``). An argument that shares memory with another or
    with the state would lose that sharing in the buffers: such a call runs ``fn`` as is.

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

Batch-size buckets
    With ``capture_sizes``, a call with fewer rows than a capture size replays that size's graph on its rows padded
    and gets its rows of each output back (``cudagraphex.step.buckets``), where the check of
    ``cudagraphex.step.rows`` found the step's rows independent on the last warm-up call of that size; otherwise,
    with the reason in the report, it runs ``fn`` as is. The step must run the same ops for every batch size up to a
    capture size.

What the caller gets back
    ``fn``'s return value, with each tensor a new copy of the graph's output (detached: the step consumed its
    autograd graph), so a tensor the caller keeps is never overwritten. ``fn`` may return tensors, None and
    containers of them. A Python value, which a graph would freeze, or a tensor that shares memory with an argument,
    the state or another result, which a copy would separate from it, keeps the step from being captured. A call that
    runs ``fn`` as is returns ``fn``'s own result.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from cudagraphex import capture as _capture
from cudagraphex._protections import PROTECTIONS
from cudagraphex.runtime import StrictModeError
from cudagraphex.runtime.guards import addresses_equal
from cudagraphex.step import buckets
from cudagraphex.step.capture import (
    NOT_RUN,
    NotCapturable,
    StepCapture,
    capture_cuda,
    capture_emulated,
    replay_emulated,
)
from cudagraphex.step.io import (
    argument_problem,
    changed_buffers,
    handed_out,
    host_values,
    on_arguments,
    output_problem,
    shared_storage,
    signature,
    storages,
    unhashable_argument,
    write_back,
)
from cudagraphex.step.report import StepReport
from cudagraphex.step.rows import RowCheck
from cudagraphex.step.state import (
    HostWork,
    Slots,
    hyperparameter_change,
    is_tensor,
    listed,
    same_hyperparameters,
    state_layout,
    unsettled,
)

__all__ = ["StepGraph", "graph_step"]

logger = logging.getLogger("cudagraphex")


class StepGraph:
    """A training step captured whole into one CUDA graph; see :func:`graph_step`."""

    def __init__(
        self,
        fn: Callable,
        modules: torch.nn.Module | Iterable[torch.nn.Module],
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
        *,
        warmup_calls: int,
        max_graphs: int | None,
        strict: bool,
        backend: str,
        capture_sizes: Sequence[int] | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.modules = listed("modules", modules, torch.nn.Module)
        self.optimizers = listed("optimizers", optimizers, torch.optim.Optimizer)
        self.capture_sizes = buckets.validated_sizes(capture_sizes)
        if max_graphs is None:
            max_graphs = max(4, len(self.capture_sizes))
        for name, value, low in (("warmup_calls", warmup_calls, 1), ("max_graphs", max_graphs, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(strict, bool):
            raise ValueError(f"strict must be a bool, got {strict!r}")  # noqa: TRY004 (contract)
        if backend not in ("cuda", "emulate"):
            raise ValueError(f"backend must be 'cuda' or 'emulate', got {backend!r}")
        self.warmup_calls = warmup_calls
        self.max_graphs = max_graphs
        self.strict = strict
        self.emulated = backend == "emulate"
        self.device_type = "cpu" if self.emulated else "cuda"
        self._slots = Slots(self.modules, self.optimizers)
        self._current: StepCapture | None = None
        self._graphs: dict[tuple, StepCapture] = {}
        self._pool = _capture.SharedPool(torch.cuda.graph_pool_handle)
        self._warmups: Counter[tuple] = Counter()
        self._refused: dict[tuple, str] = {}
        self._report = StepReport(self.__name__)
        self._warned = False
        #: With capture_sizes: per rows key, the graph padded calls replay and how its outputs carry the rows.
        self._padded: dict[tuple, tuple[StepCapture, list]] = {}
        self._row_plans: dict[tuple, tuple[str | None, list]] = {}

    # -- calls --------------------------------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self.capture_sizes:
            rows = buckets.batch_rows(flat)
            size = next((s for s in self.capture_sizes if s >= rows), None)
            if size != rows:
                return self._padded_call(args, kwargs, flat, spec, rows, size)
        graph = self._current
        if graph is not None and self._fits(graph, flat, spec):
            return self._replay(graph, flat)
        return self._slow(args, kwargs)

    def report(self) -> StepReport:
        """Captures, replays, calls that ran ``fn`` as is (by reason), capture time and memory of the step."""
        return self._report

    def _fits(self, graph: StepCapture, flat: list, spec: Any, rows: int | None = None) -> bool:
        """Whether ``graph``'s guards hold for the call ``flat``; with ``rows``, for the call padded to the graph's
        rows (the arguments' layout is then not guarded: they are copied row by row)."""
        slots = self._slots
        if (
            slots.stale()
            or spec != graph.spec
            or host_values(flat) != graph.host_values
            or slots.modes() != graph.modes
        ):
            return False
        args = graph.pick_args(flat)
        if rows is None and graph.arg_guard is not None and not graph.arg_guard.check(*args):
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

    def _replay(self, graph: StepCapture, flat: list) -> Any:
        args = graph.pick_args(flat)
        if len(graph.buffers) == 1:
            graph.buffers[0].copy_(args[0])
        elif graph.buffers:
            torch._foreach_copy_(graph.buffers, list(args))
        self._launch(graph)
        self._report.replays += 1
        write_back(args, graph.buffers, graph.written)
        return handed_out(graph.outputs, graph.out_spec)

    def _launch(self, graph: StepCapture) -> None:
        if self.emulated:
            replay_emulated(self.fn, graph, self._slots)
        else:
            graph.graph.replay()

    # -- batch-size buckets (see cudagraphex.step.buckets) ---------------------------------------------------------

    def prepare(self, *args: Any, **kwargs: Any) -> None:
        """Warms up and captures the step at every capture size, largest first, from example arguments.

        Each size runs ``fn`` ``warmup_calls + 1`` times on the example rows, repeated or cut to that size, with all
        its effects (an optimizer steps, a cache is written). Without it, a size is captured once enough calls of
        exactly that size arrived, and calls that would be padded to it run ``fn`` as is until then.

        Raises:
            RuntimeError: if the step has no ``capture_sizes``.
            ValueError: if the tensor arguments disagree on their number of rows.
        """
        if not self.capture_sizes:
            raise RuntimeError(f"step {self.__name__} has no capture_sizes to prepare")
        flat, spec = pytree.tree_flatten((args, kwargs))
        for size in reversed(self.capture_sizes):
            sized_args, sized_kwargs = buckets.sized_to(flat, spec, size)
            for _ in range(self.warmup_calls + 1):
                self(*sized_args, **sized_kwargs)

    def _padded_call(self, args: tuple, kwargs: dict, flat: list, spec: Any, rows: int, size: int | None) -> Any:
        """A call of ``rows`` rows, fewer than capture size ``size`` (None: more than the largest)."""
        if size is None:
            return self._plain(args, kwargs, "more rows than the largest capture size", inside_step=False)
        if size in self._report.not_padded:
            if self.strict:
                raise StrictModeError(
                    f"cudagraphex: step {self.__name__} does not pad calls to {size} rows: "
                    + self._report.not_padded[size]
                )
            return self._plain(args, kwargs, "not padded", inside_step=False)
        try:
            padded = self._padded.get(buckets.rows_key(flat, spec, size))
        except TypeError:  # an unhashable Python argument: the slow path says why it runs as is
            return self._slow(args, kwargs)
        if padded is None or not self._fits(padded[0], flat, spec, rows):
            return self._plain(args, kwargs, "no graph to pad into yet", inside_step=False)
        graph, layouts = padded
        buckets.copy_rows(graph.buffers, graph.pick_args(flat), rows)
        self._launch(graph)
        report = self._report
        report.replays += 1
        report.padded_calls += 1
        report.real_rows += rows
        report.padded_rows += size - rows
        return buckets.handed_out_rows(graph.outputs, layouts, graph.out_spec, rows)

    def _pad_into(self, graph: StepCapture, key: tuple, flat: list, spec: Any) -> None:
        """Lets calls with fewer rows replay ``graph`` (captured at a capture size), if its step is row-independent."""
        problem, layouts = self._row_plans[key]
        size = buckets.batch_rows(flat)
        if problem is None and graph.written:
            problem = "the step writes an argument in place"
        if problem is None and len(layouts) != len(graph.outputs):
            problem = "the step returned a different structure when it was checked"
        if problem is not None:
            if size not in self._report.not_padded:
                self._report.not_padded[size] = problem
                logger.info("step %s: calls of fewer than %d rows are not padded: %s", self.__name__, size, problem)
            return
        self._padded[buckets.rows_key(flat, spec, size)] = (graph, layouts)

    def _slow(self, args: tuple, kwargs: dict) -> Any:
        self._slots = slots = Slots(self.modules, self.optimizers)
        flat, spec = pytree.tree_flatten((args, kwargs))
        if (problem := unhashable_argument(flat)) is not None:
            self._refuse(None, problem)
            return self._plain(args, kwargs, "not captured", inside_step=False)
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
            rows = buckets.batch_rows(flat) if self.capture_sizes else 1
            check = RowCheck(flat, rows) if rows > 1 and rows in self.capture_sizes else None
            with scan, check or contextlib.nullcontext():
                out = self._plain(args, kwargs, "warm-up")
            if scan.found is not None:
                self._refuse(key, f"the step {scan.found}")
            if check is not None:
                layouts = [check.layout_of(o) if is_tensor(o) else None for o in pytree.tree_leaves(out)]
                problem = check.problem if PROTECTIONS["row_independence_check"] else None
                self._row_plans[key] = (problem, layouts)
                if scan.found is not None:
                    self._report.not_padded.setdefault(rows, f"the step is not captured: it {scan.found}")
            return out
        if self._report.captures >= self.max_graphs:
            # Where this call's signature has a graph that no longer fits, a changed hyperparameter may say why.
            why = known and hyperparameter_change(slots.hyperparameters(), known.hyperparameters)
            self._refuse(key, f"it was captured max_graphs={self.max_graphs} times" + (f"; last, {why}" if why else ""))
            return self._plain(args, kwargs, "not captured", inside_step=False)
        graph, out, problem = self._capture(flat, spec, key)
        if problem is not None:
            self._refuse(key, problem)
        if out is NOT_RUN:
            return self._plain(args, kwargs, "not captured", inside_step=False)
        if problem is not None:  # the emulated capture ran ``fn``: that run is this call's, not captured
            self._count_plain("not captured")
        self._current = graph
        if graph is None:
            self._graphs.pop(key, None)
        else:
            self._graphs[key] = graph
            if key in self._row_plans:
                self._pad_into(graph, key, flat, spec)
        self._report.graphs = len(self._graphs)
        return out

    def _plain(self, args: tuple, kwargs: dict, reason: str, *, inside_step: bool = True) -> Any:
        """Runs ``fn`` as is. Inside a step (warm-up), its regions run as plain code; outside it they replay their
        graphs."""
        self._count_plain(reason)
        if not inside_step:
            return self.fn(*args, **kwargs)
        with _capture.whole_step():
            return self.fn(*args, **kwargs)

    def _count_plain(self, reason: str) -> None:
        self._report.plain_calls[reason] = self._report.plain_calls.get(reason, 0) + 1

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

    def _capture(self, flat: list, spec: Any, key: tuple) -> tuple[StepCapture | None, Any, str | None]:
        """Captures the step for the call ``flat`` and runs it once. Returns the graph (None where the state it leaves
        behind is not the state it was captured from: the next call captures again), the call's result (``NOT_RUN``
        where the call's device work has not run), and why the step cannot be captured (None if it can)."""
        slots = self._slots
        graph = StepCapture()
        if not self.emulated:
            device = torch.device("cuda", torch.cuda.current_device())
            _capture.allocate_blas_workspaces(device, autograd_thread=True)
        peak_before = 0 if self.emulated else torch.cuda.max_memory_allocated()
        versions = graph.stage(flat, spec)
        # The emulated capture runs the step, so it shows what the step writes by value too.
        before_run = [buf.clone() for buf in graph.buffers] if self.emulated else None
        before = slots.tensors()
        hyperparameters = slots.hyperparameters()

        start = time.perf_counter()
        reserved = 0 if self.emulated else torch.cuda.memory_reserved()
        if self.emulated:
            out = capture_emulated(self.fn, graph, self._slots, before)
        else:
            try:
                out = capture_cuda(self.fn, graph, self._slots, before, self._pool)
            except NotCapturable as e:
                return None, NOT_RUN, str(e)
        self._report.captures += 1
        self._report.capture_ms = (time.perf_counter() - start) * 1e3
        added = 0 if self.emulated else torch.cuda.memory_reserved() - reserved
        self._report.pool_bytes += added
        peak_added = 0 if self.emulated else max(0, torch.cuda.max_memory_allocated() - peak_before)
        self._report.peak_added_bytes += peak_added

        flat_out, graph.out_spec = pytree.tree_flatten(out)
        graph.written = [i for i, (buf, v) in enumerate(zip(graph.buffers, versions, strict=True)) if buf._version != v]
        if before_run is not None:
            graph.written = changed_buffers(graph.buffers, before_run, graph.written)
        after = slots.tensors()
        problem = output_problem(flat_out, [*before, *after, *flat, *graph.buffers])
        if problem is not None:
            if not self.emulated:  # a CUDA capture only recorded the step: the call runs it as is
                return None, NOT_RUN, problem
            # The emulated capture ran the step on the argument buffers: that run stands for this call.
            args = graph.pick_args(flat)
            write_back(args, graph.buffers, graph.written)
            return None, on_arguments(out, graph.buffers, args), problem
        graph.outputs = [None if o is None else o.detach() for o in flat_out]

        graph.hold(after, hyperparameters)
        graph.spec, graph.host_values, graph.modes = spec, host_values(flat), key[1]
        moved = unsettled(before, after)
        self._report.not_captured = None
        logger.info(
            "step %s: captured in %.1f ms, %.1f MiB of memory added, peak raised by %.1f MiB (capture %d)%s",
            self.__name__,
            self._report.capture_ms,
            added / 2**20,
            peak_added / 2**20,
            self._report.captures,
            f"; its state moved ({moved}), so the next call captures again" if moved else "",
        )
        if not self.emulated:  # the emulated capture ran the step: that run stands for this call's replay
            before_run = [buf.clone() for buf in graph.buffers]
            graph.graph.replay()
            graph.written = changed_buffers(graph.buffers, before_run, graph.written)
        self._report.replays += 1
        write_back(graph.pick_args(flat), graph.buffers, graph.written)
        return None if moved else graph, handed_out(graph.outputs, graph.out_spec), None


def graph_step(
    fn: Callable,
    *,
    modules: torch.nn.Module | Iterable[torch.nn.Module] = (),
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
    warmup_calls: int = 2,
    max_graphs: int | None = None,
    strict: bool = False,
    backend: str = "cuda",
    capture_sizes: Sequence[int] | None = None,
) -> StepGraph:
    """Captures a whole training step into one CUDA graph and replays it.

    ``fn(*batch)`` is the step: forward through Thunder-compiled (or plain) modules, ``backward``, gradient
    accumulation over micro-batches, and optionally a capturable optimizer's ``step`` and ``zero_grad``. The first
    ``warmup_calls`` calls for a new input signature run ``fn`` as is; the next captures the step and replays it, and
    later calls replay it while the guards hold (see the module docstring for what is guarded and what a replay
    changes). Thunder regions inside ``fn`` run as plain code inside the step graph.

    Args:
        fn: the step, called with the step's arguments (tensors are copied into the graph's buffers).
        modules: a module, or modules, whose parameters and buffers the step reads or writes.
        optimizers: an optimizer, or optimizers, the step steps; use ``capturable=True`` (``foreach`` or ``fused``).
        warmup_calls: calls per input signature before a capture (the last one also checks for host work).
        max_graphs: captures in all; past it the step runs ``fn`` as is (default 4, or the number of
            ``capture_sizes`` where that is more).
        strict: raise :class:`~cudagraphex.StrictModeError` instead of running ``fn`` without the step graph.
        backend: ``"cuda"``, or ``"emulate"``: the CPU replay backend, which reruns ``fn`` and keeps the slots.
        capture_sizes: batch sizes (dim 0 of every tensor argument) to capture; a call with fewer rows than a size
            replays that size's graph on its rows padded, where the step's rows are independent
            (``cudagraphex.step.rows``), and gets its rows of each output back. Use :meth:`StepGraph.prepare` to
            capture every size up front.

    Raises:
        TypeError: for an ``fn`` that is not callable, or ``modules`` or ``optimizers`` of the wrong type.
        ValueError: for an invalid option; with ``capture_sizes``, at a call whose tensor arguments disagree on their
            number of rows.
    """
    return StepGraph(
        fn,
        modules,
        optimizers,
        warmup_calls=warmup_calls,
        max_graphs=max_graphs,
        strict=strict,
        backend=backend,
        capture_sizes=capture_sizes,
    )
