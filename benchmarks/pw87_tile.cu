// Prototype, not a kernelgen family: case 87 TF32 (16 x 64 -> 128 channels, 1024 x 1024, 1x1, NCHW)
// computed in cuDNN's structure: one block of 4 warps a tile of 128 output channels x BP pixels,
// everything loaded by cp.async up front (the weights rounded to TF32 once a call), mma.sync
// m16n8k8 TF32 with the input rounded as its fragments load, the tile staged in shared memory and
// stored in 16-byte vectors along 512-byte (BP 128) or 256-byte rows. Each variant is checked
// against a float64 reference with its output poisoned (NaN) first, then timed beside the
// movement alone in the same structure (move87.cu's v1).
//   nvcc -O3 -arch=sm_90 -o /tmp/pw87 benchmarks/pw87_tile.cu && /tmp/pw87
// H100 80GB HBM3 (2026-11-27), the 128-pixel kernel (then the file's only tile; 186 registers,
// two blocks an SM): rel err 2.607e-04; 4.735-4.738 ms with plain stores, 4.750-4.756 streaming,
// against the movement alone 4.591-4.596 and F.conv2d 4.594 (min) in a process between two runs;
// kernelgen's persistent `pointwise` measured 4.662-4.687 on the same cards. So computing in this
// structure costs 3% over its movement, more than cuDNN's kernel pays.
// Forty-fourth session. H100: 64-pixel tiles 4.984-5.002 (3 or 4 blocks an SM, plain or
// streaming, one or two load groups); 128 pixels with two load groups (MMAs start when the first
// 32 channels land) 4.734 against 4.739 with one; the movement 4.590. H200 (one run, movement
// 3.336): 128 pixels 3.663, three blocks an SM 3.649, 8 warps 3.657-3.664, fragments stored
// straight from registers 5.98-9.40. None comes within 3% of its movement.
// What costs the 3% (H100, DG variants below): without MMAs 4.73, without MMAs or staging 4.73,
// without the weight loads 4.62 against the movement's 4.60. Each tile copied the 32 KB of weights
// from L2; through L1 (cp.async.ca, DG 5) the kernel takes 4.612-4.614, rel err 2.607e-04. That
// kernel is the `pointwise_tile` family (templates/cuda/pointwise_tile.cu.j2).
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int N = 16, CIN = 64, COUT = 128;
constexpr long long HW = 1 << 20;
constexpr int WS = 68;            // W row stride in floats (bank (4co + ci))
template <int BP, int NW = 4> struct Tile {
  static constexpr int XS = BP + 8;  // X row stride (bank (8ci + px)); also the output staging's
  static constexpr int SMEM = 128 * WS * 4 + CIN * XS * 4;
  static constexpr int WNC = BP / 64, WMC = NW / WNC, MT = COUT / WMC / 16;  // warps along px, co; m-tiles a warp
  static_assert(COUT * XS * 4 <= SMEM, "the staged tile fits");
};

__device__ __forceinline__ unsigned tf32(float f) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
  return r;
}
__device__ __forceinline__ void cp16(void* s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((unsigned)__cvta_generic_to_shared(s)), "l"(g));
}

// W rounded to TF32 once a call (8192 values).
__global__ void round_w(const float* w, float* wr) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < COUT * CIN) wr[i] = __uint_as_float(tf32(w[i]));
}

__device__ __forceinline__ void cp16_l1(void* s, const void* g) {  // through L1 (cached there)
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"((unsigned)__cvta_generic_to_shared(s)), "l"(g));
}

template <int N_>
__device__ __forceinline__ void wait_groups() {  // until at most N_ committed groups are pending
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N_) : "memory");
}

