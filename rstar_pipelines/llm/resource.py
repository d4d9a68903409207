"""The Dagster resource that hands assets an LLM.

Every field left unset falls back, when the LLM is built, to an environment variable:
RSTAR_LLM_BACKEND (default "transformers"), RSTAR_LLM_MODEL (default "embedded"),
RSTAR_LLM_BATCH_SIZE (transformers backend: prompts per generate call, each batch's completions
committed together), RSTAR_LLM_CPU_SPEEDUPS (transformers backend: on or off, the switch of the
CPU speed-ups, package `cpu`), RSTAR_LLM_QUANTIZATION (transformers backend: int4, int8 or none),
RSTAR_LLM_BASE_URL (one server or several separated by commas), RSTAR_LLM_API_KEY and
RSTAR_LLM_N_PER_REQUEST (openai backend), RSTAR_SPARSE_ATTENTION and RSTAR_GATE_CHECKPOINT
(SeerAttention-R sparse decoding, transformers and vllm backends; a sparse server for the openai
backend is started with `rstar serve`).
Reading them at use time, not at import, lets one `Definitions` object serve a laptop and a GPU
cluster.
The CPU speed-ups' switch, quantization and sparse settings are part of `model_id`, so
completions cached from float32 weights are not reused for quantized ones (nor int8 ones for
int4, nor the plain path's for the speed-ups'), nor those of dense decoding for sparse decoding
(or across budgets or gates); so is the transformers backend's revision, so that neither are
those its older code computed.
"""

from __future__ import annotations

import os
from typing import Any

import dagster as dg
from pydantic import PrivateAttr

from . import (
    LLM,
    SamplingParams,
    load_llm,
    transformers_model_id,
    transformers_quantization,
)
from . import cpu_speedups as speedups_setting
from .counting import CountingLLM
from .devices import default_device
from .sparse import SeerSettings


