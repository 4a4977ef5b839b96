"""Case 87's data movement alone: how fast can any kernel read its input once and write its output?

    python benchmarks/bench_ceiling.py [--json out.json]

Case 87 (1x1, 64 -> 128 channels, 16 x 1024 x 1024) reads 4.3 GB and writes 8.6 GB (bf16: half
of each). The bytes floor divides those bytes by the card's copy bandwidth, but a copy reads
and writes equal amounts; 87 writes twice what it reads. This script times a kernel that
does nothing but 87's movement, y[n, c] = x[n, c // 2] for every output plane, in the way
a tiled convolution does it (a block per 256 x 4 pixels of an image, every channel, 16-byte
loads and streaming stores), next to kernelgen.conv2d and F.conv2d on the same shapes, in one
process. A convolution cannot beat this kernel by much: it moves the same bytes and computes.

It builds its one kernel with torch.utils.cpp_extension.load_inline (about half a minute).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernelgen  # noqa: E402
from benchmarks.bench_cases import paired_ms  # noqa: E402

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

// Output plane c of image n is input plane c / 2: each 16-byte vector is read once (from DRAM)
// and written twice. A block takes 256 consecutive vectors of one image through all channels,
// persistent over its tiles like kernelgen's GEMM kernels; 16 loads are in flight per thread.
__global__ void __launch_bounds__(256) move87(const int4* __restrict__ x, int4* __restrict__ y, long long plane,
                                              int cin, long long tiles) {
  const long long per_image = plane / 256;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const long long n = t / per_image, v = (t - n * per_image) * 256 + threadIdx.x;
    const int4* xs = x + n * cin * plane + v;
    int4* ys = y + n * 2 * cin * plane + v;
    for (int c0 = 0; c0 < cin; c0 += 16) {
      int4 r[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) r[j] = __ldg(xs + (long long)(c0 + j) * plane);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        __stcs(ys + (long long)(2 * (c0 + j)) * plane, r[j]);
        __stcs(ys + (long long)(2 * (c0 + j) + 1) * plane, r[j]);
      }
    }
  }
}

void move(torch::Tensor x, torch::Tensor y, int64_t grid) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && y.is_contiguous() && x.dim() == 3 && y.dim() == 3);
  TORCH_CHECK(y.size(0) == x.size(0) && y.size(1) == 2 * x.size(1) && y.size(2) == x.size(2) && x.size(1) % 16 == 0);
  const long long plane = x.size(2) * x.element_size() / 16;  // 16-byte vectors a plane
  TORCH_CHECK(plane % 256 == 0 && x.size(2) * x.element_size() % 16 == 0);
  const long long tiles = x.size(0) * plane / 256;
  move87<<<(unsigned)grid, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const int4*>(x.data_ptr()), reinterpret_cast<int4*>(y.data_ptr()), plane, (int)x.size(1), tiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""


def build():
    from torch.utils.cpp_extension import load_inline

    return load_inline("kg_bench_move87", cpp_sources="void move(torch::Tensor x, torch::Tensor y, int64_t grid);",
                       cuda_sources=_SOURCE, functions=["move"], extra_cuda_cflags=["-O3"], verbose=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ceiling: no CUDA device; nothing to measure")
        return 0
    ext = build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    N, C, K, HW = 16, 64, 128, 1024 * 1024
    rows = []
    print(f"# case 87's data movement alone on {torch.cuda.get_device_name()} (ms, same process; medians)")
    print("| dtype | GB moved | move only | TB/s | kernelgen | F.conv2d | kernelgen / move |")
    print("|---|---|---|---|---|---|---|")
    for name, dtype, precision in (("float32", torch.float32, "tf32"), ("bfloat16", torch.bfloat16, None)):
        torch.backends.cudnn.allow_tf32 = True
        x = torch.rand(N, C, HW, device="cuda").to(dtype)
        y = torch.full((N, K, HW), float("nan"), device="cuda", dtype=dtype)
        ext.move(x, y, 2 * sms)
        torch.cuda.synchronize()
        if not (torch.equal(y[:, 0::2], x) and torch.equal(y[:, 1::2], x)):
            raise SystemExit("bench_ceiling: the move kernel wrote the wrong output")
        gb = (x.numel() + y.numel()) * x.element_size() / 1e9
        x4, w = x.view(N, C, 1024, 1024), (torch.rand(K, C, 1, 1, device="cuda") - 0.5).to(dtype)
        kw = {"precision": precision} if precision else {}
        move_ms, kg_ms = paired_ms(lambda: ext.move(x, y, 2 * sms), lambda: kernelgen.conv2d(x4, w, **kw))
        _, torch_ms = paired_ms(lambda: ext.move(x, y, 2 * sms), lambda: F.conv2d(x4, w))
        rows.append({"dtype": name, "gb": gb, "move_ms": move_ms, "move_tbs": gb / move_ms, "kernelgen_ms": kg_ms,
                     "torch_ms": torch_ms, "kernelgen_over_move": kg_ms / move_ms})
        print(f"| {name} | {gb:.2f} | {move_ms:.3f} | {gb / move_ms:.2f} | {kg_ms:.3f} | {torch_ms:.3f} | "
              f"{kg_ms / move_ms:.3f} |", flush=True)
        del x, y, x4, w
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
