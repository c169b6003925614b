"""Pixel-tensor bytes held for a K-turn trajectory with one new image per turn: `ImageStore` against per-turn copies.

vlmreg holds each image's processor features once, in the `ImageStore`; samples refer to images by id, so a
K-turn trajectory merged into one sample references K images and the store holds K feature tensors. The naive
way (one training sample per turn, each carrying the pixel tensors of the conversation so far, as frameworks that
re-run the processor on every turn's prompt do) holds k images' tensors at turn k: K(K+1)/2 in all.

Images are 448x448 random RGB, processed by the family's tiny processor with its pixel limit raised so they are
not downscaled (the tiny processor caps images at 65536 pixels; real Qwen3-VL checkpoints allow far more).

    .venv/bin/python benchmarks/image_memory.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
from typing import Any

import torch
import transformers
from PIL import Image

import vlmreg
from vlmreg.data.store import ImageStore
from vlmreg.sdk.example import Example, image_part, text_part

TURNS = (1, 2, 4, 8, 16, 32)
#: Processor outputs that describe the text, not the images: not pixel tensors.
TEXT_KEYS = frozenset({"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"})


def random_image(index: int, side: int) -> Any:
    """A distinct ``side`` x ``side`` RGB image per index (noise, so no two share a content hash)."""

    return Image.frombytes("RGB", (side, side), random.Random(index).randbytes(side * side * 3))


def tensor_bytes(tensors: dict[str, Any]) -> int:
    return sum(t.element_size() * t.nelement() for k, t in tensors.items() if k not in TEXT_KEYS)


def trajectory_messages(image_ids: list[str]) -> list[dict[str, Any]]:
    """A K-turn conversation as one merged sample: a user turn with a new image, then the model's answer, K times."""

    messages: list[dict[str, Any]] = []
    for turn, image_id in enumerate(image_ids):
        messages.append(
            {
                "role": "user",
                "content": [image_part(image_id), text_part("What colour is it?" if turn == 0 else "And this one?")],
            }
        )
        messages.append({"role": "assistant", "content": "Red"})
    return messages


def measure(turns: int, processor: Any, side: int = 448) -> dict[str, int]:
    """Bytes of pixel tensors held for one ``turns``-turn trajectory, the vlmreg way and the naive way."""

    images = [random_image(index, side) for index in range(turns)]
    store = ImageStore(max_feature_bytes=1 << 40)  # no eviction: count everything the trajectory needs
    sample = Example("trajectory", trajectory_messages([store.add(image) for image in images]), "Red")
    for image_id in sample.image_ids():
        store.features(image_id, processor, processor.image_token)
    one_image = tensor_bytes(store.features(sample.image_ids()[0], processor, processor.image_token).tensors)

    held = []  # the naive samples, all alive at once as they are in a batch of per-turn samples
    for turn in range(1, turns + 1):
        outputs = processor(text=[processor.image_token * turn], images=images[:turn], return_tensors="pt")
        held.append({k: v for k, v in outputs.items() if k not in TEXT_KEYS})
    naive = sum(tensor_bytes(sample_tensors) for sample_tensors in held)
    return {"turns": turns, "vlmreg_bytes": store.feature_bytes, "naive_bytes": naive, "one_image_bytes": one_image}


def realistic_processor(family: str, side: int) -> Any:
    """The family's tiny processor with its pixel limit raised to at least ``side`` x ``side``."""

    descriptor = vlmreg.get_family(family)
    if descriptor.tiny_processor is None:
        raise SystemExit(f"family {family} has no tiny_processor")
    processor = descriptor.tiny_processor()
    size = processor.image_processor.size
    size["longest_edge"] = max(size["longest_edge"], side * side)
    return processor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_vl")
    parser.add_argument("--side", type=int, default=448, help="image width and height in pixels")
    args = parser.parse_args()

    transformers.logging.set_verbosity_error()  # the naive 32-image prompt passes the tiny tokenizer's length hint
    processor = realistic_processor(args.family, args.side)
    probe = processor(text=[processor.image_token], images=[random_image(0, args.side)], return_tensors="pt")
    rows = []
    for turns in TURNS:
        row = measure(turns, processor, args.side)
        rows.append({**row, "ratio": round(row["naive_bytes"] / row["vlmreg_bytes"], 2)})
    result = {
        "image": f"{args.side}x{args.side} RGB",
        "pixel_values_per_image": {
            "shape": list(probe["pixel_values"].shape),
            "dtype": str(probe["pixel_values"].dtype).removeprefix("torch."),
        },
        "processor": f"{args.family} tiny processor, size['longest_edge'] (max pixels) raised to "
        f"{processor.image_processor.size['longest_edge']} so {args.side}x{args.side} is not downscaled",
        "rows": rows,
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "argv": sys.argv[1:],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
