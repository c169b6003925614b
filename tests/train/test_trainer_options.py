"""[trainer] options of the update: learning-rate schedule, several updates per batch, entropy bonus, masking
truncated completions; each against a hand computation or an exact expectation, and all of them in one real run."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import attrs
import pytest
import torch

from vlmreg.cli import main
from vlmreg.config.checks import SectionInvalid
from vlmreg.config.load import load_config
from vlmreg.config.resolve import resolve_config
from vlmreg.config.schema import TrainerSection
from vlmreg.modeling.logprobs import token_entropy
from vlmreg.modeling.vision_calls import VISION_CALLS
from vlmreg.tasks import colour_turns
from vlmreg.train import batch_update, recipe
from vlmreg.train.losses import grpo
from vlmreg.train.step import lr_factor, policy_update

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml")
TIMING = {"tokens_per_s", "rollout_s", "update_s", "step_s"}
QUICK = ["trainer.format_warmup_steps=0", "eval.every=0", "logging.rollout_page_every=0"]


def metrics(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line]


def make_trainer(tmp_path: Path, *sets: str) -> recipe.Trainer:
    """A set-up Trainer on the tiny CPU config (padded micro-batches, so a plain model forward reads them)."""
    base = [*QUICK, "trainer.prompts_per_step=2", "rollout.group_size=4", "trainer.packing=false", "trainer.tis=false"]
    rc = resolve_config(load_config(MAIN, [*base, *sets]))
    trainer = recipe.Trainer(
        rc, output_dir=tmp_path / "run", base_dir=ROOT / "examples" / "configs", log=lambda message: None
    )
    trainer.setup()
    return trainer


def give_rewards(trainer: recipe.Trainer, monkeypatch, finish_reason=lambda i: "stop") -> None:
    """Rewards 1, 0, 0, 1, 0, 0, ... over the step's trajectories (a random tiny model earns none), so every group
    has nonzero advantages and the update moves the policy; ``finish_reason(i)`` marks trajectory i's turns."""
    real = trainer.rollouts

    def rollouts(*args, **kwargs):
        trajectories = real(*args, **kwargs)
        for i, t in enumerate(trajectories):
            t.turns = [attrs.evolve(turn, finish_reason=finish_reason(i), reward=float(i % 3 == 0)) for turn in t.turns]
        return trajectories

    monkeypatch.setattr(trainer, "rollouts", rollouts)


def model_inputs(mb) -> dict:
    """The micro-batch's inputs as the model takes them (without the vision encoder's precomputed arguments, which
    vlmreg's own forward hands to the encoder: a plain forward lets the encoder derive them)."""
    return {k: v for k, v in mb.inputs.items() if k != VISION_CALLS}


def plain_logits(trainer: recipe.Trainer, mb) -> torch.Tensor:
    """The sampler's distribution at the trained positions, from the model's own full logits (no chunking, no hooks)."""
    logits = (
        trainer.resolved.model(**model_inputs(mb), use_cache=False).logits[mb.loss_mask].float()
        / trainer.objective.temperature
    )
    if trainer.objective.suppress:
        logits = logits.index_fill(-1, torch.tensor(trainer.objective.suppress), float("-inf"))
    return logits


def plain_logprobs(trainer: recipe.Trainer, mb) -> torch.Tensor:
    with torch.no_grad():
        return (
            torch.log_softmax(plain_logits(trainer, mb), -1)
            .gather(-1, mb.targets[mb.loss_mask].unsqueeze(-1))
            .squeeze(-1)
        )


# -- the learning-rate schedule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, step, expected",
    [
        ("constant", 1, 0.5),
        ("constant", 2, 1.0),
        ("constant", 10, 1.0),  # warm-up over 2 steps, then flat
        ("linear", 1, 0.5),
        ("linear", 4, 0.1 + 0.9 * 0.75),
        ("linear", 6, 0.55),
        ("linear", 10, 0.1),
        ("cosine", 2, 1.0),
        ("cosine", 4, 0.1 + 0.45 * (1 + math.sqrt(0.5))),
        ("cosine", 6, 0.55),
        ("cosine", 10, 0.1),
    ],
)
def test_lr_factor_follows_the_formula(schedule, step, expected):
    """warmup_steps = 2, steps = 10, min_lr_ratio = 0.1: p = (step - 2) / 8 after the warm-up."""
    assert lr_factor(step, schedule=schedule, warmup_steps=2, total_steps=10, min_lr_ratio=0.1) == pytest.approx(
        expected, abs=1e-12
    )


