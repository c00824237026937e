// Native: the new keys of an upsert under one clock value, placed, given row ids and put into
// the call's result in one call, from the missing keys as the probe left them (repeats
// included, in the call's order, for a find_or_insert). It gives the slots, row ids, free list and result of the
// plain-torch sequence it replaces in BatchPlacement._upsert (docs/design/0043): sort and
// de-duplicate the missing keys, place them (place.cpp's rule, docs/design/0006), hand out one
// allocation of row ids per round (each round's slots ascending), write the result.
//
// It need not sort the keys: a round's outcome depends only on the order of the keys within each
// bucket (priority order, here ascending key), so the round's keys are grouped by the bucket they
// try and ordered by key within it. Repeats of a key try the same bucket in every round (the
// same candidates, the same free slots at the round's start), so they meet in its group.
// m places of missing keys, B buckets, W slots per bucket.
#include <omp.h>

#include <algorithm>

#include "common.h"

extern "C" int64_t dyn_place_rest(int64_t*, int64_t, uint8_t*, void*, int64_t, int64_t, void*, int64_t, int64_t, int64_t, int64_t, const int64_t*,
                                  const int64_t*, const int64_t*, const int64_t*, const int64_t*, const int64_t*, int64_t, int64_t*, int64_t, bool*, bool*,
                                  int64_t*, int64_t, int64_t*, int64_t, int64_t, int64_t, const int64_t*, int64_t, int64_t, int64_t*, int64_t, int64_t*,
                                  int64_t*, int64_t*, int64_t);
extern "C" int64_t dyn_sort_unique(const int64_t*, int64_t, int64_t*, int64_t*, int64_t*, int64_t*, int64_t*, const int64_t*, int64_t*, int64_t*,
                                   int64_t*, int64_t);

using namespace dynemb;

static constexpr int MAX_ROUNDS = PLACEMENT_ROUNDS;
static constexpr int MAX_THREADS = 8;
// Groups whose lines are requested ahead of the one placed.
static constexpr int AHEAD = 16;
// Longest run of one bucket's entries ordered by insertion.
static constexpr int64_t SHORT_RUN = 32;
// Bits of an entry of the sort array below its bucket: the item.
static constexpr int ITEM_BITS = 32;
static constexpr uint64_t ITEM_MASK = (uint64_t(1) << ITEM_BITS) - 1;
// int64 entries of scratch per missing place (insert.py's SCRATCH_PER_KEY): 10 for the rounds,
// then REST_PER_KEY for the rest's passes (what the caller reads back when they leave keys).
static constexpr int64_t ROUNDS_PER_KEY = 10, REST_PER_KEY = 8;
static constexpr int64_t SCRATCH_PER_KEY = ROUNDS_PER_KEY + REST_PER_KEY;

