"""Serving on the CPU: which weights, MLX's JIT flags, and the native kernels with their build."""
