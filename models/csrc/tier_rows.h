// The per-layer pieces of the tier manager's step ops (tier_step.cpp) and page moves
// (tier_moves.cpp), shared with the op that closes a decode step in one pass over the layers
// (tier_close.cpp). Each piece works on one layer's [C] row of the page table's [L, C] columns.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace tier_rows {

// The loops that mix element widths run over chunks of this many records, one loop per width.
constexpr int64_t kChunk = 256;

// Flags as bytes (0 / 1): GCC vectorizes byte arithmetic, not bool.
inline const uint8_t* bytes(const bool* p) { return reinterpret_cast<const uint8_t*>(p); }

void check_2d(const at::Tensor& t, const char* name, int64_t rows, int64_t cols, at::ScalarType dtype);
void check_row(const at::Tensor& t, const char* name, int64_t cols);

// A [L, B, M] input or a [B, M] one shared by every layer: its data and the stride between layers.
template <typename T>
struct Plane {
  const T* data = nullptr;
  int64_t layer_stride = 0;
  T at(int64_t l, int64_t i) const { return data[l * layer_stride + i]; }
};

template <typename T>
Plane<T> plane(const c10::optional<at::Tensor>& t, const char* name, int64_t L, int64_t B, int64_t M,
               at::ScalarType dtype) {
  Plane<T> p;
  if (!t.has_value() || !t->defined()) return p;
  TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == dtype, name,
              " must be a contiguous CPU tensor of ", dtype);
  if (t->dim() == 3) {
    TORCH_CHECK(t->size(0) == L && t->size(1) == B && t->size(2) == M, name, " must be [", L, ", ", B, ", ", M,
                "] or [", B, ", ", M, "], got ", t->sizes());
    p.layer_stride = B * M;
  } else {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == B && t->size(1) == M, name, " must be [", L, ", ", B, ", ", M,
                "] or [", B, ", ", M, "], got ", t->sizes());
  }
  p.data = t->data_ptr<T>();
  return p;
}

struct RecordRow;
using RowFn = int64_t (*)(const RecordRow&, bool, int64_t*);

// fold_record's inputs and outputs, checked (step_record_in): fold_layer folds one layer's rows of
// the step's record into that layer's row of the access record and adds the layer's counts to
// cnt[5] (masked pages, warm reads, pages streamed, streamed pages read from disk, staging rounds).
struct StepRecordIn {
  int64_t L = 0, B = 0, M = 0, C = 0;
  const int64_t* rc = nullptr;
  const bool *vd = nullptr, *hot = nullptr;
  Plane<bool> sel, att, ex, fu, wa, st;
  Plane<float> ms, imp, rel;
  const int64_t *dsl = nullptr, *wsl = nullptr, *hsl = nullptr;
  const bool* tst = nullptr;
  bool *nd = nullptr, *mi = nullptr, *sm = nullptr, *sc = nullptr;
  float *am = nullptr, *ai = nullptr, *ar = nullptr;
  int64_t rounds_of = 1;
  bool decode = false;
  RowFn row_fn = nullptr;

  void fold_layer(int64_t l, int64_t* cnt) const;
};

StepRecordIn step_record_in(at::Tensor& recs, at::Tensor& valid, at::Tensor& t0, at::Tensor& selected,
                            at::Tensor& attended, const c10::optional<at::Tensor>& mass,
                            const c10::optional<at::Tensor>& importance, const c10::optional<at::Tensor>& relevance,
                            const c10::optional<at::Tensor>& exact, const c10::optional<at::Tensor>& full,
                            const c10::optional<at::Tensor>& warm, const c10::optional<at::Tensor>& staged,
                            at::Tensor& device_slot, at::Tensor& warm_slot, at::Tensor& host_slot,
                            at::Tensor& table_staged, at::Tensor& needed, at::Tensor& missing, at::Tensor& streamed,
                            at::Tensor& scored, at::Tensor& acc_mass, at::Tensor& acc_importance,
                            at::Tensor& acc_relevance, bool decode, int64_t staging_pages);

// The page table's statistics columns that fold_end updates, [L, C] each, checked (table_stats).
struct TableStats {
  int64_t *la = nullptr, *fq = nullptr, *wa = nullptr, *hs = nullptr;  // last access, frequency, window use, history
  float *am = nullptr, *lr = nullptr, *ti = nullptr;                   // accumulated mass, last relevance, importance
};
TableStats table_stats(at::Tensor& last_access, at::Tensor& frequency, at::Tensor& win_access, at::Tensor& hist,
                       at::Tensor& acc_mass, at::Tensor& last_relevance, at::Tensor& importance, int64_t L,
                       int64_t C);

// fold_end's row: the access record's row into the layer's statistics; counts[2] = needed, missing.
void end_row(int64_t C, const bool* nd, const bool* mi, const bool* sc, const float* ms, const float* rl,
             const float* im, int64_t* la, int64_t* fq, int64_t* wa, int64_t* hs, float* am, float* lr, float* ti,
             bool decode, int64_t step_no, int64_t hist_mask, int64_t* counts);

// wanted_pages' row: want and protect written, returns how many the layer wants.
int64_t want_row(int64_t C, const uint8_t* __restrict__ mi, const uint8_t* __restrict__ nd,
                 const uint8_t* __restrict__ st, const int64_t* __restrict__ ds, const uint8_t* __restrict__ alive,
                 uint8_t* __restrict__ want, uint8_t* __restrict__ protect);

