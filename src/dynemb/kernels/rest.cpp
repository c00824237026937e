// Native: the passes of BatchPlacement._place_rest for an index that cannot grow, in one call:
// cuckoo moves for the keys a first placement pass left (dyn_make_room), the batch's known slots
// followed through them (dyn_follow), the keys with room placed (dyn_place_free) and given row
// ids from the free list, again until every key is placed or no tried key got room. The same
// kernels in the same order as the Python loop it replaces, so the same slots, row ids and moves
// (docs/design/0045). M new keys (priority order), P pending, W slots per bucket.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

extern "C" int64_t dyn_make_room(int64_t*, int64_t, uint8_t*, void*, int64_t, int64_t, void*, int64_t, int64_t, int64_t, int64_t, const int64_t*,
                                 const int64_t*, const int64_t*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, bool*, bool*, int64_t*,
                                 int64_t*, int64_t, int64_t*, int64_t, int64_t*, int64_t);
extern "C" int64_t dyn_follow(const int64_t*, const int64_t*, int64_t, const int64_t*, const int64_t*, int64_t, int64_t);
extern "C" int64_t dyn_place_free(int64_t*, int64_t, uint8_t*, void*, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, const int64_t*,
                                  const int64_t*, const int64_t*, int64_t, int64_t*, int64_t*, int64_t*, int64_t*, int64_t, int64_t*, const int64_t*,
                                  const int64_t*, int64_t);

using namespace dynemb;

// As place.cpp: placement rounds a call of dyn_place_free may make.
static constexpr int MAX_ROUNDS = PLACEMENT_ROUNDS;
// As move.py: steps of moves one make_room call may report.
static constexpr int64_t MAX_STEPS = 8;

