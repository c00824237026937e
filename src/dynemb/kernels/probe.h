// The probe of upsert.cpp (locate.cpp's dyn_locate is the same loop, with the row ids read in
// it): the slot of each key of a block, the first
// used match among its first candidate bucket's W slots, then its second's. While key i is
// compared, the lines of key i + PROBE_AHEAD's two buckets are prefetched (keys, used flags and
// optionally a third table's entries), a window the core's outstanding misses can serve.
//
// Negative result (perf-log 2026-11-26): a software pipeline that fetched the second bucket
// only for keys absent from the first, and the used flags only of matching slots (about half
// the lines), was ~10% slower with two threads on W2: the extra dependent round trips cost
// more than the bandwidth saved.
#pragma once
#include <cstdint>

#include "common.h"

namespace dynemb {

static constexpr int64_t PROBE_AHEAD = 8;
// Keys per block: their candidates live on the stack.
static constexpr int64_t PROBE_BLOCK = 256;

__attribute__((always_inline)) inline void prefetch_bucket(const int64_t* table_keys, const bool* used, const char* also, int64_t also_bytes,
                                                           int64_t base, int64_t W) {
  const char* k = reinterpret_cast<const char*>(table_keys + base);
  for (int64_t off = 0; off < W * 8; off += 64) __builtin_prefetch(k + off);
  __builtin_prefetch(used + base);
  if (also) __builtin_prefetch(also + base * also_bytes);
}

// at[i]: the flat slot of keys[i] for i in [0, len) (len <= PROBE_BLOCK), -1 where absent;
// key i of the block is key ``first + i`` of the call (for its segment). ``also`` (or null):
// a [B, W] table of ``also_bytes`` per slot (row ids, scores) whose entries the caller reads or
// writes at the found slots next: prefetched with the buckets.
inline void probe_block(const int64_t* table_keys, const bool* used, int64_t W, const Candidates& cand, const int64_t* keys, int64_t first,
                        int64_t len, int64_t* at, const char* also = nullptr, int64_t also_bytes = 0) {
  int64_t b1[PROBE_BLOCK], b2[PROBE_BLOCK];
  for (int64_t i = 0; i < len; ++i) {
    cand.of(keys[i], first + i, &b1[i], &b2[i]);
    b1[i] *= W;
    b2[i] *= W;
  }
  for (int64_t i = 0; i < PROBE_AHEAD && i < len; ++i) {
    prefetch_bucket(table_keys, used, also, also_bytes, b1[i], W);
    prefetch_bucket(table_keys, used, also, also_bytes, b2[i], W);
  }
  for (int64_t i = 0; i < len; ++i) {
    if (i + PROBE_AHEAD < len) {
      prefetch_bucket(table_keys, used, also, also_bytes, b1[i + PROBE_AHEAD], W);
      prefetch_bucket(table_keys, used, also, also_bytes, b2[i + PROBE_AHEAD], W);
    }
    const int64_t k = keys[i];
    int64_t s = -1;
    for (int c = 0; c < 2 && s < 0; ++c) {
      const int64_t base = c == 0 ? b1[i] : b2[i];
      for (int64_t j = 0; j < W; ++j) {
        if (table_keys[base + j] == k && used[base + j]) {
          s = base + j;
          break;
        }
      }
    }
    at[i] = s;
  }
}

}  // namespace dynemb
