// The tier manager's per-step accounting on the CPU, one pass each instead of some forty torch ops
// over [L, R] columns (runtime/tiered/manager.py: TierManager.record_step and end_step, whose
// torch code stays the reference these ops are tested against, bit for bit).
//
// fold_record: a step's record (StepRecord: [L, B, M] per layer, sequence and listed page; a
// [B, M] input stands for every layer) into the step's access record (StepAccess: [L, C] per
// layer and page record), through the plan's records `recs` [B, M]. A record several sequences
// list collects from each: flags or-ed, masses summed in (layer, sequence, column) order, the
// highest importance and relevance kept (values >= 0; the columns start at 0). Padding columns
// (`valid` false) add nothing. Returns the step's counts [5]: masked pages, warm reads, pages
// streamed, streamed pages with no host copy (read from disk), staging rounds.
//
// fold_end: the access record into the page table's statistics (decode steps: last access,
// frequency, window accesses, access history; where importance was scored: accumulated mass,
// relevance, importance). Returns [2]: pages needed, pages needed and missing.
//
// pick_pages: per layer, the `counts[l]` candidates of lowest key (the replacement policy's victims,
// `largest`: the highest — the most important of the pages wanted), ranked, ties going to the
// lower record; a candidate is a record `cand`-idate ([L, C] bool) and `resident` ([L, C] device
// slots: >= 0), less T0 records and `protect`-ed ones (each input optional). NaN ranks as +inf.
// Returns (layers, records) [N] each, layer by layer, within a layer by rank (the moves take
// slots in that order). The manager's torch code (runtime/tiered/moves.py: pick_lowest) is its reference.
//
// wanted_pages: the pages the closing step wants on the device — needed and missing, or needed and
// staged — that have no device slot and are alive (`want` [L, C]), what making room for them
// must not evict (`protect` = needed | want) and how many each layer wants ([L]). One pass where
// the torch code (runtime/tiered/step_fold.py: wanted_pages, its reference) takes five.
//
// lfu_priority: the lfu-importance policy's priority of every (layer, record), w_freq * frequency /
// max(the layer's highest frequency, 1) + w_imp * importance, in float32 with each operation rounded
// as torch rounds it (runtime/tiered/policies/lfu_importance.py: its torch code, the reference): one
// pass where the torch code makes six over [L, C] temporaries.
//
// mask_pairs: the (layer, record) pairs of a [L, C] mask (torch's nonzero(as_tuple=True), the
// reference), e.g. the pages wanted_pages wants, given its per-layer counts.
//
// Layers are independent (a record's row is layer * C + record): torch's thread pool splits them
// when there is enough work (layer_grain).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tier_rows.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace tier_rows {

void check_2d(const at::Tensor& t, const char* name, int64_t rows, int64_t cols, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must be [", rows, ", ", cols, "], got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// A [C] bool column (one per record, shared by every layer), checked.
void check_row(const at::Tensor& t, const char* name, int64_t cols) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == cols && t.scalar_type() == at::kBool &&
                  t.is_contiguous(), name, " must be a contiguous CPU tensor of bool [", cols, "], got ", t.sizes());
}

// Everything one (layer, sequence) row of fold_record reads and writes.
struct RecordRow {
  int64_t M;
  const bool *valid, *hot, *sel, *att, *full, *warm, *staged, *exact;  // [M] (full .. exact: null when absent)
  const float *mass, *imp, *rel;                                      // [M]
  const int64_t* recs;                                                // [M]
  const int64_t *dslot, *wslot, *hslot;                               // the layer's [C] columns
  const bool* table_staged;
  bool *needed, *missing, *streamed, *scored;
  float *acc_mass, *acc_imp, *acc_rel;
};

// A span's float statistics: mass summed in, the highest importance and relevance kept
// (restrict parameters: the loop vectorizes).
inline void span_stats(int64_t n, const float* __restrict__ mass, const float* __restrict__ imp,
                       const float* __restrict__ rel, float* __restrict__ am, float* __restrict__ ai,
                       float* __restrict__ ar) {
  for (int64_t m = 0; m < n; ++m) {
    am[m] += mass[m];
    ai[m] = std::max(ai[m], imp[m]);
    ar[m] = std::max(ar[m], rel[m]);
  }
}

// A span's flags into the access record (needed, missing, streamed, scored) and, per column, whether
// it was masked, read warm, or streamed (a page): byte lanes only, restrict parameters (vectorizes).
// f, w, g, e: full-precision resident, warm, staged, read exact.
inline void span_flags(int64_t n, uint8_t dec, const uint8_t* __restrict__ sel, const uint8_t* __restrict__ att,
                       const uint8_t* __restrict__ hot, const uint8_t* __restrict__ f, const uint8_t* __restrict__ w,
                       const uint8_t* __restrict__ g, const uint8_t* __restrict__ e, uint8_t* __restrict__ needed,
                       uint8_t* __restrict__ missing, uint8_t* __restrict__ streamed, uint8_t* __restrict__ scored,
                       uint8_t* __restrict__ was_masked, uint8_t* __restrict__ was_warm,
                       uint8_t* __restrict__ was_page) {
  for (int64_t m = 0; m < n; ++m) {
    const uint8_t s = sel[m], a = att[m];
    const uint8_t need = dec & s & (hot[m] ^ 1), held = f[m] | w[m];
    needed[m] |= need;
    missing[m] |= need & (held ^ 1) & (g[m] ^ 1);
    streamed[m] |= (a & (held ^ 1)) | e[m];  // read from its exact copy: streamed, not a warm read
    scored[m] = 1;
    was_masked[m] = dec & s & (a ^ 1);
    const uint8_t warm_read = a & w[m] & (e[m] ^ 1);
    was_warm[m] = warm_read;
    was_page[m] = a & (f[m] ^ 1) & (warm_read ^ 1) & (g[m] ^ 1);
  }
}

