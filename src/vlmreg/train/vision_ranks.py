"""Under torchrun every rank runs the vision tower in the same micro-batches: a stand-in image where a rank has none.

FSDP2 (`vlmreg.train.distributed.shard_model`) shards each vision block on its own, so a block gathers its weights
only when it runs, i.e. only on ranks whose micro-batch carries images (and, with the tower trained, reduce-scatters
its gradients only in their backward). A model runs its tower once for a micro-batch's images and once more for its
videos, so what must agree is which of the two kinds a micro-batch carries. Each rank builds its micro-batches from its
own samples, so for some i one rank's i-th micro-batch may carry images and another's none: the collectives would no
longer match (a size-mismatch error on gloo, a hang on NCCL). Real runs mix both (text tasks, multi-turn environments).

So the ranks share, with the one collective that also counts their micro-batches, which kinds each of their
micro-batches carries (an idle repeat carries what the rank's last micro-batch does), and a rank whose i-th micro-batch
lacks a kind that another rank's i-th carries gets one **stand-in** segment there: a small image (`STAND_IN_SIZE`
pixels square) and/or a two-frame clip of such images, alone in a user message, encoded by the trainer's
`PromptEncoder` through the family's own processor (a processor that takes fixed-size images resizes it as it resizes
any), placed as a segment of its own (packed: its own sequence, attended only by itself; padded: its own row), with no
loss on any of its tokens. It adds nothing to any count: no loss token, no sequence for a per-sequence aggregation, no
sample, no real token (`MicroBatch.tokens`), no metric. Since its embeddings feed the language model, the backward runs
through the vision blocks on that rank too, so a trained tower's reduce-scatters match as well; the gradient they
receive from it is zero, since no loss reads its positions.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlmreg.data.prompts import PromptEncoder
from vlmreg.data.store import is_video_id
from vlmreg.sdk.example import image_part
from vlmreg.sdk.video import video_part
from vlmreg.train.samples import TrainingSample

__all__ = ["STAND_IN_SIZE", "Media", "media_of", "stand_in_sample", "stand_ins_needed"]

#: The stand-in image's side in pixels: small (a processor that resizes small images up to its minimum gives the
#: fewest tokens it can), yet not so small that a processor mistakes its width for a channel axis.
STAND_IN_SIZE = 32
#: The stand-in clip: two frames (a temporal patch of two takes them in one), at two a second.
_CLIP_FRAMES, _CLIP_FPS = 2, 2.0

#: What a micro-batch carries: (images, videos).
Media = tuple[bool, bool]


def media_of(samples: Sequence[TrainingSample]) -> Media:
    """Whether ``samples`` carry any image, and any video."""
    ids = [i for s in samples for i in s.image_ids]
    return any(not is_video_id(i) for i in ids), any(is_video_id(i) for i in ids)


def stand_ins_needed(every: Sequence[Sequence[Media]], rank: int) -> dict[int, Media]:
    """Which of ``rank``'s micro-batches get a stand-in, and of which kinds, from every rank's `Media` per micro-batch.
    A rank with fewer micro-batches than the busiest repeats its last (weight 0), and the repeats carry what it does.
    Every rank computes from the same lists, so afterwards each micro-batch carries the same kinds on every rank."""
    needed = max((len(media) for media in every), default=0)
    padded = [[*media, *[media[-1]] * (needed - len(media))] if media else [] for media in every]
    wanted: dict[int, Media] = {}
    for i, (images, videos) in enumerate(padded[rank]):
        others = [media[i] for media in padded if media]
        missing = (not images and any(m[0] for m in others), not videos and any(m[1] for m in others))
        if any(missing):
            wanted[i] = missing
    return wanted


def stand_in_sample(encoder: PromptEncoder, media: Media) -> TrainingSample:
    """A stand-in carrying ``media``'s kinds: a small black image and/or a two-frame clip of one, alone in a user
    message, as ``encoder`` encodes it (the media in the encoder's store); every token without loss, advantage 0."""
    # deferred: start-up cost (loads PIL)
    from PIL import Image  # noqa: PLC0415

    from vlmreg.data.video import DecodedVideo  # noqa: PLC0415

    image = Image.new("RGB", (STAND_IN_SIZE, STAND_IN_SIZE), "black")
    parts = []
    if media[0]:
        parts.append(image_part(encoder.store.add(image)))
    if media[1]:
        clip = DecodedVideo((image,) * _CLIP_FRAMES, _CLIP_FPS, _CLIP_FRAMES, tuple(range(_CLIP_FRAMES)))
        parts.append(video_part(encoder.store.add_video(clip)))
    prompt = encoder.encode([{"role": "user", "content": parts}], add_generation_prompt=False, where="stand-in media")
    n = len(prompt.input_ids)
    return TrainingSample(
        list(prompt.input_ids),
        [False] * n,
        [0.0] * n,
        list(prompt.image_ids),
        list(prompt.image_spans),
        0.0,
        -1,
        "stand-in media",
    )
