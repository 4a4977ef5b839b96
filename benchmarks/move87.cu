// Case 87's data movement alone (y[n, c] = x[n, c / 2]: float32, 16 images of 64 -> 128 planes of
// 1024 x 1024) in several block structures, timed in alternating rounds in one process, medians.
// The question: does cuDNN's structure for 87 TF32 (CUTLASS's s1688gemm 128x128_32x3: one block of
// 4 warps a 128-pixel tile through all channels, all of the tile's loads first, then its stores, two
// blocks an SM) move the bytes faster than the persistent, interleaved kernel of bench_ceiling.py?
//   nvcc -O3 -arch=sm_90 -o /tmp/move87 benchmarks/move87.cu && /tmp/move87
// H100 80GB HBM3 (2026-11-27), ms, two runs of the binary: memcpy of the 4.29 GB input 2.846 /
// 2.851 (3.01-3.02 TB/s); v0 (bench_ceiling's) 4.626 / 4.633; one block a tile 4.590-4.618 in every
// form (128 or 256 pixels, 2-8 blocks an SM, registers or cp.async into shared memory, plain or
// streaming stores); F.conv2d in a process between the two runs 4.598. So one block a tile reaches
// cuDNN's time with movement alone; the persistent interleaved walk is 0.6-0.9% slower.
// Forty-fourth session, H100, three runs (F.conv2d 4.594-4.632 in processes beside them): v1/v2
// 4.584-4.635; v3 (a persistent grid taking tiles in order from a counter) 4.619-4.634 with 4
// blocks an SM, 4.655-4.669 with 2, against v0's 4.625-4.636: taking tiles in order does not move
// the bytes faster. v4 (cp.async with a 256-byte L2 prefetch hint) 4.608-4.627 against 4.614
// without. On an H200 (one run): v0 3.349, v1 3.309-3.341, v3 3.316 (4 an SM). Nothing here moves
// 87's bytes faster than 4.58 ms on the H100.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int N = 16, CIN = 64;
constexpr long long PLANE = (1 << 20) / 4;  // 16-byte vectors a plane

// V0: bench_ceiling's kernel: persistent, 256 vectors a tile, 16 loads then 32 stores, 4 times.
__global__ void __launch_bounds__(256) v0(const int4* __restrict__ x, int4* __restrict__ y, long long tiles) {
  const long long per_image = PLANE / 256;
  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
    const long long n = t / per_image, v = (t - n * per_image) * 256 + threadIdx.x;
    const int4* xs = x + n * CIN * PLANE + v;
    int4* ys = y + n * 2 * CIN * PLANE + v;
    for (int c0 = 0; c0 < CIN; c0 += 16) {
      int4 r[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) r[j] = __ldg(xs + (long long)(c0 + j) * PLANE);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        __stcs(ys + (long long)(2 * (c0 + j)) * PLANE, r[j]);
        __stcs(ys + (long long)(2 * (c0 + j) + 1) * PLANE, r[j]);
      }
    }
  }
}

// V1: one block a tile of VT vectors (4*VT pixels) through all channels; thread t takes vector
// t % VT of channels t / VT + G*j (G = 128 / VT groups): all 64 channels' loads first (held in
// registers), then all 128 planes' stores. ST: 0 plain, 1 streaming. Blocks an SM set by the
// dynamic shared memory the launch asks for.
template <int VT, int ST>
__global__ void __launch_bounds__(128) v1(const int4* __restrict__ x, int4* __restrict__ y, int zero) {
  constexpr int G = 128 / VT, J = CIN / G;
  extern __shared__ int dummy[];
  const long long per_image = PLANE / VT;
  const long long t = blockIdx.x;
  const long long n = t / per_image, v = (t - n * per_image) * VT + threadIdx.x % VT;
  const int g = threadIdx.x / VT;
  const int4* xs = x + n * CIN * PLANE + v;
  int4* ys = y + n * 2 * CIN * PLANE + v;
  int4 r[J];
#pragma unroll
  for (int j = 0; j < J; ++j) r[j] = __ldg(xs + (long long)(g + G * j) * PLANE);
  if (threadIdx.x == 1000) dummy[0] = r[0].x;  // (never)
  int acc = 0;  // every store waits for every load (zero is 0 at run time)
#pragma unroll
  for (int j = 0; j < J; ++j) acc ^= r[j].x;
  acc &= zero;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    int4* p = ys + (long long)(2 * (g + G * j)) * PLANE;
    int4 o = r[j];
    o.x ^= acc;
    if (ST) { __stcs(p, o); __stcs(p + PLANE, o); } else { p[0] = o; p[PLANE] = o; }
  }
}

