// Shared by the kernels of this folder: dynemb's 64-bit mixer and bucket rule (the same bits as
// dynemb/hashing.py), prefetch, and the OpenMP thread count a caller asks for.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dynemb {

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Bucket in [0, num_buckets) from the high 32 bits (multiply-shift), num_buckets < 2^31.
inline int64_t bucket_of(uint64_t mixed, int64_t num_buckets) {
  return static_cast<int64_t>(((mixed >> 32) * static_cast<uint64_t>(num_buckets)) >> 32);
}

// The two candidate buckets of key i: global bucket ids, as Segments.candidates computes them.
struct Candidates {
  const int64_t* seg;         // [N] segment of each key, or null (one segment)
  const int64_t* seg_counts;  // [S] buckets of each segment
  const int64_t* seg_offsets; // [S] first bucket of each segment
  int64_t total;              // buckets in all (one segment)

  inline void of(int64_t key, int64_t i, int64_t* b1, int64_t* b2) const {
    int64_t nb = total, off = 0;
    if (seg) {
      nb = seg_counts[seg[i]];
      off = seg_offsets[seg[i]];
    }
    uint64_t m = mix64(static_cast<uint64_t>(key));
    *b1 = bucket_of(m, nb) + off;
    *b2 = bucket_of(mix64(m), nb) + off;
  }
};

// LSD radix sort of (key, id) pairs by key in signed order, 11 bits a pass (6 passes; a pass
// whose digit is the same for every key moves nothing and is skipped).
inline void radix_sort(std::vector<uint64_t>& key, std::vector<int64_t>& id) {
  const size_t u = key.size();
  if (u < 2) return;
  std::vector<uint64_t> k2(u);
  std::vector<int64_t> i2(u);
  for (auto& k : key) k ^= 0x8000000000000000ULL;  // signed order as unsigned
  constexpr int BITS = 11;
  constexpr size_t DIGITS = size_t(1) << BITS;
  std::vector<size_t> count(DIGITS + 1);
  for (int shift = 0; shift < 64; shift += BITS) {
    std::fill(count.begin(), count.end(), 0);
    for (size_t i = 0; i < u; ++i) ++count[((key[i] >> shift) & (DIGITS - 1)) + 1];
    if (count[((key[0] >> shift) & (DIGITS - 1)) + 1] == u) continue;
    for (size_t d = 0; d < DIGITS; ++d) count[d + 1] += count[d];
    for (size_t i = 0; i < u; ++i) {
      const size_t at = count[(key[i] >> shift) & (DIGITS - 1)]++;
      k2[at] = key[i];
      i2[at] = id[i];
    }
    key.swap(k2);
    id.swap(i2);
  }
  for (auto& k : key) k ^= 0x8000000000000000ULL;
}

inline int threads(int64_t requested, int64_t work, int64_t per_thread) {
  int64_t t = work / per_thread;
  if (t > requested) t = requested;
  return t < 1 ? 1 : static_cast<int>(t);
}

}  // namespace dynemb
