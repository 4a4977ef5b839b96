"""CPU-tier tests of the tensor-core families (`pointwise`, `igemm`): no GPU needed.

What they cover: which specs each family accepts, that default tiles pass the family's
own checks, that the templates render under StrictUndefined, and (when nvcc is on the
PATH) that the rendered CUDA compiles for sm_90a with tensor-core MMAs in it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kernelgen import families as _families
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError, Unsupported
from kernelgen.families import gemm
from kernelgen.spec import ConvSpec, Problem

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="module")
def _registered():
    """The families must be in the registry for ConvSpec to accept them; add them if the
    registry does not list the module yet."""
    reg = _families.all_families()
    added = [f.name for f in gemm.FAMILIES if f.name not in reg]
    for f in gemm.FAMILIES:
        reg.setdefault(f.name, f)
    yield
    for name in added:
        reg.pop(name, None)


def _spec(family, cin, cout, k, stride=1, padding=0, dilation=1, groups=1, dtype="float32", math="tf32",
          bias=False, nhw=(2, 40, 44), tiles=None):
    if dtype != "float32":
        math = "ieee"
    fam = _families.get_family(family)
    params = dict(in_channels=cin, out_channels=cout, kernel_size=k, stride=stride, padding=padding,
                  dilation=dilation, groups=groups, dtype=dtype, bias=bias, device="cuda", layout="nchw",
                  math=math, family=family)
    if tiles is None:
        probe = ConvSpec(**params, tiles={n: v[0] for n, v in fam.tiles.items()})
        P, Q = probe.output_size(nhw[1], nhw[2])
        fam.check_shape(_shape_only(probe), nominal())
        tiles = fam.default_tiles(probe, Problem(nhw[0], nhw[1], nhw[2], P, Q))
    spec = ConvSpec(**params, tiles=tiles)
    fam.check(spec)
    return spec


def _shape_only(spec):
    """The spec as the selector first checks it: no tiles yet (check_shape then skips tile checks)."""
    clone = ConvSpec.from_dict(spec.to_dict())
    object.__setattr__(clone, "tiles", ())
    return clone


# -- what each family accepts ------------------------------------------------------------------

def test_pointwise_rejects_non_1x1_and_strided():
    with pytest.raises(Unsupported, match="1x1"):
        _spec("pointwise", 16, 32, 3)
    with pytest.raises(Unsupported, match="stride 1"):
        _spec("pointwise", 16, 32, 1, stride=2)
    with pytest.raises(Unsupported, match="padding"):
        _spec("pointwise", 16, 32, 1, padding=1)


def test_families_reject_float64_cpu_and_other_layouts():
    base = _spec("igemm", 16, 32, 3)
    fam = _families.get_family("igemm")
    for change, what in ((dict(dtype="float64", math="ieee"), "dtype"), (dict(layout="nhwc"), "layout"),
                         (dict(layout="any"), "layout")):
        with pytest.raises(Unsupported, match=what):
            fam.check(base.replace(**change))


def test_tile_checks_name_the_problem():
    fam = _families.get_family("igemm")
    spec = _spec("igemm", 16, 32, 3)
    bad = dict(spec.tiles)
    bad.update(block_m=128, warps_m=1, warps_n=1, tile_p=16, tile_q=128)  # 128x2048 per warp
    with pytest.raises(Unsupported, match="accumulators"):
        fam.check_tiles(spec, bad, nominal())
    bad = dict(spec.tiles, block_k=8)
    with pytest.raises(Unsupported, match="multiple of 16"):
        fam.check_tiles(spec.replace(dtype="bfloat16", math="ieee"), bad, nominal())
    with pytest.raises(ConvArgumentError):
        spec.replace(tiles=dict(spec.tiles, tile_q=24))  # not an allowed value


GRID = list(itertools.product(
    [(1, 1), (3, 3), (5, 7), (3, 1)], [1, 2], [1, 2], [1, 2], [("float32", "tf32"), ("float32", "ieee"),
                                                               ("float16", "ieee"), ("bfloat16", "ieee")],
    [False, True]))


def _grid_spec(k, stride, dil, groups, dm, bias):
    dtype, math = dm
    family = "pointwise" if k == (1, 1) and stride == 1 and dil == 1 else "igemm"
    return _spec(family, 16 * groups, 24 * groups, k, stride=stride, padding=(k[0] // 2, k[1] // 2) if
                 family == "igemm" else 0, dilation=dil, groups=groups, dtype=dtype, math=math, bias=bias)


@pytest.mark.parametrize("k,stride,dil,groups,dm,bias", GRID)
def test_default_tiles_valid_and_render(k, stride, dil, groups, dm, bias):
    spec = _grid_spec(k, stride, dil, groups, dm, bias)
    fam = _families.get_family(spec.family)
    lay = fam.layout(spec)
    assert lay["AKS"] % 8 == 4 and lay["CS"] % 16 == 8  # conflict-free fragment strides
    assert lay["SMEM_BYTES"] <= nominal().smem_block
    src = _render(spec)
    assert "kg_launch" in src and "{{" not in src and "{% " not in src  # asm operands look like {%0


def _render(spec) -> str:
    try:
        from kernelgen.render import render
    except ImportError:  # pragma: no cover - render.py not there yet
        import jinja2
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(ROOT / "templates")),
                                 undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        fam = _families.get_family(spec.family)
        return env.get_template(fam.template).render(spec.template_context())
    return render(spec).cuda


def test_default_tiles_for_the_benchmark_cases():
    p87 = _spec("pointwise", 64, 128, 1, nhw=(16, 1024, 1024))
    t = dict(p87.tiles)
    assert t["block_k"] == 64 and t["block_m"] == 128  # one stage: weights resident
    p63 = _spec("igemm", 16, 128, 3, nhw=(16, 1024, 1024))
    assert gemm.igemm.layout(p63)["WRES"]
    # 63 TF32: 128-channel blocks, cp.async input, direct stores (measured fastest); the strict
    # cells keep register-staged input.
    t63 = dict(p63.tiles)
    assert t63["async_x"] == 1 and t63["stage_out"] == 0 and t63["block_m"] == 128 and t63["min_blocks"] == 1
    # 87: 16 warps and staged rows; TF32 128 pixels, cp.async two tiles ahead; 16-bit 256 pixels.
    assert (t["warps_m"], t["warps_n"], t["block_n"], t["async_x"], t["stage_out"]) == (4, 4, 128, 2, 1)
    tb = dict(_spec("pointwise", 64, 128, 1, dtype="bfloat16", nhw=(16, 1024, 1024)).tiles)
    assert (tb["warps_m"], tb["warps_n"], tb["block_n"], tb["async_x"], tb["stage_out"]) == (4, 4, 256, 0, 1)
    for dtype in ("float32", "bfloat16"):  # small planes keep 8 warps
        small = dict(_spec("pointwise", 64, 128, 1, dtype=dtype, nhw=(2, 40, 44)).tiles)
        assert small["warps_m"] * small["warps_n"] == 8
    assert dict(_spec("pointwise", 64, 128, 1, math="ieee", nhw=(16, 1024, 1024)).tiles)["warps_n"] == 4
    assert dict(_spec("igemm", 16, 128, 3, math="ieee", nhw=(16, 1024, 1024)).tiles)["async_x"] == 0
    lay = gemm.igemm.layout(p63)
    assert lay["XASYNC"] and lay["EPI_WORDS"] == 0 and lay["SMEM_BYTES"] <= nominal().smem_block
    p56 = _spec("igemm", 64, 128, (5, 7), nhw=(8, 512, 256))
    assert gemm.igemm.layout(p56)["BN"] == 256  # compute-bound: 64x64 warp tiles


@pytest.mark.parametrize("cin,dtype", [(48, "bfloat16"), (40, "float16"), (48, "float32"), (24, "float32")])
def test_pointwise_reductions_between_block_ks_take_one_stage(cin, dtype):
    """48 channels are no allowed block_k: pointwise rounds the one stage up to 64 (zeros past
    CIN_G) rather than falling to 16-channel stages through registers, which ran bf16 48->96 on
    8 x 512 x 512 in 463 us against 239 (F.conv2d 227; fp16 40->128 976 against 516, F 533)."""
    spec = _spec("pointwise", cin, 96, 1, dtype=dtype, nhw=(8, 512, 512))
    t = dict(spec.tiles)
    assert t["block_k"] == (32 if cin == 24 else 64) and gemm.pointwise.layout(spec)["KSTAGES"] == 1
    if dtype != "float32":
        assert (t["warps_m"], t["warps_n"], t["block_n"]) == (4, 4, 256)  # the wide 16-warp tiles


def test_small_and_odd_shapes_get_tiles():
    for cin, cout, k, groups in ((3, 64, 7, 1), (4, 4, 3, 1), (6, 10, 3, 2), (2048, 512, 1, 1), (512, 1000, 3, 1)):
        family = "pointwise" if k == 1 else "igemm"
        for dtype in ("float32", "bfloat16"):
            _spec(family, cin, cout, k, groups=groups, dtype=dtype, nhw=(1, 7, 7))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80", "sm_89"])
@pytest.mark.parametrize("family,cin,cout,k,dtype,nhw", [
    ("pointwise", 64, 128, 1, "float32", (16, 1024, 1024)),   # case 87
    ("pointwise", 48, 96, 1, "bfloat16", (8, 512, 512)),
    ("igemm", 16, 128, 3, "float32", (16, 1024, 1024)),       # case 63
    ("igemm", 64, 128, (5, 7), "bfloat16", (8, 512, 256)),
    ("igemm", 3, 64, 7, "float32", (32, 224, 224)),           # a stem: packed taps
])
def test_candidates_are_legal_and_the_default_comes_first(family, cin, cout, k, dtype, nhw, arch):
    """Every configuration the family offers passes its check on that GPU (shared memory of 99 KB
    a block on the L40S, 163 on the A100), its own first choice first."""
    device = nominal(arch)
    fam = _families.get_family(family)
    base = ConvSpec(in_channels=cin, out_channels=cout, kernel_size=k, stride=2 if cin == 3 else 1,
                    padding=0 if k == 1 else 3 if cin == 3 else "same", dtype=dtype, device="cuda", layout="nchw",
                    math="tf32" if dtype == "float32" else "ieee", family=family)
    P, Q = base.output_size(*nhw[1:])
    problem = Problem(nhw[0], nhw[1], nhw[2], P, Q, device=device)
    cands = fam.candidates(base, problem)
    assert len(cands) > 1
    assert dict(cands[0].tiles) == {**fam.default_tiles(base, problem)}
    assert len({c.tiles for c in cands}) == len(cands)
    for c in cands:
        fam.check(c, device)
        assert fam.layout(c)["SMEM_BYTES"] <= device.smem_block


def test_async_input_tiles():
    p63 = _spec("igemm", 16, 128, 3, nhw=(16, 1024, 1024))
    lay = gemm.igemm.layout(p63)
    assert lay["XASYNC"] and lay["XDEPTH"] == 1 and lay["NXB"] == 2 and lay["PREFETCH_WORDS"] == 0
    two = dict(p63.tiles, async_x=2)
    gemm.igemm.check_tiles(p63, two, nominal())
    lay2 = gemm.igemm.layout(p63, two)
    assert lay2["NXB"] == 3 and lay2["SMEM_BYTES"] == lay["SMEM_BYTES"] + lay["XWORDS"] * 4
    p56 = _spec("igemm", 64, 128, (5, 7), nhw=(8, 512, 256))  # weights staged per stage
    with pytest.raises(Unsupported, match="async_x"):
        gemm.igemm.check_tiles(p56, dict(p56.tiles, async_x=1), nominal())
    with pytest.raises(Unsupported, match="async_x"):  # 16-bit words pair two channels
        gemm.igemm.check_tiles(p63.replace(dtype="bfloat16", math="ieee"), dict(p63.tiles), nominal())


def test_rows_stage_in_the_consumed_input_buffer():
    """cp.async input with staged rows: the rows go to the input buffer the MMAs just read, in
    as few rounds of whole warp rows as fit it, and take no shared memory of their own."""
    p87 = _spec("pointwise", 64, 128, 1, nhw=(16, 1024, 1024))
    lay = gemm.pointwise.layout(p87)
    assert lay["EPI_IN_X"] and lay["EPI_PARTS"] == 2 and lay["EPI_WORDS"] <= lay["XWORDS"]
    assert lay["EPI_WORDS"] * lay["EPI_PARTS"] == 128 * lay["SRS"]  # float32: a word an element
    assert lay["SMEM_BYTES"] == 4 * (lay["WWORDS"] + lay["NXB"] * lay["XWORDS"])
    t = dict(p87.tiles)
    # 32 channels in, 256 pixels: a quarter of the rows at a time.
    p32 = _spec("pointwise", 32, 128, 1, nhw=(16, 1024, 1024), tiles=dict(t, block_k=32, block_n=256, async_x=1))
    lay32 = gemm.pointwise.layout(p32)
    assert lay32["EPI_IN_X"] and lay32["EPI_PARTS"] == 4
    # Rounds divide the warp rows: two warp rows cannot take quarters, so the rows get a region.
    sep = dict(t, block_k=32, block_n=256, async_x=1, warps_m=2, warps_n=8)
    lays = gemm.pointwise.layout(p32, sep)
    assert not lays["EPI_IN_X"] and lays["EPI_PARTS"] == 1
    assert lays["SMEM_BYTES"] == 4 * (lays["WWORDS"] + lays["NXB"] * lays["XWORDS"] + lays["EPI_WORDS"])
    # Register-staged input (and 16-bit) keeps its own staging region.
    for spec, tiles in ((p87, dict(t, async_x=0)), (_spec("pointwise", 64, 128, 1, dtype="bfloat16",
                                                           nhw=(16, 1024, 1024)), None)):
        lr = gemm.pointwise.layout(spec, tiles)
        assert not lr["EPI_IN_X"] and lr["EPI_PARTS"] == 1
        assert lr["SMEM_BYTES"] == 4 * (lr["WWORDS"] + lr["NXB"] * lr["XWORDS"] + lr["EPI_WORDS"])


def test_few_channel_layers_pack_their_taps_into_the_reduction():
    """pack_k: reduction words over (channel word, tap) pairs, padded to whole k-steps once, where
    a tap has fewer channel words than a k-step; only the real planes (and one zero plane the
    padding words read) are staged, and the offset table sits after the rest, 8-byte aligned."""
    stem = _spec("igemm", 3, 64, 7, stride=2, padding=3, nhw=(32, 224, 224))
    t = dict(stem.tiles)
    assert t["pack_k"] == 1 and t["full_kh"] == 1 and t["block_k"] == 8
    lay = gemm.igemm.layout(stem)
    assert (lay["PACK"], lay["CW"], lay["KF"], lay["KSW"], lay["KP"]) == (True, 3, 147, 152, 4)  # 19 k-steps, not 49
    assert lay["AKS"] % 8 == 4 and lay["XWORDS"] == 4 * lay["CS"]
    assert lay["KTAB"] % 2 == 0 and lay["SMEM_BYTES"] == 4 * (lay["KTAB"] + lay["KSW"])
    unpacked = gemm.igemm.layout(stem, dict(t, pack_k=0, full_kh=0))
    assert unpacked["KSW"] * unpacked["KSTAGES"] == 49 * 8
    # bf16 words pair channels: 3 channels are 2 words (the second half empty), 98 of them.
    bf = gemm.igemm.layout(_spec("igemm", 3, 64, 7, stride=2, padding=3, dtype="bfloat16", nhw=(32, 224, 224)))
    assert (bf["PACK"], bf["CW"], bf["KF"], bf["KSW"], bf["KP"]) == (True, 2, 98, 104, 3)
    # Whole k-steps without padding need no zero plane (8 channels x 3x3 = 72 words, forced).
    p8 = _spec("igemm", 8, 64, 3, padding=1, dtype="bfloat16", nhw=(16, 512, 512))
    assert dict(p8.tiles)["pack_k"] == 1  # 4 bf16 words a tap: 36 words, 5 k-steps, not 9
    assert gemm.igemm.layout(p8, dict(p8.tiles))["KP"] == 5
    f8 = _spec("igemm", 8, 64, 3, padding=1, nhw=(16, 512, 512))
    assert dict(f8.tiles)["pack_k"] == 0  # float32: 8 words a tap already fill a k-step
    lay8 = gemm.igemm.layout(f8, dict(f8.tiles, pack_k=1, full_kh=1))
    assert (lay8["KSW"], lay8["KP"]) == (72, 8)
    # 8 channel words or more keep whole k-steps a tap (TF32 12->64 3x3 lost packed, H100).
    assert dict(_spec("igemm", 12, 64, 3, padding=1, nhw=(16, 512, 512)).tiles)["pack_k"] == 0
    assert dict(_spec("igemm", 12, 64, 3, padding=1, dtype="bfloat16", nhw=(16, 512, 512)).tiles)["pack_k"] == 1
    assert dict(_spec("igemm", 24, 64, 3, padding=1, dtype="bfloat16", nhw=(16, 512, 512)).tiles)["pack_k"] == 0
    # Packing needs one stage: all channels and all kernel rows; pointwise has no taps.
    with pytest.raises(Unsupported, match="pack_k"):
        gemm.igemm.check_tiles(stem, dict(t, full_kh=0), nominal())
    with pytest.raises(Unsupported, match="pack_k"):
        gemm.igemm.check_tiles(_spec("igemm", 32, 64, 3, nhw=(8, 64, 64)),
                               dict(t, block_k=16, full_kh=1), nominal())
    p87 = _spec("pointwise", 64, 128, 1, nhw=(16, 1024, 1024))
    with pytest.raises(ConvArgumentError, match="pack_k"):
        p87.replace(tiles=dict(p87.tiles, pack_k=1))


# -- compile (needs nvcc) ----------------------------------------------------------------------

NVCC = shutil.which("nvcc")
COMPILE_GRID = [g for i, g in enumerate(GRID) if i % 5 == 0]  # every MATH/dtype/kernel seen, ~50 builds


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("k,stride,dil,groups,dm,bias", COMPILE_GRID)
def test_compiles_for_sm90a(k, stride, dil, groups, dm, bias, tmp_path):
    _compile_and_check_sass(_grid_spec(k, stride, dil, groups, dm, bias), tmp_path, ("HMMA",))


def _compile_and_check_sass(spec, tmp_path, instructions) -> None:
    """nvcc the rendered spec for sm_90a; where cuobjdump exists, the SASS must hold `instructions`."""
    src = tmp_path / "k.cu"
    src.write_text(_render(spec))
    obj = tmp_path / "k.o"
    cmd = [NVCC, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-c", str(src), "-o", str(obj)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    cuobjdump = shutil.which("cuobjdump") or os.path.join(os.path.dirname(NVCC), "cuobjdump")
    if os.path.exists(cuobjdump):
        sass = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True).stdout
        for instruction in instructions:
            assert instruction in sass


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("family,k,math,depth", [("igemm", 3, "tf32", 1), ("pointwise", 1, "ieee", 2)])
def test_async_input_compiles(family, k, math, depth, tmp_path):
    spec = _spec(family, 16 if k == 3 else 64, 128, k, math=math, bias=True)
    spec = spec.replace(tiles=dict(spec.tiles, async_x=depth, stage_out=0, min_blocks=1))
    _compile_and_check_sass(spec, tmp_path, ("LDGSTS", "HMMA"))


def _ptxas_report(spec, tmp_path) -> str:
    """nvcc the rendered spec for sm_90a with ptxas's resource report (-v); returns the report."""
    src = tmp_path / "k.cu"
    src.write_text(_render(spec))
    cmd = [NVCC, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-c", str(src),
           "-o", str(tmp_path / "k.o")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype,math,k,stride,tiles", [
    ("float32", "tf32", 7, 2, {}), ("bfloat16", "ieee", 7, 2, {}), ("float32", "ieee", 7, 2, {}),
    ("float16", "ieee", 3, 2, {}), ("float32", "tf32", 3, 1, {"async_x": 1, "block_m": 128}),
    ("bfloat16", "ieee", 7, 2, {"min_blocks": 2, "tile_p": 4, "tile_q": 32})])