// Returns 0 when every pending key got a slot, 1 when a pass ended with no key to place (no
// hopeful pending key left to try, no free slot, or none of the tried keys got room: the caller
// goes on with displacement, then eviction), 2 when ``allocations`` has no room for another placement
// call (keys pending: the caller's loop goes on, and may call again), -1 when a kernel's output
// bound was exceeded (a bug: keys may have moved). ``out`` [4]: pending keys left, whether the
// moves were given up for the call (0 / 1), entries written to ``allocations``, keys placed.
extern "C" int64_t dyn_place_rest(
    int64_t* table_keys, int64_t key_step, uint8_t* tags,
    void* table_rows, int64_t row_bytes, int64_t row_step,
    void* table_scores, int64_t score_bytes, int64_t score_step,
    int64_t W, int64_t total_buckets,
    const int64_t* of_bucket, const int64_t* seg_counts, const int64_t* seg_offsets,  // segments, or null (one)
    const int64_t* keys, const int64_t* scores, const int64_t* seg,  // [M] the new keys, their scores, segments or null
    int64_t m,
    int64_t* pending, int64_t n_pending,  // [M] in/out: ranks waiting for a slot, ascending (the first n_pending)
    bool* waiting, bool* hopeful,         // [M] in/out: as _place_rest's
    int64_t* pos, int64_t n_pos,          // [U] in/out: the batch's slots, followed through the moves
    int64_t* new_pos,                     // [M] in/out: the new keys' slots (-1: none yet)
    int64_t free_slots,                   // empty slots of the index as the call starts
    int64_t depth,                        // the index's MOVE_DEPTH
    int64_t give_up,                      // its GIVE_UP: moves stop for the call after a pass that made room
                                          // for fewer than 1 in give_up of the keys tried
    const int64_t* free_ids, int64_t top, int64_t high_water,  // the free list (FreeList.reusable, high_water)
    int64_t* allocations, int64_t max_allocations,             // out: row ids taken by each placement round, in turn
    int64_t* seg_placed,                  // [S] or null (with seg): each segment's placed keys are added
    int64_t* seg_free,                    // [S] in/out or null (with seg): each segment's empty slots; the
                                          // pending keys of a segment with none are not tried (no move
                                          // leaves its segment, so none can make room for them)
    int64_t* out,                         // [4] out
    int64_t nthreads) {
  const IntCol slot_rows(table_rows, row_bytes, row_step);
  std::vector<int64_t> tried, tried_keys, tried_seg, to_place, place_keys, place_scores, place_seg;
  std::vector<int64_t> src, dst, steps(MAX_STEPS), place_pos, order, scratch;
  std::vector<char> room, stuck;
  int64_t n_alloc = 0, placed_total = 0, rounds[MAX_ROUNDS];
  bool gave_up = false;
  const int64_t arrays[2] = {reinterpret_cast<int64_t>(pos), reinterpret_cast<int64_t>(new_pos)};
  const int64_t lens[2] = {n_pos, m};
  auto finish = [&](int64_t code) {
    out[0] = n_pending;
    out[1] = gave_up;
    out[2] = n_alloc;
    out[3] = placed_total;
    return code;
  };
  for (;;) {
    // Room for one more placement call's allocations, else hand back (the caller's loop goes on).
    if (max_allocations - n_alloc < MAX_ROUNDS) return finish(2);
    to_place.clear();
    while (to_place.empty()) {
      // The hopeful pending keys, at most four times as many as there are free slots.
      tried.clear();
      // Keys of a full segment first lose hope (docs/design/0045, sixteenth session).
      if (seg && seg_free)
        for (int64_t k = 0; k < n_pending; ++k)
          if (seg_free[seg[pending[k]]] <= 0) hopeful[pending[k]] = false;
      for (int64_t k = 0; k < n_pending && static_cast<int64_t>(tried.size()) < 4 * free_slots; ++k)
        if (hopeful[pending[k]]) tried.push_back(pending[k]);
      const int64_t p = static_cast<int64_t>(tried.size());
      if (p == 0) break;
      room.assign(p, 0);
      stuck.assign(p, 1);
      if (free_slots > 0) {
        tried_keys.resize(p);
        tried_seg.resize(seg ? p : 0);
        for (int64_t i = 0; i < p; ++i) {
          tried_keys[i] = keys[tried[i]];
          if (seg) tried_seg[i] = seg[tried[i]];
        }
        const int64_t capacity = 2 * p * (W + 2);
        src.resize(capacity);
        dst.resize(capacity);
        int64_t n_out[2] = {0, 0};
        const int64_t s = dyn_make_room(table_keys, key_step, tags, table_rows, row_bytes, row_step, table_scores, score_bytes, score_step, W, total_buckets,
                                        of_bucket, seg_counts, seg_offsets, tried_keys.data(), seg ? tried_seg.data() : nullptr, p, depth, free_slots,
                                        reinterpret_cast<bool*>(room.data()), reinterpret_cast<bool*>(stuck.data()), src.data(), dst.data(), capacity,
                                        steps.data(), MAX_STEPS, n_out, nthreads);
        if (s < 0) return finish(-1);
        int64_t start = 0;
        for (int64_t step = 0; step < s; ++step) {
          if (steps[step]) dyn_follow(arrays, lens, 2, src.data() + start, dst.data() + start, steps[step], nthreads);
          start += steps[step];
        }
      }
      for (int64_t i = 0; i < p; ++i) {
        if (stuck[i]) hopeful[tried[i]] = false;
        if (room[i]) to_place.push_back(tried[i]);
      }
      if (static_cast<int64_t>(to_place.size()) * give_up < p) {
        // Few keys got room: the free slots left are hard to reach (as _place_rest).
        std::fill(hopeful, hopeful + m, false);
        gave_up = true;
      }
    }
    if (to_place.empty()) return finish(1);
    // The keys with room, in priority order (ascending ranks), placed by place.cpp's rule.
    const int64_t q = static_cast<int64_t>(to_place.size());
    place_keys.resize(q);
    place_scores.resize(q);
    place_seg.resize(seg ? q : 0);
    for (int64_t i = 0; i < q; ++i) {
      place_keys[i] = keys[to_place[i]];
      place_scores[i] = scores[to_place[i]];
      if (seg) place_seg[i] = seg[to_place[i]];
    }
    place_pos.resize(q);
    order.resize(q);
    scratch.resize(8 * q);
    const int64_t placed = dyn_place_free(table_keys, key_step, tags, table_scores, place_keys.data(), place_scores.data(), W, total_buckets, score_bytes,
                                          score_step, seg ? place_seg.data() : nullptr, seg_counts, seg_offsets, q, place_pos.data(), order.data(), rounds,
                                          scratch.data(), 8 * q, seg_placed, nullptr, nullptr, nthreads);
    if (placed < 0) return finish(-1);
    // One free-list allocation a round (FreeList.allocate: reused ids from the top of the stack,
    // then fresh ones), its ids to the round's slots ascending (put_rows).
    int64_t k = 0;
    for (int r = 0; r < MAX_ROUNDS && rounds[r]; ++r) {
      const int64_t n = rounds[r], reused = n < top ? n : top;
      for (int64_t j = 0; j < n; ++j, ++k) slot_rows.set(order[k], allocated_id(free_ids, top, high_water, reused, j));
      top -= reused;
      high_water += n - reused;
      allocations[n_alloc++] = n;
    }
    free_slots -= placed;
    placed_total += placed;
    for (int64_t i = 0; i < q; ++i) {
      if (place_pos[i] < 0) continue;
      new_pos[to_place[i]] = place_pos[i];
      waiting[to_place[i]] = false;
      if (seg && seg_free) --seg_free[place_seg[i]];
    }
    int64_t kept = 0;
    for (int64_t k2 = 0; k2 < n_pending; ++k2)
      if (waiting[pending[k2]]) pending[kept++] = pending[k2];
    n_pending = kept;
    if (n_pending == 0) return finish(0);
  }
}
