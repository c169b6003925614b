"""Nothing is lost and nothing damaged is trained on: run directories, locks, retention, resume, disk faults.

Real tiny CPU runs through the CLI; damage is done to the real files on disk; disk faults are injected into the
checkpoint writer. Each error must be one line naming the path at fault, with no traceback.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vlmreg.cli import main
from vlmreg.cli.config_cmds import load_resolved
from vlmreg.sdk.errors import VlmregError
from vlmreg.train import checkpoint as checkpoint_module
from vlmreg.train import recipe
from vlmreg.train.checkpoint import CheckpointError, checkpoint_steps, load_checkpoint, save_checkpoint
from vlmreg.train.metrics import MetricsWriter, records_up_to
from vlmreg.train.recipe import Trainer
from vlmreg.train.rundir import PREVIOUS_NAME, RUN_OUTPUTS

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml")
FAST = [
    "--set",
    "trainer.format_warmup_steps=0",
    "--set",
    "eval.every=0",
    "--set",
    "logging.rollout_page_every=0",
    "--set",
    "trainer.prompts_per_step=2",
    "--set",
    "rollout.group_size=2",
    "--set",
    "trainer.save_every=1",
]


def train(out: Path, steps: int, *extra: str) -> int:
    return main(["train", MAIN, *FAST, "--set", f"trainer.steps={steps}", "--output-dir", str(out), *extra])


def steps_in_metrics(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and "unexpected" not in err, err
    return " ".join(err.split())


def snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step run: metrics for steps 1-3, checkpoints step_000002 and step_000003, ``latest`` at 3."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train(out, 3) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000003"]
    return out


@pytest.fixture
def run(finished: Path, tmp_path: Path) -> Path:
    """A private copy of the finished run, to damage."""
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


@pytest.fixture
def no_model_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checks that must happen before the model loads: loading it is a test failure."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the output directory was checked")

    monkeypatch.setattr("vlmreg.train.recipe.load", refuse)


# -- an output directory that holds a run ---------------------------------------------------------


def test_a_fresh_run_into_a_finished_run_is_refused_and_touches_nothing(run, capsys):
    before = snapshot(run)
    assert train(run, 2) == 1
    err = one_line_error(capsys)
    assert f"output directory {run} already holds a run" in err
    assert "step_000003" in err and "--resume" in err and "--overwrite" in err
    assert snapshot(run) == before


def run_outputs(snap: dict[str, str]) -> dict[str, str]:
    """The part of a `snapshot` that --overwrite moves: metrics.jsonl, checkpoints/, rollouts/, tensorboard/, ..."""
    return {name: digest for name, digest in snap.items() if Path(name).parts[0] in RUN_OUTPUTS}


def test_overwrite_moves_the_old_run_aside_intact_and_a_second_overwrite_keeps_both(run, capsys):
    (run / "notes.txt").write_text("mine")
    first_run = run_outputs(snapshot(run))
    assert "metrics.jsonl" in first_run and "checkpoints/step_000003/state.json" in first_run
    assert train(run, 2, "--overwrite") == 0
    out = capsys.readouterr().out
    [first_aside] = list((run / PREVIOUS_NAME).iterdir())
    assert f"--overwrite: moved the previous run in {run} (" in out and f"to {first_aside}" in out
    assert snapshot(first_aside) == first_run  # every file of the old run, byte for byte
    assert steps_in_metrics(first_aside) == [1, 2, 3]
    assert (first_aside / "checkpoints" / "latest").read_text() == "step_000003"
    # the new run starts clean beside it: no old step_000003 in its checkpoints or metrics
    assert steps_in_metrics(run) == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"
    assert (run / "notes.txt").read_text() == "mine"

    second_run = run_outputs(snapshot(run))
    assert train(run, 1, "--overwrite") == 0
    assert "--overwrite: moved the previous run" in capsys.readouterr().out
    asides = sorted((run / PREVIOUS_NAME).iterdir())
    assert len(asides) == 2 and first_aside in asides
    [second_aside] = [a for a in asides if a != first_aside]
    assert snapshot(first_aside) == first_run and snapshot(second_aside) == second_run
    assert steps_in_metrics(run) == [1]
    assert (run / "notes.txt").read_text() == "mine"


def test_overwrite_refuses_a_previous_that_is_not_a_directory_and_moves_nothing(run, capsys):
    (run / PREVIOUS_NAME).write_text("not a folder")
    before = snapshot(run)
    assert train(run, 2, "--overwrite") == 1
    err = one_line_error(capsys)
    assert f"--overwrite: {run / PREVIOUS_NAME} is not a directory" in err
    assert snapshot(run) == before


def test_resume_and_overwrite_together_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train(tmp_path / "run", 1, "--resume", "--overwrite")
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


# -- one trainer per directory --------------------------------------------------------------------


def test_a_second_trainer_in_the_same_directory_is_refused_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    first = Trainer(load_resolved(MAIN, FAST[1::2]), output_dir=out, log=lambda message: None)
    first.setup()
    try:
        assert (out / ".lock").read_text().strip() == str(os.getpid())
        assert train(out, 1) == 1
        err = one_line_error(capsys)
        assert f"output directory {out} is in use by another trainer (pid {os.getpid()}" in err
        assert not (out / "metrics.jsonl").read_text()  # the second trainer wrote nothing
    finally:
        first.cleanup()
    assert train(out, 1) == 0  # cleanup released the lock
    assert steps_in_metrics(out) == [1]


HOLD = (
    "import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
    "f.write(str(os.getpid())); f.flush(); print('locked', flush=True); time.sleep(120)"
)


def test_a_lock_held_by_another_process_is_refused_and_a_killed_holder_leaves_no_stale_lock(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert train(out, 1) == 1
        assert f"(pid {holder.pid}, lock {out / '.lock'})" in one_line_error(capsys)
    finally:
        holder.kill()
        holder.wait()
    assert train(out, 1) == 0  # killed with -9: the kernel dropped its lock, the pid left in the file does not matter
    assert (out / ".lock").read_text().strip() == str(os.getpid())


# -- retention --------------------------------------------------------------------------------------


def tiny_training_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_retention_counts_only_step_folders_in_step_order_and_never_deletes_latest(tmp_path):
    directory = tmp_path / "checkpoints"
    for name in ("step_5", "step_000002.bak", "notes", ".tmp-step_000007"):
        (directory / name).mkdir(parents=True)
    model, optimizer = tiny_training_state()
    for step in (999_998, 999_999, 1_000_000, 1_000_001):  # step_1000000 sorts before step_999999 as text
        save_checkpoint(directory, step, model, optimizer, {}, keep=2)
        latest = (directory / "latest").read_text()
        assert latest == f"step_{step:06d}" and (directory / latest / "state.json").is_file()
    assert [n for n, _ in checkpoint_steps(directory)] == [1_000_000, 1_000_001]
    assert sorted(p.name for p in directory.iterdir()) == [
        "latest",
        "notes",
        "step_000002.bak",
        "step_1000000",
        "step_1000001",
        "step_5",
    ]


def test_retention_never_deletes_the_new_checkpoint_for_older_higher_steps(tmp_path):
    """The issue's data-loss path: step folders of another lineage sort above the run's own and must not push them
    out."""
    directory = tmp_path / "checkpoints"
    model, optimizer = tiny_training_state()
    for step in (50, 51):
        save_checkpoint(directory, step, model, optimizer, {}, keep=2)
    for step in (1, 2, 3):
        save_checkpoint(directory, step, model, optimizer, {}, keep=2)
        assert (directory / (directory / "latest").read_text() / "state.json").is_file()
    assert [n for n, _ in checkpoint_steps(directory)] == [2, 3, 50, 51]


# -- resume from damaged state ------------------------------------------------------------------------


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def rewrite(file: Path, change) -> None:
    tensors = load_file(file)
    name = sorted(tensors)[0]
    tensors[name] = change(tensors[name])
    save_file(tensors, file)


def poison(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[0] = float("nan")
    return tensor


DAMAGE = {
    "truncated-weights": ("trainable.safetensors", lambda step: truncate(step / "trainable.safetensors")),
    "garbage-state-json": ("state.json", lambda step: (step / "state.json").write_bytes(b"\x00garbage{")),
    "missing-optimizer": ("optimizer.safetensors", lambda step: (step / "optimizer.safetensors").unlink()),
    "wrong-shape": (
        "trainable.safetensors",
        lambda step: rewrite(step / "trainable.safetensors", lambda t: torch.cat([t, t])),
    ),
    "wrong-dtype": ("trainable.safetensors", lambda step: rewrite(step / "trainable.safetensors", lambda t: t.half())),
    "nan-weights": ("trainable.safetensors", lambda step: rewrite(step / "trainable.safetensors", poison)),
    "nan-optimizer": (
        "optimizer.safetensors",
        lambda step: rewrite(step / "optimizer.safetensors", lambda t: t * float("inf")),
    ),
    "bad-rng": (
        "rng.safetensors",
        lambda step: save_file({"torch_cpu_rank0": torch.zeros(7)}, step / "rng.safetensors"),
    ),
    "bad-data-position": (
        "state.json",
        lambda step: (step / "state.json").write_text(
            json.dumps({**json.loads((step / "state.json").read_text()), "source": {"epoch": "x"}})
        ),
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_good_one(run, capsys, damage):
    culprit, do = DAMAGE[damage]
    do(run / "checkpoints" / "step_000003")
    assert train(run, 4, "--resume") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"warning: skipped checkpoint step_000003: {run / 'checkpoints' / 'step_000003' / culprit}" in out
    assert f"resumed from {run / 'checkpoints' / 'step_000002'} (step 2)" in out
    assert steps_in_metrics(run) == [1, 2, 3, 4]  # the old step 3 was dropped and trained again
    assert (run / "checkpoints" / "latest").read_text() == "step_000004"


def test_latest_naming_a_missing_step_falls_back(run, capsys):
    shutil.rmtree(run / "checkpoints" / "step_000003")
    assert train(run, 4, "--resume") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{run / 'checkpoints' / 'latest'} names step_000003, which does not exist" in out
    assert "(step 2)" in out and steps_in_metrics(run) == [1, 2, 3, 4]


def test_latest_naming_a_path_outside_the_run_is_ignored(run, capsys, tmp_path):
    elsewhere = tmp_path / "elsewhere" / "step_000009"
    shutil.copytree(run / "checkpoints" / "step_000002", elsewhere)
    (run / "checkpoints" / "latest").write_text(str(elsewhere))
    assert train(run, 4, "--resume") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "does not hold a step_NNNNNN name in this folder; ignored" in out
    assert f"resumed from {run / 'checkpoints' / 'step_000003'} (step 3)" in out


def test_no_good_checkpoint_is_one_error_naming_each_file(run, capsys):
    truncate(run / "checkpoints" / "step_000003" / "trainable.safetensors")
    (run / "checkpoints" / "step_000002" / "state.json").write_text("[]")
    before = snapshot(run)
    assert train(run, 4, "--resume") == 1
    err = one_line_error(capsys)
    assert f"no usable checkpoint in {run / 'checkpoints'}" in err
    assert f"{run / 'checkpoints' / 'step_000003' / 'trainable.safetensors'} is damaged" in err
    assert f"{run / 'checkpoints' / 'step_000002' / 'state.json'} is damaged" in err
    assert snapshot(run) == before  # metrics.jsonl included: a failed resume truncates nothing


def test_eval_of_a_damaged_checkpoint_names_the_file(run, capsys):
    step = run / "checkpoints" / "step_000003"
    rewrite(step / "trainable.safetensors", poison)
    assert main(["eval", MAIN, "--checkpoint", str(step), "--set", "eval.num_samples=2"]) == 1
    err = one_line_error(capsys)
    assert f"{step / 'trainable.safetensors'}: weight" in err and "NaN or infinite" in err


def test_eval_of_a_run_falls_back_past_a_damaged_checkpoint_and_writes_nothing(run, capsys):
    truncate(run / "checkpoints" / "step_000003" / "rng.safetensors")
    before, locked = snapshot(run), (run / ".lock").stat().st_mtime_ns
    argv = [
        "eval",
        MAIN,
        "--checkpoint",
        str(run),
        "--json",
        "--set",
        "eval.num_samples=2",
        "--set",
        f"trainer.output_dir={run}",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["checkpoint"] == str(run / "checkpoints" / "step_000002")
    assert (
        f"skipped checkpoint step_000003: {run / 'checkpoints' / 'step_000003' / 'rng.safetensors'} is damaged"
        in " ".join(captured.err.split())
    )
    # the config's output directory: untouched
    assert snapshot(run) == before and (run / ".lock").stat().st_mtime_ns == locked


def test_load_checkpoint_applies_nothing_from_a_damaged_checkpoint(tmp_path):
    model, optimizer = tiny_training_state()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    rewrite(path / "optimizer.safetensors", poison)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: optimizer state .* NaN"):
        load_checkpoint(path, model, optimizer)
    assert all(torch.equal(v, changed[k]) for k, v in model.state_dict().items())  # weights untouched
    assert not all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_partial_last_metrics_line_is_dropped_on_resume(run, capsys):
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "reward_mean": 0.')  # killed while writing step 4's line
    assert train(run, 4, "--resume") == 0
    assert "dropped a partial last line" in capsys.readouterr().out
    assert steps_in_metrics(run) == [1, 2, 3, 4]


def test_a_garbled_metrics_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(VlmregError, match=rf"{path}:2 is not a JSON object"):
        records_up_to(path, 2, log=print)


# -- disk problems ------------------------------------------------------------------------------------


@contextlib.contextmanager
def read_only(path: Path):
    """A directory nobody can write, root included (``chattr +i`` as root, where permissions do not bind)."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        undo = lambda: path.chmod(0o755)  # noqa: E731
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        undo = lambda: subprocess.run(["chattr", "-i", str(path)], check=True)  # noqa: E731
    else:
        pytest.skip("running as root where chattr +i is unavailable: no directory is read-only")
    try:
        with pytest.raises(OSError):
            (path / "probe").write_text("x")
        yield
    finally:
        undo()


