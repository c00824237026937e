// Native twin of init.py's init_rows_torch: new keys' rows written straight into the store:
// per-key uniform embeddings (the bits of dynemb.hashing.init_bits, two uniforms from each
// 64-bit value as storage/initializers.py takes them, the same float32 operations in the same
// order, so the values are bitwise those of the plain-torch initializer) and the optimizer's
// constant initial state. n keys, D embedding columns, H = ceil(D / 2) hashed values per key,
// width = D + S.
#include <algorithm>
#include <cstdint>
#include <cstring>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "common.h"

using namespace dynemb;

// Rows written at least this many bytes in all (more than both cores' L2 caches hold, so they
// would leave them before being read) are streamed; a row at most this wide (floats).
static constexpr int64_t STREAM_BYTES = int64_t(4) << 20;
static constexpr int64_t MAX_STREAM_WIDTH = 1024;

#ifdef __SSE2__
static constexpr bool CAN_STREAM = true;
// Copy ``width`` floats to ``dest`` (4-byte aligned) with non-temporal stores: 16 bytes at a
// time where aligned, 4 at the ends.
static inline void stream_row(float* dest, const float* row, int64_t width) {
  int64_t j = 0;
  auto one = [&](int64_t k) {
    int bits;
    std::memcpy(&bits, row + k, 4);
    _mm_stream_si32(reinterpret_cast<int*>(dest + k), bits);
  };
  for (; j < width && reinterpret_cast<uintptr_t>(dest + j) % 16; ++j) one(j);
  for (; j + 4 <= width; j += 4) _mm_stream_ps(dest + j, _mm_loadu_ps(row + j));
  for (; j < width; ++j) one(j);
}
#else
static constexpr bool CAN_STREAM = false;
static inline void stream_row(float*, const float*, int64_t) {}
#endif

// The rows' places in ascending row order, in ``order`` [n] (``buffer`` [n] scratch): a row's
// values depend on its key only, and writing in address order took 7.1 against 11.0 ms for 18k
// fresh rows of 128 floats (2.8 against 6.6 ms for rows written before). Returns false (order
// unset) when the rows already ascend. New rows are usually one contiguous range (a table that
// has not evicted takes them from its high-water mark): then each goes straight to its place;
// else an LSD radix sort of (row - lowest) << 32 | place (rows spanning under 2^32, n < 2^32),
// or a comparison sort.
static bool row_order(const int64_t* rows, int64_t n, uint64_t* order, uint64_t* buffer) {
  int64_t lo = rows[0], hi = rows[0];
  bool ascending = true;
  for (int64_t i = 1; i < n; ++i) {
    ascending = ascending && rows[i] > rows[i - 1];
    lo = rows[i] < lo ? rows[i] : lo;
    hi = rows[i] > hi ? rows[i] : hi;
  }
  if (ascending) return false;
  const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
  if (span == static_cast<uint64_t>(n - 1)) {
    // Every place of the range filled once, unless rows repeat (against the contract): then the
    // sort below, which takes repeats too (the row is written twice, as it would be in turn).
    constexpr uint64_t UNSET = ~uint64_t(0);
    std::fill(order, order + n, UNSET);
    for (int64_t i = 0; i < n; ++i) order[rows[i] - lo] = static_cast<uint64_t>(i);
    if (std::find(order, order + n, UNSET) == order + n) return true;
  }
  if ((span >> 32) == 0 && (static_cast<uint64_t>(n) >> 32) == 0) {
    for (int64_t i = 0; i < n; ++i) order[i] = (static_cast<uint64_t>(rows[i] - lo) << 32) | static_cast<uint64_t>(i);
    radix_sort_bits(order, buffer, n, 0, 32, span);
    for (int64_t i = 0; i < n; ++i) order[i] &= 0xFFFFFFFFu;
    return true;
  }
  for (int64_t i = 0; i < n; ++i) order[i] = static_cast<uint64_t>(i);
  std::sort(order, order + n, [rows](uint64_t a, uint64_t b) { return rows[a] < rows[b]; });
  return true;
}

extern "C" DYN_AVX512_KERNEL int64_t dyn_init_rows(
    float* table,         // [R, width] the store's rows
    int64_t width,
    const int64_t* rows,  // [n] distinct row ids, any order
    const int64_t* keys,  // [n]
    int64_t n, int64_t D,
    int64_t salt,
    const int64_t* cols,  // [H] the odd per-column multipliers of init_bits
    double low_, double scale_, double state_value_,
    int64_t* scratch,     // [2n] the caller's buffer, for the rows' order
    int64_t nthreads) {
  if (n <= 0) return 0;
  uint64_t* order = reinterpret_cast<uint64_t*>(scratch);
  const bool ordered = row_order(rows, n, order, order + n);
  const int64_t H = (D + 1) / 2;
  const float low = static_cast<float>(low_), scale = static_cast<float>(scale_), state_value = static_cast<float>(state_value_);
  const float tiny = 5.9604644775390625e-08f;  // 2^-24, as _TINY
  const float top = 1.0f - tiny;
  // Many rows are written past the caches (non-temporal stores, no read of the lines first):
  // 3.4-3.7 against 4.8-5.1 ms for 23,000 rows of 128 floats at scattered row ids (3.5 against
  // 4.9 for rows of 129), read back after as fast (docs/perf-log.md, 2026-11-27 ninth session).
  const bool stream = CAN_STREAM && n * width * 4 >= STREAM_BYTES && width <= MAX_STREAM_WIDTH;
#pragma omp parallel num_threads(threads(nthreads, n, 512))
  {
#pragma omp for schedule(static) nowait
    for (int64_t at = 0; at < n; ++at) {
      const int64_t i = ordered ? static_cast<int64_t>(order[at]) : at;
      alignas(16) float buffer[MAX_STREAM_WIDTH];
      float* const dest = table + rows[i] * width;
      float* row = stream ? buffer : dest;
      const uint64_t base = mix64(static_cast<uint64_t>(keys[i] ^ salt));
      for (int64_t c = 0; c < H; ++c) {
        const uint64_t bits = base * static_cast<uint64_t>(cols[c]);
        float u1 = static_cast<float>(static_cast<int64_t>(bits)) * 5.421010862427522e-20f + 0.5f;  // * 2^-64
        float u2 = static_cast<float>(static_cast<int64_t>(bits << 24)) * 5.421010862427522e-20f + 0.5f;
        u1 = std::min(std::max(u1, tiny), top);
        u2 = std::min(std::max(u2, 0.0f), top);
        row[c] = u1 * scale + low;
        if (H + c < D) row[H + c] = u2 * scale + low;
      }
      for (int64_t j = D; j < width; ++j) row[j] = state_value;
      if (stream) stream_row(dest, buffer, width);
    }
#ifdef __SSE2__
    // Each thread orders its own non-temporal stores before the region ends (not relying on
    // whatever instruction the runtime's barrier uses).
    if (stream) _mm_sfence();
#endif
  }
  return 0;
}
