"""benchmarks/image_budget.py: under the image budget K a Crafter episode's images and largest sample are flat in its
turns beyond K; without a budget they grow by one frame a turn."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "image_budget.py"
ONE_FRAME = 16 * 1536 * 4 + 3 * 8  # a 64x64 frame: pixel_values (16, 1536) fp32 and image_grid_thw (1, 3) int64


def load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("image_budget_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows() -> dict[tuple[int, int | None], dict]:
    pytest.importorskip("crafter")
    benchmark = load_benchmark()
    loaded = benchmark.load_policy()
    return {(t, k): benchmark.measure(loaded, t, k) for k in (None, 2) for t in (3, 6)}


def test_episodes_play_every_turn_with_a_new_frame(rows):
    for (t, _), row in rows.items():
        assert row["turns_played"] == t and not row["died"] and row["episode_frames"] == t
        assert row["one_image_bytes"] == ONE_FRAME


def test_without_a_budget_an_episode_holds_every_frame_in_one_sample(rows):
    for t in (3, 6):
        row = rows[t, None]
        assert row["last_prompt_images"] == row["conversation_images"] == row["largest_sample_images"] == t
        assert (
            row["samples"] == 1 and row["largest_sample_image_bytes"] == row["all_samples_image_bytes"] == t * ONE_FRAME
        )


def test_with_a_budget_the_images_and_the_largest_sample_are_flat_in_the_turns(rows):
    k = 2
    for t in (3, 6):
        row = rows[t, k]
        assert row["last_prompt_images"] == row["conversation_images"] == min(t, k)
        assert row["largest_sample_image_bytes"] == k * ONE_FRAME
        # what grows: turns 1..K make one sample, each later turn its own, each with K frames and the text so far
        assert row["samples"] == t - k + 1 == row["budget_splits"] + 1 and row["images_over_budget"] == t - k
        assert row["all_samples_image_bytes"] == k * ONE_FRAME * (t - k + 1)
    assert rows[3, k]["largest_sample_image_bytes"] == rows[6, k]["largest_sample_image_bytes"]
    assert rows[6, k]["all_samples_tokens"] > rows[3, k]["all_samples_tokens"]
    assert rows[6, None]["largest_sample_image_bytes"] == 2 * rows[3, None]["largest_sample_image_bytes"]
