"""Prompt templates: Jinja files under assets/prompts/, named by the declared pipeline."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import jinja2

_ENV = jinja2.Environment(
    undefined=jinja2.StrictUndefined,  # a missing variable is a bug, not an empty string
    keep_trailing_newline=True,
    autoescape=False,
)


@functools.lru_cache(maxsize=256)
def _compiled(source: str) -> jinja2.Template:
    """A template's source compiled once: compiling costs far more than rendering, and a stage
    renders one template for each of its prompts."""
    return _ENV.from_string(source)


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    source: str

    @classmethod
    def load(cls, directory: Path, name: str) -> PromptTemplate:
        return cls(name=name, source=(directory / name).read_text(encoding="utf-8"))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    def render(self, **variables: object) -> str:
        try:
            return _compiled(self.source).render(**variables)
        except jinja2.UndefinedError as err:
            raise ValueError(f"prompt template {self.name}: {err.message}") from err
