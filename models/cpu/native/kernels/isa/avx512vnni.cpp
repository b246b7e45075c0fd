// AVX-512 VNNI's kernels: AVX-512's, with VBMI's quantized product where the CPU has VBMI and it
// is the faster there, and the products on int8 activations, whose integer sums VNNI takes in one
// instruction and whose interleaved rows it takes sixteen at once (kernels/isa/avx512vnni.h).
#include "kernels/isa/avx512vnni.h"

#include "kernels/quant_types.h"
#include "kernels/table.h"

#if defined(__x86_64__)
HOTLORA_AVX512VNNI_TARGET
namespace hotlora::avx512vnni {
#include "kernels/int8_matmul.h"
}  // namespace hotlora::avx512vnni
HOTLORA_TARGET_END

// Outside the target: the table's entry, and the check that runs before any of it.
namespace hotlora::avx512vnni {

bool supported() {
  return avx512::kernel().supported() && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq");
}

const Kernel& kernel() {
  static const Kernel kKernel = [] {
    // VBMI's picks of 4-bit values and AVX-512's conversions are the same bits; which is faster
    // depends on the core (the picks' permutes are dear on some), so the faster here serves.
    const Kernel& vbmi = avx512vbmi::kernel();
    Kernel kernel = avx512::kernel();
    if (vbmi.supported()) kernel.quant = faster_quant(vbmi.quant, kernel.quant);
    kernel.isa = "avx512vnni";
    kernel.supported = supported;
    kernel.int8 = int8_matmul_range;
    kernel.int8_rows8 = int8_rows8_entry<Int8Wide>();
    return kernel;
  }();
  return kKernel;
}

}  // namespace hotlora::avx512vnni
#endif  // __x86_64__
