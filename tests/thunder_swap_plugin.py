"""A pytest plugin, ``-p tests.thunder_swap_plugin``, that runs Thunder's own tests with cudagraphex's drop-in.

Thunder's tests import ``CUDAGraphTransform`` from ``thunder.transforms.cudagraph`` inside each test, and the
``"reduce-overhead"`` plugin took the name from there at import; both are replaced before collection. The report header
says whether the swap is in place.
"""

from __future__ import annotations

import pytest
import thunder.plugins.reduce_overhead
import thunder.transforms.cudagraph

import cudagraphex

HEADER = "cudagraphex: thunder.transforms.cudagraph.CUDAGraphTransform is cudagraphex.CUDAGraphTransform"


def pytest_configure(config: pytest.Config) -> None:
    thunder.transforms.cudagraph.CUDAGraphTransform = cudagraphex.CUDAGraphTransform
    thunder.plugins.reduce_overhead.CUDAGraphTransform = cudagraphex.CUDAGraphTransform


def pytest_report_header(config: pytest.Config) -> str:
    swapped = (
        thunder.transforms.cudagraph.CUDAGraphTransform is cudagraphex.CUDAGraphTransform
        and thunder.plugins.reduce_overhead.CUDAGraphTransform is cudagraphex.CUDAGraphTransform
    )
    return HEADER if swapped else "cudagraphex: the CUDAGraphTransform swap is NOT in place"
