"""Rollout engines (the embedded transformers engine; an OpenAI-compatible client) and environments."""

from vlmreg.rollout.engine import Completion, PromptRequest, RolloutEngine, SamplingParams

__all__ = ["Completion", "PromptRequest", "RolloutEngine", "SamplingParams"]
