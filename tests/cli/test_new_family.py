"""``vlmreg new-family``: skeletons for families vlmreg does not bundle resolve before any edit, and pass
``vlmreg check --tiny`` once the author fills in the marked fields."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from transformers import AutoConfig

import vlmreg
from vlmreg.cli import main
from vlmreg.loading.build import build_model, tiny_config_of
from vlmreg.scaffold import TODO, build_on_meta, find_layout, tiny_config_spec
from vlmreg.sdk.registry import get_registry, reset_registry

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = (ROOT / "docs" / "tutorial.md").read_text()
TINY_LLAVA_PROCESSOR = (
    ROOT / "examples" / "plugins" / "vlmreg-tiny-llava" / "src" / "vlmreg_tiny_llava" / "processor.py"
)

# Model types transformers builds on the meta device and no bundled plugin claims, with what the tree must give.
EXPECTED = {
    "llava": ("model.vision_tower", "encoder.layers", ("model.multi_modal_projector",), ("linear_1", "linear_2")),
    "mistral3": (
        "model.vision_tower",
        "transformer.layers",
        ("model.multi_modal_projector",),
        ("merging_layer", "linear_1", "linear_2"),
    ),
}


def bundled_distributions() -> list[str]:
    """The repository's bundled plugin distributions that are installed (those with a ``vlmreg`` entry point)."""

    names = []
    for pyproject in sorted((ROOT / "plugins").glob("*/pyproject.toml")):
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
        try:
            if metadata.distribution(name).entry_points.select(group="vlmreg"):
                names.append(name)
        except metadata.PackageNotFoundError:
            continue
    return names


@pytest.fixture(autouse=True)
def only_the_bundled_plugins(monkeypatch, vlmreg_fresh_registry):
    """Load the bundled plugins only (and those a test installs): a user's own plugin that claims one of these model
    types (their PaliGemma or LLaVA family) must not decide what these tests see (issue 31 item 6)."""
    monkeypatch.setenv("VLMREG_PLUGINS", ",".join(bundled_distributions()))


def with_plugin(env: dict[str, str], distribution: str) -> dict[str, str]:
    """``env`` whose ``VLMREG_PLUGINS`` also selects ``distribution``."""
    return {**env, "VLMREG_PLUGINS": f"{env['VLMREG_PLUGINS']},{distribution}"}


def error_of(capsys, *argv: str) -> str:
    assert main(list(argv)) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return " ".join(captured.err.split())


