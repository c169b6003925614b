"""Sharded checkpoints with two ranks in this process (torch's threaded process group, `threaded_ranks`), real FSDP2
``fully_shard`` on a tiny model and a real AdamW: the save, the resume and each refusal called directly, so a planted
bug in `vlmreg.train.shard_checkpoint` fails a test here (the torchrun tests in ``test_shard_checkpoint.py`` run the
same code in subprocesses, the multi-process reference, where mutmut cannot map it).

The references: the files as plain ``safetensors.torch.load_file`` / ``safe_open`` and ``json`` read them; each
rank's live ``DTensor.to_local()`` shards and ``full_tensor()``; and the uninterrupted run, compared tensor by
tensor after it and the resumed run take the same next step. Each rank's model is a copy of one built in the test's
thread (the ranks share torch's global RNG, so none is seeded inside a rank)."""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import fully_shard

from tests.train.threaded_ranks import threaded_world
from vlmreg.train import shard_checkpoint
from vlmreg.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from vlmreg.train.distributed import Distributed, full_tensor
from vlmreg.train.reshard import rows_of
from vlmreg.train.shard_checkpoint import finish_folder, shard_files, sharded_world, write_own_shards, write_verified

TRAINED = ["0.weight", "1.weight", "1.bias", "2.weight", "2.bias"]  # 0.bias is frozen: in no file
#: each trained weight's rows on rank 0 and rank 1 (FSDP2 splits dim 0: 12 = 6 + 6, 3 = 2 + 1, 1 = 1 + 0)
ROWS = {"0.weight": (6, 6), "1.weight": (2, 1), "1.bias": (2, 1), "2.weight": (1, 0), "2.bias": (1, 0)}


@pytest.fixture
def ranks():
    """``ranks(fn, world=2)``: ``fn(ctx, mesh)`` on each rank of a threaded process group made for this test."""
    with threaded_world() as run:
        yield run


def base(seed: int = 0) -> torch.nn.Module:
    """The tiny model; another ``seed`` changes its trained weights only (a checkpoint holds no frozen weight)."""
    with torch.random.fork_rng():  # the global RNG as it was: other tests' draws do not depend on this file
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Linear(12, 3), torch.nn.Linear(3, 1))
    with torch.no_grad():
        model[0].bias.copy_(torch.linspace(-0.5, 0.5, 12))
    model[0].bias.requires_grad_(False)
    return model


