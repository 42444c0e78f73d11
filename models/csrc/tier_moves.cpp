// The tier manager's page moves on the CPU, one pass over the moved pages each instead of some
// twenty torch ops over (layer, record) pairs (runtime/tiered/moves.py: PageMoves.evict and
// PageMoves.admit, whose torch code stays the reference these ops are tested against, state for
// state: tests/runtime/tiered/test_tier_moves_op.py).
//
// evict_pages: full-precision pages (layers, recs) leave the device. A page the prefetcher brought
// in or staged and no step used counts as wasted prefetch (its flags cleared); a dirty page (no
// host and no disk copy) is copied into the next free slot of its layer's host pool first (the
// pairs in order; free slots in ascending order, as TierPool.alloc takes them); then its device
// slot is freed and its T1 label dropped. Returns [4]: wasted prefetches, pages written back, pages
// evicted (a page listed twice leaves once), 0 — or, when a layer's host pool lacks the free slots
// its dirty pages need, [-1, the host slots per layer needed in all, 0, 0] with nothing changed (the
// caller grows the pool and calls again).
//
// admit_pages: non-resident pages (layers, recs) become resident, copied exact from their host
// copies into the next free device slots of their layers (same order), a warm copy released
// first. Returns [4]: warm copies released, pages copied that were not streamed this step
// (`streamed`), pages admitted (a page listed twice comes in once), 0 — or [-1, the device slots per
// layer needed in all, 0, 0] when a layer's device pool lacks the free slots, or [-2, 0, 0, 0] when
// a page has no host copy (it lives on disk: the caller takes the torch path), each with nothing
// changed.
//
// Pools: [L, S, ...] page tensors (contiguous; host and device of one dtype), their owner tables
// [L, S] (the record a slot holds, -1 free) and their owned slots per layer [L] (`*_used`: kept
// up to date, as TierPool.alloc keeps its count); the page table's columns are [L, C].

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tier_rows.h"

