"""What a searched tree teaches (docs/rstar-math.md): its trajectories with per-step Q-values
(SFT data) and step-level preference pairs for the process preference model.

Leaves are labelled as the reference does: an answer leaf with Q = 1 is correct, one
with Q = -1 is wrong; failure leaves (code errors, too many steps) are neither, and
subtrees with no answer leaf are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean

from rapidfuzz.distance import Levenshtein

from rstar_pipelines.math.mcts import Tree
from rstar_pipelines.math.steps import TOO_MANY_CODE_ERRORS, assistant_text
from rstar_pipelines.math.tree import Node


@dataclass(frozen=True)
class Trajectory:
    """A root-to-leaf path ending in an answer or a code-error leaf."""

    leaf: Node

    @property
    def nodes(self) -> list[Node]:
        return self.leaf.path()[1:]

    @property
    def steps(self) -> list[str]:
        return [n.text for n in self.nodes]

    @property
    def q_values(self) -> list[float]:
        return [n.q for n in self.nodes]

    @property
    def correct(self) -> bool:
        return self.leaf.is_answer and self.leaf.q == 1.0

    @property
    def text(self) -> str:
        return "".join(self.steps)


def trajectories(tree: Tree) -> list[Trajectory]:
    """Every path to an answer leaf or a code-error leaf, depth first."""
    return [
        Trajectory(n)
        for n in tree.root.walk()
        if n.terminal and (n.is_answer or n.kind == TOO_MANY_CODE_ERRORS)
    ]


def best_trajectories(tree: Tree, n: int = 2) -> list[Trajectory]:
    """The SFT sample of a tree (docs/rstar-math.md): correct trajectories ranked by mean, then
    minimum Q; the top `n`, less any whose text mentions "error" (dropped after the
    cut, as the reference does, so a tree may give fewer than `n`)."""
    correct = [t for t in trajectories(tree) if t.correct]
    ranked = sorted(correct, key=lambda t: (fmean(t.q_values), min(t.q_values)), reverse=True)
    return [t for t in ranked[:n] if "error" not in t.text.lower()]


@dataclass(frozen=True)
class Pair:
    """One preference pair. `kind` "step": two next steps after the same prefix;
    "final": two whole trajectories. `chosen`/`rejected` are the assistant texts the
    PPM scores (preamble, prefix, step)."""

    kind: str
    node_id: str  # the node the two steps follow (the root for final pairs)
    prompt: str
    chosen: str
    rejected: str
    chosen_step: str
    rejected_step: str
    margin: float
    chosen_q: float
    rejected_q: float
    pos_count: int
    neg_count: int
    edit_distance: int


class _Labels:
    """Correct and wrong answer leaves below each node of a tree."""

    def __init__(self, tree: Tree):
        self.correct: dict[Node, int] = {}
        self.wrong: dict[Node, int] = {}
        self._count(tree.root)

    def _count(self, node: Node) -> None:
        correct = int(node.is_answer and node.q == 1.0)
        wrong = int(node.is_answer and node.q == -1.0)
        for child in node.children:
            self._count(child)
            correct += self.correct[child]
            wrong += self.wrong[child]
        self.correct[node], self.wrong[node] = correct, wrong

    def answered(self, node: Node) -> bool:
        return self.correct[node] + self.wrong[node] > 0


def _continuation(node: Node, labels: dict[Node, int], pick) -> list[Node]:
    """The greedy path from `node` to a leaf through children that still lead to a
    leaf of the wanted label, choosing by Q with `pick` (max or min)."""
    path = [node]
    while True:
        options = [c for c in path[-1].children if labels[c] > 0]
        if not options:
            return path
        path.append(pick(options, key=lambda c: c.q))


def preference_pairs(
    tree: Tree, min_margin: float = 0.5, min_edit_distance: int = 20, final_pairs: bool = True
) -> list[Pair]:
    """Step pairs by the reference's rule (docs/rstar-math.md) and, with `final_pairs`, pairs of
    whole trajectories (the paper's; the released code makes step pairs only).

    At each node, breadth first: chosen = the top-2 children by Q with a correct answer
    below, rejected = the bottom-2 with a wrong answer below; when one side has a single
    child the other takes up to 4. A pair needs a positive Q margin and a better mean Q
    along the chosen step's greedy continuation than along the rejected one's. The
    search recurses into every child with both kinds of answer below. Final pairs: the
    two correct trajectories with the highest mean Q against the two wrong ones with
    the lowest. Pairs under `min_margin` or whose two steps are closer than
    `min_edit_distance` characters are dropped (the reference's sampling filters)."""
    labels = _Labels(tree)
    question = tree.problem.question
    pairs: list[Pair] = []
    queue = [tree.root]
    while queue:
        node = queue.pop(0)
        children = [c for c in node.children if labels.answered(c)]
        good = sorted((c for c in children if labels.correct[c]), key=lambda c: -c.q)
        bad = sorted((c for c in children if labels.wrong[c]), key=lambda c: c.q)
        chosen = good[: 4 if len(bad) == 1 else 2]
        rejected = bad[: 4 if len(good) == 1 else 2]
        for c in chosen:
            for r in rejected:
                margin = c.q - r.q
                better = fmean(n.q for n in _continuation(c, labels.correct, max)) > fmean(
                    n.q for n in _continuation(r, labels.wrong, min)
                )
                if margin > 0 and better:
                    prefix = node.steps()
                    pairs.append(
                        _pair(
                            "step",
                            node,
                            question,
                            prefix,
                            c.text,
                            r.text,
                            margin,
                            (c.q, r.q),
                            (len(chosen), len(rejected)),
                        )
                    )
        queue.extend(c for c in children if labels.correct[c] and labels.wrong[c])
    if final_pairs:
        pairs.extend(_final_pairs(tree, question))
    return [p for p in pairs if p.margin >= min_margin and p.edit_distance >= min_edit_distance]


def _final_pairs(tree: Tree, question: str) -> list[Pair]:
    answered = [t for t in trajectories(tree) if t.leaf.is_answer]
    by_mean = sorted(answered, key=lambda t: fmean(t.q_values), reverse=True)
    good = [t for t in by_mean if t.correct][:2]
    bad = [t for t in reversed(by_mean) if t.leaf.q == -1.0][:2]
    return [
        _pair(
            "final",
            tree.root,
            question,
            [],
            g.text,
            b.text,
            fmean(g.q_values) - fmean(b.q_values),
            (fmean(g.q_values), fmean(b.q_values)),
            (len(good), len(bad)),
        )
        for g in good
        for b in bad
    ]


def _pair(kind, node, question, prefix, chosen_step, rejected_step, margin, qs, counts) -> Pair:
    return Pair(
        kind=kind,
        node_id=node.node_id,
        prompt=question,
        chosen=assistant_text([*prefix, chosen_step]),
        rejected=assistant_text([*prefix, rejected_step]),
        chosen_step=chosen_step,
        rejected_step=rejected_step,
        margin=margin,
        chosen_q=qs[0],
        rejected_q=qs[1],
        pos_count=counts[0],
        neg_count=counts[1],
        edit_distance=Levenshtein.distance(chosen_step, rejected_step),
    )
