"""The depthwise CUDA family without a GPU: what it accepts, its tiles, and that every
specialisation of its template renders and compiles (nvcc, sm_90a).

The GPU tier (numerics against F.conv2d) lives with the other device tests.
"""

from __future__ import annotations

import itertools
import random
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from kernelgen.errors import Unsupported
from kernelgen.families import all_families
from kernelgen.device import nominal
from kernelgen.families.depthwise import FAMILIES, MAX_TAPS, SMEM_BUDGET, TILES, geometry
from kernelgen.spec import ConvSpec, Problem

FAMILY = FAMILIES[0]
NVCC = shutil.which("nvcc")
# What torch.utils.cpp_extension adds for every .cu, plus the target kernelgen builds for on H100.
NVCC_FLAGS = ["-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
              "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
              "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    # ConvSpec resolves its family through the registry; register this one if the
    # registry does not (yet) list it, and undo that after the test.
    fams = all_families()
    if "depthwise" not in fams:
        monkeypatch.setitem(fams, "depthwise", FAMILY)


def spec(channels=8, mult=1, kernel=3, stride=1, padding=0, dilation=1, dtype="float32", bias=False, groups=None,
         tiles=None, layout="nchw") -> ConvSpec:
    tiles = tiles or {name: values[0] for name, values in TILES.items()}
    return ConvSpec(in_channels=channels, out_channels=channels * mult, kernel_size=kernel, stride=stride,
                    padding=padding, dilation=dilation, groups=channels if groups is None else groups,
                    dtype=dtype, bias=bias, layout=layout, family="depthwise", tiles=tiles)


def with_default_tiles(s: ConvSpec, N: int, H: int, W: int) -> ConvSpec:
    P, Q = s.output_size(H, W)
    return s.replace(tiles=tuple(FAMILY.default_tiles(s, Problem(N=N, H=H, W=W, P=P, Q=Q)).items()))


# -- what the family serves --------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(),
    dict(mult=2),
    dict(mult=3, kernel=(3, 1)),
    dict(kernel=(1, 3), stride=2, padding=(0, 1)),
    dict(kernel=(2, 4), dilation=(2, 3), padding=3),
    dict(kernel=9, dtype="bfloat16"),
    dict(channels=1, mult=5, dtype="float16", bias=True),
    dict(dtype="float64", padding="same"),
])
def test_accepts_depthwise(kw):
    FAMILY.check(spec(**kw))


@pytest.mark.parametrize("kw, reason", [
    (dict(groups=1), "groups == in_channels"),
    (dict(channels=8, groups=4), "groups == in_channels"),
    (dict(kernel=(10, 9)), "taps"),
    (dict(kernel=11), "taps"),
])
def test_rejects(kw, reason):
    with pytest.raises(Unsupported, match=reason):
        FAMILY.check(spec(**kw))


def test_rejects_other_layouts_and_devices():
    with pytest.raises(Unsupported):
        FAMILY.check(spec(layout="nhwc"))
    with pytest.raises(Unsupported):
        FAMILY.check(spec(layout="any"))


def test_rejects_tiles_whose_window_overflows_shared_memory():
    big = dict(block_q=512, rows=16, threads=512, stages=2)
    s = spec(kernel=9, stride=3, dilation=3, tiles=big)
    assert geometry(s, big)["smem_bytes"] > SMEM_BUDGET
    with pytest.raises(Unsupported, match="shared memory"):
        FAMILY.check(s)


def test_first_tile_values_are_the_smallest_window():
    # A spec checked with every tile at its first value must have the smallest window, or
    # check() could reject a servable spec.
    s = spec(kernel=9, stride=2, dilation=2)
    first = {name: values[0] for name, values in TILES.items()}
    smallest = min(geometry(s, dict(zip(TILES, combo)))["smem_bytes"]
                   for combo in itertools.product(*TILES.values()))
    assert geometry(s, first)["smem_bytes"] == smallest


# -- default tiles -----------------------------------------------------------------------

@pytest.mark.parametrize("kw, shape", [
    (dict(channels=128), (64, 256, 512)),                              # KernelBench 84
    (dict(channels=8, kernel=(3, 1)), (64, 512, 512)),                 # KernelBench 83
    (dict(channels=8, kernel=(3, 1), dtype="bfloat16"), (64, 512, 512)),
    (dict(channels=1), (1, 3, 3)),                                     # one output
    (dict(channels=3, kernel=7, padding=3), (2, 1, 1000)),             # one row
    (dict(channels=3, kernel=(7, 1), padding=(3, 0)), (2, 1000, 1)),   # one column
    (dict(channels=32, mult=2, kernel=5, stride=2, padding=2), (8, 112, 112)),
    (dict(channels=16, kernel=9, stride=3, dilation=4, padding=16), (2, 300, 2000)),
    (dict(channels=16, kernel=9, dilation=8, dtype="float64"), (1, 100, 700)),
])
def test_default_tiles_are_valid_and_fit(kw, shape):
    s = with_default_tiles(spec(**kw), *shape)
    tiles = dict(s.tiles)
    for name, values in TILES.items():
        assert tiles[name] in values
    assert geometry(s, tiles)["smem_bytes"] <= SMEM_BUDGET
    FAMILY.check(s)
    FAMILY.check(s, nominal("sm_89"))  # (99 KB a block: the budget stays under every target's)


