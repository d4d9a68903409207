"""One SeerAttention-R decode step on vLLM 0.32.0's KV cache layout, counted on the CPU: host
syncs per layer per step, ops launched per layer per step, and the backend's extra memory as a
fraction of the KV cache.

    python benchmarks/sparse_step.py [--batch 8] [--context 4096] [--steps 4]

The step is `vllm_layout.SeerLayer`'s (the cache-write bookkeeping, page compression, scoring,
selection, gather, attention through the PyTorch reference), on random gates and a random cache
(H_q/H_kv = 32/8, D = 128, block 64, gate dim 128, bfloat16, token budget 1024). Counts, not
times, so they hold on any machine:
- host syncs: the calls that would wait on a GPU (`rstar_kernels.host_sync`), target 0;
- ops launched: the torch profiler's leaf aten ops, less views and allocations (which launch no
  kernel); on a GPU each is about one kernel launch (the Triton kernel replaces the reference's
  ops there, two launches);
- memory: the gate keys allocated against the cache's bytes, and one step's scratch
  (`plugin_memory`) against the cache.

Prints Markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

import torch

from rstar_kernels.gate import GateConfig, SeerGates
from rstar_kernels.host_sync import count_host_syncs
from rstar_kernels.vllm_layout import SeerLayer, Selection, plugin_memory
from rstar_sandbox.bench import load_average, machine

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 64
# Ops that make a view or an empty tensor: no kernel runs for them.
NO_KERNEL = {
    "aten::view", "aten::as_strided", "aten::slice", "aten::select", "aten::expand",
    "aten::transpose", "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::t",
    "aten::alias", "aten::_reshape_alias", "aten::detach", "aten::lift_fresh", "aten::empty",
    "aten::empty_strided", "aten::empty_like", "aten::resize_", "aten::split", "aten::unbind",
    "aten::_unsafe_view", "aten::result_type", "aten::item", "aten::_local_scalar_dense",
}  # fmt: skip


def setup(batch: int, context: int, budget: int):
    """A layer, its cache `[pages, H_kv, block, 2·D]` (one as vLLM allocates, room for every
    row plus one page each), a random block table, and the step's inputs."""
    torch.manual_seed(0)
    config = GateConfig(family="llama", num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS,
                        head_dim=DIM, rope_theta=1e6, block_size=BLOCK)  # fmt: skip
    gate = SeerGates(config)[0].to(torch.bfloat16)
    layer = SeerLayer(gate, Selection(budget, None, "torch"))
    width = context // BLOCK + 1
    kv_cache = torch.randn(batch * width, KV_HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
    table = torch.randperm(batch * width).view(batch, width).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16)
    return config, layer, kv_cache, table, seq_lens, query


def launched(prof) -> int:
    return sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::") and not e.cpu_children and e.name not in NO_KERNEL
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    config, layer, kv_cache, table, seq_lens, query = setup(args.batch, args.context, args.budget)
    layer.decode(query, kv_cache, table, seq_lens, DIM**-0.5)  # warm-up: compresses every page
    syncs, ops = [], []
    for _ in range(args.steps):
        seq_lens = seq_lens + 1  # one token more per row; every 64th step fills a page
        slots = table.long().gather(1, (seq_lens.long()[:, None] - 1) // BLOCK)[:, 0] * BLOCK
        slots = slots + (seq_lens.long() - 1) % BLOCK
        with count_host_syncs() as counts, torch.profiler.profile() as prof:
            layer.mark_written(kv_cache, slots)
            layer.decode(query, kv_cache, table, seq_lens, DIM**-0.5)
        syncs.append(sum(counts.values()))
        ops.append(launched(prof))
    keys = layer.gate_keys(kv_cache)
    memory = plugin_memory(config, layer.selection, args.batch)
    key_bytes = keys.keys.nbytes + keys.fresh.nbytes
    print(f"Machine: {machine()}, load {load_average()}, torch {torch.__version__}.\n")
    print(f"B = {args.batch}, context {args.context}, budget {args.budget}, H_q/H_kv = "
          f"{HEADS}/{KV_HEADS}, D = {DIM}, block {BLOCK}, bf16 cache {kv_cache.nbytes / 2**20:.0f}"
          f" MiB per layer, {args.steps} steps.\n")  # fmt: skip
    print("| per layer per step | value |\n|---|---|")
    print(f"| host syncs | {max(syncs)} (all steps: {syncs}) |")
    print(f"| ops launched (leaf aten ops, no views) | {min(ops)}-{max(ops)} |")
    print(f"| gate keys / KV cache | {key_bytes / kv_cache.nbytes:.2%} "
          f"(plugin_memory: {memory.gate_keys_fraction:.2%}) |")  # fmt: skip
    print(f"| decode scratch | {memory.scratch_bytes / 2**20:.0f} MiB "
          f"({memory.scratch_bytes / kv_cache.nbytes:.2%} of this cache) |")  # fmt: skip


if __name__ == "__main__":
    main()
