"""Arrow schemas of the tables the pipeline writes: the data contracts of ARCHITECTURE §4.

Nested values are lists and structs, never JSON inside strings, so DuckDB and
pyarrow readers see real types.
"""

from __future__ import annotations

import pyarrow as pa

from rstar_pipelines.math.tree import NODE

EXAMPLE = pa.struct([("stdin", pa.string()), ("stdout", pa.string())])

SEED_PROBLEMS = pa.schema(
    [
        ("id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("problem", pa.string()),
        ("answer", pa.string()),
        ("oracle_solutions", pa.list_(pa.string())),
        ("examples", pa.list_(EXAMPLE)),
        ("time_limit_s", pa.float64()),
        ("source_file", pa.string()),
        ("source_line", pa.int64()),
    ]
)

SEED_REJECTS = pa.schema(
    [
        ("batch", pa.string()),
        ("source_file", pa.string()),
        ("line", pa.int64()),
        ("field", pa.string()),
        ("reason", pa.string()),
        ("raw", pa.string()),
    ]
)

SEED_CATALOG = pa.schema(
    [
        ("batch", pa.string()),
        ("math_problems", pa.int64()),
        ("code_problems", pa.int64()),
        ("code_with_examples", pa.int64()),
        ("rejected_rows", pa.int64()),
    ]
)

# -- the verification chain (rStar-Coder) -----------------------------------------------

SYNTHESIZED_PROBLEMS = pa.schema(
    [
        ("id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("problem", pa.string()),
        ("answer", pa.string()),  # seeds' given answer; synthesized math: decided by voting
        ("oracle_solutions", pa.list_(pa.string())),
        ("examples", pa.list_(EXAMPLE)),
        ("time_limit_s", pa.float64()),
        ("is_seed", pa.bool_()),
        ("seed_id", pa.string()),
        ("model", pa.string()),
    ]
)

SCALE = pa.struct([("name", pa.string()), ("value", pa.int64())])

TEST_INPUTS = pa.schema(
    [
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("inputs", pa.list_(pa.string())),
        ("generated", pa.int64()),
        ("valid", pa.int64()),
        ("kept", pa.int64()),
        ("largest_ok_scale", pa.list_(SCALE)),
        ("generator", pa.string()),
        ("parse_error", pa.string()),
        ("errors", pa.list_(pa.string())),
        ("model", pa.string()),
    ]
)

CANDIDATE_SOLUTIONS = pa.schema(
    [
        ("id", pa.string()),
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("candidate_index", pa.int64()),
        ("text", pa.string()),
        ("program", pa.string()),
        ("answer", pa.string()),
        ("parse_error", pa.string()),
        ("finish_reason", pa.string()),
        ("completion_tokens", pa.int64()),
        ("model", pa.string()),
    ]
)

CANDIDATE_VERDICT = pa.struct(
    [
        ("candidate_id", pa.string()),
        ("candidate_index", pa.int64()),
        ("agrees", pa.bool_()),
        ("status", pa.string()),
        ("answer", pa.string()),
        ("wall_s", pa.float64()),
        ("cpu_s", pa.float64()),
        ("peak_memory_mb", pa.float64()),
    ]
)

VERIFIED_OUTPUTS = pa.schema(
    [
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("verified", pa.bool_()),
        ("reason", pa.string()),
        ("label_source", pa.string()),  # "majority", "oracle" or "given" (seed answer)
        ("agreement", pa.float64()),
        ("answer", pa.string()),
        ("inputs", pa.list_(pa.string())),
        ("labels", pa.list_(pa.string())),
        ("candidates", pa.list_(CANDIDATE_VERDICT)),
    ]
)

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
# open-r1's layout for verifiable code problems.
VERIFICATION_INFO = pa.struct(
    [
        ("language", pa.string()),
        (
            "test_cases",
            pa.list_(
                pa.struct([("input", pa.string()), ("output", pa.string()), ("type", pa.string())])
            ),
        ),
    ]
)

VERIFIED_SOLUTIONS = pa.schema(
    [
        ("id", pa.string()),
        ("problem_id", pa.string()),
        ("candidate_id", pa.string()),
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("problem", pa.string()),
        ("solution", pa.string()),
        ("program", pa.string()),
        ("answer", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("verification_info", VERIFICATION_INFO),
        ("agreement", pa.float64()),
        ("label_source", pa.string()),
        ("cpu_s", pa.float64()),
        ("model", pa.string()),
    ]
)

# -- rStar-Math: search, preference pairs, SFT data, checkpoints ------------------------

MCTS_NODES = pa.schema(
    [
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("round", pa.int64()),
        ("question", pa.string()),
        ("gold_answer", pa.string()),
        *[(f.name, f.type) for f in NODE],
        ("model", pa.string()),
    ]
)

MCTS_TRAJECTORIES = pa.schema(
    [
        ("id", pa.string()),
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("round", pa.int64()),
        ("leaf_id", pa.string()),
        ("steps", pa.list_(pa.string())),
        ("q_values", pa.list_(pa.float64())),
        ("final_answer", pa.string()),
        ("correct", pa.bool_()),
        ("mean_q", pa.float64()),
        ("min_q", pa.float64()),
        ("model", pa.string()),
    ]
)

# TRL's reward-model layout (prompt, chosen, rejected, margin) plus where each pair came from.
PPM_PAIRS = pa.schema(
    [
        ("id", pa.string()),
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("round", pa.int64()),
        ("kind", pa.string()),  # "step" or "final"
        ("node_id", pa.string()),
        ("prompt", pa.string()),
        ("chosen", pa.string()),
        ("rejected", pa.string()),
        ("margin", pa.float64()),
        ("chosen_step", pa.string()),
        ("rejected_step", pa.string()),
        ("chosen_q", pa.float64()),
        ("rejected_q", pa.float64()),
        ("pos_count", pa.int64()),
        ("neg_count", pa.int64()),
        ("edit_distance", pa.int64()),
    ]
)

SFT_DATASET = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),  # "mcts" or "verified_solutions"
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("round", pa.int64()),
        ("domain", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("mean_q", pa.float64()),
        ("min_q", pa.float64()),
    ]
)

CHECKPOINT = pa.schema(
    [
        ("id", pa.string()),
        ("job", pa.string()),  # "ppm" or "sft"
        ("round", pa.int64()),
        ("path", pa.string()),
        ("base_model", pa.string()),
        ("examples", pa.int64()),
        ("heldout_examples", pa.int64()),
        ("steps", pa.int64()),
        ("final_loss", pa.float64()),
        ("heldout_accuracy", pa.float64()),
        ("train_accuracy_before", pa.float64()),
        ("train_accuracy_after", pa.float64()),
        ("seconds", pa.float64()),
        ("run_id", pa.string()),
    ]
)

MCTS_EVAL = pa.schema(
    [
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("round", pa.int64()),
        ("gold_answer", pa.string()),
        ("greedy_answer", pa.string()),
        ("best_q_answer", pa.string()),
        ("majority_answer", pa.string()),
        ("greedy_correct", pa.bool_()),
        ("best_q_correct", pa.bool_()),
        ("majority_correct", pa.bool_()),
        ("search_nodes", pa.int64()),
        ("policy", pa.string()),
    ]
)

# -- SeerAttention-R: gate self-distillation --------------------------------------------

GATE_DISTILL_DATA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),  # "verified_solutions", "seed_problems" or "file"
        ("problem_id", pa.string()),
        ("domain", pa.string()),
        # Exactly one of the two: a plain text, or chat messages that the trainer renders
        # with the base model's own chat template.
        ("text", pa.string()),
        ("messages", pa.list_(MESSAGE)),
    ]
)

GATE_CHECKPOINT = pa.schema(
    [
        ("id", pa.string()),
        ("path", pa.string()),  # a SeerGates directory: gate_config.json + safetensors
        ("base_model", pa.string()),
        ("examples", pa.int64()),
        ("heldout_examples", pa.int64()),
        ("steps", pa.int64()),
        ("final_loss", pa.float64()),
        ("block_size", pa.int64()),
        ("gate_dim", pa.int64()),
        ("topk_blocks", pa.int64()),
        ("heldout_recall_before", pa.float64()),  # the untrained gates
        ("heldout_recall_after", pa.float64()),
        ("seconds", pa.float64()),
        ("run_id", pa.string()),
    ]
)
