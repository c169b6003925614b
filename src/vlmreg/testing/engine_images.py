"""Engine parity for text and images: conversations with 0 to 3 images sent to a server (vLLM, or `vlmreg serve` in its
place) as the trainer's `OpenAIEngine` sends them, against references the server and vlmreg did not write.

`compare_server` asks the server about each case (`image_cases`: text only, then 1, 2 and 3 images of different sizes,
as many as the family takes in one message) and compares its prompt ids with the family's processor's and with
vlmreg's `PromptEncoder`'s, and the logprobs of its sampled tokens with one plain fp32 forward on the processor's
inputs. `engine_processor_parity` compares the processor saved beside an exported checkpoint, loaded as vLLM loads
it, with the trainer's. `vlmreg.testing.engine_parity` launches the server and runs these; video is
`vlmreg.testing.engine_video`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmreg.sdk.engine import SamplingParams
from vlmreg.sdk.errors import VlmregError
from vlmreg.testing.engine_compare import (
    COMPLETION_TOKENS,
    Comparison,
    first_difference,
    plain_forward_logprobs,
)
from vlmreg.testing.parity import IMAGE_SIZES, QUESTION, noise_image, processor_inputs

__all__ = ["compare_server", "engine_processor_parity", "image_cases"]


def image_cases(descriptor: Any) -> tuple[list[tuple[str, list[Any]]], list[Comparison]]:
    """Text only, then 1, 2 and 3 images of different sizes (as many as one message may carry); SKIPs for the rest."""
    most = descriptor.max_images_per_message if descriptor.supports_vision else 0
    cases: list[tuple[str, list[Any]]] = [("text only", [])]
    skipped = []
    if descriptor.prefix_lm and most > 0:  # a prefix-LM processor writes a prompt with its images (and may need one)
        cases = []
        skipped.append(
            Comparison(
                "text only: prompt",
                "SKIP",
                f"family {descriptor.name} is a prefix LM (prefix_lm = {descriptor.prefix_lm!r}): its processor writes "
                "a prompt with its image, as training does",
            )
        )
    for count in range(1, len(IMAGE_SIZES) + 1):
        name = f"{count} image{'s' if count > 1 else ''}"
        if count <= most:
            cases.append((name, [noise_image(size, seed) for seed, size in enumerate(IMAGE_SIZES[:count])]))
        else:
            skipped.append(
                Comparison(
                    f"{name}: prompt", "SKIP", f"family {descriptor.name} takes at most {most} image(s) per message"
                )
            )
    return cases, skipped


def _plain_logprobs(
    model: Any,
    processor: Any,
    conversation: list[dict],
    completion: Sequence[int],
    suppress: Sequence[int],
    prefix_lm: str | None = None,
) -> Any:
    """The completion's logprobs from one plain forward (transformers' sdpa, fp32) on the processor's own inputs (a
    ``prefix_lm`` family's completion marked as its processor marks a suffix)."""
    return plain_forward_logprobs(
        model, processor_inputs(processor, conversation, completion, prefix_lm=prefix_lm), len(completion), suppress
    )


