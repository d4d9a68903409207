"""Arrow schemas of the tables the pipeline writes: the data contracts of ARCHITECTURE §4.

Nested values are lists and structs, never JSON inside strings, so DuckDB and
pyarrow readers see real types. Every column says what it holds (field metadata
`description`: the Dagster UI shows it as the column's description, and it travels
in the Parquet files).
"""

from __future__ import annotations

import pyarrow as pa

DESCRIPTION = b"description"
# Schema metadata of a one-row table that points at an artifact on disk (a checkpoint):
# the column that holds its path, which the materialization's `path` then shows.
ARTIFACT_COLUMN = b"rstar.artifact_column"


def contract(
    columns: list[tuple[str, pa.DataType, str] | tuple[str, pa.DataType]],
    artifact_column: str | None = None,
) -> pa.Schema:
    """A table's schema from (name, type, description) triples."""
    fields = [
        pa.field(c[0], c[1], metadata={DESCRIPTION: c[2]} if len(c) == 3 else None) for c in columns
    ]
    metadata = {ARTIFACT_COLUMN: artifact_column.encode()} if artifact_column else None
    return pa.schema(fields, metadata=metadata)


def description(field: pa.Field) -> str | None:
    value = (field.metadata or {}).get(DESCRIPTION)
    return value.decode() if value is not None else None


def artifact_column(schema: pa.Schema) -> str | None:
    value = (schema.metadata or {}).get(ARTIFACT_COLUMN)
    return value.decode() if value is not None else None


EXAMPLE = pa.struct([("stdin", pa.string()), ("stdout", pa.string())])

SEED_PROBLEMS = contract(
    [
        (
            "id",
            pa.string(),
            "content hash of domain, problem, answer and oracle solutions (the same in any batch)",
        ),
        ("batch", pa.string(), "the seed batch (partition) the row came from"),
        ("domain", pa.string(), "math or code"),
        ("problem", pa.string(), "the problem statement, whitespace-trimmed"),
        ("answer", pa.string(), "math: the given final answer; code: null"),
        (
            "oracle_solutions",
            pa.list_(pa.string()),
            "code: reference programs known to be correct; math: empty",
        ),
        ("examples", pa.list_(EXAMPLE), "code: example stdin/stdout pairs from the statement"),
        (
            "time_limit_s",
            pa.float64(),
            "code: per-run time limit in seconds (null: the stage's default)",
        ),
        ("source_file", pa.string(), "name of the seed file"),
        (
            "source_line",
            pa.int64(),
            "line (JSONL) or record number (JSON, Parquet) in the seed file, from 1",
        ),
    ]
)

SEED_REJECTS = contract(
    [
        ("batch", pa.string(), "the seed batch (partition)"),
        ("source_file", pa.string(), "name of the seed file"),
        ("line", pa.int64(), "line or record number of the rejected row, from 1"),
        ("field", pa.string(), "the field that failed validation (null: the row as a whole)"),
        ("reason", pa.string(), "why the row was rejected"),
        ("raw", pa.string(), "the row as written in the file, cut to 2000 characters"),
    ]
)

SEED_CATALOG = contract(
    [
        ("batch", pa.string(), "the seed batch"),
        ("math_problems", pa.int64(), "math problems kept from the batch"),
        ("code_problems", pa.int64(), "code problems kept from the batch"),
        ("code_with_examples", pa.int64(), "code problems that came with examples"),
        ("rejected_rows", pa.int64(), "rows of the batch rejected by validation"),
    ]
)

# -- the verification chain (rStar-Coder) -----------------------------------------------

SYNTHESIZED_PROBLEMS = contract(
    [
        ("id", pa.string(), "problem id (a seed keeps its seed id)"),
        ("batch", pa.string(), "the seed batch"),
        ("domain", pa.string(), "math or code"),
        ("problem", pa.string(), "the problem statement"),
        (
            "answer",
            pa.string(),
            "seeds: the given answer; synthesized math: null until voted on in verified_outputs",
        ),
        (
            "oracle_solutions",
            pa.list_(pa.string()),
            "seeds: reference programs; synthesized problems: empty",
        ),
        ("examples", pa.list_(EXAMPLE), "example stdin/stdout pairs"),
        ("time_limit_s", pa.float64(), "per-run time limit in seconds (null: the stage's default)"),
        (
            "is_seed",
            pa.bool_(),
            "true for a seed carried over, false for a problem the synthesizer wrote",
        ),
        (
            "seed_id",
            pa.string(),
            "the seed a synthesized problem was written from (a seed: its own id)",
        ),
        ("model", pa.string(), "the synthesizer model (null for seeds)"),
    ]
)

