"""The verification chain through Dagster with a scripted model, so the right answer is
known: oracle labels override a wrong majority, a 7-of-10 majority labels a synthesized
problem, a 5-of-10 split is rejected, math answers are voted on with math-verify, and a
second materialization reuses every cached item."""

import json

import dagster as dg
import pytest

from rstar_pipelines.definitions import build_definitions, load_spec
from rstar_pipelines.llm import Completion
from rstar_pipelines.llm.resource import LLMResource
from rstar_pipelines.sandbox_resource import SandboxResource
from rstar_pipelines.storage import query

SUM = "n = int(input())\nprint(sum(map(int, input().split())))\n"
SUM_ALT = "import sys\nd = sys.stdin.read().split()\nprint(sum(int(x) for x in d[1:]))\n"
WRONG_MAX = "n = int(input())\nprint(max(map(int, input().split())))\n"
SQUARES = "n = int(input())\nprint(sum(int(x) ** 2 for x in input().split()))\n"
WRONG_CUBES = "n = int(input())\nprint(sum(int(x) ** 3 for x in input().split()))\n"

SEEDS = [
    {
        "domain": "code",
        "problem": "Given n integers, print their sum.",
        "oracle_solutions": [SUM],
        "examples": [{"stdin": "3\n1 2 3\n", "stdout": "6\n"}],
    },
    {"domain": "math", "problem": "What is 2 + 3?", "answer": "5"},
]
SYNTHESIZED_CODE = """### Problem
Given n integers, print the sum of their squares.

### Input
The first line contains n (1 <= n <= 1000). The second line contains n integers.

### Output
Print one integer.

### Examples
Input:
```
2
1 2
```
Output:
```
5
```
Input:
```
1
3
```
Output:
```
9
```"""
GENERATOR = """```python
import random

def generate_test_input(n):
    if not 1 <= n <= 1000:
        return None
    return f"{n}\\n" + " ".join(str(random.randint(-50, 50)) for _ in range(n)) + "\\n"

def validate_test_input(text):
    lines = text.split("\\n")
    n = int(lines[0])
    return len(lines[1].split()) == n

SCALES = {"n": [1, 2, 5, 10, 100, 1000]}
```"""


def _block(program: str) -> str:
    return f"Let me think step by step.\n```python\n{program}```"


def scripted_reply(prompt: str, index: int) -> str:
    """What the scripted model writes for a prompt (its i-th sample)."""
    if "## Seed solution" in prompt:
        return "Knowledge points: sums.\n" + SYNTHESIZED_CODE
    if "New problem:" in prompt and "2 + 3" in prompt:
        return "New problem: What is 3 + 4?"
    if "generate_test_input" in prompt:  # before the problems: its prompt quotes them
        return GENERATOR
    if "sum of their squares" in prompt:  # synthesized: 7 of 10 agree
        return _block(SQUARES if index < 7 else WRONG_CUBES)
    if "print their sum" in prompt:  # seed: a wrong majority the oracle overrides
        return _block(WRONG_MAX if index < 7 else (SUM if index % 2 else SUM_ALT))
    if "3 + 4" in prompt:
        return (
            ["The answer is \\boxed{7}.", "\\boxed{7.0}", "\\boxed{\\frac{14}{2}}"][index % 3]
            if index < 7
            else "\\boxed{8}"
        )
    if "2 + 3" in prompt:
        return "\\boxed{5}" if index < 4 else "\\boxed{6}"
    raise AssertionError(f"unexpected prompt: {prompt[:200]}")


class ScriptedLLM:
    name = "scripted"

    def __init__(self):
        self.prompts = 0

    def generate(self, prompts, params):
        self.prompts += len(prompts)
        out = []
        for prompt in prompts:
            text = prompt[-1]["content"]
            out.append(
                [Completion(scripted_reply(text, i), "eos", None, 10, 10) for i in range(params.n)]
            )
        return out


class ScriptedLLMResource(LLMResource):
    def get_llm(self, model=None):
        return SCRIPTED


SCRIPTED = ScriptedLLM()
CHAIN = [
    "seed_problems",
    "seed_rejects",
    "synthesized_problems",
    "test_inputs",
    "candidate_solutions",
    "verified_outputs",
    "verified_solutions",
]


def _set_samples(spec, key: str, n: int) -> None:
    asset = spec.by_key[key]
    sampling = asset.params.sampling.model_copy(update={"n": n})
    asset.params = asset.params.model_copy(update={"sampling": sampling})


def scripted_spec():
    """The demo pipeline with ten candidates per problem and one synthesized problem per seed."""
    spec = load_spec()
    _set_samples(spec, "candidate_solutions", 10)
    _set_samples(spec, "synthesized_problems", 1)
    return spec


def write_seeds(incoming, batch: str) -> None:
    (incoming / f"{batch}.jsonl").write_text("\n".join(json.dumps(s) for s in SEEDS) + "\n")


@pytest.fixture
def chain_defs(tmp_path, monkeypatch, incoming):
    write_seeds(incoming, "t")
    defs = build_definitions(scripted_spec())
    resources = {
        **defs.resources,
        "llm": ScriptedLLMResource(),
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

        before = SCRIPTED.prompts
        second = _materialize(defs, resources, instance)
        assert second.success
        assert SCRIPTED.prompts == before  # every completion came from the item cache
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
        assert SCRIPTED.prompts == before + 4  # the four problems' candidates, once each
        rates = {
            event.asset_key.path[-1]: event.materialization.metadata["cache_hit_rate"].value
            for event in third.get_asset_materialization_events()
            if "cache_hit_rate" in event.materialization.metadata
        }
        assert rates.pop("candidate_solutions") == 0.0
        assert rates and set(rates.values()) == {1.0}
