"""mcts_eval, dser_eval, grpo_eval and eval_comparison through Dagster: a scripted policy (the
golden MCTS tree's steps, fixed DSER solutions, critiques and refinements, and a tool-using agent)
with a real PPM from a tiny random model and the real sandbox; every figure below is computed by
hand."""

from __future__ import annotations

import logging

import dagster as dg
import pyarrow as pa
import pytest

from rstar_pipelines import settings
from rstar_pipelines.definitions import build_definitions, load_spec
from rstar_pipelines.dser.evolve import DSERProblem, DSERPrompts
from rstar_pipelines.math.steps import PREAMBLE
from rstar_pipelines.pipeline.cache_store import cache_location
from rstar_pipelines.pipeline.prompts import PromptTemplate
from rstar_pipelines.pipeline.stage import StageContext, StageInputError
from rstar_pipelines.sandbox_resource import SandboxResource
from rstar_pipelines.storage import query, schemas
from rstar_pipelines.storage.parquet_io import write_table
from tests.fakes.agent import call
from tests.fakes.dser import COMPARED_METHODS
from tests.fakes.llm import ScriptedLLM, ScriptedLLMResource
from tests.fakes.math import SCRIPT, STEP_STOPS, A, D
from tests.fakes.repo import REPO

MATH_Q = "What is 2 + 3?"
CODE_Q = "Read an integer n and print 2 * n."
SPLIT = load_spec(REPO / "assets" / "pipeline.yaml").by_key["mcts_eval"].params.heldout
IDS = [f"p{i}" for i in range(40)]
HELDOUT = [i for i in IDS if SPLIT.is_heldout(i)]
TRAIN = [i for i in IDS if not SPLIT.is_heldout(i)]
MATH_IDS = HELDOUT[:2]  # mcts_eval and dser_eval take at most 2 of each domain
CODE_ID = HELDOUT[2]

# DSER on the math problem. Chain 0: wrong (I), refined to right (C), verified and kept (C).
# Chain 1: right (C) but its verification says otherwise, refined to wrong (I), refined
# to right again (C).
WRONG = "2 + 3 = 6, so \\boxed{6}"
RIGHT = "2 + 3 = 5, so \\boxed{5}"
FIXED = "Adding again: \\boxed{5}"
BROKEN = "Maybe it is \\boxed{7}"
# The code problem. Chain 0: right and verified twice (C, C, C); chain 1: wrong (prints
# n + 2: right on 2, wrong on 5), refined to another right program (I, C, C).
GOOD = "```python\nn = int(input())\nprint(2 * n)\n```"
BAD = "```python\nn = int(input())\nprint(n + 2)\n```"
GOOD2 = "```python\nprint(int(input()) * 2)\n```"

NO = "VERDICT: INCORRECT"
YES = "VERDICT: CORRECT"
VERIFY = {
    WRONG: f"3 + 2 is not 6.\n{NO}",
    RIGHT: f"I am not sure.\n{NO}",
    FIXED: f"Checks out.\n{YES}",
    BROKEN: f"2 + 3 is not 7.\n{NO}",
    GOOD: f"Doubles n.\n{YES}",
    BAD: f"Adds 2 instead of doubling.\n{NO}",
    GOOD2: f"Doubles n too.\n{YES}",
}
REFINE = {WRONG: FIXED, RIGHT: BROKEN, BROKEN: FIXED, BAD: GOOD2}
SOLVE = {"math": [WRONG, RIGHT], "code": [GOOD, BAD]}

# The agent (grpo_eval): a tool call first, then, after the tool's response, its answer.
AGENT_CALL = {"math": call("print(2 + 3)"), "code": call("print(2 * 21)")}
AGENT_ANSWER = {
    "math": "<answer>\\boxed{5}</answer>",
    "code": "<answer>\n```python\nn = int(input())\nprint(2 * n)\n```\n</answer>",
}

MATH = DSERProblem("m", "math", MATH_Q, "5")
CODE = DSERProblem("c", "code", CODE_Q, inputs=("2", "5"), labels=("4", "10"))


def _prompts() -> DSERPrompts:
    load = lambda name: PromptTemplate.load(REPO / "assets" / "prompts", name)  # noqa: E731
    return DSERPrompts.from_templates(
        load("dser_solve.jinja"), load("dser_verify.jinja"), load("dser_refine.jinja")
    )


