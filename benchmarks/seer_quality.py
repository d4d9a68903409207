"""How close SeerAttention-R sparse decoding stays to dense decoding on the embedded model, with
gates trained as `attn_gate_checkpoint` trains them in the demo, against untrained gates.

    python benchmarks/seer_quality.py [--steps 30] [--budgets 0 16 32 64 128]

Texts: the demo batch's code seeds with their oracle solutions, rendered as chats (what
`gate_distill_data` makes of them), 20% held out. Gates are trained with the demo's parameters
(block 16, gate_dim 64). On every held-out text the first half is prefilled and the second half
fed one token at a time (teacher forcing), each a sparse decode step; per step: KL(dense ‖
sparse) of the next-token distributions and whether the top token agrees with dense. Prints
Markdown for docs/benchmarks.md. Not a test: figures depend on the machine and the texts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from rstar_kernels.distill import GateTrainConfig, train_gates
from rstar_kernels.gate import SeerGates
from rstar_kernels.hf import enable_seer_decoding
from rstar_kernels.quality import kl_and_agreement, teacher_forced_logits
from rstar_pipelines.llm.cpu.backend import load_model_and_tokenizer
from rstar_sandbox.bench import machine

REPO = Path(__file__).resolve().parent.parent


def demo_texts(tokenizer) -> list[str]:
    seeds = (REPO / "assets" / "seeds" / "demo" / "demo.jsonl").read_text().splitlines()
    texts = []
    for seed in map(json.loads, seeds):
        if seed["domain"] == "code" and seed.get("oracle_solutions"):
            solution = seed["oracle_solutions"][0].rstrip("\n")
            chat = [
                {"role": "user", "content": seed["problem"]},
                {"role": "assistant", "content": f"```python\n{solution}\n```"},
            ]
            texts.append(tokenizer.apply_chat_template(chat, tokenize=False))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 32, 64, 128])
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_model_and_tokenizer("embedded", device="cpu")
    texts = demo_texts(tokenizer)
    config = GateTrainConfig(
        steps=args.steps, warmup_steps=3, max_length=512, block_size=16, gate_dim=64,
        heldout_fraction=0.2, topk_blocks=4, cache_teacher=True,
    )  # fmt: skip
    began = time.monotonic()
    trained, metrics = train_gates(model, tokenizer, texts, config, lambda _: None)
    train_s = time.monotonic() - began
    torch.manual_seed(1)
    untrained = SeerGates(trained.config)
    heldout = [
        torch.tensor(tokenizer(texts[i])["input_ids"][: config.max_length])
        for i in metrics["heldout_texts"]
    ]
    dense = [teacher_forced_logits(model, ids, ids.shape[0] // 2) for ids in heldout]
    steps = sum(d.shape[0] for d in dense)
    lengths = [ids.shape[0] for ids in heldout]

    print(f"machine: {machine()}")
    print(
        f"gates: {config.steps} steps on {metrics['examples']} texts in {train_s:.0f} s; held-out "
        f"top-{config.topk_blocks} recall {metrics['heldout_recall_before']:.3f} -> "
        f"{metrics['heldout_recall_after']:.3f}; held-out texts {lengths} tokens, "
        f"{steps} decode steps\n"
    )
    print("| budget (tokens) | gates | KL(dense ‖ sparse) per step | top-1 agreement |")
    print("| --- | --- | --- | --- |")
    for budget in args.budgets:
        for name, gates in (("trained", trained), ("untrained", untrained)):
            rows = []
            with enable_seer_decoding(model, gates, token_budget=budget, backend="torch"):
                for ids, reference in zip(heldout, dense, strict=True):
                    sparse = teacher_forced_logits(model, ids, ids.shape[0] // 2)
                    rows.append((kl_and_agreement(reference, sparse), reference.shape[0]))
            kl = sum(k * n for (k, _), n in rows) / steps
            agree = sum(a * n for (_, a), n in rows) / steps
            print(f"| {budget} | {name} | {kl:.4f} | {agree:.3f} |")


if __name__ == "__main__":
    main()
