// Shared by the kernels of this folder: dynemb's 64-bit mixer and bucket rule (the same bits as
// dynemb/hashing.py), prefetch, and the OpenMP thread count a caller asks for.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

// Float loops built twice, for any x86-64 CPU (SSE2) and for AVX2, the one to run chosen when
// the library loads (GCC's target_clones; OpenMP's outlined bodies are cloned with them). The
// arithmetic is the same in both (no FMA contraction, -ffp-contract=off; no reordered sums), so
// their results are bitwise the same. Elsewhere (other compilers or architectures) one build.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DYN_FLOAT_KERNEL __attribute__((target_clones("avx2", "default")))
// Loops built for x86-64-v4 (AVX-512) and for any x86-64, where AVX-512 measured faster on an
// AVX-512 host (docs/perf-log.md, 2026-11-27 tenth session): the hashed initial rows (vector
// int64 -> float32 conversions and 64-bit multiplies, which AVX2 lacks; each IEEE-rounded alike
// in both builds, so the rows are bitwise the same), 20,000 rows of dim 128 in 1.1 against
// 2.7 ms; and the bag copy (64-byte moves; a copy either way), 15% faster.
#if __GNUC__ >= 11  // the first GCC to name the x86-64-vN levels
#define DYN_AVX512_KERNEL __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define DYN_AVX512_KERNEL
#endif
#else
#define DYN_FLOAT_KERNEL
#define DYN_AVX512_KERNEL
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

// The index's [B, W] key table: slot p's key at base[p * step]. step is 1 for a table of its
// own and 2 when each slot's key, row id and score are packed in 16 bytes (docs/design/0041).
struct KeyCol {
  int64_t* base;
  int64_t step;
  KeyCol(const int64_t* table, int64_t key_step) : base(const_cast<int64_t*>(table)), step(key_step) {}
  int64_t& operator[](int64_t p) const { return base[p * step]; }
  const int64_t* at(int64_t p) const { return base + p * step; }
};

// An int32 or int64 [B, W] table of the index (row ids, scores): slot p's entry ``bytes`` wide
// at byte p * stride (stride = bytes for a table of its own, 16 when packed).
struct IntCol {
  char* base;
  int64_t bytes;   // 4 or 8
  int64_t stride;  // bytes from one slot's entry to the next
  IntCol(const void* table, int64_t width, int64_t step) : base(static_cast<char*>(const_cast<void*>(table))), bytes(width), stride(step * width) {}
  const char* at(int64_t p) const { return base + p * stride; }
  int64_t get(int64_t p) const { return bytes == 4 ? *reinterpret_cast<const int32_t*>(at(p)) : *reinterpret_cast<const int64_t*>(at(p)); }
  void set(int64_t p, int64_t value) const {
    char* a = base + p * stride;
    if (bytes == 4)
      *reinterpret_cast<int32_t*>(a) = static_cast<int32_t>(value);
    else
      *reinterpret_cast<int64_t*>(a) = value;
  }
  // Copy slot ``from``'s entry to slot ``to``.
  void move(int64_t from, int64_t to) const { set(to, get(from)); }
};

// Whether slot p's entry of ``col`` lies in the same 16-byte record as its key (packed slots,
// docs/design/0041), so that the key's line holds it: derived from the two tables' addresses.
inline bool same_record(const KeyCol& keys, const IntCol& col) {
  const uintptr_t key0 = reinterpret_cast<uintptr_t>(keys.base), at = reinterpret_cast<uintptr_t>(col.base);
  return col.stride == keys.step * 8 && at >= key0 && at < key0 + static_cast<uintptr_t>(col.stride);
}

// Request every line from the one holding ``first`` to the one holding ``last`` (RW 1: for writing).
template <int RW>
inline void prefetch_span(const void* first, const void* last) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(last);
  for (uintptr_t line = reinterpret_cast<uintptr_t>(first) & ~uintptr_t(63); line <= end; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), RW);
}

// A key put into slot p: its key, tag and score (the row id is the caller's).
inline void write_slot(const KeyCol& table_keys, uint8_t* tags, const IntCol& scores, int64_t p, int64_t key, int64_t score, uint8_t tag) {
  table_keys[p] = key;
  tags[p] = tag;
  scores.set(p, score);
}
inline void write_slot(const KeyCol& table_keys, uint8_t* tags, const IntCol& scores, int64_t p, int64_t key, int64_t score) {
  write_slot(table_keys, tags, scores, p, key, score, key_tag(key));
}

// Set bits of a 64-bit word, inline (the kernels are built for any x86-64 CPU: without -mpopcnt,
// __builtin_popcount is a libgcc call).
inline int popcount64(uint64_t x) {
  x = x - ((x >> 1) & 0x5555555555555555ULL);
  x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
  x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
  return static_cast<int>((x * 0x0101010101010101ULL) >> 56);
}

