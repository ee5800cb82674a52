"""A serving loop whose batch varies per step, through a whole-step graph with batch-size buckets.

Thunder's test nanoGPT (4 layers, d=128, vocab 512) scores a window of 8 tokens per request; each step serves B
requests, B drawn from 1..32, through ``graph_step(serve, capture_sizes=[1, 2, 4, 8, 16, 32])`` with every size
captured up front (``prepare``). Reported: the graphs the step kept, how far each step's logits are from the eager
model's on the same B rows (unpadded), whether their greedy tokens agree, and per capture size the median time of a
padded step (B below the size) against a step of exactly that size, both timed one call at a time in one loop.

Run: ``python -m benchmarks.buckets [--steps 200] [--out DIR]`` (``--out`` appends the run, with its versions and
command line, to ``DIR/<date>-<gpu>-buckets.md``). Without a GPU it runs a short loop on cudagraphex's CPU replay
backend with a model of 1 layer of width 32 (the suite's tests).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.report import append_run

__all__ = ["LoopResult", "run"]

SIZES = (1, 2, 4, 8, 16, 32)
WINDOW = 8


@dataclass
class LoopResult:
    steps: int
    graphs: int
    max_abs_error: float
    equal_tokens: int
    #: Per capture size: (median µs of a padded step, median µs of a step of exactly that size).
    times_us: dict[int, tuple[float, float]] = field(default_factory=dict)

    def table(self) -> str:
        head = (
            f"{self.steps} steps, {self.graphs} graph(s) for {len(SIZES)} capture sizes; greedy tokens equal to eager's"
            f" in {self.equal_tokens}/{self.steps} steps; largest |logit - eager logit| {self.max_abs_error:.2e}"
        )
        lines = [
            head,
            "",
            "| capture size | padded step µs (median) | step of that size µs (median) | ratio |",
            "|---|---|---|---|",
        ]
        for size, (padded, exact) in sorted(self.times_us.items()):
            lines.append(f"| {size} | {padded:.1f} | {exact:.1f} | {padded / exact:.2f} |")
        return "\n".join(lines)


def run(steps: int = 200, *, seed: int = 0, device: torch.device | None = None) -> LoopResult:
    """The serving loop of the module docstring."""
    import thunder
    from thunder.tests.nanogpt_model import GPT, GPTConfig

    from benchmarks.variants import graph_backend, graph_executor
    from cudagraphex import explain, graph_step

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    executor = graph_executor(device)
    torch.manual_seed(seed)
    layers, width = (4, 128) if on_gpu else (1, 32)  # a tiny model on the CPU, for the tests
    config = GPTConfig(block_size=64, vocab_size=512, n_layer=layers, n_head=4, n_embd=width, dropout=0.0)
    model = GPT(config).to(device).eval()
    compiled = thunder.jit(model, executors=[executor, *thunder.get_default_executors()])

    def serve(tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return compiled(tokens)[0]

    step = graph_step(serve, capture_sizes=SIZES, backend=graph_backend(device))
    step.prepare(torch.randint(0, config.vocab_size, (3, WINDOW), device=device))

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize(device)

    rng = random.Random(seed)
    schedule = [rng.randint(1, SIZES[-1]) for _ in range(steps)]
    schedule += [s for s in SIZES for _ in range(max(3, steps // 20))]  # steps of exactly each size, for the ratio
    rng.shuffle(schedule)
    padded: dict[int, list[float]] = {s: [] for s in SIZES}
    exact: dict[int, list[float]] = {s: [] for s in SIZES}
    worst, equal = 0.0, 0
    for rows in schedule:
        tokens = torch.randint(0, config.vocab_size, (rows, WINDOW), device=device)
        sync()
        start = time.perf_counter()
        logits = step(tokens)
        sync()
        elapsed = (time.perf_counter() - start) * 1e6
        size = next(s for s in SIZES if s >= rows)
        (exact if size == rows else padded)[size].append(elapsed)
        with torch.no_grad():
            want = model(tokens)[0]
        worst = max(worst, (logits - want).abs().max().item())
        equal += bool(torch.equal(logits.argmax(-1), want.argmax(-1)))
    times = {s: (statistics.median(padded[s]), statistics.median(exact[s])) for s in SIZES if padded[s] and exact[s]}
    return LoopResult(len(schedule), explain(step).graphs, worst, equal, times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.buckets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of a random batch size (default 200)")
    parser.add_argument("--out", type=Path, help="also append the run to OUT/<date>-<gpu>-buckets.md")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    text = run(args.steps).table()
    print(text)
    if args.out is not None:
        print(f"Appended to {append_run(args.out, 'buckets', 'cudagraphex: batch-size buckets', argv, text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
