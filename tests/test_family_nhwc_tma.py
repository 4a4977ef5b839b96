"""CPU-tier tests of the `nhwc_tma` family (channels_last implicit GEMM fed by the TMA's im2col
mode, sm_90a): no GPU needed.

What they cover: which calls it can serve (dense layers of whole 16-byte chunks of channels in
TF32 and 16-bit, channels_last or through the input's transpose, on sm_90a) and which it cannot
(strict float32, groups, targets before Hopper), that its refusals name the reason, that default
and forced tiles fit and agree with the template's layout, and (with nvcc) that every dtype
lowers to wgmma fed by TMA im2col and tiled copies through mbarriers, with no spills. Which
family the selector picks for a call is measured, not asserted here.
"""

from __future__ import annotations

import re

import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError
from kernelgen.families import get_family
from kernelgen.families.nhwc_tma import SHORT_1X1_K_TILES, k_tiles, reg_cap, short_1x1
from kernelgen.render import render
from kernelgen.spec import ConvSpec, Problem
from lowering import NVCC, lower

FAM = get_family("nhwc_tma")


def _choose(x, w, dtype="float32", math="tf32", stride=1, padding=0, dilation=1, groups=1, family="nhwc_tma",
            tiles=None, arch="sm_90a", bias=False, channels_last=True, scale=False):
    """The spec `family` (this one by default) runs the call with, on a nominal GPU of target `arch`."""
    params = dict(in_channels=x[1], out_channels=w[0], kernel_size=w[2:], stride=stride, padding=padding,
                  dilation=dilation, groups=groups, dtype=dtype, bias=bias, scale=scale)
    P, Q = ConvSpec(**params).output_size(x[2], x[3])
    problem = Problem(N=x[0], H=x[2], W=x[3], P=P, Q=Q, device=nominal(arch))
    return select.choose(params, "cuda", problem, channels_last, math if dtype == "float32" else "ieee",
                         family=family, tiles=tiles)


VGG64 = dict(x=(8, 64, 224, 224), w=(64, 64, 3, 3), padding=1)
VGG256 = dict(x=(8, 256, 56, 56), w=(256, 256, 3, 3), padding=1)
S2 = dict(x=(32, 128, 56, 56), w=(128, 128, 3, 3), stride=2, padding=1)
PW = dict(x=(32, 64, 56, 56), w=(256, 64, 1, 1))  # one k-tile of bf16, two of float32
DOWN = dict(x=(32, 256, 56, 56), w=(512, 256, 1, 1), stride=2)
L4 = dict(x=(32, 512, 7, 7), w=(512, 512, 3, 3), padding=1)  # ResNet-50's last 3x3: 13 tiles of 128 pixels


@pytest.mark.parametrize("layer", [VGG64, VGG256, S2, PW, DOWN], ids=["vgg64", "vgg256", "s2", "pw", "down"])
def test_serves_tf32_and_16_bit_on_sm_90a_only(layer):
    for dtype in ("float32", "bfloat16", "float16"):
        for channels_last in (True, False):
            for wide in (False, True):  # the H100 and the H200
                spec = _choose(**layer, dtype=dtype, channels_last=channels_last)
                assert spec.layout == ("nhwc" if channels_last else "nchw")
                FAM.check(spec, nominal("sm_90a", wide_dram=wide))
    with pytest.raises(ConvArgumentError, match="3xTF32"):  # strict float32
        _choose(**layer, math="ieee")
    for arch in ("sm_80", "sm_89", "sm_90"):  # (wgmma and the TMA's im2col need the 'a' target)
        with pytest.raises(ConvArgumentError, match="runs on sm_90a"):
            _choose(**layer, dtype="bfloat16", arch=arch)


