"""Mutual verification against scripted candidates in the real sandbox (process backend),
so the right answer is known."""

import time

import pytest

from rstar_pipelines.coder.verification import (
    CandidateVerdict,
    VerificationTask,
    check_determinism,
    mutual_verify,
    mutual_verify_many,
    mutual_verify_streamed,
    normalize_output,
)
from rstar_sandbox import RUNTIME_ERROR, TIMEOUT, Sandbox
from tests.fakes.sandbox import WindowedSandbox, require_backend

INPUTS = ["1 2\n", "10 -3\n", "0 0\n", "123456789 987654321\n"]
SUMS = ["3", "7", "0", "1111111110"]

# Seven correct adders, written differently and printing differently-padded output.
CORRECT = [
    "a, b = map(int, input().split())\nprint(a + b)\n",
    "import sys\nprint(sum(map(int, sys.stdin.read().split())))\n",
    "a, b = input().split()\nprint(int(a) + int(b), end='   \\n')\n",
    "x = [int(t) for t in input().split()]\nprint(x[0] + x[1])\nprint()\nprint('  ')\n",
    "def add(a, b):\n    return a + b\n\n\nprint(add(*map(int, input().split())))\n",
    "import sys\na, b = map(int, sys.stdin.readline().split())\n"
    "sys.stdout.write(f'{a + b}\\t\\n\\n')\n",
    "print(eval(input().strip().replace(' ', '+')))\n",
]
WRONG = [
    "a, b = map(int, input().split())\nprint(a - b)\n",
    "a, b = map(int, input().split())\nprint(a * b)\n",
    "a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n",
]
SUBTRACT = "a, b = map(int, input().split())\nprint(a - b)\n"
LOOP = "while True:\n    pass\n"
CLOCK = "import time\nprint(time.time_ns() // 3_000_000_000)\n"
WINDOW_NS = 3_000_000_000


@pytest.fixture(scope="module")
def sandbox():
    require_backend("process")
    with Sandbox(backend="process", workers=2) as sb:
        yield sb


def test_normalize_output():
    assert normalize_output("3  \n\n \n") == "3"
    assert normalize_output("  a\t\r\n\nb \n") == "  a\n\nb"
    assert normalize_output("") == normalize_output("\n\n") == ""
    assert normalize_output("1\n") == normalize_output("1")


def test_seven_of_ten_agree(sandbox):
    candidates = [WRONG[0], *CORRECT[:4], WRONG[1], *CORRECT[4:], WRONG[2]]
    mv = mutual_verify(candidates, INPUTS, sandbox, threshold=0.6, timeout_s=2.0)
    assert mv.verified and mv.reason is None and mv.label_source == "majority"
    assert mv.labels == SUMS
    assert mv.agreeing == [1, 2, 3, 4, 6, 7, 8]
    assert mv.agreement == 0.7
    assert [v.agrees for v in mv.verdicts] == [i in mv.agreeing for i in range(10)]
    assert all(v.status == "ok" and v.failed_input is None for v in mv.verdicts)
    assert all(v.wall_s > 0 and v.cpu_s >= 0 and v.peak_memory_mb > 0 for v in mv.verdicts)


def test_five_of_ten_is_not_enough(sandbox):
    candidates = CORRECT[:5] + [SUBTRACT] * 5
    mv = mutual_verify(candidates, INPUTS, sandbox, threshold=0.6)
    assert not mv.verified and mv.labels is None and mv.agreeing == []
    assert mv.agreement == 0.5
    assert mv.reason == "best agreement 0.50 < 0.60"
    assert not any(v.agrees for v in mv.verdicts)


def test_tie_goes_to_the_group_with_the_lowest_index(sandbox):
    mv = mutual_verify([SUBTRACT, CORRECT[0], CORRECT[1], SUBTRACT], INPUTS, sandbox, 0.5)
    assert mv.verified and mv.agreeing == [0, 3]
    assert mv.labels == ["-1", "13", "0", "-864197532"]


def test_unparsable_candidates_count_in_the_denominator(sandbox):
    candidates = [*CORRECT[:6], None, "", "  \n", None]
    mv = mutual_verify(candidates, INPUTS, sandbox, threshold=0.6)
    assert mv.verified and mv.agreement == 0.6 and mv.agreeing == list(range(6))
    for index in (6, 7, 8, 9):
        assert mv.verdicts[index] == CandidateVerdict(
            index, False, "unparsable", None, 0.0, 0.0, 0.0
        )


def test_a_candidate_that_fails_on_one_input_does_not_agree(sandbox):
    crashes = "a, b = map(int, input().split())\nassert a != 10\nprint(a + b)\n"
    hangs = "a, b = map(int, input().split())\nwhile a == 0:\n    pass\nprint(a + b)\n"
    mv = mutual_verify([*CORRECT[:3], crashes, hangs], INPUTS, sandbox, timeout_s=0.5)
    assert mv.verified and mv.agreeing == [0, 1, 2] and mv.labels == SUMS
    crash, hang = mv.verdicts[3], mv.verdicts[4]
    assert (crash.agrees, crash.status, crash.failed_input) == (False, RUNTIME_ERROR, 1)
    assert (hang.agrees, hang.status, hang.failed_input) == (False, TIMEOUT, 2)
    assert hang.wall_s >= 0.4


