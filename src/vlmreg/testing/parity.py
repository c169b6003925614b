"""Parity of vlmreg's model inputs with independent references, for one family (no pytest needed).

Each check compares what vlmreg builds with what the family's own processor and a plain forward of the
model give, never with vlmreg's own output:

- `prompt_parity`: prompt ids and every other input the processor's own
  ``apply_chat_template(..., tokenize=True)`` returns, shapes included, equal vlmreg's for 1, 2 and 3 images of
  different sizes; a family whose ``collate_images`` lays image tensors out otherwise (per image rather than per
  prompt, say) declares the mapping in ``processor_layout`` and is compared through it, and `logprob_parity` holds
  the model to the same logits on both layouts;
- `logprob_parity`: per-token logprobs through vlmreg's micro-batches (alone, padded, packed) equal a plain
  forward of the model on the processor's own inputs;
- in `vlmreg.testing.rollout_parity`, `stop_parity` (generation stops at the family's turn end, the token the chat
  template closes a turn with) and `multiturn_parity` (a 3-turn conversation continued from the sampled tokens
  equals the processor's encoding of the whole conversation and merges into one sample);
- and, in `vlmreg.testing.video_parity`, the same for prompts with videos (or the refusal of one).

``vlmreg check`` prints these; the conformance suite asserts them.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import attrs

from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_registry

__all__ = [
    "IMAGE_SIZES",
    "Parity",
    "logprob_parity",
    "processor_inputs",
    "prompt_parity",
    "tiny_model",
    "tiny_processor",
]

#: (width, height) of the test images: three different sizes, so mixed sizes are always exercised.
IMAGE_SIZES = ((64, 64), (32, 64), (96, 32))
#: logprobs may differ from the reference forward by at most this much (fp32)
LOGPROB_TOLERANCE = 1e-5
#: the sampler's logprobs (incremental decoding with a KV cache, left padding) against a plain forward
SAMPLER_TOLERANCE = 1e-4
QUESTION = "what colour is the image ?"
ANSWER = "red"


@attrs.frozen
class Parity:
    """One comparison: its name, whether it holds, the number behind it, and what differed."""

    name: str
    ok: bool
    detail: str
    value: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail, "value": self.value}


def tiny_model(family: str, seed: int = 0) -> Any:
    """A fresh tiny random model of ``family`` on CPU, in fp32."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    # deferred: start-up cost (loads torch)
    from vlmreg.loading.build import build_model, tiny_config_of  # noqa: PLC0415

    descriptor = get_registry().get(family)
    torch.manual_seed(seed)
    return build_model(tiny_config_of(descriptor), descriptor).eval()


@functools.cache
def tiny_processor(family: str) -> Any:
    """The family's tiny processor (cached); `VlmregError` when the family has none."""
    descriptor = get_registry().get(family)
    if descriptor.tiny_processor is None:
        raise VlmregError(
            f"family {family!r} has no tiny_processor; parity checks need one to turn images and prompts into model "
            "inputs (see docs/reference.md, field tiny_processor)"
        )
    return descriptor.tiny_processor()


def noise_image(size: tuple[int, int], seed: int) -> Any:
    """An RGB image of random pixels: images that differ everywhere, so a swapped or dropped one shows."""
    # deferred: start-up cost (loads PIL)
    from PIL import Image  # noqa: PLC0415

    rng = random.Random(seed)
    width, height = size
    return Image.frombytes("RGB", (width, height), bytes(rng.randrange(256) for _ in range(width * height * 3)))


def _conversation(
    images: Sequence[Any], ids: Sequence[str], answer: str | None = None
) -> tuple[list[dict], list[dict]]:
    """The same user turn twice: with PIL images (for the processor) and with image ids (for vlmreg)."""
    pil = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": QUESTION}]
    by_id = [{"type": "image", "image": i} for i in ids] + [{"type": "text", "text": QUESTION}]
    first, second = [{"role": "user", "content": pil}], [{"role": "user", "content": by_id}]
    if answer is not None:
        first.append({"role": "assistant", "content": answer})
        second.append({"role": "assistant", "content": answer})
    return first, second


