"""Monte-Carlo tree search over code-augmented chain-of-thought (rStar-Math,
docs/rstar-math.md), with the reference's rules by default.

A rollout starts at the root and walks down the best children by UCT, one level a step, at
most `max_depth` steps; at a node not yet expanded it samples `width` next steps from the
policy, runs their code, scores the new nodes with the PPM (when there is one), and walks on
into the best new child. It ends when every child of the node it reached is terminal (that
node becomes terminal) or its steps are spent. There is no random simulation phase. Answer
terminals back ±1 up to the root; failure terminals take -1 on themselves only. A problem
without an answer is searched in evaluation mode: the PPM's value of an answer step is backed
up instead, and the gold answer is never read.

Many trees are searched at once. Each tree is a generator that yields what it waits
for (completions, program runs, PPM scores); the scheduler sends every pending request
of a kind together to the policy (through `llm.types.submit`, one future per prompt),
the sandbox or the PPM, and resumes a tree as soon as its own answer is back: a tree is
never held for the slowest one (unless `lockstep`, the reference's schedule, kept for
comparison). A policy that takes prompts one by one (`AsyncLLM`: the openai backend over a
fleet of servers) gets each expansion as soon as its tree asks; one that batches
`generate` calls gets what is pending while its previous call runs. Over such a policy and
without a PPM, each sample is a request of its own and a rollout walks on as soon as the
samples that decide its next step are in (TreeSearch: the tree stays the reference's).

How many trees are open: over a fleet (a policy that reports its spare capacity,
`llm.types.spare_capacity`) another tree opens whenever the fleet's windows have room, so the
fleet decides (the client wakes the search when a window grows: `llm.types.on_room`), and the
trees left open at once when they are no more than the open ones; every tree at once over an
in-process policy and in lock-step. Either way at most what `memory_mb` holds
(`open_trees_bound`: that budget over the most one tree can hold) and at most `window` where
one is declared. Each tree is handed to `on_tree` when it ends (the search stages commit
it to the item cache then) and let go, so memory stays bounded whatever the number of problems.
Over a fleet each expansion goes with how far its tree has gone as its priority (the client
sends what waits for room lowest first): the trees with the most steps left go first, the last
trees opened among them, so the trees end together instead of the longest few finishing their
chains alone while the fleet drains.

Where trees are fewer than the fleet has slots, one rollout at a time leaves it idle: a tree's
steps are a chain. `rollouts_in_flight` above 1 (a declared departure; 1, the default, is the
reference) starts a tree's next rollout before the previous one's backup: each walks into the
children fewest of the others are in, waits for an expansion another has under way rather than
repeat it, and expands whole (one request of `width` samples, sharing its prefix). The trees
differ from the reference's: rollouts spread over siblings that the reference would visit one
after the other, choosing by values not yet backed up.

    trees = search(problems, policy=llm, sandbox=sb, config=MCTSConfig(rollouts=8))
    trees[0].nodes  # the node table
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from rstar_pipelines.llm.coroutines import (
    BYTES_PER_TOKEN,
    OPEN_MEMORY_MB,
    Arrivals,
    Window,
    memory_bound,
)
from rstar_pipelines.llm.types import (
    LLM,
    AsyncLLM,
    Completion,
    Prompt,
    SamplingParams,
    serves_each_request,
    spare_capacity,
    submit,
)
from rstar_pipelines.math.answers import equivalent
from rstar_pipelines.math.interpreter import interpreter_program, reference_program
from rstar_pipelines.math.steps import (
    ANSWER_END,
    BOOTSTRAP_STOPS,
    CODE_END,
    MAX_OBSERVATION_CHARS,
    NO_VALID_CHILD,
    OUTPUT_END,
    OUTPUT_START,
    TOO_MANY_CODE_ERRORS,
    TOO_MANY_STEPS,
    ParsedStep,
    assistant_text,
    is_error,
    observation_of,
    parse_step,
    program_of,
    with_output,
)
from rstar_pipelines.math.tree import Node, step_down
from rstar_pipelines.storage.schemas import NODE


class MCTSConfig(BaseModel):
    """Search knobs; defaults are the paper's bootstrap round (docs/rstar-math.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rollouts: int = Field(8, ge=1)
    width: int = Field(5, ge=1, description="steps sampled per expansion")
    max_depth: int = Field(16, ge=1, description="a step at this depth must be the answer")
    c: float = Field(2.0, ge=0, description="UCT exploration constant")
    errors_threshold: int = Field(
        2,
        ge=1,
        description="consecutive failed code steps that end a branch (2 bootstrap, 1 later)",
    )
    error_rule: Literal["substring", "status"] = Field(
        "substring",
        description="substring: the reference's test for 'error' in the output; "
        "status: the run's exit status",
    )
    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(2048, ge=1, description="per step")
    stop: tuple[str, ...] = BOOTSTRAP_STOPS
    seed: int | None = Field(None, ge=0)
    exec_timeout_s: float = Field(30.0, gt=0)
    exec_memory_mb: int = Field(512, gt=0)
    lockstep: bool = Field(
        False, description="one batch per phase for all trees, as the reference schedules"
    )
    # Where the reference's released code and ours could differ; each default is the
    # reference's rule (docs/rstar-math.md, "Reference rules and their options").
    timed_out_steps: Literal["rerun", "skip"] = Field(
        "rerun",
        description="rerun: later steps' programs re-run a step that timed out (the reference, "
        "whose check for it never fires); skip: leave it out of them",
    )
    empty_box: Literal["step", "wrong_answer"] = Field(
        "step",
        description="a step whose \\boxed{} gives no answer: an ordinary step without code "
        "(the reference), or a wrong answer",
    )
    answers: Literal["reference", "last_box"] = Field(
        "reference",
        description="how an answer step's answer is read: the reference's rule (the text "
        "before the first '.\\n', its last \\boxed{ even unclosed); last_box: the last "
        "closed box, as math-verify reads it",
    )
    blank_samples: Literal["keep", "drop"] = Field(
        "keep",
        description="a blank sample: kept as an empty code step (the reference), or dropped",
    )
    execution: Literal["interpreter", "script"] = Field(
        "interpreter",
        description="interpreter: a step's program and observation as the reference's Python "
        "tool makes them (tag lines dropped, each printing segment's output labelled); script: "
        "the tags cut out in place, run as a script, its stdout (or last error line) shown",
    )
    error_output: Literal["reference", "once"] = Field(
        "reference",
        description="the text of a code-error terminal that closed its block: its output "
        "wrapped in <output> twice (the reference's slip), or once",
    )
    rollouts_in_flight: int = Field(
        1,
        ge=1,
        description="a tree's rollouts under way at once. 1: each starts after the previous "
        "one's backup (the reference). More (a departure, for fleets with more slots than open "
        "trees): a rollout walks into the children fewest other rollouts are in (UCT among "
        "those), waits for an expansion another one has under way, and expands whole",
    )
    dedupe: Literal["text", "text_and_stop"] = Field(
        "text",
        description="duplicate samples: the same text (the reference; the first one's stop "
        "string stays), or the same text and stop string",
    )

    def sampling(self, call: int) -> SamplingParams:
        seed = None if self.seed is None else self.seed + call
        return SamplingParams(
            n=self.width,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_tokens,
            stop=self.stop,
            seed=seed,
        )


