"""Scripted DSER models: chains written by hand, and a model whose refinements follow known
transition probabilities. Both read prompts of one user message."""

from __future__ import annotations

import random

from rstar_pipelines.llm import Completion, Prompt, SamplingParams
from rstar_pipelines.math.answers import extract_boxed
from tests.fakes.llm import ScriptedLLM, completion

SOLVE, VERIFY, REFINE = 11, 22, 33  # max_tokens tell the phases apart
TOKENS = {SOLVE: 1, VERIFY: 10, REFINE: 100}  # completion tokens charged per phase


def content(prompt: Prompt) -> str:
    """The text of a prompt that is one user message, nothing else."""
    [message] = prompt
    assert message["role"] == "user"
    return message["content"]


class ScriptedChains(ScriptedLLM):
    """Solve (max_tokens SOLVE): `solutions[key]` for the key the prompt contains. Verify
    (VERIFY): CORRECT when the solution is one of `passing`. Refine (REFINE):
    `refined[solution]`. Each phase's completions cost TOKENS[its max_tokens]."""

    def __init__(self, solutions, refined, passing=()):
        super().__init__(prompt_tokens=5)
        self.solutions, self.refined, self.passing = solutions, refined, passing

    @property
    def asked(self) -> list[tuple[list[str], SamplingParams]]:
        """`calls` with each prompt as its message's text."""
        return [([content(p) for p in prompts], params) for prompts, params in self.calls]

    def reply(self, prompt: Prompt, params: SamplingParams) -> list[Completion]:
        text = content(prompt)
        if params.max_tokens == SOLVE:
            [texts] = [v for key, v in self.solutions.items() if key in text]
        elif params.max_tokens == VERIFY:
            passed = self._solution(text) in self.passing
            texts = ["Checked.\nVERDICT: CORRECT" if passed else "**Verdict:** wrong"]
        else:
            texts = [self.refined[self._solution(text)]]
        tokens = TOKENS[params.max_tokens]
        return [completion(t, tokens=tokens, prompt_tokens=5) for t in texts]

    def _solution(self, text: str) -> str:
        # The prompt's solution section, as the templates lay it out.
        [solution] = [s for s in self.refined if f"solution\n{s}\n\n" in text]
        return solution


class MarkovModel(ScriptedLLM):
    """Solves correctly with p0; refines a wrong solution into a correct one with p_improve and
    a correct one into a wrong one with p_degrade; wrong answers are drawn from `wrong`. Its
    verifier always says INCORRECT, so every state is refined: a plain two-state chain. Prompts
    are "solve ID", "verify ID\\nSOLUTION" and "refine ID\\nSOLUTION"; one token a completion."""

    def __init__(self, gold, p0, p_improve, p_degrade, seed, wrong=("1", "2", "3", "4", "6")):
        super().__init__(name="markov", tokens=1, prompt_tokens=5)
        self.gold, self.wrong = gold, wrong
        self.p0, self.p_improve, self.p_degrade = p0, p_improve, p_degrade
        self.rng = random.Random(seed)

    def reply(self, prompt: Prompt, params: SamplingParams) -> list[str]:
        problem, _, solution = content(prompt).partition("\n")
        phase, problem = problem.split(" ")
        if phase == "verify":
            return ["Checked.\nVERDICT: INCORRECT"]
        if phase == "solve":
            correct = [self.rng.random() < self.p0 for _ in range(params.n)]
        else:
            was_correct = extract_boxed(solution) == self.gold[problem]
            p = 1 - self.p_degrade if was_correct else self.p_improve
            correct = [self.rng.random() < p]
        return [f"\\boxed{{{self._answer(problem, c)}}}" for c in correct]

    def _answer(self, problem, correct):
        return self.gold[problem] if correct else self.rng.choice(self.wrong)


# eval_comparison's rows of a one-round pipeline with the declared methods, as (round,
# checkpoint, method), less the attention gates' token budgets (each pipeline declares its own).
COMPARED_METHODS = {
    (0, "policy", "greedy"),
    (0, "policy", "majority_of_4"),
    (0, "policy", "mcts_majority"),
    (1, "policy", "greedy"),
    (1, "policy", "majority_of_4"),
    (1, "policy", "dser"),
    (1, "policy+ppm", "mcts_best_q"),
    (1, "policy+ppm", "mcts_majority"),
    (1, "grpo_roc", "greedy"),
    (1, "grpo_roc", "tool"),
    (1, "attn_gates", "dense"),
}
