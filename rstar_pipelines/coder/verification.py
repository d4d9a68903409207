"""Output labeling by mutual verification (rStar-Coder, docs/rstar-coder.md).

Every candidate solution of a problem runs on every test input. Candidates that ran
cleanly on all inputs and printed the same (normalized) outputs form a group; if the
largest group holds at least `threshold` of all candidates, its outputs become the
labels. A seed problem's oracle solution, when given, supplies the labels instead.

    mv = mutual_verify(candidates, inputs, sandbox, threshold=0.6)
    if mv.verified:
        labels, correct = mv.labels, mv.agreeing
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from rstar_sandbox import OK, Job, Result, Sandbox

__all__ = [
    "UNPARSABLE",
    "CandidateVerdict",
    "MutualVerification",
    "ProgramRuns",
    "VerificationTask",
    "check_determinism",
    "determinism_mismatches",
    "mutual_verify",
    "mutual_verify_many",
    "mutual_verify_streamed",
    "normalize_output",
    "output_signature",
    "passes_tests",
    "run_programs",
]

UNPARSABLE = "unparsable"
# Jobs in a window of `mutual_verify_streamed`: two windows are queued at once, enough to
# keep any pool busy while a finished problem is decided and committed.
WINDOW_JOBS = 4096


def normalize_output(text: str) -> str:
    """The output as rStar-Coder compares it: no trailing whitespace on any line and no
    trailing blank lines; leading spaces and inner blank lines still count."""
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


@dataclass(frozen=True)
class CandidateVerdict:
    """How one program fared: `status` is "ok" when every run was, else the status of
    the first failing input (`failed_input`), or "unparsable" when there was no code."""

    index: int
    agrees: bool
    status: str
    failed_input: int | None
    wall_s: float
    cpu_s: float
    peak_memory_mb: float


@dataclass(frozen=True)
class MutualVerification:
    verified: bool
    labels: list[str] | None
    agreeing: list[int]
    agreement: float
    reason: str | None
    label_source: str  # "majority" or "oracle"
    verdicts: list[CandidateVerdict]


@dataclass(frozen=True)
class VerificationTask:
    """One problem: its candidate programs (None where no code could be extracted), its
    test inputs, an optional oracle, and an optional time limit overriding the default."""

    candidates: Sequence[str | None]
    inputs: Sequence[str]
    oracle: str | None = None
    timeout_s: float | None = None


@dataclass(frozen=True)
class ProgramRuns:
    """Programs (None where there is no code) to run on every one of `inputs`."""

    programs: Sequence[str | None]
    inputs: Sequence[str]
    timeout_s: float | None = None


def mutual_verify(
    candidates: Sequence[str | None],
    inputs: Sequence[str],
    sandbox: Sandbox,
    threshold: float = 0.6,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    oracle: str | None = None,
) -> MutualVerification:
    [verification] = mutual_verify_many(
        [VerificationTask(candidates, inputs, oracle)], sandbox, threshold, timeout_s, memory_mb
    )
    return verification


def mutual_verify_many(
    tasks: Sequence[VerificationTask],
    sandbox: Sandbox,
    threshold: float = 0.6,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
) -> list[MutualVerification]:
    """Verify many problems (`mutual_verify_streamed`), their verifications in task order."""
    out: list[MutualVerification | None] = [None] * len(tasks)

    def done(index: int, verification: MutualVerification) -> None:
        out[index] = verification

    mutual_verify_streamed(tasks, sandbox, done, threshold, timeout_s, memory_mb)
    return out  # type: ignore[return-value]


def mutual_verify_streamed(
    tasks: Sequence[VerificationTask],
    sandbox: Sandbox,
    done: Callable[[int, MutualVerification], None],
    threshold: float = 0.6,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    window: int = WINDOW_JOBS,
) -> None:
    """Verify the tasks over the sandbox's `stream`: `done(i, verification)` is called, from
    this thread, as soon as every run of task i has finished. The jobs go out a window of
    about `window` at a time with the next window queued behind it, so the workers never
    wait between problems nor on `done` (a commit, say), and memory holds two windows
    whatever the number of tasks."""
    windows = _windows(tasks, window)
    queued: deque[_Window] = deque()

    def queue_next() -> None:
        indices = next(windows, None)
        if indices is not None:
            queued.append(_Window(tasks, indices, sandbox, timeout_s, memory_mb))

    queue_next()
    queue_next()
    while queued:
        for index, candidate_runs, oracle_runs in queued.popleft().finished():
            done(index, _decide(tasks[index], candidate_runs, oracle_runs, threshold))
        queue_next()


def _programs(task: VerificationTask) -> ProgramRuns:
    return ProgramRuns([*task.candidates, task.oracle], task.inputs, task.timeout_s)


def _windows(tasks: Sequence[VerificationTask], window: int) -> Iterator[list[int]]:
    """Consecutive task indices, about `window` jobs at a time (a larger task alone)."""
    indices: list[int] = []
    jobs = 0
    for i, task in enumerate(tasks):
        indices.append(i)
        jobs += _job_count(_programs(task))
        if jobs >= window:
            yield indices
            indices, jobs = [], 0
    if indices:
        yield indices


class _Window:
    """One window's jobs, queued in the sandbox at construction."""

    def __init__(self, tasks, indices: list[int], sandbox, timeout_s: float, memory_mb: int):
        self.indices = indices
        self.programs = [_programs(tasks[i]) for i in indices]
        self.jobs, self.starts = _layout(self.programs, timeout_s, memory_mb)
        self.owner = [k for k, p in enumerate(self.programs) for _ in range(_job_count(p))]
        self.stream = sandbox.stream(self.jobs)

    def finished(self) -> Iterator[tuple[int, list, Sequence[Result] | None]]:
        """(task index, candidate runs, oracle runs) of each task as its last run ends."""
        results: list[Result | None] = [None] * len(self.jobs)
        left = [_job_count(p) for p in self.programs]
        for k in (k for k, n in enumerate(left) if n == 0):  # tasks that run nothing
            yield self._runs(k, results)
        for index, result in self.stream:
            results[index] = result
            k = self.owner[index]
            left[k] -= 1
            if left[k] == 0:
                yield self._runs(k, results)

    def _runs(self, k: int, results: list) -> tuple[int, list, Sequence[Result] | None]:
        runs = _split(self.programs[k], self.starts[k], results)
        return self.indices[k], runs[:-1], runs[-1]