// Columns [m0, m0 + n) of one row whose records run consecutively from r0, specialized on the
// optional inputs. Branch-free (the flags are random per page: a mispredicted branch per flag costs
// more than the work); the records being consecutive, no two columns touch one record, so the table
// columns are walked like the row's and the loops (span_flags, span_stats: restrict parameters, a
// bool store may alias anything otherwise) vectorize. Adds the span's masked pages to cnt[0], warm
// reads to cnt[1], streamed pages to cnt[2], streamed pages read from disk to cnt[3].
template <bool kFull, bool kWarm, bool kStaged, bool kExact>
void fold_span(const RecordRow& x, int64_t m0, int64_t n, int64_t r0, bool decode, int64_t* cnt) {
  using u8 = uint8_t;  // the flags as bytes (0 / 1): GCC vectorizes byte arithmetic, not bool
  auto in = [m0](const bool* p) { return p ? reinterpret_cast<const u8*>(p + m0) : nullptr; };  // the row's, from m0
  auto col = [r0](bool* p) { return reinterpret_cast<u8*>(p + r0); };                         // the table's, from r0
  auto f32 = [m0](const float* p) { return p ? p + m0 : p; };
  const u8 *__restrict__ hot = in(x.hot), *__restrict__ sel = in(x.sel), *__restrict__ att = in(x.att),
           *__restrict__ full = in(x.full), *__restrict__ warm = in(x.warm), *__restrict__ staged = in(x.staged),
           *__restrict__ exact = in(x.exact), *__restrict__ tst = reinterpret_cast<const u8*>(x.table_staged + r0);
  const float *__restrict__ mass = f32(x.mass), *__restrict__ imp = f32(x.imp), *__restrict__ rel = f32(x.rel);
  const int64_t *__restrict__ dslot = x.dslot + r0, *__restrict__ wslot = x.wslot + r0,
                *__restrict__ hslot = x.hslot + r0;
  u8 *__restrict__ needed = col(x.needed), *__restrict__ missing = col(x.missing),
     *__restrict__ streamed = col(x.streamed), *__restrict__ scored = col(x.scored);
  float *__restrict__ acc_mass = x.acc_mass + r0, *__restrict__ acc_imp = x.acc_imp + r0,
        *__restrict__ acc_rel = x.acc_rel + r0;
  const u8 dec = decode;
  int32_t masked = 0, warm_reads = 0, pages = 0, from_disk = 0;  // (a span is shorter than 2^31 columns)
  // In chunks, one loop per element width (GCC 12 vectorizes none that mixes int64 or float lanes
  // with byte lanes): the slot columns' flags, the byte flags, the float statistics, the counts.
  u8 full_of[kChunk], warm_of[kChunk], off_host[kChunk], was_masked[kChunk], was_warm[kChunk], was_page[kChunk];
  u8 none[kChunk] = {};  // no exact reads
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t k = std::min(kChunk, n - c);
    for (int64_t j = 0; j < k; ++j) {  // (the residency from the table where the plan did not give it)
      if constexpr (!kFull) full_of[j] = dslot[c + j] >= 0;
      if constexpr (!kWarm) warm_of[j] = (dslot[c + j] < 0) & (wslot[c + j] >= 0);
      off_host[j] = hslot[c + j] < 0;
    }
    const u8* f = kFull ? full + c : full_of;  // the plan's residency where it gave it, else the table's
    const u8* w = kWarm ? warm + c : warm_of;
    const u8* g = kStaged ? staged + c : tst + c;
    span_flags(k, dec, sel + c, att + c, hot + c, f, w, g, kExact ? exact + c : none, needed + c, missing + c,
               streamed + c, scored + c, was_masked, was_warm, was_page);
    span_stats(k, mass + c, imp + c, rel + c, acc_mass + c, acc_imp + c, acc_rel + c);
    for (int64_t j = 0; j < k; ++j) {
      masked += was_masked[j];
      warm_reads += was_warm[j];
      pages += was_page[j];
      from_disk += was_page[j] & off_host[j];
    }
  }
  cnt[0] += masked;
  cnt[1] += warm_reads;
  cnt[2] += pages;
  cnt[3] += from_disk;
}

