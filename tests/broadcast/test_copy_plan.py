"""CopyPlan: a loader recorded as its copies and replayed, checked against the loader itself on fresh values."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from vlmreg.broadcast.copy_plan import CopyPlan, GroupedCopies, PlannedLoads, PlanRefused, PushedPlan
from vlmreg.inference.vllm_worker import COPY_PLAN_ENV, WeightIntake

HIDDEN, HEADS_Q, HEADS_KV, HEAD, INTER, VOCAB = 12, 4, 2, 3, 20, 30


def _copy_keyword() -> str:
    """The name ``Tensor.copy_`` gives its source argument in this torch (``src`` in some versions, ``other`` in
    others)."""
    try:
        torch.zeros(1).copy_(src=torch.ones(1))
    except TypeError:
        return "other"
    return "src"


COPY_KEYWORD = _copy_keyword()


class FusedModel(nn.Module):
    """An engine-style model: q/k/v fused into one matrix, gate/up into another, each checkpoint tensor put into its
    shard by a per-name loader (narrowed views and copy_, as vLLM's weight loaders do); ``rank``/``world`` shard the
    fused matrices' rows as tensor parallelism does."""

    def __init__(self, rank: int = 0, world: int = 1, mode: str = "copy") -> None:
        super().__init__()
        self.rank, self.world, self.mode = rank, world, mode
        q, kv = HEADS_Q * HEAD, HEADS_KV * HEAD
        self.sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": INTER, "up_proj": INTER}
        self.qkv = nn.Parameter(torch.zeros((q + 2 * kv) // world, HIDDEN))
        self.gate_up = nn.Parameter(torch.zeros(2 * INTER // world, HIDDEN))
        self.down = nn.Parameter(torch.zeros(HIDDEN, INTER // world))
        self.norm = nn.Parameter(torch.zeros(HIDDEN))
        self.embed = nn.Parameter(torch.ones(VOCAB + 2, HIDDEN))  # padded rows, zeroed by the loader
        self.register_buffer("inv_freq", torch.arange(4.0))

    def load_weights(self, weights):
        fused = {
            "q_proj": ("qkv", 0),
            "k_proj": ("qkv", 1),
            "v_proj": ("qkv", 2),
            "gate_proj": ("gate_up", 0),
            "up_proj": ("gate_up", 1),
        }
        order = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
        for name, w in weights:
            short = name.rsplit(".", 2)[-2]
            if short in fused:
                target, index = fused[short]
                param = getattr(self, target)
                shard = self.sizes[short] // self.world
                offset = sum(self.sizes[n] // self.world for n in order[target][:index])
                w = w.narrow(0, self.rank * shard, shard)
                if self.mode == "cast":
                    w = w.to(torch.float64)
                if self.mode == "skip" and short == "v_proj":
                    continue
                param.data.narrow(0, offset, shard).copy_(w)
            elif short == "embed_tokens":
                self.embed[: w.shape[0]].data.copy_(w)
                if self.mode == "zero":
                    self.embed[w.shape[0] :].data.zero_()
                else:
                    self.embed[w.shape[0] :].data.fill_(0)
                self.embed[self.embed.shape[0] :].data.fill_(0)  # an empty region, as when nothing is padded
            elif short == "down_proj":
                part = INTER // self.world
                if self.mode == "keyword":
                    self.down.data.copy_(**{COPY_KEYWORD: w.narrow(1, self.rank * part, part)})
                else:
                    self.down.data.copy_(w.narrow(1, self.rank * part, part))
            elif short == "norm":
                if self.mode == "replace":
                    self.norm.data = w.clone()
                else:
                    self.norm.data.copy_(w)
                if self.mode == "aten":  # an op below torch's Python API, which no TorchFunctionMode sees
                    torch.ops.aten.mul_.Scalar(self.inv_freq, 2.0)
                if self.mode == "scale":
                    self.norm.data.mul_(2.0)
                if self.mode == "iadd":
                    self.norm.data += 1.0


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proj": (HEADS_Q * HEAD, HIDDEN),
        "k_proj": (HEADS_KV * HEAD, HIDDEN),
        "v_proj": (HEADS_KV * HEAD, HIDDEN),
        "gate_proj": (INTER, HIDDEN),
        "up_proj": (INTER, HIDDEN),
        "down_proj": (HIDDEN, INTER),
        "norm": (HIDDEN,),
        "embed_tokens": (VOCAB, HIDDEN),
    }
    return [(f"layers.0.{n}.weight", torch.randn(shape, generator=g)) for n, shape in shapes.items()]


def refill(pairs, seed: int) -> None:
    """New values in the same memory, as the trainer's parameters after an optimizer step."""
    for (_, t), (_, new) in zip(pairs, checkpoint(seed), strict=True):
        t.copy_(new)


def reference(pairs, **options) -> dict[str, torch.Tensor]:
    model = FusedModel(**options)
    model.load_weights([(n, t.clone()) for n, t in pairs])
    return model.state_dict()


@pytest.mark.parametrize("rank,world,mode", [(0, 1, "copy"), (1, 2, "copy"), (0, 1, "zero"), (0, 1, "keyword")])
def test_later_syncs_replay_the_loader_s_copies_exactly(rank, world, mode):
    """Also with padding rows zeroed by ``zero_`` and a ``copy_(src=...)`` by keyword: both are recorded, not
    refused."""
    model, loads, pairs = FusedModel(rank, world, mode), PlannedLoads(), checkpoint(0)
    steps = []
    for step in range(5):
        refill(pairs, step)
        steps.append(loads.load(model, model.load_weights, pairs))
        expected = reference(pairs, rank=rank, world=world, mode=mode)
        for name, value in model.state_dict().items():
            assert torch.equal(value, expected[name]), (step, name)
    assert steps == ["loaded", "recorded", "replayed", "replayed", "replayed"]
    plan = next(iter(loads.plans.values()))
    assert len(plan.copies) == 8 and len(plan.groups) == 1 and len(plan.fills) == 1


def test_new_memory_is_loaded_again_not_replayed():
    model, loads, pairs = FusedModel(), PlannedLoads(), checkpoint(0)
    for _ in range(3):
        loads.load(model, model.load_weights, pairs)
    moved = [(n, t.clone()) for n, t in checkpoint(7)]
    assert loads.load(model, model.load_weights, moved) == "loaded"
    assert all(torch.equal(v, reference(moved)[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "mode,reason",
    [
        ("cast", "copied from a tensor the loader computed"),
        ("scale", "changed in place by mul_"),
        ("skip", "never copied"),
        ("replace", r"^the loader replaced parameters \(their memory moved\), so recorded views would be stale$"),
        ("aten", "inv_freq changed with no recorded copy"),
        ("iadd", "norm: changed in place by"),  # += reaches the mode as add_ (or __iadd__)
    ],
)
def test_a_loader_a_replay_would_get_wrong_is_refused_and_keeps_loading(mode, reason):
    model, loads, pairs = FusedModel(mode=mode), PlannedLoads(), checkpoint(0)
    alone = FusedModel(mode=mode)
    with pytest.raises(PlanRefused, match=reason):
        CopyPlan.record(alone, alone.load_weights, pairs)
    for step in range(4):
        refill(pairs, step)
        assert loads.load(model, model.load_weights, pairs) == "loaded"
        expected = reference(pairs, mode=mode)
        assert all(torch.equal(v, expected[k]) for k, v in model.named_parameters())
    assert re.search(reason, next(iter(loads.refused.values())))


def test_tensors_that_move_every_sync_are_loaded_and_not_remembered_for_ever():
    model, loads, alive = FusedModel(), PlannedLoads(), []
    for step in range(3 * PlannedLoads.REMEMBERED):
        pairs = [(n, t.clone()) for n, t in checkpoint(step)]  # fresh memory each time, as merged LoRA weights are
        alive.append(pairs)  # kept, so no allocation is reused at the same address
        assert loads.load(model, model.load_weights, pairs) == "loaded"
        assert all(torch.equal(v, reference(pairs)[k]) for k, v in model.state_dict().items())
    assert len(loads.seen) == PlannedLoads.REMEMBERED and not loads.plans


def test_parameters_that_move_between_syncs_stop_the_plan():
    model, loads, pairs = FusedModel(), PlannedLoads(), checkpoint(0)
    for _ in range(2):
        loads.load(model, model.load_weights, pairs)
    model.qkv.data = model.qkv.data.clone()  # an engine that re-creates its weights before each load
    refill(pairs, 3)
    assert loads.load(model, model.load_weights, pairs) == "loaded"
    assert "moved" in next(iter(loads.refused.values()))
    assert all(torch.equal(v, reference(pairs)[k]) for k, v in model.state_dict().items())


class _SameMemory:
    """A worker receiver whose tensors stay where they are between syncs (as CUDA IPC views of the trainer's do)."""

    def __init__(self, pairs):
        self.pairs = pairs

    def receive(self, *, step, timeout_s=None, **fields):
        return list(self.pairs)

    def close(self):
        pass


def test_a_vllm_worker_s_intake_replays_its_model_s_loader(monkeypatch, capfd):
    pairs = checkpoint(0)
    model = FusedModel(1, 2)
    intake = WeightIntake(0, None, model)
    intake._receiver, intake.transport = _SameMemory(pairs), "test"
    for step in range(4):
        refill(pairs, step)
        assert intake.receive({"step": step}, model.load_weights) == len(pairs)
        assert all(torch.equal(v, reference(pairs, rank=1, world=2)[k]) for k, v in model.state_dict().items())
    assert intake.loads.last == "replayed"
    err = capfd.readouterr().err
    assert "weight sync recorded: 8 copies" in err and "weight sync replayed" in err
    monkeypatch.setenv(COPY_PLAN_ENV, "0")
    plain = WeightIntake(0, None, FusedModel())
    plain._receiver, plain.transport = _SameMemory(pairs), "test"
    for step in range(3):
        plain.receive({"step": step}, plain.model.load_weights)
    assert plain.loads is None


# -- pushed plans: the sender replays the engine's plan into the engine's memory ------------------------------------


class _Shared:
    """Stands in for CUDA IPC within one process: `share` hands out an id per allocation, `open` maps it back."""

    def __init__(self):
        self.tensors = []

    def share(self, whole):
        self.tensors.append(whole)
        return {"id": len(self.tensors) - 1}

    def open(self, entry):
        return self.tensors[entry["id"]]


def _recorded(model, pairs):
    loads = PlannedLoads()
    for step in range(2):
        refill(pairs, step)
        loads.load(model, model.load_weights, pairs)
    return next(iter(loads.plans.values()))


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_a_pushed_plan_writes_what_the_engine_s_loader_would(rank, world):
    model, pairs, shared = FusedModel(rank, world), checkpoint(0), _Shared()
    plan = _recorded(model, pairs)
    exported = json.loads(json.dumps(plan.export(pairs, shared.share)))  # what crosses the process boundary is JSON
    # the sender's own tensors: the same memory the engine read (here the very tensors; by CUDA IPC, the allocations)
    pushed = PushedPlan(exported, [t for _, t in pairs], shared.open, layout="sync-1")
    assert pushed.bytes == plan.bytes and len(pushed.copies) == len(plan.copies) and pushed.layout == "sync-1"
    assert pushed.chunked is None and sum(len(d) for d, _ in pushed.groups) == 8  # the chunked kernel is for GPUs
    for step in range(2, 5):
        refill(pairs, step)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(-7.0)  # whatever the engine holds is overwritten
        pushed.replay()
        expected = reference(pairs, rank=rank, world=world)
        for name, value in model.state_dict().items():
            assert torch.equal(value, expected[name]), (step, name)


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda e: e["copies"][0]["dst"].__setitem__(1, 10**9), "past its allocation"),
        (lambda e: e["copies"][0]["src"].__setitem__(0, 99), "names no sent tensor"),
        (lambda e: e["copies"][1]["dst"].__setitem__(0, 99), "names no shared allocation"),
        (lambda e: e["copies"][0]["src"].__setitem__(4, "complex_thing"), "unknown dtype"),
        (lambda e: e["copies"][0]["dst"].__setitem__(1, 2), "impossible layout"),  # not aligned to the element size
        (lambda e: e["copies"][0]["src"].__setitem__(2, [1, 2, 3]), "impossible layout"),
        (lambda e: e["fills"][0].__setitem__("value", "x"), "no constant value"),
        (lambda e: e.__setitem__("version", 99), "expected version"),
        (lambda e: e["copies"][0].__setitem__("dst", None), "copy 0's destination names no shared allocation"),
        (
            lambda e: e["copies"][0]["src"].__setitem__(2, [5]) or e["copies"][0]["src"].__setitem__(3, [1]),
            r"copy 0 has shapes \(5,\) -> \(12, 12\)",
        ),
    ],
)
def test_a_pushed_plan_that_would_write_outside_its_memory_is_refused(change, reason):
    model, pairs, shared = FusedModel(), checkpoint(0), _Shared()
    exported = _recorded(model, pairs).export(pairs, shared.share)
    change(exported)
    with pytest.raises(PlanRefused, match=reason):
        PushedPlan(exported, [t for _, t in pairs], shared.open)


def test_a_worker_exports_its_plan_only_once_it_has_one(monkeypatch):
    pairs = checkpoint(0)
    model = FusedModel()
    intake = WeightIntake(0, None, model)
    intake._receiver, intake.transport = _SameMemory(pairs), "test"
    assert intake.export_plan(0) == {"plan": None, "reason": "this worker has taken no sync yet", "final": False}
    intake.receive({"step": 0}, model.load_weights)
    answer = intake.export_plan(0)
    assert answer["plan"] is None and not answer["final"] and "no copy plan recorded" in answer["reason"]
    assert "not step 3" in intake.export_plan(3)["reason"]
    intake.receive({"step": 1}, model.load_weights)  # recorded
    answer = intake.export_plan(1)
    assert answer["plan"] is None and answer["final"] and "not on a GPU" in answer["reason"]  # IPC handles need CUDA


# -- what the fused model above does not reach: bf16, scalar and empty tensors, integer buffers, silent changes -------


class SmallModel(nn.Module):
    """A model of the tensors the fused one lacks: a scalar parameter (a logit scale, 0-dim), a one-value gain, a bf16
    weight (an empty incoming tensor is copied into an empty slice of it, first), a bf16 bias the loader never copies
    into, an integer buffer and a float one after it. ``change`` is what the loader does beneath torch's Python API
    (``aten`` ops, which no `TorchFunctionMode` sees); the bias's changes each show in one of the three checksums
    only, and there only when it is accumulated in float32 (a bf16 sum rounds each away)."""

    def __init__(self, change: str = "") -> None:
        super().__init__()
        self.change = change
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.gain = nn.Parameter(torch.ones(1))  # one value, never loaded
        self.weight = nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16))
        bias = torch.ones(2093, dtype=torch.bfloat16)
        bias[1] = 2.0
        self.bias = nn.Parameter(bias)
        self.register_buffer("positions", torch.arange(8))
        self.register_buffer("inv_freq", torch.arange(4.0))

    def load_weights(self, weights):
        for name, w in weights:
            target = self.weight.data[: w.shape[0]] if name == "empty" else getattr(self, name).data
            target.copy_(w)
        bias = self.bias.data
        if self.change == "gain":
            torch.ops.aten.mul_.Scalar(self.gain.data, 2.0)
        elif self.change == "inv_freq":
            torch.ops.aten.mul_.Scalar(self.inv_freq, 2.0)
        elif self.change == "negate":  # the sum: 2094 -> 2092 (2096 both, in bf16)
            torch.ops.aten.mul_.Scalar(bias[3:4], -1.0)
        elif self.change == "rebalance":  # the norm: values 1, 1 -> 2, 0 (45.75 both, in bf16)
            torch.ops.aten.add_.Scalar(bias[2:3], 1.0)
            torch.ops.aten.sub_.Scalar(bias[3:4], 1.0)
        elif (
            self.change == "swap"
        ):  # every 7th value's sum: the 2 moves from bias[1] to bias[7] (299 -> 300; 300 in bf16)
            torch.ops.aten.sub_.Scalar(bias[1:2], 1.0)
            torch.ops.aten.add_.Scalar(bias[7:8], 1.0)


def small_checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("empty", torch.zeros(0, 4, dtype=torch.bfloat16)),
        ("scale", torch.rand((), generator=g) + 0.5),
        ("weight", torch.randn(6, 4, generator=g).to(torch.bfloat16)),
    ]


def small_refill(pairs, seed: int) -> None:
    for (_, t), (_, new) in zip(pairs, small_checkpoint(seed), strict=True):
        t.copy_(new)


def small_reference(pairs) -> dict[str, torch.Tensor]:
    model = SmallModel()
    model.load_weights([(n, t.clone()) for n, t in pairs])
    return model.state_dict()


@pytest.mark.parametrize(
    "change,name",
    [
        ("gain", "parameter gain"),  # a one-value tensor
        ("inv_freq", "buffer inv_freq"),  # after an integer buffer, which has no checksum
        ("negate", "parameter bias"),
        ("rebalance", "parameter bias"),
        ("swap", "parameter bias"),
    ],
)
def test_a_tensor_changed_beneath_the_recorder_is_refused_naming_it(change, name):
    model = SmallModel(change)
    with pytest.raises(PlanRefused, match=f"^{name} changed with no recorded copy into it$"):
        CopyPlan.record(model, model.load_weights, small_checkpoint(0))
    assert model.state_dict()["positions"].tolist() == list(range(8))  # the loader did run: the plan alone is refused


def test_a_plan_of_bf16_scalar_and_empty_tensors_replays_and_pushes_what_the_loader_writes():
    model, pairs, shared = SmallModel(), small_checkpoint(0), _Shared()
    loads = PlannedLoads()
    for step in range(2):
        small_refill(pairs, step)
        loads.load(model, model.load_weights, pairs)
    assert loads.last == "recorded"
    plan = next(iter(loads.plans.values()))
    pushed = PushedPlan(json.loads(json.dumps(plan.export(pairs, shared.share))), [t for _, t in pairs], shared.open)
    assert len(pushed.copies) == 2  # the scale and the weight; the empty copy moves nothing
    for step in range(2, 6):
        small_refill(pairs, step)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(-7.0)
        if step % 2:
            assert loads.load(model, model.load_weights, pairs) == "replayed"
        else:
            pushed.replay()
        expected = small_reference(pairs)
        for key in ("scale", "weight"):
            assert torch.equal(model.state_dict()[key], expected[key]), (step, key)


def test_each_shared_allocation_is_handed_over_whole():
    """``share`` gets a uint8 tensor over each destination's whole allocation (CUDA IPC shares allocations)."""
    model, pairs, shared = FusedModel(), checkpoint(0), _Shared()
    _recorded(model, pairs).export(pairs, shared.share)
    written = [model.qkv, model.gate_up, model.down, model.norm, model.embed]
    assert sorted(t.numel() for t in shared.tensors) == sorted(p.untyped_storage().nbytes() for p in written)
    assert all(t.dtype == torch.uint8 and t.is_contiguous() for t in shared.tensors)


def test_a_pushed_view_that_ends_past_its_allocation_is_refused_with_its_end():
    model, pairs, shared = FusedModel(), checkpoint(0), _Shared()
    exported = _recorded(model, pairs).export(pairs, shared.share)
    copy = next(c for c in exported["copies"] if c["dst"][2] == [HIDDEN])  # the norm: 12 float32 values
    size = shared.tensors[copy["dst"][0]].numel()
    copy["dst"][1:4] = [size - 8, [1, HIDDEN], [HIDDEN, 1]]  # starts inside, 40 bytes short of fitting
    message = f"pushed plan: copy {exported['copies'].index(copy)}'s destination ends at byte {size + 40}, "
    with pytest.raises(PlanRefused, match=f"^{re.escape(message)}past its allocation \\({size} bytes\\)$"):
        PushedPlan(exported, [t for _, t in pairs], shared.open)


def test_a_plan_exported_for_other_tensors_than_it_read_is_refused():
    model, pairs, shared = FusedModel(), checkpoint(0), _Shared()
    plan = _recorded(model, pairs)
    others = [(n, t.clone()) for n, t in pairs]
    with pytest.raises(PlanRefused, match="^a recorded copy reads memory that is not among the incoming tensors$"):
        plan.export(others, shared.share)


def test_an_incoming_tensor_that_is_one_of_the_model_s_weights_is_refused():
    model = FusedModel()
    pairs = [*checkpoint(0), ("layers.0.norm.weight", model.norm.data)]
    with pytest.raises(PlanRefused, match="^an incoming tensor shares memory with the model's own weights$"):
        CopyPlan.record(model, model.load_weights, pairs)


def test_grouped_copies_make_every_copy_again_from_the_sources_as_they_are():
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(4, generator=g), torch.randn(3, generator=g).to(torch.bfloat16), torch.randn(2, 2)]
    destinations = [torch.zeros(4), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(5, 2)[1:3]]
    grouped = GroupedCopies(list(zip(destinations, sources, strict=True)))
    for round_ in range(2):
        for s in sources:
            s.add_(1.0)
        grouped.run()
        assert all(torch.equal(d, s) for d, s in zip(destinations, sources, strict=True)), round_


class RowsModel(nn.Module):
    """Eight rows, the first six loaded from the incoming tensor; ``mode`` says what the loader does with the last two
    (padding rows): a constant by keyword, a fill from a tensor, an assignment from the incoming tensor, or the six
    rows copied by ``torch._foreach_copy_`` (a list first argument) instead of ``copy_``."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.weight = nn.Parameter(torch.zeros(8, 4))

    def load_weights(self, weights):
        ((_, w),) = weights
        rows = self.weight.data
        if self.mode == "foreach":
            torch._foreach_copy_([rows[:6]], [w])
            return
        rows[:6].copy_(w)
        if self.mode == "fill":
            rows[6:].fill_(value=-1.5)
        elif self.mode == "fill_tensor":
            rows[6:].fill_(torch.tensor(-1.5))
        elif self.mode == "setitem":
            rows[6:] = w[:2]


def test_a_constant_fill_by_keyword_is_recorded_and_replayed_with_its_value():
    model, loads = RowsModel("fill"), PlannedLoads()
    pairs = [("weight", torch.randn(6, 4))]
    for step in range(3):
        pairs[0][1].copy_(torch.full((6, 4), float(step)))
        with torch.no_grad():
            model.weight.fill_(7.0)
        loads.load(model, model.load_weights, pairs)
        assert torch.equal(model.weight[:6], pairs[0][1]) and torch.equal(model.weight[6:], torch.full((2, 4), -1.5))
    assert loads.last == "replayed"


@pytest.mark.parametrize(
    "mode,reason",
    [
        ("fill_tensor", "weight: filled from a tensor, which a replay could not repeat"),
        ("setitem", "weight: changed in place by __setitem__, which a replay of copies would miss"),
        ("foreach", "1 incoming tensor(s) were never copied by a recorded copy_ (first: weight)"),  # no copy_ seen
    ],
)
def test_a_loader_writing_other_than_by_copy_or_constant_is_refused_naming_how(mode, reason):
    model = RowsModel(mode)
    pairs = [("weight", torch.randn(6, 4))]
    with pytest.raises(PlanRefused, match=f"^{re.escape(reason)}$"):
        CopyPlan.record(model, model.load_weights, pairs)
    assert torch.equal(model.weight[:6], pairs[0][1])  # loaded all the same


def test_the_newest_layouts_are_remembered_the_oldest_forgotten():
    model, loads = FusedModel(), PlannedLoads()
    layouts = [[(n, t.clone()) for n, t in checkpoint(k)] for k in range(PlannedLoads.REMEMBERED + 1)]
    for pairs in layouts:
        assert loads.load(model, model.load_weights, pairs) == "loaded"
    assert loads.load(model, model.load_weights, layouts[-1]) == "recorded"  # seen: the second sync records
    assert loads.load(model, model.load_weights, layouts[0]) == "loaded"  # forgotten: a first sync again


def test_plan_for_is_the_plan_load_would_replay():
    model, loads, pairs = FusedModel(), PlannedLoads(), checkpoint(0)
    loads.load(model, model.load_weights, pairs)
    assert loads.plan_for(model, pairs) is None  # it would record
    loads.load(model, model.load_weights, pairs)
    plan = loads.plan_for(model, pairs)
    assert plan is not None and plan is next(iter(loads.plans.values()))
    assert loads.plan_for(model, [(n, t.clone()) for n, t in pairs]) is None  # other memory
    model.qkv.data = model.qkv.data.clone()
    assert loads.plan_for(model, pairs) is None  # the parameters moved
    assert loads.load(model, model.load_weights, pairs) == "loaded"
    assert loads.refused[next(iter(loads.refused))] == "the model's parameters moved between syncs"


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda e, n: e["copies"][0].__setitem__("dst", 5), "copy 0's destination names no shared allocation"),
        (lambda e, n: e["copies"][0]["src"].__setitem__(0, n), "copy 0's source names no sent tensor"),
        (lambda e, n: e["fills"][0]["dst"].__setitem__(0, -1), "fill 0's destination names no shared allocation"),
    ],
)
def test_a_pushed_plan_names_the_entry_at_fault(change, message):
    model, pairs, shared = FusedModel(), checkpoint(0), _Shared()
    exported = _recorded(model, pairs).export(pairs, shared.share)
    change(exported, len(pairs))  # n: one past the last sent tensor
    with pytest.raises(PlanRefused, match=f"^pushed plan: {re.escape(message)}$"):
        PushedPlan(exported, [t for _, t in pairs], shared.open)


def test_an_export_with_no_copies_or_fills_is_an_empty_plan():
    pushed = PushedPlan({"version": 1}, [], _Shared().open)
    assert pushed.copies == [] and pushed.fills == [] and pushed.bytes == 0
    pushed.replay()