def _reference(processor: Any, messages: list[dict], **kwargs: Any) -> dict[str, Any]:
    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data.store import TARGET_KEYS  # noqa: PLC0415

    out = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt", **kwargs
    )
    return {k: v for k, v in out.items() if k not in TARGET_KEYS}  # the model's inputs: `labels` is a training target


def _setup(family: str, processor: Any = None) -> tuple[Any, Any, Any]:
    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data import ImageStore  # noqa: PLC0415
    from vlmreg.data.prompts import PromptEncoder  # noqa: PLC0415

    descriptor = get_registry().get(family)
    processor = processor if processor is not None else tiny_processor(family)
    store = ImageStore()
    return descriptor, processor, PromptEncoder(processor, store, descriptor)


def prompt_parity(
    family: str, sizes: Sequence[tuple[int, int]] = IMAGE_SIZES, *, processor: Any = None
) -> list[Parity]:
    """vlmreg's prompt encoding vs the processor's own (default: the tiny one), for 1, 2 and 3 images of different
    sizes."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    descriptor, processor, encoder = _setup(family, processor)
    results = []
    for count in range(1, min(len(sizes), max(descriptor.max_images_per_message, 1)) + 1):
        images = [noise_image(size, seed) for seed, size in enumerate(sizes[:count])]
        ids = [encoder.store.add(im) for im in images]
        pil, by_id = _conversation(images, ids)
        reference = _reference(processor, pil)
        prompt = encoder.encode(by_id)
        name = f"prompt, {count} image(s)"
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
        width = len(want)
        mine = encoder.token_inputs(
            width, [[(0, i, span) for i, span in zip(prompt.image_ids, prompt.image_spans, strict=True)]]
        )
        collated = encoder.image_inputs(prompt.image_ids)
        mine.update(collated)
        if "attention_mask" in reference:  # one prompt alone: vlmreg attends to every token
            mine["attention_mask"] = torch.ones((1, width), dtype=torch.long)
        try:
            mapped = _processor_layout(descriptor, collated)
        except VlmregError as exc:
            results.append(Parity(name, False, str(exc)))
            continue
        mine.update(mapped)
        problems = _compare_inputs(reference, mine, mapped=set(mapped))
        via = f"; {', '.join(sorted(mapped))} compared through the family's processor_layout" if mapped else ""
        detail = (
            "; ".join(problems) or f"{width} tokens, {len(images)} image(s): ids and inputs equal the processor's{via}"
        )
        results.append(Parity(name, not problems, detail, 0.0))
    return results


def _processor_layout(descriptor: Any, collated: dict[str, Any]) -> dict[str, Any]:
    """The tensors the family's ``processor_layout`` re-lays out for one prompt (empty without one or without
    images)."""
    if descriptor.processor_layout is None or not collated:
        return {}
    try:
        mapped = dict(descriptor.processor_layout(dict(collated)))
    except Exception as exc:  # the family's own code: say whose it is
        raise VlmregError(f"family {descriptor.name!r}: processor_layout raised {type(exc).__name__}: {exc}") from None
    unknown = sorted(set(mapped) - set(collated))
    if unknown:
        raise VlmregError(
            f"family {descriptor.name!r}: processor_layout returned {unknown}, which collate_images does not give "
            f"(it gives {sorted(collated)})"
        )
    return mapped


def _compare_inputs(reference: Mapping[str, Any], mine: Mapping[str, Any], mapped: Collection[str] = ()) -> list[str]:
    """Every input the processor returns (``input_ids`` aside) against vlmreg's, shapes included; one problem per
    input that is missing, shaped differently or valued differently. ``mapped`` names the inputs compared through the
    family's ``processor_layout``. Inputs vlmreg adds that the processor lacks are a problem too."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    problems = []
    for key, value in reference.items():
        if key == "input_ids":
            continue
        label = f"{key} (through processor_layout)" if key in mapped else key
        if key not in mine:
            problems.append(f"{key} missing: the processor gives {_shape(value)}, vlmreg nothing")
            continue
        got = mine[key]
        if not isinstance(value, torch.Tensor):
            if type(got) is not type(value) or not _same(got, value):
                problems.append(f"{label} differs: vlmreg {got!r} vs processor {value!r}")
            continue
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(value.shape):
            undeclared = (
                "" if key in mapped else " (a layout difference the family does not declare: see processor_layout)"
            )
            problems.append(
                f"{label} has shape {_shape(got)} in vlmreg, {_shape(value)} from the processor{undeclared}"
            )
            continue
        got = got.to(value.dtype)
        if not torch.equal(got, value):
            where = (got != value).nonzero()[0].tolist()
            problems.append(f"{label} differs (shape {_shape(value)}): first at index {where}")
    extra = sorted(set(mine) - set(reference))
    if extra:
        problems.append(f"vlmreg adds inputs the processor does not: {extra}")
    return problems


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):  # e.g. lists holding tensors: no single truth value
        return False


