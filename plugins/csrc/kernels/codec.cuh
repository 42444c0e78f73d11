// KV page codecs (fp8, fp8-r2, int6-r2, int4, int4-g16, int2, fp8-r2-delta): the codec
// descriptor, element-level encode / decode shared by host and device, and the page kernels.
// Spec: docs/codec.md; reference: tieredkv.plugins.codec (encode_pages / decode_pages), which
// these functions match bit for bit (float32 CPU semantics of torch):
//   * every float op that must match is a separately rounded IEEE op: on the device
//     __fmul_rn / __fadd_rn / __fsub_rn / __fdiv_rn (no FMA contraction), on the host plain
//     operators compiled with -ffp-contract=off (CMakeLists.txt); never build with
//     --use_fast_math (flushes subnormals, approximates division);
//   * torch.round = rintf (half to even), torch.floor = floorf;
//   * conversions are the CUDA ones: __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3),
//     __float2bfloat16_rn, __float2half_rn and back (torch's casts round the same way);
//   * torch.cumsum of a float32 CPU tensor accumulates in double and rounds each prefix to
//     float: the delta codec's decode does the same.
// Framework-free: CUDA runtime and the CUDA fp8 / bf16 / fp16 headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common.cuh"
#include "tieredkv_kernels.h"

#define TKV_HD __host__ __device__ __forceinline__

