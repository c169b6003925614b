"""trainer.memory_budget_gib: per micro-batch, decoder layers and vision blocks recompute their activations to fit.

References: the gradients of a plain backward without recomputation, forward calls counted by hooks (a module that
recomputes runs twice per micro-batch), a run without the budget, and on a GPU the CUDA allocator's own peak.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from PIL import Image

import vlmreg
from tests.train.test_packing import setup_family
from vlmreg.config import parse_config
from vlmreg.config.load import ConfigError, load_config
from vlmreg.data import ImageStore, image_part, text_part
from vlmreg.data.prompts import PromptEncoder
from vlmreg.modeling.logprobs import hidden_states
from vlmreg.modeling.recompute import GIB, MemoryBudgetError, RecomputePlanner, check_budget
from vlmreg.train.batching import make_microbatches
from vlmreg.train.samples import TrainingSample
from vlmreg.train.step import LossSettings, policy_update

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml")
OBJECTIVE = LossSettings("grpo", 0.2, 0.28, True, 2.0, 0.0, 1.0)


def tiny(*, vision_trains: bool, device: str = "cpu"):
    loaded, encoder, samples = setup_family("qwen3_vl", device)
    if vision_trains:
        for p in loaded.model.parameters():
            p.requires_grad_(True)
    loaded.model.train()
    return (
        loaded,
        make_microbatches(samples, loaded.resolved, encoder, budget=4096, packed=True, device=loaded.device),
        samples,
    )


def count_calls(planner: RecomputePlanner) -> dict[str, int]:
    """Calls of each module's first linear layer (transformers recomputes a layer's ``forward``, inside its hooks)."""
    calls: dict[str, int] = {}
    for m in planner.modules:
        first = next(sub for sub in m.module.modules() if isinstance(sub, torch.nn.Linear))
        first.register_forward_pre_hook(
            lambda module, args, name=m.name: calls.__setitem__(name, calls.get(name, 0) + 1)
        )
    return calls


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_recomputing_everything_gives_the_plain_gradients():
    loaded, mbs, samples = tiny(vision_trains=True)
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples))
    plain = gradients(loaded.model)
    loaded.model.zero_grad(set_to_none=True)
    planner = RecomputePlanner(loaded.resolved, 1, log=lambda message: None)  # 1 byte: nothing fits
    calls = count_calls(planner)
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)
    assert planner.last["recomputed_layers"] == len(loaded.resolved.layers)
    assert planner.last["recomputed_vision_blocks"] == len(loaded.resolved.vision_blocks)
    # the measuring forward once, then each micro-batch's forward and its recomputation in backward
    assert set(calls.values()) == {1 + 2 * len(mbs)}, calls
    recomputed = gradients(loaded.model)
    assert recomputed.keys() == plain.keys() and len(plain) == sum(
        1 for p in loaded.model.parameters() if p.requires_grad
    )
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=1e-6, msg=name)


def test_an_ample_budget_recomputes_nothing():
    loaded, mbs, samples = tiny(vision_trains=True)
    planner = RecomputePlanner(loaded.resolved, 1000 * GIB, log=lambda message: None)
    calls = count_calls(planner)
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)
    assert (planner.last["recomputed_layers"], planner.last["recomputed_vision_blocks"]) == (0, 0)
    assert set(calls.values()) == {1 + len(mbs)}
    assert not any(m.module.gradient_checkpointing for m in planner.switchable)


def switched(planner: RecomputePlanner) -> list[str]:
    return [m.name for m in planner.switchable if m.module.gradient_checkpointing]


def test_the_cheapest_bytes_go_first_and_only_as_many_as_needed():
    """Vision blocks keep more bytes per parameter than decoder layers, so they recompute first; one byte over the
    budget switches one module, and a budget that all vision blocks cannot meet takes layers too."""
    loaded, mbs, samples = tiny(vision_trains=True)
    mb = mbs[0]

    def plan(budget: int) -> list[str]:
        planner.budget = budget
        planner.prepare(mb.inputs, forward)
        return switched(planner)

    forward = lambda: hidden_states(loaded.resolved, mb.inputs)  # noqa: E731
    planner = RecomputePlanner(loaded.resolved, 1000 * GIB, log=lambda message: None)
    planner.prepare(mb.inputs, forward)
    need = planner.last["predicted_peak_bytes"]
    blocks = [m for m in planner.modules if m.vision]
    layers = [m for m in planner.modules if not m.vision]
    assert all(b.params / b.freed_per_row < min(layer.params / layer.freed_per_row for layer in layers) for b in blocks)
    assert plan(need) == []
    one = plan(need - 1)
    assert len(one) == 1 and one[0].startswith("vision_blocks.")
    patches = blocks[0].rows_per_unit * mb.inputs["pixel_values"].numel()
    all_blocks = sum(b.freed_per_row for b in blocks) * patches
    more = plan(need - int(all_blocks) - 1)
    assert {n for n in more if n.startswith("vision_blocks.")} == {b.name for b in blocks}
    assert any(n.startswith("layers.") for n in more)


def test_a_frozen_vision_tower_keeps_nothing_so_only_layers_recompute():
    loaded, mbs, samples = tiny(vision_trains=False)
    planner = RecomputePlanner(loaded.resolved, 1, log=lambda message: None)
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)
    assert all(m.saved_per_row == 0 for m in planner.modules if m.vision)
    assert planner.last["recomputed_vision_blocks"] == 0
    assert planner.last["recomputed_layers"] == len(loaded.resolved.layers)


def test_a_budget_that_cannot_be_met_is_warned_about_once():
    loaded, mbs, samples = tiny(vision_trains=True)
    said: list[str] = []
    planner = RecomputePlanner(loaded.resolved, 1, log=said.append)
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)
    assert len(said) == 1
    assert "trainer.memory_budget_gib" in said[0] and "trainer.max_tokens_per_microbatch" in said[0]


def test_a_budget_above_what_the_gpu_can_give_is_refused_at_once(monkeypatch):
    """An H100 gives a process about 78.5 GiB (79.2 on the card, the CUDA context outside PyTorch's allocator): a
    budget of 80 cannot be kept by any plan, so it is refused naming the key and the room, before any step. The room
    is the free memory plus what the allocator reserved already (its own cache is the process's to use)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(70.5 * GIB), int(79.2 * GIB)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 8 * GIB)
    gpu = torch.device("cuda", 0)
    with pytest.raises(MemoryBudgetError) as info:
        check_budget(80 * GIB, gpu)
    said = str(info.value)
    assert "trainer.memory_budget_gib = 80" in said and "78.5 GiB" in said and "at most 78" in said, said
    check_budget(78 * GIB, gpu)  # within the room
    check_budget(10**6 * GIB, torch.device("cpu"))  # a CPU run plans with its own tensors' sizes: nothing to ask


def test_config_refuses_a_budget_with_full_checkpointing_and_a_non_positive_one():
    with pytest.raises(ConfigError) as info:
        load_config(MAIN, ["trainer.memory_budget_gib=40", "trainer.gradient_checkpointing=true"])
    assert "memory_budget_gib" in str(info.value) and "gradient_checkpointing" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(MAIN, ["trainer.memory_budget_gib=0"])
    assert "memory_budget_gib" in str(info.value)


def test_a_run_under_a_budget_trains_exactly_as_one_without(tmp_path, monkeypatch):
    """Recomputation changes what is kept, not what is computed: the same seed gives the same steps and weights."""
    # deferred: test_trainer_options is made by the test, not importable before
    from tests.train.test_trainer_options import give_rewards, make_trainer  # noqa: PLC0415

    def run(name: str, *extra: str) -> tuple[list[dict], dict[str, torch.Tensor], list[str]]:
        trainer = make_trainer(tmp_path / name, "trainer.steps=2", "model.vlm.freeze_vision_encoder=false", *extra)
        said: list[str] = []
        trainer.log = said.append
        give_rewards(trainer, monkeypatch)
        records = [trainer.train_step(step).metrics for step in (1, 2)]
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.cleanup()
        return records, weights, said

    plain, plain_weights, _ = run("plain")
    budget, budget_weights, said = run("budget", "trainer.memory_budget_gib=0.000001")
    assert any("recompute their activations" in line for line in said) and any(
        "trainer.memory_budget_gib" in line for line in said
    )
    # in metrics.jsonl
    assert [(r["recompute_layers"], r["recompute_vision_blocks"]) for r in budget] == [(2, 2), (2, 2)]
    assert "recompute_layers" not in plain[0] and all(r["predicted_peak_gib"] > 0 for r in budget)
    keys = ["loss", "grad_norm", "entropy", "clip_fraction"]
    assert all(r["grad_norm"] > 0 for r in plain)  # real updates: the rewards give nonzero advantages
    assert [r[k] for r in budget for k in keys] == pytest.approx([r[k] for r in plain for k in keys], rel=1e-5)
    for name, weight in plain_weights.items():
        torch.testing.assert_close(budget_weights[name], weight, rtol=0, atol=1e-6, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the CUDA allocator's peak is the reference")
def test_the_allocator_peak_stays_within_the_budget_on_a_gpu():
    """The Qwen3-VL-2B shape with its vision tower trained, 12k tokens in one micro-batch, a budget halfway between
    what is held and the peak without recomputation: the CUDA allocator's own peak stays within it."""

    torch.manual_seed(0)
    loaded = vlmreg.load(
        parse_config(
            {
                "model": {
                    "init": "random",
                    "family": "qwen3_vl",
                    "size": "2b",
                    "dtype": "bfloat16",
                    "vlm": {"freeze_vision_encoder": False},
                },
                "trainer": {"device": "cuda"},
            }
        )
    )
    loaded.model.train()
    processor = loaded.processor
    processor.image_processor.size = {**dict(processor.image_processor.size), "longest_edge": 448 * 448}
    store, rng = ImageStore(), random.Random(0)
    encoder = PromptEncoder(processor, store, loaded.resolved.descriptor)
    samples = []
    for i in range(16):
        image = store.add(Image.new("RGB", (448, 448), tuple(rng.randint(0, 255) for _ in range(3))))
        prompt = encoder.encode(
            [{"role": "user", "content": [image_part(image), text_part("Which colour dominates?")]}]
        )
        completion = [rng.randint(10, 1000) for _ in range(512)]
        samples.append(
            TrainingSample(
                prompt.input_ids + completion,
                [False] * len(prompt.input_ids) + [True] * 512,
                [0.0] * len(prompt.input_ids) + [-1.0] * 512,
                prompt.image_ids,
                prompt.image_spans,
                1.0,
                i,
                f"s{i}",
            )
        )
    mbs = make_microbatches(samples, loaded.resolved, encoder, budget=16384, packed=True, device=loaded.device)
    assert len(mbs) == 1
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples))  # gradients allocated, kernels warm
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples))
    plain_peak, held = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
    budget = held + (plain_peak - held) // 2
    planner = RecomputePlanner(loaded.resolved, budget, log=lambda message: None)
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)  # measures, then plans
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)
    peak = torch.cuda.max_memory_allocated()
    figures = {
        "plain_peak_gib": plain_peak / GIB,
        "held_gib": held / GIB,
        "budget_gib": budget / GIB,
        "peak_gib": peak / GIB,
        **planner.last,
    }
    print(figures)
    assert planner.last["recomputed_layers"] + planner.last["recomputed_vision_blocks"] > 0, figures
    assert peak <= budget, figures
    assert peak >= held + (budget - held) * 0.6, figures  # and it does not recompute far more than it must


