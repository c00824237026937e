// Native twin of place.py's place_free_torch: new keys into free slots of their candidate
// buckets, round by round under the same rule (docs/design/0006), so both give the same slots.
// P keys to place (in priority order), B buckets, W slots per bucket.
#include <omp.h>

#include <algorithm>

#include "common.h"

using namespace dynemb;

static constexpr int MAX_ROUNDS = PLACEMENT_ROUNDS;

// Sort n non-negative slots ascending (radix_sort_bits over their range), ``buffer`` as large.
static void radix_sort_slots(int64_t* v, int64_t* buffer, int64_t n) {
  if (n < 2) return;
  int64_t lo = v[0], hi = v[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = v[i] < lo ? v[i] : lo;
    hi = v[i] > hi ? v[i] : hi;
  }
  radix_sort_bits(reinterpret_cast<uint64_t*>(v), reinterpret_cast<uint64_t*>(buffer), n, static_cast<uint64_t>(lo), 0, static_cast<uint64_t>(hi - lo));
}

// The lines a key's placement writes: its bucket's tags, keys and scores; when the slots are
// packed (``likely`` >= 0), the tags and the line of slot ``likely``, where a bucket's first new
// key goes (a bucket spans four lines).
__attribute__((always_inline)) inline void prefetch_target(const KeyCol& table_keys, const uint8_t* tags, const IntCol& scores, int64_t base,
                                                           int64_t W, int64_t likely) {
  __builtin_prefetch(tags + base, 1);
  if (likely >= 0) {
    __builtin_prefetch(table_keys.at(likely), 1);
    return;
  }
  __builtin_prefetch(table_keys.at(base), 1);
  __builtin_prefetch(table_keys.at(base + W - 1), 1);
  __builtin_prefetch(scores.at(base), 1);
}

// Most threads a round's placement pass uses (each scans every key of the round).
static constexpr int MAX_PLACE_THREADS = 8;
// Keys of a thread's own buckets whose lines are in flight ahead of the one being placed.
static constexpr int AHEAD = 16;

