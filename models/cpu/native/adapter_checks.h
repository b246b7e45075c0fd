// The checks an adapter's tensors pass once, at its load: all_finite and to_half.
#pragma once

#include <tuple>
#include <vector>

#include "mlx/array.h"

namespace hotlora {

namespace mx = mlx::core;

// Whether every value of each array is finite (neither NaN nor infinite): float32, float16 or
// bfloat16 arrays, evaluated and row-contiguous; a value is not finite when its exponent's bits
// are all set. One call for all of an adapter's tensors, with the GIL held throughout: a load
// that runs beside the decoding threads does not queue for the GIL again after each tensor.
std::vector<bool> all_finite(const std::vector<mx::array>& arrays);

// Each float32 array rounded to float16 into a new row-major array, with whether every rounded
// value is finite (values past float16's range become infinite). The rounding is MLX's own
// (mlx::core::float16_t, the code astype runs on this CPU), so the bits are astype's; one call
// for all of an adapter's tensors, with the GIL held throughout, and nothing queued on MLX's
// stream behind the decoding steps. A 2-D array may be strided (a PEFT pair's transpose).
std::tuple<std::vector<mx::array>, std::vector<bool>> to_half(const std::vector<mx::array>& arrays);

}  // namespace hotlora
