"""The options of a cudagraphex executor, what it knows of each region, and the errors it raises."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GraphOptions", "ParameterMovedError", "RegionInfo", "StrictModeError"]


class StrictModeError(RuntimeError):
    """Raised in strict mode where cudagraphex would otherwise run a region eagerly."""


class ParameterMovedError(RuntimeError):
    """A parameter moved in a function compiled with :class:`~cudagraphex.PruneParameterChecks`."""


@dataclass(frozen=True)
class GraphOptions:
    """Options of a :class:`~cudagraphex.CUDAGraphExecutor`; validated on construction."""

    min_region_size: int = 2
    max_graphs_per_region: int = 8
    warmup_calls: int = 1
    share_pool: bool = True
    strict: bool = False
    backend: str = "cuda"

    def __post_init__(self) -> None:
        for name in ("min_region_size", "max_graphs_per_region"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.warmup_calls, int) or isinstance(self.warmup_calls, bool) or self.warmup_calls < 0:
            raise ValueError(f"warmup_calls must be an int >= 0, got {self.warmup_calls!r}")
        for name in ("share_pool", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")  # noqa: TRY004 (contract)
        if self.backend not in ("cuda", "emulate"):
            raise ValueError(f"backend must be 'cuda' or 'emulate', got {self.backend!r}")


@dataclass
class RegionInfo:
    """What a region is, for diagnostics."""

    name: str
    phase: str
    device: str
    num_ops: int
    input_names: list[str]
    output_names: list[str]
    returned: frozenset[str]
    mutated: frozenset[str]
