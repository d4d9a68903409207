"""How SeerAttention-R gates decode against dense attention (docs/seer-attention.md): on texts
they were not trained on, the next-token distributions under teacher forcing (KL to dense, top-1
agreement), and on math problems the greedy answers, at each token budget.

Plain functions over a model in memory; the attn_gate_eval asset calls them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class TextOutcome:
    """One text at one budget: decode steps, mean KL(dense ‖ sparse) and top-1 agreement."""

    steps: int
    kl: float
    agreement: float


@dataclass
class AnswerOutcome:
    """One problem's greedy answer at one setting (dense, or a budget)."""

    text: str
    tokens: int
    seconds: float


def text_outcomes(
    model: Any,
    gates: Any,
    ids: Any,
    budgets: list[int],
    prefill_fraction: float,
    backend: str,
) -> dict[int, TextOutcome]:
    """Per budget: teacher-forced sparse decoding of the 1-D token ids against dense (the first
    `prefill_fraction` of the text prefilled densely, then one decode step per token)."""
    from rstar_kernels.hf import enable_seer_decoding
    from rstar_kernels.quality import kl_and_agreement, teacher_forced_logits

    prefill = min(max(1, int(ids.shape[0] * prefill_fraction)), ids.shape[0] - 1)
    dense = teacher_forced_logits(model, ids, prefill)
    outcomes = {}
    for budget in budgets:
        with enable_seer_decoding(model, gates, token_budget=budget, backend=backend):
            sparse = teacher_forced_logits(model, ids, prefill)
        kl, agreement = kl_and_agreement(dense, sparse)
        outcomes[budget] = TextOutcome(dense.shape[0], kl, agreement)
    return outcomes


def answer_outcomes(
    llm: Any,
    model: Any,
    gates: Any,
    prompts: list[str],
    budgets: list[int],
    max_tokens: int,
    backend: str,
) -> dict[int | None, list[AnswerOutcome]]:
    """Greedy completions of the prompts (user messages), dense (key None) and at each budget,
    from `llm`, an LLM over `model` (TransformersLLM.wrap)."""
    from rstar_kernels.hf import enable_seer_decoding
    from rstar_pipelines.llm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    chats = [[{"role": "user", "content": p}] for p in prompts]

    def run() -> list[AnswerOutcome]:
        start = time.perf_counter()
        outs = llm.generate(chats, greedy)
        seconds = (time.perf_counter() - start) / len(chats)
        return [AnswerOutcome(c.text, c.completion_tokens, seconds) for [c] in outs]

    found: dict[int | None, list[AnswerOutcome]] = {None: run()}
    for budget in budgets:
        with enable_seer_decoding(model, gates, token_budget=budget, backend=backend):
            found[budget] = run()
    return found
