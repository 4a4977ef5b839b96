"""CPU-tier tests of the `nhwc` family (channels_last implicit GEMM on mma.sync): no GPU needed.

What they cover: which calls the dispatcher sends to it (channels_last ones the tensor cores can
take) and which it never does, that its refusals name the reason, that default and forced tiles
fit and agree with the template's layout, and (with nvcc) that every dtype and precision lowers
to tensor-core MMAs fed by cp.async, with no spills, and 16-bit wgmma tiles store whole 16-byte
rows.
"""

from __future__ import annotations


import pytest

from kernelgen import dispatch
from kernelgen.errors import ConvArgumentError, Unsupported
from kernelgen.families import get_family
from kernelgen.families.nhwc import SMEM_LIMIT
from kernelgen.spec import ConvSpec, Problem
from lowering import NVCC, lower

FAM = get_family("nhwc")


def _choose(x, w, dtype="float32", math="tf32", stride=1, padding=0, groups=1, channels_last=True,
            family=None, tiles=None, arch="sm_90a"):
    params = dict(in_channels=x[1], out_channels=w[0], kernel_size=w[2:], stride=stride, padding=padding,
                  dilation=1, groups=groups, dtype=dtype, bias=False)
    probe = ConvSpec(**params)
    P, Q = probe.output_size(x[2], x[3])
    problem = Problem(N=x[0], H=x[2], W=x[3], P=P, Q=Q, arch=arch)
    return dispatch.choose(params, "cuda", problem, channels_last, math if dtype == "float32" else "ieee",
                           family=family, tiles=tiles)


# ResNet-50's layers at batch 32 (benchmarks/bench_layers.py).
R50 = {
    "l1.3x3": dict(x=(32, 64, 56, 56), w=(64, 64, 3, 3), padding=1),
    "l2.3x3.s2": dict(x=(32, 128, 56, 56), w=(128, 128, 3, 3), stride=2, padding=1),
    "l2.down.s2": dict(x=(32, 256, 56, 56), w=(512, 256, 1, 1), stride=2),
    "l4.3x3": dict(x=(32, 512, 7, 7), w=(512, 512, 3, 3), padding=1),
    "l4.1x1": dict(x=(32, 2048, 7, 7), w=(512, 2048, 1, 1)),
}


SMALL_PLANES = ("l2.3x3.s2", "l2.down.s2", "l4.3x3", "l4.1x1")  # output planes of 28 x 28 and 7 x 7

# On Hopper, nhwc_tma takes the channels_last layers of 4 k-tiles or more, in TF32 only where
# the windows read each input element 4 times or more (dispatch.py, item 3): layer -> (TF32, 16-bit).
# (TF32 layers of more than 64 output channels on nhwc_tma's a_regs tiles, dispatch.py item 3)
HOPPER_CL = {"l1.3x3": ("nhwc_tma", "nhwc_tma"), "l2.3x3.s2": ("nhwc_tma", "nhwc_tma"),
             "l2.down.s2": ("nhwc_tma", "nhwc_tma"), "l4.3x3": ("nhwc_tma", "nhwc_tma"),
             "l4.1x1": ("nhwc_tma", "nhwc_tma")}


def _tma(family, kernel):
    """On Hopper nhwc_tma takes the NCHW k x k layers nhwc would (TF32 and 16-bit; 1x1 ones stay)."""
    return "nhwc_tma" if family == "nhwc" and tuple(kernel) != (1, 1) else family


def _pw_tma(family, x, w, kw, esize):
    """On Hopper pointwise_tma takes the NCHW 1x1 stride-1 layers from 96 input channels into 64
    or more whose planes are whole 16-byte chunks (dispatch.py, item 2)."""
    aligned = x[2] * x[3] * esize % 16 == 0
    if tuple(w[2:]) == (1, 1) and kw.get("stride", 1) == 1 and x[1] >= 96 and w[0] >= 64 and aligned:
        return "pointwise_tma"
    return family


def _nhwc(*args, **kw):
    """The `nhwc` family's own choice of tiles (on Hopper the dispatcher may pick nhwc_tma)."""
    return _choose(*args, **kw, family="nhwc")


