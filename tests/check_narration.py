"""Fail on text that narrates the work instead of stating what is (`make lint` runs this).

Code, comments and docs say what the project is and why; the history of how it got there lives
in git. This scans the tracked files of a repository (`git ls-files`: Python, Markdown, YAML,
TOML, shell and C sources, Makefiles and everything under .ci/) for the marks such narration
leaves: a numbered work session, a round of the work, a date of work in parentheses or after "on" /
"as of". A line that uses such words legitimately (a quoted example, a fixture) ends with
the marker `narration: allow`; keep those few.

    python tests/check_narration.py [REPOSITORY]

Prints `path:line: 'match'` for every hit and exits 1 if there is any.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ALLOW_MARKER = "narration: allow"
SUFFIXES = frozenset({".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".c", ".h"})
# Written with \s so that these lines do not match themselves.
PATTERNS = (
    re.compile(r"\bsessions?\s\d+", re.IGNORECASE),
    re.compile(r"\bsession\s(?:of|on)\s20\d\d", re.IGNORECASE),
    re.compile(r"\bthis\ssession\b", re.IGNORECASE),
    re.compile(r"\bround\sof\swork\b", re.IGNORECASE),
    re.compile(r"\((?:20\d\d-\d\d-\d\d)(?:/\d\d)?\)"),
    re.compile(r"\b(?:as\sof|on)\s20\d\d-\d\d-\d\d\b", re.IGNORECASE),
)


def scanned(path: str) -> bool:
    """Whether a tracked file is text this check reads."""
    name = Path(path).name
    return Path(path).suffix in SUFFIXES or name == "Makefile" or path.startswith(".ci/")


def narration(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    """(line number, matched text) of every narration mark in `lines`, numbered from 1."""
    for number, line in enumerate(lines, start=1):
        if ALLOW_MARKER in line:
            continue
        for pattern in PATTERNS:
            for match in pattern.finditer(line):
                yield number, match.group(0)


def tracked_files(repository: Path) -> list[str]:
    """The repository's tracked paths that this check reads."""
    listed = subprocess.run(
        ["git", "-C", str(repository), "ls-files", "-z"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return sorted(path for path in listed.split("\0") if path and scanned(path))


def findings(repository: Path) -> list[str]:
    """`path:line: 'match'` for every narration mark in the repository's tracked files."""
    found = []
    for path in tracked_files(repository):
        file = repository / path
        if not file.is_file():  # tracked but deleted in the work tree
            continue
        text = file.read_text(encoding="utf-8", errors="replace")
        found += [f"{path}:{line}: {match!r}" for line, match in narration(text.splitlines())]
    return found


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"usage: {Path(__file__).name} [REPOSITORY]", file=sys.stderr)
        return 2
    repository = Path(argv[0] if argv else ".")
    try:
        found = findings(repository)
    except subprocess.CalledProcessError as error:
        print(f"{repository}: git ls-files failed: {error.stderr.strip()}", file=sys.stderr)
        return 2
    for finding in found:
        print(finding)
    if found:
        print(
            f"{len(found)} line(s) narrate the work: say what is (history lives in git), or end "
            f"a legitimate use with '{ALLOW_MARKER}'",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
