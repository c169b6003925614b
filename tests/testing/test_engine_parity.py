"""`vlmreg check --engine vllm`'s comparisons against a real HTTP server standing in for vLLM: `vlmreg serve` on CPU,
serving the checkpoint the check is given (as vLLM would serve the one the trainer exports).

The comparisons are the check's own (`vlmreg.testing.engine_parity.compare_server`): the server's prompt ids against
the processor's ``apply_chat_template`` and vlmreg's `PromptEncoder`, its sampled tokens' logprobs against a plain
fp32 forward. A server whose processor resizes images differently must FAIL every image prompt (and pass the text-only
one); without vLLM, launching says so and exits 2, never "equal". What needs vLLM and a GPU is skipped with the reason.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
from pathlib import Path

import attrs
import pytest
import torch

import vlmreg
from vlmreg import hookimpl
from vlmreg.cli import main
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.data import ImageStore
from vlmreg.inference.openai_client import OpenAIEngine
from vlmreg.inference.server_link import ServerLink
from vlmreg.inference.vllm_server import export_checkpoint, export_weights, vllm_command
from vlmreg.serve import serve_in_thread
from vlmreg.testing.engine_parity import (
    DEFAULT_SERVER_ARGS,
    check_engine,
    compare_server,
    engine_config,
    engine_processor_parity,
    sharpen_logits,
)
from vlmreg.testing.parity import processor_inputs

PLUGIN_SRC = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "vlmreg-tiny-llava" / "src"


def checkpoint(family: str, directory: Path) -> Path:
    """The tiny random model of ``family`` written as a checkpoint directory: weights, config, training processor."""
    torch.manual_seed(0)
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}}))
    sharpen_logits(loaded.model, loaded.resolved.descriptor, loaded.processor)  # as the check does to a random init
    export_weights(loaded.resolved, directory)
    loaded.processor.save_pretrained(directory)
    return directory


def served(directory: Path):
    return serve_in_thread(
        parse_config({"model": {"init": "pretrained", "name": str(directory)}, "trainer": {"device": "cpu"}})
    )


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """qwen3_vl's checkpoint, served as it is, and served with a processor that resizes images differently."""
    root = tmp_path_factory.mktemp("engine")
    right = checkpoint("qwen3_vl", root / "ckpt")
    wrong = root / "resized"
    shutil.copytree(right, wrong)
    config = json.loads((wrong / "processor_config.json").read_text())
    config["image_processor"]["size"]["shortest_edge"] = 128 * 128  # upscales the 64x64 test images: 16 tokens, not 4
    (wrong / "processor_config.json").write_text(json.dumps(config))
    servers = [served(right), served(wrong)]
    yield right, servers[0][1], servers[1][1]
    for server, _ in servers:
        server.close()


def check(capsys, *argv: str) -> tuple[int, list[str], dict]:
    code = main(["check", "--engine", "vllm", *argv])
    lines = capsys.readouterr().out.strip().splitlines()
    return code, lines[:-1], json.loads(lines[-1])


def test_a_server_of_the_same_checkpoint_passes_every_comparison(qwen, capsys):
    directory, url, _ = qwen
    code, lines, summary = check(capsys, str(directory), "--url", url)
    assert code == 0, "\n".join(lines)
    names = [c["name"] for c in summary["comparisons"]]
    for case in ("text only", "1 image", "2 images", "3 images"):
        for what in ("prompt ids vs the processor", "prompt ids vs vlmreg", "logprobs vs a plain forward"):
            assert f"{case}: {what}" in names
            assert f"PASS {case}: {what}: " in "\n".join(lines)
    assert summary["ok"] and summary["failed"] == 0 and summary["passed"] == len(names) - 1 == 12
    [video] = [c for c in summary["comparisons"] if c["name"] == "1 video"]  # checked on a launched server only
    assert video["status"] == "SKIP" and "attached server may be vLLM or vlmreg serve" in video["detail"]
    worst = max(c["value"] for c in summary["comparisons"] if c["name"].endswith("plain forward"))
    assert worst < 1e-4  # fp32 on both sides of the same CPU


