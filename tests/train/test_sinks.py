"""Metrics sinks are a registry: a plugin's sink gets every step's record; bad names and failing sinks are clear."""

from __future__ import annotations

import json
import types
from pathlib import Path

import vlmreg
from vlmreg import MetricsSink, hookimpl
from vlmreg.cli import main

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
    "--set",
    "logging.tensorboard=false",
]


class Memory:
    def __init__(self, context):
        self.context, self.records, self.closed = context, [], False

    def write(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True


class Broken(Memory):
    def write(self, record):
        raise ConnectionError("the tracking server is down")


def test_a_plugin_s_sink_gets_every_record_and_bad_names_and_failures_are_clear(
    vlmreg_fresh_registry, tmp_path, capsys
):
    opened: list[Memory] = []

    def register(register):
        register(MetricsSink(name="memory", open=lambda ctx: opened.append(Memory(ctx)) or opened[-1]))
        register(MetricsSink(name="broken", open=Broken))

    vlmreg.register_plugin(types.SimpleNamespace(vlmreg_register_metrics_sinks=hookimpl(register)), name="my-sinks")
    try:
        assert main(["plugins", "--json"]) == 0
        records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
        assert records["my-sinks"]["metrics_sinks"] == ["broken", "memory"]
        assert main(["validate", MAIN, "--set", 'logging.sinks=["memroy"]']) == 1
        assert "logging.sinks[0]: Unknown metrics sink 'memroy'. Did you mean 'memory'?" in " ".join(
            capsys.readouterr().err.split()
        )
        out = tmp_path / "run"
        assert main(["train", MAIN, *QUICK, "--set", 'logging.sinks=["memory"]', "--output-dir", str(out)]) == 0
        capsys.readouterr()
        assert (
            main(["train", MAIN, *QUICK, "--set", 'logging.sinks=["broken"]', "--output-dir", str(tmp_path / "b")]) == 1
        )
        err = " ".join(capsys.readouterr().err.split())
        assert "metrics sink 'broken' failed writing step 1: ConnectionError: the tracking server is down" in err
        assert "Traceback" not in err
    finally:
        vlmreg.unregister_plugin("my-sinks")
    [sink] = opened
    written = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sink.records == written and [r["step"] for r in written] == [1, 2]  # the same records as metrics.jsonl
    assert sink.closed and sink.context.output_dir == out and sink.context.resume_step is None