// KS: the tile's loads in KS groups of CIN / KS channels (input rows and weight columns), the MMAs
// of each group starting as soon as it lands. NW: warps a block. PLAIN: 0 streaming stores from the
// staged tile, 1 plain ones, 2 each thread's fragments stored straight from registers (no staging).
// DG (diagnostics; the result is then wrong): 1 no MMAs (each accumulator takes one staged input
// word, so the loads stay live), 2 MMAs on the input words as they lie (no cvt.rna rounding), 3 no
// weight loads (the MMAs read whatever shared memory holds), 4 no MMAs and no staging: the input
// rows leave from where they landed, each twice (move87.cu's v2 with this kernel's loads); 5 (a
// correct result) the weights by cp.async.ca, which keeps them in the SM's L1 for the next tiles.
template <int BP, int MINB, int PLAIN, int KS = 1, int NW = 4, int DG = 0>
__global__ void __launch_bounds__(32 * NW, MINB) pw(const float* __restrict__ x, const float* __restrict__ wr,
                                             float* __restrict__ y) {
  using T = Tile<BP, NW>;
  constexpr int NT = 32 * NW;
  constexpr int XS = T::XS, MT = T::MT, WNC = T::WNC, XCH = BP / 4;  // 16-byte chunks an X row
  extern __shared__ __align__(16) float sm[];
  float* Ws = sm;                 // [128][WS]
  float* Xs = sm + 128 * WS;      // [64][XS]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long tiles_per_image = HW / BP;
  const long long n = blockIdx.x / tiles_per_image;
  const long long p0 = (blockIdx.x - n * tiles_per_image) * BP;
  const float* xs = x + n * CIN * HW + p0;
  // loads: W 128 x 64 floats (16 chunks of 16 B a row), X 64 x BP (XCH chunks a row); group h
  // takes X rows and W columns h * KC .. h * KC + KC - 1
  constexpr int KC = CIN / KS, WQ = KC / 4;  // channels a group, W chunks a row a group
#pragma unroll
  for (int h = 0; h < KS; ++h) {
#pragma unroll
    for (int i = 0; i < KC * XCH / NT; ++i) {
      const int c = tid + NT * i;
      const int r = h * KC + c / XCH, q = c % XCH;  // X row r (channel), chunk q
      cp16(Xs + r * XS + 4 * q, xs + r * HW + 4 * q);
    }
#pragma unroll
    for (int i = 0; i < (DG == 3 ? 0 : 128 * WQ / NT); ++i) {
      const int c = tid + NT * i;
      const int r = c / WQ, q = h * WQ + c % WQ;  // W row r (output channel), chunk q
      if (DG == 5) cp16_l1(Ws + r * WS + 4 * q, wr + r * CIN + 4 * q);
      else cp16(Ws + r * WS + 4 * q, wr + r * CIN + 4 * q);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  if (DG == 4) {
    wait_groups<0>();
    __syncthreads();
    constexpr int RPW4 = 32 / XCH;
    float* yb = y + n * COUT * HW + p0 + 4 * (lane % XCH);
#pragma unroll 8
    for (int r = warp * RPW4 + lane / XCH; r < COUT; r += NW * RPW4)
      *reinterpret_cast<float4*>(yb + r * HW) = *reinterpret_cast<const float4*>(Xs + (r / 2) * XS + 4 * (lane % XCH));
    return;
  }
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / WNC, wn = warp % WNC;  // 16 MT channels x 64 pixels a warp
  float acc[MT][8][4];
#pragma unroll
  for (int a = 0; a < MT; ++a)
#pragma unroll
    for (int b = 0; b < 8; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;
#pragma unroll
  for (int k = 0; k < CIN; k += 8) {
    if (k % KC == 0) {  // group k / KC has landed (for every thread: the barrier)
      if (KS == 1 || k / KC == KS - 1) wait_groups<0>(); else wait_groups<1>();
      __syncthreads();
    }
    unsigned af[MT][4], bf[8][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float* wp = Ws + (wm * MT * 16 + mt * 16 + g) * WS + k + t;
      af[mt][0] = __float_as_uint(wp[0]);
      af[mt][1] = __float_as_uint(wp[8 * WS]);
      af[mt][2] = __float_as_uint(wp[4]);
      af[mt][3] = __float_as_uint(wp[8 * WS + 4]);
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float* xp = Xs + (k + t) * XS + wn * 64 + nt * 8 + g;
      bf[nt][0] = DG == 2 ? __float_as_uint(xp[0]) : tf32(xp[0]);
      bf[nt][1] = DG == 2 ? __float_as_uint(xp[4 * XS]) : tf32(xp[4 * XS]);
    }
    if (DG == 1) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) acc[mt][nt][k / 8 % 4] += __uint_as_float(bf[nt][mt & 1] ^ af[mt][0]);
      continue;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(acc[mt][nt][0]), "+f"(acc[mt][nt][1]), "+f"(acc[mt][nt][2]), "+f"(acc[mt][nt][3])
                     : "r"(af[mt][0]), "r"(af[mt][1]), "r"(af[mt][2]), "r"(af[mt][3]), "r"(bf[nt][0]), "r"(bf[nt][1]));
  }
  if (PLAIN == 2) {  // 8 lanes a row, 32 bytes each: one sector
    float* yb = y + n * COUT * HW + p0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int co = wm * MT * 16 + mt * 16 + g, px = wn * 64 + nt * 8 + 2 * t;
        *reinterpret_cast<float2*>(yb + co * HW + px) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
        *reinterpret_cast<float2*>(yb + (co + 8) * HW + px) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
      }
    return;
  }
  __syncthreads();  // every warp is done with W and X: the tile is staged over them
  float* Ys = sm;  // [128][XS]
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int co = wm * MT * 16 + mt * 16 + g, px = wn * 64 + nt * 8 + 2 * t;
      *reinterpret_cast<float2*>(Ys + co * XS + px) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
      *reinterpret_cast<float2*>(Ys + (co + 8) * XS + px) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
    }
  __syncthreads();
  // a warp stores 32 / XCH rows at once, XCH lanes a row
  constexpr int RPW = 32 / XCH;
  const int lr = lane / XCH, lq = lane % XCH;
  float* yb = y + n * COUT * HW + p0 + 4 * lq;