def test_a_prefix_lm_family_is_checked_with_its_image_and_says_why_text_only_is_skipped(tmp_path, capsys):
    """PaliGemma's processor refuses a prompt without an image (``images are expected``): the check compares the
    1-image prompt and SKIPs the text-only one naming prefix_lm, where it stopped with an unexpected ValueError."""
    directory = checkpoint("paligemma", tmp_path / "ckpt")
    server, url = served(directory)
    try:
        code, lines, summary = check(capsys, str(directory), "--url", url)
    finally:
        server.close()
    assert code == 0, "\n".join(lines)
    statuses = {c["name"]: c["status"] for c in summary["comparisons"]}
    for what in ("prompt ids vs the processor", "prompt ids vs vlmreg", "logprobs vs a plain forward"):
        assert statuses[f"1 image: {what}"] == "PASS"
    [text] = [c for c in summary["comparisons"] if c["name"] == "text only: prompt"]
    assert text["status"] == "SKIP" and "prefix_lm" in text["detail"]


def test_a_server_that_resizes_images_differently_fails_every_image_prompt(qwen, capsys):
    directory, _, url = qwen
    code, lines, summary = check(capsys, str(directory), "--url", url)
    assert code == 1
    status = {c["name"]: c["status"] for c in summary["comparisons"]}
    assert status["text only: prompt ids vs the processor"] == status["text only: prompt ids vs vlmreg"] == "PASS"
    for case in ("1 image", "2 images", "3 images"):
        assert status[f"{case}: prompt ids vs the processor"] == status[f"{case}: prompt ids vs vlmreg"] == "FAIL"
    detail = next(c["detail"] for c in summary["comparisons"] if c["name"] == "1 image: prompt ids vs the processor")
    assert "differs" in detail and "tokens" in detail
    assert lines[-1].startswith(f"FAIL qwen3_vl through the server at {url}: 3 passed, 9 failed")


def test_compare_server_fails_logprobs_of_other_weights(qwen):
    """The logprob comparison can fail: the same server against another random model's weights as the reference."""

    directory, url, _ = qwen
    loaded = vlmreg.load(
        parse_config({"model": {"init": "pretrained", "name": str(directory)}, "trainer": {"device": "cpu"}})
    )
    other = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl", "seed": 1}, "trainer": {"device": "cpu"}})
    )
    sharpen_logits(other.model, other.resolved.descriptor, other.processor)
    other = other.model.eval()
    engine = OpenAIEngine(url, loaded.processor, ImageStore(), descriptor=loaded.resolved.descriptor)
    results = {c.name: c for c in compare_server(engine, loaded.processor, other, loaded.resolved.descriptor, 2e-3)}
    assert results["2 images: prompt ids vs the processor"].status == "PASS"
    assert results["2 images: logprobs vs a plain forward"].status == "FAIL", results[
        "2 images: logprobs vs a plain forward"
    ].detail


def test_the_engine_s_own_processor_is_a_third_reference(qwen):
    """``saved`` (the processor the engine loaded): the server's ids against it too; one that resizes otherwise FAILs
    every image prompt while the trainer's processor and vlmreg still agree with the server."""

    directory, url, _ = qwen
    loaded = vlmreg.load(
        parse_config({"model": {"init": "pretrained", "name": str(directory)}, "trainer": {"device": "cpu"}})
    )
    descriptor = loaded.resolved.descriptor
    resized = descriptor.load_processor(directory.parent / "resized")
    for saved, verdict in ((descriptor.load_processor(directory), "PASS"), (resized, "FAIL")):
        engine = OpenAIEngine(url, loaded.processor, ImageStore(), descriptor=descriptor)
        status = {
            c.name: c.status
            for c in compare_server(engine, loaded.processor, loaded.model.eval(), descriptor, 2e-3, saved=saved)
        }
        assert status["text only: prompt ids vs AutoProcessor"] == "PASS"
        assert [status[f"{k}: prompt ids vs AutoProcessor"] for k in ("1 image", "2 images", "3 images")] == [
            verdict
        ] * 3
        assert status["2 images: prompt ids vs the processor"] == status["2 images: prompt ids vs vlmreg"] == "PASS"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_check_says_so_and_compares_nothing(capsys):
    code, lines, summary = check(capsys, "--tiny", "qwen3_vl")
    assert code == 2
    assert (
        summary["error"].startswith("vLLM is not importable by ") and summary["comparisons"] == [] and not summary["ok"]
    )
    assert not any(line.startswith("PASS") or "equal" in line for line in lines)
    assert lines[-1] == "FAIL qwen3_vl through vllm: 0 passed, 0 failed, not run"


