"""cudagraphex: CUDA graphs as a Lightning Thunder executor."""

from cudagraphex.diagnostics import Report, explain
from cudagraphex.executor import CUDAGraphExecutor, cudagraphex
from cudagraphex.legacy import CUDAGraphTransform, install_use_cudagraphs_shim, jit
from cudagraphex.runtime import ParameterMovedError, StrictModeError
from cudagraphex.trusted_parameters import PruneParameterChecks

__all__ = [
    "CUDAGraphExecutor",
    "CUDAGraphTransform",
    "ParameterMovedError",
    "PruneParameterChecks",
    "Report",
    "StrictModeError",
    "cudagraphex",
    "explain",
    "install_use_cudagraphs_shim",
    "jit",
]