def _dser_script() -> dict[str, list[str]]:
    """What the policy writes after each DSER prompt (a user message)."""
    prompts, script = _prompts(), {}
    for problem in (MATH, CODE):
        script[prompts.solve(problem)] = SOLVE[problem.domain]
        for solution, critique in VERIFY.items():
            script[prompts.verify(problem, solution)] = [critique]
            if solution in REFINE:
                script[prompts.refine(problem, solution, critique)] = [REFINE[solution]]
    return script


def _tokens(text: str) -> int:
    return len(text)  # what each scripted completion costs


def _reply(prompt, params) -> list[str]:
    """The golden MCTS tree's steps after the search's prompt (the question, then the steps so
    far, as chat or after the few-shot text); the agent's turns after its system prompt; the
    DSER script after a single user message."""
    if isinstance(prompt, str):  # the base policy's search: the few-shot prompt
        return SCRIPT[prompt.split(f"Question: {MATH_Q}\n")[-1]]
    if prompt[0]["role"] == "system":  # the agent
        domain = "math" if MATH_Q in prompt[1]["content"] else "code"
        done = "<tool_response>" in prompt[-1]["content"]
        return [(AGENT_ANSWER if done else AGENT_CALL)[domain]]
    if len(prompt) == 2:  # the search
        assert prompt[0]["content"].strip() == MATH_Q
        return SCRIPT[prompt[1]["content"].removeprefix(PREAMBLE)]
    return DSER_SCRIPT[prompt[0]["content"]]


DSER_SCRIPT = _dser_script()
# `n` completions: the scripted ones, repeated in turn; one token a character.
POLICY = ScriptedLLM(_reply, cycle=True, stops=STEP_STOPS)


def _write_upstream(tmp_path, tiny_base) -> str:
    """The verified problems of batch b1 and this round's checkpoints; the policy's path."""
    from rstar_pipelines.training.ppm import ppm_from_base

    math_ids = [*MATH_IDS, TRAIN[0]]  # the last is on the training side of the split
    code_ids = [CODE_ID, TRAIN[1]]
    problems, verified = [], []
    for domain, ids, text in (("math", math_ids, MATH_Q), ("code", code_ids, CODE_Q)):
        for i in ids:
            problems.append(
                {
                    "id": i,
                    "batch": "b1",
                    "domain": domain,
                    "problem": text,
                    "is_seed": True,
                    "seed_id": i,
                }
            )
            verified.append(
                {
                    "problem_id": i,
                    "batch": "b1",
                    "domain": domain,
                    "verified": True,
                    "answer": "5" if domain == "math" else None,
                    "inputs": list(CODE.inputs) if domain == "code" else [],
                    "labels": list(CODE.labels) if domain == "code" else [],
                }
            )
    # Each problem its own group: they share a text only so that the scripted policy knows them.
    groups = [
        {"problem_id": p["id"], "batches": ["b1"], "domain": p["domain"], "seed_id": p["id"]}
        | {"group_id": p["id"], "group_size": 1, "heldout": SPLIT.is_heldout(p["id"])}
        for p in problems
    ]
    lake = settings.lake_dir()
    write_table(
        pa.Table.from_pylist(problems, schema=schemas.SYNTHESIZED_PROBLEMS),
        lake / "synthesized_problems" / "b1.parquet",
    )
    write_table(
        pa.Table.from_pylist(groups, schema=schemas.PROBLEM_GROUPS),
        lake / "problem_groups.parquet",
    )
    write_table(
        pa.Table.from_pylist(verified, schema=schemas.VERIFIED_OUTPUTS),
        lake / "verified_outputs" / "b1.parquet",
    )
    policy = str(tmp_path / "policy")  # the scripted resource answers for any path
    ppm = ppm_from_base(tiny_base).save(tmp_path / "ppm")
    grpo = str(tmp_path / "grpo")
    for key, path in (
        ("policy_checkpoint", policy),
        ("ppm_checkpoint", str(ppm)),
        ("grpo_roc_checkpoint", grpo),
    ):
        row = {"id": key, "job": key, "round": 1, "path": path, "base_model": tiny_base}
        write_table(pa.Table.from_pylist([row], schema=schemas.CHECKPOINT), lake / f"{key}.parquet")
    write_table(
        pa.Table.from_pylist(GATE_ROWS, schema=schemas.ATTN_GATE_EVAL),
        lake / "attn_gate_eval.parquet",
    )
    return policy


