// Decode attention that reads K/V straight from a paged pool, for the CPU.
//
// One query token per sequence (decode). Pools are one layer's [C, KVH, P, D] (page slots, kv
// heads, tokens per page, head dim); `pages` [B, M] lists each sequence's slots in logical
// order and `allowed` [B, M * P] says which of those keys the query may see. Each
// (sequence, kv head) is one task of torch's thread pool: the G = H / KVH query heads that share
// the kv head are scored against every allowed key of its pages (each key row read once for all
// G), soft-maxed, and the values summed in the same pass over the pages; with enough sequences
// to keep every thread busy, a sequence's kv heads are one task, read page by page (by_sequence,
// run_fixed). Nothing is gathered:
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
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// the logit of a key the query may not see: finite (the build assumes finite math), its
// exponential 0 next to any real logit
constexpr float kMasked = -1e30f;
// The lowest argument given to the exponential: glibc's vector exponential takes a slow scalar path
// for a lane that underflows (below about -87.3), and exp(-87) is already 0 next to a sum of at least 1.
constexpr float kExpFloor = -87.f;

float bf16(const uint8_t* p, int64_t i) {
  uint16_t b;
  std::memcpy(&b, p + 2 * i, 2);
  return static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits()));
}
float fp16(const uint8_t* p, int64_t i) {
  uint16_t b;
  std::memcpy(&b, p + 2 * i, 2);
  return static_cast<float>(c10::Half(b, c10::Half::from_bits()));
}

// The warm pool's codec as the op reads it (plugins/codec.py, docs/codec.md): asymmetric
// integer codes of `bits` bits, bit-packed little-endian; keys grouped per channel (one
// bfloat16 scale and float16 zero point per kv head and channel, over the page's P tokens,
// codes in [KVH, D, P] order), values per token in groups of `vgroup` channels (codes in
// [KVH, P, D] order); x = code * scale + zero in float32.
struct WarmCodec {
  int64_t bits, vgroup, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero;
  int64_t code(const uint8_t* page, int64_t section, int64_t i) const {
    const int64_t per = 8 / bits;
    return (page[section + i / per] >> ((i % per) * bits)) & ((1 << bits) - 1);
  }
  // kv head h of an encoded page -> its keys and values [P, D] float32
  void decode(const uint8_t* page, int64_t h, int64_t P, int64_t D, float* k, float* v) const {
    for (int64_t d = 0; d < D; ++d) {
      const float s = bf16(page + k_scale, h * D + d), z = fp16(page + k_zero, h * D + d);
      for (int64_t p = 0; p < P; ++p) k[p * D + d] = code(page, k_codes, (h * D + d) * P + p) * s + z;
    }
    for (int64_t p = 0; p < P; ++p)
      for (int64_t d0 = 0; d0 < D; d0 += vgroup) {
        const int64_t grp = ((h * P + p) * D + d0) / vgroup;
        const float s = bf16(page + v_scale, grp), z = fp16(page + v_zero, grp);
        for (int64_t d = d0; d < d0 + vgroup; ++d) v[p * D + d] = code(page, v_codes, (h * P + p) * D + d) * s + z;
      }
  }
};

// One (sequence, kv head): its G query rows, where each of its pages' rows for this kv head
// start (pool slot, decoded warm page or extra page: the passes below do not care which), and
// where its G output rows go.
struct Task {
  const float* q;        // [G, D]
  const float* const* kp;  // [M]: page m's [P, D] key rows for this kv head
  const float* const* vp;  // [M]: its value rows
  const bool* allowed;   // [M * P]
  float* out;            // [G, D]
  float* probs;          // scratch [G, S]
  int64_t M, P, G, D, S;
  float scale;
  // encoded warm pages read in place (see warm_in_place): page m's bytes, or null where page m
  // is in kp / vp; null altogether otherwise
  const uint8_t* const* wp;
  const WarmCodec* codec;
  int64_t h;  // the kv head
  const float* key(const float* const* pages, int64_t s) const { return pages[s / P] + (s % P) * D; }
};

// Ask for the row of key s + ahead (the pages are scattered 4 KB blocks the hardware
// prefetcher does not follow from one to the next).
inline void prefetch_row(const Task& t, const float* const* pages, int64_t s) {
  if (s >= t.S) return;
  const char* r = reinterpret_cast<const char*>(t.key(pages, s));
  for (int64_t b = 0; b < t.D * 4; b += 64) __builtin_prefetch(r + b);
}
constexpr int64_t kAhead = 48;  // keys

// ---- generic: any G, D; loops the compiler vectorizes -------------------------------------
void logits_generic(const Task& t) {
  for (int64_t s = 0; s < t.S; ++s) {
    if (!t.allowed[s]) {
      for (int64_t g = 0; g < t.G; ++g) t.probs[g * t.S + s] = kMasked;
      continue;
    }
    const float* kr = t.key(t.kp, s);
    for (int64_t g = 0; g < t.G; ++g) {
      float acc[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= t.D; i += 16)
        for (int l = 0; l < 16; ++l) acc[l] += t.q[g * t.D + i + l] * kr[i + l];
      float dot = 0.f;
      for (int l = 0; l < 16; ++l) dot += acc[l];
      for (; i < t.D; ++i) dot += t.q[g * t.D + i] * kr[i];
      t.probs[g * t.S + s] = dot * t.scale;
    }
  }
}

