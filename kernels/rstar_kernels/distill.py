"""Self-distillation of the SeerAttention-R gates (docs/seer-attention.md): the frozen model's own
attention, max-pooled over key blocks, is the target the gates learn to predict.

Shapes: B batch, H_q query heads, H_kv KV heads, T tokens, D head dim, N = ceil(T / block) blocks.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .gate import GateConfig, SeerGates, capture_pre_rope, rotate_half

# Added to each target row's sum before renormalising, as the reference does.
RENORM_EPS = 1e-9
# Per layer: pre-RoPE q [B, H_q, T, D], k [B, H_kv, T, D], target [B, H_kv, T, N], rows [B, T].
Teacher = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# Query rows per chunk of the reference target: bounds its [H_q, rows, T] probability map.
TARGET_CHUNK = 512


@dataclass(frozen=True)
class GateTrainConfig:
    """Gate training settings (docs/seer-attention.md). Defaults follow the reference recipe where
    it has one; one step is one text (the reference packs 32k-token sequences, 16 per step)."""

    lr: float = 1e-3
    min_lr: float = 1e-5  # the cosine decay's floor
    warmup_steps: int = 20
    steps: int = 800  # optimizer steps; the training texts are cycled, reshuffled each pass
    max_length: int = 4096  # tokens per text (longer texts are truncated)
    block_size: int = 64
    gate_dim: int = 128
    qk_norm: bool = True
    loss_slice_ratio: float = 0.5  # only query rows in the last (1 - ratio) of a text count
    gate_loss_scale: float = 10.0
    max_grad_norm: float | None = 1.0
    heldout_fraction: float = 0.1
    topk_blocks: int = 4  # the budget (in blocks) of the held-out recall
    # Keep each text's frozen-model pass (q, k, target: about layers x T x (H_q + H_kv) x D
    # floats) after its first use, so later passes over the texts skip the model.
    cache_teacher: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("lr", "min_lr", "steps", "max_length", "block_size", "gate_dim", "topk_blocks")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.warmup_steps < 0 or self.seed < 0:
            raise ValueError("warmup_steps and seed must not be negative")
        if not 0 <= self.loss_slice_ratio < 1:
            raise ValueError(f"loss_slice_ratio must be in [0, 1), not {self.loss_slice_ratio}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), not {self.heldout_fraction}")
        if self.max_length <= self.block_size:
            raise ValueError("max_length must exceed block_size: no row would have a target")


def block_causal_mask(length: int, num_blocks: int, block_size: int, device: Any = None):
    """`[T, N]` bool: key block j is a target for query t iff it lies strictly before t's block
    (the current block is always attended at inference, so it is not learned)."""
    own = torch.arange(length, device=device) // block_size
    return torch.arange(num_blocks, device=device)[None, :] < own[:, None]


def distillation_target(
    q: torch.Tensor,
    k: torch.Tensor,
    num_kv_heads: int,
    block_size: int,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate's target from post-RoPE `q [B, H_q, T, D]` and `k [B, H_kv, T, D]`.

    Causal softmax attention (scale 1/sqrt(D), keys with `valid [B, T]` False masked out); for each
    query the max probability inside each key block, maxed over the GQA group, kept only for
    blocks before the query's own and renormalised. Returns `target [B, H_kv, T, N]` (float32) and
    `rows [B, T]` bool: valid queries that have a valid key in an earlier block; other rows are
    not trained on.
    """
    b, h_q, t, d = q.shape
    if k.shape != (b, num_kv_heads, t, d) or h_q % num_kv_heads:
        raise ValueError(
            f"k {tuple(k.shape)} does not match q {tuple(q.shape)} with {num_kv_heads} KV heads"
        )
    if valid is None:
        valid = torch.ones(b, t, dtype=torch.bool, device=q.device)
    group = h_q // num_kv_heads
    n = -(-t // block_size)
    keys = k.float().repeat_interleave(group, dim=1)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    blocks = block_causal_mask(t, n, block_size, q.device)
    chunks = []
    for start in range(0, t, TARGET_CHUNK):
        stop = min(start + TARGET_CHUNK, t)
        scores = q[:, :, start:stop].float() @ keys.transpose(-1, -2) / math.sqrt(d)
        allowed = causal[start:stop][None, None] & valid[:, None, None, :]
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1).nan_to_num(0.0)
        probs = torch.nn.functional.pad(probs, (0, n * block_size - t))
        pooled = probs.view(b, h_q, stop - start, n, block_size).amax(dim=-1)
        pooled = pooled.view(b, num_kv_heads, group, stop - start, n).amax(dim=2)
        chunks.append(pooled * blocks[start:stop])
    target = torch.cat(chunks, dim=2)
    target = target / (target.sum(dim=-1, keepdim=True) + RENORM_EPS)
    valid_blocks = torch.nn.functional.pad(valid, (0, n * block_size - t))
    valid_blocks = valid_blocks.view(b, n, block_size).any(dim=-1)
    rows = valid & (blocks[None] & valid_blocks[:, None, :]).any(dim=-1)
    return target, rows


