// Store-strip benchmark: case 63's output (16 x 128 x P x Q, NCHW) written as the wgmma family's
// strips write it (tile strip=1): 8 blocks a band of output rows, each walking down one 128-column
// strip, a tile being 128 channels x 1 row x 128 pixels; nothing else running. Which ranges a
// block writes (OWN) and whether a band's blocks keep pace (PACE) decide what two blocks share:
//   OWN 0: columns [128 s, 128 s + 128) in the widest stores the start allows (the kernel today);
//   OWN 1: the whole 32-byte sectors that start in those columns (the row's cut ends at its ends);
//   OWN 2: the same for whole 128-byte lines.
//   nvcc -O3 -arch=sm_90 -o /tmp/store_strips benchmarks/store_strips.cu && /tmp/store_strips
// H100 (2026-11-23), float32, ms (a fill of the same bytes 2.70): 1022-wide rows, columns 5.82
// unpaced / 3.78 paced (DRIFT 2), sectors 4.46 / 4.88, lines 4.37 / 4.95; 1024-wide rows (every
// range aligned) columns 2.77 / 3.78, sectors and lines 3.66-3.67 / 4.24. Owning whole sectors
// or lines did not take 1022-wide rows near the aligned ones (the sector or line where a row
// ends and the next begins is still shared, by strip 7 of one row and strip 0 of the next);
// pacing did. This loop is partly issue-bound (the sector and line variants' extra address work
// costs 0.9 ms on aligned rows), so read differences within a row of the table, not across.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

template <int W>
__device__ __forceinline__ void st(char* p) {
  if constexpr (W == 16) __stcs(reinterpret_cast<int4*>(p), make_int4(1, 2, 3, 4));
  else if constexpr (W == 8) __stcs(reinterpret_cast<int2*>(p), make_int2(1, 2));
  else if constexpr (W == 4) __stcs(reinterpret_cast<int*>(p), 1);
  else __stcs(reinterpret_cast<short*>(p), (short)1);
}

// Bytes [a, a + len) (a W-byte aligned) by the warp's lanes in W-byte stores; the tail (under W
// bytes) by lane 0 in narrower aligned pieces.
template <int W>
__device__ __forceinline__ void put_w(char* y, int len, int lane) {
  const int n = len / W;
#pragma unroll
  for (int k = lane; k < 512 / W + 2; k += 32)
    if (k < n) st<W>(y + k * W);
  if constexpr (W > 2) {
    if (lane == 0) {
      int x = n * W;
      if ((len - x) & (W / 2 >= 8 ? 8 : 0)) { st<8>(y + x); x += 8; }
      if ((len - x) & 4) { st<4>(y + x); x += 4; }
      if ((len - x) & 2) st<2>(y + x);
    }
  }
}

// Bytes [a, e) in the widest stores a allows (up to 16).
__device__ __forceinline__ void put_range(char* y, long long a, long long e, int lane) {
  const int al = (int)(a & 15), len = (int)(e - a);
  if (al == 0) put_w<16>(y + a, len, lane);
  else if ((al & 7) == 0) put_w<8>(y + a, len, lane);
  else if ((al & 3) == 0) put_w<4>(y + a, len, lane);
  else put_w<2>(y + a, len, lane);
}

