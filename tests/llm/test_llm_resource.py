"""LLMResource: fields, environment fallbacks, cached clients."""

from __future__ import annotations

from contextlib import closing

import dagster as dg
import pytest

from rstar_pipelines.llm import SamplingParams
from rstar_pipelines.llm.openai_backend import OpenAILLM
from rstar_pipelines.llm.resource import LLMResource
from tests.fakes.llm import TRANSFORMERS

GREEDY = SamplingParams(temperature=0, max_tokens=4)
ENV = ("RSTAR_LLM_BACKEND", "RSTAR_LLM_MODEL", "RSTAR_LLM_BASE_URL", "RSTAR_LLM_API_KEY")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_defaults_to_the_embedded_model_in_process(embedded_llm):
    resource = LLMResource()
    llm = resource.get_llm()
    assert llm.name == f"{TRANSFORMERS}:embedded+int4"
    assert resource.get_llm() is llm


def test_environment_picks_a_server(monkeypatch, transformers_server):
    monkeypatch.setenv("RSTAR_LLM_BACKEND", "openai")
    monkeypatch.setenv("RSTAR_LLM_BASE_URL", transformers_server)
    resource = LLMResource(max_concurrency=2)
    assert resource.servers_table() is None  # nothing asked yet
    with closing(resource.get_llm()) as llm:
        assert isinstance(llm.wrapped, OpenAILLM) and llm.max_concurrency == 2
        [[completion]] = llm.generate(["The capital of France is"], GREEDY)
    assert completion.text.startswith(" Paris")
    # the stage metadata's table: the window (capped at 2), 1 request, 1 sequence, 0 retries
    assert f"| {transformers_server} | 2 | 1 | 1 | " in resource.servers_table()


def test_fields_win_over_environment_and_roles_get_their_own_model(monkeypatch):
    monkeypatch.setenv("RSTAR_LLM_BACKEND", "transformers")
    monkeypatch.setenv("RSTAR_LLM_MODEL", "env-model")
    resource = LLMResource(
        backend="openai", base_url="http://127.0.0.1:9/v1", api_key="k", model="policy"
    )
    with closing(resource.get_llm()) as policy, closing(resource.get_llm("reward")) as reward:
        assert isinstance(policy.wrapped, OpenAILLM) and policy.model == "policy"
        assert reward.model == "reward" and reward is not policy


def test_openai_backend_without_url_is_refused(monkeypatch):
    monkeypatch.setenv("RSTAR_LLM_BACKEND", "openai")
    with pytest.raises(ValueError, match="RSTAR_LLM_BASE_URL"):
        LLMResource().get_llm()


def test_assets_get_the_llm_through_dagster():
    @dg.asset
    def llm_name(llm: LLMResource) -> str:
        return llm.get_llm().name

    resource = LLMResource(backend="openai", base_url="http://127.0.0.1:9/v1", model="m")
    result = dg.materialize([llm_name], resources={"llm": resource})
    assert result.output_for_node("llm_name") == "openai:http://127.0.0.1:9/v1:m"


def test_server_lists_from_fields_and_environment(monkeypatch):
    resource = LLMResource(
        backend="openai", model="m", base_urls=["http://a:1/v1", "http://b:2/v1"]
    )
    with closing(resource.get_llm()) as llm:
        assert llm.base_urls == ["http://a:1/v1", "http://b:2/v1"]
    monkeypatch.setenv("RSTAR_LLM_BACKEND", "openai")
    monkeypatch.setenv("RSTAR_LLM_BASE_URL", "http://a:1/v1, http://b:2/v1")
    monkeypatch.setenv("RSTAR_LLM_N_PER_REQUEST", "false")
    with closing(LLMResource(model="m").get_llm()) as llm:
        assert llm.base_urls == ["http://a:1/v1", "http://b:2/v1"] and llm.n_per_request is False
    # The old failure: two URLs read as one with a garbled path. Now a clear error.
    monkeypatch.setenv("RSTAR_LLM_BASE_URL", "http://a:1/v1,b:2/v1")
    with pytest.raises(ValueError, match="RSTAR_LLM_BASE_URL: server 2 of 2, 'b:2/v1'"):
        LLMResource(model="m").get_llm()
    monkeypatch.setenv("RSTAR_LLM_N_PER_REQUEST", "sometimes")
    with pytest.raises(ValueError, match="RSTAR_LLM_N_PER_REQUEST"):
        LLMResource(model="m", base_url="http://a:1/v1").get_llm()


def test_sampling_vllm_refuses_is_refused_before_an_engine_starts():
    resource = LLMResource(backend="vllm", model="some/model")
    with pytest.raises(ValueError, match="temperature=2.5: vLLM accepts temperatures in"):
        resource.check_sampling(SamplingParams(temperature=2.5))
    with pytest.raises(ValueError, match="sampling.n=4 with temperature=0"):
        resource.check_sampling(SamplingParams(n=4, temperature=0))
    resource.check_sampling(SamplingParams(n=4, temperature=0.8))
    LLMResource().check_sampling(SamplingParams(n=4, temperature=0))  # transformers repeats it


def test_sparse_settings_with_a_server_point_at_rstar_serve(tmp_path):
    (tmp_path / "gate_config.json").write_text("{}")
    resource = LLMResource(
        backend="openai", base_url="http://a:1/v1", sparse_attention="seer",
        gate_checkpoint=str(tmp_path),
    )  # fmt: skip
    with pytest.raises(ValueError, match="rstar serve MODEL --gates DIR"):
        resource.get_llm()
