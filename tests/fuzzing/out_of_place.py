"""Triage verdict for a gradient that differs, or an error only plain Thunder raises, where eager refuses the backward
because an in-place write into an intermediate changed a tensor saved for it: eager with those writes made out of place
is the reference."""

from __future__ import annotations

import dataclasses
import re

from cudagraphex import CUDAGraphExecutor
from tests.fuzzing.compare import Failure, compare_value, observed_alike, value_mode
from tests.fuzzing.programs import Program
from tests.fuzzing.world import SAVED_TENSOR_WRITTEN, BackendSpec, eager_refuses_and_rewritten_runs

#: An in-place op on a whole tensor, made out of place by rebinding its name: ``v0.mul_(x1)`` -> ``v0 = v0.mul(x1)``.
_WHOLE_TENSOR_WRITE = re.compile(r"^(\w+)\.(add|sub|mul|relu|clamp)_\((.*)\)$")
#: Lines whose result may share memory with what they read.
_ALIASING = frozenset({"view", "detach", "dropout"})


def made_out_of_place(program: Program) -> Program | None:
    """``program`` with each in-place write into an intermediate made out of place; None where it has none, or where
    one writes part of a tensor, or a tensor that may share memory with another value (a view, ``detach`` or
    dropout line made it or read it): elsewhere both compute the same values."""
    definitions = {ln.defines: ln for ln in program.lines if ln.defines}
    aliased = {name for ln in program.lines if ln.category in _ALIASING for name in ln.uses}
    lines, changed = [], False
    for ln in program.lines:
        if ln.category == "inplace_intermediate":
            match = _WHOLE_TENSOR_WRITE.match(ln.text)
            target = match.group(1) if match else None
            if target not in definitions or definitions[target].category in _ALIASING or target in aliased:
                return None
            ln = dataclasses.replace(ln, text=_WHOLE_TENSOR_WRITE.sub(r"\1 = \1.\2(\3)", ln.text), effect=False)
            changed = True
        lines.append(ln)
    return dataclasses.replace(program, lines=lines) if changed else None


def writes_made_out_of_place(failure: Failure, backend: BackendSpec, ex: CUDAGraphExecutor) -> str:
    """Why a gradient differs from plain Thunder's, or plain Thunder alone raises, where eager refuses the backward for
    a tensor saved for it that an in-place write into an intermediate changed; empty for no verdict.

    Thunder computes such a write as a new value, as eager computes the program with the write made out of place
    (:func:`made_out_of_place`). The verdict needs eager to refuse the failing step's backward, alone of the steps up
    to it, and that program to run eagerly up to and through the step as cudagraphex runs the original, giving the
    gradient that failed as cudagraphex gives it, within a tolerance; for an error, every value the step observes, as
    cudagraphex observes it.
    """
    program = failure.program
    out_of_place = made_out_of_place(program)
    raised_without = failure.label == "exception" and failure.symptom.startswith("raises only without cudagraphex")
    if not (failure.label.startswith("grad of") or raised_without) or out_of_place is None:
        return ""
    steps = program.steps[: failure.step + 1]
    tag, why = "eager, writes out of place", SAVED_TENSOR_WRITTEN
    observed = eager_refuses_and_rewritten_runs(program, out_of_place, tag, backend, ex, steps, why)
    if observed is None:
        return ""
    refused = "eager refuses the backward (an in-place write into an intermediate changed a tensor saved for it); "
    if raised_without:
        rewritten, compiled = observed[-1]
        labels = [label for label, _ in rewritten.items]
        if labels != [label for label, _ in compiled.items] or any(
            compare_value(a, b, value_mode(label, "close"), values_only=True)
            for (label, a), (_, b) in zip(rewritten.items, compiled.items)
        ):
            return ""
        return refused + "cudagraphex observes the values eager observes with the write made out of place"
    if not observed_alike(failure, *observed[-1], value_mode(failure.label, "close"), values_only=True):
        return ""
    return (
        refused
        + "cudagraphex gives the gradient that eager gives with the write made out of place, as Thunder computes it"
    )
