"""Outcome rewards of agent trajectories (rStar2-Agent, docs/agent.md): binary, from the final turn.

Math: the final answer (`format.final_answer`) is equivalent to the gold answer. Code: the program
in the final answer block (or, without one, anywhere in the final turn) prints every verified
label on its input; all code trajectories of a call run in one `sandbox.run`. No format or length
reward: a trajectory cut before its answer simply has none, and gets 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rstar_pipelines.coder.extract import extract_program
from rstar_pipelines.coder.verification import ProgramRuns, passes_tests, run_programs
from rstar_sandbox import Sandbox

from .format import answer_block, final_answer
from .rollout import Trajectory

__all__ = ["AgentProblem", "rewards"]


@dataclass(frozen=True)
class AgentProblem:
    id: str
    domain: str  # "math" or "code"
    question: str
    answer: str | None = None  # math: the gold answer
    inputs: tuple[str, ...] = ()  # code: verified test inputs ...
    labels: tuple[str, ...] = ()  # ... and their expected outputs

    def __post_init__(self) -> None:
        if self.domain == "math":
            if not self.answer:
                raise ValueError(f"math problem {self.id!r} has no gold answer")
        elif self.domain == "code":
            if not self.inputs or len(self.inputs) != len(self.labels):
                raise ValueError(
                    f"code problem {self.id!r} needs test inputs and one label per input, got "
                    f"{len(self.inputs)} inputs and {len(self.labels)} labels"
                )
        else:
            raise ValueError(f"problem {self.id!r}: domain must be 'math' or 'code'")


def rewards(
    groups: Sequence[Sequence[Trajectory]],
    problems: Sequence[AgentProblem],
    sandbox: Sandbox,
    timeout_s: float = 4.0,
    memory_mb: int = 256,
) -> list[list[float]]:
    """Per problem, the reward (1.0 or 0.0) of each of its trajectories, in `run_rollouts`'s
    shape: `groups[i]` are the rollouts of `problems[i]`."""
    # Imported here: math-verify loads SymPy, which code problems have no use for.
    from rstar_pipelines.math.answers import equivalent

    if len(groups) != len(problems):
        raise ValueError(f"{len(groups)} groups of trajectories for {len(problems)} problems")
    scores: list[list[float]] = []
    code_tasks, code_groups = [], []
    for index, (group, problem) in enumerate(zip(groups, problems, strict=True)):
        if problem.domain == "math":
            answers = [final_answer(t.final_text) for t in group]
            scores.append([float(a is not None and equivalent(a, problem.answer)) for a in answers])
        else:
            programs = [_program(t.final_text) for t in group]
            code_tasks.append(ProgramRuns(programs, problem.inputs))
            code_groups.append(index)
            scores.append([])
    if code_tasks:
        runs = run_programs(code_tasks, sandbox, timeout_s, memory_mb)
        for index, group_runs in zip(code_groups, runs, strict=True):
            labels = problems[index].labels
            scores[index] = [float(passes_tests(r, labels)) for r in group_runs]
    return scores


def _program(text: str) -> str | None:
    """The program of the answer block, or of the whole turn if it has none."""
    block = answer_block(text)
    program, _ = extract_program(text if block is None else block)
    return program