def test_a_read_only_output_directory_is_refused_before_the_model_loads(tmp_path, capsys, no_model_loading):
    out = tmp_path / "run"
    out.mkdir()
    with read_only(out):
        assert train(out, 1) == 1
    err = one_line_error(capsys)
    assert f"output directory {out} is not writable" in err


@pytest.mark.parametrize("where", ["under-a-file", "is-a-file", "checkpoints-is-a-file"])
def test_an_output_path_that_is_or_is_under_a_file_is_refused_before_the_model_loads(
    tmp_path, capsys, no_model_loading, where
):
    file = tmp_path / "file.txt"
    out, expected = {
        "under-a-file": (file / "run", f"is under {file}, which is a file"),
        "is-a-file": (file, "is a file, not a directory"),
        "checkpoints-is-a-file": (tmp_path, f"cannot hold checkpoints: {tmp_path / 'checkpoints'} is a file"),
    }[where]
    if where == "checkpoints-is-a-file":
        file = tmp_path / "checkpoints"
    file.write_text("keep me")
    assert train(out, 1) == 1
    assert f"output directory {out} {expected}" in one_line_error(capsys)
    assert file.read_text() == "keep me"


def test_a_metrics_write_that_fails_is_an_error_naming_the_file(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.path.unlink()
    writer.path.mkdir()  # anything that makes the append fail with an OSError
    with pytest.raises(VlmregError, match=rf"could not write {writer.path}: Is a directory"):
        writer.write({"step": 1})


def disk_full(real_save):
    """safetensors on a full disk: part of the file written, then its own I/O error."""

    def save(tensors, path, *args, **kwargs):
        if "step_000002" in str(path) and path.name == "optimizer.safetensors":
            path.write_bytes(b"\x00" * 4096)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, path, *args, **kwargs)

    return save


