"""Checks programs in batches, in worker processes where asked, until a deadline where given, and sums up their
outcomes."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import time
import warnings
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch

from tests.fuzzing.compare import Failure
from tests.fuzzing.generate import generate
from tests.fuzzing.programs import Program
from tests.fuzzing.runner import Outcome, check


@dataclass
class BatchResult:
    programs: int = 0
    calls: int = 0
    compilations: int = 0
    padded_calls: int = 0
    step_replays: int = 0
    step_refusals: Counter = field(default_factory=Counter)  # reason -> programs
    seconds: float = 0.0
    failures: list[Failure] = field(default_factory=list)  # excused ones included
    raised_in_both: dict[str, list[int]] = field(default_factory=dict)
    ops: Counter = field(default_factory=Counter)
    #: Seeds not checked because the deadline had passed when their turn came.
    unchecked: list[int] = field(default_factory=list)

    @property
    def counted(self) -> list[Failure]:
        return [f for f in self.failures if not f.excused]

    def add(self, program: Program, outcome: Outcome) -> None:
        self.programs += 1
        self.calls += outcome.calls
        self.compilations += outcome.compilations
        self.padded_calls += outcome.padded_calls
        self.step_replays += outcome.step_replays
        self.step_refusals.update(set(outcome.step_refusals))
        self.failures += outcome.failures
        for what in outcome.raised_in_both:
            self.raised_in_both.setdefault(what, []).append(program.seed)
        self.ops.update(set(program.categories))

    def summary(self) -> str:
        excused = len(self.failures) - len(self.counted)
        head = f"{self.programs} programs, {self.calls} calls, {self.compilations} compilations"
        head += f", {self.step_replays} step replays" if self.step_replays else ""
        head += f", {self.padded_calls} padded" if self.padded_calls else ""
        head += f", {len(self.counted)} failing"
        lines = [f"{head} (+{excused} where plain Thunder is the one that differs), {self.seconds:.1f} s"]
        if self.unchecked:
            lines.append(f"deadline reached: {len(self.unchecked)} seeds not checked, from {min(self.unchecked)}")
        for title, failures in (("failures", self.counted), ("plain Thunder differs", self.failures)):
            if title != "failures":
                failures = [f for f in failures if f.excused]
            if failures:
                lines.append(f"{title} by symptom:")
            for symptom, n in Counter(f.symptom for f in failures).most_common():
                seeds = [f.seed for f in failures if f.symptom == symptom][:10]
                lines.append(f"  {n:4d}  {symptom}  (seeds {' '.join(map(str, seeds))})")
        if self.step_refusals:
            lines.append("steps without a graph, or calls not padded, by reason (programs):")
            lines += [f"  {n:4d}  {reason}" for reason, n in self.step_refusals.most_common(10)]
        if self.raised_in_both:
            lines.append("raised in both (programs that Thunder itself rejects, or legitimate errors):")
            for what, seeds in sorted(self.raised_in_both.items(), key=lambda kv: -len(kv[1]))[:10]:
                lines.append(f"  {len(seeds):4d}  {what}  (seeds {' '.join(map(str, seeds[:6]))})")
        lines.append("programs using each op: " + ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items())))
        return "\n".join(lines)


def _check_seed(args: tuple[int, str, str, bool, float]) -> tuple[Program, Outcome] | int:
    """The program of a seed and its outcome; the seed alone where the deadline (``time.time()``) has passed."""
    seed, backend, steps, fuser, deadline = args
    if time.time() > deadline:
        return seed
    program = generate(seed).with_fuser() if fuser else generate(seed)
    if steps == "whole":
        program = program.as_whole_steps()
    elif steps == "bucketed":
        bucketed = program.as_bucketed_steps()
        if bucketed is None:  # an input without the batch along dim 0: nothing to pad
            return program, Outcome()
        program = bucketed
    return program, check(program, backend)


def _worker_init() -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


def run_batch(
    seeds: Iterable[int],
    backend: str = "emulate",
    workers: int = 1,
    on_failure=None,
    steps: str = "calls",
    fuser: bool = False,
    deadline_s: float | None = None,
) -> BatchResult:
    """Generates and checks one program per seed: its calls as they are (``steps="calls"``), each call one step
    through ``graph_step`` (``"whole"``, :meth:`Program.as_whole_steps`), or a serving step with batch-size buckets
    (``"bucketed"``, :meth:`Program.as_bucketed_steps`); with ``fuser``, with Thunder's torch.compile executor in both
    compiled functions (``Program.fuser``). ``workers`` > 1 runs that many processes: forked on the CPU replay backend
    (while CUDA is not initialised in this process, else one process), started anew on CUDA, each with a CUDA
    context of its own. A seed whose turn comes ``deadline_s`` seconds after the start or later is not checked
    (``BatchResult.unchecked``); seeds are taken in order, so those are the last ones."""
    result = BatchResult()
    start = time.perf_counter()
    deadline = time.time() + deadline_s if deadline_s is not None else float("inf")
    tasks = [(seed, backend, steps, fuser, deadline) for seed in seeds]
    method = "spawn" if backend == "cuda" else "fork" if not torch.cuda.is_initialized() else None
    parallel = workers > 1 and method is not None
    with contextlib.ExitStack() as stack:
        if parallel:
            pool = stack.enter_context(
                ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method), initializer=_worker_init)
            )
            results = pool.map(_check_seed, tasks)
        else:
            results = map(_check_seed, tasks)
        for n, checked in enumerate(results, 1):
            if isinstance(checked, int):
                result.unchecked.append(checked)
                continue
            program, outcome = checked
            result.add(program, outcome)
            for f in outcome.failures:
                if on_failure is not None:
                    on_failure(f)
            if not parallel and n % 25 == 0:
                gc.collect()
    result.seconds = time.perf_counter() - start
    return result