def run_programs(
    tasks: Sequence[ProgramRuns], sandbox: Sandbox, timeout_s: float = 2.0, memory_mb: int = 256
) -> list[list[Sequence[Result] | None]]:
    """Every task's programs on its inputs with one `sandbox.run` call: per task and program,
    its results in input order, or None for a program without code."""
    jobs, starts = _layout(tasks, timeout_s, memory_mb)
    results = sandbox.run(jobs)
    return [_split(task, s, results) for task, s in zip(tasks, starts, strict=True)]


def _layout(
    tasks: Sequence[ProgramRuns], timeout_s: float, memory_mb: int
) -> tuple[list[Job], list[list[int | None]]]:
    """The jobs of the tasks' programs on their inputs, task after task, and per task and
    program its first job (None: a program without code runs nothing)."""
    jobs: list[Job] = []
    starts: list[list[int | None]] = []
    for task in tasks:
        limit = task.timeout_s or timeout_s
        task_starts: list[int | None] = []
        for program in task.programs:
            if _parsable(program):
                task_starts.append(len(jobs))
                jobs.extend(
                    Job(code=program, stdin=stdin, timeout_s=limit, memory_mb=memory_mb)
                    for stdin in task.inputs
                )
            else:
                task_starts.append(None)
        starts.append(task_starts)
    return jobs, starts


def _job_count(task: ProgramRuns) -> int:
    return len(task.inputs) * sum(map(_parsable, task.programs))


def _split(task: ProgramRuns, starts: list[int | None], results) -> list[Sequence[Result] | None]:
    n = len(task.inputs)
    return [None if s is None else results[s : s + n] for s in starts]