void values_generic(const Task& t) {
  std::fill(t.out, t.out + t.G * t.D, 0.f);
  for (int64_t s = 0; s < t.S; ++s) {
    if (!t.allowed[s]) continue;
    const float* vr = t.key(t.vp, s);
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

// 16 4-bit codes (8 bytes, value i in bits [4 (i % 2), 4 (i % 2) + 4) of byte i / 2) as floats
inline __m512 nibbles16(const uint8_t* p) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(x, m), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
}

// The logits of a warm page's 16 keys (P = 16, 4-bit codes) read in place: its key codes are
// per channel, so channel d of the 16 keys is one vector, code * scale + zero, and each query
// head's logits are a sum over d of q[d] times it (no reduction across lanes).
template <int G, int D>
void warm_logits(const Task& t, const uint8_t* page, __m512* acc) {
  const WarmCodec& c = *t.codec;
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const int64_t row = t.h * D + d;
    const __m512 k = _mm512_fmadd_ps(nibbles16(page + c.k_codes + row * 8), _mm512_set1_ps(bf16(page + c.k_scale, row)),
                                     _mm512_set1_ps(fp16(page + c.k_zero, row)));
    for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(t.q[g * D + d]), k, acc[g]);
  }
}

// Row p of a warm page's values (4-bit codes, per-token groups of a multiple of 16 channels) as
// D floats.
template <int D>
void warm_value_row(const Task& t, const uint8_t* page, int64_t p, float* out) {
  const WarmCodec& c = *t.codec;
  const int64_t first = (t.h * t.P + p) * D;  // the row's first value in the page's [KVH, P, D] order
  for (int d0 = 0; d0 < D; d0 += 16) {
    const int64_t grp = (first + d0) / c.vgroup;
    _mm512_storeu_ps(out + d0, _mm512_fmadd_ps(nibbles16(page + c.v_codes + (first + d0) / 2),
                                               _mm512_set1_ps(bf16(page + c.v_scale, grp)),
                                               _mm512_set1_ps(fp16(page + c.v_zero, grp))));
  }
}

// Ask for the bytes of page m's kv head t.h if it is held encoded (its key codes, scales and zero
// points, and its value codes: what warm_logits and warm_value_row read).
template <int D>
inline void prefetch_warm(const Task& t, int64_t m) {
  if (m >= t.M || !t.wp || !t.wp[m]) return;
  const WarmCodec& c = *t.codec;
  const uint8_t* page = t.wp[m];
  for (int64_t b = 0; b < D * 8; b += 64) __builtin_prefetch(page + c.k_codes + t.h * D * 8 + b);
  for (int64_t b = 0; b < D * 2; b += 64) {
    __builtin_prefetch(page + c.k_scale + t.h * D * 2 + b);
    __builtin_prefetch(page + c.k_zero + t.h * D * 2 + b);
  }
  for (int64_t b = 0; b < t.P * D / 2; b += 64) __builtin_prefetch(page + c.v_codes + t.h * t.P * D / 2 + b);
}
constexpr int64_t kWarmAhead = 2;  // pages

// The logits of keys [s0, s0 + 16) of one task.
template <int G, int D>
void logits_block(const Task& t, int64_t s0) {
  constexpr int C = D / 16;
  alignas(64) float tmp[16];
  const int64_t n = std::min<int64_t>(16, t.S - s0);
  if (t.wp) prefetch_warm<D>(t, s0 / 16 + kWarmAhead);
  if (std::none_of(t.allowed + s0, t.allowed + s0 + n, [](bool a) { return a; })) {
    for (int g = 0; g < G; ++g) std::fill(t.probs + g * t.S + s0, t.probs + g * t.S + s0 + n, kMasked);
    return;  // a page not attended (not selected): not read
  }
  if (t.wp && t.wp[s0 / 16]) {  // P = 16: the block is one page, held encoded
    __m512 acc[G];
    warm_logits<G, D>(t, t.wp[s0 / 16], acc);
    for (int g = 0; g < G; ++g) {
      _mm512_store_ps(tmp, acc[g]);
      float* pr = t.probs + g * t.S + s0;
      for (int64_t i = 0; i < n; ++i) pr[i] = t.allowed[s0 + i] ? tmp[i] * t.scale : kMasked;
    }
    return;
  }
  const float* rows[16];
  for (int j = 0; j < 16; ++j) rows[j] = t.key(t.kp, std::min<int64_t>(s0 + kPerm[j], t.S - 1));
  for (int j = 0; j < 16; ++j) {  // the values too: the value pass then reads them from cache
    prefetch_row(t, t.kp, s0 + kAhead + j);
    prefetch_row(t, t.vp, s0 + kAhead + j);
  }
  for (int g = 0; g < G; ++g) {
    __m512 q[C];
    for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(t.q + g * D + c * 16);
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_mul_ps(q[0], _mm512_loadu_ps(rows[j]));
      for (int c = 1; c < C; ++c) acc[j] = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(rows[j] + c * 16), acc[j]);
    }
    _mm512_store_ps(tmp, sum16(acc));
    float* pr = t.probs + g * t.S + s0;
    for (int64_t i = 0; i < n; ++i) pr[i] = t.allowed[s0 + i] ? tmp[i] * t.scale : kMasked;
  }
}

template <int G, int D>
void logits_fixed(const Task& t) {
  for (int64_t s0 = 0; s0 < t.S; s0 += 16) logits_block<G, D>(t, s0);
}
#else
template <int G, int D>
void logits_fixed(const Task& t) { logits_generic(t); }
#endif

