"""GGUF files converted once into the model cache: the same model and tokenizer as reading the
file, one conversion per file content, complete entries only."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rstar_pipelines.llm import embedded_model_path, gguf
from rstar_pipelines.llm.types import render_chat

TEXTS = ["The capital of France is", "ab 😀 <|im_end|> 12*7 = 84\n\n  done", "\tdef f(x):\n"]


def test_the_converted_directory_is_the_gguf_files_model_and_tokenizer():
    path = embedded_model_path()
    directory = gguf.converted_dir(path)
    assert gguf.converted_dir(path) == directory  # converted once, then found
    source, name = str(path.parent), path.name
    with torch.inference_mode():
        direct = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
        cached = AutoModelForCausalLM.from_pretrained(directory)
    want, got = direct.state_dict(), cached.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert cached.generation_config.to_dict() == direct.generation_config.to_dict()
    direct_tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    cached_tokenizer = AutoTokenizer.from_pretrained(directory)
    chat = [{"role": "user", "content": "Say hi."}]
    assert render_chat(cached_tokenizer, chat) == render_chat(direct_tokenizer, chat)
    for text in TEXTS:
        ids = direct_tokenizer(text)["input_ids"]
        assert cached_tokenizer(text)["input_ids"] == ids
        assert cached_tokenizer.decode(ids) == direct_tokenizer.decode(ids)
    assert cached_tokenizer.eos_token_id == direct_tokenizer.eos_token_id
    assert cached_tokenizer.pad_token_id == direct_tokenizer.pad_token_id


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """A model cache of its own and a stand-in conversion that records its calls."""
    monkeypatch.setenv(gguf.MODEL_CACHE_ENV, str(tmp_path / "cache"))
    calls = []

    def convert(gguf_file, dest):
        calls.append(gguf_file)
        (dest / gguf.WEIGHTS).write_bytes(gguf_file.read_bytes())

    monkeypatch.setattr(gguf, "_convert", convert)
    return calls


def test_one_conversion_per_file_content(tmp_path, fake_conversion):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"first")
    first = gguf.converted_dir(model)
    assert gguf.converted_dir(model) == first and len(fake_conversion) == 1
    assert first.name.startswith("model-") and "transformers" in first.name
    model.write_bytes(b"second")
    second = gguf.converted_dir(model)
    assert second != first and len(fake_conversion) == 2
    assert (second / gguf.WEIGHTS).read_bytes() == b"second"
    assert sorted(p.name for p in first.parent.iterdir()) == sorted([first.name, second.name])


def test_a_failed_conversion_leaves_nothing(tmp_path, monkeypatch, fake_conversion):
    def broken(gguf_file, dest):
        (dest / "config.json").write_text("{}")
        raise RuntimeError("out of disk")

    monkeypatch.setattr(gguf, "_convert", broken)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    with pytest.raises(RuntimeError, match="out of disk"):
        gguf.converted_dir(model)
    assert list(gguf.model_cache_dir().iterdir()) == []


def test_another_process_finishing_first_wins(tmp_path, monkeypatch, fake_conversion):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    target = gguf.model_cache_dir() / gguf.entry_name(model)

    def racing(gguf_file, dest):
        target.mkdir(parents=True)
        (target / gguf.WEIGHTS).write_bytes(b"theirs")
        (dest / gguf.WEIGHTS).write_bytes(b"ours")

    monkeypatch.setattr(gguf, "_convert", racing)
    assert gguf.converted_dir(model) == target
    assert (target / gguf.WEIGHTS).read_bytes() == b"theirs"
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no staging left
