"""gate_distill_data and attn_gate_checkpoint through Dagster: the gates are really trained, out of
process under the launcher, on the tiny random Llama; the gate job refuses bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rstar_kernels.distill import GateTrainConfig
from rstar_kernels.gate import SeerGates
from rstar_pipelines import settings
from rstar_pipelines.definitions import build_definitions, load_spec
from rstar_pipelines.storage import query, schemas
from rstar_pipelines.storage.parquet_io import write_table
from rstar_pipelines.training.gate import GateTrainSettings
from tests.fakes.repo import REPO
from tests.fakes.training import launch


def _solution(i: int) -> str:
    steps = " ".join(f"Step {s}: {i} + {s} = {i + s}, so we carry {i * s % 7}." for s in range(12))
    return f"{steps} The answer is {i + 11}."


SPLIT = load_spec(REPO / "assets" / "pipeline.yaml").by_key["gate_distill_data"].params.heldout
IDS = [f"p{i}" for i in range(40)]
TRAIN = [i for i in IDS if not SPLIT.is_heldout(i)]
HELDOUT = [i for i in IDS if SPLIT.is_heldout(i)]


def _solution_row(i: int, problem_id: str, batch: str) -> dict:
    return {
        "id": f"v{i}",
        "problem_id": problem_id,
        "candidate_id": f"c{i}",
        "batch": batch,
        "domain": "math",
        "problem": f"What is {i} + 11?",
        "solution": _solution(i),
        "program": None,
        "answer": str(i + 11),
        "messages": [
            {"role": "user", "content": f"What is {i} + 11?"},
            {"role": "assistant", "content": _solution(i)},
        ],
        "verification_info": None,
        "agreement": 1.0,
        "label_source": "given",
        "cpu_s": 0.0,
        "model": "m",
    }


def _problem(
    problem_id: str, batch: str, domain: str, text: str, oracle: list[str], answer=None
) -> dict:
    return {
        "id": problem_id,
        "batch": batch,
        "domain": domain,
        "problem": text,
        "answer": answer,
        "oracle_solutions": oracle,
        "examples": [],
        "time_limit_s": None,
        "is_seed": True,
        "seed_id": problem_id,
        "model": None,
    }


def _write_upstream(batch: str) -> None:
    """Five verified solutions and a code seed on the training side; on the held-out side one
    verified solution (its problem verified too, with its answer) and a code seed."""
    solved = [*TRAIN[:5], HELDOUT[0]]
    solutions = [_solution_row(i, pid, batch) for i, pid in enumerate(solved)]
    # Their answers differ, so the alike texts are not near-duplicates (one group, one side).
    problems = [
        _problem(pid, batch, "math", f"What is {i} + 11?", [], str(i + 11))
        for i, pid in enumerate(solved)
    ]
    texts = {3: "Print the sum of 1 to 3.", 4: "Add up the whole numbers from one to four."}
    for pid, n in ((TRAIN[5], 3), (HELDOUT[1], 4)):
        oracle = [f"print(sum(range(1, {n + 1})))\n", "print(6)"]
        problems.append(_problem(pid, batch, "code", texts[n], oracle))
    verified = [
        {
            "problem_id": HELDOUT[0],
            "batch": batch,
            "domain": "math",
            "verified": True,
            "label_source": "given",
            "answer": "16",
            "inputs": [],
            "labels": [],
            "candidates": [],
        }
    ]
    lake = settings.lake_dir()
    for key, rows, schema in (
        ("verified_solutions", solutions, schemas.VERIFIED_SOLUTIONS),
        ("synthesized_problems", problems, schemas.SYNTHESIZED_PROBLEMS),
        ("verified_outputs", verified, schemas.VERIFIED_OUTPUTS),
    ):
        write_table(pa.Table.from_pylist(rows, schema=schema), lake / key / f"{batch}.parquet")


@pytest.mark.slow
def test_gate_checkpoint_trains_reloads_and_is_evaluated(tmp_path, tiny_base):
    text = (REPO / "assets" / "pipeline.yaml").read_text()
    text = text.replace("  policy: null", f"  policy: {tiny_base}")
    assert "      train:\n        steps: 30\n" in text
    text = text.replace("      train:\n        steps: 30\n", "      train:\n        steps: 12\n")
    text = text.replace(
        "    upstream: [verified_solutions, synthesized_problems, problem_groups]\n",
        "    upstream: [verified_solutions, synthesized_problems, problem_groups]\n    params:\n"
        "      text_file: extra/texts.jsonl\n",
    )
    # One budget of a single block, one covering every text.
    assert "      budgets: [32, 64]\n" in text
    text = text.replace("      budgets: [32, 64]\n", "      budgets: [16, 4096]\n")
    text = text.replace("      answer_tokens: 96\n", "      answer_tokens: 20\n")
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    spec = load_spec(path)
    defs = build_definitions(spec)
    _write_upstream("b1")
    extra = settings.data_dir() / "extra" / "texts.jsonl"
    extra.parent.mkdir(parents=True)
    extra.write_text(json.dumps({"text": _solution(9) * 2}) + "\n\n")

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", ["b1"])
        result = dg.materialize(
            list(defs.assets),
            selection=[
                "problem_groups",
                "gate_distill_data",
                "attn_gate_checkpoint",
                "attn_gate_eval",
            ],
            instance=instance,
            resources=dict(defs.resources),
        )
        assert result.success
        [check] = [
            c for c in result.get_asset_check_evaluations() if c.check_name == "no_heldout_problems"
        ]
        assert (check.check_name, check.passed) == ("no_heldout_problems", True)
        assert check.metadata["rows_without_a_problem"].value == 1  # the file's text
        event = instance.get_latest_materialization_event(dg.AssetKey("attn_gate_checkpoint"))
        assert "loss_curve" in event.asset_materialization.metadata

    # The training side only: the held-out solution and code seed are left out.
    data = query("select id, source, text, messages from gate_distill_data order by id").to_pylist()
    assert [(r["id"], r["source"]) for r in data] == [
        (f"{TRAIN[5]}:oracle", "seed_problems"),  # the code seed's first oracle solution
        ("texts.jsonl:1", "file"),
        *[(f"v{i}", "verified_solutions") for i in range(5)],
    ]
    assert data[0]["messages"][1]["content"] == "```python\nprint(sum(range(1, 4)))\n```"
    assert data[1]["text"] == _solution(9) * 2 and data[1]["messages"] is None

    row = query("select * from attn_gate_checkpoint").to_pylist()[0]
    assert row["base_model"] == tiny_base and row["steps"] == 12
    assert (row["examples"], row["heldout_examples"]) == (6, 1)  # 7 texts, 20% held out
    assert (row["block_size"], row["gate_dim"], row["topk_blocks"]) == (16, 64, 4)
    assert math.isfinite(row["final_loss"])
    # Distillation raises the held-out recall of the fresh gates' top-k blocks.
    assert row["heldout_recall_after"] > row["heldout_recall_before"]
    gates = SeerGates.load(row["path"])
    assert (gates.config.family, gates.config.num_layers, gates.config.base_model) == (
        "llama",
        2,
        tiny_base,
    )
    metrics = json.loads((settings.data_dir() / row["path"] / "training_metrics.json").read_text())
    assert metrics["job"] == "gate" and len(metrics["losses"]) == 12
    assert metrics["skipped_short"] == 0
    assert metrics["losses"][-1] == row["final_loss"]

    # The evaluation, on the held-out texts (the solution and the code seed) and problem.
    evaluated = {r["setting"]: r for r in query("select * from attn_gate_eval").to_pylist()}
    assert set(evaluated) == {"dense", "budget 16", "budget 4096"}
    assert all(r["texts"] == 2 and r["math_problems"] == 1 for r in evaluated.values())
    assert all(r["gates"] == row["path"] for r in evaluated.values())
    dense, small, covering = (evaluated[k] for k in ("dense", "budget 16", "budget 4096"))
    assert dense["kl"] is None and dense["decode_steps"] == small["decode_steps"] > 16
    # A budget that covers every text is dense decoding; one block is not.
    assert covering["kl"] == pytest.approx(0.0, abs=1e-5) and covering["top1_agreement"] == 1.0
    same = [(a["answer"], a["tokens"], a["same_as_dense"]) for a in covering["answers"]]
    assert same == [(a["answer"], a["tokens"], True) for a in dense["answers"]]
    assert covering["answer_agreement_with_dense"] == 1.0
    assert small["kl"] > 1e-4
    assert [a["problem_id"] for a in small["answers"]] == [HELDOUT[0]]


def test_settings_mirror_the_kernel_config():
    fields = {f.name: f.default for f in dataclasses.fields(GateTrainConfig)}
    declared = {name: f.default for name, f in GateTrainSettings.model_fields.items()}
    assert declared == fields
    assert GateTrainConfig(**GateTrainSettings().model_dump()) == GateTrainConfig()
    with pytest.raises(ValueError, match="max_length must exceed block_size"):
        GateTrainSettings(max_length=16, block_size=16)


def _run_gate_job(tmp_path, rows: list[dict]) -> subprocess.CompletedProcess:
    data = tmp_path / "texts.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    config = {
        "job": "gate",
        "base_model": "absent-model-dir",  # never loaded: the input is refused first
        "data": str(data),
        "output_dir": str(tmp_path / "out"),
        "train": {"block_size": 16},
    }
    return launch(tmp_path, config)


def test_gate_job_refuses_bad_data(tmp_path):
    result = _run_gate_job(tmp_path, [{"body": "x"}])
    assert result.returncode == 2 and "lacks the column(s) text" in result.stderr
    rows = [{"text": "a", "messages": None}, {"text": None, "messages": None}]
    result = _run_gate_job(tmp_path, rows)
    assert result.returncode == 2 and "rows [1] have neither text nor messages" in result.stderr
    assert not (tmp_path / "out").exists()
