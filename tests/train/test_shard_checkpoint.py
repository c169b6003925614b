"""Sharded checkpoints (FSDP2 under torchrun on CPU, gloo): each rank writes its own shards, resumes from them, and
the save's failures (a rank that cannot write, an output folder the ranks do not share) leave ``latest`` as it was.

The references: the live ``DTensor.to_local()`` shards and ``full_tensor`` of every weight and optimizer state (read
beside the files with safetensors), and an uninterrupted ``vlmreg train`` run's in-memory state gathered by
``full_tensor`` and saved with ``torch.save`` (never through a checkpoint)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlmreg.cli import main
from vlmreg.train.checkpoint import CheckpointError, latest_checkpoint, resume_checkpoint
from vlmreg.train.optim import CompensatedAdamW
from vlmreg.train.recipe import Trainer

HERE = Path(__file__).resolve().parent
MAIN = str(HERE.parents[1] / "examples" / "configs" / "qwen3_vl_tiny.toml")


def torchrun(*args: str, ranks: int = 2) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The run of fsdp_shard_files.py (its own checks pass on both ranks); its checkpoint folder."""
    out = tmp_path_factory.mktemp("sharded")
    result = torchrun(str(HERE / "fsdp_shard_files.py"), str(out))
    assert result.returncode == 0, result.stdout[-2000:] + "\n" + result.stderr[-3000:]
    assert result.stdout.count(": OK") == 2
    return out / "checkpoints"


def good_copy(sharded: Path, tmp_path: Path) -> Path:
    """The script's checkpoints folder with only its good checkpoint, step 2 (step 6 has a damaged rank 1 file)."""
    folder = tmp_path / "checkpoints"
    shutil.copytree(sharded, folder, ignore=shutil.ignore_patterns("step_000006"))
    (folder / "latest").write_text("step_000002")
    return folder


def test_each_rank_writes_its_own_shards_and_a_fresh_model_resumes_from_them(sharded):
    """fsdp_shard_files.py: each rank's files equal its to_local() shards, the ranks' files concatenated equal
    full_tensor, a resumed model equals the saved one and steps as it does; rank 1 failing to write and an output
    folder the ranks do not share fail the save on both ranks, latest and the previous checkpoint unchanged; a NaN in
    rank 1's file of the newest checkpoint makes both ranks resume the same earlier one."""
    assert sorted(p.name for p in (sharded / "step_000002").iterdir()) == [
        "optimizer.rank00000-of-00002.safetensors",
        "optimizer.rank00001-of-00002.safetensors",
        "rng.safetensors",
        "state.json",
        "trainable.rank00000-of-00002.safetensors",
        "trainable.rank00001-of-00002.safetensors",
    ]


def test_one_process_loads_a_two_process_checkpoint_whole(sharded, tmp_path):
    """Without FSDP (one process, as ``vlmreg eval`` or a run resumed on one GPU), each weight and optimizer state is
    read from both ranks' files: equal to the state the two processes held at that step, gathered from memory."""
    folder = good_copy(sharded, tmp_path)
    torch.manual_seed(5)  # not the saved model's seed: every value below comes from the checkpoint
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 7), torch.nn.Linear(7, 1))
    model = model.to(torch.bfloat16)
    optimizer = CompensatedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    warnings: list[str] = []
    path, state = resume_checkpoint(folder, model, optimizer, log=warnings.append)
    assert path == folder / "step_000002" and state["step"] == 2
    assert warnings == ["step_000002 was written by 2 processes and is read by 1 (resharded)"]
    reference = torch.load(sharded.parent / "full-2.pt")
    found = dict(model.named_parameters())
    found.update({f"{n}::{k}": v for n, p in model.named_parameters() for k, v in optimizer.state[p].items()})
    assert set(found) == set(reference) and any("::exp_avg" in name for name in found)
    for name, value in reference.items():
        assert found[name].dtype == value.dtype and torch.equal(found[name].detach(), value), name


def test_three_processes_resume_a_two_process_checkpoint(sharded):
    """fsdp_reshard.py: FSDP2 over three ranks, each rank's own chunk of three read from the two ranks' files."""
    result = torchrun(str(HERE / "fsdp_reshard.py"), str(sharded), str(sharded.parent / "full-2.pt"), ranks=3)
    assert result.returncode == 0, result.stdout[-2000:] + "\n" + result.stderr[-3000:]
    assert result.stdout.count("resharded from 2 processes to 3: OK") == 3
    assert result.stdout.count("step_000002 was written by 2 processes and is read by 3 (resharded)") == 3


