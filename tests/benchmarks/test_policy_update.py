"""`benchmarks/policy_update.py` on the MoE path it runs on 4 GPUs, here under torchrun with gloo and 2 processes on
the tiny qwen3_vl_moe; and its FLOP count (active parameters) against the count written out from the config."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import vlmreg
from vlmreg.data import ImageStore
from vlmreg.loading.build import build_model, shallower
from vlmreg.modeling.vision_calls import VISION_CALLS
from vlmreg.sdk.registry import get_registry
from vlmreg.train.batching import make_microbatches

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import policy_update  # noqa: E402
import update_ranks  # noqa: E402


def matmul_params_from_config(text) -> int:
    """Per token: q, k, v, o projections, q/k norms, the two layer norms, router, top-k experts (gate, up, down),
    per layer; the final norm and the lm_head once. Written from the architecture, not from the module tree."""
    h, heads, kv, d = text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim
    attention = h * heads * d * 2 + h * kv * d * 2 + 2 * d + 2 * h
    experts = text.num_experts_per_tok * 3 * text.moe_intermediate_size * h
    router = text.num_experts * h
    return text.num_hidden_layers * (attention + router + experts) + h + text.vocab_size * h


@pytest.mark.parametrize(("size", "layers"), [("tiny", None), ("30b-a3b", None), ("30b-a3b", 12)])
def test_active_parameters_are_counted_as_the_architecture_says(size, layers):
    descriptor = get_registry().get("qwen3_vl_moe")
    config = shallower(descriptor.config_for_size(size), layers, what=size)
    model = build_model(config, descriptor, device="meta")
    loaded = types.SimpleNamespace(model=model, resolved=vlmreg.resolve(model, family=descriptor))
    active, total = update_ranks.active_matmul_params(loaded)
    assert active == matmul_params_from_config(config.text_config)
    if size == "30b-a3b" and layers is None:
        assert round(active / 1e9, 2) == 3.04 and round(total / 1e9, 1) == 30.5


def test_the_sharded_moe_update_runs_under_torchrun(tmp_path):
    out = tmp_path / "update.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(ROOT / "benchmarks" / "policy_update.py"), "--family", "qwen3_vl_moe", "--samples", "3"]
    command += ["--max-completion", "24", "--warmup", "0", "--iters", "1", "--modes", "vlmreg-packed,hf-frozen"]
    command += ["--experts", "grouped_mm", "--output", str(out)]
    command += ["--memory-budget-gib", "0.000001"]  # the planner under FSDP2 (nothing fits: everything recomputes)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["setup"]["world_size"] == 2
    assert results["vlmreg-packed"]["experts"] == ["vlmreg_grouped"]  # the family's prepare_model
    assert results["vlmreg-packed[grouped_mm]"]["experts"] == ["grouped_mm"]
    assert results["hf-frozen"]["experts"] == ["grouped_mm"]  # the peer as transformers runs it
    for mode in ("vlmreg-packed", "vlmreg-packed[grouped_mm]", "hf-frozen"):
        assert results[mode]["world_size"] == 2 and results[mode]["tokens"] > 0
        assert results[mode]["seconds_per_step"] > 0
        assert results[mode]["vision_flops_per_step"] > 0  # counted on every rank, the encoder called once more
    assert results["vlmreg-packed"]["tokens"] == results["hf-frozen"]["tokens"]  # the same samples, both ranks'
    for mode in ("vlmreg-packed", "vlmreg-packed[grouped_mm]"):  # rank 0's plans, each of its micro-batches
        assert results[mode]["recompute"] and all(p["recomputed_layers"] == 2 for p in results[mode]["recompute"])
    assert "recompute" not in results["hf-frozen"]


@pytest.mark.parametrize("train_vision", [False, True])
def test_vision_matmul_flops_are_counted_once_when_blocks_recompute(train_vision):
    """`count_vision_flops` and `vision_flops_counter` (what the timed steps use) against the count written out from
    the encoder's shapes (2 x in x out per row forward, 6 x where the weight trains), over two images of different
    sizes, with every vision block recomputing its activations in backward and without. The timed counter must leave
    the encoder's layers without hooks while they run (a hook in a compiled block breaks its graph)."""
    import policy_update  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from PIL import Image  # noqa: PLC0415

    from vlmreg.config import parse_config  # noqa: PLC0415
    from vlmreg.testing.parity import processor_inputs  # noqa: PLC0415

    torch.manual_seed(0)
    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    )
    encoder = loaded.resolved.vision_encoder
    for p in encoder.parameters():
        p.requires_grad_(train_vision)
    for p in encoder.merger.parameters():
        p.requires_grad_(True)  # a connector: trained either way
    linears = {name: m for name, m in encoder.named_modules() if isinstance(m, torch.nn.Linear)}
    want, calls = 0, []
    for size in ((64, 96), (128, 64)):
        image = {"type": "image", "image": Image.new("RGB", size, "red")}
        inputs = processor_inputs(loaded.processor, [{"role": "user", "content": [image]}], [40, 41])
        calls.append(inputs)
        patches = int(inputs["pixel_values"].shape[0])
        merged = patches // encoder.spatial_merge_size**2
        for name, module in linears.items():
            rows = merged if "merger" in name else patches  # a merger's linear layers: one row per merged group
            factor = 6 if module.weight.requires_grad else 2
            want += factor * module.in_features * module.out_features * rows
    hooked = []
    watch = encoder.register_forward_pre_hook(
        lambda *_: hooked.append(any(m._forward_pre_hooks or m._forward_hooks for m in linears.values()))
    )
    counts = []
    for counter in (policy_update.count_vision_flops, policy_update.vision_flops_counter):
        for recompute in (False, True):
            for block in loaded.resolved.vision_blocks:
                block.gradient_checkpointing = recompute
                block._gradient_checkpointing_func = functools.partial(
                    torch.utils.checkpoint.checkpoint, use_reentrant=False
                )
            finish = counter(encoder)
            for inputs in calls:
                loaded.model(**inputs).logits.float().square().mean().backward()
            counts.append(finish())
    watch.remove()
    assert counts == [want] * 4
    # the old counter's hooks ran inside the encoder in each training call; the timed one's ran in none, only in the
    # call of its own after them (one per count)
    assert hooked == [True] * 4 + [False, False, True] * 2


