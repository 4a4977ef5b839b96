// Store-pattern benchmark: how fast does a conv output tile leave an SM in NCHW, by pattern?
//   nvcc -O3 -arch=sm_90 -o /tmp/store_patterns benchmarks/store_patterns.cu && /tmp/store_patterns
// H100 (2026-11-22): fragment-order float2 stores 1.54 TB/s (aligned rows) / 0.71 (1022-wide
// rows); whole-row 16-byte stores 3.0-3.2 TB/s; bf16 fragment pairs 1.00 / 0.46. This is why
// the GEMM families stage their output (templates/common/staging.cuh.j2).
// Output [16][128][P][Q]; tiles of 128 channels x 2 rows x 64 columns (case 63's igemm) and others.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

constexpr int N = 16, C = 128;
struct P { int P, Q, QT, PT; long long tiles; };

// mode 0: fragment pairs (8 rows x 8 px per instr); 1: rows, 16 B per lane, 8 lanes a 128 B row piece
template <typename T, int MODE, int TP, int TQ>
__global__ void __launch_bounds__(256) k(T* y, P pr) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp % 2, wn = warp / 2;
  for (long long t = blockIdx.x; t < pr.tiles; t += gridDim.x) {
    const int n = (int)(t / pr.PT); const int pt = (int)(t % pr.PT);
    const int p0 = (pt / pr.QT) * TP, q0 = (pt % pr.QT) * TQ;
    const float v = (float)(t & 1023);
    if (MODE == 0) {
      constexpr int WTN = TP * TQ / 4;  // pixels per warp
      for (int i = 0; i < 4; ++i)
        for (int h = 0; h < 2; ++h) {
          const int m = wm * 64 + i * 16 + (lane >> 2) + 8 * h;
#pragma unroll
          for (int j = 0; j < WTN / 8; ++j) {
            const int nn = wn * WTN + j * 8 + 2 * (lane & 3);
            const int p = p0 + nn / TQ, q = q0 + nn % TQ;
            if (p < pr.P && q + 1 < pr.Q + 1) {
              T* dst = y + (((long long)n * C + m) * pr.P + p) * pr.Q + q;
              if (sizeof(T) == 4) __stcs(reinterpret_cast<float2*>(dst), make_float2(v, v + 1));
              else __stcs(reinterpret_cast<unsigned*>(dst), 0x3f803f80u);
            }
          }
        }
    } else {
      // each warp: 64 channels x (TP*TQ/4) pixels stored row-wise, 16 B per lane (Q multiple of 16B assumed)
      constexpr int VE = 16 / sizeof(T);
      constexpr int WTN = TP * TQ / 4;
      constexpr int SEG = WTN < TQ ? WTN : TQ;  // pixels of one output row in a warp's tile
      constexpr int CPS = SEG / VE;             // chunks per segment
      constexpr int SEGS = WTN / SEG;
      for (int idx = lane; idx < 64 * SEGS * CPS; idx += 32) {
        const int c = idx % CPS, r = idx / CPS;
        const int m = wm * 64 + r / SEGS, s = r % SEGS;
        const int nn = wn * WTN + s * SEG + c * VE;
        const int p = p0 + nn / TQ, q = q0 + nn % TQ;
        if (p < pr.P && q + VE <= pr.Q) {
          T* dst = y + (((long long)n * C + m) * pr.P + p) * pr.Q + q;
          __stcs(reinterpret_cast<float4*>(dst), make_float4(v, v, v, v));
        }
      }
    }
  }
}

__global__ void linear(float4* y, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    __stcs(y + i, make_float4(1.f, 2.f, 3.f, 4.f));
}

template <typename T, int MODE, int TP, int TQ>
int run(const char* name, void* buf, int Pd, int Qd, int blocks) {
  P pr; pr.P = Pd; pr.Q = Qd; pr.QT = (Qd + TQ - 1) / TQ; pr.PT = ((Pd + TP - 1) / TP) * pr.QT; pr.tiles = (long long)N * pr.PT;
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const int R = getenv("SB_REPS") ? atoi(getenv("SB_REPS")) : 11;
  float best[11];
  for (int r = 0; r < R; ++r) {
    cudaEventRecord(a);
    k<T, MODE, TP, TQ><<<blocks, 256>>>((T*)buf, pr);
    cudaEventRecord(b); CK(cudaEventSynchronize(b)); CK(cudaGetLastError());
    cudaEventElapsedTime(&best[r], a, b);
  }
  for (int i = 0; i < R; ++i) for (int j = i + 1; j < R; ++j) if (best[j] < best[i]) { float t = best[i]; best[i] = best[j]; best[j] = t; }
  const double bytes = (double)N * C * Pd * Qd * sizeof(T);
  printf("%-34s P=%d Q=%d grid=%5d: %.3f ms  %.2f TB/s\n", name, Pd, Qd, blocks, best[R / 2], bytes / best[R / 2] / 1e9);
  return 0;
}

int main() {
  const size_t bytes = (size_t)N * C * 1024 * 1024 * 4;
  void* buf; CK(cudaMalloc(&buf, bytes));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int r = 0; r < 3; ++r) {
    long long n4 = (long long)N * C * 1022 * 1022 / 4;
    cudaEventRecord(a); linear<<<132 * 8, 256>>>((float4*)buf, n4); cudaEventRecord(b); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b); printf("linear float4 1022^2: %.3f ms %.2f TB/s\n", ms, n4 * 16.0 / ms / 1e9);
  }
  for (int blocks : {132, 264, 1056}) {
    run<float, 0, 2, 64>("f32 frag float2 tp2 tq64", buf, 1022, 1022, blocks);
    run<float, 0, 2, 64>("f32 frag float2 tp2 tq64", buf, 1024, 1024, blocks);
    run<float, 1, 2, 64>("f32 rows v4 tp2 tq64 (seg 32px)", buf, 1024, 1024, blocks);
    run<float, 1, 1, 128>("f32 rows v4 tp1 tq128 (seg 32px)", buf, 1024, 1024, blocks);
    run<float, 1, 1, 256>("f32 rows v4 tp1 tq256 (seg 64px)", buf, 1024, 1024, blocks);
    run<__nv_bfloat16, 0, 2, 128>("bf16 frag u32 tp2 tq128", buf, 1022, 1022, blocks);
    run<__nv_bfloat16, 0, 2, 128>("bf16 frag u32 tp2 tq128", buf, 1024, 1024, blocks);
    run<__nv_bfloat16, 1, 2, 128>("bf16 rows v4 tp2 tq128 (seg 64px)", buf, 1024, 1024, blocks);
    run<__nv_bfloat16, 1, 1, 256>("bf16 rows v4 tp1 tq256 (seg 64px)", buf, 1024, 1024, blocks);
  }
  return 0;
}
