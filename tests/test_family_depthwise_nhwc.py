"""CPU-tier tests of the `depthwise_nhwc` family (channels_last depthwise): no GPU needed.

What they cover: which calls it can serve (depthwise up to 9x9, channels_last or through the
transpose) and which it cannot, that its refusals name the reason, that default and forced tiles
fit the shared memory they stage taps in, and (with nvcc) that every dtype, channel multiplier
and input path lowers with 16-byte loads and stores on the vector path and no spills. Which
family the selector picks for a call is measured, not asserted here.
"""

from __future__ import annotations

import pytest

from kernelgen import select
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError, Unsupported
from kernelgen.families import get_family
from kernelgen.families.depthwise import MAX_TAPS
from kernelgen.families.groupwise_nhwc import SMEM_BUDGET, TILES, smem_bytes
from kernelgen.spec import ConvSpec, Problem
from lowering import NVCC, lower

FAM = get_family("depthwise_nhwc")


def _params(c, mult=1, kernel=3, stride=1, padding=1, dilation=1, dtype="float32", bias=False):
    return dict(in_channels=c, out_channels=c * mult, kernel_size=kernel, stride=stride, padding=padding,
                dilation=dilation, groups=c, dtype=dtype, bias=bias)


def _choose(c, hw, n=32, channels_last=True, family="depthwise_nhwc", tiles=None, device=None, **kw):
    """The spec `family` (this one by default; None: the selector's choice) runs a depthwise call
    with, on `device` (default a nominal H100)."""
    params = _params(c, **kw)
    P, Q = ConvSpec(**params).output_size(*hw)
    problem = Problem(N=n, H=hw[0], W=hw[1], P=P, Q=Q, device=device or nominal("sm_90a"))
    return select.choose(params, "cuda", problem, channels_last, "ieee", family=family, tiles=tiles)


