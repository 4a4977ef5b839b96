"""`nhwc` on channels that are not whole 16-byte chunks: the input read from a zero-padded copy.

RegNet's 1044 -> 185, a 75-channel 3x3, a first layer's 3 channels: channels_last layers of such
channel counts had only `direct` (at 0.03-0.4x of cuDNN on the H200 census). `nhwc` now copies
the input into its workspace with each group's channels padded with zeros to whole chunks,
repacks the weights so too, and writes an odd number of output channels a channel at a time.

CPU tier: the family takes such specs, sizes its workspace for the copy, and (nvcc) lowers them
for sm_90a and sm_80 without spills. GPU tier: against F.conv2d in float64 with the output
poisoned, in both layouts, every dtype and precision, groups, bias, odd outputs; and memcheck.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernelgen
from kernelgen import select
from kernelgen.device import nominal
from kernelgen.families import get_family
from kernelgen.families.nhwc import cin_padded
from kernelgen.spec import ConvSpec, Problem
from lowering import lower

FAM = get_family("nhwc")
# (N, C, K, H, W, kernel, stride, padding, groups, bias)
LAYERS = [
    (4, 185, 75, 14, 14, 1, 1, 0, 1, True),
    (2, 1044, 185, 7, 7, 1, 1, 0, 1, False),
    (3, 75, 75, 28, 28, 3, 2, 1, 1, True),
    (2, 3, 32, 33, 31, 3, 2, 1, 1, False),
    (2, 20, 33, 17, 19, 5, 1, 2, 1, True),
    (2, 30, 45, 12, 12, 3, 1, 1, 3, True),  # groups of 10 channels into 15
    (1, 116, 21, 9, 9, 3, 1, 1, 1, False),
    (5, 12, 7, 20, 13, (1, 7), 1, (0, 3), 1, True),
]


def _spec(layer, dtype, math, channels_last, arch="sm_90a"):
    N, C, K, H, W, k, s, p, g, bias = layer
    params = dict(in_channels=C, out_channels=K, kernel_size=k, stride=s, padding=p, dilation=1, groups=g,
                  dtype=dtype, bias=bias)
    P, Q = ConvSpec(**params).output_size(H, W)
    problem = Problem(N, H, W, P, Q, device=nominal(arch))
    return select.choose(params, "cuda", problem, channels_last, math, family="nhwc")


def test_odd_channels_are_served_with_a_padded_copy():
    spec = _spec(LAYERS[0], "bfloat16", "ieee", True)
    ctx = spec.template_context()
    assert cin_padded(spec) == 192 and ctx["CIN_GP"] == 192
    # the weights packed padded; the input's copy: 192 elements for every 185, rounded up to 2 bytes each
    assert ctx["WORKSPACE_PER_INPUT"] == -(-2 * 192 // 185) == 3
    assert ctx["PACKED_BYTES"] == 75 * 192 * 2
    whole = _spec((4, 192, 64, 14, 14, 1, 1, 0, 1, False), "bfloat16", "ieee", True)
    assert whole.template_context()["CIN_GP"] == 192 and whole.template_context()["WORKSPACE_PER_INPUT"] == 0


def test_the_selector_now_has_a_tensor_core_candidate_for_them():
    params = dict(in_channels=185, out_channels=75, kernel_size=1, stride=1, padding=0, dilation=1, groups=1,
                  dtype="bfloat16", bias=False)
    problem = Problem(16, 14, 14, 14, 14, device=nominal("sm_90a"))
    found, _ = select.candidates(params, "cuda", problem, True, "ieee")
    assert {"nhwc", "direct"} <= {s.family for s in found}


@pytest.mark.compile
@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("layer,dtype,math,cl", [
    (LAYERS[0], "bfloat16", "ieee", True), (LAYERS[2], "float32", "ieee", True), (LAYERS[3], "float32", "tf32", True),
    (LAYERS[5], "float16", "ieee", False), (LAYERS[7], "float32", "tf32", False),
])
def test_padded_specs_lower_without_spills(layer, dtype, math, cl, arch, tmp_path):
    spec = _spec(layer, dtype, math, cl, arch)
    _, report = lower(spec, tmp_path, arch=arch)
    assert " 0 bytes spill stores" in report and " 0 bytes spill loads" in report, report


CELLS = [("float32", "tf32"), ("float32", "ieee"), ("bfloat16", None), ("float16", None)]


def _tensors(layer, dtype, channels_last, seed, device="cuda"):
    N, C, K, H, W, k, s, p, g, bias = layer
    kh, kw = (k, k) if isinstance(k, int) else k
    gen = torch.Generator().manual_seed(seed)
    make = (lambda *shape: torch.empty(*shape, device="meta", dtype=dtype)) if device == "meta" else \
        (lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype))
    x, w = make(N, C, H, W), make(K, C // g, kh, kw)
    b = make(K) if bias else None
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, w, b, dict(stride=s, padding=p, groups=g)


@pytest.fixture(scope="module")
def built():
    """Every kernel the GPU cases below run, compiled in parallel before the first of them."""
    from kernelgen.functional import spec_for
    from kernelgen.warm import warm_specs

    specs = set()
    for layer in LAYERS:
        for dtype, precision in CELLS:
            for cl in (True, False):
                x, w, b, kw = _tensors(layer, getattr(torch, dtype), cl, seed=0, device="meta")
                specs.add(spec_for(x, w, b, **kw, device="cuda", precision=precision, family="nhwc")[0])
    failed = [r for r in warm_specs(sorted(specs, key=lambda s: s.to_json()),
                                    jobs=int(os.environ.get("KERNELGEN_JOBS", "16"))) if r.status == "failed"]
    assert not failed, failed[0].message[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [True, False], ids=["cl", "nchw"])
@pytest.mark.parametrize("dtype,precision", CELLS, ids=[f"{d}-{p}" for d, p in CELLS])
@pytest.mark.parametrize("i", range(len(LAYERS)))
def test_padded_channels_against_float64(i, dtype, precision, channels_last, built):
    layer = LAYERS[i]
    x, w, b, kw = _tensors(layer, getattr(torch, dtype), channels_last, seed=100 + i)
    ref = F.conv2d(x.double(), w.double(), None if b is None else b.double(), **kw)
    torch.empty(ref.numel(), dtype=x.dtype, device="cuda").fill_(float("nan"))  # poison what conv2d gets
    y = kernelgen.conv2d(x, w, b, **kw, precision=precision, family="nhwc")
    torch.cuda.synchronize()
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    assert y.is_contiguous(memory_format=torch.channels_last) == channels_last
    err = float((y.double() - ref).norm() / ref.norm())
    if dtype == "float32" and precision == "ieee":
        bound = 1e-5
    else:
        torch.backends.cudnn.allow_tf32 = True
        bound = 1.5 * max(float((F.conv2d(x, w, b, **kw).double() - ref).norm() / ref.norm()), 1e-3 if
                          dtype == "float32" else 1e-4)
    assert err <= bound, f"relative error {err:.3g} > {bound:.3g}"


MEMCHECK = """
import sys
sys.path.insert(0, {repo!r})
import torch, kernelgen
for i, (N, C, K, H, W, k, s, p, g, bias) in enumerate({layers!r}):
    for dtype in (torch.float32, torch.bfloat16):
        for cl in (True, False):
            kh, kw = (k, k) if isinstance(k, int) else k
            x = torch.randn(N, C, H, W, device="cuda", dtype=dtype)
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            w = torch.randn(K, C // g, kh, kw, device="cuda", dtype=dtype)
            b = torch.randn(K, device="cuda", dtype=dtype) if bias else None
            kernelgen.conv2d(x, w, b, stride=s, padding=p, groups=g, family="nhwc")
torch.cuda.synchronize()
print("memcheck script done")
"""


@pytest.mark.gpu
def test_padded_channels_memcheck_is_clean(tmp_path):
    sanitizer = "compute-sanitizer" if subprocess.run(["which", "compute-sanitizer"], capture_output=True).returncode == 0 \
        else "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(sanitizer) and sanitizer != "compute-sanitizer":
        pytest.skip("compute-sanitizer not found")
    script = tmp_path / "memcheck.py"
    script.write_text(MEMCHECK.format(repo=str(Path(__file__).resolve().parent.parent), layers=LAYERS))
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    r = subprocess.run([sanitizer, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, str(script)],
                       capture_output=True, text=True, env=env, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "memcheck script done" in r.stdout, out[-4000:]
    assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]
