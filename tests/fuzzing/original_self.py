"""Triage verdict for a gradient that differs where cudagraphex copies what an in-place op overwrites
(``cudagraphex.planning.snapshots``) and eager refuses the backward, so that plain Thunder is the only reference."""

from __future__ import annotations

from unittest import mock

from cudagraphex import CUDAGraphExecutor
from cudagraphex.planning import regions
from tests.fuzzing.compare import Failure, run_alike
from tests.fuzzing.world import SAVED_TENSOR_WRITTEN, BackendSpec, World, compile_source, lockstep


def original_self_copied(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why a gradient differs from plain Thunder's where cudagraphex gives an in-place op's own gradient the value
    its target held before the write (eager's ``original_self``); empty for no verdict.

    Thunder 0.2.6 reads that value after the write, unless its rematerialization happens to recompute it. Eager runs
    such a backward only where nothing else saved the written memory; where it refuses for another tensor (``sqrt``
    saves its result, which Thunder's backward recomputes instead of reading), plain Thunder is the only reference.
    The verdict needs eager to refuse the failing step's backward, alone of the steps up to it, and both compiled
    functions, built without those copies, to run alike up to and through it.
    """
    program = failure.program
    if not failure.label.startswith("grad of"):
        return ""
    steps = program.steps[: failure.step + 1]
    try:
        eager = World(program, backend, "eager", compile_source(program, "eager"))
    except Exception:  # noqa: BLE001 - no verdict
        return ""
    for index, (e,) in lockstep(program, (eager,), steps, seeded=not program.threads):
        refused = e.raised is not None and SAVED_TENSOR_WRITTEN in str(e.raised)
        if (e.raised is not None) != (index == failure.step) or (index == failure.step and not refused):
            return ""
    with mock.patch.object(regions, "with_snapshots", lambda sequence, trace: sequence):
        try:
            ref = World(program, backend, None, compile_source(program, "reference"))
            cgx = World(program, backend, ex, compile_source(program, "cudagraphex, no copies before writes"))
        except Exception:  # noqa: BLE001 - no verdict
            return ""
        if not run_alike(program, backend, (ref, cgx), steps, seeded=not program.threads):
            return ""
    return (
        "eager refuses the backward (a tensor saved for it written in place); cudagraphex gives the in-place op's own"
        " gradient the value before the write, as eager's original_self, where plain Thunder reads the written one;"
        " without those copies both agree"
    )
