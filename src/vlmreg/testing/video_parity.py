"""Video parity for one family: vlmreg's prompt ids and model inputs for conversations with videos against the family's
own processor given the whole prompt, and logprobs through vlmreg's micro-batches against a plain forward.

The reference is the processor called once on the chat template's rendering of the whole conversation, with every
image and every video (frames, frame rate and the indices of the frames taken, ``do_sample_frames=False``): its
``input_ids`` (the timestamps or frame markers the family writes included), ``video_grid_thw`` and whatever else it
returns. vlmreg gives each video to the processor alone and splices its expansion in (`vlmreg.data.prompts`).

A family that takes no video (``max_videos_per_message = 0``) is checked to refuse one with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder, template_messages
from vlmreg.data.store import TARGET_KEYS, is_video_id, video_inputs
from vlmreg.data.video import DecodedVideo
from vlmreg.modeling.logprobs import selected_logprobs
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_registry
from vlmreg.testing.parity import (
    ANSWER,
    LOGPROB_TOLERANCE,
    QUESTION,
    Parity,
    _compare_inputs,
    _load,
    noise_image,
    tiny_processor,
    transformers_sdpa,
)
from vlmreg.train.batching import make_microbatches
from vlmreg.train.samples import TrainingSample

__all__ = ["VIDEO_CASES", "noise_video", "video_logprob_parity", "video_parity_report", "video_prompt_parity"]

#: Each case: the parts of one user message, ``("image", (w, h))`` or ``("video", (frames, (w, h)))``: one video; an
#: image and a video of another size; two videos of different lengths and sizes (an odd frame count included).
VIDEO_CASES: tuple[tuple[tuple[str, Any], ...], ...] = (
    (("video", (4, (64, 64))),),
    (("image", (32, 64)), ("video", (6, (64, 32)))),
    (("video", (3, (32, 32))), ("video", (4, (96, 64)))),
)


def noise_video(frames: int, size: tuple[int, int], seed: int) -> Any:
    """A `DecodedVideo` of random frames, as if taken every other frame of a 4 fps clip twice as long."""
    return DecodedVideo(
        tuple(noise_image(size, 100 * seed + k) for k in range(frames)), 4.0, 2 * frames, tuple(range(0, 2 * frames, 2))
    )


def _case(
    encoder: Any, case: Sequence[tuple[str, Any]], seed: int, answer: str | None = None
) -> tuple[list[dict], dict[str, Any]]:
    """The conversation by id (for vlmreg) and the processor's arguments for the same media, in order."""
    parts: list[dict[str, Any]] = []
    images, videos, metadata = [], [], []
    for k, (kind, spec) in enumerate(case):
        if kind == "image":
            image = noise_image(spec, 10 * seed + k)
            images.append(image)
            parts.append({"type": "image", "image": encoder.store.add(image)})
        else:
            video = noise_video(spec[0], spec[1], 10 * seed + k)
            video_id = encoder.store.add_video(video)
            stored = encoder.store.video(video_id)
            one = video_inputs(stored, [encoder.store.get(f) for f in stored.frame_ids])
            videos += one["videos"]
            metadata += one["video_metadata"]
            parts.append({"type": "video", "video": video_id})
    messages: list[dict[str, Any]] = [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    media: dict[str, Any] = {"images": images} if images else {}
    if videos:
        media.update(videos=videos, video_metadata=metadata, do_sample_frames=False)
    return messages, media


def _reference(encoder: Any, messages: list[dict], media: dict[str, Any]) -> dict[str, Any]:
    """The processor's own encoding of the whole rendered prompt, with all its media."""

    chat, _ = template_messages(messages)
    text = encoder.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    out = encoder.processor(text=[text], **media, return_tensors="pt")
    return {k: v for k, v in out.items() if k not in TARGET_KEYS and k != "video_metadata"}


def video_prompt_parity(family: str, *, processor: Any = None) -> list[Parity]:
    """vlmreg's prompt ids and inputs vs the processor's, for the `VIDEO_CASES` the family's limits allow; for a family
    without video, that a video is refused with an error naming the family."""

    descriptor = get_registry().get(family)
    encoder = PromptEncoder(processor if processor is not None else tiny_processor(family), ImageStore(), descriptor)
    if not descriptor.max_videos_per_message:
        return [_refusal(encoder, family)]
    results = []
    for seed, case in enumerate(VIDEO_CASES):
        counts = [sum(1 for kind, _ in case if kind == k) for k in ("image", "video")]
        if counts[0] > descriptor.max_images_per_message or counts[1] > descriptor.max_videos_per_message:
            continue
        name = f"video prompt, {' + '.join(kind for kind, _ in case)}"
        messages, media = _case(encoder, case, seed)
        try:
            reference = _reference(encoder, messages, media)
            prompt = encoder.encode(messages)
        except Exception as exc:  # the processor or its template refusing the video: a failed check, said so
            results.append(
                Parity(
                    name,
                    False,
                    f"{type(exc).__name__}: {' '.join(str(exc).split())} (does the chat template render a video part?)",
                )
            )
            continue
        want = reference["input_ids"][0].tolist()
        if prompt.input_ids != want:
            at = next(
                (i for i, (a, b) in enumerate(zip(prompt.input_ids, want, strict=False)) if a != b),
                min(len(want), len(prompt.input_ids)),
            )
            results.append(
                Parity(
                    name,
                    False,
                    f"token {at} differs: vlmreg {prompt.input_ids[at : at + 4]} vs processor {want[at : at + 4]} "
                    f"({len(prompt.input_ids)} vs {len(want)} tokens)",
                    float(at),
                )
            )
            continue
        mine = encoder.token_inputs(
            len(want), [list(zip([0] * len(prompt.image_ids), prompt.image_ids, prompt.image_spans, strict=True))]
        )
        mine.update(encoder.image_inputs(prompt.image_ids))
        if "attention_mask" in reference:
            mine["attention_mask"] = torch.ones((1, len(want)), dtype=torch.long)
        problems = _compare_inputs(reference, mine)
        keys = ", ".join(sorted({k for i in prompt.image_ids if is_video_id(i) for k in encoder.image(i).tensors}))
        results.append(
            Parity(
                name,
                not problems,
                "; ".join(problems) or f"{len(want)} tokens: ids and inputs ({keys}) equal the processor's",
                0.0,
            )
        )
    return results


def _refusal(encoder: Any, family: str) -> Parity:
    video_id = encoder.store.add_video(noise_video(2, (32, 32), 0))
    messages = [{"role": "user", "content": [{"type": "video", "video": video_id}, {"type": "text", "text": QUESTION}]}]
    try:
        encoder.encode(messages)
    except VlmregError as exc:
        ok = family in str(exc) and "video" in str(exc)
        return Parity("video refused", ok, f"refused: {exc}")
    return Parity("video refused", False, "the family declares no video, but a prompt with one was encoded")


def video_logprob_parity(family: str) -> list[Parity]:
    """Per-token logprobs of an answer after each video case's prompt, through vlmreg's micro-batches (alone, padded
    together, packed together), vs a plain forward of the model on the processor's own inputs."""

    loaded = _load(family)
    descriptor = loaded.resolved.descriptor
    if not descriptor.max_videos_per_message:
        return []
    encoder = PromptEncoder(loaded.processor, ImageStore(), descriptor)
    answer = encoder.tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [encoder.stop_ids[0]]
    samples, references = [], []
    for seed, case in enumerate(VIDEO_CASES):
        if sum(1 for kind, _ in case if kind == "video") > descriptor.max_videos_per_message:
            continue
        messages, media = _case(encoder, case, seed)
        prompt = encoder.encode(messages)
        reference = _reference(encoder, messages, media)
        extra = torch.tensor([answer])
        for key, value in list(reference.items()):
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == len(prompt.input_ids):
                fill = (
                    extra
                    if key == "input_ids"
                    else torch.ones_like(extra)
                    if key == "attention_mask"
                    else torch.zeros_like(extra)
                )
                reference[key] = torch.cat([value, fill.to(value.dtype)], dim=1)
        with torch.no_grad(), transformers_sdpa(loaded.model):
            logits = loaded.model(**reference, use_cache=False).logits.float()
        ids = reference["input_ids"][0]
        logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
        references.append(logp[-len(answer) :])
        tokens = prompt.input_ids + answer
        mask = [False] * len(prompt.input_ids) + [True] * len(answer)
        samples.append(
            TrainingSample(
                tokens,
                mask,
                [0.0] * len(tokens),
                prompt.image_ids,
                prompt.image_spans,
                1.0,
                seed,
                f"video sample {seed}",
            )
        )
    results = []
    modes = [("alone", False, True), ("padded", False, False)] + (
        [("packed", True, False)] if descriptor.packing else []
    )
    for name, packed, alone in modes:
        groups = [[k] for k in range(len(samples))] if alone else [list(range(len(samples)))]
        worst = 0.0
        with torch.no_grad():
            for group in groups:
                chosen = [samples[k] for k in group]
                for mb in make_microbatches(
                    chosen, loaded.resolved, encoder, budget=1 << 16, packed=packed, device=loaded.device
                ):
                    logp, _ = selected_logprobs(loaded.resolved, mb.inputs, mb.targets, mb.selection)
                    owner = mb.pick(mb.sample_index)
                    for k in mb.samples:
                        worst = max(worst, float((logp[owner == k] - references[group[k]]).abs().max()))
        results.append(
            Parity(
                f"video logprobs, {name}",
                worst <= LOGPROB_TOLERANCE,
                f"max |vlmreg - plain forward| = {worst:.1e} (tolerance {LOGPROB_TOLERANCE:.0e})",
                worst,
            )
        )
    return results


def video_parity_report(family: str) -> list[Parity]:
    """Every video check of a family: prompt parity and logprobs (or, without video, the refusal)."""
    return [*video_prompt_parity(family), *video_logprob_parity(family)]
