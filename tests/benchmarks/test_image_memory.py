"""benchmarks/image_memory.py: the ImageStore holds K images for K turns; per-turn copies hold K(K+1)/2."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from types import ModuleType

import pytest

import vlmreg

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "image_memory.py"


def load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("image_memory_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def benchmark() -> ModuleType:
    return load_benchmark()


@pytest.fixture(scope="module")
def processor():
    return vlmreg.get_family("qwen3_vl").tiny_processor()


def test_store_bytes_grow_linearly_and_per_turn_copies_quadratically(benchmark, processor):
    rows = [benchmark.measure(k, processor, side=64) for k in (1, 2, 3, 4)]
    one = rows[0]["one_image_bytes"]
    assert one == 16 * 1536 * 4 + 3 * 8  # pixel_values (16, 1536) fp32 and image_grid_thw (1, 3) int64
    assert all(row["one_image_bytes"] == one for row in rows)
    store = [row["vlmreg_bytes"] for row in rows]
    assert store == [k * one for k in (1, 2, 3, 4)]
    assert {b - a for a, b in itertools.pairwise(store)} == {one}  # the same cost for every extra turn
    assert [row["naive_bytes"] for row in rows] == [k * (k + 1) // 2 * one for k in (1, 2, 3, 4)]


def test_realistic_processor_keeps_448_pixel_images_at_full_size(benchmark):
    processor = benchmark.realistic_processor("qwen3_vl", 448)
    row = benchmark.measure(1, processor, side=448)
    assert row["one_image_bytes"] == 784 * 1536 * 4 + 3 * 8  # 28 x 28 patches of 16 px: not downscaled
    # the cap it lifts
    assert vlmreg.get_family("qwen3_vl").tiny_processor().image_processor.size["longest_edge"] < 448 * 448
