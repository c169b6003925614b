"""The format warm-up: supervised steps on answers drawn at random from the task's choices.

It teaches the answer's form (one colour word and the turn's end), not which answer is right: the reward stays at
chance, and RL learns the task from there. Runs before the first RL step, at ``learning_rate``.
"""

from __future__ import annotations

import random
from typing import Any

from vlmreg.envs.calls import first_messages
from vlmreg.modeling.logprobs import selected_logprobs
from vlmreg.sdk.errors import VlmregError
from vlmreg.train.batching import make_microbatches
from vlmreg.train.samples import TrainingSample
from vlmreg.train.source import ExampleSource

__all__ = ["format_warmup"]


def format_warmup(trainer: Any, steps: int) -> None:
    """``steps`` supervised steps of a set-up `vlmreg.train.recipe.Trainer` (its model, optimizer, data, encoder)."""
    data, config = trainer.data, trainer.config
    if not data.choices:
        raise VlmregError("trainer.format_warmup_steps needs a task with choices (the answers to draw from)")
    rng = random.Random(config.trainer.seed + 7919)
    tokenizer, encoder = trainer.processor.tokenizer, trainer.encoder
    source = ExampleSource(data.examples, config.data.seed + 1)
    for k in range(1, steps + 1):
        samples: list[TrainingSample] = []
        for example in source.take(config.trainer.prompts_per_step):
            messages = first_messages(data.make_env(example), example, timeout_s=config.rollout.env_timeout_s)
            prompt = encoder.encode(messages, template_kwargs=trainer.template_kwargs, where=example.id)
            target = tokenizer(rng.choice(data.choices), add_special_tokens=False)["input_ids"] + [encoder.stop_ids[0]]
            ids = prompt.input_ids + target
            mask = [False] * len(prompt.input_ids) + [True] * len(target)
            samples.append(
                TrainingSample(
                    ids, mask, [0.0] * len(ids), prompt.image_ids, prompt.image_spans, 1.0, len(samples), example.id
                )
            )
        batches = make_microbatches(
            samples,
            trainer.resolved,
            encoder,
            budget=config.trainer.max_tokens_per_microbatch,
            packed=config.trainer.packing,
            device=trainer.loaded.device,
        )
        total = sum(mb.loss_tokens for mb in batches)
        trainer.model.train()
        trainer.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for mb in batches:
            logp, _ = selected_logprobs(trainer.resolved, mb.inputs, mb.targets, mb.selection)
            loss = -logp.sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        trainer.optimizer.step()
        trainer.log(f"format warm-up {k}/{steps}: loss {loss_sum:.3f}")
