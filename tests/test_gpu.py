"""GPU tier: kernelgen.conv2d against F.conv2d in float64, on a CUDA device.

A seeded random sweep of several hundred calls covers kernels, strides, paddings
('same'/'valid' too), dilations, groups (dense, grouped, depthwise, depthwise with a
multiplier), bias, batch sizes (unbatched too), every dtype and float32 precision,
both memory formats and non-contiguous views. Every kernel the sweep needs is
compiled up front, in parallel, through `kernelgen.warm`, so the tier takes minutes.

Outputs are poisoned: a NaN-filled block of the output's size is freed just before
each call, so the caching allocator hands it to the output and an element the kernel
never wrote shows up as NaN.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

import pytest
import torch
import torch.nn.functional as F

import kernelgen
from kernelgen import select
from kernelgen.device import nominal
from kernelgen.errors import ConvArgumentError, Unsupported
from kernelgen.families import get_family
from kernelgen.functional import candidates_for, planning_for, spec_for
from kernelgen.spec import ConvSpec, Problem
from activations import activate

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent
N_CASES = 240
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class Case:
    idx: int
    N: int  # 0 means unbatched
    C: int
    K: int
    groups: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: object
    dilation: tuple[int, int]
    bias: bool
    dtype: str
    precision: str | None
    layout: str  # contiguous, channels_last, weight_channels_last, cl_both (input and weight
    # channels_last), strided_view, offset, cl_offset, weight_slice, cl_weight_slice; a lowered
    # weight gradient's (_lowered_tensors): lowered, lowered_cl, lowered_cl_wslice, lowered_cl_cslice
    H: int
    W: int
    family: str | None
    tiles: tuple = ()  # (name, value) pairs forced over the family's defaults
    # the fused epilogue: an activation (kernelgen.ACTIVATIONS) and a residual, made (make_residual)
    # with the output's strides ('out'), the other memory format's ('other'), or as a strided view
    activation: str | None = None
    residual: str | None = None
    scale: bool = False  # a float32 scale per output channel (a folded BatchNorm's), before the bias

    def __str__(self) -> str:
        epilogue = (f" epilogue={'scale+' if self.scale else ''}{self.activation or ''}"
                    f"{'+residual(' + self.residual + ')' if self.residual else ''}"
                    if self.activation or self.residual or self.scale else "")
        return (f"#{self.idx} N{self.N} {self.C}->{self.K} g{self.groups} k{self.kernel} s{self.stride} "
                f"p{self.padding} d{self.dilation} {self.dtype}/{self.precision} {self.layout} {self.H}x{self.W}"
                f"{' bias' if self.bias else ''}{' family=' + self.family if self.family else ''}"
                f"{' ' + ','.join(f'{k}={v}' for k, v in self.tiles) if self.tiles else ''}{epilogue}")


def _extent(kernel: tuple, dilation: tuple) -> tuple:
    """Rows and columns a dilated kernel spans: the least padded input that holds it."""
    return tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation))


def _cl_window(rng: random.Random) -> tuple:
    """Stride, dilation and padding as the channels_last generators draw them ('same' and
    'valid' only at stride 1)."""
    stride = rng.choice([(1, 1), (1, 1), (2, 2), (1, 2), (3, 3)])
    dilation = rng.choice([(1, 1), (1, 1), (1, 1), (2, 2), (1, 3)])
    padding = rng.choice([0, 1, (1, 2), (0, 3)] + (["same", "valid"] if stride == (1, 1) else []))
    return stride, dilation, padding


def make_cases(n: int, seed: int = 1234) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for idx in range(n):
        kind = rng.choice(["dense", "dense", "dense", "grouped", "depthwise", "depthwise", "pointwise", "pointwise"])
        C = rng.choice([1, 2, 3, 4, 8, 16, 32, 64]) if kind != "pointwise" else rng.choice([8, 16, 32, 64, 96])
        if kind == "depthwise":
            C = rng.choice([1, 3, 8, 16, 32])
            groups, K = C, C * rng.choice([1, 1, 2])
        elif kind == "grouped":
            C = rng.choice([4, 8, 16, 32, 64])
            groups = rng.choice([g for g in (2, 4) if C % g == 0])
            K = groups * rng.choice([1, 2, 4, 8])
        else:
            groups, K = 1, rng.choice([1, 4, 8, 16, 32, 64, 128])
        if kind == "pointwise":
            kernel = (1, 1)
        else:
            kernel = rng.choice([(3, 3), (3, 3), (5, 5), (3, 1), (1, 3), (5, 7), (7, 7), (2, 2), (1, 1), (4, 3)])
        stride = rng.choice([(1, 1), (1, 1), (1, 1), (2, 2), (1, 2), (3, 3)])
        dilation = rng.choice([(1, 1), (1, 1), (1, 1), (2, 2), (1, 3)])
        if stride == (1, 1) and rng.random() < 0.15:
            padding = rng.choice(["same", "valid"])
        else:
            padding = rng.choice([0, 0, 1, 2, (1, 2), (0, 3)])
        dtype = rng.choice(["float32"] * 5 + ["float16", "bfloat16", "bfloat16", "float64"])
        precision = rng.choice([None, "ieee", "tf32"]) if dtype == "float32" else None
        layout = rng.choice(["contiguous"] * 4 + ["channels_last", "weight_channels_last", "strided_view"])
        N = rng.choice([0, 1, 1, 2, 3, 4])
        H, W = rng.randint(5, 48), rng.randint(5, 48)
        # The padded input must hold the dilated kernel.
        eh, ew = _extent(kernel, dilation)
        H, W = max(H, eh), max(W, ew)
        if N == 0 and layout != "strided_view":
            layout = "contiguous"
        family = "direct" if idx % 5 == 4 and dtype != "float64" else None
        cases.append(Case(idx, N, C, K, groups, kernel, stride, padding, dilation, rng.random() < 0.5, dtype,
                          precision, layout, H, W, family))
    return cases


def make_wgmma_cases(n: int, seed: int = 4321) -> list[Case]:
    """Calls forced onto the `wgmma` family (Hopper only), made for long
    reductions: every dtype it serves, padding, dilation, row stride, groups, bias, odd
    sizes, unbatched input and strided views (it honours input strides)."""
    rng = random.Random(seed)
    cases = []
    for idx in range(n):
        groups = rng.choice([1, 1, 1, 2])
        C = groups * rng.choice([8, 16, 24, 32, 64])
        K = groups * rng.choice([64, 80, 128, 192])
        kernel = rng.choice([(1, 1), (3, 3), (5, 7), (2, 4), (3, 1), (1, 5), (7, 7)])
        stride = rng.choice([(1, 1), (1, 1), (2, 1), (3, 1)])
        dilation = rng.choice([(1, 1), (1, 1), (2, 2), (1, 3)])
        padding = rng.choice([0, 1, (2, 0), "valid"] + (["same"] if stride == (1, 1) else []))
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16"])
        if dtype == "float16" or dtype == "bfloat16":
            C = groups * rng.choice([16, 32, 48, 64])
        precision = "tf32" if dtype == "float32" else None
        layout = rng.choice(["contiguous", "contiguous", "contiguous", "strided_view"])
        N = rng.choice([0, 1, 2, 3])
        eh, ew = _extent(kernel, dilation)
        H, W = max(rng.randint(5, 70), eh), max(rng.randint(5, 300), ew)
        cases.append(Case(1000 + idx, N, C, K, groups, kernel, stride, padding, dilation, rng.random() < 0.5,
                          dtype, precision, layout, H, W, "wgmma"))
    return cases


def make_staged_cases(n: int, seed: int = 2468) -> list[Case]:
    """Calls forced onto the staged epilogue (tile stage_out=1) of `pointwise` and `igemm`, and of
    `wgmma` on Hopper: output rows of every alignment (odd widths, strided views, unbatched),
    bias, groups, partial channel blocks, every dtype and float32 precision."""
    rng = random.Random(seed)
    cases = []
    for idx in range(n):
        family = rng.choice(["pointwise", "igemm", "igemm"] + (["wgmma"] if HOPPER else []))
        groups = rng.choice([1, 1, 2])
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16"])
        C = groups * rng.choice([8, 16, 24, 32] if family != "wgmma" or dtype == "float32" else [16, 32])
        K = groups * rng.choice([8, 24, 64, 96, 128] if family != "wgmma" else [64, 80, 128])
        kernel = (1, 1) if family == "pointwise" else rng.choice([(3, 3), (1, 1), (5, 7), (3, 1), (2, 4)])
        stride = (1, 1) if family == "pointwise" else rng.choice([(1, 1), (1, 1), (2, 1)] +
                                                                 ([(2, 2)] if family == "igemm" else []))
        padding = 0 if family == "pointwise" else rng.choice([0, 1, (2, 0), "valid"])
        dilation = (1, 1) if family == "pointwise" else rng.choice([(1, 1), (1, 1), (2, 1)])
        precision = (rng.choice(["tf32", "ieee"]) if family != "wgmma" else "tf32") if dtype == "float32" else None
        tiles = [("stage_out", 1)] + ([("min_blocks", 1)] if family != "wgmma" else [])  # the staging's smem
        if (family == "igemm" and dtype == "float32" and precision == "tf32" and kernel[0] <= 3
                and C // groups <= 32 and rng.random() < 0.5):
            tiles.append(("async_x", 1))  # resident weights only
        layout = rng.choice(["contiguous", "contiguous", "strided_view"])
        N = rng.choice([0, 1, 2, 3])
        eh, ew = _extent(kernel, dilation)
        H, W = max(rng.randint(3, 40), eh), max(rng.randint(3, 200), ew)
        cases.append(Case(2000 + idx, N, C, K, groups, kernel, stride, padding, dilation, rng.random() < 0.5,
                          dtype, precision, layout, H, W, family, tuple(tiles)))
    return cases


def make_wide_pointwise_cases(n: int, seed: int = 1470) -> list[Case]:
    """`pointwise` forced onto the wide one-stage tiles of large planes (128 or 256 pixels, 8 or 16
    warps, staged rows): float32 with cp.async input stages its rows in the input buffer the
    MMAs just read, in rounds of channels when they do not fit it at once; 16-bit through
    registers. Partial channel blocks, planes of every size (not a multiple of 4: the 4-byte
    input path), bias, groups, strided views, unbatched."""
    rng = random.Random(seed)
    cases = []
    for idx in range(n):
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16"])
        groups = rng.choice([1, 1, 2])
        C = groups * rng.choice([8, 16, 32, 64] if dtype == "float32" else [16, 32, 64])
        K = groups * rng.choice([48, 64, 128, 160])
        bn = rng.choice([256, 128])
        wm, wn = rng.choice([(4, 4), (2, 8), (2, 4)])
        tiles = [("block_n", bn), ("warps_m", wm), ("warps_n", wn), ("stage_out", 1), ("min_blocks", 1)]
        if dtype == "float32":
            tiles.append(("async_x", rng.choice([1, 2]) if bn == 128 else 1))
        precision = rng.choice(["tf32", "tf32", "ieee"]) if dtype == "float32" else None
        layout = rng.choice(["contiguous", "contiguous", "strided_view"])
        N = rng.choice([0, 1, 2, 3])
        H, W = rng.randint(3, 40), rng.randint(3, 200)
        cases.append(Case(2100 + idx, N, C, K, groups, (1, 1), (1, 1), 0, (1, 1), rng.random() < 0.5,
                          dtype, precision, layout, H, W, "pointwise", tuple(tiles)))
    # One stage of 64 channels over 48 and 40 input channels (zero past CIN_G), as pointwise's own
    # tiles take 16-bit 48-channel layers on large planes.
    for idx, (C, dtype, prec) in enumerate([(48, "bfloat16", None), (40, "float32", "ieee"), (48, "float16", None)]):
        cases.append(Case(2140 + n + idx, 2, C, 96, 1, (1, 1), (1, 1), 0, (1, 1), idx != 1, dtype, prec, "contiguous",
                          19, 37 + idx, "pointwise", (("block_k", 64), ("block_n", 128 if idx == 1 else 256),
                                                      ("warps_m", 4), ("warps_n", 4), ("stage_out", 1), ("min_blocks", 1),
                                                      ("async_x", 0))))
    # Case 87's tiles (64 channels in, rows staged in 2 rounds) and 32 channels in (4 rounds), on
    # planes of whole 256-pixel tiles and on planes that end in a cut tile (the 4-byte input path).
    wide = (("block_n", 256), ("warps_m", 4), ("warps_n", 4), ("stage_out", 1), ("min_blocks", 1), ("async_x", 1))
    for idx, (C, K, H, W) in enumerate([(64, 128, 16, 48), (64, 128, 23, 61), (32, 128, 32, 40), (32, 96, 9, 57)]):
        cases.append(Case(2100 + n + idx, 2, C, K, 1, (1, 1), (1, 1), 0, (1, 1), idx % 2 == 0, "float32", "tf32",
                          "contiguous", H, W, "pointwise", wide))
    return cases


def make_one_stage_cases(n: int, seed: int, first: int, tiles) -> list[Case]:
    """`wgmma` calls with short reductions held in one stage, every alignment and dtype, forced
    onto the tiles `tiles(rng)` returns."""
    rng = random.Random(seed)
    cases = []
    for idx in range(n):
        groups = rng.choice([1, 1, 2])
        dtype = rng.choice(["float32", "bfloat16", "float16"])
        C = groups * rng.choice([4, 8, 16] if dtype == "float32" else [8, 16])
        K = groups * rng.choice([64, 80, 128])
        kernel = rng.choice([(3, 3), (1, 1), (3, 1), (2, 4)])
        stride = rng.choice([(1, 1), (1, 1), (2, 1)])
        padding = rng.choice([0, 1, "same"]) if stride == (1, 1) else rng.choice([0, 1])
        layout = rng.choice(["contiguous", "contiguous", "strided_view"])
        N = rng.choice([0, 1, 2, 3])
        H, W = rng.randint(3, 40), max(rng.randint(3, 300), kernel[1])
        bias = rng.random() < 0.5
        cases.append(Case(first + idx, N, C, K, groups, kernel, stride, padding, (1, 1), bias,
                          dtype, "tf32" if dtype == "float32" else None, layout, H, W, "wgmma", tiles(rng)))
    return cases


def make_overlap_cases(n: int, seed: int = 1357) -> list[Case]:
    """`wgmma` calls forced onto overlapped stores (tile overlap=1: a tile's staged rows leave
    under the next tile's MMAs)."""
    return make_one_stage_cases(n, seed, 3000, lambda rng: (("stage_out", 1), ("overlap", 1)))


def make_ws_cases(n: int, seed: int = 8642) -> list[Case]:
    """`wgmma` calls forced onto the producer warpgroup (tile ws=1: one warpgroup stages the
    input, the others compute and store): one or two consumer warpgroups, partial channel
    blocks, both output paths."""
    cases = make_one_stage_cases(n, seed, 4000, lambda rng: (("stage_out", rng.choice([0, 1, 1])), ("ws", 1)))
    # Rows, strides and padding in multiples of 4 (float32) or 8 (16-bit) columns: the producer's
    # 16-byte loads (x_groups), also with a partial channel chunk, padding and a cut last tile.
    for idx, (dtype, C, K, kernel, padding, W) in enumerate([
            ("float32", 16, 128, (3, 3), 0, 256), ("float32", 12, 64, (3, 3), 4, 132),
            ("float32", 8, 80, (1, 1), 0, 64), ("float32", 16, 128, (2, 4), (1, 4), 300),
            ("bfloat16", 16, 128, (3, 3), 0, 256), ("float16", 24, 64, (3, 3), 8, 136),
            ("bfloat16", 8, 80, (1, 1), 0, 264), ("float16", 16, 128, (2, 4), (1, 8), 304)]):
        cases.append(Case(4100 + idx, 2, C, K, 1, kernel, (1, 1), padding, (1, 1), idx % 2 == 0, dtype,
                          "tf32" if dtype == "float32" else None, "contiguous", 9 + idx % 4, W, "wgmma",
                          (("stage_out", 1), ("ws", 1))))
    # 16-bit one-stage tiles load through two sets of groups (XSETS 2) that swap roles every
    # tile: blocks of several tiles, odd and even counts, padding and a partial channel chunk.
    for idx, (dtype, N, C, padding, H, W) in enumerate([("bfloat16", 3, 16, 0, 64, 264),
                                                        ("float16", 2, 24, 8, 41, 392)]):
        cases.append(Case(4108 + idx, N, C, 128, 1, (3, 3), (1, 1), padding, (1, 1), idx == 0, dtype, None,
                          "contiguous", H, W, "wgmma", (("stage_out", 1), ("ws", 1))))
    # 16-bit outputs of 4 rows or more a block (132 blocks on an H100, 66 a group with two) take
    # the whole-line epilogue (LINES): rows several tiles wide, one tile wide, a cut last tile of
    # 2 columns, partial channel blocks, groups, odd row widths, a strided input.
    for idx, (dtype, N, C, K, groups, padding, H, W, layout) in enumerate([
            ("bfloat16", 1, 16, 128, 1, 0, 600, 300, "contiguous"),
            ("float16", 2, 24, 80, 1, 1, 300, 130, "strided_view"),
            ("bfloat16", 4, 16, 128, 1, 0, 142, 101, "contiguous"),
            ("float16", 1, 32, 256, 2, 1, 300, 259, "contiguous")]):
        cases.append(Case(4110 + idx, N, C, K, groups, (3, 3), (1, 1), padding, (1, 1), idx % 2 == 0, dtype, None,
                          layout, H, W, "wgmma", (("stage_out", 1), ("ws", 1))))
    # TF32 with its weights in the consumers' registers (a_regs=1), which makes room for the
    # whole-line epilogue: the same kinds of outputs, a 1x1 kernel, a partial channel chunk and
    # one consumer warpgroup; and outputs of too few rows for it, whose rows start off 16 bytes
    # (the width-adaptive kernel) or on them (16-byte chunks).
    for idx, (N, C, K, groups, kernel, padding, H, W, layout) in enumerate([
            (1, 16, 128, 1, (3, 3), 0, 600, 300, "contiguous"),
            (2, 12, 80, 1, (3, 3), 1, 300, 130, "strided_view"),
            (4, 16, 128, 1, (3, 3), 0, 142, 101, "contiguous"),
            (1, 32, 256, 2, (3, 3), 1, 300, 259, "contiguous"),
            (1, 16, 128, 1, (1, 1), 0, 560, 262, "strided_view"),
            (2, 8, 64, 1, (3, 1), 0, 300, 70, "contiguous"),
            (2, 16, 128, 1, (3, 3), 1, 19, 70, "contiguous"),
            (2, 8, 64, 1, (3, 3), 1, 40, 136, "contiguous")]):
        cases.append(Case(4120 + idx, N, C, K, groups, kernel, (1, 1), padding, (1, 1), idx % 2 == 0, "float32",
                          "tf32", layout, H, W, "wgmma", (("stage_out", 1), ("ws", 1), ("a_regs", 1))))
    return cases


def make_ws_stage_cases(n: int, seed: int = 9753) -> list[Case]:
    """`wgmma` calls forced onto the producer warpgroup with reductions of several stages (ws=1,
    one k-step of channels a stage): the producer also starts each stage's weight copy, and the
    consumers release slots stage by stage. 256-column tiles (the producer/consumer register
    split) in some; every dtype, rows that allow the producer's 16-byte loads and rows that do
    not, partial channel chunks, groups, row stride, dilation, padding, unbatched and strided."""
    rng = random.Random(seed)
    cases = []
    for idx in range(n):
        groups = rng.choice([1, 1, 2])
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16"])
        kstep = 8 if dtype == "float32" else 16
        C = groups * rng.choice([12, 16, 24, 40] if dtype == "float32" else [24, 32, 48])
        K = groups * rng.choice([64, 80, 128, 128])
        kernel = rng.choice([(3, 3), (5, 7), (1, 1), (2, 4), (7, 7)])
        stride = rng.choice([(1, 1), (1, 1), (2, 1)])
        dilation = rng.choice([(1, 1), (1, 1), (2, 1)])
        padding = rng.choice([0, 0, 1, (2, 0), (1, 8)])
        tiles = [("ws", 1), ("block_k", kstep)] + ([("tile_p", 1), ("tile_q", 256)] if rng.random() < 0.4 else [])
        layout = rng.choice(["contiguous", "contiguous", "contiguous", "strided_view"])
        N = rng.choice([0, 1, 2])
        eh, ew = _extent(kernel, dilation)
        H = max(rng.randint(3, 20), eh)
        W = max(rng.choice([rng.randint(3, 300), 64, 136, 264, 280]), ew)
        cases.append(Case(4400 + idx, N, C, K, groups, kernel, stride, padding, dilation, rng.random() < 0.5,
                          dtype, "tf32" if dtype == "float32" else None, layout, H, W, "wgmma", tuple(tiles)))
    # float32 producers over several stages hold two sets of 16-byte groups (XSETS 2): 56's own
    # tiles, 256-column tiles over a cut second tile with a partial channel chunk and padding,
    # 3xTF32 with its per-stage sums; two or three tiles a block, so the sets swap roles.
    for idx, (precision, C, K, kernel, padding, H, W, tiles) in enumerate([
            ("tf32", 64, 128, (5, 7), 0, 150, 256, ()),
            ("tf32", 40, 128, (3, 3), 4, 100, 300, (("tile_p", 1), ("tile_q", 256), ("block_k", 16))),
            ("ieee", 40, 80, (3, 5), (1, 4), 70, 132, ())]):
        cases.append(Case(4430 + idx, 2, C, K, 1, kernel, (1, 1), padding, (1, 1), idx != 1, "float32", precision,
                          "contiguous", H, W, "wgmma", (("ws", 1),) + tiles))
    return cases


def make_split_cases(n: int, seed: int = 5791) -> list[Case]:
    """Strict float32 on `wgmma` (3xTF32: both operands staged as a TF32 pair): one stage or
    several, with the producer warpgroup or without, the staged epilogue or fragment stores,
    reductions long enough (> 256 over several stages) for per-stage partial sums (FLUSH), and
    the small weights in registers (a_regs) or in shared memory."""
    rng = random.Random(seed)
    cases = []
    for idx in range(n):
        groups = rng.choice([1, 1, 2])
        C = groups * rng.choice([8, 12, 16, 24, 40, 64])
        K = groups * rng.choice([64, 80, 128])
        kernel = rng.choice([(3, 3), (5, 7), (1, 1), (2, 4), (7, 7), (5, 5)])
        stride = rng.choice([(1, 1), (1, 1), (2, 1)])
        dilation = rng.choice([(1, 1), (1, 1), (2, 1)])
        padding = rng.choice([0, 1, (2, 0), "valid"])
        tiles = [("ws", rng.choice([0, 1])), ("stage_out", rng.choice([0, 1]))]
        if rng.random() < 0.5:
            tiles.append(("block_k", 8))  # several stages a tile
        layout = rng.choice(["contiguous", "contiguous", "contiguous", "strided_view"])
        N = rng.choice([0, 1, 2])
        eh, ew = _extent(kernel, dilation)
        H = max(rng.randint(3, 20), eh)
        W = max(rng.choice([rng.randint(3, 300), 64, 136, 264]), ew)
        cases.append(Case(4500 + idx, N, C, K, groups, kernel, stride, padding, dilation, rng.random() < 0.5,
                          "float32", "ieee", layout, H, W, "wgmma", tuple(tiles)))
    # One stage a tile takes the small weights in registers by default (a_regs=1): both halves
    # resident too, with and without the producer, and a partial channel block.
    for idx, (C, K, kernel, ws) in enumerate([(16, 128, (3, 3), 1), (12, 80, (3, 3), 0), (32, 64, (1, 1), 1)]):
        cases.append(Case(4530 + idx, 2, C, K, 1, kernel, (1, 1), 1 if kernel != (1, 1) else 0, (1, 1), idx != 1,
                          "float32", "ieee", "contiguous", 11, 70 + idx, "wgmma", (("a_regs", 0), ("ws", ws))))
    return cases


def make_ragged_cases() -> list[Case]:
    """Staged float32 `wgmma` outputs whose rows do not all start on 16 bytes (the width-adaptive
    stores): rows and planes 8 bytes off (8-byte stores), odd widths (4-byte stores) with a
    last tile of one column, and the same without the producer warpgroup."""
    cases = []
    for idx, (C, K, kernel, padding, H, W, ws) in enumerate([(16, 128, (3, 3), 0, 13, 260, 1),
                                                            (16, 64, (3, 3), 0, 14, 259, 1),
                                                            (8, 128, (1, 1), 0, 15, 130, 1),
                                                            (16, 128, (3, 3), 1, 16, 131, 0)]):
        cases.append(Case(4200 + idx, 2, C, K, 1, kernel, (1, 1), padding, (1, 1), idx % 2 == 0, "float32", "tf32",
                          "contiguous", H, W, "wgmma", (("stage_out", 1), ("ws", ws))))
    return cases


def make_first_layer_cases(hopper: bool) -> list[Case]:
    """First layers (1-4 input channels) forced onto the families that serve them: igemm (NCHW;
    strict float32 and 16-bit pack their taps into the reduction), stem_nhwc (channels_last) and,
    on Hopper, wgmma at a column stride of 1 (channels padded to a k-step, TF32 or 3xTF32); every
    dtype, bias, a strided view, stride 2, unbatched. Also TF32 reductions under 128 from 8, 16 or
    24 channels (wgmma on rows of 256 or more)."""
    rows = [  # N, C, K, kernel, stride, padding, dtype, precision, layout, H, W
        (2, 3, 64, (3, 3), (1, 1), 1, "float32", "tf32", "contiguous", 24, 300),
        (2, 3, 64, (3, 3), (1, 1), 1, "float32", "ieee", "contiguous", 24, 300),
        (2, 3, 64, (5, 5), (1, 1), 2, "float32", "ieee", "strided_view", 20, 260),
        (1, 2, 128, (3, 3), (1, 1), 1, "float32", "tf32", "contiguous", 16, 256),
        (2, 4, 64, (3, 3), (1, 1), 0, "float32", None, "channels_last", 12, 270),
        (2, 3, 32, (3, 3), (2, 2), 1, "float32", "ieee", "contiguous", 40, 40),
        (2, 3, 64, (7, 7), (2, 2), 3, "float32", "ieee", "contiguous", 40, 40),
        (2, 3, 64, (7, 7), (2, 2), 3, "bfloat16", None, "contiguous", 40, 40),
        (2, 3, 16, (3, 3), (1, 1), 1, "float16", None, "strided_view", 30, 30),
        (0, 3, 64, (3, 3), (1, 1), 1, "float32", "tf32", "contiguous", 9, 258),
        # TF32 reductions under 128 from whole k-steps of channels
        (2, 8, 64, (3, 3), (1, 1), 1, "float32", "tf32", "contiguous", 20, 256),
        (1, 16, 64, (3, 1), (2, 1), (1, 0), "float32", "tf32", "strided_view", 33, 270),
        (2, 24, 128, (1, 3), (1, 1), (0, 1), "float32", "tf32", "contiguous", 11, 300)]
    cases = []
    for idx, (N, C, K, kernel, stride, padding, dtype, precision, layout, H, W) in enumerate(rows):
        families = ["stem_nhwc"] if layout == "channels_last" else ["igemm"]
        if hopper and stride[1] == 1 and layout != "channels_last":
            families.append("wgmma")
        for family in families:
            cases.append(Case((4650 if family == "wgmma" else 4600) + idx, N, C, K, 1, kernel, stride, padding,
                              (1, 1), idx % 2 == 0, dtype, precision, layout, H, W, family))
    return cases


def make_short_reduction_cases() -> list[Case]:
    """float32 reductions of 256-511 that do not fit one stage, on `wgmma`'s own tiles (Hopper): a
    producer warpgroup over several stages a tile (one-row tiles for 128 output channels whose
    input takes 4-byte copies, two-row ones otherwise), TF32 and 3xTF32, stride-2 rows, strided
    views and a weight slice, a one-stage 1x5; and float32 layers of 16-63 output channels. (Its
    calls are NCHW: channels_last ones are other families'.)"""
    cases = []
    for idx, (N, C, K, kernel, stride, padding, precision, layout, H, W) in enumerate([
            (2, 32, 128, (3, 3), (1, 1), 1, "tf32", "contiguous", 18, 260),
            (1, 32, 128, (3, 3), (2, 1), 1, "ieee", "strided_view", 21, 270),
            (2, 32, 64, (3, 3), (1, 1), 0, "tf32", "weight_slice", 16, 300),
            (2, 16, 64, (5, 5), (1, 1), 2, "tf32", "contiguous", 14, 300),
            (2, 8, 64, (7, 7), (1, 1), 3, "ieee", "contiguous", 12, 280),
            (2, 64, 64, (1, 5), (1, 1), (0, 2), "tf32", "contiguous", 10, 260),
            (2, 48, 96, (3, 3), (1, 1), 1, "ieee", "contiguous", 9, 257),
            (2, 40, 128, (3, 3), (1, 1), 0, "tf32", "contiguous", 12, 264),
            # 16-63 output channels (wgmma's 64 rows partly idle), from reductions of 256 or more
            (2, 32, 32, (3, 3), (1, 1), 1, "tf32", "contiguous", 10, 260),
            (2, 64, 16, (3, 3), (1, 1), 1, "ieee", "strided_view", 9, 258),
            (1, 8, 16, (7, 7), (1, 1), 3, "tf32", "strided_view", 12, 256),
            (2, 48, 24, (3, 3), (2, 1), 1, "ieee", "contiguous", 15, 270),
            (2, 16, 32, (3, 3), (1, 1), 1, "ieee", "contiguous", 11, 262),
            # TF32 from 216: 24 channels 3x3 (one-row tiles), 16 channels 5x3 (two-row: one k-step a stage)
            (2, 24, 128, (3, 3), (1, 1), 1, "tf32", "contiguous", 10, 258),
            (2, 16, 128, (5, 3), (1, 1), (2, 1), "tf32", "strided_view", 9, 266)]):
        cases.append(Case(4700 + idx, N, C, K, 1, kernel, stride, padding, (1, 1), idx % 2 == 0, "float32", precision,
                          layout, H, W, "wgmma"))
    return cases


def make_packed_cases() -> list[Case]:
    """igemm with (channel word, tap) packed reductions (`pack_k`): stems and other layers of
    fewer channel words than a k-step, on igemm's own tiles and forced ones: 1-6 channels
    (odd counts leave a bf16 word half empty), 7x7 stride 2, 11x11 stride 4, dilation, groups of
    3 channels, 1x7 and 5x1, cp.async input, staged output, bias, strided views, every dtype."""
    cases = []
    pk = (("pack_k", 1),)
    for idx, (N, C, K, g, kernel, stride, padding, dil, dtype, precision, layout, H, W, fam, tiles) in enumerate([
            (2, 3, 64, 1, (7, 7), (2, 2), 3, (1, 1), "float32", "tf32", "contiguous", 30, 46, None, ()),
            (2, 3, 64, 1, (7, 7), (2, 2), 3, (1, 1), "bfloat16", None, "contiguous", 29, 37, None, ()),
            (1, 3, 64, 1, (7, 7), (2, 2), 3, (1, 1), "float32", "ieee", "strided_view", 26, 33, "igemm", pk),
            (2, 3, 32, 1, (3, 3), (2, 2), 1, (1, 1), "float16", None, "strided_view", 33, 35, None, ()),
            (2, 3, 32, 1, (3, 3), (2, 2), 1, (1, 1), "float32", "ieee", "contiguous", 31, 40, None, ()),
            (2, 3, 64, 1, (3, 3), (1, 1), 1, (1, 1), "bfloat16", None, "contiguous", 20, 70, None, ()),
            (2, 1, 24, 1, (5, 5), (1, 1), 2, (1, 1), "float32", "tf32", "contiguous", 18, 66, "igemm", pk),
            (2, 2, 48, 1, (3, 3), (1, 1), (2, 1), (2, 1), "float32", "tf32", "contiguous", 17, 50, "igemm", pk),
            (2, 5, 40, 1, (1, 7), (1, 1), (0, 3), (1, 1), "bfloat16", None, "contiguous", 12, 75, "igemm", pk),
            (2, 6, 64, 2, (3, 3), (1, 2), 1, (1, 1), "float32", "tf32", "contiguous", 19, 44, "igemm", pk),
            (0, 3, 64, 1, (11, 11), (4, 4), 2, (1, 1), "float32", "tf32", "contiguous", 67, 67, "igemm", pk),
            (2, 4, 64, 1, (5, 1), (1, 1), (2, 0), (1, 1), "float32", "ieee", "contiguous", 23, 41, "igemm", pk),
            (2, 3, 128, 1, (3, 3), (1, 1), 1, (1, 1), "float32", "tf32", "contiguous", 16, 140, "igemm",
             pk + (("async_x", 1), ("block_m", 128))),
            (2, 3, 64, 1, (7, 7), (2, 2), 3, (1, 1), "float32", "tf32", "contiguous", 40, 40, "igemm",
             pk + (("stage_out", 1),)),
            (2, 3, 64, 1, (7, 7), (2, 2), 3, (1, 1), "bfloat16", None, "contiguous", 35, 41, "igemm",
             pk + (("min_blocks", 2), ("tile_p", 4), ("tile_q", 32)))]):
        cases.append(Case(4800 + idx, N, C, K, g, kernel, stride, padding, dil, idx % 2 == 1, dtype, precision,
                          layout, H, W, fam or "igemm", tiles))
    return cases


def make_strip_cases(n: int, seed: int = 3579) -> list[Case]:
    """`wgmma` TF32 calls forced onto strips (tile strip=1: blocks walk down 128-column strips and
    the ring holds input rows): a block's run of tiles crosses strips and images (few tiles a
    block) or stays in one strip for long (many), rows that skip (stride 2, 3), dilated and tall
    kernels, rings of just a halo's rows, partial channel chunks, groups, and inputs the producer
    loads in 16-byte groups or by cp.async (strided views, widths off 4)."""
    rng = random.Random(seed)
    cases = []
    for idx in range(n):
        groups = rng.choice([1, 1, 2])
        kernel = rng.choice([(3, 3), (3, 3), (5, 5), (3, 1), (1, 3), (2, 4)])
        C = groups * rng.choice([4, 8] if kernel == (5, 5) else [4, 8, 12, 16, 16])
        K = groups * rng.choice([64, 80, 128])
        stride = rng.choice([(1, 1), (1, 1), (2, 1), (3, 1)])
        dilation = rng.choice([(1, 1), (1, 1), (2, 1)])
        padding = rng.choice([0, 0, 1, (2, 4), (1, 0)])
        eh = dilation[0] * (kernel[0] - 1) + 1
        nbuf = rng.choice([max(eh + 1, 3), max(eh + 2, 3), max(eh + 1, 6)])  # a halo's rows and one more, up
        layout = rng.choice(["contiguous", "contiguous", "strided_view"])
        N = rng.choice([0, 1, 2, 3])
        H = max(rng.choice([rng.randint(2, 12), rng.randint(40, 300)]), eh)
        W = max(rng.choice([rng.randint(3, 300), 128, 132, 256, 260, 384]), kernel[1])
        cases.append(Case(4900 + idx, N, C, K, groups, kernel, stride, padding, dilation, rng.random() < 0.5,
                          "float32", "tf32", layout, H, W, "wgmma",
                          (("strip", 1), ("ws", 1), ("nbuf", nbuf), ("stage_out", rng.choice([0, 1, 1])))))
    # The shallowest ring a strip may take, a halo's rows and one more, where rows come by cp.async
    # (padding 1: the producer hands a row over once the next one's copies are in a free slot) and
    # bands of several rows cross images: with no slot more, this waited forever.
    for idx, (C, K, kernel, dilation) in enumerate([(16, 64, (3, 3), (1, 1)), (8, 128, (3, 1), (2, 1))]):
        eh = dilation[0] * (kernel[0] - 1) + 1
        cases.append(Case(4900 + n + idx, 3, C, K, 1, kernel, (1, 1), 1, dilation, idx == 0, "float32", "tf32",
                          "contiguous", 40, 300, "wgmma", (("strip", 1), ("ws", 1), ("nbuf", eh + 1))))
    return cases


def hopper_spec(case: Case) -> ConvSpec | None:
    """The spec the case gets on a nominal H100 (its forced family and tiles, or the selector's),
    or None where the forced ones do not serve it (registers, shared memory)."""
    params = dict(in_channels=case.C, out_channels=case.K, kernel_size=case.kernel, stride=case.stride,
                  padding=case.padding, dilation=case.dilation, groups=case.groups, dtype=case.dtype, bias=case.bias)
    P, Q = ConvSpec(**params).output_size(case.H, case.W)
    problem = Problem(N=max(case.N, 1), H=case.H, W=case.W, P=P, Q=Q, device=nominal("sm_90a"))
    math = case.precision if case.dtype == "float32" else "ieee"
    try:
        return select.choose(params, "cuda", problem, False, math, family=case.family, tiles=dict(case.tiles))
    except (Unsupported, kernelgen.ConvArgumentError):  # (a forced family's refusal)
        return None


def fits_hopper(case: Case) -> bool:
    """Whether the case's forced family and tiles serve it on sm_90a."""
    return hopper_spec(case) is not None


def make_acc2_cases() -> list[Case]:
    """`wgmma` with two accumulator sets (tile acc2=1: a consumer issues its next tile's MMAs
    before it stores this one): the producer's one-stage tiles in every dtype and output path
    (random shapes, and the 16-bit whole-line outputs of make_ws_cases), and strips, whose ring
    then holds two tiles' input rows (random strips, their rings deepened to that). Shapes whose
    producer needs the registers the second set takes are left out."""
    acc2 = (("acc2", 1),)
    cases = make_one_stage_cases(24, 2468, 5000, lambda rng: (("stage_out", rng.choice([0, 1, 1])), ("ws", 1)) + acc2)
    cases += [replace(c, idx=5024 + i, tiles=c.tiles + acc2)
              for i, c in enumerate(c for c in make_ws_cases(0) if 4108 <= c.idx < 4114)]
    for i, c in enumerate(make_strip_cases(20, seed=8531)):
        eh = c.dilation[0] * (c.kernel[0] - 1) + 1
        tiles = tuple((k, max(v, 2 * eh + 1) if k == "nbuf" else v) for k, v in c.tiles) + acc2
        cases.append(replace(c, idx=5030 + i, tiles=tiles))
    cases = [c for c in cases if fits_hopper(c)]  # (also drops rings past the 16 slots nbuf allows)
    assert len(cases) >= 36, "acc2 sweep: too few shapes fit"
    # Strict float32 on wgmma's own tiles where two sets are its default (128 output channels over
    # 64-column tiles, weights in registers, several taps): bias, a strided view, an unbatched
    # input, a second m-block, rows that end mid-tile.
    default = []
    for idx, (N, C, K, kernel, padding, layout, H, W) in enumerate([
            (2, 16, 128, (3, 3), 1, "contiguous", 11, 130),
            (1, 12, 256, (3, 3), 0, "strided_view", 9, 203),
            (0, 24, 96, (3, 1), 0, "contiguous", 10, 150),
            (2, 48, 128, (1, 3), (0, 1), "contiguous", 8, 141),
            (3, 16, 192, (3, 3), 1, "strided_view", 11, 97)]):  # planes over 32 x 32 (else nhwc's)
        default.append(Case(5060 + idx, N, C, K, 1, kernel, (1, 1), padding, (1, 1), idx % 2 == 0, "float32", "ieee",
                            layout, H, W, "wgmma"))
    for c in default:
        spec = hopper_spec(c)
        assert dict(spec.tiles)["acc2"] == 1, (c, spec)
    return cases + default


def make_wide_tile_cases() -> list[Case]:
    """`wgmma` with 256-column tiles (the long reductions' first choice): both epilogues, float32
    and bf16, a row that spills two columns into a second tile."""
    cases = []
    for idx, (dtype, stage_out, padding) in enumerate([("float32", 0, 0), ("float32", 1, 1), ("bfloat16", 0, 1),
                                                       ("bfloat16", 1, 0)]):
        cases.append(Case(4300 + idx, 2, 32, 128, 1, (3, 3), (1, 1), padding, (1, 1), idx % 2 == 1, dtype,
                          "tf32" if dtype == "float32" else None, "contiguous", 17 + idx, 260, "wgmma",
                          (("tile_p", 1), ("tile_q", 256), ("stage_out", stage_out))))
    return cases


def tuner_tiles(rng: random.Random, fam, probe, values: Mapping | None = None) -> tuple:
    """A random tile choice the family accepts (up to 20 draws), as sorted (name, value) pairs, or
    () if none fits; probe(pick) is the case's spec with those tiles; `values` narrows the
    choices (default: the family's)."""
    for _ in range(20):
        pick = {name: rng.choice(vals) for name, vals in (values or fam.tiles).items()}
        try:
            fam.check(probe(pick))
        except Unsupported:
            continue
        return tuple(sorted(pick.items()))
    return ()


def make_nhwc_cases(n: int, seed: int = 6420) -> list[Case]:
    """channels_last calls forced onto the `nhwc` family: every dtype and precision it serves,
    groups, bias, strides, dilation, padding ('same' included), ragged tiles of pixels and
    channels, forced tiles, and inputs whose data starts off a 16-byte boundary (`cl_offset`:
    the kernel's element-wise input path)."""
    rng = random.Random(seed)
    fam = get_family("nhwc")
    cases = []
    for idx in range(n):
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16"])
        vec = 4 if dtype == "float32" else 8
        groups = rng.choice([1, 1, 1, 2, 4])
        C = groups * vec * rng.choice([1, 2, 3, 4, 8, 16])
        K = groups * rng.choice([2, 8, 16, 30, 64, 96, 128, 192])
        kernel = rng.choice([(1, 1), (1, 1), (3, 3), (3, 3), (5, 5), (3, 1), (1, 7), (2, 2), (7, 7)])
        stride, dilation, padding = _cl_window(rng)
        precision = rng.choice(["tf32", "ieee", None]) if dtype == "float32" else None
        eh, ew = _extent(kernel, dilation)
        H, W = max(rng.randint(3, 40), eh), max(rng.randint(3, 40), ew)
        tiles = ()
        if idx % 3 == 2:  # a tile choice of the tuner's, where it fits
            tiles = tuner_tiles(rng, fam, lambda pick: ConvSpec(
                C, K, kernel, stride, 0, dilation, groups, dtype, "cuda", False, "nhwc",
                "tf32" if precision == "tf32" else "ieee", "nhwc", tuple(pick.items())))
        cases.append(Case(6000 + idx, rng.choice([1, 2, 3, 5]), C, K, groups, kernel, stride, padding, dilation,
                          rng.random() < 0.5, dtype, precision, rng.choice(["channels_last"] * 3 + ["cl_offset"]),
                          H, W, "nhwc", tiles))
    return cases


def make_nhwc_tma_cases(n: int, seed: int = 6480, first: int = 6150, values: Mapping | None = None,
                        every: int = 2) -> list[Case]:
    """Dense channels_last calls forced onto `nhwc_tma` (Hopper): TF32 and 16-bit, channel counts
    under, at and past one k-tile's 128 bytes, output channels past a block's, kernels 1x1 to 7x7
    with strides, dilations and paddings ('same' included, whose even kernels pad unevenly),
    several images in one pixel tile, tuner tiles, and inputs the TMA cannot address as they lie
    (`cl_offset`, copied into the workspace) or weights read through their strides. `values`
    narrows the tuner's tile choices (default: every tile but a_regs), drawn for one case in `every`."""
    rng = random.Random(seed)
    fam = get_family("nhwc_tma")
    values = {**{k: v for k, v in fam.tiles.items() if k != "a_regs"}, **(values or {})}
    cases = []
    for idx in range(n):
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16"])
        vec = 4 if dtype == "float32" else 8
        C = vec * rng.choice([1, 2, 3, 4, 5, 8, 16, 24])
        K = vec * rng.choice([1, 3, 8, 12, 16, 24, 32, 40])
        kernel = rng.choice([(1, 1), (3, 3), (3, 3), (5, 5), (3, 1), (1, 7), (2, 2), (7, 7)])
        stride, dilation, padding = _cl_window(rng)
        precision = rng.choice(["tf32", "tf32", None]) if dtype == "float32" else None
        eh, ew = _extent(kernel, dilation)
        H, W = max(rng.randint(3, 48), eh), max(rng.randint(3, 48), ew)
        tiles = ()
        if idx % every == every - 1:  # (a_regs tiles have cases of their own, make_nhwc_tma_areg_cases)
            tiles = tuner_tiles(rng, fam, lambda pick: ConvSpec(
                C, K, kernel, stride, 0, dilation, 1, dtype, "cuda", False, "nhwc",
                "tf32" if dtype == "float32" else "ieee", "nhwc_tma", tuple(pick.items())), values=values)
        layout = rng.choice(["channels_last"] * 4 + ["cl_offset", "cl_weight_slice", "weight_channels_last"])
        if layout == "weight_channels_last" and kernel == (1, 1):  # a 1x1 weight is both: the call stays NCHW
            layout = "channels_last"
        cases.append(Case(first + idx, rng.choice([1, 2, 3, 5]), C, K, 1, kernel, stride, padding, dilation,
                          rng.random() < 0.5, dtype, precision, layout, H, W, "nhwc_tma", tiles))
    return cases


def make_nhwc_tma_nchw_cases(n: int, seed: int = 6491) -> list[Case]:
    """NCHW calls forced onto `nhwc_tma` (its input transposed into the workspace, its output
    written straight to NCHW, pairs or single pixels by the plane's parity): make_nhwc_tma_cases'
    shapes from another seed, on contiguous inputs and strided views."""
    rng = random.Random(seed)
    # (round_smem rounds channels_last inputs only: the transpose rounds an NCHW one)
    return [replace(c, idx=6700 + i, layout=rng.choice(["contiguous", "strided_view", "weight_slice"]),
                    tiles=tuple((k, 0 if k == "round_smem" else v) for k, v in c.tiles))
            for i, c in enumerate(make_nhwc_tma_cases(n, seed))]


def make_nhwc_tma_areg_cases() -> list[Case]:
    """`nhwc_tma`'s a_regs tiles (pixels as wgmma's M, their fragments loaded and TF32-rounded in
    registers, the output written from the accumulators): make_nhwc_tma_cases' shapes from another
    seed with tuner tiles drawn among a_regs ones (every dtype, kernel, window, ragged output
    channels, inputs copied first), and hand-picked rows for what the draws may miss: one and
    several k-tiles (odd and even counts), 64 and 128 pixels a block, wgmma N 64-256, tiles that walk
    (persistent, resident weights, two pipelines), halo windows, a last tile of a few pixels, one
    image."""
    drawn = make_nhwc_tma_cases(24, seed=6961, first=6960, every=1, values={
        "a_regs": (1,), "round_smem": (0,), "wgn": (1,), "block_p": (64, 128, 256)})
    # (a draw that found no fitting tiles takes the family's a_regs defaults)
    drawn = [c if c.tiles else replace(c, tiles=(("a_regs", 1),)) for c in drawn]
    areg = {"a_regs": 1}
    walk = {"a_regs": 1, "persist": 1}
    rows = [  # N, C, K, kernel, stride, padding, dilation, bias, dtype, precision, layout, H, W, tiles
        (3, 32, 64, (1, 1), (1, 1), 0, (1, 1), True, "float32", "tf32", "channels_last", 21, 23, areg),
        (2, 96, 40, (1, 1), (1, 1), 0, (1, 1), False, "float32", "tf32", "channels_last", 17, 30,
         {**walk, "block_p": 64, "stages": 2}),
        (4, 256, 128, (1, 1), (2, 2), 0, (1, 1), True, "float32", "tf32", "channels_last", 30, 29, walk),
        (2, 64, 256, (3, 3), (1, 1), 1, (1, 1), True, "float32", "tf32", "channels_last", 20, 20,
         {**areg, "block_co": 256, "block_p": 64, "min_blocks": 1}),
        (1, 48, 64, (3, 3), (1, 1), 1, (1, 1), True, "bfloat16", None, "channels_last", 15, 19, areg),
        (8, 64, 64, (3, 3), (1, 1), 1, (1, 1), True, "float32", "tf32", "channels_last", 64, 64,
         {**walk, "wres": 1, "stages": 2, "min_blocks": 1}),
        (8, 64, 64, (3, 3), (1, 1), 1, (1, 1), False, "bfloat16", None, "channels_last", 64, 66,
         {**walk, "wres": 1, "pipes": 2, "block_p": 64, "stages": 3, "min_blocks": 1}),
        (4, 64, 64, (3, 3), (1, 1), 1, (1, 1), True, "float32", "tf32", "channels_last", 40, 130,
         {**walk, "halo": 1, "stages": 2, "min_blocks": 1}),
        (2, 32, 64, (3, 3), (1, 1), 2, (2, 2), False, "float16", None, "cl_weight_slice", 30, 140,
         {**areg, "halo": 1, "stages": 2, "min_blocks": 1, "block_p": 64}),
        (5, 128, 160, (3, 3), (2, 2), 1, (1, 1), True, "float32", "tf32", "cl_offset", 27, 25,
         {**walk, "block_co": 64, "min_blocks": 1, "stages": 3}),
    ]
    return drawn + [Case(6984 + i, n, c, k, 1, ker, st, pad, dil, b, dt, prec, lay, h, w, "nhwc_tma",
                         tuple(sorted(t.items())))
                    for i, (n, c, k, ker, st, pad, dil, b, dt, prec, lay, h, w, t) in enumerate(rows)]


def make_nhwc_tma_walk_cases() -> list[Case]:
    """`nhwc_tma`'s persistent blocks over enough pixels that every block walks several tiles, so
    slots and phases carry from one tile to the next: the staging of their own, resident weights
    (one deep pipeline, two over one copy, wide tiles), output channels under a block's, strides,
    dilation, both precisions, NCHW calls."""
    walk = {"persist": 1}
    two = {"persist": 1, "wres": 1, "pipes": 2, "stages": 3, "min_blocks": 1}
    deep = {"persist": 1, "wres": 1, "stages": 8, "min_blocks": 1}
    wide = {"persist": 1, "wres": 1, "block_p": 256, "wgn": 2, "stages": 3, "min_blocks": 1}
    rows = [  # N, C, K, kernel, stride, padding, dilation, bias, dtype, precision, layout, H, W, tiles
        (8, 64, 64, (3, 3), (1, 1), 1, (1, 1), True, "bfloat16", None, "channels_last", 128, 128, walk),
        (8, 64, 64, (3, 3), (1, 1), 1, (1, 1), False, "bfloat16", None, "channels_last", 128, 128, two),
        (8, 48, 64, (3, 3), (1, 1), 1, (1, 1), True, "float16", None, "channels_last", 120, 136, deep),
        (8, 64, 32, (3, 3), (2, 2), 1, (1, 1), True, "bfloat16", None, "channels_last", 160, 158, two),
        (2, 64, 64, (3, 3), (1, 1), 2, (2, 2), False, "bfloat16", None, "channels_last", 200, 190, two),
        (8, 64, 64, (3, 3), (1, 1), 1, (1, 1), True, "bfloat16", None, "channels_last", 128, 130, wide),
        (4, 64, 64, (3, 3), (1, 1), 1, (1, 1), True, "bfloat16", None, "contiguous", 128, 128, two),
        (4, 64, 128, (3, 3), (1, 1), 1, (1, 1), False, "float16", None, "contiguous", 128, 124, walk),
        (8, 64, 64, (3, 3), (1, 1), 1, (1, 1), True, "float32", "tf32", "channels_last", 128, 128,
         {"persist": 1, "round_smem": 4}),
        (8, 32, 64, (3, 3), (1, 1), 1, (1, 1), False, "float32", "tf32", "channels_last", 112, 112,
         {**deep, "stages": 4, "round_smem": 0}),
    ]
    return [Case(6800 + i, n, c, k, 1, ker, st, pad, dil, b, dt, prec, lay, h, w, "nhwc_tma", tuple(sorted(t.items())))
            for i, (n, c, k, ker, st, pad, dil, b, dt, prec, lay, h, w, t) in enumerate(rows)]


def make_nhwc_tma_halo_cases() -> list[Case]:
    """`nhwc_tma`'s halo tiles (every tap read from one window of the input a channel block):
    rows that end in a partial tile, windows past every edge of the input (padding, dilation,
    'same' on an even kernel), fewer input channels than a window's 128 bytes, several blocks of
    output channels, resident weights, rounding warps and the rounded copy, NCHW rows of odd
    length, one tile a block and blocks that walk tiles."""
    walk = {"halo": 1, "persist": 1, "stages": 2, "min_blocks": 1}
    one = {"halo": 1, "stages": 2, "min_blocks": 1}
    rows = [  # N, C, K, kernel, stride, padding, dilation, bias, dtype, precision, layout, H, W, tiles
        (4, 64, 64, (3, 3), (1, 1), 1, (1, 1), True, "float32", "tf32", "channels_last", 64, 130,
         {**one, "round_smem": 4}),
        (4, 64, 64, (3, 3), (1, 1), 1, (1, 1), False, "float32", "tf32", "channels_last", 112, 112,
         {**walk, "round_smem": 4, "block_p": 64}),
        (3, 64, 64, (3, 3), (1, 1), 1, (1, 1), True, "float32", "tf32", "contiguous", 60, 57, walk),
        (4, 64, 64, (3, 3), (1, 1), 1, (1, 1), True, "bfloat16", None, "channels_last", 96, 100, {**walk, "wres": 1}),
        (4, 32, 64, (3, 3), (1, 1), 2, (2, 2), False, "bfloat16", None, "channels_last", 90, 140, walk),
        (2, 64, 128, (5, 7), (1, 1), (2, 3), (1, 1), True, "float16", None, "channels_last", 40, 150,
         {**one, "block_p": 64}),
        (4, 64, 256, (3, 3), (1, 1), 0, (1, 1), True, "bfloat16", None, "channels_last", 70, 66, walk),
        (4, 48, 64, (3, 3), (1, 1), 1, (1, 1), False, "bfloat16", None, "contiguous", 60, 60,
         {**walk, "block_p": 64}),
        (2, 16, 64, (3, 3), (1, 1), 1, (1, 1), True, "float32", "tf32", "channels_last", 64, 200,
         {**walk, "round_smem": 0}),
        (3, 64, 64, (2, 4), (1, 1), "same", (1, 1), True, "bfloat16", None, "channels_last", 50, 131, walk),
    ]
    return [Case(6850 + i, n, c, k, 1, ker, st, pad, dil, b, dt, prec, lay, h, w, "nhwc_tma", tuple(sorted(t.items())))
            for i, (n, c, k, ker, st, pad, dil, b, dt, prec, lay, h, w, t) in enumerate(rows)]


def make_nhwc_tma_split_cases() -> list[Case]:
    """`nhwc_tma`'s split reductions (each split's float32 partial sums to the workspace, summed
    with the bias into the output by a second kernel): 2 to 8 splits, both GEMM orientations (TF32
    channels_last on a_regs tiles, the others with the output channels as wgmma's M), a last pixel
    tile of a few pixels and output channels past the last whole block, NCHW calls (odd and even
    planes, a strided view), inputs copied first (TF32's rounded copy, an offset start), weights
    read as they lie (16-bit channels_last: cl_both) and through their strides, unbatched input,
    deep splits (up to 32 ways) and an epilogue scale."""
    rows = [  # N, C, K, kernel, stride, padding, dilation, bias, dtype, precision, layout, H, W, splits (+ tiles)
        (3, 64, 136, (3, 3), (1, 1), 1, (1, 1), True, "bfloat16", None, "cl_both", 7, 9, {"splits": 3}),
        (5, 128, 64, (3, 3), (1, 1), 1, (1, 1), False, "float16", None, "channels_last", 7, 7, {"splits": 6}),
        (2, 1024, 96, (1, 1), (1, 1), 0, (1, 1), True, "bfloat16", None, "cl_both", 7, 7, {"splits": 8}),
        (4, 64, 200, (3, 3), (2, 2), 1, (1, 1), True, "bfloat16", None, "cl_offset", 15, 13,
         {"splits": 3, "block_co": 64}),
        (3, 64, 136, (3, 3), (1, 1), 1, (1, 1), True, "float32", "tf32", "channels_last", 7, 9, {"splits": 2}),
        (2, 128, 256, (3, 3), (1, 1), 1, (1, 1), False, "float32", "tf32", "cl_both", 9, 7,
         {"splits": 4, "block_p": 64}),
        (3, 96, 72, (3, 3), (1, 1), 2, (2, 2), True, "float32", "tf32", "cl_weight_slice", 11, 10,
         {"splits": 3, "a_regs": 0}),
        (0, 256, 128, (1, 1), (1, 1), 0, (1, 1), True, "float32", "tf32", "contiguous", 7, 7, {"splits": 2}),
        (3, 64, 136, (3, 3), (1, 1), 1, (1, 1), True, "bfloat16", None, "contiguous", 7, 9, {"splits": 3}),
        (2, 64, 72, (3, 3), (1, 1), 1, (1, 1), False, "float32", "tf32", "contiguous", 8, 8, {"splits": 2}),
        (2, 128, 64, (3, 3), (1, 1), 1, (1, 1), True, "float32", "tf32", "strided_view", 7, 7, {"splits": 4}),
        (2, 128, 128, (5, 5), (1, 1), 2, (1, 1), True, "float16", None, "weight_slice", 9, 11, {"splits": 2}),
        # deep splits (a weight gradient's shape: a few outputs, each a long sum): the selector's
        # 12 ways, and 32 forced on TF32 channels_last's a_regs tiles
        (8, 32, 32, (18, 18), (1, 1), 0, (1, 1), False, "float32", "tf32", "contiguous", 20, 20, {}),
        (8, 32, 40, (18, 18), (1, 1), 0, (1, 1), True, "bfloat16", None, "channels_last", 20, 20, {}),
        (4, 64, 64, (16, 16), (1, 1), 1, (1, 1), False, "float32", "tf32", "channels_last", 18, 18, {"splits": 32}),
    ]
    plain = [Case(7050 + i, n, c, k, 1, ker, st, pad, dil, b, dt, prec, lay, h, w, "nhwc_tma", tuple(sorted(t.items())))
             for i, (n, c, k, ker, st, pad, dil, b, dt, prec, lay, h, w, t) in enumerate(rows)]
    # a folded BatchNorm's scale, which the final pass applies to the splits' sum: 16-bit and TF32
    # channels_last, NCHW, a strided view
    scaled = [replace(plain[j], idx=7080 + j, scale=True, activation=act)
              for j, act in ((0, "relu"), (4, None), (8, "silu"), (10, None))]
    return plain + scaled


def make_pointwise_tma_cases() -> list[Case]:
    """`pointwise_tma` (1x1 NCHW on the TMA and wgmma): planes that end in a partial tile, input
    channels short of a k-tile and odd k-tile counts, output channels past the last whole block,
    resident and ring-borne weights, shallow rings that wrap many times, every wgmma N, one and
    two blocks an SM, unbatched input, a strided view (made dense first), inputs whose data
    starts one element past a 16-byte boundary (`offset`, copied first) and planes narrower than
    one of the TMA's boxes."""
    rows = [  # N, C, K, bias, dtype, precision, layout, H, W, tiles
        (2, 64, 128, True, "float32", "tf32", "contiguous", 40, 52, {}),
        (3, 24, 144, True, "float32", "tf32", "contiguous", 28, 28, {}),
        (2, 512, 128, False, "bfloat16", None, "contiguous", 14, 16, {}),
        (3, 96, 64, True, "float16", None, "contiguous", 20, 20, {"block_p": 64, "min_blocks": 2, "stages": 4}),
        (2, 256, 256, True, "bfloat16", None, "contiguous", 16, 24, {"block_co": 256, "block_p": 64}),
        (2, 64, 64, True, "float32", "tf32", "offset", 33, 16, {}),
        (2, 48, 80, False, "bfloat16", None, "offset", 24, 24, {}),
        (1, 32, 64, True, "float32", "tf32", "strided_view", 8, 40, {}),
        (2, 96, 128, True, "float32", "tf32", "contiguous", 20, 20, {"wres": 0, "stages": 2}),
        (0, 16, 64, True, "float32", "tf32", "contiguous", 12, 12, {}),
        (3, 32, 64, False, "bfloat16", None, "contiguous", 30, 32, {"stages": 2}),
        (2, 128, 512, True, "float16", None, "contiguous", 64, 64, {"block_co": 64, "block_p": 192, "stages": 3}),
        (2, 64, 128, False, "float32", "tf32", "offset", 10, 10, {"block_co": 64, "block_p": 64, "min_blocks": 2,
                                                                 "stages": 3}),
        # planes narrower than one box (2 x 2 float32, 2 x 4 and 1 x 8 16-bit), as the dispatcher sends them
        (4, 128, 64, True, "float32", "tf32", "contiguous", 2, 2, {}),
        (3, 96, 80, False, "bfloat16", None, "contiguous", 2, 4, {}),
        (1, 256, 64, True, "float16", None, "contiguous", 1, 8, {}),
    ]
    return [Case(6870 + i, n, c, k, 1, (1, 1), (1, 1), 0, (1, 1), b, dt, prec, lay, h, w, "pointwise_tma",
                 tuple(sorted(t.items()))) for i, (n, c, k, b, dt, prec, lay, h, w, t) in enumerate(rows)] + \
        make_pointwise_tma_split_cases()


def make_pointwise_tma_split_cases() -> list[Case]:
    """`pointwise_tma`'s split reductions (float32 partial sums in the workspace, a final pass that
    adds them in split order and applies the epilogue): the default splits of ResNet-50's and
    RegNetY's batch-1 layers on 14 x 14 planes, forced splits of even, odd and one k-tile, a last
    split shorter than the others (ragged), input channels short of the last k-tile, output channels
    past the last whole block, a plane's partial last pixel tile, batch 1, 2 and unbatched, offset
    and strided views, blocks that walk several tiles of their split, a two-slot ring that wraps;
    then each epilogue term (scale, bias, residual in each form, activations) on split calls, in
    TF32, bf16 and fp16. (7 x 7 planes are not whole 16-byte chunks: the family never serves them.)"""
    rows = [  # N, C, K, bias, dtype, precision, layout, H, W, tiles
        (1, 1024, 512, False, "float32", "tf32", "contiguous", 14, 14, {}),  # 8 splits of 4 k-tiles
        (1, 336, 336, True, "float32", "tf32", "contiguous", 14, 14, {}),  # 11 k-tiles: 6 + 5
        (2, 288, 200, True, "float32", "tf32", "contiguous", 14, 14, {"splits": 3}),  # 9: 3 + 3 + 3
        (1, 300, 256, False, "float32", "tf32", "offset", 14, 14, {"splits": 5}),  # 10 (the last part): 2 each
        (1, 1024, 256, True, "bfloat16", None, "contiguous", 16, 16, {"splits": 8}),  # 16 k-tiles
        (2, 720, 160, False, "float16", None, "contiguous", 12, 12, {"splits": 4}),  # 12 (the last part): 3 each
        (1, 512, 1024, True, "bfloat16", None, "contiguous", 14, 16, {"splits": 3, "block_co": 64}),  # 3 + 3 + 2
        (0, 256, 64, True, "float32", "tf32", "contiguous", 14, 14, {"splits": 2}),  # unbatched; weights not resident
        (1, 768, 1536, False, "float32", "tf32", "contiguous", 14, 14, {}),  # 24 k-tiles: 5 + 5 + 5 + 5 + 4
        (2, 512, 128, True, "float32", "tf32", "strided_view", 14, 14, {"splits": 16}),  # one k-tile a split
        (2, 256, 512, True, "float32", "tf32", "contiguous", 64, 64, {"splits": 4}),  # 256 tiles: blocks walk
        (1, 1024, 256, False, "float32", "tf32", "contiguous", 14, 14, {"splits": 2, "stages": 2}),  # ring wraps
        (2, 640, 96, True, "float16", None, "offset", 14, 16, {"splits": 4}),  # 10 k-tiles: 3 + 3 + 3 + 1
    ]
    plain = [Case(6940 + i, n, c, k, 1, (1, 1), (1, 1), 0, (1, 1), b, dt, prec, lay, h, w, "pointwise_tma",
                  tuple(sorted(t.items()))) for i, (n, c, k, b, dt, prec, lay, h, w, t) in enumerate(rows)]
    # the epilogue in the final pass: the scale times the splits' sum, then the bias, the residual
    # (the output's strides, the other memory format's, a strided view), the activation
    fused = [replace(plain[j], idx=6960 + j, scale=scale, activation=act, residual=res)
             for j, scale, act, res in ((0, True, "hardswish", None), (1, True, "relu", "out"),
                                        (2, False, "leaky_relu", "view"), (4, True, "silu", None),
                                        (5, False, "gelu", "other"), (6, True, "sigmoid", "out"),
                                        (7, True, "relu6", None), (8, False, "hardsigmoid", "out"),
                                        (12, True, None, "out"))]
    return plain + fused


def make_wgrad_cases() -> list[Case]:
    """`wgrad` (a reduction split between blocks, partial sums added in a fixed order): the lowered
    weight gradients weight_grad makes (the GEMM tile's and the depthwise mode's), from NCHW and channels_last x and dY (make_tensors'
    'lowered', 'lowered_cl': batch and channels swapped, transposed views), strict float32, TF32,
    bf16, fp16 and float64, one group, two and depthwise (one input and output channel a group),
    the forward's stride as the dilation and its dilation as the stride, padding, a bias, rows
    and columns past the last whole tile, odd sizes, splits forced past the k-steps' count (empty
    splits) and the default splits of a long reduction; then ordinary calls (any view, an
    epilogue-free forward) forced onto it."""
    rows = [  # Cg, G*Nb, O, G, (P, Q), stride, padding, dilation, bias, dtype, precision, layout, H, W, tiles
        (3, 4, 16, 1, (18, 18), (1, 1), 1, (1, 1), True, "float32", "ieee", "lowered", 18, 18, {"splits": 4}),
        (3, 4, 16, 1, (18, 18), (1, 1), 1, (1, 1), False, "float32", "tf32", "lowered_cl", 18, 18, {}),
        (5, 6, 24, 2, (9, 11), (2, 1), 0, (2, 2), True, "bfloat16", None, "lowered", 20, 22, {"splits": 3}),
        (5, 6, 24, 2, (9, 11), (2, 1), 0, (2, 2), False, "float16", None, "lowered_cl", 20, 22, {"splits": 6}),
        (1, 16, 8, 8, (15, 13), (1, 1), 1, (1, 1), True, "float32", "tf32", "lowered", 15, 13, {"splits": 2}),
        (1, 16, 8, 8, (15, 13), (1, 1), 1, (1, 1), False, "bfloat16", None, "lowered_cl", 15, 13, {}),
        (7, 3, 33, 1, (17, 23), (1, 2), (2, 1), (1, 1), True, "float64", None, "lowered", 20, 46, {"splits": 6}),
        (7, 3, 33, 1, (17, 23), (1, 2), (2, 1), (1, 1), False, "float64", None, "lowered_cl", 20, 46, {}),
        (70, 2, 130, 1, (7, 7), (1, 1), 1, (1, 1), True, "float32", "tf32", "lowered", 7, 7,
         {"block_m": 128, "block_n": 64, "splits": 2}),
        (70, 2, 130, 1, (7, 7), (1, 1), 1, (1, 1), False, "bfloat16", None, "lowered_cl", 7, 7,
         {"block_m": 64, "block_n": 16, "splits": 1}),
        # more splits than k-steps: empty splits write zeros that the final sum adds
        (2, 2, 9, 1, (3, 5), (1, 1), 0, (1, 1), True, "float32", "ieee", "lowered", 4, 6, {"splits": 24}),
        # long reductions with the default splits (24 and 48 ways on an H100)
        (16, 8, 64, 1, (126, 126), (1, 1), 1, (1, 1), False, "float32", "tf32", "lowered", 126, 126, {}),
        (16, 8, 64, 1, (126, 126), (1, 1), 1, (1, 1), True, "bfloat16", None, "lowered_cl", 126, 126, {}),
        (3, 32, 48, 1, (60, 60), (1, 1), 0, (1, 1), False, "float32", "ieee", "lowered_cl", 60, 60, {}),
        (4, 32, 32, 4, (40, 40), (1, 1), 1, (1, 1), True, "float16", None, "lowered", 40, 40, {}),
    ]
    # The depthwise mode (dw_rows, groups_block > 0): groups = channels, one input channel a group
    # (Cg 1; 2 in one row), multipliers 1, 2 and 4; the forward's stride 2 as the dilation, its
    # dilation 2 as the stride; 3x3, 4x4, 5x5 and 7x7 rows; 40 and 36 groups (a partial last block
    # of 32, of 8); rows past dw_rows (three passes, the last partial); splits forced (empty ones
    # too) and the defaults of a long reduction; a bias in the final sum. (weight_grad's x' of one
    # channel a group is a contiguous copy either way: lanes along the terms; dY's channels_last
    # strides differ. The lanes along the groups are the ordinary channels_last calls' below.)
    depthwise = [
        (1, 40 * 3, 40, 40, (14, 14), (1, 1), 1, (1, 1), False, "float32", "ieee", "lowered", 14, 14, {}),
        (1, 40 * 3, 40, 40, (14, 14), (1, 1), 1, (1, 1), True, "float32", "tf32", "lowered_cl", 14, 14,
         {"groups_block": 32, "splits": 2}),
        (1, 36 * 3, 36, 36, (7, 7), (1, 1), 1, (2, 2), False, "bfloat16", None, "lowered", 14, 14, {}),
        (1, 36 * 3, 36, 36, (7, 7), (1, 1), 1, (2, 2), False, "float16", None, "lowered_cl", 14, 14,
         {"groups_block": 8}),
        (1, 24 * 2, 24, 24, (10, 10), (2, 2), 2, (1, 1), False, "float32", "ieee", "lowered_cl", 14, 14, {}),
        (1, 20 * 4, 40, 20, (12, 12), (1, 1), 1, (1, 1), True, "bfloat16", None, "lowered_cl", 12, 12, {}),
        (1, 20 * 4, 40, 20, (12, 12), (1, 1), 1, (1, 1), False, "float32", "tf32", "lowered", 12, 12, {}),
        (1, 12 * 2, 48, 12, (9, 9), (1, 1), 1, (1, 1), False, "float32", "ieee", "lowered_cl", 9, 9, {}),
        (1, 33 * 2, 33, 33, (9, 11), (1, 1), 2, (1, 1), True, "float64", None, "lowered", 9, 11, {}),
        (1, 33 * 2, 66, 33, (9, 11), (1, 1), 1, (1, 1), False, "float64", None, "lowered_cl", 9, 11, {}),
        (1, 48 * 2, 48, 48, (16, 16), (1, 1), 3, (1, 1), False, "float16", None, "lowered", 16, 16, {}),
        (1, 48 * 2, 48, 48, (16, 16), (1, 1), 3, (1, 1), True, "bfloat16", None, "lowered_cl", 16, 16, {}),
        (2, 16 * 3, 16, 16, (10, 10), (1, 1), 1, (1, 1), False, "float32", "ieee", "lowered", 10, 10, {}),
        (1, 8 * 64, 64, 64, (28, 28), (1, 1), 1, (1, 1), False, "float32", "tf32", "lowered_cl", 28, 28,
         {"dw_rows": 4, "groups_block": 8, "splits": 6}),
        (1, 8 * 64, 64, 64, (28, 28), (1, 1), 1, (1, 1), True, "bfloat16", None, "lowered", 28, 28,
         {"dw_rows": 4, "groups_block": 32, "splits": 3}),
        (1, 2 * 12, 12, 12, (3, 5), (1, 1), 0, (1, 1), True, "float32", "ieee", "lowered", 4, 6,
         {"dw_rows": 9, "groups_block": 8, "splits": 24}),
        (1, 32 * 32, 32, 32, (56, 56), (1, 1), 1, (1, 1), False, "float32", "ieee", "lowered", 56, 56, {}),
        (1, 32 * 32, 32, 32, (56, 56), (1, 1), 1, (1, 1), False, "bfloat16", None, "lowered_cl", 56, 56, {}),
    ]
    out = [Case(6900 + i, n, c, k, g, pq, st, pad, dil, b, dt, prec, lay, h, w, "wgrad", tuple(sorted(t.items())))
           for i, (n, c, k, g, pq, st, pad, dil, b, dt, prec, lay, h, w, t) in enumerate(rows)]
    out += [Case(7700 + i, n, c, k, g, pq, st, pad, dil, b, dt, prec, lay, h, w, "wgrad", tuple(sorted(t.items())))
            for i, (n, c, k, g, pq, st, pad, dil, b, dt, prec, lay, h, w, t) in enumerate(depthwise)]
    # ordinary calls: views, channels_last weights, offsets, unbatched
    more = [  # N, C, K, groups, kernel, stride, padding, dilation, bias, dtype, precision, layout, H, W, tiles
        (2, 24, 40, 2, (3, 3), (1, 1), 1, (1, 1), True, "float32", "tf32", "strided_view", 13, 17, {"splits": 2}),
        (3, 16, 20, 1, (5, 3), (2, 1), (1, 0), (1, 2), False, "bfloat16", None, "cl_offset", 11, 9, {}),
        (2, 8, 24, 1, (3, 3), (1, 1), 1, (1, 1), True, "float16", None, "weight_slice", 10, 10, {"block_n": 32}),
        (0, 12, 18, 3, (3, 3), (1, 1), 1, (1, 1), True, "float64", None, "offset", 9, 8, {"splits": 3}),
        # the depthwise mode with channels_last x (lanes along the groups): 40 groups (a partial block
        # of 32), two passes over 50 rows (25 a pass), multiplier 2; 64 groups, 9 rows
        (2, 40, 80, 40, (3, 3), (1, 1), 1, (1, 1), True, "bfloat16", None, "cl_offset", 5, 5,
         {"dw_rows": 25, "groups_block": 32, "splits": 1}),
        (1, 64, 64, 64, (3, 3), (1, 1), 1, (1, 1), False, "float32", "ieee", "channels_last", 3, 3,
         {"dw_rows": 9, "groups_block": 8, "splits": 2}),
        (1, 64, 128, 64, (3, 3), (2, 2), 1, (1, 1), False, "float64", None, "channels_last", 6, 6,
         {"dw_rows": 9, "groups_block": 32, "splits": 1}),
    ]
    out += [Case(6930 + i, n, c, k, g, kern, st, pad, dil, b, dt, prec, lay, h, w, "wgrad", tuple(sorted(t.items())))
            for i, (n, c, k, g, kern, st, pad, dil, b, dt, prec, lay, h, w, t) in enumerate(more)]
    return out


def make_wgrad_vector_cases() -> list[Case]:
    """`wgrad`'s 16-byte loads (p.a_vec, p.b_vec: runs of 16 bytes of x's rows, the lowered batch =
    the forward's channels, and of dY's channels) where the launch must take them, and where it
    must not: channels_last x and dY with Cg and O whole runs (8 16-bit, 4 float32, 2 float64
    elements) in every dtype and math, tiles 64 and 128 x 16, 32 and 64 (2, 4 and 8 threads a k of
    B's runs), rows and columns past the last whole tile, windows past every edge, empty splits; x a
    grouped copy (its element path) beside dY's runs; one operand's runs, the other's elements (a
    count short of a run); views of wider channels_last tensors, columns 1.. (from C elements in:
    still 16-byte runs) and channels 1.. (one element past a 16-byte boundary: element by element);
    odd channel counts. Numbered 7760 on (`-k "sweep_against_float64 and (776 or 777)"`)."""
    rows = [  # Cg, G*Nb, O, G, (P, Q), stride, padding, dilation, bias, dtype, precision, layout, H, W, tiles
        # both operands' runs
        (16, 4, 32, 1, (12, 12), (1, 1), 1, (1, 1), True, "bfloat16", None, "lowered_cl", 12, 12, {}),
        (24, 3, 72, 1, (9, 10), (2, 1), (1, 2), (1, 1), False, "float16", None, "lowered_cl", 20, 14,
         {"block_m": 128, "block_n": 64, "splits": 4}),
        (12, 5, 20, 1, (7, 7), (1, 1), 1, (2, 2), True, "float32", "tf32", "lowered_cl", 15, 15, {"block_n": 16}),
        (8, 6, 12, 1, (5, 6), (1, 1), 0, (1, 1), False, "float32", "ieee", "lowered_cl", 9, 10,
         {"block_m": 128, "block_n": 64, "splits": 6}),
        (6, 4, 10, 1, (6, 5), (1, 2), 2, (1, 1), True, "float64", None, "lowered_cl", 8, 11, {"block_m": 128, "splits": 3}),
        (32, 2, 48, 1, (6, 6), (1, 1), 0, (1, 1), True, "bfloat16", None, "lowered_cl", 8, 8,
         {"block_m": 128, "block_n": 16}),
        (16, 2, 64, 1, (6, 6), (1, 1), 1, (1, 1), False, "float16", None, "lowered_cl", 6, 6, {"block_n": 32, "splits": 2}),
        (8, 1, 8, 1, (3, 3), (1, 1), 0, (1, 1), True, "bfloat16", None, "lowered_cl", 4, 5, {"splits": 24}),
        # x' a grouped copy (elements), dY's runs a group; one operand's runs, the other's elements
        (8, 2 * 3, 32, 2, (8, 8), (1, 1), 1, (1, 1), False, "bfloat16", None, "lowered_cl", 8, 8, {"splits": 2}),
        (16, 3, 20, 1, (10, 10), (1, 1), 1, (1, 1), False, "bfloat16", None, "lowered_cl", 10, 10, {"block_n": 32}),
        (10, 3, 24, 1, (10, 10), (1, 1), 1, (1, 1), False, "float16", None, "lowered_cl", 10, 10, {"block_n": 16}),
        # views: columns 1.. of wider tensors (runs), channels 1.. (elements)
        (16, 3, 32, 1, (7, 7), (1, 1), 1, (1, 1), True, "bfloat16", None, "lowered_cl_wslice", 9, 9, {}),
        (8, 3, 12, 1, (7, 7), (1, 1), 1, (1, 1), False, "float32", "tf32", "lowered_cl_wslice", 9, 9, {}),
        (16, 3, 32, 1, (7, 7), (1, 1), 1, (1, 1), False, "bfloat16", None, "lowered_cl_cslice", 9, 9, {}),
        (8, 2, 16, 1, (7, 7), (1, 1), 1, (1, 1), True, "float64", None, "lowered_cl_cslice", 9, 9, {}),
        # odd channel counts: elements
        (7, 3, 9, 1, (6, 6), (1, 1), 1, (1, 1), False, "float16", None, "lowered_cl", 8, 8, {}),
        (12, 3, 30, 1, (6, 6), (1, 1), 1, (1, 1), True, "bfloat16", None, "lowered_cl", 8, 8, {}),
        (5, 3, 6, 1, (6, 6), (1, 1), 1, (1, 1), False, "float32", "ieee", "lowered_cl", 8, 8, {}),
    ]
    return [Case(7760 + i, n, c, k, g, pq, st, pad, dil, b, dt, prec, lay, h, w, "wgrad", tuple(sorted(t.items())))
            for i, (n, c, k, g, pq, st, pad, dil, b, dt, prec, lay, h, w, t) in enumerate(rows)]


def make_pointwise_tile_cases() -> list[Case]:
    """`pointwise_tile` (1x1 NCHW TF32, one block a tile of 128 pixels and 128 output channels, or
    64 for layers of up to 64: K 40, 64 and 1 below): case 87's channels, input channels short of a
    k-step (zeros past CIN), output channels past the last whole block of 128, planes that end in a cut tile and planes that are not whole 16-byte chunks
    (4-byte copies and stores), views whose planes start between 16-byte boundaries, a strided
    view, a channels_last weight, bias, unbatched input and an empty batch."""
    rows = [  # N, C, K, bias, layout, H, W
        (2, 64, 128, False, "contiguous", 32, 64),
        (3, 64, 128, True, "contiguous", 37, 41),
        (2, 3, 200, True, "contiguous", 16, 20),
        (1, 13, 40, False, "contiguous", 9, 31),
        (2, 48, 256, True, "offset", 24, 24),
        (2, 32, 130, True, "strided_view", 12, 40),
        (2, 64, 96, False, "weight_channels_last", 20, 28),
        (0, 16, 128, True, "contiguous", 11, 13),
        (0, 8, 64, False, "contiguous", 8, 16),
        (2, 1, 1, True, "contiguous", 5, 7),
    ]
    return [Case(7200 + i, n, c, k, 1, (1, 1), (1, 1), 0, (1, 1), b, "float32", "tf32", lay, h, w, "pointwise_tile")
            for i, (n, c, k, b, lay, h, w) in enumerate(rows)]


def make_sampled_1x1_cases() -> list[Case]:
    """NCHW 1x1 layers with a stride and no padding, as the selector plans them (so unforced): on
    the view input[..., ::sh, ::sw] at stride 1 (select.sampled_1x1). Every dtype and precision, equal
    and unequal strides, planes the strides do not divide, views the TMA family copies first
    (offset, strided), unbatched input, and ResNet's downsample at a small batch."""
    rows = [  # N, C, K, stride, bias, dtype, precision, layout, H, W
        (2, 256, 512, (2, 2), True, "float32", "tf32", "contiguous", 56, 56),
        (2, 256, 128, (2, 2), False, "float32", "ieee", "contiguous", 56, 56),
        (2, 128, 256, (2, 2), True, "bfloat16", None, "contiguous", 28, 28),
        (2, 96, 64, (2, 3), True, "float16", None, "contiguous", 33, 47),
        (1, 128, 64, (3, 3), False, "float32", None, "strided_view", 40, 40),
        (2, 128, 128, (2, 2), True, "float32", "tf32", "offset", 32, 48),
        (0, 64, 96, (2, 2), True, "bfloat16", None, "contiguous", 20, 36),
        (3, 32, 48, (1, 2), False, "float32", "tf32", "contiguous", 17, 30),
        (2, 512, 256, (2, 2), False, "bfloat16", None, "offset", 28, 28),
        (2, 16, 24, (4, 4), True, "float32", "ieee", "contiguous", 23, 19),
        (2, 8, 16, (2, 2), True, "float64", None, "contiguous", 9, 9),
    ]
    return [Case(7300 + i, n, c, k, 1, (1, 1), st, 0, (1, 1), b, dt, prec, lay, h, w, None)
            for i, (n, c, k, st, b, dt, prec, lay, h, w) in enumerate(rows)]


def make_nhwc_nchw_cases(n: int, seed: int = 6471) -> list[Case]:
    """NCHW calls forced onto the `nhwc` family (its input transposed into the workspace, its
    output written in NCHW): make_nhwc_cases' shapes from another seed, on contiguous inputs and
    strided views."""
    rng = random.Random(seed)
    return [replace(c, idx=6100 + i, layout=rng.choice(["contiguous", "strided_view"]))
            for i, c in enumerate(make_nhwc_cases(n, seed))]


def make_depthwise_nhwc_cases(n: int, seed: int = 6530) -> list[Case]:
    """channels_last depthwise calls forced onto `depthwise_nhwc`: every dtype, channel
    multipliers that divide a vector, that a vector divides and neither (the element-wise input
    path), channel counts in whole vectors and not (element-wise throughout), every kernel shape,
    stride, dilation and padding, ragged channel tiles and strips, forced tiles, and inputs off a
    16-byte boundary (`cl_offset`) or whose weight alone is channels_last."""
    rng = random.Random(seed)
    fam = get_family("depthwise_nhwc")
    cases = []
    for idx in range(n):
        dtype = rng.choice(["float32", "float32", "bfloat16", "bfloat16", "float16"])
        C = rng.choice([2, 3, 8, 16, 24, 32, 40, 96, 144])
        mult = rng.choice([1, 1, 1, 2, 3, 4, 8])
        kernel = rng.choice([(3, 3), (3, 3), (5, 5), (7, 7), (3, 1), (1, 3), (2, 4), (1, 1), (9, 9)])
        stride, dilation, padding = _cl_window(rng)
        eh, ew = _extent(kernel, dilation)
        H, W = max(rng.randint(3, 40), eh), max(rng.randint(3, 40), ew)
        tiles = ()
        if idx % 3 == 2:  # a tile choice of the tuner's, where it fits
            tiles = tuner_tiles(rng, fam, lambda pick: ConvSpec(
                C, C * mult, kernel, stride, 0, dilation, C, dtype, "cuda", False, "nhwc", "ieee",
                "depthwise_nhwc", tuple(pick.items())))
        layout = rng.choice(["channels_last"] * 3 + ["cl_offset"])
        cases.append(Case(6200 + idx, rng.choice([1, 2, 3, 5]), C, C * mult, C, kernel, stride, padding, dilation,
                          rng.random() < 0.5, dtype, None, layout, H, W, "depthwise_nhwc", tiles))
    return cases


def _nchw_depthwise_cases(family: str, n: int, seed: int, first_idx: int, side: int,
                          narrow: Mapping | None = None) -> list[Case]:
    """NCHW depthwise calls forced onto `family` with random tiles (three in four drawn from
    `narrow`'s values where given): every dtype, channel multipliers, kernel shapes, strides,
    dilations and paddings, planes from 1 x 1 to side x side, on contiguous inputs and strided
    views."""
    rng = random.Random(seed)
    fam = get_family(family)
    cases = []
    for idx in range(n):
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16", "float64"])
        C = rng.choice([1, 3, 8, 16, 24])
        mult = rng.choice([1, 1, 2, 3])
        kernel = rng.choice([(3, 3), (3, 3), (5, 5), (3, 1), (1, 3), (2, 4)])
        stride = rng.choice([(1, 1), (1, 1), (2, 2), (1, 2)])
        dilation = rng.choice([(1, 1), (1, 1), (2, 2)])
        padding = rng.choice([0, 1, (1, 2)] + (["same"] if stride == (1, 1) else []))
        eh, ew = _extent(kernel, dilation)
        H, W = max(rng.randint(1, side), eh), max(rng.randint(1, side), ew)
        values = {**fam.tiles, **narrow} if narrow and idx % 4 else None
        tiles = tuner_tiles(rng, fam, lambda pick: ConvSpec(
            C, C * mult, kernel, stride, 0, dilation, C, dtype, "cuda", False, "nchw", "ieee", family,
            tuple(pick.items())), values)
        cases.append(Case(first_idx + idx, rng.choice([1, 2, 3]), C, C * mult, C, kernel, stride, padding, dilation,
                          rng.random() < 0.5, dtype, None, rng.choice(["contiguous"] * 3 + ["strided_view"]), H, W,
                          family, tiles))
    return cases


def make_depthwise_cases(n: int, seed: int = 6570) -> list[Case]:
    """`depthwise` with tiles narrower than a warp (8 or 16 columns, the small-plane tiles: lanes
    of one warp on several rows) and some wider, on planes up to 30 x 30 (strided views take the
    element-wise window path)."""
    return _nchw_depthwise_cases("depthwise", n, seed, 6500, 30, {"block_q": (8, 16)})


def make_depthwise_planes_cases(n: int, seed: int = 6590) -> list[Case]:
    """`depthwise_planes` (whole planes a block) on planes up to 20 x 20: planes a block that do
    not divide the batch's, runs from any plane's start on contiguous inputs (16-byte copies),
    element loads on strided views."""
    return _nchw_depthwise_cases("depthwise_planes", n, seed, 6590, 20)


def make_grouped_nhwc_cases(n: int, seed: int = 6611) -> list[Case]:
    """channels_last grouped calls forced onto `grouped_nhwc`: every dtype, 2-16 input channels a
    group (runs of input that are whole 16-byte loads and not: 3, 6, 12), output channels a group
    that divide a vector or fill whole ones, every kernel shape, stride, dilation and padding,
    ragged channel tiles and strips, forced tiles, and inputs off a 16-byte boundary
    (`cl_offset`: the element-wise path)."""
    rng = random.Random(seed)
    fam = get_family("grouped_nhwc")
    cases = []
    for idx in range(n):
        dtype = rng.choice(["float32", "float32", "bfloat16", "bfloat16", "float16"])
        groups = rng.choice([2, 3, 4, 8, 32])
        cin_g = rng.choice([2, 3, 4, 4, 6, 8, 8, 12, 16])
        cout_g = rng.choice([1, 2, 4, 4, 8, 16, 24])
        kernel = rng.choice([(3, 3), (3, 3), (3, 3), (5, 5), (7, 7), (3, 1), (1, 3), (2, 4), (1, 1)])
        stride = rng.choice([(1, 1), (1, 1), (2, 2), (1, 2)])
        dilation = rng.choice([(1, 1), (1, 1), (1, 1), (2, 2), (1, 3)])
        padding = rng.choice([0, 1, (1, 2), (0, 3)] + (["same", "valid"] if stride == (1, 1) else []))
        precision = rng.choice(["tf32", "ieee", None]) if dtype == "float32" else None
        eh, ew = _extent(kernel, dilation)
        H, W = max(rng.randint(3, 30), eh), max(rng.randint(3, 30), ew)
        C, K = groups * cin_g, groups * cout_g
        tiles = ()
        if idx % 3 == 2:  # a tile choice of the tuner's, where it fits
            tiles = tuner_tiles(rng, fam, lambda pick: ConvSpec(
                C, K, kernel, stride, 0, dilation, groups, dtype, "cuda", False, "nhwc", "ieee",
                "grouped_nhwc", tuple(pick.items())))
        layout = rng.choice(["channels_last"] * 3 + ["cl_offset"])
        cases.append(Case(6300 + idx, rng.choice([1, 2, 3, 5]), C, K, groups, kernel, stride, padding, dilation,
                          rng.random() < 0.5, dtype, precision, layout, H, W, "grouped_nhwc", tiles))
    return cases


def make_grouped_mma_cases(n: int, seed: int = 7400) -> list[Case]:
    """Grouped calls forced onto `grouped_mma` (groups of whole MMA k-steps on tensor cores): TF32
    and 16-bit, 8-48 input channels a group into 8-32 output, every kernel shape whose taps fit
    the registers, stride, dilation and padding, blocks of groups past the last one, tiles past
    the last row and column, forced tiles; channels_last inputs (off a 16-byte boundary: the
    element-wise path) and NCHW ones (contiguous, strided views, weight slices: the transpose).
    Then hand-picked rows: ResNeXt-50's wider groups at a small batch."""
    from kernelgen.families.grouped_mma import WREG_LIMIT, tap_registers

    rng = random.Random(seed)
    fam = get_family("grouped_mma")
    narrow = {**fam.tiles, "block_p": tuple(range(1, 10)), "block_q": tuple(range(1, 24))}
    cases = []
    while len(cases) < n:
        idx = len(cases)
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16"])
        groups = rng.choice([2, 3, 4, 8, 32])
        cin_g = rng.choice([8, 16, 16, 24, 32] if dtype == "float32" else [16, 16, 32, 48])
        cout_g = rng.choice([8, 16, 16, 24, 32])
        kernel = rng.choice([(3, 3), (3, 3), (3, 3), (5, 5), (3, 1), (1, 3), (2, 4), (1, 1)])
        probe = ConvSpec(groups * cin_g, groups * cout_g, kernel, 1, 0, 1, groups, dtype, "cuda", False, "nhwc",
                         "tf32" if dtype == "float32" else "ieee", "grouped_mma", (("warp_n", 8),))
        if tap_registers(probe, 8) > WREG_LIMIT:
            continue
        stride, dilation, padding = _cl_window(rng)
        eh, ew = _extent(kernel, dilation)
        H, W = max(rng.randint(3, 30), eh), max(rng.randint(3, 30), ew)
        layout = rng.choice(["channels_last"] * 4 + ["cl_offset", "contiguous", "strided_view", "weight_slice"])
        tiles = ()
        if idx % 3 == 2:  # a tile choice of the tuner's, where it fits
            tiles = tuner_tiles(rng, fam, lambda pick: probe.replace(
                stride=stride, dilation=dilation, layout="nhwc" if "cl" in layout or layout == "channels_last" else "nchw",
                tiles=tuple(pick.items())), narrow)
        precision = rng.choice(["tf32", None]) if dtype == "float32" else None
        batch = rng.choice([0, 1, 2, 3] if layout in ("contiguous", "strided_view", "weight_slice") else [1, 2, 3])
        cases.append(Case(7400 + idx, batch, groups * cin_g, groups * cout_g, groups, kernel,
                          stride, padding, dilation, rng.random() < 0.5, dtype, precision, layout, H, W, "grouped_mma",
                          tiles))
    rows = [  # N, groups, cin_g, cout_g, stride, dtype, layout, H, W, tiles
        (2, 32, 16, 16, (1, 1), "bfloat16", "channels_last", 14, 14, ()),
        (2, 32, 16, 16, (2, 2), "float32", "channels_last", 28, 28, ()),
        (2, 32, 32, 32, (1, 1), "bfloat16", "channels_last", 7, 7, ()),
        (2, 32, 32, 32, (1, 1), "float32", "contiguous", 7, 7, ()),
        (2, 32, 16, 16, (1, 1), "float16", "contiguous", 14, 14, ()),
        (1, 5, 16, 16, (1, 1), "bfloat16", "channels_last", 9, 11, (("groups_block", 4),)),  # a block of 1 live group
        # NCHW read in place, rows out in runs of 16 bytes (two tiles across, a partial tile down),
        # 8 bytes (28 bf16 columns) and 16 bytes again (float16, stride 2); the earlier rows'
        # 7 and 14 columns go out an element at a time (and 14 16-bit ones in 4-byte runs)
        (2, 8, 16, 16, (1, 1), "float32", "contiguous", 13, 40, ()),
        (2, 4, 32, 16, (1, 1), "bfloat16", "strided_view", 12, 28, ()),
        (3, 5, 16, 8, (2, 2), "float16", "contiguous", 17, 32, (("groups_block", 2),)),
        # NCHW through the transpose
        (1, 8, 16, 16, (1, 1), "float32", "contiguous", 14, 14, (("transpose", 1),)),
        (3, 4, 16, 32, (1, 1), "bfloat16", "weight_slice", 9, 16, (("transpose", 1), ("block_q", 8))),
    ]
    cases += [Case(7400 + n + i, N, g * ci, g * co, g, (3, 3), st, 1, (1, 1), True, dt,
                   "tf32" if dt == "float32" else None, lay, h, w, "grouped_mma", t)
              for i, (N, g, ci, co, st, dt, lay, h, w, t) in enumerate(rows)]
    return cases


def make_groupwise_nchw_cases(n: int, seed: int = 6911) -> list[Case]:
    """NCHW calls forced onto `grouped_nhwc` and `depthwise_nhwc` (the input transposed into the
    workspace, each output channel's pixels of a strip written to its plane as one run where the
    planes hold whole strips, else element by element): make_grouped_nhwc_cases' and
    make_depthwise_nhwc_cases' shapes from other seeds, on contiguous inputs, strided views and
    weight slices, and row widths that are whole strips of 4 pixels."""
    rng = random.Random(seed)
    src = make_grouped_nhwc_cases(n, seed) + make_depthwise_nhwc_cases(n, seed + 1)
    out = []
    for i, c in enumerate(src):
        width = c.W if i % 2 else c.W + (-c.W % 4) + (c.kernel[1] - 1 if c.stride == (1, 1) else 0)
        out.append(replace(c, idx=6900 + i, W=width, layout=rng.choice(["contiguous", "contiguous", "strided_view",
                                                                          "weight_slice"])))
    return out


def make_stem_nhwc_cases(n: int, seed: int = 7010) -> list[Case]:
    """channels_last calls forced onto `stem_nhwc` (first layers of 2-8 input channels): every
    dtype and precision, kernels up to 7x7, strides, dilations and padding, output channels that
    are odd, under a block and over one, tiles past the last row and column, forced tiles, and
    inputs that are not dense channels_last (off a 16-byte boundary; NCHW with a channels_last
    weight, which makes the output channels_last); then hand-picked rows: the stems of ResNet
    and MobileNet at a small batch, and reductions that fill their last k-step exactly."""
    rng = random.Random(seed)
    fam = get_family("stem_nhwc")
    cases = []
    for idx in range(n):
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16"])
        C = rng.choice([2, 3, 3, 3, 4, 5, 6, 8])  # (one channel is NCHW as much as channels_last: torch calls it NCHW)
        K = rng.choice([1, 3, 16, 24, 32, 64, 64, 67, 96, 128])
        kernel = rng.choice([(7, 7), (7, 7), (3, 3), (3, 3), (5, 5), (3, 1), (1, 3), (1, 1), (4, 3), (2, 2)])
        stride, dilation, padding = _cl_window(rng)
        precision = rng.choice(["tf32", "ieee", None]) if dtype == "float32" else None
        eh, ew = _extent(kernel, dilation)
        H, W = max(rng.randint(3, 70), eh), max(rng.randint(3, 70), ew)
        tiles = ()
        if idx % 3 == 2:  # a tile choice of the tuner's, where it fits
            tiles = tuner_tiles(rng, fam, lambda pick: ConvSpec(
                C, K, kernel, stride, 0, dilation, 1, dtype, "cuda", False, "nhwc",
                "tf32" if precision == "tf32" else "ieee", "stem_nhwc", tuple(pick.items())))
        layout = rng.choice(["channels_last"] * 4 + ["cl_offset", "weight_channels_last", "cl_weight_slice"])
        if layout == "weight_channels_last" and (kernel == (1, 1) or K == 1):  # such a weight is NCHW too
            layout = "channels_last"
        cases.append(Case(7000 + idx, rng.choice([1, 2, 3]), C, K, 1, kernel, stride, padding, dilation,
                          rng.random() < 0.5, dtype, precision, layout, H, W, "stem_nhwc", tiles))
    rows = [  # N, C, K, kernel, stride, padding, bias, dtype, precision, H, W
        (2, 3, 64, (7, 7), (2, 2), 3, False, "float32", "tf32", 61, 67),
        (2, 3, 64, (7, 7), (2, 2), 3, True, "float32", "ieee", 61, 67),
        (2, 3, 64, (7, 7), (2, 2), 3, True, "bfloat16", None, 61, 67),
        (3, 3, 32, (3, 3), (2, 2), 1, True, "float32", "tf32", 45, 50),
        (3, 3, 32, (3, 3), (2, 2), 1, False, "float16", None, 45, 50),
        (2, 4, 40, (3, 3), (1, 1), 1, True, "float32", "ieee", 33, 35),  # K = 36: a ragged last k-step
        (2, 8, 24, (2, 2), (1, 1), 0, False, "bfloat16", None, 17, 40),  # K = 32: whole k-steps
        (1, 2, 130, (5, 5), (1, 1), 2, True, "float32", "tf32", 40, 70),  # three channel blocks
    ]
    cases += [Case(7000 + n + i, N, C, K, 1, ker, st, pad, (1, 1), b, dt, prec, "channels_last", h, w, "stem_nhwc")
              for i, (N, C, K, ker, st, pad, b, dt, prec, h, w) in enumerate(rows)]
    return cases


def make_weight_layout_cases(hopper: bool) -> list[Case]:
    """Every family reading a weight that is not contiguous OIHW, through its strides (KgW):
    a channels_last weight (which makes the call channels_last) and a slice of a larger
    tensor (`weight_slice`; `cl_weight_slice` with a channels_last input)."""
    rows = [  # family, C, K, groups, kernel, layouts
        ("depthwise", 16, 32, 16, (3, 3), ["weight_slice"]),
        ("depthwise_planes", 16, 32, 16, (3, 3), ["weight_slice"]),
        ("depthwise_nhwc", 16, 32, 16, (3, 3), ["cl_weight_slice"]),
        ("grouped_nhwc", 32, 32, 8, (3, 3), ["weight_channels_last", "cl_weight_slice"]),
        ("nhwc", 32, 64, 1, (3, 3), ["weight_channels_last", "cl_weight_slice"]),
        ("pointwise", 32, 64, 1, (1, 1), ["weight_slice"]),
        ("igemm", 16, 32, 2, (3, 3), ["weight_slice"]),
        ("igemm", 256, 64, 1, (3, 3), ["weight_slice"]),  # a long reduction: weights staged per k-step
        ("direct", 8, 12, 2, (3, 2), ["weight_slice", "weight_channels_last"]),
        ("grouped_mma", 64, 64, 4, (3, 3), ["weight_channels_last", "cl_weight_slice", "weight_slice"]),
    ] + ([("wgmma", 64, 64, 1, (3, 3), ["weight_slice"])] if hopper else [])
    cases = []
    for family, C, K, groups, kernel, layouts in rows:
        for layout in layouts:
            for dtype, precision in (("float32", "tf32"), ("float32", "ieee"), ("bfloat16", None)):
                if family == "grouped_mma" and precision == "ieee":  # (TF32 and 16-bit MMAs only)
                    continue
                padding = 0 if kernel == (1, 1) else 1
                cases.append(Case(6400 + len(cases), 2, C, K, groups, kernel, (1, 1), padding, (1, 1), True, dtype,
                                  precision, layout, 19, 21, family))
    return cases


def _lowered_tensors(case: Case, g: torch.Generator, device: str):
    """A weight gradient's own forward operands (gradients.weight_grad): the case is the lowered
    convolution (batch Cg, C = G x the forward's batch Nb, K = O, the kernel dY's plane), its
    input the forward's x (Nb, G*Cg, H, W) seen as (Cg, G*Nb, H, W), its weight dY (Nb, O, P, Q) seen
    as (O, Nb, P, Q); NCHW ('lowered') or channels_last ('lowered_cl') x and dY, or channels_last
    views of wider tensors: columns 1.. ('lowered_cl_wslice': C and O elements past their starts) or
    channels 1.. ('lowered_cl_cslice': one element past, strides of C + 1 and O + 1)."""
    dt, G, Cg = DTYPES[case.dtype], case.groups, case.N
    Nb = case.C // G
    x = torch.randn(Nb, G * Cg, case.H, case.W, generator=g).to(device=device, dtype=dt)
    dy = torch.randn(Nb, case.K, *case.kernel, generator=g).to(device=device, dtype=dt)
    if case.layout != "lowered":
        x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
    if case.layout in ("lowered_cl_wslice", "lowered_cl_cslice"):
        x, dy = (_cl_slice(t, 3 if case.layout == "lowered_cl_wslice" else 1, device) for t in (x, dy))
    xs = x.unflatten(1, (G, Cg)).permute(2, 1, 0, 3, 4).reshape(Cg, G * Nb, case.H, case.W)
    b = torch.randn(case.K, generator=g).to(device=device, dtype=dt) if case.bias else None
    return xs, dy.transpose(0, 1), b


def _cl_slice(t: torch.Tensor, dim: int, device: str) -> torch.Tensor:
    """t's values in a channels_last tensor one wider along `dim`, seen without its first index there."""
    shape = list(t.shape)
    shape[dim] += 1
    big = torch.zeros(shape, dtype=t.dtype, device=device).contiguous(memory_format=torch.channels_last)
    view = big.narrow(dim, 1, t.shape[dim])
    return view.copy_(t) if device != "meta" else view


def make_tensors(case: Case, device: str = "cuda", seed: int | None = None):
    g = torch.Generator().manual_seed(case.idx if seed is None else seed)
    dt = DTYPES[case.dtype]
    if case.layout.startswith("lowered"):
        return _lowered_tensors(case, g, device)
    shape = (case.C, case.H, case.W) if case.N == 0 else (case.N, case.C, case.H, case.W)
    if case.layout == "strided_view":
        big = torch.randn(*shape[:-1], case.W * 2, generator=g)
        x = big.to(device=device, dtype=dt)[..., 1::2]  # every other column: W columns, stride 2
    else:
        x = torch.randn(*shape, generator=g).to(device=device, dtype=dt)
    w = torch.randn(case.K, case.C // case.groups, *case.kernel, generator=g).to(device=device, dtype=dt)
    b = torch.randn(case.K, generator=g).to(device=device, dtype=dt) if case.bias else None
    if case.layout in ("channels_last", "cl_both"):
        x = x.contiguous(memory_format=torch.channels_last)
    if case.layout == "offset":  # NCHW, its data one element past an aligned start
        view = torch.empty(x.numel() + 1, device=device, dtype=dt)[1:].view(x.shape)
        x = view.copy_(x) if device != "meta" else view
    if case.layout == "cl_offset":  # channels_last, its data one element past an aligned start
        view = torch.empty(x.numel() + 1, device=device, dtype=dt)[1:].view(x.permute(0, 2, 3, 1).shape)
        view = view.permute(0, 3, 1, 2)
        x = view.copy_(x) if device != "meta" else view
    if case.layout in ("weight_channels_last", "cl_both"):
        w = w.contiguous(memory_format=torch.channels_last)
    if case.layout in ("weight_slice", "cl_weight_slice"):  # every other output channel, rows 1..kh
        big = torch.randn(2 * case.K, case.C // case.groups, case.kernel[0] + 1, case.kernel[1], generator=g)
        big = big.to(device=device, dtype=dt)
        big[::2, :, 1:] = w
        w = big[::2, :, 1:]
    if case.layout == "cl_weight_slice":
        x = x.contiguous(memory_format=torch.channels_last)
    return x, w, b


def conv_kwargs(case: Case) -> dict:
    return dict(stride=case.stride, padding=case.padding, dilation=case.dilation, groups=case.groups)


def slope(case: Case) -> float:
    """leaky_relu's slope for a case: torch's default, or for float64 one that a float32 holds
    exactly (the kernels take the slope as a float32)."""
    return 0.25 if case.dtype == "float64" else 0.01


def make_residual(case: Case, out: torch.Tensor, device: str = "cuda") -> torch.Tensor | None:
    """The case's residual for an output like `out` (F.conv2d's: its shape and format), or None:
    random (seeded by the case), with the output's strides ('out'), the other memory format's
    ('other': the call copies it), or a view every other column of a wider tensor ('view')."""
    if case.residual is None:
        return None
    g = torch.Generator().manual_seed(case.idx + 7)
    shape, dt = tuple(out.shape), DTYPES[case.dtype]
    if case.residual == "view":
        r = torch.randn(*shape[:-1], 2 * shape[-1], generator=g).to(device=device, dtype=dt)[..., ::2]
    else:
        r = torch.randn(*shape, generator=g).to(device=device, dtype=dt)
        if out.dim() == 4:
            cl = out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
            if cl != (case.residual == "other"):
                r = r.contiguous(memory_format=torch.channels_last)
    return r


def make_scale(case: Case, device: str = "cuda") -> torch.Tensor | None:
    """The case's scale (positive, near 1, as a folded BatchNorm's), or None."""
    if not case.scale:
        return None
    return (0.5 + torch.rand(case.K, generator=torch.Generator().manual_seed(case.idx))).to(device)


def torch_conv(x, w, b, s, kw) -> torch.Tensor:
    """F.conv2d, and with a scale s: the convolution without bias times s, then the bias, in x's dtype."""
    if s is None:
        return F.conv2d(x, w, b, **kw)
    y = F.conv2d(x, w, None, **kw) * s.to(x.dtype).reshape(-1, 1, 1)
    return y if b is None else y + b.reshape(-1, 1, 1)


def finish(case: Case, y: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """torch's epilogue on a convolution's output `y`, in y's dtype: the residual, the activation."""
    if r is not None:
        y = y + r.to(y.dtype)
    return activate(y, case.activation, slope(case))


def make_gemv_cases(n: int, seed: int = 5113) -> list[Case]:
    """Calls forced onto `gemv`: shapes drawn as make_cases draws them (every kernel, stride,
    padding, dilation, groups, dtype and view, including offset starts that take the element-wise
    loads), then squeeze-excitation 1x1s on 1x1 planes and small planes at batch 1, with channel
    counts that are and are not whole 16-byte loads, in both memory formats and with ragged
    tiles of output channels and pixels."""
    rng = random.Random(seed)
    cases = [replace(c, idx=9000 + i, family="gemv") for i, c in enumerate(make_cases(n // 2, seed))]
    layouts = ["contiguous", "channels_last", "cl_both", "offset", "cl_offset", "weight_slice", "cl_weight_slice"]
    while len(cases) < n:
        se = rng.random() < 0.5
        C = rng.choice([8, 16, 24, 64, 120, 174, 256, 1024] if se else [3, 16, 32, 58, 96, 160])
        K = rng.choice([4, 8, 30, 64, 85, 240, 696] if se else [8, 9, 16, 48, 85, 128])
        kernel = (1, 1) if se else rng.choice([(1, 1), (3, 3), (5, 5), (1, 7)])
        H = W = 1 if se else rng.choice([4, 7, 13, 14])
        tiles = rng.choice([(), (("block_co", 16), ("block_px", 2)), (("block_co", 1), ("block_px", 8)),
                            (("warps", 8),), (("block_co", 4), ("block_px", 4), ("warps", 2))])
        dtype = rng.choice(["float32", "float32", "bfloat16", "float16", "float64"])
        pad = 0 if kernel == (1, 1) else (kernel[0] // 2, kernel[1] // 2)
        cases.append(Case(9000 + len(cases), rng.choice([1, 1, 2, 8, 64]) if se else 1, C, K, 1, kernel, (1, 1),
                          pad, (1, 1), rng.random() < 0.5, dtype, "ieee" if dtype == "float32" else None,
                          rng.choice(layouts), H, W, "gemv", tiles))
    return cases


def make_epilogue_cases(cases: list[Case], per_family: int = 6, seed: int = 5353) -> list[Case]:
    """Fused epilogues in every family: of the sweep's `cases`, `per_family` of each forced family
    (and of the selector's own choices), drawn so that each family's dtypes and layouts vary, each
    given an activation (kernelgen.ACTIVATIONS and none, in turn) and a residual (none, with the
    output's strides, the other memory format's, a strided view, in turn), at least one of the two,
    and every other one a scale (a folded BatchNorm's) where its family applies one.
    `pytest -m gpu -k "sweep and epilogue"` runs them alone."""
    rng = random.Random(seed)
    pools: dict[str, list[Case]] = {}
    for case in cases:
        pools.setdefault(case.family or "", []).append(case)
    acts = (*kernelgen.ACTIVATIONS, None)
    residuals = ("out", None, "other", "view")
    out: list[Case] = []
    for family in sorted(pools):
        pool = pools[family][:]
        rng.shuffle(pool)
        seen: set = set()
        varied = [c for c in pool if (c.dtype, c.layout) not in seen and not seen.add((c.dtype, c.layout))]
        picked = (varied + [c for c in pool if c not in varied])[:per_family]
        for j, case in enumerate(picked):  # (every other one of a family's with a scale, where it takes one)
            i = len(out)
            act, res = acts[i % len(acts)], residuals[i % len(residuals)]
            out.append(replace(case, idx=20000 + i, activation=act, residual=res if act or res else "out",
                               scale=j % 2 == 0 and _takes_a_scale(case)))
    return out


def _takes_a_scale(case: Case) -> bool:
    """Whether the case's call can take an epilogue scale (some families refuse one), on this GPU or,
    without one, a nominal H100."""
    x, w, b = make_tensors(case, device="meta")
    target = contextlib.nullcontext() if torch.cuda.is_available() else planning_for("sm_90a")
    try:
        with target:
            spec_for(x, w, b, **conv_kwargs(case), device="cuda", precision=case.precision, family=case.family,
                     tiles=dict(case.tiles) or None, scale=torch.empty(case.K, device="meta"))
    except (Unsupported, ConvArgumentError):
        return False
    return True


def make_candidate_cases(n: int, seed: int = 8642) -> list[Case]:
    """Configurations the tuner may pick rather than a family's own first choice (kernelgen.tune
    times the candidates of `Family.candidates`, select.ranked(every=True)), forced: for shapes
    drawn as make_cases draws them, one family that can serve the call on this GPU (a nominal H100
    without one) and one of its other candidates, both drawn at random. Strided 1x1 layers that
    the selector plans on their sampled view are left to make_sampled_1x1_cases."""
    from kernelgen import device as kg_device
    from kernelgen import functional

    rng = random.Random(seed)
    gpu = kg_device.of(0) if torch.cuda.is_available() else nominal("sm_90a")
    cases = []
    with functional.planning_for(gpu):
        for case in make_cases(4 * n, seed):
            if len(cases) == n:
                break
            x, w, b = make_tensors(case, device="meta")
            specs, call = candidates_for(x, w, b, **conv_kwargs(case), device="cuda", precision=case.precision,
                                         every=True)
            if call.sample is not None or case.dtype == "float64":
                continue
            others: dict[str, list] = {}
            for spec in specs:  # (each family's own first choice comes first among its candidates)
                others.setdefault(spec.family, []).append(spec)
            families = sorted(f for f, found in others.items() if len(found) > 1)
            if not families:
                continue
            spec = rng.choice(others[rng.choice(families)][1:])
            cases.append(replace(case, idx=8000 + len(cases), family=spec.family,
                                 tiles=tuple(sorted(dict(spec.tiles).items()))))
    return cases


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
CASES = (make_cases(N_CASES) + (make_wgmma_cases(48) + make_overlap_cases(24) + make_ws_cases(24) +
                                make_ws_stage_cases(24) + make_split_cases(24) + make_ragged_cases() + make_wide_tile_cases() +
                                make_strip_cases(32) + make_acc2_cases() +
                                make_short_reduction_cases() + make_nhwc_tma_cases(48) + make_nhwc_tma_nchw_cases(24) +
                                make_nhwc_tma_walk_cases() + make_nhwc_tma_halo_cases() + make_pointwise_tma_cases() +
                                make_nhwc_tma_areg_cases() + make_nhwc_tma_split_cases()
                                if HOPPER else []) +
         make_staged_cases(48) + make_wide_pointwise_cases(24) + make_first_layer_cases(HOPPER) + make_packed_cases() +
         make_nhwc_cases(60) + make_nhwc_nchw_cases(30) + make_depthwise_nhwc_cases(60) + make_depthwise_cases(24) +
         make_depthwise_planes_cases(24) + make_sampled_1x1_cases() + make_pointwise_tile_cases() +
         make_grouped_nhwc_cases(48) + make_groupwise_nchw_cases(24) + make_grouped_mma_cases(48) +
         make_stem_nhwc_cases(48) +
         make_weight_layout_cases(HOPPER) + make_candidate_cases(48) + make_gemv_cases(64) + make_wgrad_cases())
CASES += make_epilogue_cases(CASES)
CASES += make_wgrad_vector_cases()  # (after the epilogues' draw, which they would change)

# `pytest -m gpu -k stage_out` runs the staged-epilogue cases alone, `-k overlap` the overlapped
# ones, `-k ws` the producer-warpgroup ones (the fixture below compiles only what the selected
# cases need).


def rel_err(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def call_poisoned(fn, out_numel: int, dtype: torch.dtype):
    """Run fn() right after freeing a NaN block of the output's size, so the output reuses it."""
    torch.empty(max(out_numel, 1), dtype=dtype, device="cuda").fill_(float("nan"))
    return fn()


@pytest.fixture(scope="module", autouse=True)
def warmed(session_cache, request):
    """Compile every kernel the selected sweep cases need, in parallel, before the first test."""
    from kernelgen.warm import warm_specs

    selected = [item.callspec.params["case"] for item in request.session.items
                if hasattr(item, "callspec") and isinstance(item.callspec.params.get("case"), Case)]
    specs = set()
    for case in selected:
        x, w, b = make_tensors(case, device="meta")
        r = make_residual(case, F.conv2d(x, w, b, **conv_kwargs(case)), device="meta")
        spec, _ = spec_for(x, w, b, **conv_kwargs(case), device="cuda", precision=case.precision,
                           family=case.family, tiles=dict(case.tiles) or None, activation=case.activation,
                           residual=r, scale=make_scale(case, device="meta"))
        if spec is not None:
            specs.add(spec)
    results = warm_specs(sorted(specs, key=lambda s: s.to_json()), jobs=int(os.environ.get("KERNELGEN_JOBS", "16")))
    failed = [r for r in results if r.status == "failed"]
    assert not failed, "\n\n".join(f"{r.spec.summary()}:\n{r.message[-3000:]}" for r in failed[:5])
    return results


def tolerance(case: Case, x, w, b, ref, r=None, s=None) -> float:
    """The accuracy rules (docs/performance.md) against `ref` (float64, the epilogue included), with torch's own
    error measured on its convolution in the case's dtype and the epilogue after it."""
    kw = conv_kwargs(case)
    if case.dtype == "float64":
        return 1e-10
    if case.dtype == "float32":
        if case.precision == "ieee" or (case.precision is None and kernelgen.precision.torch_fp32_conv_math() == "ieee"):
            return 1e-5
        # TF32 allowed: cuDNN's own TF32 error on these inputs sets the bar (with a floor:
        # for tiny reductions cuDNN often picks exact algorithms).
        prev = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = True
        try:
            cudnn_err = rel_err(finish(case, torch_conv(x, w, b, s, kw), r), ref)
        finally:
            torch.backends.cudnn.allow_tf32 = prev
        return max(1.5 * cudnn_err, 1e-3)
    torch_err = rel_err(finish(case, torch_conv(x, w, b, s, kw), r), ref)
    return max(1.5 * torch_err, 1e-4)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sweep_against_float64(case: Case):
    x, w, b = make_tensors(case)
    kw = conv_kwargs(case)
    expected = F.conv2d(x, w, b, **kw)
    r, s = make_residual(case, expected), make_scale(case)
    ref = finish(case, torch_conv(x.double(), w.double(), None if b is None else b.double(),
                                  None if s is None else s.double(), kw), r)
    out_numel = ref.numel()
    epilogue = dict(activation=case.activation, negative_slope=slope(case), residual=r, scale=s) \
        if case.activation or case.residual or case.scale else {}
    # Twice: the first call packs the weights where its kernel does, the second reads that packing
    # (kernelgen/packs.py).
    for call in ("first", "second"):
        y = call_poisoned(lambda: kernelgen.conv2d(x, w, b, **kw, precision=case.precision, family=case.family,
                                                   tiles=dict(case.tiles) or None, **epilogue),
                          out_numel, x.dtype)
        torch.cuda.synchronize()
        assert y.shape == ref.shape and y.dtype == x.dtype and y.device == x.device
        assert torch.isfinite(y).all(), f"{call} call: unwritten (NaN-poisoned) or non-finite output elements"
        if y.dim() == 4:
            assert y.is_contiguous(memory_format=torch.channels_last) == expected.is_contiguous(
                memory_format=torch.channels_last), "output memory format differs from F.conv2d's"
        err = rel_err(y, ref)
        assert err <= tolerance(case, x, w, b, ref, r, s), f"{call} call: relative error {err:.3g}"


def test_no_fallbacks_happened():
    assert kernelgen.stats()["fallbacks"] == 0


def test_each_specialisation_compiles_once():
    x = torch.randn(2, 8, 20, 20, device="cuda")
    w = torch.randn(16, 8, 3, 3, device="cuda")
    kernelgen.conv2d(x, w, padding=1)
    before = kernelgen.stats()["compiles"]
    for _ in range(10):
        kernelgen.conv2d(x, w, padding=1)
    kernelgen.conv2d(torch.randn(5, 8, 33, 17, device="cuda"), w, padding=1)  # new sizes, same kernel
    assert kernelgen.stats()["compiles"] == before


@pytest.mark.parametrize("xshape,wshape,kw", [
    ((4, 64, 14, 14), (64, 64, 3, 3), dict(padding=1, family="nhwc")),  # NCHW through a workspace
    ((2, 64, 32, 32), (128, 64, 1, 1), dict(family="pointwise")),
    ((2, 32, 20, 20), (32, 1, 3, 3), dict(groups=32, padding=1, family="depthwise")),
])
@pytest.mark.parametrize("kind", ["strided", "expanded"])
def test_bias_that_is_not_contiguous(kind, xshape, wshape, kw):
    # The contiguous copy of such a bias must live until its launch: freed before it, its block
    # could become the call's workspace (tests/test_cpu_path.py has the CPU side).
    x = torch.randn(*xshape, device="cuda")
    w = torch.randn(*wshape, device="cuda")
    K = wshape[0]
    b = torch.randn(2 * K, device="cuda")[::2] if kind == "strided" else torch.randn(1, device="cuda").expand(K)
    ref = F.conv2d(x.double(), w.double(), b.double(), **{k: v for k, v in kw.items() if k != "family"})
    for _ in range(3):  # planning, then the plan
        y = call_poisoned(lambda: kernelgen.conv2d(x, w, b, precision="ieee", **kw), ref.numel(), x.dtype)
        assert rel_err(y, ref) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nhwc,K,k", [((4, 32, 32, 1), 16, 3), ((4, 32, 32, 1), 1, 3), ((8, 1, 1, 64), 32, 1),
                                      ((2, 16, 1, 24), 24, 1)])
def test_ambiguous_layouts_keep_f_conv2d_format(dtype, nhwc, K, k):
    # Views of NHWC buffers that are NCHW-dense too (one channel, 1 x 1 or 1-wide planes): torch
    # reads their strides as channels_last, so F.conv2d's output is channels_last, and so must
    # kernelgen's be (checks.is_channels_last; tests/test_random_calls.py on the CPU).
    x = torch.randn(*nhwc, device="cuda", dtype=dtype).permute(0, 3, 1, 2)
    w = torch.randn(K, x.shape[1], k, k, device="cuda", dtype=dtype)
    ref = F.conv2d(x.double(), w.double(), padding=k // 2)
    expected = F.conv2d(x, w, padding=k // 2)
    y = call_poisoned(lambda: kernelgen.conv2d(x, w, padding=k // 2, precision="ieee"), ref.numel(), dtype)
    assert y.is_contiguous(memory_format=torch.channels_last) == expected.is_contiguous(
        memory_format=torch.channels_last)
    assert y.stride() == expected.stride() or y.is_contiguous() == expected.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else max(1.5 * rel_err(expected, ref), 1e-3)
    assert rel_err(y, ref) <= tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_computes_in_the_region_dtype(dtype):
    # as F.conv2d under torch.autocast: float32 arguments cast to the region's dtype
    x = torch.randn(4, 32, 28, 28, device="cuda")
    w = torch.randn(64, 32, 3, 3, device="cuda")
    b = torch.randn(64, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        y = call_poisoned(lambda: kernelgen.conv2d(x, w, b, padding=1), 4 * 64 * 28 * 28, dtype)
        expected = F.conv2d(x, w, b, padding=1)
    assert y.dtype == expected.dtype == dtype
    xc, wc, bc = x.to(dtype), w.to(dtype), b.to(dtype)
    ref = F.conv2d(xc.double(), wc.double(), bc.double(), padding=1)
    assert rel_err(y, ref) <= max(1.5 * rel_err(expected, ref), 1e-3)


def test_torch_compile_runs_kernelgen_kernels():
    # kernelgen/compiled.py: one operator a call in the graph, computed by the eager path's kernels
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(kernelgen.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                            kernelgen.Conv2d(32, 32, 1), kernelgen.Conv2d(32, 32, 3, groups=32, padding=1)).cuda()
    x = torch.randn(4, 16, 24, 24, device="cuda")
    with torch.no_grad():
        eager = m(x)
        y = torch.compile(m, fullgraph=True)(x)
        xc = x.contiguous(memory_format=torch.channels_last)
        yc = torch.compile(m, fullgraph=True)(xc)
    assert rel_err(y, eager.double()) <= 1e-6  # (a split reduction's atomics may order sums differently)
    assert yc.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert rel_err(yc, m(xc).double()) <= 1e-6
    torch._dynamo.reset()


def test_current_stream_is_used():
    x = torch.randn(4, 16, 64, 64, device="cuda")
    w = torch.randn(32, 16, 3, 3, device="cuda")
    ref = F.conv2d(x.double(), w.double(), padding=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = kernelgen.conv2d(x, w, padding=1, precision="ieee")
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()  # waiting on the side stream alone must be enough
    assert rel_err(y, ref) <= 1e-5


def test_depthwise_planes_names_planes_past_shared_memory():
    # 64 forced planes of 64 x 64 float32 (1 MB) cannot be staged: the launch says so and names the tile
    x = torch.randn(2, 64, 64, 64, device="cuda")
    w = torch.randn(64, 1, 3, 3, device="cuda")
    with pytest.raises(RuntimeError, match=r"64 planes of 64 x 64 need \d+ bytes .*choose fewer planes"):
        kernelgen.conv2d(x, w, groups=64, padding=1, family="depthwise_planes", tiles={"planes": 64})
    y = kernelgen.conv2d(x, w, groups=64, padding=1, family="depthwise_planes", tiles={"planes": 2})
    assert rel_err(y, F.conv2d(x.double(), w.double(), groups=64, padding=1)) <= 1e-5


def test_cuda_graph_capture_and_replay():
    x = torch.randn(2, 8, 32, 32, device="cuda")
    w = torch.randn(16, 8, 3, 3, device="cuda")
    b = torch.randn(16, device="cuda")
    for _ in range(2):  # plan, compile and warm outside the capture
        kernelgen.conv2d(x, w, b, padding=1, precision="ieee")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernelgen.conv2d(x, w, b, padding=1, precision="ieee")
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        ref = F.conv2d(x.double(), w.double(), b.double(), padding=1)
        assert rel_err(y, ref) <= 1e-5


@pytest.mark.skipif(not HOPPER, reason="wgmma needs a compute-capability 9.0 GPU")
@pytest.mark.parametrize("family", ["wgmma", "nhwc_tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wgmma_graph_capture_and_side_stream(dtype, family):
    """wgmma and nhwc_tma allocate their packed-weight workspace per call (nhwc_tma also encodes
    its tensor maps on the host and copies a TF32 input): they must be capturable and follow the
    current stream like every other family."""
    x = torch.randn(2, 32, 20, 70, device="cuda", dtype=dtype)
    if family == "nhwc_tma":
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(128, 32, 3, 5, device="cuda", dtype=dtype)
    b = torch.randn(128, device="cuda", dtype=dtype)
    kw = dict(padding=1, family=family, precision="tf32" if dtype == torch.float32 else None)
    tol = 5e-3 if dtype == torch.float32 else 2e-2
    for _ in range(2):
        kernelgen.conv2d(x, w, b, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernelgen.conv2d(x, w, b, **kw)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w))  # weights are repacked on every replay
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, F.conv2d(x.double(), w.double(), b.double(), padding=1)) <= tol
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y2 = kernelgen.conv2d(x, w, b, **kw)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    assert rel_err(y2, F.conv2d(x.double(), w.double(), b.double(), padding=1)) <= tol


@pytest.mark.skipif(not HOPPER, reason="wgmma needs a compute-capability 9.0 GPU")
@pytest.mark.parametrize("kernel,channels", [((5, 7), 64), ((1, 1), 64), ((3, 3), 16)])
def test_wgmma_strict_float32_keeps_1e_5_on_one_signed_data(kernel, channels):
    """3xTF32 on wgmma with every operand positive: the tensor cores' truncating accumulation
    then biases every add the same way, the worst case for a long reduction (2240 products for
    5x7 over 64 channels, summed a stage at a time; 64 and 144 in one accumulator)."""
    g = torch.Generator().manual_seed(7)
    x = torch.rand(2, channels, 24, 140, generator=g).cuda()
    w = torch.rand(128, channels, *kernel, generator=g).cuda()
    spec, _ = spec_for(x, w, None, device="cuda", precision="ieee", family="wgmma")
    assert spec.math == "ieee" and get_family("wgmma").layout(spec)["SPLIT3"]
    y = kernelgen.conv2d(x, w, precision="ieee", family="wgmma")
    assert rel_err(y, F.conv2d(x.double(), w.double())) <= 1e-5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_second_device():
    x = torch.randn(2, 8, 24, 24, device="cuda:1")
    w = torch.randn(16, 8, 3, 3, device="cuda:1")
    y = kernelgen.conv2d(x, w, padding=1, precision="ieee")
    assert y.device == x.device
    assert rel_err(y, F.conv2d(x.double(), w.double(), padding=1)) <= 1e-5
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("dtype,channels_last", [(torch.float32, False), (torch.bfloat16, True),
                                                 (torch.float16, False)])
def test_weight_grad_through_wgrad_is_bit_identical(dtype, channels_last):
    """A weight gradient the selector sends to `wgrad` (a reduction of 73,728 terms an output, split
    between blocks) gives the same bits on every run, and in 16 bits an error against float64 no
    worse than 1.5x torch's own weight gradient's (its splits' float32 sums are short ones)."""
    from kernelgen import gradients
    from kernelgen.functional import observe_meta_calls

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    g = torch.Generator().manual_seed(11)
    x = torch.randn(8, 16, 96, 96, generator=g).to("cuda", dtype).contiguous(memory_format=fmt)
    dy = torch.randn(8, 32, 96, 96, generator=g).to("cuda", dtype).contiguous(memory_format=fmt)
    kw = dict(stride=1, padding=1, dilation=1, groups=1)
    planned = []

    def on_call(inp, w, b, st, pad, dil, grp, prec, family, tiles, **epi):
        planned.append(spec_for(inp, w, b, st, pad, dil, grp, device="cuda", precision=prec)[0].family)

    with observe_meta_calls(on_call):
        gradients.weight_grad(dy.to("meta"), x.to("meta"), (32, 16, 3, 3), **kw, precision="tf32")
    assert planned == ["wgrad"], planned
    runs = [gradients.weight_grad(dy, x, (32, 16, 3, 3), **kw, precision="tf32") for _ in range(3)]
    torch.cuda.synchronize()
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    assert all(torch.equal(r.view(bits), runs[0].view(bits)) for r in runs[1:])
    xd, wd = x.double().requires_grad_(), torch.zeros(32, 16, 3, 3, dtype=torch.float64, device="cuda")
    wd.requires_grad_()
    torch.nn.functional.conv2d(xd, wd, None, **kw).backward(dy.double())
    ref = wd.grad
    err = rel_err(runs[0], ref)
    if dtype == torch.float32:
        assert err <= 1e-2  # TF32
    else:
        xt, wt = x.clone().requires_grad_(), torch.zeros(32, 16, 3, 3, dtype=dtype, device="cuda", requires_grad=True)
        torch.nn.functional.conv2d(xt, wt, None, **kw).backward(dy)
        assert err <= 1.5 * rel_err(wt.grad, ref), (err, rel_err(wt.grad, ref))


@pytest.mark.parametrize("dtype,precision", [(torch.bfloat16, None), (torch.float16, None), (torch.float32, "tf32"),
                                             (torch.float32, "ieee"), (torch.float64, None)])
def test_wgrad_16_byte_loads_stage_the_element_paths_bits(dtype, precision):
    """wgrad's 16-byte loads stage the values its element path stages, so a call gives the same bits
    either way: one lowered weight gradient (channels_last x and dY: runs of Cg = 16 rows and O = 24
    columns from 16-byte boundaries) with x, dY, both or neither one element past a 16-byte boundary
    (the same strides; the launch then loads that operand element by element), each against the
    aligned call's bits, and that one within the sweep's accuracy rules against float64."""
    g = torch.Generator().manual_seed(17)
    Nb, Cg, O, H, W_, P, Q = 3, 16, 24, 13, 12, 11, 10
    x = torch.randn(Nb, Cg, H, W_, generator=g).to("cuda", dtype).contiguous(memory_format=torch.channels_last)
    dy = torch.randn(Nb, O, P, Q, generator=g).to("cuda", dtype).contiguous(memory_format=torch.channels_last)

    def shifted(t):  # the same values and strides, the data one element past a 16-byte boundary
        n, c, h, w = t.shape
        view = torch.empty(t.numel() + 1, device="cuda", dtype=dtype)[1:].view(n, h, w, c).permute(0, 3, 1, 2)
        return view.copy_(t)

    def lowered(xt, dyt):  # weight_grad's operands: x as (Cg, Nb, H, W), dY as (O, Nb, P, Q), views
        return xt.unflatten(1, (1, Cg)).permute(2, 1, 0, 3, 4).reshape(Cg, Nb, H, W_), dyt.transpose(0, 1)

    kw = dict(stride=(1, 2), padding=1, dilation=(1, 1), groups=1)
    tiles = dict(block_m=64, block_n=32, splits=3, dw_rows=0, groups_block=0)
    runs = {}
    for xa, da in ((True, True), (False, True), (True, False), (False, False)):
        xs, ws = lowered(x if xa else shifted(x), dy if da else shifted(dy))
        assert (xs.data_ptr() % 16 == 0) == xa and (ws.data_ptr() % 16 == 0) == da
        assert xs.stride() == (1, H * W_ * Cg, W_ * Cg, Cg) and ws.stride() == (1, P * Q * O, Q * O, O)
        runs[xa, da] = kernelgen.conv2d(xs, ws, None, **kw, precision=precision, family="wgrad", tiles=tiles)
    torch.cuda.synchronize()
    first = runs[True, True]
    assert torch.isfinite(first).all()
    for key, y in runs.items():
        assert torch.equal(y, first), f"x aligned {key[0]}, dY aligned {key[1]}: bits differ from the 16-byte path's"
    xs, ws = lowered(x, dy)
    ref = F.conv2d(xs.double(), ws.double(), None, **kw)
    case = Case(0, Cg, Nb, O, 1, (P, Q), kw["stride"], 1, kw["dilation"], False,
                {v: k for k, v in DTYPES.items()}[dtype], precision, "lowered_cl", H, W_, "wgrad")
    assert rel_err(first, ref) <= tolerance(case, xs, ws, None, ref)


MEMCHECK = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import torch, kernelgen
    from kernelgen.families import all_families
    EPILOGUE = {epilogue!r}  # every call with a fused epilogue: activations in turn, a residual
    calls = [0]
    def conv(x, w, b, times=1, **kw):
        if not EPILOGUE:
            for _ in range(times):
                kernelgen.conv2d(x, w, b, **kw)
            return
        # the residual: exactly the output's size (an overrun reads past it), with the output's
        # strides, channels_last's, or a strided view (the latter two handed to the kernel copied)
        meta = kernelgen.conv2d(x.to("meta"), w.to("meta"), None if b is None else b.to("meta"), **kw)
        i = calls[0] = calls[0] + 1
        shape = tuple(meta.shape)
        if i % 3 == 2:
            r = torch.randn(*shape[:-1], 2 * shape[-1], device="cuda", dtype=x.dtype)[..., ::2]
        else:
            r = torch.randn(*shape, device="cuda", dtype=x.dtype)
            if i % 3 == 1 and r.dim() == 4:
                r = r.contiguous(memory_format=torch.channels_last)
        act = kernelgen.ACTIVATIONS[i % len(kernelgen.ACTIVATIONS)]
        for _ in range(times):
            kernelgen.conv2d(x, w, b, activation=act, negative_slope=0.1, residual=r, **kw)
    def run(family, dtype, x_shape, w_shape, view=True, **kw):
        x = torch.randn(*x_shape, device="cuda", dtype=dtype)
        if view:
            x = x[..., 1:]  # an offset view: unaligned rows
        w = torch.randn(*w_shape, device="cuda", dtype=dtype)
        b = torch.randn(w_shape[0], device="cuda", dtype=dtype)
        conv(x, w, b, times=2, family=family, **kw)  # (the second call reads the weights the first packed)
    def run_cl(dtype, x_shape, w_shape, offset, family="nhwc", **kw):
        # channels_last input, its data `offset` elements past an allocation's start
        n, c, h, w_ = x_shape
        x = torch.randn(n * h * w_ * c + offset, device="cuda", dtype=dtype)[offset:]
        x = x.view(n, h, w_, c).permute(0, 3, 1, 2)
        w = torch.randn(*w_shape, device="cuda", dtype=dtype)
        b = torch.randn(w_shape[0], device="cuda", dtype=dtype)
        conv(x, w, b, times=2, family=family, **kw)
    fams = {{name: fam for name, fam in all_families().items() if name in {families!r}}}
    for dtype in (torch.float32, torch.bfloat16):
        if "direct" in fams:
            run("direct", dtype, (2, 8, 19, 24), (16, 4, 3, 5), groups=2, stride=2, padding=1)
        if "gemv" in fams:  # 16-byte and element-wise loads, both reduction orders, ragged tiles
            for offset in (0, 1):
                run_cl(dtype, (3, 64, 1, 1), (30, 64, 1, 1), offset, family="gemv")
                run_cl(dtype, (2, 48, 5, 6), (20, 24, 3, 3), offset, family="gemv", groups=2, padding=1,
                       stride=(2, 1), tiles={{"block_co": 8, "block_px": 4, "warps": 2}})
            run("gemv", dtype, (2, 40, 7, 9), (19, 40, 3, 3), padding=(1, 2), dilation=2)
            run("gemv", dtype, (5, 96, 1, 1), (200, 96, 1, 1), view=False, tiles={{"block_co": 16, "block_px": 2}})
        if "nhwc" in fams:  # ragged pixel and channel tiles, both input paths, groups, 3xTF32
            for offset in (0, 1):
                run_cl(dtype, (3, 16, 11, 13), (30, 16, 3, 3), offset, padding=1, stride=(1, 2))
                run_cl(dtype, (2, 32, 9, 10), (68, 16, 1, 1), offset, groups=2)
            if dtype == torch.float32:
                run_cl(dtype, (2, 24, 9, 10), (32, 24, 3, 3), 0, padding=(0, 2), precision="ieee")
            # NCHW: the input transpose (ragged tiles of channels and pixels) and the NCHW epilogue
            run("nhwc", dtype, (3, 40, 9, 12), (34, 40, 3, 3), padding=1)
            run("nhwc", dtype, (2, 16, 7, 8), (64, 8, 1, 1), groups=2, stride=2)
            # wgmma (rows of 8 chunks) where the GPU has it: TF32's rounded copy (3x3) and its
            # rounding in shared memory (1x1 stride 2), 16-bit, a misaligned input
            if torch.cuda.get_device_capability() == (9, 0):
                for offset in (0, 1):
                    run_cl(dtype, (2, 64, 9, 10), (66, 64, 3, 3), offset, padding=1)
                    run_cl(dtype, (3, 64, 11, 9), (34, 64, 1, 1), offset, stride=2)
        if "stem_nhwc" in fams:
            # the staged tile (whole vectors) and stores from the fragments (67 channels), windows
            # past every edge, tiles past the last row and column, an input off a 16-byte boundary,
            # an NCHW input that its channels_last weight makes a channels_last call, 3xTF32
            for offset in (0, 1):
                run_cl(dtype, (2, 3, 19, 23), (64, 3, 7, 7), offset, family="stem_nhwc", stride=2, padding=3)
            run_cl(dtype, (3, 5, 13, 17), (67, 5, 3, 3), 0, family="stem_nhwc", padding=1, stride=(1, 2))
            x = torch.randn(2, 4, 21, 15, device="cuda", dtype=dtype)
            w = torch.randn(40, 4, 3, 3, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
            conv(x, w, None, family="stem_nhwc", padding=1)
            if dtype == torch.float32:
                run_cl(dtype, (2, 3, 19, 23), (64, 3, 7, 7), 0, family="stem_nhwc", stride=2, padding=3,
                       precision="ieee")
        if "nhwc_tma" in fams and torch.cuda.get_device_capability() == (9, 0):
            # the TMA reading the input where it lies (16-bit) or a copy (TF32, a misaligned start),
            # ragged pixel and channel tiles, the pixel tile past the last image; NCHW through the
            # transpose, with an odd plane (pixels stored one by one) and an even one (pairs)
            for offset in (0, 1):
                run_cl(dtype, (3, 32, 11, 13), (72, 32, 3, 3), offset, family="nhwc_tma", padding=1, stride=(1, 2))
            run_cl(dtype, (2, 64, 9, 10), (136, 64, 3, 3), 0, family="nhwc_tma", padding=1,
                   tiles={{"block_co": 128, "block_p": 256, "wgn": 2, "stages": 3}})
            if dtype == torch.float32:  # 64-channel tiles: TF32 rounded by warps in shared memory
                run_cl(dtype, (2, 16, 9, 11), (64, 16, 3, 3), 0, family="nhwc_tma", padding=1)
            run("nhwc_tma", dtype, (3, 40, 9, 12), (40, 40, 3, 3), padding=1)
            run("nhwc_tma", dtype, (2, 16, 8, 10), (24, 16, 3, 3), view=False, padding=(1, 0))
            # persistent blocks that walk more than one tile: their own staging, and resident
            # weights in two pipelines (16-bit) or one deep one (TF32)
            walk = (4, 64, 100, 100)
            run_cl(dtype, walk, (64, 64, 3, 3), 0, family="nhwc_tma", padding=1, tiles={{"persist": 1}})
            if dtype == torch.float32:
                run_cl(dtype, (4, 32, 100, 100), (40, 32, 3, 3), 0, family="nhwc_tma", padding=1,
                       tiles={{"persist": 1, "wres": 1, "stages": 4, "min_blocks": 1, "round_smem": 0}})
            else:
                run_cl(dtype, walk, (40, 64, 3, 3), 0, family="nhwc_tma", padding=1,
                       tiles={{"persist": 1, "wres": 1, "pipes": 2, "stages": 3, "min_blocks": 1}})
                run("nhwc_tma", dtype, walk, (64, 64, 3, 3), padding=1,
                    tiles={{"persist": 1, "wres": 1, "pipes": 2, "stages": 3, "min_blocks": 1}})
            # halo tiles: windows past every edge, a row's last tile partial, blocks that walk
            # tiles; the weights' ring (TF32, 128 output channels) and resident weights (16-bit)
            halo = {{"halo": 1, "persist": 1, "stages": 2, "min_blocks": 1}}
            run_cl(dtype, (3, 64, 20, 130), (64, 64, 3, 3), 0, family="nhwc_tma", padding=1,
                   tiles={{**halo, "wres": int(dtype != torch.float32)}})
            run_cl(dtype, (2, 32, 12, 70), (128, 32, 3, 3), 0, family="nhwc_tma", padding=(2, 1),
                   tiles={{**halo, "block_co": 128, "block_p": 64}})
            run("nhwc_tma", dtype, (2, 64, 9, 60), (64, 64, 3, 3), padding=1, tiles={{**halo, "block_p": 64}})
            # a_regs tiles (fragments loaded into registers, each warp's rows staged apart from the
            # ring): blocks that walk to a last tile of a few pixels, ragged output channels, a
            # strided 1x1 from an input copied first (offset 1), halo windows
            run_cl(dtype, (3, 48, 13, 17), (136, 48, 3, 3), 0, family="nhwc_tma", padding=1,
                   tiles={{"a_regs": 1, "persist": 1}})
            run_cl(dtype, (2, 64, 9, 11), (72, 64, 1, 1), 1, family="nhwc_tma", stride=2,
                   tiles={{"a_regs": 1, "block_p": 64}})
            run_cl(dtype, (2, 32, 12, 70), (64, 32, 3, 3), 0, family="nhwc_tma", padding=1,
                   tiles={{**halo, "a_regs": 1, "block_p": 64}})
            # short 1x1 layers' default tiles (short_1x1): walking blocks of 256 output channels
            # (16-bit; TF32 on a_regs), 144 of them, a last pixel tile of a few pixels; 64 outputs
            # (16-bit resident weights, TF32 rounding warps)
            run_cl(dtype, (3, 24, 11, 13), (144, 24, 1, 1), 0, family="nhwc_tma")
            run_cl(dtype, (3, 144, 11, 13), (24, 144, 1, 1), 0, family="nhwc_tma")
            # split reductions: the partial sums' workspace past the input's copy, a last pixel tile
            # of a few pixels, output channels past the last block; both orientations, NCHW
            run_cl(dtype, (3, 64, 7, 9), (136, 64, 3, 3), 0, family="nhwc_tma", padding=1, tiles={{"splits": 3}})
            run_cl(dtype, (3, 64, 7, 9), (72, 64, 3, 3), 1, family="nhwc_tma", padding=1,
                   tiles={{"splits": 3, "a_regs": 0}})
            run("nhwc_tma", dtype, (3, 64, 7, 10), (72, 64, 3, 3), padding=1, tiles={{"splits": 3}})
            # weights read where they lie (16-bit, channels_last and whole k-tiles of channels)
            x = torch.randn(2, 64, 9, 11, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
            w = torch.randn(72, 64, 3, 3, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
            conv(x, w, None, family="nhwc_tma", padding=1)
        if "pointwise_tma" in fams and torch.cuda.get_device_capability() == (9, 0):
            # the input read where it lies, from an aligned start and one element past one; a
            # plane's partial last tile, output channels past the last whole block, resident
            # weights and the weights' ring
            for offset in (0, 1):
                x = torch.randn(2 * 48 * 20 * 20 + offset, device="cuda", dtype=dtype)[offset:].view(2, 48, 20, 20)
                w = torch.randn(80, 48, 1, 1, device="cuda", dtype=dtype)
                conv(x, w, torch.randn(80, device="cuda", dtype=dtype), family="pointwise_tma")
            run("pointwise_tma", dtype, (3, 256, 6, 12), (136, 256, 1, 1), view=False,
                tiles={{"wres": 0, "stages": 2}})
            # split reductions: each split's partial sums at the workspace's end (9 float32 k-tiles in
            # 3, 5 bf16 ones 2 + 2 + 1), a plane's partial last tile, output channels past the last
            # block, the final pass's last quad of pixels; an offset view (copied first)
            run("pointwise_tma", dtype, (3, 264, 6, 12), (136, 264, 1, 1), view=False, tiles={{"splits": 3}})
            run("pointwise_tma", dtype, (1, 264, 8, 17), (72, 264, 1, 1), tiles={{"splits": 2}})
        if "depthwise_planes" in fams:
            # whole planes a block: runs that start past a 16-byte boundary (two planes of 49), an
            # input that ends inside a vector (735 elements: the last ones loaded one by one), a
            # partial last chunk, a multiplier, the element path (an offset view), 65 KB of shared
            # memory (64 planes of 16 x 16)
            run("depthwise_planes", dtype, (3, 5, 7, 7), (10, 1, 3, 3), view=False, groups=5, padding=1,
                tiles={{"planes": 2, "threads": 64}})
            run("depthwise_planes", dtype, (3, 5, 7, 8), (5, 1, 3, 3), groups=5, stride=2, padding=(1, 2))
            run("depthwise_planes", dtype, (2, 40, 16, 16), (40, 1, 5, 5), view=False, groups=40, padding=2,
                tiles={{"planes": 64, "threads": 256}})
        if "wgrad" in fams:
            # a weight gradient's own operands (NCHW and channels_last x and dY, transposed views):
            # rows, columns and k past the last whole tile, windows past every edge, empty splits
            for fmt in (torch.contiguous_format, torch.channels_last):
                xo = torch.randn(3, 10, 13, 11, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
                dy = torch.randn(3, 20, 7, 6, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
                xs = xo.unflatten(1, (2, 5)).permute(2, 1, 0, 3, 4).reshape(5, 6, 13, 11)
                conv(xs, dy.transpose(0, 1), None, times=2, family="wgrad", stride=2, padding=1, groups=2,
                     dilation=(2, 2), tiles={{"splits": 3}})
                conv(xs, dy.transpose(0, 1), None, family="wgrad", stride=2, padding=1, groups=2,
                     dilation=(2, 2), tiles={{"splits": 96, "block_m": 128}})
            # the 16-byte loads: channels_last x of 16 channels (runs of 8 or 4 rows, windows past every
            # edge, rows past the last whole tile) and dY of 24 (whole runs past the group's channels)
            xo = torch.randn(3, 16, 13, 11, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
            dy = torch.randn(3, 24, 7, 6, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
            xs = xo.unflatten(1, (1, 16)).permute(2, 1, 0, 3, 4).reshape(16, 3, 13, 11)
            for t in ({{"block_n": 16, "splits": 3}}, {{"block_m": 128, "block_n": 64, "splits": 96}}):
                conv(xs, dy.transpose(0, 1), None, family="wgrad", stride=2, padding=1, dilation=(2, 2), tiles=t)
            run("wgrad", dtype, (2, 12, 9, 10), (20, 4, 3, 3), groups=3, padding=(1, 2), tiles={{"block_n": 16}})
            run_cl(dtype, (2, 16, 9, 10), (40, 16, 3, 3), 1, family="wgrad", padding=1, tiles={{"splits": 2}})
        if "depthwise" in fams:
            run("depthwise", dtype, (2, 8, 19, 24), (16, 1, 3, 3), groups=8, padding=1)
            run("depthwise", dtype, (2, 8, 19, 24), (8, 1, 3, 1), groups=8)
        if "depthwise_nhwc" in fams:  # vector and element-wise paths, ragged channel tiles and strips
            for offset in (0, 1):
                run_cl(dtype, (2, 24, 9, 11), (48, 1, 3, 3), offset, family="depthwise_nhwc", groups=24,
                       padding=1)
                run_cl(dtype, (3, 36, 10, 7), (36, 1, 5, 3), offset, family="depthwise_nhwc", groups=36,
                       stride=(2, 1), padding=(2, 0), tiles={{"vec_q": 8, "rows": 2}})
        if "grouped_nhwc" in fams:  # 16-byte and 8-byte runs of input, element-wise, ragged tiles
            for offset in (0, 1):
                run_cl(dtype, (2, 32, 9, 11), (32, 4, 3, 3), offset, family="grouped_nhwc", groups=8, padding=1)
                run_cl(dtype, (3, 36, 10, 7), (24, 6, 3, 1), offset, family="grouped_nhwc", groups=6,
                       stride=(2, 1), padding=(1, 0), tiles={{"block_c": 2, "vec_q": 8, "rows": 1}})
            # NCHW: the input transpose, runs of pixels into whole-strip planes (12 columns) and
            # element by element (an offset view's 11)
            run("grouped_nhwc", dtype, (2, 32, 9, 12), (32, 4, 3, 3), view=False, groups=8, padding=1)
            run("grouped_nhwc", dtype, (3, 36, 10, 12), (24, 6, 3, 1), groups=6, stride=(2, 1))
        if "grouped_mma" in fams:  # the window's 16-byte copies and element loads (offset 1), a
            # block of groups past the last, tiles past the last row and column, 8-channel warps;
            # NCHW read in place from an offset view (element-wise rows out) and from a dense
            # tensor (16-byte runs of rows out, a tile past the last row), and through the transpose
            for offset in (0, 1):
                run_cl(dtype, (2, 80, 9, 11), (80, 16, 3, 3), offset, family="grouped_mma", groups=5, padding=1,
                       tiles={{"groups_block": 2, "block_p": 4, "block_q": 5}})
            run_cl(dtype, (3, 64, 10, 7), (128, 32, 3, 1), 0, family="grouped_mma", groups=2, stride=(2, 1),
                   padding=(1, 0), tiles={{"warp_n": 8, "m_tiles": 1}})
            run("grouped_mma", dtype, (2, 64, 9, 12), (64, 16, 3, 3), groups=4, padding=1)
            run("grouped_mma", dtype, (2, 80, 11, 16), (80, 16, 3, 3), view=False, groups=5, padding=1,
                tiles={{"groups_block": 2, "block_p": 4, "block_q": 8}})
            run("grouped_mma", dtype, (2, 64, 9, 12), (64, 16, 3, 3), groups=4, padding=1, tiles={{"transpose": 1}})
        if "depthwise_nhwc" in fams:  # NCHW: the transpose, runs of pixels, element-wise input
            run("depthwise_nhwc", dtype, (2, 24, 9, 12), (48, 1, 3, 3), view=False, groups=24, padding=1)
            run("depthwise_nhwc", dtype, (2, 24, 9, 12), (72, 1, 3, 3), groups=24, padding=1)
        staged = dict(tiles={{"stage_out": 1, "min_blocks": 1}})
        if "pointwise_tile" in fams and dtype == torch.float32:  # 16-byte and 4-byte paths, cut tiles and blocks
            run("pointwise_tile", dtype, (2, 64, 16, 40), (136, 64, 1, 1))
            run("pointwise_tile", dtype, (2, 13, 19, 25), (40, 13, 1, 1))
        if "pointwise" in fams:
            run("pointwise", dtype, (2, 32, 19, 24), (48, 32, 1, 1))
            run("pointwise", dtype, (2, 32, 19, 25), (48, 32, 1, 1), **staged)
        if "igemm" in fams:
            run("igemm", dtype, (2, 16, 19, 24), (40, 16, 3, 3), padding=1)
            run("igemm", dtype, (2, 16, 19, 24), (24, 16, 5, 7), stride=(2, 1))
            run("igemm", dtype, (2, 16, 19, 70), (40, 16, 3, 3), padding=1, **staged)
            run("igemm", dtype, (2, 16, 19, 24), (24, 16, 5, 7), stride=(2, 1), **staged)
        if "wgmma" in fams and torch.cuda.get_device_capability() == (9, 0):
            prec = dict(precision="tf32") if dtype == torch.float32 else {{}}
            run("wgmma", dtype, (2, 16, 19, 70), (64, 16, 3, 3), padding=1, **prec)
            run("wgmma", dtype, (2, 16, 19, 70), (64, 16, 3, 3), padding=1, tiles={{"stage_out": 0}}, **prec)
            run("wgmma", dtype, (2, 16, 19, 133), (64, 16, 3, 3), **prec)  # rows 8 bytes off, a 2-column tile
            run("wgmma", dtype, (2, 48, 13, 40), (128, 48, 5, 7), stride=(2, 1), padding=(2, 0), **prec)
            run("wgmma", dtype, (2, 64, 9, 33), (192, 32, 1, 1), groups=2, **prec)
            # Several stages a tile through the producer, 16-byte loads (aligned rows; float32: two
            # sets of them), a partial channel chunk, and 1 x 256 tiles (the register split).
            # Output staged in the ring's held slots (the default) and stored from the fragments.
            for so in (1, 0):
                run("wgmma", dtype, (2, 40, 9, 264), (128, 40, 5, 7), view=False, padding=(2, 0),
                    tiles={{"tile_p": 1, "tile_q": 256, "stage_out": so}}, **prec)
            # Whole lines (4 output rows a block or more): bf16 with two sets of groups, TF32 with
            # its weights in registers.
            lines = dict(tiles={{"a_regs": 1, "nbuf": 4, "strip": 0}}) if dtype == torch.float32 else {{}}
            run("wgmma", dtype, (1, 16, 560, 264), (128, 16, 3, 3), view=False, **lines, **prec)
            # Two accumulator sets (acc2=1): whole lines (bf16), paced strips and 3xTF32 (float32).
            if dtype == torch.float32:
                run("wgmma", dtype, (2, 16, 40, 262), (64, 16, 3, 3), view=False, precision="tf32",
                    tiles={{"strip": 1, "nbuf": 7, "acc2": 1}})
                run("wgmma", dtype, (2, 16, 19, 70), (128, 16, 3, 3), padding=1, precision="ieee", tiles={{"acc2": 1}})
            else:
                run("wgmma", dtype, (1, 16, 560, 264), (128, 16, 3, 3), view=False, tiles={{"acc2": 1}}, **prec)
            if dtype == torch.float32:  # TF32 strips: rows off sectors (paced), on them, a strided view
                strip = dict(tiles={{"strip": 1, "nbuf": 5}}, precision="tf32")
                run("wgmma", dtype, (2, 16, 40, 262), (64, 16, 3, 3), view=False, **strip)
                run("wgmma", dtype, (2, 16, 40, 256), (128, 16, 3, 3), view=False, padding=1, **strip)
                run("wgmma", dtype, (3, 8, 21, 130), (64, 8, 3, 3), stride=(2, 1), **strip)
            if dtype == torch.float32:  # 3xTF32: one stage (weight pairs resident), and per-stage sums
                run("wgmma", dtype, (2, 16, 19, 70), (64, 16, 3, 3), padding=1, precision="ieee")
                run("wgmma", dtype, (2, 40, 9, 264), (128, 40, 5, 7), view=False, padding=(2, 0),
                    precision="ieee")
    torch.cuda.synchronize()
    print("memcheck script done")
""")


# The script's families in two parts of about four minutes each on the H100, so that each fits a
# device call of its own (benchmarks/gpu_all.sh tests-memcheck1, tests-memcheck2).
MEMCHECK_PARTS = {"part1": ("direct", "gemv", "nhwc", "nhwc_tma", "pointwise_tma", "pointwise_tile", "stem_nhwc",
                            "wgrad"),
                  "part2": ("depthwise", "depthwise_planes", "depthwise_nhwc", "grouped_nhwc", "grouped_mma", "pointwise", "igemm",
                            "wgmma")}


def test_memcheck_parts_cover_every_family():
    from kernelgen.families import all_families

    covered = [name for part in MEMCHECK_PARTS.values() for name in part]
    assert sorted(covered) == sorted(n for n, f in all_families().items() if f.device == "cuda")


@pytest.mark.skipif(not os.path.exists("/usr/local/cuda/bin/compute-sanitizer")
                    and subprocess.run(["which", "compute-sanitizer"], capture_output=True).returncode,
                    reason="compute-sanitizer not found")
@pytest.mark.parametrize("part", sorted(MEMCHECK_PARTS))
def test_compute_sanitizer_memcheck_is_clean(part, tmp_path):
    _memcheck(tmp_path, MEMCHECK_PARTS[part], epilogue=False)


@pytest.mark.skipif(not os.path.exists("/usr/local/cuda/bin/compute-sanitizer")
                    and subprocess.run(["which", "compute-sanitizer"], capture_output=True).returncode,
                    reason="compute-sanitizer not found")
@pytest.mark.parametrize("part", sorted(MEMCHECK_PARTS))
def test_compute_sanitizer_memcheck_with_epilogues_is_clean(part, tmp_path):
    """The same calls, each with a fused epilogue: the residual read at every store path's offsets
    (benchmarks/gpu_all.sh tests-memcheck-epilogue)."""
    _memcheck(tmp_path, MEMCHECK_PARTS[part], epilogue=True)


def _memcheck(tmp_path, families, epilogue: bool):
    script = tmp_path / "memcheck.py"
    script.write_text(MEMCHECK.format(repo=str(REPO), families=families, epilogue=epilogue))
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")  # exact allocations, so overruns are seen
    sanitizer = "compute-sanitizer" if subprocess.run(["which", "compute-sanitizer"], capture_output=True).returncode == 0 \
        else "/usr/local/cuda/bin/compute-sanitizer"
    r = subprocess.run([sanitizer, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, str(script)],
                       capture_output=True, text=True, env=env, timeout=900)
    out = r.stdout + r.stderr
    # the first report names the kernel and the access; the tail says how the script ended
    first = out.find("========= Invalid")
    if first < 0:
        first = max(out.find("========="), 0)
    assert r.returncode == 0 and "memcheck script done" in r.stdout, out[first:first + 4000] + "\n[...]\n" + out[-3000:]
    assert "ERROR SUMMARY: 0 errors" in out, out[first:first + 4000]
