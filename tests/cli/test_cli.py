"""The CLI in process (output and exit codes) and as a real subprocess (no traceback, no torch for `families`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from transformers import Qwen3VLConfig

import vlmreg.loading.load
from vlmreg.cli import main
from vlmreg.loading.build import tiny_config_of
from vlmreg.sdk.registry import get_registry

BUNDLED = {
    "qwen3_vl": "vlmreg-qwen3-vl",
    "qwen3_vl_moe": "vlmreg-qwen3-vl-moe",
    "qwen3_5": "vlmreg-qwen3-5",
    "qwen3_5_moe": "vlmreg-qwen3-5-moe",
    "qwen2_5_vl": "vlmreg-qwen2-5-vl",
    "qwen2_vl": "vlmreg-qwen2-vl",
    "gemma3": "vlmreg-gemma3",
    "idefics3": "vlmreg-idefics3",
    "internvl": "vlmreg-internvl",
    "glm4v": "vlmreg-glm4v",
    "llava_onevision": "vlmreg-llava-onevision",
    "paligemma": "vlmreg-paligemma",
}


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys, *argv) -> str:
    assert main(list(argv)) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return " ".join(captured.err.split())


def test_families_json_lists_the_bundled_families_with_paths_prefix_and_distribution(capsys):
    records = {r["name"]: r for r in run_json(capsys, "families", "--json")}
    assert set(BUNDLED) <= set(records)
    for name, dist in BUNDLED.items():
        r = records[name]
        assert r["plugin"] == dist and r["plugin_version"] == "0.1.0"
        assert name in r["model_types"]
        assert r["weight_prefix"] == f"{r['language_model_attr']}.layers."
    for name in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
        r = records[name]
        assert r["model_types"] == [name]
        assert (r["vision_encoder_attr"], r["language_model_attr"], r["lm_head_attr"]) == (
            "model.visual",
            "model.language_model",
            "lm_head",
        )
        assert r["weight_prefix"] == "model.language_model.layers."
        assert r["max_images_per_message"] == 16 and r["vision_processor_id"].startswith("Qwen/")


def test_families_table_for_people(capsys):
    assert main(["families"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BUNDLED) and "vlmreg-qwen3-vl" in out


def test_show_prints_presets_and_thinking_modes(capsys):
    assert main(["show", "qwen3_5"]) == 0
    out = capsys.readouterr().out
    assert "LoRA presets" in out and "in_proj_qkv" in out and "enable_thinking=False" in out
    record = run_json(capsys, "show", "qwen3_vl_moe", "--json")
    assert record["lora_presets"]["language+experts"]["parameters"] == [
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
    ]


def test_show_unknown_family_is_a_short_error(capsys):
    message = run_error(capsys, "show", "qwen3-vl")
    assert message.startswith("error: Unknown family 'qwen3-vl'. Did you mean 'qwen3_vl'")


def test_plugins_lists_distributions_versions_and_hooks(capsys):
    records = {r["name"]: r for r in run_json(capsys, "plugins", "--json")}
    for name, dist in BUNDLED.items():
        assert records[name]["distribution"] == dist
        assert records[name]["hooks"] == ["vlmreg_register_families"]
        assert records[name]["families"] == [name]


@pytest.mark.parametrize("family", sorted(BUNDLED))
def test_check_tiny_resolves_every_bundled_family(capsys, family):
    assert main(["check", "--tiny", family]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())  # a long module line wraps inside the tree
    assert f"ok family {family} resolves on tiny {family}" in out and "◀ vision_encoder_attr" in out


def test_check_tiny_runs_the_parity_checks_and_fails_on_a_mismatch(capsys, monkeypatch):
    summary = run_json(capsys, "check", "--tiny", "qwen3_vl", "--json")
    names = [r["name"] for r in summary["parity"]]
    assert summary["ok"] and all(r["ok"] for r in summary["parity"]) and summary["packing"] is True
    assert names[:3] == ["prompt, 1 image(s)", "prompt, 2 image(s)", "prompt, 3 image(s)"]
    assert {"logprobs, alone", "logprobs, padded", "logprobs, packed", "stops at the turn end", "3-turn merge"} <= set(
        names
    )
    assert all(r["value"] <= 1e-5 for r in summary["parity"] if r["name"].startswith("logprobs"))
    # a descriptor naming the wrong turn-end token: the template closes turns with <|im_end|>

    registry = get_registry()
    wrong = attrs.evolve(registry.get("qwen3_vl"), turn_end_tokens=("<|vision_end|>",))
    original = type(registry).get
    monkeypatch.setattr(type(registry), "get", lambda self, name: wrong if name == "qwen3_vl" else original(self, name))
    assert main(["check", "--tiny", "qwen3_vl"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "FAIL stops at the turn end" in out and "<|vision_end|>" in out


def test_check_tiny_fails_on_an_image_layout_the_family_does_not_declare(capsys, monkeypatch):
    """idefics3 collates tiles per image, the processor per prompt: without its declared processor_layout the
    check fails, naming the tensor and both shapes (it used to skip tensors whose shapes differ, and pass)."""

    registry = get_registry()
    original = type(registry).get
    undeclared = attrs.evolve(original(registry, "idefics3"), processor_layout=None)
    monkeypatch.setattr(
        type(registry), "get", lambda self, name: undeclared if name == "idefics3" else original(self, name)
    )
    assert main(["check", "--tiny", "idefics3"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "FAIL prompt, 2 image(s): pixel_values has shape (2, 5, 3, 32, 32) in vlmreg, (1, 8, 3, 32, 32) from the "
        "processor" in out
    )
    assert "ok logprobs, padded" in out  # the model reads both layouts alike: only the undeclared layout fails


def test_check_a_local_model_directory_on_the_meta_device(capsys, tmp_path):
    tiny_config_of(get_registry().get("qwen3_5")).save_pretrained(tmp_path)
    summary = run_json(capsys, "check", str(tmp_path), "--json")
    assert summary["ok"] and summary["family"] == "qwen3_5" and "meta device" in summary["source"]
    assert summary["lora_presets"]["language"]["modules"] > 0


def test_check_a_2b_shaped_config_json_reads_no_weights(capsys, tmp_path):
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=24,
            hidden_size=1024,
            intermediate_size=4096,
            num_heads=16,
            out_hidden_size=2048,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            deepstack_visual_indexes=[5, 11, 17],
            num_position_embeddings=2304,
        ),
    )
    config.save_pretrained(tmp_path)
    summary = run_json(capsys, "check", str(tmp_path / "config.json"), "--json")
    assert summary["num_layers"] == 28 and summary["num_vision_blocks"] == 24
    assert summary["lora_presets"]["language"]["modules"] == 28 * 7


def test_check_with_a_bad_override_exits_1(capsys):
    message = run_error(capsys, "check", "--tiny", "qwen3_vl", "--override", "language_model_attr=model.lm")
    assert (
        "error: language_model_attr = 'model.lm' does not resolve" in message
        and "its children: visual, language_model" in message
    )


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["check"], "check takes either a TARGET"),
        (["check", "x", "--tiny", "qwen3_vl"], "check takes either a TARGET"),
        (["check", "/no/such/dir"], "/no/such/dir: no such model directory or config.json"),
        (["check", "--tiny", "qwen3_vl", "--override", "oops"], "expected FIELD=PATH"),
    ],
)
def test_check_usage_errors(capsys, argv, expected):
    assert expected in run_error(capsys, *argv)


def test_check_a_config_of_an_unknown_model_type(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava_next_video_x"}))
    assert "No installed family claims model_type 'llava_next_video_x'" in run_error(capsys, "check", str(tmp_path))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLMREG_PLUGINS"}
    return {**env, **extra}


def test_families_does_not_import_torch_or_transformers():
    code = (
        "import sys; from vlmreg.cli import main; main(['families', '--json']); print(sorted(m for m in ('torch', "
        "'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_a_broken_plugin_is_one_line_on_stderr_and_vlmreg_plugins_gets_past_it(make_distribution, tmp_path):
    make_distribution("broken-vlm", "raise RuntimeError('boom at import')\n")
    vlmreg_bin = Path(sys.executable).with_name("vlmreg")
    env = _env(PYTHONPATH=str(tmp_path / "site"))
    result = subprocess.run([vlmreg_bin, "families"], capture_output=True, text=True, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    message = " ".join(result.stderr.split())
    assert "distribution 'broken-vlm'" in message and "RuntimeError: boom at import" in message
    env["VLMREG_PLUGINS"] = ",".join(BUNDLED)
    result = subprocess.run([vlmreg_bin, "families", "--json"], capture_output=True, text=True, env=env)
    assert result.returncode == 0 and {r["name"] for r in json.loads(result.stdout)} == set(BUNDLED)


@pytest.mark.parametrize("name", ["[/x].toml", "[data].toml", "[bold]oops[/bold].toml"])
def test_error_messages_are_text_not_markup(capsys, tmp_path, name):
    """A path that looks like rich markup is printed as it is, with no MarkupError traceback (issue 11)."""
    path = tmp_path / name
    message = run_error(capsys, "validate", str(path))
    assert name in message


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weights-from", "127.0.0.1"], "argument --weights-from: '127.0.0.1' is not HOST:PORT"),
        (["--weights-from", "127.0.0.1:0"], "argument --weights-from: '127.0.0.1:0' is not HOST:PORT"),
        (["--weights-from", "h:1", "--weights-rank", "-3"], "argument --weights-rank: -3 is not positive"),
        (
            ["--weights-from", "h:1", "--weights-timeout", "nan"],
            "argument --weights-timeout: nan is not a positive, finite number",
        ),
        (
            ["--weights-from", "h:1", "--weights-timeout", "-1"],
            "argument --weights-timeout: -1 is not a positive, finite number",
        ),
    ],
)
def test_serve_refuses_bad_weight_group_flags_as_usage_errors_before_loading(capsys, monkeypatch, flags, message):
    """Found by benchmarks/reliability_corpus.py: these used to load the model first, then fail (or wait on a NaN
    timeout)."""

    monkeypatch.setattr(vlmreg.loading.load, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    config = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_vl_tiny.toml")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", config, *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("port", "message"),
    [("70000", "70000 is not a port (0..65535"), ("-1", "-1 is not a port"), ("http", "'http' is not a port number")],
)
def test_serve_refuses_a_port_out_of_range_as_a_usage_error(capsys, port, message):
    config = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_vl_tiny.toml")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", config, "--port", port])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("columns", [None, "60"])
def test_tables_piped_keep_each_row_on_one_line_unless_columns_says(columns):
    """Issue 31 item 8: piped, rich laid tables out at 80 columns and wrapped their cells ('llava_onevisio' / 'n');
    every row of `vlmreg plugins` now holds its plugin's whole name, distribution and hooks, as `--json` gives them."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns:
        env["COLUMNS"] = columns

    def run(*argv: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "vlmreg", *argv], capture_output=True, text=True, env=env, check=True
        ).stdout

    records = json.loads(run("plugins", "--json"))
    lines = run("plugins").splitlines()
    whole = [
        r["name"]
        for r in records
        if any(r["name"] in line and r["distribution"] in line and all(h in line for h in r["hooks"]) for line in lines)
    ]
    if columns:  # the width the user asked for: rows wrap
        assert len(whole) < len(records) and max(len(line) for line in lines) <= 60
    else:
        assert whole == [r["name"] for r in records]


def test_piped_tables_carry_no_padding_at_the_ends_of_their_lines():
    """Piped (a layout width of 1000), rich padded every cell of `vlmreg show`'s fields to its longest value: rows of
    about 500 characters, mostly spaces. The lines now end with their text."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run(
        [sys.executable, "-m", "vlmreg", "show", "qwen3_vl"], capture_output=True, text=True, env=env, check=True
    ).stdout
    lines = out.splitlines()
    assert any(line.startswith("model_types") and line.split()[-1] == "qwen3_vl" for line in lines)
    assert [line for line in lines if line != line.rstrip(" ")] == []
