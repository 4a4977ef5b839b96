"""Data-parallel training of a net converted to kernelgen (issue 56): DistributedDataParallel and
FSDP2's fully_shard, two processes under torchrun (tests/distributed_train.py), beside the same
net in torch. The CPU tier runs them over gloo on kernelgen's CPU kernels in float64; the GPU
tier over NCCL on two GPUs in IEEE float32, where the host has two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "distributed_train.py"


def _train(tmp_path: Path, wrap: str, device: str, dtype: str) -> dict:
    out = tmp_path / f"{wrap}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(WORKER), "--wrap", wrap, "--device", device, "--dtype", dtype, "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads(out.read_text())


def _check(result: dict, rel: float) -> None:
    assert result["world"] == 2 and result["convs"] == 2
    kg, ref = result["losses"]["kernelgen"], result["losses"]["torch"]
    assert kg == pytest.approx(ref, rel=rel) and kg[-1] < kg[0]  # (it learns, as torch's does)
    assert result["parameter_drift"] < rel
    if result["wrap"] == "ddp":
        assert result["same_on_every_rank"] == {"torch": True, "kernelgen": True}
    # kernelgen's kernels ran (loaded or built in that process), none fell back to torch
    stats = result["stats"]
    assert stats["compiles"] + stats["cache_hits"] >= 1 and stats["fallbacks"] == 0


@pytest.mark.compile  # (the CPU kernels of the forward and the gradients)
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_data_parallel_training_on_the_cpu_matches_torchs(wrap, tmp_path):
    _check(_train(tmp_path, wrap, "cpu", "float64"), rel=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_data_parallel_training_on_two_gpus_matches_torchs(wrap, tmp_path):
    # IEEE float32 on both sides (TF32 off); the sums' orders differ, a few steps apart
    _check(_train(tmp_path, wrap, "cuda", "float32"), rel=1e-4)
