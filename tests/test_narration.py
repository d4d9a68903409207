"""The narration check of `make lint` (tests/check_narration.py), run as `make lint` runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("check_narration.py")
REPOSITORY = CHECK.parent.parent


def check(repository: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), str(repository)], capture_output=True, text=True
    )


def repository_with(tmp_path: Path, files: dict[str, str], tracked: bool = True) -> Path:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
        if tracked:
            subprocess.run(["git", "-C", str(tmp_path), "add", name], check=True)
    return tmp_path


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("The demo took 596 s in session 34.", "session 34"),  # narration: allow
        ("Figures of sessions 27-28 below.", "sessions 27"),  # narration: allow
        ("Tried in this session, not kept.", "this session"),  # narration: allow
        ("A kernel built this round of work.", "round of work"),  # narration: allow
        ("Same machine (2026-12-02).", "(2026-12-02)"),  # narration: allow
        ("Measured as of 2026-12-01.", "as of 2026-12-01"),  # narration: allow
        ("33 us (session of 2026-12-02)", "session of 2026"),  # narration: allow
    ],
)
def test_a_line_that_narrates_the_work_fails_naming_file_line_and_match(
    tmp_path: Path, line: str, match: str
) -> None:
    repository = repository_with(tmp_path, {"docs/notes.md": f"# Notes\n\n{line}\n"})
    result = check(repository)
    assert result.returncode == 1
    assert f"docs/notes.md:3: {match!r}" in result.stdout
    assert "narrate the work" in result.stderr


def test_legitimate_sessions_rounds_and_dates_pass(tmp_path: Path) -> None:
    text = (
        "client = requests.Session()  # one HTTP session for every request\n"
        "# A database session per step; a Dagster session fixture (scope='session').\n"
        "# Self-evolution round 2 trains this round's policy from round 1's data.\n"
        "# True when this round has enough answers to decide on.\n"
        'MEASURED = "measured 2026-12-04 on an AMD EPYC"\n'
    )
    repository = repository_with(tmp_path, {"pkg/module.py": text, "Makefile": "lint:\n"})
    result = check(repository)
    assert (result.returncode, result.stdout) == (0, "")


def test_a_line_marked_as_allowed_passes(tmp_path: Path) -> None:
    line = "fixture = 'in session 3'  # narration: allow\n"  # narration: allow
    repository = repository_with(tmp_path, {"tests/data.py": line})
    assert check(repository).returncode == 0


def test_untracked_files_and_other_kinds_of_file_are_not_read(tmp_path: Path) -> None:
    narration = "Measured in session 33.\n"  # narration: allow
    repository = repository_with(tmp_path, {"data.json": narration, "run.log": narration})
    (repository / "untracked.md").write_text(narration)
    assert check(repository).returncode == 0


def test_files_under_ci_are_read_whatever_their_name(tmp_path: Path) -> None:
    narration = "# added in session 33\n"  # narration: allow
    repository = repository_with(tmp_path, {".ci/run": narration})
    assert ".ci/run:1: 'session 33'" in check(repository).stdout  # narration: allow


def test_the_repository_as_it_stands_passes() -> None:
    result = check(REPOSITORY)
    assert (result.returncode, result.stdout) == (0, "")


def test_a_directory_outside_git_is_refused_with_the_reason(tmp_path: Path) -> None:
    result = check(tmp_path)
    assert result.returncode == 2
    assert f"{tmp_path}: git ls-files failed" in result.stderr
