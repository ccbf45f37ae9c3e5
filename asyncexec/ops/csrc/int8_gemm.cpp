// int8 GEMM on AVX-512 VNNI for every step (asyncexec/ops/int8_gemm.py builds and calls it): the weights
// stay int8, nothing dense is kept or made. Weights as llama.cpp's Q8_0 holds them (with bf16 scales),
// activations as its Q8_1 (W8A8):
//
//   y[m, n] = sum_g scale[g, n] * sx[m, g] * sum_{k in g} xq[m, k] * w[n, k]
//   x, y, scale, inv_s: bf16; w: int8 [N, K]; groups g of kGroup = 32 inputs
//
// A scale per output channel and group of 32 inputs kept SmolLM2's argmax better than one per channel
// (a tied embedding read from the lm_head's int8 weight lost 3% of positions with one per channel, 1.6%
// with one per group). The activations are quantized first, per row and group of 32 inputs, to signed
// codes xq with scale sx and xs = sx * the group's sum of codes (`quantize_rows`, vnni.h); coarser
// scales lost too much on SmolLM2 (argmax agreement with bf16 over real text: 91.7% with one scale per
// row, 94.6% per 64 inputs, 95% and more per 32), at no measurable cost. `vpdpbusd` multiplies unsigned
// by signed bytes: the weights are stored as w + 128 (1..255), and scale * 128 * xs takes the 128 back
// out. Products and a group's sums are exact in int32; the groups add up in float32.
//
// The weights are blocked at load, [N / 16][K / 4][16][4] (`int8_gemm.pack`): one 64-byte vector holds 4
// inputs of 16 output channels, and `vpdpbusd` multiplies it with 4 codes of one row, broadcast, into 16
// int32 sums, so no horizontal sum is needed. Threads take output channels (`for_columns`); each block
// runs through its weights for every 4 rows of x (from memory for the first rows, from cache after).
// Built by inductor's C++ compiler driver; the VNNI code is compiled for its own target and runs only
// where the CPU has it.
#include "vnni.h"

namespace {

using namespace asyncexec_vnni;

#if defined(CPU_CAPABILITY_AVX512)
// rows m0 .. m0 + R - 1, output channels 16 * c0 .. 16 * (c0 + NB) - 1
template <int R, int NB, typename S>
ASYNCEXEC_VNNI inline void block(const Quantized& x, const uint8_t* w, const S* scale,
                                 c10::BFloat16* y, int64_t m0, int64_t c0, int64_t N, int64_t K) {
  __m512 out[R * NB];
#pragma GCC unroll 8
  for (int i = 0; i < R * NB; ++i) out[i] = _mm512_setzero_ps();
  const int64_t k4n = K / 4, groups = K / kGroup;
  const uint8_t* wc = w + c0 * k4n * 64;
  const int32_t* xr = reinterpret_cast<const int32_t*>(x.xq + m0 * K);
  const __m512 offset = _mm512_set1_ps(-128.0f);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R * NB];
#pragma GCC unroll 8
    for (int i = 0; i < R * NB; ++i) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int64_t k4 = g * (kGroup / 4); k4 < (g + 1) * (kGroup / 4); ++k4) {
      __m512i wv[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(wc + (j * k4n + k4) * 64);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(xr[r * k4n + k4]);
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) acc[r * NB + j] = _mm512_dpbusd_epi32(acc[r * NB + j], wv[j], xb);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const __m512 ws = load_scales(scale + g * N + (c0 + j) * 16);
      const __m512 wo = _mm512_mul_ps(ws, offset);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * groups + g;
        const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(x.sx[at]));
        out[r * NB + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r * NB + j]), s, out[r * NB + j]);
        out[r * NB + j] = _mm512_fmadd_ps(wo, _mm512_set1_ps(x.xs[at]), out[r * NB + j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + r) * N + (c0 + j) * 16), to_bf16(out[r * NB + j]));
  }
}

template <typename S>
void run(const Quantized& q, const uint8_t* w, const S* scale, c10::BFloat16* y, int64_t M, int64_t N,
         int64_t K, int t) {
  for_columns(
      [&](auto nb, int64_t c0) {
        for_rows([&](auto r, int64_t m0) { block<decltype(r)::value, decltype(nb)::value>(q, w, scale, y, m0, c0, N, K); }, M);
      },
      M, N, t);
}

#endif

}  // namespace

// w: blocked [N / 16][K / 4][16][4], stored + 128; scale: [K / 32][N] bf16, or fp16 where half_scales
// (`int8_gemm.pack`)
// 0: done; 1: K is not a multiple of 32 or N of 16; 2: M < 1; 3: not built for AVX-512; 4: no VNNI
extern "C" int asyncexec_int8_gemm(const c10::BFloat16* x, const c10::BFloat16* inv_s, const uint8_t* w,
                                   const void* scale, c10::BFloat16* y, int64_t M, int64_t N, int64_t K,
                                   int64_t threads, int64_t half_scales) {
#if defined(CPU_CAPABILITY_AVX512)
  if (!__builtin_cpu_supports("avx512vnni")) return 4;
  if (K % kGroup != 0 || N % 16 != 0) return 1;
  if (M < 1) return 2;
  const int t = static_cast<int>(threads);
  const Quantized q = quantize_rows(x, inv_s, M, K, t);
  if (half_scales)
    run(q, w, static_cast<const c10::Half*>(scale), y, M, N, K, t);
  else
    run(q, w, static_cast<const c10::BFloat16*>(scale), y, M, N, K, t);
  return 0;
#else
  return 3;
#endif
}

// 1 where this build and CPU run the kernel, else 0
extern "C" int asyncexec_int8_gemm_ready() {
#if defined(CPU_CAPABILITY_AVX512)
  return __builtin_cpu_supports("avx512vnni") ? 1 : 0;
#else
  return 0;
#endif
}
