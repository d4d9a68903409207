import logging

from rstar_pipelines.pipeline.stage import StageContext
from rstar_pipelines.pipeline.streamed import map_problems


def _context(tmp_path) -> StageContext:
    return StageContext(
        partition_key=None,
        log=logging.getLogger("test"),
        cache_path=tmp_path / "cache.sqlite",
        cache_namespace="kind:1",
    )


def test_outcomes_carry_their_seconds_and_only_the_missing_problems_run(tmp_path):
    ran: list[list[str]] = []

    def run(todo, finished):
        ran.append(list(todo))
        for j in reversed(range(len(todo))):  # any order: each lands at its problem
            finished(j, {"answer": todo[j].upper()}, float(j))

    ctx = _context(tmp_path)
    first = map_problems(ctx, ["a", "b"], str, run, "solved")
    assert first == [{"answer": "A", "seconds": 0.0}, {"answer": "B", "seconds": 1.0}]
    again = map_problems(_context(tmp_path), ["b", "c", "a"], str, run, "solved")
    assert ran == [["a", "b"], ["c"]]
    assert again == [
        {"answer": "B", "seconds": 1.0},
        {"answer": "C", "seconds": 0.0},
        {"answer": "A", "seconds": 0.0},
    ]
