"""Arrow schemas of the tables the pipeline writes: the data contracts of ARCHITECTURE §4.

Nested values are lists and structs, never JSON inside strings, so DuckDB and
pyarrow readers see real types.
"""

from __future__ import annotations

import pyarrow as pa

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

# One node of a search tree (rstar_pipelines.math.tree.Node.row).
NODE = pa.struct(
    [
        ("node_id", pa.string()),
        ("parent_id", pa.string()),
        ("depth", pa.int64()),
        ("text", pa.string()),
        ("kind", pa.string()),  # root, code, text (no code: a box without answer), answer,
        # or a failure sentinel
        ("observation", pa.string()),
        ("terminal", pa.bool_()),
        ("final_answer", pa.string()),
        ("correct", pa.bool_()),
        ("visits", pa.int64()),
        ("q", pa.float64()),
        ("value", pa.float64()),  # the first value the node was given (PPM or reward)
        # Tokens the policy generated for this step (null: the root, or a tree stored
        # before nodes counted them).
        ("completion_tokens", pa.int64()),
    ]
)


MCTS_NODES = pa.schema(
    [
        ("problem_id", pa.string()),
        ("seed_id", pa.string()),  # the seed it descends from: its side of the split
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
        ("seed_id", pa.string()),  # the seed it descends from: its side of the split
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
        ("seed_id", pa.string()),  # the seed it descends from: its side of the split
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
        ("seed_id", pa.string()),  # the seed it descends from: its side of the split
        ("batch", pa.string()),
        ("round", pa.int64()),
        ("domain", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("mean_q", pa.float64()),
        ("min_q", pa.float64()),
    ]
)

# -- rStar2-Agent: GRPO-RoC ---------------------------------------------------------------

# What a grpo training job reads: one problem per row (`id` is the problem's id) and the chat
# its rollouts start from.
GRPO_ROC_DATA = pa.schema(
    [
        ("id", pa.string()),
        ("seed_id", pa.string()),  # the seed it descends from: its side of the split
        ("batch", pa.string()),
        ("domain", pa.string()),
        ("question", pa.string()),
        ("answer", pa.string()),
        ("inputs", pa.list_(pa.string())),
        ("labels", pa.list_(pa.string())),
        ("prompt", pa.list_(MESSAGE)),
    ]
)

# The GRPO-RoC policy on the held-out problems: one row per problem and method ("greedy": one
# turn, no tool run; "tool": the training rollouts' turns with the Python tool), graded by the
# training reward.
GRPO_EVAL = pa.schema(
    [
        ("problem_id", pa.string()),
        ("seed_id", pa.string()),
        ("batch", pa.string()),
        ("round", pa.int64()),
        ("domain", pa.string()),
        ("gold_answer", pa.string()),  # math only
        ("method", pa.string()),
        ("answer", pa.string()),  # math: the final turn's answer
        ("correct", pa.bool_()),
        ("turns", pa.int64()),
        ("tool_calls", pa.int64()),
        ("tool_errors", pa.int64()),
        ("tokens", pa.int64()),
        ("seconds", pa.float64()),  # kept from when it was computed
        ("policy", pa.string()),
    ]
)

CHECKPOINT = pa.schema(
    [
        ("id", pa.string()),
        ("job", pa.string()),  # "ppm", "sft" or "grpo"
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
        ("mean_reward_first", pa.float64()),  # grpo: the first and last steps' mean reward
        ("mean_reward_last", pa.float64()),
        ("seconds", pa.float64()),
        ("run_id", pa.string()),
    ]
)

MCTS_EVAL = pa.schema(
    [
        ("problem_id", pa.string()),
        ("seed_id", pa.string()),
        ("batch", pa.string()),
        ("round", pa.int64()),
        ("gold_answer", pa.string()),  # read only to score the picks below, never by a search
        ("greedy_answer", pa.string()),
        ("best_q_answer", pa.string()),  # null without a PPM: nothing values the answers
        ("majority_answer", pa.string()),  # over the top-k answers by Q, or all without a PPM
        ("greedy_correct", pa.bool_()),
        ("best_q_correct", pa.bool_()),
        ("majority_correct", pa.bool_()),
        ("search_any_correct", pa.bool_()),  # some answer the search found is right (an oracle)
        ("search_answers", pa.int64()),
        ("answers_valued_by_ppm", pa.int64()),
        ("search_nodes", pa.int64()),
        # What each method cost on the problem: tokens generated, and wall seconds (the
        # search's own time, without loading the models; kept from when it was computed).
        ("greedy_tokens", pa.int64()),
        ("search_tokens", pa.int64()),
        ("greedy_seconds", pa.float64()),
        ("search_seconds", pa.float64()),
        ("policy", pa.string()),
        ("ppm", pa.string()),
    ]
)

# -- DSER: deep self-evolving reasoning, and the methods side by side -------------------

# One state of a self-evolving chain: iteration 0 is the first solution, iteration t the
# solution after t verify-then-refine steps (kept as it was when its verification passed).
DSER_STATE = pa.struct(
    [
        ("chain", pa.int64()),
        ("iteration", pa.int64()),
        ("text", pa.string()),
        ("answer", pa.string()),  # math: the boxed answer; code: the extracted program
        ("verdict", pa.bool_()),  # the model's own verification of this state passed
        ("correct", pa.bool_()),  # against the gold answer, or the verified tests
        ("tokens", pa.int64()),
    ]
)

DSER_EVAL = pa.schema(
    [
        ("problem_id", pa.string()),
        ("seed_id", pa.string()),
        ("batch", pa.string()),
        ("round", pa.int64()),
        ("domain", pa.string()),
        ("gold_answer", pa.string()),  # math only
        ("vote_answer", pa.string()),
        ("vote_correct", pa.bool_()),
        ("states", pa.list_(DSER_STATE)),
        # Transitions between consecutive states of every chain (C: correct, I: incorrect),
        # and the two-state Markov chain they estimate: p_improve = P(I->C), p_degrade =
        # P(C->I), predicted accuracy = its stationary P(C) (null where a count is 0).
        ("transitions_cc", pa.int64()),
        ("transitions_ci", pa.int64()),
        ("transitions_ic", pa.int64()),
        ("transitions_ii", pa.int64()),
        ("p_improve", pa.float64()),
        ("p_degrade", pa.float64()),
        ("predicted_accuracy", pa.float64()),
        ("observed_accuracy", pa.float64()),  # correct states among those the vote pools
        ("tokens", pa.int64()),
        ("calls", pa.int64()),
        ("seconds", pa.float64()),  # kept from when it was computed
        ("policy", pa.string()),
    ]
)

EVAL_COMPARISON = pa.schema(
    [
        ("round", pa.int64()),
        ("checkpoint", pa.string()),  # policy, policy+ppm, grpo_roc or attn_gates
        ("method", pa.string()),
        ("problems", pa.int64()),
        ("accuracy", pa.float64()),
        ("tokens_per_problem", pa.float64()),
        ("seconds_per_problem", pa.float64()),
        ("model", pa.string()),  # what generated: the checkpoint's model id
    ]
)

# -- SeerAttention-R: gate self-distillation --------------------------------------------

GATE_DISTILL_DATA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),  # "verified_solutions", "seed_problems" or "file"
        ("problem_id", pa.string()),
        ("seed_id", pa.string()),  # the seed it descends from: its side of the split
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

GATE_ANSWER = pa.struct(
    [
        ("problem_id", pa.string()),
        ("batch", pa.string()),
        ("answer", pa.string()),
        ("correct", pa.bool_()),
        ("same_as_dense", pa.bool_()),
        ("tokens", pa.int64()),
        ("seconds", pa.float64()),  # kept from when it was computed
    ]
)

# The gates against dense attention on the held-out split: one row for dense decoding and one per
# token budget. KL and agreement are means over every teacher-forced decode step of the texts.
ATTN_GATE_EVAL = pa.schema(
    [
        ("setting", pa.string()),  # "dense" or "budget N"
        ("token_budget", pa.int64()),
        ("texts", pa.int64()),
        ("decode_steps", pa.int64()),
        ("kl", pa.float64()),  # KL(dense || sparse) of the next-token distributions
        ("top1_agreement", pa.float64()),
        ("math_problems", pa.int64()),
        ("answer_accuracy", pa.float64()),  # greedy answers to the held-out math problems
        ("answer_agreement_with_dense", pa.float64()),
        ("answers", pa.list_(GATE_ANSWER)),
        ("gates", pa.string()),
        ("base_model", pa.string()),
    ]
)
