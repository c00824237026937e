// Native twin of dedup.py's dedup_torch: the distinct (segment, key) pairs of a batch sorted by
// segment then key, the inverse of every input and each pair's count, in one hashing pass and a
// sort of the distinct pairs; optionally the inputs grouped by pair (a stable counting sort).
// N inputs, U distinct pairs.
#include <omp.h>

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

// The distinct keys of a batch (no segments) by sorting: one stable most-significant-digit pass
// on (key - min) into about N / 4 buckets, then a sort of each bucket by (key, input index).
// Same outputs as dyn_dedup without segments; faster on both random and skewed batches (the
// hash table's random probes and one thread were dyn_dedup's cost). Parallel in every pass.
namespace {
struct Pair {
  int64_t key;
  int64_t idx;
};

// Sort a bucket stably by key (its pairs come in input order): insertion sort when small, else
// a stable most-significant-digit pass on the bucket's own key range and the same on each part
// (a part of equal keys, such as a hot key's copies, is done at once).
void sort_bucket(Pair* p, int64_t len, std::vector<Pair>& tmp) {
  if (len <= 32) {
    for (int64_t i = 1; i < len; ++i) {
      const Pair x = p[i];
      int64_t j = i;
      while (j > 0 && p[j - 1].key > x.key) {
        p[j] = p[j - 1];
        --j;
      }
      p[j] = x;
    }
    return;
  }
  int64_t lo = p[0].key, hi = p[0].key;
  for (int64_t i = 1; i < len; ++i) {
    lo = p[i].key < lo ? p[i].key : lo;
    hi = p[i].key > hi ? p[i].key : hi;
  }
  if (lo == hi) return;
  const uint64_t range = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
  const int bits = 64 - __builtin_clzll(range);
  const int shift = bits > 8 ? bits - 8 : 0;
  int64_t start[257] = {0};
  for (int64_t i = 0; i < len; ++i) ++start[((static_cast<uint64_t>(p[i].key) - static_cast<uint64_t>(lo)) >> shift) + 1];
  for (int d = 0; d < 256; ++d) start[d + 1] += start[d];
  tmp.resize(len);
  int64_t next[256];
  std::copy(start, start + 256, next);
  for (int64_t i = 0; i < len; ++i) tmp[next[(static_cast<uint64_t>(p[i].key) - static_cast<uint64_t>(lo)) >> shift]++] = p[i];
  std::copy(tmp.begin(), tmp.begin() + len, p);
  for (int d = 0; d < 256; ++d)
    if (start[d + 1] - start[d] > 1) sort_bucket(p + start[d], start[d + 1] - start[d], tmp);
}
}  // namespace

// Returns U; unique / counts get U entries, inverse N, order (if given) N.
extern "C" int64_t dyn_sort_unique(
    const int64_t* keys,  // [N]
    int64_t n,
    int64_t* unique,      // [N] out (first U used): ascending
    int64_t* inverse,     // [N] out
    int64_t* counts,      // [N] out (first U used)
    int64_t* order,       // [N] out or null: input indices grouped by key, each group in input order
    int64_t* scratch,     // [2N] the sorted (key, index) pairs
    const int64_t* seg,   // [N] or null: the segment (table) of each input
    int64_t* useg,        // [N] out with seg (first U used): the segment of each key's first input
    int64_t* mixed,       // [1] out with seg: 1 when some key's inputs lie in several segments, else 0
    int64_t* first,       // [N] out or null (first U used): each key's first input
    int64_t nthreads) {
  if (n == 0) return 0;
  const int nt = threads(nthreads, n, 16384);
  int64_t lo = keys[0], hi = keys[0];
#pragma omp parallel for schedule(static) num_threads(nt) reduction(min : lo) reduction(max : hi)
  for (int64_t i = 0; i < n; ++i) {
    lo = keys[i] < lo ? keys[i] : lo;
    hi = keys[i] > hi ? keys[i] : hi;
  }
  const uint64_t range = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
  const int bits = range ? 64 - __builtin_clzll(range) : 0;
  int digit_bits = 1;
  while (digit_bits < 16 && (int64_t(4) << digit_bits) < n) ++digit_bits;
  if (digit_bits > bits) digit_bits = bits;  // 0 when every key is the same
  const int shift = bits - digit_bits;
  const int64_t digits = int64_t(1) << digit_bits;
  auto digit = [&](int64_t k) -> int64_t { return static_cast<int64_t>((static_cast<uint64_t>(k) - static_cast<uint64_t>(lo)) >> shift); };
  Pair* pairs = reinterpret_cast<Pair*>(scratch);
  // start[t * (digits + 1) + d]: where thread t's keys of digit d go (a stable scatter).
  std::vector<int64_t> start(static_cast<size_t>(nt) * (digits + 1), 0);
  std::vector<int64_t> bucket_start(digits + 1, 0);
  const int64_t chunk = (n + nt - 1) / nt;
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    const int64_t a = t * chunk, b = a + chunk < n ? a + chunk : n;
    int64_t* mine = start.data() + static_cast<size_t>(t) * (digits + 1);
    for (int64_t i = a; i < b; ++i) ++mine[digit(keys[i])];
#pragma omp barrier
#pragma omp single
    {
      int64_t at = 0;
      for (int64_t d = 0; d < digits; ++d) {
        bucket_start[d] = at;
        for (int u = 0; u < nt; ++u) {
          int64_t& c = start[static_cast<size_t>(u) * (digits + 1) + d];
          const int64_t cnt = c;
          c = at;
          at += cnt;
        }
      }
      bucket_start[digits] = at;
    }
    for (int64_t i = a; i < b; ++i) pairs[mine[digit(keys[i])]++] = Pair{keys[i], i};
#pragma omp barrier
    std::vector<Pair> tmp;
#pragma omp for schedule(dynamic, 64)
    for (int64_t d = 0; d < digits; ++d) sort_bucket(pairs + bucket_start[d], bucket_start[d + 1] - bucket_start[d], tmp);
  }
  // Group starts: chunk c counts its keys that differ from their predecessor, then fills in.
  std::vector<int64_t> first_group(nt + 1, 0);
  int64_t any_mixed = 0;  // written only as 1, by any thread
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    const int64_t a = t * chunk, b = a + chunk < n ? a + chunk : n;
    int64_t starts = 0;
    for (int64_t i = a; i < b; ++i) starts += i == 0 || pairs[i].key != pairs[i - 1].key;
    first_group[t + 1] = starts;
#pragma omp barrier
#pragma omp single
    for (int u = 0; u < nt; ++u) first_group[u + 1] += first_group[u];
    int64_t g = first_group[t] - 1;
    bool mine_mixed = false;
    for (int64_t i = a; i < b; ++i) {
      if (i == 0 || pairs[i].key != pairs[i - 1].key) {
        unique[++g] = pairs[i].key;
        counts[g] = i;  // the group's first position; turned into its count below
        if (first) first[g] = pairs[i].idx;  // the sort keeps inputs of one key in input order
        if (seg) useg[g] = seg[pairs[i].idx];
      } else if (seg && seg[pairs[i].idx] != seg[pairs[i - 1].idx]) {
        mine_mixed = true;  // one key read through two segments: equal neighbours, all the run's
      }
      inverse[pairs[i].idx] = g;
      if (order) order[i] = pairs[i].idx;
    }
    if (mine_mixed) any_mixed = 1;
  }
  if (seg) *mixed = any_mixed;
  const int64_t u = first_group[nt];
  for (int64_t g = 0; g < u; ++g) counts[g] = (g + 1 < u ? counts[g + 1] : n) - counts[g];
  return u;
}
