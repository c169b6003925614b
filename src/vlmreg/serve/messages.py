"""The messages of a chat-completions request, parsed strictly: roles, text parts, and images and videos decoded here,
in the connection's thread, with the server's limits (`vlmreg.serve.protocol.ServeLimits`), so a bad one is a 400
before anything reaches the model's queue.

Images come as ``data:`` URIs or ``http(s)`` URLs (never a file path); videos as vLLM takes them, or as frames
already extracted (`vlmreg.serve.video_frames`). The ``developer`` role is read as ``system`` and an assistant's
``content: null`` as empty text; fields the ``openai`` client echoes back are accepted when empty. Every problem is a
`RequestError` naming the field (``messages[0].content[1].image_url``). `vlmreg.serve.protocol` parses the rest of
the request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vlmreg.data.images import ImageError, ImageLimits, decode_image
from vlmreg.data.video import VideoLimits, decode_video
from vlmreg.sdk.errors import RequestError
from vlmreg.sdk.video import DEFAULT_VIDEO_SAMPLING
from vlmreg.serve.video_frames import decode_frame_list, is_frame_list

if TYPE_CHECKING:
    from vlmreg.serve.protocol import ServeLimits

__all__ = ["EMPTY_MESSAGE_FIELDS", "ROLES", "parse_messages"]

ROLES = ("system", "developer", "user", "assistant")
# fields the client echoes back in an assistant message (``message.model_dump()``): accepted when empty
EMPTY_MESSAGE_FIELDS = ("refusal", "tool_calls", "function_call", "audio", "annotations", "name")


def _image(part: Mapping[str, Any], where: str, limits: ImageLimits) -> Any:
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, Mapping) else spec
    where = f"{where}.image_url"
    if not isinstance(url, str):
        raise RequestError(where, 'must be {"url": "data:image/...;base64,..."} or a URL string')
    scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme not in ("data", "http", "https"):
        raise RequestError(where, "must be a data: URI or an http(s):// URL")
    try:
        return decode_image(url, limits=limits, where="")
    except ImageError as exc:
        raise RequestError(where, exc.reason) from None


def _video(part: Mapping[str, Any], where: str, limits: ServeLimits, timing: Mapping[str, Any]) -> Any:
    """A ``video_url`` part as vLLM takes it (``{"video_url": {"url": "data:video/mp4;base64,..."}}``), decoded and
    sampled with the server's limits and its family's frame sampling; or frames already extracted with their
    ``timing`` (`vlmreg.serve.video_frames`)."""
    where = f"{where}.video_url"
    if not limits.max_videos_per_message:
        raise RequestError(where, f"the model's family {limits.family or '?'} takes no video input")
    spec = part.get("video_url")
    url = spec.get("url") if isinstance(spec, Mapping) else spec
    if not isinstance(url, str):
        raise RequestError(where, 'must be {"url": "data:video/...;base64,..."} or a URL string')
    scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme not in ("data", "http", "https"):
        raise RequestError(where, "must be a data: URI or an http(s):// URL")
    videos = limits.videos or VideoLimits(images=limits.images)
    if is_frame_list(url):
        return decode_frame_list(url, timing, videos, where)
    if timing:
        raise RequestError(
            "media_io_kwargs.video",
            "applies to frame lists (data:video/jpeg) only: this server samples "
            "an encoded video with the run's settings",
        )
    try:
        return decode_video(
            url,
            limits=videos,
            sampling=limits.video_sampling or DEFAULT_VIDEO_SAMPLING,
            where="",
        )
    except ImageError as exc:
        raise RequestError(where, exc.reason) from None


def _content(content: Any, where: str, limits: ServeLimits, timing: Mapping[str, Any]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, "must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise RequestError(at, "must be an object with a type")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{at}.text", "must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            parts.append({"type": "image", "image": _image(part, at, limits.images)})
        elif kind == "video_url":
            parts.append({"type": "video", "video": _video(part, at, limits, timing)})
        else:
            raise RequestError(
                f"{at}.type", f"unsupported content part type {kind!r} (supported: text, image_url, video_url)"
            )
    images = sum(1 for p in parts if p["type"] == "image")
    if images > limits.max_images_per_message:
        raise RequestError(
            where,
            f"carries {images} images; the model's family takes at most {limits.max_images_per_message} per message",
        )
    videos = sum(1 for p in parts if p["type"] == "video")
    if videos > limits.max_videos_per_message:
        raise RequestError(
            where,
            f"carries {videos} videos; the model's family takes at most {limits.max_videos_per_message} per message",
        )
    return parts


def parse_messages(value: Any, limits: ServeLimits, timing: Mapping[str, Any]) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages", "is required: a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise RequestError(where, "must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role", f"must be one of {', '.join(ROLES)} (got {role!r})")
        for key in sorted(set(message) - {"role", "content"}):
            if key not in EMPTY_MESSAGE_FIELDS:
                raise RequestError(f"{where}.{key}", "unsupported message field (supported: role, content)")
            if message[key] not in (None, []):
                raise RequestError(
                    f"{where}.{key}", "is not supported (tools, audio and names are not); leave it null or unset"
                )
        if "content" not in message:
            raise RequestError(f"{where}.content", "is required")
        content = message["content"]
        if content is None:
            if role != "assistant":
                raise RequestError(f"{where}.content", "may be null only in an assistant message")
            content = ""  # an assistant turn with no text (OpenAI allows it): rendered empty
        # developer is OpenAI's newer name for system; chat templates know system
        out.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _content(content, f"{where}.content", limits, timing),
            }
        )
    return out
