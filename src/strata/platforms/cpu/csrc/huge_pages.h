// Long-lived CPU tensors that are read whole on every step (prepacked weights), in memory advised for
// transparent huge pages.
//
// With 4 KB pages, streaming a model's weights through the GEMMs every step takes a TLB miss every 4 KB, and
// in a virtual machine each miss walks two page tables. They are backed by 2 MB pages where the kernel can
// provide them (`MADV_HUGEPAGE`, honoured when /sys/kernel/mm/transparent_hugepage/enabled is "madvise" or
// "always"), which speeds up decode steps, most at small batches. Tensors under 2 MB keep 4 KB pages rather
// than waste most of a huge page. Elsewhere (not Linux, or a kernel without the advice) the tensor is an
// ordinary one.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace strata_kernels {

constexpr int64_t kHugePageBytes = int64_t{2} << 20;

// An uninitialised 1-D tensor of `numel` elements of `options`' dtype on the CPU; from 2 MB on, in its own
// anonymous mapping aligned to 2 MB and advised for huge pages (released when the tensor is freed).
inline at::Tensor empty_huge_page_backed(int64_t numel, const at::TensorOptions& options) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const int64_t bytes = numel * static_cast<int64_t>(options.dtype().itemsize());
  if (bytes >= kHugePageBytes) {
    const int64_t page = 4096, length = (bytes + page - 1) / page * page;
    // Map one huge page more than needed and trim both ends to a 2 MB-aligned start.
    void* raw = mmap(nullptr, length + kHugePageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw != MAP_FAILED) {
      const auto start = reinterpret_cast<uintptr_t>(raw);
      const uintptr_t aligned = (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
      if (aligned > start) munmap(raw, aligned - start);
      const uintptr_t end = start + length + kHugePageBytes;
      if (end > aligned + length) munmap(reinterpret_cast<void*>(aligned + length), end - aligned - length);
      void* data = reinterpret_cast<void*>(aligned);
      madvise(data, length, MADV_HUGEPAGE);  // advice only: refused, the pages stay 4 KB
      return at::from_blob(
          data, {numel}, [length](void* p) { munmap(p, length); }, options.device(at::kCPU));
    }
  }
#endif
  return at::empty({numel}, options.device(at::kCPU));
}

}  // namespace strata_kernels
