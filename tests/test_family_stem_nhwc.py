"""CPU-tier tests of the `stem_nhwc` family (channels_last layers of few input channels: first
layers): no GPU needed.

What they cover: which calls it can serve (dense channels_last layers of up to 8 input channels,
every precision: ResNet's and MobileNet's stems) and which it cannot (NCHW, groups, wider
layers), that its refusals name the reason, its default tiles, the fragment rows' order and
staging pitch its layout picks against bank conflicts, and (with nvcc) that every dtype lowers to
ldmatrix and mma.sync without spills, with 16-byte stores of the staged tile. Which family the
selector picks for a call is measured, not asserted here.
"""

from __future__ import annotations

import re

import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError, Unsupported
from kernelgen.families import get_family
from kernelgen.families.stem_nhwc import MAX_CIN, _a_wavefronts
from kernelgen.spec import ConvSpec, Problem
from lowering import NVCC, lower

FAM = get_family("stem_nhwc")


def _params(cin, cout, kernel=3, stride=1, padding=1, dilation=1, groups=1, dtype="float32", bias=False):
    return dict(in_channels=cin, out_channels=cout, kernel_size=kernel, stride=stride, padding=padding,
                dilation=dilation, groups=groups, dtype=dtype, bias=bias)


def _choose(cin, cout, hw=(224, 224), n=32, channels_last=True, math="tf32", family="stem_nhwc", tiles=None,
            arch="sm_90a", **kw):
    """The spec `family` (this one by default) runs the call with, on a nominal GPU of target `arch`."""
    params = _params(cin, cout, **kw)
    P, Q = ConvSpec(**params).output_size(*hw)
    problem = Problem(N=n, H=hw[0], W=hw[1], P=P, Q=Q, device=nominal(arch))
    return select.choose(params, "cuda", problem, channels_last, math, family=family, tiles=tiles)


# First layers of ResNet-50, MobileNetV2 and VGG.
R50 = dict(cin=3, cout=64, kernel=7, stride=2, padding=3)
MV2 = dict(cin=3, cout=32, kernel=3, stride=2, padding=1)
VGG = dict(cin=3, cout=64, kernel=3, stride=1, padding=1)


@pytest.mark.parametrize("layer", [R50, MV2, VGG], ids=["r50", "mv2", "vgg"])
@pytest.mark.parametrize("dtype, math", [("float32", "tf32"), ("float32", "ieee"), ("bfloat16", "tf32"),
                                         ("float16", "tf32")])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80", "sm_89"])
def test_serves_channels_last_stems_in_every_precision(layer, dtype, math, arch):
    spec = _choose(**layer, dtype=dtype, math=math, arch=arch)
    assert spec.layout == "nhwc"
    assert spec.math == (math if dtype == "float32" else "ieee")
    FAM.check(spec, nominal(arch))
    assert FAM.layout(spec, dict(spec.tiles))["SMEM_BYTES"] <= nominal(arch).smem_block


def test_serves_one_to_eight_input_channels():
    for cin in range(1, MAX_CIN + 1):
        for dtype in ("float32", "bfloat16"):
            FAM.check(_choose(cin, 64, dtype=dtype))
    FAM.check(_choose(8, 64, kernel=7, stride=2, padding=3, dtype="bfloat16"))


def test_refusals_say_why():
    with pytest.raises(ConvArgumentError, match=f"dense layers of at most {MAX_CIN} input channels, got 4 in 2"):
        _choose(4, 64, groups=2, family="stem_nhwc")
    with pytest.raises(ConvArgumentError, match=f"at most {MAX_CIN} input channels, got 9"):
        _choose(9, 64, family="stem_nhwc")
    with pytest.raises(ConvArgumentError, match="takes layouts"):
        _choose(3, 64, channels_last=False, family="stem_nhwc")
    with pytest.raises(ConvArgumentError, match="whole 16 x 16 warp tiles"):
        _choose(3, 64, family="stem_nhwc", tiles={"block_p": 1, "block_q": 16, "warps_m": 2})
    with pytest.raises(ConvArgumentError, match="bytes of shared memory exceed"):  # 8 x 11 x 11 taps, 128 rows
        _choose(8, 128, kernel=11, padding=5, family="stem_nhwc", tiles={"block_n": 128, "block_p": 16, "block_q": 64})
    base = ConvSpec(**_params(3, 64), device="cuda", layout="nhwc", family="stem_nhwc")
    with pytest.raises(Unsupported, match="dtype float64"):
        FAM.check(base.replace(dtype="float64"))


