"""The diagnostics: ``explain()`` as text and as data, memory pools and peaks, and ``inspect()``."""

from __future__ import annotations

import pytest
import thunder
import torch

import cudagraphex
from benchmarks.models import mlp
from cudagraphex import explain, inspect
from tests.helpers import BACKENDS, emulated, jit


def test_explain_reads_as_text_and_as_data(backend):
    def f(x):
        y = x.sin() * 2 + 1
        s = y.sum().item()
        return (y.cos() * 3 + 1) * s

    jf = jit(f, backend.executor)
    for x in [torch.randn(8, device=backend.device) for _ in range(3)]:  # kept alive: x moves, so it is copied
        jf(x)
    report = explain(jf)
    data = report.to_dict()
    (trace,) = data["traces"]
    assert len(trace["regions"]) == 2
    region = trace["regions"][0]
    assert region["copied_inputs"] == ["x"] and region["static_inputs"] == {}
    (graph,) = region["graphs"]
    assert graph["input_shapes"] == {"x": (8,)} and graph["replays"] == 2 and graph["capture_ms"] > 0
    assert any(b["reason"] == "reads a device value on the host" and __file__ in b["source"] for b in trace["breaks"])
    text = str(report)
    for needle in (
        "CUDAGraph",
        "copied or read in place: x",
        "2 replay(s)",
        "reads a device value on the host",
        __file__,
    ):
        assert needle in text
    if backend.name == "cuda":
        assert report.pool_bytes >= 0


def test_explain_reports_each_pool_and_the_peak_the_captures_added(backend):
    jf = jit(lambda x: (x.sin() * 2 + 1).cos() * 3, backend.executor)
    xs = [torch.randn(8, device=backend.device) for _ in range(3)]
    for x in xs:
        jf(x)
    # Held across two calls: the first switches the output to copies, the second captures into a pool of its own.
    y = jf(xs[0])
    jf(xs[1])
    jf(xs[2])
    assert y.shape == (8,)
    report = explain(jf)
    data = report.to_dict()
    assert [(p["device"], p["shared"], p["graphs"]) for p in data["pools"]] == [
        (str(xs[0].device), True, 1),
        (str(xs[0].device), False, 1),
    ]
    assert report.pool_bytes == sum(p["bytes"] for p in data["pools"])
    text = str(report)
    assert "(shared): 1 graph(s)" in text and "(own): 1 graph(s)" in text and "peak raised by" in text
    if backend.name == "emulate":  # the CPU has no allocator statistics
        assert report.peak_added_bytes == 0


def test_explain_says_why_it_has_no_trace_to_report(backend):
    jf = jit(lambda x: x.sin() * 2 + 1, backend.executor)
    assert "not called yet" in str(explain(jf))
    jf(torch.randn(4, device=backend.device))
    assert explain(jf).note == ""
    plain = thunder.jit(lambda x: x.sin() * 2 + 1)
    plain(torch.randn(4, device=backend.device))
    report = explain(plain)
    assert report.regions == [] and "cudagraphex saw none of its traces" in str(report)


def test_a_step_report_says_when_the_step_was_not_called_yet(backend):
    step = cudagraphex.graph_step(lambda x: x * 2, backend=backend.name)
    text = str(explain(step))
    assert "not called yet" in text and "last capture" not in text
    for _ in range(3):  # two warm-up calls, then the capture
        step(torch.ones(4, device=backend.device))
    text = str(explain(step))
    assert "not called yet" not in text and "1 capture(s)" in text and "last capture" in text


def test_explain_rejects_what_thunder_did_not_compile():
    with pytest.raises(TypeError, match="explain and cudagraphex.inspect take .* got function"):
        explain(lambda x: x)
    with pytest.raises(TypeError, match="explain and cudagraphex.inspect take .* got StepGraph"):
        cudagraphex.inspect(cudagraphex.graph_step(lambda x: x, backend="emulate"))


@pytest.mark.cuda
def test_explain_reports_pool_memory_on_the_gpu():
    model = mlp(4, 256).cuda()
    jm = jit(model, BACKENDS["cuda"].executor)
    xs = [torch.randn(64, 256, device="cuda") for _ in range(3)]  # kept: each call's input is at a new address
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        jm(xs[0])  # the warm-up
        before = torch.cuda.max_memory_allocated()
        jm(xs[1])  # the capture: its input buffer and pool come on top of the warm-up's memory
        rise = torch.cuda.max_memory_allocated() - before
        jm(xs[2])
    report = explain(jm)
    assert report.pool_bytes > 0
    assert 0 < report.peak_added_bytes <= rise


def test_inspect_shows_the_live_regions_and_graphs():
    def f(x):
        return (x.sin() * 2).cos() + 1

    jf = jit(f, emulated)
    x = torch.randn(4)
    for _ in range(3):
        jf(x)
    view = inspect(jf)
    (region,) = view.regions(emulated.name)
    assert view.regions(emulated.name, phase="backward") == []
    assert view.graphs("no such executor") == []
    assert view.num_graphs() == view.num_graphs(emulated.name, "computation") == len(region.instances) == 1
    assert view.num_graphs(emulated.name, "forward") == 0
    assert view.replays() == region.instances[0].replays == 2  # the warm-up runs eagerly, the capture replays
    with pytest.raises(TypeError, match="compiled by thunder"):
        inspect(f)
