"""Unit tier: no process, no HTTP; tiny random models built in the test, MLX on the CPU."""
