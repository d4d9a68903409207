"""The scripted rStar-Math policy and PPM, and the golden tree's script: what the policy writes
after each partial solution of "What is 2 + 3?", whose search tree tests/math/test_mcts.py
works out by hand."""

from __future__ import annotations

from rstar_pipelines.llm import Prompt, SamplingParams
from rstar_pipelines.math.mcts import MCTSConfig, Problem, StepPrompt, search
from rstar_pipelines.math.steps import ANSWER_END, CODE_END, PREAMBLE, STEP_END
from tests.fakes.llm import ScriptedLLM

QUESTION = "What is 2 + 3?"
PREFIX = f"Question: {QUESTION}\n"
A = "<code>\n# Step 1: add the two numbers\nx = 2 + 3\n" + STEP_END
B = "<code>\n# Step 1: multiply them instead\nx = 2 * 3\n" + STEP_END
C = "<code>\nprint(1 / 0)\n" + CODE_END
D = "\nprint(x)\n" + CODE_END
E = "\nprint(z)\n" + CODE_END
F = "\n<answer>The answer is \\boxed{5}" + ANSWER_END
H = "\n# Step 2: make sure it is positive\nassert x > 0\n" + STEP_END
K = "\nprint(x - 1)\n" + CODE_END
OUT5 = "\n<output>5<end_of_output>"
OUT6 = "\n<output>6<end_of_output>"

# What the policy writes after each partial solution (the steps so far, as shown).
SCRIPT = {
    "": [A, B, C],
    A: [D, D, E],  # the duplicate of D is dropped
    A + D + OUT5: [F, "\n<answer>\\boxed{7}" + ANSWER_END],  # only the first answer stays
    B: [D, H],
    B + D + OUT6: ["\n<answer>\\boxed{6}" + ANSWER_END],
    B + H: [K],
    B + H + K + OUT5: [F],
}
STEP_STOPS = (STEP_END, CODE_END, ANSWER_END)


def padded(script: dict[str, list[str]], width: int) -> dict[str, list[str]]:
    """Every entry `width` steps long (duplicates of its last): as many as n asks for."""
    return {k: (v + [v[-1]] * width)[:width] for k, v in script.items()}


def question_and_steps(prompt: Prompt) -> tuple[str, str]:
    """The question and the steps so far of a search prompt, in either format: text whose last
    "Question: " line is followed by the steps (few-shot), or a chat whose first message is the
    question and whose last is the preamble and the steps."""
    if isinstance(prompt, str):
        question, steps = prompt.rsplit("Question: ", 1)[1].split("\n", 1)
        return question, steps
    return prompt[0]["content"].strip(), prompt[-1]["content"].removeprefix(PREAMBLE)


class StepPolicy(ScriptedLLM):
    """Writes `scripts[question][steps so far]` (default: the golden tree's `script` for
    QUESTION); every (question, steps) it is asked goes into `events`. A partial solution its
    script lacks fails the call (KeyError), as a crashed model would. Completions end at the
    step's stop string; 10 tokens each unless `tokens` says otherwise (None: one a character)."""

    def __init__(
        self,
        script: dict[str, list[str]] | None = None,
        *,
        scripts: dict[str, dict[str, list[str]]] | None = None,
        events: list | None = None,
        **options,
    ):
        super().__init__(**{"stops": STEP_STOPS, "tokens": 10, **options})
        self.scripts = (
            scripts if scripts is not None else {QUESTION: SCRIPT if script is None else script}
        )
        self.events = [] if events is None else events

    def reply(self, prompt: Prompt, params: SamplingParams) -> list[str]:
        question, steps = question_and_steps(prompt)
        self.events.append((question, steps))
        return self.scripts[question][steps]


class ScriptedPPM:
    """Scores the partial solutions it knows (the text after `prefix`), everything else 0;
    each call's prompts go into `calls`."""

    def __init__(self, values: dict[str, float], prefix: str = PREFIX):
        self.values, self.prefix = values, prefix
        self.calls: list[list] = []

    def score(self, prompts):
        self.calls.append(prompts)
        return [self.values.get(p.removeprefix(self.prefix), 0.0) for p in prompts]


PROMPT = StepPrompt(lambda q: f"Question: {q}\n")
PROBLEM = Problem("p1", QUESTION, "5")


def golden_search(sandbox, rollouts: int, **options):
    """The golden tree after `rollouts` rollouts (width 3, depth 4, one code error allowed)."""
    config = MCTSConfig(rollouts=rollouts, width=3, max_depth=4, errors_threshold=1, **options)
    return search([PROBLEM], StepPolicy(), sandbox, config, prompt=PROMPT)[0]


def state(tree) -> dict[str, tuple[int, float]]:
    """Each node's (visits, Q rounded to 6 places), by node id."""
    return {r["node_id"]: (r["visits"], round(r["q"], 6)) for r in tree.nodes.to_pylist()}
