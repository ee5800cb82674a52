"""Data-parallel training of a small nanoGPT with Thunder's DDP or FSDP, with and without cudagraphex.

Each rank trains on its shard of a global batch; the per-step losses (averaged over ranks) must match a
single-process reference that trains on the whole batch. Launch with torchrun (NCCL on GPUs), or as one process on
the CPU (gloo, world size 1, DDP only: Thunder's FSDP needs CUDA).

    torchrun --nproc-per-node 2 tests/distributed_worker.py --mode fsdp-zero3 --backend cuda
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import thunder
import torch
import torch.distributed as dist
from thunder.distributed import FSDPType, ddp, fsdp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.models import GPT, GPTConfig
from cudagraphex import CUDAGraphExecutor, explain
from cudagraphex.executor import cudagraphex

BATCH_PER_RANK, TOKENS = 2, 16


def train(model, mode, executors, data, rank, world, lr=0.1):
    jm = thunder.jit(model, executors=executors)
    if mode == "ddp":
        jm = ddp(jm)
    else:
        jm = fsdp(jm, sharding_strategy=FSDPType.ZERO2 if mode == "fsdp-zero2" else FSDPType.ZERO3)
    opt = torch.optim.SGD(jm.parameters(), lr=lr)
    losses, start = [], None
    for step, (idx, targets) in enumerate(data):
        if step == 2:
            torch.cuda.synchronize() if idx.is_cuda else None
            start = time.perf_counter()
        shard = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        loss = jm(idx[shard], targets[shard])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    torch.cuda.synchronize() if data[0][0].is_cuda else None
    steps_per_s = (len(data) - 2) / (time.perf_counter() - start)
    return jm, losses, steps_per_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "fsdp-zero2", "fsdp-zero3"], default="ddp")
    parser.add_argument("--backend", choices=["cuda", "emulate"], default="cuda")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    on_gpu = args.backend == "cuda"
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
        ex = cudagraphex
    else:
        ex = CUDAGraphExecutor("cudagraphex_emulate_dist", backend="emulate")

    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=TOKENS, vocab_size=128)
    base = GPT(config).to(device)
    batch = (world * BATCH_PER_RANK, TOKENS)
    data = [
        (torch.randint(0, 128, batch, device=device), torch.randint(0, 128, batch, device=device))
        for _ in range(args.steps)
    ]

    reference = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_losses = []
    for idx, targets in data:
        loss = reference(idx, targets)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())

    results = {}
    for name, executors in (
        ("thunder", thunder.get_default_executors()),
        ("thunder+cudagraphex", [ex, *thunder.get_default_executors()]),
    ):
        jm, losses, steps_per_s = train(copy.deepcopy(base), args.mode, executors, data, rank, world)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
        results[name] = steps_per_s
        if name == "thunder+cudagraphex":
            report = explain(jm)
            breaks = {b.reason for t in report.traces for b in t.breaks}
            assert report.num_graphs >= 2, report
            assert "is a distributed communication op" in breaks, breaks
    if rank == 0:
        speed = ", ".join(f"{k}: {v:.1f} steps/s" for k, v in results.items())
        print(f"OK {args.mode} world={world} losses match the single-process reference; {speed}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
