"""CPU-tier tests of the `depthwise_planes` family (NCHW depthwise, whole small planes a block):
no GPU needed.

What they cover: which calls it can serve (NCHW depthwise whose plane fits a block's run) and
which it cannot, its default tiles for the measured layers and for small batches, that its
refusals name the reason, that the template needs its context and nothing else, and (with nvcc)
that every dtype, multiplier, kernel, stride and dilation builds without warnings and lowers both
input paths without spills. Which family the selector picks for a call is measured, not asserted
here.
"""

from __future__ import annotations

import subprocess

import jinja2
import pytest

from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError, Unsupported
from kernelgen.families import get_family
from kernelgen.families.depthwise_planes import RUN_LIMIT, RUN_TARGET, TAPS_LIMIT, TILES, run_bytes, taps_bytes
from kernelgen.render import render, template_dir
from kernelgen.spec import ConvSpec
from lowering import NVCC, TORCH_DEFINES, lower
from test_family_depthwise_nhwc import _choose as choose_depthwise, _params

FAM = get_family("depthwise_planes")


def _choose(c, hw, channels_last=False, family="depthwise_planes", **kw):
    """The spec `family` (this one by default) runs a depthwise call with (test_family_depthwise_nhwc's
    helper), NCHW by default."""
    return choose_depthwise(c, hw, channels_last=channels_last, family=family, **kw)


# -- which calls it serves ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("c, hw, kw", [
    (960, (7, 7), {}),                                    # MobileNetV2's last depthwise
    (576, (14, 14), dict(stride=2)),
    (384, (14, 14), {}),
    (32, (16, 16), dict(mult=2, kernel=5, padding=2)),
    (192, (28, 28), {}),
    (8, (1, 200), dict(kernel=(1, 3), padding=(0, 1))),
])
def test_serves_nchw_planes_whose_run_fits(dtype, c, hw, kw):
    spec = _choose(c, hw, dtype=dtype, **kw)
    assert spec.layout == "nchw" and run_bytes(spec, 1, *hw) <= RUN_LIMIT
    FAM.check(spec, nominal("sm_89"))


def test_refuses_kernels_past_the_unrolled_stencils_and_channels_last():
    with pytest.raises(ConvArgumentError, match="taps"):  # 121 taps
        _choose(960, (7, 7), kernel=11, padding=5)
    with pytest.raises(ConvArgumentError, match="takes layouts"):
        _choose(960, (7, 7), channels_last=True)


# -- tiles -------------------------------------------------------------------------------------

@pytest.mark.parametrize("c, hw, dtype, kw, planes", [
    (960, (7, 7), "float32", {}, 64),          # 12.5 KB a run
    (960, (7, 7), "bfloat16", {}, 64),
    (384, (14, 14), "float32", {}, 16),        # 12.5 KB; 32 planes would be 25
    (384, (14, 14), "bfloat16", {}, 32),
    (576, (14, 14), "float32", dict(stride=2), 16),
])
def test_default_planes_for_the_measured_layers(c, hw, dtype, kw, planes):
    spec = _choose(c, hw, dtype=dtype, **kw)
    tiles = dict(spec.tiles)
    assert tiles == {"planes": planes, "threads": 256}
    assert run_bytes(spec, planes, *hw) <= RUN_TARGET < run_bytes(spec, 2 * planes, *hw) or planes == TILES["planes"][-1]


def test_small_batches_take_fewer_planes_a_block():
    # 384 planes in all: one a block keeps 384 blocks, two would leave 192 for an H100's 132 SMs
    assert dict(_choose(384, (14, 14), n=1).tiles)["planes"] == 1
    assert dict(_choose(384, (14, 14), n=4).tiles)["planes"] == 4
    # (an A10's 72 SMs take two blocks each from 192)
    assert dict(_choose(384, (14, 14), n=1, device=nominal("sm_86")).tiles)["planes"] == 2