namespace tier_rows {

void check_cols(const at::Tensor& t, const char* name, int64_t rows, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows, name, " must have ", rows, " rows, got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

// The (layer, record) pairs: two [N] long tensors, every pair inside the [L, C] table.
std::pair<const int64_t*, const int64_t*> pairs(const at::Tensor& layers, const at::Tensor& recs, int64_t L,
                                                int64_t C) {
  TORCH_CHECK(layers.device().is_cpu() && recs.device().is_cpu() && layers.dim() == 1 && recs.dim() == 1 &&
                  layers.size(0) == recs.size(0) && layers.scalar_type() == at::kLong &&
                  recs.scalar_type() == at::kLong && layers.is_contiguous() && recs.is_contiguous(),
              "layers and recs must be contiguous CPU long tensors of one length");
  const int64_t *l = layers.data_ptr<int64_t>(), *r = recs.data_ptr<int64_t>();
  for (int64_t i = 0; i < layers.size(0); ++i)
    TORCH_CHECK(l[i] >= 0 && l[i] < L && r[i] >= 0 && r[i] < C, "page (", l[i], ", ", r[i], ") outside the [", L,
                ", ", C, "] table");
  return {l, r};
}

int64_t* used_of(at::Tensor& used, int64_t L, const char* name) {
  TORCH_CHECK(used.device().is_cpu() && used.dim() == 1 && used.size(0) == L && used.scalar_type() == at::kLong &&
                  used.is_contiguous(), name, " must be a contiguous CPU long tensor [", L, "]");
  return used.data_ptr<int64_t>();
}

// A pool's owner table and used counts, checked (`name`: the pool's, in errors; `used` null: a pool
// the move only reads, whose slots it neither takes nor gives back).
Pool slots_of(at::Tensor& owner, at::Tensor* used, int64_t L, const char* name) {
  check_cols(owner, (std::string(name) + " owner").c_str(), L, at::kLong);
  return {owner.data_ptr<int64_t>(), used ? used_of(*used, L, (std::string(name) + "_used").c_str()) : nullptr,
          owner.size(1), nullptr, nullptr, 0, std::vector<int64_t>(L, 0)};
}

// The device and host pools of a move: pages of one shape and dtype, in contiguous CPU tensors
// [L, S, ...] matching their owner tables (`host_used` null: the move only reads the host pool).
std::pair<Pool, Pool> device_and_host(at::Tensor& dev_k, at::Tensor& dev_v, at::Tensor& dev_owner,
                                      at::Tensor& dev_used, at::Tensor& host_k, at::Tensor& host_v,
                                      at::Tensor& host_owner, at::Tensor* host_used, int64_t L) {
  auto pages = [L](at::Tensor& k, at::Tensor& v, at::Tensor& owner, at::Tensor* used, const char* name) {
    Pool p = slots_of(owner, used, L, name);
    TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && k.is_contiguous() && v.is_contiguous() &&
                    k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() && k.dim() >= 2 &&
                    k.size(0) == owner.size(0) && k.size(1) == owner.size(1),
                name, " pool: k and v must be contiguous CPU tensors [L, S, ...] matching its owner table");
    const int64_t per_page = k.size(0) * k.size(1) ? k.numel() / (k.size(0) * k.size(1)) : 0;
    p.k = static_cast<char*>(k.data_ptr());
    p.v = static_cast<char*>(v.data_ptr());
    p.page_bytes = per_page * static_cast<int64_t>(k.element_size());
    return p;
  };
  Pool dev = pages(dev_k, dev_v, dev_owner, &dev_used, "device"), host = pages(host_k, host_v, host_owner, host_used,
                                                                               "host");
  TORCH_CHECK(dev_k.scalar_type() == host_k.scalar_type() && dev.page_bytes == host.page_bytes,
              "the device and host pools must hold pages of one shape and dtype");
  return {std::move(dev), std::move(host)};
}

at::Tensor result(int64_t a, int64_t b, int64_t c = 0) {
  auto out = at::zeros({4}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  o[0] = a;
  o[1] = b;
  o[2] = c;
  return out;
}

}  // namespace tier_rows

using namespace tier_rows;

at::Tensor evict_pages(at::Tensor layers, at::Tensor recs, at::Tensor device_slot, at::Tensor host_slot,
                       at::Tensor disk_slot, at::Tensor t1, at::Tensor prefetched, at::Tensor staged,
                       at::Tensor dev_k, at::Tensor dev_v, at::Tensor dev_owner, at::Tensor dev_used,
                       at::Tensor host_k, at::Tensor host_v, at::Tensor host_owner, at::Tensor host_used) {
  const int64_t L = device_slot.size(0), C = device_slot.dim() == 2 ? device_slot.size(1) : 0;
  for (auto [t, name] : {std::pair{&device_slot, "device_slot"}, {&host_slot, "host_slot"}, {&disk_slot, "disk_slot"}})
    check_cols(*t, name, L, at::kLong);
  for (auto [t, name] : {std::pair{&t1, "t1"}, {&prefetched, "prefetched"}, {&staged, "staged"}})
    check_cols(*t, name, L, at::kBool);
  for (auto* t : {&host_slot, &disk_slot, &t1, &prefetched, &staged})
    TORCH_CHECK(t->size(1) == C, "the page table's columns must all be [", L, ", ", C, "]");
  auto [dev, host] = device_and_host(dev_k, dev_v, dev_owner, dev_used, host_k, host_v, host_owner, &host_used, L);
  auto [lp, rp] = pairs(layers, recs, L, C);
  const int64_t N = layers.size(0);
  int64_t *ds = device_slot.data_ptr<int64_t>(), *hs = host_slot.data_ptr<int64_t>(),
          *dk = disk_slot.data_ptr<int64_t>();
  bool *t1p = t1.data_ptr<bool>(), *pf = prefetched.data_ptr<bool>(), *st = staged.data_ptr<bool>();
  std::vector<int64_t> dirty(L, 0);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t at_ = lp[i] * C + rp[i];
    TORCH_CHECK(ds[at_] >= 0 && ds[at_] < dev.slots, "page (", lp[i], ", ", rp[i], ") is not resident");
    dirty[lp[i]] += (hs[at_] < 0) & (dk[at_] < 0);
  }
  int64_t host_total = 0;
  if (!host.fits(dirty, &host_total)) return result(-1, host_total);
  int64_t counts[3] = {0, 0, 0};  // wasted, written, moved
  for (int64_t i = 0; i < N; ++i) evict_one(lp[i], rp[i], lp[i] * C + rp[i], ds, hs, dk, t1p, pf, st, dev, host, counts);
  return result(counts[0], counts[1], counts[2]);
}