def output_signature(runs: Sequence[Result] | None) -> tuple[str, ...] | None:
    """What a program printed on every input (normalized); None if it has no code or any run
    failed, so it can agree with nothing."""
    if runs is None or _first_failure(runs) is not None:
        return None
    return tuple(normalize_output(r.stdout) for r in runs)


def passes_tests(runs: Sequence[Result] | None, labels: Sequence[str]) -> bool:
    """Whether a program's runs printed every label (the verified test cases)."""
    signature = output_signature(runs)
    return signature is not None and signature == tuple(normalize_output(x) for x in labels)


def check_determinism(
    program: str,
    inputs: Sequence[str],
    labels: Sequence[str],
    sandbox: Sandbox,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
) -> list[int]:
    """Re-run `program`; the indices of the inputs whose output no longer matches its
    label or whose run failed. Agreeing candidates can share a nondeterministic output
    (a clock, a random seed) when they run at the same moment; a later re-run exposes it."""
    results = sandbox.run(
        [Job(code=program, stdin=s, timeout_s=timeout_s, memory_mb=memory_mb) for s in inputs]
    )
    return determinism_mismatches(results, labels)


def determinism_mismatches(runs: Sequence[Result], labels: Sequence[str]) -> list[int]:
    """The indices of the runs that failed or no longer print their label."""
    return [
        i
        for i, (result, label) in enumerate(zip(runs, labels, strict=True))
        if not result.ok or normalize_output(result.stdout) != normalize_output(label)
    ]


def _parsable(program: str | None) -> bool:
    return bool(program and program.strip())


def _first_failure(runs: Sequence[Result]) -> int | None:
    return next((i for i, r in enumerate(runs) if not r.ok), None)


def _verdict(index: int, runs: Sequence[Result] | None, agrees: bool) -> CandidateVerdict:
    if runs is None:
        return CandidateVerdict(index, False, UNPARSABLE, None, 0.0, 0.0, 0.0)
    failed = _first_failure(runs)
    return CandidateVerdict(
        index,
        agrees,
        OK if failed is None else runs[failed].status,
        failed,
        sum(r.wall_s for r in runs),
        sum(r.cpu_s for r in runs),
        max((r.peak_memory_mb for r in runs), default=0.0),
    )


def _decide(
    task: VerificationTask,
    candidate_runs: list[Sequence[Result] | None],
    oracle_runs: Sequence[Result] | None,
    threshold: float,
) -> MutualVerification:
    n = len(candidate_runs)
    signatures = [output_signature(runs) for runs in candidate_runs]
    groups: dict[tuple[str, ...], list[int]] = {}
    for index, signature in enumerate(signatures):
        if signature is not None:
            groups.setdefault(signature, []).append(index)
    source = "majority" if task.oracle is None else "oracle"

    reason = None
    labels: tuple[str, ...] | None = None
    agreeing: list[int] = []
    agreement = 0.0
    if not task.inputs:
        reason = "no test inputs"
    elif task.oracle is not None:
        failed = None if oracle_runs is None else _first_failure(oracle_runs)
        if oracle_runs is None:
            reason = "the oracle has no code"
        elif failed is not None:
            reason = f"oracle failed on input {failed}: {oracle_runs[failed].status}"
        else:
            labels = output_signature(oracle_runs)
            agreeing = groups.get(labels, [])
            agreement = len(agreeing) / n if n else 0.0
    elif not groups:
        reason = "no candidates" if n == 0 else "no candidate ran cleanly on every input"
    else:
        # dicts keep insertion order, so on a tie max() keeps the group seen first: the
        # one holding the lowest candidate index
        signature, members = max(groups.items(), key=lambda item: len(item[1]))
        agreement = len(members) / n
        if agreement >= threshold:
            labels, agreeing = signature, members
        else:
            reason = f"best agreement {agreement:.2f} < {threshold:.2f}"
    return MutualVerification(
        verified=labels is not None,
        labels=None if labels is None else list(labels),
        agreeing=agreeing,
        agreement=agreement,
        reason=reason,
        label_source=source,
        verdicts=[_verdict(i, runs, i in agreeing) for i, runs in enumerate(candidate_runs)],
    )