def test_threads_shrink_to_the_outputs_of_a_block():
    # one 7 x 7 plane a block (one channel, one image): 49 outputs, the smallest block
    assert dict(_choose(1, (7, 7), n=1).tiles) == {"planes": 1, "threads": 64}


def test_refusals_name_the_reason():
    base = ConvSpec(**_params(16), device="cuda", layout="nchw", family="depthwise_planes")
    FAM.check(base)
    with pytest.raises(Unsupported, match="groups == in_channels"):
        FAM.check(base.replace(groups=4))
    with pytest.raises(Unsupported, match="taps"):
        FAM.check(base.replace(kernel_size=(10, 9)))
    with pytest.raises(Unsupported):
        FAM.check(base.replace(layout="nhwc"))
    # the taps of 64 planes x 2 outputs of 9x9 in float64 overflow TAPS_LIMIT: named, with the tile
    big = base.replace(out_channels=32, kernel_size=(9, 9), dtype="float64", tiles=(("planes", 64), ("threads", 256)))
    assert taps_bytes(big, 64) > TAPS_LIMIT
    with pytest.raises(Unsupported, match="fewer planes"):
        FAM.check(big)
    # a plane past RUN_LIMIT is refused by its tiles, and so by the selector when forced
    assert run_bytes(base, 1, 200, 200) > RUN_LIMIT
    with pytest.raises(ConvArgumentError, match="a plane of 200 x 200"):
        _choose(16, (200, 200))


def test_first_tile_values_are_the_smallest_footprint():
    s = ConvSpec(**_params(16, mult=4, kernel=9, dtype="float64"), device="cuda", layout="nchw",
                 family="depthwise_planes")
    assert taps_bytes(s, TILES["planes"][0]) == min(taps_bytes(s, p) for p in TILES["planes"])


# -- rendering and lowering --------------------------------------------------------------------

def test_template_needs_its_context_and_nothing_else():
    spec = _choose(960, (7, 7), bias=True, dtype="bfloat16")
    src = render(spec).cuda
    assert src.startswith("// Generated by kernelgen") and "{{" not in src and "{%" not in src
    assert "constexpr int PLANES = 64;" in src
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())), undefined=jinja2.StrictUndefined)
    ctx = spec.template_context()
    env.get_template(FAM.template).render(ctx)
    del ctx["DWP_TAPS_BYTES"]
    with pytest.raises(jinja2.UndefinedError):
        env.get_template(FAM.template).render(ctx)


LOWER = [
    # (name, channels, hw, params, tiles)
    ("f32-3x3", 960, (7, 7), dict(bias=True), None),
    ("bf16-mult2-strided", 24, (14, 14), dict(mult=2, stride=2, dtype="bfloat16"), None),
    ("f16-5x3-dilated", 8, (12, 15), dict(kernel=(5, 3), dilation=(1, 2), padding=(2, 1), dtype="float16"),
     {"planes": 8, "threads": 128}),
    ("f64-mult3-1x4", 5, (9, 9), dict(mult=3, kernel=(1, 4), padding=(0, 2), dtype="float64", bias=True),
     {"planes": 2, "threads": 512}),
]


@pytest.mark.compile
@pytest.mark.nvcc
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("name, c, hw, params, tiles", LOWER, ids=[row[0] for row in LOWER])
def test_builds_without_warnings_and_lowers_without_spills(name, c, hw, params, tiles, tmp_path):
    spec = _choose(c, hw, n=2, family="depthwise_planes", tiles=tiles, **params)
    text, report = lower(spec, tmp_path)
    # both input paths (the run's 16-byte copies and element loads through the strides), no spills
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == 2, report
    assert "cp.async.cg.shared.global" in text
    assert "st.global.cs" in text
    # the object build torch runs, warnings included
    r = subprocess.run([NVCC, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", *TORCH_DEFINES,
                        "-c", str(tmp_path / "k.cu"), "-o", str(tmp_path / "k.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning" not in (r.stdout + r.stderr).lower(), r.stderr[-3000:]
