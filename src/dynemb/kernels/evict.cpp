// Native twin of BatchPlacement._evict_for: P keys (priority order) whose candidate buckets are
// full each take the slot of the lowest-scored unlocked key among their 2W candidate slots
// (ties: bucket 1 before bucket 2, lower slot first) if that score is not above their own
// (lfu: whatever its score). In each round every active key picks its victim on the round's
// starting state; a key that cannot evict fails; a key wins when no higher-priority eligible key
// of the round shares one of its buckets; winners write, the others try again next round.
//
// The twin's outcome without its rounds (docs/design/0044): one pass in priority order. A key's
// buckets are written, before the round it acts in, only by higher-priority keys sharing one of
// them, and by all of those; a slot written is locked, so a pick can only get worse. Hence a key
// wins, or fails, on the state the keys before it leave, and its round is one past the last
// round in which a key before it claimed one of its buckets (a key claims in every round from
// the first until it wins, or until the round before the one it fails in). The round orders the
// report only. P keys, L locked slots, W slots, nb the buckets the keys name.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

using namespace dynemb;

// Buckets (in the sort) and keys (in the pass) whose lines are requested ahead of the one at hand.
static constexpr int64_t AHEAD = 8;

// The call's scratch, carved from the caller's reused buffer (fresh pages would fault in on
// every call). nb <= min(2P, B) local buckets; the hash map, where B is large beside P, has a
// power of two >= 4P entries.
struct EvictScratch {
  bool direct;
  int64_t map_size, nb_max;
  int64_t *b1, *b2, *map_bucket, *bucket_of_local, *held, *keys_held, *scores_held;
  int32_t *map_local, *l1, *l2, *open, *head, *level, *slot, *round, *round_of;
  uint8_t *locked_here, *key_tags;
  int64_t bytes = 0;

  EvictScratch(char* base, int64_t n, int64_t W, int64_t total_buckets) {
    // A direct [B] array of local ids where B is small beside P, else a hash map.
    direct = total_buckets <= 16 * n;
    map_size = 16;
    while (!direct && map_size < 4 * n) map_size <<= 1;
    nb_max = std::min(2 * n, total_buckets);
    auto take = [&](auto*& span, int64_t count) {
      span = reinterpret_cast<std::remove_reference_t<decltype(span)>>(base ? base + bytes : nullptr);
      bytes += (count * static_cast<int64_t>(sizeof(*span)) + 7) / 8 * 8;
    };
    take(b1, n), take(b2, n), take(map_bucket, direct ? 0 : map_size), take(bucket_of_local, nb_max), take(held, nb_max * W);
    take(keys_held, n), take(scores_held, n), take(map_local, direct ? total_buckets : map_size), take(l1, n), take(l2, n);
    take(open, nb_max), take(head, nb_max), take(level, nb_max), take(slot, nb_max * W), take(round, nb_max * W);
    take(round_of, n), take(locked_here, nb_max * W), take(key_tags, n);
  }
};

// Bytes of scratch a call of P keys needs on a table of B buckets of W slots.
extern "C" int64_t dyn_evict_scratch_bytes(int64_t n, int64_t W, int64_t total_buckets) { return EvictScratch(nullptr, n, W, total_buckets).bytes; }

