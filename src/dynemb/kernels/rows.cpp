// Native twins of rows.py's rows_at_torch / put_rows_torch: the index's row ids at flat slots,
// read (-1 for no slot) or written, with the slots' lines prefetched ahead and both cores used.
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