def lost_tail(real_save):
    """A write whose last buffer never reached the disk, with no error reported (as safetensors does on /dev/full)."""

    def save(tensors, path, *args, **kwargs):
        real_save(tensors, path, *args, **kwargs)
        if "step_000002" in str(path) and path.name == "trainable.safetensors":
            truncate(path)

    return save


@pytest.mark.parametrize("fault", [disk_full, lost_tail], ids=["disk-full", "lost-tail"])
def test_a_failed_checkpoint_write_keeps_the_last_good_one_and_ends_the_run_naming_the_path(
    tmp_path, capsys, monkeypatch, fault
):
    out = tmp_path / "run"
    monkeypatch.setattr(checkpoint_module, "save_file", fault(save_file))
    assert train(out, 3) == 1
    err = one_line_error(capsys)
    assert f"could not write checkpoint {out / 'checkpoints' / 'step_000002'}" in err
    assert "the partial .tmp-step_000002 was removed" in err and "still names step_000001" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert (out / "checkpoints" / "latest").read_text() == "step_000001"
    monkeypatch.setattr(checkpoint_module, "save_file", save_file)  # space again: the run resumes from the good one
    assert train(out, 2, "--resume") == 0
    assert f"resumed from {out / 'checkpoints' / 'step_000001'} (step 1)" in capsys.readouterr().out
    assert steps_in_metrics(out) == [1, 2]


