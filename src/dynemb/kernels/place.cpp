// Native twin of place.py's place_free_torch: new keys into free slots of their candidate
// buckets, round by round under the same rule (docs/design/0006), so both give the same slots.
// P keys to place (in priority order), B buckets, W slots per bucket.
#include <algorithm>
#include <vector>

#include "common.h"

using namespace dynemb;

// At most 8 halving rounds, then one filling the preferred candidate, one the other.
static constexpr int MAX_ROUNDS = 10;

// Sort non-negative slots ascending (LSD radix, 11 bits a pass, only the passes their largest
// value needs).
static void radix_sort_slots(std::vector<int64_t>& v, std::vector<int64_t>& buffer) {
  const size_t n = v.size();
  if (n < 2) return;
  int64_t top = 0;
  for (int64_t x : v) top = x > top ? x : top;
  buffer.resize(n);
  constexpr int BITS = 11;
  constexpr int64_t DIGITS = int64_t(1) << BITS;
  size_t count[DIGITS + 1];
  for (int shift = 0; shift < 63 && (top >> shift) > 0; shift += BITS) {
    std::fill(count, count + DIGITS + 1, 0);
    for (int64_t x : v) ++count[((x >> shift) & (DIGITS - 1)) + 1];
    for (int64_t d = 0; d < DIGITS; ++d) count[d + 1] += count[d];
    for (int64_t x : v) buffer[count[(x >> shift) & (DIGITS - 1)]++] = x;
    v.swap(buffer);
  }
}

static inline int64_t free_in(const bool* used, int64_t bucket, int64_t W) {
  int64_t f = 0;
  for (int64_t j = 0; j < W; ++j) f += !used[bucket * W + j];
  return f;
}

// Returns the number of keys placed; ``order`` gets their slots in row-allocation order (each
// round's slots ascending, rounds in turn), ``pos`` each key's slot (-1: not placed).
extern "C" int64_t dyn_place_free(
    int64_t* table_keys,         // [B, W]
    bool* used,                  // [B, W]
    void* table_scores,          // [B, W] int32 or int64
    const int64_t* keys,         // [P]
    const int64_t* scores,       // [P]
    int64_t W, int64_t total_buckets,
    int64_t score_bytes,         // 4 or 8
    const int64_t* seg, const int64_t* seg_counts, const int64_t* seg_offsets,
    int64_t n,
    int64_t* pos,                // [P] out
    int64_t* order,              // [P] out: the first (return value) entries are slots
    int64_t* rounds,             // [MAX_ROUNDS] out: slots taken in each round (0 after the last)
    int64_t* scratch,            // unused (kept for the launcher's signature)
    int64_t cap,
    int64_t nthreads) {
  (void)scratch;
  (void)cap;
  Candidates cand{seg, seg_counts, seg_offsets, total_buckets};
  std::vector<int64_t> b1(n), b2(n), chosen(n), nfree(n), todo(n);
  for (int64_t i = 0; i < n; ++i) {
    cand.of(keys[i], i, &b1[i], &b2[i]);
    pos[i] = -1;
    todo[i] = i;
  }
  int64_t n_todo = n, n_placed = 0;
  std::vector<int64_t> round_slots, sort_buffer;
  int round_no = 0;
  for (int r = 0; r < MAX_ROUNDS; ++r) rounds[r] = 0;

  auto one_round = [&](bool halve, bool other) -> int64_t {
    // Free slots of both candidates as the round starts, and the bucket each key tries.
#pragma omp parallel for schedule(static) num_threads(threads(nthreads, n_todo, 4096))
    for (int64_t t = 0; t < n_todo; ++t) {
      if (t + 8 < n_todo) {
        __builtin_prefetch(used + b1[todo[t + 8]] * W);
        __builtin_prefetch(used + b2[todo[t + 8]] * W);
      }
      const int64_t i = todo[t];
      const int64_t f1 = free_in(used, b1[i], W), f2 = free_in(used, b2[i], W);
      if (f1 == 0 && f2 == 0) {
        chosen[i] = -1;
        continue;
      }
      const bool tie_second = ((b1[i] ^ b2[i]) & 1) != 0;
      const bool second = f2 > f1 || (f2 == f1 && tie_second);
      const bool take_second = second != other;
      chosen[i] = take_second ? b2[i] : b1[i];
      nfree[i] = take_second ? f2 : f1;
    }
    // In priority order, the r-th key of a bucket takes its r-th free slot (the first free one
    // now, the r - 1 before it having taken theirs) while r is under the round's limit.
    round_slots.clear();
    int64_t kept = 0;
    for (int64_t t = 0; t < n_todo; ++t) {
      if (t + 8 < n_todo && chosen[todo[t + 8]] >= 0) {
        const int64_t ahead = chosen[todo[t + 8]] * W;
        __builtin_prefetch(used + ahead, 1);
        __builtin_prefetch(table_keys + ahead, 1);
        __builtin_prefetch(table_keys + ahead + W - 1, 1);
        __builtin_prefetch(static_cast<char*>(table_scores) + ahead * score_bytes, 1);
      }
      const int64_t i = todo[t];
      const int64_t b = chosen[i];
      // The key's rank among this round's keys of its bucket is how many of the bucket's free
      // slots the round has taken so far: every earlier key of the bucket took one, until one
      // did not fit (from then on the rank is at the limit, and no later key fits either).
      int64_t slot = -1, free_now = 0;
      if (b >= 0) {
        for (int64_t j = W - 1; j >= 0; --j) {
          if (!used[b * W + j]) {
            slot = b * W + j;
            ++free_now;
          }
        }
      }
      const int64_t limit = b < 0 ? 0 : (halve ? (nfree[i] + 1) / 2 : nfree[i]);
      if (b < 0 || nfree[i] - free_now >= limit) {
        todo[kept++] = i;
        continue;
      }
      table_keys[slot] = keys[i];
      used[slot] = true;
      if (score_bytes == 4)
        static_cast<int32_t*>(table_scores)[slot] = static_cast<int32_t>(scores[i]);
      else
        static_cast<int64_t*>(table_scores)[slot] = scores[i];
      pos[i] = slot;
      round_slots.push_back(slot);
    }
    radix_sort_slots(round_slots, sort_buffer);
    std::copy(round_slots.begin(), round_slots.end(), order + n_placed);
    n_placed += static_cast<int64_t>(round_slots.size());
    rounds[round_no++] = static_cast<int64_t>(round_slots.size());
    n_todo = kept;
    return static_cast<int64_t>(round_slots.size());
  };

  for (int k = 0; k < 8 && n_todo; ++k)
    if (one_round(true, false) == 0) break;
  if (n_todo) one_round(false, false);
  if (n_todo) one_round(false, true);
  return n_placed;
}
