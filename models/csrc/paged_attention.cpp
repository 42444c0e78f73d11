// Decode attention that reads K/V straight from a paged pool, for the CPU.
//
// One query token per sequence (decode). Pools are one layer's [C, KVH, P, D] (page slots, kv
// heads, tokens per page, head dim); `pages` [B, M] lists each sequence's slots in logical
// order and `allowed` [B, M * P] says which of those keys the query may see. Each
// (sequence, kv head) is one task of torch's thread pool: the G = H / KVH query heads that share
// the kv head are scored against every allowed key of its pages (each key row read once for all
// G), soft-maxed, and the values summed in the same pass over the pages. Nothing is gathered:
// the paged cache's torch path copies every page of every sequence into a [B, KVH, S, D] batch
// first, then reads it again.
//
// Float32 throughout. A query that may see no key gets zeros (as models.cache.attention).
// Built by models/cpu_attention.py with torch.utils.cpp_extension (-O3 -march=native
// -ffast-math, linked with glibc's libmvec: the exponentials vectorize). Common shapes (head
// dim 64 or 128; 1, 2, 3, 4 or 8 query heads per kv head) run specialized code: with AVX-512,
// sixteen keys' dot products at a time reduced together, and the value sums held in registers;
// other shapes and CPUs run the generic loops (auto-vectorized).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// the logit of a key the query may not see: finite (the build assumes finite math), its
// exponential 0 next to any real logit
constexpr float kMasked = -1e30f;

// One (sequence, kv head): its G query rows, its pages, and where its G output rows go.
struct Task {
  const float* q;        // [G, D]
  const float* k;        // the pool [C, KVH, P, D]
  const float* v;
  const int64_t* pages;  // [M]
  const bool* allowed;   // [M * P]
  float* out;            // [G, D]
  float* probs;          // scratch [G, S]
  int64_t M, P, KVH, h, G, D, S;
  float scale;
  const float* key(const float* pool, int64_t s) const {
    return pool + ((pages[s / P] * KVH + h) * P + s % P) * D;
  }
};

// Ask for the row of key s + ahead (the pages are scattered 4 KB blocks the hardware
// prefetcher does not follow from one to the next).
inline void prefetch_row(const Task& t, const float* pool, int64_t s) {
  if (s >= t.S) return;
  const char* r = reinterpret_cast<const char*>(t.key(pool, s));
  for (int64_t b = 0; b < t.D * 4; b += 64) __builtin_prefetch(r + b);
}
constexpr int64_t kAhead = 48;  // keys

// ---- generic: any G, D; loops the compiler vectorizes -------------------------------------
void logits_generic(const Task& t) {
  for (int64_t s = 0; s < t.S; ++s) {
    const float* kr = t.key(t.k, s);
    for (int64_t g = 0; g < t.G; ++g) {
      float acc[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= t.D; i += 16)
        for (int l = 0; l < 16; ++l) acc[l] += t.q[g * t.D + i + l] * kr[i + l];
      float dot = 0.f;
      for (int l = 0; l < 16; ++l) dot += acc[l];
      for (; i < t.D; ++i) dot += t.q[g * t.D + i] * kr[i];
      t.probs[g * t.S + s] = t.allowed[s] ? dot * t.scale : kMasked;
    }
  }
}

void values_generic(const Task& t) {
  std::fill(t.out, t.out + t.G * t.D, 0.f);
  for (int64_t s = 0; s < t.S; ++s) {
    if (!t.allowed[s]) continue;
    const float* vr = t.key(t.v, s);
    for (int64_t g = 0; g < t.G; ++g) {
      const float w = t.probs[g * t.S + s];
      float* o = t.out + g * t.D;
      for (int64_t d = 0; d < t.D; ++d) o[d] += w * vr[d];
    }
  }
}