namespace {

// An item as a round places it: its key, place and free-slot info side by side in 16 bytes.
// The first round's choice writes one per item, which the gather by bucket reads at random (one
// line an item); the gather writes one per entry of the round's order, which the placement reads
// in turn. 16 bytes, not the 24 of three int64 (perf-log, nineteenth session).
struct alignas(16) Rec {
  int64_t key;
  uint32_t place;  // < U <= UINT32_MAX
  uint32_t info;   // free slots | first free slot << 16 (each < 2^16: W <= PACKED_FREE_MAX_W);
                   // LEFT once the placement gave the entry no slot
};

constexpr uint32_t LEFT = ~uint32_t(0);  // no count is 0xFFFF (W <= PACKED_FREE_MAX_W)

inline int64_t info_count(uint32_t info) { return info & 0xFFFF; }
inline int64_t info_first(uint32_t info) { return info >> 16; }

constexpr uint64_t NONE = ~uint64_t(0) << ITEM_BITS;  // the bucket part of an item that tries none

// What phase (A) of a round reads and writes (see there), as plain pointers: a loop over them
// keeps them in registers, where the round's lambda reloaded each through its captures.
struct Share {
  const int64_t* keys;
  const int64_t* missing;
  const int64_t* tkey;
  const int64_t* tplace;
  const int64_t* pre_choice;
  const uint8_t* tags;
  int64_t W;
  const Candidates* cand;
  bool other;
  uint64_t span;  // ranges: (bucket * span) >> 32
  int rt;         // ranges of buckets (range rt: the items that try none)
  int64_t* info;
  Rec* rec;  // [m] (the first round): each item's key, place and info
  uint64_t* sort_buffer;
  int64_t* mine;  // [rt + 1] entries per range, added to
};

// Phase (A) for the round's items [lo, hi): the bucket each tries, from both candidates' free
// slots as the round starts, with the chosen bucket's free slots and first free slot (``info``)
// and the item's entry (bucket << ITEM_BITS | item, NONE where both are full). FIRST: the first
// round (item k is the place missing[k]; else tkey / tplace hold the round's items); GIVEN: the
// choices as the probe made them (pack_choice; the first round only).
template <bool FIRST, bool GIVEN>
void choose(const Share& sh, int64_t lo, int64_t hi) {
  const int64_t W = sh.W;
  const uint8_t* tags = sh.tags;
  int64_t per_range[MAX_THREADS + 1] = {};
  for (int64_t k = lo; k < hi; ++k) {
    int64_t c;
    if constexpr (GIVEN) {
      c = sh.pre_choice[sh.missing[k]];
    } else {
      const int64_t place = FIRST ? sh.missing[k] : sh.tplace[k];
      int64_t b1, b2;
      sh.cand->of(FIRST ? sh.keys[place] : sh.tkey[k], place, &b1, &b2);
      if (k + AHEAD < hi) {
        int64_t a1, a2;
        const int64_t ahead = FIRST ? sh.missing[k + AHEAD] : sh.tplace[k + AHEAD];
        sh.cand->of(FIRST ? sh.keys[ahead] : sh.tkey[k + AHEAD], ahead, &a1, &a2);
        __builtin_prefetch(tags + a1 * W);
        __builtin_prefetch(tags + a2 * W);
      }
      c = pack_choice(free_slots(tags, b1, W), free_slots(tags, b2, W), b1, b2, sh.other);
    }
    uint64_t entry = NONE | static_cast<uint64_t>(k);
    int range = sh.rt;
    uint32_t info = 0;
    if (c >= 0) {
      const uint64_t bucket = static_cast<uint64_t>(choice_bucket(c));
      entry = bucket << ITEM_BITS | static_cast<uint64_t>(k);
      info = static_cast<uint32_t>(choice_count(c) | choice_first(c) << 16);
      range = static_cast<int>((bucket * sh.span) >> 32);
    }
    if constexpr (FIRST) {
      const int64_t place = sh.missing[k];
      sh.rec[k] = Rec{sh.keys[place], static_cast<uint32_t>(place), info};
    } else {
      sh.info[k] = info;
    }
    sh.sort_buffer[k] = entry;
    ++per_range[range];
  }
  for (int r = 0; r <= sh.rt; ++r) sh.mine[r] += per_range[r];
}

}  // namespace