class LLMResource(dg.ConfigurableResource):
    """An LLM client for assets: `llm.get_llm().generate(prompts, params)`."""

    backend: str | None = None
    model: str | None = None
    # openai backend: one server (or several, comma-separated) in base_url, or a list of them.
    base_url: str | None = None
    base_urls: list[str] | None = None
    api_key: str | None = None
    batch_size: int | None = None
    # openai backend: sequences in flight per server at most (default: no cap, each server's
    # window finds its capacity), and whether a server honours `n` (default: detected).
    max_concurrency: int | None = None
    n_per_request: bool | None = None
    device: str | None = None
    dtype: str | None = None
    # The transformers backend's CPU speed-ups (package `cpu`): unset, on unless
    # RSTAR_LLM_CPU_SPEEDUPS says off; off, transformers' plain generate() on unquantized weights.
    cpu_speedups: bool | None = None
    # Weights of the transformers backend, one of the CPU speed-ups: "none", "int8" (linear
    # layers as int8, on the CPU) or "int4" (decoder layers with 4-bit weights, the LM head
    # int8); unset: int4 on a CPU for the embedded model and checkpoints trained from it, else
    # none.
    quantization: str | None = None
    # SeerAttention-R sparse decoding (transformers and vllm backends): sparse_attention="seer"
    # with the trained gates in gate_checkpoint; token_budget (default 4096) or sparse_threshold.
    sparse_attention: str | None = None
    gate_checkpoint: str | None = None
    token_budget: int | None = None
    sparse_threshold: float | None = None

    _clients: dict[tuple[str, str | None], LLM] = PrivateAttr(default_factory=dict)

    def _resolve(self, model: str | None) -> tuple[str, str | None]:
        backend = self.backend or os.environ.get("RSTAR_LLM_BACKEND", "transformers")
        model = model or self.model or os.environ.get("RSTAR_LLM_MODEL")
        if backend == "transformers":
            model = model or "embedded"
        return backend, model

    def model_id(self, model: str | None = None) -> str:
        """ "backend:model" (and the settings that change its completions: see the module
        docstring) for `model` as get_llm would resolve it, without loading it."""
        backend, resolved = self._resolve(model)
        seer = self._seer(backend)
        if backend == "transformers":
            quantization = self._quantization(backend, resolved)
            return transformers_model_id(resolved, quantization, seer, self._speedups())
        return f"{backend}:{resolved or 'server-default'}" + (seer.tag if seer else "")

    def model_name(self, model: str | None = None) -> str | None:
        """The model `model` resolves to (a role's model, else the resource's default)."""
        return self._resolve(model)[1]

    def get_llm(self, model: str | None = None) -> LLM:
        """The LLM for `model` (a role may use another model than the default), built once."""
        key = self._resolve(model)
        backend, model = key
        if key not in self._clients:
            llm = load_llm(backend, model, **self._options(backend, model))
            # Completions and tokens go to the running step's progress (progress.py).
            self._clients[key] = CountingLLM(llm)
        return self._clients[key]

    def servers_table(self) -> str | None:
        """Markdown: per server of the openai backend's fleets built here, the window it settled
        at, requests, sequences, tokens/s and retries; None when no fleet was used."""
        stats = {}
        for client in self._clients.values():
            report = getattr(client, "server_stats", None)
            stats.update(report() if report else {})
        if not any(s["requests"] or s["retries"] for s in stats.values()):
            return None
        lines = ["| server | window | requests | sequences | tokens/s | retries |",
                 "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {url} | {s['window']} | {s['requests']} | {s['sequences']} | "
            f"{s['tokens_per_s']:.1f} | {s['retries']} |"
            for url, s in stats.items()
        ]
        return "\n".join(lines)

    def check_sampling(self, params: SamplingParams, model: str | None = None) -> None:
        """Refuse, before any engine starts, sampling settings the backend of `model` would
        refuse (vLLM's limits for the vllm backend)."""
        if self._resolve(model)[0] == "vllm":
            from .vllm_backend import check_vllm_sampling

            check_vllm_sampling(params)

    def _seer(self, backend: str) -> SeerSettings | None:
        """The sparse decoding settings (env fallbacks included), None for dense decoding."""
        seer = SeerSettings.from_options(
            self.sparse_attention or os.environ.get("RSTAR_SPARSE_ATTENTION") or None,
            self.gate_checkpoint or os.environ.get("RSTAR_GATE_CHECKPOINT") or None,
            self.token_budget,
            self.sparse_threshold,
        )
        if seer is not None and backend == "openai":
            raise ValueError(
                "sparse_attention='seer' runs in-process (transformers or vllm backend); an "
                "openai server chooses its own attention: start a sparse vLLM server with "
                "`rstar serve MODEL --gates DIR` and use the RSTAR_LLM_* settings it prints"
            )
        return seer

    def _quantization(self, backend: str, model: str | None) -> str | None:
        """The transformers backend's quantization for `model` (env fallback and default
        included); None for the other backends, which refuse the setting."""
        setting = self.quantization or os.environ.get("RSTAR_LLM_QUANTIZATION") or None
        if backend != "transformers":
            if setting not in (None, "none"):
                raise ValueError(
                    f"quantization={setting!r} is a setting of the transformers backend; the "
                    f"{backend} backend's server or engine chooses its own weights"
                )
            return None
        return transformers_quantization(
            setting, model, default_device(self.device), self._speedups()
        )

    def _speedups(self) -> bool:
        """Whether the transformers backend runs with the CPU speed-ups (env fallback
        included)."""
        return speedups_setting(self.cpu_speedups)

    def _options(self, backend: str, model: str | None) -> dict[str, Any]:
        seer = self._seer(backend)
        quantization = self._quantization(backend, model)
        if backend == "transformers":
            batch_size = self.batch_size or os.environ.get("RSTAR_LLM_BATCH_SIZE")
            options = {
                "cpu_speedups": self._speedups(),
                "batch_size": int(batch_size) if batch_size else None,
                "device": self.device,
                "dtype": self.dtype,
                "quantization": quantization,
            }
        elif backend == "openai":
            options = {
                "base_url": self._base_urls(),
                "api_key": self.api_key or os.environ.get("RSTAR_LLM_API_KEY"),
                "max_concurrency": self.max_concurrency,
                "n_per_request": self._n_per_request(),
            }
        else:
            options = {"dtype": self.dtype}
        if seer is not None:
            options.update(
                sparse_attention="seer",
                gate_checkpoint=seer.gate_checkpoint,
                token_budget=seer.token_budget,
                sparse_threshold=seer.threshold,
            )
        return {name: value for name, value in options.items() if value is not None}

    def _base_urls(self) -> list[str]:
        from .openai_backend import parse_base_urls

        given = [(name, value) for name, value in (("base_url", self.base_url),
                 ("base_urls", self.base_urls)) if value]  # fmt: skip
        if not given and os.environ.get("RSTAR_LLM_BASE_URL"):
            given = [("RSTAR_LLM_BASE_URL", os.environ["RSTAR_LLM_BASE_URL"])]
        if not given:
            raise ValueError(
                "the openai LLM backend needs base_url or base_urls (or RSTAR_LLM_BASE_URL)"
            )
        return [url for name, value in given for url in parse_base_urls(value, name)]

    def _n_per_request(self) -> bool | None:
        if self.n_per_request is not None:
            return self.n_per_request
        value = os.environ.get("RSTAR_LLM_N_PER_REQUEST", "").strip().lower()
        if value in ("", "auto"):
            return None
        if value not in ("1", "true", "yes", "0", "false", "no"):
            raise ValueError(f"RSTAR_LLM_N_PER_REQUEST must be true, false or auto, not {value!r}")
        return value in ("1", "true", "yes")