// V2 / V4: as V1, but the tile's loads land in shared memory by cp.async (cuDNN's way), then each
// warp stores whole 512-byte rows from it (V2: v4<VT, 0, 1>). LH: 0 no L2 hint on the copies, 1 a
// 256-byte L2 prefetch on each. SH: 0 plain stores, 1 streaming (.cs).
template <int VT, int LH, int SH>
__global__ void __launch_bounds__(128) v4(const int4* __restrict__ x, int4* __restrict__ y) {
  constexpr int G = 128 / VT, J = CIN / G;
  extern __shared__ int4 s4[];  // [CIN][VT]
  const long long per_image = PLANE / VT;
  const long long t = blockIdx.x;
  const long long n = t / per_image, v0_ = (t - n * per_image) * VT;
  const int lane_v = threadIdx.x % VT, g = threadIdx.x / VT;
  const int4* xs = x + n * CIN * PLANE + v0_ + lane_v;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int c = g + G * j;
    unsigned dst = (unsigned)__cvta_generic_to_shared(s4 + c * VT + lane_v);
    const int4* src = xs + (long long)c * PLANE;
    if (LH == 0) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
    if (LH == 1) asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();
  int4* ys = y + n * 2 * CIN * PLANE + v0_ + lane_v;
#pragma unroll 8
  for (int j = 0; j < 2 * J; ++j) {
    const int co = g + G * j;
    const int4 o = s4[(co / 2) * VT + lane_v];
    int4* p = ys + (long long)co * PLANE;
    if (SH == 0) *p = o;
    if (SH == 1) __stcs(p, o);
  }
}

// V3: V1's tile body in a persistent grid whose blocks take tiles in order from a counter (so the
// tiles in flight stay one contiguous window), where V0's fixed interleave lets blocks drift apart.
__device__ unsigned long long next_tile;
__global__ void __launch_bounds__(128) v3(const int4* __restrict__ x, int4* __restrict__ y, long long tiles) {
  __shared__ long long tile;
  const long long per_image = PLANE / 32;
  const int g = threadIdx.x / 32;
  for (;;) {
    if (threadIdx.x == 0) tile = (long long)atomicAdd(&next_tile, 1ull);
    __syncthreads();
    const long long t = tile;
    __syncthreads();
    if (t >= tiles) return;
    const long long n = t / per_image, v = (t - n * per_image) * 32 + threadIdx.x % 32;
    const int4* xs = x + n * CIN * PLANE + v;
    int4* ys = y + n * 2 * CIN * PLANE + v;
    int4 r[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) r[j] = __ldg(xs + (long long)(g + 4 * j) * PLANE);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      int4* p = ys + (long long)(2 * (g + 4 * j)) * PLANE;
      p[0] = r[j];
      p[PLANE] = r[j];
    }
  }
}
static void v3_launch(const int4* x, int4* y, int blocks_an_sm, int nsm) {
  void* ctr;
  CK(cudaGetSymbolAddress(&ctr, next_tile));
  CK(cudaMemsetAsync(ctr, 0, 8));
  v3<<<blocks_an_sm * nsm, 128, 200 * 1024 / blocks_an_sm>>>(x, y, (long long)N * PLANE / 32);
}