def test_default_tiles_for_the_kernelbench_cases():
    # The tiling that measured fastest on H100 for both cases, float32 and bfloat16:
    # one 512-wide tile per row band (no ragged waste for Q = 510 or 512), 8 rows a thread;
    # 16-bit lanes own 4 adjacent columns, so 128 threads cover the row (float32: 256, one each).
    for dtype, threads in (("float32", 256), ("bfloat16", 128), ("float16", 128)):
        best = {"block_q": 512, "rows": 8, "threads": threads, "stages": 1}
        s84 = with_default_tiles(spec(channels=128, dtype=dtype), 64, 256, 512)
        assert dict(s84.tiles) == best
        s83 = with_default_tiles(spec(channels=8, kernel=(3, 1), dtype=dtype), 64, 512, 512)
        assert dict(s83.tiles) == best


@pytest.mark.parametrize("kw, shape, block_q", [
    (dict(channels=960, padding=1), (32, 7, 7), 8),                  # MobileNetV2's small planes
    (dict(channels=384, padding=1), (32, 14, 14), 16),
    (dict(channels=3, kernel=(7, 1), padding=(3, 0)), (2, 1000, 1), 8),  # one column
    (dict(channels=64, padding=1), (8, 17, 17), 32),                 # wider than 16: a whole warp
    (dict(channels=96, stride=2, padding=1), (32, 112, 112), 64),    # 56 columns at stride 2
    (dict(channels=32, padding=1), (32, 112, 112), 128),
])
def test_tiles_narrower_than_a_warp_only_where_one_covers_the_row(kw, shape, block_q):
    assert dict(with_default_tiles(spec(**kw), *shape).tiles)["block_q"] == block_q


def test_default_tiles_need_shared_memory_the_check_allows_whenever_check_passes():
    # For every (kernel, stride, dilation) the first tiles fit, default tiles must fit too.
    for k, st, d in itertools.product((1, 3, 9), (1, 2, 4), (1, 3, 9)):
        s = spec(kernel=k, stride=st, dilation=d)
        try:
            FAMILY.check(s)
        except Unsupported:
            continue
        FAMILY.check(with_default_tiles(s, 4, 1024, 1024))


# -- rendering and compiling ---------------------------------------------------------------

KERNELS = [(3, 3), (3, 1), (1, 3), (5, 5), (7, 7)]
DTYPES = ["float32", "float16", "bfloat16"]
# Tiles rotate through the grid, so that every value of every tile parameter is compiled.
TILE_CYCLE = [dict(block_q=512, rows=8, threads=256, stages=2), dict(block_q=32, rows=1, threads=64, stages=1),
              dict(block_q=64, rows=16, threads=512, stages=2), dict(block_q=128, rows=2, threads=128, stages=1),
              dict(block_q=256, rows=4, threads=256, stages=2), dict(block_q=8, rows=2, threads=128, stages=2),
              dict(block_q=16, rows=4, threads=64, stages=1)]


def _fit(kw):
    """kw with its tiles shrunk (rows, then block_q) until the window fits in shared memory."""
    pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)  # noqa: E731
    shape = SimpleNamespace(kernel_size=pair(kw["kernel"]), stride=pair(kw["stride"]),
                            dilation=pair(kw["dilation"]), dtype=kw["dtype"])
    tiles = dict(kw["tiles"])
    while geometry(shape, tiles)["smem_bytes"] > SMEM_BUDGET:
        if tiles["rows"] > 1:
            tiles["rows"] //= 2
        else:
            tiles["block_q"] //= 2
    return {**kw, "tiles": tiles}


