// The model's linear layers for a few rows (decode at a small batch), for the CPU.
//
// y [R, sum N_i] = x [R, K] times the weights' rows, w_i [N_i, K] (nn.Linear's row-major layout,
// read where they are: projections that read the same input give one output, their columns side
// by side, as models/cpu_linear.py's joint GEMM). At one to four rows a decode step's GEMMs are
// matrix-vector products bound by reading the weights; oneDNN's packed GEMM reads them at
// ~17-19 GB/s on this project's CPU where a plain stream of the row-major weights runs faster
// (docs/benchmarks.md §12, "Sixteenth pass"). Each output is one weight row's dot product with one
// input row, accumulated over K in 16-float blocks and summed once: the same value whatever the
// other rows, the thread count or the batch.
//
// Float32. Built with the decode-attention op (models/cpu_attention.py); with AVX-512 (and K a
// multiple of 16) the loops below, otherwise loops the compiler vectorizes.
//
// panel_linear: the same product for more rows (decode at a larger batch), from the weights packed
// once into panels of 16 output columns, [ceil(N / 16), K, 16] (models/cpu_linear.py packs them):
// eight input rows times three panels of accumulators (24 of AVX-512's 32 registers), each weight
// vector loaded once per eight rows and each input element broadcast once per three panels, the
// panels' weights streamed from memory once and read again from L2 for the next eight rows. Each
// output sums K in blocks of 64 (each block in order in one lane, the blocks' sums added in order:
// rounding as a blocked GEMM's, not a 576-term chain's), the same value whatever the other rows.
// AVX-512 only (panel_linear_native() says whether it was built so; without it the caller keeps
// oneDNN).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kRowsMax = 4;  // input rows this op takes
constexpr int64_t kUnit = 64;    // weight rows per unit of parallel work

// out[r * ldo + n] for weight rows [n0, n0 + nr) of w (row stride K) against R input rows. One
// weight row at a time, read as one stream: four accumulators per input row over K's 64-float
// blocks (a 16-float remainder into the first), summed (0 + 1) + (2 + 3), then across lanes.
template <int R>
void rows_dot(const float* x, const float* w, int64_t K, int64_t n0, int64_t nr, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  if (K % 16 == 0) {
    for (int64_t n = n0; n < n0 + nr; ++n) {
      const float* wr = w + n * K;
      __m512 acc[4][R];
      for (int j = 0; j < 4; ++j)
        for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 64 <= K; k += 64)
        for (int j = 0; j < 4; ++j) {
          const __m512 wv = _mm512_loadu_ps(wr + k + 16 * j);
          for (int r = 0; r < R; ++r) acc[j][r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * K + k + 16 * j), acc[j][r]);
        }
      for (; k < K; k += 16) {
        const __m512 wv = _mm512_loadu_ps(wr + k);
        for (int r = 0; r < R; ++r) acc[0][r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * K + k), acc[0][r]);
      }
      for (int r = 0; r < R; ++r)
        out[r * ldo + n] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]), _mm512_add_ps(acc[2][r], acc[3][r])));
    }
    return;
  }
#endif
  for (int64_t n = n0; n < n0 + nr; ++n)
    for (int r = 0; r < R; ++r) {
      float lanes[16] = {0.f};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += w[n * K + k + l] * x[r * K + k + l];
      float dot = 0.f;
      for (int l = 0; l < 16; ++l) dot += lanes[l];
      for (; k < K; ++k) dot += w[n * K + k] * x[r * K + k];
      out[r * ldo + n] = dot;
    }
}

using RowsDot = void (*)(const float*, const float*, int64_t, int64_t, int64_t, float*, int64_t);

RowsDot pick(int64_t R) {
  switch (R) {
    case 1: return rows_dot<1>;
    case 2: return rows_dot<2>;
    case 3: return rows_dot<3>;
    default: return rows_dot<4>;
  }
}

#if defined(__AVX512F__)
constexpr int kPanel = 16;      // output columns per panel
constexpr int kPanelRows = 8;   // input rows per micro-kernel call
constexpr int64_t kGroup = 3;   // panels per micro-kernel call (and per unit of parallel work)
constexpr int64_t kBlock = 64;  // K summed in blocks of this many, the blocks' sums added in order

// y[r * ldy + n] for R input rows x [R, K] and P panels from panel p0 of `wp` ([NB, K, 16]); n < N.
template <int R, int P>
void panel_kernel(const float* x, int64_t K, const float* wp, int64_t p0, float* y, int64_t ldy, int64_t N) {
  __m512 acc[R][P], total[R][P];  // (total: in memory, added to once per block of K)
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) total[r][p] = _mm512_setzero_ps();
  const float* w[P];
  for (int p = 0; p < P; ++p) w[p] = wp + (p0 + p) * K * kPanel;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    const int64_t k1 = std::min(K, k0 + kBlock);
    for (int64_t k = k0; k < k1; ++k) {
      __m512 wv[P];
      for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_ps(w[p] + k * kPanel);
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * K + k]);
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xb, wv[p], acc[r][p]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) total[r][p] = _mm512_add_ps(total[r][p], acc[r][p]);
  }
  for (int p = 0; p < P; ++p) {
    const int64_t n0 = (p0 + p) * kPanel, left = N - n0;
    const __mmask16 m = left >= kPanel ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, m, total[r][p]);
  }
}