def test_packed_reductions_compile_without_spills(dtype, math, k, stride, tiles, tmp_path):
    """Stems with their taps packed into the reduction: table-driven MMAs, no spills (the tall
    halo's element indices are recomputed per tile, not kept in registers)."""
    spec = _spec("igemm", 3, 128 if tiles.get("block_m") == 128 else 64, k, stride=stride, padding=k // 2,
                 dtype=dtype, math=math, nhw=(32, 224, 224))
    spec = spec.replace(tiles=dict(spec.tiles, **tiles))
    assert dict(spec.tiles)["pack_k"] == 1
    report = _ptxas_report(spec, tmp_path)
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == 2, report  # both kernels


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("cin,dtype,rounds", [(64, "float32", 2), (32, "float32", 4), (64, "bfloat16", 1)])
def test_wide_pointwise_tiles_compile_without_spills(cin, dtype, rounds, tmp_path):
    """Case 87's 16-warp tiles (rows staged in the consumed input buffer in 2 or 4 rounds for
    float32, a region of their own for bf16) compile to tensor-core MMAs with no spills."""
    spec = _spec("pointwise", cin, 128, 1, dtype=dtype, nhw=(16, 1024, 1024))
    lay = gemm.pointwise.layout(spec)
    assert lay["NTH"] == 512 and lay["EPI_PARTS"] == rounds and lay["EPI_IN_X"] == (dtype == "float32")
    report = _ptxas_report(spec, tmp_path)
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == 4, report  # the four kernels