# A node's object, its dict and its numbers; a prompt in flight per expansion.
NODE_OVERHEAD_BYTES = 1024


def tree_bytes(config: MCTSConfig) -> int:
    """The most one tree of `config` holds while it is open: every expansion of every rollout
    adding `width` children whose step runs to max_tokens (kept twice: as generated, and with
    its output) with an observation at its cap, and the prompt of one expansion in flight (the
    question aside: it is held once for the tree's problem)."""
    nodes = 1 + config.rollouts * config.max_depth * config.width
    step = config.max_tokens * BYTES_PER_TOKEN
    node = 2 * step + 2 * MAX_OBSERVATION_CHARS + NODE_OVERHEAD_BYTES
    prompt = config.max_depth * (step + MAX_OBSERVATION_CHARS)
    return nodes * node + config.width * prompt


def open_trees_bound(config: MCTSConfig, memory_mb: float) -> int:
    """How many trees of `config` may be open at once in `memory_mb` (at least one)."""
    return memory_bound(tree_bytes(config), memory_mb)


@dataclass(frozen=True)
class Problem:
    """A problem to search. Without an answer the search is in evaluation mode: it never
    knows the gold answer, and the PPM's value of an answer step is backed up as its reward
    (the reference's evaluation mode); without a PPM too, answers get no value."""

    id: str
    question: str
    answer: str | None = None


class ValueModel(Protocol):
    """A process preference model: one value in [-1, 1] per (partial) solution prompt."""

    def score(self, prompts: Sequence[Prompt]) -> list[float]: ...


class Sandbox(Protocol):
    def run(self, jobs: Sequence[Any]) -> list[Any]: ...


@dataclass(frozen=True)
class StepPrompt:
    """How a tree's state becomes the policy's prompt. Raw: `prefix(question)` followed
    by the steps so far (the bootstrap round's few-shot prompt). Chat: the user message
    `prefix(question)` and an assistant turn to continue, the preamble and the steps so
    far (a policy trained on our SFT data; the PPM scores the same prompt)."""

    prefix: Callable[[str], str]
    chat: bool = False

    def build(self, question: str, steps: Sequence[str]) -> Prompt:
        if self.chat:
            return [
                {"role": "user", "content": self.prefix(question)},
                {"role": "assistant", "content": assistant_text(steps)},
            ]
        return self.prefix(question) + "".join(steps)


DEFAULT_PROMPT = StepPrompt(lambda q: f"Question: {q}\n")


@dataclass(eq=False)
class Tree:
    problem: Problem
    root: Node
    rollout_paths: list[list[str]] = field(default_factory=list)

    @property
    def nodes(self) -> pa.Table:
        """node_id, parent_id, depth, text, kind, observation, terminal, final_answer,
        correct, visits, q, value, completion_tokens: one row per node, depth first."""
        return pa.Table.from_pylist(
            [n.row() for n in self.root.walk()], schema=pa.schema(list(NODE))
        )

    def answers(self) -> list[Node]:
        return [n for n in self.root.walk() if n.is_answer]

    @property
    def completion_tokens(self) -> int:
        """Every token of the tree's nodes (nodes stored without a count add none): all the
        search generated, but for a walk the early search undid (`SearchStats.discarded_tokens`,
        and the samples it withdrew)."""
        return sum(n.completion_tokens or 0 for n in self.root.walk())


