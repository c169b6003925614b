"""``stream: true``: the answer as OpenAI's Server-Sent Events, ``chat.completion.chunk`` objects then ``[DONE]``.

The completion is generated in one batch as usual, then sent token by token: for each choice a first chunk
with the role, one chunk per sampled token (its text piece, its logprob entry when asked for, its id with
``return_token_ids``), and a last chunk with ``finish_reason``; with ``stream_options.include_usage`` a final
chunk with no choices carries ``usage`` (and every other chunk ``"usage": null``), as OpenAI does.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from vlmreg.serve.protocol import Answer, ChatRequest, logprob_entries, usage

__all__ = ["DONE", "sse", "stream_chunks"]

DONE = b"data: [DONE]\n\n"


def sse(chunk: dict[str, Any]) -> bytes:
    """One Server-Sent Event carrying ``chunk`` as JSON."""
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def stream_chunks(request: ChatRequest, answer: Answer, model_name: str) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of one answer, in the order they are sent."""
    base: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model_name,
    }
    if request.include_usage:
        base["usage"] = None

    def chunk(
        index: int, delta: dict[str, Any], logprobs: Any = None, finish_reason: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **extra}
        return {**base, "choices": [choice]}

    for index, choice in enumerate(answer.choices):
        first = chunk(index, {"role": "assistant", "content": ""})
        if request.return_token_ids and index == 0:
            first["prompt_token_ids"] = answer.prompt_token_ids
        yield first
        for i, piece in enumerate(choice.pieces):
            logprobs = {"content": logprob_entries(choice, i, i + 1)} if request.logprobs else None
            extra: dict[str, Any] = {"token_ids": [choice.token_ids[i]]} if request.return_token_ids else {}
            yield chunk(index, {"content": piece}, logprobs, **extra)
        yield chunk(index, {}, None, choice.finish_reason)
    if request.include_usage:
        yield {**base, "choices": [], "usage": usage(answer)}
