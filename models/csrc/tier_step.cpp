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
// Layers are independent (a record's row is layer * C + record): torch's thread pool splits them
// when there is enough work (layer_grain).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace {

void check_2d(const at::Tensor& t, const char* name, int64_t rows, int64_t cols, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must be [", rows, ", ", cols, "], got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

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

// One row, specialized on the optional inputs. Branch-free (the flags are random per page: a
// mispredicted branch per flag costs more than the work), through restrict locals (a bool store
// may alias anything: the compiler would reload every pointer after each one). Adds the row's
// masked pages to cnt[0], warm reads to cnt[1], streamed pages read from disk to cnt[3]; returns the
// pages it streamed (the caller counts them and their staging rounds).
template <bool kFull, bool kWarm, bool kStaged, bool kExact>
int64_t fold_row(const RecordRow& x, bool decode, int64_t* cnt) {
  const bool *__restrict__ valid = x.valid, *__restrict__ hot = x.hot, *__restrict__ sel = x.sel,
             *__restrict__ att = x.att, *__restrict__ full = x.full, *__restrict__ warm = x.warm,
             *__restrict__ staged = x.staged, *__restrict__ exact = x.exact, *__restrict__ tst = x.table_staged;
  const float *__restrict__ mass = x.mass, *__restrict__ imp = x.imp, *__restrict__ rel = x.rel;
  const int64_t *__restrict__ recs = x.recs, *__restrict__ dslot = x.dslot, *__restrict__ wslot = x.wslot,
                *__restrict__ hslot = x.hslot;
  bool *__restrict__ needed = x.needed, *__restrict__ missing = x.missing, *__restrict__ streamed = x.streamed,
       *__restrict__ scored = x.scored;
  float *__restrict__ acc_mass = x.acc_mass, *__restrict__ acc_imp = x.acc_imp, *__restrict__ acc_rel = x.acc_rel;
  int64_t masked = 0, warm_reads = 0, pages = 0, from_disk = 0;
  for (int64_t m = 0; m < x.M; ++m) {
    if (!valid[m]) continue;  // padding adds nothing (a row's valid columns come first: predictable)
    const int64_t r = recs[m];
    const bool s = sel[m], a = att[m];
    bool f, w;
    if constexpr (kFull) f = full[m]; else f = dslot[r] >= 0;
    if constexpr (kWarm) w = warm[m]; else w = (dslot[r] < 0) & (wslot[r] >= 0);
    bool g;
    if constexpr (kStaged) g = staged[m]; else g = tst[r];
    bool e = false;  // read from its exact copy: streamed, not a warm read
    if constexpr (kExact) e = exact[m];
    const bool need = decode & s & !hot[m];
    needed[r] |= need;
    missing[r] |= need & !(f | w) & !g;
    masked += decode & s & !a;
    streamed[r] |= (a & !(f | w)) | e;
    acc_mass[r] += mass[m];
    acc_imp[r] = std::max(acc_imp[r], imp[m]);
    acc_rel[r] = std::max(acc_rel[r], rel[m]);
    scored[r] = true;
    const bool warm_read = a & w & !e;
    warm_reads += warm_read;
    const bool page = a & !f & !warm_read & !g;
    pages += page;
    from_disk += page & (hslot[r] < 0);
  }
  cnt[0] += masked;
  cnt[1] += warm_reads;
  cnt[3] += from_disk;
  return pages;
}

using RowFn = int64_t (*)(const RecordRow&, bool, int64_t*);

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

// One layer's [C] columns of fold_end: elementwise, through restrict pointers (so it vectorizes).
void end_row(int64_t C, const bool* __restrict__ nd, const bool* __restrict__ mi, const bool* __restrict__ sc,
             const float* __restrict__ ms, const float* __restrict__ rl, const float* __restrict__ im,
             int64_t* __restrict__ la, int64_t* __restrict__ fq, int64_t* __restrict__ wa, int64_t* __restrict__ hs,
             float* __restrict__ am, float* __restrict__ lr, float* __restrict__ ti, bool decode, int64_t step_no,
             int64_t hist_mask, int64_t* counts) {
  int64_t n_needed = 0, n_missing = 0;
  if (decode)
    for (int64_t i = 0; i < C; ++i) {
      const int64_t n = nd[i];
      la[i] = n ? step_no : la[i];
      fq[i] += n;
      wa[i] += n;
      hs[i] = ((hs[i] << 1) & hist_mask) | n;
    }
  for (int64_t i = 0; i < C; ++i) {
    n_needed += nd[i];
    n_missing += mi[i];
    // scored: its mass (+0 elsewhere: adding it changes nothing) and its latest relevance and importance
    am[i] += ms[i];
    lr[i] = sc[i] ? rl[i] : lr[i];
    ti[i] = sc[i] ? im[i] : ti[i];
  }
  counts[0] = n_needed;
  counts[1] = n_missing;
}

}  // namespace

