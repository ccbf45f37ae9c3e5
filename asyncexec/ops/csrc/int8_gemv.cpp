// int8 weight-only GEMV for steps of 1-4 rows (asyncexec/ops/int8_gemv.py builds and calls it).
//
//   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]     x, y, scale: bf16; w: int8 [N, K]; fp32 accumulation
//
// A lone stream's step reads every weight once, so this is a memory stream: each thread takes blocks of 4
// output channels (4 weight rows, contiguous), converts 16 (AVX-512) or 8 (AVX2) int8 weights at a time
// to float and multiplies them with the rows of x, and prefetches the weights 4 KiB ahead. The scale is
// applied once per output, not per weight. Built by inductor's C++ compiler driver, which defines
// CPU_CAPABILITY_AVX512 or CPU_CAPABILITY_AVX2 for this CPU and links OpenMP (torch's own runtime).
#include <immintrin.h>
#include <omp.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int kPrefetchBytes = 4096;
constexpr int kBlockN = 4;

#if defined(CPU_CAPABILITY_AVX512)
using vf = __m512;
constexpr int V = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#define ASYNCEXEC_INT8_GEMV 1
#elif defined(CPU_CAPABILITY_AVX2)
using vf = __m256;
constexpr int V = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#define ASYNCEXEC_INT8_GEMV 1
#endif

#ifdef ASYNCEXEC_INT8_GEMV
// outputs n0 .. n0 + NB - 1 of all M rows
template <int M, int NB>
inline void block(const float* xf, const int8_t* w, const c10::BFloat16* scale, c10::BFloat16* y,
                  int64_t n0, int64_t N, int64_t K) {
  vf acc[M * NB];
#pragma GCC unroll 16
  for (int i = 0; i < M * NB; ++i) acc[i] = vzero();
  const int8_t* rows = w + n0 * K;
  for (int64_t k = 0; k < K; k += V) {
    // NB rows consume NB * V bytes per step: one cache line ahead per step on AVX-512
    _mm_prefetch(reinterpret_cast<const char*>(rows + kPrefetchBytes + k * NB), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const vf wv = vload_i8(rows + j * K + k);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc[m * NB + j] = vfma(vload(xf + m * K + k), wv, acc[m * NB + j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const float s = static_cast<float>(scale[n0 + j]);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) y[m * N + n0 + j] = static_cast<c10::BFloat16>(vsum(acc[m * NB + j]) * s);
  }
}

template <int M>
void gemv(const float* xf, const int8_t* w, const c10::BFloat16* scale, c10::BFloat16* y, int64_t N,
          int64_t K, int threads) {
  const int64_t blocks = N / kBlockN;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) block<M, kBlockN>(xf, w, scale, y, b * kBlockN, N, K);
  for (int64_t n = blocks * kBlockN; n < N; ++n) block<M, 1>(xf, w, scale, y, n, N, K);
}
#endif

}  // namespace

// 0: done; 1: K is not a multiple of the vector width; 2: M is not 1-4; 3: no AVX2 or AVX-512 build
extern "C" int asyncexec_int8_gemv(const c10::BFloat16* x, const int8_t* w, const c10::BFloat16* scale,
                                   c10::BFloat16* y, int64_t M, int64_t N, int64_t K, int64_t threads) {
#ifdef ASYNCEXEC_INT8_GEMV
  if (K % V != 0) return 1;
  if (M < 1 || M > 4) return 2;
  thread_local std::vector<float> xf;  // x in float, read once per output block
  xf.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(x[i]);
  const int t = static_cast<int>(threads);
  switch (M) {
    case 1: gemv<1>(xf.data(), w, scale, y, N, K, t); break;
    case 2: gemv<2>(xf.data(), w, scale, y, N, K, t); break;
    case 3: gemv<3>(xf.data(), w, scale, y, N, K, t); break;
    default: gemv<4>(xf.data(), w, scale, y, N, K, t); break;
  }
  return 0;
#else
  return 3;
#endif
}

extern "C" int asyncexec_int8_gemv_width() {
#ifdef ASYNCEXEC_INT8_GEMV
  return V;
#else
  return 0;
#endif
}
