// CPU executor: rows (the innermost dim of each job) are spread over at::parallel_for; a contiguous row is one
// memcpy, a strided row is copied unit by unit. An odometer walks the outer dims so no division runs per row.
// (at::parallel_for is a header template: setup.py compiles with -fopenmp, or it would run on one thread.)
#include "copy_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace dpfast {
namespace {

// Below this many bytes per task, thread hand-off costs more than it saves.
constexpr int64_t kGrainBytes = 128 * 1024;
// Rows longer than this are cut into pieces of about this size, so one long row still spreads over threads.
constexpr int64_t kPieceBytes = 64 * 1024;

template <int64_t W>
inline void copy_strided_row(const char* s, char* d, int64_t n, int64_t ss, int64_t ds) {
  for (int64_t i = 0; i < n; ++i) std::memcpy(d + i * ds, s + i * ss, W);
}

void copy_row(const CopyJob& j, const char* s, char* d) {
  const int64_t n = j.sizes[j.ndim - 1];
  const int64_t ss = j.src_strides[j.ndim - 1], ds = j.dst_strides[j.ndim - 1];
  if (ss == j.unit && ds == j.unit) {
    std::memcpy(d, s, static_cast<size_t>(n * j.unit));
    return;
  }
  switch (j.unit) {
    case 1: copy_strided_row<1>(s, d, n, ss, ds); break;
    case 2: copy_strided_row<2>(s, d, n, ss, ds); break;
    case 4: copy_strided_row<4>(s, d, n, ss, ds); break;
    case 8: copy_strided_row<8>(s, d, n, ss, ds); break;
    default: copy_strided_row<16>(s, d, n, ss, ds); break;
  }
}

// Walks the rows (all dims but the innermost) of one job in order, keeping byte offsets up to date with an
// odometer instead of dividing per row.
struct RowCursor {
  const CopyJob* job;
  int64_t idx[kMaxCopyDims] = {0};
  int64_t src = 0, dst = 0;

  RowCursor(const CopyJob& j, int64_t row) : job(&j) {
    for (int k = j.ndim - 2; k >= 0; --k) {  // decompose the first row index once
      idx[k] = row % j.sizes[k];
      row /= j.sizes[k];
      src += idx[k] * j.src_strides[k];
      dst += idx[k] * j.dst_strides[k];
    }
  }
  void copy_and_advance() {
    const CopyJob& j = *job;
    copy_row(j, j.src + src, j.dst + dst);
    for (int k = j.ndim - 2; k >= 0; --k) {
      src += j.src_strides[k];
      dst += j.dst_strides[k];
      if (++idx[k] < j.sizes[k]) return;
      src -= idx[k] * j.src_strides[k];
      dst -= idx[k] * j.dst_strides[k];
      idx[k] = 0;
    }
  }
};

int64_t rows_of(const CopyJob& j) { return j.numel / j.sizes[j.ndim - 1]; }

// Jobs with the same number of rows (the chunks of a split or a gather along an inner dim, h and c of a state)
// go row-interleaved: row r of every job, then row r + 1. The shared side (the source of a split, the output of
// a gather) is then walked once, in address order, instead of once per chunk with page-sized strides.
void run_interleaved(const std::vector<CopyJob>& jobs, int64_t rows, int64_t grain) {
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<RowCursor> cursors;
    cursors.reserve(jobs.size());
    for (const CopyJob& j : jobs) cursors.emplace_back(j, begin);
    for (int64_t r = begin; r < end; ++r) {
      for (RowCursor& c : cursors) c.copy_and_advance();
    }
  });
}

// Otherwise the rows of all jobs form one index space, split across threads. A long contiguous row (a split
// along dim 0 is one row per chunk) is cut into pieces of about kPieceBytes so that it, too, spreads over threads.
void run_sequential(const std::vector<CopyJob>& jobs, int64_t bytes) {
  const size_t n = jobs.size();
  std::vector<int64_t> first(n + 1, 0), pieces(n, 1);
  for (size_t k = 0; k < n; ++k) {
    const CopyJob& j = jobs[k];
    const int64_t last = j.ndim - 1;
    if (j.src_strides[last] == j.unit && j.dst_strides[last] == j.unit) {
      pieces[k] = std::max<int64_t>(1, j.sizes[last] * j.unit / kPieceBytes);
    }
    first[k + 1] = first[k] + rows_of(j) * pieces[k];
  }
  const int64_t items = first.back();
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, bytes / items));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    while (begin < end) {
      const CopyJob& j = jobs[k];
      const int64_t stop = std::min(end, first[k + 1]);
      if (pieces[k] == 1) {
        RowCursor cursor(j, begin - first[k]);
        for (int64_t r = begin; r < stop; ++r) cursor.copy_and_advance();
      } else {
        const int64_t p = pieces[k], units = j.sizes[j.ndim - 1];
        for (int64_t i = begin - first[k]; i < stop - first[k]; ++i) {
          const int64_t row = i / p, piece = i % p;
          const int64_t lo = units * piece / p, hi = units * (piece + 1) / p;
          int64_t so, dso;
          job_offsets(j, row * units + lo, so, dso);
          std::memcpy(j.dst + dso, j.src + so, static_cast<size_t>((hi - lo) * j.unit));
        }
      }
      begin = stop;
      ++k;
    }
  });
}

}  // namespace

void run_copies_cpu(const CopyBatch& batch) {
  const auto& jobs = batch.jobs;
  if (!jobs.empty()) {
    const int64_t rows = rows_of(jobs[0]);
    bool uniform = jobs.size() > 1;
    int64_t total_rows = 0;
    for (const CopyJob& j : jobs) {
      uniform = uniform && rows_of(j) == rows;
      total_rows += rows_of(j);
    }
    const int64_t row_bytes = std::max<int64_t>(1, batch.bytes / total_rows);
    if (uniform && rows > 1 && row_bytes <= kPieceBytes) {
      // a task is `grain` rows of every job
      run_interleaved(jobs, rows, std::max<int64_t>(1, kGrainBytes / (row_bytes * static_cast<int64_t>(jobs.size()))));
    } else {
      run_sequential(jobs, batch.bytes);
    }
  }
  for (const auto& [src, dst] : batch.fallback) dst.copy_(src);
}

}  // namespace dpfast
