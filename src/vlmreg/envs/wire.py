"""The remote-environment protocol on the wire (version 1): JSON bodies, images as base64 PNG keyed by content id.

An image travels as ``"images": {ID: BASE64_PNG}`` next to the messages that refer to it by ``{"type": "image",
"image": ID}``. ``ID`` is the image's content hash (`vlmreg.data.store.image_id_of`: the same pixels give the same id
in every process), so the receiver adds the decoded image to its own `ImageStore` and checks that the id it gets is
the id it was given: an image that does not match its id is refused. Everything received is checked against the
schema; a violation is a `ProtocolError` naming what was wrong.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Iterator, Mapping
from typing import Any

from vlmreg.sdk.environment import EnvStep
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.example import Example

__all__ = [
    "API_KEY_HEADER",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "decode_images",
    "encode_images",
    "example_from_json",
    "example_to_json",
    "messages_from_json",
    "step_from_json",
    "step_to_json",
]

PROTOCOL = "vlmreg-env"
PROTOCOL_VERSION = 1
#: The header a request proves the API key with (as ``vlmreg serve``): ``Authorization: Bearer KEY``.
API_KEY_HEADER = "Authorization"
MAX_IMAGE_PIXELS = 16_000_000
MAX_IMAGE_BYTES = 20_000_000


class ProtocolError(VlmregError):
    """A body that breaks the protocol's schema (a lying or out-of-date peer)."""


def _image_ids_in(value: Any, store: Any) -> Iterator[str]:
    """Strings anywhere in ``value`` (messages, metadata) that name an image held in ``store``."""
    if isinstance(value, str):
        if value in store:
            yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _image_ids_in(item, store)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _image_ids_in(item, store)


def encode_images(image_ids: Any, store: Any) -> dict[str, str]:
    """``{id: base64 PNG}`` for the images ``image_ids`` names (each once)."""
    out = {}
    for image_id in dict.fromkeys(image_ids):
        buffer = io.BytesIO()
        store.get(image_id).save(buffer, format="PNG")
        out[image_id] = base64.b64encode(buffer.getvalue()).decode("ascii")
    return out


def decode_images(images: Any, store: Any, where: str) -> None:
    """Add every image of an ``images`` object to ``store``, checking each against its id."""
    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data.images import ImageError, ImageLimits, decode_image  # noqa: PLC0415

    if not isinstance(images, Mapping):
        raise ProtocolError(f"{where}: 'images' must be an object of id -> base64 PNG, got {type(images).__name__}")
    limits = ImageLimits(max_bytes=MAX_IMAGE_BYTES, max_pixels=MAX_IMAGE_PIXELS, roots=())
    for image_id, data in images.items():
        if not isinstance(data, str):
            raise ProtocolError(f"{where}: images[{image_id!r}] must be base64 text")
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError:
            raise ProtocolError(f"{where}: images[{image_id!r}] is not valid base64") from None
        try:
            image = decode_image(raw, limits=limits, where=f"{where}: images[{image_id!r}]")
        except ImageError as exc:
            raise ProtocolError(str(exc)) from None
        got = store.add(image)
        if got != image_id:
            raise ProtocolError(
                f"{where}: images[{image_id!r}] holds an image whose content id is {got!r}; ids are content hashes"
            )


def messages_from_json(value: Any, store: Any, where: str) -> list[dict[str, Any]]:
    """Chat messages, checked: each ``{"role": str, "content": str | [parts]}``, every image part's id in ``store``."""
    if not isinstance(value, list):
        raise ProtocolError(f"{where}: 'messages' must be a list, got {type(value).__name__}")
    out = []
    for k, message in enumerate(value):
        at = f"{where}: messages[{k}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ProtocolError(f"{at} must be an object with a string 'role' and a 'content'")
        content = message["content"]
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise ProtocolError(f"{at}.content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image" and isinstance(part.get("image"), str):
                if part["image"] not in store:
                    raise ProtocolError(f"{at}.content[{j}] names image {part['image']!r}, which is not in 'images'")
                parts.append({"type": "image", "image": part["image"]})
            else:
                raise ProtocolError(
                    f"{at}.content[{j}] must be {{'type': 'text', 'text': str}} or {{'type': 'image', 'image': id}}"
                )
        out.append({"role": message["role"], "content": parts})
    return out


def example_to_json(example: Any, store: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """An `Example` as JSON, and its images: those of its messages and any its metadata names (by id)."""
    body = {
        "id": example.id,
        "messages": [dict(m) for m in example.messages],
        "answer": example.answer,
        "task": example.task,
        "metadata": dict(example.metadata),
    }
    ids = [*_image_ids_in(body["messages"], store), *_image_ids_in(body["metadata"], store)]
    return body, encode_images(ids, store)


def example_from_json(value: Any, store: Any, where: str) -> Any:
    """An `Example` from its JSON (its images already in ``store``)."""

    if not isinstance(value, Mapping) or not isinstance(value.get("id"), str):
        raise ProtocolError(f"{where}: 'example' must be an object with a string 'id'")
    metadata = value.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise ProtocolError(f"{where}: example.metadata must be an object")
    task = value.get("task")
    return Example(
        id=value["id"],
        messages=messages_from_json(value.get("messages", []), store, f"{where}: example"),
        answer=value.get("answer"),
        task=task if isinstance(task, str) else None,
        metadata=dict(metadata),
    )


def step_to_json(step: Any, store: Any) -> dict[str, Any]:
    """An `EnvStep` as JSON, with the images its messages show."""
    messages = [dict(m) for m in step.messages]
    return {
        "reward": float(step.reward),
        "done": bool(step.done),
        "messages": messages,
        "info": dict(step.info),
        "images": encode_images(_image_ids_in(messages, store), store),
    }


def step_from_json(value: Any, store: Any, where: str) -> Any:
    """An `EnvStep` from a ``/step`` answer, checked (its images added to ``store``)."""

    if not isinstance(value, Mapping):
        raise ProtocolError(f"{where}: the answer must be a JSON object, got {type(value).__name__}")
    reward, done = value.get("reward"), value.get("done")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ProtocolError(f"{where}: 'reward' must be a finite number, got {reward!r}")
    if not isinstance(done, bool):
        raise ProtocolError(f"{where}: 'done' must be true or false, got {done!r}")
    info = value.get("info") or {}
    if not isinstance(info, Mapping):
        raise ProtocolError(f"{where}: 'info' must be an object")
    decode_images(value.get("images") or {}, store, where)
    messages = messages_from_json(value.get("messages") or [], store, where)
    if not done and not messages:
        raise ProtocolError(f"{where}: an answer that is not done must carry the next 'messages'")
    return EnvStep(reward=float(reward), done=done, messages=messages, info=dict(info))
