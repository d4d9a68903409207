"""The declared recipes: they validate, their dry runs multiply their assumptions out, bad ones
are refused with the field named, and the paper-scale recipe, scaled down, runs end to end against
a scripted OpenAI-compatible server on loopback."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from rstar_pipelines import recipes
from rstar_pipelines.cli import main
from rstar_pipelines.storage import query
from tests.fakes.openai_server import ScriptedOpenAIServer
from tests.fakes.repo import SHARED_DATA

PAPER, CPU = "paper-qwen-math", "cpu-gsm8k-200"
POLICY = "Qwen/Qwen2.5-Math-7B-Instruct"


@pytest.fixture(autouse=True)
def shared_data():
    if not (SHARED_DATA / "gsm8k_test.json").exists():
        pytest.skip(f"{SHARED_DATA} not present (it lives in ../shared/data beside the checkout)")


def _checked(name, tmp_path, override=None):
    return recipes.validate(recipes.load_recipe(name, override), name, tmp_path / name)


def test_the_paper_recipe_declares_the_paper_run(tmp_path):
    checked = _checked(PAPER, tmp_path)
    spec = checked.spec
    assert checked.seeds == {"gsm8k": 1319, "math500": 500}
    assert checked.heldout_seeds >= 500
    search = spec.by_key["mcts_trajectories"].params.search
    assert (search.rollouts, search.max_depth) == (16, 16)
    assert spec.by_key["mcts_eval_r4"].params.search.rollouts == 16
    assert "mcts_trajectories_r5" not in spec.by_key  # 4 rounds
    assert spec.by_key["mcts_trajectories"].model == POLICY
    assert spec.by_key["candidate_solutions"].params.sampling.n == 16
    assert checked.recipe.llm == {"backend": "openai"}


def test_the_dry_run_multiplies_the_assumptions_out(tmp_path):
    checked = _checked(PAPER, tmp_path)
    costs = {c.asset: c for c in recipes.estimate(checked)}
    fleet = checked.recipe.throughput
    seeds = 1819
    synthesis = costs["synthesized_problems"]
    assert (synthesis.jobs, synthesis.problems, synthesis.completions) == (1, seeds, 2 * seeds)
    seconds = (seeds * 2 * 400 / 20000 + seeds * 2 * 500 / 2000) / fleet.servers
    assert synthesis.hours == pytest.approx(seconds / 3600)
    search = costs["mcts_trajectories"]
    assert search.jobs == 4 and search.completions == search.problems * 320 * 4
    assert costs["policy_checkpoint"].hours == pytest.approx(16 * 4 / 8)

    result = CliRunner().invoke(main, ["recipe", "dry-run", PAPER])
    assert result.exit_code == 0, result.output
    for key in ("synthesized_problems", "mcts_trajectories", "mcts_eval", "grpo_roc_checkpoint"):
        assert key in result.output
    assert "not measurements" in result.output and "total" in result.output


def test_the_cpu_recipe_validates():
    result = CliRunner().invoke(main, ["recipe", "validate", CPU])
    assert result.exit_code == 0, result.output
    assert "seeds {'gsm8k200': 200}" in result.output


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (
            {"pipeline": {"assets": {"no_such_asset": {"x": 1}}}},
            "no declared asset ['no_such_asset']",
        ),
        ({"pipeline": {"assets": {"mcts_eval": {"search": {"rollouts": 0}}}}}, "mcts_eval"),
        ({"min_heldout": 100000}, "fewer than min_heldout 100000"),
        ({"seeds": [{"batch": "x", "path": "../shared/data/none.json"}]}, "batch x"),
        ({"select": ["mcts_evl"]}, "select: no declared asset ['mcts_evl']"),
        ({"throughput": {"servers": 0}}, "throughput.servers"),
    ],
)
def test_a_bad_recipe_is_refused_naming_what_is_wrong(tmp_path, override, named):
    path = tmp_path / "override.yaml"
    path.write_text(yaml.safe_dump(override))
    result = CliRunner().invoke(main, ["recipe", "validate", PAPER, "--override", str(path)])
    assert result.exit_code != 0 and named in result.output, result.output


# -- end to end, scaled down ------------------------------------------------------------------

SCALED_DOWN = {
    "pipeline": {
        "rounds": 1,
        "heldout": {"fraction": 0.5},
        "assets": {
            "synthesized_problems": {"sampling": {"n": 1, "max_tokens": 256}},
            "candidate_solutions": {"sampling": {"n": 3, "max_tokens": 256}},
            "mcts_trajectories": {
                "search": {"rollouts": 2, "width": 2, "max_depth": 4, "max_tokens": 256}
            },
        },
    },
    "seeds": [
        {"batch": "gsm8k", "path": "../shared/data/gsm8k_test.json", "limit": 4},
        {"batch": "math500", "path": "../shared/data/math500_test.json", "limit": 3},
    ],
    "min_heldout": 1,
    # Everything that generates before a checkpoint (those train local copies of the policy).
    "select": [
        *("seed_problems", "seed_rejects", "synthesized_problems", "problem_groups"),
        *("test_inputs", "candidate_solutions", "verified_outputs", "verified_solutions"),
        *("mcts_trajectories", "mcts_nodes", "ppm_pairs", "sft_dataset", "grpo_roc_data"),
        "gate_distill_data",
    ],
}


def _scripted_math_model(questions: dict[str, str]):
    """A policy that knows the answers to `questions` (text -> answer). Asked for a new problem,
    it restates the seed. As a solver, its odd samples answer wrongly (candidates still agree by
    a majority). As the search's policy (a prompt in the step format), even samples work the
    problem out in a step and odd ones guess; an answer follows, right after the worked step and
    wrong after the guess, so every tree holds a right and a wrong branch to pair."""

    def reply(prompt: str, sample: int) -> str:
        question = max((q for q in questions if q in prompt), key=len, default=None)
        if question is None:
            return "I do not know."
        right = f"<answer>The answer is \\boxed{{{questions[question]}}}<end_of_answer>"
        wrong = "<answer>The guess stands: \\boxed{999}<end_of_answer>"
        if "New problem:" in prompt:
            return f"New problem: Restated: {question}"
        if "<end_of_step>" not in prompt:  # a solver's chat
            return wrong if sample % 2 else right
        if WORKED in prompt or GUESSED in prompt:
            return right if WORKED in prompt else wrong
        step = GUESSED if sample % 2 else WORKED
        return f"<code>\n{step}\n<end_of_step>"

    return reply


WORKED = "# Step 1: read the numbers off the question and combine them\nworked = True"
GUESSED = "# Step 1: guess\nguess = 999"


def test_the_paper_recipe_runs_end_to_end_against_a_scripted_server(tmp_path, monkeypatch):
    override = tmp_path / "small.yaml"
    override.write_text(yaml.safe_dump(SCALED_DOWN))
    questions = {}
    for name, limit in (("gsm8k_test.json", 4), ("math500_test.json", 3)):
        for row in json.loads((SHARED_DATA / name).read_text())[:limit]:
            questions[row["question"].strip()] = row["answer"]
    server = ScriptedOpenAIServer(_scripted_math_model(questions), models=(POLICY,))
    monkeypatch.setenv("RSTAR_SANDBOX_BACKEND", "process")
    with server as url:
        monkeypatch.setenv("RSTAR_LLM_BASE_URL", url)
        result = CliRunner().invoke(main, ["recipe", "run", PAPER, "--override", str(override)])
    assert result.exit_code == 0, result.output
    assert {r["model"] for r in server.requests} == {POLICY}
    batches = query("select batch, count(*) n from seed_problems group by 1 order by 1")
    assert batches.to_pylist() == [{"batch": "gsm8k", "n": 4}, {"batch": "math500", "n": 3}]
    groups = query("select count(distinct group_id) g, count(*) n from problem_groups")
    # Each seed's restatement is grouped with it.
    assert groups.to_pylist() == [{"g": 7, "n": 14}]
    verified = query("select count(*) n from verified_outputs where verified").column("n")
    assert verified[0].as_py() >= 7
    trained = query("select distinct problem_id from sft_dataset").column("problem_id")
    heldout = query("select problem_id from problem_groups where heldout").column("problem_id")
    assert trained.to_pylist() and not set(trained.to_pylist()) & set(heldout.to_pylist())
    assert query("select count(*) n from ppm_pairs").column("n")[0].as_py() > 0
