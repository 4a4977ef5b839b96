"""A convolution whose every output's reduction is spread over the threads of a block.

For layers with few outputs and long reductions: the 1x1 layers of squeeze-excitation blocks
(one pixel an image), small planes at batch 1, narrow outputs of wide inputs. There a family
that gives each tile whole outputs launches a handful of blocks on a GPU of a hundred SMs; this
one launches a block per few output channels and pixels, and its warps share their reduction.
It serves every spec (any kernel, stride, padding, dilation, groups, dtype and strides), in
exact float32 for float32. Whether it should run a call is the selector's to decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from ..errors import Unsupported
from .base import Family, pow2_at_most, target

if TYPE_CHECKING:  # pragma: no cover
    from ..spec import ConvSpec, Problem

MAX_SUMS = 32  # partial sums a thread keeps (block_co x block_px): registers, not spills

# How much faster than DRAM a re-read from L2 is, roughly: a block reads its pixels' inputs once
# for each tile of output channels, and its channels' weights once for each tile of pixels.
L2_OVER_DRAM = 3.0
LOAD_FMAS = 4  # an SM issues four FMAs for each load (128 and 32 a cycle)


def _vec(dtype: str) -> int:
    """Elements of one 16-byte load."""
    return 16 // {"float64": 8, "float32": 4}.get(dtype, 2)


def _loads(spec: "ConvSpec") -> int:
    """Loads of one output's reduction: 16 bytes each where the input channels of a group are
    whole 16-byte loads (and the call's strides allow, which the launcher decides), else one
    element each."""
    kh, kw = spec.kernel_size
    vec = _vec(spec.dtype)
    return spec.cin_per_group * kh * kw // (vec if spec.cin_per_group % vec == 0 else 1)


@dataclass(frozen=True)
class GemvFamily(Family):
    def check_shape(self, spec: "ConvSpec", device) -> None:
        t = dict(spec.tiles)
        if t["block_co"] * t["block_px"] > MAX_SUMS:
            raise Unsupported(f"gemv keeps at most {MAX_SUMS} sums a thread (block_co x block_px = "
                              f"{t['block_co']} x {t['block_px']})")

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        return {"VEC_OK": spec.cin_per_group % _vec(spec.dtype) == 0}

    def default_tiles(self, spec: "ConvSpec", problem: "Problem",
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Warps by the loads of the reduction (a thread's each); pixels by the call's (up to 8); then as many output
        channels as the sums allow, halved while the blocks would not fill the GPU twice."""
        fixed = dict(fixed or {})
        pixels = problem.N * problem.P * problem.Q
        loads = _loads(spec)
        warps = fixed.get("warps", 8 if loads >= 256 else 4 if loads >= 128 else 2)
        px = fixed.get("block_px", min(8, 1 << max(pixels - 1, 0).bit_length()))  # pixels, rounded up to 2^k
        if "block_co" in fixed:
            co = fixed["block_co"]
        else:
            co = pow2_at_most(spec.cout_per_group, min(16, max(MAX_SUMS // px, 1)))
            slots = 2 * target(problem.device).sms
            while co > 1 and self._blocks(spec, pixels, co, px) < slots:
                co //= 2
        return {"block_co": co, "block_px": px, "warps": warps}

    @staticmethod
    def _blocks(spec: "ConvSpec", pixels: int, co: int, px: int) -> int:
        return -(-spec.cout_per_group // co) * spec.groups * -(-pixels // px)

    def tiles_of(self, spec: "ConvSpec", problem: "Problem") -> int:
        t = dict(spec.tiles)
        return self._blocks(spec, problem.N * problem.P * problem.Q, t["block_co"], t["block_px"])

    def work(self, spec: "ConvSpec", problem: "Problem") -> float:
        """Flops its threads spend, idle lanes and loads included: every thread of every block takes
        whole passes over the reduction, each pass loading block_co weights and block_px inputs
        (a load issues at a quarter of the FMA rate, and element-wise ones gather twice the
        sectors), then sums its block_co x block_px partial sums with the block (about six steps
        each)."""
        t = dict(spec.tiles)
        threads = 32 * t["warps"]
        passes = -(-_loads(spec) // threads)
        vec = _vec(spec.dtype) if spec.cin_per_group % _vec(spec.dtype) == 0 else 1
        sums = t["block_co"] * t["block_px"]
        load_cost = LOAD_FMAS * (1 if vec > 1 else 2) * (t["block_co"] + t["block_px"])
        return 2.0 * self.tiles_of(spec, problem) * threads * (passes * (sums * vec + load_cost) + 6 * sums)

    def traffic(self, spec: "ConvSpec", problem: "Problem") -> float:
        """DRAM bytes once (Family.traffic), plus the re-reads from L2 at their relative cost: the
        input once for each tile of output channels, the weights once for each tile of pixels."""
        from ..spec import ELEMENT_BYTES

        t = dict(spec.tiles)
        kh, kw = spec.kernel_size
        x = problem.N * spec.in_channels * problem.H * problem.W
        w = spec.out_channels * spec.cin_per_group * kh * kw
        co_tiles = -(-spec.cout_per_group // t["block_co"])
        px_tiles = -(-problem.N * problem.P * problem.Q // t["block_px"])
        rereads = (x * (co_tiles - 1) + w * (px_tiles - 1)) * ELEMENT_BYTES[spec.dtype] / L2_OVER_DRAM
        return super().traffic(spec, problem) + rereads


gemv = GemvFamily(
    name="gemv", device="cuda", template="cuda/gemv.cu.j2", layouts=("any",),
    dtypes=("float32", "float16", "bfloat16", "float64"),
    tiles={"block_co": (1, 2, 4, 8, 16), "block_px": (1, 2, 4, 8), "warps": (2, 4, 8)},
    wide_weights=True, engine="fma", epilogue=True, scale=True,
)

FAMILIES = (gemv,)
