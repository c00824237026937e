// Native twin of locate.py's locate_torch: the flat slot of each key in the bucketed index.
// N keys, B buckets, W slots per bucket.
#include "common.h"

using namespace dynemb;

// Keys probed together: their buckets are prefetched first, so the memory reads overlap.
static constexpr int64_t BLOCK = 32;

extern "C" int64_t dyn_locate(
    const int64_t* table_keys,  // [B, W]
    const bool* used,           // [B, W]
    int64_t W, int64_t total_buckets,
    const int64_t* keys,        // [N]
    const int64_t* seg, const int64_t* seg_counts, const int64_t* seg_offsets,
    int64_t n,
    int64_t* pos,               // [N] out: flat slot, -1 where absent
    bool* found,                // [N] out
    const void* table_rows,     // [B, W] row ids (int32 or int64), or null
    int64_t row_bytes,          // 4 or 8
    int64_t* rows_out,          // [N] out: row id, -1 where absent (with table_rows)
    int64_t nthreads) {
  Candidates cand{seg, seg_counts, seg_offsets, total_buckets};
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads(nthreads, n, 4096))
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t lo = blk * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
    int64_t b[2 * BLOCK];
    for (int64_t i = lo; i < hi; ++i) {
      int64_t* bb = b + 2 * (i - lo);
      cand.of(keys[i], i, bb, bb + 1);
      __builtin_prefetch(table_keys + bb[0] * W);
      __builtin_prefetch(table_keys + bb[0] * W + W - 1);
      __builtin_prefetch(used + bb[0] * W);
      __builtin_prefetch(table_keys + bb[1] * W);
      __builtin_prefetch(table_keys + bb[1] * W + W - 1);
      __builtin_prefetch(used + bb[1] * W);
    }
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t k = keys[i];
      int64_t at = -1;
      for (int c = 0; c < 2 && at < 0; ++c) {
        const int64_t base = b[2 * (i - lo) + c] * W;
        for (int64_t j = 0; j < W; ++j) {
          if (table_keys[base + j] == k && used[base + j]) {
            at = base + j;
            break;
          }
        }
      }
      pos[i] = at;
      found[i] = at >= 0;
      if (rows_out) {
        int64_t r = -1;
        if (at >= 0) r = row_bytes == 4 ? static_cast<const int32_t*>(table_rows)[at] : static_cast<const int64_t*>(table_rows)[at];
        rows_out[i] = r;
      }
    }
  }
  return 0;
}
