// CPU executor: rows (the innermost dim of each job) are spread over at::parallel_for; a contiguous row is one
// memcpy, a strided row is copied unit by unit. An odometer walks the outer dims so no division runs per row.
#include "copy_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace dpfast {
namespace {

// Below this many bytes per task, thread hand-off costs more than it saves.
constexpr int64_t kGrainBytes = 256 * 1024;

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

// Copies rows [begin, end) of one job.
void copy_rows(const CopyJob& j, int64_t begin, int64_t end) {
  const int outer = j.ndim - 1;
  int64_t idx[kMaxCopyDims] = {0};
  int64_t so = 0, dso = 0;
  int64_t r = begin;
  for (int k = outer - 1; k >= 0; --k) {  // decompose the first row index once
    idx[k] = r % j.sizes[k];
    r /= j.sizes[k];
    so += idx[k] * j.src_strides[k];
    dso += idx[k] * j.dst_strides[k];
  }
  for (int64_t row = begin; row < end; ++row) {
    copy_row(j, j.src + so, j.dst + dso);
    for (int k = outer - 1; k >= 0; --k) {  // odometer step
      so += j.src_strides[k];
      dso += j.dst_strides[k];
      if (++idx[k] < j.sizes[k]) break;
      so -= idx[k] * j.src_strides[k];
      dso -= idx[k] * j.dst_strides[k];
      idx[k] = 0;
    }
  }
}

}  // namespace

void run_copies_cpu(const CopyBatch& batch) {
  const auto& jobs = batch.jobs;
  if (!jobs.empty()) {
    // Rows of all jobs form one index space, so one parallel_for covers every tensor and chunk.
    std::vector<int64_t> first_row(jobs.size() + 1, 0);
    for (size_t k = 0; k < jobs.size(); ++k) {
      first_row[k + 1] = first_row[k] + jobs[k].numel / jobs[k].sizes[jobs[k].ndim - 1];
    }
    const int64_t rows = first_row.back();
    const int64_t row_bytes = std::max<int64_t>(1, batch.bytes / std::max<int64_t>(1, rows));
    const int64_t grain = std::max<int64_t>(1, kGrainBytes / row_bytes);
    auto work = [&](int64_t begin, int64_t end) {
      size_t k = std::upper_bound(first_row.begin(), first_row.end(), begin) - first_row.begin() - 1;
      while (begin < end) {
        const int64_t stop = std::min(end, first_row[k + 1]);
        if (stop > begin) copy_rows(jobs[k], begin - first_row[k], stop - first_row[k]);
        begin = stop;
        ++k;
      }
    };
    if (rows <= grain) {
      work(0, rows);  // small: skip the thread pool entirely
    } else {
      at::parallel_for(0, rows, grain, work);
    }
  }
  for (const auto& [src, dst] : batch.fallback) dst.copy_(src);
}

}  // namespace dpfast