// Returns the number of places left without a slot (0: every new key placed), or -1 when the
// scratch is too small or m too large. ``rounds`` gets the slots each round took (the free
// list's allocations to commit, in turn).
//
// With ``rest`` (an index that cannot grow), the places left go on here to the passes of
// rest.cpp, as BatchPlacement._upsert would hand them to BatchPlacement._place_rest: the new
// keys among them (each once, in priority order: the places' order for distinct keys, else by
// key) by cuckoo moves and free slots. ``tail`` [6] then gets the rest's code (0: every key
// placed, and the result written at every left place; else as dyn_place_rest's, the caller
// going on from the state below), the new keys M, the ranks still pending, whether the moves
// were given up for the call, the allocations written and the keys placed. The state, in the
// scratch from ROUNDS_PER_KEY * m on: [M] the new keys, [M] the first place of each, [n] the
// new key of each left place (with repeats), [M] their slots (-1: none), [M] the ranks pending
// (the first tail[2]), [M] scores, [M] segments (with seg), then [M] waiting and [M] hopeful
// flags (bytes). Without ``rest``, tail[0] is -2.
extern "C" int64_t dyn_insert_new(
    int64_t* table_keys,         // [B, W]
    int64_t key_step,            // elements from one slot's key to the next (1, or 2 packed)
    uint8_t* tags,               // [B, W] tags: 0 where empty, else the slot key's tag
    void* table_scores,          // [B, W] int32 or int64
    int64_t W, int64_t total_buckets,
    int64_t score_bytes,         // 4 or 8
    int64_t score_step,          // elements from one slot's score to the next (1, or 4 packed)
    void* table_rows,            // [B, W] row ids, int32 or int64
    int64_t row_bytes,
    int64_t row_step,            // elements from one slot's row id to the next (1, or 4 packed)
    const int64_t* keys,         // [U] the call's keys
    const int64_t* seg,          // [U] their segments, or null (one segment)
    const int64_t* seg_counts,   // [S] buckets of each segment (with seg or of_bucket)
    const int64_t* seg_offsets,  // [S] first bucket of each segment (with seg or of_bucket)
    const int64_t* missing,      // [m] places in keys of the missing keys (repeats allowed)
    int64_t m,
    int64_t score,               // the call's score, every new key's
    const int64_t* pre_choice,   // [U] or null: pack_choice of each place's candidates, as the probe read them
    const int64_t* free_ids,     // [top] the free list's reusable ids, the next allocation's from the end
    int64_t top,
    int64_t high_water,          // the free list's first never-used id
    int64_t* pos,                // [U] out at the places of new keys placed: their slots
    int64_t* rows,               // [U] out there: their row ids
    int64_t* rounds,             // [MAX_ROUNDS] out: slots taken in each round (0 after the last)
    int64_t* seg_placed,         // [S] or null (with seg, whose keys must not repeat): each
                                 // segment's placed keys are added
    int64_t* left_out,           // [m] out or null: the places left without a slot, in
                                 // ``missing``'s order (the first n of them, n returned)
    int64_t* scratch,            // [SCRATCH_PER_KEY * m] the caller's reused buffer
    int64_t cap,                 // its size
    int64_t nthreads,
    int64_t n_keys,              // U
    int64_t repeats,             // 1: ``missing`` may repeat a key (one segment); 0: its keys are distinct, in priority order
    int64_t rest,                // 1: the places left go on to the rest's passes (see above)
    const int64_t* of_bucket,    // (with rest) [B] the segment of each bucket, or null (one segment)
    int64_t empty_slots,         // (with rest) the index's empty slots as the call starts
    int64_t depth, int64_t give_up,                   // (with rest) as dyn_place_rest's
    int64_t* allocations, int64_t max_allocations,    // (with rest) out: the row ids each of its placement rounds took
    int64_t* seg_free,           // (with rest and seg) [S] in/out: each segment's empty slots, as dyn_place_rest's
    int64_t* tail) {             // [6] out (see above)
  for (int r = 0; r < MAX_ROUNDS; ++r) rounds[r] = 0;
  tail[0] = -2;
  if (m == 0) return 0;
  if (reinterpret_cast<uintptr_t>(scratch) % alignof(Rec)) return -1;
  // (W: a round's choices pack as pack_choice does.)
  if (W > PACKED_FREE_MAX_W || cap < SCRATCH_PER_KEY * m || m > static_cast<int64_t>(ITEM_MASK) || n_keys > static_cast<int64_t>(UINT32_MAX) || total_buckets >= (int64_t(1) << (64 - ITEM_BITS - 1))) return -1;
  // A round's items are numbered k = 0, 1, ... (in the first round k is the item t, the place
  // missing[t]). Per k: as the round starts, the free slots of the bucket it tries and the first
  // of them (``info``, as a Rec's); in a round after the first, its item (``item``),
  // key and place (``tkey``, ``tplace``), carried from the round before in its order, so that
  // no round reads ``missing`` or ``keys`` at random (perf-log, fifteenth session).
  int64_t *info = scratch, *item = info + m;
  // Per entry of the round's ``order`` (the k that try a bucket, by bucket, then key): its key,
  // place and info (``erec``, 16-byte aligned: the scratch is, and 4 m int64 precede it).
  uint64_t* order = reinterpret_cast<uint64_t*>(item + m);
  uint64_t* sort_buffer = order + m;
  Rec* erec = reinterpret_cast<Rec*>(sort_buffer + m);
  int64_t *tkey = reinterpret_cast<int64_t*>(erec + m), *tplace = tkey + m, *next_item = tplace + m;
  // The items that tried no bucket in a round: both candidates were full, as they stay for
  // every later round (placing only takes slots), so they wait no more rounds.
  int64_t* dead = next_item + m;
  int64_t n_dead = 0;
  // The first round's records, in the rest's part of the scratch (used only after the rounds),
  // aligned to their size.
  Rec* rec = reinterpret_cast<Rec*>((reinterpret_cast<uintptr_t>(scratch + ROUNDS_PER_KEY * m) + alignof(Rec) - 1) & ~uintptr_t(alignof(Rec) - 1));
  const KeyCol slot_keys(table_keys, key_step);
  const IntCol slot_scores(table_scores, score_bytes, score_step);
  const IntCol slot_rows(table_rows, row_bytes, row_step);
  const bool packed = same_record(slot_keys, slot_scores) && same_record(slot_keys, slot_rows);
  const Candidates cand{seg, seg_counts, seg_offsets, total_buckets};
  int nt = threads(nthreads, m, 2048);
  if (nt > MAX_THREADS) nt = MAX_THREADS;
  auto bucket_of_entry = [](uint64_t entry) -> int64_t { return static_cast<int64_t>(entry >> ITEM_BITS); };
  int64_t n_todo = m;
  int round_no = 0;

  // Entries [g, e) of one bucket in key order, their arrays with them: by insertion for the
  // few new keys a bucket usually gets, else through a sorted permutation (keys crowding one
  // bucket must not cost a quadratic sort).
  auto sort_run = [&](int64_t g, int64_t e) {
    if (e - g > SHORT_RUN) {
      std::vector<int64_t> perm(e - g);
      for (int64_t i = 0; i < e - g; ++i) perm[i] = g + i;
      std::sort(perm.begin(), perm.end(), [&](int64_t a, int64_t b) { return erec[a].key < erec[b].key; });
      const std::vector<uint64_t> o(order + g, order + e);
      const std::vector<Rec> r(erec + g, erec + e);
      for (int64_t i = 0; i < e - g; ++i) {
        const int64_t from = perm[i] - g;
        order[g + i] = o[from];
        erec[g + i] = r[from];
      }
      return;
    }
    for (int64_t i = g + 1; i < e; ++i) {
      const uint64_t o = order[i];
      const Rec r = erec[i];
      int64_t j = i;
      for (; j > g && erec[j - 1].key > r.key; --j) {
        order[j] = order[j - 1];
        erec[j] = erec[j - 1];
      }
      order[j] = o;
      erec[j] = r;
    }
  };

  auto one_round = [&](bool halve, bool other) -> int64_t {
    const bool given = pre_choice && round_no == 0;
    const int rt = n_todo >= 2048 ? nt : 1;
    // Thread r's buckets: the r-th of rt spans of the bucket ids (multiply-shift, as place.cpp);
    // range rt holds the items that try no bucket this round.
    const uint64_t span = (static_cast<uint64_t>(rt) << 32) / static_cast<uint64_t>(total_buckets);
    auto range_of = [&](uint64_t entry) -> int {
      return (entry & NONE) == NONE ? rt : static_cast<int>((static_cast<uint64_t>(bucket_of_entry(entry)) * span) >> 32);
    };
    int64_t count[MAX_THREADS][MAX_THREADS + 1] = {}, start[MAX_THREADS + 2], placed_in[MAX_THREADS + 1], left_in[MAX_THREADS + 1];
    placed_in[0] = left_in[0] = 0;
#pragma omp parallel num_threads(rt)
    {
      const int a = omp_get_thread_num();
      const int64_t chunk = (n_todo + rt - 1) / rt, lo = a * chunk, hi = lo + chunk < n_todo ? lo + chunk : n_todo;
      // This share's entries per range, counted on the thread's own stack: the shared table's
      // rows of two threads may share a cache line, which a count per item would bounce.
      int64_t mine[MAX_THREADS + 1] = {};
      // (A) The bucket each item of this thread's share tries, from both candidates' free slots
      // as the round starts (in the first round as the probe read them).
      const Share share{keys, missing, tkey, tplace, pre_choice, tags, W, &cand, other, span, rt, info, rec, sort_buffer, mine};
      if (round_no > 0)
        choose<false, false>(share, lo, hi);
      else if (given)
        choose<true, true>(share, lo, hi);
      else
        choose<true, false>(share, lo, hi);
      for (int r = 0; r <= rt; ++r) count[a][r] = mine[r];
#pragma omp barrier
#pragma omp single
      {
        // Each range's entries, shares in turn (range rt last): where each share writes them.
        int64_t at = 0;
        for (int r = 0; r <= rt; ++r) {
          start[r] = at;
          for (int q = 0; q < rt; ++q) {
            const int64_t c = count[q][r];
            count[q][r] = at;
            at += c;
          }
        }
        start[rt + 1] = at;
      }
      for (int r = 0; r <= rt; ++r) mine[r] = count[a][r];
      for (int64_t k = lo; k < hi; ++k) order[mine[range_of(sort_buffer[k])]++] = sort_buffer[k];
#pragma omp barrier
      // (B) Thread r's range by bucket, by key within a bucket (repeats side by side), with each
      // entry's key, place and free slots beside it.
      const int r = a;
      const int64_t elo = start[r], ehi = start[r + 1];
      // By bucket: the bits above the item's (radix_sort_bits, stable).
      radix_sort_bits(order + elo, sort_buffer + elo, ehi - elo, 0, ITEM_BITS, static_cast<uint64_t>(total_buckets - 1));
      // Each bucket's keys in key order as its last entry arrives, and how many the range
      // places: each bucket's distinct keys, up to the round's limit (under the limit a bucket
      // has a free slot for each: the limit is at most its free slots).
      int64_t placed = 0, g = elo;
      auto close_bucket = [&](int64_t e) {  // entries [g, e) are one bucket's
        if (e - g > 1) sort_run(g, e);
        int64_t distinct = 1;
        for (int64_t q = g + 1; q < e; ++q) distinct += erec[q].key != erec[q - 1].key;
        const int64_t free_at_start = info_count(erec[g].info);
        const int64_t limit = halve ? (free_at_start + 1) / 2 : free_at_start;
        placed += distinct < limit ? distinct : limit;
        g = e;
      };
      auto bucket_ends = [&](int64_t e) { return e + 1 == ehi || bucket_of_entry(order[e + 1]) != bucket_of_entry(order[e]); };
      if (round_no == 0) {
        for (int64_t e = elo; e < ehi; ++e) {
          if (e + AHEAD < ehi) __builtin_prefetch(rec + (order[e + AHEAD] & ITEM_MASK));
          erec[e] = rec[order[e] & ITEM_MASK];
          if (bucket_ends(e)) close_bucket(e + 1);
        }
      } else {
        for (int64_t e = elo; e < ehi; ++e) {
          if (e + AHEAD < ehi) {
            const int64_t ahead = static_cast<int64_t>(order[e + AHEAD] & ITEM_MASK);
            __builtin_prefetch(tplace + ahead);
            __builtin_prefetch(tkey + ahead);
            __builtin_prefetch(info + ahead);
          }
          const int64_t k = static_cast<int64_t>(order[e] & ITEM_MASK);
          erec[e] = Rec{tkey[k], static_cast<uint32_t>(tplace[k]), static_cast<uint32_t>(info[k])};
          if (bucket_ends(e)) close_bucket(e + 1);
        }
      }
      placed_in[r + 1] = placed;
#pragma omp barrier
#pragma omp single
      for (int q = 0; q < rt; ++q) placed_in[q + 1] += placed_in[q];
      // (C) Place the range's buckets in turn: the j-th distinct key of a bucket takes its j-th
      // free slot while j is under the round's limit. The round's slots ascending (the ranges in
      // turn) get one free-list allocation: reused ids from the end of the stack first, then
      // fresh ones.
      const int64_t total = placed_in[rt], reused = total < top ? total : top;
      int64_t k = placed_in[r], unplaced = 0;
      for (int64_t g = elo; g < ehi;) {
        if (g + AHEAD < ehi) {
          const int64_t ahead = bucket_of_entry(order[g + AHEAD]) * W, likely = ahead + info_first(erec[g + AHEAD].info);
          __builtin_prefetch(tags + ahead, 1);
          __builtin_prefetch(slot_keys.at(likely), 1);
          // The result's entries it writes (at random places of the call).
          __builtin_prefetch(pos + erec[g + AHEAD].place, 1);
          __builtin_prefetch(rows + erec[g + AHEAD].place, 1);
          if (!packed) {
            __builtin_prefetch(slot_scores.at(likely), 1);
            __builtin_prefetch(slot_rows.at(likely), 1);
          }
        }
        const int64_t b = bucket_of_entry(order[g]);
        const int64_t free_at_start = info_count(erec[g].info);
        const int64_t limit = halve ? (free_at_start + 1) / 2 : free_at_start;
        int64_t taken = 0, e = g;
        // The bucket's empty slots as a mask, read once (its j-th key takes the j-th): no load
        // of the tag line behind the store of the key before (buckets of up to MASK_SLOTS slots).
        uint64_t empty = W <= MASK_SLOTS && limit ? free_mask_at(tags + b * W, W) : 0;
        while (e < ehi && bucket_of_entry(order[e]) == b) {
          // One distinct key: entries [e, f) hold it.
          const int64_t key = erec[e].key;
          int64_t f = e + 1;
          while (f < ehi && bucket_of_entry(order[f]) == b && erec[f].key == key) ++f;
          int64_t slot = -1;
          if (taken < limit) {
            if (W <= MASK_SLOTS) {
              slot = b * W + __builtin_ctzll(empty);
              empty &= empty - 1;
            } else {
              slot = b * W + free_slots(tags, b, W).first;
            }
            write_slot(slot_keys, tags, slot_scores, slot, key, score);
            const int64_t id = allocated_id(free_ids, top, high_water, reused, k);
            slot_rows.set(slot, id);
            ++k;
            ++taken;
            for (int64_t q = e; q < f; ++q) {
              pos[erec[q].place] = slot;
              rows[erec[q].place] = id;
            }
          } else {
            for (int64_t q = e; q < f; ++q) erec[q].info = LEFT;
            unplaced += f - e;
          }
          e = f;
        }
        g = e;
      }
      // The range's entries that got no slot go on to the next round, each with its item, key
      // and place (the ranges in turn).
      left_in[r + 1] = unplaced;
#pragma omp barrier
#pragma omp single
      for (int q = 0; q < rt; ++q) left_in[q + 1] += left_in[q];
      int64_t at = left_in[r];
      for (int64_t e = elo; e < ehi; ++e) {
        if (erec[e].info != LEFT) continue;
        const int64_t k_e = static_cast<int64_t>(order[e] & ITEM_MASK);
        next_item[at] = round_no == 0 ? k_e : item[k_e];
        tkey[at] = erec[e].key;
        tplace[at] = erec[e].place;
        ++at;
      }
    }
    const int64_t taken = placed_in[rt], reused = taken < top ? taken : top;
    top -= reused;
    high_water += taken - reused;
    rounds[round_no++] = taken;
    // The items that tried no bucket wait no more.
    for (int64_t e = start[rt]; e < start[rt + 1]; ++e) {
      const int64_t k = static_cast<int64_t>(order[e] & ITEM_MASK);
      dead[n_dead++] = round_no == 1 ? k : item[k];  // round_no was advanced above
    }
    std::swap(item, next_item);
    n_todo = left_in[rt];
    return taken;
  };

  // The places left (``left`` [n], ascending) through the rest's passes (see above), ``placed``
  // keys having been placed by the rounds.
  auto pass_rest = [&](const int64_t* left, int64_t n, bool sort_keys, int64_t* state, int64_t m_cap, int64_t placed) {
    int64_t *new_keys = state, *first = new_keys + m_cap, *spread = first + m_cap, *new_pos = spread + m_cap;
    int64_t *pending = new_pos + m_cap, *new_scores = pending + m_cap, *new_seg = new_scores + m_cap;
    bool* waiting = reinterpret_cast<bool*>(new_seg + m_cap);
    bool* hopeful = waiting + m_cap;
    int64_t M = 0;
    if (sort_keys) {
      // The distinct keys ascending (priority order under one clock value), each at its first
      // place; spread: each place's key. The kernel of sort_unique_first_native, which the
      // caller ran on these places before (dedup.cpp).
      std::vector<int64_t> left_keys(n), counts(n), at(n), sort_scratch(2 * n);
      for (int64_t j = 0; j < n; ++j) left_keys[j] = keys[left[j]];
      M = dyn_sort_unique(left_keys.data(), n, new_keys, spread, counts.data(), nullptr, sort_scratch.data(), nullptr, nullptr, nullptr, at.data(), nthreads);
      for (int64_t i = 0; i < M; ++i) first[i] = left[at[i]];
    } else {
      for (int64_t j = 0; j < n; ++j) {
        new_keys[j] = keys[left[j]];
        first[j] = left[j];
        spread[j] = j;
      }
      M = n;
    }
    for (int64_t i = 0; i < M; ++i) {
      new_pos[i] = -1;
      pending[i] = i;
      new_scores[i] = score;
      waiting[i] = hopeful[i] = true;
      if (seg) new_seg[i] = seg[first[i]];
    }
    int64_t out[4] = {0, 0, 0, 0};
    const int64_t code = dyn_place_rest(table_keys, key_step, tags, table_rows, row_bytes, row_step, table_scores, score_bytes, score_step, W, total_buckets,
                                        of_bucket, seg_counts, seg_offsets, new_keys, new_scores, seg ? new_seg : nullptr, M,
                                        pending, M, waiting, hopeful, pos, n_keys, new_pos, empty_slots - placed, depth, give_up, free_ids, top, high_water,
                                        allocations, max_allocations, seg_placed, seg_free, out, nthreads);
    if (code == 0)
      // Every left place's slot and row id into the result.
      for (int64_t j = 0; j < n; ++j) {
        const int64_t p = new_pos[spread[j]];
        pos[left[j]] = p;
        rows[left[j]] = slot_rows.get(p);
      }
    tail[0] = code;
    tail[1] = M;
    tail[2] = out[0];
    tail[3] = out[1];
    tail[4] = out[2];
    tail[5] = out[3];
  };

  placement_rounds(one_round, n_todo);
  // Each segment's placed keys (with segments every key comes once: a placed place has a slot).
  if (seg && seg_placed)
    for (int64_t t = 0; t < m; ++t)
      if (pos[missing[t]] >= 0) {
        ++seg_placed[seg[missing[t]]];
        if (seg_free) --seg_free[seg[missing[t]]];
      }
  // The items left (those of no round, then those the last round left), in missing's order.
  const int64_t n_left = n_dead + n_todo;
  if (left_out && n_left) {
    std::copy(item, item + n_todo, dead + n_dead);
    std::sort(dead, dead + n_left);
    for (int64_t k = 0; k < n_left; ++k) left_out[k] = missing[dead[k]];
  }
  if (rest && n_left && left_out) {
    int64_t placed = 0;
    for (int r = 0; r < MAX_ROUNDS; ++r) placed += rounds[r];
    pass_rest(left_out, n_left, repeats != 0, scratch + ROUNDS_PER_KEY * m, m, placed);
  }
  return n_left;
}
