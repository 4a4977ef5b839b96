"""CPU-tier tests of the `grouped_mma` family (grouped layers of 8-64 channels a group on mma.sync):
no GPU needed.

What they cover: which calls it can serve (ResNeXt's groups of 16 and 32, in channels_last and
NCHW) and which it cannot (groups that are not whole MMA k-steps, strict float32, dense layers),
that its refusals name the reason, its default tiles and the shared memory they take (the window
in whole 128-byte lines), and (with nvcc) that every dtype and layout lowers without spilling,
its MMAs and ldmatrix in the PTX. Which family the selector picks for a call is measured, not
asserted here.
"""

from __future__ import annotations

import re

import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError
from kernelgen.families import get_family
from kernelgen.families.grouped_mma import WREG_LIMIT, pixel_units, smem_bytes, tap_registers
from kernelgen.spec import ConvSpec, Problem
from lowering import NVCC, lower

FAM = get_family("grouped_mma")


def _choose(groups, cin_g, hw, cout_g=None, n=32, kernel=3, stride=1, dtype="bfloat16", channels_last=True,
            math="tf32", family="grouped_mma", tiles=None, device=None):
    """The spec `family` (this one by default) runs a grouped call with on `device` (a nominal H100)."""
    cout_g = cin_g if cout_g is None else cout_g
    params = dict(in_channels=groups * cin_g, out_channels=groups * cout_g, kernel_size=kernel, stride=stride,
                  padding=kernel // 2, dilation=1, groups=groups, dtype=dtype, bias=True)
    P, Q = ConvSpec(**params).output_size(*hw)
    problem = Problem(N=n, H=hw[0], W=hw[1], P=P, Q=Q, device=device or nominal("sm_90a"))
    return select.choose(params, "cuda", problem, channels_last, math, family=family, tiles=tiles)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_serves_resnext_groups_of_16_and_32_in_both_layouts(dtype):
    for groups, cin_g, hw, stride in ((32, 16, (14, 14), 1), (32, 16, (28, 28), 2), (32, 32, (7, 7), 1)):
        for channels_last in (True, False):
            for arch in ("sm_90a", "sm_80", "sm_89"):
                spec = _choose(groups, cin_g, hw, stride=stride, dtype=dtype, channels_last=channels_last,
                               device=nominal(arch))
                assert spec.layout == ("nhwc" if channels_last else "nchw")
                assert spec.math == ("tf32" if dtype == "float32" else "ieee")
                FAM.check(spec, nominal(arch))


def test_refusals_name_the_reason():
    with pytest.raises(ConvArgumentError, match="strict float32 is not served"):
        _choose(32, 16, (14, 14), dtype="float32", math="ieee", family="grouped_mma")
    with pytest.raises(ConvArgumentError, match="whole MMA k-steps.*16 for bfloat16.*8 -> 8 a group"):
        _choose(32, 8, (14, 14), family="grouped_mma")
    with pytest.raises(ConvArgumentError, match="whole 8s of output channels.*16 -> 12 a group"):
        _choose(4, 16, (14, 14), cout_g=12, family="grouped_mma")
    with pytest.raises(ConvArgumentError, match="groups=1"):
        _choose(1, 16, (14, 14), family="grouped_mma")
    with pytest.raises(ConvArgumentError, match=f"200 registers a thread, at most {WREG_LIMIT}"):
        _choose(4, 16, (14, 14), dtype="float32", kernel=5, family="grouped_mma", tiles={"warp_n": 16})
    with pytest.raises(ConvArgumentError, match="warp_n=32 must divide the 16 output channels"):
        _choose(4, 16, (14, 14), family="grouped_mma", tiles={"warp_n": 32})
    with pytest.raises(ConvArgumentError, match="bytes of shared memory"):
        _choose(4, 32, (64, 64), dtype="float32", family="grouped_mma", tiles={"block_p": 32, "block_q": 64})
    with pytest.raises(ConvArgumentError, match="transpose=1 serves NCHW calls"):
        _choose(32, 16, (14, 14), family="grouped_mma", tiles={"transpose": 1})
    with pytest.raises(ConvArgumentError, match="threads a block, at most 1024"):
        _choose(16, 16, (14, 14), cout_g=32, family="grouped_mma", tiles={"groups_block": 16, "warp_n": 8})


def test_default_tiles():
    t = dict(_choose(32, 16, (14, 14)).tiles)  # bf16: four groups fill a 128-byte window pixel
    assert t == {"block_p": 7, "block_q": 14, "groups_block": 4, "warp_n": 16, "m_tiles": 1, "min_blocks": 0,
                 "transpose": 0}
    t = dict(_choose(32, 16, (14, 14), dtype="float32").tiles)
    assert (t["groups_block"], t["warp_n"]) == (2, 16)
    t = dict(_choose(32, 32, (7, 7), dtype="float32", channels_last=False).tiles)  # 16 x 32 TF32 taps: 144
    assert (t["groups_block"], t["warp_n"], t["block_p"], t["block_q"]) == (1, 8, 7, 7)
    t = dict(_choose(3, 16, (100, 90), cout_g=8).tiles)  # rows cut evenly; groups_block no more than the layer's
    assert (t["block_q"], t["block_p"], t["groups_block"], t["warp_n"]) == (30, 5, 2, 8)
    # a window that does not fit halves its rows: 8 rows of 16 pixels, dilated 8, of 64 float32
    # channels take 233 KB
    spec = _choose(4, 32, (64, 64), dtype="float32", family="grouped_mma").replace(dilation=(8, 8))
    problem = Problem(N=1, H=64, W=64, P=64, Q=64, device=nominal("sm_90a"))
    t = FAM.default_tiles(spec, problem, fixed={"block_q": 16, "groups_block": 2})
    limit = nominal().smem_block
    assert t["block_p"] == 4 and smem_bytes(spec, t) <= limit < smem_bytes(spec, {**t, "block_p": 8})


def test_window_in_whole_lines():
    spec = _choose(2, 16, (13, 7), family="grouped_mma")  # bf16, two groups: 64-byte window pixels
    t = dict(spec.tiles)
    assert pixel_units(spec, t["groups_block"]) == 4
    # a 13 x 7 window (3x3, 11 x 5 outputs, padding 1 -> rows 13, columns 7) of 91 pixels x 4
    # units takes 46 lines, not 45.5: the last pixel's units may swizzle to the line's far half
    wh, ww = (t["block_p"] - 1) + 3, (t["block_q"] - 1) + 3
    staged = t["block_p"] * t["block_q"] * (128 + 16)
    assert smem_bytes(spec, t) == -(-wh * ww * 4 // 8) * 128 + staged
    assert pixel_units(_choose(4, 24, (14, 14), dtype="float32", family="grouped_mma"), 1) == 8
    assert pixel_units(_choose(4, 8, (14, 14), dtype="float32", family="grouped_mma"), 1) == 2
    assert tap_registers(_choose(4, 16, (14, 14), dtype="float32", family="grouped_mma"), 16) == 72


def test_nchw_reads_in_place_unless_16_bit_threads_would_load_too_much():
    """NCHW calls read their input in place (transpose 0) unless 16-bit threads would each load more
    than ELEMENT_LOADS window elements: then through the transpose. Float32 copies by cp.async."""
    from kernelgen.families.grouped_mma import ELEMENT_LOADS, window_loads

    for dtype in ("float32", "bfloat16", "float16"):
        for groups, cin_g, hw, stride in ((32, 16, (14, 14), 1), (32, 32, (7, 7), 1), (32, 32, (14, 14), 2)):
            spec = _choose(groups, cin_g, hw, stride=stride, dtype=dtype, channels_last=False)
            assert dict(spec.tiles)["transpose"] == 0, (dtype, cin_g, hw)
        spec = _choose(32, 16, (28, 28), stride=2, dtype=dtype, channels_last=False)  # a 15 x 29 window
        t = dict(spec.tiles)
        assert window_loads(spec, t) > ELEMENT_LOADS and t["transpose"] == (dtype != "float32")
        forced = _choose(32, 16, (28, 28), stride=2, dtype=dtype, channels_last=False, tiles={"transpose": 0})
        assert dict(forced.tiles)["transpose"] == 0
    channels_last = _choose(32, 16, (28, 28), stride=2)  # bf16: no transpose to choose
    assert dict(channels_last.tiles)["transpose"] == 0


def test_nchw_stages_a_channel_a_row():
    """NCHW stages each output channel's pixels as a row of the tile's pixels in whole 128-byte
    lines and 16 bytes more (so a fragment write spreads over the banks and a row's 16-byte runs
    stay aligned); the transpose's workspace is the input's size, and only with transpose=1."""
    for dtype, esize in (("float32", 4), ("bfloat16", 2)):
        spec = _choose(32, 16, (14, 14), dtype=dtype, channels_last=False, family="grouped_mma")
        t = dict(spec.tiles)
        wh, ww = t["block_p"] + 2, t["block_q"] + 2
        channels = t["groups_block"] * 16
        row = -(-t["block_p"] * t["block_q"] * esize // 128) * 128 + 16
        assert row % 128 == 16
        lines = -(-wh * ww * pixel_units(spec, t["groups_block"]) // 8)
        assert smem_bytes(spec, t) == lines * 128 + channels * row
        assert FAM.context(spec)["WORKSPACE_PER_INPUT"] == 0 and not FAM.context(spec)["TRANSPOSE"]
        spec = spec.replace(tiles=tuple(sorted({**t, "transpose": 1}.items())))
        assert FAM.context(spec)["WORKSPACE_PER_INPUT"] == esize and FAM.context(spec)["TRANSPOSE"]


@pytest.mark.compile
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype,channels_last,groups,cin_g,cout_g,tiles", [
    ("bfloat16", True, 32, 16, 16, None),
    ("float32", True, 32, 16, 16, None),
    ("float16", False, 32, 16, 16, None),
    ("float32", False, 32, 32, 32, None),
    ("float32", False, 32, 16, 16, {"transpose": 1}),
    ("bfloat16", False, 32, 16, 16, {"transpose": 1, "block_q": 8}),  # 16-byte runs of rows
    ("bfloat16", True, 5, 48, 24, {"warp_n": 8, "m_tiles": 2}),  # 6-chunk pixels padded to a line
])
def test_lowers_without_spills(dtype, channels_last, groups, cin_g, cout_g, tiles, tmp_path):
    spec = _choose(groups, cin_g, (14, 14), cout_g=cout_g, dtype=dtype, channels_last=channels_last,
                   family="grouped_mma", tiles=tiles)
    ptx, report = lower(spec, tmp_path)
    for spill in re.findall(r"(\d+) bytes spill stores", report):
        assert spill == "0", report
    shape = "m16n8k8.row.col.f32.tf32" if dtype == "float32" else f"m16n8k16.row.col.f32.{'bf16' if dtype == 'bfloat16' else 'f16'}"
    assert f"mma.sync.aligned.{shape}" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
    assert ("cvt.rna.tf32.f32" in ptx) == (dtype == "float32")  # TF32 rounds its fragments and taps
    assert ("kg_nhwc_transpose" in ptx) == bool(tiles and tiles.get("transpose"))
    direct = not channels_last and not (tiles and tiles.get("transpose"))
    four_byte_copies = re.search(r"cp\.async\.ca\.shared\.global \[[^]]+\], \[[^]]+\], 4,", ptx)
    assert bool(four_byte_copies) == (direct and dtype == "float32")  # NCHW read in place, float32