@dataclass
class SearchStats:
    expansions: int = 0
    llm_calls: int = 0
    # Trees open as LLM requests go out, summed and at most: counters, not a list per call,
    # so a search's stats stay the same size however long it runs.
    open_trees_requests: int = 0
    open_trees_sum: int = 0
    open_trees_most: int = 0
    sandbox_calls: int = 0
    programs_run: int = 0
    ppm_calls: int = 0
    llm_s: float = 0.0
    sandbox_s: float = 0.0
    ppm_s: float = 0.0
    engine_s: float = 0.0  # the search's own work: tree rules, answer checks, scheduling
    # What an early walk did below a node whose later samples held an answer (TreeSearch).
    discarded_nodes: int = 0
    discarded_tokens: int = 0
    wall_s: float = 0.0

    @property
    def mean_llm_batch(self) -> float:
        return self.expansions / self.llm_calls if self.llm_calls else 0.0

    @property
    def mean_open_trees(self) -> float:
        return self.open_trees_sum / self.open_trees_requests if self.open_trees_requests else 0.0

    def requested(self, open_trees: int) -> None:
        """An LLM request went out while `open_trees` trees were open."""
        self.open_trees_requests += 1
        self.open_trees_sum += open_trees
        self.open_trees_most = max(self.open_trees_most, open_trees)

    def as_dict(self) -> dict:
        return {
            "expansions": self.expansions,
            "llm_calls": self.llm_calls,
            "mean_llm_batch": self.mean_llm_batch,
            "sandbox_calls": self.sandbox_calls,
            "programs_run": self.programs_run,
            "ppm_calls": self.ppm_calls,
            "llm_s": self.llm_s,
            "sandbox_s": self.sandbox_s,
            "ppm_s": self.ppm_s,
            "engine_s": self.engine_s,
            "wall_s": self.wall_s,
            "discarded_nodes": self.discarded_nodes,
            "discarded_tokens": self.discarded_tokens,
        }


# What a tree waits for. An expansion carries how far its tree has gone (`TreeSearch.progress`).
@dataclass
class _Generate:
    prompt: Prompt
    progress: int


@dataclass
class _Sample:
    """The expansion's `width` samples as requests of their own: answered at once with a
    future per sample, which the tree then waits for one by one (`_Wait`)."""

    prompt: Prompt
    progress: int


@dataclass
class _Wait:
    future: Future


@dataclass
class _Execute:
    programs: list[str]


@dataclass
class _Score:
    prompts: list[Prompt]


_Request = _Generate | _Sample | _Wait | _Execute | _Score
_Search = Generator[_Request, Any, None]

# The least time a model lane holds a partial batch for trees still running code.
MIN_GATHER_S = 0.05


@dataclass
class _Unsettled:
    """An expansion the walk went past before all its samples were in."""

    node: Node
    samples: list[Future]
    received: list[Completion]
    steps_left: int  # the rollout's steps after this expansion's
    # Its first <end_of_answer> sample is in: nothing later can change its child, only that
    # child's token count, so nothing waits for the rest before the tree ends.
    decided: bool = False


