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


def test_code_version_follows_params_and_prompts(tmp_path, monkeypatch):
    base = _load(tmp_path, GOOD)
    same = _load(tmp_path, GOOD)
    assert base.by_key["seed_problems"].code_version == same.by_key["seed_problems"].code_version

    changed = _load(tmp_path, _edit("seed_problems", params={"incoming_dir": "seeds/other"}))
    assert changed.by_key["seed_problems"].code_version != base.by_key["seed_problems"].code_version
    assert changed.by_key["seed_catalog"].code_version == base.by_key["seed_catalog"].code_version

    # A prompt template's text is part of the version of every asset that uses it.
    class Prompted(STAGES["SeedCatalog"]):
        prompt_roles = ("system",)

    monkeypatch.setitem(STAGES, "Prompted", Prompted)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "sys.jinja").write_text("You are {{ role }}.")
    doc = _edit("seed_catalog", stage="Prompted", prompts={"system": "sys.jinja"})
    v1 = _load(tmp_path, doc, prompts).by_key["seed_catalog"]
    assert v1.prompts["system"].render(role="a solver") == "You are a solver."
    (prompts / "sys.jinja").write_text("You are {{ role }}!")
    v2 = _load(tmp_path, doc, prompts).by_key["seed_catalog"]
    assert v1.code_version != v2.code_version
    with pytest.raises(ValueError, match="sys.jinja: 'role' is undefined"):
        v2.prompts["system"].render()
