"""The live adapter in a vLLM worker (CPU, no vLLM): each sync's factors reach vLLM's GPU slots in place.

vLLM 0.24's LoRA classes are stood in for by what `vlmreg.inference.vllm_lora_live` touches of them, each written
after vLLM's own (vllm/lora/lora_model.py, lora_weights.py, model_manager.py, layers/base_linear.py,
column_parallel_linear.py): ``from_lora_tensors`` (names mapped, tensors kept as given when device and dtype agree),
packing of q/k/v and gate/up with ``lora_B`` scaled in place, ``activate_adapter`` into the first free slot, and each
wrapped layer's stacked tensors with ``reset_lora`` / ``set_lora``. The reference for what a slot must hold is peft's
own delta of each adapted module (``get_delta_weight``) on the trainer's model, at the synced step.
"""

from __future__ import annotations

import pytest
import torch

import vlmreg
from vlmreg.broadcast.plan import WeightPlan, lora_modules
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.inference import vllm_lora
from vlmreg.inference.cache_scope import CacheScope
from vlmreg.inference.vllm_adapters import VllmAdapters
from vlmreg.inference.vllm_lora_live import LiveAdapter
from vlmreg.inference.vllm_worker import WeightIntake

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
MAX_RANK, SLOTS = 8, 2


def _vllm_name(peft_name: str) -> tuple[str, bool]:
    """vLLM's module name of a peft factor (Qwen3-VL's hf_to_vllm_mapper), and whether it is lora_A."""
    name = peft_name.removeprefix("base_model.model.").replace("model.language_model.", "language_model.model.", 1)
    module, factor, _ = name.rsplit(".", 2)
    return module, factor == "lora_A"


class Weights:  # vLLM's LoRALayerWeights / PackedLoRALayerWeights: lists of slices when packed
    def __init__(self, lora_a, lora_b, scaling):
        self.lora_a, self.lora_b, self.scaling = lora_a, lora_b, scaling

    def optimize(self):  # scaling merged into lora_b, in place
        parts = self.lora_b if isinstance(self.lora_b, list) else [self.lora_b]
        scalings = self.scaling if isinstance(self.scaling, list) else [self.scaling]
        for b, s in zip(parts, scalings, strict=True):
            if s != 1:
                b *= s
        self.scaling = [1] * len(parts) if isinstance(self.scaling, list) else 1


class LoRAModel:
    def __init__(self, lora_model_id, loras):
        self.id, self.loras = lora_model_id, loras

    @classmethod
    def from_lora_tensors(cls, lora_model_id, tensors, peft_helper, device="cuda", dtype=None, **_):
        loras: dict[str, Weights] = {}
        for name, tensor in tensors.items():
            module, is_a = _vllm_name(name)
            weights = loras.setdefault(module, Weights(None, None, peft_helper.vllm_lora_scaling_factor))
            setattr(weights, "lora_a" if is_a else "lora_b", tensor.to(device=device, dtype=dtype))
        return cls(lora_model_id, loras)

    @classmethod
    def from_local_checkpoint(cls, lora_dir, expected, peft_helper, **kwargs):
        raise AssertionError("nothing is read from the adapter directory")

    def get_lora(self, name):
        return self.loras.get(name)


class Layer:  # a wrapped linear layer: one stacked (A, B) pair per output slice
    def __init__(self, in_features, outs, computed=False):
        self.lora_a_stacked = tuple(torch.zeros(SLOTS, 1, MAX_RANK, in_features) for _ in outs)
        self.lora_b_stacked = tuple(torch.zeros(SLOTS, 1, out, MAX_RANK) for out in outs)
        self.computed = computed  # a layer that copies from a tensor it computed (a replay cannot repeat it)

    def reset_lora(self, index):
        for s in range(len(self.lora_a_stacked)):
            self.lora_a_stacked[s][index] = 0
            self.lora_b_stacked[s][index] = 0

    def set_lora(self, index, lora_a, lora_b):
        self.reset_lora(index)
        lora_a = lora_a if isinstance(lora_a, list) else [lora_a]
        lora_b = lora_b if isinstance(lora_b, list) else [lora_b]
        for s, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
            b = b * 1 if self.computed else b
            self.lora_a_stacked[s][index, 0, : a.shape[0], : a.shape[1]].copy_(a, non_blocking=True)
            self.lora_b_stacked[s][index, 0, : b.shape[0], : b.shape[1]].copy_(b, non_blocking=True)

    def delta(self, index):
        """The weight delta slot ``index`` adds, per slice (punica's shrink then expand)."""
        return [b[index, 0] @ a[index, 0] for a, b in zip(self.lora_a_stacked, self.lora_b_stacked, strict=True)]