def compare_server(
    engine: Any,
    processor: Any,
    reference: Any,
    descriptor: Any,
    tolerance: float,
    *,
    cases: Sequence[tuple[str, list[Any]]] | None = None,
    label: str = "",
    saved: Any = None,
) -> list[Comparison]:
    """Ask the server behind ``engine`` (an `OpenAIEngine` with the trainer's processor) about each case and compare its
    prompt ids with ``processor``'s and with vlmreg's `PromptEncoder`'s (and with ``saved``'s, the processor the engine
    loaded, when given), and its sampled tokens' logprobs with a plain forward of ``reference`` (the same weights,
    fp32)."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data.prompts import vision_token_ids  # noqa: PLC0415

    skipped: list[Comparison] = []
    if cases is None:
        cases, skipped = image_cases(descriptor)
    suppress = sorted(vision_token_ids(processor, descriptor))
    params = SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=COMPLETION_TOKENS, suppress_token_ids=tuple(suppress)
    )
    out: list[Comparison] = []
    for name, images in cases:
        name = f"{label}{name}"
        ids = [engine.store.add(im) for im in images]
        pil = [
            {
                "role": "user",
                "content": [*({"type": "image", "image": im} for im in images), {"type": "text", "text": QUESTION}],
            }
        ]
        by_id = [
            {
                "role": "user",
                "content": [*({"type": "image", "image": i} for i in ids), {"type": "text", "text": QUESTION}],
            }
        ]
        try:
            body = engine.answer(by_id, params, name=name)
            prompt = [int(t) for t in body["prompt_token_ids"]]
            choice = body["choices"][0]
            tokens = [int(t) for t in choice["token_ids"]]
            logprobs = [float(e["logprob"]) for e in choice["logprobs"]["content"]]
        except VlmregError as exc:
            out.append(Comparison(f"{name}: request", "FAIL", str(exc)))
            continue
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            out.append(
                Comparison(
                    f"{name}: request",
                    "FAIL",
                    f"the answer lacks {exc}: the server must return prompt_token_ids, token_ids and logprobs",
                )
            )
            continue
        want = processor_inputs(processor, pil)["input_ids"][0].tolist()
        same = prompt == want
        out.append(
            Comparison(
                f"{name}: prompt ids vs the processor",
                "PASS" if same else "FAIL",
                f"{len(prompt)} tokens, equal" if same else first_difference(prompt, want),
            )
        )
        if saved is not None:  # the engine's own processor (transformers' class, as vLLM loads it)
            theirs = processor_inputs(saved, pil)["input_ids"][0].tolist()
            out.append(
                Comparison(
                    f"{name}: prompt ids vs AutoProcessor",
                    "PASS" if prompt == theirs else "FAIL",
                    f"{len(prompt)} tokens, equal" if prompt == theirs else first_difference(prompt, theirs),
                )
            )
        mine = engine.prompts.encode(by_id).input_ids
        out.append(
            Comparison(
                f"{name}: prompt ids vs vlmreg",
                "PASS" if prompt == mine else "FAIL",
                f"{len(prompt)} tokens, equal" if prompt == mine else first_difference(prompt, mine),
            )
        )
        if not tokens or len(tokens) != len(logprobs):
            out.append(
                Comparison(
                    f"{name}: logprobs vs a plain forward",
                    "FAIL",
                    f"{len(tokens)} tokens with {len(logprobs)} logprobs",
                )
            )
            continue
        diff = (
            torch.tensor(logprobs) - _plain_logprobs(reference, processor, pil, tokens, suppress, descriptor.prefix_lm)
        ).abs()
        worst = float(diff.max())
        note = "" if same else " (on the processor's prompt, which the engine's differs from)"
        out.append(
            Comparison(
                f"{name}: logprobs vs a plain forward",
                "PASS" if worst <= tolerance else "FAIL",
                f"{len(tokens)} sampled tokens: max |engine - fp32 forward| = {worst:.1e}, mean "
                f"{float(diff.mean()):.1e} (tolerance {tolerance:.0e}){note}",
                worst,
            )
        )
    return [*out, *skipped]


def engine_processor_parity(directory: Path, processor: Any, descriptor: Any) -> tuple[Comparison, Any]:
    """The processor saved beside the checkpoint, loaded as vLLM loads it (``AutoProcessor``), against the trainer's on
    the prompt with the most images; returns the comparison and that processor (``None`` when it did not load whole)."""
    # deferred: start-up cost (loads transformers)
    from transformers import AutoProcessor  # noqa: PLC0415

    name = "engine processor (AutoProcessor) vs the trainer's"
    cases, _ = image_cases(descriptor)
    images = cases[-1][1]
    try:
        saved = AutoProcessor.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises is the finding
        return Comparison(
            name, "FAIL", f"AutoProcessor.from_pretrained({directory}) raised {type(exc).__name__}: {exc}"
        ), None
    if images and getattr(saved, "image_processor", None) is None:
        return Comparison(
            name, "FAIL", f"AutoProcessor gave a {type(saved).__name__} with no image processor (torchvision missing?)"
        ), None
    pil = [
        {
            "role": "user",
            "content": [*({"type": "image", "image": im} for im in images), {"type": "text", "text": QUESTION}],
        }
    ]
    got, want = (processor_inputs(p, pil)["input_ids"][0].tolist() for p in (saved, processor))
    return Comparison(
        name,
        "PASS" if got == want else "FAIL",
        f"{type(saved).__name__}, {len(images)} images: {len(got)} tokens, equal"
        if got == want
        else first_difference(got, want),
    ), saved
