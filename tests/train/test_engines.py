"""Rollout engines are a registry: a plugin's engine is listed, checked and built with the run's context."""

from __future__ import annotations

import json
import types
from pathlib import Path

import vlmreg
from vlmreg import Engine, hookimpl
from vlmreg.cli import main
from vlmreg.inference.embedded import EmbeddedEngine

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml")
QUICK = [
    "--set",
    "trainer.format_warmup_steps=0",
    "--set",
    "eval.every=0",
    "--set",
    "logging.rollout_page_every=0",
    "--set",
    "trainer.steps=2",
    "--set",
    "trainer.prompts_per_step=2",
    "--set",
    "rollout.group_size=2",
]


class Recording:
    """The embedded engine, counting the conversations it is asked to sample."""

    def __init__(self, inner):
        self.inner, self.conversations = inner, 0

    @property
    def encoder(self):
        return self.inner.encoder

    def chat(self, conversations, params, **kwargs):
        self.conversations += len(conversations)
        return self.inner.chat(conversations, params, **kwargs)


def test_a_plugin_s_engine_is_listed_checked_and_samples_a_real_run(vlmreg_fresh_registry, tmp_path, capsys):
    built = []

    def build(ctx):
        engine = Recording(EmbeddedEngine(ctx.model, ctx.processor, ctx.store, ctx.device, descriptor=ctx.descriptor))
        built.append((ctx, engine))
        return engine

    plugin = types.SimpleNamespace(
        vlmreg_register_rollout_engines=hookimpl(
            lambda register: register(Engine(name="recording", build=build, description="the embedded engine, counted"))
        )
    )
    vlmreg.register_plugin(plugin, name="my-engines")
    try:
        assert main(["plugins", "--json"]) == 0
        records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
        assert records["my-engines"]["rollout_engines"] == ["recording"]
        assert records["vlmreg.engines"]["rollout_engines"] == ["embedded", "openai"]
        assert main(["validate", MAIN, "--set", "rollout.engine=recordng"]) == 1
        assert "Did you mean 'recording'" in capsys.readouterr().err
        assert (
            main(["validate", MAIN, "--set", "rollout.engine=recording", "--set", "rollout.url=http://127.0.0.1:9"])
            == 1
        )
        assert "engine = 'recording' runs in the trainer" in capsys.readouterr().err
        out = tmp_path / "run"
        assert main(["train", MAIN, *QUICK, "--set", "rollout.engine=recording", "--output-dir", str(out)]) == 0
    finally:
        vlmreg.unregister_plugin("my-engines")
    [(ctx, engine)] = built
    assert ctx.output_dir == out and ctx.url is None and ctx.rc.config.rollout.engine == "recording"
    assert engine.conversations == 2 * 2 * 2  # steps x prompts x group: every rollout came from the plugin's engine
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
