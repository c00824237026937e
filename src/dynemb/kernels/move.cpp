// Native twin of BatchPlacement._move_out (Mover): free one slot in each full bucket of a list by moving
// one of its keys to that key's other candidate bucket (the one with most free slots, ties: lower
// slot), several keys heading for one bucket taking its free slots in turn; with depth > 1, the
// buckets none of whose keys could move first get room made in their keys' other buckets
// (recursively), then try again. Q buckets, W slots per bucket. ``dyn_make_room`` is the twin of
// BatchPlacement._make_room around it: P pending keys in, whether each has room now out.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "common.h"

using namespace dynemb;

namespace {

// Buckets whose lines are requested ahead of the one being read.
constexpr int64_t AHEAD = 4;
// Full buckets a thread takes at least: a parallel region costs a few microseconds.
constexpr int64_t MIN_PER_THREAD = 256;

struct Mover {
  KeyCol keys;
  uint8_t* tags;  // [B, W] 0 where empty, else the slot key's tag
  IntCol rows, scores;
  int64_t W, total;
  const int64_t* of_bucket;  // [B] segment of each bucket, or null
  const int64_t* seg_counts;
  const int64_t* seg_offsets;
  int64_t nthreads;
  std::vector<int64_t> src_all, dst_all, steps;

  int64_t free_in(int64_t b) const { return dynemb::free_in(tags, b, W); }

  // The other candidate of the key at a slot of bucket ``own`` (== own when both coincide).
  int64_t other(int64_t key, int64_t own) const {
    int64_t nb = total, off = 0;
    if (of_bucket) {
      const int64_t s = of_bucket[own];
      nb = seg_counts[s];
      off = seg_offsets[s];
    }
    const uint64_t m = mix64(static_cast<uint64_t>(key));
    const int64_t r1 = bucket_of(m, nb) + off, r2 = bucket_of(mix64(m), nb) + off;
    return r1 == own ? r2 : r1;
  }

  void copy_slot(int64_t from, int64_t to) {
    keys[to] = keys[from];
    rows.move(from, to);
    scores.move(from, to);
  }

