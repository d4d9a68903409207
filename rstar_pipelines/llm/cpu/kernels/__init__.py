"""Kernels of our own in C for the CPU speed-ups, built with the machine's C compiler on first
use and loaded with ctypes (module `c_library`): the quantized matmuls (`quantized_cpu`) and
the decode attention (`decode_attention_cpu`)."""