// Adds keys [s0, s1)'s values, weighted by their probabilities, to acc [G][D].
template <int G, int D>
void values_range(const Task& t, int64_t s0, int64_t s1, float (&acc)[G][D]) {
  alignas(64) float row[D];
  for (int64_t s = s0; s < s1; ++s) {
    if (!t.allowed[s]) continue;
    const float* vr = t.key(t.vp, s);
#if defined(__AVX512F__)
    if (t.wp && t.wp[s / t.P]) {
      warm_value_row<D>(t, t.wp[s / t.P], s % t.P, row);
      vr = row;
    }
#endif
    for (int g = 0; g < G; ++g) {
      const float w = t.probs[g * t.S + s];
      for (int d = 0; d < D; ++d) acc[g][d] += w * vr[d];
    }
  }
}

template <int G, int D>
void values_fixed(const Task& t) {
  float acc[G][D] = {};
  values_range<G, D>(t, 0, t.S, acc);
  std::copy(&acc[0][0], &acc[0][0] + G * D, t.out);
}

void softmax(const Task& t) {
  for (int64_t g = 0; g < t.G; ++g) {
    float* pr = t.probs + g * t.S;
    float mx = kMasked;
    for (int64_t s = 0; s < t.S; ++s) mx = std::max(mx, pr[s]);
    float sum = 0.f;
    for (int64_t s = 0; s < t.S; ++s) {
      // a masked key's probability is 0; the others' arguments stay in the exponential's range
      const float e = pr[s] == kMasked ? 0.f : std::exp(std::max(pr[s] - mx, kExpFloor));
      pr[s] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
    for (int64_t s = 0; s < t.S; ++s) pr[s] *= inv;
  }
}

// A kernel runs n tasks: the kv heads of one sequence (n > 1), or one (sequence, kv head).
using Kernel = void (*)(const Task*, int64_t n);

// n > 1: the heads' pages read page by page, all heads of a page together — a pool slot holds
// the page's kv heads side by side, so a page is one run of KVH * P * D floats rather than KVH
// separate 4 KB blocks (the hardware prefetcher follows a run, not scattered blocks). Each head's
// keys are scored, soft-maxed and summed in the same order as alone: the same result, bit for bit.
template <int G, int D>
void run_fixed(const Task* ts, int64_t n) {
  if (n == 1) {
    logits_fixed<G, D>(ts[0]);
    softmax(ts[0]);
    values_fixed<G, D>(ts[0]);
    return;
  }
  const int64_t S = ts[0].S;
#if defined(__AVX512F__)
  for (int64_t s0 = 0; s0 < S; s0 += 16)
    for (int64_t i = 0; i < n; ++i) logits_block<G, D>(ts[i], s0);
#else
  for (int64_t i = 0; i < n; ++i) logits_fixed<G, D>(ts[i]);
#endif
  for (int64_t i = 0; i < n; ++i) softmax(ts[i]);
  std::vector<float> sums(n * G * D, 0.f);
  float acc[G][D];
  const int64_t block = ts[0].P;
  for (int64_t s0 = 0; s0 < S; s0 += block)
    for (int64_t i = 0; i < n; ++i) {
      float* a = sums.data() + i * G * D;
      std::copy(a, a + G * D, &acc[0][0]);
      values_range<G, D>(ts[i], s0, std::min(S, s0 + block), acc);
      std::copy(&acc[0][0], &acc[0][0] + G * D, a);
    }
  for (int64_t i = 0; i < n; ++i) std::copy(sums.data() + i * G * D, sums.data() + (i + 1) * G * D, ts[i].out);
}

void run_generic(const Task* ts, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    logits_generic(ts[i]);
    softmax(ts[i]);
    values_generic(ts[i]);
  }
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

// Where page m of sequence b lives: 0 the pool (by slot), 1 the warm pool (encoded, by slot),
// 2 the extra pages (by index: pages read from the host, disk or an exact copy).
enum Kind : int8_t { kPool = 0, kWarm = 1, kExtra = 2 };

struct Sources {
  const float *pool_k, *pool_v, *extra_k, *extra_v;
  const uint8_t* warm;
  int64_t warm_bytes;  // one encoded page
  WarmCodec codec;
  const int8_t* kind;   // [B, M]; null: every page in the pool
  Kind of(int64_t i) const { return kind ? static_cast<Kind>(kind[i]) : kPool; }
  const int64_t* slot;  // [B, M]
};

// Whether the kernel reads warm pages where they are (the specialized kernels with AVX-512, 16
// tokens per page, 4-bit codes, value groups of a multiple of 16 channels) instead of from a
// decoded copy in the task's scratch.
bool warm_in_place(const WarmCodec& c, bool fixed, int64_t P, int64_t D) {
#if defined(__AVX512F__)
  return fixed && P == 16 && c.bits == 4 && c.vgroup % 16 == 0 && D % 16 == 0;
#else
  return false;
#endif
}

// Whether a sequence's kv heads run as one task (read page by page: see run_fixed) rather than one
// task each: when there are enough sequences to keep every thread busy. The paged op only: the
// tiered op, whose pages come from three places and are mostly not attended at a bound budget,
// ran 14 % slower that way at batch 16 (docs/benchmarks.md §12, "Sixteenth pass").
bool by_sequence(int64_t B, int64_t KVH) { return KVH > 1 && B >= 4 * at::get_num_threads(); }

// Every (sequence, kv head): the page pointers resolved (warm pages decoded into the task's
// scratch), the kernel run — one sequence's heads together (`group` and by_sequence), or each head alone —
// and the attention mass per page summed over the head's query heads into mass [B, KVH, M] when
// asked for.
void run_tasks(const float* q, float* out, float* mass, const Sources& src, const bool* allowed, int64_t allowed_heads,
               int64_t B, int64_t H, int64_t KVH, int64_t M, int64_t P, int64_t D, float scale, bool group) {
  const int64_t G = H / KVH, S = M * P;
  const Kernel kernel = pick(G, D);
  const bool in_place = warm_in_place(src.codec, kernel != run_generic, P, D);
  const int64_t heads = group && by_sequence(B, KVH) ? KVH : 1;  // per unit of work
  // the keys task (b * KVH + h)'s queries may see: its sequence's row, or its kv head's
  const auto allowed_row = [&](int64_t task) {
    return allowed + (task / KVH * allowed_heads + (allowed_heads == 1 ? 0 : task % KVH)) * S;
  };
  at::parallel_for(0, B * KVH / heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(heads * G * S), zeros(P * D, 0.f), decoded;
    std::vector<const float*> kp(heads * M), vp(heads * M);
    std::vector<const uint8_t*> wp(in_place ? heads * M : 0, nullptr);
    std::vector<Task> tasks;
    std::vector<int64_t> ids;
    for (int64_t unit = begin; unit < end; ++unit) {
      tasks.clear();
      ids.clear();
      for (int64_t task = unit * heads; task < (unit + 1) * heads; ++task) {
        const bool* al = allowed_row(task);
        if (std::none_of(al, al + S, [](bool x) { return x; })) {
          float* o = out + task * G * D;
          std::fill(o, o + G * D, 0.f);
          if (mass) std::fill(mass + task * M, mass + (task + 1) * M, 0.f);
        } else {
          ids.push_back(task);
        }
      }
      // the warm pages decoded for the kernel (unless it reads them in place), sized first: the
      // tasks keep pointers into it
      int64_t n_warm = 0;
      for (const int64_t task : ids)
        for (int64_t m = 0; m < M; ++m) n_warm += !in_place && src.of(task / KVH * M + m) == kWarm;
      if (static_cast<int64_t>(decoded.size()) < 2 * n_warm * P * D) decoded.resize(2 * n_warm * P * D);
      int64_t w = 0;
      for (size_t i = 0; i < ids.size(); ++i) {
        const int64_t task = ids[i], b = task / KVH, h = task % KVH;
        const bool* al = allowed_row(task);
        const float** kpi = kp.data() + i * M;
        const float** vpi = vp.data() + i * M;
        const uint8_t** wpi = in_place ? wp.data() + i * M : nullptr;
        for (int64_t m = 0; m < M; ++m) {
          const int64_t slot = src.slot[b * M + m];
          if (in_place) wpi[m] = nullptr;
          if (std::none_of(al + m * P, al + (m + 1) * P, [](bool x) { return x; })) {
            kpi[m] = vpi[m] = zeros.data();  // not attended: never read
            continue;
          }
          switch (src.of(b * M + m)) {
            case kPool:
              kpi[m] = src.pool_k + (slot * KVH + h) * P * D;
              vpi[m] = src.pool_v + (slot * KVH + h) * P * D;
              break;
            case kExtra:
              kpi[m] = src.extra_k + (slot * KVH + h) * P * D;
              vpi[m] = src.extra_v + (slot * KVH + h) * P * D;
              break;
            default: {
              if (in_place) {  // read by the kernel itself
                kpi[m] = vpi[m] = zeros.data();
                wpi[m] = src.warm + slot * src.warm_bytes;
                break;
              }
              float* k = decoded.data() + 2 * w * P * D;
              src.codec.decode(src.warm + slot * src.warm_bytes, h, P, D, k, k + P * D);
              kpi[m] = k;
              vpi[m] = k + P * D;
              ++w;
            }
          }
        }
        tasks.push_back(Task{q + (b * H + h * G) * D, kpi, vpi, al, out + (b * H + h * G) * D,
                             probs.data() + i * G * S, M, P, G, D, S, scale, wpi, &src.codec, h});
      }
      if (tasks.empty()) continue;
      kernel(tasks.data(), static_cast<int64_t>(tasks.size()));
      if (mass)
        for (size_t i = 0; i < ids.size(); ++i) {
          const Task& t = tasks[i];
          float* ms = mass + ids[i] * M;
          for (int64_t m = 0; m < M; ++m) {
            float acc = 0.f;
            for (int64_t g = 0; g < G; ++g)
              for (int64_t p = 0; p < P; ++p) acc += t.probs[g * S + m * P + p];
            ms[m] = acc;
          }
        }
    }
  });
}

