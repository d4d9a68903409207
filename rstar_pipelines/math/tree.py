"""Search-tree nodes and the rStar-Math rules on them: UCT selection, reward backup,
and the node table every tree is stored as."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from rstar_pipelines.math.steps import FAILURES


@dataclass(eq=False)
class Node:
    """One step of a solution. `node_id` is the reference's dotted tag: the root is
    "0", its children "0.1", "0.2", ... in generation order."""

    node_id: str
    parent: Node | None
    depth: int
    text: str = ""
    kind: str = "root"
    action: str = ""  # the step as generated, without any appended output
    observation: str | None = None
    terminal: bool = False
    final_answer: str | None = None
    correct: bool | None = None
    consecutive_errors: int = 0
    visits: int = 0
    value_sum: float = 0.0
    value: float | None = None
    # The tokens of the completions this step came from: its own, plus those of the
    # samples of the same expansion that the post-filter folded into it, so that a tree's
    # nodes sum to every token its search generated.
    completion_tokens: int | None = None
    children: list[Node] = field(default_factory=list)

    @property
    def q(self) -> float:
        return self.value_sum / self.visits if self.visits else 0.0

    @property
    def is_answer(self) -> bool:
        return self.kind == "answer"

    @property
    def is_failure(self) -> bool:
        return self.kind in FAILURES

    def update(self, reward: float) -> None:
        if self.value is None:
            self.value = reward
        self.visits += 1
        self.value_sum += reward

    def backup(self, reward: float) -> None:
        """A terminal answer's reward, on itself and every ancestor up to the root."""
        node: Node | None = self
        while node is not None:
            node.update(reward)
            node = node.parent

    def uct(self, c: float) -> float:
        """Q + c·sqrt(ln N(parent) / N). The reference's detail: an unvisited node
        scores 0 (no exploration bonus), and so does any node of an unvisited parent
        beyond its Q — so a PPM's initial values decide the first visits."""
        parent_visits = self.parent.visits if self.parent else 0
        if self.visits == 0:
            return 0.0
        if parent_visits == 0:
            return self.q
        return self.q + c * math.sqrt(math.log(parent_visits) / self.visits)

    def path(self) -> list[Node]:
        """Root to this node."""
        nodes: list[Node] = []
        node: Node | None = self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def steps(self) -> list[str]:
        """The texts of the steps from the root's first child to this node."""
        return [n.text for n in self.path()[1:]]

    def walk(self) -> Iterator[Node]:
        """This node and its descendants, depth first in generation order."""
        yield self
        for child in self.children:
            yield from child.walk()

    def row(self) -> dict:
        return {
            "node_id": self.node_id,
            "parent_id": self.parent.node_id if self.parent else None,
            "depth": self.depth,
            "text": self.text,
            "kind": self.kind,
            "observation": self.observation,
            "terminal": self.terminal,
            "final_answer": self.final_answer,
            "correct": self.correct,
            "visits": self.visits,
            "q": self.q,
            "value": self.value,
            "completion_tokens": self.completion_tokens,
        }


def select_child(node: Node, c: float, busy: Mapping[Node, int] | None = None) -> Node | None:
    """The non-terminal child with the highest UCT, ties to the first generated; None when
    every child is terminal. With `busy` (how many other rollouts are in each node), the
    children fewest of them are in first, UCT among those."""
    best, best_score = None, (-math.inf, -math.inf)
    for child in node.children:
        if child.terminal:
            continue
        score = (-(busy or {}).get(child, 0), child.uct(c))
        if score > best_score:
            best, best_score = child, score
    return best


def step_down(node: Node, c: float, busy: Mapping[Node, int] | None = None) -> Node | None:
    """One level of the reference's selection: from an expanded node, its best child (or, when
    every child is terminal, None, and the node becomes terminal); an unexpanded open node
    stays where it is; None from a terminal node. `busy` as select_child's."""
    if node.children or node.terminal:
        child = select_child(node, c, busy)
        if child is None:
            node.terminal = True
            return None
        node = child
    return None if node.terminal else node


def tree_from_rows(rows: list[dict]) -> Node:
    """Rebuild a stored tree (rows of the node table, parents before children) and
    return its root. Rows stored before nodes counted tokens have no completion_tokens."""
    nodes: dict[str, Node] = {}
    root = None
    for row in rows:
        parent = nodes[row["parent_id"]] if row["parent_id"] is not None else None
        node = Node(
            row["node_id"],
            parent,
            row["depth"],
            text=row["text"],
            kind=row["kind"],
            observation=row["observation"],
            terminal=row["terminal"],
            final_answer=row["final_answer"],
            correct=row["correct"],
            visits=row["visits"],
            value_sum=row["q"] * row["visits"],
            value=row["value"],
            completion_tokens=row.get("completion_tokens"),
        )
        nodes[node.node_id] = node
        if parent is None:
            root = node
        else:
            parent.children.append(node)
    if root is None:
        raise ValueError("a stored tree needs its root row (parent_id null)")
    return root
