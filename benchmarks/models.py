"""Models shared by the benchmarks and the tests: small, self-contained, with nothing downloaded."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def mlp(depth: int = 16, width: int = 256) -> nn.Sequential:
    """``depth`` × (Linear(width, width), GELU)."""
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


@dataclass
class GPTConfig:
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 64
    vocab_size: int = 512
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.dropout(self.proj(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    """A nanoGPT-style decoder: token and position embeddings, ``n_layer`` blocks, a tied language-model head.

    ``forward(idx)`` returns logits; ``forward(idx, targets)`` returns the cross-entropy loss.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class _LogitsOrLoss(nn.Module):
    """Calls a nanoGPT whose ``forward(idx, targets)`` returns ``(logits, loss)``; returns the loss when given
    targets, else the logits."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits, loss = self.gpt(idx, targets)
        return logits if targets is None else loss


def thunder_nanogpt(config) -> nn.Module:
    """Thunder's test copy of nanoGPT (``thunder.tests.nanogpt_model.GPT`` with its ``GPTConfig`` ``config``), called
    as :class:`GPT` is: ``forward(idx)`` returns the logits, ``forward(idx, targets)`` the cross-entropy loss."""
    from thunder.tests.nanogpt_model import GPT as ThunderGPT

    return _LogitsOrLoss(ThunderGPT(config))


class LlamaDecodeStep(nn.Module):
    """One-token decode steps of a Hugging Face ``LlamaForCausalLM`` against a static KV cache kept as state.

    ``forward(input_ids, cache_position)`` takes ``input_ids`` (batch, 1) and a 1-element int64 ``cache_position`` P;
    it writes the token's keys and values at position P, attends to positions 0..P and returns the logits (batch, 1,
    vocab). The same arguments repeat the same work and give the same logits.

    For ``thunder.jit`` it calls the model's submodules instead of ``LlamaModel.forward`` (whose ``capture_outputs``
    writes a module-level variable, which Thunder refuses), and builds the boolean mask from ``cache_position``. The
    cache is transformers' ``StaticCache``; its tensors are also buffers of ``kv``, so that ``graph_step`` guards them
    as state. Under transformers 5.x the layers write at a running counter (``cumulative_length``), which the step
    first sets to ``cache_position``; under 4.5x they write at ``cache_position``.
    """

    def __init__(self, model: nn.Module, cache, max_cache_len: int, cache_kwarg: str):
        super().__init__()
        self.model = model
        self.cache = cache
        self.cache_kwarg = cache_kwarg
        self.counted = hasattr(cache.layers[0], "cumulative_length")
        self.register_buffer("kv_positions", torch.arange(max_cache_len), persistent=False)
        # The cache's tensors as buffers, so that graph_step guards them as the step's state.
        self.kv = nn.Module()
        for i, layer in enumerate(cache.layers):
            self.kv.register_buffer(f"keys_{i}", layer.keys, persistent=False)
            self.kv.register_buffer(f"values_{i}", layer.values, persistent=False)
            if self.counted:
                self.kv.register_buffer(f"length_{i}", layer.cumulative_length, persistent=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        if self.counted:
            for layer in self.cache.layers:
                layer.cumulative_length.copy_(cache_position[0])
        attention_mask = (self.kv_positions <= cache_position[-1]).view(1, 1, 1, -1)
        position_ids = cache_position.unsqueeze(0)
        decoder = self.model.model
        hidden = decoder.embed_tokens(input_ids)
        position_embeddings = decoder.rotary_emb(hidden, position_ids)
        cache_arg = {self.cache_kwarg: self.cache}
        if not self.counted:
            cache_arg["cache_position"] = cache_position
        for layer in decoder.layers:
            hidden = layer(
                hidden,
                attention_mask=attention_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=True,
                **cache_arg,
            )
        return self.model.lm_head(decoder.norm(hidden))


def llama_decode(
    *,
    num_layers: int = 4,
    hidden_size: int = 512,
    num_heads: int = 8,
    intermediate_size: int = 1408,
    vocab_size: int = 32000,
    max_cache_len: int = 256,
    batch_size: int = 1,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LlamaDecodeStep:
    """A :class:`LlamaDecodeStep` around a randomly initialised ``LlamaForCausalLM`` (nothing is downloaded).

    The whole cache is filled with random keys and values, standing in for a prompt: the mask decides which positions
    a step reads. Raises ImportError if ``transformers`` is not installed.
    """
    import inspect

    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max(2048, max_cache_len),
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)
    head_dim = hidden_size // num_heads
    try:
        cache = StaticCache(config=config, max_cache_len=max_cache_len)
    except TypeError:  # transformers 4.5x allocates the layers with the cache, so it needs their sizes
        cache = StaticCache(
            config=config, max_batch_size=batch_size, max_cache_len=max_cache_len, device=device, dtype=dtype
        )
    else:
        cache.early_initialization(batch_size, num_heads, head_dim, dtype, torch.device(device))
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
    # The decoder layers' cache argument is ``past_key_value`` (4.5x), ``past_key_values``, then ``cache`` (5.2x).
    parameters = inspect.signature(LlamaDecoderLayer.forward).parameters
    cache_kwarg = next(name for name in ("cache", "past_key_values", "past_key_value") if name in parameters)
    return LlamaDecodeStep(model, cache, max_cache_len, cache_kwarg).to(device)


def llama_1b_config(tiny: bool = False, layers: int | None = None):
    """Llama-3.2-1B's configuration with ``layers`` decoder layers (default 16); ``tiny``: width 64, vocabulary 256
    and 2 layers by default, for the CPU."""
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope["original_max_position_embeddings"] = 8192
    shared = {"rope_scaling": rope, "rope_theta": 500000.0, "tie_word_embeddings": True}
    if tiny:  # max_position_embeddings above the rope scaling's original 8192, as the real config's
        sizes = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
        sizes |= {"vocab_size": 256, "max_position_embeddings": 16384, "num_hidden_layers": layers or 2}
    else:
        sizes = {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8}
        sizes |= {"head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5}
        sizes |= {"num_hidden_layers": layers or 16}
    return LlamaConfig(**(shared | sizes))


class CausalLMLoss(nn.Module):
    """A Hugging Face causal language model for training: ``forward(input_ids, labels)`` returns its own loss.

    Attention runs through ``causal_sdpa`` (causal SDPA, key/value heads repeated for grouped-query attention):
    ``thunder.jit`` cannot trace Hugging Face's ``sdpa`` path in training (its mask builder takes the ``torch.vmap``
    path, and it passes ``enable_gqa``, which Thunder 0.2.6's SDPA does not accept).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        from transformers import AttentionInterface

        AttentionInterface.register("causal_sdpa", _causal_sdpa)
        model.config._attn_implementation = "causal_sdpa"
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def _causal_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention for :class:`CausalLMLoss`; the mask is ignored (no padding)."""
    from transformers.models.llama.modeling_llama import repeat_kv

    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True)
    return out.transpose(1, 2).contiguous(), None