PROBLEM_GROUPS = contract(
    [
        ("problem_id", pa.string(), "a problem (or seed) of synthesized_problems, any batch"),
        ("batches", pa.list_(pa.string()), "the seed batches that hold it"),
        ("domain", pa.string(), "math or code"),
        ("seed_id", pa.string(), "the seed it was written from (a seed: its own id)"),
        (
            "group_id",
            pa.string(),
            "its near-duplicate group: the smallest seed id in it, the key the split hashes",
        ),
        ("group_size", pa.int64(), "problems in the group"),
        ("heldout", pa.bool_(), "whether the group is on the held-out side of the split"),
        (
            "duplicate_of",
            pa.string(),
            "the problem it was found to duplicate (null: grouped by its seed alone)",
        ),
        ("similarity", pa.float64(), "how alike their normalized texts are (1: the same)"),
    ]
)

SCALE = pa.struct([("name", pa.string()), ("value", pa.int64())])

TEST_INPUTS = contract(
    [
        ("problem_id", pa.string(), "the code problem"),
        ("batch", pa.string(), "the seed batch"),
        ("domain", pa.string(), "always code"),
        (
            "inputs",
            pa.list_(pa.string()),
            "the kept test inputs (stdin texts), de-duplicated; examples first",
        ),
        ("generated", pa.int64(), "inputs the generator produced over the scale grid"),
        ("valid", pa.int64(), "generated inputs the validator accepted"),
        ("kept", pa.int64(), "inputs kept after de-duplication (and the target)"),
        (
            "largest_ok_scale",
            pa.list_(SCALE),
            "the largest scale values the generator ran at without error",
        ),
        (
            "generator",
            pa.string(),
            "the model-written generate_test_input/validate_test_input program",
        ),
        (
            "parse_error",
            pa.string(),
            "why no program could be read from the completion (null: one was)",
        ),
        (
            "errors",
            pa.list_(pa.string()),
            "errors of generator or validator runs, one per failed run",
        ),
        ("model", pa.string(), "the model that wrote the generator"),
    ]
)

