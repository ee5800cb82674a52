"""Reduces a failing program to a smaller one with the same symptom."""

from __future__ import annotations

import dataclasses
import re

from tests.fuzzing.compare import Failure
from tests.fuzzing.programs import Program
from tests.fuzzing.runner import check


def _without_line(program: Program, i: int) -> Program | None:
    line = program.lines[i]
    later = program.lines[i + 1 :]
    if line.defines and (
        any(line.defines in ln.uses for ln in later)
        or any(re.search(rf"\b{line.defines}\b", o) for o in program.outputs)
    ):
        return None
    return dataclasses.replace(program, lines=program.lines[:i] + later)


def _used(program: Program, name: str) -> bool:
    ref = f"self.{name}" if any(t.name == name and t.role in ("param", "buffer") for t in program.tensors) else name
    return any(ref in ln.uses for ln in program.lines) or any(
        re.search(rf"\b{re.escape(ref)}\b", o) for o in program.outputs
    )


def shrink(failure: Failure, backend: str = "emulate", budget: int = 60) -> Failure:
    """A smaller program (fewer steps, lines, outputs and tensors) that fails with the same symptom."""
    best = failure
    runs = 0

    def attempt(candidate: Program) -> bool:
        nonlocal best, runs
        runs += 1
        fs = check(candidate, backend).failures
        match = [f for f in fs if f.symptom == best.symptom and bool(f.excused) == bool(best.excused)]
        if match:
            best = match[0]
            return True
        return False

    changed = True
    while changed and runs < budget:
        changed = False
        p = best.program
        # steps after the failing one, then each earlier step
        if 0 <= best.step < len(p.steps) - 1 and attempt(dataclasses.replace(p, steps=p.steps[: best.step + 1])):
            changed = True
            continue
        for i in range(len(p.steps) - 1, -1, -1):
            if runs >= budget:
                break
            if attempt(dataclasses.replace(p, steps=p.steps[:i] + p.steps[i + 1 :])):
                changed = True
                break
        if changed:
            continue
        for i in range(len(p.outputs) - 1, -1, -1):
            if len(p.outputs) > 1 and attempt(dataclasses.replace(p, outputs=p.outputs[:i] + p.outputs[i + 1 :])):
                changed = True
                break
        if changed:
            continue
        for i in range(len(p.lines) - 1, -1, -1):
            candidate = _without_line(p, i)
            if candidate is not None and runs < budget and attempt(candidate):
                changed = True
                break
        if changed:
            continue
        targets = {s.target for s in p.steps if s.action == "write_input"}
        for t in p.tensors:
            unused = not _used(p, t.name) and t.name not in targets
            if unused and attempt(dataclasses.replace(p, tensors=[u for u in p.tensors if u is not t])):
                changed = True
                break
        if changed:
            continue
        if p.threads and attempt(dataclasses.replace(p, threads=False)):
            changed = True
            continue
        for i, step in enumerate(p.steps):
            simpler = [
                dataclasses.replace(step, **{k: v})
                for k, v in (("layout", "contiguous"), ("keep", "drop"), ("loss", "none"), ("fresh", True))
                if step.action == "call" and getattr(step, k) != v
            ]
            for s in simpler:
                if runs < budget and attempt(dataclasses.replace(p, steps=[*p.steps[:i], s, *p.steps[i + 1 :]])):
                    changed = True
                    break
            if changed:
                break
    return best