def test_a_prediction_short_of_the_observed_peak_widens_the_margin():
    loaded, mbs, samples = tiny(vision_trains=True)
    planner = RecomputePlanner(loaded.resolved, 1000 * GIB, log=lambda message: None)
    planner.begin_step()
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)
    margin, predicted = planner.margin, max(p["predicted_peak_bytes"] for p in planner.history)
    # within: kept
    assert planner.end_step(predicted - 5)["predicted_peak_bytes"] == predicted and planner.margin == margin
    planner.begin_step()
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)
    planner.end_step(predicted + 12345)
    assert planner.margin == margin + 12345
    planner.begin_step()
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)
    assert max(p["predicted_peak_bytes"] for p in planner.history) == predicted + 12345


def test_the_plan_is_logged_again_when_its_predicted_peak_moves_by_a_gib():
    """The first update plans without the optimizer state its step creates after the backward pass; the second holds
    it. Same modules recomputing (none here), but a prediction some GiB higher: the log says so, where it used to keep
    showing the first update's figure. A move under a GiB is not logged."""
    loaded, mbs, samples = tiny(vision_trains=True)
    said: list[str] = []
    held = [0]
    planner = RecomputePlanner(loaded.resolved, 1000 * GIB, held=lambda: held[0], log=said.append)
    for extra in (0, GIB // 2, 3 * GIB):
        held[0] = extra
        planner.begin_step()
        policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)
        planner.end_step()
    assert len(said) == 2, said
    first, second = (float(line.split("predicted peak ")[1].split(" GiB")[0]) for line in said)
    assert all("0 of" in line for line in said) and 2.9 < second - first < 3.1, said


