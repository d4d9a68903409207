import shutil
from pathlib import Path

import pytest
import yaml

from rstar_pipelines import settings
from rstar_pipelines.pipeline.spec import PipelineSpecError, load_pipeline
from rstar_pipelines.stages import STAGES

GOOD = yaml.safe_load(settings.pipeline_file().read_text())


def _load(tmp_path: Path, doc, prompts_dir: Path | None = None):
    path = tmp_path / "pipeline.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return load_pipeline(path, STAGES, prompts_dir or settings.prompts_dir())


def _edit(asset_key: str, **changes):
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    entry = next(a for a in doc["assets"] if a["key"] == asset_key)
    for field, value in changes.items():
        if value is None:
            entry.pop(field, None)
        else:
            entry[field] = value
    return doc


@pytest.mark.parametrize(
    "doc, key, field, message",
    [
        (
            _edit("seed_problems", stage="SeedSwallower"),
            "seed_problems",
            "stage",
            "unknown stage kind",
        ),
        (
            _edit("seed_catalog", upstream=["seed_problems", "nope"]),
            "seed_catalog",
            "upstream",
            "unknown upstream asset 'nope'",
        ),
        (
            _edit("seed_problems", params={"incoming_dir": 3}),
            "seed_problems",
            "params.incoming_dir",
            "valid string",
        ),
        (
            _edit("seed_problems", params={"incomming_dir": "x"}),
            "seed_problems",
            "params.incomming_dir",
            "Extra inputs are not permitted",
        ),
        (
            _edit("seed_problems", partitioning="hourly"),
            "seed_problems",
            "partitioning",
            "'seed_batches' or 'none'",
        ),
        (_edit("seed_catalog", group=None), "seed_catalog", "group", "Field required"),
        (_edit("seed_problems", outputs=None), "seed_problems", "outputs", "missing ['rejects']"),
        (_edit("seed_catalog", key="seed_rejects"), "seed_rejects", "key", "already produced"),
        (
            _edit("seed_catalog", prompts={"system": "nowhere.jinja"}),
            "seed_catalog",
            "prompts",
            "needs prompt templates for roles []",
        ),
        (_edit("seed_catalog", key="Seed-Catalog"), "Seed-Catalog", "key", "should match pattern"),
    ],
)
def test_bad_pipeline_names_file_asset_and_field(tmp_path, doc, key, field, message):
    with pytest.raises(PipelineSpecError) as err:
        _load(tmp_path, doc)
    text = str(err.value)
    assert text.startswith(str(tmp_path / "pipeline.yaml") + ": ")
    assert f"asset {key!r}" in text
    assert f"field {field!r}" in text
    assert message in text


def test_cycle_is_reported(tmp_path):
    doc = _edit("seed_problems", upstream=["seed_catalog"])
    with pytest.raises(
        PipelineSpecError, match="dependency cycle: .*seed_catalog -> seed_problems"
    ):
        _load(tmp_path, doc)


def test_unparsable_yaml_and_missing_file(tmp_path):
    with pytest.raises(PipelineSpecError, match="not valid YAML"):
        _load(tmp_path, "assets: [\n  - key: x\n   bad")
    with pytest.raises(PipelineSpecError, match="pipeline file not found"):
        load_pipeline(tmp_path / "missing.yaml", STAGES, settings.prompts_dir())


def test_code_version_follows_params_prompts_and_models(tmp_path):
    base = _load(tmp_path, GOOD)
    same = _load(tmp_path, GOOD)
    assert base.by_key["seed_problems"].code_version == same.by_key["seed_problems"].code_version

    changed = _load(tmp_path, _edit("seed_problems", params={"incoming_dir": "seeds/other"}))
    assert changed.by_key["seed_problems"].code_version != base.by_key["seed_problems"].code_version
    assert changed.by_key["seed_catalog"].code_version == base.by_key["seed_catalog"].code_version

    # A prompt template's text is part of the version of the assets that use it.
    prompts = tmp_path / "prompts"
    shutil.copytree(settings.prompts_dir(), prompts)
    v1 = _load(tmp_path, GOOD, prompts).by_key
    template = prompts / "solve_math.jinja"
    template.write_text(template.read_text() + "\nBe brief.\n")
    v2 = _load(tmp_path, GOOD, prompts).by_key
    assert v1["candidate_solutions"].code_version != v2["candidate_solutions"].code_version
    assert v1["synthesized_problems"].code_version == v2["synthesized_problems"].code_version
    assert "Be brief." in v2["candidate_solutions"].prompts["math"].render(problem="1+1?")
    with pytest.raises(ValueError, match="solve_math.jinja: 'problem' is undefined"):
        v2["candidate_solutions"].prompts["math"].render()

    # So is the model a role resolves to.
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    doc["models"]["solver"] = "Qwen/Qwen2.5-Math-7B-Instruct"
    v3, v0 = _load(tmp_path, doc).by_key, base.by_key
    assert v3["candidate_solutions"].model == "Qwen/Qwen2.5-Math-7B-Instruct"
    assert v3["candidate_solutions"].code_version != v0["candidate_solutions"].code_version
    assert v3["synthesized_problems"].code_version == v0["synthesized_problems"].code_version


