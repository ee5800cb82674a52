"""Hugging Face ``generate`` end to end, the way a user serves a model.

``LlamaForCausalLM`` with Llama-3.2-1B's configuration (random weights, bf16, nothing downloaded), greedy
``model.generate(..., cache_implementation="static", max_new_tokens=100)`` at batch 1, with the model's forward
replaced by a compiled one. Each variant is timed end to end (ms per ``generate``, tokens per second) in rounds, one
``generate`` of every variant per round. Its generated tokens are compared with eager's and, for a variant with graphs,
with those of the same Thunder program without graphs (``WITHOUT_GRAPHS``) where that variant runs too: graphs must
not change them.

Variants:

* ``hf-reduce-overhead``: Hugging Face's own recipe: on a GPU, ``generate`` with a static cache compiles the model's
  call with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` by itself. Built and timed first, before any other
  variant is built, and not run again: CUDA-graph trees may record again in a later ``generate``, and a recording frees
  cuBLAS's workspaces, which graphs captured by then still use (an illegal memory access on the H200).
* ``eager``: the model as it is, with that automatic compilation switched off (``disable_compile=True``), as it is for
  every variant below.
* ``thunder``: ``thunder.jit(model.forward)``.
* ``thunder+torchcompile``: with Thunder's torch.compile executor.
* ``thunder+CUDAGraphTransform``: with Thunder's ``CUDAGraphTransform``.
* ``thunder+cudagraphex``: cudagraphex first in the executors.
* ``thunder+torchcompile+cudagraphex``: cudagraphex, then Thunder's torch.compile executor (the fused stack for a
  machine without nvFuser).
* ``thunder+cudagraphex-step``, ``thunder+torchcompile+cudagraphex-step`` (the recommended stack): the forward of
  ``thunder+cudagraphex`` or ``thunder+torchcompile+cudagraphex``, returning the logits, through
  ``cudagraphex.graph_step``: after warm-up a decode step (and the prefill) replays one graph. The static cache's
  tensors are passed to the step as buffers of a module, so that its guards check them (a step graph writes them where
  they were at the capture).

The path needs transformers 4.46-4.55 (the range Thunder's Hugging Face recipe supports; setup.cfg pins 4.55.4 for the
benchmarks): under 5.x, ``thunder.jit`` of ``LlamaForCausalLM.forward`` fails. Without a GPU the same code runs a tiny
configuration in float32 with cudagraphex's CPU replay backend (the suite's tests).

Run: ``python -m benchmarks.generate [--new-tokens 100] [--rounds 5] [--layers 16] [--variants a,b] [--out DIR]``;
``--out`` appends the run, with its versions and command line, to ``DIR/<date>-<gpu>-generate.md``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["VARIANTS", "Row", "run"]

#: Hugging Face's own compilation: built and timed before any other variant, never run again (module docstring).
HF_RECIPE = "hf-reduce-overhead"
VARIANTS = (
    HF_RECIPE,
    "eager",
    "thunder",
    "thunder+torchcompile",
    "thunder+CUDAGraphTransform",
    "thunder+cudagraphex",
    "thunder+torchcompile+cudagraphex",
    "thunder+cudagraphex-step",
    "thunder+torchcompile+cudagraphex-step",
)


@dataclass
class Row:
    variant: str
    #: Median over the timed rounds, or None where the variant failed.
    ms_per_generate: float | None
    tokens_per_s: float | None
    #: How many of the generated tokens, from the first, equal eager's.
    equal_tokens: int
    new_tokens: int
    setup_s: float
    error: str | None = None
    #: The step variants: their step graphs' captures and replays.
    note: str | None = None
    #: How many of the generated tokens, from the first, equal those of the same Thunder program without graphs (None
    #: where this variant has no such program or it did not run).
    equal_without_graphs: int | None = None


#: The Thunder program each graph variant runs, without graphs.
WITHOUT_GRAPHS = {
    "thunder+CUDAGraphTransform": "thunder",
    "thunder+cudagraphex": "thunder",
    "thunder+cudagraphex-step": "thunder",
    "thunder+torchcompile+cudagraphex": "thunder+torchcompile",
    "thunder+torchcompile+cudagraphex-step": "thunder+torchcompile",
}


def _forward_of(variant: str, model: torch.nn.Module, cudagraphex_executor) -> Callable:
    """The forward ``variant`` gives ``model`` (the model's own for eager and Hugging Face's recipe)."""
    if variant in ("eager", HF_RECIPE):
        return model.forward
    if variant in VARIANTS:
        import thunder

        from benchmarks.variants import thunder_options

        jitted = thunder.jit(model.forward, **thunder_options(variant.removesuffix("-step"), cudagraphex_executor))
        return _stepped(jitted, model) if variant.endswith("-step") else jitted
    raise ValueError(f"unknown variant {variant!r}; the variants: {', '.join(VARIANTS)}")


def _stepped(forward: Callable, model: torch.nn.Module) -> Callable:
    """``forward``, returning only the logits, through ``cudagraphex.graph_step``: one step per KV cache object, with
    the model and the cache's tensors (as buffers of a module) as its state."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    import cudagraphex
    from benchmarks.models import cache_state
    from benchmarks.variants import graph_backend

    backend = graph_backend(next(model.parameters()).device)
    steps: dict[int, tuple[object, Callable]] = {}

    def logits(**kwargs: object) -> torch.Tensor:
        return forward(**kwargs).logits

    # Hugging Face picks the inputs it passes (the 4-D attention mask of a static cache) from the forward's signature.
    @functools.wraps(forward)
    def stepped(**kwargs: object) -> CausalLMOutputWithPast:
        cache = kwargs.get("past_key_values")
        cache_obj, step = steps.get(id(cache), (None, None))
        if cache_obj is not cache:
            state = cache_state(getattr(cache, "layers", ()))
            step = cudagraphex.graph_step(logits, modules=[model, state], backend=backend)
            steps[id(cache)] = (cache, step)
        return CausalLMOutputWithPast(logits=step(**kwargs), past_key_values=cache)

    def summary() -> str:
        reports = [cudagraphex.explain(step) for _, step in steps.values()]
        captures, replays = sum(r.captures for r in reports), sum(r.replays for r in reports)
        text = f"step graphs: {captures} capture(s), {replays} replay(s)"
        return text + "".join(f"; not captured: {r.not_captured}" for r in reports if r.not_captured)

    stepped.summary = summary
    return stepped