#pragma unroll 8
  for (int r = warp * RPW + lr; r < COUT; r += NW * RPW) {
    const float4 v = *reinterpret_cast<const float4*>(Ys + r * XS + 4 * lq);
    if (PLAIN) *reinterpret_cast<float4*>(yb + r * HW) = v;
    else __stcs(reinterpret_cast<float4*>(yb + r * HW), v);
  }
}

// the movement alone in the same structure (move87.cu's v1, plain stores)
__global__ void __launch_bounds__(128) move(const int4* __restrict__ x, int4* __restrict__ y, int zero) {
  constexpr long long PLANE = HW / 4;
  const long long per_image = PLANE / 32;
  const long long tt = blockIdx.x;
  const long long n = tt / per_image, v = (tt - n * per_image) * 32 + threadIdx.x % 32;
  const int gg = threadIdx.x / 32;
  const int4* xs = x + n * CIN * PLANE + v;
  int4* ys = y + n * 2 * CIN * PLANE + v;
  int4 r[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) r[j] = __ldg(xs + (long long)(gg + 4 * j) * PLANE);
  int acc = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) acc ^= r[j].x;
  acc &= zero;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    int4* p = ys + (long long)(2 * (gg + 4 * j)) * PLANE;
    int4 o = r[j];
    o.x ^= acc;
    p[0] = o;
    p[PLANE] = o;
  }
}

__global__ void ref_kernel(const float* x, const float* w, double* ref) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;  // over n, co, p
  if (i >= (long long)N * COUT * HW) return;
  const long long p = i % HW, co = (i / HW) % COUT, n = i / (HW * COUT);
  double s = 0;
  for (int ci = 0; ci < CIN; ++ci) s += (double)w[co * CIN + ci] * (double)x[(n * CIN + ci) * HW + p];
  ref[i] = s;
}
__global__ void err_kernel(const float* y, const double* ref, double* out) {  // out[0] += (y-ref)^2, out[1] += ref^2
  double a = 0, b = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)N * COUT * HW;
       i += (long long)gridDim.x * blockDim.x) {
    const double d = (double)y[i] - ref[i];
    a += d * d;
    b += ref[i] * ref[i];
  }
  atomicAdd(out, a);
  atomicAdd(out + 1, b);
}
__global__ void init(float* p, long long n, unsigned seed, float scale) {  // hash-based uniform(-1, 1) * scale
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    p[i] = ((h & 0xFFFFFF) / 8388608.0f - 1.0f) * scale;
  }
}

