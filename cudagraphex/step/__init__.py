"""Whole-step graphs: a training or serving step captured into one graph and replayed.

Data flow: :func:`graph_step` wraps the step (``graph``: keys, guards, warm-up, capture, replay); ``state`` finds the
tensors it reads and writes (its slots); ``io`` stages its arguments and hands out its results; ``capture`` records
it; ``rows`` (with ``compiled_code``) and ``buckets`` pad calls up to a capture size; ``report`` says what happened.
"""

from cudagraphex.step.graph import StepGraph, graph_step
from cudagraphex.step.report import StepReport

__all__ = ["StepGraph", "StepReport", "graph_step"]
