// Native twin of locate.py's locate_torch: the flat slot of each key in the bucketed index.
// N keys, B buckets, W slots per bucket.
#include "common.h"

using namespace dynemb;

// Candidates are computed a block at a time; while key i is probed, the buckets of key
// i + AHEAD are prefetched (a window the core's outstanding misses can serve).
static constexpr int64_t BLOCK = 256;
static constexpr int64_t AHEAD = 8;

static inline void prefetch_bucket(const int64_t* table_keys, const bool* used, const void* table_rows, int64_t row_bytes, int64_t b, int64_t W) {
  const char* k = reinterpret_cast<const char*>(table_keys + b * W);
  for (int64_t off = 0; off < W * 8; off += 64) __builtin_prefetch(k + off);
  __builtin_prefetch(used + b * W);
  if (table_rows) __builtin_prefetch(static_cast<const char*>(table_rows) + b * W * row_bytes);
}

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
    const int64_t lo = blk * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n, len = hi - lo;
    int64_t b1[BLOCK], b2[BLOCK];
    for (int64_t i = 0; i < len; ++i) cand.of(keys[lo + i], lo + i, &b1[i], &b2[i]);
    for (int64_t i = 0; i < AHEAD && i < len; ++i) {
      prefetch_bucket(table_keys, used, table_rows, row_bytes, b1[i], W);
      prefetch_bucket(table_keys, used, table_rows, row_bytes, b2[i], W);
    }
    for (int64_t i = 0; i < len; ++i) {
      if (i + AHEAD < len) {
        prefetch_bucket(table_keys, used, table_rows, row_bytes, b1[i + AHEAD], W);
        prefetch_bucket(table_keys, used, table_rows, row_bytes, b2[i + AHEAD], W);
      }
      const int64_t k = keys[lo + i];
      int64_t at = -1;
      for (int c = 0; c < 2 && at < 0; ++c) {
        const int64_t base = (c == 0 ? b1[i] : b2[i]) * W;
        for (int64_t j = 0; j < W; ++j) {
          if (table_keys[base + j] == k && used[base + j]) {
            at = base + j;
            break;
          }
        }
      }
      pos[lo + i] = at;
      found[lo + i] = at >= 0;
      if (rows_out) {
        int64_t r = -1;
        if (at >= 0) r = row_bytes == 4 ? static_cast<const int32_t*>(table_rows)[at] : static_cast<const int64_t*>(table_rows)[at];
        rows_out[lo + i] = r;
      }
    }
  }
  return 0;
}

// The two candidate buckets of each key (global bucket ids), as Segments.candidates gives them.
extern "C" int64_t dyn_candidates(
    const int64_t* keys, const int64_t* seg, const int64_t* seg_counts, const int64_t* seg_offsets, int64_t total_buckets,
    int64_t n, int64_t* b1, int64_t* b2, int64_t nthreads) {
  Candidates cand{seg, seg_counts, seg_offsets, total_buckets};
#pragma omp parallel for schedule(static) num_threads(threads(nthreads, n, 16384))
  for (int64_t i = 0; i < n; ++i) cand.of(keys[i], i, &b1[i], &b2[i]);
  return 0;
}