def _gate_answer(problem_id: str, correct: bool) -> dict:
    return {
        "problem_id": problem_id,
        "batch": "b1",
        "answer": "5" if correct else None,
        "correct": correct,
        "same_as_dense": True,
        "tokens": 30,
        "seconds": 0.5,
    }


# attn_gate_eval, as tests/training/test_gate_assets.py makes it (here written by hand): dense and
# one budget, each right on the first held-out math problem only.
GATE_ROWS = [
    {
        "setting": setting,
        "token_budget": budget,
        "texts": 1,
        "decode_steps": 40,
        "kl": kl,
        "top1_agreement": agreement,
        "math_problems": 2,
        "answer_accuracy": 0.5,
        "answer_agreement_with_dense": 1.0,
        "answers": [_gate_answer(MATH_IDS[0], True), _gate_answer(MATH_IDS[1], False)],
        "gates": "gates",
        "base_model": "tiny",
    }
    for setting, budget, kl, agreement in (("dense", None, None, None), ("budget 32", 32, 0.1, 0.9))
]


@pytest.fixture
def evaluation(tmp_path, tiny_base):
    spec = load_spec(REPO / "assets" / "pipeline.yaml")
    defs = build_definitions(spec)
    resources = {
        **defs.resources,
        "llm": ScriptedLLMResource.serving(POLICY),
        "sandbox": SandboxResource(backend="process", workers=2),
    }
    policy = _write_upstream(tmp_path, tiny_base)
    resource = ScriptedLLMResource.serving(POLICY)
    models = (policy, str(tmp_path / "grpo"), spec.by_key["base_policy_eval"].stage().model)
    return defs, resources, *map(resource.model_id, models)


def _materialize(defs, resources, instance):
    result = dg.materialize(
        list(defs.assets),
        selection=["base_policy_eval", "mcts_eval", "dser_eval", "grpo_eval", "eval_comparison"],
        instance=instance,
        resources=resources,
    )
    assert result.success
    return {k: query(f"select * from {k} order by {order}").to_pylist() for k, order in ORDER}


ORDER = (
    ("base_policy_eval", "problem_id"),
    ("mcts_eval", "problem_id"),
    ("dser_eval", "problem_id"),
    ("grpo_eval", "method, problem_id"),
    ("eval_comparison", "round, checkpoint, method"),
)


def _metadata(instance, key):
    event = instance.get_latest_materialization_event(dg.AssetKey(key))
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}


