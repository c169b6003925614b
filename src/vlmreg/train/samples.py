"""Trajectories -> training samples: multi-turn merge, loss mask, multimodal-safe truncation.

Consecutive turns of one trajectory become one sample while the token prefix property holds (the next
prompt starts with this prompt plus this completion, token for token, with the same images). Engines that
continue conversations from the sampled tokens (the embedded engine) hold it by construction; a server
that re-renders the conversation may not (a template that drops earlier reasoning, say): then a new
sample starts, and the break is counted with where it happened. A turn whose prompt dropped earlier images under
the image budget (``Turn.budget_break``, `vlmreg.rollout.image_budget`) starts a new sample too, by design: its
context differs from the previous turn's, and each completion is trained in exactly the context it was sampled in
(counted in ``budget_splits``, not as a break). The loss mask covers generated tokens only. Samples over ``seq_len`` are
cut before an image, or dropped, per config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from vlmreg.data.truncation import safe_cut
from vlmreg.rollout.episodes import Trajectory

__all__ = ["SampleStats", "TrainingSample", "build_samples"]


@attrs.frozen(eq=False)
class TrainingSample:
    input_ids: list[int]
    loss_mask: list[bool]
    rollout_logprobs: list[float]
    image_ids: list[str]
    image_spans: list[tuple[int, int]]
    advantage: float
    trajectory: int
    example_id: str

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def image_tokens(self) -> list[int]:
        return [end - start for start, end in self.image_spans]

    def __len__(self) -> int:
        return len(self.input_ids)


@attrs.define
class SampleStats:
    merged_turns: int = 0
    prefix_breaks: int = 0
    budget_splits: int = 0  # samples started because the image budget dropped earlier images (expected, not a break)
    truncated: int = 0
    dropped: int = 0
    images_cut: int = 0
    #: one line per prefix break: which trajectory and turn, and the first token that differs
    break_reasons: list[str] = attrs.field(factory=list)


def _grow(
    sample: dict,
    prompt: Sequence[int],
    completion: Sequence[int],
    logprobs: Sequence[float],
    forced: Sequence[int] = (),
) -> None:
    """Extend ``sample`` by a turn: the prompt's new tokens and the completion's, the policy's samples in the loss
    (``forced``: completion positions the engine wrote itself, which are not)."""
    new_prompt = len(prompt) - len(sample["ids"])
    sample["ids"] = [*prompt, *completion]
    skip = set(forced)
    sample["mask"] += [False] * new_prompt + [i not in skip for i in range(len(completion))]
    sample["logprobs"] += [0.0] * new_prompt + list(logprobs)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def build_samples(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float],
    *,
    seq_len: int,
    overlong: str = "truncate",
    check: Callable[[Sequence[int], Sequence[str], Sequence[tuple[int, int]], str], None] | None = None,
) -> tuple[list[TrainingSample], SampleStats]:
    """Samples from trajectories; ``check(ids, image_ids, spans, where)`` (e.g. `PromptEncoder.check`) runs on each."""
    stats = SampleStats()
    samples: list[TrainingSample] = []

    def emit(sample: dict, index: int, trajectory: Trajectory) -> None:
        ids, mask, logprobs = sample["ids"], sample["mask"], sample["logprobs"]
        images, spans = sample["images"], sample["spans"]
        if check is not None:
            check(ids, images, spans, trajectory.example.id)
        cut = safe_cut(len(ids), spans, seq_len)
        if cut.length < len(ids):
            if overlong == "drop" or not any(mask[: cut.length]):
                stats.dropped += 1
                return
            stats.truncated += 1
            stats.images_cut += len(images) - cut.images
            ids, mask, logprobs = ids[: cut.length], mask[: cut.length], logprobs[: cut.length]
            images, spans = images[: cut.images], spans[: cut.images]
        if any(mask):
            samples.append(
                TrainingSample(
                    ids, mask, logprobs, images, spans, float(advantages[index]), index, trajectory.example.id
                )
            )

    for index, trajectory in enumerate(trajectories):
        current: dict | None = None
        for number, turn in enumerate(trajectory.turns, 1):
            if current is not None and getattr(turn, "budget_break", False):
                stats.budget_splits += 1
                emit(current, index, trajectory)
                current = None
            if current is not None:
                same_tokens = turn.prompt_ids[: len(current["ids"])] == current["ids"]
                same_images = turn.image_ids[: len(current["images"])] == current["images"]
                if same_tokens and same_images:
                    stats.merged_turns += 1
                    _grow(current, turn.prompt_ids, turn.completion_ids, turn.logprobs, turn.forced)
                    current["images"], current["spans"] = list(turn.image_ids), list(turn.image_spans)
                    continue
                stats.prefix_breaks += 1
                where = _first_difference(turn.prompt_ids, current["ids"])
                what = f"token {where} differs" if same_tokens is False else "the images differ"
                stats.break_reasons.append(
                    f"{trajectory.example.id} turn {number}: the prompt does not extend the previous turn's tokens "
                    f"({what}); a new sample starts"
                )
                emit(current, index, trajectory)
            current = {
                "ids": [],
                "mask": [],
                "logprobs": [],
                "images": list(turn.image_ids),
                "spans": list(turn.image_spans),
            }
            _grow(current, turn.prompt_ids, turn.completion_ids, turn.logprobs, turn.forced)
        if current is not None:
            emit(current, index, trajectory)
    return samples, stats