// One (layer, sequence) row: its valid columns (padding adds nothing) in runs of consecutive
// records — a sequence's pages are mostly recorded in order, so a row is a few long runs — each
// folded by fold_span. Adds to cnt[0..3] as fold_span; returns the pages the row streamed (the
// caller counts its staging rounds).
template <bool kFull, bool kWarm, bool kStaged, bool kExact>
int64_t fold_row(const RecordRow& x, bool decode, int64_t* cnt) {
  int64_t span[4] = {0, 0, 0, 0};
  for (int64_t m = 0; m < x.M;) {
    if (!x.valid[m]) {
      ++m;
      continue;
    }
    const int64_t r0 = x.recs[m];  // the run: recs[m + j] = r0 + j
    int64_t end = m + 1;
    while (end < x.M && x.valid[end] && x.recs[end] == r0 + (end - m)) ++end;
    fold_span<kFull, kWarm, kStaged, kExact>(x, m, end - m, r0, decode, span);
    m = end;
  }
  cnt[0] += span[0];
  cnt[1] += span[1];
  cnt[3] += span[3];
  return span[2];
}

template <int kBits>
RowFn row_fn_of() {
  return fold_row<(kBits & 1) != 0, (kBits & 2) != 0, (kBits & 4) != 0, (kBits & 8) != 0>;
}

template <int... kBits>
RowFn pick_row(int bits, std::integer_sequence<int, kBits...>) {
  static const RowFn table[] = {row_fn_of<kBits>()...};
  return table[bits];
}

// Layers per task of torch's thread pool: at least ~32k entries each, so a small step (SmolLM2's
// tables) runs inline instead of waking the pool for microseconds of work.
int64_t layer_grain(int64_t per_layer) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, per_layer));
}

// fold_end's pieces of one chunk of a layer's columns, each of one element width with restrict
// parameters (GCC 12 vectorizes no loop that mixes byte lanes with 8-byte ones): the needed flags
// widened to the statistics' width first, then the decode step's statistics, then the scored
// pages' (flags widened to 4 bytes, as the floats).
inline void widen(int64_t n, const uint8_t* __restrict__ in, int64_t* __restrict__ out) {
  for (int64_t i = 0; i < n; ++i) out[i] = in[i];
}
inline void widen(int64_t n, const uint8_t* __restrict__ in, int32_t* __restrict__ out) {
  for (int64_t i = 0; i < n; ++i) out[i] = in[i];
}
inline void end_decode(int64_t n, const int64_t* __restrict__ nd, int64_t* __restrict__ la, int64_t* __restrict__ fq,
                       int64_t* __restrict__ wa, int64_t* __restrict__ hs, int64_t step_no, int64_t hist_mask) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = nd[i];
    la[i] = k ? step_no : la[i];
    fq[i] += k;
    wa[i] += k;
    hs[i] = ((hs[i] << 1) & hist_mask) | k;
  }
}
inline void end_scored(int64_t n, const int32_t* __restrict__ sc, const float* __restrict__ ms,
                       const float* __restrict__ rl, const float* __restrict__ im, float* __restrict__ am,
                       float* __restrict__ lr, float* __restrict__ ti) {
  for (int64_t i = 0; i < n; ++i) {
    // scored: its mass (+0 elsewhere: adding it changes nothing) and its latest relevance and importance
    am[i] += ms[i];
    lr[i] = sc[i] ? rl[i] : lr[i];
    ti[i] = sc[i] ? im[i] : ti[i];
  }
}
inline int32_t count_flags(int64_t n, const uint8_t* __restrict__ f) {
  int32_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += f[i];
  return c;
}

// One layer's [C] columns of fold_end, in chunks.
void end_row(int64_t C, const bool* nd, const bool* mi, const bool* sc, const float* ms, const float* rl,
             const float* im, int64_t* la, int64_t* fq, int64_t* wa, int64_t* hs, float* am, float* lr, float* ti,
             bool decode, int64_t step_no, int64_t hist_mask, int64_t* counts) {
  int64_t n64[kChunk];
  int32_t s32[kChunk];
  int64_t n_needed = 0, n_missing = 0;
  for (int64_t c = 0; c < C; c += kChunk) {
    const int64_t k = std::min(kChunk, C - c);
    if (decode) {
      widen(k, bytes(nd + c), n64);
      end_decode(k, n64, la + c, fq + c, wa + c, hs + c, step_no, hist_mask);
    }
    widen(k, bytes(sc + c), s32);
    end_scored(k, s32, ms + c, rl + c, im + c, am + c, lr + c, ti + c);
    n_needed += count_flags(k, bytes(nd + c));
    n_missing += count_flags(k, bytes(mi + c));
  }
  counts[0] = n_needed;
  counts[1] = n_missing;
}

// A candidate (Candidate, tier_rows.h) as one integer: its key above, its record below — the rank order (the
// lower key first, then the lower record) is the integers' order (the std algorithms below compare with `<`).

