"""Engine parity for video: a conversation with a video sent to a launched server (vLLM, or `vlmreg serve` in its
place) as the trainer's `OpenAIEngine` sends it (the trainer's frames and timing, `vlmreg.inference.video_request`),
against references the server and vlmreg did not write.

For a family that declares video, ``vlmreg check --engine vllm`` adds (`compare_server_video`): the server's prompt ids
against the family's processor given the stored frames with their metadata (``do_sample_frames=False``) and its own
chat template, and against vlmreg's `PromptEncoder`; and the logprobs the server gives its sampled tokens against one
plain fp32 forward on the processor's inputs (pixels included). The clip has an odd frame count (the processor pads the
last temporal patch) and a frame size the processor resizes (the family's ``engine_video`` resizes it first).
"""

from __future__ import annotations

from typing import Any

from vlmreg.sdk.engine import SamplingParams
from vlmreg.sdk.errors import VlmregError
from vlmreg.testing.engine_compare import COMPLETION_TOKENS, Comparison, first_difference, plain_forward_logprobs
from vlmreg.testing.parity import QUESTION

__all__ = ["VIDEO_CLIP", "compare_server_video"]

#: (frames, (width, height)) of the check's clip: 5 frames (odd), a size a patch-16 video processor resizes
VIDEO_CLIP = (5, (90, 70))


def _processor_inputs(processor: Any, chat: list[dict], media: dict[str, Any], completion: list[int]) -> Any:
    """The processor's own inputs for the rendered prompt and the stored frames, ``completion`` appended."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    out = dict(processor(text=[text], **media, return_tensors="pt"))
    out.pop("video_metadata", None)
    prompt = out["input_ids"].shape[1]
    extra = torch.tensor([completion], dtype=torch.long)
    for key, value in list(out.items()):
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == prompt:
            fill = extra if key == "input_ids" else torch.ones_like(extra) if key == "attention_mask" else 0 * extra
            out[key] = torch.cat([value, fill.to(value.dtype)], dim=1)
    return out


def compare_server_video(
    engine: Any, processor: Any, reference: Any, descriptor: Any, tolerance: float, *, label: str = ""
) -> list[Comparison]:
    """Send one video conversation through ``engine`` (an `OpenAIEngine` with the trainer's processor) and compare the
    server's prompt ids and logprobs with the processor's and a plain forward of ``reference`` (fp32)."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data.prompts import template_messages, vision_token_ids  # noqa: PLC0415
    from vlmreg.data.store import video_inputs  # noqa: PLC0415

    # deferred: start-up cost (loads torch; `vlmreg check --help` reads engine_parity, which imports this module)
    from vlmreg.testing.video_parity import noise_video  # noqa: PLC0415

    name = f"{label}1 video ({VIDEO_CLIP[0]} frames of {VIDEO_CLIP[1][0]}x{VIDEO_CLIP[1][1]})"
    video_id = engine.store.add_video(noise_video(VIDEO_CLIP[0], VIDEO_CLIP[1], 7))
    stored = engine.store.video(video_id)
    media = video_inputs(stored, [engine.store.get(f) for f in stored.frame_ids])
    by_id = [{"role": "user", "content": [{"type": "video", "video": video_id}, {"type": "text", "text": QUESTION}]}]
    chat, _ = template_messages(by_id)
    suppress = sorted(vision_token_ids(processor, descriptor))
    params = SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=COMPLETION_TOKENS, suppress_token_ids=tuple(suppress)
    )
    try:
        body = engine.answer(by_id, params, name=name)
        prompt = [int(t) for t in body["prompt_token_ids"]]
        tokens = [int(t) for t in body["choices"][0]["token_ids"]]
        logprobs = [float(e["logprob"]) for e in body["choices"][0]["logprobs"]["content"]]
    except VlmregError as exc:
        return [Comparison(f"{name}: request", "FAIL", str(exc))]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return [Comparison(f"{name}: request", "FAIL", f"the answer lacks {exc}")]
    want = _processor_inputs(processor, chat, media, [])["input_ids"][0].tolist()
    mine = engine.prompts.encode(by_id).input_ids
    out = [
        Comparison(
            f"{name}: prompt ids vs {who}",
            "PASS" if prompt == ref else "FAIL",
            f"{len(prompt)} tokens, equal (timestamps and markup included)"
            if prompt == ref
            else first_difference(prompt, ref),
        )
        for who, ref in (("the processor", want), ("vlmreg", mine))
    ]
    if not tokens or len(tokens) != len(logprobs):
        return [
            *out,
            Comparison(
                f"{name}: logprobs vs a plain forward", "FAIL", f"{len(tokens)} tokens, {len(logprobs)} logprobs"
            ),
        ]
    expected = plain_forward_logprobs(
        reference, _processor_inputs(processor, chat, media, tokens), len(tokens), suppress
    )
    diff = (torch.tensor(logprobs) - expected).abs()
    worst = float(diff.max())
    out.append(
        Comparison(
            f"{name}: logprobs vs a plain forward",
            "PASS" if worst <= tolerance else "FAIL",
            f"{len(tokens)} sampled tokens: max |engine - fp32 forward| = {worst:.1e}, mean {float(diff.mean()):.1e} "
            f"(tolerance {tolerance:.0e})",
            worst,
        )
    )
    return out
