"""The search engine on a golden tree: a scripted policy whose steps and code outcomes
are fixed, run through the real sandbox (process backend), with visit counts,
Q-values, selections and pairs computed by hand in the comments."""

from __future__ import annotations

import math

from rstar_pipelines.math import mcts as mcts_module
from rstar_pipelines.math.mcts import MCTSConfig, MCTSSearch, Problem, search
from rstar_pipelines.math.pairs import best_trajectories, preference_pairs, trajectories
from rstar_pipelines.math.steps import ANSWER_END, CODE_END, STEP_END, assistant_text
from rstar_pipelines.math.tree import tree_from_rows
from tests.fakes.llm import ArrivingLLM, EveryOrder, StreamingLLM
from tests.fakes.math import (
    OUT5,
    OUT6,
    PROBLEM,
    PROMPT,
    SCRIPT,
    A,
    B,
    C,
    D,
    E,
    F,
    H,
    K,
    ScriptedPPM,
    StepPolicy,
    golden_search,
    padded,
    state,
)
from tests.fakes.sandbox import MemoSandbox


def test_first_rollout(sandbox):
    # Root expands to 0.1 (A), 0.2 (B) and 0.3 (C: ZeroDivisionError, a code-error
    # terminal taking -1 on itself only). 0.1 and 0.2 are unvisited (UCT 0): the tie
    # goes to the first, 0.1. It expands to 0.1.1 (D, output 5) and 0.1.2 (E, NameError);
    # 0.1.1 expands to the answer 5: +1 backed up to 0.1.1, 0.1 and the root. All of
    # 0.1.1's children are terminal, so 0.1.1 becomes terminal and the rollout ends.
    tree = golden_search(sandbox, 1)
    assert tree.rollout_paths == [["0", "0.1", "0.1.1"]]
    assert state(tree) == {
        "0": (1, 1.0),
        "0.1": (1, 1.0),
        "0.1.1": (1, 1.0),
        "0.1.1.1": (1, 1.0),
        "0.1.2": (1, -1.0),
        "0.2": (0, 0.0),
        "0.3": (1, -1.0),
    }
    nodes = {r["node_id"]: r for r in tree.nodes.to_pylist()}
    assert nodes["0.3"]["kind"] == "TOO_MANY_CODE_ERRORS"
    assert nodes["0.3"]["observation"] == "ZeroDivisionError: division by zero"
    assert nodes["0.1.2"]["observation"] == "NameError: name 'z' is not defined"
    assert nodes["0.1.1"]["text"] == D + OUT5
    assert nodes["0.1.1"]["terminal"]  # closed: every child is terminal
    assert nodes["0.1.1.1"]["final_answer"] == "5" and nodes["0.1.1.1"]["correct"]


def test_rollouts_two_to_four(sandbox):
    # Rollout 2: 0.1 has UCT 1 + 2·sqrt(ln 1 / 1) = 1 against 0 for the unvisited 0.2;
    # it is chosen, all its children are terminal, so it closes and the rollout ends
    # having expanded nothing.
    # Rollout 3: 0.1 and 0.3 are terminal, 0.2 is chosen and expands to 0.2.1 (D: 6)
    # and 0.2.2 (H); the tie goes to 0.2.1, whose answer 6 is wrong: -1 to the root.
    # Rollout 4: 0.2 has UCT -1 + 2·sqrt(ln 2 / 1) = 0.665; below it 0.2.1 is closed, so
    # 0.2.2 expands (K: 5), then 0.2.2.1 expands to the answer 5: +1 to the root.
    tree = golden_search(sandbox, 2)
    assert tree.rollout_paths == [["0", "0.1", "0.1.1"], []]
    assert state(tree)["0"] == (1, 1.0)
    tree = golden_search(sandbox, 4)
    assert tree.rollout_paths == [["0", "0.1", "0.1.1"], [], ["0.2", "0.2.1"], ["0.2.2", "0.2.2.1"]]
    assert state(tree) == {
        "0": (3, round(1 / 3, 6)),
        "0.1": (1, 1.0),
        "0.1.1": (1, 1.0),
        "0.1.1.1": (1, 1.0),
        "0.1.2": (1, -1.0),
        "0.2": (2, 0.0),
        "0.2.1": (1, -1.0),
        "0.2.1.1": (1, -1.0),
        "0.2.2": (1, 1.0),
        "0.2.2.1": (1, 1.0),
        "0.2.2.1.1": (1, 1.0),
        "0.3": (1, -1.0),
    }
    root = tree.root
    assert math.isclose(root.children[1].uct(2.0), 0 + 2 * math.sqrt(math.log(3) / 2))


