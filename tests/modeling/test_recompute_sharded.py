"""trainer.memory_budget_gib under FSDP2: two ranks in this process (torch's threaded process group,
`tests.train.threaded_ranks`), a tiny real MoE VLM sharded as the trainer shards it (`shard_model`).

References: the same ranks' gradients with no planner (recomputation must not change a number), and the planner's
measurement of the same micro-batch on the unsharded model in one process (what a layer keeps does not depend on
where its weights come from). Each rank has its own samples: a text-only first micro-batch, then one with images (the
vision blocks measured at the second), and each rank its own plan (a decoder layer recomputes on one rank only).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from PIL import Image

from tests.train.test_packing import setup_family
from tests.train.threaded_ranks import threaded_world
from vlmreg.data import image_part, text_part
from vlmreg.modeling.logprobs import hidden_states
from vlmreg.modeling.recompute import GIB, RecomputePlanner, held_bytes
from vlmreg.resolution import resolve
from vlmreg.train.batching import MicroBatch, make_microbatches
from vlmreg.train.distributed import Distributed, full_tensor, shard_model
from vlmreg.train.samples import TrainingSample
from vlmreg.train.step import LossSettings, policy_update

OBJECTIVE = LossSettings("grpo", 0.2, 0.28, True, 2.0, 0.0, 1.0)
FAMILY = "qwen3_vl_moe"


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, list[list[MicroBatch]], int, int]:
    """The model (vision tower trained, fp32) and each rank's two micro-batches: text only, then with images."""
    loaded, encoder, _ = setup_family(FAMILY)
    for p in loaded.model.parameters():
        p.requires_grad_(True)
    store = encoder.store
    generator = torch.Generator().manual_seed(3)

    def sample(content: Any, completion: int, k: int) -> TrainingSample:
        prompt = encoder.encode([{"role": "user", "content": content}])
        ids = prompt.input_ids + torch.randint(10, 1000, (completion,), generator=generator).tolist()
        mask = [False] * len(prompt.input_ids) + [True] * completion
        return TrainingSample(
            ids, mask, [-1.0] * len(ids), prompt.image_ids, prompt.image_spans, (-1.0) ** k, k, f"s{k}"
        )

    red, blue = (store.add(Image.new("RGB", size, colour)) for size, colour in (((64, 64), "red"), ((96, 64), "blue")))
    per_rank = [
        [sample("only text, rank zero", 9, 0), sample([image_part(red), text_part("Colour?")], 7, 1)],
        [
            sample("a longer text-only prompt on rank one", 5, 2),
            sample([image_part(red), image_part(blue), text_part("Two?")], 11, 3),
        ],
    ]
    loss_tokens = sum(s.loss_tokens for samples in per_rank for s in samples)
    batches = [
        [
            make_microbatches([s], loaded.resolved, encoder, budget=4096, packed=True, device=loaded.device)[0]
            for s in mine
        ]
        for mine in per_rank
    ]
    assert all("pixel_values" not in mbs[0].inputs and "pixel_values" in mbs[1].inputs for mbs in batches)
    return loaded, batches, loss_tokens, sum(len(samples) for samples in per_rank)


def sharded_copy(loaded: Any, ctx: Distributed, prefetch: int = 0) -> Any:
    model = copy.deepcopy(loaded.model)
    resolved = resolve(model, family=loaded.resolved.descriptor)
    shard_model(resolved, ctx, prefetch)
    return resolved


