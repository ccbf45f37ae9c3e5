// Paged decode attention on CPU (asyncexec/ops/paged_decode.py builds and calls it).
//
//   out[b, h] = softmax(scale * q[b, h] . K[b, t]) . V[b, t]   over the positions t of row b's blocks
//
// One query token per row; K/V are read where they lie in the paged cache [num_blocks, block_size, Hkv,
// D] through the row's block table, never copied. Each (row, KV head) is one task over the OpenMP threads:
// the G = H / Hkv query heads that share the KV head read each key and value once. Two passes: scores
// (one dot per key and query head) and their max, then exp, sum and the weighted sum of V, all in float32.
// ATen's vector types (at::vec, the same ones inductor's kernels use) give the CPU's vector width and a
// vectorized exp. Built by inductor's C++ compiler driver with this CPU's CPU_CAPABILITY flags.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();

inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_to_float(p, v);
  return v;
}

inline float hsum(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v); }

// exp(s - mx) in place over n scores (n padded to a multiple of V with -inf); returns their sum
inline float exp_sum(float* s, int64_t n, float mx) {
  const Vec m(mx);
  Vec acc(0.f);
  for (int64_t i = 0; i < n; i += V) {
    Vec e = (Vec::loadu(s + i) - m).exp_u20();
    e.store(s + i);
    acc = acc + e;
  }
  return hsum(acc);
}

constexpr int kMaxG = 8;  // query heads per KV head the kernel serves
// Keys and values are requested this many positions ahead of the one being read. One task walks its row's
// blocks one position (D elements) at a time, and without this the loads stall on memory one after the
// other: on a 2-core AMX Xeon, 32 rows of 16-384 tokens with the caches in memory, 561 us a layer
// without, 229-286 us with (8 ahead: 404 us; 64: 407 us).
constexpr int64_t kAhead = 24;

template <typename T, int ND>
inline void prefetch(const T* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < ND * V * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

// One (row, KV head): ND vectors per head (D = ND * V), G query heads, keys start .. len - 1.
template <typename T, int ND>
void attend_one(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t start, int64_t len,
                T* o, int64_t G, int64_t row_stride, int64_t BS, float scale, std::vector<float>& scores) {
  const int64_t n = len - start;
  const int64_t np = (n + V - 1) / V * V;
  scores.assign(G * np, -std::numeric_limits<float>::infinity());
  Vec qv[kMaxG * ND];
  for (int64_t j = 0; j < G; ++j)
    for (int c = 0; c < ND; ++c) qv[j * ND + c] = load(q + j * ND * V + c * V) * Vec(scale);
  float mx[kMaxG];
  std::fill(mx, mx + kMaxG, -std::numeric_limits<float>::infinity());
  for (int64_t t = start; t < len; ++t) {
    const T* k = kc + (table[t / BS] * BS + t % BS) * row_stride;
    if (t + kAhead < len) {  // the values too: the second pass finds them in cache
      const int64_t ahead = (table[(t + kAhead) / BS] * BS + (t + kAhead) % BS) * row_stride;
      prefetch<T, ND>(kc + ahead);
      prefetch<T, ND>(vc + ahead);
    }
    Vec kv[ND];
    for (int c = 0; c < ND; ++c) kv[c] = load(k + c * V);
    for (int64_t j = 0; j < G; ++j) {
      Vec a = qv[j * ND] * kv[0];
      for (int c = 1; c < ND; ++c) a = at::vec::fmadd(qv[j * ND + c], kv[c], a);
      const float s = hsum(a);
      scores[j * np + t - start] = s;
      mx[j] = std::max(mx[j], s);
    }
  }
  float inv[kMaxG];
  for (int64_t j = 0; j < G; ++j) inv[j] = 1.f / exp_sum(scores.data() + j * np, np, mx[j]);
  Vec acc[kMaxG * ND];
  for (int64_t i = 0; i < G * ND; ++i) acc[i] = Vec(0.f);
  for (int64_t t = start; t < len; ++t) {
    const T* v = vc + (table[t / BS] * BS + t % BS) * row_stride;
    Vec vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = load(v + c * V);
    for (int64_t j = 0; j < G; ++j) {
      const Vec p(scores[j * np + t - start]);
      for (int c = 0; c < ND; ++c) acc[j * ND + c] = at::vec::fmadd(p, vv[c], acc[j * ND + c]);
    }
  }
  float buf[ND * V];
  for (int64_t j = 0; j < G; ++j) {
    for (int c = 0; c < ND; ++c) (acc[j * ND + c] * Vec(inv[j])).store(buf + c * V);
    for (int64_t d = 0; d < ND * V; ++d) o[j * ND * V + d] = static_cast<T>(buf[d]);
  }
}

template <typename T, int ND>
void attend(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out,
            int64_t B, int64_t H, int64_t Hkv, int64_t BS, int64_t W, float scale, int64_t window,
            int threads) {
  constexpr int64_t D = ND * V;
  const int64_t G = H / Hkv;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t len = std::min(lens[b], W * BS);
        const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        T* o = out + (b * H + h * G) * D;
        if (len <= start) {  // nothing to attend (a padded row): zeros
          std::fill(o, o + G * D, static_cast<T>(0.f));
          continue;
        }
        attend_one<T, ND>(q + (b * H + h * G) * D, kc + h * D, vc + h * D, tables + b * W, start, len, o,
                          G, Hkv * D, BS, scale, scores);
      }
    }
  }
}

template <typename T>
int dispatch(const void* q, const void* kc, const void* vc, const int64_t* tables, const int64_t* lens,
             void* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t BS, int64_t W, float scale,
             int64_t window, int threads) {
  auto* qp = static_cast<const T*>(q);
  auto* kp = static_cast<const T*>(kc);
  auto* vp = static_cast<const T*>(vc);
  auto* op = static_cast<T*>(out);
#define ASYNCEXEC_ND(nd) \
  case nd: attend<T, nd>(qp, kp, vp, tables, lens, op, B, H, Hkv, BS, W, scale, window, threads); return 0;
  switch (D / V) {
    ASYNCEXEC_ND(1) ASYNCEXEC_ND(2) ASYNCEXEC_ND(4) ASYNCEXEC_ND(8) ASYNCEXEC_ND(16)
    default: return 3;
  }
#undef ASYNCEXEC_ND
}

}  // namespace

// dtype: 0 float32, 1 bfloat16. Returns 0 when done, 1 for a dtype it does not serve, 2 for H / Hkv
// over kMaxG or not whole, 3 for a head size that is not 1, 2, 4, 8 or 16 vectors.
extern "C" int asyncexec_paged_decode(const void* q, const void* k_cache, const void* v_cache,
                                      const int64_t* tables, const int64_t* lens, void* out, int64_t dtype,
                                      int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t BS, int64_t W,
                                      double scale, int64_t window, int64_t threads) {
  if (Hkv <= 0 || H % Hkv != 0 || H / Hkv > kMaxG) return 2;
  if (D % V != 0) return 3;
  const int t = static_cast<int>(threads);
  const float s = static_cast<float>(scale);
  if (dtype == 0) return dispatch<float>(q, k_cache, v_cache, tables, lens, out, B, H, Hkv, D, BS, W, s, window, t);
  if (dtype == 1)
    return dispatch<c10::BFloat16>(q, k_cache, v_cache, tables, lens, out, B, H, Hkv, D, BS, W, s, window, t);
  return 1;
}

extern "C" int asyncexec_paged_decode_width() { return static_cast<int>(V); }
