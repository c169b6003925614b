"""Chat messages with image ids -> the token ids and model inputs the family's processor gives them.

The family's processor is the truth. The chat template renders each image as the family's placeholder;
each image goes through the processor once, alone (`ImageStore.features`), which tells what the
placeholder expands to for that image; the rendered text is tokenized around the placeholders and the
expansions are spliced in, so each image owns one span of the ids. This equals the processor's own
encoding of the whole prompt (added tokens split text before anything else; plain text an expansion
adds around itself is tokenized with its neighbours), which the conformance suite and ``vlmreg check``
verify per family, without processing pixels again on every turn.

Multi-turn conversations grow from the tokens actually sampled (`PromptEncoder.extend`): the next prompt
is this prompt, the completion's tokens, and the new messages as the template renders them after an
assistant turn, never a re-render of the history (which a template may change, e.g. by dropping
reasoning from earlier turns).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from vlmreg.data.store import (
    Collate,
    ImageFeatures,
    ImageStore,
    ImageTokenError,
    aligned_keys,
    collate_on_device,
    is_video_id,
    pad_and_concat,
)
from vlmreg.sdk.engine import EncodedPrompt
from vlmreg.sdk.errors import VlmregError

__all__ = [
    "EncodedPrompt",
    "ImageTokenError",
    "ProcessorContractError",
    "PromptEncoder",
    "image_placeholder",
    "template_messages",
    "turn_end_ids",
    "video_placeholder",
    "vision_token_ids",
]

#: How many images' prefix-LM expansions (`PromptEncoder._prefix_expansion`) are kept before the cache starts again.
_EXPANSIONS_KEPT = 4096
# Stand-ins rendered through the chat template to find where an assistant turn ends in its output.
_USER_PROBE = "vlmreg probe question"
_ASSISTANT_PROBE = "vlmreg probe answer 7f3a"


class ProcessorContractError(VlmregError):
    """The family's processor does not do what vlmreg needs of it (docs/reference.md, "The processor contract")."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _tokenizer(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


def image_placeholder(processor: Any, descriptor: Any = None) -> str:
    """The text the chat template renders for one image: the family's ``image_placeholder``, else the processor's image
    token."""
    placeholder = getattr(descriptor, "image_placeholder", None) or getattr(processor, "image_token", None)
    if not placeholder:
        if descriptor is None:
            raise VlmregError(
                f"the processor ({type(processor).__name__}) has no image_token; give the family's descriptor, with "
                "its image_placeholder"
            )
        raise VlmregError(
            f"family {descriptor.name}: the processor has no image_token; set the descriptor's image_placeholder"
        )
    return placeholder


def video_placeholder(processor: Any, descriptor: Any = None) -> str | None:
    """The text the chat template renders for one video: the family's ``video_placeholder``, else the processor's
    video token; ``None`` for a family that takes no video (``max_videos_per_message = 0``)."""
    if descriptor is not None and not getattr(descriptor, "max_videos_per_message", 0):
        return None
    return getattr(descriptor, "video_placeholder", None) or getattr(processor, "video_token", None) or None


