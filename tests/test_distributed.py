"""cudagraphex under Thunder's data-parallel training: collectives stay outside graphs, results match."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import thunder.distributed.prims as dist_prims
from thunder.executors.torchex import ex as torch_executor

from cudagraphex.planning.safety import NEVER_CAPTURED

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = WORKER.parent.parent


def test_every_communication_symbol_stays_out_of_graphs():
    for prim in dist_prims.PrimIDs:
        assert NEVER_CAPTURED[prim] == "is a distributed communication op"
        impl = torch_executor.implmap.get(prim)
        if impl is not None:
            assert NEVER_CAPTURED[impl.symbol.id] == "is a distributed communication op"


def free_port() -> str:
    """A local TCP port free now, so that two test runs on one machine do not race for a fixed one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_worker(args: list[str], env: dict[str, str], launcher: list[str]) -> str:
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONPATH": pythonpath, **env}
    done = subprocess.run(
        [*launcher, str(WORKER), *args], check=False, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_ddp_over_gloo_matches_and_keeps_collectives_out():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    out = run_worker(["--mode", "ddp", "--backend", "emulate"], env, [sys.executable])
    assert "OK ddp world=1 losses match" in out


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["ddp", "fsdp-zero2", "fsdp-zero3"])
def test_two_gpu_training_matches_a_single_process(mode):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", free_port()]
    out = run_worker(["--mode", mode, "--backend", "cuda"], {}, launcher)
    assert f"OK {mode} world=2 losses match" in out