// A float's rank as an unsigned key, on its bits (this file builds with -ffast-math, which may
// drop NaN and infinity checks on floats): -0 as +0, NaN as +inf.
uint32_t order_key(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if ((b & 0x7fffffffu) == 0) b = 0;
  if ((b & 0x7fffffffu) > 0x7f800000u) b = 0x7f800000u;
  return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

// pick_layer's flags of one chunk: a record resident (device slot >= 0), and a candidate (in `cand`,
// resident, not T0, not protected; absent inputs given as all ones / all zeros). Restrict
// parameters, one element width per loop: both vectorize.
inline void resident_flags(int64_t n, const int64_t* __restrict__ slot, uint8_t* __restrict__ out) {
  for (int64_t i = 0; i < n; ++i) out[i] = slot[i] >= 0;
}
inline void candidate_flags(int64_t n, const uint8_t* __restrict__ cand, const uint8_t* __restrict__ held,
                            const uint8_t* __restrict__ hot, const uint8_t* __restrict__ kept,
                            uint8_t* __restrict__ out) {
  for (int64_t i = 0; i < n; ++i) out[i] = cand[i] & held[i] & (hot[i] ^ 1) & (kept[i] ^ 1);
}

// The positions `base + j` of the set flags ok[j] (bytes 0 / 1, j < n) appended to idx[at..]; returns the
// new end. Eight flags at a time as one word: a word of no candidate costs one test (candidates are
// sparse: the wanted pages, the unprotected resident ones), a set flag one bit scan.
inline int64_t compact(int64_t n, const uint8_t* ok, int64_t base, int64_t* idx, int64_t at) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t w;
    std::memcpy(&w, ok + j, sizeof w);
    while (w) {
      idx[at++] = base + j + (__builtin_ctzll(w) >> 3);
      w &= w - 1;  // (a flag is 0 or 1: its lowest bit is its only one)
    }
  }
  for (; j < n; ++j) {
    idx[at] = base + j;
    at += ok[j];
  }
  return at;
}

int64_t compact_flags(int64_t C, const uint8_t* flags, int64_t* idx) { return compact(C, flags, 0, idx, 0); }

// One layer's picks of pick_pages into `out` (records, by rank).
void pick_layer(int64_t l, int64_t C, int64_t count, bool largest, const float* prio, const bool* cand,
                const int64_t* resident, const bool* t0, const bool* protect, std::vector<int64_t>& idx,
                std::vector<Candidate>& pool, std::vector<int64_t>& out) {
  out.clear();
  if (count <= 0) return;
  pool.clear();
  const float* p = prio + l * C;
  const bool* cd = cand ? cand + l * C : nullptr;
  const int64_t* rs = resident ? resident + l * C : nullptr;
  const bool* pr = protect ? protect + l * C : nullptr;
  // the candidates' records in order, compacted branch-free (which records qualify is random: a
  // branch per record would mispredict), the table's columns read sequentially: per chunk the
  // qualifying flags first (byte lanes, the residency narrowed to a byte in its own loop: both
  // vectorize), then the compaction
  idx.resize(C);
  int64_t n = 0;
  uint8_t ok[kChunk], held[kChunk];
  static const std::array<uint8_t, kChunk> kOnes = [] {
    std::array<uint8_t, kChunk> a;
    a.fill(1);
    return a;
  }();
  static const std::array<uint8_t, kChunk> kZeros{};
  for (int64_t c = 0; c < C; c += kChunk) {
    const int64_t k = std::min(kChunk, C - c);
    if (rs) resident_flags(k, rs + c, held);
    candidate_flags(k, cd ? bytes(cd + c) : kOnes.data(), rs ? held : kOnes.data(),
                    t0 ? bytes(t0 + c) : kZeros.data(), pr ? bytes(pr + c) : kZeros.data(), ok);
    n = compact(k, ok, c, idx.data(), n);
  }
  // a few picks among many candidates: the best `count` kept in a heap as the candidates go by (most
  // are compared with its top only; a heap of hundreds costs more in replacements than a selection);
  // else all collected, then selected
  const bool few = count <= 64 && count * 16 <= n;
  pool.reserve(few ? count : n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = idx[i];
    const Candidate c = uint64_t{order_key(largest ? -p[r] : p[r])} << 32 | static_cast<uint64_t>(r);
    if (!few) {
      pool.push_back(c);
    } else if (static_cast<int64_t>(pool.size()) < count) {
      pool.push_back(c);
      std::push_heap(pool.begin(), pool.end());  // a max-heap: the worst kept on top
    } else if (c < pool.front()) {
      std::pop_heap(pool.begin(), pool.end());
      pool.back() = c;
      std::push_heap(pool.begin(), pool.end());
    }
  }
  if (few) {
    std::sort_heap(pool.begin(), pool.end());
    for (const Candidate c : pool) out.push_back(static_cast<int64_t>(c & 0xffffffffu));
    return;
  }
  const int64_t k = std::min<int64_t>(count, static_cast<int64_t>(pool.size()));
  if (k < static_cast<int64_t>(pool.size())) std::nth_element(pool.begin(), pool.begin() + k, pool.end());
  std::sort(pool.begin(), pool.begin() + k);
  for (int64_t i = 0; i < k; ++i) out.push_back(static_cast<int64_t>(pool[i] & 0xffffffffu));
}