class Manager:  # vLLM's LRUCacheLoRAModelManager, as far as the live adapter and activation go
    def __init__(self, modules):
        self.modules = modules
        self.lora_index_to_id: list[int | None] = [None] * SLOTS
        self.registered: dict[int, LoRAModel] = {}

    def get_adapter(self, lora_id):
        return self.registered.get(lora_id)

    def add_adapter(self, lora):
        for fused, parts in PACKED.items():  # _create_merged_loras_inplace: pack, then scale every lora_B in place
            for name in [n for n in lora.loras if n.endswith("." + parts[0])]:
                prefix = name.rsplit(".", 1)[0]
                subs = [lora.loras.pop(f"{prefix}.{p}") for p in parts]
                for sub in subs:
                    sub.optimize()
                lora.loras[f"{prefix}.{fused}"] = Weights(
                    [w.lora_a for w in subs], [w.lora_b for w in subs], [1] * len(subs)
                )
        for weights in lora.loras.values():
            weights.optimize()
        self.registered[lora.id] = lora

    def activate_adapter(self, lora_id):
        index = self.lora_index_to_id.index(None)
        self.lora_index_to_id[index] = lora_id
        for name, module in self.modules.items():
            weights = self.registered[lora_id].get_lora(name)
            if weights is None:
                module.reset_lora(index)
            else:
                module.set_lora(index, weights.lora_a, weights.lora_b)


class Helper:  # vLLM's PEFTHelper: rank, alpha, the scaling vLLM applies
    def __init__(self, r, alpha):
        self.r, self.lora_alpha, self.vllm_lora_scaling_factor = r, alpha, alpha / r


def _config():
    raw = {
        "model": {"init": "random", "family": "qwen3_vl", "lora": {"r": 4, "alpha": 8, "targets": "language"}},
        "rollout": {"engine": "openai", "server": "vllm", "launch": True, "launch_gpu": "same"},
        "broadcast": {"transport": "ipc", "lora_sync": "adapters"},
        "trainer": {"device": "cpu"},
    }
    return resolve_config(parse_config(raw))


def _setup(computed: bool = False):
    loaded = vlmreg.load(_config())
    _, keepable = lora_modules(loaded.resolved)
    plan = WeightPlan.from_resolved(
        loaded.resolved, include_frozen_vision=False, lora_modules=frozenset(keepable), lora_base=False
    )
    peft_layers = {_vllm_name(f"base_model.model.{n}.lora_A.weight")[0]: m.layer for n, m in keepable.items()}
    modules = {}
    for name, layer in peft_layers.items():
        prefix, last = name.rsplit(".", 1)
        fused = next((f for f, parts in PACKED.items() if last in parts), None)
        if fused is None:
            modules[name] = Layer(layer.in_features, [layer.out_features], computed)
        elif last == PACKED[fused][0]:
            outs = [peft_layers[f"{prefix}.{p}"].out_features for p in PACKED[fused]]
            modules[f"{prefix}.{fused}"] = Layer(layer.in_features, outs, computed)
    return loaded, plan, peft_layers, Manager(modules)


