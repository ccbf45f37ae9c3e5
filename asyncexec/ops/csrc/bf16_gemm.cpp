// bf16 GEMM on AVX-512 BF16 whose sums do not depend on the number of rows (asyncexec/ops/bf16_gemm.py
// builds and calls it): the batch-invariant mode's dense linears (`EngineConfig.batch_invariant`).
//
//   y[m, n] = bias[n] + sum_k x[m, k] * w[n, k]      x, w, bias, y: bf16; sums in float32
//
// Why not oneDNN's bf16 matmul: it picks its kernel and its blocking of K by the number of rows (a GEMV
// for one row, other blockings for hundreds), so a row's output moves by an ulp with the batch it is
// in (measured on a 2-core EPYC: a 2048 x 8192 weight gave other bits at 1 row and at 600 than at 2-512).
// Here every output is one float32 accumulator walked through K in one fixed order, two inputs at a
// time (`vdpbf16ps`), whatever M is, whichever block of rows or thread computes it; the bias is added
// in float32 and the sum rounded once to bf16 (nearest even).
//
// The weights are blocked at load, [N / 16][K / 2][16][2] (`bf16_gemm.pack`): one 64-byte vector holds 2
// inputs of 16 output channels, which `vdpbf16ps` multiplies with 2 inputs of one row, broadcast, into
// 16 float sums (the int8 GEMM's layout, `int8_gemm.cpp`, with pairs for quads). Threads take output
// channels and rows go in blocks of 4 (`for_columns`, `for_rows` of vnni.h), as in the int8 GEMM.
#include "vnni.h"

namespace {

using namespace asyncexec_vnni;

#if defined(CPU_CAPABILITY_AVX512)
#define ASYNCEXEC_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))

// rows m0 .. m0 + R - 1, output channels 16 * c0 .. 16 * (c0 + NB) - 1
template <int R, int NB>
ASYNCEXEC_BF16 inline void block(const c10::BFloat16* x, const uint16_t* w, const c10::BFloat16* bias,
                                 c10::BFloat16* y, int64_t m0, int64_t c0, int64_t N, int64_t K) {
  __m512 out[R * NB];
#pragma GCC unroll 8
  for (int i = 0; i < R * NB; ++i) out[i] = _mm512_setzero_ps();
  const int64_t k2n = K / 2;
  const uint16_t* wc = w + c0 * k2n * 32;
  const int32_t* xr = reinterpret_cast<const int32_t*>(x + m0 * K);
#pragma GCC unroll 4
  for (int64_t k2 = 0; k2 < k2n; ++k2) {
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wc + (j * k2n + k2) * 32);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[r * k2n + k2]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) out[r * NB + j] = _mm512_dpbf16_ps(out[r * NB + j], xb, wv[j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const __m512 b = bias ? from_bf16(bias + (c0 + j) * 16) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + r) * N + (c0 + j) * 16),
                          to_bf16(_mm512_add_ps(out[r * NB + j], b)));
  }
}

void run(const c10::BFloat16* x, const uint16_t* w, const c10::BFloat16* bias, c10::BFloat16* y, int64_t M,
         int64_t N, int64_t K, int t) {
  for_columns(
      [&](auto nb, int64_t c0) {
        for_rows([&](auto r, int64_t m0) { block<decltype(r)::value, decltype(nb)::value>(x, w, bias, y, m0, c0, N, K); }, M);
      },
      M, N, t);
}

#endif

}  // namespace

// w: blocked [N / 16][K / 2][16][2] bf16 (`bf16_gemm.pack`); bias: [N] bf16 or null
// 0: done; 1: K is odd or N not a multiple of 16; 2: M < 1; 3: not built for AVX-512; 4: no AVX-512 BF16
extern "C" int asyncexec_bf16_gemm(const c10::BFloat16* x, const uint16_t* w, const c10::BFloat16* bias,
                                   c10::BFloat16* y, int64_t M, int64_t N, int64_t K, int64_t threads) {
#if defined(CPU_CAPABILITY_AVX512)
  if (!__builtin_cpu_supports("avx512bf16")) return 4;
  if (K % 2 != 0 || N % 16 != 0) return 1;
  if (M < 1) return 2;
  run(x, w, bias, y, M, N, K, static_cast<int>(threads));
  return 0;
#else
  return 3;
#endif
}

// 1 where this build and CPU run the kernel, else 0
extern "C" int asyncexec_bf16_gemm_ready() {
#if defined(CPU_CAPABILITY_AVX512)
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") ? 1 : 0;
#else
  return 0;
#endif
}