def test_without_warmup_the_first_step_trains_at_the_full_rate():
    assert lr_factor(1, schedule="constant", warmup_steps=0, total_steps=5, min_lr_ratio=0.0) == 1.0
    assert lr_factor(5, schedule="cosine", warmup_steps=0, total_steps=5, min_lr_ratio=0.0) == pytest.approx(
        0.0, abs=1e-12
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("lr_schedule", "exponential"),
        ("warmup_steps", -1),
        ("warmup_steps", 200),
        ("min_lr_ratio", 1.5),
        ("min_lr_ratio", -0.1),
        ("updates_per_batch", 0),
        ("entropy_coef", -0.01),
    ],
)
def test_bad_values_are_refused(field, value):
    with pytest.raises((SectionInvalid, ValueError, TypeError)) as info:
        load_config(MAIN, [f"trainer.{field}={json.dumps(value)}"])
    assert field in str(info.value) or any(field in str(e) for e in getattr(info.value, "exceptions", ()))


def test_the_defaults_change_nothing():
    t = TrainerSection()
    assert (t.lr_schedule, t.warmup_steps, t.min_lr_ratio, t.updates_per_batch, t.entropy_coef, t.mask_truncated) == (
        "constant",
        0,
        0.0,
        1,
        0.0,
        False,
    )


# -- several updates per batch ----------------------------------------------------------------------------------


def test_the_second_update_s_ratio_is_against_the_policy_before_the_first(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "trainer.updates_per_batch=2", "trainer.steps=1")
    give_rewards(trainer, monkeypatch)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (logp, logp_old) of every loss call
    plain: list[list[torch.Tensor]] = []  # a plain forward of every micro-batch before each update

    def recording(x):
        seen.append((x.logp.detach().clone(), x.logp_old.clone()))

        return grpo(x)

    trainer.objective = attrs.evolve(trainer.objective, loss=recording)
    real = batch_update.policy_update_sums

    def update(resolved, batches, *args, **kwargs):
        plain.append([plain_logprobs(trainer, mb) for mb in batches])
        return real(resolved, batches, *args, **kwargs)

    monkeypatch.setattr(batch_update, "policy_update_sums", update)
    record = trainer.train_step(1).metrics
    trainer.cleanup()
    assert len(plain) == 2 and len(seen) == 2 * len(plain[0])
    batches = len(plain[0])
    for i in range(batches):
        before, after = plain[0][i], plain[1][i]
        first_old, (second_logp, second_old) = seen[i][1], seen[batches + i]
        assert torch.allclose(first_old, before, atol=1e-5) and torch.allclose(second_old, before, atol=1e-5)
        assert torch.allclose(second_logp, after, atol=1e-5)
        ratio = torch.exp(second_logp - second_old)
        assert torch.allclose(ratio, torch.exp(after - before), atol=1e-5)
        assert (ratio - 1).abs().max() > 1e-3  # the first update moved the policy: the ratio is no longer 1
    assert "clip_fraction_last" in record and record["lr"] == pytest.approx(3e-3)


def test_one_update_per_batch_makes_no_extra_forward(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "trainer.steps=1")
    calls = []
    monkeypatch.setattr(
        batch_update, "old_logprobs", lambda *a, **k: calls.append(a) or pytest.fail("old_logprobs with one update")
    )
    equal = []

    def recording(x):
        equal.append(torch.equal(x.logp.detach(), x.logp_old))

        return grpo(x)

    trainer.objective = attrs.evolve(trainer.objective, loss=recording)
    record = trainer.train_step(1).metrics
    trainer.cleanup()
    assert equal and all(equal) and not calls
    assert "clip_fraction_last" not in record


# -- the entropy bonus --------------------------------------------------------------------------------------------


def test_token_entropy_has_the_gradient_of_the_formula():
    torch.manual_seed(0)
    hidden = torch.randn(5, 4, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float32, requires_grad=True)
    suppress = torch.tensor([2, 5])
    ours = token_entropy(hidden, weight, None, 0.7, suppress)
    g_ours = torch.autograd.grad((ours * torch.arange(1.0, 6.0, dtype=torch.float32)).sum(), (hidden, weight))
    # a suppressed token is not in the distribution at all
    kept = torch.tensor([v for v in range(7) if v not in (2, 5)])
    reference = torch.special.entr(torch.softmax(hidden @ weight[kept].T / 0.7, -1)).sum(-1)  # - sum p log p
    g_ref = torch.autograd.grad((reference * torch.arange(1.0, 6.0, dtype=torch.float32)).sum(), (hidden, weight))
    assert torch.allclose(ours, reference, atol=1e-5)
    for a, b in zip(g_ours, g_ref, strict=True):
        assert torch.isfinite(a).all() and torch.allclose(a, b, atol=1e-5)