class TreeSearch:
    """The rules of one tree (docs/rstar-math.md), written as a generator of requests.

    With `early` (no PPM, and a policy that takes prompts one by one), a rollout does not wait
    for all the samples of a node it expands: the reference walks on into the node's first open
    child, which is known once that sample and the ones before it are in (new open children are
    unvisited, so their UCT ties at 0 and goes to the first). A later sample can still change
    it: one that stopped at <end_of_answer> is left as the only child (by its stop string, not
    by a box in its text). So the walk goes on speculatively, the rest of the samples are
    attached in order when the rollout ends, and such a sample among them discards what the
    walk did below that node, which the rollout then walks on from as the reference's did. The
    rollout's answers back up their rewards then, in the order the reference's expansions gave
    them (shallowest first). The tree is the reference's."""

    def __init__(
        self,
        tree: Tree,
        config: MCTSConfig,
        prompt: StepPrompt,
        with_ppm: bool,
        early: bool = False,
        stats: SearchStats | None = None,
    ):
        self.tree = tree
        self.config = config
        self.prompt = prompt
        self.with_ppm = with_ppm
        self.evaluating = tree.problem.answer is None
        self.early = early and not with_ppm and config.rollouts_in_flight == 1
        self.stats = stats or SearchStats()
        self.unsettled: list[_Unsettled] = []
        self.path: list[str] = []  # the node ids the current rollout expanded
        # The nodes an early walk undid, held (not their ids, which new nodes can reuse).
        self.gone: set[Node] = set()
        self.rewards: list[tuple[Node, float]] = []  # answers' rewards, backed up when settled
        # Overlapping rollouts: how many are in each node, the expansions under way.
        self.busy: dict[Node, int] = {}
        self.expanding: dict[Node, Future] = {}
        self.started = 0

    def searches(self) -> list[_Search]:
        """The tree's first searches: its rollouts one after another (`run`), or with
        `rollouts_in_flight` the first that many rollouts (`next_rollout` gives the others)."""
        if self.config.rollouts_in_flight == 1:
            return [self.run()]
        firsts = (self.next_rollout() for _ in range(self.config.rollouts_in_flight))
        return [rollout for rollout in firsts if rollout is not None]

    def next_rollout(self) -> _Search | None:
        """Another overlapping rollout, while the budget lasts and the root is open."""
        config = self.config
        if config.rollouts_in_flight == 1 or self.started == config.rollouts:
            return None
        if self.tree.root.terminal:
            return None
        self.started += 1
        return self._overlapping_rollout()

    def _overlapping_rollout(self) -> _Search:
        """One rollout beside others in the same tree: the reference's walk, with each step's
        child chosen away from the other rollouts (select_child's `busy`); a node another
        rollout is expanding is waited for, then walked on from."""
        path: list[str] = []
        self.tree.rollout_paths.append(path)
        entered: list[Node] = []
        node = step_down(self.tree.root, self.config.c, self.busy)
        try:
            for _ in range(self.config.max_depth):
                if node is None:
                    break
                entered.append(node)
                self.busy[node] = self.busy.get(node, 0) + 1
                if node in self.expanding:
                    yield _Wait(self.expanding[node])
                elif not node.children:
                    path.append(node.node_id)
                    yield from self._expand_alone(node)
                node = step_down(node, self.config.c, self.busy)
        finally:
            for left in entered:
                self.busy[left] -= 1

    def _expand_alone(self, node: Node) -> _Search:
        """Expand `node`, with a future the other rollouts that reach it wait for."""
        expanded: Future = Future()
        self.expanding[node] = expanded
        try:
            yield from self.expand(node, 0)
        finally:
            del self.expanding[node]
            if not expanded.done():  # a withdrawn run cancels it
                expanded.set_result(None)

    def run(self) -> _Search:
        """`rollouts` rollouts, each of at most `max_depth` steps (the reference's budget): a
        step expands the node reached, if it has no children yet, and moves on to its best
        child; the first move, from the root, is free."""
        root = self.tree.root
        for _ in range(self.config.rollouts):
            if root.terminal:
                break  # every branch is closed
            self.path: list[str] = []
            self.tree.rollout_paths.append(self.path)
            yield from self._walk(step_down(root, self.config.c), self.config.max_depth)
            yield from self._settle()
        yield from self._settle(final=True)

    def _walk(self, node: Node | None, steps: int) -> _Search:
        """At most `steps` steps of a rollout from `node`."""
        for step in range(steps):
            if node is None:
                break
            if not node.children:
                self.path.append(node.node_id)
                yield from self.expand(node, steps - step - 1)
            node = step_down(node, self.config.c)

    def progress(self, steps_left: int) -> int:
        """How far the tree has gone, in rollout steps, at an expansion with `steps_left` steps
        of its rollout after it: every step of the rollouts before, and this rollout's up to
        here. The work left is about the budget less this (an early answer ends a rollout and
        skips ahead), so over a fleet the expansion goes with it as its priority: lowest first,
        the trees with the most left go first and the trees end together, instead of the
        longest few finishing alone on a draining fleet."""
        depth = self.config.max_depth
        return (len(self.tree.rollout_paths) - 1) * depth + depth - 1 - steps_left

    def expand(self, node: Node, steps_left: int) -> _Search:
        prompt = self.prompt.build(self.tree.problem.question, node.steps())
        progress = self.progress(steps_left)
        if self.early:
            samples = yield _Sample(prompt, progress)
            unsettled = _Unsettled(node, samples, [], steps_left)
            self.unsettled.append(unsettled)
            while len(unsettled.received) < len(samples):
                [sample] = yield _Wait(samples[len(unsettled.received)])
                unsettled.received.append(sample)
                at = len(unsettled.received)
                if at < len(samples) and samples[at].done():
                    continue  # decide on every sample already in: fewer walks to undo
                if (yield from self._attach(node, unsettled.received, len(samples))):
                    unsettled.decided = True
                    return  # its first <end_of_answer> sample alone, whatever the rest are
                if any(not child.terminal for child in node.children):
                    return  # the walk goes on into the first open child
            self.unsettled.remove(unsettled)  # every sample in, and no open child
            return
        completions: list[Completion] = yield _Generate(prompt, progress)
        yield from self._attach(node, completions, len(completions))
        # The PPM values every new node still open, and in evaluation mode every new answer too.
        scored = [
            ch
            for ch in node.children
            if not ch.terminal or (self.evaluating and ch.is_answer and ch.visits == 0)
        ]
        if self.with_ppm and scored:
            question = self.tree.problem.question
            values = yield _Score([self.prompt.build(question, ch.steps()) for ch in scored])
            for child, value in zip(scored, values, strict=True):
                if child.is_answer:
                    child.backup(value)  # the PPM's value as the answer's reward, to the root
                else:
                    child.update(value)  # on the new node only: its initial Q

    def _attach(
        self, node: Node, completions: list[Completion], width: int, alone: bool = False
    ) -> Generator[_Request, Any, bool]:
        """The children of `node` from the first of its `width` samples (all of them, or the
        first ones: those already attached are kept, their token counts brought up to date,
        unless a sample that stopped at <end_of_answer> is among them and was not attached
        alone before, `alone`: the post-filter leaves it the only child). Whether the children
        are that sample alone (no later sample can change them)."""
        config = self.config
        kept = _distinct(completions, config.dedupe, config.blank_samples)
        answered = bool(kept) and kept[0][0].stop_string == ANSWER_END
        if answered and not alone and node.children:
            self._discard(node)
        attached = node.children
        for child, (_, tokens) in zip(attached, kept, strict=False):
            child.completion_tokens = tokens
        new = kept[len(attached) :]
        steps = [
            parse_step(c.text, c.stop_string, config.empty_box, config.answers) for c, _ in new
        ]
        code = [s for s in steps if s.kind == "code"]
        history = _open_block(node, config.timed_out_steps)
        runs = (yield _Execute([self._program([*history, s.text]) for s in code])) if code else []
        outcomes = iter(runs)
        for step, (_, tokens) in zip(steps, new, strict=True):
            child = Node(f"{node.node_id}.{len(node.children) + 1}", node, node.depth + 1)
            child.action = step.text
            child.completion_tokens = tokens
            node.children.append(child)
            if step.kind == "answer":
                self._answer(child, step.text, step.final_answer)
            elif step.kind == "code":
                self._code(child, step, next(outcomes))
            else:
                child.text, child.kind = step.text, "text"
                self._depth_limit(child)
        if not kept and len(completions) == width:
            failed = Node(f"{node.node_id}.1", node, node.depth + 1)
            failed.completion_tokens = sum(c.completion_tokens for c in completions)
            self._fail(failed, NO_VALID_CHILD)
        return answered

    def _settle(self, final: bool = False) -> _Search:
        """The samples still coming for this rollout's expansions, attached in order (one that
        stopped at <end_of_answer> discards the walk below, and the rollout walks on from there
        with the steps it had left), then the rollout's rewards backed up. Expansions already
        decided wait for the tree's end (`final`): only token counts are left."""
        later = []
        while self.unsettled:
            unsettled = self.unsettled.pop(0)
            if unsettled.decided and not final:
                later.append(unsettled)
                continue
            node, width = unsettled.node, len(unsettled.samples)
            while len(unsettled.received) < width:
                [sample] = yield _Wait(unsettled.samples[len(unsettled.received)])
                unsettled.received.append(sample)
            alone = yield from self._attach(node, unsettled.received, width, unsettled.decided)
            if alone and not unsettled.decided:  # the walk below was undone
                yield from self._walk(step_down(node, self.config.c), unsettled.steps_left)
        self.unsettled = [u for u in later if u.node not in self.gone]
        # The reference backs up each expansion's answers as it makes them, down the rollout's
        # path: the order decides each ancestor's first value.
        for child, reward in sorted(self.rewards, key=lambda r: r[0].depth):
            child.backup(reward)
        self.rewards.clear()

    def _discard(self, node: Node) -> None:
        """Undo the walk below `node` (a sample that stopped at <end_of_answer> came in among
        its later samples)."""
        gone = {n for child in node.children for n in child.walk()}
        self.gone |= gone
        self.stats.discarded_nodes += len(gone)
        self.stats.discarded_tokens += sum(n.completion_tokens or 0 for n in gone)
        node.children.clear()
        for later in self.unsettled:
            if later.node in gone:
                for future in later.samples:
                    future.cancel()
        self.unsettled = [u for u in self.unsettled if u.node not in gone]
        self.rewards = [(n, r) for n, r in self.rewards if n not in gone]
        if node.node_id in self.path:
            del self.path[self.path.index(node.node_id) + 1 :]

    def _answer(self, child: Node, text: str, final_answer: str | None) -> None:
        child.text, child.kind, child.terminal = text, "answer", True
        child.final_answer = final_answer
        if self.evaluating:
            return  # valued by the PPM, if there is one; scored against the gold answer later
        child.correct = final_answer is not None and equivalent(
            final_answer, self.tree.problem.answer
        )
        reward = 1.0 if child.correct else -1.0
        if self.early:
            self.rewards.append((child, reward))  # backed up when the rollout is settled
        else:
            child.backup(reward)

    def _program(self, actions: list[str]) -> str:
        if self.config.execution == "interpreter":
            return interpreter_program(reference_program(actions), self.config.exec_timeout_s)
        return program_of(actions)

    def _observe(self, run: Any) -> str:
        """The interpreter program prints its observation (and exits 1 if the step raised);
        a script's is made of its output here. A run the sandbox stopped (a time, memory or
        output limit) is shown as that error either way."""
        if self.config.execution == "interpreter" and (
            run.status == "ok" or (run.status == "runtime_error" and run.exit_code == 1)
        ):
            return run.stdout
        return observation_of(run.status, run.stdout, run.stderr)

    def _code(self, child: Node, step: ParsedStep, run: Any) -> None:
        child.kind = "code"
        child.observation = self._observe(run)
        if is_error(child.observation, run.status, self.config.error_rule):
            child.consecutive_errors = child.parent.consecutive_errors + 1
        if child.consecutive_errors >= self.config.errors_threshold:
            closed = step.text if step.closes_code else step.text + CODE_END
            shown = child.observation
            if step.closes_code and self.config.error_output == "reference":
                shown = f"{OUTPUT_START}{shown}{OUTPUT_END}"
            child.text = with_output(closed, shown)
            self._fail(child, TOO_MANY_CODE_ERRORS, attach=False)
            return
        child.text = with_output(step.text, child.observation) if step.closes_code else step.text
        self._depth_limit(child)

    def _depth_limit(self, child: Node) -> None:
        """A step still open below max_depth ends the branch (the reference's rule: the deepest
        open step is at max_depth, and an answer may follow it)."""
        if child.depth > self.config.max_depth:
            self._fail(child, TOO_MANY_STEPS, attach=False)

    @staticmethod
    def _fail(child: Node, sentinel: str, attach: bool = True) -> None:
        if attach:
            child.parent.children.append(child)
        child.kind, child.terminal, child.final_answer, child.correct = (
            sentinel,
            True,
            sentinel,
            False,
        )
        child.update(-1.0)  # on itself only: a failure says nothing about its ancestors