  std::vector<int64_t> move_out(const std::vector<int64_t>& buckets, int64_t depth, int64_t deep_limit) {
    // Three passes, each requesting AHEAD buckets ahead the random lines the next needs: the
    // buckets' tags, then the full ones' keys (their other buckets), then those buckets' tags.
    const int64_t Q = static_cast<int64_t>(buckets.size());
    std::vector<int64_t> full;
    for (int64_t q = 0; q < Q; ++q) {
      if (q + AHEAD < Q) __builtin_prefetch(tags + buckets[q + AHEAD] * W);
      if (free_in(buckets[q]) == 0) full.push_back(buckets[q]);
    }
    const int64_t F = static_cast<int64_t>(full.size());
    if (F == 0) return full;
    // Every resident's other bucket and its free slots, on the state as the call starts (reads
    // only: the full buckets are shared among the threads).
    std::vector<int64_t> alt(F * W), best(F), best_free(F);
#pragma omp parallel num_threads(threads(nthreads, F, MIN_PER_THREAD))
    {
#pragma omp for schedule(static)
      for (int64_t f = 0; f < F; ++f) {
        if (f + AHEAD < F) prefetch_span<0>(keys.at(full[f + AHEAD] * W), keys.at(full[f + AHEAD] * W + W - 1));
        for (int64_t j = 0; j < W; ++j) alt[f * W + j] = other(keys[full[f] * W + j], full[f]);
      }
#pragma omp for schedule(static)
      for (int64_t f = 0; f < F; ++f) {
        if (f + AHEAD < F)
          for (int64_t j = 0; j < W; ++j) __builtin_prefetch(tags + alt[(f + AHEAD) * W + j] * W);
        best_free[f] = -1;
        for (int64_t j = 0; j < W; ++j) {
          const int64_t a = alt[f * W + j];
          const int64_t fa = a == full[f] ? 0 : free_in(a);
          if (fa > best_free[f]) {
            best_free[f] = fa;
            best[f] = j;
          }
        }
      }
    }
    // Movable keys by target bucket (stable), each taking its target's first free slot now,
    // which is the twin's rank-th free slot of the call's starting state.
    // (target, f) pairs: sorted as pairs, ties in f's order (no two pairs are equal).
    std::vector<std::pair<int64_t, int64_t>> movable;
    for (int64_t f = 0; f < F; ++f)
      if (best_free[f] > 0) movable.emplace_back(alt[f * W + best[f]], f);
    std::sort(movable.begin(), movable.end());
    int64_t n_moves = 0;
    for (const auto& [target, f] : movable) {
      int64_t dst = -1;
      for (int64_t j = 0; j < W && dst < 0; ++j)
        if (!tags[target * W + j]) dst = target * W + j;
      if (dst < 0) continue;
      const int64_t src = full[f] * W + best[f];
      copy_slot(src, dst);
      tags[dst] = tags[src];
      tags[src] = 0;
      src_all.push_back(src);
      dst_all.push_back(dst);
      ++n_moves;
    }
    steps.push_back(n_moves);
    std::vector<int64_t> stuck;
    for (int64_t f = 0; f < F; ++f)
      if (best_free[f] <= 0) stuck.push_back(f);
    if (depth > 1 && deep_limit > 0 && !stuck.empty()) {
      const int64_t n_explore = std::min<int64_t>(deep_limit, static_cast<int64_t>(stuck.size()));
      std::vector<int64_t> explore, deeper;
      for (int64_t t = 0; t < n_explore; ++t) {
        const int64_t f = stuck[t];
        explore.push_back(full[f]);
        for (int64_t j = 0; j < W; ++j)
          if (alt[f * W + j] != full[f]) deeper.push_back(alt[f * W + j]);
      }
      std::sort(deeper.begin(), deeper.end());
      deeper.erase(std::unique(deeper.begin(), deeper.end()), deeper.end());
      if (!deeper.empty()) {
        move_out(deeper, depth - 1, deep_limit);
        std::vector<int64_t> out = move_out(explore, 1, 0);
        for (int64_t t = n_explore; t < static_cast<int64_t>(stuck.size()); ++t) out.push_back(full[stuck[t]]);
        return out;
      }
    }
    std::vector<int64_t> out;
    for (int64_t f : stuck) out.push_back(full[f]);
    return out;
  }
};

}  // namespace

