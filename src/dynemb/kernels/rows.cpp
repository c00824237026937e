// Native twins of rows.py's rows_at_torch / put_rows_torch / rows_of_new_torch: the index's row
// ids at flat slots, read (-1 for no slot) or written, with the slots' lines prefetched ahead
// and both cores used.
// n slots, row ids int32 or int64 (row_bytes 4 or 8).
#include <omp.h>

#include "common.h"

using namespace dynemb;

static constexpr int64_t AHEAD = 16;

extern "C" int64_t dyn_rows_at(
    const void* table_rows,  // [B * W]
    int64_t row_bytes,
    int64_t row_step,        // elements from one slot's row id to the next (1, or 4 packed)
    const int64_t* pos,      // [n] flat slots, < 0 for none
    int64_t n,
    int64_t* out,            // [n] out: the row id at each slot, -1 where pos < 0
    int64_t nthreads) {
  const IntCol rows(table_rows, row_bytes, row_step);
  const int nt = threads(nthreads, n, 8192);
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), got = omp_get_num_threads();
    const int64_t chunk = (n + got - 1) / got, lo = t * chunk, hi = lo + chunk < n ? lo + chunk : n;
    for (int64_t i = lo; i < lo + AHEAD && i < hi; ++i)
      if (pos[i] >= 0) __builtin_prefetch(rows.at(pos[i]));
    for (int64_t i = lo; i < hi; ++i) {
      if (i + AHEAD < hi && pos[i + AHEAD] >= 0) __builtin_prefetch(rows.at(pos[i + AHEAD]));
      out[i] = pos[i] >= 0 ? rows.get(pos[i]) : -1;
    }
  }
  return 0;
}

extern "C" int64_t dyn_rows_put(
    void* table_rows,        // [B * W] written at pos
    int64_t row_bytes,
    int64_t row_step,
    const int64_t* pos,      // [n] distinct flat slots
    const int64_t* ids,      // [n] row ids
    int64_t n,
    int64_t nthreads) {
  const IntCol rows(table_rows, row_bytes, row_step);
  const int nt = threads(nthreads, n, 8192);
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), got = omp_get_num_threads();
    const int64_t chunk = (n + got - 1) / got, lo = t * chunk, hi = lo + chunk < n ? lo + chunk : n;
    for (int64_t i = lo; i < lo + AHEAD && i < hi; ++i) __builtin_prefetch(rows.at(pos[i]), 1);
    for (int64_t i = lo; i < hi; ++i) {
      if (i + AHEAD < hi) __builtin_prefetch(rows.at(pos[i + AHEAD]), 1);
      rows.set(pos[i], ids[i]);
    }
  }
  return 0;
}

// An upsert's new keys into its result, in one pass: for each place j of a missing key in the
// call's keys, pos[occ[j]] = p and rows[occ[j]] = the row id at slot p (-1 where p < 0), with
// p = new_pos[spread[j]] (new_pos[j] without spread).
extern "C" int64_t dyn_rows_of_new(
    const void* table_rows,  // [B * W]
    int64_t row_bytes,
    int64_t row_step,
    const int64_t* occ,      // [m] places in the call's keys
    const int64_t* spread,   // [m] the new key of each place, or null (place j is new key j)
    int64_t m,
    const int64_t* new_pos,  // [M] each new key's slot, -1 for none
    int64_t* pos,            // [U] written at occ
    int64_t* rows,           // [U] written at occ
    int64_t nthreads) {
  const IntCol table(table_rows, row_bytes, row_step);
  auto slot = [&](int64_t j) -> int64_t { return new_pos[spread ? spread[j] : j]; };
  const int nt = threads(nthreads, m, 8192);
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), got = omp_get_num_threads();
    const int64_t chunk = (m + got - 1) / got, lo = t * chunk, hi = lo + chunk < m ? lo + chunk : m;
    for (int64_t j = lo; j < lo + AHEAD && j < hi; ++j)
      if (slot(j) >= 0) __builtin_prefetch(table.at(slot(j)));
    for (int64_t j = lo; j < hi; ++j) {
      if (j + AHEAD < hi && slot(j + AHEAD) >= 0) __builtin_prefetch(table.at(slot(j + AHEAD)));
      const int64_t p = slot(j);
      pos[occ[j]] = p;
      rows[occ[j]] = p >= 0 ? table.get(p) : -1;
    }
  }
  return 0;
}