def _distinct(
    completions: Sequence[Completion], dedupe: str = "text", blank_samples: str = "keep"
) -> list[tuple[Completion, int]]:
    """The reference's post-filter: duplicates go (by text, or with `dedupe="text_and_stop"`
    by text and stop string), and if any sample finished its answer, only the first such
    sample stays (an answer expansion has one child). With `blank_samples="drop"`, samples
    that are only whitespace go too. Each kept sample comes with the tokens it stands for,
    so that none go uncounted: its own, its duplicates', and those of every other dropped
    sample (blank, or beside an answer) on the first kept one."""
    first_of: dict[str, int] = {}
    kept: list[Completion] = []
    tokens: list[int] = []
    dropped = 0
    for c in completions:
        full = c.text + (c.stop_string or "")
        text = full if dedupe == "text_and_stop" else c.text
        if blank_samples == "drop" and not full.strip():
            dropped += c.completion_tokens
        elif text in first_of:
            tokens[first_of[text]] += c.completion_tokens
        else:
            first_of[text] = len(kept)
            kept.append(c)
            tokens.append(c.completion_tokens)
    answer = next((i for i, c in enumerate(kept) if c.stop_string == ANSWER_END), None)
    if answer is not None:
        return [(kept[answer], sum(tokens) + dropped)]
    if kept:
        tokens[0] += dropped
    return list(zip(kept, tokens, strict=True))


