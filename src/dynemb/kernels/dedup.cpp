// Native twin of dedup.py's dedup_torch: the distinct (segment, key) pairs of a batch sorted by
// segment then key, the inverse of every input and each pair's count, in one hashing pass and a
// sort of the distinct pairs; optionally the inputs grouped by pair (a stable counting sort).
// N inputs, U distinct pairs.
#include <algorithm>
#include <vector>

#include "common.h"

using namespace dynemb;

// Returns U; unique / useg / counts get U entries, inverse N, order (if given) N.
extern "C" int64_t dyn_dedup(
    const int64_t* keys,  // [N]
    int64_t n,
    const int64_t* seg,   // [N] or null
    int64_t* unique,      // [N] out (first U used)
    int64_t* useg,        // [N] out with seg (first U used)
    int64_t* inverse,     // [N] out
    int64_t* counts,      // [N] out (first U used)
    int64_t* order,       // [N] out or null: inputs grouped by pair, each group in input order
    int64_t* scratch,     // [3 * cap] the hash table (the caller's reused buffer)
    int64_t cap,          // a power of two >= 2N
    int64_t nthreads) {
  (void)nthreads;
  if (n == 0) return 0;
  const uint64_t mask = static_cast<uint64_t>(cap - 1);
  // Open addressing on (key, segment): [id + 1 (0: empty), key, segment] per slot, together so
  // that a probe reads one cache line.
  int64_t* slots = scratch;
  for (int64_t h = 0; h < cap; ++h) slots[3 * h] = 0;
  std::vector<uint64_t> ukey;
  std::vector<int64_t> useg_of;
  ukey.reserve(n / 2 + 16);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = keys[i];
    const int64_t s = seg ? seg[i] : 0;
    uint64_t h = mix64(static_cast<uint64_t>(k) ^ (static_cast<uint64_t>(s) * 0x9E3779B97F4A7C15ULL)) & mask;
    for (;;) {
      int64_t* slot = slots + 3 * h;
      const int64_t id = slot[0] - 1;
      if (id < 0) {
        const int64_t fresh = static_cast<int64_t>(ukey.size());
        slot[0] = fresh + 1;
        slot[1] = k;
        slot[2] = s;
        inverse[i] = fresh;
        ukey.push_back(static_cast<uint64_t>(k));
        if (seg) useg_of.push_back(s);
        break;
      }
      if (slot[1] == k && slot[2] == s) {
        inverse[i] = id;
        break;
      }
      h = (h + 1) & mask;
    }
  }
  const int64_t u = static_cast<int64_t>(ukey.size());
  std::vector<int64_t> ids(u);
  for (int64_t id = 0; id < u; ++id) ids[id] = id;
  std::vector<uint64_t> sorted_key = ukey;
  radix_sort(sorted_key, ids);
  if (seg) {
    // Stable counting sort by segment (small non-negative ints) after the key sort.
    int64_t smax = 0;
    for (int64_t s : useg_of) smax = s > smax ? s : smax;
    std::vector<int64_t> start(smax + 2, 0);
    for (int64_t id : ids) ++start[useg_of[id] + 1];
    for (int64_t s = 0; s <= smax; ++s) start[s + 1] += start[s];
    std::vector<int64_t> by_seg(u);
    for (int64_t id : ids) by_seg[start[useg_of[id]]++] = id;
    ids.swap(by_seg);
  }
  std::vector<int64_t> rank(u);
  for (int64_t r = 0; r < u; ++r) {
    const int64_t id = ids[r];
    rank[id] = r;
    unique[r] = static_cast<int64_t>(ukey[id]);
    if (seg) useg[r] = useg_of[id];
    counts[r] = 0;
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = rank[inverse[i]];
    inverse[i] = r;
    ++counts[r];
  }
  if (order) {
    std::vector<int64_t> next(u);
    int64_t at = 0;
    for (int64_t r = 0; r < u; ++r) {
      next[r] = at;
      at += counts[r];
    }
    for (int64_t i = 0; i < n; ++i) order[next[inverse[i]]++] = i;
  }
  return u;
}
