// NEON's kernels: every operation's, written once in kernels/*.h, built for its traits. The
// baseline of every ARMv8-A CPU: no target to ask for, nothing to check at run time.
#include "kernels/isa/neon.h"

#include "kernels/quant_types.h"
#include "kernels/table.h"

#if defined(__aarch64__)
namespace hotlora::neon {

#include "kernels/activations.h"
#include "kernels/attention.h"
#include "kernels/int8_matmul.h"
#include "kernels/lora_gather.h"
#include "kernels/matmul.h"
#include "kernels/quant_matmul.h"

bool supported() { return true; }

const Kernel& kernel() {
  static const Kernel kKernel = HOTLORA_KERNEL("neon", supported);
  return kKernel;
}

}  // namespace hotlora::neon
#endif  // __aarch64__