def test_the_entropy_bonus_adds_minus_coef_times_the_gradient_of_the_mean_entropy(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "trainer.steps=1")
    captured = []
    real = batch_update.policy_update_sums
    monkeypatch.setattr(
        batch_update,
        "policy_update_sums",
        lambda resolved, batches, *a, **k: captured.append((batches, k)) or real(resolved, batches, *a, **k),
    )
    trainer.train_step(1)
    batches, kwargs = captured[0]
    total = kwargs["total_tokens"]
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def gradient(coef: float) -> list[torch.Tensor]:
        trainer.optimizer.zero_grad(set_to_none=True)
        policy_update(
            trainer.resolved,
            batches,
            attrs.evolve(trainer.objective, entropy_coef=coef),
            num_samples=kwargs["num_samples"],
            total_tokens=total,
        )
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    without, with_bonus = gradient(0.0), gradient(0.5)
    trainer.optimizer.zero_grad(set_to_none=True)
    vocab = trainer.resolved.lm_head.weight.shape[0]
    # suppressed: not in it at all
    kept = torch.tensor([v for v in range(vocab) if v not in set(trainer.objective.suppress)])

    def entropy_sum(mb) -> torch.Tensor:
        logits = (
            trainer.resolved.model(**model_inputs(mb), use_cache=False).logits[mb.loss_mask][:, kept].float()
            / trainer.objective.temperature
        )
        return torch.special.entr(torch.softmax(logits, -1)).sum()  # - sum p log p, by autograd

    mean_entropy = sum(entropy_sum(mb) for mb in batches) / total
    expected = torch.autograd.grad(-0.5 * mean_entropy, params, allow_unused=True)
    trainer.cleanup()
    differs = 0
    for w, b, e in zip(without, with_bonus, expected, strict=True):
        e = torch.zeros_like(w) if e is None else e
        assert torch.allclose(b - w, e, atol=1e-6, rtol=1e-3)
        differs += int(e.abs().max() > 1e-6)
    assert differs  # the bonus did move some gradient


# -- masking truncated completions ----------------------------------------------------------------------------------