// The positions of the set flags of a [C] byte row (0 / 1) into idx, in order; returns how many.
int64_t compact_flags(int64_t C, const uint8_t* flags, int64_t* idx);

// lfu_priority's row (the layer's highest frequency read first).
void lfu_row(int64_t C, const int64_t* fq, const float* im, float* out, float w_freq, float w_imp);

// pick_pages' layer: the `count` best candidates of layer l into `out` (records, by rank).
using Candidate = uint64_t;
void pick_layer(int64_t l, int64_t C, int64_t count, bool largest, const float* prio, const bool* cand,
                const int64_t* resident, const bool* t0, const bool* protect, std::vector<int64_t>& idx,
                std::vector<Candidate>& pool, std::vector<int64_t>& out);

// One pool of one tier, as the page moves see it: its owner table [L, S] and owned slots per layer [L] —
// kept as slots are taken and given back — and, for the device and host pools, its pages' bytes.
struct Pool {
  int64_t *owner, *used, slots;
  char *k = nullptr, *v = nullptr;
  int64_t page_bytes = 0;
  std::vector<int64_t> next;  // per layer: the free slot to look from

  char* at(char* base, int64_t l, int64_t s) const { return base + (l * slots + s) * page_bytes; }

  // Whether `need` more pages per layer fit; else the slots each layer needs in all (used + need),
  // the most of them in `total_max`.
  bool fits(const std::vector<int64_t>& need, int64_t* total_max) const {
    bool ok = true;
    *total_max = 0;
    for (size_t l = 0; l < need.size(); ++l) {
      if (!need[l]) continue;
      ok &= used[l] + need[l] <= slots;
      *total_max = std::max(*total_max, used[l] + need[l]);
    }
    return ok;
  }

  // The next free slot of layer l (ascending, as TierPool.alloc takes them), now holding `rec`.
  int64_t take(int64_t l, int64_t rec) {
    int64_t& s = next[l];
    while (s < slots && owner[l * slots + s] >= 0) ++s;  // the caller checked that enough are free
    TORCH_CHECK(s < slots, "internal: layer ", l, " has fewer free slots than its used count says");
    owner[l * slots + s] = rec;
    ++used[l];
    return s++;
  }

  void give_back(int64_t l, int64_t s) {
    owner[l * slots + s] = -1;
    --used[l];
  }
};

void check_cols(const at::Tensor& t, const char* name, int64_t rows, at::ScalarType dtype);
int64_t* used_of(at::Tensor& used, int64_t L, const char* name);
int64_t layer_grain(int64_t per_layer);
Pool slots_of(at::Tensor& owner, at::Tensor* used, int64_t L, const char* name);
std::pair<Pool, Pool> device_and_host(at::Tensor& dev_k, at::Tensor& dev_v, at::Tensor& dev_owner,
                                      at::Tensor& dev_used, at::Tensor& host_k, at::Tensor& host_v,
                                      at::Tensor& host_owner, at::Tensor* host_used, int64_t L);

// One page's K and V from slot `fs` of a layer of `from` into slot `ts` of that layer of `to`.
inline void copy_page(const Pool& to, int64_t l, int64_t ts, const Pool& from, int64_t fs) {
  std::memcpy(to.at(to.k, l, ts), from.at(from.k, l, fs), to.page_bytes);
  std::memcpy(to.at(to.v, l, ts), from.at(from.v, l, fs), to.page_bytes);
}

// evict_pages' move of page `at_` (= l * C + record) of layer l, resident: wasted-prefetch flags
// cleared (added to counts[0]), written back into a free host slot when dirty (counts[1]), its
// device slot freed (counts[2]). A page no longer resident (listed twice) is skipped.
inline void evict_one(int64_t l, int64_t rec, int64_t at_, int64_t* ds, int64_t* hs, const int64_t* dk, bool* t1,
                      bool* pf, bool* st, Pool& dev, Pool& host, int64_t* counts) {
  const int64_t d = ds[at_];
  if (d < 0) return;
  counts[0] += pf[at_] | st[at_];
  pf[at_] = st[at_] = false;
  if ((hs[at_] < 0) & (dk[at_] < 0)) {
    const int64_t h = host.take(l, rec);
    copy_page(host, l, h, dev, d);
    hs[at_] = h;
    ++counts[1];
  }
  dev.give_back(l, d);
  ++counts[2];
  ds[at_] = -1;
  t1[at_] = false;
}

// admit_pages' move of page `at_` of layer l, not resident, with a host copy: its warm copy released
// (counts[0]), copied from the host into the next free device slot (counts[2]; counts[1] when it was
// not streamed this step). A page resident already (listed twice) is skipped.
inline void admit_one(int64_t l, int64_t rec, int64_t at_, bool was_streamed, int64_t* ds, const int64_t* hs,
                      int64_t* ws, Pool& dev, const Pool& host, Pool* warm, int64_t* counts) {
  if (ds[at_] >= 0) return;
  if (ws[at_] >= 0) {
    warm->give_back(l, ws[at_]);
    ws[at_] = -1;
    ++counts[0];
  }
  const int64_t d = dev.take(l, rec);
  copy_page(dev, l, d, host, hs[at_]);
  ds[at_] = d;
  counts[1] += !was_streamed;
  ++counts[2];
}

}  // namespace tier_rows