def _single_token(tokenizer: Any, token: str, what: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise VlmregError(f"{what} {token!r} is {len(ids)} tokens for this tokenizer ({ids}); it must be exactly one")
    return int(ids[0])


def turn_end_ids(processor: Any, descriptor: Any = None) -> tuple[int, ...]:
    """Ids that end an assistant turn: the family's ``turn_end_tokens`` and the tokenizer's end-of-text token."""
    tokenizer = _tokenizer(processor)
    tokens = tuple(getattr(descriptor, "turn_end_tokens", ()) or ())
    ids = [_single_token(tokenizer, t, "turn_end_tokens entry") for t in tokens]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise VlmregError("no turn-end token: the family names none and the tokenizer has no eos token")
    return tuple(ids)


def vision_token_ids(processor: Any, descriptor: Any) -> tuple[int, ...]:
    """Ids of the family's vision special tokens: generated text must never contain them (they would claim
    image features that do not exist), so the sampler and the trainer give them no probability."""
    tokens = {image_placeholder(processor, descriptor)}
    if getattr(processor, "image_token", None):
        tokens.add(processor.image_token)
    if descriptor is not None and descriptor.vision_tokens is not None:
        tokens |= {t for t in attrs.astuple(descriptor.vision_tokens) if t}
    tokenizer = _tokenizer(processor)
    ids = {tokenizer.convert_tokens_to_ids(t) for t in tokens}
    return tuple(sorted(i for i in ids if i is not None and i != tokenizer.unk_token_id))


def template_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages as chat templates expect them (``{"type": "image"}`` / ``{"type": "video"}`` parts) and the image and
    video ids in order."""
    out, image_ids = [], []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        parts = []
        for part in content:
            if part.get("type") in ("image", "video"):
                image_ids.append(part[part["type"]])
                parts.append({"type": part["type"]})
            else:
                parts.append(dict(part))
        out.append({"role": message["role"], "content": parts})
    return out, image_ids


class PromptEncoder:
    """Encodes conversations for one family's processor, with the run's `ImageStore`.

    ``descriptor`` supplies the image placeholder, the turn-end tokens and the image collation
    (``None``: the processor's image token, the tokenizer's eos, `pad_and_concat`).
    """

    def __init__(self, processor: Any, store: ImageStore, descriptor: Any = None) -> None:
        self.processor, self.store, self.descriptor = processor, store, descriptor
        self.tokenizer = _tokenizer(processor)
        self.placeholder = image_placeholder(processor, descriptor)
        self.video_placeholder = video_placeholder(processor, descriptor)
        marks = sorted({m for m in (self.placeholder, self.video_placeholder) if m is not None}, key=len, reverse=True)
        self._placeholders = re.compile("|".join(re.escape(m) for m in marks))
        self.stop_ids = turn_end_ids(processor, descriptor)
        self.collate: Collate = getattr(descriptor, "collate_images", None) or pad_and_concat
        # a prefix-LM processor writes a prompt only as a whole (images, then its own separator, the text, its end):
        # prompts are its own encoding, and each image's expansion is what it adds for one more image
        self.prefix_lm: str | None = getattr(descriptor, "prefix_lm", None) or None  # the input marking the prefix
        self._expansions: dict[str, tuple[tuple[int, ...], dict[str, tuple[int, ...]]]] = {}

    # -- images ---------------------------------------------------------------------------
    def image(self, image_id: str) -> ImageFeatures:
        """The processor's features for an image or a video (an id beginning ``video:``)."""
        if is_video_id(image_id):
            if self.video_placeholder is None:
                raise ImageTokenError(self._no_video())
            return self.store.features(image_id, self.processor, self.video_placeholder)
        features = self.store.features(image_id, self.processor, self.placeholder)
        if self.prefix_lm:
            token_ids, token_inputs = self._prefix_expansion(image_id)
            return attrs.evolve(features, token_ids=token_ids, token_inputs=token_inputs, text_before="", text_after="")
        return features

    def _prefix_expansion(self, image_id: str) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
        """A prefix-LM processor's expansion of one image: what one more copy of the image adds to its encoding (the
        processor's own separator after the last image, a ``<bos>`` say, is not part of any image)."""
        if image_id in self._expansions:
            return self._expansions[image_id]
        image = self.store.get(image_id)
        keys = self.store.features(image_id, self.processor, self.placeholder).token_inputs
        encode = lambda count: self.processor(  # noqa: E731
            text=[self.placeholder * count], images=[[image] * count], add_special_tokens=False, return_tensors="pt"
        )
        one, two = encode(1), encode(2)
        a, b = one["input_ids"][0].tolist(), two["input_ids"][0].tolist()
        n = len(b) - len(a)
        if n <= 0 or b[n:] != a or b[:n] != a[:n]:
            raise ProcessorContractError(
                f"family {self.descriptor.name} (prefix_lm): its processor's encoding of two copies "
                f"of an image ({len(b)} tokens) is not one image's ({len(a)} tokens) with one expansion more in front, "
                "so vlmreg cannot tell which tokens an image owns"
            )
        found = (tuple(int(t) for t in b[:n]), {k: tuple(int(x) for x in two[k][0][:n].tolist()) for k in keys})
        if len(self._expansions) >= _EXPANSIONS_KEPT:  # a cache of token ids, bounded as the store's features are
            self._expansions.clear()
        self._expansions[image_id] = found
        return found

    def _no_video(self) -> str:
        if self.descriptor is None:
            return (
                f"the processor ({type(self.processor).__name__}) has no video token, and no family's descriptor names "
                "a video placeholder; give the frames as images, or the family's descriptor"
            )
        return (
            f"family {self.descriptor.name} takes no video input (its descriptor's max_videos_per_message is 0); give "
            "the frames as images, or use a family that declares video"
        )

    def image_inputs(self, image_ids: Sequence[str], device: Any = None) -> dict[str, Any]:
        """The images' and videos' tensors for one forward pass, in order (repeats included), each kind collated by
        the family (images before videos in the dict; a processor's own order). ``device``: a CUDA device where the
        pixels go (`vlmreg.data.store.collate_on_device`) when the family collates by default; the rest stays here."""
        collate = self.collate
        if device is not None and getattr(device, "type", device) == "cuda" and collate is pad_and_concat:
            collate = functools.partial(collate_on_device, device=device)
        images = [self.image(i).tensors for i in image_ids if not is_video_id(i)]
        videos = [self.image(i).tensors for i in image_ids if is_video_id(i)]
        out: dict[str, Any] = dict(collate(images)) if images else {}
        if videos:
            out.update(collate(videos))
        return out

    @functools.cached_property
    def _text_probe(self) -> tuple[tuple[str, ...], list[int], list[int]]:
        """What the processor does to plain text: its token-aligned inputs, and the special tokens it adds before and
        after."""
        if self.prefix_lm:  # never asked: prompts are the processor's own encoding, its token inputs the images'
            return (), [], []
        try:
            out = self.processor(text=["a"], return_tensors="pt")
        except Exception as exc:  # a processor that requires images with any text (a prefix-LM one)
            who = f"family {self.descriptor.name}: its" if self.descriptor is not None else "the"
            raise ProcessorContractError(
                f"{who} processor ({type(self.processor).__name__}) refuses text without images ({_first_line(exc)}). "
                "vlmreg encodes a prompt as its text with each image's expansion spliced in, so the processor contract "
                "(docs/reference.md, 'The processor contract') requires a processor that encodes text alone; the "
                "descriptor field prefix_lm lifts it for a prefix-LM processor (one that writes the images, then the "
                "text, as one prompt prefix): vlmreg then takes each prompt as the processor "
                "encodes it whole, with its images"
            ) from None
        plain = self._encode_text("a")
        ids = [int(t) for t in out["input_ids"][0].tolist()]
        at = next((i for i in range(len(ids) - len(plain) + 1) if ids[i : i + len(plain)] == plain), 0)
        return tuple(sorted(aligned_keys(out))), ids[:at], ids[at + len(plain) :]

    def token_input_keys(self, image_ids: Sequence[str] = ()) -> list[str]:
        """Token-aligned inputs the processor gives (for text alone, and for these images)."""
        keys = list(self._text_probe[0])
        for image_id in dict.fromkeys(image_ids):
            keys += [k for k in self.image(image_id).token_inputs if k not in keys]
        return keys

    def token_inputs(self, width: int, rows: Sequence[Sequence[tuple[int, str, tuple[int, int]]]]) -> dict[str, Any]:
        """Token-aligned inputs for a (rows, width) batch: 0 over text, the processor's values over each image's span.

        ``rows`` lists, per row, ``(offset, image_id, (start, end))`` for every image placed in it.
        """
        # deferred: start-up cost (loads torch)
        import torch  # noqa: PLC0415

        keys = self.token_input_keys([image_id for row in rows for _, image_id, _ in row])
        out = {k: torch.zeros((len(rows), width), dtype=torch.long) for k in keys}
        for r, row in enumerate(rows):
            for offset, image_id, (start, end) in row:
                for key, values in self.image(image_id).token_inputs.items():
                    out[key][r, offset + start : offset + end] = torch.tensor(values, dtype=torch.long)
        return out

    # -- text ---------------------------------------------------------------------------
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[str]]:
        chat, image_ids = template_messages(messages)
        if self.video_placeholder is None and any(is_video_id(i) for i in image_ids):
            raise ImageTokenError(self._no_video())  # before the template, which may refuse a video part its own way
        text = self.processor.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, tokenize=False, **(template_kwargs or {})
        )
        return text, image_ids

    def tokenize(self, text: str, image_ids: Sequence[str], where: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of rendered text whose placeholders stand for ``image_ids``, and each image's span."""
        if self.video_placeholder is None and any(is_video_id(i) for i in image_ids):
            raise ImageTokenError(f"{where}: {self._no_video()}")
        pieces = self._placeholders.split(text)
        marks = self._placeholders.findall(text)
        if len(marks) != len(image_ids):
            shown = " / ".join(repr(p) for p in (self.placeholder, self.video_placeholder) if p)
            what = ("image or video", "image(s) and video(s)") if self.video_placeholder else ("image", "image(s)")
            raise ImageTokenError(
                f"{where}: the chat template rendered {len(marks)} {what[0]} placeholder(s) {shown} for "
                f"{len(image_ids)} {what[1]}; an image would be dropped or duplicated"
            )
        for k, (mark, image_id) in enumerate(zip(marks, image_ids, strict=True)):
            if (mark == self.video_placeholder) != is_video_id(image_id):
                kind = "a video" if is_video_id(image_id) else "an image"
                raise ImageTokenError(
                    f"{where}: placeholder {k + 1} is {mark!r}, but it stands for {kind}; the template reordered "
                    "images and videos"
                )
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        pending = pieces[0]
        for image_id, piece in zip(image_ids, pieces[1:], strict=True):
            features = self.image(image_id)
            ids += self._encode_text(pending + features.text_before)
            spans.append((len(ids), len(ids) + features.tokens))
            ids += features.token_ids
            pending = features.text_after + piece
        ids += self._encode_text(pending)
        return ids, spans

    def _encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def encode(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        where: str = "prompt",
    ) -> EncodedPrompt:
        """Render and tokenize a conversation; each image's expansion is spliced in and checked."""
        text, image_ids = self.render(
            messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs
        )
        if self.prefix_lm:
            return self._encode_whole(text, image_ids, where)
        ids, spans = self.tokenize(text, image_ids, where)
        bos = self.tokenizer.bos_token
        # as apply_chat_template: the processor's own special tokens, unless the template has them
        if not (bos and text.startswith(bos)):
            _, before, after = self._text_probe
            ids = [*before, *ids, *after]
            spans = [(start + len(before), end + len(before)) for start, end in spans]
        return EncodedPrompt(input_ids=ids, image_ids=image_ids, image_spans=spans, text=text)

    def _encode_whole(self, text: str, image_ids: Sequence[str], where: str) -> EncodedPrompt:
        """A prefix-LM family's prompt: the processor's own encoding of the rendered text with its images, each
        image's span found in order (no video: a prefix-LM family declares none, and `render` refuses one)."""
        images = [self.store.get(i) for i in image_ids]
        bos = self.tokenizer.bos_token
        try:
            out = self.processor(
                text=[text],
                images=[images] if images else None,
                add_special_tokens=not (bos and text.startswith(bos)),  # as apply_chat_template(tokenize=True)
                return_tensors="pt",
            )
        except Exception as exc:  # the processor's own refusal, e.g. a prompt without an image
            raise ProcessorContractError(
                f"{where}: family {self.descriptor.name} (prefix_lm): its processor "
                f"({type(self.processor).__name__}) refused the prompt with {len(images)} image(s) "
                f"({_first_line(exc)}); a prefix-LM processor writes each prompt with its images, and one that needs "
                "an image needs one in every prompt"
            ) from None
        ids = [int(t) for t in out["input_ids"][0].tolist()]
        spans: list[tuple[int, int]] = []
        at = 0
        for k, image_id in enumerate(image_ids):
            expansion = list(self.image(image_id).token_ids)
            start = next(
                (i for i in range(at, len(ids) - len(expansion) + 1) if ids[i : i + len(expansion)] == expansion), None
            )
            if start is None:
                raise ImageTokenError(
                    f"{where}: image {k + 1} of {len(image_ids)}: its {len(expansion)} expansion tokens are not in the "
                    "processor's encoding of the prompt after the images before it"
                )
            spans.append((start, start + len(expansion)))
            at = start + len(expansion)
        return EncodedPrompt(input_ids=ids, image_ids=list(image_ids), image_spans=spans, text=text)

    def continuation_text(
        self, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None
    ) -> tuple[str, int]:
        """What the template renders after an assistant turn's end token, for ``messages`` and the next generation
        prompt; and that end token's id (the first turn-end token the template puts after the turn's content)."""
        probe = [{"role": "user", "content": _USER_PROBE}, {"role": "assistant", "content": _ASSISTANT_PROBE}]
        text, _ = self.render([*probe, *messages], template_kwargs=template_kwargs)
        at = text.find(_ASSISTANT_PROBE)
        if at < 0:
            raise VlmregError(
                "the chat template does not render an assistant message's content; multi-turn prompts cannot be "
                "continued"
            )
        after = at + len(_ASSISTANT_PROBE)
        ends = [
            (text.find(token, after), token, i)
            for token, i in zip(self._turn_end_strings(), self.stop_ids, strict=True)
        ]
        ends = [end for end in ends if end[0] >= 0]
        if not ends:
            raise VlmregError(
                "the chat template ends an assistant turn with none of the turn-end tokens "
                f"{self._turn_end_strings()}; set the family's turn_end_tokens"
            )
        index, token, token_id = min(ends)
        return text[index + len(token) :], token_id

    def _turn_end_strings(self) -> list[str]:
        return [self.tokenizer.convert_ids_to_tokens(i) for i in self.stop_ids]

    def extend(
        self,
        prompt: EncodedPrompt,
        completion_ids: Sequence[int],
        messages: Sequence[Mapping[str, Any]],
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        where: str = "prompt",
    ) -> EncodedPrompt:
        """The next turn's prompt: ``prompt``, the sampled ``completion_ids`` (closed by a turn-end token when it was
        cut short), then ``messages`` and the generation prompt as the template renders them after a turn."""
        if self.prefix_lm:
            raise VlmregError(
                f"{where}: family {self.descriptor.name} is a prefix-LM family (descriptor field "
                "prefix_lm): its processor writes a conversation as one prompt prefix, with every image first and the "
                "text after, so a prompt cannot go on after a sampled turn, and a sampled turn would be attended "
                "bidirectionally as part of the next prompt; its episodes take one turn (an environment or task "
                "that answers with more messages cannot run on it)"
            )
        text, turn_end = self.continuation_text(messages, template_kwargs)
        ids = [*prompt.input_ids, *completion_ids]
        if not completion_ids or completion_ids[-1] not in self.stop_ids:
            ids.append(turn_end)
        _, image_ids = template_messages(messages)
        more, spans = self.tokenize(text, image_ids, where)
        offset = len(ids)
        return EncodedPrompt(
            input_ids=ids + more,
            image_ids=[*prompt.image_ids, *image_ids],
            image_spans=[*prompt.image_spans, *((s + offset, e + offset) for s, e in spans)],
            text=prompt.text + self.tokenizer.decode(ids[len(prompt.input_ids) :]) + text,
        )

    # -- checks ---------------------------------------------------------------------------
    def check(
        self, input_ids: Sequence[int], image_ids: Sequence[str], spans: Sequence[tuple[int, int]], where: str
    ) -> None:
        """Raise `ImageTokenError` naming ``where`` unless every image's span holds exactly its expansion."""
        if len(image_ids) != len(spans):
            raise ImageTokenError(f"{where}: {len(image_ids)} image(s) but {len(spans)} image span(s)")
        previous = 0
        for k, (image_id, (start, end)) in enumerate(zip(image_ids, spans, strict=True)):
            expected = self.image(image_id).token_ids
            if start < previous or end > len(input_ids) or tuple(input_ids[start:end]) != expected:
                raise ImageTokenError(
                    f"{where}: image {k + 1} of {len(image_ids)} should occupy tokens {start}..{end} with its "
                    f"{len(expected)} expansion tokens, but they differ: tokens and images disagree"
                )
            previous = end