StepRecordIn step_record_in(at::Tensor& recs, at::Tensor& valid, at::Tensor& t0, at::Tensor& selected,
                            at::Tensor& attended, const c10::optional<at::Tensor>& mass,
                            const c10::optional<at::Tensor>& importance, const c10::optional<at::Tensor>& relevance,
                            const c10::optional<at::Tensor>& exact, const c10::optional<at::Tensor>& full,
                            const c10::optional<at::Tensor>& warm, const c10::optional<at::Tensor>& staged,
                            at::Tensor& device_slot, at::Tensor& warm_slot, at::Tensor& host_slot,
                            at::Tensor& table_staged, at::Tensor& needed, at::Tensor& missing, at::Tensor& streamed,
                            at::Tensor& scored, at::Tensor& acc_mass, at::Tensor& acc_importance,
                            at::Tensor& acc_relevance, bool decode, int64_t staging_pages) {
  StepRecordIn x;
  const int64_t B = recs.size(0), M = recs.dim() == 2 ? recs.size(1) : 0;
  const int64_t L = needed.size(0), C = needed.size(1);
  check_2d(recs, "recs", B, M, at::kLong);
  check_2d(valid, "valid", B, M, at::kBool);
  check_2d(t0, "t0", B, M, at::kBool);
  for (auto [t, name] : {std::pair{&needed, "needed"}, {&missing, "missing"}, {&streamed, "streamed"},
                         {&scored, "scored"}, {&table_staged, "table_staged"}})
    check_2d(*t, name, L, C, at::kBool);
  for (auto [t, name] : {std::pair{&device_slot, "device_slot"}, {&warm_slot, "warm_slot"}, {&host_slot, "host_slot"}})
    check_2d(*t, name, L, C, at::kLong);
  for (auto [t, name] : {std::pair{&acc_mass, "acc_mass"}, {&acc_importance, "acc_importance"},
                         {&acc_relevance, "acc_relevance"}})
    check_2d(*t, name, L, C, at::kFloat);
  x.L = L, x.B = B, x.M = M, x.C = C;
  x.rc = recs.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * M; ++i) TORCH_CHECK(x.rc[i] >= 0 && x.rc[i] < C, "recs must lie in [0, ", C, ")");
  x.vd = valid.data_ptr<bool>(), x.hot = t0.data_ptr<bool>();
  x.sel = plane<bool>(selected, "selected", L, B, M, at::kBool);
  x.att = plane<bool>(attended, "attended", L, B, M, at::kBool);
  x.ms = plane<float>(mass, "mass", L, B, M, at::kFloat);
  x.imp = importance.has_value() ? plane<float>(importance, "importance", L, B, M, at::kFloat) : x.ms;
  x.rel = relevance.has_value() ? plane<float>(relevance, "relevance", L, B, M, at::kFloat) : x.ms;
  x.ex = plane<bool>(exact, "exact", L, B, M, at::kBool);
  x.fu = plane<bool>(full, "full", L, B, M, at::kBool);
  x.wa = plane<bool>(warm, "warm", L, B, M, at::kBool);
  x.st = plane<bool>(staged, "staged", L, B, M, at::kBool);
  x.dsl = device_slot.data_ptr<int64_t>(), x.wsl = warm_slot.data_ptr<int64_t>(), x.hsl = host_slot.data_ptr<int64_t>();
  x.tst = table_staged.data_ptr<bool>();
  x.nd = needed.data_ptr<bool>(), x.mi = missing.data_ptr<bool>(), x.sm = streamed.data_ptr<bool>();
  x.sc = scored.data_ptr<bool>();
  x.am = acc_mass.data_ptr<float>(), x.ai = acc_importance.data_ptr<float>(), x.ar = acc_relevance.data_ptr<float>();
  x.rounds_of = std::max<int64_t>(1, staging_pages);
  x.decode = decode;
  x.row_fn = pick_row(int(x.fu.data != nullptr) | int(x.wa.data != nullptr) << 1 | int(x.st.data != nullptr) << 2 |
                      int(x.ex.data != nullptr) << 3, std::make_integer_sequence<int, 16>{});
  return x;
}

TableStats table_stats(at::Tensor& last_access, at::Tensor& frequency, at::Tensor& win_access, at::Tensor& hist,
                       at::Tensor& acc_mass, at::Tensor& last_relevance, at::Tensor& importance, int64_t L,
                       int64_t C) {
  for (auto [t, name] : {std::pair{&last_access, "last_access"}, {&frequency, "frequency"},
                         {&win_access, "win_access"}, {&hist, "hist"}})
    check_2d(*t, name, L, C, at::kLong);
  for (auto [t, name] : {std::pair{&acc_mass, "table acc_mass"}, {&last_relevance, "last_relevance"},
                         {&importance, "table importance"}})
    check_2d(*t, name, L, C, at::kFloat);
  return {last_access.data_ptr<int64_t>(), frequency.data_ptr<int64_t>(), win_access.data_ptr<int64_t>(),
          hist.data_ptr<int64_t>(), acc_mass.data_ptr<float>(), last_relevance.data_ptr<float>(),
          importance.data_ptr<float>()};
}

void StepRecordIn::fold_layer(int64_t l, int64_t* cnt) const {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t i = b * M, at_ = l * C;
    if (!ms.data) {  // the step measured nothing: what it needed, only
      if (decode)
        for (int64_t m = 0; m < M; ++m) nd[at_ + rc[i + m]] |= vd[i + m] & sel.at(l, i + m) & !hot[i + m];
      continue;
    }
    auto row = [&](const auto& p) { return p.data ? p.data + l * p.layer_stride + i : nullptr; };
    const RecordRow x{M, vd + i, hot + i, row(sel), row(att), row(fu), row(wa), row(st), row(ex),
                      row(ms), row(imp), row(rel), rc + i, dsl + at_, wsl + at_, hsl + at_, tst + at_,
                      nd + at_, mi + at_, sm + at_, sc + at_, am + at_, ai + at_, ar + at_};
    const int64_t pages = row_fn(x, decode, cnt);
    cnt[2] += pages;
    cnt[4] += (pages + rounds_of - 1) / rounds_of;
  }
}

}  // namespace tier_rows