int main() {
  const long long nx = (long long)N * CIN * HW, ny = (long long)N * COUT * HW;
  float *x, *w, *wr, *y;
  double *ref, *e;
  CK(cudaMalloc(&x, nx * 4)); CK(cudaMalloc(&y, ny * 4)); CK(cudaMalloc(&ref, ny * 8));
  CK(cudaMalloc(&w, COUT * CIN * 4)); CK(cudaMalloc(&wr, COUT * CIN * 4)); CK(cudaMalloc(&e, 16));
  init<<<4096, 256>>>(x, nx, 12345u, 1.0f);
  init<<<32, 256>>>(w, COUT * CIN, 777u, 0.125f);
  CK(cudaGetLastError());
  ref_kernel<<<(unsigned)((ny + 255) / 256), 256>>>(x, w, ref);
  CK(cudaGetLastError());
  CK(cudaFuncSetAttribute(move, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
  struct Var { const char* name; void (*k)(const float*, const float*, float*); int bp, smem, nt; };
  Var vars[] = {
      {"pw 128 px, 2 an SM, plain", pw<128, 2, 1>, 128, Tile<128>::SMEM, 128},
      {"pw 128 px, 3 an SM, plain", pw<128, 3, 1>, 128, Tile<128>::SMEM, 128},
      {"pw 128 px, 2 an SM, fragments", pw<128, 2, 2>, 128, Tile<128>::SMEM, 128},
      {"pw 128 px, 3 an SM, fragments", pw<128, 3, 2>, 128, Tile<128>::SMEM, 128},
      {"pw 128 px, 8 warps, 2 an SM, plain", pw<128, 2, 1, 1, 8>, 128, Tile<128, 8>::SMEM, 256},
      {"pw 128 px, 8 warps, 2 an SM, fragments", pw<128, 2, 2, 1, 8>, 128, Tile<128, 8>::SMEM, 256},
      {"pw 128 px, 8 warps, 2 an SM, 2 load groups", pw<128, 2, 1, 2, 8>, 128, Tile<128, 8>::SMEM, 256},
      {"diag: 128 px, no MMAs (wrong result)", pw<128, 2, 1, 1, 4, 1>, 128, Tile<128>::SMEM, 128},
      {"diag: 128 px, MMAs unrounded input", pw<128, 2, 1, 1, 4, 2>, 128, Tile<128>::SMEM, 128},
      {"diag: 128 px, no weight loads", pw<128, 2, 1, 1, 4, 3>, 128, Tile<128>::SMEM, 128},
      {"diag: 128 px, no MMAs, no staging", pw<128, 2, 1, 1, 4, 4>, 128, Tile<128>::SMEM, 128},
      {"pw 128 px, 2 an SM, weights via L1", pw<128, 2, 1, 1, 4, 5>, 128, Tile<128>::SMEM, 128},
      {"pw 128 px, 3 an SM, weights via L1", pw<128, 3, 1, 1, 4, 5>, 128, Tile<128>::SMEM, 128},
      {"pw 128 px, 8 warps, weights via L1", pw<128, 2, 1, 1, 8, 5>, 128, Tile<128, 8>::SMEM, 256},
  };
  constexpr int NV = sizeof(vars) / sizeof(vars[0]);
  for (auto& v : vars) {
    CK(cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
    int bps = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, v.k, v.nt, v.smem));
    CK(cudaMemset(y, 0xFF, ny * 4));  // NaN: an unwritten element fails
    round_w<<<32, 256>>>(w, wr);
    v.k<<<(unsigned)(N * HW / v.bp), v.nt, v.smem>>>(x, wr, y);
    CK(cudaGetLastError());
    CK(cudaMemset(e, 0, 16));
    err_kernel<<<1024, 256>>>(y, ref, e);
    CK(cudaDeviceSynchronize());
    double h[2];
    CK(cudaMemcpy(h, e, 16, cudaMemcpyDeviceToHost));
    printf("%-34s %d blocks an SM, %d B shared: rel err %.3e\n", v.name, bps, v.smem, sqrt(h[0] / h[1]));
  }
  CK(cudaFree(ref));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  std::vector<float> t[NV + 1];
  for (int round = 0; round < 6; ++round)
    for (int v = 0; v <= NV; ++v)
      for (int k = 0; k < 5; ++k) {
        CK(cudaEventRecord(a));
        if (v < NV) {
          round_w<<<32, 256>>>(w, wr);
          vars[v].k<<<(unsigned)(N * HW / vars[v].bp), vars[v].nt, vars[v].smem>>>(x, wr, y);
        } else {
          move<<<(unsigned)(N * HW / 128), 128, 100 * 1024>>>((const int4*)x, (int4*)y, 0);
        }
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        CK(cudaGetLastError());
        float ms; CK(cudaEventElapsedTime(&ms, a, b));
        if (round > 0) t[v].push_back(ms);
      }
  for (int v = 0; v <= NV; ++v) {
    std::sort(t[v].begin(), t[v].end());
    printf("%-40s median %.3f ms  min %.3f\n", v < NV ? vars[v].name : "movement alone (tile 128 px, plain)",
           t[v][t[v].size() / 2], t[v][0]);
  }
  return 0;
}
