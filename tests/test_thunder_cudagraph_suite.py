"""Thunder's own CUDA-graph tests (``-k cudagraph`` in ``thunder.tests.test_transforms`` and
``thunder.tests.test_networks``), run in a subprocess with :class:`cudagraphex.CUDAGraphTransform` swapped in for
Thunder's ``CUDAGraphTransform`` by ``tests/thunder_swap_plugin.py``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.thunder_swap_plugin import HEADER

ROOT = Path(__file__).resolve().parent.parent

#: Thunder's CUDA-graph tests left out, and why.
DESELECTED = {
    "test_cudagraph_fw_bw": "imports litgpt, which the test extra does not install (it also reads the internals"
    " CUDAGraphRunner.python_callables and .mem_pool, which the drop-in does not provide)",
}

#: Every one of these must pass, on each of Thunder's test executors (torch, and nvFuser where installed).
EXPECTED = (
    "test_cudagraph_warmup_runs_with_correct_buffers",
    "test_cudagraph_empty_inputs",
    "test_nanogpt_complete_cudagraphs_torch_cuda",
    "test_nanogpt_complete_cudagraphs_autograd_torch_cuda",
)


def thunder_suite(*extra: str, timeout: float) -> subprocess.CompletedProcess:
    selection = " and ".join(["cudagraph", *(f"not {name}" for name in DESELECTED)])
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "tests.thunder_swap_plugin",
        "-p",
        "no:cacheprovider",
        "--pyargs",
        "thunder.tests.test_transforms",
        "thunder.tests.test_networks",
        "-k",
        selection,
        *extra,
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def test_thunder_suite_collects_with_the_swap():
    """The command imports Thunder's test modules with the packages the test extra installs, and swaps the name."""
    result = thunder_suite("--collect-only", timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-8000:]
    assert HEADER in out
    assert "test_cudagraph_empty_inputs" in out and "test_cudagraph_warmup_runs_with_correct_buffers" in out
    assert not any(name in out for name in DESELECTED)


@pytest.mark.cuda
def test_thunders_cuda_graph_tests_pass_with_the_drop_in():
    result = thunder_suite("-rA", timeout=1800)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-8000:]
    assert HEADER in out
    passed = re.findall(r"^PASSED (\S+)", out, flags=re.MULTILINE)
    for name in EXPECTED:
        assert any(name in nodeid for nodeid in passed), f"{name} did not pass:\n{out[-8000:]}"
    assert not re.search(r"^(FAILED|ERROR|SKIPPED) ", out, flags=re.MULTILINE), out[-8000:]