GRID = [_fit(dict(kernel=k, stride=s, dilation=d, mult=m, dtype=t, bias=b, padding=(i % 3, (i // 3) % 3),
                  tiles=TILE_CYCLE[i % len(TILE_CYCLE)]))
        for i, (k, s, d, m, t, b) in enumerate(itertools.product(
            KERNELS, (1, 2), (1, 2), (1, 2), DTYPES, (False, True)))]


# Every grid spec renders; a fixed sixth of them compiles (a seeded sample in which every
# kernel, stride, dilation, multiplier, dtype and bias still appears): the whole grid took
# 15 minutes of nvcc on a 2-core CI machine, beside the other families' grids.
COMPILE_GRID = [GRID[i] for i in sorted(random.Random(6).sample(range(len(GRID)), len(GRID) // 6))]


def _grid_id(kw):
    (kh, kwid) = kw["kernel"]
    return (f"k{kh}x{kwid}-s{kw['stride']}-d{kw['dilation']}-m{kw['mult']}-{kw['dtype']}"
            f"{'-bias' if kw['bias'] else ''}")


def _render(kw) -> str:
    from kernelgen.render import render

    return render(spec(**kw)).cuda


def test_render_is_strict_and_self_describing():
    src = _render(GRID[0])
    assert "extern \"C\" int kg_launch(const KgArgs* a, char* err, int errlen)" in src
    assert src.startswith("// Generated by kernelgen")
    assert "{{" not in src and "{%" not in src


def test_render_with_plain_jinja():
    # The template needs nothing beyond the documented context plus its own names.
    import jinja2
    from kernelgen.render import template_dir

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                             undefined=jinja2.StrictUndefined)
    s = spec(kernel=(3, 1), mult=2, bias=True, dtype="bfloat16", tiles=TILE_CYCLE[0])
    src = env.get_template(FAMILY.template).render(s.template_context())
    assert "typedef __nv_bfloat16 scalar_t;" in src
    assert "constexpr int MULT = 2;" in src
    ctx = s.template_context()
    del ctx["DW_SMEM_BYTES"]
    with pytest.raises(jinja2.UndefinedError):
        env.get_template(FAMILY.template).render(ctx)


@pytest.mark.parametrize("dtype, cv", [("float32", 1), ("float64", 1), ("bfloat16", 4), ("float16", 4)])
def test_columns_per_lane(dtype, cv):
    # 16-bit lanes own (up to) 4 adjacent columns; 4- and 8-byte types one.
    src = _render(dict(kernel=(3, 3), stride=1, dilation=1, padding=(0, 0), mult=1, dtype=dtype, bias=False,
                       tiles=dict(block_q=512, rows=8, threads=128, stages=1)))
    assert f"constexpr int CV = cv_of(COLS, {cv});" in src


@pytest.mark.parametrize("kw", GRID, ids=_grid_id)
def test_grid_renders(kw):
    assert "kg_launch" in _render(kw)


@pytest.fixture(scope="module")
def compiled_grid():
    """Compile every grid specialisation once, in parallel: id -> (returncode, log)."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    sources = {}
    for kw in COMPILE_GRID:
        with _registered_for_fixture():
            sources[_grid_id(kw)] = _render(kw)
    with tempfile.TemporaryDirectory(prefix="kg-depthwise-") as tmp:
        def build(item):
            name, src = item
            path = os.path.join(tmp, name + ".cu")
            with open(path, "w") as f:
                f.write(src)
            proc = subprocess.run([NVCC, *NVCC_FLAGS, "-c", path, "-o", path + ".o"],
                                  capture_output=True, text=True)
            return name, (proc.returncode, proc.stdout + proc.stderr)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            return dict(pool.map(build, sources.items()))


class _registered_for_fixture:
    # The module-scoped fixture cannot use the function-scoped monkeypatch.
    def __enter__(self):
        fams = all_families()
        self.added = "depthwise" not in fams
        if self.added:
            fams["depthwise"] = FAMILY

    def __exit__(self, *exc):
        if self.added:
            del all_families()["depthwise"]


@pytest.mark.compile
@pytest.mark.nvcc
@pytest.mark.parametrize("kw", COMPILE_GRID, ids=_grid_id)
def test_grid_compiles(kw, compiled_grid):
    rc, log = compiled_grid[_grid_id(kw)]
    assert rc == 0, log[-4000:]
    assert "warning" not in log.lower(), log[-4000:]


@pytest.mark.compile
@pytest.mark.nvcc
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("kw", [
    _fit(dict(kernel=(2, 4), stride=(3, 1), dilation=(1, 3), padding=(1, 2), mult=3, dtype="float64", bias=True,
              tiles=TILE_CYCLE[2])),
    _fit(dict(kernel=9, stride=2, dilation=2, padding=8, dtype="float16", tiles=TILE_CYCLE[4])),
    # 16-bit lanes with 4 columns (8-byte shared reads and stores), misaligned span (odd padding).
    dict(kernel=(3, 3), stride=1, dilation=1, padding=(1, 1), mult=1, dtype="bfloat16", bias=True,
         tiles=dict(block_q=512, rows=8, threads=128, stages=1)),
    dict(kernel=(1, 4), stride=(1, 3), dilation=(1, 2), padding=(0, 3), mult=2, dtype="float16", bias=False,
         tiles=dict(block_q=256, rows=2, threads=64, stages=2)),
], ids=["even-asymmetric-float64", "9x9-strided-dilated-float16", "cv4-bfloat16", "cv4-strided-float16"])
def test_odd_specs_compile(kw, tmp_path):
    path = tmp_path / "k.cu"
    path.write_text(_render(kw))
    proc = subprocess.run([NVCC, *NVCC_FLAGS, "-c", str(path), "-o", str(path) + ".o"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