def _gradient_of_step(
    tmp_path: Path, monkeypatch, *, mask: bool, drop_cut_samples_by_hand: bool
) -> tuple[dict, list[torch.Tensor]]:
    """One step in which even trajectories are marked cut by max_tokens (and rewards are set so that advantages are
    not all zero); the gradient the optimizer step sees."""
    trainer = make_trainer(
        tmp_path / f"{mask}",
        "trainer.steps=1",
        f"trainer.mask_truncated={str(mask).lower()}",
        "trainer.max_grad_norm=1e9",
    )
    give_rewards(trainer, monkeypatch, finish_reason=lambda i: "length" if i % 2 == 0 else "stop")
    real_build = batch_update.build_samples

    def build(trajectories, *args, **kwargs):
        samples, stats = real_build(trajectories, *args, **kwargs)
        return ([s for s in samples if s.trajectory % 2] if drop_cut_samples_by_hand else samples), stats

    monkeypatch.setattr(batch_update, "build_samples", build)
    grads: list[torch.Tensor] = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def clip(params, *args, **kwargs):  # the gradient of the step, as clipping (then the optimizer) sees it
        params = list(params)
        grads.extend(p.grad.clone() for p in params if p.grad is not None)
        return real_clip(params, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    record = trainer.train_step(1).metrics
    trainer.cleanup()
    monkeypatch.undo()
    return record, grads


def test_masked_truncated_samples_contribute_zero_gradient(tmp_path, monkeypatch):
    masked, g_masked = _gradient_of_step(tmp_path, monkeypatch, mask=True, drop_cut_samples_by_hand=False)
    by_hand, g_by_hand = _gradient_of_step(tmp_path, monkeypatch, mask=False, drop_cut_samples_by_hand=True)
    unmasked, g_unmasked = _gradient_of_step(tmp_path, monkeypatch, mask=False, drop_cut_samples_by_hand=False)
    assert masked["samples_masked_truncated"] == 4 and masked["samples"] == 4  # 2 prompts x 4: the 4 even ones are cut
    assert by_hand["samples_masked_truncated"] == 0 and unmasked["samples"] == 8
    assert len(g_masked) == len(g_by_hand) and all(torch.equal(a, b) for a, b in zip(g_masked, g_by_hand, strict=True))
    change = sum(float((a - b).norm() ** 2) for a, b in zip(g_masked, g_unmasked, strict=True)) ** 0.5
    assert change > 0.1 * sum(float(b.norm() ** 2) for b in g_unmasked) ** 0.5  # masking changed the gradient


# -- a real run with every option on, and --resume with a schedule ------------------------------------------------


def test_a_run_with_every_option_on_logs_them(tmp_path):
    out = tmp_path / "run"
    options = [
        "trainer.steps=3",
        "trainer.prompts_per_step=2",
        "rollout.group_size=4",
        "trainer.lr_schedule=cosine",
        "trainer.warmup_steps=1",
        "trainer.min_lr_ratio=0.1",
        "trainer.updates_per_batch=2",
        "trainer.entropy_coef=0.01",
        "trainer.mask_truncated=true",
        "rollout.max_tokens=3",
    ]
    # a short format warm-up teaches the word and the stop token, so some completions end within 3 tokens and some are
    # cut
    argv = [
        "train",
        MAIN,
        *(a for o in [*QUICK, *options, "trainer.format_warmup_steps=15"] for a in ("--set", o)),
        "--output-dir",
        str(out),
    ]
    assert main(argv) == 0
    records = metrics(out)
    # warm-up 1, then cosine
    assert [r["lr"] for r in records] == pytest.approx([3e-3, 3e-3 * 0.55, 3e-3 * 0.1], rel=1e-9)
    for r in records:  # one sample per (single-turn) trajectory: masked ones are exactly the cut ones
        assert (
            r["samples_masked_truncated"] == r["truncated_responses"]
            and r["samples_masked_truncated"] + r["samples"] == 8
        )
    trained = [r for r in records if r["samples"]]
    assert trained and any(r["samples_masked_truncated"] for r in records)
    for r in trained:
        assert {"loss", "entropy", "clip_fraction", "clip_fraction_last", "grad_norm"} <= set(r)
        assert r["loss"] < 0  # zero advantages in these tiny groups leave the entropy bonus: - 0.01 * entropy
        assert r["loss"] == pytest.approx(-0.01 * r["entropy"], abs=1e-3)


def test_resume_with_a_schedule_gives_the_same_metrics_as_an_uninterrupted_run(tmp_path):
    """The run is interrupted after step 3 of 6 (its step-6 checkpoint removed); resuming must follow the same
    cosine."""
    common = [
        *QUICK,
        "trainer.prompts_per_step=2",
        "rollout.group_size=4",
        "trainer.save_every=3",
        "trainer.steps=6",
        "trainer.lr_schedule=cosine",
        "trainer.warmup_steps=2",
        "trainer.min_lr_ratio=0.2",
    ]
    argv = [a for o in common for a in ("--set", o)]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", MAIN, *argv, "--output-dir", str(straight)]) == 0
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000006")
    (resumed / "checkpoints" / "latest").write_text("step_000003")
    assert main(["train", MAIN, *argv, "--output-dir", str(resumed), "--resume"]) == 0
    a = [{k: v for k, v in r.items() if k not in TIMING} for r in metrics(straight)]
    b = [{k: v for k, v in r.items() if k not in TIMING} for r in metrics(resumed)]
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert a == b
    expected = [
        lr_factor(s, schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.2) * 3e-3 for s in range(1, 7)
    ]
    assert [r["lr"] for r in b] == pytest.approx(expected, rel=1e-9)
    assert len({r["lr"] for r in b}) == 6  # every step has its own rate: a schedule restarted at resume would show


def test_the_image_budget_is_counted_in_the_step_metrics(tmp_path):
    """colour_turns shows one image per turn (3 turns): with max_images_in_context = 1 each episode drops 2 images
    and its last 2 turns start new samples; the step's metrics count exactly that."""

    trainer = make_trainer(
        tmp_path, "data.task=colour_turns", "rollout.max_images_in_context=1", "rollout.max_tokens=4"
    )
    try:
        step = trainer.train_step(1)
        record, trajectories = step.metrics, step.batch.trajectories
    finally:
        trainer.cleanup()
    episodes = len(trajectories)
    assert all(len(t.turns) == colour_turns.TURNS for t in trajectories)
    assert record["images_over_budget"] == episodes * (colour_turns.TURNS - 1)
    assert record["samples_split_by_budget"] == episodes * (colour_turns.TURNS - 1)
    assert record["images_dropped"] >= record["images_over_budget"]
