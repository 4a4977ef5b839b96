// Store-line benchmark: case 63's output (16 x 128 x P x Q, NCHW) written tile by tile (128
// channels x 1 row x 128 pixels), by store pattern, with nothing else running.
//   nvcc -O3 -arch=sm_90 -o /tmp/store_lines benchmarks/store_lines.cu && /tmp/store_lines
// Add ONE=1 to time one launch of each (for Nsight Compute). H100 (2026-11-22), 1022-wide rows:
// 16-byte chunks with cut ends 5.9 ms float32 / 5.9 bf16; whole lines rounded out per tile 3.3 /
// 1.8; whole lines from blocks that own whole rows 2.9 / 1.5; a fill 2.7 / 1.35. This is why
// the wgmma family's 16-bit one-row tiles write whole lines (epilogue_lines).
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)
__device__ __forceinline__ void st(char* p, int s) {
  if (s == 16) *reinterpret_cast<uint4*>(p) = make_uint4(1, 2, 3, 4);
  else if (s == 8) *reinterpret_cast<uint2*>(p) = make_uint2(1, 2);
  else if (s == 4) *reinterpret_cast<unsigned*>(p) = 1u;
  else *reinterpret_cast<unsigned short*>(p) = 1;
}
// MODE 0: 16-byte chunks + cut ends by one lane in pieces; 1: W-byte stores (W = 8 f32, 4 bf16);
// 2: whole 128-byte lines [floor(a), floor(e)) (the carried-lines design; last tile of a range rounds up)
template <int E, int MODE>
__global__ void __launch_bounds__(256) st63(char* y, long long tiles, int P, int Q, int QT, int contiguous) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int LPR = 128 * E / 16 < 32 ? 128 * E / 16 : 32;  // lanes per channel row
  constexpr int RPI = 32 / LPR;
  const int r = lane / LPR, l = lane % LPR;
  const long long plane = (long long)P * Q * E;
  long long t0, t1, step;
  if (contiguous) { t0 = tiles * blockIdx.x / gridDim.x; t1 = tiles * (blockIdx.x + 1) / gridDim.x; step = 1; }
  else { t0 = blockIdx.x; t1 = tiles; step = gridDim.x; }
  for (long long t = t0; t < t1; t += step) {
    const int n = (int)(t / ((long long)P * QT)); const int rem = (int)(t % ((long long)P * QT));
    const int p = rem / QT, q0 = (rem % QT) * 128, len = min(128, Q - q0);
    for (int cc = 0; cc < 16; cc += RPI) {
      const int c = warp * 16 + cc + r;
      const long long a = (long long)(n * 128 + c) * plane + ((long long)p * Q + q0) * E, e = a + (long long)len * E;
      if (MODE == 0) {
        const long long a16 = (a + 15) & ~15LL, e16 = e & ~15LL;
        for (long long x = a16 + 16 * l; x < e16; x += 16 * LPR) st(y + x, 16);
        if (l == 0) {
          for (long long x = a; x < a16;) { int s = 8; while ((x % s) || x + s > a16) s >>= 1; st(y + x, s); x += s; }
          for (long long x = e16; x < e;) { int s = 8; while (x + s > e) s >>= 1; st(y + x, s); x += s; }
        }
      } else if (MODE == 1) {
        constexpr int W = E == 4 ? 8 : 4;
        for (long long x = a + W * l; x < e; x += W * LPR) st(y + x, W);
      } else {
        const long long lo = a & ~127LL, hi = (contiguous && t + 1 < t1) ? (e & ~127LL) : ((e + 127) & ~127LL);
        for (long long x = lo + 16 * l; x < hi; x += 16 * LPR) st(y + x, 16);
      }
    }
  }
}
__global__ void linear(uint4* y, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    y[i] = make_uint4(1, 2, 3, 4);
}
template <int E, int MODE>
void run(const char* name, char* buf, int Pd, int Qd, int blocks, int contiguous) {
  const int QT = (Qd + 127) / 128; const long long tiles = 16LL * Pd * QT;
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  float ms[9];
  const int R = getenv("ONE") ? 1 : 9;
  for (int rr = 0; rr < R; ++rr) {
    cudaEventRecord(a);
    st63<E, MODE><<<blocks, 256>>>(buf, tiles, Pd, Qd, QT, contiguous);
    cudaEventRecord(b); CK(cudaEventSynchronize(b)); CK(cudaGetLastError());
    cudaEventElapsedTime(&ms[rr], a, b);
  }
  for (int i = 0; i < R; ++i) for (int j = i + 1; j < R; ++j) if (ms[j] < ms[i]) { float t = ms[i]; ms[i] = ms[j]; ms[j] = t; }
  const double bytes = 16.0 * 128 * Pd * Qd * E;
  printf("%-5s %-26s %s Q=%d grid=%4d: %.3f ms %.2f TB/s\n", E == 4 ? "f32" : "bf16", name,
         contiguous ? "contig " : "strided", Qd, blocks, ms[R / 2], bytes / ms[R / 2] / 1e9);
}
int main() {
  char* buf; CK(cudaMalloc(&buf, (size_t)16 * 128 * 1024 * 1024 * 4 + 4096));
  for (int E : {4, 2}) {
    const long long n16 = 16LL * 128 * 1022 * 1022 * E / 16;
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int rr = 0; rr < 3; ++rr) {
      cudaEventRecord(a); linear<<<132 * 8, 256>>>((uint4*)buf, n16); cudaEventRecord(b); CK(cudaEventSynchronize(b));
      float ms; cudaEventElapsedTime(&ms, a, b);
      if (rr == 2) printf("%-5s linear fill 1022^2: %.3f ms %.2f TB/s\n", E == 4 ? "f32" : "bf16", ms, n16 * 16.0 / ms / 1e9);
    }
  }
  for (int blocks : {132, 264}) for (int Q : {1022, 1024}) {
    run<4, 0>("chunks+ends", buf, Q, Q, blocks, 0);
    run<4, 1>("W-byte", buf, Q, Q, blocks, 0);
    run<4, 2>("lines", buf, Q, Q, blocks, 0);
    run<4, 2>("lines", buf, Q, Q, blocks, 1);
    run<2, 0>("chunks+ends", buf, Q, Q, blocks, 0);
    run<2, 1>("W-byte", buf, Q, Q, blocks, 0);
    run<2, 2>("lines", buf, Q, Q, blocks, 0);
    run<2, 2>("lines", buf, Q, Q, blocks, 1);
  }
  return 0;
}
