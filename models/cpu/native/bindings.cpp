// The extension's Python module: every operation of primitives/ops.h, the LoRA plans, the
// adapter checks, and the threads' and kernels' settings.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "adapter_checks.h"
#include "kernels/table.h"
#include "lora_plans.h"
#include "primitives/ops.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace hotlora;

namespace {

// The active kernel's ISA, or "none" where this CPU runs none.
std::string active_isa() {
  const Kernel* kernel = active_kernel();
  return kernel ? kernel->isa : "none";
}

}  // namespace

NB_MODULE(_rows_matmul, m) {
  m.doc() =
      "The projections and attention of a batched decode step's few rows, and the norms and "
      "RoPE of every step, on the CPU";
  m.def("rows_matmul", &rows_matmul, "x"_a, "w"_a);
  m.def("rows_matmul_lora", &rows_matmul_lora, "x"_a, "w"_a, "a_t"_a, "b_t"_a, "mask"_a);
  m.def("quant_matmul", &quant_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a, "int8"_a = 0);
  nb::class_<AdapterPairs>(m, "AdapterPairs",
                           "One adapter's pairs at each LoRA slot, as the gathered kernels read "
                           "them");
  nb::class_<RowPlan>(m, "RowPlan", "A batch's adapters and each row's entries");
  m.def("adapter_pairs", &adapter_pairs, "pairs"_a);
  m.def("row_plan", &row_plan, "adapters"_a, "offsets"_a, "entries"_a, "scales"_a);
  m.def("quant_matmul_heads", &quant_matmul_heads, "x"_a, "ws"_a, "scales"_a, "biases"_a, "heads"_a,
        "group_size"_a, "bits"_a, "plan"_a.none() = nb::none(), "slots"_a = std::vector<int>{},
        "int8"_a = 0, "offset"_a.none() = nb::none(), "roped"_a = 0, "rope_dims"_a = 0,
        "rope_traditional"_a = false, "rope_base"_a = 10000.0f, "rope_scale"_a = 1.0f,
        "norm"_a.none() = nb::none(), "norm_eps"_a = 1e-5f, "glu"_a = false);
  m.def("quant_matmul_gather", &quant_matmul_gather, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, "plan"_a, "slot"_a, "int8"_a = 0);
  nb::class_<DecoderOperands>(m, "DecoderOperands",
                              "What a llama decoder layer's decode steps share, checked once");
  m.def("decoder_operands", &decoder_operands, "ws"_a, "scales"_a, "biases"_a, "bits"_a, "groups"_a,
        "int8"_a, "norm1"_a, "norm2"_a, "eps1"_a, "eps2"_a, "heads"_a, "kv_heads"_a, "scale"_a,
        "rope_dims"_a, "rope_traditional"_a, "rope_base"_a, "rope_scale"_a);
  m.def("decoder_layers", &decoder_layers, "x"_a, "layers"_a, "keys"_a, "values"_a, "at"_a,
        "mask"_a, "positions"_a, "plan"_a.none(), "slots"_a, "layers_a_call"_a,
        "Llama decoder layers' decode step, one after another, a primitive for each "
        "`layers_a_call` of them; each layer's keys and values become its cache after its "
        "write.");
  m.def("all_finite", &all_finite, "arrays"_a);
  m.def("to_half", &to_half, "arrays"_a);
  m.def("packed_lookup", &packed_lookup, "ids"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "bits"_a);
  m.def("rms_norm_rows", &rms_norm_rows, "x"_a, "weight"_a, "eps"_a);
  m.def("rope_rows", &rope_rows, "x"_a, "offset"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a);
  m.def("rows_argmax", &rows_argmax, "logits"_a);
  m.def("step_key_mask", &step_key_mask, "batch"_a, "span"_a, "left_padding"_a.none() = nb::none());
  m.def("attention_rows", &attention_rows, "q"_a, "k"_a, "v"_a, "mask"_a, "scale"_a);
  m.def("attention_rows_merged", &attention_rows_merged, "q"_a, "k"_a, "v"_a, "mask"_a, "scale"_a);
  m.def("masked_softmax", &masked_softmax, "scores"_a, "mask"_a);
  m.def("lora_seconds", &lora_seconds,
        "Seconds the gathered LoRA residuals' passes have taken since the last call.");
  m.def("set_threads", &set_threads, "threads"_a, "The threads of every later product.");
  m.def("isa", &active_isa, "The vector instructions the kernel uses.");
  m.def(
      "interleaves", [] { return active_kernel() && active_kernel()->int8_rows8; },
      "Whether the kernel's integer products read rows interleaved by eight.");
  m.def("use_isa", &use_kernel, "name"_a,
        "Use the avx512vnni, avx512vbmi, avx512, avx2 or neon kernel for later products; False if "
        "the CPU lacks it.");
}
