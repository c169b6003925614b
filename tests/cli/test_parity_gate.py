"""``vlmreg train`` refuses a family that fails ``vlmreg check --tiny``'s parity, unless told to go on (issue 31 item 1:
PaliGemma's sampler logprobs failed the check at 9.4e-3 and ``vlmreg train`` ran anyway without a word).

The failing family is the bundled PaliGemma descriptor with a wrong turn end (``<pad>``, where the chat template
closes a turn with ``<eos>``): it trains without any error, stopping its completions at a token the template never
writes; the turn-end check tells.
"""

from __future__ import annotations

import attrs
import pytest

from vlmreg import hookimpl
from vlmreg.cli import main, parity_gate
from vlmreg.sdk.registry import get_registry

CONFIG = """
[model]
init = "random"
family = "{family}"

[rollout]
group_size = 2
max_tokens = 2

[trainer]
steps = 1
prompts_per_step = 2
device = "cpu"

[data]
task = "colour"
num_samples = 4
"""


class WrongTurnEnd:
    """PaliGemma with a turn end its chat template does not write."""

    @staticmethod
    @hookimpl
    def vlmreg_register_families(register):
        from vlmreg_paligemma import descriptor  # noqa: PLC0415 - the bundled plugin, installed with vlmreg

        register(attrs.evolve(descriptor(), name="x_wrong_turn_end", turn_end_tokens=("<pad>",)))


@pytest.fixture
def wrong_turn_end(vlmreg_add_plugin, monkeypatch, tmp_path):
    monkeypatch.setenv("VLMREG_PLUGINS", "vlmreg-qwen3-vl")  # not the bundled paligemma, which claims its model type
    monkeypatch.setenv("VLMREG_CACHE_DIR", str(tmp_path / "cache"))
    vlmreg_add_plugin(WrongTurnEnd(), "x_wrong_turn_end")
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(family="x_wrong_turn_end"))
    return config


def err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def test_a_family_failing_its_parity_is_refused_before_anything_is_written(wrong_turn_end, capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", str(wrong_turn_end), "--output-dir", str(out)]) == 1
    message = err(capsys)
    assert message.startswith("error: family x_wrong_turn_end fails")
    assert "of the parity checks of `vlmreg check --tiny x_wrong_turn_end`" in message
    assert "stops at the turn end: the family's first turn-end token is '<pad>'" in message
    assert (
        "hint: processor contract requirement 3 (an assistant turn closes with one token): field turn_end_tokens"
        in (message)
    )
    assert message.endswith("Fix the family, or pass --ignore-parity to train anyway")
    assert not out.exists()
    assert not list((tmp_path / "cache").glob("parity/*.json"))  # a failure is not remembered


def test_ignore_parity_trains_anyway_with_the_failures_as_a_warning(wrong_turn_end, capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", str(wrong_turn_end), "--output-dir", str(out), "--ignore-parity"]) == 0
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert "warning: family x_wrong_turn_end fails" in text and "--ignore-parity: training anyway" in text
    assert (out / "metrics.jsonl").is_file()


def test_a_pass_is_remembered_under_the_sources_and_versions(monkeypatch, tmp_path, capsys):
    """The bundled paligemma passes; the second run does not check again, and another key (a changed source, or
    another version of transformers or torch) would."""
    monkeypatch.setenv("VLMREG_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(family="paligemma"))
    assert main(["train", str(config), "--output-dir", str(tmp_path / "a")]) == 0
    [remembered] = (tmp_path / "cache" / "parity").glob("*.json")
    assert remembered.stem == parity_gate.cache_key(get_registry().get("paligemma"))

    def must_not_run(family):
        raise AssertionError("the checks ran again")

    monkeypatch.setattr(parity_gate, "_run_checks", must_not_run)
    assert main(["train", str(config), "--output-dir", str(tmp_path / "b")]) == 0
    monkeypatch.setattr("transformers.__version__", "0.0.0")
    assert parity_gate.cache_key(get_registry().get("paligemma")) != remembered.stem


def test_vlmreg_check_prints_the_requirement_and_the_field_under_a_failed_check(wrong_turn_end, capsys):
    assert main(["check", "--tiny", "x_wrong_turn_end", "--depth", "0"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "FAIL stops at the turn end: the family's first turn-end token is '<pad>'" in out
    assert (
        "hint: processor contract requirement 3 (an assistant turn closes with one token): field turn_end_tokens"
        in (out)
    )
    assert "ok logprobs, padded" in out and "ok 3-turn prompt" in out  # the other checks still run and pass
