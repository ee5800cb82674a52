"""Helpers for the tests: the two backends, jitting with cudagraphex in either list position, and graph inspection."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import thunder
import torch
from thunder.extend import register_executor
from torch import nn

from benchmarks.models import GPT, GPTConfig
from cudagraphex import CUDAGraphExecutor, cudagraphex, inspect
from cudagraphex._protections import PROTECTIONS
from cudagraphex.runtime import FunctionGraphs, GraphedRegion

emulated = CUDAGraphExecutor("cudagraphex_emulate", backend="emulate")
register_executor(emulated)


@dataclass(frozen=True)
class Backend:
    name: str
    executor: CUDAGraphExecutor
    device: str


BACKENDS = {"emulate": Backend("emulate", emulated, "cpu"), "cuda": Backend("cuda", cudagraphex, "cuda")}


def executors(ex: CUDAGraphExecutor, position: str = "first") -> list:
    if position == "first":
        return [ex, *thunder.get_default_executors()]
    assert position == "last"
    return [*thunder.get_default_executors(), ex]


def jit(fn, ex: CUDAGraphExecutor, position: str = "first", **kwargs):
    return thunder.jit(fn, executors=executors(ex, position), **kwargs)


def graphs(jfn, ex: CUDAGraphExecutor) -> FunctionGraphs:
    (found,) = inspect(jfn).graphs(ex.name)
    return found


def regions(jfn, ex: CUDAGraphExecutor, phase: str | None = None) -> list[GraphedRegion]:
    return inspect(jfn).regions(ex.name, phase)


def num_graphs(jfn, ex: CUDAGraphExecutor, phase: str | None = None) -> int:
    return inspect(jfn).num_graphs(ex.name, phase)


def replays(jfn, ex: CUDAGraphExecutor) -> int:
    return inspect(jfn).replays(ex.name)


@contextmanager
def protection_off(*names: str):
    """Switches protections off, to show that a test fails without them."""
    saved = {n: PROTECTIONS[n] for n in names}
    try:
        for n in names:
            assert n in PROTECTIONS, n
            PROTECTIONS[n] = False
        yield
    finally:
        PROTECTIONS.update(saved)


def twin(module: torch.nn.Module) -> torch.nn.Module:
    """An independent copy of ``module``, for the eager reference."""
    return copy.deepcopy(module)


def assert_grads_close(module: torch.nn.Module, reference: torch.nn.Module, **kwargs) -> None:
    for (name, p), r in zip(module.named_parameters(), reference.parameters(), strict=True):
        if p.grad is None or r.grad is None:
            assert p.grad is None and r.grad is None, name
            continue
        torch.testing.assert_close(p.grad, r.grad, msg=lambda m, name=name: f"grad of {name}: {m}", **kwargs)


def errors_in_threads(worker: Callable[[int], None], seeds: tuple[int, ...] = (1, 2)) -> list[str]:
    """Runs ``worker(seed)`` in one thread per seed, all at once; returns what each raised, as ``repr``."""
    errors: list[str] = []

    def run(seed: int) -> None:
        try:
            worker(seed)
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(seed,)) for seed in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def install_cuda_device_guard() -> None:
    """Installs torch's CUDA device guard in this thread, on a machine without CUDA.

    FakeTensorMode (Thunder enters it to trace some ops) installs a no-op guard on first use; installed from a thread
    that then exits, it leaves the process to crash at its next use (torch 2.11). Tests compile in threads.
    """
    if not torch.cuda.is_available():
        torch._C._ensureCUDADeviceGuardSet()


def small_gpt(device: str) -> GPT:
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)).to(device)


def with_item(x):
    y = torch.sin(x) * 2 + 1
    s = y.sum().item()  # a host read in the middle: the graph breaks here
    return (torch.cos(y) * 3 + x).exp() * s


def square_written_by_its_own_mul(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    square = x.square()
    square.mul_(x)  # its gradient for x reads the square as it was before the write (eager's original_self)
    return square, x.sum()


def conv_bn(channels: int = 8) -> nn.Sequential:
    """A small conv + BatchNorm + ReLU network (BatchNorm updates its running statistics in training mode)."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, 10),
    )
