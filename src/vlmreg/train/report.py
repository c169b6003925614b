"""A page of sample rollouts (HTML, images embedded) to see what the model sees and says."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path

from vlmreg.data.store import ImageStore
from vlmreg.rollout.episodes import Trajectory

__all__ = ["write_rollout_page"]

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}
.t{border:1px solid #ccc;border-radius:6px;padding:1em;margin:1em 0}
.m{white-space:pre-wrap;font-family:ui-monospace,monospace;background:#f6f6f6;padding:.5em;margin:.3em 0}
img{image-rendering:pixelated;width:128px;border:1px solid #999;margin:.2em}
.r{font-weight:bold}
"""


def _png(store: ImageStore, image_id: str) -> str:
    buffer = io.BytesIO()
    store.get(image_id).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def write_rollout_page(
    path: Path, step: int, trajectories: Sequence[Trajectory], store: ImageStore, limit: int = 8
) -> Path:
    """Write up to ``limit`` trajectories (one per group first) with images, prompt, completions, answer and reward."""
    seen, chosen = set(), []
    for t in trajectories:
        if t.group not in seen:
            seen.add(t.group)
            chosen.append(t)
    chosen = chosen[:limit]
    parts = [
        (
            f"<!doctype html><meta charset=utf-8><title>step {step} rollouts</title><style>{_STYLE}</style><h1>Step "
            f"{step}: sample rollouts</h1>"
        )
    ]
    for t in chosen:
        parts.append(
            f"<div class=t><div>{html.escape(t.example.id)} &middot; <span class=r>reward {t.reward:.3f}</span> "
            f"&middot; answer <code>{html.escape(str(t.example.answer))}</code></div>"
        )
        for message in t.example.messages:
            content = message["content"]
            if isinstance(content, str):
                parts.append(f"<div class=m><b>{html.escape(message['role'])}</b>: {html.escape(content)}</div>")
                continue
            pieces = []
            for part in content:
                if part.get("type") == "image" and part["image"] in store:
                    pieces.append(
                        f"<img alt='image {part['image'][:8]}' "
                        f"src='data:image/png;base64,{_png(store, part['image'])}'>"
                    )
                elif part.get("type") == "text":
                    pieces.append(html.escape(part["text"]))
            parts.append(f"<div class=m><b>{html.escape(message['role'])}</b>: {' '.join(pieces)}</div>")
        for k, turn in enumerate(t.turns):
            extra = "".join(
                f"<img src='data:image/png;base64,{_png(store, i)}'>"
                for i in turn.image_ids[len(t.example.image_ids()) + len(t.example.video_ids()) :]
                if k and i in store
            )
            parts.append(
                f"<div class=m><b>turn {k + 1}</b> {extra}<br>{html.escape(turn.completion)} <i>(reward "
                f"{turn.reward:.3f}, {turn.finish_reason})</i></div>"
            )
        parts.append("</div>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    return path
