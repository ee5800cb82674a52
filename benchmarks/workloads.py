"""The benchmark workloads: what model, what inputs, which modes, in which dtype.

Every workload is built from a fixed seed, so two builds on one device hold the same weights and inputs. ``plan=True``
builds the reduced version the CPU capture plan compiles (Thunder's tracing takes seconds per layer on a CPU; the
graph structure repeats per layer, so one or a few layers show the same plan).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks.cases import MODES
from benchmarks.models import GPT, CausalLMLoss, GPTConfig, llama_1b_config, llama_decode, mlp, thunder_nanogpt


@dataclass
class Setup:
    """A built workload: a model and the arguments of its calls, on one device.

    ``train_args`` is None for an inference-only workload. ``train_step`` calls ``model(*train_args)``; an output
    that is not a scalar loss is backpropagated with a fixed random cotangent.
    """

    model: nn.Module
    inference_args: tuple[torch.Tensor, ...]
    train_args: tuple[torch.Tensor, ...] | None
    dtype: torch.dtype
    #: For the CPU plan: what was made smaller than the real workload (empty when nothing was).
    reduced: str = ""

    def fresh_model(self) -> nn.Module:
        """An independent copy of the model (each variant gets its own, so no variant sees another's state)."""
        return copy.deepcopy(self.model)

    def args(self, mode: str) -> tuple[torch.Tensor, ...]:
        if mode == "inference":
            return self.inference_args
        if self.train_args is None:
            raise ValueError(f"mode {mode} is not supported by this workload")
        return self.train_args


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    modes: tuple[str, ...]
    #: (device, plan) -> Setup
    build: Callable[[torch.device, bool], Setup] = field(repr=False)
    needs_transformers: bool = False


def _build_mlp(device: torch.device, plan: bool) -> Setup:
    torch.manual_seed(0)
    model = mlp(4 if plan else 16, 256).to(device)
    x = torch.randn(8, 256, device=device)
    return Setup(model, (x,), (x,), torch.float32, "4 of the 16 (Linear, GELU) layers" if plan else "")


def _gpt(config, batch: int, tokens: int, dtype: torch.dtype, make=GPT, reduced: str = "", plan=None):
    """The builder of ``make(config)`` (a GPT that returns the loss when given targets) with random tokens and
    targets. For the CPU plan it builds ``plan`` (another builder) if given, else the model with one layer, which
    ``reduced`` describes."""

    def build(device: torch.device, for_plan: bool) -> Setup:
        if for_plan and plan is not None:
            return plan(device, True)
        torch.manual_seed(0)
        model = make(dataclasses.replace(config, n_layer=1) if for_plan else config).to(device=device, dtype=dtype)
        idx, targets = (torch.randint(0, config.vocab_size, (batch, tokens), device=device) for _ in range(2))
        return Setup(model, (idx,), (idx, targets), dtype, reduced if for_plan else "")

    return build


#: The reduced GPT of the 12-layer workloads' CPU plan.
_PLAN_GPT = _gpt(
    GPTConfig(n_layer=1, n_head=2, n_embd=128, block_size=64, vocab_size=512, dropout=0.0),
    1,
    32,
    torch.float32,
    reduced="1 of 12 layers, d=128, vocab 512, batch 1, 32 tokens, fp32",
)


def _build_nanogpt_thunder_tests(device: torch.device, plan: bool) -> Setup:
    from thunder.tests.nanogpt_model import GPTConfig as ThunderGPTConfig

    config = ThunderGPTConfig(block_size=64, vocab_size=512, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    return _gpt(config, 2, 64, torch.float32, thunder_nanogpt, "1 of the 4 layers")(device, plan)


def _build_llama(device: torch.device, plan: bool) -> Setup:
    torch.manual_seed(0)
    if plan:
        sizes = {"num_layers": 1, "hidden_size": 128, "num_heads": 4, "intermediate_size": 352, "vocab_size": 1000}
        sizes["max_cache_len"] = 64
        dtype = torch.float32
    else:
        sizes = {}
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = llama_decode(device=device, dtype=dtype, **sizes)
    position = 32
    input_ids = torch.randint(0, model.model.config.vocab_size, (1, 1), device=device)
    cache_position = torch.tensor([position], device=device)
    reduced = "1 of 4 layers, hidden 128, vocab 1000, cache 64" if plan else ""
    return Setup(model, (input_ids, cache_position), None, dtype, reduced)


def _build_llama_train(device: torch.device, plan: bool) -> Setup:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    dtype = torch.float32 if plan else torch.bfloat16
    batch, tokens = (1, 32) if plan else (2, 1024)
    model = CausalLMLoss(LlamaForCausalLM(llama_1b_config(tiny=plan, layers=1 if plan else 4)))
    model = model.to(device=device, dtype=dtype)
    input_ids = torch.randint(0, model.model.config.vocab_size, (batch, tokens), device=device)
    labels = torch.randint(0, model.model.config.vocab_size, (batch, tokens), device=device)
    reduced = "1 layer of width 64, vocab 256, 32 tokens, fp32" if plan else ""
    return Setup(model, (input_ids, labels), (input_ids, labels), dtype, reduced)


_NANOGPT6 = GPTConfig(n_layer=6, n_head=4, n_embd=256, block_size=64, vocab_size=512, dropout=0.0)
# GPT-2 trains in fp32; the 12-layer d=1024 GPT in bf16 (its fp32 step's time is the GPU's, not launch overhead).
_GPT2 = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=256, vocab_size=50304, dropout=0.0, bias=True)
_GPT12 = GPTConfig(n_layer=12, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304, dropout=0.0)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "mlp16x256-b8",
            "16 x (Linear 256, GELU), batch 8, fp32",
            MODES,
            _build_mlp,
        ),
        Workload(
            "nanogpt6-d256-t32-b1",
            "nanoGPT decoder: 6 layers, d=256, 4 heads, vocab 512, 32 tokens, batch 1, fp32; training returns the loss",
            MODES,
            _gpt(_NANOGPT6, 1, 32, torch.float32, reduced="1 of the 6 layers"),
        ),
        Workload(
            "nanogpt-thunder-tests",
            "Thunder's test nanoGPT (thunder.tests.nanogpt_model.GPT): 4 layers, d=128, 4 heads, vocab 512, 64 tokens,"
            " batch 2, fp32; training returns the loss",
            MODES,
            _build_nanogpt_thunder_tests,
        ),
        Workload(
            "llama-decode",
            "HF LlamaForCausalLM (4 layers, hidden 512, 8 heads, vocab 32000, random weights), one-token decode at"
            " position 32 of a 256-long static KV cache, batch 1, bf16",
            ("inference",),
            _build_llama,
            needs_transformers=True,
        ),
        Workload(
            "llama1b-4l-train",
            "HF LlamaForCausalLM with Llama-3.2-1B's configuration cut to 4 of its 16 layers (random weights), 1024"
            " tokens, batch 2, bf16; the model's own loss; training only",
            ("train_step",),
            _build_llama_train,
            needs_transformers=True,
        ),
        Workload(
            "gpt2-124m",
            "GPT-2 124M: 12 layers, d=768, 12 heads, vocab 50304, block 256, 128 tokens, batch 1, biases, fp32",
            MODES,
            _gpt(_GPT2, 1, 128, torch.float32, plan=_PLAN_GPT),
        ),
        Workload(
            "gpt12-d1024-b8-t512",
            "GPT: 12 layers, d=1024, 16 heads, vocab 50304, 512 tokens, batch 8, bf16 weights and activations",
            MODES,
            _gpt(_GPT12, 8, 512, torch.bfloat16, plan=_PLAN_GPT),
        ),
    )
}


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True
