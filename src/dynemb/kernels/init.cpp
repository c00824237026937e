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

extern "C" int64_t dyn_init_rows(
    float* table,         // [R, width] the store's rows
    int64_t width,
    const int64_t* rows,  // [n] distinct row ids
    const int64_t* keys,  // [n]
    int64_t n, int64_t D,
    int64_t salt,
    const int64_t* cols,  // [H] the odd per-column multipliers of init_bits
    double low_, double scale_, double state_value_,
    int64_t nthreads) {
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
    for (int64_t i = 0; i < n; ++i) {
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
