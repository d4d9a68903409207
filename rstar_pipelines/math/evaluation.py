"""Choosing a searched tree's final answer (docs/rstar-math.md) and the greedy baseline."""

from __future__ import annotations

from rstar_pipelines.math.answers import majority_answer
from rstar_pipelines.math.mcts import MCTSConfig, Tree
from rstar_pipelines.math.steps import ANSWER_END, CODE_END
from rstar_pipelines.math.tree import Node


def ranked_answers(tree: Tree) -> list[str]:
    """The final answers of the tree's answer leaves, highest Q first, ties broken as the
    reference's evaluation breaks them: it reads the tree level by level, each level's nodes
    sorted by Q (stably, from their parents' order), collects the answer leaves in that order
    and sorts them by Q stably, so the shallowest tied leaf wins."""
    leaves: list[Node] = []
    level = [tree.root]
    while level:
        level = sorted((c for n in level for c in n.children), key=lambda n: n.q, reverse=True)
        leaves.extend(n for n in level if n.is_answer and n.final_answer)
    leaves.sort(key=lambda n: n.q, reverse=True)
    return [n.final_answer for n in leaves]


def best_q_answer(tree: Tree) -> str | None:
    """The answer of the leaf with the highest Q (the reference's `q_value` strategy)."""
    ranked = ranked_answers(tree)
    return ranked[0] if ranked else None


def top_answers_vote(tree: Tree, top: int = 4) -> str | None:
    """Majority vote, by answer equivalence, over the `top` highest-Q answers."""
    return majority_answer(ranked_answers(tree)[:top], threshold=0.0).answer


def all_answers_vote(tree: Tree) -> str | None:
    """Majority vote, by answer equivalence, over every answer the tree found (what is left to
    vote on when nothing values the answers: an evaluation search without a PPM)."""
    answers = [n.final_answer for n in tree.answers() if n.final_answer]
    return majority_answer(answers, threshold=0.0).answer


def greedy_config(search: MCTSConfig) -> MCTSConfig:
    """Greedy decoding as the reference evaluates it (its sft_eval_greedy config), on the
    search engine: one sample at temperature 0, the whole program in one step (it stops only
    at the end of the code and of the answer), its output, then the answer; three code
    errors allowed."""
    return search.model_copy(
        update={
            "rollouts": 1,
            "width": 1,
            "temperature": 0.0,
            "stop": (CODE_END, ANSWER_END),
            "max_depth": 2,
            "max_tokens": search.max_tokens * 4,
            "errors_threshold": 3,
        }
    )
