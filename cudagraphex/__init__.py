"""cudagraphex: CUDA graphs as a Lightning Thunder executor."""

from cudagraphex.diagnostics import Report, explain
from cudagraphex.executor import CUDAGraphExecutor, cudagraphex
from cudagraphex.legacy import CUDAGraphTransform, install_use_cudagraphs_shim, jit
from cudagraphex.runtime import StrictModeError

__all__ = [
    "CUDAGraphExecutor",
    "CUDAGraphTransform",
    "Report",
    "StrictModeError",
    "cudagraphex",
    "explain",
    "install_use_cudagraphs_shim",
    "jit",
]
