// Native twin of upsert.py's found_and_missing_torch: the first part of an upsert of U distinct
// keys: locate them, give the found keys this call's score (lfu: the saturating sum), and list
// the missing ones in priority order (higher score first, ties in key order). B buckets, W slots.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "probe.h"

using namespace dynemb;

extern "C" int64_t dyn_locate(const int64_t*, int64_t, const uint8_t*, int64_t, int64_t, const int64_t*, const int64_t*, const int64_t*,
                              const int64_t*, int64_t, int64_t*, bool*, const void*, int64_t, int64_t, int64_t*, int64_t);

static constexpr int64_t I64_MAX = std::numeric_limits<int64_t>::max();
static constexpr int64_t I32_MIN = std::numeric_limits<int32_t>::min();
static constexpr int64_t I32_MAX = std::numeric_limits<int32_t>::max();
// Most threads the probe's parallel region takes (its per-thread counts live on the stack).
static constexpr int MAX_PROBE_THREADS = 64;

// Returns M, the number of missing keys (``missing`` gets them in priority order), or -1 when
// a score of this call does not fit the int32 scores (nothing written: widen, then call again).
// With ``rows_out``, the found keys' row ids too (-1 for the missing): read in the probe, from
// the line its score is written to when the slots are packed (docs/design/0041).
extern "C" int64_t dyn_upsert_found(
    const int64_t* table_keys, int64_t key_step,     // [B, W] (key_step 1, or 2 packed)
    const uint8_t* tags,                             // [B, W] tags: 0 where empty
    void* table_scores,            // [B, W] int32 or int64
    int64_t W, int64_t total_buckets, int64_t score_bytes, int64_t score_step,
    const void* table_rows, int64_t row_bytes, int64_t row_step,  // [B, W] int32 or int64
    const int64_t* keys,           // [U] distinct
    const int64_t* seg, const int64_t* seg_counts, const int64_t* seg_offsets,
    int64_t n,
    const int64_t* batch_scores,   // [U] this call's score of each key (key i's at i * score_stride)
    int64_t score_stride,          // 1, or 0 where every key has the one score batch_scores[0]
    const int64_t* counts,         // [U] occurrences (the lfu increment)
    int64_t lfu_add,               // found keys add counts to their score (saturating)
    int64_t uniform,               // every key has the same score: priority = key order
    int64_t* pos, bool* found,     // [U] out
    int64_t* missing,              // [U] out: the first M entries
    int64_t* rows_out,             // [U] out or null: row id of each found key, -1 where missing
    int64_t* free_info,            // [U] out or null: each missing key's pack_choice of its two
                                   // candidates (W <= PACKED_FREE_MAX_W; filled without lfu_add only)
    bool* absent,                  // [U] out or null: not found (what an insert that places every
                                   // missing key returns as ``inserted``)
    int64_t nthreads) {
  const KeyCol slot_keys(table_keys, key_step);
  const IntCol scores(table_scores, score_bytes, score_step), rows(table_rows, row_bytes, row_step);
  auto stored = [&](int64_t p) -> int64_t { return scores.get(p); };
  if (!lfu_add) {
    // Every score written is one of the batch's: check they fit before the probe, then write
    // the found keys' scores in the probe's parallel blocks (distinct keys, distinct slots).
    if (score_bytes == 4)
      for (int64_t i = 0; i < (score_stride ? n : 1); ++i)
        if (batch_scores[i] < I32_MIN || batch_scores[i] > I32_MAX) return -1;
    Candidates cand{seg, seg_counts, seg_offsets, total_buckets};
    const int64_t blocks = (n + PROBE_BLOCK - 1) / PROBE_BLOCK;
    const int nt = std::min(threads(nthreads, n, 4096), MAX_PROBE_THREADS);
    // Each thread's missing keys, then where its part of ``missing`` starts.
    int64_t missing_in[MAX_PROBE_THREADS + 1] = {};
#pragma omp parallel num_threads(nt)
    {
      // Thread t probes blocks [b0, b1), then lists their missing keys (in order, after the
      // threads before it): the found flags it reads are its own, in its cache.
      const int t = omp_get_thread_num(), team = omp_get_num_threads();
      const int64_t b0 = blocks * t / team, b1 = blocks * (t + 1) / team;
      int64_t mine = 0;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t lo = blk * PROBE_BLOCK, len = lo + PROBE_BLOCK < n ? PROBE_BLOCK : n - lo;
        int64_t* at = pos + lo;
        // The score line of each key's likely slot is requested with its key line.
        if (free_info)
          probe_block<true>(slot_keys, tags, W, cand, keys + lo, lo, len, at, &scores, free_info + lo);
        else
          probe_block(slot_keys, tags, W, cand, keys + lo, lo, len, at, &scores);
        for (int64_t i = 0; i < len; ++i) {
          found[lo + i] = at[i] >= 0;
          mine += at[i] < 0;
          if (absent) absent[lo + i] = at[i] < 0;
          if (at[i] >= 0) scores.set(at[i], batch_scores[(lo + i) * score_stride]);
          if (rows_out) rows_out[lo + i] = at[i] >= 0 ? rows.get(at[i]) : -1;
        }
      }
      missing_in[t + 1] = mine;
#pragma omp barrier
      int64_t k = 0;
      for (int q = 0; q < t; ++q) k += missing_in[q + 1];
      const int64_t end = b1 * PROBE_BLOCK < n ? b1 * PROBE_BLOCK : n;
      for (int64_t i = b0 * PROBE_BLOCK; i < end; ++i)
        if (!found[i]) missing[k++] = i;
    }
    int64_t m = 0;
    for (int q = 0; q < nt; ++q) m += missing_in[q + 1];
    if (!uniform)
      std::stable_sort(missing, missing + m, [&](int64_t a, int64_t b) { return batch_scores[a * score_stride] > batch_scores[b * score_stride]; });
    return m;
  }
  dyn_locate(table_keys, key_step, tags, W, total_buckets, keys, seg, seg_counts, seg_offsets, n, pos, found, table_rows, row_bytes, row_step,
             rows_out, nthreads);
  if (absent)
    for (int64_t i = 0; i < n; ++i) absent[i] = !found[i];
  auto new_score = [&](int64_t i) -> int64_t {
    const int64_t old = stored(pos[i]), add = counts[i];
    return old > I64_MAX - add ? I64_MAX : old + add;
  };
  if (score_bytes == 4) {
    // As KeyIndex._fit_scores: every score of the call (the batch's, and lfu's sums) must fit.
    bool fits = true;
    for (int64_t i = 0; i < n && fits; ++i) {
      const int64_t s = batch_scores[i * score_stride];
      fits = s >= I32_MIN && s <= I32_MAX;
      if (fits && found[i]) {
        const int64_t t = new_score(i);
        fits = t >= I32_MIN && t <= I32_MAX;
      }
    }
    if (!fits) return -1;
  }
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!found[i]) {
      missing[m++] = i;
      continue;
    }
    scores.set(pos[i], new_score(i));
  }
  if (!uniform)
    std::stable_sort(missing, missing + m, [&](int64_t a, int64_t b) { return batch_scores[a * score_stride] > batch_scores[b * score_stride]; });
  return m;
}
