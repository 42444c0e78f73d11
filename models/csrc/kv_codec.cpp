// The warm tier's page encoder for the CPU: plugins/codec.py's encode_pages for the asymmetric
// integer codecs the decode op reads (int4, int4-g16, int2: keys grouped per channel over a page's
// tokens, values per token in groups of `vgroup` channels), in one pass per page instead of a
// dozen torch passes over the whole batch. The same bytes as the reference (tests/models/
// test_cpu_attention.py): per group lo = min, hi = max; scale = bfloat16((hi - lo) / levels), 1 where
// that is not above 0; zero = float16(lo) (saturated to float16's range, -0 as +0); code =
// round-half-even((x - zero) / scale) clamped to [0, levels]; codes bit-packed little-endian, a
// section per role and field at the byte offsets of plugins.codec.page_layout.
//
// The extension is built with -ffast-math; this file's arithmetic must round as IEEE float32 does
// (a true division, no reciprocal), so it is compiled without it (the pragma below). With AVX-512
// (head dim and value group multiples of 16) sixteen channels or values at a time, with IEEE
// vector division and rounding: the scalar loop's bytes. Finite input only: the caller checks
// (plugins.codec.sanitize replaces NaN / Inf first otherwise).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

namespace {

constexpr float kHalfMax = 65504.f;

struct Layout {
  int64_t bits, vgroup, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero;
};

inline void put16(uint8_t* p, uint16_t x) { std::memcpy(p, &x, 2); }

// A group's stored scale and zero point from its min and max (written at sc / zp, returned as the
// float32 values the codes are computed with).
inline void scale_zero(float lo, float hi, int64_t levels, uint8_t* sc, uint8_t* zp, float& scale, float& zero) {
  const c10::BFloat16 s16((hi - lo) / static_cast<float>(levels));
  scale = static_cast<float>(s16);
  if (!(scale > 0.f)) scale = 1.f;
  const c10::Half z16(std::min(std::max(lo + 0.f, -kHalfMax), kHalfMax));
  zero = static_cast<float>(z16);
  put16(sc, c10::BFloat16(scale).x);
  put16(zp, z16.x);
}

// One group of n values read with stride `step` from x: its stored scale and zero point (written
// at sc / zp), its codes into codes[0, n).
void quantize_group(const float* x, int64_t n, int64_t step, int64_t levels, uint8_t* sc, uint8_t* zp,
                    uint8_t* codes) {
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, x[i * step]);
    hi = std::max(hi, x[i * step]);
  }
  float scale, zero;
  scale_zero(lo, hi, levels, sc, zp, scale, zero);
  const float top = static_cast<float>(levels);
  for (int64_t i = 0; i < n; ++i) {
    const float c = std::nearbyint((x[i * step] - zero) / scale);
    codes[i] = static_cast<uint8_t>(std::min(std::max(c, 0.f), top));
  }
}

#if defined(__AVX512F__)
// 16 codes, round-half-even((x - zero) / scale) clamped to [0, top], as bytes (IEEE division and
// rounding: the scalar loop's values)
inline __m128i codes16(__m512 x, __m512 zero, __m512 scale, __m512 top) {
  __m512 c = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(x, zero), scale),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  c = _mm512_min_ps(_mm512_max_ps(c, _mm512_setzero_ps()), top);
  return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c));
}

// The keys of one kv head (x: its [P, D] rows), 16 channels at a time: each channel's min / max over
// the P tokens lane by lane, then its codes token by token, written in [D, P] order.
void keys_avx512(const float* x, int64_t P, int64_t D, int64_t levels, uint8_t* sc, uint8_t* zp, uint8_t* codes) {
  const __m512 top = _mm512_set1_ps(static_cast<float>(levels));
  alignas(64) float lo[16], hi[16], scale[16], zero[16];
  std::vector<uint8_t> tmp(P * 16);
  for (int64_t c0 = 0; c0 < D; c0 += 16) {
    __m512 l = _mm512_loadu_ps(x + c0), h = l;
    for (int64_t p = 1; p < P; ++p) {
      const __m512 r = _mm512_loadu_ps(x + p * D + c0);
      l = _mm512_min_ps(l, r);
      h = _mm512_max_ps(h, r);
    }
    _mm512_store_ps(lo, l);
    _mm512_store_ps(hi, h);
    for (int j = 0; j < 16; ++j)
      scale_zero(lo[j], hi[j], levels, sc + 2 * (c0 + j), zp + 2 * (c0 + j), scale[j], zero[j]);
    const __m512 s = _mm512_load_ps(scale), z = _mm512_load_ps(zero);
    for (int64_t p = 0; p < P; ++p)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp.data() + p * 16),
                       codes16(_mm512_loadu_ps(x + p * D + c0), z, s, top));
    for (int j = 0; j < 16; ++j)
      for (int64_t p = 0; p < P; ++p) codes[(c0 + j) * P + p] = tmp[p * 16 + j];
  }
}