// Returns the number of keys placed; ``order`` gets their slots in row-allocation order (each
// round's slots ascending, rounds in turn), ``pos`` each key's slot (-1: not placed).
//
// Each round: (A) in parallel over the keys, the free slots of both candidates as the round
// starts and the bucket each key tries; (B) in parallel over bucket ranges, thread r places, in
// priority order, the keys whose bucket lies in its range r: keys of one bucket keep their
// order, and no two threads touch one bucket, so the slots are those of a serial pass; each
// thread sorts its slots, and the ranges ascend, so the round's slots come out ascending.
extern "C" int64_t dyn_place_free(
    int64_t* table_keys,         // [B, W]
    int64_t key_step,            // elements from one slot's key to the next (1, or 2 packed)
    uint8_t* tags,               // [B, W] tags: 0 where empty, else the slot key's tag
    void* table_scores,          // [B, W] int32 or int64
    const int64_t* keys,         // [P]
    const int64_t* scores,       // [P]
    int64_t W, int64_t total_buckets,
    int64_t score_bytes,         // 4 or 8
    int64_t score_step,          // elements from one slot's score to the next (1, or 4 packed)
    const int64_t* seg, const int64_t* seg_counts, const int64_t* seg_offsets,
    int64_t n,
    int64_t* pos,                // [P] out
    int64_t* order,              // [P] out: the first (return value) entries are slots
    int64_t* rounds,             // [MAX_ROUNDS] out: slots taken in each round (0 after the last)
    int64_t* scratch,            // [8P] the caller's reused buffer
    int64_t cap,                 // its size, at least 8P
    int64_t* seg_placed,         // [S] or null (with seg): each segment's placed keys are added
    const int64_t* pre_choice,   // or null: pack_choice of each key's candidates as the first round
    const int64_t* pre_at,       //   starts, at pre_choice[pre_at[i]] (read by the caller's probe)
    int64_t nthreads) {
  for (int r = 0; r < MAX_ROUNDS; ++r) rounds[r] = 0;
  if (n == 0) return 0;
  if (cap < 8 * n) return -1;
  Candidates cand{seg, seg_counts, seg_offsets, total_buckets};
  int64_t *b1 = scratch, *b2 = b1 + n, *chosen = b2 + n, *nfree = chosen + n, *todo = nfree + n, *slots = todo + n, *likely = slots + n, *sort_buffer = likely + n;
  int nt = threads(nthreads, n, 2048);
  if (nt > MAX_PLACE_THREADS) nt = MAX_PLACE_THREADS;
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t i = 0; i < n; ++i) {
    cand.of(keys[i], i, &b1[i], &b2[i]);
    pos[i] = -1;
    todo[i] = i;
  }
  const KeyCol slot_keys(table_keys, key_step);
  const IntCol slot_scores(table_scores, score_bytes, score_step);
  const bool packed = same_record(slot_keys, slot_scores);
  int64_t n_todo = n, n_placed = 0;
  int round_no = 0;
  // own[a * nt + r]: keys of thread a's share of the round (pass A) whose bucket is in range r.
  int64_t own[MAX_PLACE_THREADS * MAX_PLACE_THREADS], placed_in[MAX_PLACE_THREADS + 1];

  auto one_round = [&](bool halve, bool other) -> int64_t {
    std::fill(own, own + MAX_PLACE_THREADS * MAX_PLACE_THREADS, 0);
    int rt = 1;  // the threads the round got: bucket ranges and shares of the keys
#pragma omp parallel num_threads(n_todo >= 2048 ? nt : 1)
    {
      const int a = omp_get_thread_num();
#pragma omp single
      rt = omp_get_num_threads();
      // Range of a bucket: rt spans of the bucket ids, ascending (multiply-shift: a division per
      // key and thread cost ~10% of the kernel).
      const uint64_t span = (static_cast<uint64_t>(rt) << 32) / static_cast<uint64_t>(total_buckets);
      auto range_of = [&](int64_t bucket) -> int { return static_cast<int>((static_cast<uint64_t>(bucket) * span) >> 32); };
      const int64_t chunk = (n_todo + rt - 1) / rt, lo = a * chunk, hi = lo + chunk < n_todo ? lo + chunk : n_todo;
      int64_t* mine = own + a * MAX_PLACE_THREADS;
      // (A) Free slots of both candidates as the round starts, and the bucket each key tries
      // (in the first round from the probe's reading when the caller has it).
      const bool given = pre_choice && round_no == 0;
      for (int64_t t = lo; t < hi; ++t) {
        if (t + AHEAD < hi) {
          if (given) {
            __builtin_prefetch(pre_choice + pre_at[todo[t + AHEAD]]);
          } else {
            __builtin_prefetch(tags + b1[todo[t + AHEAD]] * W);
            __builtin_prefetch(tags + b2[todo[t + AHEAD]] * W);
          }
        }
        const int64_t i = todo[t];
        if (given) {
          // The first round (which tries the preferred candidate) as the probe chose it.
          const int64_t c = pre_choice[pre_at[i]];
          if (c < 0) {
            chosen[i] = -1;
            continue;
          }
          chosen[i] = choice_bucket(c);
          nfree[i] = choice_count(c);
          if (packed) likely[i] = chosen[i] * W + choice_first(c);
          ++mine[range_of(chosen[i])];
          continue;
        }
        const FreeSlots s1 = free_slots(tags, b1[i], W), s2 = free_slots(tags, b2[i], W);
        const int64_t f1 = s1.count, f2 = s2.count;
        if (f1 == 0 && f2 == 0) {
          chosen[i] = -1;
          continue;
        }
        const bool take_second = tries_second(f1, f2, b1[i], b2[i], other);
        chosen[i] = take_second ? b2[i] : b1[i];
        nfree[i] = take_second ? f2 : f1;
        // Packed slots: the slot the key most likely takes, its bucket's first free one (the
        // last slot when none is: the last round may try a full bucket), whose line alone pass
        // B requests.
        if (packed) {
          const int64_t first = (take_second ? s2 : s1).first;
          likely[i] = chosen[i] * W + (first >= 0 ? first : W - 1);
        }
        ++mine[range_of(chosen[i])];
      }
#pragma omp barrier
      // (B) Thread r places the keys of its bucket range, in priority order: the r-th key of a
      // bucket takes its r-th free slot (the first free one now, the r - 1 before it having
      // taken theirs) while r is under the round's limit.
      const int r = a;
      int64_t base = 0;
      for (int q = 0; q < r; ++q)
        for (int u = 0; u < rt; ++u) base += own[u * MAX_PLACE_THREADS + q];
      int64_t* my_slots = slots + base;
      int64_t placed = 0;
      int64_t ring[AHEAD];
      int64_t head = 0, tail = 0, scan = 0;
      for (;;) {
        // Keep AHEAD keys of this range found (and their lines requested) ahead of the one placed.
        while (tail - head < AHEAD && scan < n_todo) {
          const int64_t i = todo[scan++];
          if (chosen[i] < 0 || range_of(chosen[i]) != r) continue;
          prefetch_target(slot_keys, tags, slot_scores, chosen[i] * W, W, packed ? likely[i] : -1);
          ring[tail++ % AHEAD] = i;
        }
        if (head == tail) break;
        const int64_t i = ring[head++ % AHEAD];
        const int64_t b = chosen[i];
        // The key's rank among this round's keys of its bucket is how many of the bucket's free
        // slots the round has taken so far: every earlier key of the bucket took one, until one
        // did not fit (from then on the rank is at the limit, and no later key fits either).
        const FreeSlots now = free_slots(tags, b, W);
        const int64_t free_now = now.count, slot = now.first >= 0 ? b * W + now.first : -1;
        const int64_t limit = halve ? (nfree[i] + 1) / 2 : nfree[i];
        if (nfree[i] - free_now >= limit) continue;
        write_slot(slot_keys, tags, slot_scores, slot, keys[i], scores[i]);
        pos[i] = slot;
        my_slots[placed++] = slot;
      }
      radix_sort_slots(my_slots, sort_buffer + base, placed);
      placed_in[r + 1] = placed;
#pragma omp barrier
#pragma omp single
      {
        placed_in[0] = 0;
        for (int q = 0; q < rt; ++q) placed_in[q + 1] += placed_in[q];
      }
      std::copy(my_slots, my_slots + placed, order + n_placed + placed_in[r]);
    }
    const int64_t taken = placed_in[rt];
    // The keys not placed stay, in priority order.
    int64_t kept = 0;
    for (int64_t t = 0; t < n_todo; ++t)
      if (pos[todo[t]] < 0) todo[kept++] = todo[t];
    n_placed += taken;
    rounds[round_no++] = taken;
    n_todo = kept;
    return taken;
  };

  placement_rounds(one_round, n_todo);
  if (seg && seg_placed)
    for (int64_t i = 0; i < n; ++i)
      if (pos[i] >= 0) ++seg_placed[seg[i]];
  return n_placed;
}