def test_pairs_of_the_golden_tree(sandbox):
    tree = golden_search(sandbox, 4)
    pairs = preference_pairs(tree, min_margin=0.5, min_edit_distance=5)
    # At the root: chosen 0.1 (Q 1) and 0.2 (Q 0) lead to a correct answer, only 0.2
    # leads to a wrong one, so up to four chosen face it: (0.1, 0.2) has margin 1, and
    # the chosen continuation's mean Q (1) beats the rejected one's (0, -1, -1: -2/3);
    # (0.2, 0.2) has margin 0. At 0.2 (both kinds below): (0.2.2, 0.2.1), margin 2.
    # Final pairs: the correct trajectories (mean Q 1 and 0.75) against the wrong one
    # (mean -2/3).
    step = [
        (p.node_id, p.chosen_step, p.rejected_step, p.margin) for p in pairs if p.kind == "step"
    ]
    assert step == [("0", A, B, 1.0), ("0.2", H, D + OUT6, 2.0)]
    first = pairs[0]
    assert (first.pos_count, first.neg_count) == (2, 1)
    assert first.prompt == "What is 2 + 3?"
    assert first.chosen == assistant_text([A]) and first.rejected == assistant_text([B])
    assert pairs[1].chosen == assistant_text([B, H])
    final = [(p.chosen, p.rejected, round(p.margin, 4)) for p in pairs if p.kind == "final"]
    wrong = B + D + OUT6 + "\n<answer>\\boxed{6}" + ANSWER_END
    assert final == [
        (assistant_text([A + D + OUT5 + F]), assistant_text([wrong]), round(1 + 2 / 3, 4)),
        (assistant_text([B + H + K + OUT5 + F]), assistant_text([wrong]), round(0.75 + 2 / 3, 4)),
    ]
    # The filters: a margin of 1.5 keeps only the pairs above it.
    assert {round(p.margin, 4) for p in preference_pairs(tree, 1.5, 5)} == {2.0, round(5 / 3, 4)}
    assert preference_pairs(tree, 0.5, 10_000) == []


def test_trajectories_and_sft_sample(sandbox):
    tree = golden_search(sandbox, 4)
    found = {t.leaf.node_id: (t.correct, t.q_values) for t in trajectories(tree)}
    assert found == {
        "0.1.1.1": (True, [1.0, 1.0, 1.0]),
        "0.1.2": (False, [1.0, -1.0]),
        "0.2.1.1": (False, [0.0, -1.0, -1.0]),
        "0.2.2.1.1": (True, [0.0, 1.0, 1.0, 1.0]),
        "0.3": (False, [-1.0]),
    }
    best = best_trajectories(tree, n=2)
    assert [t.leaf.node_id for t in best] == ["0.1.1.1", "0.2.2.1.1"]
    assert [t.leaf.node_id for t in best_trajectories(tree, n=1)] == ["0.1.1.1"]