template <int E, int OWN, bool PACE>
__global__ void __launch_bounds__(256) strips(char* y, int P, int Q, int QT, int run, int* prog, int drift) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int G = OWN == 2 ? 128 : 32;  // ownership grain (bytes)
  const int b = blockIdx.x, s = b % QT, first = b - s;
  const long long plane = (long long)P * Q * E;
  const int g0 = (b / QT) * run, g1 = min(g0 + run, 16 * P);
  for (int g = g0, i = 0; g < g1; ++g, ++i) {
    const int n = g / P, p = g % P;
    if (PACE && i >= drift) {
      const int need = 8 * (i - drift + 1);
      for (;;) {
        bool ok = true;
        for (int k = lane; k < QT; k += 32) ok = ok && *(const volatile int*)(prog + first + k) >= need;
        if (__all_sync(0xffffffffu, ok)) break;
        __nanosleep(20);
      }
    }
#pragma unroll 4
    for (int cc = 0; cc < 16; ++cc) {
      const int c = warp * 16 + cc;
      const long long row = (long long)(n * 128 + c) * plane + (long long)p * Q * E;
      long long a = row + 128LL * s * E, e = row + min(128LL * (s + 1), (long long)Q) * E;
      if (OWN) {
        if (s > 0) a &= ~(long long)(G - 1);
        if (s < QT - 1) e &= ~(long long)(G - 1);
      }
      if (OWN && s == 0 && (a & 15)) {  // the row's cut head: up to 16 bytes, then whole chunks
        const long long a16 = (a + 15) & ~15LL;
        if (lane == 1) { long long x = a; if (x & 2) { st<2>(y + x); x += 2; } if (x & 4) { st<4>(y + x); x += 4; } if (x & 8) st<8>(y + x); }
        a = a16;
      }
      put_range(y, a, e, lane);
    }
    if (PACE) { __syncwarp(); if (lane == 0) atomicAdd(prog + b, 1); }
  }
}

template <int E, int OWN, bool PACE>
void time_it(const char* name, char* buf, int* prog, int Q, int drift = 2) {
  const int QT = (Q + 127) / 128, bands = 132 / QT, rows = 16 * Q;  // P = Q
  const int run = (rows + bands - 1) / bands, grid = (rows + run - 1) / run * QT;
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  float ms[9];
  for (int rr = 0; rr < 9; ++rr) {
    CK(cudaMemset(prog, 0, 4096 * sizeof(int)));
    cudaEventRecord(a);
    strips<E, OWN, PACE><<<grid, 256>>>(buf, Q, Q, QT, run, prog, drift);
    cudaEventRecord(b); CK(cudaEventSynchronize(b)); CK(cudaGetLastError());
    cudaEventElapsedTime(&ms[rr], a, b);
  }
  for (int i = 0; i < 9; ++i) for (int j = i + 1; j < 9; ++j) if (ms[j] < ms[i]) { float t = ms[i]; ms[i] = ms[j]; ms[j] = t; }
  const double bytes = 16.0 * 128 * Q * Q * E;
  printf("%-5s Q=%d %-22s grid=%d: %.3f ms (%.3f-%.3f) %.2f TB/s\n", E == 4 ? "f32" : "bf16", Q, name, grid, ms[4], ms[0],
         ms[8], bytes / ms[4] / 1e9);
}

__global__ void fill(int4* y, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    __stcs(y + i, make_int4(1, 2, 3, 4));
}

int main() {
  char* buf; int* prog;
  CK(cudaMalloc(&buf, (size_t)16 * 128 * 1024 * 1024 * 4 + 4096));
  CK(cudaMalloc(&prog, 4096 * sizeof(int)));
  for (int rr = 0; rr < 3; ++rr) {
    const long long n16 = 16LL * 128 * 1022 * 1022 * 4 / 16;
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    cudaEventRecord(a); fill<<<132 * 8, 256>>>((int4*)buf, n16); cudaEventRecord(b); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b);
    if (rr == 2) printf("f32   fill of 1022^2 outputs: %.3f ms %.2f TB/s\n", ms, n16 * 16.0 / ms / 1e9);
  }
  for (int Q : {1022, 1024}) {
    time_it<4, 0, false>("columns", buf, prog, Q);
    time_it<4, 0, true>("columns, paced 2", buf, prog, Q);
    time_it<4, 1, false>("sectors", buf, prog, Q);
    time_it<4, 1, true>("sectors, paced 2", buf, prog, Q);
    time_it<4, 2, false>("lines", buf, prog, Q);
    time_it<4, 2, true>("lines, paced 2", buf, prog, Q);
  }
  for (int Q : {1022, 1024}) {
    time_it<2, 0, false>("columns", buf, prog, Q);
    time_it<2, 0, true>("columns, paced 2", buf, prog, Q);
    time_it<2, 1, false>("sectors", buf, prog, Q);
    time_it<2, 2, false>("lines", buf, prog, Q);
  }
  return 0;
}