using namespace tier_rows;

at::Tensor fold_record(at::Tensor recs, at::Tensor valid, at::Tensor t0, at::Tensor selected, at::Tensor attended,
                       c10::optional<at::Tensor> mass, c10::optional<at::Tensor> importance,
                       c10::optional<at::Tensor> relevance, c10::optional<at::Tensor> exact,
                       c10::optional<at::Tensor> full, c10::optional<at::Tensor> warm,
                       c10::optional<at::Tensor> staged, at::Tensor device_slot, at::Tensor warm_slot,
                       at::Tensor host_slot, at::Tensor table_staged, at::Tensor needed, at::Tensor missing,
                       at::Tensor streamed, at::Tensor scored, at::Tensor acc_mass, at::Tensor acc_importance,
                       at::Tensor acc_relevance, bool decode, int64_t staging_pages) {
  const StepRecordIn x = step_record_in(recs, valid, t0, selected, attended, mass, importance, relevance, exact, full,
                                        warm, staged, device_slot, warm_slot, host_slot, table_staged, needed,
                                        missing, streamed, scored, acc_mass, acc_importance, acc_relevance, decode,
                                        staging_pages);
  const int64_t L = x.L;
  std::vector<int64_t> counts(5 * L, 0);  // per layer: masked, warm reads, streamed, from disk, rounds
  at::parallel_for(0, L, layer_grain(x.B * x.M), [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) x.fold_layer(l, counts.data() + 5 * l);
  });
  auto out = at::zeros({5}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t l = 0; l < L; ++l)
    for (int k = 0; k < 5; ++k) o[k] += counts[5 * l + k];
  return out;
}

at::Tensor fold_end(at::Tensor needed, at::Tensor missing, at::Tensor scored, at::Tensor mass, at::Tensor relevance,
                    at::Tensor importance, at::Tensor last_access, at::Tensor frequency, at::Tensor win_access,
                    at::Tensor hist, at::Tensor acc_mass, at::Tensor last_relevance, at::Tensor table_importance,
                    bool decode, int64_t step_no, int64_t hist_mask) {
  const int64_t L = needed.size(0), C = needed.dim() == 2 ? needed.size(1) : 0;
  for (auto [t, name] : {std::pair{&needed, "needed"}, {&missing, "missing"}, {&scored, "scored"}})
    check_2d(*t, name, L, C, at::kBool);
  for (auto [t, name] : {std::pair{&mass, "mass"}, {&relevance, "relevance"}, {&importance, "importance"}})
    check_2d(*t, name, L, C, at::kFloat);
  const TableStats st = table_stats(last_access, frequency, win_access, hist, acc_mass, last_relevance,
                                    table_importance, L, C);
  const bool *nd = needed.data_ptr<bool>(), *mi = missing.data_ptr<bool>(), *sc = scored.data_ptr<bool>();
  const float *ms = mass.data_ptr<float>(), *rl = relevance.data_ptr<float>(), *im = importance.data_ptr<float>();
  std::vector<int64_t> counts(2 * L, 0);
  at::parallel_for(0, L, layer_grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) {
      const int64_t o = l * C;
      end_row(C, nd + o, mi + o, sc + o, ms + o, rl + o, im + o, st.la + o, st.fq + o, st.wa + o, st.hs + o, st.am + o,
              st.lr + o, st.ti + o, decode, step_no, hist_mask, counts.data() + 2 * l);
    }
  });
  auto out = at::zeros({2}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t l = 0; l < L; ++l) {
    o[0] += counts[2 * l];
    o[1] += counts[2 * l + 1];
  }
  return out;
}


// One layer's [C] columns of wanted_pages (byte lanes: vectorizes; the device slots are read as a
// byte flag first, in their own loop).
int64_t tier_rows::want_row(int64_t C, const uint8_t* __restrict__ mi, const uint8_t* __restrict__ nd,
                 const uint8_t* __restrict__ st, const int64_t* __restrict__ ds, const uint8_t* __restrict__ alive,
                 uint8_t* __restrict__ want, uint8_t* __restrict__ protect) {
  uint8_t absent[kChunk];
  int64_t n = 0;
  for (int64_t c = 0; c < C; c += kChunk) {
    const int64_t k = std::min(kChunk, C - c);
    for (int64_t j = 0; j < k; ++j) absent[j] = ds[c + j] < 0;
    int32_t count = 0;
    for (int64_t j = 0; j < k; ++j) {
      const uint8_t w = (mi[c + j] | (nd[c + j] & st[c + j])) & absent[j] & alive[c + j];
      want[c + j] = w;
      protect[c + j] = nd[c + j] | w;
      count += w;
    }
    n += count;
  }
  return n;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> wanted_pages(at::Tensor missing, at::Tensor needed, at::Tensor staged,
                                                            at::Tensor device_slot, at::Tensor alive) {
  const int64_t L = missing.size(0), C = missing.dim() == 2 ? missing.size(1) : 0;
  for (auto [t, name] : {std::pair{&missing, "missing"}, {&needed, "needed"}, {&staged, "staged"}})
    check_2d(*t, name, L, C, at::kBool);
  check_2d(device_slot, "device_slot", L, C, at::kLong);
  check_row(alive, "alive", C);
  auto want = at::empty({L, C}, at::kBool), protect = at::empty({L, C}, at::kBool), need = at::empty({L}, at::kLong);
  const uint8_t *mi = bytes(missing.data_ptr<bool>()), *nd = bytes(needed.data_ptr<bool>()),
                *st = bytes(staged.data_ptr<bool>()), *al = bytes(alive.data_ptr<bool>());
  auto out8 = [](at::Tensor& t) { return reinterpret_cast<uint8_t*>(t.data_ptr<bool>()); };
  uint8_t *w = out8(want), *pr = out8(protect);
  const int64_t* ds = device_slot.data_ptr<int64_t>();
  int64_t* nl = need.data_ptr<int64_t>();
  at::parallel_for(0, L, layer_grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) {
      const int64_t o = l * C;
      nl[l] = want_row(C, mi + o, nd + o, st + o, ds + o, al, w + o, pr + o);
    }
  });
  return {want, protect, need};
}

