// The probe of locate.cpp and upsert.cpp: the slot of each key of a block, the first used match among its first candidate
// bucket's W slots, then its second's. Three stages over the block: the tag lines of key
// i + 2 * PROBE_AHEAD's buckets are requested; key i + PROBE_AHEAD's first slot with its tag is
// found and that slot's key line (and optionally a third table's entry) requested; key i is
// compared (docs/design/0039).
//
// Negative result (perf-log 2026-11-26): with the key lines of both buckets read in full (no
// tags), a pipeline that fetched the second bucket only for keys absent from the first, and the
// used flags only of matching slots, was ~10% slower: the dependent round trips cost more than
// the bandwidth saved. The tags make the first stage one line a bucket.
#pragma once
#include <cstdint>

#include "common.h"

namespace dynemb {

static constexpr int64_t PROBE_AHEAD = 12;
// Keys per block: their candidates live on the stack.
static constexpr int64_t PROBE_BLOCK = 256;

// at[i]: the flat slot of keys[i] for i in [0, len) (len <= PROBE_BLOCK), -1 where absent;
// key i of the block is key ``first + i`` of the call (for its segment). ``also`` (or null):
// a [B, W] table (row ids, scores) whose entries the caller reads or writes at the found slots
// next: prefetched with the key line unless it shares that line (packed slots). With FREE,
// ``free_out`` gets for each absent key its first placement round's choice (pack_choice of its
// two candidates), read while their tags are in cache (a template flag: the find's probe
// carries no test for it).
template <bool FREE = false>
inline void probe_block(const KeyCol& table_keys, const uint8_t* tags, int64_t W, const Candidates& cand, const int64_t* keys, int64_t first,
                        int64_t len, int64_t* at, const IntCol* also = nullptr, int64_t* free_out = nullptr) {
  const bool also_apart = also && !same_record(table_keys, *also);
  int64_t b1[PROBE_BLOCK], b2[PROBE_BLOCK];
  int64_t id1[FREE ? PROBE_BLOCK : 1], id2[FREE ? PROBE_BLOCK : 1];  // the bucket ids (b1, b2: their first slots)
  uint8_t tg[PROBE_BLOCK];
  for (int64_t i = 0; i < len; ++i) {
    cand.of(keys[i], first + i, &b1[i], &b2[i], &tg[i]);
    if constexpr (FREE) {
      id1[i] = b1[i];
      id2[i] = b2[i];
    }
    b1[i] *= W;
    b2[i] *= W;
  }
  for (int64_t step = 0; step < len + 2 * PROBE_AHEAD; ++step) {
    if (step < len) {
      for (int64_t off = 0; off < W; off += 64) {
        __builtin_prefetch(tags + b1[step] + off);
        __builtin_prefetch(tags + b2[step] + off);
      }
    }
    const int64_t g = step - PROBE_AHEAD;
    if (g >= 0 && g < len) {
      int64_t s = first_tag(tags, b1[g], W, tg[g]);
      if (s < 0) s = first_tag(tags, b2[g], W, tg[g]);
      at[g] = s;  // the guess, until key g is compared
      if (s >= 0) {
        __builtin_prefetch(table_keys.at(s));
        if (also_apart) __builtin_prefetch(also->at(s));
      }
    }
    const int64_t i = step - 2 * PROBE_AHEAD;
    if (i < 0 || i >= len) continue;
    // The guess holds the key: the first used slot that does. Else screen every tag match.
    if (at[i] >= 0 && table_keys[at[i]] != keys[i]) {
      at[i] = find_in_bucket(table_keys, tags, b1[i], W, keys[i], tg[i]);
      if (at[i] < 0) at[i] = find_in_bucket(table_keys, tags, b2[i], W, keys[i], tg[i]);
    }
    if constexpr (FREE) {
      if (at[i] < 0) {
        free_out[i] = pack_choice(free_slots_at(tags + b1[i], W), free_slots_at(tags + b2[i], W), id1[i], id2[i]);
      }
    }
  }
}

}  // namespace dynemb
