// Native twin of BatchPlacement._evict_for: P keys (priority order) whose candidate buckets are
// full each take the slot of the lowest-scored unlocked key among their 2W candidate slots
// (ties: bucket 1 before bucket 2, lower slot first) if that score is not above their own
// (lfu: whatever its score). In each round every active key picks its victim on the round's
// starting state; a key wins when no higher-priority eligible key of the round shares one of its
// buckets; winners write, the others try again next round. P keys, L locked slots, W slots.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"

using namespace dynemb;

// Keys whose buckets are prefetched ahead of the one picking its victim.
static constexpr int64_t AHEAD = 8;

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
    int64_t nthreads) {
  Candidates cand{seg, seg_counts, seg_offsets, total_buckets};
  const KeyCol slot_keys(table_keys, key_step);
  const IntCol slot_scores(table_scores, score_bytes, score_step);
  auto score_at = [&](int64_t p) -> int64_t { return slot_scores.get(p); };
  // One byte a slot for this call (as the twin's lock tensor), one a bucket for the round's claims.
  std::vector<uint8_t> lock(total_buckets * W, 0), claimed(total_buckets, 0);
  for (int64_t i = 0; i < n_locked; ++i) lock[locked[i]] = 1;
  std::vector<int64_t> b1(n), b2(n), active(n);
  for (int64_t i = 0; i < n; ++i) {
    cand.of(keys[i], i, &b1[i], &b2[i]);
    pos[i] = -1;
    active[i] = i;
  }
  int64_t n_active = n, e = 0;
  // A key's victim changes only when a winner wrote into one of its buckets: after the first
  // round only keys with a bucket written in the last round look again.
  std::vector<int64_t> victim_of(n, -1), claims, written;
  std::vector<uint8_t> eligible_of(n, 0), dirty(total_buckets, 0);
  auto pick_victim = [&](int64_t i) {
    int64_t best = -1, best_score = 0;
    for (int c = 0; c < 2; ++c) {
      const int64_t base = (c == 0 ? b1[i] : b2[i]) * W;
      for (int64_t j = 0; j < W; ++j) {
        const int64_t p = base + j;
        if (!tags[p] || lock[p]) continue;
        const int64_t s = score_at(p);
        if (best < 0 || s < best_score) {
          best = p;
          best_score = s;
        }
      }
    }
    victim_of[i] = best;
    eligible_of[i] = best >= 0 && (lfu || scores[i] >= best_score);
  };
  // The lines a key's pick reads in one bucket: its tags, lock bytes and scores.
  auto prefetch_bucket = [&](int64_t b) {
    const int64_t base = b * W;
    __builtin_prefetch(tags + base);
    __builtin_prefetch(lock.data() + base);
    prefetch_span<0>(slot_scores.at(base), slot_scores.at(base + W - 1));
  };
  std::vector<int64_t> look(n);
  bool first_round = true;
  while (n_active) {
    // The round's picks read the state as the round starts and write only their own key's
    // entries: in parallel, the buckets of a key AHEAD picks later prefetched (the picks are
    // random reads of tags, locks and scores, latency-bound when serial).
    int64_t n_look = 0;
    for (int64_t t = 0; t < n_active; ++t) {
      const int64_t i = active[t];
      if (first_round || dirty[b1[i]] || dirty[b2[i]]) look[n_look++] = i;
    }
#pragma omp parallel for schedule(static) num_threads(threads(nthreads, n_look, 2048))
    for (int64_t t = 0; t < n_look; ++t) {
      if (t + AHEAD < n_look) {
        prefetch_bucket(b1[look[t + AHEAD]]);
        prefetch_bucket(b2[look[t + AHEAD]]);
      }
      pick_victim(look[t]);
    }
    bool any = false;
    for (int64_t t = 0; t < n_active && !any; ++t) any = eligible_of[active[t]] != 0;
    first_round = false;
    for (int64_t b : written) dirty[b] = 0;
    written.clear();
    if (!any) break;
    // In priority order: an eligible key wins unless an earlier eligible key of this round
    // claimed one of its buckets; every eligible key claims both of its buckets.
    int64_t kept = 0;
    for (int64_t t = 0; t < n_active; ++t) {
      // The victim slot of a key AHEAD later: its key and score are read and written if it wins.
      if (t + AHEAD < n_active && eligible_of[active[t + AHEAD]]) {
        const int64_t q = victim_of[active[t + AHEAD]];
        __builtin_prefetch(slot_keys.at(q), 1);
        __builtin_prefetch(slot_scores.at(q), 1);
      }
      const int64_t i = active[t];
      if (!eligible_of[i]) continue;
      const bool free1 = !claimed[b1[i]], free2 = !claimed[b2[i]];
      claimed[b1[i]] = claimed[b2[i]] = 1;
      claims.push_back(b1[i]);
      claims.push_back(b2[i]);
      if (!(free1 && free2)) {
        active[kept++] = i;
        continue;
      }
      const int64_t p = victim_of[i];
      taken[e] = p;
      old_keys[e] = slot_keys[p];
      old_scores[e] = score_at(p);
      ++e;
      write_slot(slot_keys, tags, slot_scores, p, keys[i], scores[i]);
      lock[p] = 1;
      pos[i] = p;
      dirty[p / W] = 1;
      written.push_back(p / W);
    }
    for (int64_t b : claims) claimed[b] = 0;
    claims.clear();
    n_active = kept;
  }
  return e;
}
