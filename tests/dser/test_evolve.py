"""DSER chains with scripted models: batching and bookkeeping by hand, a model whose refinements
follow known transition probabilities (the estimates must converge to them), the vote, and the
code judge on the real sandbox."""

from __future__ import annotations

import math

import pytest

from rstar_pipelines.dser.chain import ChainState
from rstar_pipelines.dser.evolve import (
    DSERConfig,
    DSERProblem,
    DSERPrompts,
    Judge,
    parse_verdict,
    problem_bytes,
    run_dser,
)
from rstar_pipelines.dser.markov import (
    accuracy_after,
    accuracy_by_iteration,
    estimate,
    transition_counts,
)
from rstar_pipelines.dser.vote import last_states, vote
from rstar_pipelines.pipeline.prompts import PromptTemplate
from rstar_pipelines.settings import prompts_dir
from rstar_sandbox import Sandbox
from tests.fakes.dser import REFINE, SOLVE, VERIFY, MarkovModel, ScriptedChains
from tests.fakes.sandbox import CountingSandbox


def _templates() -> DSERPrompts:
    load = lambda role: PromptTemplate.load(prompts_dir(), f"dser_{role}.jinja")  # noqa: E731
    return DSERPrompts.from_templates(load("solve"), load("verify"), load("refine"))


# -- parsing and configuration ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("critique", "verdict"),
    [
        ("All steps check out.\nVERDICT: CORRECT", True),
        ("The sum is wrong.\nVERDICT: INCORRECT", False),
        ("**Verdict:** correct", True),
        ("verdict - Incorrect.", False),
        ("`VERDICT: CORRECT`", True),
        # the last verdict counts: a model that changes its mind
        ("VERDICT: CORRECT\nWait, 3*4 is 12, not 11.\nVERDICT: INCORRECT", False),
        ("The solution looks correct.", None),
        ("VERDICT: CORRECTLY DONE", None),
        ("", None),
    ],
)
def test_parse_verdict(critique, verdict):
    assert parse_verdict(critique) is verdict


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match=r"vote_last=4 exceeds the 3 states of a chain"):
        DSERConfig(iterations=2, vote_last=4)
    with pytest.raises(ValueError, match="chains"):
        DSERConfig(chains=0)
    with pytest.raises(ValueError, match="extra"):
        DSERConfig(chain=2)
    DSERConfig(iterations=2, vote_last=3)  # s_0 may be in the window


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        (DSERProblem("c", "code", "q"), "'c': a code problem needs test inputs"),
        (DSERProblem("c", "code", "q", inputs=("1",), labels=("1", "2")), "2 labels for 1"),
        (DSERProblem("p", "chess", "q"), "'p': domain 'chess' is not one of"),  # type: ignore[arg-type]
    ],
)
def test_bad_problems_are_rejected_before_any_call(problem, message):
    llm = ScriptedChains({}, {})
    with pytest.raises(ValueError, match=message):
        run_dser(
            llm, [problem], DSERConfig(chains=1, iterations=1, vote_last=1), _templates(), Judge()
        )
    assert llm.calls == []


def test_duplicate_problem_ids_are_rejected():
    problem = DSERProblem("m", "math", "q", "1")
    with pytest.raises(ValueError, match="'m' appears twice"):
        run_dser(ScriptedChains({}, {}), [problem, problem], DSERConfig(), _templates(), Judge())


def test_code_needs_a_sandbox():
    problem = DSERProblem("c", "code", "q", inputs=("1",), labels=("1",))
    with pytest.raises(ValueError, match="no sandbox"):
        Judge().grade([(problem, "print(1)")])


def test_templates_render_every_variable():
    prompts = _templates()
    math_problem = DSERProblem("m", "math", "What is 2 + 3?", "5")
    code_problem = DSERProblem("c", "code", "Print the sum of two integers.", inputs=("1 2",))
    assert "What is 2 + 3?" in prompts.solve(math_problem)
    assert "\\boxed{}" in prompts.solve(math_problem)
    assert "```python" in prompts.solve(code_problem)
    verify = prompts.verify(math_problem, "2 + 3 = 6, so \\boxed{6}")
    assert "2 + 3 = 6, so \\boxed{6}" in verify
    assert "VERDICT: CORRECT" in verify and "VERDICT: INCORRECT" in verify
    refine = prompts.refine(code_problem, "print(1)", "It ignores the input.")
    assert all(s in refine for s in ("Print the sum", "print(1)", "It ignores the input."))
    assert "```python" in refine and "\\boxed" not in refine


