"""GGUF files as Hugging Face directories, converted once per file and kept.

transformers reads a GGUF file by dequantizing every tensor with gguf-py and building the
tokenizer from the file's vocabulary: 20-60 s for the embedded model on two CPUs, paid again by
every process that loads it (the demo's trainer subprocesses, every test session).
`converted_dir(path)` pays it once: it writes what transformers made of the file (config,
generation config, float32 safetensors, tokenizer) to a directory in the model cache, which
later loads read in about a second. The tensors are the very ones transformers dequantized (a
float32 safetensors file round-trips them exactly).

The cache is `RSTAR_MODEL_CACHE` (default `~/.cache/rstar-pipelines/models`, under
`XDG_CACHE_HOME` where set), not the data directory: tests and demo runs each get a data
directory of their own, and a conversion is the same for all of them. An entry is named by the
file's sha256 and the transformers and gguf versions that converted it, so a changed file or an
upgrade that converts differently gets an entry of its own; it is written to a temporary
directory and renamed into place, so a present entry is a complete one, and two processes
converting at once both end with one entry.
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

MODEL_CACHE_ENV = "RSTAR_MODEL_CACHE"
WEIGHTS = "model.safetensors"


def model_cache_dir() -> Path:
    if os.environ.get(MODEL_CACHE_ENV):
        return Path(os.environ[MODEL_CACHE_ENV]).resolve()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rstar-pipelines" / "models"


def entry_name(gguf_file: Path) -> str:
    """The cache entry of a GGUF file: its name, its content hash, the converting versions."""
    converter = f"transformers{version('transformers')}-gguf{version('gguf')}"
    with gguf_file.open("rb") as f:
        content = hashlib.file_digest(f, "sha256").hexdigest()
    return f"{gguf_file.stem}-{content[:16]}-{converter}"


def converted_dir(gguf_file: str | Path) -> Path:
    """The Hugging Face directory of `gguf_file`, converting it on the first call."""
    gguf_file = Path(gguf_file).resolve()
    target = model_cache_dir() / entry_name(gguf_file)
    if (target / WEIGHTS).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert(gguf_file, staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / WEIGHTS).is_file():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def plain_config(model: Any) -> Any:
    """A copy of `model`'s config that loaders can build it from again: it names the
    architecture (servers pick the model class from it) and drops the GGUF quantization_config,
    which would make loaders look for a .gguf file."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _convert(gguf_file: Path, dest: Path) -> None:
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: its parts are written one by one.
    plain_config(model).save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    # save_model writes tied tensors (the LM head shares the embeddings) once.
    save_model(model, str(dest / WEIGHTS))
