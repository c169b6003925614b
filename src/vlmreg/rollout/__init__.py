"""Rollout engines (the embedded transformers engine; an OpenAI-compatible client) and the episode runner.

The engine protocol and its values (`RolloutEngine`, `SamplingParams`, `PromptRequest`, `Completion`) are the SDK's
(`vlmreg.sdk.engine`), named here too for the engines' callers.
"""

from vlmreg.sdk.engine import Completion, PromptRequest, RolloutEngine, SamplingParams

__all__ = ["Completion", "PromptRequest", "RolloutEngine", "SamplingParams"]
