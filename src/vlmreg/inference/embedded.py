"""The embedded engine: transformers ``generate`` in the trainer's process, on the trainer's own weights.

No weight sync is needed: the policy being trained is the one sampling. Generation config is built
from scratch (``top_k=0``), never taken from the checkpoint's defaults, so the reported logprobs are
those of the distribution actually sampled from.

`LogitControls` (logit bias, frequency and presence penalties) change the logits before temperature and
top-p; the reported logprobs (and ``top_logprobs`` alternatives) are still those of the distribution each
token was sampled from, since they come from the scores ``generate`` sampled with. ``stop_when`` ends a
row when its completion so far satisfies a test (the server's stop strings).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from vlmreg.data.prompts import PromptEncoder
from vlmreg.data.store import ImageStore, pad_token_id
from vlmreg.inference.thinking import ThinkingBudget, forced_marker_positions, thinking_markers
from vlmreg.sdk.engine import ChatTurn, Completion, EncodedPrompt, PromptRequest, SamplingParams
from vlmreg.sdk.errors import VlmregError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["EmbeddedEngine", "LogitControls", "ScoredCompletion", "model_inputs"]


def model_inputs(
    requests: Sequence[PromptRequest], encoder: PromptEncoder, device: torch.device, *, left_pad: bool
) -> dict[str, torch.Tensor]:
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
        placed.append(
            [(offset, image_id, span) for image_id, span in zip(request.image_ids, request.image_spans, strict=True)]
        )
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    inputs.update(encoder.token_inputs(width, placed))
    if encoder.prefix_lm:  # the whole prompt is the bidirectional prefix (0); generate marks each sampled token 1
        inputs.setdefault(encoder.prefix_lm, torch.zeros_like(ids))
    inputs.update(encoder.image_inputs([i for r in requests for i in r.image_ids]))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@attrs.frozen
class LogitControls:
    """Changes to the logits before temperature and top-p, as OpenAI defines them.

    ``logit_bias``: ``(token id, bias)`` pairs added to the logits. ``frequency_penalty`` / ``presence_penalty``:
    ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``, where ``count[j]`` counts
    token ``j`` among the tokens the row has sampled so far (the prompt is not counted).
    """

    logit_bias: tuple[tuple[int, float], ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.frequency_penalty != 0 or self.presence_penalty != 0


@attrs.frozen
class ScoredCompletion(Completion):
    """A `Completion` with, for each token, its ``top_logprobs`` alternatives: ``(token id, logprob)`` pairs, most
    likely first, under the distribution the token was sampled from (tokens it gave no probability are left out)."""

    top_logprobs: list[list[tuple[int, float]]] = attrs.field(factory=list)


class _ShapeLogits:
    """`LogitControls` as a transformers logits processor; the first call's width is the prompt's."""

    def __init__(self, controls: LogitControls) -> None:
        self.controls = controls
        self.start: int | None = None
        self.bias: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        controls = self.controls
        if self.start is None:
            self.start = input_ids.shape[1]
        if controls.logit_bias:
            if self.bias is None:
                self.bias = torch.zeros(scores.shape[-1], dtype=scores.dtype, device=scores.device)
                ids, values = zip(*controls.logit_bias, strict=True)
                self.bias[list(ids)] = torch.tensor(values, dtype=scores.dtype, device=scores.device)
            scores = scores + self.bias
        sampled = input_ids[:, self.start :]
        if (controls.frequency_penalty or controls.presence_penalty) and sampled.shape[1]:
            counts = torch.zeros_like(scores).scatter_add_(1, sampled, torch.ones_like(sampled, dtype=scores.dtype))
            scores = (
                scores - counts * controls.frequency_penalty - (counts > 0).to(scores.dtype) * controls.presence_penalty
            )
        return scores


class _StopWhen:
    """A transformers stopping criterion: a row ends once ``check(its completion so far)`` holds; ``ends`` records
    where."""

    def __init__(self, start: int, check: Callable[[list[int]], bool], stop_ids: set[int]) -> None:
        self.start, self.check, self.stop_ids = start, check, stop_ids
        self.ends: dict[int, int] = {}  # row -> completion length at which the check held
        self.done: set[int] = set()  # rows ended (by the check, or by a stop token)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        for row, ids in enumerate(input_ids[:, self.start :].tolist()):
            if row in self.done:
                continue
            if any(t in self.stop_ids for t in ids):
                self.done.add(row)
            elif self.check(ids):
                self.ends[row] = len(ids)
                self.done.add(row)
        out = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.ends:
            out[list(self.ends)] = True
        return out


class EmbeddedEngine:
    """Samples from the trainer's model with transformers ``generate``."""

    def __init__(
        self,
        model: PreTrainedModel,
        processor: Any,
        store: ImageStore,
        device: torch.device,
        *,
        batch_size: int = 64,
        descriptor: Any = None,
    ):
        self.model, self.processor, self.store, self.device = model, processor, store, device
        self.encoder = PromptEncoder(processor, store, descriptor)
        self.batch_size = batch_size
        self.thinking_markers = thinking_markers(self.encoder.tokenizer, descriptor)

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
            self.encoder.encode(c, template_kwargs=template_kwargs, where=n)
            for c, n in zip(conversations, names, strict=True)
        ]
        completions = self.complete(prompts, params)
        decode = self.encoder.tokenizer.decode
        return [
            ChatTurn(p, c, decode(c.token_ids, skip_special_tokens=True))
            for p, c in zip(prompts, completions, strict=True)
        ]

    def complete(self, prompts: Sequence[EncodedPrompt], params: SamplingParams) -> list[Completion]:
        """One completion per token prompt (see `PromptEncoder.encode` / `PromptEncoder.extend`)."""
        return self.generate([PromptRequest.of(p) for p in prompts], params)

    def generate(
        self,
        requests: Sequence[PromptRequest],
        params: SamplingParams,
        *,
        controls: LogitControls | None = None,
        stop_when: Callable[[list[int]], bool] | None = None,
        top_logprobs: int = 0,
    ) -> list[Completion]:
        """One completion per request, in batches of ``batch_size``.

        ``controls`` change the logits before temperature and top-p; ``stop_when(ids)`` is asked after each
        token with the row's completion so far, and ends it there (``finish_reason`` ``stop``, every sampled
        token kept); ``top_logprobs > 0`` returns `ScoredCompletion`s with that many alternatives per token.
        """
        out: list[Completion] = []
        for start in range(0, len(requests), self.batch_size):
            out.extend(
                self._generate(requests[start : start + self.batch_size], params, controls, stop_when, top_logprobs)
            )
        return out

    @torch.no_grad()
    def _generate(
        self,
        requests: Sequence[PromptRequest],
        params: SamplingParams,
        controls: LogitControls | None = None,
        stop_when: Callable[[list[int]], bool] | None = None,
        top_logprobs: int = 0,
    ) -> list[Completion]:
        # deferred: start-up cost (loads transformers)
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList  # noqa: PLC0415

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
        width = inputs["input_ids"].shape[1]
        extra: dict[str, Any] = {}
        processors: list[Any] = []
        # before temperature and top-p: transformers runs custom processors first
        if controls is not None and controls.active:
            processors.append(_ShapeLogits(controls))
        budget = None
        if params.thinking_budget is not None:
            if self.thinking_markers is None:
                raise VlmregError(
                    "rollout.thinking_budget: the family declares no thinking markers (thinking_start, thinking_end)"
                )
            budget = ThinkingBudget(
                params.thinking_budget, *self.thinking_markers, [r.input_ids for r in requests], stops
            )
            processors.append(budget)
        if processors:
            extra["logits_processor"] = LogitsProcessorList(processors)
        stopper = _StopWhen(width, stop_when, stops) if stop_when is not None else None
        if stopper is not None:
            extra["stopping_criteria"] = StoppingCriteriaList([stopper])
        was_training = self.model.training
        self.model.eval()
        try:
            result = self.model.generate(**inputs, generation_config=config, **extra)
        finally:
            self.model.train(was_training)
        new_tokens = result.sequences[:, width:]
        # (batch, new tokens, vocab): the sampling distribution
        steps = torch.log_softmax(torch.stack(result.scores, dim=1).float(), dim=-1)
        logprobs = steps.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        top = torch.topk(steps, min(top_logprobs, steps.shape[-1]), dim=-1) if top_logprobs > 0 else None
        completions: list[Completion] = []
        for r, (row, lp) in enumerate(zip(new_tokens.tolist(), logprobs.tolist(), strict=True)):
            end = next((i + 1 for i, t in enumerate(row) if t in stops), None)
            if stopper is not None and r in stopper.ends:
                end = min(end or len(row), stopper.ends[r])
            reason = "stop" if end is not None else "length"
            end = end or len(row)
            forced = budget is not None and r in budget.forced
            written = (
                forced_marker_positions(budget.forced_at.get(r, ()), len(budget.end), end) if budget is not None else ()
            )
            if top is None:
                completions.append(
                    Completion(
                        token_ids=row[:end],
                        logprobs=lp[:end],
                        finish_reason=reason,
                        thinking_forced=forced,
                        forced=written,
                    )
                )
                continue
            alternatives = [
                [(i, v) for i, v in zip(ids, values, strict=True) if v != float("-inf")]
                for ids, values in zip(top.indices[r, :end].tolist(), top.values[r, :end].tolist(), strict=True)
            ]
            completions.append(
                ScoredCompletion(
                    token_ids=row[:end],
                    logprobs=lp[:end],
                    finish_reason=reason,
                    thinking_forced=forced,
                    forced=written,
                    top_logprobs=alternatives,
                )
            )
        return completions