# -- batching and bookkeeping on a hand-made script -------------------------------------------

HALF = DSERProblem("half", "math", "What is half of 1?", "1/2")
SUM = DSERProblem("sum", "math", "What is 2 + 3?", "5")


def _config(**options):
    options = {"chains": 3, "iterations": 2, "vote_last": 2, "seed": 100} | options
    return DSERConfig(solve_tokens=SOLVE, verify_tokens=VERIFY, refine_tokens=REFINE, **options)


def per_prompt(llm):
    """(max_tokens, n, seed) of every prompt the model was asked, in a stable order: how the
    chains' requests fell into generate calls depends on when each chain was ready."""
    return sorted((p.max_tokens, p.n, p.seed) for contents, p in llm.calls for _ in contents)


SUM_AND_HALF = {
    "solutions": {
        "2 + 3": ["So \\boxed{5}", "So \\boxed{6}", "I do not know"],
        "half of": ["So \\boxed{0.5}", "So \\boxed{2}", "So \\boxed{1/2}"],
    },
    # the verifier passes 5 and 0.5 only: a correct 1/2 is refined into itself
    "passing": ("So \\boxed{5}", "So \\boxed{0.5}"),
    "refined": {
        "So \\boxed{5}": "-",
        "So \\boxed{6}": "So \\boxed{5}",
        "I do not know": "So \\boxed{5}",
        "So \\boxed{0.5}": "-",
        "So \\boxed{2}": "So \\boxed{1/2}",
        "So \\boxed{1/2}": "So \\boxed{1/2}",
    },
}


def test_every_phase_of_every_chain_is_sampled_with_its_seed():
    llm = ScriptedChains(**SUM_AND_HALF)
    prompts = _templates()
    reported = {}  # problem -> (its run, its seconds, the model calls made by then)
    sum_run, half_run = run_dser(
        llm,
        [SUM, HALF],
        _config(),
        prompts,
        Judge(),
        lambda p, run, seconds: reported.setdefault(p, (run, seconds, len(llm.calls))),
    )
    # Each problem reported once, as soon as its chains ended: sum's before half's last
    # refinements were sampled.
    assert reported[0][0] == sum_run and reported[1][0] == half_run
    assert reported[0][2] < reported[1][2] == len(llm.calls)
    assert 0 < reported[0][1] < reported[1][1]

    # solve: both problems, n=3, in one call; iteration 1: 6 verifications, 4 refinements
    # (sum 1-2, half 1-2); iteration 2: 6 verifications, 2 refinements (half 1-2, refined
    # into 1/2 again)
    assert per_prompt(llm) == sorted(
        [(SOLVE, 3, 100)] * 2
        + [(VERIFY, 1, 101)] * 6
        + [(REFINE, 1, 102)] * 4
        + [(VERIFY, 1, 103)] * 6
        + [(REFINE, 1, 104)] * 2
    )
    solve_prompts, _ = llm.asked[0]
    assert solve_prompts == [prompts.solve(SUM), prompts.solve(HALF)]
    asked = {content for contents, _ in llm.asked for content in contents}
    assert prompts.verify(SUM, "So \\boxed{6}") in asked
    assert prompts.refine(SUM, "So \\boxed{6}", "**Verdict:** wrong") in asked

    texts = lambda run: [[s.text for s in chain] for chain in run.chains]  # noqa: E731
    assert texts(sum_run) == [
        ["So \\boxed{5}"] * 3,  # passed twice: kept
        ["So \\boxed{6}", "So \\boxed{5}", "So \\boxed{5}"],
        ["I do not know", "So \\boxed{5}", "So \\boxed{5}"],
    ]
    assert [[s.answer for s in chain] for chain in sum_run.chains][2] == [None, "5", "5"]
    assert sum_run.correctness == [[True] * 3, [False, True, True], [False, True, True]]
    assert [[s.verdict for s in chain] for chain in sum_run.chains] == [
        [True, True, None],
        [False, True, None],
        [False, True, None],
    ]
    assert [[s.iteration for s in chain] for chain in half_run.chains] == [[0, 1, 2]] * 3
    assert texts(half_run)[2] == ["So \\boxed{1/2}"] * 3  # refined into the same text
    assert [[s.verdict for s in chain] for chain in half_run.chains][2] == [False, False, None]

    # Tokens: sum: 3 solves (1) + 6 verifications (10) + 2 refinements (100) = 263;
    # half: 3 + 60 + 4 refinements = 463. A kept state costs only its verification.
    assert (sum_run.tokens, sum_run.calls) == (263, 3 + 6 + 2)
    assert (half_run.tokens, half_run.calls) == (463, 3 + 6 + 4)
    assert [s.tokens for s in sum_run.chains[0]] == [1 + 10, 0 + 10, 0]
    assert [s.tokens for s in sum_run.chains[1]] == [1 + 10, 100 + 10, 0]
    for run in (sum_run, half_run):
        assert run.tokens == sum(s.tokens for chain in run.chains for s in chain)

    # The vote pools iterations 1-2 of all chains: sum, six 5s; half: 0.5 twice and 1/2 four
    # times, one class whose first member (chain 0) is 0.5.
    assert (sum_run.vote_answer, sum_run.vote_share, sum_run.vote_correct) == ("5", 1.0, True)
    assert (half_run.vote_answer, half_run.vote_share, half_run.vote_correct) == ("0.5", 1.0, True)


