"""The model a training job starts from: a trainable float32 copy with the step tags added."""

from __future__ import annotations

from typing import Any

from rstar_pipelines.math.steps import TAGS


def load_trainable(model: str) -> tuple[Any, Any]:
    """A float32 causal LM that can be trained and `save_pretrained`-ed, and its tokenizer.

    `model` is "embedded", a .gguf path or a Hugging Face directory (or hub id). A GGUF model is
    read from its converted directory in the model cache (`llm.gguf.converted_dir`: the float32
    weights transformers dequantized, which the LLM layer's loader reads too), as a model of its
    own: the loader's copy serves generation, and training must not change it. (Copying the
    loader's model instead cost a training job about 5 s: a load, then a randomly initialized
    model for the copy.)
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model == "embedded" or model.endswith(".gguf"):
        from rstar_pipelines.llm.embedded import embedded_model_path
        from rstar_pipelines.llm.gguf import converted_dir

        model = str(converted_dir(embedded_model_path() if model == "embedded" else model))
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return loaded, AutoTokenizer.from_pretrained(model)


def add_tags(model: Any, tokenizer: Any) -> None:
    """Make the code-augmented CoT tags (`TAGS`) special tokens, as the reference trains with.

    Each tag becomes one id that is never split, so a step boundary is one token to predict (and one
    stop token to match). Embeddings grow only when the tokenizer outgrows them: many checkpoints
    have spare rows. Also gives the tokenizer a pad token (EOS when it has none) and sets the
    model's `pad_token_id`, which batched training and sequence classification need.
    """
    missing = [tag for tag in TAGS if tag not in tokenizer.all_special_tokens]
    if missing:
        tokenizer.add_special_tokens(
            {"extra_special_tokens": missing}, replace_extra_special_tokens=False
        )
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
