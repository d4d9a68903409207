"""The GPU install resolves: nothing the `gpu` extra brings in contradicts the pins of the vLLM it
pins (the data: vllm-0.32.0-requires.txt beside this file, copied from the wheel's metadata)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from rstar_kernels.vllm_plugin import PINNED_VLLM

REPO = Path(__file__).resolve().parents[2]
VLLM_REQUIRES = Path(__file__).with_name(f"vllm-{PINNED_VLLM}-requires.txt")
# The machine the GPU extra is for (markers of vLLM's requirements are evaluated there).
LINUX_X86 = {"platform_machine": "x86_64", "platform_system": "Linux", "python_version": "3.11"}


def extra_requirements(extra: str) -> list[Requirement]:
    """The project's requirements with `extra` installed: its base dependencies and the extra's
    own, following the extra's references to other extras of the project."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name = canonicalize_name(project["name"])
    requirements, todo, seen = [Requirement(r) for r in project["dependencies"]], [extra], set()
    while todo:
        current = todo.pop()
        seen.add(current)
        for text in project["optional-dependencies"][current]:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == name:
                todo += [e for e in requirement.extras if e not in seen]
            else:
                requirements.append(requirement)
    return requirements


def vllm_pins() -> dict[str, SpecifierSet]:
    pins = {}
    for line in VLLM_REQUIRES.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(LINUX_X86):
                pins[canonicalize_name(requirement.name)] = requirement.specifier
    return pins


def compatible(ours: SpecifierSet, theirs: SpecifierSet) -> bool:
    """Whether some version satisfies both: tried on every version either side names and on
    its neighbours (enough for the ==, >=, <, != clauses that requirements use)."""
    named = {Version(s.version.removesuffix(".*")) for s in (*ours, *theirs)}
    if not named:
        return True  # neither side says anything
    candidates = set(named)
    for version in named:
        parts = list(version.release) + [0] * (3 - len(version.release))
        for i in range(len(parts)):
            for step in (-1, 1):
                bumped = parts[: i + 1]
                bumped[i] = max(0, bumped[i] + step)
                candidates.add(Version(".".join(map(str, bumped + [0] * (len(parts) - i - 1)))))
    return any(ours.contains(v, prereleases=True) and theirs.contains(v) for v in candidates)


def contradictions(requirements: list[Requirement], pins: dict[str, SpecifierSet]) -> list[str]:
    found = []
    for requirement in requirements:
        theirs = pins.get(canonicalize_name(requirement.name))
        if theirs is not None and not compatible(requirement.specifier, theirs):
            found.append(
                f"{requirement} contradicts vLLM {PINNED_VLLM}'s {requirement.name}{theirs}"
            )
    return found


def test_gpu_extra_pins_the_vllm_the_plugin_is_written_for():
    [vllm] = [r for r in extra_requirements("gpu") if r.name == "vllm"]
    assert str(vllm.specifier) == f"=={PINNED_VLLM}"


def test_gpu_extra_contradicts_none_of_vllms_pins():
    requirements = extra_requirements("gpu")
    assert {"torch", "transformers", "tilelang", "triton"} <= {r.name for r in requirements}
    assert contradictions(requirements, vllm_pins()) == []


def test_cpu_constraints_pin_the_torch_vllm_pins():
    pins = vllm_pins()
    for line in (REPO / "constraints-cpu.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            assert compatible(requirement.specifier, pins[canonicalize_name(requirement.name)])


@pytest.mark.parametrize(
    ("ours", "theirs", "expected"),
    [
        ("tilelang>=0.1.15", "==0.1.12", False),  # what the kernels extra used to say
        ("vllm>=0.11", "==0.32.0", True),
        ("transformers>=5.0", ">=5.16.1,<5.20.0", True),
        ("transformers>=5.20", ">=5.16.1,<5.20.0", False),
        ("transformers<5.16", ">=5.16.1,<5.20.0", False),
        ("protobuf<5", "!=6.30.*,>=5.29.6", False),
        ("protobuf>=6.30,<6.31", "!=6.30.*,>=5.29.6", False),
        ("pydantic>=2.7", ">=2.12.0", True),
        ("numpy", "", True),
    ],
)
def test_compatibility_check_finds_contradictions(ours, theirs, expected):
    assert compatible(Requirement(ours).specifier, SpecifierSet(theirs)) is expected