def test_the_memory_budget_bounds_the_problems_open_at_once():
    """A budget that holds one problem's chains runs the problems one after another, with the
    same chains as when both run at once (each phase keeps its seed)."""
    config = _config()
    one_problem = 1.5 * problem_bytes(config) / 2**20
    bounded, unbounded = ScriptedChains(**SUM_AND_HALF), ScriptedChains(**SUM_AND_HALF)
    runs = run_dser(bounded, [SUM, HALF], config, _templates(), Judge(), memory_mb=one_problem)
    assert runs == run_dser(unbounded, [SUM, HALF], config, _templates(), Judge())
    assert all(len({"2 + 3" in p for p in prompts}) == 1 for prompts, _ in bounded.asked)
    assert len(bounded.calls) > len(unbounded.calls)  # the two never shared a call
    longer = config.model_copy(update={"iterations": 4, "refine_tokens": 2 * REFINE})
    assert problem_bytes(longer) > problem_bytes(config)


def test_no_refine_call_when_every_chain_passes():
    llm = ScriptedChains(
        solutions={"2 + 3": ["So \\boxed{5}", "So \\boxed{7}"]},
        passing=("So \\boxed{5}", "So \\boxed{7}"),
        refined={"So \\boxed{5}": "-", "So \\boxed{7}": "-"},
    )
    [run] = run_dser(
        llm, [SUM], _config(chains=2, iterations=3, vote_last=4), _templates(), Judge()
    )
    assert [t for t, _, _ in per_prompt(llm)] == [SOLVE] + [VERIFY] * 6
    assert [[s.answer for s in chain] for chain in run.chains] == [["5"] * 4, ["7"] * 4]
    # a tie of four 5s and four 7s goes to chain 0's class
    assert (run.vote_answer, run.vote_share, run.vote_correct) == ("5", 0.5, True)
    asked = len(per_prompt(llm))
    assert run_dser(llm, [], _config(), _templates(), Judge()) == []
    assert len(per_prompt(llm)) == asked


# -- a scripted model with known transition probabilities -------------------------------------


MARKOV_PROMPTS = DSERPrompts(
    solve=lambda p: f"solve {p.id}",
    verify=lambda p, s: f"verify {p.id}\n{s}",
    refine=lambda p, s, c: f"refine {p.id}\n{s}",
)
GOLD = {"a": "7", "b": "12", "c": "5"}
PROBLEMS = [DSERProblem(k, "math", f"question {k}", v) for k, v in GOLD.items()]


