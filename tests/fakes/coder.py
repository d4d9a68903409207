"""The scripted model of the rStar-Coder chain, so the right answer is known: a code seed whose
candidates are mostly wrong (the oracle overrides them), a synthesized problem whose candidates
agree 7 of 10, and math answers to vote on; the pipeline and seeds it runs on."""

from __future__ import annotations

import json
from pathlib import Path

from rstar_pipelines.definitions import load_spec
from rstar_pipelines.llm import Prompt, SamplingParams
from tests.fakes.llm import ScriptedLLM

SUM = "n = int(input())\nprint(sum(map(int, input().split())))\n"
SUM_ALT = "import sys\nd = sys.stdin.read().split()\nprint(sum(int(x) for x in d[1:]))\n"
WRONG_MAX = "n = int(input())\nprint(max(map(int, input().split())))\n"
SQUARES = "n = int(input())\nprint(sum(int(x) ** 2 for x in input().split()))\n"
WRONG_CUBES = "n = int(input())\nprint(sum(int(x) ** 3 for x in input().split()))\n"

SEEDS = [
    {
        "domain": "code",
        "problem": "Given n integers, print their sum.",
        "oracle_solutions": [SUM],
        "examples": [{"stdin": "3\n1 2 3\n", "stdout": "6\n"}],
    },
    {"domain": "math", "problem": "What is 2 + 3?", "answer": "5"},
]
SYNTHESIZED_CODE = """### Problem
Given n integers, print the sum of their squares.

### Input
The first line contains n (1 <= n <= 1000). The second line contains n integers.

### Output
Print one integer.

### Examples
Input:
```
2
1 2
```
Output:
```
5
```
Input:
```
1
3
```
Output:
```
9
```"""
GENERATOR = """```python
import random

def generate_test_input(n):
    if not 1 <= n <= 1000:
        return None
    return f"{n}\\n" + " ".join(str(random.randint(-50, 50)) for _ in range(n)) + "\\n"

def validate_test_input(text):
    lines = text.split("\\n")
    n = int(lines[0])
    return len(lines[1].split()) == n

SCALES = {"n": [1, 2, 5, 10, 100, 1000]}
```"""


def _block(program: str) -> str:
    return f"Let me think step by step.\n```python\n{program}```"


def scripted_reply(prompt: str, index: int) -> str:
    """What the scripted model writes for a prompt (its i-th sample)."""
    if "## Seed solution" in prompt:
        return "Knowledge points: sums.\n" + SYNTHESIZED_CODE
    if "New problem:" in prompt and "2 + 3" in prompt:
        return "New problem: What is 3 + 4?"
    if "generate_test_input" in prompt:  # before the problems: its prompt quotes them
        return GENERATOR
    if "sum of their squares" in prompt:  # synthesized: 7 of 10 agree
        return _block(SQUARES if index < 7 else WRONG_CUBES)
    if "print their sum" in prompt:  # seed: a wrong majority the oracle overrides
        return _block(WRONG_MAX if index < 7 else (SUM if index % 2 else SUM_ALT))
    if "3 + 4" in prompt:
        return (
            ["The answer is \\boxed{7}.", "\\boxed{7.0}", "\\boxed{\\frac{14}{2}}"][index % 3]
            if index < 7
            else "\\boxed{8}"
        )
    if "2 + 3" in prompt:
        return "\\boxed{5}" if index < 4 else "\\boxed{6}"
    raise AssertionError(f"unexpected prompt: {prompt[:200]}")


def coder_reply(prompt: Prompt, params: SamplingParams) -> list[str]:
    """`params.n` samples of `scripted_reply` for a chat prompt's last message."""
    return [scripted_reply(prompt[-1]["content"], i) for i in range(params.n)]


# One model for every test and code location process: tests count the prompts it was asked.
CODER = ScriptedLLM(coder_reply, tokens=10)


CHAIN = [
    "seed_problems",
    "seed_rejects",
    "synthesized_problems",
    "test_inputs",
    "candidate_solutions",
    "verified_outputs",
    "verified_solutions",
]


def _set_samples(spec, key: str, n: int) -> None:
    asset = spec.by_key[key]
    sampling = asset.params.sampling.model_copy(update={"n": n})
    asset.params = asset.params.model_copy(update={"sampling": sampling})


def scripted_spec():
    """The demo pipeline with ten candidates per problem and one synthesized problem per seed."""
    spec = load_spec()
    _set_samples(spec, "candidate_solutions", 10)
    _set_samples(spec, "synthesized_problems", 1)
    return spec


def write_seeds(incoming: Path, batch: str) -> None:
    (incoming / f"{batch}.jsonl").write_text("\n".join(json.dumps(s) for s in SEEDS) + "\n")
