// Native twin of pool.py's copy_bags_torch: a bag collection's single-hot outputs copied
// straight from each group's unique rows into their columns of the concat. F features of the
// group, B samples, U unique rows; sizes in bytes (the copy is dtype-agnostic).
#include <cstring>

#include "common.h"

using namespace dynemb;

static constexpr int64_t AHEAD = 8;

extern "C" int64_t dyn_copy_bags(
    char* out, int64_t out_stride,    // [B, *] the concat: row b at out + b * out_stride
    const int64_t* cols,              // [F] byte offset of feature j's columns in a concat row
    int64_t F, int64_t B,
    const char* src, int64_t src_stride,  // [U, *] the group's unique rows
    const int64_t* inv,               // [F * B] unique row of (feature j, sample b) at j * B + b
    int64_t row_bytes,                // bytes copied per (feature, sample): D * element size
    int64_t nthreads) {
  // Sample-major: a thread writes whole concat rows, each feature's columns in turn.
#pragma omp parallel for schedule(static) num_threads(threads(nthreads, F * B, 8192))
  for (int64_t b = 0; b < B; ++b) {
    if (b + AHEAD < B)
      for (int64_t j = 0; j < F; ++j) __builtin_prefetch(src + inv[j * B + b + AHEAD] * src_stride);
    char* row = out + b * out_stride;
    for (int64_t j = 0; j < F; ++j) std::memcpy(row + cols[j], src + inv[j * B + b] * src_stride, row_bytes);
  }
  return 0;
}