// ---- fixed G, D ----------------------------------------------------------------------------
#if defined(__AVX512F__)
// lane i of the result = the sum of the 16 lanes of v[i]. The tree below leaves key j's sum in
// lane kLane[j]'s place, so the rows go in as rows[kPerm[j]] (kPerm is its own inverse).
constexpr int kPerm[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

inline __m512 sum16(const __m512* v) {
  __m512 w[8], u[4], z[2];
  for (int i = 0; i < 8; ++i)  // halves: lo = v[i]'s partials, hi = v[i + 8]'s
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[i], w[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // pairs within each quarter
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[i], u[i + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

template <int G, int D>
void logits_fixed(const Task& t) {
  constexpr int C = D / 16;
  __m512 q[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) q[g][c] = _mm512_loadu_ps(t.q + g * D + c * 16);
  alignas(64) float tmp[16];
  for (int64_t s0 = 0; s0 < t.S; s0 += 16) {
    const float* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = t.key(t.k, std::min<int64_t>(s0 + kPerm[j], t.S - 1));
    const int64_t n = std::min<int64_t>(16, t.S - s0);
    for (int j = 0; j < 16; ++j) {  // the values too: the value pass then reads them from cache
      prefetch_row(t, t.k, s0 + kAhead + j);
      prefetch_row(t, t.v, s0 + kAhead + j);
    }
    for (int g = 0; g < G; ++g) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_mul_ps(q[g][0], _mm512_loadu_ps(rows[j]));
        for (int c = 1; c < C; ++c) acc[j] = _mm512_fmadd_ps(q[g][c], _mm512_loadu_ps(rows[j] + c * 16), acc[j]);
      }
      _mm512_store_ps(tmp, sum16(acc));
      float* pr = t.probs + g * t.S + s0;
      for (int64_t i = 0; i < n; ++i) pr[i] = t.allowed[s0 + i] ? tmp[i] * t.scale : kMasked;
    }
  }
}
#else
template <int G, int D>
void logits_fixed(const Task& t) { logits_generic(t); }
#endif

template <int G, int D>
void values_fixed(const Task& t) {
  float acc[G][D] = {};
  for (int64_t s = 0; s < t.S; ++s) {
    if (!t.allowed[s]) continue;
    const float* vr = t.key(t.v, s);
    for (int g = 0; g < G; ++g) {
      const float w = t.probs[g * t.S + s];
      for (int d = 0; d < D; ++d) acc[g][d] += w * vr[d];
    }
  }
  std::copy(&acc[0][0], &acc[0][0] + G * D, t.out);
}

void softmax(const Task& t) {
  for (int64_t g = 0; g < t.G; ++g) {
    float* pr = t.probs + g * t.S;
    float mx = kMasked;
    for (int64_t s = 0; s < t.S; ++s) mx = std::max(mx, pr[s]);
    float sum = 0.f;
    for (int64_t s = 0; s < t.S; ++s) {  // a masked key: exp(-1e30 - max) is 0
      const float e = std::exp(pr[s] - mx);
      pr[s] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
    for (int64_t s = 0; s < t.S; ++s) pr[s] *= inv;
  }
}

using Kernel = void (*)(const Task&);

template <int G, int D>
void run_fixed(const Task& t) {
  logits_fixed<G, D>(t);
  softmax(t);
  values_fixed<G, D>(t);
}

void run_generic(const Task& t) {
  logits_generic(t);
  softmax(t);
  values_generic(t);
}

template <int D>
Kernel pick_g(int64_t g) {
  switch (g) {
    case 1: return run_fixed<1, D>;
    case 2: return run_fixed<2, D>;
    case 3: return run_fixed<3, D>;
    case 4: return run_fixed<4, D>;
    case 8: return run_fixed<8, D>;
    default: return run_generic;
  }
}

Kernel pick(int64_t g, int64_t d) {
  if (d == 64) return pick_g<64>(g);
  if (d == 128) return pick_g<128>(g);
  return run_generic;
}

void check(const at::Tensor& t, const char* name, int64_t dims, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dims, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

// q [B, H, D]; pool_k, pool_v [C, KVH, P, D]; pages [B, M] int64 slots in [0, C);
// allowed [B, M * P] bool. Returns [B, H, D].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v, at::Tensor pages,
                                  at::Tensor allowed, double scale) {
  check(q, "q", 3, at::kFloat);
  check(pool_k, "pool_k", 4, at::kFloat);
  check(pool_v, "pool_v", 4, at::kFloat);
  check(pages, "pages", 2, at::kLong);
  check(allowed, "allowed", 2, at::kBool);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t C = pool_k.size(0), KVH = pool_k.size(1), P = pool_k.size(2), M = pages.size(1);
  TORCH_CHECK(pool_v.sizes() == pool_k.sizes(), "pool_v must have pool_k's shape");
  TORCH_CHECK(pool_k.size(3) == D, "pool head dim ", pool_k.size(3), " != q head dim ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "q heads ", H, " must be a multiple of kv heads ", KVH);
  TORCH_CHECK(pages.size(0) == B && allowed.size(0) == B, "pages and allowed need one row per sequence");
  TORCH_CHECK(allowed.size(1) == M * P, "allowed must have pages.size(1) * page_size = ", M * P, " columns");
  const int64_t* pg = pages.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * M; ++i) TORCH_CHECK(pg[i] >= 0 && pg[i] < C, "page slot ", pg[i], " outside the pool");

  auto out = at::empty({B, H, D}, q.options());
  const int64_t G = H / KVH, S = M * P;
  if (S == 0) return out.zero_();
  const Kernel kernel = pick(G, D);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(G * S);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      Task t{q.data_ptr<float>() + (b * H + h * G) * D, pool_k.data_ptr<float>(), pool_v.data_ptr<float>(),
             pg + b * M, allowed.data_ptr<bool>() + b * S, out.data_ptr<float>() + (b * H + h * G) * D,
             probs.data(), M, P, KVH, h, G, D, S, static_cast<float>(scale)};
      if (std::none_of(t.allowed, t.allowed + S, [](bool a) { return a; })) {
        std::fill(t.out, t.out + G * D, 0.f);
        continue;
      }
      kernel(t);
    }
  });
  return out;
}

TORCH_LIBRARY(tieredkv_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor pool_k, Tensor pool_v, Tensor pages, Tensor allowed, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(tieredkv_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
