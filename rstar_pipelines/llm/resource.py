"""The Dagster resource that hands assets an LLM.

Every field left unset falls back, when the LLM is built, to an environment variable:
RSTAR_LLM_BACKEND (default "transformers"), RSTAR_LLM_MODEL (default "embedded"),
RSTAR_LLM_BASE_URL and RSTAR_LLM_API_KEY (openai backend). Reading them at use time, not at
import, lets one `Definitions` object serve a laptop and a GPU cluster.
"""

from __future__ import annotations

import os
from typing import Any

import dagster as dg
from pydantic import PrivateAttr

from . import LLM, load_llm


class LLMResource(dg.ConfigurableResource):
    """An LLM client for assets: `llm.get_llm().generate(prompts, params)`."""

    backend: str | None = None
    model: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    batch_size: int | None = None
    max_concurrency: int | None = None
    device: str | None = None
    dtype: str | None = None

    _clients: dict[tuple[str, str | None], LLM] = PrivateAttr(default_factory=dict)

    def _resolve(self, model: str | None) -> tuple[str, str | None]:
        backend = self.backend or os.environ.get("RSTAR_LLM_BACKEND", "transformers")
        model = model or self.model or os.environ.get("RSTAR_LLM_MODEL")
        if backend == "transformers":
            model = model or "embedded"
        return backend, model

    def model_id(self, model: str | None = None) -> str:
        """ "backend:model" for `model` as get_llm would resolve it, without loading it."""
        backend, resolved = self._resolve(model)
        return f"{backend}:{resolved or 'server-default'}"

    def model_name(self, model: str | None = None) -> str | None:
        """The model `model` resolves to (a role's model, else the resource's default)."""
        return self._resolve(model)[1]

    def get_llm(self, model: str | None = None) -> LLM:
        """The LLM for `model` (a role may use another model than the default), built once."""
        key = self._resolve(model)
        backend, model = key
        if key not in self._clients:
            self._clients[key] = load_llm(backend, model, **self._options(backend))
        return self._clients[key]

    def _options(self, backend: str) -> dict[str, Any]:
        if backend == "transformers":
            options = {"batch_size": self.batch_size, "device": self.device, "dtype": self.dtype}
        elif backend == "openai":
            options = {
                "base_url": self.base_url or os.environ.get("RSTAR_LLM_BASE_URL"),
                "api_key": self.api_key or os.environ.get("RSTAR_LLM_API_KEY"),
                "max_concurrency": self.max_concurrency,
            }
            if options["base_url"] is None:
                raise ValueError("the openai LLM backend needs base_url (or RSTAR_LLM_BASE_URL)")
        else:
            options = {"dtype": self.dtype}
        return {name: value for name, value in options.items() if value is not None}