def test_attaching_needs_the_checkpoint_the_server_serves(capsys):
    code, _, summary = check(capsys, "--tiny", "qwen3_vl", "--url", "http://127.0.0.1:1")
    assert code == 2 and "--url needs the checkpoint DIR" in summary["error"]


@pytest.fixture
def acme(vlmreg_add_plugin, monkeypatch, tmp_path):
    """A third party's family (the example tiny LLaVA plugin, one image per message), checkpoint served by vlmreg
    serve."""
    # not the installed example plugin, which claims model_type llava too
    monkeypatch.setenv("VLMREG_PLUGINS", "qwen3_vl")
    monkeypatch.syspath_prepend(str(PLUGIN_SRC))
    llava = importlib.import_module("vlmreg_tiny_llava")

    class Acme:
        @hookimpl
        def vlmreg_register_families(self, register):
            llava.vlmreg_register_families(lambda d: register(attrs.evolve(d, name="acme_llava")))

    vlmreg_add_plugin(Acme(), "acme")
    directory = checkpoint("acme_llava", tmp_path / "acme")
    server, url = served(directory)
    yield directory, url
    server.close()


def test_a_third_party_family_is_checked_as_a_bundled_one(acme, capsys):
    directory, url = acme
    code, lines, summary = check(capsys, str(directory), "--url", url)
    assert code == 0, "\n".join(lines)
    assert summary["family"] == "acme_llava" and summary["passed"] == 6  # text only and 1 image, 3 comparisons each
    skipped = [c for c in summary["comparisons"] if c["status"] == "SKIP"]
    assert [c["name"] for c in skipped] == ["2 images: prompt", "3 images: prompt"]
    assert "takes at most 1 image(s) per message" in skipped[0]["detail"]


def test_the_launch_config_is_a_valid_run_with_the_check_s_vllm_flags_last():
    """What the check launches vLLM with: the trainer's command (`vllm_command`) with the check's flags after it."""

    raw = engine_config(
        "qwen3_vl",
        None,
        dtype="float32",
        server_args=DEFAULT_SERVER_ARGS,
        gpu_memory_fraction=0.08,
        launch=True,
        device="cuda",
    )
    rc = resolve_config(parse_config(raw))
    command = vllm_command(rc, "/ckpt", 8000, "float32", 2056)
    assert command[-len(DEFAULT_SERVER_ARGS) :] == list(DEFAULT_SERVER_ARGS)
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.08"
    assert command[command.index("--attention-backend") + 1] == "FLEX_ATTENTION"
    assert json.loads(command[command.index("--limit-mm-per-prompt") + 1]) == {"image": 3, "video": 1}


