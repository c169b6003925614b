"""The embedded engine: transformers ``generate`` in the trainer's process, on the trainer's own weights.

No weight sync is needed: the policy being trained is the one sampling. Generation config is built
from scratch (``top_k=0``), never taken from the checkpoint's defaults, so the reported logprobs are
those of the distribution actually sampled from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vlmreg.data.prompts import encode_messages, image_token_id
from vlmreg.data.store import ImageStore, pad_token_id
from vlmreg.rollout.engine import ChatTurn, Completion, PromptRequest, SamplingParams

__all__ = ["EmbeddedEngine", "model_inputs"]


def model_inputs(
    rows: Sequence[Sequence[int]], image_ids: Sequence[str], processor: Any, store: ImageStore, device: torch.device, *, left_pad: bool
) -> dict[str, torch.Tensor]:
    """Padded token tensors plus the images' features (in the order their tokens appear across rows)."""
    pad = pad_token_id(processor.tokenizer)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left_pad else slice(0, len(row))
        ids[i, span] = torch.tensor(row, dtype=torch.long)
        mask[i, span] = 1
    inputs: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask}
    if "mm_token_type_ids" in getattr(processor, "model_input_names", ()):
        inputs["mm_token_type_ids"] = (ids == image_token_id(processor)).long() * mask
    inputs.update(store.batch_features(image_ids, processor))
    return {k: v.to(device) for k, v in inputs.items()}


class EmbeddedEngine:
    """Samples from the trainer's model with transformers ``generate``."""

    def __init__(self, model: torch.nn.Module, processor: Any, store: ImageStore, device: torch.device, *, batch_size: int = 64):
        self.model, self.processor, self.store, self.device = model, processor, store, device
        self.batch_size = batch_size

    def chat(
        self,
        conversations: Sequence[Sequence[Mapping[str, Any]]],
        params: SamplingParams,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        names: Sequence[str] | None = None,
    ) -> list[ChatTurn]:
        """Encode each conversation with the local processor, then sample all of them in batches."""
        names = names or [f"conversation {i}" for i in range(len(conversations))]
        prompts = [
            encode_messages(c, self.processor, self.store, template_kwargs=template_kwargs, where=n) for c, n in zip(conversations, names, strict=True)
        ]
        completions = self.generate([PromptRequest(p.input_ids, p.image_ids) for p in prompts], params)
        decode = self.processor.tokenizer.decode
        return [ChatTurn(p, c, decode(c.token_ids, skip_special_tokens=True)) for p, c in zip(prompts, completions, strict=True)]

    def generate(self, requests: Sequence[PromptRequest], params: SamplingParams) -> list[Completion]:
        out: list[Completion] = []
        for start in range(0, len(requests), self.batch_size):
            out.extend(self._generate(requests[start : start + self.batch_size], params))
        return out

    @torch.no_grad()
    def _generate(self, requests: Sequence[PromptRequest], params: SamplingParams) -> list[Completion]:
        from transformers import GenerationConfig

        tokenizer = self.processor.tokenizer
        stops = set(params.stop_token_ids) or {tokenizer.eos_token_id}
        inputs = model_inputs(
            [r.input_ids for r in requests], [i for r in requests for i in r.image_ids], self.processor, self.store, self.device, left_pad=True
        )
        config = GenerationConfig(
            do_sample=not params.greedy,
            temperature=params.temperature if not params.greedy else None,
            top_p=params.top_p if not params.greedy else None,
            top_k=0 if not params.greedy else None,
            max_new_tokens=params.max_tokens,
            eos_token_id=sorted(stops),
            pad_token_id=pad_token_id(tokenizer),
            suppress_tokens=list(params.suppress_token_ids) or None,
            output_scores=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            result = self.model.generate(**inputs, generation_config=config)
        finally:
            self.model.train(was_training)
        width = inputs["input_ids"].shape[1]
        new_tokens = result.sequences[:, width:]
        steps = torch.stack(result.scores, dim=1).float()  # (batch, new tokens, vocab): the sampling distribution
        logprobs = torch.log_softmax(steps, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        completions = []
        for row, lp in zip(new_tokens.tolist(), logprobs.tolist(), strict=True):
            end = next((i + 1 for i, t in enumerate(row) if t in stops), None)
            reason = "stop" if end is not None else "length"
            end = end or len(row)
            completions.append(Completion(token_ids=row[:end], logprobs=lp[:end], finish_reason=reason))
        return completions