// A whole number of query heads per kv head (the attention ops and page_relevance).
void check_heads(int64_t H, int64_t KVH) {
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "q heads ", H, " must be a multiple of kv heads ", KVH);
}

// The arguments both attention ops share: q [B, H, D] and a pool pair [C, KVH, P, D], float32, with
// q's head dim and a whole number of query heads per kv head.
void check_q_pool(const at::Tensor& q, const at::Tensor& pool_k, const at::Tensor& pool_v) {
  check(q, "q", 3, at::kFloat);
  check(pool_k, "pool_k", 4, at::kFloat);
  check(pool_v, "pool_v", 4, at::kFloat);
  TORCH_CHECK(pool_v.sizes() == pool_k.sizes(), "pool_v must have pool_k's shape");
  TORCH_CHECK(pool_k.size(3) == q.size(2), "pool head dim ", pool_k.size(3), " != q head dim ", q.size(2));
  check_heads(q.size(1), pool_k.size(1));
}

void check_pages(const at::Tensor& slots, int64_t count, const char* what) {
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < count, "page slot ", s[i], " outside the ", what, " (", count, " pages)");
}

}  // namespace

// q [B, H, D]; pool_k, pool_v [C, KVH, P, D]; pages [B, M] int64 slots in [0, C);
// allowed [B, M * P] bool. Returns [B, H, D].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v, at::Tensor pages,
                                  at::Tensor allowed, double scale) {
  check_q_pool(q, pool_k, pool_v);
  check(pages, "pages", 2, at::kLong);
  check(allowed, "allowed", 2, at::kBool);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t C = pool_k.size(0), KVH = pool_k.size(1), P = pool_k.size(2), M = pages.size(1);
  TORCH_CHECK(pages.size(0) == B && allowed.size(0) == B, "pages and allowed need one row per sequence");
  TORCH_CHECK(allowed.size(1) == M * P, "allowed must have pages.size(1) * page_size = ", M * P, " columns");
  check_pages(pages, C, "pool");
  auto out = at::empty({B, H, D}, q.options());
  if (M * P == 0) return out.zero_();
  const Sources src{pool_k.data_ptr<float>(), pool_v.data_ptr<float>(), nullptr, nullptr, nullptr, 0, {},
                    nullptr, pages.data_ptr<int64_t>()};
  run_tasks(q.data_ptr<float>(), out.data_ptr<float>(), nullptr, src, allowed.data_ptr<bool>(), 1, B, H, KVH, M, P, D,
            static_cast<float>(scale), /*group=*/true);
  return out;
}

