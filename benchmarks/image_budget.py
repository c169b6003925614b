"""Image memory of a Crafter episode of T turns, with and without the image budget `[rollout] max_images_in_context`.

Real Crafter episodes (64x64 frames, one a turn) played by the tiny random qwen3_vl model through the embedded
engine, as `tests/tasks/test_crafter.py` plays them, then cut into training samples by `build_samples`. For each T
and budget K this prints what one episode holds: the images in its last prompt, the distinct images its conversation
references at the end, the bytes of image tensors (`ImageStore` features, counted per image reference, as a forward
pass collates them) in its largest training sample and over all its samples, its samples and their tokens.

Every turn must show a new frame, so the answer moves the game: an answer that names a Crafter action plays it, any
other answer (nearly all of a random model's) plays a move drawn from a seeded walk. A game that ended early (the
player died) is reported with its real length.

    .venv/bin/python benchmarks/image_budget.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import sys
from typing import Any

import torch
import transformers

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.envs.gym import GymEnvironment
from vlmreg.inference.embedded import EmbeddedEngine
from vlmreg.rollout.episodes import run_episodes
from vlmreg.sdk.engine import SamplingParams
from vlmreg.tasks import crafter
from vlmreg.train.samples import build_samples

TURNS = (4, 8, 16, 32)
BUDGETS = (None, 2, 4)
MOVES = ("move_left", "move_right", "move_up", "move_down")


class WalkingActions:
    """Crafter's action for an answer: the one it names, else the next move of a seeded random walk."""

    def __init__(self, seed: int) -> None:
        self.lookup = {name: index for index, name in enumerate(crafter.ACTIONS)}
        self.rng = random.Random(seed)
        self.named = 0

    def __call__(self, completion: str) -> int:
        word = re.search(r"[A-Za-z0-9_\-]+", completion)  # the first word, as the gymnasium adapter reads it
        if word and word.group(0).lower() in self.lookup:
            self.named += 1
            return self.lookup[word.group(0).lower()]
        return self.lookup[self.rng.choice(MOVES)]


def load_policy(family: str = "qwen3_vl", seed: int = 0) -> Any:
    """The family's tiny random model, on CPU."""

    torch.manual_seed(seed)
    return vlmreg.load(parse_config({"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}}))


def play(loaded: Any, turns: int, budget: int | None, *, seed: int = 0) -> tuple[Any, Any, Any]:
    """One Crafter episode of at most ``turns`` turns under ``budget`` (``None``: no budget); returns the
    trajectory, the run's `ImageStore` and the engine's `PromptEncoder`."""

    torch.manual_seed(seed)  # the same completions for the same prompts, whatever ran before
    store = ImageStore(max_feature_bytes=1 << 40)  # no eviction: count everything the episode needs
    engine = EmbeddedEngine(loaded.model, loaded.processor, store, torch.device("cpu"))
    [example] = crafter.generate(1, seed, store)
    actions = WalkingActions(seed)

    def make_env(example: Any) -> GymEnvironment:
        return GymEnvironment(
            crafter.CrafterGame(),
            store,
            actions=actions,
            prompt=crafter.PROMPT,
            follow_up=crafter.FOLLOW_UP,
            max_steps=turns,
            frame="observation",
            name="crafter",
        )

    [trajectory] = run_episodes(
        [(example, 0)],
        make_env,
        engine,
        SamplingParams(max_tokens=4),
        max_images_per_message=1,
        max_images_in_context=budget,
        max_turns=turns,
    )
    trajectory.info["answers_naming_an_action"] = actions.named
    return trajectory, store, engine.encoder


def measure(loaded: Any, turns: int, budget: int | None, *, seed: int = 0) -> dict[str, Any]:
    """What one ``turns``-turn episode under ``budget`` holds: images, image-tensor bytes, samples and tokens."""

    trajectory, store, encoder = play(loaded, turns, budget, seed=seed)
    samples, stats = build_samples([trajectory], [1.0], seq_len=1 << 30)

    def image_bytes(image_ids: list[str]) -> int:  # per reference: what one forward pass over the sample collates
        return sum(encoder.image(image_id).nbytes for image_id in image_ids)

    last = trajectory.turns[-1]
    per_sample = [image_bytes(s.image_ids) for s in samples]
    largest = max(samples, key=lambda s: (image_bytes(s.image_ids), len(s)))
    return {
        "turns": turns,
        "budget": budget,
        "turns_played": len(trajectory.turns),
        "died": len(trajectory.turns) < turns,
        "answers_naming_an_action": trajectory.info["answers_naming_an_action"],
        "last_prompt_images": len(last.image_ids),
        "conversation_images": len(set(last.image_ids)),
        "episode_frames": len(store),
        "samples": len(samples),
        "budget_splits": stats.budget_splits,
        "largest_sample_images": len(largest.image_ids),
        "largest_sample_image_bytes": max(per_sample),
        "all_samples_image_bytes": sum(per_sample),
        "largest_sample_tokens": max(len(s) for s in samples),
        "all_samples_tokens": sum(len(s) for s in samples),
        "all_samples_text_tokens": sum(len(s) - sum(s.image_tokens) for s in samples),
        "last_prompt_tokens": len(last.prompt_ids),
        "images_over_budget": trajectory.images_over_budget,
        "one_image_bytes": encoder.image(last.image_ids[-1]).nbytes,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as the Markdown table BENCHMARKS.md shows."""
    head = (
        "T",
        "K",
        "turns played",
        "images in last prompt",
        "images held by the conversation",
        "samples",
        "largest sample: image bytes",
        "largest sample: tokens",
        "all samples: image bytes",
        "all samples: tokens (text)",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = (
            r["turns"],
            r["budget"] or "none",
            r["turns_played"],
            r["last_prompt_images"],
            r["conversation_images"],
            r["samples"],
            f"{r['largest_sample_image_bytes']:,}",
            f"{r['largest_sample_tokens']:,}",
            f"{r['all_samples_image_bytes']:,}",
            f"{r['all_samples_tokens']:,} ({r['all_samples_text_tokens']:,})",
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_vl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--turns", type=int, nargs="+", default=list(TURNS))
    parser.add_argument("--budgets", type=int, nargs="+", default=[b or 0 for b in BUDGETS], help="0: no budget")
    args = parser.parse_args()

    transformers.logging.set_verbosity_error()
    loaded = load_policy(args.family, args.seed)
    rows = [measure(loaded, turns, budget or None, seed=args.seed) for budget in args.budgets for turns in args.turns]
    print(table(rows))
    print()
    meta = {
        "family": f"{args.family} tiny random model, embedded engine, CPU",
        "frame": "Crafter 64x64 RGB, one a turn",
        "seed": args.seed,
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "argv": sys.argv[1:],
    }
    print(json.dumps(meta))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