def test_modules_that_cannot_recompute_are_named_once_and_never_switched():
    loaded, mbs, samples = tiny(vision_trains=True)
    layer = loaded.resolved.layers[1]
    # a family's own class
    layer.__class__ = type("OwnDecoderLayer", (torch.nn.Module,), {"forward": type(layer).forward})
    layer.gradient_checkpointing = False  # what transformers' forward reads; the class itself has no such switch
    said: list[str] = []
    planner = RecomputePlanner(loaded.resolved, 1, log=said.append)
    assert len([line for line in said if line.startswith("note:")]) == 1
    assert "OwnDecoderLayer" in said[0] and "1 of 4" in said[0]
    policy_update(loaded.resolved, mbs, OBJECTIVE, num_samples=len(samples), recompute=planner)
    assert layer.gradient_checkpointing is False and "layers.1" not in switched(planner)
    assert planner.last["recomputed_layers"] == len(loaded.resolved.layers) - 1


def test_a_moe_layer_is_weighed_by_the_experts_a_token_reaches():
    """`active_params`, the planner's cost of recomputing a layer, against torch's own FLOP count of the layer's
    matmuls on one-token rows with transformers' eager expert loop: 2 FLOPs per token per matmul parameter used (the
    norms' 1-D weights take part in no matmul). A dense vision block counts every parameter."""
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415 - only this test counts FLOPs

    from vlmreg.modeling.sizes import active_params  # noqa: PLC0415 - beside the reference it is checked against

    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": "qwen3_vl_moe", "dtype": "float32"}}))
    loaded.model.set_experts_implementation("eager")  # a matmul per expert on its routed tokens: countable
    text = loaded.model.config.get_text_config()
    assert text.num_experts_per_tok < text.num_experts  # else the test could not tell the counts apart
    layers = loaded.resolved.layers
    rows = 64
    hidden = torch.randn(rows, 1, text.hidden_size)
    ids = torch.zeros(rows, 1, dtype=torch.long)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        loaded.resolved.language_model(inputs_embeds=hidden, position_ids=ids, use_cache=False)
    counts = counter.get_flop_counts()
    matmul_ops = {"aten.mm", "aten.addmm", "aten.bmm", "aten.matmul"}
    for index, layer in enumerate(layers):
        name = next(k for k in counts if k.endswith(f"layers.{index}"))
        flops = sum(v for op, v in counts[name].items() if str(op).split(".default")[0] in matmul_ops)
        vectors = sum(p.numel() for p in layer.parameters() if p.dim() == 1)
        everything = sum(p.numel() for p in layer.parameters())
        assert active_params(layer, text) - vectors == flops // (2 * rows), index
        assert active_params(layer, text) < everything  # the experts a token does not reach are left out
    block = loaded.resolved.vision_blocks[0]
    assert active_params(block, None) == sum(p.numel() for p in block.parameters())
    planner = RecomputePlanner(loaded.resolved, GIB)
    assert {m.name: m.params for m in planner.modules if not m.vision} == {
        f"layers.{i}": active_params(layer, text) for i, layer in enumerate(layers)
    }