def sharded(model: torch.nn.Module, mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """This rank's FSDP2 copy of ``model`` and an AdamW over every parameter (the frozen one gets no state)."""
    model = copy.deepcopy(model)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:  # each rank its own batch, the same for a given step and rank in every run
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every trained weight and optimizer state under its checkpoint name, as they live (sharded or not)."""
    found: dict[str, torch.Tensor] = {name: p for name, p in model.named_parameters() if p.requires_grad}
    names = {id(p): name for name, p in model.named_parameters()}
    for p, fields in optimizer.state.items():
        found.update({f"{names[id(p)]}::{key}": value for key, value in fields.items()})
    return found


def gathered(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """`states` gathered whole (a collective), copied."""
    return {name: full_tensor(value).clone() for name, value in states(model, optimizer).items()}


def trained(ctx: Distributed, mesh: Any, folder: Path, steps: int = 2) -> tuple[torch.nn.Module, Any, Path]:
    model, optimizer = sharded(MODEL, mesh)
    train(model, optimizer, ctx.rank, range(steps))
    return model, optimizer, save_checkpoint(folder, steps, model, optimizer, {"source": None}, ctx=ctx)


MODEL = base()


def rank_file(path: Path, kind: str, rank: int) -> Path:
    return path / f"{kind}.rank{rank:05d}-of-00002.safetensors"


def digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


# -- saving -----------------------------------------------------------------------------------


def test_each_rank_writes_exactly_its_own_shards_and_rank_0_the_rng_and_state(ranks, tmp_path):
    def rank_main(ctx, mesh):
        model, optimizer = sharded(MODEL, mesh)
        train(model, optimizer, ctx.rank, range(2))
        rng = torch.get_rng_state()
        path = save_checkpoint(tmp_path, 2, model, optimizer, {"source": None}, ctx=ctx)
        live = {name: v.to_local() if hasattr(v, "to_local") else v for name, v in states(model, optimizer).items()}
        return path, {name: v.detach().clone() for name, v in live.items()}, gathered(model, optimizer), rng

    (path, live0, whole, rng0), (path1, live1, _, rng1) = ranks(rank_main)
    assert path == path1 == tmp_path / "step_000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002"]
    assert (tmp_path / "latest").read_text() == "step_000002"
    assert sorted(p.name for p in path.iterdir()) == [
        "optimizer.rank00000-of-00002.safetensors",
        "optimizer.rank00001-of-00002.safetensors",
        "rng.safetensors",
        "state.json",
        "trainable.rank00000-of-00002.safetensors",
        "trainable.rank00001-of-00002.safetensors",
    ]
    moments = [f"{name}::{key}" for name in TRAINED for key in ("step", "exp_avg", "exp_avg_sq")]
    files = []
    for rank, live in enumerate((live0, live1)):
        weights, optim = load_file(rank_file(path, "trainable", rank)), load_file(rank_file(path, "optimizer", rank))
        assert sorted(weights) == sorted(TRAINED) and sorted(optim) == sorted(moments)
        for kind, listed in (("trainable", {}), ("optimizer", {"python_numbers": "{}"})):  # AdamW keeps no numbers
            with safe_open(rank_file(path, kind, rank), "pt") as f:
                assert f.metadata() == {**listed, "rank": str(rank), "world_size": "2"}
        for name, value in {**weights, **optim}.items():
            assert value.dtype == live[name].dtype and torch.equal(value, live[name]), (rank, name)
        assert {name: weights[name].shape[0] for name in TRAINED} == {name: ROWS[name][rank] for name in TRAINED}
        files.append({**weights, **optim})
    for name, value in whole.items():  # the ranks' files together are the whole tensors
        if value.dim():
            assert torch.equal(torch.cat([files[0][name], files[1][name]]), value), name
        else:  # the step count: whole in each rank's file
            assert torch.equal(files[0][name], value) and torch.equal(files[1][name], value), name
    state = json.loads((path / "state.json").read_text())
    assert state["sharded"] == {"world_size": 2} and state["step"] == 2 and state["source"] is None
    rng = load_file(path / "rng.safetensors")
    assert sorted(rng) == ["torch_cpu_rank0", "torch_cpu_rank1"]
    assert torch.equal(rng["torch_cpu_rank0"], rng0) and torch.equal(rng["torch_cpu_rank1"], rng1)


def test_a_save_replaces_a_stale_temporary_folder_and_makes_missing_parent_folders(ranks, tmp_path):
    """A run killed while saving step 4 left its temporary folder; the next save of step 4 starts it afresh. An
    ``output_dir`` that does not exist yet is made, parents and all."""
    stale = tmp_path / "run" / ".tmp-step_000004"
    stale.mkdir(parents=True)
    (stale / "trainable.rank00005-of-00009.safetensors").write_bytes(b"left by a killed run")

    def rank_main(ctx, mesh):
        model, optimizer = sharded(MODEL, mesh)
        train(model, optimizer, ctx.rank, range(1))
        for step in (4, 6):
            save_checkpoint(tmp_path / "run", step, model, optimizer, {"source": None}, ctx=ctx)
        save_checkpoint(tmp_path / "new" / "checkpoints", 1, model, optimizer, {"source": None}, ctx=ctx)

    ranks(rank_main)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["latest", "step_000004", "step_000006"]
    assert len(list((tmp_path / "run" / "step_000004").iterdir())) == 6
    assert sorted(p.name for p in (tmp_path / "new" / "checkpoints").iterdir()) == ["latest", "step_000001"]


def test_each_rank_fsyncs_its_own_files_once_they_are_complete(ranks, tmp_path, monkeypatch):
    """Rank 0's fsync of the folder does not reach the page cache of another machine: each rank syncs what it
    wrote, after writing it whole (the recorder reads each file as it is synced)."""
    synced: list[tuple[int, str, list[str]]] = []
    real = shard_checkpoint.fsync_file

    def recording(path):
        synced.append((dist.get_rank(), path.name, sorted(load_file(path))))
        real(path)

    monkeypatch.setattr(shard_checkpoint, "fsync_file", recording)
    ranks(lambda ctx, mesh: trained(ctx, mesh, tmp_path))
    assert sorted(synced) == [
        (rank, f"{kind}.rank{rank:05d}-of-00002.safetensors", names)
        for rank in (0, 1)
        for kind, names in (
            ("optimizer", sorted(f"{n}::{k}" for n in TRAINED for k in ("exp_avg", "exp_avg_sq", "step"))),
            ("trainable", sorted(TRAINED)),
        )
    ]


def test_which_runs_save_sharded_files(ranks):
    """Only a run of several processes whose trainable weights FSDP2 sharded; one process (or one rank, or no
    sharding) saves whole tensors."""

    def rank_main(ctx, mesh):
        model, _ = sharded(MODEL, mesh)
        return sharded_world(model, ctx), sharded_world(copy.deepcopy(MODEL), ctx), sharded_world(model, None)

    assert ranks(rank_main) == [(2, None, None)] * 2
    assert ranks(rank_main, world=1) == [(None, None, None)]


@pytest.mark.parametrize(
    ("kind", "error", "reason"),
    [
        ("trainable", OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
        ("optimizer", OSError(errno.EIO, "Input/output error"), "Input/output error"),
        ("trainable", RuntimeError("Error while serializing: IoError"), "Error while serializing: IoError"),
    ],
)
def test_rank_1_failing_to_write_fails_the_save_on_every_rank_and_keeps_the_last_checkpoint(
    ranks, tmp_path, monkeypatch, kind, error, reason
):
    def failing(tensors, path, metadata=None):  # rank 1's write of step 3 (the ranks share the module)
        if dist.get_rank() == 1 and path.parent.name == ".tmp-step_000003" and path.name.startswith(kind):
            raise error
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(shard_checkpoint, "save_file", failing)

    def rank_main(ctx, mesh):
        model, optimizer, saved = trained(ctx, mesh, tmp_path)
        before = digest(saved)
        with pytest.raises(CheckpointError) as caught:
            save_checkpoint(tmp_path, 3, model, optimizer, {"source": None}, ctx=ctx)
        return str(caught.value), before

    (message, before), (message1, _) = ranks(rank_main)
    bad = tmp_path / ".tmp-step_000003" / f"{kind}.rank00001-of-00002.safetensors"
    assert message1 == message
    assert message == (
        f"could not write checkpoint {tmp_path / 'step_000003'}: rank 1: {reason} ({bad}); the partial "
        f".tmp-step_000003 was removed and {tmp_path / 'latest'} still names step_000002"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002"]
    assert digest(tmp_path / "step_000002") == before


@pytest.mark.parametrize("blocked", ["temporary folder", "output folder"])
def test_rank_0_unable_to_make_the_temporary_folder_fails_the_save_before_any_rank_writes(ranks, tmp_path, blocked):
    """A file where rank 0 makes the folder; rank 1 (on a machine of its own, with a stale folder of that name)
    writes nothing."""
    out = "" if blocked == "temporary folder" else "out"
    (tmp_path / "view0").mkdir()
    at = tmp_path / "view0" / (".tmp-step_000002" if blocked == "temporary folder" else "out")
    at.write_text("a file where the folder goes")
    (tmp_path / "view1" / out / ".tmp-step_000002").mkdir(parents=True)

    def rank_main(ctx, mesh):
        model, optimizer = sharded(MODEL, mesh)
        train(model, optimizer, ctx.rank, range(1))
        with pytest.raises(CheckpointError) as caught:
            save_checkpoint(tmp_path / f"view{ctx.rank}" / out, 2, model, optimizer, {"source": None}, ctx=ctx)
        return str(caught.value)

    messages = ranks(rank_main)
    view = tmp_path / "view0" / out
    expected = (
        f"could not write checkpoint {view / 'step_000002'}: rank 0: File exists ({at}); the partial "
        ".tmp-step_000002 was removed and there is no earlier checkpoint"
    )
    assert messages == [expected, expected]
    assert list((tmp_path / "view1" / out / ".tmp-step_000002").iterdir()) == []


def test_an_output_folder_the_ranks_do_not_share_fails_the_save_naming_rank_1(ranks, tmp_path):
    """Each rank's ``view{rank}`` is its machine's view of ``output_dir``: rank 1 does not see the folder rank 0
    made; then, with a stale folder of that name on its machine, it writes there and rank 0 does not find its files."""
    (tmp_path / "view1" / ".tmp-step_000005").mkdir(parents=True)

    def rank_main(ctx, mesh):
        model, optimizer = sharded(MODEL, mesh)
        train(model, optimizer, ctx.rank, range(1))
        messages = []
        for step in (4, 5):
            with pytest.raises(CheckpointError) as caught:
                save_checkpoint(tmp_path / f"view{ctx.rank}", step, model, optimizer, {"source": None}, ctx=ctx)
            messages.append(str(caught.value))
        return messages

    (unseen, missing), rank1 = ranks(rank_main)
    view0, view1 = tmp_path / "view0", tmp_path / "view1"
    assert rank1 == [unseen, missing]
    shared = "output_dir must be on a filesystem every rank sees (a shared one when the ranks run on several machines)"
    assert unseen == (
        f"could not write checkpoint {view0 / 'step_000004'}: rank 1 does not see the folder "
        f"{view1 / '.tmp-step_000004'} that rank 0 made: {shared}; the partial .tmp-step_000004 was removed and there "
        "is no earlier checkpoint"
    )
    assert missing == (
        f"could not write checkpoint {view0 / 'step_000005'}: "
        f"{view0 / '.tmp-step_000005' / 'trainable.rank00001-of-00002.safetensors'} is missing although rank 1 wrote "
        f"it: {shared}; the partial .tmp-step_000005 was removed and there is no earlier checkpoint"
    )
    assert list(view0.iterdir()) == []
    assert sorted(p.name for p in (view1 / ".tmp-step_000005").iterdir()) == [
        "optimizer.rank00001-of-00002.safetensors",
        "trainable.rank00001-of-00002.safetensors",
    ]


def test_a_write_is_read_back_and_a_lost_tail_or_tensor_is_an_error(tmp_path):
    tensors = {"a": torch.arange(6.0), "b": torch.ones(2, 2)}
    write_verified(tensors, tmp_path / "whole.safetensors", {"rank": "0"})
    with safe_open(tmp_path / "whole.safetensors", "pt") as f:
        assert f.metadata() == {"rank": "0"}
    assert all(torch.equal(load_file(tmp_path / "whole.safetensors")[k], v) for k, v in tensors.items())

    def cut(tensors, path, metadata=None):  # the header's length says more than the file holds: a full disk
        save_file(tensors, path, metadata=metadata)
        path.write_bytes(path.read_bytes()[:20])

    with pytest.raises(OSError, match=r"^cut\.safetensors is incomplete after writing \(.+\); is the disk full\?$"):
        write_verified(tensors, tmp_path / "cut.safetensors", save=cut)

    def dropped(tensors, path, metadata=None):
        save_file({"a": tensors["a"]}, path, metadata=metadata)

    with pytest.raises(OSError) as caught:
        write_verified(tensors, tmp_path / "dropped.safetensors", save=dropped)
    assert str(caught.value) == "dropped.safetensors is missing tensors after writing; is the disk full?"


# -- finding and resuming -----------------------------------------------------------------------


def test_a_fresh_model_resumed_from_the_shards_goes_on_as_the_uninterrupted_run(ranks, tmp_path):
    """Saved after 2 steps, resumed into a model of other weights: equal, and step 3 on each keeps them equal."""
    other = base(seed=5)

    def rank_main(ctx, mesh):
        model, optimizer, saved = trained(ctx, mesh, tmp_path)
        at_save = gathered(model, optimizer)
        train(model, optimizer, ctx.rank, range(2, 3))
        fresh, fresh_optimizer = sharded(other, mesh)
        state = load_checkpoint(saved, fresh, fresh_optimizer, ctx)
        resumed = gathered(fresh, fresh_optimizer)
        kinds = [(k, type(v)) for k, v in states(model, optimizer).items()]  # the uninterrupted run's
        same_kinds = sorted(kinds) == sorted((k, type(v)) for k, v in states(fresh, fresh_optimizer).items())
        train(fresh, fresh_optimizer, ctx.rank, range(2, 3))
        went_on = gathered(fresh, fresh_optimizer)
        return state["step"], at_save, resumed, same_kinds, gathered(model, optimizer), went_on

    for step, at_save, resumed, same_kinds, uninterrupted, went_on in ranks(rank_main):
        assert step == 2 and same_kinds  # DTensors for weights and moments, plain tensors for step counts
        assert set(resumed) == set(at_save) == set(uninterrupted) and len(at_save) == 4 * len(TRAINED)
        for name, value in at_save.items():
            assert resumed[name].dtype == value.dtype and torch.equal(resumed[name], value), name
            assert torch.equal(went_on[name], uninterrupted[name]), name
            assert not torch.equal(uninterrupted[name], value), name  # step 3 changed it: not two untouched states


def test_the_weights_alone_load_without_the_optimizer_files(ranks, tmp_path):
    """`vlmreg eval`'s case: no optimizer given, so the optimizer's files are neither needed nor read."""
    other = base(seed=5)

    def rank_main(ctx, mesh):
        model, optimizer, saved = trained(ctx, mesh, tmp_path)
        dist.barrier()
        if ctx.is_main:
            for rank in (0, 1):
                rank_file(saved, "optimizer", rank).unlink()
        dist.barrier()
        fresh, _ = sharded(other, mesh)
        load_checkpoint(saved, fresh, None, ctx)
        return gathered(model, optimizer), gathered(fresh, torch.optim.AdamW(fresh.parameters()))

    for saved, loaded in ranks(rank_main):
        assert sorted(loaded) == sorted(TRAINED)
        assert all(torch.equal(loaded[name], saved[name]) for name in TRAINED)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"


def test_the_files_of_a_sharded_checkpoint_are_named_from_state_json_or_else_from_the_files(tmp_path):
    ranks4 = [f"{kind}.rank{r:05d}-of-00004.safetensors" for r in range(4) for kind in ("trainable", "optimizer")]
    assert shard_files(tmp_path, optimizer=True, world=4) == ["state.json", "rng.safetensors", *ranks4]
    assert shard_files(tmp_path, optimizer=False, world=4) == ["state.json", "rng.safetensors", *ranks4[::2]]
    assert shard_files(tmp_path, optimizer=True) == []  # nothing here: the whole layout's files, not these
    (tmp_path / "state.json").write_text(json.dumps({"step": 1, "sharded": {"world_size": 2}}))
    assert shard_files(tmp_path, optimizer=True) == [
        "state.json",
        "rng.safetensors",
        *[f"{kind}.rank{r:05d}-of-00002.safetensors" for r in range(2) for kind in ("trainable", "optimizer")],
    ]
    (tmp_path / "optimizer.rank00003-of-00004.safetensors").write_bytes(b"")  # damaged state.json: the names say 4
    (tmp_path / "trainable.rank00000-of-00003.safetensors").write_bytes(b"")
    (tmp_path / "trainable.rank00000-of-00009.txt").write_bytes(b"")  # not a shard file
    for damaged in (
        b"{not json",
        b"\xff\xfe\x00",
        b"[2]",
        b'{"sharded": {"world_size": "2"}}',
        b'{"sharded": 2}',
        b'{"sharded": {"world_size": true}}',
    ):
        (tmp_path / "state.json").write_bytes(damaged)
        assert shard_files(tmp_path, optimizer=True) == ["state.json", "rng.safetensors", *ranks4], damaged
    (tmp_path / "state.json").write_text(json.dumps({"step": 1}))  # the whole layout's state.json
    for path in tmp_path.glob("*.rank*"):
        path.unlink()
    assert shard_files(tmp_path, optimizer=True) == []


def rewrite(file: Path, change, metadata: dict[str, str] | None | bool = True) -> None:
    """``file``'s tensors through ``change`` (in place), written back with its own metadata (or the one given)."""
    with safe_open(file, "pt") as f:
        meta, tensors = f.metadata(), {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    change(tensors)
    save_file(tensors, file, metadata=meta if metadata is True else metadata or None)


def nan_at(name: str, count: int = 1, value: float = float("nan")):
    def change(tensors):
        tensors[name].view(-1)[:count] = value

    return change


def renamed(old: str, new: str):
    def change(tensors):
        tensors[new] = tensors.pop(old)

    return change


def replaced(name: str, value: torch.Tensor | None):
    def change(tensors):
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value

    return change


TR1, TR0, OP1 = "trainable.rank00001-of-00002", "trainable.rank00000-of-00002", "optimizer.rank00001-of-00002"
NO_MATCH = "the checkpoint's trainable weights do not match this model's"
#: (what is done to the checkpoint folder, the message every rank gives; {path}: the step folder)
DAMAGES = {
    "rank 1's file missing": (
        lambda p: rank_file(p, "trainable", 1).unlink(),
        "{path}/" + TR1 + ".safetensors is missing (an incomplete checkpoint)",
    ),
    "rank 0's file under rank 1's name": (
        lambda p: rank_file(p, "trainable", 1).write_bytes(rank_file(p, "trainable", 0).read_bytes()),
        "{path}/" + TR1 + ".safetensors says it is rank 0 of 2, not rank 1 of 2; was it renamed or copied from "
        "another checkpoint?",
    ),
    "rank 1's file from a run of 3": (
        lambda p: rewrite(rank_file(p, "trainable", 1), lambda t: None, {"rank": "1", "world_size": "3"}),
        "{path}/" + TR1 + ".safetensors says it is rank 1 of 3, not rank 1 of 2; was it renamed or copied from "
        "another checkpoint?",
    ),
    "rank 1's file without its metadata": (
        lambda p: rewrite(rank_file(p, "optimizer", 1), lambda t: None, None),
        "{path}/" + OP1 + ".safetensors says it is rank None of None, not rank 1 of 2; was it renamed or copied "
        "from another checkpoint?",
    ),
    "a weight missing from rank 1's file": (
        lambda p: rewrite(rank_file(p, "trainable", 1), replaced("2.bias", None)),
        "{path}/" + TR1 + ".safetensors: " + NO_MATCH + " (missing ['2.bias'], unexpected []); was it written with "
        "another [model] config?",
    ),
    "a weight too many in rank 1's file": (
        lambda p: rewrite(rank_file(p, "trainable", 1), replaced("0.bias", torch.zeros(6))),
        "{path}/" + TR1 + ".safetensors: " + NO_MATCH + " (missing [], unexpected ['0.bias']); was it written with "
        "another [model] config?",
    ),
    "rank 1's file of another model": (
        lambda p: rewrite(rank_file(p, "trainable", 1), lambda t: [t.pop(n) for n in TRAINED if n != "2.weight"]),
        "{path}/" + TR1 + ".safetensors: " + NO_MATCH + " (missing ['0.weight', '1.bias', '1.weight'], unexpected "
        "[]); was it written with another [model] config?",
    ),
    "four weights too many in rank 1's file": (
        lambda p: rewrite(
            rank_file(p, "trainable", 1), lambda t: t.update({f"x.{i}": torch.ones(1) for i in range(4)})
        ),
        "{path}/" + TR1 + ".safetensors: " + NO_MATCH + " (missing [], unexpected ['x.0', 'x.1', 'x.2']); was it "
        "written with another [model] config?",
    ),
    "a shard of another shape on rank 0": (
        lambda p: rewrite(rank_file(p, "trainable", 0), replaced("1.weight", torch.zeros(3, 12))),
        "{path}/" + TR0 + ".safetensors: weight '1.weight' is torch.float32 [3, 12], this rank's shard of the "
        "model's is torch.float32 [2, 12]; was it written with another [model] config?",
    ),
    "a shard of another dtype on rank 1": (
        lambda p: rewrite(rank_file(p, "trainable", 1), replaced("0.weight", torch.zeros(6, 8, dtype=torch.float64))),
        "{path}/" + TR1 + ".safetensors: weight '0.weight' is torch.float64 [6, 8], this rank's shard of the model's "
        "is torch.float32 [6, 8]; was it written with another [model] config?",
    ),
    "a moment of another shape on rank 1": (
        lambda p: rewrite(rank_file(p, "optimizer", 1), replaced("1.bias::exp_avg", torch.zeros(2))),
        "{path}/" + OP1 + ".safetensors: optimizer state '1.bias::exp_avg' is torch.float32 [2], this rank's shard "
        "of the model's is torch.float32 [1]; was it written with another [model] config?",
    ),
    "a NaN weight on rank 1": (
        lambda p: rewrite(rank_file(p, "trainable", 1), nan_at("1.weight")),
        "{path}/" + TR1 + ".safetensors: weight '1.weight' holds 1 NaN or infinite value(s); the run diverged or "
        "the file is damaged",
    ),
    "two infinite moments on rank 1": (
        lambda p: rewrite(rank_file(p, "optimizer", 1), nan_at("0.weight::exp_avg_sq", 2, float("inf"))),
        "{path}/" + OP1 + ".safetensors: optimizer state '0.weight::exp_avg_sq' holds 2 NaN or infinite value(s); "
        "the run diverged or the file is damaged",
    ),
    "a NaN step count on rank 1": (
        lambda p: rewrite(rank_file(p, "optimizer", 1), nan_at("2.bias::step")),
        "{path}/" + OP1 + ".safetensors: optimizer state '2.bias::step' holds 1 NaN or infinite value(s); the run "
        "diverged or the file is damaged",
    ),
    "a state of no weight on rank 1": (
        lambda p: rewrite(rank_file(p, "optimizer", 1), renamed("1.bias::exp_avg", "exp_avg")),
        "{path}/" + OP1 + ".safetensors: optimizer state 'exp_avg' belongs to no trainable weight of this model",
    ),
    "a state of the frozen weight on rank 1": (
        lambda p: rewrite(rank_file(p, "optimizer", 1), renamed("1.bias::exp_avg", "0.bias::exp_avg")),
        "{path}/" + OP1 + ".safetensors: optimizer state '0.bias::exp_avg' belongs to no trainable weight of this "
        "model",
    ),
    "rank 1's file not safetensors": (
        lambda p: rank_file(p, "trainable", 1).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"),
        "{path}/" + TR1 + ".safetensors is damaged: it cannot be read as safetensors (",
    ),
}
OP1_META = {"rank": "1", "world_size": "2"}
for listed, problem in (
    ("{not json", "is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ('["0.weight::step"]', "is not a map from its scalars to ['bool', 'float', 'int']"),
    ('{"0.weight::step": "str"}', "is not a map from its scalars to ['bool', 'float', 'int']"),
    ('{"0.weight::step": ["int"]}', "is not a map from its scalars to ['bool', 'float', 'int']"),
    ('{"0.weight::count": "int"}', "is not a map from its scalars to ['bool', 'float', 'int']"),
    ('{"9.weight::step": "int"}', "is not a map from its scalars to ['bool', 'float', 'int']"),
    ('{"0.weight::exp_avg": "float"}', "is not a map from its scalars to ['bool', 'float', 'int']"),
):
    DAMAGES[f"rank 1's python_numbers {listed}"] = (
        lambda p, listed=listed: rewrite(
            rank_file(p, "optimizer", 1), lambda t: None, {**OP1_META, "python_numbers": listed}
        ),
        "{path}/"
        + OP1
        + ".safetensors is damaged: its 'python_numbers' metadata "
        + problem.replace("{", "{{").replace("}", "}}"),
    )
for entry in ({"world_size": "2"}, {"world_size": 0}, {"world_size": True}, {"world": 2}, 2, [2]):
    DAMAGES[f"state.json's sharded entry {entry!r}"] = (
        lambda p, entry=entry: (p / "state.json").write_text(
            json.dumps({**json.loads((p / "state.json").read_text()), "sharded": entry})
        ),
        "{path}/state.json is damaged: 'sharded' is "
        + repr(entry).replace("{", "{{").replace("}", "}}")
        + ", not {{'world_size': N}}",
    )


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_shard_is_refused_on_every_rank_before_anything_is_applied(ranks, tmp_path, damage):
    change, expected = DAMAGES[damage]
    other = base(seed=5)

    def rank_main(ctx, mesh):
        _, _, saved = trained(ctx, mesh, tmp_path)
        dist.barrier()
        if ctx.is_main:
            change(saved)
        dist.barrier()
        fresh, fresh_optimizer = sharded(other, mesh)
        train(fresh, fresh_optimizer, ctx.rank, range(1))
        before = gathered(fresh, fresh_optimizer)
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(saved, fresh, fresh_optimizer, ctx)
        return str(caught.value), before, gathered(fresh, fresh_optimizer)

    path = tmp_path / "step_000002"
    for message, before, after in ranks(rank_main):
        if expected.endswith("("):  # safetensors' own words follow
            assert message.startswith(expected.format(path=path)), message
        else:
            assert message == expected.format(path=path)
        assert set(after) == set(before) and all(torch.equal(after[name], value) for name, value in before.items())


def test_each_rank_refuses_with_its_own_problem_when_both_have_one(ranks, tmp_path):
    def rank_main(ctx, mesh):
        model, optimizer, saved = trained(ctx, mesh, tmp_path)
        dist.barrier()
        if ctx.is_main:
            rewrite(rank_file(saved, "trainable", 0), nan_at("0.weight"))
            rank_file(saved, "optimizer", 1).unlink()
        dist.barrier()
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(saved, model, optimizer, ctx)
        return str(caught.value)

    path = tmp_path / "step_000002"
    assert ranks(rank_main) == [
        (
            f"{path / TR0}.safetensors: weight '0.weight' holds 1 NaN or infinite value(s); the run diverged or the "
            "file is damaged"
        ),
        f"{path / OP1}.safetensors is missing (an incomplete checkpoint)",
    ]


def test_another_number_of_processes_or_no_fsdp_shards_reads_every_rank_s_files(ranks, tmp_path):
    """One FSDP2 rank, two ranks without FSDP2 and one process without a group each take the whole tensors (the
    rows of both ranks' files, `reshard`), and two FSDP2 ranks given no ``ctx`` their own rows from both files:
    equal to the two ranks' state gathered from memory; numbers as numbers."""

    def save(ctx, mesh):
        model, _ = sharded(MODEL, mesh)
        optimizer = IntStepAdam(model.parameters())
        train(model, optimizer, ctx.rank, range(2))
        save_checkpoint(tmp_path, 2, model, optimizer, {"source": None}, ctx=ctx)
        return {n: full_tensor(v) if torch.is_tensor(v) else v for n, v in states(model, optimizer).items()}

    at_save = ranks(save)[0]
    path = tmp_path / "step_000002"

    def resume(ctx, mesh, shard=True, given=True):
        model = sharded(MODEL, mesh)[0] if shard else copy.deepcopy(MODEL)
        optimizer = IntStepAdam(model.parameters())
        load_checkpoint(path, model, optimizer, ctx if given else None)
        return {n: full_tensor(v) if torch.is_tensor(v) else v for n, v in states(model, optimizer).items()}

    loaded = [*ranks(resume, world=1), *ranks(lambda ctx, mesh: resume(ctx, mesh, shard=False))]
    loaded += ranks(lambda ctx, mesh: resume(ctx, mesh, given=False))
    loaded.append(resume(None, None, shard=False))
    for resumed in loaded:
        assert set(resumed) == set(at_save)
        for name, value in at_save.items():
            if torch.is_tensor(value):
                assert torch.equal(resumed[name], value), name
            else:
                assert type(resumed[name]) is type(value) and resumed[name] == value, name


class IntStepAdam(torch.optim.Optimizer):
    """Adam as many third-party optimizers write it: the step count a Python int, the bias corrections Python floats
    (a tensor step would make them tensors, which ``addcdiv_``'s ``value`` refuses)."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), decay=1.0)
                state["step"] += 1
                state["decay"] *= 0.987654321  # a float that float32 would round
                state["exp_avg"].mul_(0.9).add_(p.grad, alpha=0.1)
                state["exp_avg_sq"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                correction = (1 - 0.999 ** state["step"]) ** 0.5 / (1 - 0.9 ** state["step"])
                size = -group["lr"] * correction * state["decay"]
                p.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(1e-8), value=size)


def test_an_optimizer_that_keeps_python_numbers_resumes_exactly_with_them(ranks, tmp_path):
    """The numbers are written exactly (int64, float64), listed in each optimizer file's metadata, and given back as
    numbers: the resumed run's step 3 equals the uninterrupted run's, tensor by tensor and number by number."""
    other = base(seed=5)

    def rank_main(ctx, mesh):
        model, _ = sharded(MODEL, mesh)
        optimizer = IntStepAdam(model.parameters())
        train(model, optimizer, ctx.rank, range(2))
        saved = save_checkpoint(tmp_path, 2, model, optimizer, {"source": None}, ctx=ctx)
        numbers = {n: v for n, v in states(model, optimizer).items() if not torch.is_tensor(v)}
        train(model, optimizer, ctx.rank, range(2, 3))
        fresh, _ = sharded(other, mesh)
        fresh_optimizer = IntStepAdam(fresh.parameters())
        load_checkpoint(saved, fresh, fresh_optimizer, ctx)
        resumed = {n: v for n, v in states(fresh, fresh_optimizer).items() if not torch.is_tensor(v)}
        train(fresh, fresh_optimizer, ctx.rank, range(2, 3))
        went_on = states(fresh, fresh_optimizer)
        tensors = {n: full_tensor(v) for n, v in states(model, optimizer).items() if torch.is_tensor(v)}
        return (
            numbers,
            resumed,
            {n: v for n, v in states(model, optimizer).items() if not torch.is_tensor(v)},
            {n: full_tensor(v) if torch.is_tensor(v) else v for n, v in went_on.items()},
            tensors,
        )

    path = tmp_path / "step_000002"
    for rank, (numbers, resumed, after, went_on, tensors) in enumerate(ranks(rank_main)):
        assert sorted(numbers) == sorted(f"{n}::{k}" for n in TRAINED for k in ("step", "decay"))
        assert {n: (type(v), v) for n, v in resumed.items()} == {n: (type(v), v) for n, v in numbers.items()}
        assert {n: (type(v), v) for n, v in after.items()} == {n: (type(went_on[n]), went_on[n]) for n in after}
        assert all(torch.equal(went_on[n], v) for n, v in tensors.items())
        with safe_open(rank_file(path, "optimizer", rank), "pt") as f:
            listed = json.loads(f.metadata()["python_numbers"])
            written = {n: f.get_tensor(n) for n in listed}
        assert listed == {n: type(v).__name__ for n, v in numbers.items()}
        assert all(
            written[n].dtype == (torch.int64 if isinstance(v, int) else torch.float64) for n, v in numbers.items()
        )
        assert all(written[n].item() == v for n, v in numbers.items())


def test_an_optimizer_state_that_is_neither_a_tensor_nor_a_number_fails_the_save_naming_it(ranks, tmp_path):
    def rank_main(ctx, mesh):
        model, optimizer = sharded(MODEL, mesh)
        train(model, optimizer, ctx.rank, range(1))
        if ctx.rank == 1:
            optimizer.state[model[1].bias]["history"] = [0.5]
        with pytest.raises(CheckpointError) as caught:
            save_checkpoint(tmp_path, 1, model, optimizer, {"source": None}, ctx=ctx)
        return str(caught.value)

    file = tmp_path / ".tmp-step_000001" / f"{OP1}.safetensors"
    expected = (
        f"could not write checkpoint {tmp_path / 'step_000001'}: rank 1: optimizer state '1.bias::history' is a list: "
        f"a checkpoint holds tensors and Python numbers only ({file}); the partial .tmp-step_000001 was removed and "
        "there is no earlier checkpoint"
    )
    assert ranks(rank_main) == [expected, expected]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def double_colon_model() -> torch.nn.Module:
    """A tiny model with a module named with ``::`` (the separator of optimizer state keys)."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        named = torch.nn.Sequential()
        named.add_module("in::proj", torch.nn.Linear(8, 4))
        named.add_module("out", torch.nn.Linear(4, 1))
    return named


def test_a_module_named_with_a_double_colon_resumes_its_optimizer_state(ranks, tmp_path):
    """State keys are ``NAME::key``; the name is what comes before the last ``::`` (numbers' names too)."""
    named = double_colon_model()

    def rank_main(ctx, mesh):
        found = []
        for make in (lambda m: torch.optim.AdamW(m.parameters()), lambda m: IntStepAdam(m.parameters())):
            model = sharded(named, mesh)[0]
            optimizer = make(model)
            train(model, optimizer, ctx.rank, range(2))
            saved = save_checkpoint(tmp_path, 2, model, optimizer, {"source": None}, ctx=ctx)
            fresh = sharded(named, mesh)[0]
            fresh_optimizer = make(fresh)
            load_checkpoint(saved, fresh, fresh_optimizer, ctx)
            whole = [
                {n: full_tensor(v) if torch.is_tensor(v) else v for n, v in states(m, o).items()}
                for m, o in ((model, optimizer), (fresh, fresh_optimizer))
            ]
            found.append(whole)
        return found

    for found in ranks(rank_main):
        for at_save, resumed in found:
            assert "in::proj.weight::exp_avg" in at_save and set(resumed) == set(at_save)
            for name, value in at_save.items():
                same = torch.equal(resumed[name], value) if torch.is_tensor(value) else resumed[name] == value
                assert same and type(resumed[name]) is type(value), name


def test_optimizer_files_written_before_python_numbers_were_listed_still_load(ranks, tmp_path):
    """A sharded checkpoint of an earlier vlmreg: its optimizer files' metadata holds only the rank and N."""
    other = base(seed=5)

    def rank_main(ctx, mesh):
        model, optimizer, saved = trained(ctx, mesh, tmp_path)
        dist.barrier()
        if ctx.is_main:
            for rank in (0, 1):
                rewrite(rank_file(saved, "optimizer", rank), lambda t: None, {"rank": str(rank), "world_size": "2"})
        dist.barrier()
        fresh, fresh_optimizer = sharded(other, mesh)
        load_checkpoint(saved, fresh, fresh_optimizer, ctx)
        return gathered(model, optimizer), gathered(fresh, fresh_optimizer)

    for at_save, resumed in ranks(rank_main):
        assert set(resumed) == set(at_save) and all(torch.equal(resumed[n], v) for n, v in at_save.items())


def test_the_module_s_files_for_one_rank_load_into_a_one_rank_fsdp2_model(ranks, tmp_path):
    """N = 1: the trainer saves the whole layout then (`sharded_world`), but the module's own save and check take any
    N; a folder written by `write_own_shards` and `finish_folder` for one rank resumes a one-rank FSDP2 model."""
    other = base(seed=5)
    folder = tmp_path / "step_000001"

    def rank_main(ctx, mesh):
        model, optimizer = sharded(MODEL, mesh)
        train(model, optimizer, ctx.rank, range(1))
        rngs, problem = write_own_shards(tmp_path, folder, model, optimizer, ctx, {"torch_cpu": torch.get_rng_state()})
        state = {"step": 1, "python_random": json.loads(json.dumps(random.getstate()))}
        finish_folder(folder, 1, problem, rngs, state)
        loaded = []
        for given in (ctx, None):  # without vlmreg's ctx too: rank 0 of 1 reads rank 0's files
            fresh, fresh_optimizer = sharded(other, mesh)
            load_checkpoint(folder, fresh, fresh_optimizer, given)
            loaded.append(gathered(fresh, fresh_optimizer))
        return gathered(model, optimizer), loaded

    [(at_save, loaded)] = ranks(rank_main, world=1)
    assert json.loads((folder / "state.json").read_text())["sharded"] == {"world_size": 1}
    for resumed in loaded:
        assert set(resumed) == set(at_save) and all(torch.equal(resumed[n], v) for n, v in at_save.items())


def test_a_resharded_load_refuses_a_non_finite_step_count_in_rank_0_s_file(ranks, tmp_path):
    """A count every rank wrote whole is read from rank 0's file, checked like the rest: a NaN there is refused,
    naming that file and the state (rank 1's good copy is not read instead)."""
    path = ranks(lambda ctx, mesh: trained(ctx, mesh, tmp_path)[2])[0]
    rewrite(path / "optimizer.rank00000-of-00002.safetensors", nan_at("0.weight::step"))
    model = copy.deepcopy(MODEL)  # one process without a group: every tensor read through `reshard`
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, torch.optim.AdamW(model.parameters()))
    assert str(caught.value) == (
        f"{path / 'optimizer.rank00000-of-00002.safetensors'}: optimizer state '0.weight::step' holds 1 NaN or "
        "infinite value(s); the run diverged or the file is damaged"
    )


def test_resharding_refuses_a_placement_other_than_fsdp2_s_dim_0(ranks):
    """Rows are FSDP2's split of dim 0; a tensor split along another dimension, or replicated, is refused by name."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: PLC0415

    def rank_main(ctx, mesh):
        messages = []
        for placement in (Shard(1), Replicate()):
            with pytest.raises(shard_checkpoint.ShardError) as caught:
                rows_of(distribute_tensor(torch.zeros(4, 6), mesh, [placement]))
            messages.append(str(caught.value))
        return messages

    for messages in ranks(rank_main):
        assert messages == [
            f"a shard placed as ({placement},): vlmreg reshards only FSDP2's default placement (dim 0)"
            for placement in ("Shard(dim=1)", "Replicate()")
        ]


def test_resharding_refuses_a_dim_0_shard_of_other_rows_than_fsdp2_s_split(ranks):
    """Rows 0-2 on rank 0 and 3-4 on rank 1 is FSDP2's split of 5 rows over 2 (``torch.chunk``); a DTensor that
    puts 3 on each claims another split, and the rank whose rows differ says so."""
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415

    def rank_main(ctx, mesh):
        uneven = DTensor.from_local(torch.zeros(3, 4), mesh, [Shard(0)], run_check=False, shape=(5, 4), stride=(4, 1))
        try:
            return rows_of(uneven)
        except shard_checkpoint.ShardError as exc:
            return str(exc)

    refusal = (
        "this rank's shard has 3 of 5 rows, not the 2 FSDP2's split by dim 0 gives; vlmreg reshards only FSDP2's "
        "default placement (dim 0)"
    )
    assert ranks(rank_main) == [(0, 3), refusal]


def test_a_resharded_load_refuses_rank_files_that_hold_other_tensors(ranks, tmp_path):
    """Read by one process, rank 1's trainable file without a weight rank 0's has is refused naming both files."""
    path = ranks(lambda ctx, mesh: trained(ctx, mesh, tmp_path)[2])[0]
    rewrite(path / f"{TR1}.safetensors", replaced("1.bias", None))
    model = copy.deepcopy(MODEL)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, None)
    assert str(caught.value) == (
        f"{path / TR1}.safetensors holds other tensors than {TR0}.safetensors; the checkpoint is damaged"
    )


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_a_resharded_load_refuses_a_missing_or_unreadable_rank_file_naming_it(ranks, tmp_path, damage):
    path = ranks(lambda ctx, mesh: trained(ctx, mesh, tmp_path)[2])[0]
    file = path / f"{TR1}.safetensors"
    if damage == "missing":
        file.unlink()
    else:
        file.write_bytes(b"not safetensors at all")
    model = copy.deepcopy(MODEL)  # one process: rank 1's file is read for every weight's rows
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, None)
    if damage == "missing":
        assert str(caught.value) == f"{file} is missing (an incomplete checkpoint)"
    else:
        assert str(caught.value).startswith(f"{file} is damaged: it cannot be read as safetensors (")


def test_a_resharded_load_refuses_what_does_not_fit_naming_the_file(ranks, tmp_path):
    """One process reading a two-rank checkpoint: a file whose metadata names another rank, a model whose rows have
    another shape or which trains another weight, and optimizer state of no weight; each refused naming the file."""
    path = ranks(lambda ctx, mesh: trained(ctx, mesh, tmp_path)[2])[0]
    tr0, tr1, op0 = (path / f"{name}.safetensors" for name in (TR0, TR1, "optimizer.rank00000-of-00002"))

    def refusal(model: torch.nn.Module, optimizer: bool = False) -> str:
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(path, model, torch.optim.AdamW(model.parameters()) if optimizer else None)
        return str(caught.value)

    wider = base()
    wider[0] = torch.nn.Linear(9, 12)
    wider[0].bias.requires_grad_(False)
    assert refusal(wider) == (
        f"{tr0}: weight '0.weight' has rows of shape [8], the model's are [9]; was it written with another [model] "
        "config?"
    )
    more = base()
    more[0].bias.requires_grad_(True)
    assert refusal(more) == (
        f"{tr0}: the checkpoint's trainable weights do not match this model's (missing ['0.bias'], unexpected []); "
        "was it written with another [model] config?"
    )
    for rank in (0, 1):
        rewrite(path / f"optimizer.rank0000{rank}-of-00002.safetensors", renamed("1.bias::exp_avg", "9.bias::exp_avg"))
    assert refusal(copy.deepcopy(MODEL), optimizer=True) == (
        f"{op0}: optimizer state '9.bias::exp_avg' belongs to no trainable weight of this model"
    )
    rewrite(tr1, lambda tensors: None, metadata={"rank": "0", "world_size": "2"})
    assert refusal(copy.deepcopy(MODEL)) == (
        f"{tr1} says it is rank 0 of 2, not rank 1 of 2; was it renamed or copied from another checkpoint?"
    )


def test_three_ranks_resume_two_ranks_checkpoint_each_with_its_own_rows(ranks, tmp_path):
    """Rank 1 of three takes rows 4-7 of 12: two from each of the two ranks' files (6 + 6); every state equal to the
    two ranks' state gathered from memory."""

    def save(ctx, mesh):
        model, optimizer, _ = trained(ctx, mesh, tmp_path)
        return gathered(model, optimizer)

    at_save = ranks(save)[0]

    def resume(ctx, mesh):
        model, optimizer = sharded(base(seed=5), mesh)
        load_checkpoint(tmp_path / "step_000002", model, optimizer, ctx)
        return model[0].weight.to_local().shape[0], gathered(model, optimizer)

    for rank, (rows, resumed) in enumerate(ranks(resume, world=3)):
        assert rows == 4, rank
        assert resumed.keys() == at_save.keys()
        for name, value in at_save.items():
            assert torch.equal(resumed[name], value), (rank, name)


def test_a_resharded_load_names_the_file_that_holds_a_nan_and_the_folder_for_another_dtype(ranks, tmp_path):
    path = ranks(lambda ctx, mesh: trained(ctx, mesh, tmp_path)[2])[0]
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, base().to(torch.float64), None)
    assert str(caught.value) == (
        f"{path}: weight '0.weight' is torch.float32 [12, 8], this rank's shard of the model's is torch.float64 "
        "[12, 8]; was it written with another [model] config?"
    )
    rewrite(path / f"{TR1}.safetensors", nan_at("0.weight", count=2))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, copy.deepcopy(MODEL), None)
    assert str(caught.value) == (
        f"{path / TR1}.safetensors: weight '0.weight' holds 2 NaN or infinite value(s); the run diverged or the file "
        "is damaged"
    )


