"""cudagraphex: CUDA graphs as a Lightning Thunder executor."""

from cudagraphex.diagnostics import Inspection, Report, explain, inspect
from cudagraphex.executor import CUDAGraphExecutor, cudagraphex
from cudagraphex.legacy import CUDAGraphTransform, install_use_cudagraphs_shim, jit
from cudagraphex.runtime import ParameterMovedError, StrictModeError
from cudagraphex.step import StepGraph, StepReport, graph_step
from cudagraphex.trusted_parameters import PruneParameterChecks

__version__ = "0.1.0"

__all__ = [
    "CUDAGraphExecutor",
    "CUDAGraphTransform",
    "Inspection",
    "ParameterMovedError",
    "PruneParameterChecks",
    "Report",
    "StepGraph",
    "StepReport",
    "StrictModeError",
    "cudagraphex",
    "explain",
    "graph_step",
    "inspect",
    "install_use_cudagraphs_shim",
    "jit",
]