// The tiered cache's decode attention: pages from three places, named per page by kind [B, M]
// int8 (0: pool_k / pool_v [C, KVH, P, D] by slot; 1: warm [Cw, NB] uint8, encoded pages by
// slot, in the codec `warm_codec` = [bits, value group, then the byte offsets of the key codes,
// scales, zero points and the value codes, scales, zero points]; 2: extra_k / extra_v
// [X, KVH, P, D] by index) and slot [B, M] int64. allowed [B, 1 or KVH, M * P] bool: the keys each
// query (or each kv head's queries) may see; a page with no allowed key is not read. Returns
// (out [B, H, D], mass [B, KVH, M]: each page's attention probability summed over the kv head's
// query heads).
std::tuple<at::Tensor, at::Tensor> tiered_decode_attention(at::Tensor q, at::Tensor pool_k, at::Tensor pool_v,
                                                           at::Tensor extra_k, at::Tensor extra_v, at::Tensor warm,
                                                           at::IntArrayRef warm_codec, at::Tensor kind,
                                                           at::Tensor slot, at::Tensor allowed, double scale) {
  check_q_pool(q, pool_k, pool_v);
  check(extra_k, "extra_k", 4, at::kFloat);
  check(extra_v, "extra_v", 4, at::kFloat);
  check(warm, "warm", 2, at::kByte);
  check(kind, "kind", 2, at::kChar);
  check(slot, "slot", 2, at::kLong);
  check(allowed, "allowed", 3, at::kBool);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = pool_k.size(1), P = pool_k.size(2), M = slot.size(1), A = allowed.size(1);
  TORCH_CHECK(extra_k.sizes() == extra_v.sizes(), "extra_v must have extra_k's shape");
  TORCH_CHECK(extra_k.size(1) == KVH && extra_k.size(2) == P && extra_k.size(3) == D,
              "extra pages must be [*, KVH, P, D] like the pool's, with q's head dim ", D);
  TORCH_CHECK(kind.sizes() == slot.sizes() && slot.size(0) == B && allowed.size(0) == B,
              "kind, slot and allowed need one row per sequence (kind and slot of one shape)");
  TORCH_CHECK((A == 1 || A == KVH) && allowed.size(2) == M * P,
              "allowed must be [B, 1 or KVH, M * P] with M * P = ", M * P);
  TORCH_CHECK(warm_codec.size() == 8, "warm_codec: [bits, value group, 6 byte offsets], got ", warm_codec.size(),
              " values");
  const WarmCodec codec{warm_codec[0], warm_codec[1], warm_codec[2], warm_codec[3], warm_codec[4],
                        warm_codec[5], warm_codec[6], warm_codec[7]};
  const int8_t* kd = kind.data_ptr<int8_t>();
  const int64_t* sl = slot.data_ptr<int64_t>();
  const int64_t counts[3] = {pool_k.size(0), warm.size(0), extra_k.size(0)};
  for (int64_t i = 0; i < B * M; ++i) {
    TORCH_CHECK(kd[i] >= 0 && kd[i] <= 2, "page kind ", int(kd[i]), " is not 0 (pool), 1 (warm) or 2 (extra)");
    TORCH_CHECK(sl[i] >= 0 && sl[i] < counts[kd[i]], "page slot ", sl[i], " outside its source (",
                counts[kd[i]], " pages)");
  }
  const bool any_warm = std::any_of(kd, kd + B * M, [](int8_t k) { return k == kWarm; });
  if (any_warm) {
    TORCH_CHECK(std::all_of(warm_codec.begin() + 2, warm_codec.end(), [](int64_t o) { return o >= 0; }),
                "warm_codec: byte offsets must not be negative");
    TORCH_CHECK((codec.bits == 2 || codec.bits == 4 || codec.bits == 8) && codec.vgroup > 0 && D % codec.vgroup == 0,
                "warm_codec: bits must be 2, 4 or 8 and the value group divide the head dim");
    const int64_t n = KVH * P * D, need = std::max({codec.k_codes + n * codec.bits / 8, codec.v_codes + n * codec.bits / 8,
                                                    codec.k_scale + 2 * KVH * D, codec.k_zero + 2 * KVH * D,
                                                    codec.v_scale + 2 * n / codec.vgroup,
                                                    codec.v_zero + 2 * n / codec.vgroup});
    TORCH_CHECK(need <= warm.size(1), "warm_codec's sections reach byte ", need, " of a ", warm.size(1), "-byte page");
  }
  auto out = at::empty({B, H, D}, q.options());
  auto mass = at::zeros({B, KVH, M}, q.options());
  if (M * P == 0) return {out.zero_(), mass};
  const Sources src{pool_k.data_ptr<float>(), pool_v.data_ptr<float>(), extra_k.data_ptr<float>(),
                    extra_v.data_ptr<float>(), warm.data_ptr<uint8_t>(), warm.size(1), codec, kd, sl};
  run_tasks(q.data_ptr<float>(), out.data_ptr<float>(), mass.data_ptr<float>(), src, allowed.data_ptr<bool>(), A, B, H,
            KVH, M, P, D, static_cast<float>(scale), /*group=*/false);
  return {out, mass};
}

