"""Trajectories -> training samples: multi-turn merge, loss mask, multimodal-safe truncation.

Consecutive turns of one trajectory become one sample while the token prefix property holds (the next
prompt starts with this prompt plus this completion, token for token, with the same images); otherwise a
new sample starts. The loss mask covers generated tokens only. Samples over ``seq_len`` are cut at an
image boundary, or dropped, per config.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from vlmreg.data.truncation import check_image_tokens, safe_cut
from vlmreg.rollout.episodes import Trajectory

__all__ = ["SampleStats", "TrainingSample", "build_samples"]


@attrs.frozen(eq=False)
class TrainingSample:
    input_ids: list[int]
    loss_mask: list[bool]
    rollout_logprobs: list[float]
    image_ids: list[str]
    image_tokens: list[int]
    advantage: float
    trajectory: int
    example_id: str

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)

    def __len__(self) -> int:
        return len(self.input_ids)


@attrs.define
class SampleStats:
    merged_turns: int = 0
    prefix_breaks: int = 0
    truncated: int = 0
    dropped: int = 0
    images_cut: int = 0


def _grow(sample: dict, prompt: Sequence[int], completion: Sequence[int], logprobs: Sequence[float]) -> None:
    new_prompt = len(prompt) - len(sample["ids"])
    sample["ids"] = [*prompt, *completion]
    sample["mask"] += [False] * new_prompt + [True] * len(completion)
    sample["logprobs"] += [0.0] * new_prompt + list(logprobs)


def build_samples(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float],
    *,
    seq_len: int,
    image_token: int,
    overlong: str = "truncate",
) -> tuple[list[TrainingSample], SampleStats]:
    stats = SampleStats()
    samples: list[TrainingSample] = []

    def emit(sample: dict, index: int, trajectory: Trajectory) -> None:
        ids, mask, logprobs = sample["ids"], sample["mask"], sample["logprobs"]
        images, tokens = sample["images"], sample["tokens"]
        check_image_tokens(ids, image_token, tokens, trajectory.example.id)
        cut = safe_cut(ids, image_token, tokens, seq_len)
        if cut.length < len(ids):
            if overlong == "drop" or not any(mask[: cut.length]):
                stats.dropped += 1
                return
            stats.truncated += 1
            stats.images_cut += len(images) - cut.images
            ids, mask, logprobs = ids[: cut.length], mask[: cut.length], logprobs[: cut.length]
            images, tokens = images[: cut.images], tokens[: cut.images]
            check_image_tokens(ids, image_token, tokens, f"{trajectory.example.id} (truncated)")
        if any(mask):
            samples.append(TrainingSample(ids, mask, logprobs, images, tokens, float(advantages[index]), index, trajectory.example.id))

    for index, trajectory in enumerate(trajectories):
        current: dict | None = None
        for turn in trajectory.turns:
            if current is not None:
                prefix_ok = turn.prompt_ids[: len(current["ids"])] == current["ids"] and turn.image_ids[: len(current["images"])] == current["images"]
                if prefix_ok:
                    stats.merged_turns += 1
                    _grow(current, turn.prompt_ids, turn.completion_ids, turn.logprobs)
                    current["images"], current["tokens"] = list(turn.image_ids), list(turn.image_tokens)
                    continue
                stats.prefix_breaks += 1
                emit(current, index, trajectory)
            current = {"ids": [], "mask": [], "logprobs": [], "images": list(turn.image_ids), "tokens": list(turn.image_tokens)}
            _grow(current, turn.prompt_ids, turn.completion_ids, turn.logprobs)
        if current is not None:
            emit(current, index, trajectory)
    return samples, stats