namespace tieredkv {
namespace kernels {
namespace codec {

constexpr float kFp8Max = 448.f;  //!< largest finite float8_e4m3fn (codec.FP8_MAX)
constexpr int64_t kAlign = 128;   //!< every section starts at a multiple of this (codec.ALIGN)
constexpr int kRoleK = 0;
constexpr int kRoleV = 1;

// ------------------------------------------------------------------------------ the codecs
//! One entry of codec.CODECS.
struct CodecSpec {
    const char* name;
    int32_t base;  //!< TKV_CODEC_FP8 or TKV_CODEC_INT
    int32_t bits;
    int32_t asym;
    int32_t residual_bits;
    int32_t key_axis;  //!< TKV_AXIS_TOKEN or TKV_AXIS_CHANNEL
    int32_t value_axis;
    int32_t group;
    int32_t keyframe;
};

//! Mirrors tieredkv.plugins.codec.CODECS (same order: the `codec` index of a descriptor).
constexpr CodecSpec kCodecs[] = {
    {"fp8", TKV_CODEC_FP8, 8, 0, 0, TKV_AXIS_TOKEN, TKV_AXIS_TOKEN, 64, 0},
    {"fp8-r2", TKV_CODEC_FP8, 8, 0, 2, TKV_AXIS_TOKEN, TKV_AXIS_TOKEN, 64, 0},
    {"int6-r2", TKV_CODEC_INT, 6, 0, 2, TKV_AXIS_TOKEN, TKV_AXIS_TOKEN, 64, 0},
    {"int4", TKV_CODEC_INT, 4, 1, 0, TKV_AXIS_CHANNEL, TKV_AXIS_TOKEN, 32, 0},
    {"int4-g16", TKV_CODEC_INT, 4, 1, 0, TKV_AXIS_CHANNEL, TKV_AXIS_TOKEN, 16, 0},
    {"int2", TKV_CODEC_INT, 2, 1, 0, TKV_AXIS_CHANNEL, TKV_AXIS_TOKEN, 32, 0},
    {"fp8-r2-delta", TKV_CODEC_FP8, 8, 0, 2, TKV_AXIS_TOKEN, TKV_AXIS_TOKEN, 64, 10},
};
constexpr int kNumCodecs = static_cast<int>(sizeof(kCodecs) / sizeof(kCodecs[0]));

inline int64_t gcd64(int64_t a, int64_t b) {
    while (b != 0) {
        const int64_t r = a % b;
        a = b;
        b = r;
    }
    return a;
}

inline int64_t aligned(int64_t nbytes) { return (nbytes + kAlign - 1) / kAlign * kAlign; }

//! The descriptor of codec `index` (kCodecs) for pages [kvh, p, d]: mirrors codec.page_layout
//! (sections K then V, each codes | scale | [zero] | [rcodes | rscale] | [keyframes], every one
//! starting at a multiple of 128 bytes). False for a bad index or a non-positive size.
inline bool make_codec_desc_at(int index, int64_t kvh, int64_t p, int64_t d, tkv_codec_desc_t* out) {
    if (out == nullptr || index < 0 || index >= kNumCodecs || kvh <= 0 || p <= 0 || d <= 0) return false;
    if (kvh > (int64_t{1} << 20) || p > (int64_t{1} << 20) || d > (int64_t{1} << 20) || kvh * p * d > (int64_t{1} << 40)) {
        return false;  // keeps every byte count far from int64 overflow
    }
    const CodecSpec& spec = kCodecs[index];
    tkv_codec_desc_t desc;
    std::memset(&desc, 0, sizeof(desc));
    desc.codec = index;
    desc.base = spec.base;
    desc.bits = spec.bits;
    desc.asym = spec.asym;
    desc.residual_bits = spec.residual_bits;
    desc.keyframe = spec.keyframe;
    desc.group = spec.group;
    desc.axis[kRoleK] = spec.key_axis;
    desc.axis[kRoleV] = spec.value_axis;
    desc.keyframes_per_page = spec.keyframe > 0 ? static_cast<int32_t>((p + spec.keyframe - 1) / spec.keyframe) : 0;
    desc.kvh = kvh;
    desc.p = p;
    desc.d = d;
    desc.values = kvh * p * d;
    const int64_t padded = (desc.values + 3) / 4 * 4;  // codes are packed in whole units of 4 values
    int64_t offset = 0;
    for (int role = 0; role < 2; ++role) {
        const bool channel = desc.axis[role] == TKV_AXIS_CHANNEL;
        desc.group_size[role] = channel ? p : gcd64(spec.group, d);
        desc.groups[role] = desc.values / desc.group_size[role];
        int64_t size[TKV_CODEC_SECTIONS];
        for (int s = 0; s < TKV_CODEC_SECTIONS; ++s) size[s] = -1;
        size[TKV_SECTION_CODES] = padded * spec.bits / 8;
        size[TKV_SECTION_SCALE] = 2 * desc.groups[role];
        if (spec.asym) size[TKV_SECTION_ZERO] = 2 * desc.groups[role];
        if (spec.residual_bits) {
            size[TKV_SECTION_RCODES] = padded * spec.residual_bits / 8;
            size[TKV_SECTION_RSCALE] = 2 * desc.groups[role];
        }
        if (spec.keyframe) size[TKV_SECTION_KEYFRAMES] = 2 * kvh * desc.keyframes_per_page * d;
        for (int s = 0; s < TKV_CODEC_SECTIONS; ++s) {  // sections in page_layout order
            if (size[s] < 0) {
                desc.offset[role][s] = -1;
                desc.bytes[role][s] = 0;
                continue;
            }
            desc.offset[role][s] = offset;
            desc.bytes[role][s] = size[s];
            offset += aligned(size[s]);
        }
    }
    desc.page_bytes = offset;
    *out = desc;
    return true;
}

//! Index of codec `name` in kCodecs, or -1.
inline int codec_index(const char* name) {
    if (name == nullptr) return -1;
    for (int i = 0; i < kNumCodecs; ++i) {
        if (std::strcmp(kCodecs[i].name, name) == 0) return i;
    }
    return -1;
}

//! make_codec_desc_at for codec `name` (a key of codec.CODECS).
inline bool make_codec_desc(const char* name, int64_t kvh, int64_t p, int64_t d, tkv_codec_desc_t* out) {
    return make_codec_desc_at(codec_index(name), kvh, p, d, out);
}

//! True when `desc` is exactly what make_codec_desc builds for its codec and shape (so every
//! offset the kernels derive from it stays inside a page of desc->page_bytes bytes).
inline bool codec_desc_valid(const tkv_codec_desc_t* desc) {
    tkv_codec_desc_t expected;
    return desc != nullptr && make_codec_desc_at(desc->codec, desc->kvh, desc->p, desc->d, &expected) &&
           std::memcmp(&expected, desc, sizeof(expected)) == 0;
}

// ------------------------------------------------------------------------------ float ops
// Separately rounded IEEE float32 operations (no FMA contraction on either side).
TKV_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
TKV_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
TKV_HD float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
TKV_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

TKV_HD uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t u;
    std::memcpy(&u, &x, sizeof(u));
    return u;
#endif
}
TKV_HD bool is_nan(float x) { return (float_bits(x) & 0x7fffffffu) > 0x7f800000u; }
TKV_HD bool is_inf(float x) { return (float_bits(x) & 0x7fffffffu) == 0x7f800000u; }
TKV_HD bool is_finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }

// ------------------------------------------------------------------------------ conversions
TKV_HD uint16_t bf16_bits(float x) {
    const __nv_bfloat16_raw raw = __float2bfloat16_rn(x);
    return raw.x;
}
TKV_HD float bf16_value(uint16_t bits) {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return __bfloat162float(__nv_bfloat16(raw));
}
TKV_HD uint16_t half_bits(float x) {
    const __half_raw raw = __float2half_rn(x);
    return raw.x;
}
//! float16 bits of x saturated to +-65504 (zero points and keyframes: codec.FP16_MAX); x is finite.
TKV_HD uint16_t half_bits_saturated(float x) { return half_bits(fminf(fmaxf(x, -65504.f), 65504.f)); }
TKV_HD float half_value(uint16_t bits) {
    __half_raw raw;
    raw.x = bits;
    return __half2float(__half(raw));
}
TKV_HD uint8_t fp8_code(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
TKV_HD float fp8_value(uint8_t code) {
    const __half_raw raw = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
    return __half2float(__half(raw));
}

//! codec._stored_scale: the bfloat16 value of s, 1 where that is not > 0.
TKV_HD float stored_scale(float s) {
    const float v = bf16_value(bf16_bits(s));
    return v > 0.f ? v : 1.f;
}

TKV_HD float clampf(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }

// ------------------------------------------------------------------------------ page bytes
TKV_HD uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
TKV_HD void store_u16(uint8_t* p, uint16_t v) {
    p[0] = static_cast<uint8_t>(v & 0xff);
    p[1] = static_cast<uint8_t>(v >> 8);
}

//! Code c of a section of `bits`-bit codes, packed little-endian: code c occupies bits
//! [c * bits, (c + 1) * bits) of the section (for 6 bits: 4 codes per 3-byte word).
//! `Index` is int64_t (any page) or int32_t (PageReader: pages under 2^28 values).
template <typename Index>
TKV_HD uint32_t load_code(const uint8_t* section, Index c, int bits) {
    if (bits == 8) return section[c];
    const Index bit = c * bits;
    const Index byte = bit >> 3;
    const int shift = static_cast<int>(bit & 7);
    uint32_t word = section[byte];
    if (shift + bits > 8) word |= static_cast<uint32_t>(section[byte + 1]) << 8;
    return (word >> shift) & ((1u << bits) - 1u);
}

//! Writes the packed unit u (codes 4u .. 4u+3, `bits` / 2 whole bytes; units never share a byte).
TKV_HD void store_unit(uint8_t* section, int64_t u, const uint32_t (&codes)[4], int bits) {
    uint32_t word = 0;
    for (int i = 0; i < 4; ++i) word |= codes[i] << (i * bits);
    const int unit_bytes = bits / 2;
    for (int k = 0; k < unit_bytes; ++k) section[u * unit_bytes + k] = static_cast<uint8_t>((word >> (8 * k)) & 0xff);
}

// ------------------------------------------------------------------------------ indexing
//! Element (h, t, j) of a role's [KVH, P, D] page <-> (group g, position k in the group); the
//! code index (order of the codes section) is g * group_size + k.
TKV_HD int64_t code_index(const tkv_codec_desc_t& desc, int role, int64_t h, int64_t t, int64_t j) {
    if (desc.axis[role] == TKV_AXIS_CHANNEL) return (h * desc.d + j) * desc.p + t;  // (head, channel, token)
    return (h * desc.p + t) * desc.d + j;                                          // (head, token, channel)
}

//! Offset of element (h, t, j) in a float [KVH, P, D] page from its code index.
TKV_HD int64_t element_of_code(const tkv_codec_desc_t& desc, int role, int64_t c) {
    if (desc.axis[role] == TKV_AXIS_CHANNEL) {
        const int64_t t = c % desc.p;
        const int64_t hj = c / desc.p;  // h * D + j
        const int64_t h = hj / desc.d;
        const int64_t j = hj % desc.d;
        return (h * desc.p + t) * desc.d + j;
    }
    return c;
}

TKV_HD const uint8_t* section(const tkv_codec_desc_t& desc, const uint8_t* page, int role, int s) {
    return page + desc.offset[role][s];
}
TKV_HD uint8_t* section(const tkv_codec_desc_t& desc, uint8_t* page, int role, int s) {
    return page + desc.offset[role][s];
}

// ------------------------------------------------------------------------------ quantizers
//! Scale / zero point / residual scale of one group as decode reads them.
struct GroupParams {
    float scale;
    float zero;    //!< asymmetric codecs
    float rscale;  //!< the stored residual scale (0 for a residual group of zeros)
};

TKV_HD GroupParams load_group(const tkv_codec_desc_t& desc, const uint8_t* page, int role, int64_t g) {
    GroupParams gp;
    gp.scale = bf16_value(load_u16(section(desc, page, role, TKV_SECTION_SCALE) + 2 * g));
    gp.zero = desc.asym ? half_value(load_u16(section(desc, page, role, TKV_SECTION_ZERO) + 2 * g)) : 0.f;
    gp.rscale = desc.residual_bits ? bf16_value(load_u16(section(desc, page, role, TKV_SECTION_RSCALE) + 2 * g)) : 0.f;
    return gp;
}

//! codec.quantize of one (sanitized) value.
TKV_HD uint32_t quantize_value(const tkv_codec_desc_t& desc, float x, const GroupParams& gp) {
    if (desc.base == TKV_CODEC_FP8) return fp8_code(clampf(div_rn(x, gp.scale), -kFp8Max, kFp8Max));
    const float levels = static_cast<float>((1 << desc.bits) - 1);
    if (desc.asym) return static_cast<uint32_t>(clampf(rintf(div_rn(sub_rn(x, gp.zero), gp.scale)), 0.f, levels));
    const float half = static_cast<float>(1 << (desc.bits - 1));
    const float q = clampf(rintf(div_rn(x, gp.scale)), -half, half - 1.f);
    return static_cast<uint32_t>(add_rn(q, half));
}

//! codec.dequantize of one code of a codec with these base / bits / asym (TKV_CODEC_*).
TKV_HD float dequantize_code(int32_t base, int32_t bits, int32_t asym, uint32_t code, float scale, float zero) {
    if (base == TKV_CODEC_FP8) return mul_rn(fp8_value(static_cast<uint8_t>(code)), scale);
    if (asym) return add_rn(mul_rn(static_cast<float>(code), scale), zero);
    return mul_rn(sub_rn(static_cast<float>(code), static_cast<float>(1 << (bits - 1))), scale);
}

//! codec.dequantize of one code.
TKV_HD float dequantize_value(const tkv_codec_desc_t& desc, uint32_t code, const GroupParams& gp) {
    return dequantize_code(desc.base, desc.bits, desc.asym, code, gp.scale, gp.zero);
}

//! codec.quantize_residual of one residual, with the scale the encoder used (the stored one,
//! or 1 where a residual group of zeros stores 0).
TKV_HD uint32_t quantize_residual_value(float r, float rscale_stored) {
    const float s = rscale_stored > 0.f ? rscale_stored : 1.f;
    return static_cast<uint32_t>(clampf(add_rn(floorf(div_rn(r, s)), 2.f), 0.f, 3.f));
}

TKV_HD float dequantize_residual_value(uint32_t rcode, float rscale) {
    return mul_rn(sub_rn(static_cast<float>(rcode), 1.5f), rscale);
}

// ------------------------------------------------------------------------------ decode
//! The group-decoded value of element (h, t, j) of `role` (dequantized code plus residual):
//! the page value itself, except for the delta codec (a difference to token t - 1).
TKV_HD float decode_group_value(const tkv_codec_desc_t& desc, const uint8_t* page, int role, int64_t h, int64_t t,
                                int64_t j) {
    const int64_t c = code_index(desc, role, h, t, j);
    const int64_t g = c / desc.group_size[role];
    const GroupParams gp = load_group(desc, page, role, g);
    const float x = dequantize_value(desc, load_code(section(desc, page, role, TKV_SECTION_CODES), c, desc.bits), gp);
    if (!desc.residual_bits) return x;
    const uint32_t rcode = load_code(section(desc, page, role, TKV_SECTION_RCODES), c, desc.residual_bits);
    return add_rn(x, dequantize_residual_value(rcode, gp.rscale));
}

//! Decoded value of element (h, t, j) (kv head, token, channel) of `role` (kRoleK / kRoleV) of
//! one encoded page: equals codec.decode_pages(page)[role][h, t, j] bit for bit. Delta codec:
//! the fp16 keyframe of the segment plus the decoded differences up to t, summed in double
//! from the keyframe on and rounded to float once (torch.cumsum on float32 CPU tensors).
TKV_HD float decode_value(const tkv_codec_desc_t& desc, const uint8_t* page, int role, int64_t h, int64_t t,
                          int64_t j) {
    if (!desc.keyframe) return decode_group_value(desc, page, role, h, t, j);
    const int64_t key = t / desc.keyframe;
    const uint8_t* frames = section(desc, page, role, TKV_SECTION_KEYFRAMES);
    double acc = static_cast<double>(half_value(load_u16(frames + 2 * ((h * desc.keyframes_per_page + key) * desc.d + j))));
    for (int64_t s = key * desc.keyframe + 1; s <= t; ++s) {
        acc += static_cast<double>(decode_group_value(desc, page, role, h, s, j));
    }
    return static_cast<float>(acc);
}

// ------------------------------------------------------------------------------ decode, 32-bit
// decode_value with the layout pre-digested for one launch: 32-bit offsets and code indices, and
// the group of a code found without a division (token-axis groups hold gcd(group, D) values, a
// power of two: a shift; channel-axis groups are the P tokens of one (head, channel): the
// group index is h * D + j). The warm TieredAttention decodes every K / V element it reads
// with it; the arithmetic on the values is decode_value's, so the result is the same bit for bit.

//! desc's page layout for decode_value32 (make_page_reader).
struct PageReader {
    int32_t base, bits, asym, residual_bits, keyframe, keyframes_per_page;
    int32_t p, d;
    int32_t channel[2];      //!< per role: 1 = TKV_AXIS_CHANNEL groups
    int32_t group_shift[2];  //!< per role, token axis: log2 of the group size
    int32_t offset[2][TKV_CODEC_SECTIONS];
};

//! The reader of a valid descriptor; false when a page holds 2^28 values or more (32-bit bit
//! offsets) or a token-axis group size is not a power of two (no codec of kCodecs has one).
inline bool make_page_reader(const tkv_codec_desc_t& desc, PageReader* out) {
    if (!codec_desc_valid(&desc) || desc.values >= (int64_t{1} << 28) || desc.page_bytes >= (int64_t{1} << 30)) {
        return false;
    }
    PageReader r;
    std::memset(&r, 0, sizeof(r));
    r.base = desc.base;
    r.bits = desc.bits;
    r.asym = desc.asym;
    r.residual_bits = desc.residual_bits;
    r.keyframe = desc.keyframe;
    r.keyframes_per_page = desc.keyframes_per_page;
    r.p = static_cast<int32_t>(desc.p);
    r.d = static_cast<int32_t>(desc.d);
    for (int role = 0; role < 2; ++role) {
        r.channel[role] = desc.axis[role] == TKV_AXIS_CHANNEL ? 1 : 0;
        const int64_t size = desc.group_size[role];
        if (!r.channel[role]) {
            if (size <= 0 || (size & (size - 1)) != 0) return false;
            while ((int64_t{1} << r.group_shift[role]) < size) ++r.group_shift[role];
        }
        for (int s = 0; s < TKV_CODEC_SECTIONS; ++s) r.offset[role][s] = static_cast<int32_t>(desc.offset[role][s]);
    }
    *out = r;
    return true;
}

//! decode_group_value in 32-bit index arithmetic (h, t, j: kv head, token, channel of the page).
TKV_HD float group_value32(const PageReader& r, const uint8_t* page, int role, int32_t h, int32_t t, int32_t j) {
    int32_t c, g;
    if (r.channel[role]) {
        g = h * r.d + j;
        c = g * r.p + t;
    } else {
        c = (h * r.p + t) * r.d + j;
        g = c >> r.group_shift[role];
    }
    const int32_t* off = r.offset[role];
    const float scale = bf16_value(load_u16(page + off[TKV_SECTION_SCALE] + 2 * g));
    const float zero = r.asym ? half_value(load_u16(page + off[TKV_SECTION_ZERO] + 2 * g)) : 0.f;
    const float x = dequantize_code(r.base, r.bits, r.asym, load_code(page + off[TKV_SECTION_CODES], c, r.bits), scale,
                                    zero);
    if (!r.residual_bits) return x;
    const float rscale = bf16_value(load_u16(page + off[TKV_SECTION_RSCALE] + 2 * g));
    const uint32_t rcode = load_code(page + off[TKV_SECTION_RCODES], c, r.residual_bits);
    return add_rn(x, dequantize_residual_value(rcode, rscale));
}

//! decode_value (bit-exact with codec.decode_pages) in 32-bit index arithmetic.
TKV_HD float decode_value32(const PageReader& r, const uint8_t* page, int role, int32_t h, int32_t t, int32_t j) {
    if (!r.keyframe) return group_value32(r, page, role, h, t, j);
    const int32_t key = t / r.keyframe;
    const uint8_t* frames = page + r.offset[role][TKV_SECTION_KEYFRAMES];
    double acc = static_cast<double>(half_value(load_u16(frames + 2 * ((h * r.keyframes_per_page + key) * r.d + j))));
    for (int32_t s = key * r.keyframe + 1; s <= t; ++s) {
        acc += static_cast<double>(group_value32(r, page, role, h, s, j));
    }
    return static_cast<float>(acc);
}

// ------------------------------------------------------------------------------ encode
// Encoding one role of one page ([KVH, P, D] float32 `x`) takes two steps, each a loop over
// independent items (host loops, or the threads of one block with a barrier after step 1):
//   1. encode_group for every group g: writes scale, zero point and residual scale;
//   2. encode_unit for every packed unit of 4 codes (reads the group parameters of step 1):
//      writes the code bytes and residual code bytes; encode_keyframe for every keyframe
//      value (delta codec); encode_padding zeroes the alignment bytes between sections.
// No two items write one byte.

//! Largest finite |x| over the D values of row (h, t) (codec.sanitize of the delta codec's rows).
TKV_HD float row_big(const tkv_codec_desc_t& desc, const float* x, int64_t h, int64_t t) {
    const float* row = x + (h * desc.p + t) * desc.d;
    float big = 0.f;
    for (int64_t j = 0; j < desc.d; ++j) {
        if (is_finite(row[j])) big = fmaxf(big, fabsf(row[j]));
    }
    return big;
}

//! codec.sanitize of one value given the largest finite magnitude `big` of its group.
TKV_HD float sanitize_value(float v, float big) {
    if (is_nan(v)) return 0.f;
    if (is_inf(v)) return copysignf(big, v);
    return v;
}

//! The delta codec's row-sanitized value of element (h, t, j) (big of the row only looked up
//! for an infinite value).
TKV_HD float row_sanitized(const tkv_codec_desc_t& desc, const float* x, int64_t h, int64_t t, int64_t j) {
    const float v = x[(h * desc.p + t) * desc.d + j];
    return is_inf(v) ? copysignf(row_big(desc, x, h, t), v) : sanitize_value(v, 0.f);
}

//! The value codec.encode quantizes at code index c, before the group's sanitize: x itself, or
//! for the delta codec 0 at keyframes and else the difference of the row-sanitized tokens t, t-1.
TKV_HD float source_value(const tkv_codec_desc_t& desc, int role, const float* x, int64_t c) {
    const int64_t e = element_of_code(desc, role, c);
    if (!desc.keyframe) return x[e];
    const int64_t j = e % desc.d;
    const int64_t t = (e / desc.d) % desc.p;
    const int64_t h = e / (desc.d * desc.p);
    if (t % desc.keyframe == 0) return 0.f;
    return sub_rn(row_sanitized(desc, x, h, t, j), row_sanitized(desc, x, h, t - 1, j));
}

//! Largest finite |source value| of group g.
TKV_HD float group_big(const tkv_codec_desc_t& desc, int role, const float* x, int64_t g) {
    const int64_t n = desc.group_size[role];
    float big = 0.f;
    for (int64_t k = 0; k < n; ++k) {
        const float v = source_value(desc, role, x, g * n + k);
        if (is_finite(v)) big = fmaxf(big, fabsf(v));
    }
    return big;
}

//! Sanitized source value at code index c (group big recomputed only for an infinite value).
TKV_HD float group_sanitized(const tkv_codec_desc_t& desc, int role, const float* x, int64_t c) {
    const float v = source_value(desc, role, x, c);
    return is_inf(v) ? copysignf(group_big(desc, role, x, c / desc.group_size[role]), v) : sanitize_value(v, 0.f);
}

//! Step 1 for group g of `role`: scale (bf16), zero point (fp16), residual scale (bf16) into `page`.
TKV_HD void encode_group(const tkv_codec_desc_t& desc, int role, const float* x, uint8_t* page, int64_t g) {
    const int64_t n = desc.group_size[role];
    const float big = group_big(desc, role, x, g);  // = max |sanitized value| of the group
    GroupParams gp{0.f, 0.f, 0.f};
    if (desc.base == TKV_CODEC_FP8) {
        gp.scale = stored_scale(div_rn(big, kFp8Max));
    } else if (desc.asym) {
        float lo = 0.f, hi = 0.f;
        for (int64_t k = 0; k < n; ++k) {  // amin / amax
            const float s = sanitize_value(source_value(desc, role, x, g * n + k), big);
            if (k == 0 || s < lo) lo = s;
            if (k == 0 || s > hi) hi = s;
        }
        gp.scale = stored_scale(div_rn(sub_rn(hi, lo), static_cast<float>((1 << desc.bits) - 1)));
        const uint16_t zero = half_bits_saturated(add_rn(lo, 0.f));  // -0 -> +0, saturated, as the reference
        gp.zero = half_value(zero);
        store_u16(section(desc, page, role, TKV_SECTION_ZERO) + 2 * g, zero);
    } else {
        gp.scale = stored_scale(div_rn(big, static_cast<float>((1 << (desc.bits - 1)) - 1)));
    }
    store_u16(section(desc, page, role, TKV_SECTION_SCALE) + 2 * g, bf16_bits(gp.scale));
    if (!desc.residual_bits) return;
    float absmax = 0.f;
    for (int64_t k = 0; k < n; ++k) {
        const float s = sanitize_value(source_value(desc, role, x, g * n + k), big);
        const float r = sub_rn(s, dequantize_value(desc, quantize_value(desc, s, gp), gp));
        absmax = fmaxf(absmax, fabsf(r));
    }
    const float rscale = absmax > 0.f ? stored_scale(div_rn(absmax, 2.f)) : 0.f;
    store_u16(section(desc, page, role, TKV_SECTION_RSCALE) + 2 * g, bf16_bits(rscale));
}

//! Step 2 for packed unit u of `role`: codes 4u .. 4u+3 (and their residual codes); code indices
//! past the page's values are the zero padding.
TKV_HD void encode_unit(const tkv_codec_desc_t& desc, int role, const float* x, uint8_t* page, int64_t u) {
    uint32_t codes[4] = {0u, 0u, 0u, 0u};
    uint32_t rcodes[4] = {0u, 0u, 0u, 0u};
    for (int i = 0; i < 4; ++i) {
        const int64_t c = 4 * u + i;
        if (c >= desc.values) break;
        const GroupParams gp = load_group(desc, page, role, c / desc.group_size[role]);
        const float s = group_sanitized(desc, role, x, c);
        codes[i] = quantize_value(desc, s, gp);
        if (desc.residual_bits) {
            rcodes[i] = quantize_residual_value(sub_rn(s, dequantize_value(desc, codes[i], gp)), gp.rscale);
        }
    }
    store_unit(section(desc, page, role, TKV_SECTION_CODES), u, codes, desc.bits);
    if (desc.residual_bits) store_unit(section(desc, page, role, TKV_SECTION_RCODES), u, rcodes, desc.residual_bits);
}

//! Step 2, delta codec: keyframe value i (of KVH * keyframes_per_page * D): the row-sanitized
//! token t = key * keyframe in fp16.
TKV_HD void encode_keyframe(const tkv_codec_desc_t& desc, int role, const float* x, uint8_t* page, int64_t i) {
    const int64_t j = i % desc.d;
    const int64_t key = (i / desc.d) % desc.keyframes_per_page;
    const int64_t h = i / (desc.d * desc.keyframes_per_page);
    const float v = row_sanitized(desc, x, h, key * desc.keyframe, j);
    store_u16(section(desc, page, role, TKV_SECTION_KEYFRAMES) + 2 * i, half_bits_saturated(v));
}

//! Number of packed units / keyframe values of one role.
TKV_HD int64_t units(const tkv_codec_desc_t& desc) { return (desc.values + 3) / 4; }
TKV_HD int64_t keyframe_values(const tkv_codec_desc_t& desc) {
    return desc.keyframe ? desc.kvh * desc.keyframes_per_page * desc.d : 0;
}

//! Bytes of alignment padding after the sections of `role` (between a section's end and the
//! next multiple of 128).
TKV_HD int64_t padding_bytes(const tkv_codec_desc_t& desc, int role) {
    int64_t n = 0;
    for (int s = 0; s < TKV_CODEC_SECTIONS; ++s) {
        if (desc.offset[role][s] >= 0) n += (desc.bytes[role][s] + kAlign - 1) / kAlign * kAlign - desc.bytes[role][s];
    }
    return n;
}
//! Step 2: padding byte i of `role` (padding_bytes of them, section by section) -> 0.
TKV_HD void encode_padding(const tkv_codec_desc_t& desc, int role, uint8_t* page, int64_t i) {
    for (int s = 0; s < TKV_CODEC_SECTIONS; ++s) {
        if (desc.offset[role][s] < 0) continue;
        const int64_t pad = (desc.bytes[role][s] + kAlign - 1) / kAlign * kAlign - desc.bytes[role][s];
        if (i < pad) {
            page[desc.offset[role][s] + desc.bytes[role][s] + i] = 0;
            return;
        }
        i -= pad;
    }
}

#ifndef TKV_CODEC_FUNCTIONS_ONLY  // translation units that only need the element functions skip the kernels
// ------------------------------------------------------------------------------ kernels
constexpr int kCodecThreads = 256;

//! One block per (page n, role): step 1 over the groups, a barrier, step 2 over units,
//! keyframes and padding.
__global__ void __launch_bounds__(kCodecThreads)
encode_pages_kernel(const float* __restrict__ k, const float* __restrict__ v, uint8_t* __restrict__ out,
                    tkv_codec_desc_t desc) {
    const int64_t n = blockIdx.x / 2;
    const int role = static_cast<int>(blockIdx.x % 2);
    const float* x = (role == kRoleK ? k : v) + n * desc.values;
    uint8_t* page = out + n * desc.page_bytes;
    for (int64_t g = threadIdx.x; g < desc.groups[role]; g += blockDim.x) encode_group(desc, role, x, page, g);
    __syncthreads();
    const int64_t nu = units(desc);
    for (int64_t u = threadIdx.x; u < nu; u += blockDim.x) encode_unit(desc, role, x, page, u);
    const int64_t nk = keyframe_values(desc);
    for (int64_t i = threadIdx.x; i < nk; i += blockDim.x) encode_keyframe(desc, role, x, page, i);
    const int64_t np = padding_bytes(desc, role);
    for (int64_t i = threadIdx.x; i < np; i += blockDim.x) encode_padding(desc, role, page, i);
}

//! Grid-stride over the N * 2 * KVH * P * D decoded values.
__global__ void __launch_bounds__(kCodecThreads)
decode_pages_kernel(const uint8_t* __restrict__ data, float* __restrict__ k, float* __restrict__ v, int64_t N,
                    tkv_codec_desc_t desc) {
    const int64_t per_role = desc.values;
    const int64_t total = N * 2 * per_role;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t e = i % per_role;  // (h, t, j) of a [KVH, P, D] page
        const int role = static_cast<int>((i / per_role) % 2);
        const int64_t n = i / (2 * per_role);
        const int64_t j = e % desc.d;
        const int64_t t = (e / desc.d) % desc.p;
        const int64_t h = e / (desc.d * desc.p);
        const float value = decode_value(desc, data + n * desc.page_bytes, role, h, t, j);
        (role == kRoleK ? k : v)[n * per_role + e] = value;
    }
}

// ------------------------------------------------------------------------------ launchers
//! Encode N pages (float32, contiguous row-major, on the device):
//!   k, v   [N, KVH, P, D] float32   one layer's keys / values of each page
//!   out    [N, page_bytes] uint8    codec.encode_pages(k, v, codec): the byte layout of
//!                                   docs/codec.md, alignment padding zeroed
//! `desc` comes from make_codec_desc / tkv_codec_desc (KVH, P, D = desc.kvh, desc.p, desc.d).
//! Returns the launch status, cudaErrorInvalidValue for a bad descriptor or N.
inline cudaError_t launch_encode_pages(const float* k, const float* v, uint8_t* out, int64_t N,
                                       const tkv_codec_desc_t& desc, cudaStream_t stream) {
    if (N < 0 || !codec_desc_valid(&desc) || 2 * N > 0x7fffffffLL) return cudaErrorInvalidValue;
    if (N == 0) return cudaSuccess;
    encode_pages_kernel<<<static_cast<unsigned int>(2 * N), kCodecThreads, 0, stream>>>(k, v, out, desc);
    return cudaGetLastError();
}

//! Decode N pages (on the device):
//!   data   [N, page_bytes] uint8    pages in the layout of codec.encode_pages
//!   k, v   [N, KVH, P, D] float32   outputs: codec.decode_pages(data, codec, (KVH, P, D)), bit-exact
//! Returns the launch status, cudaErrorInvalidValue for a bad descriptor or N.
inline cudaError_t launch_decode_pages(const uint8_t* data, float* k, float* v, int64_t N,
                                       const tkv_codec_desc_t& desc, cudaStream_t stream) {
    if (N < 0 || !codec_desc_valid(&desc)) return cudaErrorInvalidValue;
    if (N == 0) return cudaSuccess;
    decode_pages_kernel<<<grid_for(N * 2 * desc.values, kCodecThreads), kCodecThreads, 0, stream>>>(data, k, v,
                                                                                                       N, desc);
    return cudaGetLastError();
}

//! launch_encode_pages on host memory, in plain loops running the same element functions.
inline cudaError_t encode_pages_host(const float* k, const float* v, uint8_t* out, int64_t N,
                                     const tkv_codec_desc_t& desc) {
    if (N < 0 || !codec_desc_valid(&desc) || (N > 0 && (k == nullptr || v == nullptr || out == nullptr))) {
        return cudaErrorInvalidValue;
    }
    for (int64_t n = 0; n < N; ++n) {
        uint8_t* page = out + n * desc.page_bytes;
        for (int role = 0; role < 2; ++role) {
            const float* x = (role == kRoleK ? k : v) + n * desc.values;
            for (int64_t g = 0; g < desc.groups[role]; ++g) encode_group(desc, role, x, page, g);
            for (int64_t u = 0; u < units(desc); ++u) encode_unit(desc, role, x, page, u);
            for (int64_t i = 0; i < keyframe_values(desc); ++i) encode_keyframe(desc, role, x, page, i);
            for (int64_t i = 0; i < padding_bytes(desc, role); ++i) encode_padding(desc, role, page, i);
        }
    }
    return cudaSuccess;
}

//! launch_decode_pages on host memory, in plain loops running the same element functions.
inline cudaError_t decode_pages_host(const uint8_t* data, float* k, float* v, int64_t N,
                                     const tkv_codec_desc_t& desc) {
    if (N < 0 || !codec_desc_valid(&desc) || (N > 0 && (data == nullptr || k == nullptr || v == nullptr))) {
        return cudaErrorInvalidValue;
    }
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* page = data + n * desc.page_bytes;
        for (int role = 0; role < 2; ++role) {
            float* x = (role == kRoleK ? k : v) + n * desc.values;
            for (int64_t h = 0; h < desc.kvh; ++h) {
                for (int64_t t = 0; t < desc.p; ++t) {
                    for (int64_t j = 0; j < desc.d; ++j) {
                        x[(h * desc.p + t) * desc.d + j] = decode_value(desc, page, role, h, t, j);
                    }
                }
            }
        }
    }
    return cudaSuccess;
}

#endif  // TKV_CODEC_FUNCTIONS_ONLY

}  // namespace codec
}  // namespace kernels
}  // namespace tieredkv
