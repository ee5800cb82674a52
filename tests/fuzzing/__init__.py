"""Differential fuzzing of cudagraphex against Thunder without graphs.

``generate(seed)`` builds a small random program and a call pattern from a seeded ``random.Random``: a module (or a
function) whose body draws from a pool of ops (elementwise, matmul, reductions, views, in-place writes into inputs,
buffers and intermediates, ``index_copy_``, dropout and ``randn``-style ops, ``.item()``, scalar tensors, sdpa,
layer norm, embedding), and a list of steps (calls in several input signatures, grad modes, train/eval modes and
under ``torch.autocast`` to bfloat16, held, dropped and written outputs, writes into inputs after a call, backwards
now, later, out of order or twice with ``retain_graph``). ``check(program, backend)`` compiles it twice, with
cudagraphex (first or last in the executors list, ``min_region_size`` 1 or 2, both chosen from the seed) and with
plain ``thunder.jit`` (the reference), runs both in lock-step and compares after every step what a caller can
observe: outputs, their metadata and which tensors share memory, values of inputs, parameters and buffers, gradients,
held outputs, and exception types.

On the CPU replay backend (``"emulate"``) everything is compared exactly: both runs start every step from the same
``torch.manual_seed``, and the replay backend draws what Thunder draws. On ``"cuda"`` RNG-free programs are compared
within a tolerance and programs with random ops statistically (zero fraction, mean and spread; larger tensors there).

With ``steps="whole"`` (``--steps whole``) each call of a program is one training step, forward and backward at once
(``Program.as_whole_steps``), run through ``graph_step`` and compared with the same step run by plain Thunder; a step
whose results share memory with its arguments, state or each other runs as is, so that sharing is compared too.
With ``steps="bucketed"`` each call is a serving step through ``graph_step`` with batch-size buckets, captured at
the program's larger batch, so that calls of its smaller batch replay that graph padded where its rows are
independent; values are then compared within a tolerance. For both, the summary counts the calls step graphs served
and padded, and gives ``explain``'s reasons where a step was not captured or its calls not padded.

With ``fuser`` (``--fuser``) both compiled functions also run Thunder's torch.compile executor, after cudagraphex
where it comes first, as README recommends without nvFuser, in one thread (``Program.with_fuser``); values are then
compared within a tolerance, as Inductor rounds by the fusions it is handed.

``python -m tests.fuzzing --backend emulate --count 2000 --start 0`` runs a batch and prints each failure (seed,
program, call pattern, error) and a summary (``--workers N`` runs N processes, on CUDA too; ``--deadline SECONDS`` takes
no seed after that long, as on a leased GPU); ``--show SEED`` prints one program; ``--shrink`` reduces each failing
program to a smaller one with the same symptom; ``--side-by-side --seed SEED`` runs one program in every world triage
compares (eager, with writes made out of place, without the fusion executor) and prints, step by step, how far each
departs from plain Thunder.
"""

from tests.fuzzing.batch import BatchResult, run_batch
from tests.fuzzing.compare import Failure
from tests.fuzzing.generate import generate
from tests.fuzzing.programs import Line, Mode, Program, Step, TensorSpec
from tests.fuzzing.runner import Outcome, check
from tests.fuzzing.shrink import shrink
from tests.helpers import install_cuda_device_guard

install_cuda_device_guard()  # thread programs compile in threads

__all__ = [
    "BatchResult",
    "Failure",
    "Line",
    "Mode",
    "Outcome",
    "Program",
    "Step",
    "TensorSpec",
    "check",
    "generate",
    "run_batch",
    "shrink",
]