namespace tier_rows {

// lfu_priority's row, in chunks: the frequencies as floats (exact below 2^24), then the formula.
// Built without fast-math and without contracting a * b + c into one fused multiply-add, so that
// every operation rounds as torch's separate kernels round it (bit for bit the reference's).
__attribute__((optimize("no-fast-math", "fp-contract=off"))) void priority_chunk(
    int64_t n, const float* __restrict__ freq, const float* __restrict__ imp, float* __restrict__ out, float top,
    float w_freq, float w_imp) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = w_freq * (freq[i] / top), b = w_imp * imp[i];
    out[i] = a + b;
  }
}
inline void to_float(int64_t n, const int64_t* __restrict__ in, float* __restrict__ out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
}
inline int64_t row_max(int64_t n, const int64_t* __restrict__ in) {
  int64_t m = std::numeric_limits<int64_t>::min();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, in[i]);
  return m;
}

void lfu_row(int64_t C, const int64_t* fq, const float* im, float* out, float w_freq, float w_imp) {
  // torch: freq.float().amax(1).clamp(min=1): the float of the highest count (the conversion keeps order)
  const float top = C ? std::max(static_cast<float>(row_max(C, fq)), 1.0f) : 1.0f;
  float f[kChunk];
  for (int64_t c = 0; c < C; c += kChunk) {
    const int64_t k = std::min(kChunk, C - c);
    to_float(k, fq + c, f);
    priority_chunk(k, f, im + c, out + c, top, w_freq, w_imp);
  }
}

}  // namespace tier_rows