def run(
    variants: Sequence[str] = VARIANTS,
    *,
    new_tokens: int = 100,
    rounds: int = 5,
    prompt_tokens: int = 16,
    layers: int | None = None,
    device: torch.device | None = None,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Builds the model once, gives it each variant's forward in turn, and times ``generate`` in rounds.

    Each variant first runs two ``generate`` calls (compilation, warm-up, capture), whose tokens are the ones compared
    with eager's. A variant that fails gets a row with its error; the others go on.
    """
    from transformers import LlamaForCausalLM

    from benchmarks.models import llama_1b_config
    from benchmarks.report import short_error
    from benchmarks.variants import graph_executor

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    executor = graph_executor(device)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = LlamaForCausalLM(llama_1b_config(tiny=not on_gpu, layers=layers)).to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), device=device)
    options = {"do_sample": False, "cache_implementation": "static", "max_new_tokens": new_tokens, "pad_token_id": 0}
    own_forward = model.forward

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize(device)

    def generate(variant: str, forward: Callable) -> torch.Tensor:
        model.forward = forward
        try:
            return model.generate(prompt, disable_compile=variant != HF_RECIPE, **options)[0, prompt_tokens:]
        finally:
            model.forward = own_forward

    def time_one(variant: str, forward: Callable, times: list[float]) -> None:
        sync()
        start = time.perf_counter()
        generate(variant, forward)
        sync()
        times.append(time.perf_counter() - start)

    # reduce-overhead first (module docstring); eager always, for the tokens every variant is compared with
    order = [v for v in VARIANTS if v in variants or v == "eager"]
    forwards: dict[str, Callable] = {}
    rows: dict[str, Row] = {}
    generated: dict[str, torch.Tensor] = {}
    times: dict[str, list[float]] = {}
    for variant in order:
        start = time.perf_counter()
        try:
            forward = _forward_of(variant, model, executor)
            generate(variant, forward)
            generated[variant] = generate(variant, forward)
            sync()
        except Exception as e:  # noqa: BLE001 - recorded; the other variants go on
            error = short_error(e)
            rows[variant] = Row(variant, None, None, 0, new_tokens, time.perf_counter() - start, error)
            log(f"{variant}: failed: {error}")
            continue
        forwards[variant] = forward
        rows[variant] = Row(variant, None, None, 0, new_tokens, time.perf_counter() - start)
        log(f"{variant}: set up in {rows[variant].setup_s:.1f} s")
        times[variant] = []
        if variant == HF_RECIPE:  # timed now, never run again
            for _ in range(rounds):
                time_one(variant, forward, times[variant])
    if "eager" not in generated:
        raise RuntimeError(f"eager generate failed: {rows['eager'].error}")
    for variant, tokens in generated.items():
        rows[variant].equal_tokens = _equal_prefix(tokens, generated["eager"])
        plain = generated.get(WITHOUT_GRAPHS.get(variant, ""))
        if plain is not None:
            rows[variant].equal_without_graphs = _equal_prefix(tokens, plain)

    for _ in range(rounds):
        for variant, forward in forwards.items():
            if variant != HF_RECIPE:
                time_one(variant, forward, times[variant])
    for variant, samples in times.items():
        ms = statistics.median(samples) * 1e3
        rows[variant].ms_per_generate = ms
        rows[variant].tokens_per_s = new_tokens / ms * 1e3
        if hasattr(forwards[variant], "summary"):
            rows[variant].note = forwards[variant].summary()
    return [rows[v] for v in order if v in rows]


def _equal_prefix(tokens: torch.Tensor, reference: torch.Tensor) -> int:
    return int((tokens == reference).int().cumprod(0).sum())


def table(rows: Sequence[Row]) -> str:
    eager = next((r.ms_per_generate for r in rows if r.variant == "eager"), None)
    lines = [
        (
            "| variant | ms per generate | tokens/s | x eager | tokens equal to eager's | tokens equal without graphs"
            " | setup s | error or note |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = "–" if r.ms_per_generate is None else f"{r.ms_per_generate:.1f}"
        rate = "–" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}"
        ratio = "–" if r.ms_per_generate is None or not eager else f"{r.ms_per_generate / eager:.2f}"
        plain = "–" if r.equal_without_graphs is None else f"{r.equal_without_graphs}/{r.new_tokens}"
        lines.append(
            f"| {r.variant} | {ms} | {rate} | {ratio} | {r.equal_tokens}/{r.new_tokens} | {plain} | {r.setup_s:.1f} |"
            f" {r.error or r.note or ''} |"
        )
    return "\n".join(lines)


def write_run(rows: Sequence[Row], argv: Sequence[str], out_dir: Path) -> Path:
    """Appends this run to ``<out_dir>/<date>-<gpu>-generate.md`` (see ``benchmarks.report.append_run``); each run's
    ratios are to its own eager row."""
    from benchmarks.report import append_run

    return append_run(out_dir, "generate", "cudagraphex: Hugging Face `generate`", argv, table(rows))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.generate",
        description=__doc__.split("\n\n")[0],
        epilog="variants: " + ", ".join(VARIANTS),
    )
    parser.add_argument("--variants", help="comma-separated (names below); default all")
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, help="decoder layers (default: Llama-3.2-1B's 16)")
    parser.add_argument("--out", type=Path, help="also append the run to OUT/<date>-<gpu>-generate.md")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    variants = VARIANTS if args.variants is None else tuple(args.variants.split(","))
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; the variants: {', '.join(VARIANTS)}")
    rows = run(variants, new_tokens=args.new_tokens, rounds=args.rounds, layers=args.layers)
    print(table(rows))
    if args.out is not None:
        print(f"Appended to {write_run(rows, argv, args.out)}")
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
