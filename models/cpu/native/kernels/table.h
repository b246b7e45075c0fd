// The kernels of every ISA as one table, and the choice among them at run time: the widest this
// CPU runs, unless use_kernel picks another. Every caller reaches the kernels through a Kernel's
// pointers, never an ISA's namespace.
#pragma once

#include <span>
#include <string>

#include "kernels/types.h"

namespace hotlora {

// One ISA's kernels, with what the CPU needs for them.
struct Kernel {
  const char* isa;
  bool (*supported)();  // whether this CPU runs them
  Range range;
  Attend attend;
  Softmax softmax;
  Glu swiglu;
  QuantRange quant;
  Int8Range int8;        // the quantized product on int8 activations (kernels/int8_matmul.h)
  Int8Range int8_rows8;  // the same for rows interleaved by eight; null: none
  Residuals<float> residuals;
  LowRank<float> low_rank;  // rows' activations of one adapter (kernels/lora_gather.h)
  Residuals<uint16_t> residuals_half;
  LowRank<uint16_t> low_rank_half;
};

// An ISA's entry from its namespace's kernels (kernels/*.h built there), named `isa` and run
// where `supported()` finds the CPU's features: what each kernels/isa/<name>.cpp returns.
#define HOTLORA_KERNEL(isa, supported)                                                        \
  Kernel {                                                                                    \
    isa, supported, rows_matmul_range, attend, softmax_rows, swiglu_rows, quant_matmul_range, \
        int8_matmul_range, int8_rows8_entry(), add_residuals<float>, low_rank_rows<float>,    \
        add_residuals<uint16_t>, low_rank_rows<uint16_t>                                      \
  }

// Each ISA's entry, in kernels/isa/<name>.cpp; on another architecture it is not defined.
namespace avx512vnni {
const Kernel& kernel();
}
namespace avx512vbmi {
const Kernel& kernel();
}
namespace avx512 {
const Kernel& kernel();
}
namespace avx2 {
const Kernel& kernel();
}
namespace neon {
const Kernel& kernel();
}

// This architecture's kernels, widest first, whether this CPU runs them or not.
std::span<const Kernel* const> kernels();

// Of two quantized products that give the same bits, the one faster on this CPU: each timed on
// a 4-bit layer of float16 scales, one row and four, the best of a few runs (~1 ms in all).
QuantRange faster_quant(QuantRange a, QuantRange b);

// The kernel named `isa` (empty: the widest this CPU runs); nullptr if the CPU lacks it.
const Kernel* find_kernel(const std::string& isa = "");

// The kernel every later product takes: the widest this CPU runs, or the last use_kernel's;
// nullptr when this CPU runs none.
const Kernel* active_kernel();

// Makes the kernel named `isa` the active one; false (and nothing changed) if the CPU lacks it.
bool use_kernel(const std::string& isa);

}  // namespace hotlora