def test_nodes_count_every_generated_token(sandbox):
    # First rollout (see test_first_rollout): the root's three samples are kept as they
    # are; 0.1's duplicate D is folded into 0.1.1; the wrong answer sampled beside F is
    # dropped by the one-answer rule and counted on 0.1.1.1.
    policy = StepPolicy(tokens=None)  # a token a character
    config = MCTSConfig(rollouts=1, width=3, max_depth=4, errors_threshold=1)
    tree = search([PROBLEM], policy, sandbox, config, prompt=PROMPT)[0]
    tokens = {r["node_id"]: r["completion_tokens"] for r in tree.nodes.to_pylist()}
    seven = "\n<answer>\\boxed{7}" + ANSWER_END
    assert tokens == {
        "0": None,
        "0.1": len(A),
        "0.1.1": 2 * len(D),
        "0.1.1.1": len(F) + len(seven),
        "0.1.2": len(E),
        "0.2": len(B),
        "0.3": len(C),
    }
    assert sum(t for t in tokens.values() if t) == policy.generated
    # A tree stored before nodes counted tokens still loads, without the counts.
    old = [{k: v for k, v in r.items() if k != "completion_tokens"} for r in tree.nodes.to_pylist()]
    assert {n.completion_tokens for n in tree_from_rows(old).walk()} == {None}


def test_ppm_initial_value_is_applied_once_to_the_new_node_only(sandbox):
    # With a PPM, each new non-terminal child gets one update with its score (visits 1,
    # Q = score) and nothing else changes. The root is unvisited, so UCT = Q: 0.2
    # (0.25) beats 0.1 (-0.5). 0.2's children 0.2.1 and 0.2.2 score 0; 0.2 has one
    # visit (ln 1 = 0), so the tie goes to 0.2.1, whose answer 6 is wrong: -1 on
    # 0.2.1.1, 0.2.1 (0 - 1 over 2 visits), 0.2 (0.25 - 1 over 2) and the root.
    ppm = ScriptedPPM({A: -0.5, B: 0.25})
    config = MCTSConfig(rollouts=1, width=3, max_depth=4, errors_threshold=1)
    tree = search([PROBLEM], StepPolicy(), sandbox, config, ppm=ppm, prompt=PROMPT)[0]
    assert tree.rollout_paths == [["0", "0.2", "0.2.1"]]
    assert state(tree) == {
        "0": (1, -1.0),
        "0.1": (1, -0.5),
        "0.2": (2, -0.375),
        "0.2.1": (2, -0.5),
        "0.2.1.1": (1, -1.0),
        "0.2.2": (1, 0.0),
        "0.3": (1, -1.0),
    }
    assert tree.root.children[1].value == 0.25  # the first value it was given
    assert [len(c) for c in ppm.calls] == [2, 2]  # non-terminal children only


def test_failure_terminals_do_not_propagate(sandbox):
    tree = golden_search(sandbox, 1)
    failures = [n for n in tree.root.walk() if n.is_failure]
    assert {n.node_id for n in failures} == {"0.3", "0.1.2"}
    # The root saw one terminal backup (+1), none from the two failures.
    assert (tree.root.visits, tree.root.q) == (1, 1.0)


def test_too_many_steps(sandbox):
    # max_depth 1: a rollout takes one step. Rollout 1 expands the root and moves to 0.1,
    # which stays unexpanded; rollout 2 moves to 0.1 for free and expands it: its children
    # are at depth 2, beyond max_depth, so the code step D is a TOO_MANY_STEPS terminal (E,
    # a code error, is one of those first).
    config = MCTSConfig(rollouts=2, width=3, max_depth=1, errors_threshold=1)
    tree = search([PROBLEM], StepPolicy(), sandbox, config, prompt=PROMPT)[0]
    kinds = {r["node_id"]: r["kind"] for r in tree.nodes.to_pylist()}
    assert kinds == {
        "0": "root",
        "0.1": "code",
        "0.1.1": "TOO_MANY_STEPS",
        "0.1.2": "TOO_MANY_CODE_ERRORS",
        "0.2": "code",
        "0.3": "TOO_MANY_CODE_ERRORS",
    }
    assert tree.rollout_paths == [["0"], ["0.1"]]