def install(folder: Path, name: str, monkeypatch: pytest.MonkeyPatch, site: Path) -> None:
    """What ``pip install -e`` does for vlmreg: the entry point in a .dist-info, and the src folder on sys.path."""
    info = site / f"vlmreg_{name}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vlmreg-{name.replace('_', '-')}\nVersion: 0.1.0\n")
    entry = re.search(
        r"^\[project\.entry-points\.vlmreg\]\n(.+)$", (folder / "pyproject.toml").read_text(), re.M
    ).group(1)
    assert entry == f'{name} = "vlmreg_{name}"'
    (info / "entry_points.txt").write_text(f"[vlmreg]\n{name} = vlmreg_{name}\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(folder / "src"))
    monkeypatch.setenv("VLMREG_PLUGINS", with_plugin(dict(os.environ), name)["VLMREG_PLUGINS"])
    reset_registry()  # the command loaded the plugins before this one was installed


@pytest.fixture
def forget_modules():
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("vlmreg_x"):
            del sys.modules[name]


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_the_skeleton_resolves_strictly_before_any_edit(
    model_type, tmp_path, monkeypatch, capsys, vlmreg_fresh_registry, forget_modules
):
    name = f"x_{model_type}"
    assert main(["new-family", name, "--from-model-type", model_type, "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / f"vlmreg-{name.replace('_', '-')}"
    assert f"wrote {folder}/" in out and "resolves strictly" in out
    assert {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} == {
        "pyproject.toml",
        "README.md",
        f"src/vlmreg_{name}/__init__.py",
        f"tests/test_{name}.py",
    }
    install(folder, name, monkeypatch, tmp_path / "site")
    registry = get_registry()
    descriptor = registry.get(name)
    assert registry.plugin_of(name).distribution == f"vlmreg-{name.replace('_', '-')}"
    vision, blocks, connectors, connector_linear = EXPECTED[model_type]
    assert (descriptor.vision_encoder_attr, descriptor.language_model_attr, descriptor.lm_head_attr) == (
        vision,
        "model.language_model",
        "lm_head",
    )
    assert (descriptor.vision_blocks_attr, descriptor.connector_attrs, descriptor.weight_prefix) == (
        blocks,
        connectors,
        "model.language_model.layers.",
    )
    assert descriptor.lora_presets["language+projector"].modules[-len(connector_linear) :] == connector_linear

    # a real tiny model on CPU, from the skeleton's tiny_config
    model = build_model(tiny_config_of(descriptor), descriptor)
    resolved = vlmreg.resolve(model)
    assert resolved.name == name and len(resolved.layers) == 2
    assert sum(p.numel() for p in resolved.language_model.parameters()) < sum(p.numel() for p in model.parameters())
    for preset, targets in resolved.lora_presets.items():
        assert all(targets.matches.values()), preset
    assert main(["check", "--tiny", name, "--no-parity"]) == 0
    assert f"ok family {name} resolves" in " ".join(capsys.readouterr().out.split())
    assert error_of(capsys, "check", "--tiny", name) == (
        f"error: family {name!r} has no tiny_processor; parity checks need one to turn images and prompts into model "
        "inputs (see docs/reference.md, field tiny_processor)"
    )

    source = (folder / "src" / f"vlmreg_{name}" / "__init__.py").read_text()
    marked = [line for line in source.splitlines() if TODO in line]
    for field in (
        "tiny_processor=None",
        "vision_processor_id=",
        "turn_end_tokens=",
        "image_placeholder=",
        '"vocab_size"',
        "_token_index=",
        '"image_size"',
    ):
        assert any(field in line for line in marked), field


def test_the_skeleton_installs_with_pip_and_resolves_in_a_fresh_process(tmp_path, capsys):
    """A real install (pip, into a target folder; no network, no build isolation), then `vlmreg check` as a user runs
    it."""
    assert main(["new-family", "x_pip", "--from-model-type", "mistral3", "--output", str(tmp_path)]) == 0
    capsys.readouterr()
    target = tmp_path / "target"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--target",
        str(target),
    ]
    subprocess.run([*pip, str(tmp_path / "vlmreg-x-pip")], check=True, capture_output=True, timeout=300)
    env = with_plugin({**os.environ, "PYTHONPATH": str(target)}, "vlmreg-x-pip")
    check = subprocess.run(
        [sys.executable, "-m", "vlmreg", "check", "--tiny", "x_pip", "--no-parity"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr
    assert "ok family x_pip resolves" in " ".join(check.stdout.split())
    families = subprocess.run(
        [sys.executable, "-m", "vlmreg", "families", "--json"], capture_output=True, text=True, env=env, timeout=300
    )
    assert any(f["name"] == "x_pip" and f["plugin"] == "vlmreg-x-pip" for f in json.loads(families.stdout))


def test_paligemma_family_specific_sizes_follow_the_tiny_text_model(tmp_path):
    """PaliGemma's projector output (vision_config.projection_dim) and top-level hidden_size equal the text hidden
    size."""

    config = tiny_config_spec("paligemma").build()
    assert config.vision_config.projection_dim == config.hidden_size == config.text_config.hidden_size == 64
    assert (
        config.text_config.num_image_tokens == (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    )


def fill(source: str, key: str, value: str) -> str:
    """Replace the value of a field marked TODO (``"key": v,  # TODO`` or ``key=v,  # TODO``) as an author would."""
    pattern = re.compile(rf'^(\s*)("{key}": |{key}=)[^\n]*?,  # {re.escape(TODO)}[^\n]*$', re.M)
    assert pattern.search(source), f"no marked field {key!r}"
    return pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}{value},", source, count=1)


def test_after_filling_in_the_processor_check_tiny_passes(
    tmp_path, monkeypatch, capsys, vlmreg_fresh_registry, forget_modules
):
    """The author's edits for LLaVA: the tutorial's tiny processor, and the marked tiny-config fields made to agree with
    it."""
    name = "x_llava_done"
    assert main(["new-family", name, "--from-model-type", "llava", "--output", str(tmp_path)]) == 0
    capsys.readouterr()
    folder = tmp_path / "vlmreg-x-llava-done"
    package = folder / "src" / f"vlmreg_{name}"
    (package / "processor.py").write_text(TINY_LLAVA_PROCESSOR.read_text())
    source = (package / "__init__.py").read_text()
    for key, value in {
        "image_size": "32",
        "patch_size": "8",
        "vocab_size": "p.VOCAB_SIZE",
        "pad_token_id": "0",
        "bos_token_id": "1",
        "eos_token_id": "2",
        "image_token_index": "p.IMAGE_TOKEN_ID",
        "image_seq_length": "16",
    }.items():
        source = fill(source, key, value)
    source = source.replace(
        "    from transformers import LlavaConfig\n",
        f"    from transformers import LlavaConfig\n\n    from vlmreg_{name} import processor as p\n",
    )
    source = source.replace(
        "\ndef descriptor()",
        f"\ndef tiny_processor():\n    from vlmreg_{name}.processor import tiny_processor as build\n\n    return "
        "build()\n\n\ndef descriptor()",
    )
    source = fill(source, "tiny_processor", "tiny_processor")
    (package / "__init__.py").write_text(source)
    install(folder, name, monkeypatch, tmp_path / "site")

    assert main(["check", "--tiny", name]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "FAIL" not in out and "ok prompt" in out and f"ok family {name} resolves" in out
    # And the skeleton's own conformance tests, all of them, as the author runs them.
    run = run_generated_tests(folder, tmp_path / "site")
    passed = set(re.findall(r"^PASSED \S+::\w+::(\w+)", run.stdout, re.M))
    assert run.returncode == 0 and passed >= STRUCTURAL | PROCESSOR_CHECKS, run.stdout[-3000:]


def run_generated_tests(folder: Path, site: Path) -> subprocess.CompletedProcess:
    distribution = folder.name  # vlmreg-NAME
    env = with_plugin({**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(folder / "src")])}, distribution)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "tests"],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=600,
    )


def test_the_generated_conformance_tests_before_any_edit(tmp_path):
    """Run the skeleton's own tests/ as its author would: the structural checks pass, the processor ones fail saying
    why."""
    assert main(["new-family", "x_llava_raw", "--from-model-type", "llava", "--output", str(tmp_path)]) == 0
    folder = tmp_path / "vlmreg-x-llava-raw"
    site = tmp_path / "site"
    info = site / "vlmreg_x_llava_raw-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vlmreg-x-llava-raw\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[vlmreg]\nx_llava_raw = vlmreg_x_llava_raw\n")
    run = run_generated_tests(folder, site)
    passed = set(re.findall(r"^PASSED \S+::\w+::(\w+)", run.stdout, re.M))
    assert passed == STRUCTURAL, run.stdout[-3000:]
    failed = set(re.findall(r"^FAILED \S+::\w+::(\w+)", run.stdout, re.M))
    assert failed == PROCESSOR_CHECKS and "has no tiny_processor" in run.stdout, run.stdout[-3000:]


