"""Decode-attention latency: block-sparse (Triton, TileLang) against dense (torch SDPA, and
flash_attn.flash_attn_with_kvcache when installed) at 50/75/90% sparsity.

    python benchmarks/sparse_decode.py [--quick] [--out results.json]

On a GPU: contexts 8k..128k (--quick: 8k and 32k), batch 1, 8 and 32, H_q/H_kv = 64/8 (the paper's
setting; --heads 32 for 32/8), D = 128, block 64, random distinct block indices, every row at the
full context. Each sparse backend is first checked against the PyTorch reference in fp16 and
bf16; latency (bf16) is the median over CUDA-event-timed iterations after a warmup. Target: 5x
dense at 32k context and 90% sparsity. Runs in one invocation well under ten minutes (--quick:
one context, fewer iterations; what benchmarks/gpu_checks.sh runs).

On a CPU no kernel timing means anything: the script checks the Triton kernel (interpreter)
against the reference at small sizes and times only the PyTorch references (sparse and dense,
one thread) for a few small shapes. The sparse reference masks a dense score matrix, so it is
no faster than dense; the figures record what the CPU fallback costs, not the kernels.

Prints Markdown for docs/benchmarks.md. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # The Triton interpreter must be chosen before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rstar_kernels import dense_decode_reference, sparse_decode, sparse_decode_reference
from rstar_sandbox.bench import machine

GPU = torch.cuda.is_available()

SPARSITIES = (0.5, 0.75, 0.9)
HEAD_DIM = 128
BLOCK = 64


def random_indices(batch, kv_heads, num_blocks, sparsity, device):
    """Distinct random blocks per (row, KV head), kept fraction 1 - sparsity, in random order."""
    keep = max(1, round((1 - sparsity) * num_blocks))
    order = torch.rand(batch, kv_heads, num_blocks, device=device).argsort(dim=-1)
    return order[..., :keep].int().contiguous()


def make_inputs(batch, heads, kv_heads, length, dtype, device, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(batch, heads, HEAD_DIM, dtype=dtype, device=device)
    k = torch.randn(batch, kv_heads, length, HEAD_DIM, dtype=dtype, device=device)
    v = torch.randn(batch, kv_heads, length, HEAD_DIM, dtype=dtype, device=device)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device=device)
    return q, k, v, seqlens


def gpu_median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cpu_median_ms(fn, iters):
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def dense_baselines(q, k, v, seqlens):
    """name -> callable for the dense decode baselines available here."""
    group = q.shape[1] // k.shape[1]
    q4 = q[:, :, None]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=group > 1)

    baselines = {"sdpa": sdpa}
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return baselines
    # flash_attn wants [B, L, H_kv, D]: transpose once, outside the timed call.
    k_fa, v_fa = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    q_fa = q[:, None]
    baselines["flash_attn"] = lambda: flash_attn_with_kvcache(
        q_fa, k_fa, v_fa, cache_seqlens=seqlens
    )
    return baselines


def check_backends(backends, heads, kv_heads, dtype, device, length=4096, batch=2):
    """Max abs error of each sparse backend against the reference, per sparsity."""
    q, k, v, seqlens = make_inputs(batch, heads, kv_heads, length, dtype, device, seed=1)
    # Ragged rows with left padding exercise the masks the timed runs do not need.
    seqlens[-1] = length - 77
    starts = torch.zeros_like(seqlens)
    starts[0] = 45
    checks = []
    for sparsity in SPARSITIES:
        idx = random_indices(batch, kv_heads, length // BLOCK, sparsity, device)
        expected = sparse_decode_reference(q, k, v, idx, seqlens, BLOCK, starts=starts).float()
        for backend in backends:
            out = sparse_decode(q, k, v, idx, seqlens, BLOCK, backend=backend, starts=starts)
            err = (out.float() - expected).abs().max().item()
            checks.append(
                {"backend": backend, "dtype": str(dtype).removeprefix("torch."),
                 "heads": f"{heads}/{kv_heads}",
                 "batch": batch, "context": length, "sparsity": sparsity, "max_abs_err": err}
            )  # fmt: skip
    return checks


def run_gpu(args):
    dtype = torch.bfloat16
    backends = []
    q, k, v, seqlens = make_inputs(1, args.heads, args.kv_heads, 1024, dtype, "cuda")
    idx = random_indices(1, args.kv_heads, 1024 // BLOCK, 0.5, "cuda")
    for backend in ("triton", "tilelang"):
        # One backend that fails to build (no nvcc, no tilelang) must not cost the other's figures.
        try:
            sparse_decode(q, k, v, idx, seqlens, BLOCK, backend=backend)
            backends.append(backend)
        except Exception as exc:
            print(f"{backend}: not measured ({type(exc).__name__}: {exc})")
    contexts = (8192, 32768) if args.quick else (8192, 32768, 131072)
    batches = (1, 8, 32)
    warmup, iters = (3, 10) if args.quick else (10, 50)
    checks = [
        c
        for check_dtype in (torch.float16, torch.bfloat16)
        for c in check_backends(backends, args.heads, args.kv_heads, check_dtype, "cuda")
    ]
    rows = []
    for length in contexts:
        for batch in batches:
            q, k, v, seqlens = make_inputs(batch, args.heads, args.kv_heads, length, dtype, "cuda")
            dense = {
                name: gpu_median_ms(fn, warmup, iters)
                for name, fn in dense_baselines(q, k, v, seqlens).items()
            }
            best_dense = min(dense.values())
            for sparsity in SPARSITIES:
                idx = random_indices(batch, args.kv_heads, length // BLOCK, sparsity, "cuda")
                row = {"batch": batch, "context": length, "sparsity": sparsity,
                       "selected_blocks": idx.shape[-1]}  # fmt: skip
                row |= {f"{name}_ms": ms for name, ms in dense.items()}
                for backend in backends:
                    call = partial(sparse_decode, q, k, v, idx, seqlens, BLOCK, backend=backend)
                    ms = gpu_median_ms(call, warmup, iters)
                    row[f"{backend}_ms"] = ms
                    row[f"{backend}_speedup"] = best_dense / ms
                rows.append(row)
                print(json.dumps(row), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    return {"mode": "gpu", "device": device, "dtype": "bfloat16", "checks": checks, "rows": rows}


def run_cpu(args):
    torch.set_num_threads(1)
    checks = []
    for dtype in (torch.float32, torch.float16):
        checks += check_backends(["triton"], 8, 2, dtype, "cpu", length=1024, batch=2)
    rows = []
    configs = [(1, 2048), (1, 8192)]
    if not args.quick:
        configs += [(4, 2048), (4, 8192), (1, 32768)]
    for batch, length in configs:
        shape = (batch, args.heads, args.kv_heads, length)
        q, k, v, seqlens = make_inputs(*shape, torch.float32, "cpu")
        dense_ms = cpu_median_ms(partial(dense_decode_reference, q, k, v, seqlens), 3)
        for sparsity in SPARSITIES:
            idx = random_indices(batch, args.kv_heads, length // BLOCK, sparsity, "cpu")
            ms = cpu_median_ms(partial(sparse_decode_reference, q, k, v, idx, seqlens, BLOCK), 3)
            rows.append(
                {"batch": batch, "context": length, "sparsity": sparsity,
                 "selected_blocks": idx.shape[-1], "dense_reference_ms": dense_ms,
                 "sparse_reference_ms": ms}
            )  # fmt: skip
    device = "CPU, 1 thread, Triton interpreter"
    return {"mode": "cpu", "device": device, "dtype": "float32", "checks": checks, "rows": rows}


def markdown(result, heads, kv_heads):
    lines = [f"Checks against the PyTorch reference ({result['device']}):", ""]
    lines += ["| backend | dtype | H_q/H_kv | batch | context | sparsity | max abs err |"]
    lines += ["|---" * 7 + "|"]
    for c in result["checks"]:
        lines.append(
            f"| {c['backend']} | {c['dtype']} | {c['heads']} | {c['batch']} | {c['context']} | "
            f"{c['sparsity']:.2f} | {c['max_abs_err']:.1e} |"
        )
    rows = result["rows"]
    timed = [key for key in rows[0] if key.endswith("_ms") or key.endswith("_speedup")]
    shape = f"H_q/H_kv = {heads}/{kv_heads}, D = {HEAD_DIM}, block {BLOCK}"
    lines += ["", f"Latency in ms, {result['dtype']}, {shape}:", ""]
    names = [key.removesuffix("_ms").replace("_", " ") for key in timed]
    header = ["batch", "context", "sparsity", "blocks", *names]
    lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in rows:
        cells = [row["batch"], row["context"], f"{row['sparsity']:.2f}", row["selected_blocks"]]
        cells += [
            f"{row[key]:.2f}x" if key.endswith("speedup") else f"{row[key]:.3f}" for key in timed
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    parser.add_argument("--heads", type=int, default=64, help="query heads (paper: 64)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    started = time.perf_counter()
    print(f"Machine: {machine()}; {time.strftime('%Y-%m-%d')}")
    if not GPU:
        print(
            "No GPU: checking Triton under the interpreter and timing only the PyTorch references"
            " (the sparse reference masks dense scores, so it is not faster than dense)."
        )
    result = run_gpu(args) if GPU else run_cpu(args)
    result |= {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "heads": args.heads,
               "kv_heads": args.kv_heads, "wall_s": time.perf_counter() - started}  # fmt: skip
    print(markdown(result, args.heads, args.kv_heads))
    print(f"\nwall time {result['wall_s']:.0f} s")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
