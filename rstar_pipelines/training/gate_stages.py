"""Stage kinds of the SeerAttention-R gates: gate_distill_data (the texts) and
attn_gate_checkpoint (gates distilled from the frozen policy model, out of process)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field

from rstar_pipelines import settings
from rstar_pipelines.heldout import HeldoutSplit
from rstar_pipelines.llm import (
    torch_thread,
    transformers_llm_class,
    transformers_model_id,
    transformers_quantization,
)
from rstar_pipelines.llm.devices import default_device
from rstar_pipelines.pipeline.item_cache import fingerprint
from rstar_pipelines.pipeline.plots import markdown_table
from rstar_pipelines.pipeline.stage import (
    Stage,
    StageContext,
    StageInputError,
    StageParams,
    StageResult,
    rows_of,
)
from rstar_pipelines.problems import (
    NO_HELDOUT_CHECK,
    ProblemFreeSource,
    VerifiedProblem,
    groups_of,
    heldout_texts,
    no_heldout_check,
    seeds_of,
    verified_problems,
)
from rstar_pipelines.storage import schemas
from rstar_pipelines.training.gate import GateTrainSettings
from rstar_pipelines.training.stages import TrainingParams, TrainingStage, _local_model

FILE_SOURCE = "file"  # the `source` of text_file's rows, which name no problem


class GateDataParams(StageParams):
    heldout: HeldoutSplit = HeldoutSplit()  # the file's `heldout:` section, set by the loader
    seed_solutions: bool = Field(
        True,
        description="also each code seed with its first oracle solution (verified by "
        "definition), so a batch whose candidates all failed still has texts",
    )
    text_file: str | None = Field(
        None,
        description="JSONL or Parquet of more texts (`text`, optional `id`); relative paths "
        "are under the data directory",
    )
    max_texts: int | None = Field(None, ge=1)


def problem_texts(
    inputs: dict[str, pa.Table], split: HeldoutSplit, heldout: bool, seed_solutions: bool
) -> list[dict[str, Any]]:
    """The chats of one side of the split: each verified solution (problem, then solution), and
    with `seed_solutions` each code seed with its first oracle solution."""
    lineage = seeds_of(inputs["synthesized_problems"])
    groups = groups_of(inputs["problem_groups"])

    def on_this_side(problem_id: str) -> bool:
        return problem_id in groups and split.is_heldout(groups[problem_id]) == heldout

    rows = [
        _chat_row(
            r["id"], "verified_solutions", r["problem_id"], lineage, r["domain"], r["messages"]
        )
        for r in rows_of(inputs["verified_solutions"])
        if on_this_side(r["problem_id"])
    ]
    if seed_solutions:
        rows += [
            _seed_row(r, lineage)
            for r in rows_of(inputs["synthesized_problems"])
            if r["is_seed"] and r["oracle_solutions"] and on_this_side(r["id"])
        ]
    return rows


class GateDistillData(Stage):
    """Texts to distil the attention gates on, from the training side of the held-out split:
    each verified solution as a chat (problem, then the solution; the trainer renders it with the
    base model's chat template), plus the declared extra sources."""

    Params = GateDataParams
    schema = schemas.GATE_DISTILL_DATA
    checks = (NO_HELDOUT_CHECK,)
    version = "3"  # the split over near-duplicate groups; the file's texts checked

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        rows = problem_texts(inputs, p.heldout, heldout=False, seed_solutions=p.seed_solutions)
        if p.text_file is not None:
            rows += _file_rows(settings.resolve_data_path(p.text_file))
        rows = rows[: p.max_texts]
        counts = Counter(r["source"] for r in rows)
        groups = groups_of(inputs["problem_groups"])
        # The file's texts name no problem: declared problem-free, and proven so against the
        # text of every held-out problem.
        files = ProblemFreeSource(
            FILE_SOURCE, heldout_texts(inputs["synthesized_problems"], groups, p.heldout)
        )
        return StageResult(
            table=pa.Table.from_pylist(rows, schema=self.schema),
            metadata={"texts": len(rows), **{f"from_{k}": v for k, v in sorted(counts.items())}},
            checks=[no_heldout_check(rows, groups, p.heldout, problem_free=files)],
        )


def _chat_row(
    id_: str,
    source: str,
    problem_id: str,
    lineage: dict[str, str],
    domain: str,
    messages: list[dict],
) -> dict[str, Any]:
    return {
        "id": id_,
        "source": source,
        "problem_id": problem_id,
        "seed_id": lineage[problem_id],
        "domain": domain,
        "text": None,
        "messages": messages,
    }


def _seed_row(seed: dict[str, Any], lineage: dict[str, str]) -> dict[str, Any]:
    solution = seed["oracle_solutions"][0].rstrip("\n")
    messages = [
        {"role": "user", "content": seed["problem"]},
        {"role": "assistant", "content": f"```python\n{solution}\n```"},
    ]
    return _chat_row(
        f"{seed['id']}:oracle", "seed_problems", seed["id"], lineage, seed["domain"], messages
    )


def _file_rows(path: Path) -> list[dict[str, Any]]:
    """The texts of a JSONL or Parquet file, each with its `id` or `<file>:<line>`."""
    if not path.is_file():
        raise StageInputError(f"text_file not found: {path}")
    if path.suffix == ".parquet":
        try:
            records = pq.read_table(path).to_pylist()
        except pa.ArrowInvalid as error:
            raise StageInputError(f"{path} is not a Parquet file: {error}") from error
    else:
        records = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                records.append(json.loads(line) if line.strip() else None)
            except json.JSONDecodeError as error:
                raise StageInputError(f"{path} line {number} is not JSON: {error}") from error
    rows = []
    for number, record in enumerate(records, 1):
        if record is None:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise StageInputError(f"{path} row {number} has no string `text`")
        rows.append(
            {
                "id": str(record.get("id") or f"{path.name}:{number}"),
                "source": FILE_SOURCE,
                "problem_id": None,
                "seed_id": None,
                "domain": None,
                "text": record["text"],
                "messages": None,
            }
        )
    return rows


class GateTrainingParams(TrainingParams):
    model: str  # the frozen base model's role
    train: GateTrainSettings = GateTrainSettings()


class AttnGateCheckpoint(TrainingStage):
    """SeerAttention-R gates for the declared base model, self-distilled from its own attention
    on gate_distill_data (docs/seer-attention.md); the base model stays frozen. The row reports the
    held-out top-k block recall before (fresh gates) and after training."""

    Params = GateTrainingParams
    schema = schemas.GATE_CHECKPOINT
    resources = ("llm",)
    job = "gate"
    data_input = "gate_distill_data"
    empty_hint = "verify some solutions, keep seed_solutions on, or declare a text_file"

    def base_model(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> str:
        return _local_model(ctx, self.model)

    def checkpoint_name(self) -> str:
        return "attn_gates"

    def _row(self, out: Path, base: str, m: dict[str, Any]) -> dict[str, Any]:
        gate = m["gate_config"]
        return {
            "path": str(out),
            "base_model": base,
            "examples": m["examples"],
            "heldout_examples": m["heldout_examples"],
            "steps": m["steps"],
            "final_loss": m["losses"][-1],
            "block_size": gate["block_size"],
            "gate_dim": gate["gate_dim"],
            "topk_blocks": m["topk_blocks"],
            "heldout_recall_before": m["heldout_recall_before"],
            "heldout_recall_after": m["heldout_recall_after"],
            "seconds": m["seconds"],
        }


class GateEvalParams(StageParams):
    heldout: HeldoutSplit = HeldoutSplit()  # the file's `heldout:` section, set by the loader
    budgets: list[int] = Field(
        [64, 128], min_length=2, description="token budgets of sparse decoding to compare"
    )
    max_texts: int = Field(4, ge=1, description="held-out texts decoded under teacher forcing")
    max_length: int = Field(512, ge=4, description="tokens of each text")
    prefill_fraction: float = Field(0.5, gt=0, lt=1, description="of each text, prefilled dense")
    max_problems: int | None = Field(2, ge=1, description="held-out math problems answered")
    answer_tokens: int = Field(128, ge=1, description="greedy tokens per answer")
    backend: Literal["torch", "triton", "tilelang"] = Field(
        "torch", description="the sparse_decode kernel (triton or tilelang on a GPU)"
    )


class AttnGateEvaluation(Stage):
    """attn_gate_checkpoint's gates on its base model, sparse decoding against dense at each
    token budget, on the held-out split: texts it never trained on (their verified solutions,
    and held-out code seeds with an oracle solution) decoded under teacher forcing (KL to dense,
    top-1 agreement), and the greedy answers to the held-out math problems (accuracy). The base
    model runs with the weights it decodes with everywhere else (`transformers_quantization`'s
    default: int4 for the embedded model on a CPU), dense and sparse alike."""

    Params = GateEvalParams
    schema = schemas.ATTN_GATE_EVAL
    prompt_roles = ("solve",)
    kinds = frozenset({"pytorch"})

    def run(self, ctx: StageContext, inputs: dict[str, pa.Table]) -> StageResult:
        p = self.params
        rows = inputs["attn_gate_checkpoint"].to_pylist()
        if not rows:
            raise StageInputError("attn_gate_checkpoint has no row: train the gates first")
        gates_path, base = rows[-1]["path"], rows[-1]["base_model"]
        texts, math = self._heldout(inputs)
        loaded: list[tuple[Any, Any, Any]] = []
        # The weights the base model decodes with everywhere else (int4 for the embedded model
        # on a CPU), named as the backend names its completions (with its revision, so that
        # items its older code decoded are not served): part of every item's key.
        quantization = transformers_quantization(None, base, default_device(None))

        def model():
            if not loaded:
                from rstar_kernels.gate import SeerGates

                load = transformers_llm_class().load_model_and_tokenizer
                lm, tokenizer = load(base, quantization=quantization)
                loaded.append((lm, tokenizer, SeerGates.load(gates_path, device=lm.device)))
            return loaded[0]

        setting = [gates_path, transformers_model_id(base, quantization), p.backend, p.budgets]
        # The model's forwards on the torch thread, where it was loaded and where the LLMs of
        # this process generate (module `llm.torch_thread`).
        text_items = ctx.cache.map(
            texts,
            lambda t: fingerprint(setting, p.max_length, p.prefill_fraction, t["messages"]),
            lambda chunk: torch_thread.run(lambda: [self._decode_text(model(), t) for t in chunk]),
            chunk=1,
        )
        prompts = [self.prompts["solve"].render(domain="math", question=q.question) for q in math]
        answer_items = ctx.cache.map(
            prompts,
            lambda prompt: fingerprint(setting, p.answer_tokens, prompt),
            lambda chunk: torch_thread.run(lambda: self._answer(model(), chunk)),
            chunk=8,
        )
        table = _gate_rows(p, texts, text_items, math, answer_items, gates_path, base)
        return StageResult(
            table=pa.Table.from_pylist(table, schema=self.schema),
            metadata={
                "gates": gates_path,
                "base_model": base,
                "quantization": quantization,
                "texts": len(texts),
                "math_problems": len(math),
                "comparison": _comparison(table),
            },
        )

    def _heldout(self, inputs: dict[str, pa.Table]) -> tuple[list[dict], list[VerifiedProblem]]:
        """The held-out texts decoded under teacher forcing and the held-out math problems
        answered; an error when there is neither."""
        p = self.params
        texts = problem_texts(inputs, p.heldout, heldout=True, seed_solutions=True)[: p.max_texts]
        math = [q for q in verified_problems(inputs, "math") if p.heldout.is_heldout(q.group)]
        math = math[: p.max_problems]
        if not texts and not math:
            raise StageInputError(
                "attn_gate_eval: the held-out split has no text (verified solution or code seed "
                "with an oracle solution) and no verified math problem to decode"
            )
        return texts, math

    def _decode_text(self, loaded: tuple[Any, Any, Any], text: dict[str, Any]) -> dict[str, Any]:
        import torch

        from rstar_pipelines.llm.types import render_chat
        from rstar_pipelines.training.gate_eval import text_outcomes

        lm, tokenizer, gates = loaded
        p = self.params
        rendered = render_chat(tokenizer, text["messages"])
        ids = torch.tensor(
            tokenizer(rendered, add_special_tokens=False)["input_ids"][: p.max_length]
        )
        if ids.shape[0] < 2:
            return {"budgets": []}
        found = text_outcomes(lm, gates, ids, p.budgets, p.prefill_fraction, p.backend)
        return {"budgets": [dataclasses.asdict(found[b]) for b in p.budgets]}

    def _answer(self, loaded: tuple[Any, Any, Any], prompts: list[str]) -> list[dict[str, Any]]:
        from rstar_pipelines.training.gate_eval import answer_outcomes

        lm, tokenizer, gates = loaded
        p = self.params
        llm = transformers_llm_class().wrap(lm, tokenizer, name="gate-eval")
        found = answer_outcomes(llm, lm, gates, prompts, p.budgets, p.answer_tokens, p.backend)
        settings_ = [None, *p.budgets]
        return [
            {"answers": [dataclasses.asdict(found[s][i]) for s in settings_]}
            for i in range(len(prompts))
        ]


def _gate_rows(p, texts, text_items, math, answer_items, gates_path, base) -> list[dict]:
    """One row for dense decoding and one per budget."""
    from rstar_pipelines.math.answers import equivalent, extract_boxed

    decoded = [item["budgets"] for item in text_items if item["budgets"]]
    rows = []
    for index, budget in enumerate([None, *p.budgets]):
        answers = []
        for q, item in zip(math, answer_items, strict=True):
            outcome = item["answers"][index]
            answer = extract_boxed(outcome["text"])
            dense_answer = extract_boxed(item["answers"][0]["text"])
            answers.append(
                {
                    "problem_id": q.id,
                    "batch": q.batch,
                    "answer": answer,
                    "correct": answer is not None and equivalent(answer, q.answer),
                    "same_as_dense": answer == dense_answer,
                    "tokens": outcome["tokens"],
                    "seconds": outcome["seconds"],
                }
            )
        steps = sum(t[index - 1]["steps"] for t in decoded) if budget is not None else None
        rows.append(
            {
                "setting": "dense" if budget is None else f"budget {budget}",
                "token_budget": budget,
                "texts": len(decoded),
                "decode_steps": steps
                if budget is not None
                else sum(t[0]["steps"] for t in decoded),
                "kl": _weighted(decoded, index - 1, "kl") if budget is not None else None,
                "top1_agreement": (
                    _weighted(decoded, index - 1, "agreement") if budget is not None else None
                ),
                "math_problems": len(answers),
                "answer_accuracy": _share([a["correct"] for a in answers]),
                "answer_agreement_with_dense": _share([a["same_as_dense"] for a in answers]),
                "answers": answers,
                "gates": gates_path,
                "base_model": base,
            }
        )
    return rows


def _comparison(rows: list[dict]) -> str:
    """The settings side by side: decode steps, divergence from dense and answer accuracy."""
    return markdown_table(
        [
            "setting",
            "decode steps",
            "KL(dense ‖ sparse)",
            "top-1 agreement",
            "answer accuracy",
            "answers as dense",
        ],
        [
            [
                r["setting"],
                r["decode_steps"],
                _fmt(r["kl"], 4),
                _fmt(r["top1_agreement"], 3),
                _fmt(r["answer_accuracy"], 3),
                _fmt(r["answer_agreement_with_dense"], 3),
            ]
            for r in rows
        ],
    )


def _weighted(decoded: list[list[dict]], index: int, key: str) -> float | None:
    """The mean over every decode step of all texts (each text weighs by its steps)."""
    steps = sum(t[index]["steps"] for t in decoded)
    return sum(t[index][key] * t[index]["steps"] for t in decoded) / steps if steps else None


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _fmt(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
