// AVX-512's kernels: every operation's, written once in kernels/*.h, built for its traits.
#include "kernels/isa/avx512.h"

#include "kernels/quant_types.h"
#include "kernels/table.h"

#if defined(__x86_64__)
HOTLORA_AVX512_TARGET
namespace hotlora::avx512 {
#include "kernels/activations.h"
#include "kernels/attention.h"
#include "kernels/int8_matmul.h"
#include "kernels/lora_gather.h"
#include "kernels/matmul.h"
#include "kernels/quant_matmul.h"
}  // namespace hotlora::avx512
HOTLORA_TARGET_END

// Outside the target: the table's entry, and the check that runs before any of it.
namespace hotlora::avx512 {

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("fma");
}

const Kernel& kernel() {
  static const Kernel kKernel = HOTLORA_KERNEL("avx512", supported);
  return kKernel;
}

}  // namespace hotlora::avx512
#endif  // __x86_64__
