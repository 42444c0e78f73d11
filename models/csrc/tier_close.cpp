// close_decode_step: the end of a decode step in one pass over the layers, where the tier manager
// (runtime/tiered/step_fold.py: StepFold.close_step) would otherwise make six passes over the
// page table's [L, C] columns — fold_record, fold_end, wanted_pages, lfu_priority, pick_pages for
// the victims and evict_pages, pick_pages (or mask_pairs) for the wanted pages and admit_pages —
// each streaming every layer's columns from memory (at 70B shapes, 80 layers of ~2k records, the
// columns are ~17 MB: they do not stay in the caches between the passes). Here each layer runs its
// pieces back to back while its rows (~200 KB) are in the core's caches. The pieces are the same
// functions the separate ops call (tier_rows.h), in the same order within a layer, so the results
// are those of the separate ops bit for bit: the access record, the statistics, the pages evicted
// and admitted, their slots and bytes (tests/runtime/tiered/test_tier_moves_op.py).
//
// Where it applies (the manager checks): a decode step that is not a migration-window boundary,
// no prefetcher and nothing staged, a device budget, the lfu-importance policy without a next-use
// oracle, no warm tier, the page moves on the CPU with an unbounded host tier — the manager's own
// end_step runs otherwise.
//
// Per layer l, from its `stage[l]` (0: nothing done; calls resume where the last one stopped):
//   stage 0 -> 1: the step's record folded into the access record's row (fold_record), the row into
//     the statistics (fold_end), the wanted pages and what making room must not evict (wanted_pages);
//   stage 1 -> 2: room made — need[l] wanted, `resident_cap - used` free: the shortfall's victims
//     picked by the lfu-importance priority among the resident pages that are neither T0 nor
//     protected (pick_pages) and evicted (evict_pages); room[l] = min(need, resident_cap - used).
//     When the layer's host pool lacks the free slots its dirty victims need, the layer stays at
//     stage 1 and the call returns [1, the host slots per layer needed in all] (the caller grows
//     the pool and calls again);
//   (stage 4: as 2, and a wanted page has a warm copy or no host copy);
//   stage 2 -> 3 (once every layer is at 2): the wanted pages admitted — all of them, by record,
//     when every layer has room for all it wants, else the room[l] most important (pick_pages) —
//     from their host copies into free device slots (admit_pages). When the device pool lacks the
//     slots, [2, the device slots per layer needed in all] with nothing admitted; when a wanted page
//     has a warm copy or no host copy (it lives on disk), [3, 0] with nothing admitted (the caller
//     admits them its own way: the torch path reads the disk).
// Returns [0, 0] when every layer is done. `counts` [L, 13] accumulates per layer: masked pages,
// warm reads, pages streamed, streamed from disk, staging rounds (fold_record), pages needed,
// needed and missing (fold_end), wasted prefetches, pages written back, pages evicted
// (evict_pages), warm copies released, pages admitted that were not streamed, pages admitted
// (admit_pages).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "tier_rows.h"

using namespace tier_rows;

namespace {
constexpr int64_t kCounts = 13;
}  // namespace