def _within(estimated, true, n, se_multiple=4.0):
    return abs(estimated - true) <= se_multiple * math.sqrt(true * (1 - true) / n)


def test_estimates_converge_to_the_true_transition_probabilities():
    p0, p_improve, p_degrade = 0.2, 0.3, 0.1
    config = DSERConfig(chains=60, iterations=20, vote_last=5, seed=0)
    model = MarkovModel(GOLD, p0, p_improve, p_degrade, seed=1)
    runs = run_dser(model, PROBLEMS[:2], config, MARKOV_PROMPTS, Judge())

    chains = [chain for run in runs for chain in run.correctness]
    counts = transition_counts(chains)
    from_incorrect, from_correct = counts.ic + counts.ii, counts.cc + counts.ci
    assert from_incorrect + from_correct == 2 * 60 * 20
    assert min(from_incorrect, from_correct) > 400  # enough to make the check sharp
    result = estimate(counts)
    assert _within(result.p_improve, p_improve, from_incorrect)
    assert _within(result.p_degrade, p_degrade, from_correct)
    assert abs(result.predicted - 0.75) < 0.06

    # The per-iteration accuracy follows P_t(C) = pi + (p0 - pi)(1 - p_i - p_d)^t.
    for t, observed in enumerate(accuracy_by_iteration(chains)):
        expected = accuracy_after(p0, p_improve, p_degrade, t)
        assert _within(observed, expected, len(chains)), (t, observed, expected)


def test_vote_recovers_the_answer_when_improving_beats_degrading():
    config = DSERConfig(chains=8, iterations=10, vote_last=4, seed=0)
    runs = run_dser(
        MarkovModel(GOLD, 0.2, 0.3, 0.1, seed=2), PROBLEMS, config, MARKOV_PROMPTS, Judge()
    )
    assert [(r.vote_answer, r.vote_correct) for r in runs] == [(v, True) for v in GOLD.values()]


def test_vote_loses_when_degrading_dominates():
    config = DSERConfig(chains=8, iterations=10, vote_last=4, seed=0)
    runs = run_dser(
        MarkovModel(GOLD, 0.5, 0.02, 0.6, seed=3), PROBLEMS, config, MARKOV_PROMPTS, Judge()
    )
    # long-run accuracy 0.02 / 0.62 ~ 0.03, below each of the five scattered wrong answers'
    assert [r.vote_correct for r in runs] == [False] * 3
    assert all(r.vote_answer not in GOLD.values() for r in runs)


# -- pooling and voting on hand-made chains ---------------------------------------------------


def _chain(answers, gold=None, signatures=None):
    signatures = signatures or [None] * len(answers)
    return [
        ChainState(
            iteration=t,
            text=f"state {t}",
            answer=a,
            verdict=None,
            correct=None if gold is None else a == gold,
            tokens=0,
            signature=s,
        )
        for t, (a, s) in enumerate(zip(answers, signatures, strict=True))
    ]


def test_vote_pools_only_the_last_states():
    chains = [
        _chain(["3", "3", "3", "7"], gold="7"),
        _chain(["3", "3", "\\frac{1}{2}", "0.5"], gold="7"),
        _chain([None, "3", "7", None], gold="7"),
    ]
    # last 2: 3 7 | 1/2 0.5 | 7 None -> {7: 2, 1/2: 2, 3: 1}; the tie goes to 7 (seen first)
    pooled = last_states(chains, 2)
    assert [s.answer for s in pooled] == ["3", "7", "\\frac{1}{2}", "0.5", "7", None]
    result = vote(pooled, "math")
    assert (result.answer, result.members, result.correct) == ("7", (1, 4), True)
    assert result.share == pytest.approx(2 / 6)
    # all four states: 3 holds six of twelve (three, two and one per chain)
    result = vote(last_states(chains, 4), "math")
    assert (result.answer, result.correct, result.share) == ("3", False, 6 / 12)


def test_equivalent_answers_vote_together():
    states = _chain(["\\frac{1}{2}", "7", "0.5", "1/2", "7"])
    result = vote(states, "math")
    assert (result.answer, result.members, result.correct) == ("\\frac{1}{2}", (0, 2, 3), None)


