"""CPU-tier tests of the `pointwise_tile` family (1x1 NCHW TF32, one block a 128 x 128 tile): no
GPU needed.

What they cover: which calls it can serve (dense TF32 1x1 layers at stride 1 of up to 64 input
channels, NCHW) and which it cannot, that its refusals name the reason, the layout constants it
hands the template (channels rounded to k-steps, blocks of output channels, the workspace of
rounded weights), and (with nvcc) that it lowers to TF32 mma.sync fed by cp.async, the weights
through L1, with no spills, for sm_90a and sm_80. Which family the selector picks for a call is
measured, not asserted here.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError, Unsupported
from kernelgen.families import get_family
from kernelgen.spec import ConvSpec, Problem
from lowering import NVCC, lower

FAM = get_family("pointwise_tile")
C87 = dict(x=(16, 64, 1024, 1024), w=(128, 64, 1, 1))


def _params(x, w, dtype="float32", stride=1, padding=0, groups=1, bias=False):
    return dict(in_channels=x[1], out_channels=w[0], kernel_size=w[2:], stride=stride, padding=padding,
                dilation=1, groups=groups, dtype=dtype, bias=bias)


def _choose(x, w, dtype="float32", math="tf32", arch="sm_90a", wide_dram=False, family="pointwise_tile", **kw):
    """The spec `family` (this one by default) runs an NCHW call with, on a nominal GPU of target
    `arch` (wide_dram: its larger-memory part)."""
    params = _params(x, w, dtype, **kw)
    P, Q = ConvSpec(**params).output_size(x[2], x[3])
    problem = Problem(N=x[0], H=x[2], W=x[3], P=P, Q=Q, device=nominal(arch, wide_dram=wide_dram))
    return select.choose(params, "cuda", problem, False, math if dtype == "float32" else "ieee", family=family)


def _spec(cin, cout, bias=False, math="tf32"):
    return ConvSpec(**_params((1, cin, 8, 8), (cout, cin, 1, 1), bias=bias), device="cuda", layout="nchw",
                    math=math, family="pointwise_tile")


@pytest.mark.parametrize("layer", [
    C87,
    dict(x=(16, 32, 1024, 1024), w=(128, 32, 1, 1)),
    dict(x=(4, 64, 1024, 1024), w=(256, 64, 1, 1)),
    dict(x=(8, 48, 512, 512), w=(96, 48, 1, 1)),
    dict(x=(8, 16, 512, 512), w=(128, 16, 1, 1)),
    dict(x=(32, 64, 256, 256), w=(128, 64, 1, 1)),
    dict(x=(8, 64, 128, 128), w=(128, 64, 1, 1)),
    dict(x=(2, 64, 64, 64), w=(128, 64, 1, 1)),
    dict(x=(16, 64, 1024, 1024), w=(64, 64, 1, 1)),
    dict(x=(16, 64, 1024, 1024), w=(32, 64, 1, 1)),
    dict(x=(16, 12, 512, 512), w=(64, 12, 1, 1)),
    dict(x=(8, 24, 512, 512), w=(64, 24, 1, 1)),
    dict(x=(32, 64, 56, 56), w=(256, 64, 1, 1)),
    dict(x=(16, 8, 1024, 1024), w=(16, 8, 1, 1)),
])
def test_serves_tf32_1x1_layers_of_up_to_64_inputs_on_every_target(layer):
    for arch, wide in (("sm_90a", False), ("sm_90a", True), ("sm_80", False), ("sm_89", False), ("sm_86", False)):
        spec = _choose(**layer, arch=arch, wide_dram=wide)
        assert spec.layout == "nchw" and spec.math == "tf32"
        FAM.check(spec, nominal(arch, wide_dram=wide))
    # strict float32 (3xTF32) and 16-bit are not its
    with pytest.raises(ConvArgumentError, match="TF32"):
        _choose(**layer, math="ieee")
    with pytest.raises(ConvArgumentError, match="dtype bfloat16"):
        _choose(**layer, dtype="bfloat16")


def test_refusals_name_the_reason():
    for spec, match in ((_spec(64, 128).replace(groups=2, out_channels=128, in_channels=128), "groups=1"),
                        (_spec(64, 128).replace(kernel_size=(3, 3)), "1x1"),
                        (_spec(64, 128).replace(padding=(1, 1, 1, 1)), "padding"),
                        (_spec(64, 128).replace(stride=(2, 2)), "stride 1"),
                        (_spec(64, 128, math="ieee"), "TF32"),
                        (_spec(96, 128), "64 input channels")):
        with pytest.raises(Unsupported, match=match):
            FAM.check(spec)
    with pytest.raises(Unsupported, match="dtype"):
        FAM.check(_spec(64, 128).replace(dtype="bfloat16", math="ieee"))
    with pytest.raises(ConvArgumentError, match="pointwise_tile"):
        _choose(x=(2, 96, 64, 64), w=(128, 96, 1, 1), family="pointwise_tile")
    # a GPU whose blocks opt into less shared memory than the tile's 68 KB (none kernelgen targets)
    small = dataclasses.replace(nominal("sm_89"), smem_block=48 * 1024)
    assert FAM.context(_spec(64, 128))["SMEM_BYTES"] > small.smem_block
    with pytest.raises(Unsupported, match="shared memory exceed 49152"):
        FAM.check(_spec(64, 128), small)
    FAM.check(_spec(32, 64), small)  # (64-channel tiles of 32 inputs: 34 KB)


@pytest.mark.parametrize("cin,cout,bm,cinp,mb", [(64, 128, 128, 64, 1), (3, 200, 128, 8, 2), (13, 40, 64, 16, 1),
                                                 (1, 1, 64, 8, 1), (48, 256, 128, 48, 2), (57, 129, 128, 64, 2),
                                                 (64, 64, 64, 64, 1), (24, 65, 128, 24, 1)])
def test_layout_rounds_channels_to_k_steps_and_outputs_to_blocks(cin, cout, bm, cinp, mb):
    ctx = _spec(cin, cout).template_context()
    assert (ctx["BM"], ctx["CINP"], ctx["MB"]) == (bm, cinp, mb)
    assert ctx["PACKED_BYTES"] == mb * bm * cinp * 4  # the rounded weights, [MB * BM][CINP]
    # the operands (weights [BM][CINP + 4], input [CINP][136]) and the staged tile ([BM][136]) share it
    assert ctx["SMEM_BYTES"] == 4 * max(bm * (cinp + 4) + cinp * 136, bm * 136)
    blocks = 2 if bm == 128 else 4  # an SM (the launch bounds')
    assert blocks * (ctx["SMEM_BYTES"] + 1024) <= nominal().smem_sm


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("cin,cout,bias,arch", [(64, 128, False, "sm_90a"), (3, 200, True, "sm_90a"),
                                                (48, 96, True, "sm_80"), (64, 64, True, "sm_90a"), (24, 40, False, "sm_80")])
def test_lowers_to_tf32_mma_fed_by_cp_async_without_spills(cin, cout, bias, arch, tmp_path):
    ptx, report = lower(_spec(cin, cout, bias=bias), tmp_path, arch=arch)
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx
    assert "cvt.rna.tf32.f32" in ptx  # operands rounded, not truncated
    # the weights through L1 (16 bytes a copy, no zero fill), the input in L2 only
    assert re.search(r"cp\.async\.ca\.shared\.global \[%r\d+\], \[%rd\d+\], 16;", ptx)
    assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+\], \[%rd\d+\], 16, %r\d+;", ptx)
    kernels = re.findall(r"Compiling entry function '(\w*kg_pointwise_tile\w*)'", report)
    assert len(kernels) == 4, report  # 16-byte and 4-byte input and output paths
    assert report.count("0 bytes spill stores, 0 bytes spill loads") >= 4, report
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    blocks = 2 if cout > 64 else 4  # an SM: 128-channel tiles, or 64-channel ones
    assert max(regs) * 128 * blocks <= 65536, regs
