"""The thinking budget (``[rollout] thinking_budget``): after N thinking tokens the engine writes the end marker itself.

A row is thinking while its last thinking start marker (the family's ``thinking_start``) has no end marker
(``thinking_end``) after it, counting the prompt: a chat template that opens the thinking block in the generation
prompt (a thinking mode's chat template kwargs) starts the row thinking; one that closes it there (thinking off) does
not, and a row that never opens one is never touched. Thinking tokens are counted from the start marker on, the
prompt's own tokens after it included (a generation prompt ending in the start marker and a newline counts the
newline), as vLLM 0.24 counts them for its ``thinking_token_budget``. Once a row's open block holds ``budget``
tokens, the end marker's tokens are forced, one per step (every other logit -inf), and sampling goes on. Every
block gets the budget: a row that samples the start marker again after a forced end opens a new block, and its end is
forced in turn. A forced token's logprob is that of the distribution it was drawn from, a point mass: 0.
`ThinkingBudget.forced` holds the rows whose thinking the budget ended (the ``thinking_budget_hits`` metric counts
them), and `ThinkingBudget.forced_at` where each of a row's forced markers begins. The forced tokens are the engine's,
not the policy's: `Completion.forced` lists the positions of all of them, and the trainer keeps them out of the loss
and of ``mismatch_kl`` (as it does the prompt's tokens).

An engine that only sees what a server returned (`vlmreg.inference.openai_client`, for vLLM or ``vlmreg serve``) finds
the forced markers with `forced_markers`: each end marker that closes a thinking block exactly ``budget`` thinking
tokens after its start marker, and whose tokens were drawn with logprob 0 (a point mass, as forced tokens are, within
`FORCED_LOGPROB_TOLERANCE`), so a marker the model wrote itself at that place, with any doubt, is not counted; a
completion with one is a hit (`budget_ended`).
vLLM forces the marker by setting its logit to 1e9, whose processed logprob (``--logprobs-mode processed_logprobs``,
as the trainer launches it) is 0 as well.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "FORCED_LOGPROB_TOLERANCE",
    "ThinkingBudget",
    "budget_ended",
    "forced_marker_positions",
    "forced_markers",
    "opens_thinking",
    "thinking_markers",
    "thinking_so_far",
    "vllm_reasoning_config",
]

#: A forced token's logprob is 0; one above ``-FORCED_LOGPROB_TOLERANCE`` counts as forced (`budget_ended`).
FORCED_LOGPROB_TOLERANCE = 1e-5


def _ends_with(ids: Sequence[int], marker: Sequence[int]) -> bool:
    return len(ids) >= len(marker) > 0 and list(ids[len(ids) - len(marker) :]) == list(marker)


def _last(ids: Sequence[int], marker: Sequence[int]) -> int:
    """Where ``marker`` last occurs in ``ids`` (its end), or -1."""
    n = len(marker)
    for end in range(len(ids), n - 1, -1):
        if list(ids[end - n : end]) == list(marker):
            return end
    return -1


def opens_thinking(prompt_ids: Sequence[int], start: Sequence[int], end: Sequence[int]) -> bool:
    """Whether the prompt leaves a thinking block open: its last start marker has no end marker after it."""
    return thinking_so_far(prompt_ids, start, end) is not None


def thinking_so_far(prompt_ids: Sequence[int], start: Sequence[int], end: Sequence[int]) -> int | None:
    """The thinking tokens the prompt's open block already holds (those after its last start marker), or ``None``
    when the prompt leaves no block open."""
    opened = _last(prompt_ids, start)
    return len(prompt_ids) - opened if opened >= 0 and opened > _last(prompt_ids, end) else None


def thinking_markers(tokenizer: Any, descriptor: Any) -> tuple[list[int], list[int]] | None:
    """The token ids of the family's thinking start and end markers, or ``None`` when it declares no pair."""
    start, end = getattr(descriptor, "thinking_start", None), getattr(descriptor, "thinking_end", None)
    if not start or not end:
        return None
    return (
        list(tokenizer(start, add_special_tokens=False)["input_ids"]),
        list(tokenizer(end, add_special_tokens=False)["input_ids"]),
    )


def vllm_reasoning_config(descriptor: Any) -> str | None:
    """vLLM's ``--reasoning-config`` for the family's markers (JSON), without which vLLM refuses a request's
    ``thinking_token_budget``; ``None`` when the family declares no pair."""
    start, end = getattr(descriptor, "thinking_start", None), getattr(descriptor, "thinking_end", None)
    if not start or not end:
        return None
    return json.dumps({"reasoning_start_str": start, "reasoning_end_str": end})