def gate_kl_loss(gate_logits: torch.Tensor, target: torch.Tensor, rows: torch.Tensor):
    """KL(target || softmax(gate_logits)) over blocks, averaged over the contributing rows (`rows
    [B, T]`, for every KV head).

    The reference uses KLDivLoss's element-wise mean, i.e. this divided by N: a per-row mean makes
    the loss independent of the sequence length. AdamW is nearly invariant to the loss's scale,
    so the recipe's lr and gate_loss_scale carry over. `gate_logits` must be -inf outside the
    target's support (blocks at or after the query's own; see `block_causal_mask`).
    """
    b, h, t, _ = gate_logits.shape
    selected = rows[:, None, :].expand(b, h, t)
    if not selected.any():
        raise ValueError("no row contributes to the loss (texts shorter than two blocks?)")
    log_probs = torch.log_softmax(gate_logits[selected].float(), dim=-1)
    p = target[selected]
    support = p > 0
    kl = torch.where(support, p * (p.clamp_min(1e-30).log() - log_probs.where(support, 0.0)), 0.0)
    return kl.sum(dim=-1).mean()


def topk_recall(
    gate_logits: torch.Tensor, target: torch.Tensor, rows: torch.Tensor, k: int
) -> torch.Tensor:
    """Per (row, KV head): the fraction of the target's top-k blocks that are among the gate's
    top-k. Only rows with more than k candidate blocks (finite logits) count: with fewer, any
    selection keeps them all. Returns a flat tensor, one value per counted (row, head)."""
    b, h, t, _ = gate_logits.shape
    selected = rows[:, None, :].expand(b, h, t) & (gate_logits.isfinite().sum(dim=-1) > k)
    logits, p = gate_logits[selected], target[selected]
    truth = torch.zeros_like(p, dtype=torch.bool).scatter(-1, p.topk(k, dim=-1).indices, True)
    chosen = torch.zeros_like(truth).scatter(-1, logits.topk(k, dim=-1).indices, True)
    return (truth & chosen).sum(dim=-1).float() / k


def _target(q, k, num_kv_heads: int, block_size: int):
    """The distillation target: on a GPU from the fused Triton kernel (no T x T map in memory;
    the values are not needed, so the keys stand in for them), else the PyTorch reference."""
    if not q.is_cuda:
        return distillation_target(q, k, num_kv_heads, block_size)
    from .pooling_triton import attention_with_block_max, group_max_target

    _, block_max = attention_with_block_max(q, k, k, block_size)
    return group_max_target(block_max, num_kv_heads, block_size)


def teacher_pass(model: Any, ids: torch.Tensor, config: GateConfig) -> list[Teacher]:
    """The frozen model's side of one tokenised text `ids [T]`: per layer, the pre-RoPE q and k
    the gate reads, the distillation target and its rows (see `distillation_target`)."""
    inner = getattr(model, "model", model)
    positions = torch.arange(ids.shape[0], device=ids.device)[None]
    with torch.no_grad(), capture_pre_rope(model) as captured:
        inner(input_ids=ids[None], use_cache=False)
        # The model's own rotary turns the captured q/k into what its attention used.
        cos, sin = (x[:, None] for x in inner.rotary_emb(captured[0]["q"], positions))
        out = []
        for layer in captured:
            q, k = layer["q"], layer["k"]
            target, rows = _target(
                q * cos + rotate_half(q) * sin,
                k * cos + rotate_half(k) * sin,
                config.num_kv_heads,
                config.block_size,
            )
            out.append((q, k, target, rows))
    return out