CANDIDATE_SOLUTIONS = contract(
    [
        ("id", pa.string(), "candidate id"),
        ("problem_id", pa.string(), "the problem it answers"),
        ("batch", pa.string(), "the seed batch"),
        ("domain", pa.string(), "math or code"),
        ("candidate_index", pa.int64(), "its index among the problem's samples, from 0"),
        ("text", pa.string(), "the full long-CoT completion"),
        ("program", pa.string(), "code: the last fenced code block (null if none)"),
        ("answer", pa.string(), "math: the last \\boxed{} answer (null if none)"),
        ("parse_error", pa.string(), "why no program or answer could be read (null: one was)"),
        ("finish_reason", pa.string(), "stop, length or eos"),
        ("completion_tokens", pa.int64(), "tokens the model generated for it"),
        ("model", pa.string(), "the solver model"),
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

VERIFIED_OUTPUTS = contract(
    [
        ("problem_id", pa.string(), "the problem"),
        ("batch", pa.string(), "the seed batch"),
        ("domain", pa.string(), "math or code"),
        ("verified", pa.bool_(), "labels were decided (seeds: always, by their oracle or answer)"),
        ("reason", pa.string(), "why the problem is not verified (null when it is)"),
        (
            "label_source",
            pa.string(),
            "majority (candidates voted), oracle (a seed's program) or given (a seed's answer)",
        ),
        (
            "agreement",
            pa.float64(),
            "share of candidates that agree with the label (majority: the vote's share)",
        ),
        ("answer", pa.string(), "math: the verified answer"),
        ("inputs", pa.list_(pa.string()), "code: the test inputs"),
        ("labels", pa.list_(pa.string()), "code: the verified output for each input"),
        (
            "candidates",
            pa.list_(CANDIDATE_VERDICT),
            "per candidate: agrees, run status, answer, wall and CPU seconds, peak memory",
        ),
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

VERIFIED_SOLUTIONS = contract(
    [
        ("id", pa.string(), "solution id"),
        ("problem_id", pa.string(), "the problem"),
        ("candidate_id", pa.string(), "the agreeing candidate it was made from"),
        ("batch", pa.string(), "the seed batch"),
        ("domain", pa.string(), "math or code"),
        ("problem", pa.string(), "the problem statement"),
        ("solution", pa.string(), "the long-CoT text"),
        ("program", pa.string(), "code: the program"),
        ("answer", pa.string(), "math: the final answer"),
        (
            "messages",
            pa.list_(MESSAGE),
            "the chat (user problem, assistant solution) for SFT trainers",
        ),
        ("verification_info", VERIFICATION_INFO, "code: the test cases in open-r1's layout"),
        ("agreement", pa.float64(), "the problem's candidate agreement"),
        ("label_source", pa.string(), "majority, oracle or given (see verified_outputs)"),
        ("cpu_s", pa.float64(), "code: CPU seconds of its runs on the test inputs"),
        ("model", pa.string(), "the solver model"),
    ]
)

# -- rStar-Math: search, preference pairs, SFT data, checkpoints ------------------------

# One node of a search tree (rstar_pipelines.math.tree.Node.row).
SEED_COLUMN = ("seed_id", pa.string(), "the seed it descends from: its side of the held-out split")

NODE = pa.struct(
    [
        ("node_id", pa.string()),
        ("parent_id", pa.string()),
        ("depth", pa.int64()),
        ("text", pa.string()),
        ("kind", pa.string()),
        ("observation", pa.string()),
        ("terminal", pa.bool_()),
        ("final_answer", pa.string()),
        ("correct", pa.bool_()),
        ("visits", pa.int64()),
        ("q", pa.float64()),
        ("value", pa.float64()),
        ("completion_tokens", pa.int64()),
    ]
)

NODE_COLUMNS = {
    "node_id": "the node's dotted tag: the root is 0, its children 0.1, 0.2, ...",
    "parent_id": "the parent node (null: the root)",
    "depth": "steps from the root",
    "text": "the step as the policy wrote it, with its code's output",
    "kind": "root, code, text (a step whose box gives no answer: no code), answer, or a failure",
    "observation": "the output of the step's code in the sandbox",
    "terminal": "the node ends a trajectory",
    "final_answer": "a terminal's answer",
    "correct": "an answer matches the verified answer (null: searched without one, to evaluate)",
    "visits": "backups it received (terminal rewards, and the PPM's first value)",
    "q": "its Q-value after the search",
    "value": "the first value it was given (PPM or reward)",
    "completion_tokens": "tokens the policy generated for the step (null: the root)",
}

MCTS_NODES = contract(
    [
        ("problem_id", pa.string(), "the problem the tree searched"),
        SEED_COLUMN,
        ("batch", pa.string(), "the seed batch"),
        ("round", pa.int64(), "the self-evolution round"),
        ("question", pa.string(), "the problem statement"),
        ("gold_answer", pa.string(), "the verified answer the terminals are scored against"),
        *[(f.name, f.type, NODE_COLUMNS[f.name]) for f in NODE],
        ("model", pa.string(), "the policy that generated the steps"),
    ]
)

MCTS_TRAJECTORIES = contract(
    [
        ("id", pa.string(), "trajectory id"),
        ("problem_id", pa.string(), "the problem"),
        SEED_COLUMN,
        ("batch", pa.string(), "the seed batch"),
        ("round", pa.int64(), "the self-evolution round"),
        ("leaf_id", pa.string(), "the terminal node it ends at"),
        ("steps", pa.list_(pa.string()), "the steps from the root's child to the leaf"),
        ("q_values", pa.list_(pa.float64()), "each step's Q-value after the search"),
        ("final_answer", pa.string(), "the answer it ends with"),
        ("correct", pa.bool_(), "the final answer matches the verified answer"),
        ("mean_q", pa.float64(), "mean of the steps' Q-values"),
        ("min_q", pa.float64(), "smallest of the steps' Q-values"),
        ("model", pa.string(), "the policy"),
    ]
)

# TRL's reward-model layout (prompt, chosen, rejected, margin) plus where each pair came from.
PPM_PAIRS = contract(
    [
        ("id", pa.string(), "pair id"),
        ("problem_id", pa.string(), "the problem"),
        SEED_COLUMN,
        ("batch", pa.string(), "the seed batch"),
        ("round", pa.int64(), "the self-evolution round"),
        ("kind", pa.string(), "step (sibling steps) or final (whole trajectories)"),
        ("node_id", pa.string(), "the parent node whose children are compared"),
        ("prompt", pa.string(), "the question and the steps before the compared ones"),
        ("chosen", pa.string(), "the preferred continuation"),
        ("rejected", pa.string(), "the other continuation"),
        ("margin", pa.float64(), "chosen Q minus rejected Q"),
        ("chosen_step", pa.string(), "the chosen step alone"),
        ("rejected_step", pa.string(), "the rejected step alone"),
        ("chosen_q", pa.float64(), "Q-value of the chosen step"),
        ("rejected_q", pa.float64(), "Q-value of the rejected step"),
        (
            "pos_count",
            pa.int64(),
            "positive steps under the parent (the loss weights by 1/(pos·neg))",
        ),
        ("neg_count", pa.int64(), "negative steps under the parent"),
        ("edit_distance", pa.int64(), "edit distance between the two steps"),
    ]
)

SFT_DATASET = contract(
    [
        ("id", pa.string(), "example id"),
        ("source", pa.string(), "mcts (a top trajectory) or verified_solutions"),
        ("problem_id", pa.string(), "the problem"),
        SEED_COLUMN,
        ("batch", pa.string(), "the seed batch"),
        ("round", pa.int64(), "the self-evolution round"),
        ("domain", pa.string(), "math or code"),
        ("messages", pa.list_(MESSAGE), "the chat the policy is fine-tuned on"),
        ("mean_q", pa.float64(), "mcts: the trajectory's mean Q-value"),
        ("min_q", pa.float64(), "mcts: the trajectory's smallest Q-value"),
    ]
)

# -- rStar2-Agent: GRPO-RoC ---------------------------------------------------------------

# What a grpo training job reads: one problem per row and the chat its rollouts start from.
GRPO_ROC_DATA = contract(
    [
        ("id", pa.string(), "the problem's id"),
        SEED_COLUMN,
        ("batch", pa.string(), "the seed batch"),
        ("domain", pa.string(), "math or code"),
        ("question", pa.string(), "the problem statement"),
        ("answer", pa.string(), "math: the verified answer the reward checks"),
        ("inputs", pa.list_(pa.string()), "code: the verified test inputs"),
        ("labels", pa.list_(pa.string()), "code: the verified outputs of the inputs"),
        ("prompt", pa.list_(MESSAGE), "the system and user messages a rollout starts from"),
    ]
)

# The GRPO-RoC policy on the held-out problems, one row per problem and method, graded by the
# training reward.
GRPO_EVAL = contract(
    [
        ("problem_id", pa.string(), "the held-out problem"),
        SEED_COLUMN,
        ("batch", pa.string(), "the seed batch"),
        ("round", pa.int64(), "the self-evolution round"),
        ("domain", pa.string(), "math or code"),
        ("gold_answer", pa.string(), "math: the verified answer (it grades, never generates)"),
        ("method", pa.string(), "greedy (one turn, no tool run) or tool (its rollouts' turns)"),
        ("answer", pa.string(), "math: the final turn's answer"),
        ("correct", pa.bool_(), "the training reward: math-verify, or the verified tests"),
        ("turns", pa.int64(), "assistant turns"),
        ("tool_calls", pa.int64(), "tool calls answered"),
        ("tool_errors", pa.int64(), "tool calls whose run did not end ok"),
        ("tokens", pa.int64(), "model tokens over all turns"),
        ("seconds", pa.float64(), "wall seconds, kept from when it was computed"),
        ("policy", pa.string(), "the GRPO-RoC checkpoint evaluated"),
    ]
)

CHECKPOINT = contract(
    [
        ("id", pa.string(), "the job's directory name (a fingerprint of its inputs)"),
        ("job", pa.string(), "ppm, sft or grpo"),
        ("round", pa.int64(), "the self-evolution round"),
        ("path", pa.string(), "the checkpoint: a Hugging Face directory"),
        ("base_model", pa.string(), "the model training started from"),
        ("examples", pa.int64(), "training examples (ppm: pairs; grpo: problems)"),
        ("heldout_examples", pa.int64(), "examples held out for evaluation"),
        ("steps", pa.int64(), "training steps"),
        ("final_loss", pa.float64(), "the last optimizer step's loss (null: no update was made)"),
        ("heldout_accuracy", pa.float64(), "ppm: pairwise accuracy on the held-out pairs"),
        (
            "train_accuracy_before",
            pa.float64(),
            "ppm: pairwise accuracy on the training pairs before training",
        ),
        (
            "train_accuracy_after",
            pa.float64(),
            "ppm: pairwise accuracy on the training pairs after training",
        ),
        ("mean_reward_first", pa.float64(), "grpo: mean reward of the first step's rollouts"),
        ("mean_reward_last", pa.float64(), "grpo: mean reward of the last step's rollouts"),
        ("seconds", pa.float64(), "wall seconds of the training process"),
        ("run_id", pa.string(), "the Dagster run that trained it"),
        ("processes", pa.int64(), "accelerate's processes (one per GPU, or gloo CPU ranks)"),
        (
            "resumed_from_step",
            pa.int64(),
            "the checkpoint step a killed job resumed from (null: trained from the start)",
        ),
    ],
    artifact_column="path",
)

MCTS_EVAL = contract(
    [
        ("problem_id", pa.string(), "the held-out problem"),
        SEED_COLUMN,
        ("batch", pa.string(), "the seed batch"),
        ("round", pa.int64(), "the self-evolution round"),
        ("gold_answer", pa.string(), "the verified answer: it scores the picks, no search sees it"),
        ("greedy_answer", pa.string(), "the policy's answer with greedy decoding"),
        ("best_q_answer", pa.string(), "the search's answer with the highest Q (null: no PPM)"),
        ("majority_answer", pa.string(), "the vote over the top answers by Q (no PPM: all)"),
        ("greedy_correct", pa.bool_(), "greedy answer matches the gold answer"),
        ("best_q_correct", pa.bool_(), "best-Q answer matches the gold answer (null: no PPM)"),
        ("majority_correct", pa.bool_(), "voted answer matches the gold answer"),
        ("search_any_correct", pa.bool_(), "some answer the search found is right (an oracle)"),
        ("search_answers", pa.int64(), "answers the search found"),
        ("answers_valued_by_ppm", pa.int64(), "of those, answers the PPM gave a value"),
        ("search_nodes", pa.int64(), "nodes of the search tree"),
        # What each method cost on the problem: tokens generated, and wall seconds (the
        # search's own time, without loading the models; kept from when it was computed).
        ("greedy_tokens", pa.int64(), "tokens greedy decoding generated"),
        ("search_tokens", pa.int64(), "tokens the search generated"),
        ("greedy_seconds", pa.float64(), "wall seconds of greedy decoding"),
        ("search_seconds", pa.float64(), "wall seconds of the search, without loading models"),
        ("policy", pa.string(), "the policy checkpoint evaluated"),
        ("ppm", pa.string(), "the PPM checkpoint that guided the search (null: none)"),
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

DSER_EVAL = contract(
    [
        ("problem_id", pa.string(), "the held-out problem"),
        SEED_COLUMN,
        ("batch", pa.string(), "the seed batch"),
        ("round", pa.int64(), "the self-evolution round"),
        ("domain", pa.string(), "math or code"),
        ("gold_answer", pa.string(), "math: the verified answer"),
        ("vote_answer", pa.string(), "the vote over the chains' last states"),
        ("vote_correct", pa.bool_(), "the voted answer is correct"),
        (
            "states",
            pa.list_(DSER_STATE),
            "every chain's states: iteration, text, answer, self-verdict, correctness, tokens",
        ),
        # Transitions between consecutive states of every chain (C: correct, I: incorrect),
        # and the two-state Markov chain they estimate: p_improve = P(I->C), p_degrade =
        # P(C->I), predicted accuracy = its stationary P(C) (null where a count is 0).
        ("transitions_cc", pa.int64(), "consecutive states correct -> correct"),
        ("transitions_ci", pa.int64(), "consecutive states correct -> incorrect"),
        ("transitions_ic", pa.int64(), "consecutive states incorrect -> correct"),
        ("transitions_ii", pa.int64(), "consecutive states incorrect -> incorrect"),
        ("p_improve", pa.float64(), "estimated P(incorrect -> correct) (null: no incorrect state)"),
        ("p_degrade", pa.float64(), "estimated P(correct -> incorrect) (null: no correct state)"),
        ("predicted_accuracy", pa.float64(), "stationary P(correct) of the two-state Markov chain"),
        ("observed_accuracy", pa.float64(), "correct states among those the vote pools"),
        ("tokens", pa.int64(), "tokens generated for the problem"),
        ("calls", pa.int64(), "LLM calls made for the problem"),
        ("seconds", pa.float64(), "wall seconds, kept from when it was computed"),
        ("policy", pa.string(), "the policy checkpoint evaluated"),
    ]
)

EVAL_COMPARISON = contract(
    [
        ("round", pa.int64(), "the round that trained the checkpoint (0: the base policy)"),
        ("checkpoint", pa.string(), "policy, policy+ppm, grpo_roc or attn_gates"),
        ("method", pa.string(), "how it was evaluated (docs/evaluation.md)"),
        ("problems", pa.int64(), "held-out math problems all the evaluations share"),
        ("correct", pa.int64(), "of those, problems answered correctly"),
        ("accuracy", pa.float64(), "share of those problems answered correctly"),
        ("accuracy_low", pa.float64(), "the 95% Wilson interval of the accuracy: low end"),
        ("accuracy_high", pa.float64(), "the 95% Wilson interval of the accuracy: high end"),
        # Against a round-0 row on the same problems (null on round 0's greedy row): the
        # round-0 row of the same method, else round 0's greedy decoding.
        ("baseline", pa.string(), "the round-0 row it is compared with"),
        ("difference", pa.float64(), "accuracy minus the baseline's, on the same problems"),
        ("gained", pa.int64(), "problems it answers right and the baseline wrong"),
        ("lost", pa.int64(), "problems the baseline answers right and it wrong"),
        ("p_value", pa.float64(), "exact McNemar test against the baseline, two-sided"),
        ("completions_per_problem", pa.float64(), "mean full solutions generated per problem"),
        ("tokens_per_problem", pa.float64(), "mean tokens generated per problem"),
        ("seconds_per_problem", pa.float64(), "mean wall seconds per problem"),
        (
            "oracle_any_correct",
            pa.float64(),
            "an oracle, not a method: share of problems where any of its solutions is right "
            "by the gold answer (null: one solution)",
        ),
        ("model", pa.string(), "what generated: the checkpoint's model id"),
    ]
)

# -- SeerAttention-R: gate self-distillation --------------------------------------------

GATE_DISTILL_DATA = contract(
    [
        ("id", pa.string(), "text id"),
        ("source", pa.string(), "verified_solutions, seed_problems or file"),
        ("problem_id", pa.string(), "the problem it came from (null: a file's text)"),
        SEED_COLUMN,
        ("domain", pa.string(), "math or code (null: a file's text)"),
        # Exactly one of the two: a plain text, or chat messages that the trainer renders
        # with the base model's own chat template.
        ("text", pa.string(), "a plain text (null when messages is set)"),
        (
            "messages",
            pa.list_(MESSAGE),
            "chat messages the trainer renders with the model's template",
        ),
    ]
)

GATE_CHECKPOINT = contract(
    [
        ("id", pa.string(), "the checkpoint's directory name (the run id)"),
        ("path", pa.string(), "the SeerGates directory: gate_config.json and safetensors"),
        ("base_model", pa.string(), "the frozen model the gates were distilled from"),
        ("examples", pa.int64(), "training texts"),
        ("heldout_examples", pa.int64(), "held-out texts"),
        ("steps", pa.int64(), "training steps"),
        ("final_loss", pa.float64(), "the last step's distillation loss"),
        ("block_size", pa.int64(), "tokens per key block"),
        ("gate_dim", pa.int64(), "the gates' hidden size"),
        ("topk_blocks", pa.int64(), "blocks the recall figures keep"),
        (
            "heldout_recall_before",
            pa.float64(),
            "held-out top-k block recall of the untrained gates",
        ),
        ("heldout_recall_after", pa.float64(), "held-out top-k block recall after training"),
        ("seconds", pa.float64(), "wall seconds of the training process"),
        ("run_id", pa.string(), "the Dagster run that trained it"),
    ],
    artifact_column="path",
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
ATTN_GATE_EVAL = contract(
    [
        ("setting", pa.string(), "dense, or budget <n> (sparse decoding with n tokens)"),
        ("token_budget", pa.int64(), "tokens a sparse decode step reads (null: dense)"),
        ("texts", pa.int64(), "held-out texts decoded under teacher forcing"),
        ("decode_steps", pa.int64(), "decode steps over those texts"),
        ("kl", pa.float64(), "mean KL(dense || sparse) of the next-token distributions"),
        ("top1_agreement", pa.float64(), "share of steps whose most likely token is dense's"),
        ("math_problems", pa.int64(), "held-out math problems answered greedily"),
        ("answer_accuracy", pa.float64(), "share of them answered correctly"),
        ("answer_agreement_with_dense", pa.float64(), "share answered as dense decoding does"),
        ("answers", pa.list_(GATE_ANSWER), "per problem: answer, correct, tokens, seconds"),
        ("gates", pa.string(), "the attn_gate_checkpoint directory"),
        ("base_model", pa.string(), "the model the gates were distilled from"),
    ]
)
