"""The trainable copy of a base model and the step tags added to it."""

from __future__ import annotations

import torch

from rstar_pipelines.llm.transformers_backend import load_model_and_tokenizer
from rstar_pipelines.math.steps import TAGS
from rstar_pipelines.training.base_models import add_tags, load_trainable


def test_embedded_gguf_becomes_a_savable_float32_model(embedded_tokenizer, tmp_path):
    model, tokenizer = load_trainable("embedded")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not hasattr(model.config, "quantization_config")
    # The weights the LLM layer generates with unquantized, in tensors of the model's own.
    served, _ = load_model_and_tokenizer("embedded", device="cpu", quantization="none")
    ours, theirs = model.state_dict(), served.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]) and tensor.data_ptr() != theirs[name].data_ptr()
    add_tags(model, tokenizer)
    assert len(tokenizer) == len(embedded_tokenizer) + len(TAGS)
    # The LLM layer's cached tokenizer, which generation uses, is not changed.
    assert not set(TAGS) & set(embedded_tokenizer.all_special_tokens)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()


def test_tags_are_added_once_and_embeddings_follow(tiny_base):
    model, tokenizer = load_trainable(tiny_base)
    add_tags(model, tokenizer)
    add_tags(model, tokenizer)
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)
    assert list(tokenizer.convert_tokens_to_ids(list(TAGS))) == list(
        range(len(tokenizer) - len(TAGS), len(tokenizer))
    )
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