def budget_ended(
    prompt_ids: Sequence[int],
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    budget: int,
    start: Sequence[int],
    end: Sequence[int],
) -> bool:
    """Whether a thinking budget of ``budget`` ended a thinking block of this completion (see `forced_markers`)."""
    return bool(forced_markers(prompt_ids, token_ids, logprobs, budget, start, end))


def forced_markers(
    prompt_ids: Sequence[int],
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    budget: int,
    start: Sequence[int],
    end: Sequence[int],
) -> list[int]:
    """Where in ``token_ids`` each end marker a thinking budget of ``budget`` forced begins (see the module doc), in
    order: an end marker that begins exactly ``budget`` thinking tokens after its block's start marker (in the prompt
    or the completion), each of its tokens with a logprob above ``-FORCED_LOGPROB_TOLERANCE``. A completion that opens
    a new block after one can hold several."""
    found: list[int] = []
    ids, offset = [*prompt_ids, *token_ids], len(prompt_ids)
    start, end = list(start), list(end)
    count = thinking_so_far(prompt_ids, start, end)  # thinking tokens of the open block; None: none open
    at = offset
    while at < len(ids):
        if count is not None and ids[at : at + len(end)] == end:
            k = at - offset
            if count == budget and all(lp > -FORCED_LOGPROB_TOLERANCE for lp in logprobs[k : k + len(end)]):
                found.append(k)
            count, at = None, at + len(end)
            continue
        at += 1
        if count is not None:
            count += 1
        elif at - len(start) >= offset and ids[at - len(start) : at] == start:  # a start marker the completion wrote
            count = 0
    return found


def forced_marker_positions(starts: Sequence[int], marker_length: int, length: int) -> tuple[int, ...]:
    """The positions of the forced markers' tokens that begin at ``starts`` in a completion of ``length`` tokens (a
    marker that ``max_tokens`` cut keeps the tokens it has): `Completion.forced`."""
    return tuple(i for at in starts for i in range(at, min(at + marker_length, length)))


class ThinkingBudget:
    """A transformers logits processor ending each row's thinking after ``budget`` thinking tokens (see the module doc).

    ``start``/``end``: the markers' token ids; ``prompts``: each row's prompt ids; ``stops``: ids that end a row
    (a finished row is left alone).
    """

    def __init__(
        self, budget: int, start: Sequence[int], end: Sequence[int], prompts: Sequence[Sequence[int]], stops: set[int]
    ) -> None:
        if budget < 0 or not start or not end:
            raise ValueError("a thinking budget needs budget >= 0 and both markers' token ids")
        self.budget, self.start, self.end, self.stops = budget, list(start), list(end), stops
        held = [thinking_so_far(p, self.start, self.end) for p in prompts]
        self.open = [n is not None for n in held]
        self.count = [n or 0 for n in held]  # thinking tokens of the open block, the prompt's included
        self.pending: list[list[int]] = [[] for _ in prompts]  # marker tokens still to force
        self.done = [False] * len(prompts)
        self.forced: set[int] = set()
        self.forced_at: dict[int, list[int]] = {}  # row -> where in its completion each forced end marker begins
        self.width: int | None = None
        self._tail = max(len(self.start), len(self.end))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.width is None:
            self.width = input_ids.shape[1]
        sampled = input_ids.shape[1] - self.width
        tails = input_ids[:, -min(self._tail, sampled) :].tolist() if sampled else [[] for _ in self.open]
        force: list[tuple[int, int]] = []
        for row, tail in enumerate(tails):
            if self.done[row]:
                continue
            if tail and tail[-1] in self.stops:
                self.done[row] = True
                continue
            if tail:  # the token sampled last step
                if self.open[row] and not self.pending[row] and _ends_with(tail, self.end):
                    self.open[row] = False
                elif self.open[row]:
                    self.count[row] += 1
                elif _ends_with(tail, self.start):
                    self.open[row], self.count[row] = True, 0
            if self.open[row] and not self.pending[row] and self.count[row] >= self.budget:
                self.pending[row] = list(self.end)
                self.forced.add(row)
                self.forced_at.setdefault(row, []).append(sampled)
            if self.pending[row]:
                force.append((row, self.pending[row].pop(0)))
                if not self.pending[row]:  # the marker is complete once this token is sampled
                    self.open[row] = False
        if force:
            scores = scores.clone()
            for row, token in force:
                keep = scores[row, token].clone()
                scores[row] = float("-inf")
                scores[row, token] = keep if torch.isfinite(keep) else 0.0
        return scores
