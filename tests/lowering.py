"""What the CPU tier's lowering tests share: a rendered spec through nvcc to PTX, then ptxas."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

from kernelgen.render import render
from kernelgen.toolchain import CUDA_CFLAGS_BASE

NVCC = shutil.which("nvcc")
# torch's build adds these (no implicit half/bf16 conversions or operators); lowering without
# them would accept code the real build rejects.
TORCH_DEFINES = [f for f in COMMON_NVCC_FLAGS if f.startswith("-D")]


def lower(spec, tmp_path: Path, arch: str = "sm_90a") -> tuple[str, str]:
    """(PTX text, ptxas's -v report) of the rendered spec; asserts both tools succeed."""
    src = tmp_path / "k.cu"
    src.write_text(render(spec).cuda)
    ptx = tmp_path / "k.ptx"
    r = subprocess.run([NVCC, *CUDA_CFLAGS_BASE, *TORCH_DEFINES, f"-arch={arch}", "-ptx", str(src), "-o", str(ptx)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ptxas = shutil.which("ptxas") or str(Path(NVCC).resolve().parent / "ptxas")
    r = subprocess.run([ptxas, f"-arch={arch}", "-v", str(ptx), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return ptx.read_text(), r.stdout + r.stderr