@pytest.mark.parametrize("synced", [True, False], ids=["synced", "sync-lost"])
def test_launched_as_the_trainer_launches_it_and_checked_again_after_a_weight_sync(tmp_path, monkeypatch, synced):
    """The launched path with `vlmreg serve` in vLLM's place (`ServerLink`, gloo syncs on CPU): every comparison holds,
    also after the trainer changes every language-model weight and syncs; a sync that never reaches the server FAILs."""

    if not synced:
        real = ServerLink.sync
        monkeypatch.setattr(
            ServerLink, "sync", lambda self, step, full=False: real(self, step, full=full) if step == 0 else None
        )
    report = check_engine(
        "qwen3_vl", server="vlmreg", device="cpu", transport="gloo", output_dir=tmp_path, log=lambda m: None
    )
    status = {c.name: c.status for c in report.comparisons}
    after = "after a weight sync (gloo), 3 images: logprobs vs a plain forward"
    assert report.error is None and report.launch_s is not None and report.engine == "vlmreg"
    assert (
        status["3 images: logprobs vs a plain forward"]
        == status["after a weight sync (gloo), 3 images: prompt ids vs the processor"]
        == "PASS"
    )
    assert status[after] == ("PASS" if synced else "FAIL")
    assert report.ok is synced
    # the video case through the launched vlmreg serve: the trainer's frames and timing, no vLLM wrapper
    for what in ("prompt ids vs the processor", "prompt ids vs vlmreg", "logprobs vs a plain forward"):
        assert status[f"1 video (5 frames of 90x70): {what}"] == "PASS", report.comparisons
    assert "output head x" in report.source


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(), reason="needs vLLM and a GPU"
)
def test_vllm_serves_the_tiny_qwen3_vl_as_the_references_say(tmp_path):
    report = check_engine("qwen3_vl", output_dir=tmp_path, log=print)
    assert report.ok, json.dumps(report.as_dict(), indent=1)


def test_the_engine_processor_is_compared_as_vllm_loads_it(tmp_path):
    """`engine_processor_parity`: the processor `export_checkpoint` saved, loaded with AutoProcessor, against the
    trainer's; a saved processor that tiles images otherwise FAILs (idefics3 needs no torchvision to load here)."""

    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "idefics3"}, "trainer": {"device": "cpu"}})
    )
    directory = export_checkpoint(loaded.resolved, loaded.processor, tmp_path / "engine")
    same, saved = engine_processor_parity(directory, loaded.processor, loaded.resolved.descriptor)
    assert (
        same.status == "PASS" and "Idefics3Processor" in same.detail and type(saved).__name__ == "Idefics3Processor"
    ), same
    config = json.loads((directory / "processor_config.json").read_text())
    config["image_processor"]["max_image_size"] = {"longest_edge": 16}  # smaller tiles: more of them per image
    (directory / "processor_config.json").write_text(json.dumps(config))
    other, _ = engine_processor_parity(directory, loaded.processor, loaded.resolved.descriptor)
    assert other.status == "FAIL" and "differs" in other.detail, other


BUNDLED = ["qwen3_vl", "gemma3", "idefics3", "internvl", "qwen2_vl", "glm4v", "llava_onevision", "qwen3_5"]


@pytest.mark.parametrize("family", BUNDLED)
def test_the_check_s_random_model_has_spread_but_not_one_hot_distributions(family):
    """Against the model's own forward on another prompt than the one the factor was chosen on: the sampled tokens'
    logprobs must be informative. gemma3 ties its head to the input embeddings, and the old rule (logits of std 4)
    gave it probability 1 for one token everywhere: every logprob 0 on both sides, so the check compared nothing."""
    torch.manual_seed(0)
    loaded = vlmreg.load(
        parse_config(
            {
                "model": {"init": "random", "family": family, "size": "tiny", "dtype": "float32"},
                "trainer": {"device": "cpu"},
            }
        )
    )
    sharpen_logits(loaded.model, loaded.resolved.descriptor, loaded.processor)

    inputs = processor_inputs(
        loaded.processor,
        [{"role": "user", "content": [{"type": "text", "text": "Name a colour, in one word please."}]}],
    )
    with torch.no_grad():
        logp = loaded.model(**inputs, use_cache=False).logits[0, -8:].float().log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    top = logp.max(-1).values.exp()
    assert 1.0 < float(entropy.mean()) < 4.0, entropy
    assert int((top > 0.99).sum()) <= 2, top  # at most a couple of near-certain positions
