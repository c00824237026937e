// Native twin of locate.py's locate_torch: the flat slot of each key in the bucketed index.
// N keys, B buckets, W slots per bucket.
#include "common.h"
#include "probe.h"

using namespace dynemb;

// The probe of probe.h a block at a time (2 tag lines a key, then the likely slot's key line and
// its row id line, requested together: one line when the slots are packed; docs/design/0039,
// 0041), then the block's outputs.
extern "C" int64_t dyn_locate(
    const int64_t* table_keys,  // [B, W]
    int64_t key_step,           // elements from one slot's key to the next (1, or 2 packed)
    const uint8_t* tags,        // [B, W] 0 where empty, else the slot's key's tag
    int64_t W, int64_t total_buckets,
    const int64_t* keys,        // [N]
    const int64_t* seg, const int64_t* seg_counts, const int64_t* seg_offsets,
    int64_t n,
    int64_t* pos,               // [N] out: flat slot, -1 where absent (or null: not wanted)
    bool* found,                // [N] out
    const void* table_rows,     // [B, W] row ids (int32 or int64), or null
    int64_t row_bytes,          // 4 or 8
    int64_t row_step,           // elements from one slot's row id to the next (1, or 4 packed)
    int64_t* rows_out,          // [N] out: row id, -1 where absent (with table_rows)
    int64_t nthreads) {
  Candidates cand{seg, seg_counts, seg_offsets, total_buckets};
  const KeyCol slot_keys(table_keys, key_step);
  const IntCol rows(table_rows, row_bytes, row_step);
  const int64_t blocks = (n + PROBE_BLOCK - 1) / PROBE_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads(nthreads, n, 4096))
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t lo = blk * PROBE_BLOCK, len = lo + PROBE_BLOCK < n ? PROBE_BLOCK : n - lo;
    int64_t at[PROBE_BLOCK];
    probe_block(slot_keys, tags, W, cand, keys + lo, lo, len, at, table_rows ? &rows : nullptr);
    for (int64_t i = 0; i < len; ++i) {
      if (pos) pos[lo + i] = at[i];
      found[lo + i] = at[i] >= 0;
      if (rows_out) rows_out[lo + i] = at[i] >= 0 ? rows.get(at[i]) : -1;
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