def test_many_trees_share_batches(sandbox):
    policy = StepPolicy()
    config = MCTSConfig(rollouts=4, width=3, max_depth=4, errors_threshold=1)
    problems = [Problem(f"p{i}", "What is 2 + 3?", "5") for i in range(6)]
    trees = search(problems, policy, sandbox, config, prompt=PROMPT)
    assert all(state(t) == state(trees[0]) for t in trees)
    # The trees move together, and the LLM waits the moment it takes for the trees still
    # running code: every call carries all six.
    assert policy.batches == [6] * len(policy.batches)


def test_a_window_starts_the_next_tree_as_soon_as_one_ends(sandbox):
    policy = StepPolicy()
    config = MCTSConfig(rollouts=4, width=3, max_depth=4, errors_threshold=1)
    problems = [Problem(f"p{i}", "What is 2 + 3?", "5") for i in range(3)]
    ended = []
    search = MCTSSearch(policy, sandbox, config, prompt=PROMPT)
    kept = search.run(problems, window=2, on_tree=lambda i, tree, s: ended.append((i, tree, s)))
    assert kept == []  # each tree was handed over as it ended, and let go
    trees = [tree for _, tree, _ in ended]
    assert all(state(t) == state(trees[0]) for t in trees)
    assert sorted(i for i, _, _ in ended[:2]) == [0, 1] and ended[2][0] == 2
    assert [tree.problem for _, tree, _ in sorted(ended, key=lambda e: e[0])] == problems
    # Two trees at a time, the third started when the first two ended: alone, it has the
    # model to itself.
    assert policy.batches[0] == 2 and max(policy.batches) == 2 and policy.batches[-1] == 1
    assert sum(s for _, _, s in ended) <= search.stats.wall_s


def test_an_early_walk_builds_the_reference_tree(sandbox):
    config = MCTSConfig(rollouts=4, width=3, max_depth=4, errors_threshold=1)
    # The golden tree, and one whose root's third sample is the answer: the walk into the
    # first sample's step (taken before that answer is in) is undone, and the root keeps the
    # answer alone, as the reference's post-filter does.
    for script in (padded(SCRIPT, 3), padded({**SCRIPT, "": [A, B, F]}, 3)):
        reference = search([PROBLEM], StepPolicy(script), sandbox, config, prompt=PROMPT)
        early = MCTSSearch(
            StreamingLLM(StepPolicy(script), delay_s=0.1), sandbox, config, prompt=PROMPT
        )
        [tree] = early.run([PROBLEM])
        assert tree.nodes.to_pylist() == reference[0].nodes.to_pylist()
        assert tree.rollout_paths == reference[0].rollout_paths
    assert [n.node_id for n in tree.root.walk()] == ["0", "0.1"]
    assert early.stats.discarded_nodes >= 3 and early.stats.discarded_tokens > 0


def test_only_a_policy_whose_engine_serves_each_request_walks_early(sandbox):
    # Through the in-process batcher every per-sample request would be a batch of one row with
    # its own prefill: an in-process policy keeps whole expansions, also behind the stages'
    # progress counter (which has `submit` for any LLM); a fleet's walks early behind it too.
    from rstar_pipelines.llm.counting import CountingLLM

    config = MCTSConfig(rollouts=4, width=3, max_depth=4, errors_threshold=1)
    script = padded({**SCRIPT, "": [A, B, F]}, 3)
    in_process = MCTSSearch(CountingLLM(StepPolicy(script)), sandbox, config, prompt=PROMPT)
    reference = search([PROBLEM], StepPolicy(script), sandbox, config, prompt=PROMPT)
    [tree] = in_process.run([PROBLEM])
    assert tree.nodes.to_pylist() == reference[0].nodes.to_pylist()
    assert in_process.stats.discarded_nodes == 0
    fleet = StreamingLLM(StepPolicy(script), delay_s=0.05)
    behind_counter = MCTSSearch(CountingLLM(fleet), sandbox, config, prompt=PROMPT)
    behind_counter.run([PROBLEM])
    assert behind_counter.stats.discarded_nodes >= 3


