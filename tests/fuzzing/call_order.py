"""A triage verdict for a bucketed step whose difference comes from the order in which Thunder's function is called.

A bucketed step replays its graph for padded calls, so the compiled function sees fewer calls, in another order, than
plain Thunder's run does. Thunder 0.2.6's cache hands a call an entry compiled under autocast where it holds none
compiled without it for that call's inputs, so what a call without autocast returns can depend on which calls came
before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cudagraphex import CUDAGraphExecutor
from tests.fuzzing.compare import Failure
from tests.fuzzing.world import BackendSpec, World, compile_source, lockstep

_DTYPE_SYMPTOM = "outN: dtype"


class _Call:
    """One call of a compiled function: its arguments (copied), grad mode and autocast, and its outputs' dtypes."""

    def __init__(self, args: tuple, device_type: str) -> None:
        self.args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
        self.grad = torch.is_grad_enabled()
        self.autocast = torch.is_autocast_enabled(device_type)
        self.autocast_dtype = torch.get_autocast_dtype(device_type)
        self.dtypes: list[torch.dtype] = []

    def run(self, fn: Callable, device_type: str) -> list[torch.dtype]:
        with (
            torch.set_grad_enabled(self.grad),
            torch.autocast(device_type, dtype=self.autocast_dtype, enabled=self.autocast),
        ):
            return _dtypes(fn(*self.args))


def _dtypes(outs: Any) -> list[torch.dtype]:
    return [o.dtype for o in torch.utils._pytree.tree_leaves(outs) if isinstance(o, torch.Tensor)]


class _Recorded(World):
    """A world whose compiled function records its calls from the first, the bucketed step's ``prepare`` included
    (``World._prepare`` makes those). With ``calls`` None it makes none there: a function no call has reached yet."""

    def __init__(self, *args: Any, calls: list[_Call] | None, **kwargs: Any) -> None:
        self.recorded = calls
        super().__init__(*args, **kwargs)

    def _prepare(self, size: int, graphed: bool) -> None:
        if self.recorded is None:
            return
        compiled, calls, device_type = self.fn, self.recorded, torch.device(self.device).type

        def recording(*args: Any) -> Any:
            call = _Call(args, device_type)
            outs = compiled(*args)
            call.dtypes = _dtypes(outs)
            calls.append(call)
            return outs

        self.fn = recording
        super()._prepare(size, graphed)


def thunder_called_in_the_steps_order(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why a bucketed step's output dtype differs from plain Thunder's, where Thunder's cache is the cause; empty for
    no verdict. The verdict needs the failing step to call the compiled function in the step's grad mode and autocast;
    plain Thunder, given the calls that cudagraphex's step passed to its function up to then, in that order, to return
    at that step's calls the dtypes that cudagraphex's function returned; and plain Thunder given that step's calls
    alone to return others."""
    program = failure.program
    if not program.bucketed or failure.symptom != _DTYPE_SYMPTOM:
        return ""
    mode = program.steps[failure.step].mode
    calls: list[_Call] = []
    try:
        cgx = _Recorded(program, backend, ex, compile_source(program, "cudagraphex"), calls=calls)
        ordered, alone = (
            _Recorded(program, backend, None, compile_source(program, tag), calls=None)
            for tag in ("reference, in the step's order", "reference, the failing step alone")
        )
    except Exception:  # noqa: BLE001 - no verdict
        return ""
    before = 0
    for index, (o,) in lockstep(program, (cgx,), program.steps[: failure.step + 1], seeded=not program.threads):
        if o.raised is not None:
            return ""
        if index < failure.step:
            before = len(calls)
    at_failure = calls[before:]
    if not at_failure or any((c.grad, c.autocast) != (mode.grad, mode.autocast) for c in at_failure):
        return ""
    device_type = torch.device(cgx.device).type
    try:
        for call in calls[:before]:
            call.run(ordered.fn, device_type)
        if any(call.run(ordered.fn, device_type) != call.dtypes for call in at_failure):
            return ""
        if all(call.run(alone.fn, device_type) == call.dtypes for call in at_failure):
            return ""
    except Exception:  # noqa: BLE001 - no verdict
        return ""
    return (
        "Thunder's cache hands a call without autocast an entry compiled under autocast where it holds none for that"
        " call; plain Thunder, given the calls that the bucketed step passed to its function in that order, returns"
        " the dtypes cudagraphex returns, and given that step's calls alone returns others"
    )