// Returns E, the keys placed by eviction; ``pos`` gets each key's slot (-1: failed) and
// ``taken`` the E slots taken (``old_keys`` / ``old_scores`` what they held), in the order the
// twin reports them (round by round, each round's winners in priority order).
extern "C" int64_t dyn_evict_for(
    int64_t* table_keys, int64_t key_step,                   // [B, W] (key_step 1, or 2 packed)
    uint8_t* tags, void* table_scores,                      // [B, W] tags: 0 where empty
    int64_t W, int64_t total_buckets, int64_t score_bytes, int64_t score_step,
    const int64_t* keys, const int64_t* scores,                 // [P]
    const int64_t* seg, const int64_t* seg_counts, const int64_t* seg_offsets,
    int64_t n,
    const int64_t* locked, int64_t n_locked,                    // [L] slots of the batch's keys
    int64_t lfu,
    int64_t* pos,                                               // [P] out
    int64_t* taken, int64_t* old_keys, int64_t* old_scores,     // [P] out: the first E entries
    char* scratch, int64_t scratch_bytes,                       // dyn_evict_scratch_bytes(P, W, B)
    int64_t nthreads) {
  if (n == 0) return 0;
  EvictScratch z(scratch, n, W, total_buckets);
  if (z.bytes > scratch_bytes) return -1;
  int64_t *b1 = z.b1, *b2 = z.b2, *map_bucket = z.map_bucket, *bucket_of_local = z.bucket_of_local, *held = z.held;
  int32_t *map_local = z.map_local, *l1 = z.l1, *l2 = z.l2, *open = z.open, *head = z.head, *level = z.level;
  int32_t *slot = z.slot, *round = z.round, *round_of = z.round_of;
  uint8_t* locked_here = z.locked_here;
  Candidates cand{seg, seg_counts, seg_offsets, total_buckets};
  const KeyCol slot_keys(table_keys, key_step);
  const IntCol slot_scores(table_scores, score_bytes, score_step);
  const int nt = threads(nthreads, n, 2048);
#pragma omp parallel for schedule(static) num_threads(nt)
  for (int64_t i = 0; i < n; ++i) cand.of(keys[i], i, &b1[i], &b2[i], &z.key_tags[i]);

  // Local ids of the buckets the keys name (a direct array, or an open-addressing map bucket ->
  // id where the table has many buckets beside P), so that the call's state takes O(P W).
  const int64_t map_size = z.map_size;
  const uint64_t mask = static_cast<uint64_t>(map_size - 1);
  if (z.direct)
    std::fill(map_local, map_local + total_buckets, -1);
  else
    std::fill(map_bucket, map_bucket + map_size, -1);
  int32_t nb = 0;
  auto local_of = [&](int64_t b, bool add) -> int32_t {
    if (z.direct) {
      int32_t& l = map_local[b];
      if (l < 0 && add) {
        bucket_of_local[nb] = b;
        l = nb++;
      }
      return l;
    }
    for (uint64_t h = mix64(static_cast<uint64_t>(b)) & mask;; h = (h + 1) & mask) {
      if (map_bucket[h] == b) return map_local[h];
      if (map_bucket[h] < 0) {
        if (!add) return -1;
        map_bucket[h] = b;
        map_local[h] = nb;
        bucket_of_local[nb] = b;
        return nb++;
      }
    }
  };
  for (int64_t i = 0; i < n; ++i) {
    l1[i] = local_of(b1[i], true);
    l2[i] = local_of(b2[i], true);
  }
  // Each local bucket's open slots (not empty, not locked by the call) by score, then slot:
  // the order a bucket's victims are taken in (a key's victim in a bucket is that bucket's first
  // lowest open slot), with ``head`` the first not yet taken.
  std::fill(locked_here, locked_here + static_cast<size_t>(nb) * W, 0);
  for (int64_t q = 0; q < n_locked; ++q) {
    const int32_t l = local_of(locked[q] / W, false);
    if (l >= 0) locked_here[static_cast<size_t>(l) * W + locked[q] % W] = 1;
  }
#pragma omp parallel for schedule(static) num_threads(threads(nthreads, nb, 1024))
  for (int32_t l = 0; l < nb; ++l) {
    const int64_t base = bucket_of_local[l] * W;
    if (l + AHEAD < nb) {
      const int64_t ahead = bucket_of_local[l + AHEAD] * W;
      __builtin_prefetch(tags + ahead);
      prefetch_span<0>(slot_scores.at(ahead), slot_scores.at(ahead + W - 1));
    }
    int32_t* sl = slot + static_cast<size_t>(l) * W;
    int64_t* sc = held + static_cast<size_t>(l) * W;
    int32_t c = 0;
    for (int64_t j = 0; j < W; ++j) {
      if (!tags[base + j] || locked_here[static_cast<size_t>(l) * W + j]) continue;
      // By insertion: (score, slot) ascending, slots come in ascending order.
      const int64_t s = slot_scores.get(base + j);
      int32_t k = c++;
      for (; k > 0 && sc[k - 1] > s; --k) {
        sl[k] = sl[k - 1];
        sc[k] = sc[k - 1];
      }
      sl[k] = static_cast<int32_t>(j);
      sc[k] = s;
    }
    open[l] = c;
    head[l] = level[l] = 0;
  }

  // In priority order, each key's pick on the state the keys before it leave: the lower of its
  // buckets' heads (ties: bucket 1).
  for (int64_t i = 0; i < n; ++i) {
    if (i + AHEAD < n) {
      // The lines a key AHEAD later likely reads and writes: its buckets' heads as they stand.
      const int64_t k = i + AHEAD;
      for (const int32_t l : {l1[k], l2[k]})
        if (head[l] < open[l]) {
          const int64_t q = bucket_of_local[l] * W + slot[static_cast<size_t>(l) * W + head[l]];
          __builtin_prefetch(slot_keys.at(q), 1);
          __builtin_prefetch(slot_scores.at(q), 1);
          __builtin_prefetch(tags + q, 1);
        }
    }
    const int32_t a = l1[i], b = l2[i];
    int32_t from = -1;
    if (head[a] < open[a]) from = a;
    if (head[b] < open[b] && (from < 0 || held[static_cast<size_t>(b) * W + head[b]] < held[static_cast<size_t>(a) * W + head[a]])) from = b;
    const size_t at = from < 0 ? 0 : static_cast<size_t>(from) * W + head[from];
    if (from >= 0 && (lfu || scores[i] >= held[at])) {
      const int64_t p = bucket_of_local[from] * W + slot[at];
      const int32_t r = 1 + std::max(level[a], level[b]);
      z.keys_held[i] = slot_keys[p];
      z.scores_held[i] = held[at];
      write_slot(slot_keys, tags, slot_scores, p, keys[i], scores[i], z.key_tags[i]);
      ++head[from];
      round[at] = r;
      pos[i] = p;
      round_of[i] = r;
      level[a] = level[b] = r;
      continue;
    }
    // It fails in the first round with none of the slots it could evict open (those scored at
    // most its own score; lfu: any), all taken by now; so it claims its buckets up to the round
    // before: up to the last round in which one of those was taken.
    pos[i] = -1;
    round_of[i] = 0;
    int32_t last = 0;
    for (const int32_t l : {a, b})
      for (int32_t k = 0; k < head[l]; ++k) {
        const size_t e = static_cast<size_t>(l) * W + k;
        if (lfu || held[e] <= scores[i]) last = std::max(last, round[e]);
      }
    level[a] = std::max(level[a], last);
    level[b] = std::max(level[b], last);
  }

  // The report, round by round, each round's winners in priority order (a counting sort).
  int32_t rounds = 0;
  for (int64_t i = 0; i < n; ++i) rounds = std::max(rounds, round_of[i]);
  std::vector<int64_t> start(static_cast<size_t>(rounds) + 2, 0);
  for (int64_t i = 0; i < n; ++i)
    if (round_of[i]) ++start[round_of[i] + 1];
  for (int32_t r = 1; r <= rounds; ++r) start[r + 1] += start[r];
  const int64_t e = start[rounds + 1];
  for (int64_t i = 0; i < n; ++i)
    if (round_of[i]) {
      const int64_t at = start[round_of[i]]++;
      taken[at] = pos[i];
      old_keys[at] = z.keys_held[i];
      old_scores[at] = z.scores_held[i];
    }
  return e;
}
