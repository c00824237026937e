// Native twin of update.py's update_rows_torch: one optimizer step on float32 rows of the store
// in place, by row id, with the gradient summed per key; rows whose gradient or update is not
// finite are left unchanged and flagged (nonfinite_grads="skip"). U rows, D embedding columns,
// S state columns, width = D + S. The arithmetic follows dynemb/optim/optimizers.py op by op
// in float32 (the row-wise mean's sum runs in a fixed order of its own, sum_of_squares, so it
// may differ from torch's in the last bits).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"

using namespace dynemb;

static constexpr int64_t AHEAD = 4;

enum Kind : int64_t { SGD = 0, ADAGRAD = 1, ROWWISE_ADAGRAD = 2, ADAM = 3 };

// Whether n floats are all finite: an OR over their exponent bits (all ones only for inf and
// NaN), which vectorises where a std::isfinite loop does not.
static inline bool all_finite(const float* x, int64_t n) {
  uint32_t bad = 0;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t bits;
    std::memcpy(&bits, x + j, sizeof bits);
    bad |= static_cast<uint32_t>((bits & 0x7F800000u) == 0x7F800000u);
  }
  return bad == 0;
}

// The sum of x[j]^2 over n floats in one fixed order on every CPU: LANES running sums (lane k
// takes j = k, k + LANES, ... while a whole group of LANES remains), combined pairwise, then
// the tail in turn. The lanes vectorise (SSE2 or AVX2 alike: the same adds in the same order)
// where one running sum is a chain of dependent adds: row-wise Adagrad on W3's rows took
// 12% of a step on that chain (docs/perf-log.md, 2026-11-27 ninth session).
static constexpr int64_t LANES = 8;
static inline float sum_of_squares(const float* x, int64_t n) {
  float lane[LANES] = {};
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int64_t k = 0; k < LANES; ++k) lane[k] += x[j + k] * x[j + k];
  float sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; j < n; ++j) sum += x[j] * x[j];
  return sum;
}

// The optimizer's constants of one step (see dyn_rows_update's arguments).
struct Step {
  int64_t kind;
  float lr, wd, eps, a, b, c;
};

// One row's step in place from its summed gradient ``gu`` [D] (``g`` [D] and ``out`` [width]
// scratch): returns false, the row unchanged, where ``check`` finds the gradient or the result
// not finite. Inlined into each kernel's clone (the same arithmetic in both kernels).
static inline __attribute__((always_inline)) bool step_row(float* row, const float* gu, float* g, float* out, int64_t D, int64_t width, const Step& st,
                                                           bool check) {
  const float lr = st.lr, wd = st.wd, eps = st.eps, a = st.a, b = st.b, c = st.c;
  for (int64_t j = 0; j < D; ++j) g[j] = wd != 0.0f ? gu[j] + wd * row[j] : gu[j];
  bool finite = !check || all_finite(gu, D);
  switch (st.kind) {
    case SGD:
      for (int64_t j = 0; j < D; ++j) out[j] = row[j] + (-lr) * g[j];
      break;
    case ADAGRAD: {
      for (int64_t j = 0; j < D; ++j) {
        const float s = row[D + j] + g[j] * g[j];
        out[D + j] = s;
        out[j] = row[j] + (-a) * (g[j] / (std::sqrt(s) + eps));
      }
      break;
    }
    case ROWWISE_ADAGRAD: {
      const float s = row[D] + sum_of_squares(g, D) / static_cast<float>(D);
      out[D] = s;
      const float denom = std::sqrt(s) + eps;
      for (int64_t j = 0; j < D; ++j) out[j] = row[j] + (-lr) * (g[j] / denom);
      break;
    }
    case ADAM: {
      for (int64_t j = 0; j < D; ++j) {
        const float m0 = row[D + j], v0 = row[2 * D + j];
        const float m = m0 + a * (g[j] - m0);
        const float v = v0 + (g[j] * g[j] - v0) * b;
        out[D + j] = m;
        out[2 * D + j] = v;
        out[j] = row[j] + (-c) * (m / (std::sqrt(v) + eps));
      }
      break;
    }
  }
  if (check && !(finite && all_finite(out, width))) return false;
  for (int64_t j = 0; j < width; ++j) row[j] = out[j];
  return true;
}