// The twin of BatchPlacement._make_room (the caller has checked that the index has a free slot):
// the candidates of P pending keys, their distinct buckets ascending moved out of (the twin of
// BatchPlacement._move_out, up to ``depth`` moves in a chain and ``deep_limit`` buckets explored
// one level deeper), then for each key whether one of its buckets has a free slot now
// (``room``) and, where none has, whether no key of either bucket could move (``stuck``).
// Returns the number of steps of moves: ``src`` / ``dst`` get the moves, ``steps`` how many each
// invocation of the move-out made (one entry per invocation that found a full bucket, in call
// order, as the twin appends them), ``n_out`` [2] the number of moves and of steps (-1: more moves
// than ``capacity`` or steps than ``max_steps``, a bug).
extern "C" int64_t dyn_make_room(
    int64_t* table_keys, int64_t key_step, uint8_t* tags,
    void* table_rows, int64_t row_bytes, int64_t row_step, void* table_scores, int64_t score_bytes, int64_t score_step,
    int64_t W, int64_t total_buckets,
    const int64_t* of_bucket, const int64_t* seg_counts, const int64_t* seg_offsets,
    const int64_t* keys, const int64_t* seg, int64_t p,  // [P] pending keys, their segments or null
    int64_t depth, int64_t deep_limit,
    bool* room, bool* stuck,             // [P] out
    int64_t* src, int64_t* dst,          // [capacity] out
    int64_t capacity,
    int64_t* steps, int64_t max_steps,   // out
    int64_t* n_out,                      // [2] out
    int64_t nthreads) {
  Mover m{KeyCol(table_keys, key_step), tags, IntCol(table_rows, row_bytes, row_step), IntCol(table_scores, score_bytes, score_step), W, total_buckets,
          of_bucket, seg_counts, seg_offsets, nthreads, {}, {}, {}};
  const Candidates cand{seg, seg_counts, seg_offsets, total_buckets};
  std::vector<int64_t> b1(p), b2(p), needy(2 * p);
  for (int64_t i = 0; i < p; ++i) {
    cand.of(keys[i], i, &b1[i], &b2[i]);
    needy[2 * i] = b1[i];
    needy[2 * i + 1] = b2[i];
  }
  std::sort(needy.begin(), needy.end());
  needy.erase(std::unique(needy.begin(), needy.end()), needy.end());
  std::vector<int64_t> out = m.move_out(needy, depth, deep_limit);
  std::sort(out.begin(), out.end());
  auto is_stuck = [&](int64_t b) { return std::binary_search(out.begin(), out.end(), b); };
  for (int64_t i = 0; i < p; ++i) {
    room[i] = m.free_in(b1[i]) > 0 || m.free_in(b2[i]) > 0;
    stuck[i] = !room[i] && is_stuck(b1[i]) && is_stuck(b2[i]);
  }
  const int64_t n_moves = static_cast<int64_t>(m.src_all.size()), n_steps = static_cast<int64_t>(m.steps.size());
  if (n_moves > capacity || n_steps > max_steps) return -1;
  std::copy(m.src_all.begin(), m.src_all.end(), src);
  std::copy(m.dst_all.begin(), m.dst_all.end(), dst);
  std::copy(m.steps.begin(), m.steps.end(), steps);
  n_out[0] = n_moves;
  n_out[1] = n_steps;
  return n_steps;
}

// Positions after one step of moves (follow_torch's loop body), in each of ``count`` arrays
// (``arrays[a]``: the address of an int64 array of ``lens[a]`` positions): each position equal
// to a moved slot src[k] becomes dst[k]; the others, and -1, stay. ``src`` are distinct slots
// (>= 0); they go into an open-addressing table of at least 2m entries, built once for all the
// arrays; each position is looked up there when a bit set of the moved slots' hashes (about 64
// bits a move) says it may be one of them.
extern "C" int64_t dyn_follow(const int64_t* arrays, const int64_t* lens, int64_t count, const int64_t* src, const int64_t* dst, int64_t m,
                              int64_t nthreads) {
  if (m == 0) return 0;
  int64_t size = 1;
  while (size < 2 * m) size <<= 1;
  const int64_t mask = size - 1, bit_mask = 32 * size - 1;
  std::vector<int64_t> from(size, -1), to(size);
  std::vector<uint64_t> bits(size / 2, 0);
  for (int64_t k = 0; k < m; ++k) {
    const uint64_t x = mix64(static_cast<uint64_t>(src[k]));
    const int64_t b = static_cast<int64_t>(x >> 32) & bit_mask;
    bits[b >> 6] |= uint64_t(1) << (b & 63);
    int64_t h = static_cast<int64_t>(x & mask);
    while (from[h] >= 0 && from[h] != src[k]) h = (h + 1) & mask;
    from[h] = src[k];
    to[h] = dst[k];
  }
  for (int64_t a = 0; a < count; ++a) {
    int64_t* positions = reinterpret_cast<int64_t*>(arrays[a]);
    const int64_t n = lens[a];
#pragma omp parallel for schedule(static) num_threads(threads(nthreads, n, 16384))
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = positions[i];
      if (p < 0) continue;
      const uint64_t x = mix64(static_cast<uint64_t>(p));
      const int64_t b = static_cast<int64_t>(x >> 32) & bit_mask;
      if (!((bits[b >> 6] >> (b & 63)) & 1)) continue;
      for (int64_t h = static_cast<int64_t>(x & mask); from[h] >= 0; h = (h + 1) & mask) {
        if (from[h] == p) {
          positions[i] = to[h];
          break;
        }
      }
    }
  }
  return 0;
}