def every_early_tree(sandbox, monkeypatch, script, config) -> int:
    """Checks the early walk's tree against the lock-step tree in every order its samples can
    arrive in (`ArrivingLLM`); the number of orders played."""
    sandbox = MemoSandbox(sandbox)
    lockstep = config.model_copy(update={"lockstep": True})
    [reference] = search([PROBLEM], StepPolicy(script), sandbox, lockstep, prompt=PROMPT)
    orders, played = EveryOrder(), 0
    while True:
        policy = ArrivingLLM(StepPolicy(script), orders)
        monkeypatch.setattr(mcts_module, "Arrivals", policy.arrivals)
        [tree] = MCTSSearch(policy, sandbox, config, prompt=PROMPT).run([PROBLEM])
        arrivals = [choice for choice, _ in orders.played]
        assert tree.nodes.to_pylist() == reference.nodes.to_pylist(), arrivals
        assert tree.rollout_paths == reference.rollout_paths, arrivals
        played += 1
        if not orders.next():
            return played


# A step that holds an answer but stopped at <end_of_step>: an answer terminal (the parser reads
# `boxed`), which the post-filter does not keep alone (only an <end_of_answer> stop is).
G = "\nSo the answer is \\boxed{6}\n" + STEP_END
# An <end_of_answer> stop without a box: kept alone, yet a code step (it closes the block and
# prints 5) that the walk goes on into.
NOBOX = "\nprint(x)\n" + CODE_END + "\nThe answer is 5" + ANSWER_END
EARLY = MCTSConfig(rollouts=2, width=3, max_depth=4, errors_threshold=1)


def test_a_sample_is_alone_by_its_stop_string_not_its_box(sandbox, monkeypatch):
    # The root's first sample G is an answer (-1) that stopped at <end_of_step>: the others
    # stay beside it, and the rollout walks on into A, the first open child. The walk must
    # not close the root on G alone.
    script = padded({**SCRIPT, "": [G, A, B]}, 3)
    every_early_tree(sandbox, monkeypatch, script, EARLY)
    [tree] = search([PROBLEM], StepPolicy(script), sandbox, EARLY, prompt=PROMPT)
    assert [c.node_id for c in tree.root.children] == ["0.1", "0.2", "0.3"]
    assert tree.rollout_paths[0] == ["0", "0.2", "0.2.1"]


def test_a_later_end_of_answer_sample_discards_a_boxed_first_child(sandbox, monkeypatch):
    # G is attached first, A walked into; then F, stopped at <end_of_answer>, comes in: the
    # post-filter keeps F alone (+1), whatever the first attached child was.
    script = padded({**SCRIPT, "": [G, A, F]}, 3)
    every_early_tree(sandbox, monkeypatch, script, EARLY)
    [tree] = search([PROBLEM], StepPolicy(script), sandbox, EARLY, prompt=PROMPT)
    assert state(tree) == {"0": (1, 1.0), "0.1": (1, 1.0)}


def test_a_late_end_of_answer_step_without_a_box_is_walked_into(sandbox, monkeypatch):
    # A's third sample stopped at <end_of_answer> but holds no box: alone, and open. The walk
    # into A's first sample is undone, and the rollout goes on into A's only child with the
    # steps it had left, as the reference's does.
    script = padded({**SCRIPT, A: [D, E, NOBOX], A + NOBOX + OUT5: [F]}, 3)
    every_early_tree(sandbox, monkeypatch, script, EARLY)
    [tree] = search([PROBLEM], StepPolicy(script), sandbox, EARLY, prompt=PROMPT)
    assert tree.rollout_paths[0] == ["0", "0.1", "0.1.1"]
    assert tree.root.children[0].children[0].text == NOBOX + OUT5
    assert state(tree)["0.1.1.1"] == (1, 1.0)


