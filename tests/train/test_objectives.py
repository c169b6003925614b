"""The registered objectives against hand computations, and a plugin's own objective used by a real run."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import attrs
import pytest
import torch

import vlmreg
from vlmreg import Objective, hookimpl
from vlmreg.cli import main
from vlmreg.config import load_config
from vlmreg.config.resolve import resolve_config
from vlmreg.sdk import LossInputs
from vlmreg.sdk.registry import get_objective_registry
from vlmreg.train.step import LossSettings

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml")


def inputs(logp, logp_old, advantages, sequence, *, clip=(0.2, 0.28), total_tokens=None, num_samples=1, max_tokens=4):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    return LossInputs(
        logp=logp,
        logp_old=torch.tensor(logp_old, dtype=torch.float64),
        logp_rollout=torch.tensor(logp_old, dtype=torch.float64),
        advantages=torch.tensor(advantages, dtype=torch.float64),
        weights=torch.ones(len(logp_old), dtype=torch.float64),
        sequence=torch.tensor(sequence),
        clip_low=clip[0],
        clip_high=clip[1],
        total_tokens=total_tokens or len(logp_old),
        num_samples=num_samples,
        max_tokens=max_tokens,
    )


def run(name: str, x: LossInputs) -> tuple[float, list[float], list[bool]]:
    """The registered objective's loss under its default aggregation, as a run without ``loss_aggregation`` gives it."""
    objective = vlmreg.get_objective_registry().get(name)
    loss, clipped = objective.loss(attrs.evolve(x, aggregation=objective.aggregation))
    loss.backward()
    return float(loss.detach()), x.logp.grad.tolist(), clipped.tolist()


def test_grpo_is_a_token_mean_over_the_whole_step():
    # r = (e^0.1, 1, e^-0.2) = (1.10517, 1, 0.81873), all inside [0.8, 1.28]; A = (1, 1, -1); 10 loss tokens in the step
    loss, grad, clipped = run(
        "grpo", inputs([-1.0, -2.0, -0.5], [-1.1, -2.0, -0.3], [1, 1, -1], [0, 0, 1], total_tokens=10)
    )
    assert loss == pytest.approx(-(1.1051709 + 1.0 - 0.8187308) / 10, abs=1e-6)
    assert grad == pytest.approx([-1.1051709 / 10, -1.0 / 10, 0.8187308 / 10], abs=1e-6)
    assert clipped == [False, False, False]


def test_dr_grpo_divides_by_samples_times_max_tokens():
    # the same tokens; 2 samples of at most 4 tokens: the normaliser is 8, whatever the lengths
    loss, grad, _ = run(
        "dr_grpo", inputs([-1.0, -2.0, -0.5], [-1.1, -2.0, -0.3], [1, 1, -1], [0, 0, 1], num_samples=2, max_tokens=4)
    )
    assert loss == pytest.approx(-1.2864401 / 8, abs=1e-6)
    assert grad == pytest.approx([-1.1051709 / 8, -1.0 / 8, 0.8187308 / 8], abs=1e-6)


def test_gspo_uses_one_ratio_per_sequence_and_averages_over_samples():
    # sample 0: tokens (-1.0 vs -1.2, -2.0 vs -2.0): s_0 = exp(mean(0.2, 0)) = e^0.1 = 1.10517, outside [1 - 3e-4, 1 +
    # 4e-4] with A = 1 > 0 the clipped branch wins: 1.0004 per token, no gradient; sample 1: one token, ratio 1, A = -1
    loss, grad, clipped = run(
        "gspo", inputs([-1.0, -2.0, -0.5], [-1.2, -2.0, -0.5], [1, 1, -1], [0, 0, 1], clip=(3e-4, 4e-4), num_samples=2)
    )
    assert loss == pytest.approx(-(1.0004 * 0.5 + 1.0004 * 0.5 - 1.0) / 2, abs=1e-6)
    assert grad == pytest.approx([0.0, 0.0, 1.0 / 2], abs=1e-6)
    assert clipped == [True, True, False]


def test_cispo_clips_the_weight_but_keeps_every_token_s_gradient():
    # r = (e^0.5 = 1.64872 -> 1.28, 1); A = (2, -1); terms = -kept * A * logp, mean over 2 tokens
    loss, grad, clipped = run("cispo", inputs([-1.0, -0.5], [-1.5, -0.5], [2, -1], [0, 1], clip=(0.99, 0.28)))
    assert loss == pytest.approx((2.56 - 0.5) / 2, abs=1e-6)
    assert grad == pytest.approx([-1.28 * 2 / 2, 1.0 / 2], abs=1e-6)  # the clipped token still gets -kept * A / N
    assert clipped == [True, False]
    assert math.isclose(grad[0], -1.28)


