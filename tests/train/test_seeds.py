"""What each seed sets, as docs/config.md says: ``trainer.seed`` the sampling, ``data.seed`` the data order,
``model.seed`` a random init's weights; none of them moves what another sets. Real one-step CPU runs."""

from __future__ import annotations

from pathlib import Path

import vlmreg

MAIN = Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_vl_tiny.toml"
QUICK = [
    "trainer.format_warmup_steps=0",
    "eval.every=0",
    "logging.rollout_page_every=0",
    "trainer.prompts_per_step=2",
    "rollout.group_size=2",
    "trainer.steps=1",
]


def first_batch(tmp_path: Path, *sets: str) -> tuple[list[str], list[list[int]]]:
    """The first step's example ids and completion token ids."""
    seen = []
    vlmreg.train(
        MAIN,
        overrides=[*QUICK, *sets],
        output_dir=tmp_path / f"run{len(list(tmp_path.iterdir()))}",
        log=lambda message: None,
        on_rollouts=lambda step, trajectories: seen.extend(trajectories),
    )
    return [t.example.id for t in seen], [t.turns[0].completion_ids for t in seen]


def test_trainer_seed_sets_the_sampling_and_data_seed_the_order(tmp_path):
    ids, tokens = first_batch(tmp_path, "trainer.seed=0")
    assert first_batch(tmp_path, "trainer.seed=0") == (ids, tokens)  # reproducible
    other_ids, other_tokens = first_batch(tmp_path, "trainer.seed=1")
    assert other_ids == ids and other_tokens != tokens  # the same examples, sampled differently
    shuffled_ids, _ = first_batch(tmp_path, "data.seed=1")
    assert shuffled_ids != ids  # another order (and other generated examples)