@pytest.mark.parametrize("x, w, dtype, expect", [
    # 16-bit: every short reduction walks; 129-256 output channels in one block of 256, 64 or fewer
    # with the weights resident in two pipelines; (persist, block_co)
    ((32, 24, 56, 56), (144, 24, 1, 1), "bfloat16", (1, 256)),
    ((32, 16, 112, 112), (96, 16, 1, 1), "float16", (1, 128)),
    ((32, 64, 56, 56), (256, 64, 1, 1), "bfloat16", (1, 256)),
    ((32, 64, 56, 56), (64, 64, 1, 1), "bfloat16", (1, 64)),
    ((32, 144, 56, 56), (24, 144, 1, 1), "bfloat16", (1, 64)),
    ((32, 128, 28, 28), (128, 128, 1, 1), "bfloat16", (1, 128)),
    ((32, 256, 14, 14), (1024, 256, 1, 1), "bfloat16", (1, 128)),
    ((32, 320, 7, 7), (1280, 320, 1, 1), "bfloat16", (1, 128)),  # 5 k-tiles: the most
    ((32, 512, 28, 28), (128, 512, 1, 1), "bfloat16", (0, 128)),  # 8: one block a tile
    # TF32 into 64 or fewer: rounding warps, walking (over 64: a_regs tiles, below)
    ((32, 64, 56, 56), (64, 64, 1, 1), "float32", (1, 64)),
    ((32, 144, 56, 56), (24, 144, 1, 1), "float32", (1, 64)),  # 5 k-tiles of float32
    ((32, 192, 28, 28), (64, 192, 1, 1), "float32", None),  # 6: past short_1x1
])
def test_short_1x1_layers_walk_tiles(x, w, dtype, expect):
    spec = _choose(x, w, dtype=dtype)
    t = dict(spec.tiles)
    assert short_1x1(spec) == (k_tiles(spec) <= SHORT_1X1_K_TILES)
    if expect is None:
        assert not short_1x1(spec)
    else:
        assert (t["persist"], t["block_co"]) == expect
    # not at stride 2, nor in NCHW (pointwise_tma and the 1x1 table decide those)
    assert not short_1x1(_choose(x, w, dtype=dtype, stride=2, family="nhwc_tma"))
    assert not short_1x1(_choose(x, w, dtype=dtype, channels_last=False, family="nhwc_tma"))


def test_short_1x1_tf32_layers_past_64_output_channels_keep_a_regs_tiles():
    for x, w in (((32, 24, 56, 56), (144, 24, 1, 1)), ((32, 64, 56, 56), (256, 64, 1, 1))):
        t = dict(_choose(x, w).tiles)
        assert (t["a_regs"], t["persist"], t["block_co"]) == (1, 1, 128)


def test_nchw_calls_transpose_their_input_into_the_workspace():
    for layer, dtype, esize in ((VGG256, "float32", 4), (S2, "bfloat16", 2), (L4, "float16", 2)):
        spec = _choose(**layer, dtype=dtype, channels_last=False, bias=True)
        assert spec.layout == "nchw" and spec.template_context()["WORKSPACE_PER_INPUT"] == esize


def test_channels_in_whole_16_byte_chunks():
    # 12 float32 channels are whole chunks (the k-tile's other 20 are zero-filled); 12 bf16 are not
    FAM.check(_choose((8, 12, 28, 28), (64, 12, 3, 3), padding=1))
    with pytest.raises(ConvArgumentError, match="16-byte chunks"):
        _choose((8, 12, 28, 28), (64, 12, 3, 3), dtype="bfloat16", padding=1)


def test_refusals_say_why():
    with pytest.raises(ConvArgumentError, match="groups=1"):
        _choose((8, 64, 28, 28), (64, 32, 3, 3), groups=2, family="nhwc_tma")
    with pytest.raises(ConvArgumentError, match="3xTF32"):
        _choose(**VGG64, math="ieee", family="nhwc_tma")
    with pytest.raises(ConvArgumentError, match="16-byte chunks"):
        _choose((8, 64, 28, 28), (30, 64, 3, 3), dtype="bfloat16", family="nhwc_tma")
    with pytest.raises(ConvArgumentError, match="runs on sm_90a"):
        _choose(**VGG64, family="nhwc_tma", arch="sm_80")
    with pytest.raises(ConvArgumentError, match="im2col box"):
        _choose((1, 8, 300, 300), (8, 8, 3, 3), dilation=100, family="nhwc_tma")
    with pytest.raises(ConvArgumentError, match="steps 8 pixels"):
        _choose((1, 8, 300, 300), (8, 8, 9, 9), stride=9, family="nhwc_tma")
    with pytest.raises(ConvArgumentError, match="1024"):  # 8 consumer warpgroups and the producer
        _choose(**VGG256, dtype="bfloat16", family="nhwc_tma", tiles={"block_co": 256, "block_p": 64, "wgn": 2,
                                                                      "stages": 3, "min_blocks": 1})
    with pytest.raises(ConvArgumentError, match="round_smem"):
        _choose(**VGG64, dtype="bfloat16", family="nhwc_tma", tiles={"round_smem": 4})
    with pytest.raises(ConvArgumentError, match="round_smem"):
        _choose(**VGG64, channels_last=False, family="nhwc_tma", tiles={"round_smem": 4})
    with pytest.raises(ConvArgumentError, match="shared memory"):
        _choose(**VGG64, family="nhwc_tma", tiles={"block_co": 256, "block_p": 256, "stages": 4})
    with pytest.raises(ConvArgumentError, match="registers"):
        _choose(**VGG256, dtype="bfloat16", family="nhwc_tma",
                tiles={"block_co": 256, "block_p": 256, "wgn": 1, "stages": 3, "min_blocks": 1})
    with pytest.raises(ConvArgumentError, match="staged output tile"):
        _choose(**VGG64, family="nhwc_tma", tiles={"block_co": 256, "block_p": 256, "stages": 2, "min_blocks": 1})