def test_a_plugin_s_objective_is_listed_checked_and_used_by_a_run(vlmreg_fresh_registry, tmp_path, capsys):
    calls = []

    def reinforce(x):
        calls.append(len(x.logp))
        return -(x.advantages * x.logp).sum() / max(x.total_tokens, 1), torch.zeros_like(x.logp, dtype=torch.bool)

    plugin = types.SimpleNamespace(
        vlmreg_register_objectives=hookimpl(
            lambda register: register(
                Objective(name="plain_reinforce", loss=reinforce, clip=(0.1, 0.1), description="REINFORCE, token mean")
            )
        )
    )
    vlmreg.register_plugin(plugin, name="my-objectives")
    try:
        assert main(["plugins", "--json"]) == 0
        records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
        assert records["my-objectives"]["objectives"] == ["plain_reinforce"]
        assert records["vlmreg.objectives"]["objectives"] == ["cispo", "dr_grpo", "grpo", "gspo", "sapo"]
        assert main(["validate", MAIN, "--set", "trainer.algorithm=plain_reinforse"]) == 1
        assert "Did you mean 'plain_reinforce'" in capsys.readouterr().err
        # it divides by a count of its own (no aggregation declared): a loss_aggregation would do nothing, so it is
        # refused
        assert (
            main(
                [
                    "validate",
                    MAIN,
                    "--set",
                    "trainer.algorithm=plain_reinforce",
                    "--set",
                    "trainer.loss_aggregation=token-mean",
                ]
            )
            == 1
        )
        err = " ".join(capsys.readouterr().err.split())
        assert "--set trainer.loss_aggregation=token-mean: objective 'plain_reinforce' normalises its own loss" in err
        out = tmp_path / "run"
        quick = [
            "--set",
            "trainer.format_warmup_steps=0",
            "--set",
            "eval.every=0",
            "--set",
            "logging.rollout_page_every=0",
            "--set",
            "trainer.steps=2",
            "--set",
            "trainer.prompts_per_step=2",
            "--set",
            "rollout.group_size=2",
        ]
        assert (
            main(["train", MAIN, *quick, "--set", "trainer.algorithm=plain_reinforce", "--output-dir", str(out)]) == 0
        )
    finally:
        vlmreg.unregister_plugin("my-objectives")
    assert calls and all(n > 0 for n in calls)  # the plugin's loss computed every micro-batch's loss
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["clip_fraction"] == 0 for r in records)


def test_sapo_is_a_soft_gate_with_the_plain_gradient_on_policy():
    # on-policy (r = 1): f(1) = sigmoid(0) * 4 / tau = 2 / tau, f'(1) = 1, so the gradient is -A / |y_i| / samples
    loss, grad, faded = run(
        "sapo", inputs([-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], [1, 1, -1], [0, 0, 1], num_samples=2)
    )
    assert loss == pytest.approx(-(2.0 / 1.0 * 0.5 + 2.0 / 1.0 * 0.5 - 2.0 / 1.05) / 2, abs=1e-9)
    assert grad == pytest.approx([-0.5 / 2, -0.5 / 2, 1.0 / 2], abs=1e-9)
    assert faded == [False, False, False]


def test_sapo_fades_the_gradient_far_from_the_old_policy_instead_of_cutting_it():
    # r = e^1.5 = 4.4817 with A = 1, tau = 1: s = sigmoid(3.4817) = 0.97014, gate weight 4 s (1 - s) = 0.11587,
    # d/dlogp f(r) = 4 s (1 - s) * r: the gradient is small but not zero (a hard clip would give exactly 0)
    loss, grad, faded = run("sapo", inputs([0.5], [-1.0], [1], [0], num_samples=1))
    s = 1 / (1 + math.exp(-(math.exp(1.5) - 1)))
    assert loss == pytest.approx(-4 * s, abs=1e-9)
    assert grad == pytest.approx([-4 * s * (1 - s) * math.exp(1.5)], abs=1e-9)
    assert 0 < -grad[0] < 1 and faded == [True]


@pytest.mark.parametrize(
    "overrides, aggregation, level, clip_low, line",
    [
        (
            [],
            "seq-mean-token-mean",
            "sequence",
            3e-4,
            "gspo: seq-mean-token-mean, ratio clip [0.9997, 1.0004], TIS sequence truncate at 2",
        ),
        (
            ["trainer.tis_level=token", "trainer.loss_aggregation=token-mean"],
            "token-mean",
            "token",
            3e-4,
            "gspo: token-mean, ratio clip [0.9997, 1.0004], TIS token truncate at 2",
        ),
        (
            ["trainer.algorithm=cispo", "trainer.kl_coef=0.1"],
            "token-mean",
            "token",
            1.0,
            "cispo: token-mean, ratio clip [none, 1.28], TIS token truncate at 2, KL 0.1",
        ),
        (
            ["trainer.algorithm=cispo", "trainer.clip_low=0.5", "trainer.tis=false"],
            "token-mean",
            "token",
            0.5,
            "cispo: token-mean, ratio clip [0.5, 1.28], no TIS",
        ),
    ],
)
def test_a_run_s_loss_settings_fill_what_the_config_leaves_unset_from_the_objective(
    overrides, aggregation, level, clip_low, line
):
    config = load_config(MAIN, ["trainer.algorithm=gspo", *overrides])
    settings = LossSettings.for_run(config.trainer, config.rollout, ())
    assert (settings.aggregation, settings.tis_level, settings.clip_low) == (aggregation, level, clip_low)
    assert settings.describe() == line  # the line the run logs


def test_training_takes_the_objective_the_config_resolved_and_looks_nothing_up_by_name(monkeypatch):
    """Issue 27 item 1: `resolve_config` looks the objective up once (``ResolvedConfig.specs.objective``); the loss
    settings the Trainer builds hold that object, so a registry changed afterwards (or a name no longer registered)
    does not change the run's loss."""
    config = load_config(MAIN, ["trainer.algorithm=gspo"])
    resolved = resolve_config(config).specs.objective
    own = attrs.evolve(resolved, clip=(0.123, 0.456))
    settings = LossSettings.for_run(config.trainer, config.rollout, (), own)
    assert (settings.clip_low, settings.clip_high) == (0.123, 0.456) and settings.objective is own

    def refuse(name):
        raise AssertionError(f"looked up {name!r} by name during training")

    monkeypatch.setattr(get_objective_registry(), "get", refuse)
    assert settings.loss_function() is own.loss and settings.loss_aggregation() == own.aggregation
