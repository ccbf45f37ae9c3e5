// int4 GEMM on AVX-512 VNNI for every step (asyncexec/ops/int4_gemm.py builds and calls it): the weights
// stay 4-bit, nothing dense is kept or made. The int8 GEMM's structure (int8_gemm.cpp), with the weights
// as llama.cpp's Q4_1 holds them and the activations as its Q8_1 (W4A8):
//
//   w[n, k] = q[n, k] * d[g, n] + mn[g, n]       q in 0..15; d, mn bf16; groups g of kGroup = 32 inputs
//   y[m, n] = sum_g sx[m, g] * d[g, n] * sum_{k in g} xq[m, k] * q[n, k]  +  mn[g, n] * xs[m, g]
//
// with xq the activations' signed codes per row and group, sx their scale and xs = sx * sum of the
// group's codes (`quantize_rows`, vnni.h). The nibbles are the unsigned operand of `vpdpbusd`, the
// codes the signed one, so no offset is taken out; products and a group's sums are exact in int32, the
// groups add up in float32.
//
// The weights are blocked at load, [N / 16][K / 8][16][4] bytes (`int4_gemm.pack`): one 64-byte vector
// holds 8 inputs of 16 output channels, the low nibbles of its 4 bytes per channel inputs k .. k + 3, the
// high ones k + 4 .. k + 7; a mask and a shift make the two vectors `vpdpbusd` multiplies with 4 codes of
// one row, broadcast. A group of 32 inputs of 16 channels is 256 bytes of codes and 64 of d and mn: 5 bits
// a weight, Q4_1's size. Threads take output channels, as in int8_gemm.cpp.
#include "vnni.h"

namespace {

using namespace asyncexec_vnni;

#if defined(CPU_CAPABILITY_AVX512)
// rows m0 .. m0 + R - 1, output channels 16 * c0 .. 16 * (c0 + NB) - 1
// S: the scales' type (bf16, or fp16 from a GGUF file); mn null: Q4_0, w = (q - 8) * d
template <int R, int NB, typename S>
ASYNCEXEC_VNNI inline void block(const Quantized& x, const uint8_t* w, const S* d, const S* mn, c10::BFloat16* y,
                                 int64_t m0, int64_t c0, int64_t N, int64_t K) {
  __m512 out[R * NB];
#pragma GCC unroll 8
  for (int i = 0; i < R * NB; ++i) out[i] = _mm512_setzero_ps();
  const int64_t k8n = K / 8, k4n = K / 4, groups = K / kGroup;
  const uint8_t* wc = w + c0 * k8n * 64;
  const int32_t* xr = reinterpret_cast<const int32_t*>(x.xq + m0 * K);
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R * NB];
#pragma GCC unroll 8
    for (int i = 0; i < R * NB; ++i) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t k8 = g * (kGroup / 8); k8 < (g + 1) * (kGroup / 8); ++k8) {
      __m512i lo[NB], hi[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const __m512i v = _mm512_loadu_si512(wc + (j * k8n + k8) * 64);
        lo[j] = _mm512_and_si512(v, low);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i x0 = _mm512_set1_epi32(xr[r * k4n + 2 * k8]);
        const __m512i x1 = _mm512_set1_epi32(xr[r * k4n + 2 * k8 + 1]);
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) {
          acc[r * NB + j] = _mm512_dpbusd_epi32(acc[r * NB + j], lo[j], x0);
          acc[r * NB + j] = _mm512_dpbusd_epi32(acc[r * NB + j], hi[j], x1);
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const __m512 dv = load_scales(d + g * N + (c0 + j) * 16);
      const __m512 mv = mn ? load_scales(mn + g * N + (c0 + j) * 16) : _mm512_mul_ps(dv, _mm512_set1_ps(-8.0f));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * groups + g;
        const __m512 scaled = _mm512_mul_ps(dv, _mm512_set1_ps(x.sx[at]));
        out[r * NB + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r * NB + j]), scaled, out[r * NB + j]);
        out[r * NB + j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.xs[at]), out[r * NB + j]);
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
void run(const Quantized& q, const uint8_t* w, const S* d, const S* mn, c10::BFloat16* y, int64_t M, int64_t N,
         int64_t K, int t) {
  for_columns(
      [&](auto nb, int64_t c0) {
        for_rows([&](auto r, int64_t m0) { block<decltype(r)::value, decltype(nb)::value>(q, w, d, mn, y, m0, c0, N, K); }, M);
      },
      M, N, t);
}

#endif

}  // namespace

// w: blocked nibbles [N / 16][K / 8][16][4]; d, mn: [K / 32][N], bf16, or fp16 where half_scales; mn null:
// Q4_0's symmetric codes, w = (q - 8) * d (`int4_gemm.pack`)
// 0: done; 1: K is not a multiple of 32 or N of 16; 2: M < 1; 3: not built for AVX-512; 4: no VNNI
extern "C" int asyncexec_int4_gemm(const c10::BFloat16* x, const uint8_t* w, const void* d, const void* mn,
                                   c10::BFloat16* y, int64_t M, int64_t N, int64_t K, int64_t threads,
                                   int64_t half_scales) {
#if defined(CPU_CAPABILITY_AVX512)
  if (!__builtin_cpu_supports("avx512vnni")) return 4;
  if (K % kGroup != 0 || N % 16 != 0) return 1;
  if (M < 1) return 2;
  const int t = static_cast<int>(threads);
  const Quantized q = quantize_rows(x, nullptr, M, K, t);
  if (half_scales)
    run(q, w, static_cast<const c10::Half*>(d), static_cast<const c10::Half*>(mn), y, M, N, K, t);
  else
    run(q, w, static_cast<const c10::BFloat16*>(d), static_cast<const c10::BFloat16*>(mn), y, M, N, K, t);
  return 0;
#else
  return 3;
#endif
}

// 1 where this build and CPU run the kernel, else 0
extern "C" int asyncexec_int4_gemm_ready() {
#if defined(CPU_CAPABILITY_AVX512)
  return __builtin_cpu_supports("avx512vnni") ? 1 : 0;
#else
  return 0;
#endif
}