@pytest.mark.parametrize("layer", [VGG64, VGG256, S2, DOWN])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_tiles_fit(layer, dtype):
    spec = _choose(**layer, dtype=dtype, family="nhwc_tma")
    t = dict(spec.tiles)
    lay = FAM.layout(spec, t)
    # 64 output channels a block where the layer has no more; 128 pixels a warpgroup, or (halo
    # tiles, VGG's 224-pixel rows) half a row
    halo = layer is VGG64
    areg = dtype == "float32" and layer["w"][0] > 64  # TF32 past 64 output channels: a_regs tiles
    assert t["block_co"] == (64 if layer["w"][0] <= 64 else 128) and t["wgn"] == 1
    assert (t["halo"], t["block_p"]) == ((1, 112) if halo else (0, 128))
    # TF32 rounds 64-channel tiles' pixels in shared memory (4 warps); a_regs tiles in their fragments
    assert t["round_smem"] == (4 if dtype == "float32" and t["block_co"] == 64 else 0)
    assert t["a_regs"] == areg
    ctx = spec.template_context()
    assert ctx["SMEM_BYTES"] == lay["SMEM_BYTES"] and ctx["BCO"] == t["block_co"]
    assert ctx["WN"] == (64 if areg else t["block_p"]) and ctx["AREG"] == areg
    assert lay["SMEM_BYTES"] + lay["STATIC"] <= nominal().smem_block
    if halo:
        # persistent blocks, one an SM, over windows of 3 rows x 114 pixels; 16-bit with the
        # weights resident and three windows, TF32 with a ring of the weights' boxes and two
        assert (t["persist"], t["min_blocks"], t["pipes"]) == (1, 1, 1) and (lay["HB"], lay["WB"]) == (3, 114)
        window = 3 * 114 * 128 // 1024 * 1024 + 1024  # 1 KB-aligned slots
        staged = 112 * (64 + 16 // (4 if dtype == "float32" else 2)) * (4 if dtype == "float32" else 2)
        if dtype == "bfloat16":
            assert (t["wres"], t["stages"]) == (1, 3)
            assert lay["SMEM_BYTES"] == 9 * 64 * 128 + 3 * window + staged + 1024
        else:
            assert (t["wres"], t["stages"], t["wstages"]) == (0, 2, 4)
            assert lay["SMEM_BYTES"] == 4 * 64 * 128 + 2 * window + staged + 1024
    elif areg:
        # persistent blocks, one an SM, of two warpgroups of 64 pixels; each warp stages its rows
        # apart from the ring
        assert (t["persist"], t["wres"], t["pipes"], t["min_blocks"]) == (1, 0, 1, 1)
        assert lay["NTH"] == 2 * 128 + 32 and lay["STAGED"] == 0 and lay["REGS"] <= reg_cap(lay["NTH"], 1)
        assert lay["SMEM_BYTES"] == t["stages"] * (128 + 128) * 128 + 128 * (128 + 8) * 4 + 1024
    elif dtype == "bfloat16" and t["block_co"] == 64:
        # 16-bit 64-channel tiles: the weights resident (72 KB) under two pipelines, one block an SM
        assert (t["persist"], t["wres"], t["pipes"], t["min_blocks"], t["stages"]) == (1, 1, 2, 1, 3)
        assert lay["NTH"] == 2 * (128 + 32) and lay["REGS"] <= reg_cap(lay["NTH"], 1)
    else:
        # two blocks an SM with a ring of three slots or more, one block a tile
        assert (t["persist"], t["wres"], t["pipes"], t["min_blocks"]) == (0, 0, 1, 2) and t["stages"] >= 3
        assert 2 * (lay["SMEM_BYTES"] + 1024) <= nominal().smem_sm
        assert lay["REGS"] <= reg_cap(lay["NTH"], 2) and lay["STAGED"] <= lay["RING"]
        assert lay["NTH"] == 128 * t["block_co"] // 64 + 32 + 32 * t["round_smem"]
    # the weights packed in whole k-tiles (kept with the weight); the call's scratch has room for a
    # dense copy of the input
    esize = 4 if dtype == "float32" else 2
    kt = layer["w"][2] * layer["w"][3] * -(-layer["w"][1] * esize // 128)
    assert ctx["PACKED_BYTES"] == layer["w"][0] * kt * 128
    assert ctx["WORKSPACE_BYTES"] == 0 and ctx["WORKSPACE_PER_INPUT"] == esize


def test_register_and_shared_memory_budgets_follow_ptxas_and_the_driver():
    # ptxas counts warps in fours: 672 threads in two blocks get 40 registers, 288 get 80
    assert reg_cap(672, 2) == 40 and reg_cap(288, 2) == 80 and reg_cap(160, 2) == 128
    # tile classes ptxas refused at two blocks an SM (it asked 90, 58 and 42 registers)
    for tiles in ({"block_co": 128, "round_smem": 2}, {"block_co": 256, "block_p": 64},
                  {"block_co": 128, "block_p": 64, "wgn": 2, "round_smem": 4}):
        with pytest.raises(ConvArgumentError, match="registers"):
            _choose((2, 16, 9, 9), (48, 16, 7, 7), stride=2, padding=1, family="nhwc_tma",
                    tiles={**tiles, "stages": 3, "min_blocks": 2})
    # the defaults of 64- and 128-channel tiles keep two blocks an SM (but halo and a_regs tiles: one)
    assert dict(_choose(**VGG64, family="nhwc_tma", tiles={"halo": 0}).tiles)["min_blocks"] == 2
    assert dict(_choose(**VGG256, family="nhwc_tma", tiles={"a_regs": 0}).tiles)["min_blocks"] == 2
    # the mbarriers' static shared memory (three a slot, the weights' and one pair of the halo
    # weights' ring, which has none here) counts against the 227 KB too
    spec = _choose(**VGG256, family="nhwc_tma", tiles={"stages": 7, "min_blocks": 1, "a_regs": 0})
    lay = FAM.layout(spec, dict(spec.tiles))
    assert lay["STATIC"] == 24 * 7 + 8 + 16 and lay["SMEM_BYTES"] + lay["STATIC"] <= nominal().smem_block


def test_resident_weights_and_two_pipelines_are_refused_where_they_cannot_work():
    with pytest.raises(ConvArgumentError, match="persistent"):
        _choose(**VGG64, dtype="bfloat16", family="nhwc_tma", tiles={"wres": 1, "persist": 0})
    with pytest.raises(ConvArgumentError, match="one block of output channels"):
        _choose(**VGG256, dtype="bfloat16", family="nhwc_tma", tiles={"persist": 1, "wres": 1, "block_co": 128})
    with pytest.raises(ConvArgumentError, match="two pipelines"):
        _choose(**VGG64, dtype="bfloat16", family="nhwc_tma", tiles={"persist": 1, "pipes": 2, "wres": 0})
    with pytest.raises(ConvArgumentError, match="shared memory"):  # 18 k-tiles of TF32 weights and two rings
        _choose(**VGG64, family="nhwc_tma", tiles={"persist": 1, "wres": 1, "pipes": 2, "round_smem": 0,
                                                   "stages": 3, "min_blocks": 1})
    spec = _choose(**VGG64, dtype="bfloat16", family="nhwc_tma",
                   tiles={"persist": 1, "wres": 1, "pipes": 2, "stages": 3, "min_blocks": 1})
    lay = FAM.layout(spec, dict(spec.tiles))
    # 9 k-tiles of 64 x 128-byte weights, two rings of 3 x 16 KB and two 128 x 144-byte stagings
    assert lay["SMEM_BYTES"] == 9 * 8192 + 2 * (3 * 16384 + 128 * 144) + 1024 and lay["NTH"] == 2 * 160


@pytest.mark.parametrize("layer,dtype,cl,expect", [
    (VGG64, "float32", True, 112), (VGG64, "float16", True, 112),
    (dict(x=(4, 64, 256, 256), w=(64, 64, 3, 3), padding=1), "bfloat16", True, 128),
    (dict(x=(4, 32, 90, 130), w=(64, 32, 3, 3), padding=1), "bfloat16", True, 80),  # 130: 2 x 80 (of 128: 2 x 128)
    (dict(x=(32, 64, 56, 56), w=(64, 64, 3, 3), padding=1), "bfloat16", True, None),  # rows under 112
    (VGG64, "float32", False, None),  # NCHW calls (measured slower)
    (dict(x=(8, 64, 224, 224), w=(64, 64, 3, 3), padding=1, stride=2), "bfloat16", True, None),
    (dict(x=(8, 128, 112, 112), w=(128, 128, 3, 3), padding=1), "float32", True, None),  # 128-channel tiles
])
def test_halo_tiles_are_the_default_on_long_rows_of_64_output_channels(layer, dtype, cl, expect):
    spec = _choose(**layer, dtype=dtype, family="nhwc_tma", channels_last=cl)
    t = dict(spec.tiles)
    assert t["halo"] == (expect is not None)
    if expect is not None:
        assert t["block_p"] == expect and t["persist"] == 1
    # a forced halo=0 or block_p holds
    assert dict(_choose(**layer, dtype=dtype, family="nhwc_tma", channels_last=cl, tiles={"halo": 0}).tiles)["halo"] == 0
    if expect is not None:
        assert dict(_choose(**layer, dtype=dtype, family="nhwc_tma", channels_last=cl,
                            tiles={"block_p": 64}).tiles)["block_p"] == 64


def test_halo_block_p_covers_a_row_with_the_fewest_idle_pixels():
    from kernelgen.families.nhwc_tma import halo_block_p
    assert [halo_block_p(q, 16) for q in (112, 130, 200, 224, 256, 1022)] == [112, 80, 112, 112, 128, 128]
    assert halo_block_p(104, 8) == 112 and halo_block_p(56, 8) == 56 and halo_block_p(56, 16) == 64


def test_halo_refusals_say_why():
    halo = {"halo": 1, "persist": 1, "stages": 2, "min_blocks": 1}
    with pytest.raises(ConvArgumentError, match="stride 1"):
        _choose(**S2, family="nhwc_tma", tiles=halo)
    with pytest.raises(ConvArgumentError, match="two window slots"):
        _choose(**VGG64, family="nhwc_tma", tiles={**halo, "stages": 1})
    with pytest.raises(ConvArgumentError, match="TMA's box"):
        _choose(**VGG64, dtype="bfloat16", family="nhwc_tma", tiles={**halo, "block_p": 256, "wgn": 2})
    with pytest.raises(ConvArgumentError, match="multiple of 16"):
        _choose(**VGG64, dtype="bfloat16", family="nhwc_tma", tiles={**halo, "block_p": 56})


SMALL = dict(x=(32, 512, 7, 7), w=(512, 512, 3, 3), padding=1)  # 52 tiles of 128 pixels x 128 channels


@pytest.mark.parametrize("layer,block_p", [(S2, 128), (DOWN, 128), (PW, 128), (VGG256, 128), (SMALL, 64),
                                           (dict(x=(32, 2048, 7, 7), w=(512, 2048, 1, 1)), 64)])
def test_tf32_channels_last_past_64_output_channels_takes_a_regs_tiles(layer, block_p):
    # (nhwc_tma.py's default_tiles quotes the A/B)
    t = dict(_choose(**layer).tiles)
    assert (t["a_regs"], t["persist"], t["round_smem"], t["block_co"], t["block_p"]) == (1, int(block_p == 128), 0, 128,
                                                                                         block_p)
    spec = _choose(**layer)
    lay = FAM.layout(spec, t)
    assert lay["NTH"] == 128 * block_p // 64 + 32 and lay["REGS"] <= reg_cap(lay["NTH"], t["min_blocks"])
    assert lay["SMEM_BYTES"] + lay["STATIC"] <= nominal().smem_block
    # 16-bit, NCHW calls and 64 output channels or fewer keep what they had
    assert dict(_choose(**layer, dtype="bfloat16", family="nhwc_tma").tiles)["a_regs"] == 0
    assert dict(_choose(**layer, channels_last=False).tiles)["a_regs"] == 0
    assert dict(_choose(**VGG64).tiles)["a_regs"] == 0
    # a forced a_regs=0 gives the tiles before them
    assert dict(_choose(**VGG256, family="nhwc_tma", tiles={"a_regs": 0}).tiles)["round_smem"] == 0


def test_a_regs_refusals_say_why():
    with pytest.raises(ConvArgumentError, match="channels_last rows"):
        _choose(**VGG256, channels_last=False, family="nhwc_tma", tiles={"a_regs": 1})
    with pytest.raises(ConvArgumentError, match="round_smem=0, wgn=1"):
        _choose(**VGG64, family="nhwc_tma", tiles={"a_regs": 1, "round_smem": 4})
    with pytest.raises(ConvArgumentError, match="round_smem=0, wgn=1"):
        _choose(**VGG256, family="nhwc_tma", tiles={"a_regs": 1, "wgn": 2})
    with pytest.raises(ConvArgumentError, match="64 pixels a warpgroup"):
        _choose(**VGG256, family="nhwc_tma", tiles={"a_regs": 1, "block_p": 96})
    with pytest.raises(ConvArgumentError, match="registers"):  # four warpgroups of 64 pixels
        _choose(**VGG256, family="nhwc_tma", tiles={"a_regs": 1, "block_p": 256, "block_co": 64, "stages": 2,
                                                   "min_blocks": 1})


def test_split_reductions_take_one_block_a_tile_and_room_for_their_partial_sums():
    for dtype, cl in (("bfloat16", True), ("float32", True), ("float32", False)):
        spec = _choose(**L4, dtype=dtype, family="nhwc_tma", tiles={"splits": 4}, channels_last=cl)
        t = dict(spec.tiles)
        # forced splits walk no tiles, whatever the layer's default (TF32 channels_last: a_regs tiles)
        assert (t["splits"], t["persist"], t["halo"], t["wres"]) == (4, 0, 0, 0)
        assert t["a_regs"] == int(dtype == "float32" and cl)
        ctx = spec.template_context()
        # the partial sums: four float32 sums an output element, from a 256-byte boundary past the
        # input's copy
        assert ctx["WORKSPACE_PER_OUTPUT"] == 16 and ctx["WORKSPACE_BYTES"] == 256
        assert ctx["WORKSPACE_PER_INPUT"] == (4 if dtype == "float32" else 2)
    unsplit = _choose(**L4, dtype="bfloat16", family="nhwc_tma", tiles={"splits": 1}).template_context()
    assert unsplit["SPLITS"] == 1 and unsplit["WORKSPACE_PER_OUTPUT"] == 0
    assert unsplit["WORKSPACE_BYTES"] == 0


@pytest.mark.parametrize("layer,dtype,cl,splits", [
    # 52 tiles of 128 output channels x 128 pixels: split in two (16-bit channels_last, NCHW)
    (L4, "bfloat16", True, 2), (L4, "bfloat16", False, 2), (L4, "float32", False, 2),
    (dict(x=(32, 2048, 7, 7), w=(512, 2048, 1, 1)), "bfloat16", True, 2),
    # 98 tiles: whole reductions; TF32 channels_last keeps its a_regs tiles whole
    (dict(x=(32, 256, 14, 14), w=(256, 256, 3, 3), padding=1), "bfloat16", True, 1), (L4, "float32", True, 1),
    # 9 k-tiles (an odd count) and 64-channel tiles (which walk) stay whole
    (dict(x=(32, 64, 7, 7), w=(128, 64, 3, 3), padding=1), "bfloat16", True, 1),
    (dict(x=(32, 256, 7, 7), w=(64, 256, 3, 3), padding=1), "bfloat16", True, 1),
])
def test_layers_of_few_tiles_split_their_reduction_in_two(layer, dtype, cl, splits):
    spec = _choose(**layer, dtype=dtype, family="nhwc_tma", channels_last=cl)
    assert dict(spec.tiles)["splits"] == splits


@pytest.mark.parametrize("layer,dtype,cl,splits", [
    # weight gradients' convolutions (batch and channels swapped, dY as the kernel): ResNet-50's
    # 3x3 64->64 at batch 64 (5 tiles, 3136 k-tiles: 32 ways, 160 blocks) and its 1x1 256->64
    (dict(x=(64, 64, 56, 56), w=(64, 64, 56, 56), padding=1), "bfloat16", True, 32),
    (dict(x=(64, 64, 56, 56), w=(64, 64, 56, 56), padding=1), "float32", False, 32),
    (dict(x=(256, 64, 56, 56), w=(64, 64, 56, 56)), "float32", False, 64),
    # 324 k-tiles over one tile: as many as divide it with 16 k-tiles a split or more (12)
    (dict(x=(8, 32, 20, 20), w=(32, 32, 18, 18)), "float32", False, 12),
    # under 256 k-tiles: the forward's rule (two ways for 128-channel tiles, or none)
    (dict(x=(1, 512, 7, 7), w=(512, 512, 3, 3), padding=1), "bfloat16", True, 2),
    (dict(x=(8, 64, 20, 20), w=(64, 64, 10, 10)), "bfloat16", True, 1),
    # half the SMs of tiles or more: none
    (dict(x=(64, 64, 64, 64), w=(256, 64, 40, 40)), "bfloat16", True, 1),
])
def test_reduction_bound_layers_split_deep(layer, dtype, cl, splits):
    spec = _choose(**layer, dtype=dtype, family="nhwc_tma", channels_last=cl)
    t = dict(spec.tiles)
    assert t["splits"] == splits
    if splits > 1:
        assert (t["persist"], t["halo"], t["wres"]) == (0, 0, 0)
        assert spec.template_context()["WORKSPACE_PER_OUTPUT"] == 4 * splits


@pytest.mark.nvcc
@pytest.mark.compile
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype,cl,splits", [("bfloat16", True, 32), ("float32", False, 64), ("float32", True, 48)])
def test_deep_splits_lower_without_spills(dtype, cl, splits, tmp_path):
    spec = _choose((64, 64, 24, 24), (64, 64, 24, 24), dtype=dtype, channels_last=cl, tiles={"splits": splits})
    assert dict(spec.tiles)["splits"] == splits
    text, report = lower(spec, tmp_path)
    assert "kg_tma_reduce" in text
    assert report.count(" 0 bytes spill stores, 0 bytes spill loads") == report.count("spill stores"), report


def test_split_refusals_say_why():
    with pytest.raises(ConvArgumentError, match="one block a tile"):
        _choose(**L4, dtype="bfloat16", family="nhwc_tma", tiles={"splits": 2, "persist": 1})
    with pytest.raises(ConvArgumentError, match="one block a tile"):
        _choose(**VGG64, dtype="bfloat16", family="nhwc_tma", tiles={"splits": 2, "halo": 1, "stages": 2})
    # 9 k-tiles (bf16 64 channels, 3x3) split 2 or 6 ways: not the same number a split, or under two
    for splits in (2, 4, 6):
        with pytest.raises(ConvArgumentError, match="cannot be split"):
            _choose((8, 64, 7, 7), (64, 64, 3, 3), padding=1, dtype="bfloat16", family="nhwc_tma",
                    tiles={"splits": splits})
    assert dict(_choose((8, 64, 7, 7), (64, 64, 3, 3), padding=1, dtype="bfloat16", family="nhwc_tma",
                        tiles={"splits": 3}).tiles)["splits"] == 3


@pytest.mark.nvcc
@pytest.mark.compile
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype,cl", [("bfloat16", True), ("float32", False)])
def test_split_reductions_apply_the_epilogue_scale_to_the_splits_sum(dtype, cl, tmp_path):
    # A folded BatchNorm's scale keeps the split (refusing it once cost ResNet-50 bf16 fourteen
    # batch-1 layers' split-K): the final pass multiplies the sum, then adds the bias.
    spec = _choose(**L4, dtype=dtype, bias=True, channels_last=cl, scale=True)
    assert spec.scale and dict(spec.tiles)["splits"] == 2
    source = render(spec).cuda
    final = "void reduce_quad(const Params& pr"  # (the final pass's functions, to the file's end)
    assert ("pr.epi_s[c + k]" if cl else "pr.epi_s[c]") in source[source.index(final):]
    plain = render(spec.replace(scale=False)).cuda
    assert "epi_s" not in plain[plain.index(final):]
    text, report = lower(spec, tmp_path)
    assert "kg_tma_reduce" in text
    assert report.count(" 0 bytes spill stores, 0 bytes spill loads") == report.count("spill stores"), report


def test_forced_tiles_hold():
    spec = _choose(**VGG256, dtype="bfloat16", family="nhwc_tma",
                   tiles={"block_co": 64, "block_p": 256, "wgn": 2, "stages": 3})
    t = dict(spec.tiles)
    assert (t["block_co"], t["block_p"], t["wgn"], t["stages"]) == (64, 256, 2, 3)
    assert FAM.layout(spec, t)["NTH"] == 2 * 128 + 32
    assert spec.template_context()["WN"] == 128


@pytest.mark.nvcc
@pytest.mark.compile
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("layer,dtype,bias,tiles,cl", [
    (VGG64, "float32", True, None, True), (VGG64, "bfloat16", False, None, True), (S2, "float16", True, None, True),
    (VGG64, "float32", False, {"round_smem": 0}, True),  # the rounded copy instead of rounding warps
    (VGG64, "bfloat16", True, {"persist": 1}, True), (VGG256, "float32", False, {"persist": 1}, False),
    # resident weights: two pipelines over one copy, one deep pipeline, NCHW
    (VGG64, "bfloat16", True, {"persist": 1, "wres": 1, "pipes": 2, "stages": 3, "min_blocks": 1}, True),
    (VGG64, "float16", False, {"persist": 1, "wres": 1, "stages": 8, "min_blocks": 1}, True),
    (VGG64, "bfloat16", False, {"persist": 1, "wres": 1, "pipes": 2, "stages": 3, "min_blocks": 1}, False),
    (VGG256, "bfloat16", True, {"block_p": 256, "wgn": 2}, True),
    (VGG256, "float32", False, {"block_co": 256, "block_p": 64, "stages": 4, "min_blocks": 1, "a_regs": 0}, True),
    # NCHW calls: the input transpose and the direct NCHW epilogue
    (VGG256, "float32", True, None, False), (S2, "bfloat16", False, {"block_p": 256, "wgn": 2}, False),
    # halo tiles: a ring of the weights' boxes (TF32 rounding warps, the rounded copy, 128 output
    # channels), resident weights, NCHW
    (VGG64, "float32", False, {"halo": 1, "stages": 2, "min_blocks": 1, "persist": 0}, True),
    (VGG64, "float32", True, {"halo": 1, "stages": 2, "min_blocks": 1, "round_smem": 0, "wstages": 8}, True),
    (VGG256, "bfloat16", False, {"halo": 1, "stages": 2, "min_blocks": 1, "persist": 1, "block_p": 64}, True),
    (VGG64, "float16", True, {"halo": 1, "stages": 2, "min_blocks": 1, "persist": 1, "wres": 1, "pipes": 2,
                              "block_p": 64}, True),
    (VGG256, "float32", True, {"halo": 1, "stages": 2, "min_blocks": 1, "persist": 1, "block_p": 56}, False),
    # a_regs tiles: TF32's defaults past 64 output channels (strided and 1x1 windows), 16-bit, wgmma
    # N 256, halo windows, resident weights under two pipelines
    (S2, "float32", True, None, True), (DOWN, "float32", False, None, True), (PW, "bfloat16", True, {"a_regs": 1}, True),
    (VGG256, "float16", False, {"a_regs": 1, "block_co": 256, "block_p": 64, "min_blocks": 1}, True),
    (VGG64, "float32", True, {"a_regs": 1, "halo": 1, "persist": 1, "stages": 2, "min_blocks": 1, "block_p": 64}, True),
    (VGG64, "bfloat16", False, {"a_regs": 1, "persist": 1, "wres": 1, "pipes": 2, "stages": 3, "min_blocks": 1,
                                "block_p": 64}, True),
    # split reductions (the partial sums and the kernel that adds them up): both orientations, NCHW
    (L4, "bfloat16", True, {"splits": 4}, True), (L4, "float32", False, {"splits": 2}, True),
    (L4, "float32", True, {"splits": 3}, False), (L4, "float16", False, {"splits": 6, "block_co": 64}, False),
])
def test_lowers_to_wgmma_fed_by_tma_im2col_without_spills(layer, dtype, bias, tiles, cl, tmp_path):
    spec = _choose(**layer, dtype=dtype, bias=bias, family="nhwc_tma", tiles=tiles, channels_last=cl)
    assert spec.layout == ("nhwc" if cl else "nchw")
    text, report = lower(spec, tmp_path)
    t = dict(spec.tiles)
    areg = t["a_regs"] == 1
    ab = {"float32": "tf32.tf32", "bfloat16": "bf16.bf16", "float16": "f16.f16"}[dtype]
    wn = t["block_co"] if areg else t["block_p"] // t["wgn"]  # (a_regs: the output channels are wgmma's N)
    assert f"wgmma.mma_async.sync.aligned.m64n{wn}k{8 if dtype == 'float32' else 16}.f32.{ab}" in text
    # a_regs: A fragments from ldmatrix into registers (a register operand list), no wgmma serialised
    assert ("ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text) == areg
    assert bool(re.search(r"wgmma\.mma_async[^;]*\},\s*\{%r", text)) == areg
    assert "serialized" not in report, report
    # the im2col operand (halo tiles: a tiled 4-D window instead) and the weights' 2-D boxes
    im2col = "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes" in text
    window = "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" in text
    assert (im2col, window) == ((False, True) if t["halo"] else (True, False))
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" in text
    assert "mbarrier.try_wait.parity" in text and "mma.sync" not in text and "cp.async.cg" not in text
    assert ("cvt.rna.tf32.f32" in text) == (dtype == "float32")
    # a_regs TF32 fragments: the two-instruction rounding that leaves the bits wgmma ignores
    assert bool(re.search(r"@p add\.u32 (%r\d+), \1, 0x1000;", text)) == (dtype == "float32" and areg)
    # the main kernel, the weight repack (and, over 1x1, the one that reads NCHW's dense weights
    # through shared memory), the strided copy, the dense rounding copy, (NCHW) the transpose and
    # (split reductions) the sum of the splits; NCHW tiles leave straight from the accumulators,
    # channels_last ones as 16-byte rows, split ones as partial sums
    split = t["splits"] > 1
    taps = spec.kernel_size != (1, 1)
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == 4 + (not cl) + split + taps, report
    assert ("kg_tma_reduce" in text) == split and ("kg_repack_oihw" in text) == taps
    # staging: consumers meet (a_regs warps stage their own rows, with no barrier beyond the warp's)
    staged = cl and not split
    assert ("kg_nhwc_transpose" in text) == (not cl) and bool(re.search(r"bar\.sync\s+%r", text)) == (staged and not areg)
    # 16-bit channels_last tiles stage their fragments with stmatrix, transposed to pixel rows
    assert ("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in text) == (staged and dtype != "float32" and not areg)