@pytest.mark.slow
def test_the_evaluations_and_their_comparison(evaluation, tmp_path):
    defs, resources, policy, grpo, base = evaluation
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", ["b1"])
        first = _materialize(defs, resources, instance)
        calls = POLICY.prompts

        # mcts_eval: the two held-out math problems. Greedy (one sample, two steps) writes
        # A, then D, and its steps are spent before an answer.
        mcts = first["mcts_eval"]
        assert sorted(r["problem_id"] for r in mcts) == sorted(MATH_IDS)
        for r in mcts:
            assert (r["greedy_answer"], r["greedy_correct"]) == (None, False)
            assert r["greedy_tokens"] == _tokens(A) + _tokens(D)
            assert r["search_tokens"] > r["greedy_tokens"]
            assert r["greedy_seconds"] > 0 and r["search_seconds"] > 0
            assert r["policy"] == policy
            # The PPM valued every answer the search found; the gold answer scored the picks.
            assert r["answers_valued_by_ppm"] == r["search_answers"] > 0
            assert r["best_q_correct"] == (r["best_q_answer"] == "5")
        eval_md = _metadata(instance, "mcts_eval")
        assert eval_md["gold_answer_in_search"] is False
        assert eval_md["search_ppm_calls"] > 0

        # grpo_eval: one turn ends on the tool call, unanswered; with the tool, the answer
        # follows the tool's response, on the math and the code problem alike.
        tool_eval = first["grpo_eval"]
        assert [(r["method"], r["correct"], r["tool_calls"]) for r in tool_eval] == [
            ("greedy", False, 0),
            ("greedy", False, 0),
            ("greedy", False, 0),
            ("tool", True, 1),
            ("tool", True, 1),
            ("tool", True, 1),
        ]
        assert {r["policy"] for r in tool_eval} == {grpo}

        # dser_eval: the two math problems and the held-out code problem.
        dser = {r["problem_id"]: r for r in first["dser_eval"]}
        assert sorted(dser) == sorted([*MATH_IDS, CODE_ID])
        math = dser[MATH_IDS[0]]
        states = [(s["chain"], s["iteration"], s["text"], s["correct"]) for s in math["states"]]
        assert states == [
            (0, 0, WRONG, False),
            (0, 1, FIXED, True),
            (0, 2, FIXED, True),
            (1, 0, RIGHT, True),
            (1, 1, BROKEN, False),
            (1, 2, FIXED, True),
        ]
        assert [s["verdict"] for s in math["states"]] == [False, True, None, False, False, None]
        # Transitions: chain 0 I->C, C->C; chain 1 C->I, I->C. p_improve = 2/2, p_degrade
        # = 1/2, stationary accuracy 1 / 1.5; the last 2 states: 3 of 4 correct.
        counts = [math[f"transitions_{k}"] for k in ("cc", "ci", "ic", "ii")]
        assert counts == [1, 1, 2, 0]
        assert (math["p_improve"], math["p_degrade"]) == (1.0, 0.5)
        assert math["predicted_accuracy"] == pytest.approx(2 / 3)
        assert math["observed_accuracy"] == 0.75
        # The vote over FIXED, FIXED, BROKEN, FIXED.
        assert (math["vote_answer"], math["vote_correct"]) == ("5", True)
        # One solve call (2 samples), then per iteration the verifications of both chains
        # and the refinements of the chains that did not pass (2, then 1).
        assert math["calls"] == 2 + 2 + 2 + 2 + 1
        written = [WRONG, RIGHT, VERIFY[WRONG], VERIFY[RIGHT], FIXED, BROKEN]
        written += [VERIFY[FIXED], VERIFY[BROKEN], FIXED]
        assert math["tokens"] == sum(map(_tokens, written))
        assert sum(s["tokens"] for s in math["states"]) == math["tokens"]
        code = dser[CODE_ID]
        assert [s["correct"] for s in code["states"]] == [True, True, True, False, True, True]
        assert [code[f"transitions_{k}"] for k in ("cc", "ci", "ic", "ii")] == [3, 0, 1, 0]
        assert (code["p_improve"], code["p_degrade"], code["predicted_accuracy"]) == (1, 0, 1)
        assert code["vote_correct"] and "print(2 * n)" in code["vote_answer"]
        assert code["calls"] == 2 + 2 + 1 + 2
        assert all(r["seconds"] > 0 and r["policy"] == policy for r in dser.values())
        dser_md = _metadata(instance, "dser_eval")
        assert dser_md["accuracy"] == 1.0
        assert dser_md["accuracy_by_iteration_math"].startswith("![DSER math")
        # Pooled over both math problems: the first solutions 1 of 2 right, the Markov
        # prediction as for one (both ran alike).
        math_line = next(
            line for line in dser_md["summary"].splitlines() if line.startswith("| math")
        )
        assert math_line.split(" | ")[1:6] == ["2", "1.000", "0.500", "0.750", "0.667"]

        # base_policy_eval, round 0: the base policy on the same two problems with the few-shot
        # prompt, greedy as above, and the search without a PPM (nothing values its answers).
        base_rows = first["base_policy_eval"]
        assert [r["problem_id"] for r in base_rows] == [r["problem_id"] for r in mcts]
        for r in base_rows:
            assert (r["round"], r["policy"], r["ppm"]) == (0, base, None)
            assert (r["greedy_correct"], r["best_q_correct"]) == (False, None)
            assert r["greedy_tokens"] == _tokens(A) + _tokens(D)
            assert r["answers_valued_by_ppm"] == 0 and r["search_answers"] > 0

        # eval_comparison: round 0 and every checkpoint and method of round 1, on the two
        # shared math problems. The vote over 4 samples (WRONG, RIGHT, WRONG, RIGHT) ties, and
        # the first class (6) wins.
        compared = {(r["round"], r["checkpoint"], r["method"]): r for r in first["eval_comparison"]}
        assert set(compared) == COMPARED_METHODS | {(1, "attn_gates", "budget_32")}
        assert all(r["problems"] == 2 for r in compared.values())
        assert {r["model"] for k, r in compared.items() if k[0] == 0} == {base}
        assert {r["model"] for k, r in compared.items() if k[:2] == (1, "policy")} == {policy}
        mean = lambda column: sum(r[column] for r in mcts) / 2  # noqa: E731
        greedy, dser_row = compared[1, "policy", "greedy"], compared[1, "policy", "dser"]
        assert (greedy["accuracy"], dser_row["accuracy"]) == (0.0, 1.0)
        assert greedy["tokens_per_problem"] == _tokens(A) + _tokens(D)
        assert greedy["seconds_per_problem"] == pytest.approx(mean("greedy_seconds"))
        best_q = compared[1, "policy+ppm", "mcts_best_q"]
        assert best_q["accuracy"] == mean("best_q_correct")
        assert best_q["tokens_per_problem"] == mean("search_tokens")
        assert best_q["completions_per_problem"] == mean("search_answers")
        majority = compared[1, "policy", "majority_of_4"]
        assert (majority["accuracy"], majority["completions_per_problem"]) == (0.0, 4)
        assert majority["tokens_per_problem"] == 2 * (_tokens(WRONG) + _tokens(RIGHT))
        assert majority["seconds_per_problem"] > 0
        assert dser_row["tokens_per_problem"] == math["tokens"]
        assert dser_row["seconds_per_problem"] == pytest.approx(
            sum(dser[i]["seconds"] for i in MATH_IDS) / 2
        )
        tool = compared[1, "grpo_roc", "tool"]
        assert (compared[1, "grpo_roc", "greedy"]["accuracy"], tool["accuracy"]) == (0.0, 1.0)
        assert tool["tokens_per_problem"] == _tokens(AGENT_CALL["math"]) + _tokens(
            AGENT_ANSWER["math"]
        )
        assert tool["model"] == grpo
        gates = compared[1, "attn_gates", "budget_32"]
        assert (gates["accuracy"], gates["tokens_per_problem"]) == (0.5, 30)

        # The statistics: 0 of 2 has the Wilson interval [0, z²/(2+z²)], 2 of 2 [2/(2+z²), 1].
        z2 = 1.959963984540054**2
        assert (greedy["correct"], greedy["accuracy_low"]) == (0, 0.0)
        assert greedy["accuracy_high"] == pytest.approx(z2 / (2 + z2))
        assert dser_row["accuracy_low"] == pytest.approx(2 / (2 + z2))
        # Paired with round 0 on the same problems: the same method where round 0 has it, else
        # its greedy decoding. DSER wins both problems greedy loses: p = 2 / 2^2.
        assert compared[0, "policy", "greedy"]["baseline"] is None
        assert compared[1, "policy", "majority_of_4"]["baseline"] == "round 0 majority_of_4"
        against = [dser_row[k] for k in ("baseline", "difference", "gained", "lost", "p_value")]
        assert against == ["round 0 greedy", 1.0, 2, 0, 0.5]
        assert (greedy["difference"], greedy["p_value"]) == (0.0, 1.0)
        assert compared[1, "attn_gates", "budget_32"]["gained"] == 1
        # The oracle stands apart: any of the 4 samples right (RIGHT is), none for greedy.
        assert (majority["oracle_any_correct"], greedy["oracle_any_correct"]) == (1.0, None)
        assert dser_row["oracle_any_correct"] == 1.0
        comparison_md = _metadata(instance, "eval_comparison")
        table = comparison_md["comparison"].splitlines()
        assert len(table) == 2 + 12
        assert (
            "| 1 | policy | dser | 2/2 | 1.000 [0.342, 1.000] | round 0 greedy | +1.000 | 0.5 |"
            in (comparison_md["comparison"])
        )
        assert "oracle" not in comparison_md["comparison"]
        assert comparison_md["oracle"].startswith("An oracle, not a method")
        assert "| 1 | policy | majority_of_4 | 4.0 | 1.000 |" in comparison_md["oracle"]
        assert "none could: on 2 paired problems" in comparison_md["significance"]
        assert comparison_md["accuracy_by_round"].startswith("![accuracy (95% Wilson interval)")
        assert comparison_md["accuracy_vs_tokens"].startswith("![accuracy against tokens")

        # Again: every result comes from the item caches, seconds included.
        again = _materialize(defs, resources, instance)
        assert again == first
        assert POLICY.prompts == calls
    _round_two_starts_from_round_one(tmp_path, first["eval_comparison"])


