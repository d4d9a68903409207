"""Training tokens/s on the CPU: SFT and PPM on TRL (this checkout) against the hand-written loops
they replaced (the last commit that had them, `--baseline`), same data and model, one run.

    python benchmarks/training.py [--model embedded] [--rounds 2] [--baseline e0dd0e3]

The baseline's `rstar_pipelines` is taken from git (`git archive`) into a temporary directory
and imported in its own process, so both sides run their own code on the same installed torch
and transformers. Each measurement is a fresh process that loads the model, builds the data and
times the training call (tokenizing, the steps and the accuracy passes the PPM job makes; not
the model load); the two sides alternate, `--rounds` times, and the median is reported. Tokens
are the real (unpadded) tokens of the sequences the steps train on. Prints Markdown for
docs/benchmarks.md. Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = "the sum of the two numbers is what we compute here step by step with care".split(" ")  # noqa: SIM905


def sft_examples(count: int, words: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"Problem {i}: " + " ".join(WORDS[: 8 + i % 8])},
                {
                    "role": "assistant",
                    "content": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)),
                },
            ]
        }
        for i in range(count)
    ]


def ppm_pairs(count: int, words: int) -> list[dict]:
    return [
        {
            "prompt": f"Problem {i}: " + " ".join(WORDS[: 8 + i % 8]),
            "chosen": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)),
            "rejected": " ".join(WORDS[(i + 3 * j) % len(WORDS)] for j in range(words)),
            "pos_count": 2,
            "neg_count": 2,
        }
        for i in range(count)
    ]


def worker(side: str, job: str, model_ref: str, examples: int, words: int, batch: int) -> dict:
    """One measurement in this process (the baseline's code is first on sys.path for "loops")."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    from rstar_pipelines.training.base_models import add_tags, load_trainable

    quiet = lambda message: None  # noqa: E731
    if job == "sft":
        from rstar_pipelines.training.sft import SFTTrainConfig, train_sft

        model, tokenizer = load_trainable(model_ref)
        add_tags(model, tokenizer)
        data = sft_examples(examples, words)
        config = SFTTrainConfig(lr=1e-5, epochs=1, batch_size=batch, max_length=1024)
        tokens = sum(
            len(tokenizer(text, add_special_tokens=False)["input_ids"])
            for text in (tokenizer.apply_chat_template(e["messages"], tokenize=False) for e in data)
        )
        started = time.perf_counter()
        metrics = train_sft(model, tokenizer, data, config, quiet)
    else:
        from rstar_pipelines.training import ppm as ppm_module
        from rstar_pipelines.training.ppm import PPMTrainConfig, train_ppm

        # The loops' commit made a new PPM with ProcessPreferenceModel.from_base.
        new_ppm = getattr(ppm_module, "ppm_from_base", None) or (
            ppm_module.ProcessPreferenceModel.from_base
        )
        torch.manual_seed(0)
        ppm = new_ppm(model_ref)
        data = ppm_pairs(examples, words)
        config = PPMTrainConfig(lr=1e-5, epochs=1, batch_size=batch, heldout_fraction=0.0)
        tokens = sum(
            len(ppm.tokenizer(text, add_special_tokens=False)["input_ids"])
            for pair in data
            for text in _ppm_texts(ppm.tokenizer, pair)
        )
        started = time.perf_counter()
        metrics = train_ppm(ppm, data, config, quiet)
    seconds = time.perf_counter() - started
    return {
        "side": side,
        "job": job,
        "tokens": tokens,
        "seconds": seconds,
        "steps": metrics["steps"],
    }


def _ppm_texts(tokenizer, pair: dict) -> list[str]:
    from rstar_pipelines.training.ppm import ppm_input

    return [ppm_input(tokenizer, pair["prompt"], pair[key]) for key in ("chosen", "rejected")]


def baseline_tree(commit: str, into: Path) -> Path:
    """The baseline commit's rstar_pipelines package under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "rstar_pipelines"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def measure(side: str, job: str, args: argparse.Namespace, baseline: Path) -> dict:
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    if side == "loops":
        env["PYTHONPATH"] = os.pathsep.join([str(baseline), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        __file__,
        "--worker",
        side,
        job,
        args.model,
        str(args.examples),
        str(args.words),
        str(args.batch),
    ]
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{side} {job} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        side, job, model_ref, examples, words, batch = sys.argv[2:8]
        if side == "loops":  # the baseline's package must win over the installed checkout
            sys.path.insert(0, os.environ["PYTHONPATH"].split(os.pathsep)[0])
        result = worker(side, job, model_ref, int(examples), int(words), int(batch))
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--words", type=int, default=120, help="words per answer/completion")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--baseline", default="e0dd0e3", help="a commit with the hand-written loops"
    )
    parser.add_argument("--jobs", nargs="+", default=["sft", "ppm"])
    args = parser.parse_args()
    from rstar_sandbox.bench import machine

    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        baseline = baseline_tree(args.baseline, Path(tmp))
        for _ in range(args.rounds):
            for job in args.jobs:
                for side in ("loops", "trl"):
                    result = measure(side, job, args, baseline)
                    print(json.dumps(result), file=sys.stderr, flush=True)
                    results.setdefault((job, side), []).append(result)
    print(
        f"Machine: {machine()}; model {args.model}; {args.examples} examples, batch {args.batch}\n"
    )
    print("| job | trainer | steps | tokens | median s | tokens/s | TRL / loops |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for job in args.jobs:
        rate = {}
        for side in ("loops", "trl"):
            runs = results[(job, side)]
            seconds = statistics.median(r["seconds"] for r in runs)
            rate[side] = runs[0]["tokens"] / seconds
            name = "hand-written loop" if side == "loops" else "TRL"
            ratio = f"{rate['trl'] / rate['loops']:.2f}x" if side == "trl" else ""
            print(
                f"| {job} | {name} | {runs[0]['steps']} | {runs[0]['tokens']} | {seconds:.1f} "
                f"| {rate[side]:.0f} | {ratio} |"
            )


if __name__ == "__main__":
    main()