STRUCTURAL = {
    "test_registered_through_an_entry_point",
    "test_tiny_config_is_claimed",
    "test_resolves",
    "test_weight_prefix_covers_every_layer_in_the_state_dict",
    "test_resolves_on_the_meta_device",
}
# The checks that feed an image through the family's processor (LoRA training needs a forward pass with one).
PROCESSOR_CHECKS = {
    "test_every_lora_preset_applies_and_trains",
    "test_forward_with_an_image",
    "test_prompt_ids_and_inputs_equal_the_processors",
    "test_logprobs_equal_a_plain_forward_alone_padded_and_packed",
    "test_generation_stops_at_the_turn_end_and_mixed_sizes_generate",
    "test_three_turns_continue_from_sampled_tokens_and_merge",
    "test_tokenizer_fits_the_embeddings",
    "test_video_prompts_equal_the_processors_or_video_is_refused",
    "test_video_logprobs_equal_a_plain_forward_alone_padded_and_packed",
}


def test_unknown_model_type_suggests_the_close_ones(capsys, tmp_path):
    message = error_of(capsys, "new-family", "x", "--from-model-type", "lava", "--output", str(tmp_path))
    assert (
        message.startswith("error: Unknown model type 'lava' in transformers")
        and "Did you mean" in message
        and "'llava'" in message
    )
    assert not any(tmp_path.iterdir())