namespace {

// page_relevance's sums: for the G query heads q [G, D] of one kv head, sum_d max(q_d lo_d, q_d hi_d)
// of one page's summary rows lo, hi [D] into out[g * stride]. The heads' sums run side by side over
// d (one pass over the rows; the compiler vectorizes each over d).
template <int G>
void bounds_fixed(const float* q, const float* lo, const float* hi, int64_t D, int64_t, float* out, int64_t stride) {
  float acc[G] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float l = lo[d], u = hi[d];
    for (int g = 0; g < G; ++g) acc[g] += std::max(q[g * D + d] * l, q[g * D + d] * u);
  }
  for (int g = 0; g < G; ++g) out[g * stride] = acc[g];
}

void bounds_generic(const float* q, const float* lo, const float* hi, int64_t D, int64_t G, float* out, int64_t stride) {
  for (int64_t g = 0; g < G; ++g) {
    float acc = 0.f;
    for (int64_t d = 0; d < D; ++d) acc += std::max(q[g * D + d] * lo[d], q[g * D + d] * hi[d]);
    out[g * stride] = acc;
  }
}

using Bounds = void (*)(const float*, const float*, const float*, int64_t, int64_t, float*, int64_t);

Bounds pick_bounds(int64_t g) {
  switch (g) {
    case 1: return bounds_fixed<1>;
    case 2: return bounds_fixed<2>;
    case 3: return bounds_fixed<3>;
    case 4: return bounds_fixed<4>;
    default: return bounds_generic;
  }
}

}  // namespace

// ImportanceScore's relevance by share (plugins/importance_score.py, weights (1, 0, 0), aggregate
// "share") of a decode step's listed pages, reading the layer's page summaries by record: per
// query head h, the bound of page m's logit ub = scale * sum_d max(q_d kmin_d, q_d kmax_d) (the
// page's kv head) + log(max(tokens, 1)); its softmax over the competing pages (mask); each page's
// largest share over the heads, divided by the row's largest (0 where no page competes).
// q [B, H, D]; kmin, kmax [R, KVH, D] (one layer's summaries); recs [B, M] int64 in [0, R);
// tokens [B, M] float; mask [B, M] bool. Returns [B, M], 0 for a page that does not compete.
at::Tensor page_relevance(at::Tensor q, at::Tensor kmin, at::Tensor kmax, at::Tensor recs, at::Tensor tokens,
                          at::Tensor mask, double scale) {
  check(q, "q", 3, at::kFloat);
  check(kmin, "kmin", 3, at::kFloat);
  check(kmax, "kmax", 3, at::kFloat);
  check(recs, "recs", 2, at::kLong);
  check(tokens, "tokens", 2, at::kFloat);
  check(mask, "mask", 2, at::kBool);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), R = kmin.size(0), KVH = kmin.size(1), M = recs.size(1);
  TORCH_CHECK(kmax.sizes() == kmin.sizes() && kmin.size(2) == D, "kmin and kmax must be [R, KVH, D] with q's head dim");
  check_heads(H, KVH);
  TORCH_CHECK(recs.size(0) == B && tokens.sizes() == recs.sizes() && mask.sizes() == recs.sizes(),
              "recs, tokens and mask must be [B, M] with q's B");
  const int64_t* rc = recs.data_ptr<int64_t>();
  const bool* mk = mask.data_ptr<bool>();
  for (int64_t i = 0; i < B * M; ++i)
    TORCH_CHECK(!mk[i] || (rc[i] >= 0 && rc[i] < R), "page record ", rc[i], " outside the summaries (", R, " rows)");
  auto out = at::zeros({B, M}, q.options());
  const float *qp = q.data_ptr<float>(), *lo = kmin.data_ptr<float>(), *hi = kmax.data_ptr<float>();
  const float* tk = tokens.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = H / KVH;
  const float sc = static_cast<float>(scale);
  const Bounds bounds = pick_bounds(G);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ub(H * M), share(M), logt(M);
    for (int64_t b = begin; b < end; ++b) {
      const bool* valid = mk + b * M;
      if (std::none_of(valid, valid + M, [](bool v) { return v; })) continue;
      for (int64_t m = 0; m < M; ++m) logt[m] = std::log(std::max(tk[b * M + m], 1.f));
      // every head's bound of every competing page: a page's summary rows (its kv heads', side by
      // side) read once, each for the G query heads of its kv head
      for (int64_t m = 0; m < M; ++m) {
        if (!valid[m]) continue;
        for (int64_t j = 0; j < KVH; ++j) {
          const int64_t row = (rc[b * M + m] * KVH + j) * D;
          bounds(qp + (b * H + j * G) * D, lo + row, hi + row, D, G, ub.data() + j * G * M + m, M);
        }
      }
      std::fill(share.begin(), share.end(), 0.f);
      for (int64_t h = 0; h < H; ++h) {
        float* u = ub.data() + h * M;
        float mx = -std::numeric_limits<float>::max();
        for (int64_t m = 0; m < M; ++m)
          if (valid[m]) {
            u[m] = u[m] * sc + logt[m];
            mx = std::max(mx, u[m]);
          }
        // (a page that does not compete gets exp of the floor, then 0: the loop vectorizes)
        for (int64_t m = 0; m < M; ++m) u[m] = std::exp(valid[m] ? std::max(u[m] - mx, kExpFloor) : kExpFloor);
        float sum = 0.f;
        for (int64_t m = 0; m < M; ++m)
          if (valid[m]) sum += u[m];
        for (int64_t m = 0; m < M; ++m)
          if (valid[m]) share[m] = std::max(share[m], u[m] / sum);
      }
      const float top = std::max(*std::max_element(share.begin(), share.end()), 1e-30f);
      for (int64_t m = 0; m < M; ++m) op[b * M + m] = valid[m] ? share[m] / top : 0.f;
    }
  });
  return out;
}

