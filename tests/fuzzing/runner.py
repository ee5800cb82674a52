"""Runs a program with cudagraphex and with plain Thunder in lock-step, and reports their differences."""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field

import thunder
import torch

from cudagraphex import CUDAGraphExecutor, explain
from tests.fuzzing.compare import Failure, compare_step, normalise
from tests.fuzzing.programs import Program
from tests.fuzzing.triage import triage as triage_failure
from tests.fuzzing.world import BACKENDS, BackendSpec, World, compile_source, executor, lockstep


@dataclass
class Outcome:
    failures: list[Failure] = field(default_factory=list)
    raised_in_both: list[str] = field(default_factory=list)  # "ExceptionType: message" of runs both rejected
    calls: int = 0
    compilations: int = 0  # Thunder cache misses of both compiled functions
    padded_calls: int = 0  # bucketed programs: calls that replayed a larger batch's graph padded
    step_replays: int = 0  # whole-step programs: calls the step graph served
    #: Whole-step programs: why the step was not captured, or calls were not padded (``explain``'s reasons).
    step_refusals: list[str] = field(default_factory=list)


def _run_pair(program: Program, backend: BackendSpec, ex: CUDAGraphExecutor, seeded: bool) -> Outcome:
    outcome = Outcome()
    try:
        ref = World(program, backend, None, compile_source(program, "reference"))
        cgx = World(program, backend, ex, compile_source(program, "cudagraphex"))
    except Exception as e:  # noqa: BLE001 - a program the fuzzer should not have built
        outcome.failures.append(Failure(program.seed, -1, "setup", repr(e), f"setup: {type(e).__name__}", program))
        return outcome
    for index, (a, b) in lockstep(program, (ref, cgx), program.steps, seeded):
        outcome.calls += program.steps[index].action == "call"
        failure = compare_step(program, backend, index, a, b)
        if failure is not None:
            outcome.failures.append(failure)
            break
        if a.raised is not None:
            outcome.raised_in_both.append(f"{type(a.raised).__name__}: {normalise(str(a.raised))}")
            break
    outcome.compilations = thunder.cache_misses(ref.fn) + thunder.cache_misses(cgx.fn)
    if program.whole_step:
        report = explain(cgx.step)
        outcome.step_replays = report.replays
        outcome.padded_calls = report.padded_calls
        if report.not_captured:
            outcome.step_refusals.append(f"not captured: {normalise(report.not_captured)}")
        outcome.step_refusals += [f"not padded: {normalise(reason)}" for reason in report.not_padded.values()]
    return outcome


def check(program: Program, backend: str = "emulate", triage: bool = True) -> Outcome:
    """Runs ``program`` with cudagraphex and with plain Thunder and returns the differences (at most one per
    thread: a run stops at its first difference, or where both raise). With ``triage``, each difference is also
    checked against eager PyTorch (see :func:`tests.fuzzing.triage.triage`)."""
    spec = BACKENDS[backend]
    ex = executor(backend, program.min_region_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if spec.device == "cuda" else []):
            if not program.threads:
                outcome = _run_pair(program, spec, ex, seeded=True)
            else:
                outcome = _run_threads(program, spec, ex)
            if triage:
                for f in outcome.failures:
                    triage_failure(f, spec, ex)
    return outcome


def _run_threads(program: Program, spec: BackendSpec, ex: CUDAGraphExecutor) -> Outcome:
    """Two threads, each with its own compiled pair (RNG-free programs only: the threads share the generator)."""
    outcomes: list[Outcome] = [Outcome(), Outcome()]

    def worker(k: int) -> None:
        try:
            outcomes[k] = _run_pair(program, spec, ex, seeded=False)
        except Exception as e:  # noqa: BLE001 - reported as a failure
            f = Failure(program.seed, -1, f"thread {k}", repr(e), f"thread: {type(e).__name__}", program)
            outcomes[k] = Outcome([f])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    merged = Outcome()
    for o in outcomes:
        merged.failures += o.failures
        merged.raised_in_both += o.raised_in_both
        merged.calls += o.calls
        merged.compilations += o.compilations
        merged.padded_calls += o.padded_calls
        merged.step_replays += o.step_replays
        merged.step_refusals += o.step_refusals
    return merged
