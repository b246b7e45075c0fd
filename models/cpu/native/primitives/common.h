// What every primitive shares: its inputs read row-major, its work queued on MLX's CPU stream.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/table.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/scheduler.h"

namespace hotlora {

namespace mx = mlx::core;

// An input's elements in row-major order, read where the kernel runs: the input's own buffer
// when it is row-contiguous (the usual case, no copy), else a packed copy of its strided view.
// The layout is known when the primitive is evaluated; the data only once the inputs' own work,
// queued before it on the stream, has run.
class RowMajor {
 public:
  explicit RowMajor(const mx::array& a)
      : data_(a.data<float>()),
        shape_(a.shape()),
        strides_(a.strides()),
        contiguous_(a.flags().row_contiguous) {}

  const float* get() {
    if (contiguous_) return data_;
    if (packed_.empty()) {
      size_t size = 1;
      for (int n : shape_) size *= n;
      packed_.reserve(size);
      pack(0, data_);
    }
    return packed_.data();
  }

 private:
  void pack(size_t axis, const float* from) {
    for (int i = 0; i < shape_[axis]; i++, from += strides_[axis]) {
      if (axis + 1 == shape_.size())
        packed_.push_back(*from);
      else
        pack(axis + 1, from);
    }
  }

  const float* data_;
  mx::Shape shape_;
  mx::Strides strides_;
  bool contiguous_;
  std::vector<float> packed_;
};

// Queues a primitive's task on its stream, after the work queued there before it, as MLX's command
// encoder does, but not counted among the scheduler's active tasks: an evaluation waits while
// more than ten of those (a hundred dispatches of the encoder) are queued, which would hold a
// decode step's evaluation until the step before has nearly run and leave its next step's graph
// unbuilt meanwhile. Each of these tasks is a large part of a step; MLX's own operations and the
// task it queues after every primitive still count.
template <typename Task>
void queue_task(const mx::Stream& stream, Task&& task) {
  mx::scheduler::enqueue(stream, std::forward<Task>(task));
}

// Shared by the primitives: the output's allocation, and body(operands, out) queued on
// the stream with the first `floats` inputs as RowMajor operands; out is the output's data as
// `Out` (float32 unless told).
template <typename Out = float, typename Body>
void dispatch_rows(const mx::Stream& stream, const std::vector<mx::array>& inputs, size_t floats,
                   mx::array& out, Body body) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& input : inputs) encoder.set_input_array(input);
  encoder.set_output_array(out);
  std::vector<RowMajor> operands(inputs.begin(), inputs.begin() + floats);
  queue_task(stream, [operands = std::move(operands), op = out.data<Out>(), body]() mutable {
    body(operands, op);
  });
}

// The primitives run on the CPU only.
class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }
};

// Refuses anything but float32 arrays of two or more dimensions, rows not empty, and a CPU
// without a kernel.
inline void check_float32(const std::vector<mx::array>& arrays) {
  for (const auto& a : arrays)
    if (a.ndim() < 2 || a.dtype() != mx::float32 || a.shape(-1) == 0)
      throw std::invalid_argument(
          "rows_matmul: float32 arrays of two or more dimensions, rows not empty, only");
  if (active_kernel() == nullptr)
    throw std::invalid_argument("rows_matmul: the CPU lacks AVX2 and FMA");
}

}  // namespace hotlora
