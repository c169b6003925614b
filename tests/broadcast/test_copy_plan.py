"""CopyPlan: a loader recorded as its copies and replayed, checked against the loader itself on fresh values."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from vlmreg.broadcast.copy_plan import CopyPlan, PlannedLoads, PlanRefused, PushedPlan
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
        ("replace", "replaced parameters"),
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
    assert reason in next(iter(loads.refused.values()))


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