def test_early_trees_are_the_lockstep_trees_in_every_arrival_order(sandbox, monkeypatch):
    # Small trees, every order their samples can arrive in: the golden tree, answers of
    # both stop strings beside and among open steps, and answers that come in late beside
    # a deeper walk's (backed up in the reference's order: it sets the ancestors' first value).
    config = EARLY.model_copy(update={"rollouts": 3})
    scripts = [
        padded(SCRIPT, 3),
        padded({**SCRIPT, "": [A, B, F]}, 3),
        padded({**SCRIPT, "": [A, G, B], A: [D, G, E]}, 3),
        padded({**SCRIPT, "": [B, A, G], B: [H, D, F]}, 3),
    ]
    played = [every_early_tree(sandbox, monkeypatch, s, config) for s in scripts]
    assert min(played) > 1


def backed_up_visits_add_up(node) -> bool:
    """Every open node's visits are its children's backups: answers' rewards reach every
    ancestor, a failure's -1 stays on the failure (nothing a rollout held on the way is left)."""
    if not node.children:
        return True
    below = sum(child.visits for child in node.children if not child.is_failure)
    return node.visits == below and all(backed_up_visits_add_up(ch) for ch in node.children)


def test_overlapping_rollouts_expand_apart_and_keep_the_tree_whole(sandbox):
    # Two rollouts at once in the golden tree: the second waits for the first's root
    # expansion, then walks into the child the first is not in (0.2, B, by UCT a tie with
    # 0.1), so both expansions are in flight together, where the reference expands A's
    # subtree first and B's only in its third rollout.
    config = MCTSConfig(rollouts=4, width=3, max_depth=4, errors_threshold=1)
    script = padded(SCRIPT, 3)
    overlapping = config.model_copy(update={"rollouts_in_flight": 2})
    policy = StepPolicy(script)
    search = MCTSSearch(StreamingLLM(policy, delay_s=0.05), sandbox, overlapping, prompt=PROMPT)
    [tree] = search.run([PROBLEM])
    assert policy.events[0][1] == "" and {steps for _, steps in policy.events[1:3]} == {A, B}
    reference = StepPolicy(script)
    search_reference = MCTSSearch(StreamingLLM(reference, 0.05), sandbox, config, prompt=PROMPT)
    search_reference.run([PROBLEM])
    expanded = list(dict.fromkeys(steps for _, steps in reference.events))
    assert expanded[:3] == ["", A, A + D + OUT5] and B in expanded
    # Each node expanded once (no two rollouts expanded one node), every rollout kept.
    prompts = [steps for _, steps in policy.events]
    assert len(prompts) == len(set(prompts))
    assert len(tree.rollout_paths) == 4
    ids = [n.node_id for n in tree.root.walk()]
    assert len(ids) == len(set(ids))
    assert backed_up_visits_add_up(tree.root)
    assert {n.final_answer for n in tree.answers()} == {"5", "6"}


def test_overlapping_rollouts_over_an_in_process_policy_and_in_lockstep(sandbox):
    # The same rules where expansions are batched: every tree finishes its rollouts whole.
    problems = [Problem(f"p{i}", "What is 2 + 3?", "5") for i in range(3)]
    for lockstep in (False, True):
        config = MCTSConfig(
            rollouts=4, width=3, max_depth=4, errors_threshold=1, rollouts_in_flight=3,
            lockstep=lockstep,
        )  # fmt: skip
        trees = search(problems, StepPolicy(padded(SCRIPT, 3)), sandbox, config, prompt=PROMPT)
        for tree in trees:
            assert len(tree.rollout_paths) == 4 and backed_up_visits_add_up(tree.root)
            assert state(tree) == state(trees[0])