def _train(loaded, seed: int) -> None:
    """What an optimizer step does to the adapters (every factor moves)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in loaded.model.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)


def _expected(peft_layers) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {name: layer.get_delta_weight("default").clone() for name, layer in peft_layers.items()}


def _assert_slots_hold(manager, peft_deltas, index) -> None:
    for name, module in manager.modules.items():
        prefix, last = name.rsplit(".", 1)
        parts = PACKED.get(last, [last])
        for part, delta in zip(parts, module.delta(index), strict=True):
            assert torch.allclose(delta, peft_deltas[f"{prefix}.{part}"], atol=1e-6), (name, part)


@pytest.mark.parametrize("computed", [False, True])
def test_each_sync_rewrites_the_adapter_vllm_computes_with(tmp_path, computed):
    loaded, plan, peft_layers, manager = _setup(computed)
    worker = type("WorkerLoRAManager", (), {"_lora_model_cls": LoRAModel})()
    vllm_lora.install(worker)
    model = type("Model", (), {"lora_manager": manager})()
    path = str(tmp_path / "v1")
    _train(loaded, 0)
    # sync 1: staged in a live buffer, loaded once by vLLM (its _load_adapter, add_adapter, activate_adapter)
    assert vllm_lora.take_adapter(path, "live", list(plan.tensors()), model, None) == "28 adapter tensors staged"
    lora = worker._lora_model_cls.from_local_checkpoint(
        path, set(), Helper(4, 8), lora_model_id=7, device="cpu", dtype=torch.float32
    )
    manager.add_adapter(lora)
    manager.activate_adapter(7)
    _assert_slots_hold(manager, _expected(peft_layers), 0)
    hows = []
    for step in (1, 2, 3):
        _train(loaded, step)
        synced = _expected(peft_layers)
        hows.append(vllm_lora.take_adapter(path, "update", list(plan.tensors()), model, None))
        _train(loaded, 100 + step)  # the trainer moves on: the slots keep what was synced
        _assert_slots_hold(manager, synced, 0)
    if computed:  # a copy from a computed tensor cannot be replayed: vLLM's set_lora every sync, still right
        assert hows == ["28 adapter tensors written with set_lora"] * 3
    else:
        assert hows == [
            f"28 adapter tensors recorded ({2 * (3 + 2 + 1 + 1) * 2} copies)",
            "28 adapter tensors replayed (checked against set_lora)",
            "28 adapter tensors replayed",
        ]
    assert manager.get_adapter(7) is lora and len(manager.registered) == 1


def test_an_adapter_in_no_slot_is_refreshed_for_vllm_to_copy_in(tmp_path):
    loaded, plan, peft_layers, manager = _setup()
    worker = type("WorkerLoRAManager", (), {"_lora_model_cls": LoRAModel})()
    vllm_lora.install(worker)
    model = type("Model", (), {"lora_manager": manager})()
    path = str(tmp_path / "v1")
    vllm_lora.take_adapter(path, "live", list(plan.tensors()), model, None)
    lora = worker._lora_model_cls.from_local_checkpoint(
        path, set(), Helper(4, 8), lora_model_id=3, device="cpu", dtype=torch.float32
    )
    manager.add_adapter(lora)  # registered, not yet in a slot (no request has named it)
    _train(loaded, 5)
    how = vllm_lora.take_adapter(path, "update", list(plan.tensors()), model, None)
    assert how.endswith("refreshed (in no GPU slot: vLLM copies it there for its next request)")
    manager.activate_adapter(3)  # vLLM, for the next request: from the live buffer
    _assert_slots_hold(manager, _expected(peft_layers), 0)
    # vLLM evicted it from its adapter cache: the next update registers it again, and reloading it by its directory
    # gives the live adapter, not the directory's files
    del manager.registered[3]
    manager.lora_index_to_id = [None] * SLOTS
    how = vllm_lora.take_adapter(path, "update", list(plan.tensors()), model, None)
    assert how.endswith("re-registered (vLLM had evicted it)") and manager.get_adapter(3) is lora
    assert worker._lora_model_cls.from_local_checkpoint(path, set(), Helper(4, 8), lora_model_id=3) is lora


def test_an_update_without_a_live_adapter_or_with_other_factors_is_an_error(tmp_path):
    loaded, plan, _, manager = _setup()
    model = type("Model", (), {"lora_manager": manager})()
    vllm_lora.LIVE.clear()
    with pytest.raises(RuntimeError, match="no live LoRA adapter was loaded from"):
        vllm_lora.take_adapter(str(tmp_path / "v9"), "update", list(plan.tensors()), model, None)
    live = LiveAdapter(list(plan.tensors()))
    with pytest.raises(ValueError, match="differ from the live adapter's"):
        live._copy(list(plan.tensors())[1:])
    with pytest.raises(ValueError, match="unknown lora_mode"):
        vllm_lora.take_adapter(str(tmp_path / "v9"), "swap", [], model, None)


def test_the_trainer_s_requests_take_a_worker_from_one_load_to_updates_in_place(tmp_path):
    """The trainer's side (`VllmAdapters`: each sync's fields, the load after it) against a worker's `WeightIntake`
    (its receive hands the factors to vLLM's LoRA manager) and vLLM's load path (`/v1/load_lora_adapter`: the
    worker's ``_load_adapter``, ``add_adapter``, ``activate_adapter``): one load, then every sync in place, each
    leaving peft's deltas of that step in the slot; nothing goes through ``load_weights``."""
    loaded, plan, peft_layers, manager = _setup()
    rc = _config()
    adapters = VllmAdapters(rc, loaded.resolved, log=lambda line: None, peft_model=loaded.model, directory=tmp_path)
    assert adapters.choose(lambda names: [(names, True)], "http://x") == frozenset(adapters.keepable)
    worker = type("WorkerLoRAManager", (), {"_lora_model_cls": LoRAModel})()
    vllm_lora.install(worker)  # what vlmreg_lora_modules does
    intake = WeightIntake(0, None, type("Model", (), {"lora_manager": manager})())

    class Receiver:  # the transport's worker end: this sync's tensors as the trainer's plan gives them
        def receive(self, *, step, timeout_s=None, **fields):
            assert "lora_path" not in fields and "lora_mode" not in fields  # the worker keeps those
            return list(plan.tensors())

    intake._receiver, intake.transport = Receiver(), "test"
    posts = []

    def post(path, body):  # vLLM's API server, as far as adapters go
        posts.append(path)
        if path == "/v1/load_lora_adapter":
            lora = worker._lora_model_cls.from_local_checkpoint(
                body["lora_path"], set(), Helper(4, 8), lora_model_id=1, device="cpu", dtype=torch.float32
            )
            manager.add_adapter(lora)
            manager.activate_adapter(1)

    scope = CacheScope()
    for step in range(4):
        _train(loaded, step)
        update = {"step": step, "timeout_s": 30, "fields": adapters.request_fields()}
        assert intake.receive(update, lambda pairs: pytest.fail("factors loaded as weights")) == 28
        adapters.finish(post, scope)
        assert scope.model == "vlmreg-lora"
        _assert_slots_hold(manager, _expected(peft_layers), 0)
    assert posts == ["/v1/load_lora_adapter"] and len(manager.registered) == 1
