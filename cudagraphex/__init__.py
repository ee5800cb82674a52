"""cudagraphex: CUDA graphs as a Lightning Thunder executor."""

from cudagraphex.compat.legacy import CUDAGraphTransform, install_use_cudagraphs_shim, jit
from cudagraphex.compat.trusted_parameters import PruneParameterChecks
from cudagraphex.diagnostics import Inspection, Report, explain, inspect
from cudagraphex.executor import CUDAGraphExecutor, cudagraphex
from cudagraphex.runtime import ParameterMovedError, StrictModeError
from cudagraphex.step import StepGraph, StepReport, graph_step

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
