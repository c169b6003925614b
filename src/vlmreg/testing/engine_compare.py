"""What engine parity's checks share (`vlmreg.testing.engine_images` for text and images, `vlmreg.testing.engine_video`
for video): one `Comparison`, how two prompts' ids first differ, and the plain fp32 forward the engine's logprobs are
compared with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

from vlmreg.testing.parity import transformers_sdpa

__all__ = ["COMPLETION_TOKENS", "Comparison", "Status", "first_difference", "plain_forward_logprobs"]

#: tokens sampled per prompt (the logprobs compared)
COMPLETION_TOKENS = 8

Status = Literal["PASS", "FAIL", "SKIP"]


@attrs.frozen
class Comparison:
    """One comparison: what was compared, PASS / FAIL / SKIP, what differed (or what held), and its number."""

    name: str
    status: Status
    detail: str
    value: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "value": self.value}


def first_difference(got: Sequence[int], want: Sequence[int]) -> str:
    """Where an engine's prompt ids first differ from a reference's, for a FAIL line."""
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return (
        f"token {at} differs: engine {list(got[at : at + 4])} vs {list(want[at : at + 4])} ({len(got)} vs "
        f"{len(want)} tokens)"
    )


def plain_forward_logprobs(model: Any, inputs: dict[str, Any], count: int, suppress: Sequence[int]) -> Any:
    """The last ``count`` tokens' logprobs from one plain forward (transformers' sdpa, fp32) on ``inputs``, the
    ``suppress`` ids given no probability (as the engine's sampler gives them none)."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    inputs = {
        k: (v.to(model.device, torch.float32) if v.is_floating_point() else v.to(model.device))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in inputs.items()
    }
    with torch.no_grad(), transformers_sdpa(model):
        logits = model(**inputs, use_cache=False).logits.float()
    if suppress:
        logits[..., list(suppress)] = float("-inf")
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, inputs["input_ids"][0, 1:, None]).squeeze(-1)
    return logp[logp.shape[0] - count :].cpu()