at::Tensor lfu_priority(at::Tensor frequency, at::Tensor importance, double w_freq, double w_imp) {
  const int64_t L = frequency.size(0), C = frequency.dim() == 2 ? frequency.size(1) : 0;
  check_2d(frequency, "frequency", L, C, at::kLong);
  check_2d(importance, "importance", L, C, at::kFloat);
  auto out = at::empty({L, C}, at::kFloat);
  const int64_t* fq = frequency.data_ptr<int64_t>();
  const float* im = importance.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float wf = static_cast<float>(w_freq), wi = static_cast<float>(w_imp);
  at::parallel_for(0, L, layer_grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) lfu_row(C, fq + l * C, im + l * C, o + l * C, wf, wi);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> pick_pages(at::Tensor prio, at::Tensor counts, bool largest,
                                              c10::optional<at::Tensor> cand, c10::optional<at::Tensor> resident,
                                              c10::optional<at::Tensor> t0, c10::optional<at::Tensor> protect) {
  const int64_t L = prio.size(0), C = prio.dim() == 2 ? prio.size(1) : 0;
  check_2d(prio, "prio", L, C, at::kFloat);
  TORCH_CHECK(C <= (int64_t{1} << 32), "pick_pages takes at most 2^32 records, got ", C);
  TORCH_CHECK(counts.device().is_cpu() && counts.dim() == 1 && counts.size(0) == L && counts.scalar_type() == at::kLong &&
                  counts.is_contiguous(), "counts must be a contiguous CPU tensor of long [", L, "], got ", counts.sizes());
  auto opt = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  const bool *cd = nullptr, *hot = nullptr, *pr = nullptr;
  const int64_t* rs = nullptr;
  if (opt(cand)) {
    check_2d(*cand, "cand", L, C, at::kBool);
    cd = cand->data_ptr<bool>();
  }
  if (opt(resident)) {
    check_2d(*resident, "resident", L, C, at::kLong);
    rs = resident->data_ptr<int64_t>();
  }
  if (opt(t0)) {
    check_row(*t0, "t0", C);
    hot = t0->data_ptr<bool>();
  }
  if (opt(protect)) {
    check_2d(*protect, "protect", L, C, at::kBool);
    pr = protect->data_ptr<bool>();
  }
  const float* p = prio.data_ptr<float>();
  const int64_t* want = counts.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> picks(L);
  at::parallel_for(0, L, layer_grain(C), [&](int64_t begin, int64_t end) {
    std::vector<int64_t> idx;
    std::vector<Candidate> pool;
    for (int64_t l = begin; l < end; ++l)
      pick_layer(l, C, want[l], largest, p, cd, rs, hot, pr, idx, pool, picks[l]);
  });
  int64_t n = 0;
  for (const auto& v : picks) n += static_cast<int64_t>(v.size());
  auto layers = at::empty({n}, at::kLong), recs = at::empty({n}, at::kLong);
  int64_t *lo = layers.data_ptr<int64_t>(), *ro = recs.data_ptr<int64_t>();
  for (int64_t l = 0; l < L; ++l)
    for (const int64_t r : picks[l]) {
      *lo++ = l;
      *ro++ = r;
    }
  return {layers, recs};
}

// mask_pairs: the (layer, record) pairs where a [L, C] bool mask is set, layer by layer and within a
// layer by record — torch's mask.nonzero(as_tuple=True) — in one pass over the mask's 8-byte words
// (zero words skipped) where torch's nonzero takes ~0.18 ms over an [80, 2k] mask on one thread.
// `counts` [L], when given, is how many each layer holds (wanted_pages returns it); it is checked.
std::tuple<at::Tensor, at::Tensor> mask_pairs(at::Tensor mask, c10::optional<at::Tensor> counts) {
  const int64_t L = mask.size(0), C = mask.dim() == 2 ? mask.size(1) : 0;
  check_2d(mask, "mask", L, C, at::kBool);
  const uint8_t* mk = bytes(mask.data_ptr<bool>());
  std::vector<int64_t> start(L + 1, 0);
  if (counts.has_value() && counts->defined()) {
    TORCH_CHECK(counts->device().is_cpu() && counts->dim() == 1 && counts->size(0) == L &&
                    counts->scalar_type() == at::kLong && counts->is_contiguous(),
                "counts must be a contiguous CPU tensor of long [", L, "], got ", counts->sizes());
    const int64_t* n = counts->data_ptr<int64_t>();
    for (int64_t l = 0; l < L; ++l) {
      TORCH_CHECK(n[l] >= 0 && n[l] <= C, "counts[", l, "] = ", n[l], " lies outside [0, ", C, "]");
      start[l + 1] = start[l] + n[l];
    }
  } else {
    for (int64_t l = 0; l < L; ++l) start[l + 1] = start[l] + count_flags(C, mk + l * C);
  }
  auto layers = at::empty({start[L]}, at::kLong), recs = at::empty({start[L]}, at::kLong);
  int64_t *lo = layers.data_ptr<int64_t>(), *ro = recs.data_ptr<int64_t>();
  std::vector<int64_t> found(L, 0);
  at::parallel_for(0, L, layer_grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) {
      const uint8_t* row = mk + l * C;
      int64_t o = start[l];
      const int64_t cap = start[l + 1];
      int64_t c = 0;
      for (; c + 8 <= C; c += 8) {
        uint64_t word;
        std::memcpy(&word, row + c, 8);
        if (!word) continue;
        for (int64_t j = 0; j < 8; ++j)
          if (row[c + j]) {
            if (o < cap) lo[o] = l, ro[o] = c + j;
            ++o;
          }
      }
      for (; c < C; ++c)
        if (row[c]) {
          if (o < cap) lo[o] = l, ro[o] = c;
          ++o;
        }
      found[l] = o - start[l];
    }
  });
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(found[l] == start[l + 1] - start[l], "counts[", l, "] = ", start[l + 1] - start[l],
                " but the mask's layer holds ", found[l]);
  return {layers, recs};
}

TORCH_LIBRARY_FRAGMENT(tieredkv_cpu, m) {
  m.def("fold_record(Tensor recs, Tensor valid, Tensor t0, Tensor selected, Tensor attended, Tensor? mass, "
        "Tensor? importance, Tensor? relevance, Tensor? exact, Tensor? full, Tensor? warm, Tensor? staged, "
        "Tensor device_slot, Tensor warm_slot, Tensor host_slot, Tensor table_staged, Tensor(a!) needed, "
        "Tensor(b!) missing, Tensor(c!) streamed, Tensor(d!) scored, Tensor(e!) acc_mass, Tensor(f!) acc_importance, "
        "Tensor(g!) acc_relevance, bool decode, int staging_pages) -> Tensor");
  m.def("fold_end(Tensor needed, Tensor missing, Tensor scored, Tensor mass, Tensor relevance, Tensor importance, "
        "Tensor(a!) last_access, Tensor(b!) frequency, Tensor(c!) win_access, Tensor(d!) hist, Tensor(e!) acc_mass, "
        "Tensor(f!) last_relevance, Tensor(g!) table_importance, bool decode, int step_no, int hist_mask) -> Tensor");
  m.def("pick_pages(Tensor prio, Tensor counts, bool largest, Tensor? cand, Tensor? resident, Tensor? t0, "
        "Tensor? protect) -> (Tensor, Tensor)");
  m.def("wanted_pages(Tensor missing, Tensor needed, Tensor staged, Tensor device_slot, Tensor alive) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("lfu_priority(Tensor frequency, Tensor importance, float w_freq, float w_imp) -> Tensor");
  m.def("mask_pairs(Tensor mask, Tensor? counts) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tieredkv_cpu, CPU, m) {
  m.impl("fold_record", &fold_record);
  m.impl("fold_end", &fold_end);
  m.impl("pick_pages", &pick_pages);
  m.impl("wanted_pages", &wanted_pages);
  m.impl("lfu_priority", &lfu_priority);
  m.impl("mask_pairs", &mask_pairs);
}