at::Tensor admit_pages(at::Tensor layers, at::Tensor recs, c10::optional<at::Tensor> streamed, at::Tensor device_slot,
                       at::Tensor host_slot, at::Tensor warm_slot, at::Tensor dev_k, at::Tensor dev_v,
                       at::Tensor dev_owner, at::Tensor dev_used, at::Tensor host_k, at::Tensor host_v,
                       at::Tensor host_owner, c10::optional<at::Tensor> warm_owner,
                       c10::optional<at::Tensor> warm_used) {
  const int64_t L = device_slot.size(0), C = device_slot.dim() == 2 ? device_slot.size(1) : 0;
  for (auto [t, name] : {std::pair{&device_slot, "device_slot"}, {&host_slot, "host_slot"}, {&warm_slot, "warm_slot"}})
    check_cols(*t, name, L, at::kLong);
  TORCH_CHECK(host_slot.size(1) == C && warm_slot.size(1) == C, "the page table's columns must all be [", L, ", ",
              C, "]");
  auto [dev, host] = device_and_host(dev_k, dev_v, dev_owner, dev_used, host_k, host_v, host_owner, nullptr, L);
  auto [lp, rp] = pairs(layers, recs, L, C);
  const int64_t N = layers.size(0);
  const bool* sp = nullptr;
  if (streamed.has_value() && streamed->defined()) {
    TORCH_CHECK(streamed->device().is_cpu() && streamed->dim() == 1 && streamed->size(0) == N &&
                    streamed->scalar_type() == at::kBool && streamed->is_contiguous(),
                "streamed must be a contiguous CPU bool tensor [", N, "]");
    sp = streamed->data_ptr<bool>();
  }
  std::optional<Pool> warm;
  if (warm_owner.has_value() && warm_owner->defined()) {
    TORCH_CHECK(warm_used.has_value() && warm_used->defined(), "a warm owner table needs its warm_used counts");
    warm = slots_of(*warm_owner, &*warm_used, L, "warm");
  }
  int64_t *ds = device_slot.data_ptr<int64_t>(), *hs = host_slot.data_ptr<int64_t>(),
          *ws = warm_slot.data_ptr<int64_t>();
  std::vector<int64_t> need(L, 0);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t at_ = lp[i] * C + rp[i];
    TORCH_CHECK(ds[at_] < 0, "page (", lp[i], ", ", rp[i], ") is resident already");
    TORCH_CHECK(ws[at_] < 0 || (warm && ws[at_] < warm->slots), "page (", lp[i], ", ", rp[i],
                ") has a warm copy but no warm pool was given");
    if (hs[at_] < 0) return result(-2, 0);  // on disk: the torch path reads it
    ++need[lp[i]];
  }
  int64_t dev_total = 0;
  if (!dev.fits(need, &dev_total)) return result(-1, dev_total);
  int64_t counts[3] = {0, 0, 0};  // warm copies released, fresh, moved
  for (int64_t i = 0; i < N; ++i)
    admit_one(lp[i], rp[i], lp[i] * C + rp[i], sp && sp[i], ds, hs, ws, dev, host, warm ? &*warm : nullptr, counts);
  return result(counts[0], counts[1], counts[2]);
}

TORCH_LIBRARY_FRAGMENT(tieredkv_cpu, m) {
  m.def("evict_pages(Tensor layers, Tensor recs, Tensor(a!) device_slot, Tensor(b!) host_slot, Tensor disk_slot, "
        "Tensor(c!) t1, Tensor(d!) prefetched, Tensor(e!) staged, Tensor dev_k, Tensor dev_v, Tensor(f!) dev_owner, "
        "Tensor(g!) dev_used, Tensor(h!) host_k, Tensor(i!) host_v, Tensor(j!) host_owner, Tensor(k!) host_used) "
        "-> Tensor");
  m.def("admit_pages(Tensor layers, Tensor recs, Tensor? streamed, Tensor(a!) device_slot, Tensor host_slot, "
        "Tensor(b!) warm_slot, Tensor(c!) dev_k, Tensor(d!) dev_v, Tensor(e!) dev_owner, Tensor(f!) dev_used, "
        "Tensor host_k, Tensor host_v, Tensor host_owner, Tensor(g!)? warm_owner, Tensor(h!)? warm_used) -> Tensor");
}

TORCH_LIBRARY_IMPL(tieredkv_cpu, CPU, m) {
  m.impl("evict_pages", &evict_pages);
  m.impl("admit_pages", &admit_pages);
}
