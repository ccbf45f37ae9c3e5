// What asyncexec's VNNI GEMMs share (int8_gemm.cpp, int4_gemm.cpp; `ops.build` pastes this file where
// they include it): bf16 <-> float32 vectors, and the activations' quantization per row and group of
// kGroup = 32 inputs (as llama.cpp quantizes them per block of 32 for its integer dot products).
//
// A row of x (times `inv_s`, int8's activation-aware input scales, where given) is divided by
// sx[g] = max |x[g]| / 127 and rounded to nearest even, as torch.round, to signed codes: the signed
// operand of `vpdpbusd`, whose unsigned one is the weights (int8's stored + 128, int4's nibbles). Each
// group's sum of codes times sx (`xs`) takes the weights' offset (int8's 128, int4's minimum) back out.
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace asyncexec_vnni {

constexpr int kGroup = 32;  // inputs per activation scale

#if defined(CPU_CAPABILITY_AVX512)
#define ASYNCEXEC_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// 16 float lanes to bf16, rounded to nearest even (no AVX-512 BF16 needed)
ASYNCEXEC_VNNI inline __m256i to_bf16(__m512 v) {
  const __m512i xi = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(xi, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(xi, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

ASYNCEXEC_VNNI inline __m512 from_bf16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 weight scales to float: bf16 (quantized here) or fp16 (as a GGUF file ships them)
ASYNCEXEC_VNNI inline __m512 load_scales(const c10::BFloat16* p) { return from_bf16(p); }
ASYNCEXEC_VNNI inline __m512 load_scales(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// one row of x to codes, its scale per group and each group's sum of codes times the scale
ASYNCEXEC_VNNI inline void quantize_row(const c10::BFloat16* x, const c10::BFloat16* inv_s, uint8_t* xq, float* sx,
                                 float* xs, int64_t K) {
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    __m512 v[kGroup / 16];
    __m512 vmax = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int i = 0; i < kGroup / 16; ++i) {
      const int64_t k = g * kGroup + i * 16;
      v[i] = from_bf16(x + k);
      if (inv_s) v[i] = _mm512_mul_ps(v[i], from_bf16(inv_s + k));
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v[i]));
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    sx[g] = s;
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < kGroup / 16; ++i) {  // rounds to nearest even, as torch.round
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));
      q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
      sum = _mm512_add_epi32(sum, q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * kGroup + i * 16), _mm512_cvtepi32_epi8(q));
    }
    xs[g] = s * static_cast<float>(_mm512_reduce_add_epi32(sum));
  }
}
// every row of x quantized, into this thread's buffers (reused from call to call): codes [M][K], scales
// and scaled sums [M][K / kGroup]
struct Quantized {
  const uint8_t* xq;
  const float* sx;
  const float* xs;
};

ASYNCEXEC_VNNI inline Quantized quantize_rows(const c10::BFloat16* x, const c10::BFloat16* inv_s, int64_t M, int64_t K,
                                       int threads) {
  thread_local std::vector<uint8_t> xq;
  thread_local std::vector<float> sx, xs;
  const int64_t groups = K / kGroup;
  xq.resize(M * K);
  sx.resize(M * groups);
  xs.resize(M * groups);
  uint8_t* q = xq.data();  // thread_local: each OpenMP thread would see its own (empty) vectors
  float* s = sx.data();
  float* t = xs.data();
  if (M >= 8) {  // a region of its own costs more than a few rows' quantization (about 36 us)
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; ++m)
      quantize_row(x + m * K, inv_s, q + m * K, s + m * groups, t + m * groups, K);
  } else {
    for (int64_t m = 0; m < M; ++m)
      quantize_row(x + m * K, inv_s, q + m * K, s + m * groups, t + m * groups, K);
  }
  return {q, s, t};
}
// the rows in blocks of kBlockM, the rest as one block of 1-3: `block(r, m0)` computes rows m0 ..
// m0 + r - 1 (r a std::integral_constant)
constexpr int kBlockM = 4;

template <class Block>
ASYNCEXEC_VNNI void for_rows(const Block& block, int64_t M) {
  int64_t m = 0;
  for (; m + kBlockM <= M; m += kBlockM) block(std::integral_constant<int, kBlockM>{}, m);
  switch (M - m) {
    case 3: block(std::integral_constant<int, 3>{}, m); break;
    case 2: block(std::integral_constant<int, 2>{}, m); break;
    case 1: block(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// the output channels' vectors of 16 split between threads: `column(nb, c0)` computes vectors c0 ..
// c0 + nb - 1 (nb a std::integral_constant) for every row. Up to 2 rows the step streams the weights
// from memory: 4 vectors at a time, more loads in flight; more rows take 2, which keeps the
// accumulators of 4 rows in registers.
template <class Column>
ASYNCEXEC_VNNI void for_columns(const Column& column, int64_t M, int64_t N, int threads) {
  const int64_t vectors = N / 16;
  if (M <= 2) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < vectors / 4; ++b) column(std::integral_constant<int, 4>{}, b * 4);
    for (int64_t c = vectors / 4 * 4; c < vectors; ++c) column(std::integral_constant<int, 1>{}, c);
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < vectors / 2; ++b) column(std::integral_constant<int, 2>{}, b * 2);
  if (vectors % 2) column(std::integral_constant<int, 1>{}, vectors - 1);
}
#endif

}  // namespace asyncexec_vnni
