"""The thinking budget (``[rollout] thinking_budget``): after N thinking tokens the engine writes the end marker itself.

A row is thinking while its last thinking start marker (the family's ``thinking_start``) has no end marker
(``thinking_end``) after it, counting the prompt: a chat template that opens the thinking block in
the generation prompt (a thinking mode's chat template kwargs) starts the row thinking; one that closes it there (thinking
off) does not, and a row that never opens one is never touched. Once a row has sampled ``budget`` tokens inside
its open block, the end marker's tokens are forced, one per step (every other logit -inf), and sampling goes on.
A forced token's logprob is that of the distribution it was drawn from, a point mass: 0. `ThinkingBudget.forced`
holds the rows whose thinking the budget ended (the ``thinking_budget_hits`` metric counts them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ThinkingBudget", "opens_thinking"]


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
    opened = _last(prompt_ids, start)
    return opened >= 0 and opened > _last(prompt_ids, end)


class ThinkingBudget:
    """A transformers logits processor ending each row's thinking after ``budget`` tokens (see the module doc).

    ``start``/``end``: the markers' token ids; ``prompts``: each row's prompt ids; ``stops``: ids that end a row
    (a finished row is left alone).
    """

    def __init__(self, budget: int, start: Sequence[int], end: Sequence[int], prompts: Sequence[Sequence[int]], stops: set[int]) -> None:
        if budget < 1 or not start or not end:
            raise ValueError("a thinking budget needs budget >= 1 and both markers' token ids")
        self.budget, self.start, self.end, self.stops = budget, list(start), list(end), stops
        self.open = [opens_thinking(p, self.start, self.end) for p in prompts]
        self.count = [0] * len(prompts)  # tokens sampled inside the open block
        self.pending: list[list[int]] = [[] for _ in prompts]  # marker tokens still to force
        self.done = [False] * len(prompts)
        self.forced: set[int] = set()
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