at::Tensor close_decode_step(
    at::Tensor recs, at::Tensor valid, at::Tensor t0, at::Tensor selected, at::Tensor attended,
    c10::optional<at::Tensor> mass, c10::optional<at::Tensor> importance, c10::optional<at::Tensor> relevance,
    c10::optional<at::Tensor> exact, c10::optional<at::Tensor> full, c10::optional<at::Tensor> warm,
    c10::optional<at::Tensor> staged, at::Tensor needed, at::Tensor missing, at::Tensor streamed, at::Tensor scored,
    at::Tensor acc_mass, at::Tensor acc_importance, at::Tensor acc_relevance, at::Tensor device_slot,
    at::Tensor warm_slot, at::Tensor host_slot, at::Tensor disk_slot, at::Tensor table_staged, at::Tensor prefetched,
    at::Tensor t1, at::Tensor alive, at::Tensor table_t0, at::Tensor last_access, at::Tensor frequency,
    at::Tensor win_access, at::Tensor hist, at::Tensor table_acc_mass, at::Tensor last_relevance,
    at::Tensor table_importance, at::Tensor dev_k, at::Tensor dev_v, at::Tensor dev_owner, at::Tensor dev_used,
    at::Tensor host_k, at::Tensor host_v, at::Tensor host_owner, at::Tensor host_used, at::Tensor want,
    at::Tensor need, at::Tensor room, at::Tensor stage, at::Tensor counts, int64_t resident_cap, double w_freq,
    double w_imp, int64_t step_no, int64_t hist_mask, int64_t staging_pages) {
  const StepRecordIn rec = step_record_in(recs, valid, t0, selected, attended, mass, importance, relevance, exact,
                                          full, warm, staged, device_slot, warm_slot, host_slot, table_staged, needed,
                                          missing, streamed, scored, acc_mass, acc_importance, acc_relevance,
                                          /*decode=*/true, staging_pages);
  const int64_t L = rec.L, C = rec.C;
  check_2d(disk_slot, "disk_slot", L, C, at::kLong);
  for (auto [t, name] : {std::pair{&prefetched, "prefetched"}, {&t1, "t1"}, {&want, "want"}})
    check_2d(*t, name, L, C, at::kBool);
  check_row(alive, "alive", C);
  check_row(table_t0, "table_t0", C);
  const TableStats st = table_stats(last_access, frequency, win_access, hist, table_acc_mass, last_relevance,
                                    table_importance, L, C);
  for (auto [t, name] : {std::pair{&need, "need"}, {&room, "room"}, {&stage, "stage"}}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->size(0) == L && t->scalar_type() == at::kLong &&
                    t->is_contiguous(), name, " must be a contiguous CPU long tensor [", L, "]");
  }
  check_2d(counts, "counts", L, kCounts, at::kLong);
  TORCH_CHECK(resident_cap >= 0, "resident_cap must be >= 0, got ", resident_cap);
  auto [dev, host] = device_and_host(dev_k, dev_v, dev_owner, dev_used, host_k, host_v, host_owner, &host_used, L);

  int64_t *ds = device_slot.data_ptr<int64_t>(), *ws = warm_slot.data_ptr<int64_t>(),
          *hs = host_slot.data_ptr<int64_t>();
  const int64_t* dk = disk_slot.data_ptr<int64_t>();
  bool *pf = prefetched.data_ptr<bool>(), *t1p = t1.data_ptr<bool>(), *tst = table_staged.data_ptr<bool>();
  const bool *hot = table_t0.data_ptr<bool>(), *al = alive.data_ptr<bool>();
  bool* wt = want.data_ptr<bool>();
  int64_t *nl = need.data_ptr<int64_t>(), *rm = room.data_ptr<int64_t>(), *sg = stage.data_ptr<int64_t>(),
          *cn = counts.data_ptr<int64_t>();
  for (int64_t l = 0; l < L; ++l) TORCH_CHECK(sg[l] >= 0 && sg[l] <= 4, "stage[", l, "] must lie in [0, 4]");
  const float wf = static_cast<float>(w_freq), wi = static_cast<float>(w_imp);

  // stages 0 -> 2, layer by layer (layers are independent: a pool's slots and counts are per layer)
  std::vector<int64_t> host_short(L, 0);  // per layer: the host slots it needs in all (0: it had them)
  at::parallel_for(0, L, layer_grain(C), [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> protect(C);
    std::vector<float> prio(C);
    std::vector<int64_t> idx, victims;
    std::vector<Candidate> pool;
    for (int64_t l = begin; l < end; ++l) {
      if (sg[l] >= 2) continue;
      const int64_t o = l * C;
      int64_t* cnt = cn + l * kCounts;
      if (sg[l] == 0) {
        rec.fold_layer(l, cnt);
        end_row(C, rec.nd + o, rec.mi + o, rec.sc + o, rec.am + o, rec.ar + o, rec.ai + o, st.la + o, st.fq + o,
                st.wa + o, st.hs + o, st.am + o, st.lr + o, st.ti + o, /*decode=*/true, step_no, hist_mask, cnt + 5);
        sg[l] = 1;
      }
      // the wanted pages (again on a resumed layer: their inputs have not changed since)
      nl[l] = want_row(C, bytes(rec.mi + o), bytes(rec.nd + o), bytes(tst + o), ds + o, bytes(al),
                       reinterpret_cast<uint8_t*>(wt + o), protect.data());
      bool elsewhere = false;  // a wanted page with a warm copy or no host copy (its rows are cached now)
      if (nl[l] > 0) {
        idx.resize(C);
        const int64_t n = compact_flags(C, bytes(wt + o), idx.data());
        for (int64_t i = 0; i < n; ++i) elsewhere |= (hs[o + idx[i]] < 0) | (ws[o + idx[i]] >= 0);
      }
      // (a layer that wants nothing evicts nothing: its device use is within resident_cap)
      const int64_t short_by = nl[l] > 0 ? std::max<int64_t>(0, nl[l] - (resident_cap - dev.used[l])) : 0;
      if (short_by > 0) {
        lfu_row(C, st.fq + o, st.ti + o, prio.data(), wf, wi);
        pick_layer(0, C, short_by, /*largest=*/false, prio.data(), nullptr, ds + o, hot,
                   reinterpret_cast<const bool*>(protect.data()), idx, pool, victims);
        int64_t dirty = 0;
        for (const int64_t r : victims) dirty += (hs[o + r] < 0) & (dk[o + r] < 0);
        if (host.used[l] + dirty > host.slots) {
          host_short[l] = host.used[l] + dirty;
          continue;
        }
        for (const int64_t r : victims) evict_one(l, r, o + r, ds, hs, dk, t1p, pf, tst, dev, host, cnt + 7);
      }
      rm[l] = std::min(nl[l], resident_cap - dev.used[l]);
      sg[l] = elsewhere ? 4 : 2;
    }
  });
  auto out = at::zeros({2}, at::kLong);
  int64_t* res = out.data_ptr<int64_t>();
  const int64_t host_need = L ? *std::max_element(host_short.begin(), host_short.end()) : 0;
  if (host_need > 0) {
    res[0] = 1, res[1] = host_need;
    return out;
  }

  // stage 2 -> 3: the admissions, once the device pool has the slots and every wanted page has its
  // host copy and no warm one (else nothing is admitted here)
  bool fits = true, dev_short = false, away = false;
  int64_t dev_need = 0;
  for (int64_t l = 0; l < L; ++l) {
    if (sg[l] == 3) continue;
    fits &= rm[l] >= nl[l];
    dev_need = std::max(dev_need, dev.used[l] + rm[l]);
    dev_short |= dev.used[l] + rm[l] > dev.slots;
    away |= sg[l] == 4 && rm[l] > 0;
  }
  if (away) {
    res[0] = 3;
    return out;
  }
  if (dev_short) {
    res[0] = 2, res[1] = dev_need;
    return out;
  }
  at::parallel_for(0, L, layer_grain(C), [&](int64_t begin, int64_t end) {
    std::vector<int64_t> idx, take;
    std::vector<Candidate> pool;
    for (int64_t l = begin; l < end; ++l) {
      if (sg[l] == 3) continue;
      sg[l] = 3;
      if (rm[l] <= 0) continue;
      const int64_t o = l * C;
      if (fits) {  // every wanted page, by record
        take.clear();
        for (int64_t c = 0; c < C; ++c)
          if (wt[o + c]) take.push_back(c);
      } else {  // the room[l] most important
        pick_layer(0, C, rm[l], /*largest=*/true, st.ti + o, wt + o, nullptr, nullptr, nullptr, idx, pool, take);
      }
      for (const int64_t r : take)
        admit_one(l, r, o + r, rec.sm[o + r], ds, hs, ws, dev, host, nullptr, cn + l * kCounts + 10);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(tieredkv_cpu, m) {
  m.def("close_decode_step(Tensor recs, Tensor valid, Tensor t0, Tensor selected, Tensor attended, Tensor? mass, "
        "Tensor? importance, Tensor? relevance, Tensor? exact, Tensor? full, Tensor? warm, Tensor? staged, "
        "Tensor(a!) needed, Tensor(b!) missing, Tensor(c!) streamed, Tensor(d!) scored, Tensor(e!) acc_mass, "
        "Tensor(f!) acc_importance, Tensor(g!) acc_relevance, Tensor(h!) device_slot, Tensor warm_slot, "
        "Tensor(i!) host_slot, Tensor disk_slot, Tensor(j!) table_staged, Tensor(k!) prefetched, Tensor(l!) t1, "
        "Tensor alive, Tensor table_t0, Tensor(m!) last_access, Tensor(n!) frequency, Tensor(o!) win_access, "
        "Tensor(p!) hist, Tensor(q!) table_acc_mass, Tensor(r!) last_relevance, Tensor(s!) table_importance, "
        "Tensor(t!) dev_k, Tensor(u!) dev_v, Tensor(v!) dev_owner, Tensor(w!) dev_used, Tensor(x!) host_k, "
        "Tensor(y!) host_v, Tensor(z!) host_owner, Tensor(a1!) host_used, Tensor(b1!) want, Tensor(c1!) need, "
        "Tensor(d1!) room, Tensor(e1!) stage, Tensor(f1!) counts, int resident_cap, float w_freq, float w_imp, "
        "int step_no, int hist_mask, int staging_pages) -> Tensor");
}

TORCH_LIBRARY_IMPL(tieredkv_cpu, CPU, m) { m.impl("close_decode_step", &close_decode_step); }
