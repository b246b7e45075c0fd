// AVX-512 VBMI's kernels: AVX-512's (kernels/isa/avx512.cpp) but for the quantized product,
// whose 4-bit codes VBMI picks from their dequantized values (kernels/isa/avx512vbmi.h).
#include "kernels/isa/avx512vbmi.h"

#include "kernels/quant_types.h"
#include "kernels/table.h"

#if defined(__x86_64__)
HOTLORA_AVX512VBMI_TARGET
namespace hotlora::avx512vbmi {
#include "kernels/matmul.h"
#include "kernels/quant_matmul.h"
}  // namespace hotlora::avx512vbmi
HOTLORA_TARGET_END

// Outside the target: the table's entry, and the check that runs before any of it.
namespace hotlora::avx512vbmi {

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vbmi") &&
         __builtin_cpu_supports("f16c");
}

const Kernel& kernel() {
  static const Kernel kKernel = [] {
    Kernel kernel = avx512::kernel();
    kernel.isa = "avx512vbmi";
    kernel.supported = supported;
    kernel.quant = quant_matmul_range;
    return kernel;
  }();
  return kKernel;
}

}  // namespace hotlora::avx512vbmi
#endif  // __x86_64__
