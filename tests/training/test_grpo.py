"""GRPO-RoC training on trl.GRPOTrainer: the token masks of a multi-turn rollout, a tiny random
Llama that really learns from the rewards, the launcher's grpo job, and grpo_roc_checkpoint in
Dagster. Tool calls and code rewards run in the real process sandbox."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rstar_pipelines import settings
from rstar_pipelines.agent.reward import AgentProblem
from rstar_pipelines.agent.rollout import RolloutConfig, ToolCall, Trajectory
from rstar_pipelines.definitions import build_definitions, load_spec
from rstar_pipelines.pipeline.prompts import PromptTemplate
from rstar_pipelines.storage import query, schemas
from rstar_pipelines.storage.parquet_io import write_table
from rstar_pipelines.training.base_models import load_trainable
from rstar_pipelines.training.grpo import GRPOTrainConfig, rollout_tokens, train_grpo
from rstar_pipelines.training.sft import SFTTrainConfig, train_sft
from rstar_sandbox import Sandbox
from tests.fakes.repo import REPO
from tests.fakes.training import launch

SYSTEM = "Answer inside <answer> </answer>."


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(backend="process", workers=2) as sb:
        yield sb


# -- (a) what is trained in a multi-turn rollout ---------------------------------------

CALL = (
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(3 + 4)", "input": ""}}\n'
    "</tool_call>"
)
RESPONSE = "<tool_response>\nTool call success\nstdout: 7\n</tool_response>"
ANSWER = "The tool says 7. <answer>\\boxed{7}</answer>"


def multi_turn() -> Trajectory:
    return Trajectory(
        prompt=chat("What is 3 + 4?"),
        messages=[
            {"role": "assistant", "content": f"Let me compute it.\n{CALL}"},
            {"role": "user", "content": RESPONSE},
            {"role": "assistant", "content": ANSWER},
        ],
        tool_calls=[ToolCall("print(3 + 4)", "", "ok", "Tool call success\nstdout: 7")],
        completion_tokens=40,
        finish_reason="answer",
    )


def _runs(ids: list[int], mask: list[bool], value: bool) -> list[list[int]]:
    """The maximal runs of ids whose mask is `value`, in order."""
    runs: list[list[int]] = []
    for i, (token, flag) in enumerate(zip(ids, mask, strict=True)):
        if flag == value:
            if i == 0 or mask[i - 1] != value:
                runs.append([])
            runs[-1].append(token)
    return runs


def test_exactly_the_assistant_turns_are_trained(embedded_tokenizer):
    tok = embedded_tokenizer
    trajectory = multi_turn()
    ids, mask = rollout_tokens(tok, trajectory, max_length=4096)
    conversation = [*trajectory.prompt, *trajectory.messages]
    assert tok.decode(ids) == tok.apply_chat_template(conversation, tokenize=False)
    # Each turn the model wrote, with its end-of-turn; nothing else.
    assert [tok.decode(run) for run in _runs(ids, mask, True)] == [
        f"Let me compute it.\n{CALL}<|im_end|>\n",
        f"{ANSWER}<|im_end|>\n",
    ]
    # The prompt up to the generation prompt, then the tool-response turn and the next
    # generation prompt: what the model was given, not what it wrote.
    assert [tok.decode(run) for run in _runs(ids, mask, False)] == [
        "<|im_start|>system\nAnswer inside <answer> </answer>.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n",
        f"<|im_start|>user\n{RESPONSE}<|im_end|>\n<|im_start|>assistant\n",
    ]
    # The first turn's tokens are those generation saw for the prompt.
    prompt = tok.apply_chat_template(trajectory.prompt, tokenize=False, add_generation_prompt=True)
    assert ids[: mask.index(True)] == tok(prompt, add_special_tokens=False)["input_ids"]

    cut_ids, cut_mask = rollout_tokens(tok, trajectory, max_length=len(ids) - 5)
    assert (cut_ids, cut_mask) == (ids[:-5], mask[:-5])


# -- (b) the learning test ---------------------------------------------------------------
# Every problem's answer is 7. A few SFT steps teach the tiny random model the answer format
# with answers drawn from 3, 5, 7 and 9 (the rStar2 recipe starts RL from an SFT that teaches
# format, not reasoning): sampling it is right a quarter of the time. GRPO-RoC with the real
# binary reward then has to move it to the right answer.

PAIRS = [(a, 7 - a) for a in range(8)]
PROBLEMS = [
    AgentProblem(id=f"p{a}", domain="math", question=f"What is {a} + {b}?", answer="7")
    for a, b in PAIRS
]


def format_examples(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "messages": [
                *chat(p.question),
                {
                    "role": "assistant",
                    "content": f"<answer>\\boxed{{{rng.choice('3579')}}}</answer>",
                },
            ]
        }
        for p in PROBLEMS
        for _ in range(8)
    ]


# Enough steps that the reward's rise stands above the noise of which samples a step draws.
STEPS = 16


@pytest.mark.slow
def test_grpo_roc_raises_the_reward_of_a_tiny_model(tiny_base, sandbox):
    model, tokenizer = load_trainable(tiny_base)
    sft = SFTTrainConfig(lr=3e-2, epochs=20, batch_size=8, max_length=128, weight_decay=0.0)
    train_sft(model, tokenizer, format_examples(0), sft, log=lambda _: None)
    config = GRPOTrainConfig(
        lr=2e-3,
        steps=STEPS,
        prompts_per_step=4,
        group_size=4,
        oversample=2,
        batch_size=8,  # up to 16 kept rollouts: two optimizer steps per training step
        max_length=128,
        generation_batch_size=32,
        rollout=RolloutConfig(max_turns=1, max_response_tokens=24),
    )
    lines = []
    metrics = train_grpo(
        model,
        tokenizer,
        PROBLEMS,
        config,
        sandbox,
        [chat(p.question) for p in PROBLEMS],
        lines.append,
    )
    rewards = metrics["mean_reward"]
    print("mean reward per step:", rewards)
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert rewards[0] < 0.5  # before any update: about the random-answer rate of 0.25
    assert last > 0.7 and last - first > 0.25
    # Two optimizer steps per training step (16 kept rollouts, 8 a micro-batch).
    assert metrics["updates_per_step"] == 2
    assert any(line.startswith(f"GRPO step {2 * STEPS}/{2 * STEPS}: loss") for line in lines)
    assert all(len(metrics[name]) == STEPS for name in ("kept", "loss", "clip_low", "step_seconds"))
    updated = [n for n in metrics["updates"] if n]
    assert len(metrics["losses"]) == sum(updated) and max(updated) == 2
    assert metrics["tool_calls"] == [0.0] * STEPS
    assert metrics["tool_error_ratio"] == [0.0] * STEPS
    # The model is still the one being trained in place, back in eval mode.
    assert not model.training


def test_a_step_without_a_kept_group_makes_no_update(tiny_base, sandbox):
    model, tokenizer = load_trainable(tiny_base)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # The random model never writes this answer: every group's rewards are all 0.
    problems = [AgentProblem(id="m", domain="math", question="What is 2 + 2?", answer="123457")]
    config = GRPOTrainConfig(
        lr=1e-2,
        steps=2,
        prompts_per_step=1,
        group_size=2,
        min_each=1,
        batch_size=2,
        max_length=128,
        rollout=RolloutConfig(max_turns=1, max_response_tokens=8),
    )
    # Forwards that build a graph: the loss's (rollouts and old log-probabilities take none).
    trained_forwards = []
    hook = model.register_forward_hook(
        lambda *_: trained_forwards.append(1) if torch.is_grad_enabled() else None
    )
    try:
        metrics = train_grpo(
            model, tokenizer, problems, config, sandbox, [chat(problems[0].question)], print
        )
    finally:
        hook.remove()
    assert metrics["mean_reward"] == [0.0, 0.0] and metrics["groups_dropped"] == [1.0, 1.0]
    # One process and nothing kept: the loss is a zero without the model's forward and backward.
    assert trained_forwards == []
    assert metrics["updates"] == [0, 0] and metrics["loss"] == [None, None]
    assert metrics["clip_low"] == [None, None]
    assert metrics["kept"] == [0, 0] and metrics["skipped_steps"] == 2 and metrics["losses"] == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- (c) the training process's grpo job -------------------------------------------------

CODE_Q = "Read an integer n and print 2 * n."


def problem_rows() -> list[dict]:
    return [
        {
            "id": "m1",
            "domain": "math",
            "question": "What is 3 + 4?",
            "answer": "7",
            "inputs": [],
            "labels": [],
            "prompt": chat("What is 3 + 4?"),
        },
        {
            "id": "c1",
            "domain": "code",
            "question": CODE_Q,
            "answer": None,
            "inputs": ["2\n", "5\n"],
            "labels": ["4\n", "10\n"],
            "prompt": chat(CODE_Q),
        },
    ]


def grpo_config(tmp_path: Path, base: str, data: Path, **train) -> dict:
    return {
        "job": "grpo",
        "base_model": base,
        "data": str(data),
        "output_dir": str(tmp_path / "grpo"),
        "train": {
            "lr": 1e-3,
            "steps": 2,
            "prompts_per_step": 2,
            "group_size": 2,
            "min_each": 1,
            "batch_size": 2,
            "max_length": 256,
            "sandbox_backend": "process",
            "sandbox_workers": 1,
            "rollout": {"max_turns": 2, "max_response_tokens": 32, "max_turn_tokens": 16},
            **train,
        },
        "num_threads": 1,
    }


def test_grpo_job_trains_saves_and_reloads(tiny_base, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "problems.parquet"
    pq.write_table(pa.Table.from_pylist(problem_rows()), data)
    result = launch(tmp_path, grpo_config(tmp_path, tiny_base, data))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting a process sandbox" in result.stderr
    assert "GRPO step 4/4: loss" in result.stderr and "roc/mean_reward" in result.stderr

    out = tmp_path / "grpo"
    metrics = json.loads((out / "training_metrics.json").read_text())
    assert metrics["job"] == "grpo" and metrics["base_model"] == tiny_base
    assert metrics["steps"] == 2 and metrics["examples"] == 2 and metrics["updates_per_step"] == 2
    assert metrics["train"]["group_size"] == 2 and metrics["train"]["sandbox_backend"] == "process"
    for name in ("mean_reward", "tool_error_ratio", "response_length", "groups_dropped", "kept"):
        assert len(metrics[name]) == 2
    assert all(0 < length <= 32 for length in metrics["response_length"])
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template is not None
    assert reloaded.config.num_hidden_layers == 2


def test_grpo_job_refuses_bad_input_before_loading(tiny_base, tmp_path):
    data = tmp_path / "problems.parquet"
    rows = problem_rows()
    pq.write_table(
        pa.Table.from_pylist([{k: v for k, v in r.items() if k != "prompt"} for r in rows]), data
    )
    result = launch(tmp_path, grpo_config(tmp_path, tiny_base, data))
    assert result.returncode == 2
    assert "lacks the column(s) prompt" in result.stderr

    pq.write_table(pa.Table.from_pylist([{**rows[0], "answer": None}, rows[1]]), data)
    result = launch(tmp_path, grpo_config(tmp_path, tiny_base, data))
    assert result.returncode == 2
    assert "row 0: math problem 'm1' has no gold answer" in result.stderr

    pq.write_table(
        pa.Table.from_pylist([rows[0], {**rows[1], "prompt": rows[1]["prompt"][:1]}]), data
    )
    result = launch(tmp_path, grpo_config(tmp_path, tiny_base, data))
    assert result.returncode == 2
    assert "row 1: prompt must be chat messages ending with user" in result.stderr

    pq.write_table(pa.Table.from_pylist(rows), data)
    result = launch(tmp_path, grpo_config(tmp_path, tiny_base, data, max_steps=3))
    assert result.returncode == 2
    assert "max_steps does not apply to GRPO" in result.stderr
    result = launch(tmp_path, grpo_config(tmp_path, tiny_base, data, group_size=2, min_each=2))
    assert result.returncode == 2
    assert "group_size 2 cannot keep min_each = 2" in result.stderr
    result = launch(tmp_path, grpo_config(tmp_path, tiny_base, data, batch_size=3))
    assert result.returncode == 2
    assert "each process trains 4 rollouts a step" in result.stderr
    assert "loading" not in result.stderr and not (tmp_path / "grpo").exists()


# -- (d) grpo_roc_checkpoint through Dagster ---------------------------------------------

SPLIT = load_spec(REPO / "assets" / "pipeline.yaml").by_key["grpo_roc_data"].params.heldout
IDS = [f"p{i}" for i in range(40)]
TRAIN = [i for i in IDS if not SPLIT.is_heldout(i)]
HELDOUT = [i for i in IDS if SPLIT.is_heldout(i)]
# A problem synthesized from a held-out seed: held out too, whatever its own id.
OFFSPRING = TRAIN[10]


def _write_upstream(tiny_base: str) -> None:
    # One held out and one held out by its seed; max_problems 2 keeps two of the rest.
    math_ids = [HELDOUT[0], OFFSPRING, *TRAIN[:3]]
    code_ids = [TRAIN[3]]
    problems, verified = [], []
    for domain, ids in (("math", math_ids), ("code", code_ids)):
        for i in ids:
            text = f"What is {IDS.index(i)} + 1?" if domain == "math" else CODE_Q
            seed = HELDOUT[1] if i == OFFSPRING else i
            # With its answer, so alike math texts are not near-duplicates of one another.
            answer = str(IDS.index(i) + 1) if domain == "math" else None
            problems.append(
                {"id": i, "batch": "b1", "domain": domain, "problem": text, "seed_id": seed}
                | {"answer": answer}
            )
            verified.append(
                {
                    "problem_id": i,
                    "batch": "b1",
                    "domain": domain,
                    "verified": True,
                    "answer": str(IDS.index(i) + 1) if domain == "math" else None,
                    "inputs": ["2\n", "5\n"] if domain == "code" else [],
                    "labels": ["4\n", "10\n"] if domain == "code" else [],
                }
            )
    lake = settings.lake_dir()
    write_table(
        pa.Table.from_pylist(problems, schema=schemas.SYNTHESIZED_PROBLEMS),
        lake / "synthesized_problems" / "b1.parquet",
    )
    write_table(
        pa.Table.from_pylist(verified, schema=schemas.VERIFIED_OUTPUTS),
        lake / "verified_outputs" / "b1.parquet",
    )
    row = {"id": "sft-r1", "job": "sft", "round": 1, "path": tiny_base, "base_model": "embedded"}
    write_table(
        pa.Table.from_pylist([row], schema=schemas.CHECKPOINT), lake / "policy_checkpoint.parquet"
    )


def test_grpo_roc_checkpoint_asset(tiny_base, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("RSTAR_SANDBOX_BACKEND", "process")
    monkeypatch.setenv("RSTAR_SANDBOX_WORKERS", "1")
    defs = build_definitions(load_spec(REPO / "assets" / "pipeline.yaml"))
    _write_upstream(tiny_base)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", ["b1"])
        result = dg.materialize(
            list(defs.assets),
            selection=["problem_groups", "grpo_roc_data", "grpo_roc_checkpoint"],
            instance=instance,
            resources=dict(defs.resources),
        )
        assert result.success
        [check] = [
            c for c in result.get_asset_check_evaluations() if c.check_name == "no_heldout_problems"
        ]
        assert (check.check_name, check.passed) == ("no_heldout_problems", True)
        event = instance.get_latest_materialization_event(dg.AssetKey("grpo_roc_checkpoint"))
        metadata = {k: v.value for k, v in event.asset_materialization.metadata.items()}

    [row] = query("select * from grpo_roc_checkpoint").to_pylist()
    assert (row["job"], row["round"], row["base_model"]) == ("grpo", 1, tiny_base)
    assert row["steps"] == 2 and row["examples"] == 3  # two math problems, one code problem
    metrics = json.loads((Path(row["path"]) / "training_metrics.json").read_text())
    assert row["mean_reward_first"] == metrics["mean_reward"][0]
    assert row["mean_reward_last"] == metrics["mean_reward"][-1]
    config = json.loads((Path(row["path"]) / "train_config.json").read_text())
    assert (config["train"]["sandbox_backend"], config["train"]["sandbox_workers"]) == (
        "process",
        1,
    )
    assert config["train"]["group_size"] == 2 and config["train"]["rollout"]["max_turns"] == 2

    data = pq.read_table(Path(row["path"]) / "train_data.parquet").to_pylist()
    assert data == query("select * from grpo_roc_data").to_pylist()
    assert [(r["id"], r["domain"]) for r in data] == [
        (TRAIN[0], "math"),
        (TRAIN[1], "math"),
        (TRAIN[3], "code"),
    ]
    system = PromptTemplate.load(REPO / "assets" / "prompts", "agent_system.jinja")
    user = PromptTemplate.load(REPO / "assets" / "prompts", "agent_user.jinja")
    assert data[0]["prompt"] == [
        {"role": "system", "content": system.render(question=data[0]["question"], domain="math")},
        {"role": "user", "content": user.render(question=data[0]["question"], domain="math")},
    ]
    assert data[0]["answer"] == str(IDS.index(TRAIN[0]) + 1)
    assert (data[2]["inputs"], data[2]["labels"]) == (["2\n", "5\n"], ["4\n", "10\n"])

    for plot in (
        "reward_curve",
        "tool_error_curve",
        "response_length_curve",
        "groups_dropped_curve",
    ):
        assert metadata[plot].startswith("![")
    assert metadata["mean_reward_first"] == row["mean_reward_first"]
    assert AutoModelForCausalLM.from_pretrained(row["path"]).config.num_hidden_layers == 2


def test_rollouts_sample_outside_the_trainers_autocast(tiny_base):
    # accelerate wraps a bf16-mixed-precision model's forward in autocast; the rollouts run the
    # model's own float32 forward and leave the wrapper in place for the loss.
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    from rstar_pipelines.training.grpo import _without_autocast

    model = AutoModelForCausalLM.from_pretrained(tiny_base)
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    # accelerate keeps one state per process: the trainers of other tests set theirs.
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with torch.no_grad():
            exact = model(input_ids=ids).logits
            model = Accelerator(cpu=True, mixed_precision="bf16").prepare_model(model)
            autocast = model(input_ids=ids).logits
            with _without_autocast(model):
                inside = model(input_ids=ids).logits
            after = model(input_ids=ids).logits
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert not torch.equal(autocast, exact)
    assert torch.equal(inside, exact)
    assert torch.equal(after, autocast)
