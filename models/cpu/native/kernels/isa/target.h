// The pragmas that build an ISA's code for its own target, whatever the flags of the rest: a
// CPU without it runs none of that code, as kernels/table.cpp checks first.
#pragma once

#define HOTLORA_PRAGMA(text) _Pragma(#text)
// An ISA's code: built for `features` (a string: "avx2,fma,f16c" on x86-64, "+dotprod" on
// AArch64), from here to HOTLORA_TARGET_END. Each ISA beyond its architecture's baseline names
// its own (HOTLORA_<ISA>_TARGET, kernels/isa/<isa>.h), for its traits and for its kernels
// (kernels/isa/<isa>.cpp), and runs where the CPU has them (its Kernel's `supported`).
#define HOTLORA_TARGET_BEGIN(features) \
  HOTLORA_PRAGMA(GCC push_options)     \
  HOTLORA_PRAGMA(GCC target(features)) HOTLORA_PRAGMA(GCC diagnostic push)
#define HOTLORA_TARGET_END HOTLORA_PRAGMA(GCC diagnostic pop) HOTLORA_PRAGMA(GCC pop_options)
// GCC before 12.3 warns that AVX-512's own intrinsics read an undefined vector once they are
// inlined (`_mm512_undefined_ps`'s deliberate self-initialization): quiet in AVX-512's code alone;
// the same kernels built for AVX2 and NEON keep these warnings.
#define HOTLORA_QUIET_AVX512_INTRINSICS                    \
  HOTLORA_PRAGMA(GCC diagnostic ignored "-Wuninitialized") \
  HOTLORA_PRAGMA(GCC diagnostic ignored "-Wmaybe-uninitialized")