// One group of g values (a multiple of 16) at x: its scale and zero point, its codes.
void values_avx512(const float* x, int64_t g, int64_t levels, uint8_t* sc, uint8_t* zp, uint8_t* codes) {
  __m512 l = _mm512_loadu_ps(x), h = l;
  for (int64_t i = 16; i < g; i += 16) {
    const __m512 r = _mm512_loadu_ps(x + i);
    l = _mm512_min_ps(l, r);
    h = _mm512_max_ps(h, r);
  }
  float scale, zero;
  scale_zero(_mm512_reduce_min_ps(l), _mm512_reduce_max_ps(h), levels, sc, zp, scale, zero);
  const __m512 s = _mm512_set1_ps(scale), z = _mm512_set1_ps(zero), top = _mm512_set1_ps(static_cast<float>(levels));
  for (int64_t i = 0; i < g; i += 16)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), codes16(_mm512_loadu_ps(x + i), z, s, top));
}
#endif

// codes [n] (n a multiple of 8 / bits) -> bytes, value i of a byte in bits [i * bits, (i + 1) * bits)
void pack(const uint8_t* codes, int64_t n, int64_t bits, uint8_t* out) {
  const int64_t per = 8 / bits;
  for (int64_t j = 0; j < n / per; ++j) {
    uint8_t b = 0;
    for (int64_t i = 0; i < per; ++i) b |= static_cast<uint8_t>(codes[j * per + i] << (i * bits));
    out[j] = b;
  }
}

}  // namespace

// k, v [N, KVH, P, D] float32 (finite); layout = [bits, value group, then the byte offsets of the
// key codes, scales, zero points and the value codes, scales, zero points] (models.cache.warm_codec_args);
// page_bytes: one encoded page. Returns uint8 [N, page_bytes], the bytes between sections zero.
at::Tensor encode_int_pages(at::Tensor k, at::Tensor v, at::IntArrayRef layout, int64_t page_bytes) {
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4 && t->is_contiguous(),
                "k and v must be contiguous float32 [N, KVH, P, D] CPU tensors");
  }
  TORCH_CHECK(k.sizes() == v.sizes(), "v must have k's shape");
  TORCH_CHECK(layout.size() == 8, "layout: [bits, value group, 6 byte offsets], got ", layout.size(), " values");
  const Layout L{layout[0], layout[1], layout[2], layout[3], layout[4], layout[5], layout[6], layout[7]};
  const int64_t N = k.size(0), KVH = k.size(1), P = k.size(2), D = k.size(3), n = KVH * P * D;
  TORCH_CHECK(L.bits == 2 || L.bits == 4, "bits must be 2 or 4, got ", L.bits);
  TORCH_CHECK(L.vgroup > 0 && D % L.vgroup == 0, "the value group must divide the head dim ", D);
  const int64_t packed = -(-n / 4) * 4 * L.bits / 8;  // codes padded to whole groups of 4 values
  TORCH_CHECK(std::min({L.k_codes, L.k_scale, L.k_zero, L.v_codes, L.v_scale, L.v_zero}) >= 0 &&
                  std::max({L.k_codes + packed, L.v_codes + packed, L.k_scale + 2 * KVH * D, L.k_zero + 2 * KVH * D,
                            L.v_scale + 2 * n / L.vgroup, L.v_zero + 2 * n / L.vgroup}) <= page_bytes,
              "layout's sections must lie inside a ", page_bytes, "-byte page");
  auto out = at::zeros({N, page_bytes}, k.options().dtype(at::kByte));
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const int64_t levels = (1 << L.bits) - 1;
  const bool vector = D % 16 == 0 && L.vgroup % 16 == 0;  // the AVX-512 loops (where built with it)
  (void)vector;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> codes(-(-n / 4) * 4, 0);
    for (int64_t pg = begin; pg < end; ++pg) {
      uint8_t* page = op + pg * page_bytes;
      // keys: one group per (kv head, channel) over the page's P tokens, codes in [KVH, D, P] order
      const float* x = kp + pg * n;
      for (int64_t h = 0; h < KVH; ++h) {
#if defined(__AVX512F__)
        if (vector) {
          keys_avx512(x + h * P * D, P, D, levels, page + L.k_scale + 2 * h * D, page + L.k_zero + 2 * h * D,
                      codes.data() + h * D * P);
          continue;
        }
#endif
        for (int64_t d = 0; d < D; ++d) {
          const int64_t g = h * D + d;
          quantize_group(x + h * P * D + d, P, D, levels, page + L.k_scale + 2 * g, page + L.k_zero + 2 * g,
                         codes.data() + g * P);
        }
      }
      pack(codes.data(), static_cast<int64_t>(codes.size()), L.bits, page + L.k_codes);
      // values: groups of vgroup consecutive channels of a token, codes in [KVH, P, D] order
      x = vp + pg * n;
      for (int64_t g = 0; g < n / L.vgroup; ++g) {
#if defined(__AVX512F__)
        if (vector) {
          values_avx512(x + g * L.vgroup, L.vgroup, levels, page + L.v_scale + 2 * g, page + L.v_zero + 2 * g,
                        codes.data() + g * L.vgroup);
          continue;
        }
#endif
        quantize_group(x + g * L.vgroup, L.vgroup, 1, levels, page + L.v_scale + 2 * g, page + L.v_zero + 2 * g,
                       codes.data() + g * L.vgroup);
      }
      pack(codes.data(), static_cast<int64_t>(codes.size()), L.bits, page + L.v_codes);
    }
  });
  return out;
}

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(tieredkv_cpu, m) {
  m.def("encode_int_pages(Tensor k, Tensor v, int[] layout, int page_bytes) -> Tensor");
}

TORCH_LIBRARY_IMPL(tieredkv_cpu, CPU, m) {
  m.impl("encode_int_pages", &encode_int_pages);
}