// SelectPages (plugins/select_pages.py) row by row: every valid page when attend[n] covers them
// all; else the valid pinned pages plus the first attend[n] - #(valid pinned) positions of the
// columns ordered by score, highest first (NaN above every number, ties in column order), that
// are valid unpinned candidates (a non-candidate counts as -inf). score [N, M] float;
// valid, pinned [N, M] bool; attend [N] int64. Returns [N, M] bool.
at::Tensor select_pages(at::Tensor score, at::Tensor valid, at::Tensor pinned, at::Tensor attend) {
  check(score, "score", 2, at::kFloat);
  check(valid, "valid", 2, at::kBool);
  check(pinned, "pinned", 2, at::kBool);
  check(attend, "attend", 1, at::kLong);
  const int64_t N = score.size(0), M = score.size(1);
  TORCH_CHECK(valid.sizes() == score.sizes() && pinned.sizes() == score.sizes() && attend.size(0) == N,
              "valid and pinned must be [N, M] like score, attend [N]");
  auto out = at::zeros({N, M}, valid.options());
  const float* sc = score.data_ptr<float>();
  const bool *vd = valid.data_ptr<bool>(), *pn = pinned.data_ptr<bool>();
  const int64_t* at_ = attend.data_ptr<int64_t>();
  bool* op = out.data_ptr<bool>();
  // the scores as integers in the order torch's sort gives them (built with -ffast-math, so no float
  // comparison or isnan here): -0.0 equal to 0.0, every NaN equal and above +inf
  auto order_key = [](float x) -> int32_t {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return std::numeric_limits<int32_t>::max();
    if (u == 0x80000000u) u = 0;
    const int32_t i = static_cast<int32_t>(u);
    return i >= 0 ? i : i ^ 0x7fffffff;
  };
  const int32_t below_all = order_key(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order(M);
    std::vector<int32_t> key(M);
    for (int64_t n = begin; n < end; ++n) {
      const float* s = sc + n * M;
      const bool *v = vd + n * M, *p = pn + n * M;
      bool* o = op + n * M;
      int64_t n_valid = 0, n_pinned = 0;
      for (int64_t m = 0; m < M; ++m) {
        n_valid += v[m];
        n_pinned += v[m] && p[m];
      }
      if (at_[n] >= n_valid) {
        std::copy(v, v + M, o);
        continue;
      }
      for (int64_t m = 0; m < M; ++m) o[m] = v[m] && p[m];
      const int64_t take = std::min(at_[n] - n_pinned, M);
      if (take <= 0) continue;
      for (int64_t m = 0; m < M; ++m) key[m] = (v[m] && !p[m]) ? order_key(s[m]) : below_all;
      std::iota(order.begin(), order.end(), int64_t{0});
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key[a] > key[b]; });
      for (int64_t i = 0; i < take; ++i) {
        const int64_t m = order[i];
        if (v[m] && !p[m]) o[m] = true;
      }
    }
  });
  return out;
}