def test_under_torchrun_rank_0_owns_the_directory_and_every_rank_stops_with_its_error(run):
    """Only rank 0 takes the lock; its refusal reaches rank 1 (no hang, nothing written)."""
    before = snapshot(run)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "vlmreg",
            "train",
            MAIN,
            *FAST,
            "--output-dir",
            str(run),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 2 and all(f"output directory {run} already holds a run" in line for line in lines), (
        result.stderr[-3000:]
    )
    assert snapshot(run) == before


def test_eval_of_a_missing_checkpoint_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def never(self):  # the model must not even start loading for a path that is not there
        raise AssertionError("setup ran")

    monkeypatch.setattr(recipe.Trainer, "setup", never)
    missing = tmp_path / "no-such-run" / "step_000003"
    assert main(["eval", MAIN, "--checkpoint", str(missing)]) == 1
    assert f"{missing}: no such checkpoint folder or run directory" in one_line_error(capsys)


def test_with_filesystem_syncs_a_run_resumes_and_is_overwritten(tmp_path):
    """The filesystem transport's syncs live in the run (OUTPUT/weights): a resumed run writes the step it starts from
    again (it failed: 'step_000002 already exists'), and --overwrite moves the old syncs aside with the rest (the new
    run's first sync was pruned at once as older than the old run's steps, and the server refused it)."""
    out = tmp_path / "run"
    served = [
        "--set",
        "rollout.engine=openai",
        "--set",
        "rollout.launch=true",
        "--set",
        "broadcast.transport=filesystem",
    ]
    assert train(out, 2, *served) == 0
    assert train(out, 3, *served, "--resume") == 0
    assert steps_in_metrics(out) == [1, 2, 3]
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["latest", "step_000002", "step_000003"]
    assert train(out, 1, *served, "--overwrite") == 0
    [aside] = list((out / PREVIOUS_NAME).iterdir())
    assert sorted(p.name for p in (aside / "weights").iterdir()) == ["latest", "step_000002", "step_000003"]
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["latest", "step_000000", "step_000001"]