// Bit j set where tags[j] == t, for the 16 tags at ``tags``.
#ifdef __SSE2__
inline unsigned tag_mask16(const uint8_t* tags, __m128i t) {
  return static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tags)), t)));
}
#endif

// Empty slots of bucket ``bucket`` (tag 0).
inline int64_t free_in(const uint8_t* tags, int64_t bucket, int64_t W) {
  int64_t f = 0, j = 0;
#ifdef __SSE2__
  for (; j + 16 <= W; j += 16) f += popcount64(tag_mask16(tags + bucket * W + j, _mm_setzero_si128()));
#endif
  for (; j < W; ++j) f += tags[bucket * W + j] == 0;
  return f;
}

// Most slots a bucket may have for a bit mask of its free slots.
constexpr int64_t MASK_SLOTS = 64;

// A bucket's empty slots: how many, and the first of them (-1: none).
struct FreeSlots {
  int64_t count, first;
};

// FreeSlots of the bucket whose W tags start at ``t`` (free_slots: of bucket ``bucket``): from
// a bit mask of its tags (bit j set where slot j is empty) for buckets of up to MASK_SLOTS
// slots, with no loop over the slots and no branch per slot; wider buckets slot by slot.
// Bit j set where slot j of the bucket whose W <= MASK_SLOTS tags start at ``t`` is empty.
inline uint64_t free_mask_at(const uint8_t* t, int64_t W) {
  uint64_t m = 0;
  int64_t j = 0;
#ifdef __SSE2__
  for (; j + 16 <= W; j += 16) m |= static_cast<uint64_t>(tag_mask16(t + j, _mm_setzero_si128())) << j;
#endif
  for (; j < W; ++j) m |= static_cast<uint64_t>(t[j] == 0) << j;
  return m;
}

inline FreeSlots free_slots_at(const uint8_t* t, int64_t W) {
  if (W > MASK_SLOTS) {
    int64_t first = 0;
    while (first < W && t[first]) ++first;
    return {free_in(t, 0, W), first < W ? first : -1};
  }
  const uint64_t m = free_mask_at(t, W);
  return {popcount64(m), m ? static_cast<int64_t>(__builtin_ctzll(m)) : -1};
}

inline FreeSlots free_slots(const uint8_t* tags, int64_t bucket, int64_t W) { return free_slots_at(tags + bucket * W, W); }

// The widest bucket whose free slots and first free slot pack_choice (below) can hold: what
// the upsert's probe saw, handed to the first placement round so that it need not read the tag
// lines again.
constexpr int64_t PACKED_FREE_MAX_W = 65534;

