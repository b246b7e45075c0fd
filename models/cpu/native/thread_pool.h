// The threads every primitive's work is split over: one pool, its size set from Python.
#pragma once

#include <functional>

namespace hotlora {

// body(n0, n1) over [0, n) in chunks of at least `least` rows (bounds on multiples of `align`:
// 4, the matmul kernel's blocks, unless told), a few per thread of the pool so that the threads
// even out. Returns when every chunk is done.
void parallel_rows(int n, int least, const std::function<void(int, int)>& body, int align = 4);

// How many threads the pool has (1 before any call): not from inside a call's body.
int pool_threads();

// The pool's threads for every later call (clamped to 1..256); returns how many it has.
int set_threads(int threads);

}  // namespace hotlora