def test_one_process_reads_a_double_colon_module_and_names_the_file_of_a_damaged_optimizer_state(ranks, tmp_path):
    """Resharded (one process, no FSDP2): a module named with ``::`` gets its optimizer state and Python numbers back
    as saved; an infinite moment names the rank file that holds it as optimizer state; a damaged numbers list names
    rank 0's file, the one it is read from."""
    named = double_colon_model()

    def save(ctx, mesh):
        model = sharded(named, mesh)[0]
        optimizer = IntStepAdam(model.parameters())
        train(model, optimizer, ctx.rank, range(2))
        path = save_checkpoint(tmp_path, 2, model, optimizer, {"source": None}, ctx=ctx)
        return path, {
            n: full_tensor(v).clone() if torch.is_tensor(v) else v for n, v in states(model, optimizer).items()
        }

    path, at_save = ranks(save)[0]
    model = copy.deepcopy(named)
    optimizer = IntStepAdam(model.parameters())
    load_checkpoint(path, model, optimizer, None)
    resumed = states(model, optimizer)
    assert "in::proj.weight::exp_avg" in at_save and set(resumed) == set(at_save)
    for name, value in at_save.items():
        if torch.is_tensor(value):
            assert torch.equal(resumed[name], value), name
        else:  # the Python step counts stay Python numbers
            assert resumed[name] == value and type(resumed[name]) is type(value), name

    rank1 = rank_file(path, "optimizer", 1)
    original = rank1.read_bytes()
    rewrite(rank1, nan_at("in::proj.weight::exp_avg_sq", value=float("inf")))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, copy.deepcopy(named), IntStepAdam(copy.deepcopy(named).parameters()), None)
    assert str(caught.value) == (
        f"{rank1}: optimizer state 'in::proj.weight::exp_avg_sq' holds 1 NaN or infinite value(s); the run diverged "
        "or the file is damaged"
    )
    rank1.write_bytes(original)
    rank0 = rank_file(path, "optimizer", 0)
    with safe_open(rank0, "pt") as f:
        meta = f.metadata()
    rewrite(rank0, lambda t: None, meta | {shard_checkpoint.NUMBERS: "{not json"})
    with pytest.raises(CheckpointError) as caught:
        fresh = copy.deepcopy(named)
        load_checkpoint(path, fresh, IntStepAdam(fresh.parameters()), None)
    assert str(caught.value).startswith(f"{rank0} is damaged: its 'python_numbers' metadata is not JSON ("), str(
        caught.value
    )


def test_a_resume_says_when_it_reshards_and_only_then(ranks, tmp_path):
    """`resume_checkpoint` logs ``step_N was written by W processes and is read by M (resharded)`` for three ranks or
    one process reading a two-rank checkpoint, and nothing of the kind for two ranks reading it."""
    ranks(lambda ctx, mesh: trained(ctx, mesh, tmp_path)[2])

    def resume(ctx, mesh):
        said: list[str] = []
        model, optimizer = sharded(base(seed=5), mesh)
        resume_checkpoint(tmp_path, model, optimizer, ctx, log=said.append)
        return said

    resharded = "step_000002 was written by 2 processes and is read by {} (resharded)"
    assert ranks(resume, world=3) == [[resharded.format(3)]] * 3
    assert ranks(resume) == [[], []]
    said: list[str] = []
    resume_checkpoint(tmp_path, copy.deepcopy(MODEL), None, None, log=said.append)
    assert said == [resharded.format(1)]