// The slot of ``key`` among bucket ``base``'s W slots (its tag ``t``), or -1: the first slot whose
// tag and key match. A used slot always holds its key's tag, so this is the first used slot
// holding the key; the tags (one line for 16 slots) screen the key lines.
inline int64_t find_in_bucket(const KeyCol& table_keys, const uint8_t* tags, int64_t base, int64_t W, int64_t key, uint8_t t) {
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

// Stable LSD radix sort of n values ascending by their bits from ``first_shift`` up (of
// ``v - base``), only the passes the largest such field, ``span``, needs, at most 11 bits a
// pass, the field's bits shared evenly among them (18 bits: two passes of 9, whose 512 digits'
// lines stay in L1 as a pass scatters, where 11 bits' 2,048 did not); ``buffer`` as large.
// Placement sorts slots (base: the smallest) and entries by bucket.
inline void radix_sort_bits(uint64_t* v, uint64_t* buffer, int64_t n, uint64_t base, int first_shift, uint64_t span) {
  if (n < 2 || span == 0) return;
  constexpr int MAX_BITS = 11;
  const int field = 64 - __builtin_clzll(span), passes = (field + MAX_BITS - 1) / MAX_BITS, bits = (field + passes - 1) / passes;
  const int64_t digits = int64_t(1) << bits;
  int64_t count[(int64_t(1) << MAX_BITS) + 1];
  uint64_t* src = v;
  uint64_t* dst = buffer;
  for (int pass = 0, shift = first_shift; pass < passes; ++pass, shift += bits) {
    std::fill(count, count + digits + 1, 0);
    for (int64_t i = 0; i < n; ++i) ++count[(((src[i] - base) >> shift) & (digits - 1)) + 1];
    for (int64_t d = 0; d < digits; ++d) count[d + 1] += count[d];
    for (int64_t i = 0; i < n; ++i) dst[count[((src[i] - base) >> shift) & (digits - 1)]++] = src[i];
    std::swap(src, dst);
  }
  if (src != v) std::copy(src, src + n, v);
}

// A bag collection's backward, one unique row's gradient: the D floats at each of its ids' first
// unit row of the concat gradient ``grad`` (``unit`` floats a unit row), its ids
// ``order[begin, end)`` added in that order into ``sum`` from zero (embedding_bag's order; N
// ids in all, for the prefetch). pool.cpp's dyn_sum_bags and update.cpp's dyn_rows_update_bags
// both sum through it: the same floats in the same order. Inlined into each clone of a kernel.
// Ids whose gradient slices (every line of them) are requested ahead of the one being added.
constexpr int64_t SUM_AHEAD = 16;

inline __attribute__((always_inline)) void sum_slices(float* sum, const float* grad, int64_t unit, const int64_t* first_row, const int64_t* order,
                                                      int64_t begin, int64_t end, int64_t N, int64_t D) {
  for (int64_t d = 0; d < D; ++d) sum[d] = 0.0f;
  for (int64_t t = begin; t < end; ++t) {
    // The slices of the ids a few places on (the next rows' when this one ends).
    if (t + SUM_AHEAD < N) {
      const char* next = reinterpret_cast<const char*>(grad + first_row[order[t + SUM_AHEAD]] * unit);
      for (int64_t off = 0; off < D * 4; off += 64) __builtin_prefetch(next + off);
    }
    const float* src = grad + first_row[order[t]] * unit;
    for (int64_t d = 0; d < D; ++d) sum[d] += src[d];
  }
}

// The k-th of the n row ids one FreeList.allocate(n) hands out, from the free list's reusable
// ids ``free_ids[0, top)`` and its first never-used id ``high_water``: the last ``reused`` =
// min(n, top) reusable ids in order, then fresh ones. The caller then takes ``reused`` off ``top``
// and adds n - reused to ``high_water``.
inline int64_t allocated_id(const int64_t* free_ids, int64_t top, int64_t high_water, int64_t reused, int64_t k) {
  return k < reused ? free_ids[top - reused + k] : high_water + (k - reused);
}

// Whether a key whose candidates b1, b2 have free slots f1, f2 tries b2 in a placement round
// (docs/design/0006): the candidate with more free slots, ties by a bit of the buckets; the
// other one in the last round (``other``).
inline bool tries_second(int64_t f1, int64_t f2, int64_t b1, int64_t b2, bool other) {
  // Bitwise, not short-circuit: no branch to mispredict on a coin flip.
  const bool second = (f2 > f1) | ((f2 == f1) & (((b1 ^ b2) & 1) != 0));
  return second != other;
}

// A placement round's choice for a key whose candidates b1, b2 have free slots s1, s2 (as
// tries_second; ``other``: the last round's), packed in one int64 (buckets below 2^31, at most
// PACKED_FREE_MAX_W slots): the bucket it tries << 32 | that bucket's first free slot (0 where
// it has none) << 16 | its free slots; -1 where both are full. The upsert's probe packs the
// first round's, so that the compiled placements' first round neither hashes the key again nor
// reads its tag lines (insert.cpp, place.cpp).
inline int64_t pack_choice(FreeSlots s1, FreeSlots s2, int64_t b1, int64_t b2, bool other = false) {
  // Selected by masks: the choice is a coin flip to a branch predictor.
  const int64_t m = -static_cast<int64_t>(tries_second(s1.count, s2.count, b1, b2, other));
  const int64_t bucket = (b1 & ~m) | (b2 & m), count = (s1.count & ~m) | (s2.count & m), first = (s1.first & ~m) | (s2.first & m);
  const int64_t packed = bucket << 32 | (first & ~(first >> 63)) << 16 | count;
  return (s1.count | s2.count) ? packed : -1;
}

// The parts of pack_choice's value c >= 0: the bucket tried, its free slots, its first free slot.
inline int64_t choice_bucket(int64_t c) { return c >> 32; }
inline int64_t choice_count(int64_t c) { return c & 0xFFFF; }
inline int64_t choice_first(int64_t c) { return (c >> 16) & 0xFFFF; }

// The placement rounds of docs/design/0006: halving rounds (at most HALVING_ROUNDS, while one
// places a key), then one filling the preferred candidate, then one the other. ``one_round(halve,
// other)`` returns the slots it took; the rounds stop once ``n_todo`` (the keys waiting) is 0.
// A halving round places a key of every bucket a waiting key tries (it takes up to half of the
// bucket's free slots, rounded up), so one that places none leaves no waiting key a free slot
// in either candidate: the filling rounds would place none either, and are skipped (each read
// every waiting key's two buckets again: ~40 us a round for ~800 keys of an index at load 0.9).
constexpr int HALVING_ROUNDS = 8;
constexpr int PLACEMENT_ROUNDS = HALVING_ROUNDS + 2;

template <class Round>
inline void placement_rounds(Round&& one_round, const int64_t& n_todo) {
  for (int k = 0; k < HALVING_ROUNDS && n_todo; ++k)
    if (one_round(true, false) == 0) return;
  if (n_todo) one_round(false, false);
  if (n_todo) one_round(false, true);
}

inline int threads(int64_t requested, int64_t work, int64_t per_thread) {
  int64_t t = work / per_thread;
  if (t > requested) t = requested;
  return t < 1 ? 1 : static_cast<int>(t);
}

}  // namespace dynemb