def update(resolved: Any, mbs: list[MicroBatch], tokens: int, samples: int, planner: RecomputePlanner | None) -> None:
    resolved.model.zero_grad(set_to_none=True)
    policy_update(resolved, mbs, OBJECTIVE, num_samples=samples, total_tokens=tokens, loss_scale=2.0, recompute=planner)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient whole (a collective per parameter, in the same order on every rank)."""
    return {n: full_tensor(p.grad) if p.grad is not None else torch.zeros(p.shape) for n, p in model.named_parameters()}


def freed(planner: RecomputePlanner, mb: MicroBatch, name: str) -> float:
    m = next(m for m in planner.modules if m.name == name)
    units = mb.inputs["pixel_values"].numel() if m.vision else mb.inputs["input_ids"].numel()
    return m.freed_per_row * m.rows_per_unit * units


def record_collectives(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[tuple]]:
    """Each rank's FSDP2 all-gathers and reduce-scatters, in order, with their tensors' sizes."""
    names = [n for n in ("all_gather_single", "reduce_scatter_single") if hasattr(dist, n)] or [
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
    ]
    log: dict[int, list[tuple]] = {0: [], 1: []}

    def recorded(name: str) -> Any:
        inner = getattr(dist, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            sizes = tuple(t.numel() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
            log[dist.get_rank()].append((name, sizes))
            return inner(*args, **kwargs)

        return wrapped

    for name in names:
        monkeypatch.setattr(dist, name, recorded(name))
    return log


def test_each_rank_plans_its_own_and_the_gradients_are_those_without_recomputation(tiny, monkeypatch):
    """Recomputation runs inside the layer's backward, where FSDP2 holds its weights gathered: the ranks' collectives
    are those of the update without recomputation, whatever each rank recomputes."""
    loaded, batches, tokens, samples = tiny
    collectives = record_collectives(monkeypatch)

    def rank(ctx: Distributed, mesh: Any) -> dict[str, Any]:
        mbs = batches[ctx.rank]
        log = collectives[ctx.rank]
        reference = sharded_copy(loaded, ctx)
        start = len(log)
        update(reference, mbs, tokens, samples, None)
        plain_collectives = log[start:]
        expected = grads(reference.model)

        resolved = sharded_copy(loaded, ctx)
        planner = RecomputePlanner(resolved, 1000 * GIB, log=lambda message: None)
        planner.allocated = lambda: 0  # a GPU's second pass (each module class run again) runs too, on the CPU
        planner.margin = 0
        calls = {m.name: 0 for m in planner.modules}
        for m in planner.modules:
            m.module.register_forward_pre_hook(lambda *_, name=m.name: calls.__setitem__(name, calls[name] + 1))
        update(resolved, mbs, tokens, samples, planner)  # measures (text, then vision at the second); keeps all
        measured = dict(calls)
        need = planner.history[-1]["predicted_peak_bytes"]
        blocks = [m.name for m in planner.modules if m.vision]
        # rank 0: both vision blocks and one decoder layer recompute; rank 1: one vision block, no layer
        cut = (
            sum(freed(planner, mbs[1], b) for b in blocks) + freed(planner, mbs[1], "layers.0") / 2
            if ctx.rank == 0
            else freed(planner, mbs[1], blocks[0]) / 2
        )
        planner.budget = int(need - cut)
        start = len(log)
        update(resolved, mbs, tokens, samples, planner)
        recomputing_collectives = log[start:]
        got = grads(resolved.model)
        return {
            "plan": {k: planner.last[k] for k in ("recomputed_layers", "recomputed_vision_blocks")},
            "switched": sorted(m.name for m in planner.switchable if m.module.gradient_checkpointing),
            "measured_calls": measured,
            "collectives": (plain_collectives, recomputing_collectives),
            "errors": {n: float((got[n] - g).abs().max()) for n, g in expected.items()},
            "scale": max(float(g.abs().max()) for g in expected.values()),
        }

    with threaded_world() as run:
        results = run(rank)
    assert results[0]["plan"] == {"recomputed_layers": 1, "recomputed_vision_blocks": 2}, results[0]
    assert results[1]["plan"] == {"recomputed_layers": 0, "recomputed_vision_blocks": 1}, results[1]
    plain = results[0]["collectives"][0]
    print("collectives of an update on each rank:", {n: sum(1 for m, _ in plain if m == n) for n, _ in plain})
    assert len(plain) > 20 and {name for name, _ in plain} == {name for name, _ in collectives[0]}, plain[:4]
    assert all(r["collectives"] == (plain, plain) for r in results)
    for r in results:
        # the eager measuring forward at the first micro-batch and again at the first with pixels, each followed (the
        # GPU's pass) by the first module of each class that ran three more times (unmeasured, keeping, recomputing);
        # then each micro-batch's forward. Every rank the same: the same all-gathers in the same order.
        first_layer, first_block = r["measured_calls"]["layers.0"], r["measured_calls"]["vision_blocks.0"]
        assert (first_layer, first_block) == (2 * (1 + 3) + 2, 1 + 3 + 1), r["measured_calls"]
        assert r["measured_calls"]["layers.1"] == 2 + 2 and r["measured_calls"]["vision_blocks.1"] == 1 + 1
        worst = max(r["errors"].values())
        print(f"largest gradient {r['scale']:.3e}, largest difference {worst:.3e}")
        assert r["scale"] > 1e-5 and worst <= 1e-6 * r["scale"], r["errors"]


def test_what_a_sharded_layer_keeps_is_measured_as_in_one_process(tiny):
    """Under FSDP2 a layer's weights are gathered tensors while it runs, saved by its linear layers for backward: they
    are not its activations. The measurement on the sharded model equals the one-process measurement of the same
    micro-batch on the whole model."""
    loaded, batches, _, _ = tiny

    def measure(resolved: Any, mb: MicroBatch) -> dict[str, tuple[float, float]]:
        planner = RecomputePlanner(resolved, 1000 * GIB, log=lambda message: None)
        planner.measure(lambda: hidden_states(resolved, mb.inputs), mb.inputs)
        # and what the root keeps outside them (the embeddings, the final norm), per token
        return {m.name: (m.saved_per_row, m.input_per_row) for m in planner.modules} | {
            "rest": (planner.rest_per_token, 0.0)
        }

    def rank(ctx: Distributed, mesh: Any) -> tuple[dict, dict]:
        mb = batches[ctx.rank][1]
        whole = copy.deepcopy(loaded.model)
        one_process = measure(resolve(whole, family=loaded.resolved.descriptor), mb)
        return measure(sharded_copy(loaded, ctx), mb), one_process

    with threaded_world() as run:
        results = run(rank)
    for sharded, one_process in results:
        assert sharded.keys() == one_process.keys() and all(v[0] > 0 for v in one_process.values())
        for name, (saved, given) in one_process.items():
            assert sharded[name][0] == pytest.approx(saved, rel=1e-6), (name, sharded[name], saved)
            assert sharded[name][1] == pytest.approx(given, rel=1e-6), name


def test_held_bytes_counts_this_ranks_shards():
    """On a CPU the planner's held bytes are the rank's own: each sharded weight's local part (about half of it with
    two ranks), not its global size."""
    loaded, _, _ = setup_family("qwen3_vl")
    whole = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    whole += sum(b.numel() * b.element_size() for b in loaded.model.buffers())

    def rank(ctx: Distributed, mesh: Any) -> int:
        return held_bytes(sharded_copy(loaded, ctx).model, None)

    with threaded_world() as run:
        held = run(rank)
    assert held_bytes(loaded.model, None) == whole
    assert all(0.4 * whole < h < 0.6 * whole for h in held) and sum(held) == pytest.approx(whole, rel=0.02), (
        held,
        whole,
    )


def test_the_reserve_holds_what_fsdp_gathers_at_the_whole_sizes(tiny):
    """The reserve of a sharded plan, against the whole model's own tensors: the root's weights and gradients, the
    largest layer's weights for itself and the layers gathered ahead (one without explicit prefetching, ``prefetch``
    with it), its gradients twice. One process holds whole weights already: no reserve."""
    loaded, _, _, _ = tiny
    resolved = loaded.resolved
    modules = [*resolved.layers, *resolved.vision_blocks]
    inner = {id(p) for m in modules for p in m.parameters()}
    root = sum(p.numel() * p.element_size() for p in loaded.model.parameters() if id(p) not in inner)
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in modules)
    assert all(p.requires_grad for p in loaded.model.parameters())  # the fixture trains everything
    assert RecomputePlanner(resolved, GIB, log=lambda message: None).sharded_reserve == 0

    def rank(ctx: Distributed, mesh: Any) -> list[int]:
        return [
            RecomputePlanner(
                sharded_copy(loaded, ctx, prefetch), GIB, prefetch=prefetch, log=lambda message: None
            ).sharded_reserve
            for prefetch in (0, 1, 3)
        ]

    with threaded_world() as run:
        results = run(rank)
    expected = [2 * root + (1 + ahead) * largest + 2 * largest for ahead in (1, 1, 3)]
    assert results == [expected, expected], (results, expected)