def test_default_tiles():
    t = dict(_choose(**R50).tiles)  # 112 columns: rows of 16 fill them
    assert t == {"block_p": 8, "block_q": 16, "block_n": 64, "warps_m": 4, "warps_n": 1, "min_blocks": 2}
    assert dict(_choose(**R50, math="ieee").tiles) == {**t, "warps_n": 2, "min_blocks": 1}  # 3xTF32: 4 x 2
    assert dict(_choose(**MV2, math="ieee").tiles)["warps_m"] == 2  # 32 channels: 2 x 2
    assert dict(_choose(**MV2).tiles)["block_n"] == 32
    # 96 columns: 32 and 16 fill them (the narrower); 40 columns: 16 leaves 8 idle, 32 and 64 more
    assert dict(_choose(3, 64, hw=(96, 96)).tiles)["block_q"] == 16
    t = dict(_choose(3, 64, hw=(100, 100), kernel=1, padding=0, stride=1).tiles)
    assert (t["block_p"], t["block_q"]) == (8, 16)
    # forced tiles are kept, the rest chosen around them
    t = dict(_choose(**R50, tiles={"block_q": 32}).tiles)
    assert (t["block_p"], t["block_q"]) == (4, 32)


def test_layout_picks_the_rows_order_and_staging_with_fewer_bank_conflicts():
    lay = lambda spec: FAM.layout(spec, dict(spec.tiles))  # noqa: E731
    r50 = _choose(**R50)
    L = lay(r50)
    # 3 float32 channels at stride 2: neighbours' windows 6 words apart, so eight rows in order
    # share banks; the interleaved order spreads them (the simulation's minimum is 16 wavefronts)
    shape = (4, 3, 7, 7, 2, 2, 1, 1)
    assert L["ORDER"] == 1
    assert _a_wavefronts(*shape, 1, 16, L["XPITCH"], 4) < _a_wavefronts(*shape, 0, 16, L["XPITCH"], 4)
    assert _a_wavefronts(*shape, 1, 16, L["XPITCH"], 4) <= 20
    assert lay(_choose(**VGG))["ORDER"] == 0  # 3 words apart: in order is conflict-free
    for spec in (r50, _choose(**MV2, dtype="bfloat16"), _choose(**VGG, math="ieee")):
        L, vec = lay(spec), 16 // (4 if spec.dtype == "float32" else 2)
        assert L["SROW"] % vec == 0 and L["SROW"] > dict(spec.tiles)["block_n"]
        t = dict(spec.tiles)
        assert L["SMEM_BYTES"] >= t["block_p"] * t["block_q"] * L["SROW"] * (4 if vec == 4 else 2)
    # the workspace holds the repacked weights, K padded to whole k-steps: 147 -> 152 (TF32), 160 (bf16)
    assert r50.template_context()["PACKED_BYTES"] == 64 * 152 * 4
    assert _choose(**R50, dtype="bfloat16").template_context()["PACKED_BYTES"] == 64 * 160 * 2


# -- lowering ------------------------------------------------------------------------------------

LOWER = [
    # (name, choose kwargs, the MMA, whether the tile is staged: output channels in whole vectors)
    ("r50-tf32", dict(**R50, bias=True), "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", True),
    ("r50-strict", dict(**R50, math="ieee"), "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", True),
    ("r50-bf16", dict(**R50, dtype="bfloat16", bias=True), "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", True),
    ("mv2-f16", dict(**MV2, dtype="float16"), "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", True),
    ("odd-out", dict(cin=5, cout=67, kernel=(5, 3), stride=(1, 2), dilation=(2, 1), padding=2, bias=True),
     "mma.sync.aligned.m16n8k8", False),
]


@pytest.mark.compile
@pytest.mark.nvcc
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("name, kw, mma, staged", LOWER, ids=[c[0] for c in LOWER])
def test_lowers_to_ldmatrix_and_mma_without_spills(name, kw, mma, staged, tmp_path):
    spec = _choose(**kw, hw=(61, 67), n=2, family="stem_nhwc")
    text, report = lower(spec, tmp_path)
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text and mma in text
    spills = [int(m) for m in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report
    # the staged tile leaves as 16-byte vectors; otherwise pairs (or single elements) from the fragments
    assert ("st.global.v4.u32" in text) == staged, name
