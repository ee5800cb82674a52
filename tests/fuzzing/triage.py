"""Triage of a difference between cudagraphex and plain Thunder: the runs that show plain Thunder is the one that
differs, or that the difference is Thunder's own choice made on other fusions, so it is reported and not counted."""

from __future__ import annotations

import dataclasses
import re
from typing import Any
from unittest import mock

from cudagraphex import CUDAGraphExecutor
from tests.fuzzing.call_order import thunder_called_in_the_steps_order
from tests.fuzzing.compare import (
    MISSING,
    Failure,
    compare_step,
    compare_value,
    largest_difference,
    normalise,
    observed_alike,
    value_mode,
)
from tests.fuzzing.fusion_executor import THUNDER_FUNCTION_VIEW, a_view_as_without_a_fusion_executor, fuser_departs
from tests.fuzzing.moved_write import cotangents_of_an_unwritten_output, moved_write
from tests.fuzzing.original_self import original_self_copied
from tests.fuzzing.out_of_place import writes_made_out_of_place
from tests.fuzzing.programs import Line, Program, Step
from tests.fuzzing.world import (
    SAVED_TENSOR_WRITTEN,
    BackendSpec,
    World,
    compile_source,
    eager_refuses_and_rewritten_runs,
    lockstep,
)


def triage(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> None:
    """Sets ``failure.excused`` where other runs of the program show that plain Thunder is the one that differs, or that
    the difference is Thunder's own choice made on other fusions. First by eager PyTorch run beside cudagraphex up to
    the failing step (:func:`_eager_verdict`); then by the verdicts below, each of which says what it needs:
    :func:`_write_not_read`, :func:`_leaf_written_through_a_view`, :func:`cotangents_of_an_unwritten_output`,
    :func:`_saved_by_rematerialization`, :func:`_closer_to_eager`, :func:`original_self_copied`,
    :func:`writes_made_out_of_place`, :func:`a_view_as_without_a_fusion_executor`, :func:`fuser_departs`,
    :func:`thunder_called_in_the_steps_order`; last, :func:`moved_write` (what plain Thunder moves into its
    backward)."""
    program = failure.program
    if failure.symptom.startswith("raises only without cudagraphex") and THUNDER_FUNCTION_VIEW in failure.symptom:
        failure.excused = (
            "an error of Thunder's autograd function, which returns outputs as views of one another; eager and"
            " cudagraphex hand out plain tensors and views, which autograd lets the caller write"
        )
        return
    if failure.step < 0 or (failure.nearly_equal and program.random):
        return
    failure.excused = (
        _eager_verdict(failure, backend, ex)
        or _write_not_read(failure, backend, ex)
        or _leaf_written_through_a_view(failure, backend, ex)
        or cotangents_of_an_unwritten_output(failure, backend, ex)
        or _saved_by_rematerialization(failure, backend, ex)
        or _closer_to_eager(failure, backend, ex)
        or original_self_copied(failure, backend, ex)
        or writes_made_out_of_place(failure, backend, ex)
        or a_view_as_without_a_fusion_executor(failure, backend)
        or fuser_departs(failure, backend, ex)
        or thunder_called_in_the_steps_order(failure, backend, ex)
    )
    if not failure.excused:
        failure.excused = moved_write(failure, backend, ex)


def _eager_verdict(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why plain Thunder is the one that differs, by eager PyTorch run beside cudagraphex; empty for no verdict. Eager
    must agree with cudagraphex on what failed: the same error or none; values within a tolerance, or to the last bit
    where the difference was within one; metadata only for random programs. A backward that eager refused for a saved
    tensor written in place does not end the run there, for a failure that is not about gradients
    (:func:`_refused_backward`)."""
    program = failure.program
    try:
        eager = World(program, backend, "eager", compile_source(program, "eager"))
        cgx = World(program, backend, ex, compile_source(program, "cudagraphex"))
    except Exception:  # noqa: BLE001 - no verdict
        return ""
    steps = program.steps[: failure.step + 1]
    refused_backward = False
    for index, (e, c) in lockstep(program, (eager, cgx), steps, seeded=not program.threads):
        if e.raised is not None and c.raised is None and _thunder_refuses_later(failure, e.raised):
            return (
                "eager refuses the program (a tensor saved for backward written in place); plain Thunder runs that"
                " write in its backward and refuses a later backward, cudagraphex runs it in the forward"
            )
        if index < failure.step:
            if c.raised is None and e.raised is not None and _refused_backward(failure, steps[index], e.raised):
                refused_backward = True
            elif e.raised is not None or c.raised is not None:
                return ""
            continue
        if failure.label == "exception":  # the same error (type and message), or none
            same = (e.raised is None) == (c.raised is None)
            if same and e.raised is not None:
                same = type(e.raised) is type(c.raised) and _gist(e.raised) == _gist(c.raised)
        else:
            # a difference within a tolerance is Thunder's only where eager and cudagraphex agree to the last bit
            mode = "meta" if program.random else "exact" if failure.nearly_equal else "close"
            values_only = failure.symptom.endswith(("values", "values (within a tolerance)"))
            same = observed_alike(failure, e, c, value_mode(failure.label, mode), values_only)
        if same:
            return "plain Thunder differs from eager here, and cudagraphex agrees with eager" + (
                " (eager refused an earlier backward, which read a tensor saved for it and written in place)"
                if refused_backward
                else ""
            )
    return ""


def _refused_backward(failure: Failure, step: Step, error: BaseException) -> bool:
    """Whether eager's error at ``step`` is a refused backward that later steps can be judged past: a backward (a
    step of its own, or a call's) that read a tensor saved for it and written in place, which Thunder's backward
    computes, where the failure is not about gradients, which that refusal leaves eager without. A call whose
    backward eager refused does not hold or write its outputs there, so a later step that depends on them differs
    in eager, and gives no verdict. In a whole step the refusal also skips the optimizer's step, so only a whole step
    without an optimizer can be judged past."""
    backward = step.action == "backward" or (step.action == "call" and step.loss in ("now", "retain"))
    return (
        backward
        and (not failure.program.whole_step or failure.program.optimizer == "none")
        and SAVED_TENSOR_WRITTEN in str(error)
        and failure.label != "exception"
        and not failure.label.startswith("grad of")
    )


def _write_not_read(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why plain Thunder refuses a backward for a saved input written in place after its forward while cudagraphex
    computes one; empty for no verdict.

    The verdict needs the program with its input writes left out to run alike in both up to that step, and
    cudagraphex's gradients there to be the same with and without the writes: its backward read no written tensor, so
    they are the gradients of the forward as it ran. Thunder 0.2.6 moves an in-place write of the forward that no
    output needs into its backward, which then saves the input it recomputes that write from; cudagraphex keeps the
    write in the forward graph. (Eager refuses such programs or not by its own formulas: ``index_copy_`` saves its
    source for the source's shape.)
    """
    program = failure.program
    if not (failure.label == "exception" and SAVED_TENSOR_WRITTEN in failure.detail):
        return ""
    steps = program.steps[: failure.step + 1]
    # A write to no input, at the same index, so that every later step draws the same seeds and inputs.
    unwritten = [dataclasses.replace(s, target="") if s.action == "write_input" else s for s in steps]
    try:
        written = World(program, backend, ex, compile_source(program, "cudagraphex"))
        ref = World(program, backend, None, compile_source(program, "reference"))
        cgx = World(program, backend, ex, compile_source(program, "cudagraphex"))
    except Exception:  # noqa: BLE001 - no verdict
        return ""
    # Each world runs seeded per step, as in the checked run, so the two lock-steps need not interleave.
    with_writes = None
    for _, (obs,) in lockstep(program, (written,), steps, seeded=True):
        if obs.raised is not None:
            return ""
        with_writes = obs
    without = None
    for index, (a, b) in lockstep(program, (ref, cgx), unwritten, seeded=True):
        if a.raised is not None or b.raised is not None or compare_step(program, backend, index, a, b):
            return ""
        without = b
    grads = [{k: v for k, v in obs.items if k.startswith("grad of")} for obs in (with_writes, without)]
    if not grads[0] or grads[0].keys() != grads[1].keys():
        return ""
    if any(compare_value(grads[0][k], grads[1][k], "exact") is not None for k in grads[0]):
        return ""
    return (
        "plain Thunder refuses a backward that saved an input written in place after the forward, as it moved an"
        " in-place write of the forward into its backward; without the writes both agree, and cudagraphex's gradients"
        " are the same with them: its backward read no written tensor"
    )


_LEAF_WRITTEN = "leaf Variable that requires grad is being used in an in-place operation"


def _leaf_written_through_a_view(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why cudagraphex and plain Thunder differ on a program that writes in place into a view of a leaf that requires
    grad; empty for no verdict.

    Eager refuses the write. Thunder 0.2.6 checks only the write's target, which is a view here (or what
    ``x.t().contiguous().t()`` returns for a transposed ``x``: ``contiguous`` returns ``x.t()`` itself, which Thunder
    takes for a new tensor), so neither Thunder path refuses it; plain Thunder drops the write (as it does for a leaf
    that requires no grad, where eager writes). The verdict needs eager to refuse the program at the failing step,
    and the program with each write that may reach such a leaf made through ``.detach()`` to run eagerly as
    cudagraphex runs the original, up to that step (in a random program, to raise nowhere and agree on what failed).
    """
    program = failure.program
    writes = [ln for ln in program.lines if _may_write_a_grad_leaf(program, ln)]
    if failure.label == "exception" or not writes:
        return ""
    through_detach = dataclasses.replace(
        program,
        lines=[
            dataclasses.replace(ln, text=re.sub(r"^(\w+)", r"\1.detach()", ln.text, count=1)) if ln in writes else ln
            for ln in program.lines
        ],
    )
    steps = program.steps[: failure.step + 1]
    tag = "eager, writes detached"
    observed = eager_refuses_and_rewritten_runs(program, through_detach, tag, backend, ex, steps, _LEAF_WRITTEN)
    if observed is None:
        return ""
    if not program.random and any(compare_step(program, backend, i, d, c) for i, (d, c) in enumerate(observed)):
        return ""
    # eager draws other numbers than Thunder: in a random program, the failing observation alone, which must agree
    if program.random and not observed_alike(failure, *observed[-1], value_mode(failure.label, "close")):
        return ""
    return (
        "eager refuses an in-place write into a view of a leaf that requires grad; Thunder checks the write's target,"
        " a view, so neither Thunder path refuses it: cudagraphex computes what eager computes with the write made"
        " through .detach(), plain Thunder drops the write"
    )


def _closer_to_eager(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why values that differ within a tolerance are plain Thunder's rounding, where eager agrees with neither to the
    last bit; empty for no verdict. The verdict needs the three to run alike up to the failing step, and cudagraphex's
    values there to be as close to eager's as plain Thunder's or closer (largest difference)."""
    program = failure.program
    if not failure.nearly_equal:
        return ""
    try:
        tags = {"eager": "eager", None: "reference", ex: "cudagraphex"}
        worlds = [World(program, backend, w, compile_source(program, tag)) for w, tag in tags.items()]
    except Exception:  # noqa: BLE001 - no verdict
        return ""
    steps = program.steps[: failure.step + 1]
    for _, observed in lockstep(program, worlds, steps, seeded=not program.threads):
        if any(o.raised is not None for o in observed):
            return ""
    eager, plain, cgx = (dict(o.items).get(failure.label, MISSING) for o in observed)
    if MISSING in (eager, plain, cgx) or compare_value(eager, cgx, "close", values_only=True) is not None:
        return ""
    if _largest_difference(cgx, eager) > _largest_difference(plain, eager):
        return ""
    return (
        "a difference within a tolerance where eager agrees with neither to the last bit, and cudagraphex is as close"
        " to eager as plain Thunder or closer"
    )


def _largest_difference(a: Any, b: Any) -> float:
    """:func:`largest_difference` as a number: infinite where the values are not comparable."""
    difference = largest_difference(a, b)
    return float("inf") if isinstance(difference, str) else difference


def _saved_by_rematerialization(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why cudagraphex refuses a backward for an input written after its forward, where a fusion executor after it
    rematerializes and plain Thunder does not refuse it (it runs it, or fails otherwise); empty for no verdict.

    Thunder's rematerialization, which a fusion executor runs over every fusion of the trace, graph regions included,
    trades a tensor saved for backward for the tensors it is computed from, preferring the producer's inputs. A region
    holds more than the fusions plain Thunder forms, so more of what the backward reads is computed inside it, and the
    backward may come to save an input of the forward; autograd then refuses it after a write into that input, as it
    does where eager saves an input. The verdict needs both compiled functions, built with rematerialization turned
    off, to run alike up to and through the failing step (where both may raise the same error).
    """
    program = failure.program
    refused_by_cudagraphex = failure.label == "exception" and not failure.symptom.startswith("raises only without")
    if not (program.fuser and refused_by_cudagraphex and SAVED_TENSOR_WRITTEN in failure.detail):
        return ""
    from thunder.executors import torch_compile

    steps = program.steps[: failure.step + 1]
    with mock.patch.object(torch_compile, "rematerialize", lambda trace: trace):
        try:
            ref = World(program, backend, None, compile_source(program, "reference, not rematerialized"))
            cgx = World(program, backend, ex, compile_source(program, "cudagraphex, not rematerialized"))
        except Exception:  # noqa: BLE001 - no verdict
            return ""
        for index, (a, b) in lockstep(program, (ref, cgx), steps, seeded=not program.threads):
            raised = a.raised is not None or b.raised is not None
            if compare_step(program, backend, index, a, b) or (raised and index < failure.step):
                return ""
    return (
        "Thunder's rematerialization, run by the fusion executor after cudagraphex over regions larger than plain"
        " Thunder's fusions, makes the backward save an input that is written before it; with rematerialization off"
        " both agree"
    )


def _may_write_a_grad_leaf(program: Program, line: Line) -> bool:
    """Whether ``line`` writes in place into an input that requires grad, or into a chain of views of one."""
    if line.category == "write_grad_leaf":
        return True
    if line.category != "inplace_intermediate":
        return False
    definitions = {ln.defines: ln for ln in program.lines if ln.defines}
    name = re.match(r"\w+", line.text).group()
    while name in definitions and definitions[name].category == "view" and len(definitions[name].uses) == 1:
        (name,) = definitions[name].uses
    return any(t.name == name and t.requires_grad for t in program.inputs)


def _thunder_refuses_later(failure: Failure, eager_error: BaseException) -> bool:
    """Whether eager refused the program for a saved tensor written in place, and the difference is that plain Thunder
    refuses it for the same reason at a later step (Thunder 0.2.6 moves such a forward write into its backward)."""
    return (
        failure.label == "exception"
        and SAVED_TENSOR_WRITTEN in str(eager_error)
        and SAVED_TENSOR_WRITTEN in failure.detail
    )


def _gist(e: BaseException) -> str:
    """The start of an error message, up to the first detail in brackets. Thunder's in-place check says "a leaf
    Variable" where eager says "a view of a leaf Variable": the same error."""
    return normalise(str(e)).removeprefix("a view of ").split("[")[0][:60]
