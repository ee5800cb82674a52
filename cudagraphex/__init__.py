"""cudagraphex: CUDA graphs as a Lightning Thunder executor."""

from cudagraphex.executor import CUDAGraphExecutor, cudagraphex
from cudagraphex.runtime import StrictModeError

__all__ = ["CUDAGraphExecutor", "StrictModeError", "cudagraphex"]
