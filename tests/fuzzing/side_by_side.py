"""``python -m tests.fuzzing --side-by-side --seed S``: one program run step by step in the worlds that triage compares,
with the largest difference of every value each observes from plain Thunder's. A diagnostic for a failure that has no
verdict: it shows which world departs where, without a script of one's own.

The worlds: plain Thunder (the reference), cudagraphex, eager PyTorch, eager with in-place writes into intermediates
made out of place (where :func:`~tests.fuzzing.out_of_place.made_out_of_place` gives that form), and, for programs
with Thunder's torch.compile executor, plain Thunder and cudagraphex without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tests.fuzzing.compare import MISSING, largest_difference, normalise
from tests.fuzzing.out_of_place import made_out_of_place
from tests.fuzzing.programs import Program
from tests.fuzzing.world import BACKENDS, World, compile_source, executor, lockstep


def _cell(difference: float | str) -> str:
    return difference if isinstance(difference, str) else f"{difference:.3g}"


def side_by_side(program: Program, backend: str, out: Callable[[str], None] = print) -> None:
    """Prints, for each step of ``program`` on ``backend``, what each world raised and a row per value plain Thunder
    observed: its largest absolute difference in each other world ("-" where that world did not observe it, "shape"
    or "other" where it is not comparable). A world that cannot be built is named and left out; without plain Thunder
    nothing runs."""
    if program.threads:
        raise ValueError("side by side runs one thread; this program calls from several")
    spec, ex = BACKENDS[backend], executor(backend, program.min_region_size)
    sources = {"plain Thunder": (program, None), "cudagraphex": (program, ex), "eager": (program, "eager")}
    rewritten = made_out_of_place(program)
    if rewritten is not None:
        sources["eager, writes out of place"] = (rewritten, "eager")
    if program.fuser:
        unfused = dataclasses.replace(program, fuser=False)
        sources["plain Thunder, no fusion executor"] = (unfused, None)
        sources["cudagraphex, no fusion executor"] = (unfused, ex)
    names, worlds = [], []
    for name, (p, w) in sources.items():
        try:
            worlds.append(World(p, spec, w, compile_source(p, name)))
            names.append(name)
        except Exception as e:  # noqa: BLE001 - shown, and the other worlds go on
            out(f"{name}: not built: {type(e).__name__}: {normalise(str(e))}")
    if names[:1] != ["plain Thunder"]:
        return
    out("columns: " + "; ".join(f"[{k}] {name}" for k, name in enumerate(names[1:], 1)))
    for index, observed in lockstep(program, worlds, program.steps, seeded=True):
        out(f"step {index}: {program.steps[index].describe()}")
        for name, o in zip(names, observed):
            if o.raised is not None:
                out(f"  {name} raises {type(o.raised).__name__}: {normalise(str(o.raised))}")
        others = [dict(o.items) for o in observed[1:]]
        for label, value in observed[0].items:
            cells = [_cell(largest_difference(value, other.get(label, MISSING))) for other in others]
            out(f"  {label:32s}" + "".join(f" [{k}] {c:>9s}" for k, c in enumerate(cells, 1)))
