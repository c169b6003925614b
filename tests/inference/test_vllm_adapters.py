"""The trainer's side of adapter syncs into vLLM, and the worker's reading of which modules vLLM serves as LoRA (CPU,
no vLLM: vLLM's LoRA manager is stood in for by the three things `served_modules` reads from it, filled with what
vLLM 0.24's Qwen3-VL model declares)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from peft import LoraConfig

import vlmreg
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.inference.cache_scope import CacheScope
from vlmreg.inference.vllm_adapters import VllmAdapters, adapters_wanted, worker_answers
from vlmreg.inference.vllm_lora import served_modules
from vlmreg.inference.vllm_server import vllm_command
from vlmreg.sdk.errors import VlmregError


def _run(targets: str, r: int = 16, **broadcast):
    raw = {
        "model": {
            "init": "random",
            "family": "qwen3_vl",
            "lora": {"r": r, "alpha": 2 * r, "targets": targets},
            "vlm": {"freeze_vision_encoder": targets == "language"},
        },
        "rollout": {"engine": "openai", "server": "vllm", "launch": True, "launch_gpu": "same"},
        "broadcast": {"transport": "ipc", **broadcast},
        "trainer": {"device": "cpu"},
    }
    rc = resolve_config(parse_config(raw))
    return rc, vlmreg.load(rc)


class Mapper:  # vLLM's WeightsMapper with Qwen3VLForConditionalGeneration.hf_to_vllm_mapper's prefixes (vLLM 0.24)
    prefixes = {
        "model.visual.": "visual.",
        "lm_head.": "language_model.lm_head.",
        "model.language_model.": "language_model.model.",
    }

    def apply_list(self, names):
        out = []
        for name in names:
            for old, new in self.prefixes.items():
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            out.append(name)
        return out


# what served_modules reads of vLLM's LoRAModelManager: the model's mapper, packed modules, wrapped modules
class Manager:
    def __init__(self, wrapped):
        self.model = type("Model", (), {"hf_to_vllm_mapper": Mapper()})()
        self.packed_modules_mapping = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
            "qkv": ["qkv"],
        }
        self.modules = {name: object() for name in wrapped}


def _vllm_modules(layers: int, blocks: int, tower: bool) -> list[str]:
    """The module names vLLM 0.24 wraps with LoRA in a tiny Qwen3-VL: the language model's fused linear layers, and the
    vision tower's and connector's only with --enable-tower-connector-lora."""
    names = [
        f"language_model.model.layers.{i}.{m}"
        for i in range(layers)
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]
    if tower:
        names += [
            f"visual.blocks.{i}.{m}"
            for i in range(blocks)
            for m in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
        ]
        names += [
            "visual.merger.linear_fc1",
            "visual.merger.linear_fc2",
            "visual.deepstack_merger_list.0.linear_fc1",
            "visual.deepstack_merger_list.0.linear_fc2",
        ]
    return names


@pytest.mark.parametrize("tower", [False, True])
def test_the_worker_reads_which_adapted_modules_vllm_wrapped(tower):
    rc, loaded = _run("all-linear")
    adapters = VllmAdapters(rc, loaded.resolved, log=lambda line: None)
    names = sorted(adapters.keepable)
    served = served_modules(Manager(_vllm_modules(2, 2, tower)), names)
    language = [n for n in names if n.startswith("model.language_model.")]
    # q_proj, k_proj, v_proj under qkv_proj; gate/up under gate_up_proj
    assert language and set(language) <= set(served)
    vision = [n for n in names if n.startswith("model.visual.")]
    assert vision and (set(vision) <= set(served) if tower else not set(vision) & set(served))
    lines: list[str] = []
    adapters.log = lines.append
    kept = adapters.choose(
        lambda asked: [(served_modules(Manager(_vllm_modules(2, 2, tower)), asked), True)], "http://x"
    )
    assert kept == frozenset(served)
    assert lines == [
        f"LoRA syncs to vLLM at http://x: {len(served)} module(s) as adapters, "
        + (
            "0 merged into base weights"
            if tower
            else f"{len(vision)} merged into base weights: {len(vision)} not served as "
            f"LoRA by the server (e.g. {adapters.split.merged and next(iter(adapters.split.merged))})"
        ),
        "LoRA adapter in vLLM at http://x: kept live, rewritten in place each sync",
    ]


def test_launch_options_follow_the_preset_and_rank():
    rc, loaded = _run("language", r=4)
    args = VllmAdapters(rc, loaded.resolved, log=print).server_args()
    assert args[:3] == ["--enable-lora", "--max-lora-rank", "8"] and "--enable-tower-connector-lora" not in args
    command = vllm_command(rc, "/m", 8000, "float32", 512, lora_args=args)
    assert command[command.index("--enable-lora") :][:3] == args[:3]
    rc, loaded = _run("all-linear", r=64)
    args = VllmAdapters(rc, loaded.resolved, log=print).server_args()
    assert args[2] == "64" and "--enable-tower-connector-lora" in args
    rc, loaded = _run("language", r=600)
    with pytest.raises(VlmregError, match="up to rank 512"):
        VllmAdapters(rc, loaded.resolved, log=print).server_args()
    rc, loaded = _run("language", lora_sync="merged")
    assert not adapters_wanted(rc, loaded.resolved)


@pytest.mark.parametrize("live", [False, True])
def test_versions_are_loaded_named_in_requests_and_the_one_before_unloaded(live, tmp_path):
    """Versioned: each version gets a directory holding peft's adapter config (what vLLM reads the rank and alpha
    from), is loaded under a new name the engine's requests then use, and the one before is unloaded and its directory
    removed. Live: the first version is loaded once, later syncs tell the workers to rewrite it in place (no request
    to the API server); requests keep its name."""
    rc, loaded = _run("language")
    adapters = VllmAdapters(rc, loaded.resolved, log=print, peft_model=loaded.model, directory=tmp_path / "vllm-lora")
    assert adapters.choose(lambda names: [(names, live), (names, live)], "http://x") == frozenset(adapters.keepable)
    assert adapters.live is live and not adapters.sends_weights  # the language preset: factors only, every step
    posts: list[tuple[str, dict]] = []
    scope = CacheScope()
    sent = []
    for version in range(1, 4):
        fields = adapters.request_fields()
        sent.append(fields)
        directory = Path(fields["lora_path"])
        assert sorted(p.name for p in directory.iterdir()) == ["adapter_config.json"]
        config = LoraConfig.from_pretrained(str(directory))  # peft reads it back: rank and alpha as the run's
        assert (config.r, config.lora_alpha) == (16, 32)
        adapters.finish(lambda path, body: posts.append((path, body)), scope)
        assert scope.model == ("vlmreg-lora" if live else f"vlmreg-lora-{version}")
    loads = [body for path, body in posts if path == "/v1/load_lora_adapter"]
    unloads = [body["lora_name"] for path, body in posts if path == "/v1/unload_lora_adapter"]
    first = str((tmp_path / "vllm-lora" / "v1").resolve())
    if live:
        assert sent == [{"lora_path": first, "lora_mode": "live"}] + [{"lora_path": first, "lora_mode": "update"}] * 2
        assert loads == [{"lora_name": "vlmreg-lora", "lora_path": first}] and unloads == []
        assert sorted(p.name for p in (tmp_path / "vllm-lora").iterdir()) == ["v1"]
    else:
        assert [f.get("lora_mode") for f in sent] == [None] * 3
        assert [b["lora_name"] for b in loads] == ["vlmreg-lora-1", "vlmreg-lora-2", "vlmreg-lora-3"]
        assert loads[2]["lora_path"] == str((tmp_path / "vllm-lora" / "v3").resolve())
        assert unloads == ["vlmreg-lora-1", "vlmreg-lora-2"]
        assert sorted(p.name for p in (tmp_path / "vllm-lora").iterdir()) == ["v3"]


def test_a_worker_answer_says_what_it_serves_and_whether_it_keeps_the_adapter_live():
    assert worker_answers({"results": [json.dumps({"served": ["a"], "live": True}), json.dumps(["b"])]}) == [
        (["a"], True),
        (["b"], False),  # an older worker: a bare list, loaded version by version
    ]
    with pytest.raises(VlmregError, match="unexpected answer"):
        worker_answers({"results": [json.dumps(3)]})


def test_auto_syncs_adapters_to_vllm_and_merged_merges():
    """The default sends adapters to vLLM too, now that its live adapter syncs have run on GPUs (BENCHMARKS.md);
    ``merged`` is the way back to whole weights."""
    rc, loaded = _run("language", lora_sync="auto")
    assert rc.config.broadcast.lora_sync == "auto" and adapters_wanted(rc, loaded.resolved)
    rc, loaded = _run("language", lora_sync="merged")
    assert not adapters_wanted(rc, loaded.resolved)
