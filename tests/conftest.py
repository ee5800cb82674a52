"""Shared fixtures: every behaviour is tested on the CPU replay backend, and on real CUDA graphs where a GPU exists."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import BACKENDS, install_cuda_device_guard

install_cuda_device_guard()


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "cuda" in item.keywords and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


@pytest.fixture(params=[pytest.param("emulate"), pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request):
    """A :class:`tests.helpers.Backend`: the executor to test and the device its tensors live on."""
    return BACKENDS[request.param]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
