"""Capturing a whole step and replaying it on the CPU backend (see ``cudagraphex.step.graph``).

A CUDA capture records the step on the process's capture stream into the step's pool and runs nothing; if it fails,
the RNG state and the slots are restored, so the process is as before the attempt. The CPU backend's capture runs
the step; its replay runs it again on the argument buffers and writes the results where a graph would.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch._C._dynamo.guards import TensorGuards
from torch.utils import _pytree as pytree

from cudagraphex import capture as _capture
from cudagraphex.runtime.guards import layout_guard
from cudagraphex.runtime.staging import picker
from cudagraphex.step.io import storages
from cudagraphex.step.state import Slots, is_tensor, keep_slots

__all__ = ["NOT_RUN", "NotCapturable", "StepCapture", "capture_cuda", "capture_emulated", "replay_emulated"]


class NotCapturable(Exception):
    """Capturing the step failed; nothing of it ran."""


#: The result of a call whose device work has not run (a failed CUDA capture).
NOT_RUN = object()


class StepCapture:
    """One captured step: the graph, its argument buffers, the guards of its state, and its outputs."""

    def __init__(self) -> None:
        self.graph: Any = None
        self.spec: Any = None
        self.host_values: tuple = ()
        self.modes: tuple = ()
        self.buffers: list[torch.Tensor] = []
        #: Indices of the buffers the step writes in place (``io.changed_buffers``): copied back into the caller's
        #: arguments after a replay.
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

    def stage(self, flat: list, spec: Any) -> list[int]:
        """Copies the tensor arguments of the call ``flat`` into new buffers and makes the buffers what the capture
        runs on; returns their version counters."""
        tensor_idx = [i for i, a in enumerate(flat) if is_tensor(a)]
        self.pick_args = picker(tensor_idx)
        # Normal tensors, also under inference mode: the arguments the step writes are found by version counters.
        with torch.inference_mode(False):
            self.buffers = [
                torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                for a in map(flat.__getitem__, tensor_idx)
            ]
        for buf, i in zip(self.buffers, tensor_idx, strict=True):
            buf.copy_(flat[i])
        self.arg_guard = layout_guard([flat[i] for i in tensor_idx])
        call_flat = list(flat)
        for buf, i in zip(self.buffers, tensor_idx, strict=True):
            call_flat[i] = buf
        self.replay_args = list(pytree.tree_unflatten(call_flat, spec))
        return [buf._version for buf in self.buffers]

    def hold(self, slots: list[torch.Tensor | None], hyperparameters: list) -> None:
        """Records the state the graph was captured with: the slots' tensors after the capture and the optimizers'
        hyperparameters, which replays are guarded on."""
        self.slots = slots
        self.hyperparameters = hyperparameters
        self.state_idx = [i for i, t in enumerate(slots) if t is not None]
        present = [slots[i] for i in self.state_idx]
        self.state_ptrs = [t.data_ptr() for t in present]
        self.ptr_idx = list(range(len(present)))
        self.state_storages = storages(present)
        self.state_guard = layout_guard(present)


def capture_cuda(fn: Callable, graph: StepCapture, slots: Slots, before: list, pool: _capture.SharedPool) -> Any:
    """Records ``fn`` on the buffers of ``graph`` into ``pool``; returns what ``fn`` returned (its outputs)."""
    device = torch.device("cuda", torch.cuda.current_device())
    cuda_graph = torch.cuda.CUDAGraph()
    pool_id = pool.for_capture()
    rng_state = torch.cuda.get_rng_state(device)
    gc_enabled = gc.isenabled()
    with _capture.on_capture_stream(device) as stream:
        gc.disable()
        try:
            with _capture.whole_step():
                cuda_graph.capture_begin(pool=pool_id, capture_error_mode="thread_local")
                try:
                    out = fn(*graph.replay_args[0], **graph.replay_args[1])
                    keep_slots(slots, before)
                finally:
                    cuda_graph.capture_end()
        except BaseException as e:
            _capture._reset_generator(stream, rng_state, device)
            keep_slots(slots, before, restore=True)
            raise NotCapturable(f"capturing the step failed ({type(e).__name__}: {e})") from e
        finally:
            if gc_enabled:
                gc.enable()
    graph.graph = cuda_graph
    pool.captured(cuda_graph, pool_id)
    return out


def capture_emulated(fn: Callable, graph: StepCapture, slots: Slots, before: list) -> Any:
    """The CPU backend's capture: runs ``fn`` on the buffers of ``graph``."""
    with _capture.whole_step():
        out = fn(*graph.replay_args[0], **graph.replay_args[1])
        keep_slots(slots, before)
    graph.graph = "emulated"
    return out


def replay_emulated(fn: Callable, graph: StepCapture, slots: Slots) -> None:
    """A replay on the CPU: runs the step again on the argument buffers and writes its results where a graph would:
    the slots' tensors and the output tensors."""
    with _capture.whole_step():
        out = fn(*graph.replay_args[0], **graph.replay_args[1])
        keep_slots(slots, graph.slots)
    with torch.no_grad():
        for target, fresh in zip(graph.outputs, pytree.tree_leaves(out), strict=True):
            if target is not None:
                target.copy_(fresh)
