"""The CPU speed-ups of the transformers backend, in one package that can be switched off (and
deleted) as a whole: quantized linear layers on the GGUF grid (`quantization`,
`quantized_linear`), C kernels built on first use (`kernels`), cascade attention
(`cascade_attention`) over a cache that appends in place (`kv_cache`), stored prompt prefixes
(`prefix_cache`) and a decode loop that drops finished rows (`decode_loop`), put together by
`backend.CpuTransformersLLM`.

The switch is `rstar_pipelines.llm.cpu_speedups` (the LLM resource's `cpu_speedups`,
RSTAR_LLM_CPU_SPEEDUPS): off, the backend is the plain `transformers_backend.TransformersLLM`,
transformers' own `generate()` on unquantized weights. This package imports the plain backend's
pieces; they never import it (an import-linter contract).

Importing this package (and its `quantization` settings) loads no torch.
"""