@pytest.mark.parametrize(
    ("file", "change", "message"),
    [
        (
            "trainable.safetensors",
            poison,
            (
                r"trainable\.safetensors: weight '[^']+' holds 1 NaN or infinite value\(s\); the run diverged or the "
                r"file is damaged$"
            ),
        ),
        (
            "optimizer.safetensors",
            poison,
            (
                r"optimizer\.safetensors: optimizer state '[^']+' holds 1 NaN or infinite value\(s\); the run "
                r"diverged or the file is damaged$"
            ),
        ),
        (
            "trainable.safetensors",
            lambda t: t.half(),
            (
                r"trainable\.safetensors: weight '[^']+' is torch\.float16, this model's is torch\.float32; was it "
                r"written with another \[model\] config\?$"
            ),
        ),
    ],
    ids=["nan-weight", "nan-optimizer-state", "wrong-dtype"],
)
def test_a_damaged_tensor_is_named_whole_in_the_error(tmp_path, file, change, message):
    model, optimizer = tiny_training_state()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    rewrite(path / file, change)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, model, optimizer)


def test_a_state_json_whose_python_rng_state_is_not_one_is_named_damaged(tmp_path):
    model, optimizer = tiny_training_state()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    state = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps({**state, "python_random": [1, 2]}))
    with pytest.raises(CheckpointError, match=r"state\.json is damaged: 'python_random' is not a Python RNG state \("):
        load_checkpoint(path, model, optimizer)


def test_a_non_finite_step_count_in_the_optimizer_state_is_named_whole(tmp_path):
    model, optimizer = tiny_training_state()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    tensors = load_file(path / "optimizer.safetensors")
    step = sorted(k for k in tensors if k.endswith("::step"))[0]
    tensors[step] = torch.tensor(float("inf"))
    save_file(tensors, path / "optimizer.safetensors")
    message = (
        f"{path / 'optimizer.safetensors'}: optimizer state {step!r} holds 1 NaN or infinite value(s); the run "
        "diverged or the file is damaged"
    )
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, optimizer)
    assert str(caught.value) == message