def test_no_answers_vote_for_nothing():
    assert vote(_chain([None, None], gold="7"), "math").correct is False
    ungraded = vote(_chain([None, " "]), "math")
    assert (ungraded.answer, ungraded.share, ungraded.members, ungraded.correct) == (
        None,
        0.0,
        (),
        None,
    )
    with pytest.raises(ValueError, match="last=0"):
        last_states([_chain(["1"])], 0)
    with pytest.raises(ValueError, match="domain 'chess'"):
        vote(_chain(["1"]), "chess")


def test_code_votes_by_output_signature():
    states = _chain(
        ["p0", "p1", "p2", "p3", "p4", "p5"],
        signatures=[None, ("4",), ("3", "1"), None, ("3", "1"), None],
    )
    result = vote(states, "code")
    # three programs without a signature (no code or a failed run) do not make a class
    assert (result.answer, result.members, result.share) == ("p2", (2, 4), 2 / 6)


# -- the code judge on the real sandbox -------------------------------------------------------

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_TOO = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
MUL = "a, b = map(int, input().split())\nprint(a * b)\n"
CRASH = "print(1 / 0)\n"
ADDITION = DSERProblem(
    "add", "code", "Print the sum of two integers.", inputs=("1 2\n", "5 7\n"), labels=("3", "12")
)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(backend="process", workers=2) as sb:
        yield CountingSandbox(sb)


def test_code_judge_runs_every_program_in_one_sandbox_run(sandbox):
    before = sandbox.runs
    grades = Judge(sandbox).grade(
        [
            (ADDITION, ADD),
            (ADDITION, ADD_TOO),
            (ADDITION, MUL),
            (ADDITION, CRASH),
            (ADDITION, None),
            (SUM, "5"),
        ]
    )
    assert sandbox.runs == before + 1
    assert [g.correct for g in grades] == [True, True, False, False, False, True]
    assert [g.signature for g in grades] == [
        ("3", "12"),
        ("3", "12"),
        ("2", "35"),
        None,
        None,
        None,
    ]
    unlabelled = DSERProblem("add", "code", "q", inputs=ADDITION.inputs)
    [grade] = Judge(sandbox).grade([(unlabelled, ADD)])
    assert (grade.correct, grade.signature) == (None, ("3", "12"))


def _fenced(program):
    return f"Here is the program.\n```python\n{program}```\n"


def test_code_chains_vote_by_output_signature(sandbox):
    llm = ScriptedChains(
        solutions={
            "sum of two": [_fenced(ADD), _fenced(CRASH), _fenced(MUL)],
            "2 + 3": ["So \\boxed{5}"] * 3,
        },
        refined={
            _fenced(ADD).strip(): _fenced(ADD_TOO),
            _fenced(CRASH).strip(): _fenced(CRASH),
            _fenced(MUL).strip(): _fenced(CRASH),
            "So \\boxed{5}": "So \\boxed{5}",
        },
    )
    before = sandbox.runs
    code_run, math_run = run_dser(
        llm, [ADDITION, SUM], _config(iterations=1, vote_last=2), _templates(), Judge(sandbox)
    )
    # both domains' chains through the same model; a sandbox run for each batch of code
    # states waiting to be graded: the first solutions, then the refinements (1 to 3 runs)
    assert [t for t, _, _ in per_prompt(llm)] == [SOLVE] * 2 + [VERIFY] * 6 + [REFINE] * 6
    assert before + 2 <= sandbox.runs <= before + 4
    assert [[s.answer for s in chain] for chain in code_run.chains] == [
        [ADD, ADD_TOO],
        [CRASH, CRASH],
        [MUL, CRASH],
    ]
    assert code_run.correctness == [[True, True], [False, False], [False, False]]
    # the crashing program is the most common text (3 of 6) but votes for nothing; the two
    # different adding programs print the same outputs and beat the multiplication
    assert (code_run.vote_answer, code_run.vote_correct) == (ADD, True)
    assert code_run.vote_share == pytest.approx(2 / 6)
    assert (math_run.vote_answer, math_run.vote_correct) == ("5", True)
