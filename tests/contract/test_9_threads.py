"""Contract point 9: threads."""

from __future__ import annotations

import threading
import time

import pytest
import thunder
import torch
from thunder.extend import OperatorExecutor, register_executor

from benchmarks.models import mlp
from cudagraphex.capture import is_capturing
from tests.contract.scenarios import fragile, fragile_triple
from tests.helpers import BACKENDS, emulated, errors_in_threads, jit


def test_two_threads_each_with_its_own_function(backend):
    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        model = mlp(4, 32).to(backend.device).eval()
        jm = jit(model, backend.executor)
        with torch.no_grad():
            for _ in range(20):
                x = torch.randn(8, 32, generator=g).to(backend.device)
                out = jm(x)
                assert torch.allclose(out, model(x), atol=1e-5), "wrong result"

    assert errors_in_threads(worker) == []


@pytest.mark.cuda
def test_capture_does_not_break_another_threads_kernels():
    stop = threading.Event()
    errors = []

    def busy():
        a = torch.randn(256, 256, device="cuda")
        expected = (a @ a).sum().item()
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    b = a @ a
                    stream.synchronize()  # the thread's own stream: a device-wide sync would end any capture
                    if not torch.isclose(b.sum(), torch.tensor(expected, device="cuda"), rtol=1e-4):
                        errors.append("wrong result")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        cuda = BACKENDS["cuda"].executor
        for width in (32, 48, 64, 80):
            model = mlp(3, width).cuda().eval()
            jm = jit(model, cuda)
            with torch.no_grad():
                for _ in range(4):
                    x = torch.randn(8, width, device="cuda")
                    torch.testing.assert_close(jm(x), model(x))
    finally:
        stop.set()
        thread.join()
    assert errors == []


_slow = OperatorExecutor("cudagraphex_test_slow")
register_executor(_slow)


def _slow_under_capture(x):
    if is_capturing():
        time.sleep(0.4)  # keeps this thread's capture open while the other thread runs
    return x + 1


slow_increment = _slow.register_operator("slow_increment", like=thunder.torch.neg, fn=_slow_under_capture)


def capture_in_one_thread_breaks_the_other(ex) -> bool:
    """Thread A captures a slow region while thread B runs, eagerly, an op that fails under capture."""

    def a_fn(x):
        return slow_increment(x.sin() * 2) * 3

    def b_fn(x):
        return fragile_triple(x.cos() + 1)

    ja = thunder.jit(a_fn, executors=[ex, _slow, *thunder.get_default_executors()])
    jb = thunder.jit(b_fn, executors=[fragile, *thunder.get_default_executors()])
    x = torch.randn(8)
    ja(x)  # warm-up: the next call captures
    jb(x)
    errors, started = [], threading.Event()

    def b_loop():
        started.set()
        deadline = time.perf_counter() + 0.6
        while time.perf_counter() < deadline:
            try:
                jb(x)
            except torch.OutOfMemoryError as e:
                errors.append(e)
                return

    thread = threading.Thread(target=b_loop)
    thread.start()
    started.wait()
    ja(x)
    thread.join()
    return bool(errors)


def test_thread_local_capture_bites(monkeypatch):
    """The replay backend's analogue of capture_error_mode="thread_local": only the capturing thread is capturing."""
    import types

    import cudagraphex.capture

    assert not capture_in_one_thread_breaks_the_other(emulated)
    monkeypatch.setattr(cudagraphex.capture, "_capturing", types.SimpleNamespace(active=False))  # one for all threads
    assert capture_in_one_thread_breaks_the_other(emulated)
