"""How many trees the search keeps open over a fleet: as many as the fleet has room for (its
spare capacity), at most what the memory budget holds, and each tree the lock-step search's
whatever order its samples arrive in."""

from __future__ import annotations

import threading

import pytest

from rstar_pipelines.llm.counting import CountingLLM
from rstar_pipelines.math.mcts import MCTSConfig, MCTSSearch, Problem, open_trees_bound, search
from tests.fakes.llm import CapacityFleet
from tests.fakes.math import PROMPT, SCRIPT, A, B, F, StepPolicy, padded
from tests.fakes.sandbox import MemoSandbox
from tests.fakes.servers import wait_until

CONFIG = MCTSConfig(rollouts=4, width=3, max_depth=4, errors_threshold=1)
# Twelve problems, worded apart so each tree has prompts of its own: the golden tree, and one
# whose root's third sample is the answer (its early walk is undone).
SCRIPTS = {
    f"What is 2 + 3? (problem {i})": padded(SCRIPT if i % 2 else {**SCRIPT, "": [A, B, F]}, 3)
    for i in range(12)
}
PROBLEMS = [Problem(f"p{i}", q, "5") for i, q in enumerate(SCRIPTS)]


def memory_for(trees: int, config: MCTSConfig = CONFIG) -> float:
    """A memory budget, in MiB, that holds `trees` open trees of `config` and not one more."""
    one = open_trees_bound(config, 1024) / 1024  # trees a MiB
    return (trees + 0.5) / one


def fleet_search(sandbox, capacity: int, memory_mb: float, seed: int = 0):
    """The trees over a fleet of `capacity` slots, and the search's stats."""
    fleet = CapacityFleet(StepPolicy(scripts=SCRIPTS), capacity, delay_s=0.05, seed=seed)
    searcher = MCTSSearch(fleet, sandbox, CONFIG, prompt=PROMPT)
    ended = {}
    searcher.run(
        PROBLEMS, on_tree=lambda i, tree, s: ended.setdefault(i, tree), memory_mb=memory_mb
    )
    return [ended[i] for i in range(len(PROBLEMS))], searcher.stats


def test_the_memory_budget_bounds_the_open_trees():
    assert open_trees_bound(CONFIG, memory_for(3)) == 3
    bigger = CONFIG.model_copy(update={"max_tokens": 4 * CONFIG.max_tokens})
    assert open_trees_bound(bigger, memory_for(3)) < 3  # longer steps, fewer trees
    with pytest.raises(ValueError, match="memory_mb=0"):
        open_trees_bound(CONFIG, 0)


def test_a_partition_beyond_the_bound_gives_the_lockstep_trees(sandbox):
    lockstep = CONFIG.model_copy(update={"lockstep": True})
    reference = search(PROBLEMS, StepPolicy(scripts=SCRIPTS), sandbox, lockstep, prompt=PROMPT)
    for seed in range(3):  # three orders of arrival
        trees, stats = fleet_search(sandbox, capacity=1000, memory_mb=memory_for(3), seed=seed)
        assert stats.open_trees_most == 3  # the fleet had room for all; memory held three
        for tree, expected in zip(trees, reference, strict=True):
            assert tree.problem == expected.problem
            assert tree.nodes.to_pylist() == expected.nodes.to_pylist()
            assert tree.rollout_paths == expected.rollout_paths


def test_the_open_trees_follow_the_fleets_spare_capacity(sandbox):
    programs = MemoSandbox(sandbox)  # every tree runs the same programs: instant once run
    search(PROBLEMS[:2], StepPolicy(scripts=SCRIPTS), programs, CONFIG, prompt=PROMPT)
    memory = memory_for(8)
    stats = {c: fleet_search(programs, capacity=c, memory_mb=memory)[1] for c in (3, 6, 1000)}
    mean = {c: s.mean_open_trees for c, s in stats.items()}
    # An expansion asks for 3 samples: 3 slots keep about one tree busy (a few more open while
    # the others' code runs or their next step is being made), 6 about two, and a fleet with
    # room for every tree is held to what memory allows.
    assert mean[3] < mean[6] < mean[1000]
    assert stats[3].open_trees_most < stats[1000].open_trees_most == 8


def test_trees_open_when_the_fleet_grows_before_any_answer(sandbox):
    """The search waits for answers, but room on the fleet (a client's window that grew) wakes
    it too: more trees open while the first one's samples are still out."""
    held = threading.Event()
    fleet = CapacityFleet(StepPolicy(scripts=SCRIPTS), CONFIG.width, delay_s=0.0, held=held)
    searcher = MCTSSearch(fleet, sandbox, CONFIG, prompt=PROMPT)
    runner = threading.Thread(target=searcher.run, args=(PROBLEMS[:3],))
    runner.start()
    try:
        wait_until(lambda: fleet.outstanding == CONFIG.width, "one tree's expansion", 10)
        fleet.grow(3 * CONFIG.width)
        wait_until(lambda: fleet.outstanding == 3 * CONFIG.width, "three trees' expansions", 10)
    finally:
        held.set()
        runner.join()
    assert searcher.stats.open_trees_most == 3


def test_an_expansion_goes_with_how_far_its_tree_has_gone(sandbox):
    """Over a fleet, each sample of an expansion goes with the rollout steps its tree has taken
    before it (the rollouts before, times max_depth, and the steps of this one) as its
    priority: the client sends what waits lowest first, so the trees with the most left go
    first and the trees end together."""
    fleet = CapacityFleet(StepPolicy(scripts=SCRIPTS), 1000, delay_s=0.02)
    MCTSSearch(fleet, sandbox, CONFIG, prompt=PROMPT).run(PROBLEMS[:2])
    golden = [priority for prompt, priority in fleet.sent if PROBLEMS[1].question in prompt]
    # The golden tree (max_depth 4): the first rollout expands the root and two nodes below
    # it (steps 0-2); the second expands nothing; the third two nodes from its first step
    # (2 x 4 + 0, + 1); the fourth two from its second step (3 x 4 + 1, + 2).
    steps = [0, 1, 2, 8, 9, 13, 14]
    assert golden == [step for step in steps for _ in range(CONFIG.width)]


def test_a_model_in_process_behind_a_wrapper_gets_the_expansions_as_one_batch(sandbox):
    """The progress counter's wrapper has `submit`, but the model behind it batches: the roots
    of all the trees go in one generate call, as before the priorities (its seeds are drawn per
    call, so splitting the batch would change the samples)."""
    policy = StepPolicy(scripts=SCRIPTS)
    batches = []
    generate = policy.generate
    policy.generate = lambda prompts, params: (
        batches.append(len(prompts)) or generate(prompts, params)
    )
    MCTSSearch(CountingLLM(policy), sandbox, CONFIG, prompt=PROMPT).run(PROBLEMS[:4])
    assert batches[0] == 4
