"""Microbenchmark: the host cost cudagraphex adds to a replay.

One region of 100 pointwise ops (``hundred_ops``: 50 x ``y = y * 1.0001``, ``y = y + 0.0001`` on 1024 floats) with
k inputs (summed first; the warm-up gets copies, so the graph copies them on every call), replayed three ways on one
captured graph: (a) ``thunder call``, the compiled Thunder function; (b) ``region call``, the region called with its
inputs (guards, input copy, liveness check, replay, hand-out); (c) ``graph.replay``, ``CUDAGraph.replay()`` alone.
Two more cases: ``hundred_outputs`` hands out its 100 results; and ``hundred_ops`` warmed up on its input itself, so
that the graph reads it in place.

Times are host times: a block of calls starts on an idle GPU and ends when its last call returns (the GPU's ~94 µs
would set the pace otherwise); a measurement is the median of its blocks, one block per round for every measurement.
Derived, in µs: per region = (b) - (c) at k=1, and the same read in place; per copied input = the least-squares slope
of (b) - (c) over k; per returned output = the extra (b) - (c) of ``hundred_outputs`` over ``hundred_ops`` at k=1,
per extra output; Thunder's prologue, epilogue and glue = (a) - (b) at k=1.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from benchmarks.report import Record, full_error, short_error

MICRO_WORKLOAD = "micro-100ops"
K_VALUES = (1, 8, 32)
_NUMEL = 1024
#: (a), (b), (c) of the module docstring, timed for every case.
_WAYS = ("thunder call", "region call", "graph.replay")
#: The keys of the ``hundred_outputs`` case and of the case whose input is read in place, beside the k values.
_OUTPUTS = "100 outputs"
_IN_PLACE = "k=1 read in place"
#: The ``hundred_ops`` cases (one per k, and k=1 read in place) and the ``hundred_outputs`` case, each timed 3 ways.
MICRO_MEASUREMENTS = len(_WAYS) * (len(K_VALUES) + 2)
#: Calls per timed block: few enough that the GPU's queue never fills, so the host never waits for it.
_CALLS_PER_BLOCK = 20
#: Rounds of blocks per repetition the suite asks for (a block lasts well under a millisecond), and untimed calls of
#: every measurement before the first round.
_ROUNDS_PER_REP = 6
_WARMUP_CALLS = 3


def hundred_ops(*xs: torch.Tensor) -> torch.Tensor:
    """The sum of ``xs`` put through 100 alternating pointwise ops."""
    y = xs[0]
    for x in xs[1:]:
        y = y + x
    for _ in range(50):
        y = y * 1.0001
        y = y + 0.0001
    return y


def hundred_outputs(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The 100 results of alternating pointwise ops on ``x``."""
    outs = []
    y = x
    for _ in range(50):
        y = y * 1.0001
        outs.append(y)
        y = y + 0.0001
        outs.append(y)
    return tuple(outs)


def _host_time_per_call_us(call: Callable[[], None], sync: Callable[[], None]) -> float:
    """The host time per call, in microseconds, of one block of calls that starts on an idle GPU."""
    sync()
    start = time.perf_counter()
    for _ in range(_CALLS_PER_BLOCK):
        call()
    return (time.perf_counter() - start) / _CALLS_PER_BLOCK * 1e6


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var