// One decode layer of the tiered cache in one call (runtime/tiered/layer_step.py, LayerStep.attend
// on its CPU path): the three ops above in the order the layer runs them, with the step's
// [L, ...] tensors and the layer's index, its results written into the step's record in place.
// 1. score (when `score`): page_relevance of the listed pages under q from layer `layer`'s summaries
//    kmin, kmax [L, R, KVH, D] -> relevance[layer]; select_pages with valid, pinned (T0) [B, M]
//    and attend [B] -> the selected pages; else every valid page;
// 2. attend: tiered_decode_attention over the selected pages' keys inside their sequences
//    (inside [B, M * P] bool), each page where kind, slot [L, B, M] say: pools [L, C, KVH, P, D],
//    extra (host) pages [L, X, KVH, P, D], warm [L, Cw, NB] (empty: none) in warm_codec's layout;
// 3. record: selected[layer] and attended[layer] (the same here), mass[layer] = the op's mass summed
//    over kv heads divided by the query heads (as models/cache.py does after the op), and
//    exact[layer] = exact_choice[layer] & selected when the step reads warm pages exact.
// q [B, H, D]. Returns out [B, H, D]. The same ATen arithmetic as the separate calls: the same bits.
at::Tensor tiered_decode_layer(at::Tensor q, int64_t layer, bool score, at::Tensor kmin, at::Tensor kmax,
                               at::Tensor recs, at::Tensor tokens, at::Tensor candidates, at::Tensor valid,
                               at::Tensor pinned, at::Tensor attend, at::Tensor pool_k, at::Tensor pool_v,
                               at::Tensor extra_k, at::Tensor extra_v, at::Tensor warm, at::IntArrayRef warm_codec,
                               at::Tensor kind, at::Tensor slot, at::Tensor inside,
                               std::optional<at::Tensor> exact_choice, at::Tensor selected, at::Tensor attended,
                               at::Tensor mass, at::Tensor relevance, std::optional<at::Tensor> exact, double scale) {
  TORCH_CHECK(kmin.dim() == 4 && pool_k.dim() == 5 && extra_k.dim() == 5 && kind.dim() == 3 && slot.dim() == 3,
              "tiered_decode_layer takes every layer's summaries [L, R, KVH, D], pools [L, C, KVH, P, D], extra "
              "pages [L, X, KVH, P, D], kind and slot [L, B, M]");
  TORCH_CHECK(layer >= 0 && layer < pool_k.size(0) && layer < kmin.size(0) && layer < kind.size(0) &&
                  layer < selected.size(0),
              "layer ", layer, " outside the step's tensors");
  for (const at::Tensor* t : {&selected, &attended, &mass, &relevance})
    TORCH_CHECK(t->dim() == 3 && t->size(1) == kind.size(1) && t->size(2) == kind.size(2),
                "the record's tensors must be [L, B, M] like kind");
  TORCH_CHECK(exact_choice.has_value() == exact.has_value(), "exact_choice and exact come together");
  const int64_t B = q.size(0), H = q.size(1), M = kind.size(2), P = pool_k.size(3);
  TORCH_CHECK(inside.dim() == 2 && inside.size(0) == B && inside.size(1) == M * P, "inside must be [B, M * P]");
  at::Tensor sel = valid;
  if (score) {
    const at::Tensor rel = page_relevance(q, kmin.select(0, layer), kmax.select(0, layer), recs, tokens, candidates,
                                          scale);
    relevance.select(0, layer).copy_(rel);
    sel = select_pages(rel, valid, pinned, attend);
  }
  selected.select(0, layer).copy_(sel);
  attended.select(0, layer).copy_(sel);
  const at::Tensor allowed = inside.view({B, M, P}).logical_and(sel.unsqueeze(-1)).view({B, 1, M * P});
  const at::Tensor w = warm.numel() ? warm.select(0, layer) : at::zeros({0, 0}, warm.options());
  std::vector<int64_t> codec(warm_codec.begin(), warm_codec.end());
  if (!warm.numel()) codec.assign(8, 0);
  auto [out, m] = tiered_decode_attention(q, pool_k.select(0, layer), pool_v.select(0, layer), extra_k.select(0, layer),
                                          extra_v.select(0, layer), w, codec, kind.select(0, layer),
                                          slot.select(0, layer), allowed, scale);
  mass.select(0, layer).copy_(m.sum(1).div_(H));
  if (exact) exact->select(0, layer).copy_(exact_choice->select(0, layer).logical_and(sel));
  return out;
}

TORCH_LIBRARY(tieredkv_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor pool_k, Tensor pool_v, Tensor pages, Tensor allowed, float scale) "
        "-> Tensor");
  m.def("tiered_decode_attention(Tensor q, Tensor pool_k, Tensor pool_v, Tensor extra_k, Tensor extra_v, "
        "Tensor warm, int[] warm_codec, Tensor kind, Tensor slot, Tensor allowed, float scale) -> (Tensor, Tensor)");
  m.def("page_relevance(Tensor q, Tensor kmin, Tensor kmax, Tensor recs, Tensor tokens, Tensor mask, float scale) "
        "-> Tensor");
  m.def("select_pages(Tensor score, Tensor valid, Tensor pinned, Tensor attend) -> Tensor");
  m.def("tiered_decode_layer(Tensor q, int layer, bool score, Tensor kmin, Tensor kmax, Tensor recs, Tensor tokens, "
        "Tensor candidates, Tensor valid, Tensor pinned, Tensor attend, Tensor pool_k, Tensor pool_v, Tensor extra_k, "
        "Tensor extra_v, Tensor warm, int[] warm_codec, Tensor kind, Tensor slot, Tensor inside, Tensor? exact_choice, "
        "Tensor(a!) selected, Tensor(b!) attended, Tensor(c!) mass, Tensor(d!) relevance, Tensor(e!)? exact, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tieredkv_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("tiered_decode_attention", &tiered_decode_attention);
  m.impl("page_relevance", &page_relevance);
  m.impl("select_pages", &select_pages);
  m.impl("tiered_decode_layer", &tiered_decode_layer);
}