def _round_two_starts_from_round_one(tmp_path, round_one: list[dict]) -> None:
    """eval_comparison of round 2 (run on round 1's tables as round 2's, for brevity): rows
    for round 0, for round 1's checkpoint the round starts from (from round 1's mcts_eval, as
    previous_mcts_eval) and for round 2's own."""
    text = (REPO / "assets" / "pipeline.yaml").read_text()
    (tmp_path / "pipeline.yaml").write_text(text.replace("rounds: 1", "rounds: 2"))
    asset = load_spec(tmp_path / "pipeline.yaml").by_key["eval_comparison_r2"]
    tables = {}
    for key, name in asset.input_names.items():
        tables[name] = query(f"select * from {key.removesuffix('_r2')}")
    assert {"previous_mcts_eval", "previous_policy_checkpoint"} <= set(tables)
    # Round 1's item cache: the samples of the vote come from it, seconds included.
    context = StageContext(
        None,
        logging.getLogger("test"),
        resources={"llm": ScriptedLLMResource.serving(POLICY)},
        cache_path=cache_location("eval_comparison", None),
        cache_namespace=asset.stage_cls.cache_namespace(),
    )
    calls = POLICY.prompts
    table = asset.stage().run(context, tables).table
    assert POLICY.prompts == calls
    rows = {(r["round"], r["checkpoint"], r["method"]): r for r in table.to_pylist()}
    one = {(r["round"], r["checkpoint"], r["method"]): r for r in round_one}
    starts = {k for k in rows if k[0] == 1}
    assert starts == {
        (1, "policy", "greedy"),
        (1, "policy", "majority_of_4"),
        (1, "policy+ppm", "mcts_best_q"),
        (1, "policy+ppm", "mcts_majority"),
    }
    assert all(rows[k] == one[k] for k in starts)
    assert all(rows[0, *k[1:]] == one[0, *k[1:]] for k in one if k[0] == 0)
    assert {k[1:] for k in rows if k[0] == 2} == {k[1:] for k in one if k[0] == 1}


