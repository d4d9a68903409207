"""The verification chain through Dagster with a scripted model, so the right answer is
known: oracle labels override a wrong majority, a 7-of-10 majority labels a synthesized
problem, a 5-of-10 split is rejected, math answers are voted on with math-verify, and a
second materialization reuses every cached item."""

import dagster as dg
import pytest

from rstar_pipelines.definitions import build_definitions
from rstar_pipelines.sandbox_resource import SandboxResource
from rstar_pipelines.storage import query
from tests.fakes.coder import CHAIN, CODER, scripted_spec, write_seeds
from tests.fakes.llm import ScriptedLLMResource


@pytest.fixture
def chain_defs(tmp_path, monkeypatch, incoming):
    write_seeds(incoming, "t")
    defs = build_definitions(scripted_spec())
    resources = {
        **defs.resources,
        "llm": ScriptedLLMResource.serving(CODER, key="coder"),
        "sandbox": SandboxResource(backend="process", workers=2),
    }
    return defs, resources


def _materialize(defs, resources, instance):
    return dg.materialize(
        list(defs.assets),
        selection=CHAIN,
        partition_key="t",
        instance=instance,
        resources=resources,
    )


@pytest.mark.slow
def test_chain_labels_and_caches(chain_defs, monkeypatch):
    defs, resources = chain_defs
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("seed_batches", ["t"])
        first = _materialize(defs, resources, instance)
        assert first.success
        checks = {e.check_name: e.passed for e in first.get_asset_check_evaluations()}
        assert checks == {"has_inputs_and_labels": True, "labels_deterministic": True}

        outcomes = {
            r["problem"]: r
            for r in query(
                "select p.problem, v.* from verified_outputs v "
                "join synthesized_problems p on p.id = v.problem_id"
            ).to_pylist()
        }
        seed = outcomes["Given n integers, print their sum."]
        assert seed["verified"] and seed["label_source"] == "oracle"
        assert [c["candidate_index"] for c in seed["candidates"] if c["agrees"]] == [7, 8, 9]
        assert seed["labels"][0] == "6"  # the example comes first
        squares = next(r for p, r in outcomes.items() if "squares" in p)
        assert squares["verified"] and squares["label_source"] == "majority"
        assert squares["agreement"] == pytest.approx(0.7)
        assert len(squares["inputs"]) >= 50 and squares["labels"][0] == "5"
        math_seed = outcomes["What is 2 + 3?"]
        assert math_seed["label_source"] == "given" and math_seed["agreement"] == pytest.approx(0.4)
        math_new = outcomes["What is 3 + 4?"]
        assert math_new["verified"] and math_new["answer"] in ("7", "7.0", "\\frac{14}{2}")
        assert math_new["agreement"] == pytest.approx(0.7)

        solutions = query("select domain, verification_info from verified_solutions").to_pylist()
        assert len(solutions) == 3 + 7 + 4 + 7
        code_info = next(s["verification_info"] for s in solutions if s["domain"] == "code")
        assert (
            code_info["language"] == "python"
            and code_info["test_cases"][0]["type"] == "stdin_stdout"
        )

        before = CODER.prompts
        second = _materialize(defs, resources, instance)
        assert second.success
        assert CODER.prompts == before  # every completion came from the item cache
        for event in second.get_asset_materialization_events():
            md = event.materialization.metadata
            if "cache_hit_rate" in md:
                assert md["cache_hit_rate"].value == 1.0, event.asset_key

        # A new version of one stage kind redoes that stage's items, and only those: the
        # candidates are generated again (the same, so everything after them still hits).
        from rstar_pipelines.coder.generation_stages import CandidateSolutions

        monkeypatch.setattr(CandidateSolutions, "version", CandidateSolutions.version + "-next")
        third = _materialize(defs, resources, instance)
        assert third.success
        assert CODER.prompts == before + 4  # the four problems' candidates, once each
        rates = {
            event.asset_key.path[-1]: event.materialization.metadata["cache_hit_rate"].value
            for event in third.get_asset_materialization_events()
            if "cache_hit_rate" in event.materialization.metadata
        }
        assert rates.pop("candidate_solutions") == 0.0
        assert rates and set(rates.values()) == {1.0}
