"""The transformers backend's decode loop, in which a row that finishes leaves the batch.

`generate()` runs every row of a batch until the last one ends, the finished ones included: with
sampled completions of spread-out lengths many of the rows' steps are spent on rows already
done. On a CPU a step's cost falls steeply with the rows in it (docs/benchmarks.md), so `decode`
drops finished rows from the batch, the key/value cache and the attention mask, and the batch
gets faster as it empties. Dropping copies the kept rows' cache, so it waits until a quarter of
the batch is done (a few copies per call, each cheaper than the steps it saves).

It does what `generate()` does for a plain causal LM and nothing else: the model's own logits
processors (`generation_config`: repetition penalty, top-k, ...) and sampling, one token per row
per step, positions counted per row from its first valid token, left padding masked.
`TokenPicker` samples from the distribution `generate()`'s temperature, top-k and top-p warpers
give, over the top-k candidates alone where `generate()` sorts and draws over the whole
vocabulary: over tens of thousands of tokens that sort and draw costs a small model on a CPU a
large share of each decode step. Each row draws from its own random stream (`RowSeeds`), so
dropping rows, or batching a prompt with others, changes no row's samples. Rows are kept where
per-row state lives outside the cache (SeerAttention-R's compressed keys,
`drop_finished=False`): they run on, their tokens ignored, as in `generate()`.

Stop strings are looked for in each row's generated text (`stop_strings.StopStrings`, which
the plain backend's `generate()` path uses too).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Collection, Sequence
from typing import Any

import torch

from ..stop_strings import StopStrings
from .cascade_attention import model_inputs

# Rows are dropped once this share of the batch has finished.
DROP_SHARE = 0.25
# The fewest prompt tokens every prompt of a batch must start with for them to be run once.
MIN_SHARED_PREFIX = 32


class TokenPicker:
    """The next token of every row, as `generate()` would draw it for `config`.

    Greedy: the argmax after the model's logits processors. Sampling: the processors, then
    temperature, top-k and top-p (transformers' warpers, in their order) over the k best scores
    only (every other token is out after top-k anyway), then one draw. A config with any other
    warper after those (min-p, typical-p, epsilon or eta cutoffs, top-h, watermarking,
    renormalization) is left whole to transformers' processors and drawn over the vocabulary.
    """

    def __init__(self, model: Any, config: Any, prompt_width: int, device: Any):
        self.sample = bool(config.do_sample)
        others = (
            config.top_h is not None
            or config.min_p is not None
            or (config.typical_p is not None and config.typical_p < 1.0)
            or (config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0)
            or (config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0)
            or config.watermarking_config is not None
            or config.renormalize_logits
        )
        self.own_warpers = self.sample and not others
        if self.own_warpers:
            self.temperature = config.temperature if config.temperature is not None else 1.0
            self.top_k = config.top_k or 0
            self.top_p = config.top_p if config.top_p is not None else 1.0
            config = copy.copy(config)
            config.update(temperature=1.0, top_k=None, top_p=1.0)
        self.processors = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=prompt_width, device=device
        )

    def __call__(
        self, history: torch.Tensor, logits: torch.Tensor, uniforms: torch.Tensor | None
    ) -> torch.Tensor:
        """[rows, 1] token ids, from each row's `logits` (float32), its tokens so far and, when
        sampling, one uniform draw in [0, 1) per row (`RowSeeds`)."""
        if not self.sample:
            return self.processors(history, logits).argmax(dim=-1, keepdim=True)
        probs, candidates = self.distribution(history, logits)
        drawn = _inverse_cdf(probs, uniforms)
        return drawn if candidates is None else candidates.gather(-1, drawn)

    def distribution(
        self, history: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a sampled row draws from: unnormalized probabilities and the token id of each
        (None: the whole vocabulary, in order)."""
        scores = self.processors(history, logits)
        if not self.own_warpers:
            return scores.softmax(dim=-1), None
        scores = scores / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            scores, candidates = scores.topk(self.top_k, dim=-1)  # best first
        else:
            scores, candidates = scores.sort(dim=-1, descending=True)
        probs = scores.softmax(dim=-1)
        if self.top_p < 1.0:
            # transformers drops the low tail whose mass is at most 1 - top_p: best first, a
            # token stays while the mass before it is below top_p (the best always stays).
            before = probs.cumsum(dim=-1) - probs
            probs = probs.masked_fill(before >= self.top_p, 0.0)
        return probs, candidates


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[rows, 1] indices drawn from each row's (unnormalized) `probs` by its uniform: the first
    index whose cumulative mass passes it, as a multinomial draw would be distributed."""
    mass = probs.cumsum(dim=-1)
    target = uniforms.to(mass.device)[:, None] * mass[:, -1:]
    index = torch.searchsorted(mass, target, right=True)
    return index.clamp(max=probs.shape[-1] - 1)


class RowSeeds:
    """One random stream per sampled row, so that a row's random draws depend on the call's
    seed, its prompt and which copy it is, never on the other rows of its batch: the same
    prompt and seed draw the same numbers alone, in another batch (the LLM resource merges
    callers' requests into batches as they come), with rows dropped or kept. vLLM seeds a
    request's sampling the same way, per request. Prompt i's copy j is seeded from (seed, its
    tokens, how many equal prompts came before it in the call, j). Without a seed the streams
    start from torch's generator."""

    def __init__(self, generators: list[torch.Generator]):
        self._generators = generators

    @classmethod
    def for_call(cls, seed: int | None, prompts: Sequence[Sequence[int]], copies: int) -> RowSeeds:
        """The streams of a call's rows, prompt i's copy j at i * copies + j."""
        base = seed if seed is not None else int(torch.randint(0, 2**62, ()).item())
        seen: dict[tuple[int, ...], int] = {}
        generators = []
        for prompt in prompts:
            key = tuple(prompt)
            occurrence = seen[key] = seen.get(key, -1) + 1
            for copy_index in range(copies):
                text = f"{base}:{occurrence}:{copy_index}:{','.join(map(str, key))}"
                row_seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
                generators.append(torch.Generator().manual_seed(row_seed))
        return cls(generators)

    def prompts(self, indices: Sequence[int], copies: int) -> RowSeeds:
        """The streams of the copies of the call's prompts `indices`, in that order (prompt
        indices[k]'s copy j as row k * copies + j)."""
        return RowSeeds([self._generators[i * copies + j] for i in indices for j in range(copies)])

    def draw(self, rows: Sequence[int]) -> torch.Tensor:
        """The next uniform of each of `rows` (indices into the call's rows, in batch order)."""
        return torch.cat([torch.rand(1, generator=self._generators[row]) for row in rows])


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all `prompts` have in common and can be run once for all of
    them (a few-shot preamble, a chat's system turn; a lone prompt's tokens but the last): 0
    below MIN_SHARED_PREFIX. Every prompt keeps at least one token of its own, which gives its
    first logits."""
    limit = min(len(p) for p in prompts) - 1
    length = min(common_prefix_length(prompts[0], p) for p in prompts)
    length = min(length, limit)
    return length if length >= MIN_SHARED_PREFIX else 0


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    shorter = min(len(a), len(b))
    return next((i for i in range(shorter) if a[i] != b[i]), shorter)


def first_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """The position of every token of a padded batch, each row counting its valid tokens from 0
    (padding at 0), as `generate()` numbers a left-padded batch."""
    return (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


@torch.inference_mode()
def decode(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: Any,
    *,
    max_new_tokens: int,
    pick: TokenPicker,
    seeds: RowSeeds | None,
    eos_ids: Collection[int],
    stops: StopStrings | None,
    drop_finished: bool,
) -> list[list[int]]:
    """The tokens each row of a padded batch (`padded_batch`) generates, up to and including the
    one that ended it (an EOS id, or the token that completed a stop string), at most
    `max_new_tokens`.

    `cache` holds the batch's first tokens already (a shared preamble, a prefill shared by copies
    of a prompt) or none; the first step runs the rest. `seeds` (when sampling) holds one random
    stream per row.
    """
    rows = input_ids.shape[0]
    generated: list[list[int]] = [[] for _ in range(rows)]
    slots = list(range(rows))  # the row in each slot of the batch (indices into `generated`)
    ended: set[int] = set()  # rows done; their slots run on until they are dropped
    history = input_ids  # prompt and generated tokens, what the logits processors read
    mask = attention_mask
    positions = first_positions(mask)
    step_ids = input_ids[:, cache.get_seq_length() :]
    step_positions = positions[:, cache.get_seq_length() :]
    next_position = positions[:, -1:] + 1
    for _ in range(max_new_tokens):
        logits = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_positions,
            **model_inputs(model, cache),
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]
        tokens = pick(history, logits.float(), seeds.draw(slots) if seeds else None)
        for row, token in zip(slots, tokens[:, 0].tolist(), strict=True):
            if row in ended:
                continue
            generated[row].append(token)
            last = token in eos_ids or len(generated[row]) == max_new_tokens
            if last or (stops is not None and stops.found(row, [token])):
                ended.add(row)
        if len(ended) == rows:
            break
        history = torch.cat([history, tokens], dim=-1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        step_ids, step_positions = tokens, next_position
        next_position = next_position + 1
        done = sum(row in ended for row in slots)
        if drop_finished and done >= DROP_SHARE * len(slots):
            keep = [slot for slot, row in enumerate(slots) if row not in ended]
            index = torch.tensor(keep, device=input_ids.device)
            cache.batch_select_indices(index)
            history, mask = history[index], mask[index]
            step_ids, step_positions = step_ids[index], step_positions[index]
            next_position = next_position[index]
            slots = [slots[slot] for slot in keep]
    return generated
