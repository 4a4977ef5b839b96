"""The general CUDA family: a shared-memory tiled direct convolution.

It serves every spec (any kernel, stride, padding, dilation, groups, dtype, and any
strides), so every CUDA call has at least one candidate. Halo tiles and weights are
staged in shared memory when they fit in 40 KB (below the 48 KB a block gets without
opting in); otherwise the kernel reads them through the cache instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Family, pow2_at_most

SMEM_BUDGET = 40 * 1024

_ACC_BYTES = {"float64": 8}


@dataclass(frozen=True)
class DirectFamily(Family):
    def smem_bytes(self, spec, which: str) -> int:
        t = dict(spec.tiles)
        (kh, kw), (sh, sw), (dh, dw) = spec.kernel_size, spec.stride, spec.dilation
        acc = _ACC_BYTES.get(spec.dtype, 4)
        w = t["cout_tile"] * t["cin_chunk"] * kh * kw * acc
        if which == "w":
            return w
        th = (t["block_p"] - 1) * sh + (kh - 1) * dh + 1
        tw = (t["block_q"] - 1) * sw + (kw - 1) * dw + 1
        return t["cin_chunk"] * th * tw * acc

    def context(self, spec) -> dict[str, object]:
        w_bytes = self.smem_bytes(spec, "w")
        w_smem = w_bytes <= SMEM_BUDGET // 2
        x_budget = SMEM_BUDGET - (w_bytes if w_smem else 0)
        return {"W_SMEM": w_smem, "X_SMEM": self.smem_bytes(spec, "x") <= x_budget}

    def default_tiles(self, spec, problem,
                      fixed: "Mapping[str, int] | None" = None) -> dict[str, int]:
        """Small outputs get small tiles (fewer idle threads); channels tile up to 8x4.

        block_q follows the output width (coalesced row segments), block_p makes the
        block 128-256 threads; cout_tile reuses each staged input value for up to 8
        output channels; cin_chunk stages up to 4 input channels per barrier.
        """
        block_q = 32 if problem.Q >= 32 else 16 if problem.Q >= 16 else 8
        block_p = 8 if problem.P >= 8 else 4
        tiles = {"block_p": block_p, "block_q": block_q,
                 "cout_tile": pow2_at_most(spec.cout_per_group, 8),
                 "cin_chunk": pow2_at_most(spec.cin_per_group, 4)}
        return tiles


direct = DirectFamily(
    name="direct", device="cuda", template="cuda/direct.cu.j2", layouts=("any",),
    dtypes=("float32", "float16", "bfloat16", "float64"),
    tiles={"block_p": (4, 8, 16), "block_q": (8, 16, 32), "cout_tile": (1, 2, 4, 8, 16),
           "cin_chunk": (1, 2, 4, 8)},
    wide_weights=True, epilogue=True, scale=True,
)

FAMILIES = (direct,)