def test_nothing_to_verify(sandbox):
    mv = mutual_verify(CORRECT, [], sandbox)
    assert (mv.verified, mv.reason, mv.labels, mv.agreement) == (False, "no test inputs", None, 0)
    assert len(mv.verdicts) == len(CORRECT)
    mv = mutual_verify([], INPUTS, sandbox)
    assert not mv.verified and mv.reason == "no candidates" and mv.verdicts == []
    mv = mutual_verify([None, "raise SystemExit(1)"], INPUTS, sandbox)
    assert not mv.verified and mv.agreement == 0.0 and mv.reason


def test_oracle_overrides_a_wrong_majority(sandbox):
    candidates = [SUBTRACT] * 4 + CORRECT[:3] + [SUBTRACT] * 3
    mv = mutual_verify(candidates, INPUTS, sandbox, threshold=0.6, oracle=CORRECT[0])
    assert mv.verified and mv.reason is None and mv.label_source == "oracle"
    assert mv.labels == SUMS
    assert mv.agreeing == [4, 5, 6] and mv.agreement == 0.3
    assert [v.index for v in mv.verdicts if v.agrees] == [4, 5, 6]
    alone = mutual_verify([], INPUTS, sandbox, oracle=CORRECT[0])
    assert alone.verified and alone.labels == SUMS and alone.agreement == 0.0


def test_a_failing_oracle_labels_nothing(sandbox):
    oracle = "a, b = map(int, input().split())\nprint(a + b // b)\n"  # 0 // 0 on input 2
    mv = mutual_verify(CORRECT, INPUTS, sandbox, oracle=oracle)
    assert not mv.verified and mv.labels is None and mv.agreeing == []
    assert mv.reason == "oracle failed on input 2: runtime_error"
    assert mv.label_source == "oracle"
    empty = mutual_verify(CORRECT, INPUTS, sandbox, oracle="")
    assert not empty.verified and empty.reason == "the oracle has no code"


def test_check_determinism_catches_a_clock_reading_majority(sandbox):
    inputs = ["1\n", "2\n", "3\n"]
    clocks = [CLOCK, CLOCK.replace("print(", "print( "), CLOCK + "\n\n", None]
    for _ in range(2):  # a run straddling a window boundary splits the vote: retry once
        mv = mutual_verify(clocks, inputs, sandbox, threshold=0.75)
        if mv.verified:
            break
    assert mv.verified and mv.agreeing == [0, 1, 2]
    latest = max(int(label) for label in mv.labels)
    time.sleep(max(0, (latest + 1) * WINDOW_NS - time.time_ns()) / 1e9 + 0.01)
    assert check_determinism(CLOCK, inputs, mv.labels, sandbox) == [0, 1, 2]


def test_check_determinism_flags_failed_runs(sandbox):
    assert check_determinism(CORRECT[0], INPUTS, SUMS, sandbox) == []
    assert check_determinism(CORRECT[0], INPUTS, [*SUMS[:3], "0"], sandbox) == [3]
    assert check_determinism("raise SystemExit(2)", INPUTS[:2], SUMS[:2], sandbox) == [0, 1]


def _decision(mv):
    """What verification decided, without the timings."""
    verdicts = [(v.index, v.agrees, v.status, v.failed_input) for v in mv.verdicts]
    return mv.verified, mv.labels, mv.agreeing, mv.agreement, mv.reason, mv.label_source, verdicts


def test_many_equals_one_at_a_time(sandbox):
    tasks = [
        VerificationTask([WRONG[0], *CORRECT[:4], WRONG[1], *CORRECT[4:], WRONG[2]], INPUTS),
        VerificationTask([*CORRECT[:2], SUBTRACT, None], INPUTS[:2], oracle=SUBTRACT),
        VerificationTask([SUBTRACT, CORRECT[0], LOOP], INPUTS[1:3], timeout_s=0.3),
    ]
    many = mutual_verify_many(tasks, sandbox, threshold=0.6, timeout_s=0.5)
    one_by_one = [
        mutual_verify(t.candidates, t.inputs, sandbox, 0.6, t.timeout_s or 0.5, oracle=t.oracle)
        for t in tasks
    ]
    assert [_decision(mv) for mv in many] == [_decision(mv) for mv in one_by_one]
    assert [mv.verified for mv in many] == [True, True, False]
    assert many[2].verdicts[2].status == TIMEOUT
    assert many[2].verdicts[2].wall_s < 0.8  # two runs under the task's own 0.3 s limit


def test_streamed_decides_each_problem_as_its_runs_end_within_two_windows(sandbox):
    slow = "import time\ntime.sleep(1)\n" + CORRECT[0]
    tasks = [
        VerificationTask([slow], INPUTS[:1]),  # 1 job, the first a worker takes
        VerificationTask([], INPUTS),  # runs nothing
        *(VerificationTask([*CORRECT[:4], WRONG[i % 3]], INPUTS) for i in range(6)),  # 20 each
    ]
    windowed = WindowedSandbox(sandbox)
    decided = []
    mutual_verify_streamed(
        tasks, windowed, lambda i, mv: decided.append((i, mv)), 0.6, 2.0, window=20
    )
    # Windows of at least 20 jobs, consecutive problems: [0, 1, 2], [3], [4], ...
    assert windowed.calls == [21, 20, 20, 20, 20, 20]
    assert windowed.most_queued <= 2 * 21  # two windows, whatever the number of problems
    order = [i for i, _ in decided]
    assert sorted(order) == list(range(len(tasks)))
    assert order.index(1) < order.index(2) < order.index(0)  # the slow problem's end waits
    many = mutual_verify_many(tasks, sandbox, 0.6, 2.0)
    assert [_decision(mv) for _, mv in sorted(decided, key=lambda d: d[0])] == [
        _decision(mv) for mv in many
    ]