# MobileNetV2's and ConvNeXt's depthwise layers at batch 32 (benchmarks/bench_layers.py and the
# measurements in depthwise_nhwc.py).
LAYERS = {
    "mv2.dw32.112": dict(c=32, hw=(112, 112)),
    "mv2.dw96.s2": dict(c=96, hw=(112, 112), stride=2),
    "mv2.dw960.7": dict(c=960, hw=(7, 7)),
    "convnext.7x7": dict(c=96, hw=(56, 56), kernel=7, padding=3),
    "effnet.5x5.s2": dict(c=144, hw=(56, 56), kernel=5, stride=2, padding=2),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_serves_the_measured_layers_in_either_layout(name, dtype):
    spec = _choose(**LAYERS[name], dtype=dtype)
    assert spec.layout == "nhwc"
    FAM.check(spec, nominal("sm_89"))
    nchw = _choose(**LAYERS[name], dtype=dtype, channels_last=False)  # (the input transposed first)
    assert nchw.layout == "nchw"
    FAM.check(nchw, nominal("sm_80"))


def test_default_tiles_for_the_measured_layers():
    t = dict(_choose(**LAYERS["mv2.dw32.112"]).tiles)
    assert t == {"block_c": 8, "vec_q": 4, "rows": 1, "threads": 256, "min_blocks": 0}  # 32 float32 channels: 8 vectors
    assert dict(_choose(**LAYERS["mv2.dw32.112"], dtype="bfloat16").tiles)["block_c"] == 4
    assert dict(_choose(**LAYERS["mv2.dw960.7"]).tiles)["block_c"] == 16  # 240 vectors: 15 whole tiles
    assert dict(_choose(**LAYERS["convnext.7x7"]).tiles)["rows"] == 2  # 7 kernel rows: two output rows
    assert dict(_choose(**LAYERS["effnet.5x5.s2"]).tiles)["rows"] == 1


@pytest.mark.parametrize("q, vec_q", [(1, 1), (2, 2), (3, 4), (7, 4), (1000, 4)])
def test_strips_no_wider_than_narrow_rows(q, vec_q):
    spec = _choose(16, (9, q), kernel=(3, 1), padding=(1, 0))
    assert dict(spec.tiles)["vec_q"] == vec_q


@pytest.mark.parametrize("kw", [
    dict(kernel=(9, 9), padding=4),
    dict(mult=3),                                # a multiplier neither divides nor is divided by a vector
    dict(mult=8, kernel=(1, 5), padding=(0, 2)),
])
def test_serves_kernels_up_to_9x9_and_any_multiplier(kw):
    assert _choose(24, (20, 30), **kw).family == "depthwise_nhwc"


def test_refuses_kernels_past_the_unrolled_taps():
    with pytest.raises(ConvArgumentError, match="taps"):  # 121 taps
        _choose(24, (20, 30), kernel=11, padding=5)
    assert _choose(24, (20, 30), kernel=11, padding=5, family=None).family != "depthwise_nhwc"


def test_refusals_name_the_reason():
    base = ConvSpec(**_params(16), device="cuda", layout="nhwc", family="depthwise_nhwc")
    FAM.check(base)
    with pytest.raises(Unsupported, match="groups == in_channels"):
        FAM.check(base.replace(groups=4))
    with pytest.raises(Unsupported, match="taps"):
        FAM.check(base.replace(kernel_size=(10, 9)))
    assert MAX_TAPS == 81
    FAM.check(base.replace(layout="nchw"))  # an NCHW call's input is transposed first (forced only)
    with pytest.raises(Unsupported, match="layout any"):
        FAM.check(base.replace(layout="any"))
    with pytest.raises(Unsupported, match="float64"):
        FAM.check(base.replace(dtype="float64"))
    big = base.replace(kernel_size=(9, 9), dtype="bfloat16", tiles=(("block_c", 32),))
    assert smem_bytes(big, dict(big.tiles)) > SMEM_BUDGET
    with pytest.raises(Unsupported, match="block_c"):
        FAM.check(big)
    with pytest.raises(ConvArgumentError, match="block_c"):
        _choose(16, (20, 20), kernel=9, padding=4, dtype="bfloat16", tiles={"block_c": 32})


def test_the_selector_passes_over_it_for_dtypes_it_refuses():
    # The selector asks for tiles before the family's check: float64 must reach the check.
    assert _choose(16, (20, 20), dtype="float64", family=None).family != "depthwise_nhwc"
    with pytest.raises(ConvArgumentError, match="does not serve dtype float64"):
        _choose(16, (20, 20), dtype="float64")


def test_default_block_c_shrinks_until_the_taps_fit():
    for dtype in ("float32", "bfloat16"):
        spec = _choose(512, (20, 20), kernel=9, padding=4, dtype=dtype)
        tiles = dict(spec.tiles)
        assert smem_bytes(spec, tiles) <= SMEM_BUDGET
        # halved only as far as it had to be (bf16: 32 blocks of 8-channel vectors do not fit)
        wider = {**tiles, "block_c": 2 * tiles["block_c"]}
        assert tiles["block_c"] == TILES["block_c"][-1] or smem_bytes(spec, wider) > SMEM_BUDGET
        assert (tiles["block_c"] < TILES["block_c"][-1]) == (dtype == "bfloat16")


def test_every_tile_value_is_servable_with_the_smallest_block_c():
    # The family's checks take tiles picked from these values; the first block_c fits any kernel.
    assert TILES["block_c"][0] == 1
    spec = ConvSpec(**_params(16, kernel=9, dtype="bfloat16"), device="cuda", layout="nhwc",
                    family="depthwise_nhwc", tiles={"block_c": 1, "vec_q": 8, "rows": 8, "threads": 512})
    FAM.check(spec)


# -- lowering: one spec per input path and dtype ------------------------------------------------

LOWER = [
    # (name, params, tiles, 16-byte vector path expected to load 16 bytes)
    ("f32-3x3", _params(32), None, "v4"),
    ("bf16-3x3-bias", _params(40, bias=True, dtype="bfloat16"), None, "v4"),
    ("f16-7x7", _params(96, kernel=7, padding=3, dtype="float16"), None, "v4"),
    ("f32-mult2-strided", _params(24, mult=2, stride=2, kernel=(5, 3), padding=(2, 1)), None, "v2"),
    ("bf16-mult8-dilated", _params(16, mult=8, dilation=(1, 2), dtype="bfloat16"),
     {"block_c": 32, "vec_q": 8, "rows": 2, "threads": 64}, "u16"),
    ("f32-mult3", _params(8, mult=3, kernel=(1, 3), padding=(0, 1)), None, "elem"),
    ("bf16-9x9", _params(24, kernel=9, padding=4, dtype="bfloat16"), {"block_c": 2, "vec_q": 1, "rows": 4,
                                                                      "threads": 128}, "v4"),
]


@pytest.mark.compile
@pytest.mark.nvcc
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("name, params, tiles, load", LOWER, ids=[c[0] for c in LOWER])
def test_lowers_with_vector_loads_and_stores_without_spills(name, params, tiles, load, tmp_path):
    c = params["in_channels"]
    P, Q = ConvSpec(**params).output_size(30, 31)
    spec = select.choose(params, "cuda", Problem(N=2, H=30, W=31, P=P, Q=Q, device=nominal("sm_90a")), True,
                         "ieee", family="depthwise_nhwc", tiles=tiles)
    assert spec.groups == c
    text, report = lower(spec, tmp_path)
    # both input paths (vector and element-wise) are built, neither spilling
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == 2, report
    assert "st.global.cs.v4.u32" in text  # the vector path's 16-byte streaming stores
    pattern = {"v4": "ld.global.nc.v4.u32", "v2": "ld.global.nc.v2.u32", "u16": "ld.global.nc.u16",
               "elem": None}[load]
    if pattern:
        assert pattern in text