def _region_inputs(jfn, region, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors the region is called with, by name among the computation trace's arguments (the inputs, in
    order)."""
    import thunder

    names = [getattr(a, "name", None) for a in thunder.last_traces(jfn)[-1].args]
    if len(names) != len(xs):
        raise RuntimeError(f"expected {len(xs)} computation arguments, got {names}")
    by_name = dict(zip(names, xs, strict=True))
    missing = [n for n in region.info.input_names if n not in by_name]
    if missing:
        raise RuntimeError(f"region inputs {missing} are not arguments of the computation trace")
    return [by_name[n] for n in region.info.input_names]


def run_micro(
    executor,
    device: torch.device,
    options,
    sync: Callable[[], None],
    log: Callable[[str], None] = lambda line: None,
) -> tuple[list[Record], dict]:
    """Measures (a), (b) and (c) for every case of the module docstring; returns the records and the derived host
    breakdown (None where its inputs are missing). ``executor`` is the cudagraphex executor (an emulating one on the
    CPU, where (c) replays the emulation). Errors are recorded per measurement, their tracebacks go to ``log``."""
    records: list[Record] = []
    # (key, function, k, whether the graph reads its inputs in place)
    cases: list[tuple[int | str, Callable, int, bool]] = [(k, hundred_ops, k, False) for k in K_VALUES]
    cases += [(_IN_PLACE, hundred_ops, 1, True), (_OUTPUTS, hundred_outputs, 1, False)]
    # (case key, way, record, call) of every measurement that could be prepared
    timed: list[tuple[int | str, str, Record, Callable[[], None]]] = []
    for key, fn, k, in_place in cases:
        label = f"k={key}" if isinstance(key, int) else key
        group = [Record(MICRO_WORKLOAD, "inference", f"{name} {label}") for name in _WAYS]
        try:
            calls = _prepare(fn, k, executor, device, sync, group, in_place)
            timed += [(key, name, record, calls[name]) for record, name in zip(group, _WAYS, strict=True)]
        except Exception as e:  # noqa: BLE001 - recorded for the whole group
            for record in group:
                record.error = record.error or short_error(e)
            log(f"{MICRO_WORKLOAD} / {label}: failed:\n{full_error(e)}")
        records += group
    blocks: dict[int, list[float]] = {id(record): [] for _, _, record, _ in timed}
    failed: set[int] = set()
    # Every measurement gets one block per round, so that a slow stretch of the host touches all of them alike.
    with torch.no_grad():  # the grad mode the functions were compiled and captured in
        for _ in range(_WARMUP_CALLS):
            for _, _, _, call in timed:
                call()
        for _ in range(max(1, options.reps) * _ROUNDS_PER_REP):
            for _, _, record, call in timed:
                if id(record) in failed:
                    continue
                try:
                    blocks[id(record)].append(_host_time_per_call_us(call, sync))
                except Exception as e:  # noqa: BLE001 - recorded; the other measurements go on
                    record.error = short_error(e)
                    failed.add(id(record))
                    log(f"{MICRO_WORKLOAD} / {record.variant}: failed:\n{full_error(e)}")
    sync()
    medians: dict[str, dict[int | str, float]] = {name: {} for name in _WAYS}
    for key, name, record, _ in timed:
        if id(record) not in failed:
            record.median_us = statistics.median(blocks[id(record)])
            medians[name][key] = record.median_us
    return records, _breakdown(medians)


def _prepare(
    fn: Callable,
    k: int,
    executor,
    device: torch.device,
    sync: Callable[[], None],
    group: list[Record],
    in_place: bool,
) -> dict:
    """Compiles and captures ``fn`` of ``k`` inputs, checks (a) and (b) against eager (into ``group``), and returns
    the three ways to replay it. With ``in_place`` the warm-up gets the inputs themselves, so that the graph reads them
    in place; otherwise copies of them, so that the graph copies them."""
    import thunder

    import cudagraphex

    xs = [torch.full((_NUMEL,), 1.0 + i / k, device=device) for i in range(k)]
    jfn = thunder.jit(fn, executors=[executor, *thunder.get_default_executors()])
    with torch.no_grad():
        sync()
        start = time.perf_counter()
        jfn(*(xs if in_place else [x.clone() for x in xs]))  # the warm-up
        for _ in range(2):  # capture + replay, replay
            jfn(*xs)
        sync()
        group[0].setup_s = time.perf_counter() - start
        regions = cudagraphex.inspect(jfn).regions(executor.name)
        if len(regions) != 1 or not regions[0].instances:
            raise RuntimeError(f"expected one captured region, got {len(regions)} region(s)")
        region = regions[0]
        read = region.instances[0].read_in_place
        if len(read) != (k if in_place else 0):
            raise RuntimeError(f"the graph reads inputs {read} in place; expected {'all' if in_place else 'none'}")
        args = _region_inputs(jfn, region, xs)
        graph = region.instances[0].graph
        expected = _flat(fn(*xs))
        # Outputs are never held across calls: a held output makes the region return copies from then on.
        group[0].correct = _close(_flat(jfn(*xs)), expected)
        group[1].correct = _close(region(*args), expected)
    group[0].note = (
        f"region of {region.info.num_ops} ops, {len(region.info.input_names)} input(s),"
        f" {len(region.info.output_names)} output(s)"
    )

    def thunder_call() -> None:
        jfn(*xs)

    def region_call() -> None:
        region(*args)

    # One Python frame per call in each of the three, so that their differences are cudagraphex's and Thunder's.
    if device.type == "cuda":

        def replay() -> None:
            graph.replay()

    else:  # the emulated graph of the CPU replay backend takes the region's inputs

        def replay() -> None:
            graph.replay(args)

    return {"thunder call": thunder_call, "region call": region_call, "graph.replay": replay}


def _flat(out: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


def _close(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> bool:
    return len(got) == len(expected) and all(
        torch.allclose(g, e, rtol=1e-4, atol=1e-4) for g, e in zip(got, expected, strict=True)
    )


def _breakdown(medians: dict[str, dict[int | str, float]]) -> dict:
    a, b, c = (medians[name] for name in _WAYS)
    both = [k for k in K_VALUES if k in b and k in c]
    per_region = b[1] - c[1] if 1 in both else None
    in_place = b[_IN_PLACE] - c[_IN_PLACE] if _IN_PLACE in b and _IN_PLACE in c else None
    per_output = None
    if per_region is not None and _OUTPUTS in b and _OUTPUTS in c:
        per_output = (b[_OUTPUTS] - c[_OUTPUTS] - per_region) / (100 - 1)
    return {
        "k": list(K_VALUES),
        "thunder_call_us": [a.get(k) for k in K_VALUES],
        "region_call_us": [b.get(k) for k in K_VALUES],
        "graph_replay_us": [c.get(k) for k in K_VALUES],
        "cudagraphex_overhead_per_region_us": per_region,
        "per_region_read_in_place_us": in_place,
        "per_copied_input_us": _slope(both, [b[k] - c[k] for k in both]) if len(both) >= 2 else None,
        "per_returned_output_us": per_output,
        "thunder_glue_us": a[1] - b[1] if 1 in a and 1 in b else None,
    }
