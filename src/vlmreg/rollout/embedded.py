"""The embedded engine: transformers ``generate`` in the trainer's process, on the trainer's own weights.

No weight sync is needed: the policy being trained is the one sampling. Generation config is built
from scratch (``top_k=0``), never taken from the checkpoint's defaults, so the reported logprobs are
those of the distribution actually sampled from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vlmreg.data.prompts import EncodedPrompt, PromptEncoder
from vlmreg.data.store import ImageStore, pad_token_id
from vlmreg.rollout.engine import ChatTurn, Completion, PromptRequest, SamplingParams

__all__ = ["EmbeddedEngine", "model_inputs"]


def model_inputs(requests: Sequence[PromptRequest], encoder: PromptEncoder, device: torch.device, *, left_pad: bool) -> dict[str, torch.Tensor]:
    """Padded token tensors, the family's token-aligned inputs, and the images' inputs (in token order across rows)."""
    pad = pad_token_id(encoder.tokenizer)
    width = max(len(r.input_ids) for r in requests)
    ids = torch.full((len(requests), width), pad, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    placed = []
    for i, request in enumerate(requests):
        offset = width - len(request.input_ids) if left_pad else 0
        ids[i, offset : offset + len(request.input_ids)] = torch.tensor(request.input_ids, dtype=torch.long)
        mask[i, offset : offset + len(request.input_ids)] = 1
        placed.append([(offset, image_id, span) for image_id, span in zip(request.image_ids, request.image_spans, strict=True)])
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    inputs.update(encoder.token_inputs(width, placed))
    inputs.update(encoder.image_inputs([i for r in requests for i in r.image_ids]))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


class EmbeddedEngine:
    """Samples from the trainer's model with transformers ``generate``."""

    def __init__(
        self, model: torch.nn.Module, processor: Any, store: ImageStore, device: torch.device, *, batch_size: int = 64, descriptor: Any = None
    ):
        self.model, self.processor, self.store, self.device = model, processor, store, device
        self.encoder = PromptEncoder(processor, store, descriptor)
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
        prompts = [self.encoder.encode(c, template_kwargs=template_kwargs, where=n) for c, n in zip(conversations, names, strict=True)]
        completions = self.complete(prompts, params)
        decode = self.encoder.tokenizer.decode
        return [ChatTurn(p, c, decode(c.token_ids, skip_special_tokens=True)) for p, c in zip(prompts, completions, strict=True)]

    def complete(self, prompts: Sequence[EncodedPrompt], params: SamplingParams) -> list[Completion]:
        """One completion per token prompt (see `PromptEncoder.encode` / `PromptEncoder.extend`)."""
        return self.generate([PromptRequest.of(p) for p in prompts], params)

    def generate(self, requests: Sequence[PromptRequest], params: SamplingParams) -> list[Completion]:
        out: list[Completion] = []
        for start in range(0, len(requests), self.batch_size):
            out.extend(self._generate(requests[start : start + self.batch_size], params))
        return out

    @torch.no_grad()
    def _generate(self, requests: Sequence[PromptRequest], params: SamplingParams) -> list[Completion]:
        from transformers import GenerationConfig

        tokenizer = self.encoder.tokenizer
        stops = set(params.stop_token_ids) or set(self.encoder.stop_ids)
        inputs = model_inputs(requests, self.encoder, self.device, left_pad=True)
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
