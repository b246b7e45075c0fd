// The kernel table: each ISA's entry, widest first, and the one in use.
#include "kernels/table.h"

#include <atomic>

namespace hotlora {

std::span<const Kernel* const> kernels() {
  static const Kernel* const kTable[] = {
#if defined(__x86_64__)
    &avx512vnni::kernel(),
    &avx512vbmi::kernel(),
    &avx512::kernel(),
    &avx2::kernel(),
#elif defined(__aarch64__)
    &neon::kernel(),
#else
#error "the native kernels are written for x86-64 and AArch64"
#endif
  };
  return kTable;
}

const Kernel* find_kernel(const std::string& isa) {
  for (const Kernel* kernel : kernels())
    if ((isa.empty() || isa == kernel->isa) && kernel->supported()) return kernel;
  return nullptr;
}

namespace {

std::atomic<const Kernel*>& active() {
  static std::atomic<const Kernel*> kernel{find_kernel()};
  return kernel;
}

}  // namespace

const Kernel* active_kernel() { return active().load(); }

bool use_kernel(const std::string& isa) {
  const Kernel* kernel = isa.empty() ? nullptr : find_kernel(isa);
  if (kernel == nullptr) return false;
  active().store(kernel);
  return true;
}

}  // namespace hotlora