def test_unknown_model_role(tmp_path):
    doc = _edit("candidate_solutions", params={"model": "oracle"})
    with pytest.raises(
        PipelineSpecError, match="field 'params.model': unknown model role 'oracle'"
    ):
        _load(tmp_path, doc)


def _rounds(rounds: int, **mcts_changes):
    doc = _edit("mcts_trajectories", **mcts_changes)
    doc["rounds"] = rounds
    return doc


def test_rounds_repeat_the_per_round_assets(tmp_path):
    spec = _load(tmp_path, _rounds(3))
    keys = [a.key for a in spec.assets]
    assert {"mcts_trajectories", "mcts_trajectories_r2", "mcts_trajectories_r3"} <= set(keys)
    assert {"ppm_checkpoint_r3", "policy_checkpoint_r2", "sft_dataset_r3"} <= set(keys)
    third = spec.by_key["mcts_trajectories_r3"]
    assert third.decl.outputs == {"nodes": "mcts_nodes_r3"}
    # Its own round's upstream by the round-1 name, round 2's checkpoints as previous_*.
    assert third.input_names == {
        "verified_outputs": "verified_outputs",
        "synthesized_problems": "synthesized_problems",
        "policy_checkpoint_r2": "previous_policy_checkpoint",
        "ppm_checkpoint_r2": "previous_ppm_checkpoint",
    }
    assert spec.by_key["ppm_pairs_r3"].input_names == {
        "mcts_nodes_r3": "mcts_nodes",
        "synthesized_problems": "synthesized_problems",
        "problem_groups": "problem_groups",
    }
    # later_rounds overrides params from round 2 on, nested mappings key by key.
    first, later = spec.by_key["mcts_trajectories"].params, third.params
    assert (first.round, first.prompt, first.search.errors_threshold) == (1, "bootstrap", 2)
    assert (later.round, later.prompt, later.search.errors_threshold) == (3, "policy", 1)
    assert later.search.rollouts == first.search.rollouts
    assert "<end_of_output>" not in later.search.stop
    assert spec.by_key["mcts_trajectories"].code_version != third.code_version


def test_bad_round_declarations(tmp_path):
    with pytest.raises(PipelineSpecError, match="'mcts_trajectories': field 'previous_round'"):
        _load(tmp_path, _rounds(2, previous_round=["verified_outputs"]))
    doc = _edit("seed_catalog", later_rounds={"x": 1})
    with pytest.raises(PipelineSpecError, match="'seed_catalog': field 'later_rounds'"):
        _load(tmp_path, doc)
    with pytest.raises(PipelineSpecError, match="field 'rounds'"):
        _load(tmp_path, _rounds(0))


def test_the_heldout_split_is_declared_once(tmp_path):
    text = settings.pipeline_file().read_text()
    spec = _load(tmp_path, text)
    split = spec.by_key["mcts_eval"].params.heldout
    assert split == spec.by_key["sft_dataset"].params.heldout
    assert split == spec.by_key["grpo_eval"].params.heldout
    other = _load(tmp_path, text.replace("salt: rstar-heldout-1", "salt: another-draw"))
    assert other.by_key["mcts_eval"].params.heldout.salt == "another-draw"
    # The split is part of every reader's code version: a new draw marks them stale.
    assert other.by_key["mcts_eval"].code_version != spec.by_key["mcts_eval"].code_version
    assert (
        other.by_key["candidate_solutions"].code_version
        == spec.by_key["candidate_solutions"].code_version
    )
    own = text.replace("      top_answers: 4", "      top_answers: 4\n      heldout_fraction: 0.5")
    with pytest.raises(
        PipelineSpecError, match="mcts_eval.*params.heldout_fraction.*declared once"
    ):
        _load(tmp_path, own)
    with pytest.raises(PipelineSpecError, match="heldout.fraction"):
        _load(tmp_path, text.replace("fraction: 0.2", "fraction: 1.5"))


@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("changed", ["base_policy_eval", "dser_eval", "attn_gate_eval"])
def test_the_evaluations_a_comparison_pairs_declare_one_max_problems(tmp_path, rounds, changed):
    """eval_comparison pairs its evaluations over the problems all of them evaluated: one of
    them declared smaller would shrink every row to its problems."""
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    doc["rounds"] = rounds
    assert _load(tmp_path, doc).by_key["eval_comparison"]  # the declared pipeline agrees
    entry = next(a for a in doc["assets"] if a["key"] == changed)
    entry["params"]["max_problems"] = None
    with pytest.raises(PipelineSpecError) as err:
        _load(tmp_path, doc)
    assert "asset 'eval_comparison'" in str(err.value) and f"{changed} null" in str(err.value)