def _open_block(node: Node, timed_out_steps: str = "rerun") -> list[str]:
    """The actions of the code block still open at `node`: its code steps (and theirs up the
    tree) after the last step whose text closed a block (it shows an output or ends the code),
    oldest first. Steps without code (the root, text steps) add nothing. With
    `timed_out_steps="skip"`, a step that timed out is left out."""
    actions: list[str] = []
    for ancestor in reversed(node.path()):
        if OUTPUT_END in ancestor.text or CODE_END in ancestor.text:
            break
        if ancestor.kind != "code":
            continue
        if timed_out_steps == "skip" and (ancestor.observation or "").startswith("TimeoutError"):
            continue
        actions.append(ancestor.action)
    return actions[::-1]


@dataclass
class _Run:
    """One `MCTSSearch.run`: the open trees with their searches (one a tree, or a search per
    overlapping rollout), the replies ready for them, the requests waiting for their lane and
    the futures in flight; replies and requests are keyed by search."""

    problems: Sequence[Problem]
    on_tree: Callable[[int, Tree, float], None] | None
    opened: Window
    all_opened: threading.Event  # set when every tree has opened, or the run has ended
    kept: dict[int, Tree] = field(default_factory=dict)
    rules: dict[int, TreeSearch] = field(default_factory=dict)  # the open trees
    searches: dict[int, _Search] = field(default_factory=dict)
    tree_of: dict[int, int] = field(default_factory=dict)  # each search's tree
    live: dict[int, int] = field(default_factory=dict)  # each open tree's searches
    keys: Iterator[int] = field(default_factory=itertools.count)
    ready: deque[tuple[int, Any]] = field(default_factory=deque)
    pending: dict[type, list[tuple[int, _Request]]] = field(
        default_factory=lambda: {_Generate: [], _Execute: [], _Score: []}
    )
    in_flight: dict[Future, tuple[type, list[tuple[int, _Request]]]] = field(default_factory=dict)
    kinds_in_flight: Counter[type] = field(default_factory=Counter)
    # Looked up when the run starts, not bound here: a test puts its own `Arrivals` in place.
    arrivals: Arrivals = field(default_factory=lambda: Arrivals())
    held_since: dict[type, float] = field(default_factory=dict)

    def opened_all(self) -> None:
        """Every tree has opened (or the run has ended): room no longer concerns the run."""
        self.arrivals.stop_waking()
        self.all_opened.set()

    def begin(self, tree: int, search: _Search) -> None:
        key = next(self.keys)
        self.searches[key], self.tree_of[key] = search, tree
        self.live[tree] = self.live.get(tree, 0) + 1
        self.ready.append((key, None))

    def await_reply(self, future: Future, kind: type, entries: list[tuple[int, _Request]]) -> None:
        """The searches of `entries` wait for `future` (a lane's batch, an expansion, or a
        sample several rollouts wait for)."""
        waiting = self.in_flight.get(future)
        if waiting is not None:
            waiting[1].extend(entries)
            return
        self.in_flight[future] = (kind, entries)
        self.kinds_in_flight[kind] += 1
        self.arrivals.watch(future)

    def replied(self, future: Future) -> tuple[type, list[tuple[int, _Request]]]:
        kind, entries = self.in_flight.pop(future)
        self.kinds_in_flight[kind] -= 1
        return kind, entries

    def withdraw(self) -> None:
        """On an error: the expansions (and samples) not yet started are cancelled."""
        for future in self.in_flight:
            future.cancel()
        for future in (f for r in self.rules.values() for u in r.unsettled for f in u.samples):
            future.cancel()