static float run(void (*launch)(const int4*, int4*), const int4* x, int4* y, cudaEvent_t a, cudaEvent_t b) {
  CK(cudaEventRecord(a));
  launch(x, y);
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  CK(cudaGetLastError());
  float ms;
  CK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

const int4* gx; int4* gy; int nsm;
#define L(name, ...) {name, [](const int4* x, int4* y) { __VA_ARGS__; }}
struct V { const char* name; void (*f)(const int4*, int4*); };

int main() {
  CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
  const size_t xb = (size_t)N * CIN * PLANE * 16, yb = 2 * xb;
  int4 *x, *y;
  CK(cudaMalloc(&x, xb));
  CK(cudaMalloc(&y, yb));
  CK(cudaMemset(x, 1, xb));
  const int TILES128 = N * PLANE / 32;   // 128-pixel tiles
  const int TILES256 = N * PLANE / 64;
  for (auto f : {(const void*)v1<32, 1>, (const void*)v1<32, 0>, (const void*)v1<64, 1>, (const void*)v4<32, 0, 1>, (const void*)v4<64, 0, 1>, (const void*)v3,
                 (const void*)v4<32, 0, 0>, (const void*)v4<32, 1, 0>, (const void*)v4<32, 1, 1>, (const void*)v4<64, 1, 0>})
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  // shared memory a block so that k blocks share an SM: 228 KB / k, less the 1 KB reserved each
  // (24 KB would let 8 share one; v1<32, 1>'s 80 registers let 6)
  static std::vector<V> vs = {
      L("memcpy 4.29 GB (reads = writes)", CK(cudaMemcpyAsync(y, x, (size_t)N * CIN * PLANE * 16, cudaMemcpyDeviceToDevice))),
      L("v0 persistent interleaved (bench_ceiling)", v0<<<2 * nsm, 256>>>(x, y, (long long)N * PLANE / 256)),
      L("v1 tile 128px, loads then stores, cs, 2/SM", (v1<32, 1><<<TILES128, 128, 100 * 1024>>>(x, y, 0))),
      L("v1 tile 128px, loads then stores, cs, 3/SM", (v1<32, 1><<<TILES128, 128, 70 * 1024>>>(x, y, 0))),
      L("v1 tile 128px, loads then stores, cs, 4/SM", (v1<32, 1><<<TILES128, 128, 50 * 1024>>>(x, y, 0))),
      L("v1 tile 128px, loads then stores, cs, 6/SM", (v1<32, 1><<<TILES128, 128, 24 * 1024>>>(x, y, 0))),
      L("v1 tile 128px, loads then stores, plain, 2/SM", (v1<32, 0><<<TILES128, 128, 100 * 1024>>>(x, y, 0))),
      L("v1 tile 256px, loads then stores, cs, 2/SM", (v1<64, 1><<<TILES256, 128, 100 * 1024>>>(x, y, 0))),
      L("v1 tile 256px, loads then stores, cs, 4/SM", (v1<64, 1><<<TILES256, 128, 50 * 1024>>>(x, y, 0))),
      L("v2 tile 128px, cp.async to smem, 2/SM", (v4<32, 0, 1><<<TILES128, 128, 100 * 1024>>>(x, y))),
      L("v2 tile 128px, cp.async to smem, 4/SM", (v4<32, 0, 1><<<TILES128, 128, 50 * 1024>>>(x, y))),
      L("v2 tile 256px, cp.async to smem, 2/SM", (v4<64, 0, 1><<<TILES256, 128, 100 * 1024>>>(x, y))),
      L("v4 128px cp.async, no hints, plain, 2/SM", (v4<32, 0, 0><<<TILES128, 128, 100 * 1024>>>(x, y))),
      L("v4 128px cp.async L2::256B, plain, 2/SM", (v4<32, 1, 0><<<TILES128, 128, 100 * 1024>>>(x, y))),
      L("v4 128px cp.async L2::256B, streaming, 2/SM", (v4<32, 1, 1><<<TILES128, 128, 100 * 1024>>>(x, y))),
      L("v4 256px cp.async L2::256B, plain, 2/SM", (v4<64, 1, 0><<<TILES256, 128, 100 * 1024>>>(x, y))),
      L("v3 persistent, tiles from a counter, 2/SM", v3_launch(x, y, 2, nsm)),
      L("v3 persistent, tiles from a counter, 4/SM", v3_launch(x, y, 4, nsm)),
  };
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<std::vector<float>> t(vs.size());
  for (auto& v : vs) for (int i = 0; i < 2; ++i) run(v.f, x, y, a, b);
  for (int round = 0; round < 4; ++round)
    for (size_t i = 0; i < vs.size(); ++i)
      for (int k = 0; k < 4; ++k) t[i].push_back(run(vs[i].f, x, y, a, b));
  for (size_t i = 0; i < vs.size(); ++i) {
    std::sort(t[i].begin(), t[i].end());
    const double bytes = i == 0 ? 2.0 * xb : (double)xb + yb;
    printf("%-48s median %.3f ms  min %.3f  %.2f TB/s\n", vs[i].name, t[i][t[i].size() / 2], t[i][0],
           bytes / (t[i][t[i].size() / 2] * 1e-3) / 1e12);
  }
  return 0;
}