def _shape(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return str(tuple(shape)) if shape is not None else type(value).__name__


def _samples(encoder: Any, sizes: Sequence[tuple[int, int]], descriptor: Any) -> list[tuple[list[dict], Any]]:
    """Three samples (one image; text only; two images of other sizes), each a prompt plus a fixed answer."""
    # deferred: start-up cost (loads asyncio, concurrent, urllib.request)
    from vlmreg.train.samples import TrainingSample  # noqa: PLC0415

    plans = [[sizes[0]], [], list(sizes[1:3])]
    plans = [plan[: max(descriptor.max_images_per_message, 0)] for plan in plans]
    if descriptor.prefix_lm:  # a prefix-LM processor writes a prompt with its images (and may need one)
        plans = [plan for plan in plans if plan]
    answer = encoder.tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [encoder.stop_ids[0]]
    out = []
    for k, plan in enumerate(plans):
        images = [noise_image(size, 10 * k + j) for j, size in enumerate(plan)]
        ids = [encoder.store.add(im) for im in images]
        pil, by_id = _conversation(images, ids)
        prompt = encoder.encode(by_id)
        tokens = prompt.input_ids + answer
        mask = [False] * len(prompt.input_ids) + [True] * len(answer)
        out.append(
            (
                pil,
                TrainingSample(
                    tokens, mask, [0.0] * len(tokens), prompt.image_ids, prompt.image_spans, 1.0, k, f"sample {k}"
                ),
            )
        )
    return out


def processor_inputs(
    processor: Any, conversation: list[dict], completion: Sequence[int] = (), *, prefix_lm: str | None = None
) -> dict[str, Any]:
    """The processor's own inputs for a conversation's prompt (``apply_chat_template``, tokenized, with the
    generation prompt), with ``completion`` token ids appended (0 in every other token-aligned input; for a
    ``prefix_lm`` family 1 in the input it names, as its processor writes a ``suffix`` and ``generate`` marks what it
    samples)."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    inputs = _reference(processor, conversation)
    prompt = inputs["input_ids"].shape[1]
    extra = torch.tensor([list(completion)], dtype=torch.long)
    for key, value in list(inputs.items()):
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == prompt:
            fill = (
                extra
                if key == "input_ids"
                else torch.ones_like(extra)
                if key == "attention_mask" or key == prefix_lm
                else torch.zeros_like(extra)
            )
            inputs[key] = torch.cat([value, fill.to(value.dtype)], dim=1)
    return inputs


@contextlib.contextmanager
def transformers_sdpa(model: Any) -> Iterator[None]:
    """Run ``model`` with transformers' own sdpa attention (the reference; eager for a model transformers does not run
    with sdpa), whatever vlmreg set, then put back each sub-model's own (the vision encoder's may differ from the text
    model's)."""
    configs = {
        id(m.config): m.config
        for m in model.modules()
        if hasattr(getattr(m, "config", None), "_attn_implementation_internal")
    }
    previous = {key: config._attn_implementation_internal for key, config in configs.items()}
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:  # a model sdpa cannot run (one that soft-caps its attention logits): transformers' eager
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation_internal = previous[key]


