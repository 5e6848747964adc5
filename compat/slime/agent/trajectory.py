"""slime.agent.trajectory: TrajectoryManager turns an agent session's turns (each a /generate snapshot, TurnRecord,
with the chat messages it answered) into loss-masked training Samples. Turns are routed into a per-session tree of
messages; each branch is linearized into Samples, a turn whose prompt tokens no longer extend the held tokens
(re-tokenization drift) either overwriting the last response span (a short drift there) or starting a new Sample.
Pure bookkeeping: it calls no service (Physarum's gateway keeps its own trajectories; this is for slime-style
adapters and harnesses a plugin builds itself)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

from slime.utils.types import Sample

logger = logging.getLogger(__name__)

DEFAULT_FORK_THRESHOLD_TOKENS = 1024


@dataclasses.dataclass(frozen=True)
class TurnRecord:
    """One /generate snapshot of a turn: its prompt and output token ids, finish reason, output log-probs."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    output_log_probs: list[float] = dataclasses.field(default_factory=list)
    ill_formed: bool = False


@dataclasses.dataclass(eq=False)
class _Node:
    """A message in a session's tree; `turn` is set on an assistant message the model generated (else the message
    only routes: system, user, tool, or an assistant message replayed by the client)."""

    role: str | None = None
    message: dict[str, Any] | None = None
    parent: _Node | None = None
    children: list[_Node] = dataclasses.field(default_factory=list)
    turn: TurnRecord | None = None
    trained: bool = False  # a branch already trains on this turn: other branches hold it as context

    def child(self, role: str | None, message: dict[str, Any] | None) -> _Node:
        node = _Node(role=role, message=message, parent=self)
        self.children.append(node)
        return node

    def leaves(self) -> Iterator[_Node]:
        if not self.children:
            yield self
        for node in self.children:
            yield from node.leaves()

    def branch(self) -> list[_Node]:
        """The nodes from the root's child down to this one."""
        nodes, node = [], self
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _Tokens:
    """One Sample's tokens as a branch's turns build them."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.log_probs: list[float] = []
        self.prompt_len = 0  # the first turn's prompt, left out of the Sample's response
        self.last_response_at: int | None = None

    def absorbs(self, turn: TurnRecord, fork_threshold: int) -> bool | None:
        """True: the prompt extends the held tokens; False: a short drift inside the last response, healed by
        overwriting it; None: this Sample ends here (a fork)."""
        shared = _shared_prefix(self.tokens, turn.prompt_ids)
        if shared == len(self.tokens):
            return True
        at = self.last_response_at
        if at is not None and shared >= at and len(turn.output_ids) < fork_threshold:
            return False
        return None

    def add(self, turn: TurnRecord, *, extends: bool, trained: bool) -> None:
        first = self.last_response_at is None
        start = len(self.tokens) if extends else self.last_response_at
        context = turn.prompt_ids[start:]
        del self.tokens[start:], self.loss_mask[start:], self.log_probs[start:]
        self.tokens += context
        self.loss_mask += [0] * len(context)
        self.log_probs += [0.0] * len(context)
        self.last_response_at = len(self.tokens)
        self.tokens += turn.output_ids
        self.loss_mask += [int(trained)] * len(turn.output_ids)
        self.log_probs += list(turn.output_log_probs) if trained and turn.output_log_probs else \
            [0.0] * len(turn.output_ids)
        if first:
            self.prompt_len = len(turn.prompt_ids)

    def trains(self) -> bool:
        return any(self.loss_mask[self.prompt_len:])

    def sample(self, base: Sample, metadata: dict[str, Any], max_tokens: int) -> Sample:
        cut = max_tokens or len(self.tokens)
        tokens, mask, log_probs = self.tokens[:cut], self.loss_mask[:cut], self.log_probs[:cut]
        start = self.prompt_len
        return Sample(index=base.index, group_index=base.group_index,
                      rollout_id=base.rollout_id if base.rollout_id is not None else base.index, prompt=base.prompt,
                      label=base.label, tokens=tokens, response_length=len(mask) - start, loss_mask=mask[start:],
                      rollout_log_probs=log_probs[start:], reward=0.0, status=Sample.Status.COMPLETED,
                      metadata=dict(metadata))


class TrajectoryManager:
    """Per-session trees of turns, linearized into Samples by get_trajectory."""

    def __init__(self, *, fork_threshold_tokens: int | None = None) -> None:
        self.fork_threshold = DEFAULT_FORK_THRESHOLD_TOKENS if fork_threshold_tokens is None else fork_threshold_tokens
        self._roots: dict[str, _Node] = {}
        self._turns: dict[str, int] = {}

    def has_session(self, sid: str) -> bool:
        return sid in self._roots

    def turn_count(self, sid: str) -> int:
        return self._turns.get(sid, 0)

    def record_turn(self, sid: str, *, turn: TurnRecord, prompt_messages: list[dict[str, Any]],
                    response_message: dict[str, Any] | None, metadata: dict[str, Any] | None = None) -> None:
        """Route the turn under the messages it answered (shared history is shared), its response a leaf."""
        if not prompt_messages:
            logger.warning("record_turn(sid=%s): no prompt_messages; the turn is not recorded", sid)
            return
        if turn.output_log_probs and len(turn.output_log_probs) != len(turn.output_ids):
            raise ValueError(f"record_turn(sid={sid}): {len(turn.output_log_probs)} output_log_probs for "
                             f"{len(turn.output_ids)} output_ids")
        node = self._roots.setdefault(sid, _Node())
        depth = 0
        for message in prompt_messages:
            match = next((c for c in node.children if c.role == message.get("role") and c.message == message), None)
            if match is None:
                break
            node, depth = match, depth + 1
        node, depth = self._merge_rewrite(node, prompt_messages, depth)
        for message in prompt_messages[depth:]:
            node = node.child(message.get("role"), message)
        leaf = node.child("assistant", response_message)
        leaf.turn = turn
        self._turns[sid] = self._turns.get(sid, 0) + 1

    def _merge_rewrite(self, node: _Node, messages: list[dict[str, Any]], depth: int) -> tuple[_Node, int]:
        """A client that replays our last (short) assistant message re-rendered: the replay takes that node's
        place and the generated turn stops training, rather than leaving a dead branch that trains."""
        if self.fork_threshold <= 0 or depth >= len(messages) or messages[depth].get("role") != "assistant":
            return node, depth
        generated = [c for c in node.children if c.role == "assistant"]
        if len(generated) != 1:
            return node, depth
        only = generated[0]
        if only.children or only.turn is None or len(only.turn.output_ids) >= self.fork_threshold:
            return node, depth
        only.turn, only.message = None, messages[depth]
        return only, depth + 1

    def get_trajectory(self, sid: str, *, base_sample: Sample, reward: float = 0.0,
                       extra_metadata: dict[str, Any] | None = None, max_sample_tokens: int = 0) -> list[Sample]:
        """The session's Samples (each branch's, split where it forks), each with `reward`; the session is
        consumed (a second call returns [])."""
        root = self._roots.pop(sid, None)
        self._turns.pop(sid, None)
        if root is None:
            return []
        samples = []
        for leaf in root.leaves():
            if leaf is not root:
                samples += self._branch_samples(leaf.branch(), base_sample, extra_metadata, max_sample_tokens)
        for sample in samples:
            sample.reward = reward
        return samples

    def drop_session(self, sid: str) -> None:
        self._roots.pop(sid, None)
        self._turns.pop(sid, None)

    def _branch_samples(self, branch: list[_Node], base: Sample, extra: dict[str, Any] | None,
                        max_tokens: int) -> list[Sample]:
        generated = [n for n in branch if n.turn is not None]
        metadata = {**(extra or {}),
                    "truncated": bool(generated) and generated[-1].turn.finish_reason == "length",
                    "use_tool": any(bool((n.message or {}).get("tool_calls")) for n in generated),
                    "ill_formed": any(n.turn.ill_formed for n in generated)}
        pieces: list[_Tokens] = []
        for node in generated:
            trained, node.trained = not node.trained, True
            extends = pieces[-1].absorbs(node.turn, self.fork_threshold) if pieces else None
            if extends is None:
                pieces.append(_Tokens())
                extends = True
            pieces[-1].add(node.turn, extends=extends, trained=trained)
        return [piece.sample(base, metadata, max_tokens) for piece in pieces if piece.trains()]


__all__ = ["TrajectoryManager", "TurnRecord"]
