// Native twin of locate.py's locate_torch: the flat slot of each key in the bucketed index.
// N keys, B buckets, W slots per bucket.
#include "common.h"

using namespace dynemb;

// Candidates are computed a block at a time, then a three-stage pipeline runs over the block:
// the tag lines of key i + 2 * AHEAD's two buckets are requested; key i + AHEAD's first slot with
// its tag is found and that slot's key and row id lines requested; key i is compared. About 4
// lines a key (2 tag lines, 1 key line, 1 row line) against 8 when every key line and used flag
// of both buckets was read: 2x on a cold 4M-slot index (docs/design/0039).
static constexpr int64_t BLOCK = 256;
static constexpr int64_t AHEAD = 12;

extern "C" int64_t dyn_locate(
    const int64_t* table_keys,  // [B, W]
    const uint8_t* tags,        // [B, W] 0 where empty, else the slot's key's tag
    int64_t W, int64_t total_buckets,
    const int64_t* keys,        // [N]
    const int64_t* seg, const int64_t* seg_counts, const int64_t* seg_offsets,
    int64_t n,
    int64_t* pos,               // [N] out: flat slot, -1 where absent (or null: not wanted)
    bool* found,                // [N] out
    const void* table_rows,     // [B, W] row ids (int32 or int64), or null
    int64_t row_bytes,          // 4 or 8
    int64_t* rows_out,          // [N] out: row id, -1 where absent (with table_rows)
    int64_t nthreads) {
  Candidates cand{seg, seg_counts, seg_offsets, total_buckets};
  const char* rows_base = static_cast<const char*>(table_rows);
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads(nthreads, n, 4096))
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t lo = blk * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n, len = hi - lo;
    int64_t b1[BLOCK], b2[BLOCK], guess[BLOCK];
    uint8_t tg[BLOCK];
    for (int64_t i = 0; i < len; ++i) {
      cand.of(keys[lo + i], lo + i, &b1[i], &b2[i], &tg[i]);
      b1[i] *= W;
      b2[i] *= W;
    }
    for (int64_t step = 0; step < len + 2 * AHEAD; ++step) {
      if (step < len) {
        for (int64_t off = 0; off < W; off += 64) {
          __builtin_prefetch(tags + b1[step] + off);
          __builtin_prefetch(tags + b2[step] + off);
        }
      }
      const int64_t g = step - AHEAD;
      if (g >= 0 && g < len) {
        int64_t s = first_tag(tags, b1[g], W, tg[g]);
        if (s < 0) s = first_tag(tags, b2[g], W, tg[g]);
        guess[g] = s;
        if (s >= 0) {
          __builtin_prefetch(table_keys + s);
          if (rows_base) __builtin_prefetch(rows_base + s * row_bytes);
        }
      }
      const int64_t i = step - 2 * AHEAD;
      if (i < 0 || i >= len) continue;
      const int64_t k = keys[lo + i];
      // The guess is the first slot with the key's tag (b1's, else b2's): when it holds the key
      // it is the first used slot that does. Else (no tag match, or another key's tag: 1 in 255
      // a slot) every tag match of both buckets is screened.
      int64_t at = guess[i];
      if (at >= 0 && table_keys[at] != k) {
        at = find_in_bucket(table_keys, tags, b1[i], W, k, tg[i]);
        if (at < 0) at = find_in_bucket(table_keys, tags, b2[i], W, k, tg[i]);
      }
      if (pos) pos[lo + i] = at;
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