def test_a_checkpoint_for_another_model_is_refused_naming_the_file_and_the_rows(sharded, tmp_path):
    """Read by another number of processes, a weight whose rows across the ranks' files are not the model's."""
    folder = good_copy(sharded, tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(24, 41), torch.nn.Linear(41, 7), torch.nn.Linear(7, 1))
    warnings: list[str] = []
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        resume_checkpoint(folder, model.to(torch.bfloat16), None, log=warnings.append)
    step = folder / "step_000002"
    reason = (
        f"{step}: weight '0.weight' has 40 rows across the 2 ranks' files, the model's has 41; was it written with "
        "another [model] config?"
    )
    assert warnings == [f"warning: skipped checkpoint step_000002: {reason}"]


@pytest.mark.parametrize("kind", ["trainable", "optimizer"])
def test_a_checkpoint_missing_one_rank_s_file_is_incomplete(sharded, tmp_path, kind):
    folder = good_copy(sharded, tmp_path)
    missing = folder / "step_000002" / f"{kind}.rank00001-of-00002.safetensors"
    missing.unlink()
    warnings: list[str] = []
    found = latest_checkpoint(folder, log=warnings.append)
    if kind == "optimizer":  # for the weights alone (vlmreg eval) it is complete
        assert found == folder / "step_000002" and warnings == []
    else:
        assert found is None
        assert warnings == [f"warning: skipped checkpoint step_000002: {missing} is missing (an incomplete checkpoint)"]
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="no usable checkpoint") as caught:
        resume_checkpoint(folder, model, torch.optim.AdamW(model.parameters()), log=warnings.append)
    assert f"{missing} is missing (an incomplete checkpoint)" in str(caught.value)


QUICK = [  # supervised warm-up steps 1-3 (answers drawn at random) and an RL step: every tensor changes each step
    "trainer.format_warmup_steps=3",
    "trainer.prompts_per_step=4",
    "rollout.group_size=4",
    "eval.every=0",
    "logging.rollout_page_every=0",
    "trainer.save_every=2",
]


MOE = str(HERE.parents[1] / "examples" / "configs" / "qwen3_vl_moe_tiny.toml")


@pytest.mark.parametrize("config", [MAIN, MOE], ids=["qwen3_vl", "qwen3_vl_moe"])
def test_a_two_process_run_saved_at_step_2_and_resumed_equals_the_uninterrupted_one(tmp_path, config):
    """`vlmreg train` under torchrun: 4 steps at once, and 2 steps then --resume to 4, each run's final weights and
    optimizer state gathered from memory (fsdp_train_state.py): equal tensor by tensor. Then `vlmreg eval` (one
    process) on the step 2 checkpoint evaluates the weights the two processes held at step 2. The MoE family's fused
    3-D experts are split by FSDP2 along the experts."""
    script = str(HERE / "fsdp_train_state.py")
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    for out, mode, steps in ((whole, "fresh", 4), (halves, "fresh", 2), (halves, "resume", 4)):
        result = torchrun(script, config, str(out), mode, f"trainer.steps={steps}", *QUICK)
        assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {halves / 'checkpoints' / 'step_000002'} (step 2)" in result.stdout
    assert (halves / "checkpoints" / "step_000002" / "trainable.rank00001-of-00002.safetensors").is_file()
    reference, resumed = torch.load(whole / "final-4.pt"), torch.load(halves / "final-4.pt")
    halfway = torch.load(halves / "final-2.pt")
    assert set(resumed) == set(reference)
    assert any("::exp_avg" in name for name in reference)
    for name, value in reference.items():
        assert resumed[name].dtype == value.dtype and torch.equal(resumed[name], value), name
    # steps 3 and 4 changed every weight and state: the comparison above is not of two untouched states
    assert all(not torch.equal(halfway[name], value) for name, value in reference.items())
    # `vlmreg eval --checkpoint`, one process, on the two processes' checkpoint of step 2: the model it evaluates
    # holds the weights the two processes held at step 2, gathered from their memory (final-2.pt)
    evaluated: dict[str, torch.Tensor] = {}

    def evaluate_and_keep(self: Trainer) -> dict[str, float]:
        evaluated.update({n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad})
        return evaluate(self)

    evaluate = Trainer.evaluate
    step_2 = halves / "checkpoints" / "step_000002"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "evaluate", evaluate_and_keep)
        assert main(["eval", config, "--checkpoint", str(step_2), "--set", "eval.num_samples=2", "--json"]) == 0
    weights = {name: value for name, value in halfway.items() if "::" not in name}
    assert evaluated.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(evaluated[name], value), name