@pytest.mark.parametrize("name", sorted(R50))
@pytest.mark.parametrize("dtype,math", [("float32", "tf32"), ("float32", "ieee"), ("bfloat16", "ieee"),
                                        ("float16", "ieee")])
def test_channels_last_layers_go_to_nhwc_and_nchw_ones_on_small_planes(name, dtype, math):
    spec = _choose(**R50[name], dtype=dtype, math=math)
    strict = dtype == "float32" and math == "ieee"
    want = "nhwc" if strict else HOPPER_CL[name][dtype != "float32"]
    assert spec.family == want and spec.layout == "nhwc" and spec.math == math
    spec = _choose(**R50[name], dtype=dtype, math=math, arch="sm_80")  # no TMA im2col before Hopper
    assert spec.family == "nhwc" and spec.layout == "nhwc" and spec.math == math
    nchw = _choose(**R50[name], dtype=dtype, math=math, channels_last=False)
    if name in SMALL_PLANES:
        want = "nhwc" if strict else _tma("nhwc", R50[name]["w"][2:])
        assert nchw.family == want and nchw.layout == "nchw" and nchw.math == math
        nchw = _choose(**R50[name], dtype=dtype, math=math, channels_last=False, arch="sm_80")
        assert nchw.family == "nhwc" and nchw.layout == "nchw"
    else:  # 56 x 56: the NCHW families' per-image tiles are full, and no transpose to pay
        # (except TF32 64 -> 64 3x3 on Hopper, which nhwc_tma's transpose and wgmma beat: dispatch.py)
        tma = name == "l1.3x3" and dtype == "float32" and math == "tf32"
        assert nchw.family == ("nhwc_tma" if tma else "wgmma") and nchw.layout == "nchw"
        nchw = _choose(**R50[name], dtype=dtype, math=math, channels_last=False, arch="sm_80")
        assert nchw.family not in ("nhwc", "nhwc_tma")


def test_nchw_calls_keep_their_families_where_grouped_or_large():
    # grouped (ResNeXt's 32 groups on 14 x 14: grouped_mma's; not 64 a group), a plane just
    # over 32 x 32, and the five cases' planes
    assert _choose((32, 512, 14, 14), (512, 16, 3, 3), groups=32, padding=1, channels_last=False).family == "grouped_mma"
    assert _choose((32, 512, 14, 14), (512, 64, 3, 3), groups=8, padding=1, channels_last=False).family != "grouped_mma"
    # (16-bit here: TF32 64 -> 64 k x k layers go to nhwc_tma on rows that are not whole 128-column tiles)
    assert _choose((8, 64, 33, 32), (64, 64, 3, 3), padding=1, dtype="bfloat16", channels_last=False).family == "wgmma"
    assert _choose((8, 64, 32, 32), (64, 64, 3, 3), padding=1, dtype="bfloat16",
                   channels_last=False).family == "nhwc_tma"
    assert _choose((8, 64, 33, 32), (64, 64, 3, 3), padding=1, channels_last=False).family == "nhwc_tma"
    assert _choose((8, 64, 32, 32), (64, 64, 3, 3), padding=1, channels_last=False, arch="sm_80").family == "nhwc"
    assert _choose((16, 64, 1024, 1024), (128, 64, 1, 1), channels_last=False).family == "pointwise_tile"
    # too few channels for a 16-byte chunk: the NCHW families, as before
    assert _choose((32, 3, 14, 14), (64, 3, 3, 3), padding=1, channels_last=False).family not in ("nhwc", "nhwc_tma")


