"""The contract as a whole: a randomized check against eager, and the INFO log of captures and fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch

from benchmarks.models import GPT, GPTConfig
from tests.contract.scenarios import accumulate, held_outputs_survive
from tests.helpers import assert_grads_close, emulated, jit, twin


@pytest.mark.parametrize("seed", range(3))
def test_randomized_against_eager(backend, seed):
    """Interleaves new shapes, held outputs, out-of-order backwards and in-place inputs, and compares with eager."""
    rng = torch.Generator().manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)).to(backend.device)
    reference = twin(model)
    jm = jit(model, backend.executor)
    jacc = jit(accumulate, backend.executor)
    buf, ref_buf = torch.zeros(4, device=backend.device), torch.zeros(4, device=backend.device)
    held, pending = [], []
    steps = 40 if backend.name == "cuda" else 16
    for _ in range(steps):
        action = int(torch.randint(0, 5, (), generator=rng))
        batch, length = (
            int(torch.randint(1, 3, (), generator=rng)),
            int(torch.randint(8, 17, (), generator=rng)) // 8 * 8,
        )
        idx = torch.randint(0, 64, (batch, length), generator=rng).to(backend.device)
        if action == 0:  # inference, output kept
            with torch.no_grad():
                out = jm(idx)
                torch.testing.assert_close(out, reference(idx))
                held.append((out, out.clone()))
        elif action in (1, 2):  # a forward whose backward runs later, maybe out of order
            pending.append((jm(idx).square().mean(), reference(idx).square().mean()))
            if len(pending) > 2 or action == 2:
                loss, ref = pending.pop(int(torch.randint(0, len(pending), (), generator=rng)))
                torch.testing.assert_close(loss, ref)
                loss.backward()
                ref.backward()
                assert_grads_close(model, reference, atol=1e-5, rtol=1e-4)
        elif action == 3:
            x = torch.randn(4, generator=rng).to(backend.device)
            torch.testing.assert_close(jacc(buf, x), accumulate(ref_buf, x))
            torch.testing.assert_close(buf, ref_buf)
        else:
            model.zero_grad()
            reference.zero_grad()
        for out, snapshot in held:
            assert torch.equal(out, snapshot)
    for loss, ref in pending:
        loss.backward()
        ref.backward()
    assert_grads_close(model, reference, atol=1e-5, rtol=1e-4)


def test_info_logs_name_captures_and_fallbacks(caplog):
    with caplog.at_level(logging.INFO, logger="cudagraphex"):
        assert held_outputs_survive(emulated)
    messages = [r.getMessage() for r in caplog.records if r.name == "cudagraphex"]
    assert any("captured graph 1" in m for m in messages)
    assert any("returned as a copy from now on" in m for m in messages)