static Step step_of(int64_t kind, double lr, double weight_decay, double eps, double a, double b, double c) {
  return {kind, static_cast<float>(lr), static_cast<float>(weight_decay), static_cast<float>(eps), static_cast<float>(a), static_cast<float>(b),
          static_cast<float>(c)};
}

extern "C" DYN_FLOAT_KERNEL int64_t dyn_rows_update(
    float* table,        // [R, width] the store's rows
    int64_t width,
    const int64_t* rows, // [U] row ids, distinct, each in [0, R)
    const float* grad,   // [U, D] rows of grad_stride floats
    int64_t grad_stride,
    int64_t n, int64_t D, int64_t kind,
    double lr_, double weight_decay_, double eps_,
    double a_, double b_, double c_,  // Adagrad: a = the decayed lr; Adam: a, b = 1 - beta1, 1 - beta2, c = step size
    bool* bad,           // [U] out, or null: apply whatever comes (nonfinite_grads="apply")
    int64_t nthreads) {
  const Step st = step_of(kind, lr_, weight_decay_, eps_, a_, b_, c_);
  int64_t n_bad = 0;
#pragma omp parallel num_threads(threads(nthreads, n, 256)) reduction(+ : n_bad)
  {
    std::vector<float> g(D), out(width);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < n; ++u) {
      // The rows lie anywhere in the store: fetch a few rows ahead while this one is updated.
      if (u + AHEAD < n) {
        const char* next = reinterpret_cast<const char*>(table + rows[u + AHEAD] * width);
        for (int64_t off = 0; off < width * 4; off += 64) __builtin_prefetch(next + off, 1);
      }
      const bool ok = step_row(table + rows[u] * width, grad + u * grad_stride, g.data(), out.data(), D, width, st, bad != nullptr);
      if (bad) {
        bad[u] = !ok;
        n_bad += !ok;
      }
    }
  }
  return n_bad;
}

// dyn_rows_update with each row's gradient summed from a bag collection's concat gradient as
// pool.cpp's dyn_sum_bags sums it (common.h's sum_slices), in the same pass: no [U, D] gradient
// is written and read back (docs/design/0017). Bitwise dyn_sum_bags, then dyn_rows_update.

extern "C" DYN_FLOAT_KERNEL int64_t dyn_rows_update_bags(
    float* table,              // [R, width] the store's rows
    int64_t width,
    const int64_t* rows,       // [U] row ids, distinct, each in [0, R)
    const float* grad,         // the concat gradient as unit rows [B * K, u]
    int64_t unit,              // u: floats per unit row
    const int64_t* first_row,  // [N] the unit row where id n's D floats begin
    const int64_t* order,      // [N] the ids grouped by unique row
    const int64_t* starts,     // [U] where row u's ids begin in order (ids up to the next start, or N)
    int64_t n, int64_t N, int64_t D, int64_t kind,
    double lr_, double weight_decay_, double eps_, double a_, double b_, double c_,
    bool* bad,                 // [U] out, or null
    int64_t nthreads) {
  const Step st = step_of(kind, lr_, weight_decay_, eps_, a_, b_, c_);
  int64_t n_bad = 0;
  // Threads by the ids to sum (as dyn_sum_bags) or by the rows to update (as dyn_rows_update),
  // whichever gives more: a batch of few ids and many rows still updates on every thread.
  const int nt = std::max(threads(nthreads, N, 8192), threads(nthreads, n, 256));
#pragma omp parallel num_threads(nt) reduction(+ : n_bad)
  {
    std::vector<float> sum(D), g(D), out(width);
    // Dynamic chunks, as dyn_sum_bags: a hot key's row has many ids.
#pragma omp for schedule(dynamic, 256)
    for (int64_t u = 0; u < n; ++u) {
      // The rows lie anywhere in the store: fetch a few rows ahead while this one is summed.
      if (u + AHEAD < n) {
        const char* next = reinterpret_cast<const char*>(table + rows[u + AHEAD] * width);
        for (int64_t off = 0; off < width * 4; off += 64) __builtin_prefetch(next + off, 1);
      }
      sum_slices(sum.data(), grad, unit, first_row, order, starts[u], u + 1 < n ? starts[u + 1] : N, N, D);
      const bool ok = step_row(table + rows[u] * width, sum.data(), g.data(), out.data(), D, width, st, bad != nullptr);
      if (bad) {
        bad[u] = !ok;
        n_bad += !ok;
      }
    }
  }
  return n_bad;
}