@pytest.mark.parametrize("x, w, kw, tf32, bf16", [
    # up to 9 taps from >= 96 input channels (16-bit: 128): nhwc on any plane
    ((8, 256, 56, 56), (256, 256, 3, 3), dict(padding=1), "nhwc", "nhwc"),
    ((32, 96, 56, 56), (96, 96, 3, 3), dict(padding=1), "nhwc", "wgmma"),
    ((8, 128, 112, 112), (128, 128, 3, 3), dict(padding=1, stride=2), "nhwc", "nhwc"),  # was igemm
    ((16, 128, 64, 64), (128, 128, 3, 1), dict(padding=(1, 0)), "nhwc", "nhwc"),
    ((16, 128, 64, 64), (128, 128, 5, 5), dict(padding=2), "wgmma", "wgmma"),  # 25 taps
    ((32, 64, 56, 56), (64, 64, 3, 3), dict(padding=1), "nhwc_tma", "wgmma"),  # TF32: nhwc_tma from 64 into 64
    ((8, 256, 64, 64), (256, 128, 3, 3), dict(padding=1, groups=2), "wgmma", "wgmma"),
    # 1x1 on planes over 32 x 32: nhwc from 256 into 256 or more (float32: into half as many),
    # wgmma where the outputs are twice the inputs or 16-bit from over 256, pointwise the rest
    ((8, 1024, 64, 64), (1024, 1024, 1, 1), {}, "nhwc", "nhwc"),
    ((8, 1024, 64, 64), (256, 1024, 1, 1), {}, "pointwise", "nhwc"),
    ((32, 128, 56, 56), (512, 128, 1, 1), {}, "wgmma", "wgmma"),
    ((32, 512, 56, 56), (128, 512, 1, 1), {}, "pointwise", "wgmma"),
    ((32, 256, 56, 56), (64, 256, 1, 1), {}, "pointwise", "pointwise"),
    # planes of 28 x 28: pointwise for reductions to a quarter from at most 512, else nhwc
    ((32, 512, 28, 28), (128, 512, 1, 1), {}, "pointwise", "pointwise"),
    ((32, 1024, 28, 28), (256, 1024, 1, 1), {}, "nhwc", "nhwc"),
    ((32, 128, 28, 28), (512, 128, 1, 1), {}, "nhwc", "nhwc"),
    ((32, 1024, 14, 14), (256, 1024, 1, 1), {}, "nhwc", "nhwc"),
    ((32, 256, 56, 56), (512, 256, 1, 1), dict(stride=2), "nhwc", "nhwc"),
    # the five cases' planes keep their families
    ((16, 64, 1024, 1024), (128, 64, 1, 1), {}, "pointwise_tile", "pointwise"),
    ((8, 64, 512, 256), (128, 64, 5, 7), dict(padding=(2, 3)), "wgmma", "wgmma"),
    ((16, 16, 1024, 1024), (128, 16, 3, 3), {}, "wgmma", "wgmma"),
])
def test_nchw_layers_on_large_planes(x, w, kw, tf32, bf16):
    assert _choose(x, w, channels_last=False, **kw).family == _pw_tma(_tma(tf32, w[2:]), x, w, kw, 4)
    assert _choose(x, w, dtype="bfloat16", channels_last=False, **kw).family == _pw_tma(_tma(bf16, w[2:]), x, w, kw, 2)
    assert _choose(x, w, channels_last=False, arch="sm_80", **kw).family not in ("nhwc_tma", "pointwise_tma")  # Hopper
    # strict float32 moves to nhwc on planes up to 32 x 32 only (elsewhere wgmma's 3xTF32 wins)
    small = (x[2] // kw.get("stride", 1)) * (x[3] // kw.get("stride", 1)) <= 1024
    assert (_choose(x, w, math="ieee", channels_last=False, **kw).family == "nhwc") == small


def test_what_it_cannot_take_goes_elsewhere():
    # depthwise (one channel a group) has a channels_last family of its own, and so do dense
    # layers of few input channels (stem_nhwc: 3 float32 channels are under a 16-byte chunk, 4
    # bf16 under 8); an odd number of output channels a group and float64 go to direct
    assert _choose((8, 32, 28, 28), (32, 1, 3, 3), groups=32, padding=1).family == "depthwise_nhwc"
    assert _choose((8, 3, 224, 224), (64, 3, 7, 7), stride=2, padding=3).family == "stem_nhwc"
    assert _choose((8, 4, 28, 28), (64, 4, 3, 3), dtype="bfloat16").family == "stem_nhwc"
    assert _choose((8, 64, 28, 28), (63, 64, 3, 3)).family == "direct"
    assert _choose((8, 64, 28, 28), (64, 64, 3, 3), dtype="float64", math="ieee").family == "direct"


def test_tiles_without_a_family_pick_a_family_that_has_them():
    # channels_last 1x1: the families before nhwc (depthwise_nhwc, grouped_nhwc) have no `chunks`
    spec = _choose((32, 24, 56, 56), (144, 24, 1, 1), dtype="bfloat16", tiles={"chunks": 4})
    assert spec.family == "nhwc" and dict(spec.tiles)["chunks"] == 4
    # NCHW 56 x 56: nhwc has `block_m` but is not chosen there; wgmma (next in order) is
    spec = _choose(**R50["l1.3x3"], channels_last=False, tiles={"block_m": 128})
    assert spec.family == "wgmma" and dict(spec.tiles)["block_m"] == 128
    # only nhwc has `chunks`: taken though the dispatcher would not choose it there
    spec = _choose(**R50["l1.3x3"], channels_last=False, tiles={"chunks": 4})
    assert spec.family == "nhwc" and spec.layout == "nchw"
    with pytest.raises(ConvArgumentError, match="has no tile parameter"):
        _choose(**R50["l1.3x3"], tiles={"no_such_tile": 1})


def test_refusals_say_why():
    with pytest.raises(ConvArgumentError, match="16-byte chunks"):
        _choose((8, 12, 28, 28), (64, 12, 3, 3), dtype="bfloat16", family="nhwc")
    with pytest.raises(ConvArgumentError, match="pairs of output channels"):
        _choose((8, 64, 28, 28), (63, 64, 3, 3), family="nhwc")
    with pytest.raises(ConvArgumentError, match="registers"):
        _choose(**R50["l2.3x3.s2"], family="nhwc", tiles={"block_m": 256, "block_n": 128, "chunks": 8, "wg": 0})
    with pytest.raises(ConvArgumentError, match="cannot share"):
        _choose(**R50["l1.3x3"], family="nhwc", tiles={"block_m": 64, "block_n": 128, "chunks": 2, "wg": 0})
    # wgmma: Hopper only, no 3xTF32, accumulators that cannot spill, 256-channel tiles its own
    with pytest.raises(ConvArgumentError, match="needs sm_90a"):
        _choose(**R50["l1.3x3"], family="nhwc", tiles={"wg": 1}, arch="sm_80")
    with pytest.raises(ConvArgumentError, match="mma.sync only"):
        _choose(**R50["l1.3x3"], math="ieee", family="nhwc", tiles={"wg": 1})
    with pytest.raises(ConvArgumentError, match="accumulators stay in registers"):
        _choose(**R50["l1.3x3"], family="nhwc", tiles={"wg": 1, "block_m": 128, "block_n": 256, "min_blocks": 2})
    with pytest.raises(ConvArgumentError, match="256-channel tiles"):
        _choose(**R50["l1.3x3"], family="nhwc", tiles={"wg": 0, "block_n": 256})


@pytest.mark.parametrize("name", sorted(R50))
@pytest.mark.parametrize("dtype,math", [("float32", "tf32"), ("float32", "ieee"), ("bfloat16", "ieee")])
def test_default_tiles_fit_and_fill_the_card(name, dtype, math):
    spec = _nhwc(**R50[name], dtype=dtype, math=math)
    t = dict(spec.tiles)
    lay = FAM.layout(spec, t)
    assert lay["SMEM_BYTES"] <= SMEM_LIMIT
    assert lay["REGS"] * lay["NTH"] * t["min_blocks"] <= 65536
    x, w = R50[name]["x"], R50[name]["w"]
    P, Q = ConvSpec(x[1], w[0], w[2:], R50[name].get("stride", 1), R50[name].get("padding", 0)).output_size(x[2], x[3])
    blocks = -(-x[0] * P * Q // t["block_m"]) * -(-w[0] // t["block_n"])
    if dtype == "float32" and math == "ieee":
        assert t["block_m"] == 64 and t["wg"] == 0  # mma.sync, with room for the k-tile sums
    if t["wg"]:  # wgmma: 128 pixels, channels halved only while under half a wave
        assert t["block_m"] == 128 and (blocks >= 66 or t["block_n"] == 64) and t["stages"] >= 3
    else:
        assert blocks >= 132 or (t["block_m"], t["block_n"]) == (64, 64)  # two waves, or the smallest tiles
    # the template's context carries the same constants, and the workspace the repacked weights
    ctx = spec.template_context()
    assert ctx["SMEM_BYTES"] == lay["SMEM_BYTES"] and ctx["NTH"] == lay["NTH"]
    esize = 4 if dtype == "float32" else 2
    wbytes = w[0] * w[1] * w[2] * w[3] * esize
    if FAM.round_copy(spec):  # wgmma on TF32 read 4 times or more: a rounded input copy after the weights
        assert ctx["WORKSPACE_BYTES"] == ctx["WS_X_OFFSET"] == -(-wbytes // 256) * 256
        assert ctx["WORKSPACE_PER_INPUT"] == 4
    else:
        assert ctx["WORKSPACE_BYTES"] == wbytes and ctx["WORKSPACE_PER_INPUT"] == 0
    if name in SMALL_PLANES:  # NCHW: the weights, then the transposed input from a 256-byte boundary
        ctx = _nhwc(**R50[name], dtype=dtype, math=math, channels_last=False).template_context()
        assert ctx["WORKSPACE_BYTES"] == ctx["WS_X_OFFSET"] == -(-w[0] * w[1] * w[2] * w[3] * esize // 256) * 256
        assert ctx["WORKSPACE_PER_INPUT"] == esize


def test_few_channels_take_short_k_tiles():
    # 16 float32 channels fill four 16-byte chunks; 8 bf16 channels one (the smallest k-tile is two)
    assert dict(_nhwc((8, 16, 64, 64), (64, 16, 3, 3), padding=1).tiles)["chunks"] == 4
    assert dict(_nhwc((8, 8, 64, 64), (64, 8, 3, 3), dtype="bfloat16", padding=1).tiles)["chunks"] == 2
    assert dict(_nhwc(**R50["l1.3x3"]).tiles)["chunks"] == 8


def test_wgmma_on_hopper_for_tf32_and_16_bit_rows_of_eight_chunks():
    for dtype in ("float32", "bfloat16", "float16"):
        assert dict(_nhwc(**R50["l4.3x3"], dtype=dtype).tiles)["wg"] == 1
        assert dict(_nhwc(**R50["l4.3x3"], dtype=dtype, arch="sm_80").tiles)["wg"] == 0
    assert dict(_nhwc(**R50["l4.3x3"], math="ieee").tiles)["wg"] == 0  # 3xTF32 stays on mma.sync
    assert dict(_nhwc((8, 16, 64, 64), (64, 16, 3, 3), padding=1).tiles)["wg"] == 0  # rows of 4 chunks
    # 52 blocks of 128 x 128 on 32 x 7 x 7: halved to 64 channels; 98 on 14 x 14 keep 128
    assert dict(_nhwc(**R50["l4.3x3"]).tiles)["block_n"] == 64
    assert dict(_nhwc((32, 256, 14, 14), (256, 256, 3, 3), padding=1).tiles)["block_n"] == 128
    # a ring of 3 (two blocks an SM) for short reductions, 4 for long ones
    assert dict(_nhwc(**R50["l2.down.s2"]).tiles)["stages"] == 3
    assert dict(_nhwc(**R50["l4.3x3"]).tiles)["stages"] == 4
    # tiles only mma.sync takes keep it
    assert dict(_nhwc(**R50["l1.3x3"], tiles={"stages": 2}).tiles)["wg"] == 0


def test_wgmma_rounds_a_copy_of_channels_last_tf32_inputs_read_four_times_or_more():
    assert FAM.round_copy(_nhwc(**R50["l4.3x3"]))  # 9 taps
    assert FAM.round_copy(_nhwc(**R50["l4.1x1"]))  # 8 blocks across 512 channels
    assert not FAM.round_copy(_nhwc(**R50["l2.down.s2"]))  # 1x1 stride 2: a quarter of the input, once
    assert not FAM.round_copy(_nhwc(**R50["l2.3x3.s2"]))  # 9 taps over stride 2 x 2: 2.25 reads
    assert not FAM.round_copy(_nhwc(**R50["l4.3x3"], channels_last=False))  # the transpose rounds
    assert not FAM.round_copy(_nhwc(**R50["l4.3x3"], dtype="bfloat16"))
    assert not FAM.round_copy(_nhwc(**R50["l4.3x3"], tiles={"wg": 0}))


def test_forced_tiles_hold():
    spec = _choose(**R50["l1.3x3"], family="nhwc", tiles={"block_m": 256, "block_n": 64, "stages": 2})
    t = dict(spec.tiles)
    assert (t["block_m"], t["block_n"], t["stages"]) == (256, 64, 2)
    assert FAM.layout(spec, t)["NTH"] == 256




@pytest.mark.nvcc
@pytest.mark.compile
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("name,dtype,math,bias,tiles,cl", [
    ("l1.3x3", "float32", "tf32", False, None, True), ("l1.3x3", "float32", "ieee", True, None, True),
    ("l1.3x3", "bfloat16", "ieee", True, None, True), ("l2.down.s2", "float16", "ieee", False, None, True),
    ("l4.3x3", "float32", "tf32", True, None, True),
    ("l2.3x3.s2", "bfloat16", "ieee", False, {"block_m": 256, "block_n": 64}, True),
    ("l1.3x3", "float32", "tf32", False, {"block_m": 64, "block_n": 32, "stages": 2}, True),
    # NCHW calls: the input transpose and the NCHW epilogue
    ("l4.3x3", "float32", "tf32", True, None, False), ("l4.1x1", "float32", "ieee", False, None, False),
    ("l2.3x3.s2", "bfloat16", "ieee", True, None, False), ("l2.down.s2", "float16", "ieee", False, None, False),
    # the mma.sync path where wgmma is the default
    ("l4.3x3", "bfloat16", "ieee", True, {"wg": 0}, True), ("l4.1x1", "float32", "tf32", False, {"wg": 0}, False),
    # wgmma: rows of 4 and 2 chunks (64- and 32-byte swizzles), 256-channel and 256-pixel tiles
    ("l1.3x3", "float32", "tf32", False, {"wg": 1, "chunks": 4, "block_n": 256, "block_m": 64}, True),
    ("l1.3x3", "bfloat16", "ieee", False, {"wg": 1, "chunks": 2, "block_m": 256, "block_n": 64}, True),
    ("l2.down.s2", "float32", "tf32", True, None, True),  # TF32 rounded in shared memory, not copied
])
def test_lowers_to_mma_sync_fed_by_cp_async_without_spills(name, dtype, math, bias, tiles, cl, tmp_path):
    spec = _choose(**R50[name], dtype=dtype, math=math, family="nhwc", tiles=tiles, channels_last=cl)
    spec = spec.replace(bias=bias)
    assert spec.layout == ("nhwc" if cl else "nchw")
    text, report = lower(spec, tmp_path)
    ab = {"float32": "tf32.tf32", "bfloat16": "bf16.bf16", "float16": "f16.f16"}[dtype]
    t = dict(spec.tiles)
    if t["wg"]:
        assert f"wgmma.mma_async.sync.aligned.m64n{t['block_n']}k{8 if dtype == 'float32' else 16}.f32.{ab}" in text
        assert "mma.sync" not in text and "fence.proxy.async.shared::cta" in text
    else:
        shape = "m16n8k8" if dtype == "float32" else "m16n8k16"
        assert f"mma.sync.aligned.{shape}.row.col.f32.{ab}.f32" in text and "wgmma" not in text
    assert "cp.async.cg.shared.global" in text
    assert ("cvt.rna.tf32.f32" in text) == (dtype == "float32")
    # the repack (and, over 1x1, the one that reads NCHW's dense weights through shared memory),
    # the main loop's two input paths, (NCHW) the input transpose and (wgmma on a channels_last
    # TF32 input) the rounding copy, none spilling
    rounds = FAM.round_copy(spec)
    assert not rounds or (cl and t["wg"] == 1 and dtype == "float32" and math == "tf32")
    taps = spec.kernel_size != (1, 1)
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == 3 + (not cl) + rounds + taps, report
    assert ("kg_nhwc_transpose" in text) == (not cl) and ("kg_nhwc_round" in text) == rounds
    assert ("kg_repack_oihw" in text) == taps
    if dtype != "float32":
        # wgmma's 16-bit channels_last tiles leave through shared memory as 16-byte row vectors
        # (STAGE_Y; these tiles all fit the ring); the others store fragments' channel pairs.
        assert ("st.global.v4" in text) == bool(t["wg"] and cl), text.count("st.global.v4")
