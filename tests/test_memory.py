"""Memory given back: after ``del`` of a compiled function and its model, nothing of theirs stays allocated.

For inference and training, region and whole-step graphs. On the CPU replay backend the tests check that nothing keeps
the model's parameters alive; on CUDA, also that no block of the caching allocator allocated during the round is still
allocated after it. A first round builds the process-wide caches (cuBLAS's workspace for the capture stream, Thunder's
caches); the second round must then leave nothing behind. Blocks, not ``memory_allocated()``: a free of something
older during the round (a cache another test filled) would hide a leak of the same size in the byte count.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from benchmarks.models import mlp
from cudagraphex import graph_step
from tests.helpers import jit


def _live_blocks() -> set[tuple[int, int]]:
    """(address, size) of every block the caching allocator holds allocated, once garbage is collected."""
    gc.collect()
    if not torch.cuda.is_available():
        return set()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {
        (block["address"], block["size"])
        for segment in torch.cuda.memory_snapshot()
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    }


def _run_and_delete(backend, kind: str) -> weakref.ref:
    """Builds a model and a compiled function of the given ``kind``, calls it 4 times, deletes both."""
    model = mlp(3, 64).to(backend.device)
    probe = weakref.ref(next(model.parameters()))
    compiled = jit(model, backend.executor)
    x = torch.randn(8, 64, device=backend.device)
    if kind == "inference":
        with torch.no_grad():
            for _ in range(4):
                out = compiled(x)
    elif kind == "training":
        for _ in range(4):
            out = compiled(x).square().mean()
            out.backward()
    else:
        stepped = _whole_step(compiled, model, backend)
        for _ in range(4):
            out = stepped(x)
        del stepped
    del out, compiled, model, x
    return probe


def _whole_step(compiled, model, backend):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    def step(x):
        opt.zero_grad()
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return graph_step(step, modules=[model], optimizers=[opt], backend=backend.name)


@pytest.mark.parametrize("kind", ["inference", "training", "whole_step"])
def test_deleting_the_function_and_model_gives_back_their_memory(backend, kind):
    _run_and_delete(backend, kind)
    before = _live_blocks()
    probe = _run_and_delete(backend, kind)
    left = _live_blocks() - before
    assert probe() is None, "something still holds the model's parameters"
    assert not left, f"{len(left)} blocks, {sum(size for _, size in left) / 2**20:.2f} MiB, still allocated"


_FIRST_CAPTURES = """
import torch
from benchmarks.models import mlp
from cudagraphex import explain
from tests.helpers import BACKENDS, jit
from tests.test_memory import _whole_step

backend = BACKENDS["cuda"]
model = mlp(3, 64).cuda()
compiled = jit(model, backend.executor)
fn = compiled if "{kind}" == "regions" else _whole_step(compiled, model, backend)
x = torch.randn(8, 64, device="cuda")
for _ in range(4):
    out = fn(x)
    if "{kind}" == "regions":
        out.square().mean().backward()
print(explain(fn).pool_bytes)
"""


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["regions", "whole_step"])
def test_the_first_captures_of_a_process_keep_cublas_workspaces_out_of_their_pool(kind):
    """cuBLAS keeps a workspace (32 MiB on an H100) per thread and stream for the life of the process. The first
    captures on the capture stream, on the caller's thread and autograd's, find theirs allocated outside the pool."""
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_CAPTURES.format(kind=kind)],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    pool_bytes = int(done.stdout.split()[-1])
    assert 0 < pool_bytes < 8 * 2**20, f"{pool_bytes / 2**20:.1f} MiB"