def gate_outputs(
    gates: SeerGates, teacher: list[Teacher], first_row: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer: the gate's block-causal logits (with gradients), the target and the rows
    from `first_row` on."""
    bs = gates.config.block_size
    length = teacher[0][0].shape[2]
    positions = torch.arange(length, device=teacher[0][0].device)[None]
    starts = positions[:, ::bs]
    blocks = block_causal_mask(length, starts.shape[1], bs, positions.device)
    out = []
    for gate, (q, k, target, rows) in zip(gates, teacher, strict=True):
        logits = gate.logits(gate.query(q, positions), gate.keys(gate.pool(k), starts))
        kept = rows & (positions >= first_row)
        out.append((logits.masked_fill(~blocks, -math.inf), target, kept))
    return out


def sequence_loss(gates: SeerGates, teacher: list[Teacher], config: GateTrainConfig):
    """The training loss of one text: per-layer KL summed over layers, times gate_loss_scale."""
    first_row = math.ceil(config.loss_slice_ratio * teacher[0][0].shape[2])
    layers = gate_outputs(gates, teacher, first_row)
    return config.gate_loss_scale * sum(gate_kl_loss(*layer) for layer in layers)


def heldout_recall(gates: SeerGates, teachers: Iterable[list[Teacher]], k: int) -> float | None:
    """Mean top-k recall over the held-out texts' layers, KV heads and rows; None when no row has
    more than k earlier blocks."""
    values = []
    with torch.no_grad():
        for teacher in teachers:
            values += [topk_recall(*layer, k) for layer in gate_outputs(gates, teacher)]
    values = torch.cat(values) if values else torch.empty(0)
    return values.mean().item() if values.numel() else None


def _schedule(config: GateTrainConfig) -> Callable[[int], float]:
    """Linear warm-up to lr, then cosine decay to min_lr (as a factor of lr)."""
    floor = config.min_lr / config.lr
    warmup = min(config.warmup_steps, config.steps - 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, config.steps - 1 - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _tokenise(tokenizer: Any, texts: Sequence[str], config: GateTrainConfig, device: Any):
    encoded = tokenizer(list(texts), truncation=True, max_length=config.max_length)["input_ids"]
    return [torch.tensor(ids, dtype=torch.long, device=device) for ids in encoded]


def train_gates(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    config: GateTrainConfig,
    log: Callable[[str], Any],
    base_model: str | None = None,
) -> tuple[SeerGates, dict[str, Any]]:
    """Train fresh gates for the frozen `model` on `texts` (one text per step); returns the gates
    (their config records `base_model`, default the model's name or path) and the metrics
    (losses per step, which texts were held out, held-out top-k recall before and after
    training)."""
    began = time.monotonic()
    torch.manual_seed(config.seed)
    gates = _fresh_gates(model, config, base_model)
    gate_config = gates.config
    encoded = _tokenise(tokenizer, texts, config, next(model.parameters()).device)
    rng = random.Random(config.seed)
    usable, held = _split(encoded, config, rng)
    cache: dict[int, list[Teacher]] = {}

    def teacher(index: int) -> list[Teacher]:
        if index in cache:
            return cache[index]
        out = teacher_pass(model, usable[index][1], gate_config)
        if config.cache_teacher:
            cache[index] = out
        return out

    log(
        f"training {gate_config.num_layers} gates on {len(usable) - held} texts ({held} held "
        f"out, {len(encoded) - len(usable)} too short) for {config.steps} steps"
    )
    heldout = range(held)
    before = heldout_recall(gates, map(teacher, heldout), config.topk_blocks)
    losses = _optimize(gates, teacher, range(held, len(usable)), config, rng, log)
    after = heldout_recall(gates, map(teacher, heldout), config.topk_blocks)
    metrics = {
        "losses": losses,
        "steps": config.steps,
        "examples": len(usable) - held,
        "heldout_examples": held,
        "heldout_texts": [i for i, _ in usable[:held]],  # indices into texts
        "skipped_short": len(encoded) - len(usable),
        "topk_blocks": config.topk_blocks,
        "heldout_recall_before": before,
        "heldout_recall_after": after,
        "seconds": time.monotonic() - began,
        "gate_config": gate_config.to_dict(),
    }
    log(f"held-out top-{config.topk_blocks} recall {before} -> {after}")
    return gates, metrics


def _fresh_gates(model: Any, config: GateTrainConfig, base_model: str | None) -> SeerGates:
    """Untrained gates on the model's device, the model frozen in eval mode."""
    model.requires_grad_(False)
    model.eval()
    overrides = {"base_model": base_model} if base_model is not None else {}
    gate_config = GateConfig.for_model(
        model.config,
        block_size=config.block_size,
        gate_dim=config.gate_dim,
        qk_norm=config.qk_norm,
        **overrides,
    )
    return SeerGates(gate_config).to(next(model.parameters()).device)


def _split(
    encoded: list[torch.Tensor], config: GateTrainConfig, rng: random.Random
) -> tuple[list[tuple[int, torch.Tensor]], int]:
    """The texts long enough to have a target, as (index into texts, token ids) in a shuffled
    order, and how many of the first are held out."""
    usable = [(i, ids) for i, ids in enumerate(encoded) if ids.shape[0] > config.block_size]
    if not usable:
        raise ValueError(
            f"none of the {len(encoded)} texts is longer than one block ({config.block_size} "
            "tokens): there is nothing to distil"
        )
    rng.shuffle(usable)
    # At least one text is trained on, and one held out when the fraction asks for any.
    wanted = max(1, round(len(usable) * config.heldout_fraction)) if config.heldout_fraction else 0
    return usable, min(len(usable) - 1, wanted)


def _optimize(
    gates: SeerGates,
    teacher: Callable[[int], list[Teacher]],
    trained: range,
    config: GateTrainConfig,
    rng: random.Random,
    log: Callable[[str], Any],
) -> list[float]:
    """`config.steps` AdamW steps, one text of `trained` each, in shuffled passes; the losses."""
    optimizer = torch.optim.AdamW(gates.parameters(), lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config))
    order: list[int] = []
    losses = []
    every = max(1, config.steps // 20)
    for step in range(config.steps):
        if not order:
            order = list(trained)
            rng.shuffle(order)
        loss = sequence_loss(gates, teacher(order.pop()), config)
        optimizer.zero_grad()
        loss.backward()
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(gates.parameters(), config.max_grad_norm)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % every == 0 or step == config.steps - 1:
            log(f"step {step + 1}/{config.steps}: loss {losses[-1]:.4f}")
    return losses
