// Native twin of pool.py's copy_bags_torch: a bag collection's single-hot outputs copied
// straight from each group's unique rows into their columns of the concat. F features (every
// group's), B samples; sizes in bytes (the copy is dtype-agnostic).
#include <cstring>

#include "common.h"

using namespace dynemb;

static constexpr int64_t AHEAD = 4;

// memcpy with the usual row sizes known at compile time (inlined moves instead of a libc call
// per row: ~100k rows a W3 batch).
static inline void copy_row(char* dst, const char* src, int64_t n) {
  switch (n) {
    case 32: std::memcpy(dst, src, 32); break;
    case 64: std::memcpy(dst, src, 64); break;
    case 128: std::memcpy(dst, src, 128); break;
    case 256: std::memcpy(dst, src, 256); break;
    case 512: std::memcpy(dst, src, 512); break;
    default: std::memcpy(dst, src, n);
  }
}

extern "C" DYN_AVX512_KERNEL int64_t dyn_copy_bags(
    char* out, int64_t out_stride,  // [B, *] the concat: row b at out + b * out_stride
    int64_t F, int64_t B,
    const int64_t* cols,            // [F] byte offset of feature f's columns in a concat row
    const int64_t* srcs,            // [F] address of feature f's group rows [U_g, *]
    const int64_t* src_strides,     // [F] bytes from one of those rows to the next
    const int64_t* invs,            // [F] address of feature f's [B] int64 unique row of each sample
    const int64_t* row_bytes,       // [F] bytes copied for feature f: D_f * element size
    int64_t nthreads) {
  // Sample-major, features in the order given (the caller passes them by column): a thread
  // writes whole concat rows front to back, one pass over the output.
#pragma omp parallel for schedule(static) num_threads(threads(nthreads, F * B, 8192))
  for (int64_t b = 0; b < B; ++b) {
    char* row = out + b * out_stride;
    for (int64_t f = 0; f < F; ++f) {
      const int64_t* inv = reinterpret_cast<const int64_t*>(invs[f]);
      const char* src = reinterpret_cast<const char*>(srcs[f]);
      if (b + AHEAD < B) __builtin_prefetch(src + inv[b + AHEAD] * src_strides[f]);
      copy_row(row + cols[f], src + inv[b] * src_strides[f], row_bytes[f]);
    }
  }
  return 0;
}

// Native twin of pool.py's sum_bags_torch: each unique row's gradient, the sum of the D-float
// slices of the concat gradient its ids point at, added in the ids' order (the order
// embedding_bag's sum takes). U unique rows, N ids, float32.
extern "C" DYN_FLOAT_KERNEL int64_t dyn_sum_bags(
    const float* grad,         // the concat gradient as unit rows [B * K, u]
    int64_t unit,              // u: floats per unit row
    const int64_t* first_row,  // [N] the unit row where id n's D floats begin
    const int64_t* order,      // [N] the ids grouped by unique row
    const int64_t* starts,     // [U] where unique row i's ids begin in order (ids up to the next start, or N)
    int64_t U, int64_t N, int64_t D,
    float* out,                // [U, D] contiguous
    int64_t nthreads) {
  // Dynamic chunks: a hot key's row has many ids. Each row is summed by one thread, in order.
#pragma omp parallel for schedule(dynamic, 256) num_threads(threads(nthreads, N, 8192))
  for (int64_t i = 0; i < U; ++i) sum_slices(out + i * D, grad, unit, first_row, order, starts[i], i + 1 < U ? starts[i + 1] : N, N, D);
  return 0;
}
