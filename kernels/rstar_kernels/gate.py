"""The SeerAttention-R attention gate (docs/seer-attention.md): one small module per attention
layer that scores key blocks from the layer's pre-RoPE queries and block-pooled pre-RoPE keys.

Shapes: B batch, H_q query heads, H_kv KV heads, g = H_q / H_kv, D head dim, T query tokens,
L key tokens, N key blocks, d = gate_dim.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

FAMILIES = ("llama", "qwen2", "qwen3")
CONFIG_FILE = "gate_config.json"
WEIGHTS_FILE = "gate_weights.safetensors"
# Weight-only RMSNorm of the reference gate.
NORM_EPS = 1e-6


def model_family(model_or_config: Any) -> str:
    """The gate family of a transformers model or config (its `model_type`); others are refused
    because where their pre-RoPE q/k live is not known here."""
    config = getattr(model_or_config, "config", model_or_config)
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(
            f"SeerAttention gates support the model types {', '.join(FAMILIES)}; "
            f"this model's model_type is {family!r}"
        )
    return family


def _rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling parameters (None for plain RoPE) of a transformers config,
    from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (older configs). The
    scaling parameters also record the model's max_position_embeddings, which some scaling
    types (dynamic, longrope) read."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", None)
    if theta is None:
        raise ValueError("the model config names no rope_theta")
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    params["rope_type"] = rope_type
    params.pop("type", None)
    params.setdefault("max_position_embeddings", config.max_position_embeddings)
    return float(theta), params


@dataclass
class GateConfig:
    """Everything needed to rebuild the gates of one model; `gate_config.json` holds it."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    block_size: int = 64
    gate_dim: int = 128
    qk_norm: bool = True
    base_model: str | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, not {self.family!r}")
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.gate_dim < 2 or self.gate_dim % 2:
            raise ValueError(f"gate_dim must be even (RoPE rotates pairs), not {self.gate_dim}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def for_model(cls, model_config: Any, **overrides: Any) -> GateConfig:
        """The config for a transformers model config; `overrides` set block_size, gate_dim,
        qk_norm, base_model (default: the config's name or path)."""
        theta, scaling = _rope_settings(model_config)
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        values = {
            "family": model_family(model_config),
            "num_layers": model_config.num_hidden_layers,
            "num_heads": heads,
            "num_kv_heads": getattr(model_config, "num_key_value_heads", None) or heads,
            "head_dim": head_dim,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "base_model": getattr(model_config, "_name_or_path", None) or None,
        }
        unknown = set(overrides) - {"block_size", "gate_dim", "qk_norm", "base_model"}
        if unknown:
            raise TypeError(f"GateConfig.for_model got unknown overrides: {sorted(unknown)}")
        return cls(**{**values, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def gate_parameter_count(
    num_heads: int, num_kv_heads: int, head_dim: int, gate_dim: int, qk_norm: bool
) -> int:
    """Parameters of one layer's gate (docs/seer-attention.md): the grouped query projection, the
    key projection of the max/min/mean-pooled keys and the two norms' weights."""
    group = num_heads // num_kv_heads
    q_proj = num_kv_heads * group * head_dim * gate_dim
    k_proj = num_kv_heads * 3 * head_dim * gate_dim
    return q_proj + k_proj + (2 * gate_dim if qk_norm else 0)


def _gate_inv_freq(config: GateConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (and the cos/sin scaling) of RoPE over gate_dim dims with the base
    model's theta and scaling, computed by transformers' own RoPE init functions."""
    d = config.gate_dim
    if config.rope_scaling is None:
        return 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(config.rope_scaling)
    max_positions = scaling.pop("max_position_embeddings")
    rope_type = scaling["rope_type"]
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r} in the gate's rope_scaling")
    # A stand-in config whose head is the gate's: the init functions read dims from it.
    stand_in = LlamaConfig(
        hidden_size=d,
        num_attention_heads=1,
        head_dim=d,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_theta": config.rope_theta, **scaling},
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](stand_in)
    return inv_freq.float(), float(attention_scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class AttnGate(nn.Module):
    """The gate of one attention layer (`Qproj` + `Kmaxminavg`, docs/seer-attention.md)."""

    def __init__(self, config: GateConfig):
        super().__init__()
        self.config = config
        c = config
        q_features = c.group_size * c.head_dim
        self.q_weight = nn.Parameter(torch.empty(c.num_kv_heads, q_features, c.gate_dim))
        self.k_weight = nn.Parameter(torch.empty(c.num_kv_heads, 3 * c.head_dim, c.gate_dim))
        self.q_norm = nn.RMSNorm(c.gate_dim, eps=NORM_EPS) if c.qk_norm else None
        self.k_norm = nn.RMSNorm(c.gate_dim, eps=NORM_EPS) if c.qk_norm else None
        inv_freq, self.rope_scale = _gate_inv_freq(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for weight in (self.q_weight, self.k_weight):
            for head in weight.data:  # per head: fan-in and fan-out of one projection
                nn.init.xavier_uniform_(head)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE (rotate_half form, as Llama) of `x [B, H, T, d]` at `positions [B, T]`."""
        freqs = positions[..., None].to(torch.float32) * self.inv_freq.to(x.device)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        cos = (angles.cos() * self.rope_scale).to(x.dtype)
        sin = (angles.sin() * self.rope_scale).to(x.dtype)
        return x * cos + rotate_half(x) * sin

    def query(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Gate queries `[B, H_kv, T, d]` from pre-RoPE `q [B, H_q, T, D]`: each KV head's group
        of query heads is concatenated (head-major) and projected, normed, rotated."""
        c = self.config
        b, h_q, t, d = q.shape
        if (h_q, d) != (c.num_heads, c.head_dim):
            raise ValueError(
                f"q has {h_q} heads of dim {d}; the gate expects {c.num_heads} of {c.head_dim}"
            )
        grouped = q.to(self.q_weight.dtype).view(b, c.num_kv_heads, c.group_size, t, d)
        grouped = grouped.permute(0, 1, 3, 2, 4).reshape(b, c.num_kv_heads, t, c.group_size * d)
        gq = torch.einsum("bhtf,hfe->bhte", grouped, self.q_weight)
        if self.q_norm is not None:
            gq = self.q_norm(gq)
        return self.rotate(gq, positions)

    def pool(self, k: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Max, min and mean of pre-RoPE `k [B, H_kv, L, D]` over each block's valid tokens
        (`valid [B, L]` bool, default all) -> `[B, H_kv, N, 3D]`, N = ceil(L / block_size). A
        block without valid tokens pools to zeros."""
        bs = self.config.block_size
        b, h, length, d = k.shape
        if valid is None:
            valid = torch.ones(b, length, dtype=torch.bool, device=k.device)
        if valid.shape != (b, length):
            raise ValueError(f"valid has shape {tuple(valid.shape)}; expected {(b, length)}")
        n = -(-length // bs)
        pad = n * bs - length
        k = nn.functional.pad(k.to(self.k_weight.dtype), (0, 0, 0, pad))
        mask = nn.functional.pad(valid, (0, pad), value=False)
        blocks = k.view(b, h, n, bs, d)
        mask = mask.view(b, 1, n, bs, 1)
        count = mask.sum(dim=3)
        high = blocks.masked_fill(~mask, -math.inf).amax(dim=3)
        low = blocks.masked_fill(~mask, math.inf).amin(dim=3)
        mean = (blocks * mask).sum(dim=3) / count.clamp(min=1)
        empty = count == 0
        return torch.cat((high.masked_fill(empty, 0), low.masked_fill(empty, 0), mean), dim=-1)

    def keys(self, pooled: torch.Tensor, block_positions: torch.Tensor) -> torch.Tensor:
        """Gate keys `[B, H_kv, N, d]` from `pool`'s output, rotated at `block_positions [B, N]`
        (each block's first token, as in the paper)."""
        gk = torch.einsum("bhnf,hfe->bhne", pooled.to(self.k_weight.dtype), self.k_weight)
        if self.k_norm is not None:
            gk = self.k_norm(gk)
        return self.rotate(gk, block_positions)

    def logits(
        self, gq: torch.Tensor, gk: torch.Tensor, block_valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Block scores `[B, H_kv, T, N]`; blocks with `block_valid [B, N]` False get -inf."""
        scores = gq @ gk.transpose(-1, -2) / math.sqrt(self.config.gate_dim)
        if block_valid is not None:
            scores = scores.masked_fill(~block_valid[:, None, None, :], -math.inf)
        return scores


class SeerGates(nn.ModuleList):
    """One `AttnGate` per layer of the base model, saved as config JSON + safetensors."""

    def __init__(self, config: GateConfig):
        super().__init__(AttnGate(config) for _ in range(config.num_layers))
        self.config = config

    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        weights = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(weights, str(path / WEIGHTS_FILE))
        return path

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device | None = None) -> SeerGates:
        from safetensors.torch import load_file

        path = Path(directory)
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{path} holds no {name}: not a saved SeerGates directory")
        gates = cls(GateConfig(**json.loads((path / CONFIG_FILE).read_text())))
        gates.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
        return gates if device is None else gates.to(device)


def decoder_layers(model: Any) -> Any:
    """The decoder layers of a llama/qwen2/qwen3 causal LM (or of its inner base model)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers")
    return layers


@contextmanager
def capture_pre_rope(model: Any) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Record every layer's pre-RoPE q `[B, H_q, T, D]` and k `[B, H_kv, T, D]` during the
    forward passes inside the block: outputs of q_proj/k_proj (llama, qwen2) or of
    q_norm/k_norm (qwen3, whose pre-RoPE q/k are normed per head). Each layer's dict holds the
    latest forward's tensors."""
    family = model_family(model)
    config = GateConfig.for_model(model.config)
    captured: list[dict[str, torch.Tensor]] = [{} for _ in range(config.num_layers)]
    handles = []

    def hook(store: dict[str, torch.Tensor], name: str):
        def record(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            # [B, T, H*D] (projection) or [B, T, H, D] (qwen3 norm) -> [B, H, T, D]
            store[name] = output.view(*output.shape[:2], -1, config.head_dim).transpose(1, 2)

        return record

    try:
        for store, layer in zip(captured, decoder_layers(model), strict=True):
            attn = layer.self_attn
            q_mod, k_mod = (
                (attn.q_norm, attn.k_norm) if family == "qwen3" else (attn.q_proj, attn.k_proj)
            )
            handles.append(q_mod.register_forward_hook(hook(store, "q")))
            handles.append(k_mod.register_forward_hook(hook(store, "k")))
        yield captured
    finally:
        for handle in handles:
            handle.remove()