def _context(tmp_path, resources) -> StageContext:
    return StageContext(
        None, logging.getLogger("test"), resources=resources, cache_path=tmp_path / "cache.db"
    )


def test_no_heldout_problem_is_a_clear_error(tmp_path):
    spec = load_spec(REPO / "assets" / "pipeline.yaml")
    stage = spec.by_key["dser_eval"].stage()
    problems = [
        {"id": i, "batch": "b1", "domain": "math", "problem": MATH_Q, "seed_id": i}
        for i in TRAIN[:3]
    ]
    verified = [
        {"problem_id": i, "batch": "b1", "domain": "math", "verified": True, "answer": "5"}
        for i in TRAIN[:3]
    ]
    inputs = {
        "synthesized_problems": pa.Table.from_pylist(problems),
        "problem_groups": pa.Table.from_pylist(
            [{"problem_id": i, "group_id": i} for i in TRAIN[:3]]
        ),
        "verified_outputs": pa.Table.from_pylist(verified),
        "policy_checkpoint": pa.Table.from_pylist([{"path": "policy"}]),
    }
    with pytest.raises(StageInputError, match="no verified problem .* falls in the held-out split"):
        stage.run(_context(tmp_path, {"llm": ScriptedLLMResource.serving(POLICY)}), inputs)


def test_comparison_refuses_another_policy(tmp_path):
    """Each evaluation must be of the checkpoint it stands for: mcts_eval of this round's
    policy, base_policy_eval of the base (round 0) policy."""
    spec = load_spec(REPO / "assets" / "pipeline.yaml")
    stage = spec.by_key["eval_comparison"].stage()
    resource = ScriptedLLMResource.serving(POLICY)
    evaluated = {"batch": "b1", "problem_id": MATH_IDS[0], "domain": "math"}
    by = lambda model: pa.Table.from_pylist([{**evaluated, "policy": resource.model_id(model)}])  # noqa: E731
    inputs = {
        "mcts_eval": by("round_0_policy"),
        "dser_eval": by("policy"),
        "base_policy_eval": by(stage.model),
        "policy_checkpoint": pa.Table.from_pylist([{"path": "policy"}]),
    }
    context = _context(tmp_path, {"llm": resource})
    with pytest.raises(StageInputError, match="mcts_eval evaluated .*round_0_policy.*re-mat"):
        stage.run(context, inputs)
    inputs["mcts_eval"] = by("policy")
    inputs["base_policy_eval"] = by("policy")
    with pytest.raises(StageInputError, match="base_policy_eval evaluated .*:policy'], not"):
        stage.run(context, inputs)
