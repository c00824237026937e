// Native twin of init.py's init_rows_torch: new keys' rows written straight into the store:
// per-key uniform embeddings (the bits of dynemb.hashing.init_bits, two uniforms from each
// 64-bit value as storage/initializers.py takes them, the same float32 operations in the same
// order, so the values are bitwise those of the plain-torch initializer) and the optimizer's
// constant initial state. n keys, D embedding columns, H = ceil(D / 2) hashed values per key,
// width = D + S.
#include <algorithm>

#include "common.h"

using namespace dynemb;

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
#pragma omp parallel for schedule(static) num_threads(threads(nthreads, n, 512))
  for (int64_t i = 0; i < n; ++i) {
    float* row = table + rows[i] * width;
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
  }
  return 0;
}