class MCTSSearch:
    """Searches many trees at once and keeps the figures of the run in `stats`."""

    def __init__(
        self,
        policy: LLM,
        sandbox: Sandbox,
        config: MCTSConfig | None = None,
        ppm: ValueModel | None = None,
        prompt: StepPrompt = DEFAULT_PROMPT,
        descend_early: bool = True,
    ):
        self.policy = policy
        self.sandbox = sandbox
        self.config = config or MCTSConfig()
        self.ppm = ppm
        self.prompt = prompt
        self.stats = SearchStats()
        # Servers batch continuously: an expansion goes out as soon as its tree asks, and
        # (without a PPM) each sample as a request of its own, so that the walk can go on as
        # soon as the samples that decide it are in (TreeSearch).
        self._streamed = isinstance(policy, AsyncLLM)
        # Per-sample requests pay only where an engine serves each one as it comes: through the
        # in-process batcher each would be a batch of one row with its own prefill.
        self._fleet = serves_each_request(policy)
        self._early = descend_early and self._fleet and not self.config.lockstep

    def run(
        self,
        problems: Sequence[Problem],
        window: int | None = None,
        on_tree: Callable[[int, Tree, float], None] | None = None,
        memory_mb: float = OPEN_MEMORY_MB,
        all_opened: threading.Event | None = None,
    ) -> list[Tree]:
        """One tree per problem, opened as the module docstring says: at most `window` at
        once where it is given and what `memory_mb` holds (`open_trees_bound`), the next one
        started when the fleet has room (or one ends). `on_tree(i, tree, seconds)` is called
        from this thread as soon as tree `i` ends, with its share of the wall time (each moment
        split evenly among the trees open then: llm.coroutines.Window), and the tree is not
        kept: run then returns []. Without `on_tree`, every tree, in order. `all_opened` is set
        once the last tree has opened (or the run has ended): a search that waits for it leaves
        the fleet's room to this one while this one has trees to open."""
        start = time.perf_counter()
        bound = open_trees_bound(self.config, memory_mb)
        opened = Window(len(problems), min(window or bound, bound))
        run = _Run(problems, on_tree, opened, all_opened or threading.Event())
        if not self.config.lockstep:  # over a fleet, the client wakes the run when it has room
            run.arrivals.wake_on_room(self.policy)
        with ThreadPoolExecutor(max_workers=2) as pool:  # the sandbox's lane and the PPM's
            try:
                while True:
                    engine_start = time.perf_counter()
                    self._open_trees(run)
                    self._advance(run)
                    # Once the last tree's first requests are out (a search waiting for it
                    # would take the fleet's room first), and once, not on every turn.
                    if run.opened.all_started and not run.all_opened.is_set():
                        run.opened_all()
                    now = time.perf_counter()
                    for kind in self._lanes_to_start(
                        run.pending, run.kinds_in_flight, run.opened.running, run.held_since, now
                    ):
                        self._start_lane(run, kind, pool)
                    self.stats.engine_s += time.perf_counter() - engine_start
                    if run.opened.has_room and self._trees_to_open(run.opened) != 0:
                        continue  # the fleet has room for another tree
                    if not run.in_flight:
                        break
                    self._gather(run, now)
            finally:
                run.opened_all()
                run.withdraw()
        self.stats.wall_s += time.perf_counter() - start
        return [run.kept[i] for i in range(len(run.kept))]

    def _open_trees(self, run: _Run) -> None:
        started = run.opened.start(self._trees_to_open(run.opened))
        for i in started:
            tree = Tree(run.problems[i], Node("0", None, 0))
            early, ppm = self._early, self.ppm is not None
            run.rules[i] = TreeSearch(tree, self.config, self.prompt, ppm, early, self.stats)
            for search in run.rules[i].searches():
                run.begin(i, search)

    def _search_ended(self, run: _Run, key: int) -> None:
        """A search is over: the tree's next rollout begins, or the tree ends with its last."""
        del run.searches[key]
        i = run.tree_of.pop(key)
        run.live[i] -= 1
        following = run.rules[i].next_rollout()
        if following is not None:
            run.begin(i, following)
        elif run.live[i] == 0:
            del run.live[i]
            self._ended(run, i)

    def _ended(self, run: _Run, i: int) -> None:
        tree = run.rules.pop(i).tree
        seconds = run.opened.end(i)
        if run.on_tree is None:
            run.kept[i] = tree
        else:
            run.on_tree(i, tree, seconds)
        self._open_trees(run)

    def _advance(self, run: _Run) -> None:
        """Each search with a reply ready goes on to its next request: a sample goes out at
        once, a wait parks on its future, the rest wait for their lane."""
        while run.ready:
            key, reply = run.ready.popleft()
            try:
                request = run.searches[key].send(reply)
            except StopIteration:
                self._search_ended(run, key)
                continue
            if isinstance(request, _Sample):
                self.stats.requested(run.opened.running)
                run.ready.append((key, self._sample(request)))
            elif isinstance(request, _Wait):
                if request.future.done():
                    run.ready.append((key, request.future.result()))
                else:  # overlapping rollouts can wait for one expansion
                    run.await_reply(request.future, _Wait, [(key, request)])
            else:
                run.pending[type(request)].append((key, request))

    def _start_lane(self, run: _Run, kind: type, pool: ThreadPoolExecutor) -> None:
        """A lane's pending requests go out: expansions with a future per tree, so each
        resumes on its own; executions and scores as one batch on the `pool`."""
        batch, run.pending[kind] = run.pending[kind], []
        run.held_since.pop(kind, None)
        if kind is _Generate:
            self.stats.requested(run.opened.running)
            futures = self._generate([r for _, r in batch])
            for future, entry in zip(futures, batch, strict=True):
                run.await_reply(future, kind, [entry])
            return
        lane = self._execute if kind is _Execute else self._score
        run.await_reply(pool.submit(lane, [r for _, r in batch]), kind, batch)

    def _gather(self, run: _Run, now: float) -> None:
        """Waits for the first future in flight (or a held lane's deadline); their replies
        become ready."""
        deadlines = [t + self._gather_s(k) for k, t in run.held_since.items()]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        for future in run.arrivals.wait(timeout):
            kind, batch = run.replied(future)
            one = kind is _Generate or kind is _Wait  # a reply for each search waiting
            replies = [future.result()] * len(batch) if one else future.result()
            run.ready.extend(zip((i for i, _ in batch), replies, strict=True))

    def _trees_to_open(self, opened: Window) -> int | None:
        """How many more trees to open now (None: as many as the window has room for). Over a
        policy that reports its spare capacity (a fleet), one while the fleet has room, or
        when none is open, and all that are left once they are no more than the open ones:
        opened as room frees, the last trees would start their chains as the fleet drains,
        while opened now (their expansions go first: `TreeSearch.progress`) they end with the
        others. Every tree the window has room for in lock-step (the reference's schedule)
        and over a policy that reports none (an in-process model)."""
        if self.config.lockstep:
            return None
        spare = spare_capacity(self.policy)
        if spare is None or opened.left <= opened.running:
            return None
        return 1 if spare > 0 or opened.running == 0 else 0

    def _lanes_to_start(
        self, pending: dict, kinds_in_flight: Counter, open_trees: int, held_since: dict, now: float
    ) -> list[type]:
        # Rollouts waiting for another's expansion (or early walks, for their samples) hold no
        # lane: what they wait for is pending or in flight itself.
        busy = {kind for kind, count in kinds_in_flight.items() if count and kind is not _Wait}
        if self.config.lockstep:
            # The reference's schedule: one phase at a time for all trees (code runs, then
            # PPM scores, then the next completions), each waiting for the slowest tree.
            if busy:
                return []
            return next(([k] for k in (_Execute, _Score, _Generate) if pending[k]), [])
        active = busy | {kind for kind, requests in pending.items() if requests}
        if self._streamed:
            busy.discard(_Generate)  # the servers take requests while they decode others
        start = []
        for kind, requests in pending.items():
            if not requests or kind in busy:
                continue
            if kind is _Generate and self._streamed:
                start.append(kind)
                continue
            # A model call costs about the same for one prompt as for many, so the model
            # lanes wait a little for the trees whose code is still running; the sandbox
            # does not wait. With no other lane at work, nothing else is coming.
            everyone = len(requests) >= open_trees or active == {kind}
            if kind is _Execute or everyone:
                start.append(kind)
                continue
            held_since.setdefault(kind, now)
            if now >= held_since[kind] + self._gather_s(kind):
                start.append(kind)
        return start

    def _gather_s(self, kind: type) -> float:
        """How long a model lane holds a partial batch: a tenth of its mean call time."""
        if kind is _Generate and self.stats.llm_calls:
            return max(MIN_GATHER_S, 0.1 * self.stats.llm_s / self.stats.llm_calls)
        if kind is _Score and self.stats.ppm_calls:
            return max(MIN_GATHER_S, 0.1 * self.stats.ppm_s / self.stats.ppm_calls)
        return MIN_GATHER_S

    def _generate(self, requests: list[_Generate]) -> list[Future[list[Completion]]]:
        """Submit the expansions together; `llm_s` gains the time until the last is back. To
        a fleet each goes with its tree's progress as its priority; an in-process model gets
        them as one batch."""
        sampling = self._next_sampling(len(requests))
        if not self._fleet:  # one submit: the batcher then seeds them as one batch
            return self._timed(submit(self.policy, [r.prompt for r in requests], sampling))
        return self._timed(
            [submit(self.policy, [r.prompt], sampling, r.progress)[0] for r in requests]
        )

    def _sample(self, request: _Sample) -> list[Future[list[Completion]]]:
        """Submit one expansion's samples as requests of their own, sample i seeded with
        seed + i (as vLLM seeds the samples of one request)."""
        sampling = self._next_sampling(1)
        one = sampling.model_copy(update={"n": 1})
        return self._timed(
            [
                submit(
                    self.policy,
                    [request.prompt],
                    one if one.seed is None else one.model_copy(update={"seed": one.seed + i}),
                    request.progress,
                )[0]
                for i in range(sampling.n)
            ]
        )

    def _next_sampling(self, expansions: int) -> SamplingParams:
        sampling = self.config.sampling(self.stats.llm_calls)
        self.stats.llm_calls += 1
        self.stats.expansions += expansions
        return sampling

    def _timed(self, futures: list[Future]) -> list[Future]:
        start, left = time.perf_counter(), [len(futures)]

        def finished(_: Future) -> None:
            left[0] -= 1
            if left[0] == 0:
                self.stats.llm_s += time.perf_counter() - start

        for future in futures:
            future.add_done_callback(finished)
        return futures

    def _execute(self, requests: list[_Execute]) -> list[list[Any]]:
        from rstar_sandbox import Job

        start = time.perf_counter()
        programs = [p for r in requests for p in r.programs]
        # The interpreter program stops itself at exec_timeout_s (with the reference's
        # TimeoutError); the sandbox's limit behind it is a second longer.
        grace = 1.0 if self.config.execution == "interpreter" else 0.0
        timeout_s, memory_mb = self.config.exec_timeout_s + grace, self.config.exec_memory_mb
        results = self.sandbox.run(
            [Job(p, timeout_s=timeout_s, memory_mb=memory_mb) for p in programs]
        )
        self.stats.sandbox_calls += 1
        self.stats.programs_run += len(programs)
        self.stats.sandbox_s += time.perf_counter() - start
        out, at = [], 0
        for r in requests:
            out.append(results[at : at + len(r.programs)])
            at += len(r.programs)
        return out

    def _score(self, requests: list[_Score]) -> list[list[float]]:
        start = time.perf_counter()
        prompts = [p for r in requests for p in r.prompts]
        values = self.ppm.score(prompts)
        self.stats.ppm_calls += 1
        self.stats.ppm_s += time.perf_counter() - start
        out, at = [], 0
        for r in requests:
            out.append(list(values[at : at + len(r.prompts)]))
            at += len(r.prompts)
        return out


def search(
    problems: Sequence[Problem],
    policy: LLM,
    sandbox: Sandbox,
    config: MCTSConfig | None = None,
    ppm: ValueModel | None = None,
    prompt: StepPrompt = DEFAULT_PROMPT,
) -> list[Tree]:
    """Search one tree per problem; see the module docstring."""
    return MCTSSearch(policy, sandbox, config, ppm, prompt).run(problems)
