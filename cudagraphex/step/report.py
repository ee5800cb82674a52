"""What a whole step did (:class:`StepReport`), as :func:`cudagraphex.explain` returns it for a step."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepReport"]


@dataclass
class StepReport:
    """What :func:`graph_step` did: read it as text (``str(report)``) or as data."""

    function: str
    captures: int = 0
    #: Calls the step graph served, the capturing call included (on both backends).
    replays: int = 0
    #: Calls that ran ``fn`` as is, by reason (warm-up included).
    plain_calls: dict[str, int] = field(default_factory=dict)
    capture_ms: float = 0.0
    #: Memory the captures added to the step's pool (reserved by the allocator).
    pool_bytes: int = 0
    #: How far the process's peak allocated memory (``torch.cuda.max_memory_allocated``) rose during the captures,
    #: the argument buffers included; 0 where every capture stayed below an earlier peak, and on the CPU backend.
    peak_added_bytes: int = 0
    #: Why the step is not replayed (None while it is).
    not_captured: str | None = None
    #: Graphs kept (one per input signature, modes and state layout).
    graphs: int = 0
    #: With ``capture_sizes``: calls padded up to a capture size, their rows, and the rows added.
    padded_calls: int = 0
    real_rows: int = 0
    padded_rows: int = 0
    #: With ``capture_sizes``: capture sizes whose calls are not padded, with the reason.
    not_padded: dict[int, str] = field(default_factory=dict)

    def __str__(self) -> str:
        last = f" last capture {self.capture_ms:.1f} ms," if self.captures else ""
        head = (
            f"cudagraphex step report for {self.function}: {self.captures} capture(s), {self.replays} replay(s),{last}"
            f" {self.pool_bytes / 2**20:.1f} MiB of graph memory, peak raised by {self.peak_added_bytes / 2**20:.1f} MiB"
        )
        if not (self.captures or self.replays or self.plain_calls):
            return f"{head}\n  not called yet"
        lines = [head, f"  {self.graphs} graph(s) kept"]
        if self.padded_calls:
            lines.append(
                f"  {self.padded_calls} padded call(s): {self.real_rows} real row(s), {self.padded_rows} padding row(s)"
            )
        for size, reason in self.not_padded.items():
            lines.append(f"  calls of fewer than {size} rows are not padded to {size}: {reason}")
        if self.plain_calls:
            lines.append(
                "  calls without the step graph: " + ", ".join(f"{k} x{n}" for k, n in self.plain_calls.items())
            )
        if self.not_captured:
            lines.append(f"  not captured: {self.not_captured}")
        return "\n".join(lines)
