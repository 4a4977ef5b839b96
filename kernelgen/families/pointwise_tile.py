"""`pointwise_tile`: 1x1 convolutions of NCHW float32 inputs in TF32, one block a tile.

Each block computes one tile of 128 output channels x 128 pixels of one image's plane
(templates/cuda/pointwise_tile.cu.j2): it copies the tile's input rows and the weights' rows
into shared memory by cp.async, runs mma.sync m16n8k8 TF32 on 4 warps, stages the tile over
its operands and stores whole 512-byte rows; two blocks share an SM. This is cuDNN's structure
for case 87 (CUTLASS's s1688gemm_128x128_32x3), where `pointwise`'s persistent blocks walk the
tiles. The weights are rounded to TF32 once a call into the workspace, then read through L1
(cp.async.ca), where they stay from one tile to the next.

Why it exists: on case 87 the bytes move faster with one block a tile than with the persistent
walk, and cuDNN computes 87 about as fast as they move; this structure, with the weights read
through L1, comes within a fraction of a percent of that movement (measured: docs/selection.md,
pointwise_tile).

It serves groups of one, 1x1 kernels at stride 1 without padding, 1-64 input channels
(rounded up to whole k-steps of 8 with zeros) and any number of output channels (blocks of
128, the last one cut), on dense planes of any size (the last tile cut; 4-byte copies and
stores where the planes or the tensors do not start on 16-byte boundaries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import Unsupported
from .base import Family, check_dense_1x1

if TYPE_CHECKING:  # pragma: no cover
    from ..device import Device
    from ..spec import ConvSpec

BP = 128      # pixels a tile
MAX_CIN = 64  # the whole reduction in one stage of shared memory


def _layout(spec: "ConvSpec") -> dict[str, int]:
    """Output channels a tile (BM): 128, or 64 for layers of up to 64 (a tile half as tall, with
    half the accumulators, so that four blocks share an SM); input channels rounded up to whole
    k-steps (CINP); blocks of output channels (MB); shared memory, where the staged tile overlays
    the operands."""
    bm = 64 if spec.out_channels <= 64 else 128
    cinp = -(-spec.in_channels // 8) * 8
    operands = 4 * (bm * (cinp + 4) + cinp * (BP + 8))
    staged = 4 * bm * (BP + 8)
    return {"BM": bm, "CINP": cinp, "MB": -(-spec.out_channels // bm), "SMEM_BYTES": max(operands, staged)}


@dataclass(frozen=True)
class PointwiseTileFamily(Family):
    def check_shape(self, spec: "ConvSpec", device: "Device") -> None:
        check_dense_1x1(self.name, spec)
        if spec.math != "tf32":
            raise Unsupported("pointwise_tile computes in TF32 (strict float32 needs 3xTF32, which wgmma runs)")
        if spec.in_channels > MAX_CIN:
            raise Unsupported(f"pointwise_tile holds at most {MAX_CIN} input channels in one stage "
                              f"(got {spec.in_channels})")
        if _layout(spec)["SMEM_BYTES"] > device.smem_block:
            raise Unsupported(f"pointwise_tile: {_layout(spec)['SMEM_BYTES']} bytes of shared memory exceed "
                              f"{device.smem_block} on {device.name}")

    def context(self, spec: "ConvSpec") -> dict[str, object]:
        lay = _layout(spec)
        return {**lay, "PACKED_BYTES": lay["MB"] * lay["BM"] * lay["CINP"] * 4}  # the rounded weights


pointwise_tile = PointwiseTileFamily(
    name="pointwise_tile", device="cuda", template="cuda/pointwise_tile.cu.j2", layouts=("nchw",),
    dtypes=("float32",), tf32=True, engine="mma", epilogue=True, scale=True,
)

FAMILIES = (pointwise_tile,)
