"""The CPU fallback of the main job: without a GPU nothing can be timed, so it shows what cudagraphex would capture.

Each workload is compiled with an executor that uses the CPU replay backend (cudagraphex's testing mode, which treats
CPU tensors as the GPU path treats CUDA tensors), in the first position of the executors list, and run for two small
calls per phase (the first is the eager warm-up, the second captures and replays); then ``explain()`` is printed.
Workloads are reduced in size, since Thunder's tracing takes seconds per layer on a CPU; the output says how.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


def show_plan(workloads: Sequence[str], modes: Sequence[str], out: Callable[[str], None] = print) -> list[str]:
    """Prints, for each workload, the cudagraphex capture plan of its (reduced) model on the CPU; returns the names of
    the workloads whose plan failed.

    Inference is shown if ``inference`` is among ``modes``, a training step if ``train_step`` is. A workload that
    needs ``transformers`` is skipped when it is not installed; a workload that fails prints its whole traceback.
    Never raises for a workload's failure.
    """
    from benchmarks.measure import rare_gc
    from benchmarks.variants import graph_executor

    cpu = torch.device("cpu")
    with rare_gc():
        return _show(workloads, modes, out, graph_executor(cpu), cpu)


def _show(
    workloads: Sequence[str], modes: Sequence[str], out: Callable[[str], None], executor, device: torch.device
) -> list[str]:
    import thunder

    from benchmarks.report import full_error
    from benchmarks.workloads import WORKLOADS, transformers_available
    from cudagraphex import explain

    failed = []
    for name in workloads:
        workload = WORKLOADS[name]
        out(f"\n=== {name}: {workload.description}")
        if workload.needs_transformers and not transformers_available():
            out("skipped: transformers is not installed")
            continue
        start = time.monotonic()
        try:
            setup = workload.build(device, True)
            if setup.reduced:
                out(f"(sizes reduced for the CPU: {setup.reduced})")
            model = setup.model
            jitted = thunder.jit(model, executors=[executor, *thunder.get_default_executors()])
            phases = []
            if "inference" in modes and "inference" in workload.modes:
                with torch.no_grad():
                    for _ in range(2):
                        jitted(*setup.inference_args)
                phases.append("2 inference calls")
            if setup.train_args is not None and "train_step" in modes:
                for _ in range(2):
                    loss = jitted(*setup.train_args)
                    loss = loss if loss.dim() == 0 else loss.square().mean()
                    loss.backward()
                    model.zero_grad(set_to_none=True)
                    del loss
                phases.append("2 training steps")
            out(
                f"ran {' and '.join(phases) or 'nothing (no selected mode applies)'} on the CPU"
                f" in {time.monotonic() - start:.1f} s"
            )
            out(str(explain(jitted)))
        except Exception as e:  # noqa: BLE001 - reported; the other workloads go on
            out(f"capture plan failed:\n{full_error(e)}")
            failed.append(name)
    return failed
