"""Run kernel flavours outside MLX (CPU via ctypes, CUDA via CuPy) against the float64 oracle."""
