"""Triage verdicts for differences that Thunder's torch.compile fusion executor makes (``--fuser``), not cudagraphex:
where plain Thunder with it departs from plain Thunder without it, and where it changes which outputs are views."""

from __future__ import annotations

import dataclasses

from cudagraphex import CUDAGraphExecutor
from tests.fuzzing.compare import Failure, compare_step, normalise
from tests.fuzzing.programs import Program
from tests.fuzzing.world import BackendSpec, World, compile_source, lockstep

THUNDER_FUNCTION_VIEW = "Output N of ThunderOutputFunctionBackward is a view"


def _raised_by_torch_compile(error: BaseException | None) -> bool:
    return error is not None and type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))


def fuser_departs(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why cudagraphex differs from plain Thunder under ``--fuser`` where the fusion executor is the cause; empty for
    no verdict.

    Thunder 0.2.6's rematerialization ignores in-place writes: with a fusion executor its backward may recompute a
    tensor from memory written since, or run a recomputed write again. cudagraphex keeps such region outputs from
    being recomputed (``cudagraphex.planning.rematerialization``). Eager gives no verdict where it refuses a backward
    that read a tensor saved for it and written in place.

    The verdict needs a value difference, or an error that only plain Thunder raises (its fusion executor may fail to
    compile what it is handed), and plain Thunder with and without the fusion executor to differ up to the failing
    step. Then cudagraphex, with the fusion executor, must run up to and through that step either alike with plain
    Thunder without it, or alike with cudagraphex without it, where the fuzzer, run on the program without the fusion
    executor up to that step, finds no difference it does not excuse.

    Where both raise at the failing step with other errors, the verdict needs both errors to come from torch.compile
    (Dynamo or Inductor: graph regions hand it other code, so it may fail elsewhere), and cudagraphex without the
    fusion executor to run through that step, where the fuzzer, run on the program without it, finds no difference it
    does not excuse.
    """
    program = failure.program
    only_plain_raises = failure.symptom.startswith("raises only without cudagraphex")
    both_raise = failure.symptom.startswith("reference raises")
    if not program.fuser or (failure.label == "exception" and not (only_plain_raises or both_raise)):
        return ""
    steps = program.steps[: failure.step + 1]
    unfused = dataclasses.replace(program, fuser=False)
    try:
        fused = World(program, backend, None, compile_source(program, "reference"))
        plain = World(unfused, backend, None, compile_source(unfused, "reference, no fusion executor"))
        cgx = World(program, backend, ex, compile_source(program, "cudagraphex"))
        cgx_unfused = World(unfused, backend, ex, compile_source(unfused, "cudagraphex, no fusion executor"))
    except Exception:  # noqa: BLE001 - no verdict
        return ""
    departs, like_plain, like_unfused, unfused_runs = False, True, True, True
    both_fail_in_torch_compile = False
    for index, (f, p, c, u) in lockstep(program, (fused, plain, cgx, cgx_unfused), steps, seeded=not program.threads):
        departs = departs or f.raised is not None or compare_step(program, backend, index, f, p) is not None
        like_plain = (
            like_plain and p.raised is None and c.raised is None and not compare_step(program, backend, index, p, c)
        )
        like_unfused = like_unfused and c.raised is None and not compare_step(program, backend, index, u, c)
        unfused_runs = unfused_runs and u.raised is None
        # Read after the loop: the failing step's, which is the last.
        both_fail_in_torch_compile = _raised_by_torch_compile(f.raised) and _raised_by_torch_compile(c.raised)
    if both_raise:
        excuses = both_fail_in_torch_compile and unfused_runs and _excuses_without(unfused, steps, backend)
        if excuses:
            return (
                "Thunder's torch.compile fusion executor fails in plain Thunder and in cudagraphex, which hands it other"
                " code; without it, cudagraphex runs that step, and the fuzzer finds no difference from plain Thunder"
                f" that it does not excuse ({excuses})"
            )
        return ""
    if not departs:
        return ""
    if like_plain:
        return (
            "plain Thunder with its torch.compile fusion executor departs from plain Thunder without it, and"
            " cudagraphex, with it, computes what Thunder computes without it"
        )
    excuses = like_unfused and _excuses_without(unfused, steps, backend)
    if excuses:
        return (
            "plain Thunder with its torch.compile fusion executor departs from plain Thunder without it, and"
            " cudagraphex, with it, computes what cudagraphex computes without it, where the fuzzer finds no"
            f" difference from plain Thunder that it does not excuse ({excuses})"
        )
    return ""


def _excuses_without(unfused: Program, steps: list, backend: BackendSpec) -> str:
    """The excuses the fuzzer gives, run on ``unfused`` up to and through ``steps`` ("none" where it finds no
    difference); empty where it finds one that it does not excuse."""
    from tests.fuzzing.runner import check  # runner triages through this module

    failures = check(dataclasses.replace(unfused, steps=steps), backend.name).failures
    if not all(w.excused for w in failures):
        return ""
    return "; ".join(sorted({w.excused for w in failures})) or "none"


def a_view_as_without_a_fusion_executor(failure: Failure, backend: BackendSpec) -> str:
    """Why only cudagraphex refuses an in-place write into an output of Thunder's autograd function that is a view,
    where Thunder's fusion executor runs in both; empty for no verdict. Inductor returns a new tensor where a view is
    asked for; cudagraphex returns the view, as Thunder's other executors do, and autograd refuses writes into views
    that a custom function returns. The verdict needs plain Thunder without the fusion executor to refuse the write at
    the same step for the same reason."""
    program = failure.program
    if not (
        program.fuser
        and failure.symptom.startswith("raises only with cudagraphex")
        and THUNDER_FUNCTION_VIEW in failure.symptom
    ):
        return ""
    unfused = dataclasses.replace(program, fuser=False)
    try:
        ref = World(unfused, backend, None, compile_source(unfused, "reference without a fusion executor"))
    except Exception:  # noqa: BLE001 - no verdict
        return ""
    steps = unfused.steps[: failure.step + 1]
    for index, (r,) in lockstep(unfused, (ref,), steps, seeded=not program.threads):
        if r.raised is not None:
            if index == failure.step and THUNDER_FUNCTION_VIEW in normalise(str(r.raised)):
                return (
                    "Thunder's autograd function refuses a write into an output that is a view, which Inductor"
                    " returns as a new tensor; plain Thunder without its fusion executor refuses it too"
                )
            return ""
    return ""