def test_a_type_without_a_vision_to_text_class_is_refused(capsys, tmp_path):
    message = error_of(capsys, "new-family", "x", "--from-model-type", "llama", "--output", str(tmp_path))
    assert "'llama' has no image-text-to-text class" in message
    assert not any(tmp_path.iterdir())


def test_a_type_whose_default_config_does_not_build_is_refused_as_the_tutorial_says(capsys, tmp_path):
    message = error_of(capsys, "new-family", "x", "--from-model-type", "aya_vision", "--output", str(tmp_path))
    assert "cannot build AyaVisionConfig (model_type 'aya_vision') on the meta device" in message
    assert (
        "embed_dim must be divisible by num_heads" in message and "embed_dim must be divisible by num_heads" in TUTORIAL
    )
    assert not any(tmp_path.iterdir())


def test_the_tutorial_shows_the_real_output(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    command = "vlmreg new-family my_llava --from-model-type llava"
    assert f"```bash\n{command}\n```" in TUTORIAL
    assert main(command.split()[1:]) == 0
    out = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    shown = TUTORIAL.split(f"{command}\n```", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    for line in shown.splitlines():
        if line.strip() != "...":
            assert " ".join(line.split()) in out, line
    source = (tmp_path / "vlmreg-my-llava" / "src" / "vlmreg_my_llava" / "__init__.py").read_text()
    assert (
        'my_llava = "vlmreg_my_llava"' in (tmp_path / "vlmreg-my-llava" / "pyproject.toml").read_text()
        and 'my_llava = "vlmreg_my_llava"' in TUTORIAL
    )
    for key in (
        "vocab_size",
        "image_token_index",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "image_size",
        "patch_size",
        "image_seq_length",
    ):
        assert f"`{key}`" in TUTORIAL and any(key in line and TODO in line for line in source.splitlines()), key


def test_an_existing_output_folder_is_refused(capsys, tmp_path):
    (tmp_path / "vlmreg-x-llava").mkdir()
    message = error_of(capsys, "new-family", "x_llava", "--from-model-type", "llava", "--output", str(tmp_path))
    assert message == f"error: {tmp_path / 'vlmreg-x-llava'} already exists; remove it or pass another --output"


@pytest.mark.parametrize("name", ["My-Family", "9lives", "for-x", ""])
def test_a_name_that_is_not_an_identifier_is_refused(capsys, tmp_path, name):
    message = error_of(capsys, "new-family", name, "--from-model-type", "llava", "--output", str(tmp_path))
    assert "is not a lower-case Python identifier" in message


def test_a_registered_family_name_or_claimed_type_is_refused(capsys, tmp_path):
    message = error_of(capsys, "new-family", "gemma3", "--from-model-type", "llava", "--output", str(tmp_path))
    assert message == "error: family 'gemma3' is already registered by vlmreg-gemma3; pick another name"
    message = error_of(capsys, "new-family", "my_gemma", "--from-model-type", "gemma3", "--output", str(tmp_path))
    assert "model type 'gemma3' is already claimed by the installed family 'gemma3'" in message


@pytest.mark.parametrize(
    "family", ["gemma3", "idefics3", "qwen2_5_vl", "internvl", "glm4v", "llava_onevision", "paligemma"]
)
def test_the_paths_found_are_the_bundled_families_own(family):
    """An independent check of the discovery: on bundled families, it finds what their authors wrote by hand."""

    descriptor = get_registry().get(family)
    layout = find_layout(build_on_meta(AutoConfig.for_model(descriptor.model_types[0])))
    assert (layout.vision_encoder_attr, layout.language_model_attr, layout.layers_attr, layout.lm_head_attr) == (
        descriptor.vision_encoder_attr,
        descriptor.language_model_attr,
        descriptor.layers_attr,
        descriptor.lm_head_attr,
    )
    assert layout.vision_blocks_attr == descriptor.vision_blocks_attr
    assert set(layout.connector_attrs) <= set(descriptor.connector_attrs)


def test_families_still_imports_no_torch():
    code = (
        "import sys; from vlmreg.cli import main; main(['families', '--json']); print(sorted(m for m in ('torch', "
        "'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
