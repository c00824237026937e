// Shared by the kernels of this folder: dynemb's 64-bit mixer and bucket rule (the same bits as
// dynemb/hashing.py), prefetch, and the OpenMP thread count a caller asks for.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

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

// The tag byte of a key from mix64(mix64(key)): its low 8 bits, 0 read as 1 (dynemb/hashing.py
// tag_of). A slot's tag is 0 when it is empty, else its key's tag.
inline uint8_t tag_of(uint64_t mixed2) {
  const uint8_t t = static_cast<uint8_t>(mixed2 & 0xFF);
  return t ? t : 1;
}

inline uint8_t key_tag(int64_t key) { return tag_of(mix64(mix64(static_cast<uint64_t>(key)))); }

// Entry p of an int32 or int64 table (``bytes`` 4 or 8: the index's row ids and scores).
inline int64_t load_int(const void* table, int64_t bytes, int64_t p) {
  return bytes == 4 ? static_cast<const int32_t*>(table)[p] : static_cast<const int64_t*>(table)[p];
}

inline void store_int(void* table, int64_t bytes, int64_t p, int64_t value) {
  if (bytes == 4)
    static_cast<int32_t*>(table)[p] = static_cast<int32_t>(value);
  else
    static_cast<int64_t*>(table)[p] = value;
}

// A key put into slot p: its key, tag and score (the row id is the caller's).
inline void write_slot(int64_t* table_keys, uint8_t* tags, void* table_scores, int64_t score_bytes, int64_t p, int64_t key, int64_t score) {
  table_keys[p] = key;
  tags[p] = key_tag(key);
  store_int(table_scores, score_bytes, p, score);
}

// Empty slots of bucket ``bucket`` (tag 0).
inline int64_t free_in(const uint8_t* tags, int64_t bucket, int64_t W) {
  int64_t f = 0;
  for (int64_t j = 0; j < W; ++j) f += tags[bucket * W + j] == 0;
  return f;
}

// Bit j set where tags[j] == t, for the 16 tags at ``tags``.
#ifdef __SSE2__
inline unsigned tag_mask16(const uint8_t* tags, __m128i t) {
  return static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tags)), t)));
}
#endif

// The slot of ``key`` among bucket ``base``'s W slots (its tag ``t``), or -1: the first slot whose
// tag and key match. A used slot always holds its key's tag, so this is the first used slot
// holding the key; the tags (one line for 16 slots) screen the key lines.
inline int64_t find_in_bucket(const int64_t* table_keys, const uint8_t* tags, int64_t base, int64_t W, int64_t key, uint8_t t) {
  int64_t j = 0;
#ifdef __SSE2__
  const __m128i tv = _mm_set1_epi8(static_cast<char>(t));
  for (; j + 16 <= W; j += 16) {
    for (unsigned m = tag_mask16(tags + base + j, tv); m; m &= m - 1) {
      const int b = __builtin_ctz(m);
      if (table_keys[base + j + b] == key) return base + j + b;
    }
  }
#endif
  for (; j < W; ++j)
    if (tags[base + j] == t && table_keys[base + j] == key) return base + j;
  return -1;
}

// The first slot of bucket ``base`` whose tag is ``t`` (-1: none): where the key most likely is,
// to prefetch its key and row lines before the compare.
inline int64_t first_tag(const uint8_t* tags, int64_t base, int64_t W, uint8_t t) {
  int64_t j = 0;
#ifdef __SSE2__
  const __m128i tv = _mm_set1_epi8(static_cast<char>(t));
  for (; j + 16 <= W; j += 16) {
    const unsigned m = tag_mask16(tags + base + j, tv);
    if (m) return base + j + __builtin_ctz(m);
  }
#endif
  for (; j < W; ++j)
    if (tags[base + j] == t) return base + j;
  return -1;
}

// The two candidate buckets of key i: global bucket ids, as Segments.candidates computes them.
struct Candidates {
  const int64_t* seg;         // [N] segment of each key, or null (one segment)
  const int64_t* seg_counts;  // [S] buckets of each segment
  const int64_t* seg_offsets; // [S] first bucket of each segment
  int64_t total;              // buckets in all (one segment)

  inline void of(int64_t key, int64_t i, int64_t* b1, int64_t* b2, uint8_t* tag = nullptr) const {
    int64_t nb = total, off = 0;
    if (seg) {
      nb = seg_counts[seg[i]];
      off = seg_offsets[seg[i]];
    }
    const uint64_t m = mix64(static_cast<uint64_t>(key)), m2 = mix64(m);
    *b1 = bucket_of(m, nb) + off;
    *b2 = bucket_of(m2, nb) + off;
    if (tag) *tag = tag_of(m2);
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
