"""Rollouts collected ahead of training (``max_off_policy_steps = 1``) against a launched ``vlmreg serve``.

The reference for "batch t was sampled by the policy of update v" is a plain forward of the model (transformers,
on the processor's own encoding) with the weights the trainer had after update v, copied at that time: the
server's sampled logprobs must equal it, and must not equal the weights of update v + 1.
"""

from __future__ import annotations

import json

import pytest
import torch

from vlmreg.config import parse_config
from vlmreg.config.load import ConfigError
from vlmreg.config.resolve import resolve_config
from vlmreg.testing.parity import processor_inputs
from vlmreg.train.recipe import Trainer


def config(**trainer):
    return resolve_config(
        parse_config(
            {
                "model": {"init": "random", "family": "qwen3_vl"},
                "rollout": {"engine": "openai", "launch": True, "group_size": 4, "max_tokens": 6},
                "broadcast": {"transport": "gloo", "timeout_s": 60},
                "trainer": {
                    "steps": 4,
                    "prompts_per_step": 2,
                    "learning_rate": 3e-3,
                    "seq_len": 256,
                    "max_tokens_per_microbatch": 2048,
                    "device": "cpu",
                    "max_off_policy_steps": 1,
                    **trainer,
                },
                "logging": {"rollout_page_every": 0, "tensorboard": False},
            }
        )
    )


def plain_logprobs(trainer: Trainer, trajectory) -> tuple[list[int], torch.Tensor]:
    """The first turn's completion logprobs by a plain forward of ``trainer.model`` on the processor's encoding."""
    turn = trajectory.turns[0]
    conversation = []
    for message in trajectory.example.messages:
        content = message["content"]
        if not isinstance(content, str):
            content = [
                {"type": "image", "image": trainer.store.get(p["image"])} if p.get("type") == "image" else p
                for p in content
            ]
        conversation.append({**message, "content": content})
    inputs = processor_inputs(trainer.processor, conversation, turn.completion_ids)
    prompt = inputs["input_ids"][0].tolist()[: -len(turn.completion_ids)]
    with torch.no_grad():
        logits = trainer.model(**inputs, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    logits[:, list(trainer.objective.suppress)] = float("-inf")
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(turn.completion_ids)[:, None]).squeeze(-1)
    return prompt, logp


def test_each_batch_is_sampled_by_the_policy_version_it_carries(tmp_path):
    # the tiny random model earns no reward (zero advantages): the entropy bonus makes every update move the weights
    trainer = Trainer(config(entropy_coef=0.05), output_dir=tmp_path, log=lambda message: None)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    records, batches = [], {}

    def copy_weights() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    def on_step(record):
        records.append(dict(record))
        snapshots[record["step"]] = copy_weights()

    try:
        trainer.setup()
        snapshots[0] = copy_weights()
        trainer.on_step = on_step
        trainer.on_rollouts = lambda step, trajectories: batches.__setitem__(step, trajectories)
        trainer.train()
        assert trainer.link.step_synced == 4
        gaps = {}
        for step, trajectories in batches.items():
            version = trajectories[0].policy_version
            assert all(t.policy_version == version for t in trajectories)
            gaps[step] = {}
            for candidate in (version, version + 1):
                trainer.model.load_state_dict(snapshots[candidate])
                prompt, logp = plain_logprobs(trainer, trajectories[0])
                assert prompt == trajectories[0].turns[0].prompt_ids  # the processor's encoding is what the server saw
                gaps[step][candidate] = float((logp - torch.tensor(trajectories[0].turns[0].logprobs)).abs().max())
    finally:
        trainer.cleanup()
    assert [r["policy_version"] for r in records] == [0, 0, 1, 2]
    assert [r["off_policy_steps_max"] for r in records] == [0, 1, 1, 1]
    assert [r["off_policy_steps_mean"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert all("rollout_wait_s" in r and r["sync_s"] > 0 for r in records)
    for step, by_version in gaps.items():
        claimed, newer = by_version.values()
        assert claimed <= 1e-4, (step, by_version)  # sampled by exactly the version it carries
        assert newer > 10 * max(claimed, 1e-6), (step, by_version)  # and the next update is measurably different
    # a stale batch differs from the trainer's policy at update time: the mismatch TIS corrects is visible
    assert records[0]["mismatch_kl"] < 1e-6 and all(r["mismatch_kl"] > 1e-6 for r in records[1:])


def test_a_resumed_run_takes_the_same_examples_as_an_uninterrupted_one(tmp_path):
    """The checkpoint saves where the example source stood after the last trained batch, not after batches taken
    ahead: a run stopped after step 2 and resumed trains steps 3 and 4 on the same examples."""

    def run(output, steps, resume=False):
        trainer = Trainer(config(steps=steps, save_every=2), output_dir=output, resume=resume, log=lambda message: None)
        seen = {}
        try:
            trainer.setup()
            trainer.on_rollouts = lambda step, trajectories: seen.__setitem__(
                step, sorted({t.example.id for t in trajectories})
            )
            trainer.train()
        finally:
            trainer.cleanup()
        return seen

    whole = run(tmp_path / "whole", 4)
    first = run(tmp_path / "cut", 2)
    resumed = run(tmp_path / "cut", 4, resume=True)
    assert first == {1: whole[1], 2: whole[2]}
    assert resumed == {3: whole[3], 4: whole[4]}
    lines = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert lines[2]["policy_version"] == 2  # after a resume the first batch comes from the checkpoint's weights


def test_off_policy_steps_need_a_server_engine():
    with pytest.raises(ConfigError, match="trainer.max_off_policy_steps"):
        resolve_config(
            parse_config(
                {
                    "model": {"init": "random", "family": "qwen3_vl"},
                    "trainer": {"max_off_policy_steps": 1, "device": "cpu"},
                }
            )
        )