// The last rows (fewer than kPanelRows): the kernel for exactly `left` of them.
template <int P, int R>
void panel_tail(int64_t left, const float* x, int64_t K, const float* wp, int64_t p0, float* y, int64_t ldy,
                int64_t N) {
  if constexpr (R > 0) {
    if (left == R) return panel_kernel<R, P>(x, K, wp, p0, y, ldy, N);
    panel_tail<P, R - 1>(left, x, K, wp, p0, y, ldy, N);
  }
}

// Every row of x [M, K] against P panels from p0: eight rows at a time, then the rest.
template <int P>
void panel_rows(int64_t M, const float* x, int64_t K, const float* wp, int64_t p0, float* y, int64_t N) {
  int64_t r = 0;
  for (; r + kPanelRows <= M; r += kPanelRows) panel_kernel<kPanelRows, P>(x + r * K, K, wp, p0, y + r * N, N, N);
  if (r < M) panel_tail<P, kPanelRows - 1>(M - r, x + r * K, K, wp, p0, y + r * N, N, N);
}
#endif
}  // namespace

// x [R, K] float32 contiguous, R in [1, 4]; weights: [N_i, K] float32 contiguous. Returns
// [R, sum N_i]: weight i's outputs in columns [sum_{j<i} N_j, sum_{j<=i} N_j).
at::Tensor small_linear(at::Tensor x, at::TensorList weights) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous [R, K] float32 CPU tensor");
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(R >= 1 && R <= kRowsMax, "x must have 1 to ", kRowsMax, " rows, got ", R);
  TORCH_CHECK(!weights.empty(), "at least one weight");
  std::vector<int64_t> first{0};  // each weight's first output column, then the total
  for (const auto& w : weights) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous(),
                "weights must be contiguous [N, K] float32 CPU tensors");
    TORCH_CHECK(w.size(1) == K, "a weight has ", w.size(1), " columns where x has ", K);
    first.push_back(first.back() + w.size(0));
  }
  const int64_t N = first.back();
  auto out = at::empty({R, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<const float*> wp;
  std::vector<int64_t> units{0};  // each weight's first unit of work (kUnit rows), then the total
  for (size_t i = 0; i < weights.size(); ++i) {
    wp.push_back(weights[i].data_ptr<float>());
    const int64_t rows = first[i + 1] - first[i];
    units.push_back(units.back() + (rows + kUnit - 1) / kUnit);
  }
  const RowsDot dot = pick(R);
  at::parallel_for(0, units.back(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const size_t i = std::upper_bound(units.begin(), units.end(), u) - units.begin() - 1;
      const int64_t rows = first[i + 1] - first[i], n0 = (u - units[i]) * kUnit;
      dot(xp, wp[i], K, n0, std::min(kUnit, rows - n0), op + first[i], N);
    }
  });
  return out;
}

// x [M, K] float32 contiguous; packed [NB, K, 16] float32 contiguous (the weights' rows n in panel
// n / 16, lane n % 16; the last panel's missing rows zero); N: the weights' rows (NB = ceil(N / 16)).
// Returns [M, N].
at::Tensor panel_linear(at::Tensor x, at::Tensor packed, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous [M, K] float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kFloat && packed.dim() == 3 &&
                  packed.is_contiguous() && packed.size(1) == K && packed.size(2) == 16,
              "packed must be a contiguous [ceil(N / 16), ", K, ", 16] float32 CPU tensor, got ", packed.sizes());
  const int64_t NB = packed.size(0);
  TORCH_CHECK(N > (NB - 1) * 16 && N <= NB * 16, "N = ", N, " does not fit ", NB, " panels of 16");
  auto y = at::empty({M, N}, x.options());
#if defined(__AVX512F__)
  const float *xp = x.data_ptr<float>(), *wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = (NB + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t p0 = g * kGroup, np = std::min(kGroup, NB - p0);
      if (np == 3) panel_rows<3>(M, xp, K, wp, p0, yp, N);
      else if (np == 2) panel_rows<2>(M, xp, K, wp, p0, yp, N);
      else panel_rows<1>(M, xp, K, wp, p0, yp, N);
    }
  });
#else
  TORCH_CHECK(false, "panel_linear was built without AVX-512 (panel_linear_native() is false)");
#endif
  return y;
}

bool panel_linear_native() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(tieredkv_cpu, m) {
  m.def("small_linear(Tensor x, Tensor[] weights) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("panel_linear_native() -> bool", &panel_linear_native);
}

TORCH_LIBRARY_IMPL(tieredkv_cpu, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("panel_linear", &panel_linear);
}