def test_the_uncached_comparison_builds_the_same_micro_batches():
    """`--uncached-host-inputs` (transformers' helpers on each whole grid and row, as before the Qwen families kept
    their host work) changes how long a micro-batch takes to build, not what it holds."""
    args = types.SimpleNamespace(
        layers=None, family="qwen3_vl", size="tiny", dtype="float32", device="cpu", keep_layers=0, image_size=64,
        samples=6, min_completion=4, max_completion=12,
    )  # fmt: skip
    loaded = policy_update.load(args, trainable_vision=False, checkpointing=False, attn="sdpa", ours=True)
    store = ImageStore()
    samples = policy_update.make_samples(loaded, store, args)
    built = [
        make_microbatches(
            samples, which.resolved, policy_update.encoder(loaded, store), budget=128, packed=True, device="cpu"
        )
        for which in (loaded, policy_update.uncached_host_inputs(loaded))
    ]
    assert len(built[0]) == len(built[1]) > 1
    for ours, before in zip(*built, strict=True):
        assert torch.equal(ours.inputs["position_ids"], before.inputs["position_ids"])
        calls, calls_before = ours.inputs[VISION_CALLS], before.inputs[VISION_CALLS]
        assert calls.keys() == calls_before.keys() == {"image_grid_thw"}
        for name, value in calls["image_grid_thw"].items():
            want = calls_before["image_grid_thw"][name]
            assert torch.equal(value, want) if isinstance(value, torch.Tensor) else value == want