at::Tensor fold_record(at::Tensor recs, at::Tensor valid, at::Tensor t0, at::Tensor selected, at::Tensor attended,
                       c10::optional<at::Tensor> mass, c10::optional<at::Tensor> importance,
                       c10::optional<at::Tensor> relevance, c10::optional<at::Tensor> exact,
                       c10::optional<at::Tensor> full, c10::optional<at::Tensor> warm,
                       c10::optional<at::Tensor> staged, at::Tensor device_slot, at::Tensor warm_slot,
                       at::Tensor host_slot, at::Tensor table_staged, at::Tensor needed, at::Tensor missing,
                       at::Tensor streamed, at::Tensor scored, at::Tensor acc_mass, at::Tensor acc_importance,
                       at::Tensor acc_relevance, bool decode, int64_t staging_pages) {
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
  const int64_t* rc = recs.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * M; ++i) TORCH_CHECK(rc[i] >= 0 && rc[i] < C, "recs must lie in [0, ", C, ")");
  const bool *vd = valid.data_ptr<bool>(), *hot = t0.data_ptr<bool>();
  const auto sel = plane<bool>(selected, "selected", L, B, M, at::kBool);
  const auto att = plane<bool>(attended, "attended", L, B, M, at::kBool);
  const auto ms = plane<float>(mass, "mass", L, B, M, at::kFloat);
  const auto imp = importance.has_value() ? plane<float>(importance, "importance", L, B, M, at::kFloat) : ms;
  const auto rel = relevance.has_value() ? plane<float>(relevance, "relevance", L, B, M, at::kFloat) : ms;
  const auto ex = plane<bool>(exact, "exact", L, B, M, at::kBool);
  const auto fu = plane<bool>(full, "full", L, B, M, at::kBool);
  const auto wa = plane<bool>(warm, "warm", L, B, M, at::kBool);
  const auto st = plane<bool>(staged, "staged", L, B, M, at::kBool);
  const int64_t *dsl = device_slot.data_ptr<int64_t>(), *wsl = warm_slot.data_ptr<int64_t>(),
                *hsl = host_slot.data_ptr<int64_t>();
  const bool* tst = table_staged.data_ptr<bool>();
  bool *nd = needed.data_ptr<bool>(), *mi = missing.data_ptr<bool>(), *sm = streamed.data_ptr<bool>(),
       *sc = scored.data_ptr<bool>();
  float *am = acc_mass.data_ptr<float>(), *ai = acc_importance.data_ptr<float>(),
        *ar = acc_relevance.data_ptr<float>();
  const int64_t rounds_of = std::max<int64_t>(1, staging_pages);
  const RowFn row_fn = pick_row(int(fu.data != nullptr) | int(wa.data != nullptr) << 1 |
                                int(st.data != nullptr) << 2 | int(ex.data != nullptr) << 3,
                                std::make_integer_sequence<int, 16>{});
  std::vector<int64_t> counts(5 * L, 0);  // per layer: masked, warm reads, streamed, from disk, rounds

  at::parallel_for(0, L, layer_grain(B * M), [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) {
      int64_t* cnt = counts.data() + 5 * l;
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
  for (auto [t, name] : {std::pair{&last_access, "last_access"}, {&frequency, "frequency"},
                         {&win_access, "win_access"}, {&hist, "hist"}})
    check_2d(*t, name, L, C, at::kLong);
  for (auto [t, name] : {std::pair{&mass, "mass"}, {&relevance, "relevance"}, {&importance, "importance"},
                         {&acc_mass, "acc_mass"}, {&last_relevance, "last_relevance"},
                         {&table_importance, "table_importance"}})
    check_2d(*t, name, L, C, at::kFloat);
  const bool *nd = needed.data_ptr<bool>(), *mi = missing.data_ptr<bool>(), *sc = scored.data_ptr<bool>();
  const float *ms = mass.data_ptr<float>(), *rl = relevance.data_ptr<float>(), *im = importance.data_ptr<float>();
  int64_t *la = last_access.data_ptr<int64_t>(), *fq = frequency.data_ptr<int64_t>(),
          *wa = win_access.data_ptr<int64_t>(), *hs = hist.data_ptr<int64_t>();
  float *am = acc_mass.data_ptr<float>(), *lr = last_relevance.data_ptr<float>(),
        *ti = table_importance.data_ptr<float>();
  std::vector<int64_t> counts(2 * L, 0);
  at::parallel_for(0, L, layer_grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) {
      const int64_t o = l * C;
      end_row(C, nd + o, mi + o, sc + o, ms + o, rl + o, im + o, la + o, fq + o, wa + o, hs + o, am + o, lr + o, ti + o,
              decode, step_no, hist_mask, counts.data() + 2 * l);
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

TORCH_LIBRARY_FRAGMENT(tieredkv_cpu, m) {
  m.def("fold_record(Tensor recs, Tensor valid, Tensor t0, Tensor selected, Tensor attended, Tensor? mass, "
        "Tensor? importance, Tensor? relevance, Tensor? exact, Tensor? full, Tensor? warm, Tensor? staged, "
        "Tensor device_slot, Tensor warm_slot, Tensor host_slot, Tensor table_staged, Tensor(a!) needed, "
        "Tensor(b!) missing, Tensor(c!) streamed, Tensor(d!) scored, Tensor(e!) acc_mass, Tensor(f!) acc_importance, "
        "Tensor(g!) acc_relevance, bool decode, int staging_pages) -> Tensor");
  m.def("fold_end(Tensor needed, Tensor missing, Tensor scored, Tensor mass, Tensor relevance, Tensor importance, "
        "Tensor(a!) last_access, Tensor(b!) frequency, Tensor(c!) win_access, Tensor(d!) hist, Tensor(e!) acc_mass, "
        "Tensor(f!) last_relevance, Tensor(g!) table_importance, bool decode, int step_no, int hist_mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(tieredkv_cpu, CPU, m) {
  m.impl("fold_record", &fold_record);
  m.impl("fold_end", &fold_end);
}