def reference_attention(family: str, checkpoint: str | None = None) -> str:
    """The attention a check runs ``family``'s model with (its tiny shape, or ``checkpoint``'s config): transformers'
    sdpa, or eager for a model transformers does not run with sdpa (one that soft-caps its attention logits, as
    a prefix-LM family's decoder may), as `transformers_sdpa` chooses for the reference. Built on the meta device: no
    memory, no weights read."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    # deferred: start-up cost (loads transformers)
    from vlmreg.loading.build import load_config, model_class_for, tiny_config_of  # noqa: PLC0415
    from vlmreg.sdk.registry import get_registry  # noqa: PLC0415

    descriptor = get_registry().get(family)
    config = load_config(checkpoint) if checkpoint else tiny_config_of(descriptor)
    cls = model_class_for(descriptor)
    factory = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    try:
        with torch.device("meta"):
            factory(config, attn_implementation="sdpa")
    except ValueError:
        return "eager"
    return "sdpa"


def plain_logprobs(
    model: Any,
    processor: Any,
    conversation: list[dict],
    completion: Sequence[int],
    suppress: Sequence[int] = (),
    *,
    prefix_lm: str | None = None,
) -> Any:
    """Logprobs of ``completion`` after the conversation's prompt: one plain forward of the model (transformers'
    sdpa attention) on the processor's own inputs; ``suppress`` ids get no probability, as in the sampler.
    ``prefix_lm``: the completion is marked as the processor marks a suffix (`processor_inputs`)."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    inputs = processor_inputs(processor, conversation, completion, prefix_lm=prefix_lm)
    with torch.no_grad(), transformers_sdpa(model):
        logits = model(**inputs, use_cache=False).logits.float()
    if suppress:
        logits[..., list(suppress)] = float("-inf")
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, inputs["input_ids"][0, 1:, None]).squeeze(-1)
    return logp[logp.shape[0] - len(completion) :]


def _load(family: str) -> Any:
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    # deferred: start-up cost (loads cattrs)
    from vlmreg.config import parse_config  # noqa: PLC0415

    # deferred: start-up cost (loads cattrs, torch)
    from vlmreg.loading.load import load  # noqa: PLC0415

    torch.manual_seed(0)
    loaded = load(parse_config({"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}}))
    if loaded.resolved.descriptor.prepare_model is not None:
        loaded.resolved.descriptor.prepare_model(loaded.model)
    loaded.model.eval()
    return loaded


def logprob_parity(family: str, sizes: Sequence[tuple[int, int]] = IMAGE_SIZES) -> list[Parity]:
    """Per-token logprobs through vlmreg (alone, padded batch of mixed image sizes, packed) vs a plain forward."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data import ImageStore  # noqa: PLC0415
    from vlmreg.data.prompts import PromptEncoder  # noqa: PLC0415

    # deferred: start-up cost (loads torch)
    from vlmreg.modeling.logprobs import selected_logprobs  # noqa: PLC0415

    # deferred: start-up cost (loads asyncio, concurrent, torch, urllib.request)
    from vlmreg.train.batching import make_microbatches  # noqa: PLC0415

    loaded = _load(family)
    descriptor = loaded.resolved.descriptor
    encoder = PromptEncoder(loaded.processor, ImageStore(), descriptor)
    samples = _samples(encoder, sizes, descriptor)
    references = [
        plain_logprobs(
            loaded.model,
            loaded.processor,
            pil,
            s.input_ids[s.loss_mask.index(True) :],
            prefix_lm=descriptor.prefix_lm,
        )
        for pil, s in samples
    ]
    modes = [("alone", False, True), ("padded", False, False)]
    if descriptor.packing:
        modes.append(("packed", True, False))
    results = []
    for name, packed, alone in modes:
        groups = [[k] for k in range(len(samples))] if alone else [list(range(len(samples)))]
        worst = 0.0
        with torch.no_grad():
            for group in groups:
                chosen = [samples[k][1] for k in group]
                for mb in make_microbatches(
                    chosen, loaded.resolved, encoder, budget=1 << 16, packed=packed, device=loaded.device
                ):
                    # the trainer's path
                    logp, _ = selected_logprobs(loaded.resolved, mb.inputs, mb.targets, mb.selection)
                    owner = mb.pick(mb.sample_index)
                    for k in mb.samples:
                        worst = max(worst, float((logp[owner == k] - references[group[k]]).abs().max()))
        ok = worst <= LOGPROB_TOLERANCE
        results.append(
            Parity(
                f"logprobs, {name}",
                ok,
                f"max |vlmreg - plain forward| = {worst:.1e} (tolerance {LOGPROB_TOLERANCE:.0e})",
                worst,
            )
        )
    if not descriptor.packing:
        results.append(
            Parity("logprobs, packed", True, "family declares packing=False: micro-batches are padded", None)
        )
    return results
