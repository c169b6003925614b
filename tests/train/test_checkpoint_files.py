"""What a checkpoint's folder must hold, and what each problem with it says: missing files, a damaged state.json, a
rejected state, no checkpoint at all.

The references are the files on disk as the test leaves them (removed, rewritten with plain json and safetensors)
and the weights the model had when it saved, cloned by the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vlmreg.train import checkpoint as checkpoint_module
from vlmreg.train.checkpoint import (
    CheckpointError,
    checkpoint_steps,
    latest_checkpoint,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def edit_state(path: Path, **changes) -> None:
    file = path / "state.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


@pytest.mark.parametrize("missing", ["state.json", "trainable.safetensors", "optimizer.safetensors", "rng.safetensors"])
def test_loading_a_folder_without_one_of_its_files_names_it_missing(tmp_path, missing):
    model, optimizer = tiny()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    (path / missing).unlink()
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, optimizer)
    assert str(caught.value) == f"{path / missing} is missing (an incomplete checkpoint)"


def test_for_evaluation_the_optimizer_state_is_not_needed(tmp_path):
    model, optimizer = tiny()
    saved = weights(model)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"note": "kept"})
    (path / "optimizer.safetensors").unlink()
    with torch.no_grad():
        model.weight.add_(1.0)
    logged: list[str] = []
    assert resume_checkpoint(tmp_path, model, None, log=logged.append) == (path, {"step": 1, "note": "kept"})
    assert logged == [] and same(model, saved)


def test_a_missing_file_is_named_before_any_file_is_read(tmp_path):
    """For training, the optimizer state is one of the files a complete checkpoint has: its absence is the error,
    even where another file (here state.json) is damaged too."""
    model, optimizer = tiny()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    (path / "optimizer.safetensors").unlink()
    (path / "state.json").write_text("{")
    with pytest.raises(CheckpointError) as caught:
        resume_checkpoint(tmp_path, model, optimizer, log=lambda message: None)
    assert str(caught.value) == (
        f"no usable checkpoint in {tmp_path}: {path / 'optimizer.safetensors'} is missing (an incomplete checkpoint)"
    )


def test_a_checkpoint_at_step_0_loads(tmp_path):
    model, optimizer = tiny()
    path = save_checkpoint(tmp_path, 0, model, optimizer, {})
    assert path.name == "step_000000" and load_checkpoint(path, model, optimizer)["step"] == 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "a JSON object was expected, found list"),
        ('"step"', "a JSON object was expected, found str"),
        (json.dumps({"step": "1"}), "'step' is '1', not a step number"),
        (json.dumps({"step": None}), "'step' is None, not a step number"),
        (json.dumps({"step": 1.0}), "'step' is 1.0, not a step number"),
        (json.dumps({"step": -1}), "'step' is -1, not a step number"),
        (json.dumps({"step": 2}), "it says step 2 in folder step_000001"),
    ],
    ids=["list", "string", "step-text", "step-null", "step-float", "step-negative", "step-of-another-folder"],
)
def test_a_damaged_state_json_says_what_is_wrong(tmp_path, content, message):
    model, optimizer = tiny()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    (path / "state.json").write_text(content)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, optimizer)
    assert str(caught.value) == f"{path / 'state.json'} is damaged: {message}"


def test_every_checkpoint_a_rejected_state_skips_is_warned_about_and_listed(tmp_path):
    model, optimizer = tiny()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, optimizer, {"source": {"epoch": step}}, keep=3)

    def check_state(state):
        if state["source"]["epoch"] >= 2:
            raise ValueError(f"epoch {state['source']['epoch']} is past this data")

    logged: list[str] = []
    path, state = resume_checkpoint(tmp_path, model, optimizer, log=logged.append, check_state=check_state)
    assert path.name == "step_000001" and state == {"step": 1, "source": {"epoch": 1}}
    assert logged == [
        (
            f"warning: skipped checkpoint step_000003: {tmp_path / 'step_000003' / 'state.json'} is damaged: "
            "ValueError: epoch 3 is past this data"
        ),
        (
            f"warning: skipped checkpoint step_000002: {tmp_path / 'step_000002' / 'state.json'} is damaged: "
            "ValueError: epoch 2 is past this data"
        ),
        "warning: resuming from step_000001, the newest good checkpoint, after skipping 2 newer one(s)",
    ]

    def reject_all(state):
        raise KeyError("source")

    with pytest.raises(CheckpointError) as caught:
        resume_checkpoint(tmp_path, model, optimizer, log=lambda message: None, check_state=reject_all)
    assert str(caught.value) == f"no usable checkpoint in {tmp_path}: " + "; ".join(
        f"{tmp_path / f'step_00000{n}' / 'state.json'} is damaged: KeyError: 'source'" for n in (3, 2, 1)
    )


def test_a_folder_without_checkpoints_is_one_error_naming_it(tmp_path):
    model, optimizer = tiny()
    (tmp_path / "step_5").mkdir()  # not a checkpoint's name
    with pytest.raises(CheckpointError) as caught:
        resume_checkpoint(tmp_path, model, optimizer)
    assert str(caught.value) == f"no checkpoint in {tmp_path}"


@pytest.mark.parametrize("key", ["weight", "other::exp_avg", "::exp_avg"], ids=["no-separator", "unknown", "unnamed"])
def test_optimizer_state_that_names_no_trainable_weight_is_refused_naming_it(tmp_path, key):
    model, optimizer = tiny()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    state = load_file(path / "optimizer.safetensors")
    save_file({**state, key: torch.zeros(2, 3)}, path / "optimizer.safetensors")
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, optimizer)
    assert str(caught.value) == (
        f"{path / 'optimizer.safetensors'}: optimizer state {key!r} belongs to no trainable weight of this model"
    )


def test_a_model_with_more_weights_than_the_checkpoint_names_three_it_lacks(tmp_path):
    narrow = torch.nn.Linear(2, 2)
    path = save_checkpoint(tmp_path, 1, narrow, torch.optim.AdamW(narrow.parameters()), {})
    wide = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(3)))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, wide, None)
    assert "(missing ['0.bias', '0.weight', '1.bias'], unexpected ['bias', 'weight'])" in str(caught.value)


def test_a_python_rng_state_python_refuses_is_named_with_pythons_error(tmp_path):
    model, optimizer = tiny()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    edit_state(path, python_random=[99, [1, 2], None])  # version 99: random.setstate's own error
    with pytest.raises(ValueError) as python:
        random.Random().setstate((99, (1, 2), None))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, optimizer)
    assert str(caught.value) == (
        f"{path / 'state.json'} is damaged: 'python_random' is not a Python RNG state (ValueError: {python.value})"
    )


def test_latest_checkpoint_skips_incomplete_ones_with_a_warning_and_needs_no_optimizer_state(tmp_path):
    model, optimizer = tiny()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, optimizer, {}, keep=3)
    (tmp_path / "step_000003" / "state.json").unlink()
    (tmp_path / "step_000002" / "optimizer.safetensors").unlink()  # enough to evaluate
    logged: list[str] = []
    assert latest_checkpoint(tmp_path, log=logged.append) == tmp_path / "step_000002"
    assert logged == [
        (
            f"warning: skipped checkpoint step_000003: {tmp_path / 'step_000003' / 'state.json'} is missing (an "
            "incomplete checkpoint)"
        )
    ]


@pytest.mark.parametrize(
    ("pointer", "warning"),
    [
        (
            "../elsewhere/step_000009",
            "does not hold a step_NNNNNN name in this folder; ignored, trying the newest checkpoint",
        ),
        ("step_000007", "names step_000007, which does not exist (as a folder); trying the newest earlier checkpoint"),
        (None, "is missing; trying the newest checkpoint"),
    ],
    ids=["not-a-step-name", "a-missing-step", "no-pointer"],
)
def test_a_latest_pointer_that_cannot_be_followed_is_warned_about(tmp_path, pointer, warning):
    model, optimizer = tiny()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, optimizer, {})
    if pointer is None:
        (tmp_path / "latest").unlink()
    else:
        (tmp_path / "latest").write_text(pointer)
    logged: list[str] = []
    assert latest_checkpoint(tmp_path, log=logged.append) == tmp_path / "step_000002"
    assert logged == [f"warning: {tmp_path / 'latest'} {warning}"]


def test_a_checkpoint_newer_than_the_one_latest_names_is_not_taken(tmp_path):
    """A step folder above ``latest`` (renamed into place by a run killed before it moved the pointer, or left by
    another run) is not the run's last good checkpoint."""
    model, optimizer = tiny()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, optimizer, {}, keep=3)
    (tmp_path / "latest").write_text("step_000002")
    logged: list[str] = []
    assert latest_checkpoint(tmp_path, log=logged.append) == tmp_path / "step_000002"
    assert resume_checkpoint(tmp_path, model, optimizer, log=logged.append)[0] == tmp_path / "step_000002"
    assert logged == []


def test_a_file_that_cannot_be_read_back_after_writing_fails_the_write_naming_it(tmp_path, monkeypatch):
    model, optimizer = tiny()

    def lost_tail(tensors, path, *args, **kwargs):  # the disk took only half of the file, and said nothing
        save_file(tensors, path, *args, **kwargs)
        if path.name == "optimizer.safetensors":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    monkeypatch.setattr(checkpoint_module, "save_file", lost_tail)
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(tmp_path, 1, model, optimizer, {})
    assert re.fullmatch(
        rf"could not write checkpoint {re.escape(str(tmp_path / 'step_000001'))}: optimizer\.safetensors is "
        r"incomplete after writing \(.+\); is the disk full\?; the partial \.tmp-step_000001 was removed and there "
        r"is no earlier checkpoint",
        str(caught.value),
    )
    assert list(tmp_path.iterdir()) == []


@contextlib.contextmanager
def undeletable(folder: Path):
    """A folder whose entries nobody can delete, root included (``chattr +i`` as root, where permissions do not
    bind)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        undo = lambda: folder.chmod(0o755)  # noqa: E731
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        undo = lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)  # noqa: E731
    else:
        pytest.skip("running as root where chattr +i is unavailable: every folder can be deleted")
    try:
        yield
    finally:
        undo()


def test_a_folder_retention_cannot_delete_does_not_fail_the_checkpoint(tmp_path):
    """Retention is housekeeping: an old checkpoint or a partial folder it cannot delete stays, and the new
    checkpoint is written and named by ``latest`` all the same."""
    model, optimizer = tiny()
    save_checkpoint(tmp_path, 1, model, optimizer, {}, keep=1)
    for folder in (tmp_path / "step_000001" / "stuck", tmp_path / ".tmp-step_000009" / "stuck"):
        folder.mkdir(parents=True)
        (folder / "file").write_text("x")
    with undeletable(tmp_path / "step_000001" / "stuck"), undeletable(tmp_path / ".tmp-step_000009" / "stuck"):
        for step in (2, 3):
            save_checkpoint(tmp_path, step, model, optimizer, {}, keep=1)
            assert (tmp_path / "latest").read_text() == f"step_{step:06d}"
    assert (tmp_path / "step_000001" / "stuck" / "file").is_file()
    assert (tmp_path / ".tmp-step_000009" / "stuck" / "file").is_file()
    assert not (tmp_path / "step_000002").exists() and (tmp_path / "step_000003" / "state.json").is_file()


def test_keeping_one_checkpoint_keeps_only_the_newest(tmp_path):
    model, optimizer = tiny()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, optimizer, {}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000003"]


def json_error(text: str) -> str:
    try:
        json.loads(text)
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"{text!r} is JSON")


@pytest.mark.parametrize(
    ("listed", "problem"),
    [
        (
            "{",
            f"its 'python_numbers' metadata is not JSON ({json_error('{')})",
        ),
        ('["bias::step"]', "its 'python_numbers' metadata is not a map from its scalars to ['bool', 'float', 'int']"),
        (
            '{"bias::step": "complex"}',
            "its 'python_numbers' metadata is not a map from its scalars to ['bool', 'float', 'int']",
        ),
        (
            '{"bias::nothing": "int"}',
            "its 'python_numbers' metadata is not a map from its scalars to ['bool', 'float', 'int']",
        ),
        (
            '{"bias::exp_avg": "float"}',
            "its 'python_numbers' metadata is not a map from its scalars to ['bool', 'float', 'int']",
        ),
        (  # a type that is not a string (a list cannot even be looked up: once a TypeError)
            '{"bias::step": ["int"]}',
            "its 'python_numbers' metadata is not a map from its scalars to ['bool', 'float', 'int']",
        ),
    ],
    ids=["not-json", "not-a-map", "unknown-type", "absent-state", "not-a-scalar", "type-not-a-string"],
)
def test_a_damaged_list_of_python_numbers_is_named(tmp_path, listed, problem):
    model, optimizer = tiny()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    file = path / "optimizer.safetensors"
    save_file(load_file(file), file, metadata={"python_numbers": listed})
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, optimizer)
    assert str(caught.value) == f"{file} is damaged: {problem}"


def test_the_python_numbers_an_optimizer_kept_are_saved_exactly_and_listed(tmp_path):
    """The file as safetensors reads it: each number at full precision (float64, int64), its type in the metadata."""
    model, optimizer = tiny()
    optimizer.state[model.weight].update({"count": 3, "scale": 0.1, "warm": True})
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    with safe_open(path / "optimizer.safetensors", "pt") as f:
        listed = json.loads(f.metadata()["python_numbers"])
        saved = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    assert listed == {"weight::count": "int", "weight::scale": "float", "weight::warm": "bool"}
    assert saved["weight::scale"].dtype == torch.float64 and saved["weight::scale"].item() == 0.1
    assert saved["weight::count"].dtype == torch.int64 and saved["weight::count"].item() == 3
    assert saved["weight::warm"].item() == 1 and saved["weight::step"].dtype == torch.float32  # AdamW's: a tensor
    fresh = torch.optim.AdamW(model.parameters())
    load_checkpoint(path, model, fresh)
    kept = fresh.state[model.weight]
    assert (kept["count"], kept["scale"], kept["warm"]) == (3, 0.1, True)
    assert [type(kept[k]) for k in ("count", "scale", "warm")] == [int, float, bool]
    assert torch.is_tensor(kept["step"]) and torch.equal(kept["step"], optimizer.state[model.weight]["step"])


def test_a_checkpoint_folder_is_made_with_its_parents(tmp_path):
    model, optimizer = tiny()
    directory = tmp_path / "run" / "checkpoints"
    assert save_checkpoint(directory, 1, model, optimizer, {}) == directory / "step_000001"
    assert (directory / "latest").read_text() == "step_000001"


def test_a_partial_folder_of_the_same_step_left_by_a_killed_run_is_replaced(tmp_path):
    model, optimizer = tiny()
    (tmp_path / ".tmp-step_000002").mkdir()
    (tmp_path / ".tmp-step_000002" / "trainable.safetensors").write_bytes(b"\x00" * 10)  # half written
    (tmp_path / ".tmp-step_000002" / "stale").write_text("x")
    path = save_checkpoint(tmp_path, 2, model, optimizer, {})
    assert sorted(p.name for p in path.iterdir()) == [
        "optimizer.safetensors",
        "rng.safetensors",
        "state.json",
        "trainable.safetensors",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002"]


def test_a_run_killed_while_swapping_in_a_rewritten_step_leaves_folders_the_next_checkpoint_removes(
    tmp_path, monkeypatch
):
    """The same step written again (a run resumed from before it) swaps the old folder out first; a kill between
    the two renames leaves the old one and the new one under temporary names, which the next checkpoint removes."""
    model, optimizer = tiny()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, optimizer, {})
    real_replace = os.replace

    def killed_after_the_first_rename(src, dst):
        real_replace(src, dst)
        if Path(dst).name.startswith(".tmp-old-"):
            raise KeyboardInterrupt  # as a kill: not an error the writer handles

    monkeypatch.setattr(checkpoint_module.os, "replace", killed_after_the_first_rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, optimizer, {})
    monkeypatch.setattr(checkpoint_module.os, "replace", real_replace)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp-old-step_000002",
        ".tmp-step_000002",
        "latest",
        "step_000001",
    ]
    save_checkpoint(tmp_path, 3, model, optimizer, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001", "step_000003"]


def test_a_step_written_again_over_a_swapped_out_folder_left_by_a_killed_run(tmp_path):
    model, optimizer = tiny()
    save_checkpoint(tmp_path, 2, model, optimizer, {})
    (tmp_path / ".tmp-old-step_000002").mkdir()
    (tmp_path / ".tmp-old-step_000002" / "state.json").write_text("{}")
    path = save_checkpoint(tmp_path, 2, model, optimizer, {"again": True})
    assert json.loads((path / "state.json").read_text())["again"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002"]


def test_a_pointer_that_cannot_be_written_is_an_error_and_latest_still_names_the_last_one(tmp_path):
    model, optimizer = tiny()
    save_checkpoint(tmp_path, 1, model, optimizer, {})
    (tmp_path / ".latest.tmp").mkdir()  # anything that makes writing the new pointer fail
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(tmp_path, 2, model, optimizer, {})
    assert str(caught.value) == (
        f"could not write checkpoint {tmp_path / 'step_000002'}: Is a directory; the partial .tmp-step_000002 was "
        f"removed and {tmp_path / 'latest'} still names step_000001"
    )
    assert (tmp_path / "latest").read_text() == "step_000001"


def test_only_step_folders_count_as_checkpoints_not_files_or_links(tmp_path):
    model, optimizer = tiny()
    elsewhere = save_checkpoint(tmp_path / "elsewhere", 8, model, optimizer, {})
    directory = tmp_path / "checkpoints"
    save_checkpoint(directory, 1, model, optimizer, {})
    (directory / "step_000009").write_text("a file")
    (directory / "step_000008").symlink_to(elsewhere, target_is_directory=True)
    assert checkpoint_steps(directory) == [(1, directory / "step_000001")]
    assert checkpoint_steps(tmp_path / "absent") == []


@pytest.mark.parametrize(
    "pointer", [b"step_000001\n", b"\xff\xfe", None], ids=["with-a-newline", "not-text", "a-folder"]
)
def test_a_latest_pointer_is_read_as_a_name_with_surrounding_whitespace_ignored(tmp_path, pointer):
    model, optimizer = tiny()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, optimizer, {})
    latest = tmp_path / "latest"
    latest.unlink()
    if pointer is None:
        latest.mkdir()
    else:
        latest.write_bytes(pointer)
    logged: list[str] = []
    found = latest_checkpoint(tmp_path, log=logged.append)
    if pointer == b"step_000001\n":
        assert found == tmp_path / "step_000001" and logged == []
    else:
        assert found == tmp_path / "step_000002"
        assert logged == [
            f"warning: {latest} does not hold a step_NNNNNN name in this folder; ignored, trying the newest checkpoint"
        ]


def test_optimizer_state_that_is_neither_a_tensor_nor_a_number_is_refused_naming_it(tmp_path):
    model, optimizer = tiny()
    optimizer.state[model.weight]["history"] = [0.1, 0.2]
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(tmp_path, 1, model, optimizer, {})
    assert str(caught.value) == (
        "optimizer state 'weight::history' is a list: a checkpoint holds tensors and Python numbers only"
    )
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_an_optimizer_file_without_the_list_of_python_numbers_loads(tmp_path):
    """As written before the list was kept: every state is a tensor."""
    model, optimizer = tiny()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    file = path / "optimizer.safetensors"
    save_file(load_file(file), file)
    with safe_open(file, "pt") as f:
        assert not (f.metadata() or {})
    fresh = torch.optim.AdamW(model.parameters())
    load_checkpoint(path, model, fresh)
    assert all(
        torch.equal(fresh.state[p][k], optimizer.state[p][k]) for p in model.parameters() for k in optimizer.state[p]
    )


def test_a_rewritten_step_whose_pointer_cannot_be_written_leaves_no_swapped_out_folder(tmp_path):
    model, optimizer = tiny()
    save_checkpoint(tmp_path, 2, model, optimizer, {})
    (tmp_path / ".latest.tmp").mkdir()  # writing the pointer fails after the new step_000002 is in place
    with pytest.raises(CheckpointError, match=r"Is a directory; .* still names step_000002$"):
        save_checkpoint(tmp_path, 2, model, optimizer, {"again": True})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".latest.tmp", "latest", "step_000002"]
    assert json.loads((tmp_path / "step_000002" / "state.json").read_text())["again"] is True
