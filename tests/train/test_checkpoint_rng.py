"""Each rank resumes its own RNG state, a state torch refuses is found before anything is applied, and a CUDA state
(on a machine that has one) is saved and handed back as it was.

The references: a ``torch.Generator`` seeded by the test (the draws a restored state must give), the tensors
safetensors reads back from ``rng.safetensors``, and the state the (stand-in) CUDA device gave when saving.
"""

from __future__ import annotations

import datetime
import gc
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlmreg.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from vlmreg.train.distributed import Distributed

from .test_checkpoint_files import tiny


def seeded_state(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


def draws_after(seed: int) -> torch.Tensor:
    return torch.rand(6, generator=torch.Generator().manual_seed(seed))


def rank(r: int) -> Distributed:
    """Rank ``r`` of two: loading reads only its rank (no collective), so no process group is needed."""
    return Distributed(rank=r, world=2, device=torch.device("cpu"))


@pytest.mark.parametrize("how", ["resume_checkpoint", "load_checkpoint"])
def test_each_rank_resumes_its_own_cpu_rng_state(tmp_path, how):
    model, optimizer = tiny()
    torch.manual_seed(11)  # rank 0's state when it saved
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    written = load_file(path / "rng.safetensors")
    assert torch.equal(written["torch_cpu_rank0"], seeded_state(11))
    # what rank 1 would have gathered to rank 0: its own state
    save_file({**written, "torch_cpu_rank1": seeded_state(22)}, path / "rng.safetensors")
    for r, seed in ((1, 22), (0, 11)):
        torch.manual_seed(99)
        if how == "resume_checkpoint":
            assert resume_checkpoint(tmp_path, model, optimizer, rank(r))[0] == path
        else:
            load_checkpoint(path, model, optimizer, rank(r))
        assert torch.equal(torch.rand(6), draws_after(seed)), f"rank {r}"


def test_a_rank_the_checkpoint_holds_no_rng_state_for_draws_a_stream_of_its_own(tmp_path, caplog):
    """More processes than wrote the checkpoint (a resharded resume): rank 1 of a one-process checkpoint gets neither
    rank 0's stream nor the one it had, the same on every load, with a warning naming the file and the rank."""
    model, optimizer = tiny()
    torch.manual_seed(11)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})  # one process wrote it
    draws: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for r in (0, 1, 1):
        torch.manual_seed(99)
        with caplog.at_level(logging.WARNING, logger="vlmreg.train.checkpoint"):
            load_checkpoint(path, model, optimizer, rank(r))
        draws[r].append(torch.rand(6))
    assert torch.equal(draws[0][0], draws_after(11))  # rank 0: its own saved stream
    assert not torch.equal(draws[1][0], draws_after(11)) and not torch.equal(draws[1][0], draws_after(99))
    assert torch.equal(draws[1][0], draws[1][1])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all(
        m.startswith(f"warning: {path / 'rng.safetensors'} has no RNG state for rank 1 (fewer processes wrote it)")
        for m in warned
    ), warned


def test_an_rng_state_torch_refuses_is_found_before_anything_is_applied_and_resume_falls_back(tmp_path):
    """Its size and dtype are a CPU state's, its content is not (an all-zero Mersenne Twister state): it was found
    only while applying, after the weights were loaded, and resume stopped there instead of falling back."""
    model, optimizer = tiny()
    first = save_checkpoint(tmp_path, 1, model, optimizer, {})
    at_first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    second = save_checkpoint(tmp_path, 2, model, optimizer, {})
    rng = load_file(second / "rng.safetensors")
    save_file({**rng, "torch_cpu_rank0": torch.zeros_like(rng["torch_cpu_rank0"])}, second / "rng.safetensors")
    with torch.no_grad():
        model.weight.add_(1.0)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    expected = (
        f"{second / 'rng.safetensors'} is damaged: torch_cpu_rank0 is not a CPU RNG state (Invalid mt19937 state)"
    )
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(second, model, optimizer)
    assert str(caught.value) == expected
    assert all(torch.equal(v, changed[k]) for k, v in model.state_dict().items())  # nothing applied
    logged: list[str] = []
    assert resume_checkpoint(tmp_path, model, optimizer, log=logged.append)[0] == first
    assert logged == [
        f"warning: skipped checkpoint step_000002: {expected}",
        "warning: resuming from step_000001, the newest good checkpoint, after skipping 1 newer one(s)",
    ]
    assert all(torch.equal(v, at_first[k]) for k, v in model.state_dict().items())


def test_warnings_go_to_the_module_logger_by_default(tmp_path, caplog):
    model, optimizer = tiny()
    save_checkpoint(tmp_path, 1, model, optimizer, {})
    (tmp_path / "latest").unlink()
    with caplog.at_level(logging.WARNING, logger="vlmreg.train.checkpoint"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            "vlmreg.train.checkpoint",
            logging.WARNING,
            f"warning: {tmp_path / 'latest'} is missing; trying the newest checkpoint",
        )
    ]


class StandInCuda:
    """What a machine with CUDA shows the checkpoint code: an RNG state to save, and the state it is handed back."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, state: torch.Tensor, available: bool = True, refuse: str = ""
    ) -> None:
        self.state = state
        self.set_to: list[torch.Tensor] = []
        self.refuse = refuse  # the RuntimeError torch's CUDA generator raises for a state it does not accept
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: self.state.clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_rng_state)

    def set_rng_state(self, new_state: torch.Tensor, *args, **kwargs) -> None:
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.set_to.append(new_state)


def test_with_cuda_its_rng_state_is_saved_per_rank_and_handed_back(tmp_path, monkeypatch):
    model, optimizer = tiny()
    cuda_state = torch.arange(16, dtype=torch.uint8)  # a CUDA generator's state: 16 bytes (seed and offset)
    device = StandInCuda(monkeypatch, cuda_state)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    written = load_file(path / "rng.safetensors")
    assert sorted(written) == ["torch_cpu_rank0", "torch_cuda_rank0"]
    assert torch.equal(written["torch_cuda_rank0"], cuda_state)
    device.state = torch.zeros(16, dtype=torch.uint8)  # the device moved on
    load_checkpoint(path, model, optimizer)
    assert len(device.set_to) == 1 and torch.equal(device.set_to[0], cuda_state)


@pytest.mark.parametrize(
    ("entry", "shown"),
    [(torch.zeros(2, 8, dtype=torch.uint8), "torch.uint8 [2, 8]"), (torch.zeros(16), "torch.float32 [16]")],
    ids=["two-dimensional", "not-bytes"],
)
def test_a_malformed_cuda_rng_state_is_refused_before_anything_is_applied(tmp_path, monkeypatch, entry, shown):
    model, optimizer = tiny()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    save_file({**load_file(path / "rng.safetensors"), "torch_cuda_rank0": entry}, path / "rng.safetensors")
    device = StandInCuda(monkeypatch, torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, optimizer)
    assert str(caught.value) == (
        f"{path / 'rng.safetensors'} is damaged: torch_cuda_rank0 is {shown}, not a CUDA RNG state"
    )
    assert device.set_to == []


@pytest.mark.parametrize("entry", [torch.zeros(7, dtype=torch.uint8), torch.zeros(5056)], ids=["short", "not-bytes"])
def test_a_cpu_rng_state_of_another_size_or_dtype_is_refused_naming_both(tmp_path, entry):
    model, optimizer = tiny()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    assert load_file(path / "rng.safetensors")["torch_cpu_rank0"].shape == torch.get_rng_state().shape
    save_file({"torch_cpu_rank0": entry}, path / "rng.safetensors")
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, optimizer)
    assert str(caught.value) == (
        f"{path / 'rng.safetensors'} is damaged: torch_cpu_rank0 is {entry.dtype} {list(entry.shape)}, not a CPU RNG "
        "state"
    )


def test_a_cuda_rng_state_the_device_refuses_is_an_error_naming_the_file(tmp_path, monkeypatch):
    model, optimizer = tiny()
    StandInCuda(monkeypatch, torch.arange(16, dtype=torch.uint8))
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    StandInCuda(monkeypatch, torch.arange(16, dtype=torch.uint8), refuse="Expected a state of 16 bytes")
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, optimizer)
    assert str(caught.value) == f"{path / 'rng.safetensors'} is damaged: Expected a state of 16 bytes"


def test_a_cuda_rng_state_is_left_alone_on_a_machine_without_cuda(tmp_path, monkeypatch):
    model, optimizer = tiny()
    StandInCuda(monkeypatch, torch.arange(16, dtype=torch.uint8))
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})  # written on a machine with CUDA
    assert "torch_cuda_rank0" in load_file(path / "rng.safetensors")
    device = StandInCuda(monkeypatch, torch.zeros(16, dtype=torch.uint8), available=False)
    load_checkpoint(path, model, optimizer)
    assert device.set_to == []


def sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model sharded over the two processes (FSDP2), and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    return model, torch.optim.AdamW(model.parameters())


def two_ranks(rank_: int, folder: str) -> None:
    """One of two processes (gloo, FSDP2): both save, each with its own RNG state, into one folder (a sharded
    checkpoint: each rank writes its shards, rank 0 the RNG states), then resume from it into a fresh sharded model,
    and write what each drew after resuming and the optimizer state it was given."""
    import torch.distributed as dist  # noqa: PLC0415

    root = Path(folder)
    # a rank left waiting for one that failed gives up soon (not after gloo's default 30 minutes)
    timeout = datetime.timedelta(seconds=30)
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=rank_, world_size=2, timeout=timeout)
    try:
        save_and_resume(rank_, root)
    finally:
        # the sharded modules (held in reference cycles) freed before the group is destroyed: left to the interpreter's
        # exit, a gloo thread freed during C++ static destruction killed ranks that had finished (fsdp_optimizer.py)
        gc.collect()
        dist.destroy_process_group()


def save_and_resume(rank_: int, root: Path) -> None:
    """`two_ranks`' work, in the process group it joined."""
    import torch.distributed as dist  # noqa: PLC0415

    ctx = Distributed(rank=rank_, world=2, device=torch.device("cpu"))
    model, optimizer = sharded(0)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    torch.manual_seed(100 + rank_)
    final = save_checkpoint(root / "shared", 1, model, optimizer, {}, ctx=ctx)
    dist.barrier()  # rank 0 has published
    model, optimizer = sharded(5)
    torch.manual_seed(7)
    path, _ = resume_checkpoint(root / "shared", model, optimizer, ctx)
    draws = torch.rand(6)
    names = {id(p): n for n, p in model.named_parameters()}
    given = {f"{names[id(p)]}::{k}": v for p, state in optimizer.state.items() for k, v in state.items()}
    kinds = {key: type(v).__name__ for key, v in given.items()}
    whole = {key: v.full_tensor() if kinds[key] == "DTensor" else v.clone() for key, v in given.items()}
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()  # the state it was given is usable: sharded like the parameters
    result = {"final": str(final), "resumed": str(path), "draws": draws, "kinds": kinds, "whole": whole}
    torch.save(result, root / f"drew{rank_}.pt")


def test_with_two_processes_rank_0_writes_every_ranks_rng_state_and_each_resumes_its_own(tmp_path):
    """And with FSDP each rank is given back its own shard of the optimizer state (the rank files, joined along the
    first dimension, are the whole state each rank gathered after resuming)."""
    model, optimizer = tiny()
    save_checkpoint(tmp_path / "shared", 0, model, optimizer, {})  # an earlier one-process checkpoint there
    spawn = torch.multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=two_ranks, args=(r, str(tmp_path))) for r in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=60)
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    assert [process.exitcode for process in ranks] == [0, 0]
    written = tmp_path / "shared" / "step_000001"
    rng = load_file(written / "rng.safetensors")
    assert sorted(rng) == ["torch_cpu_rank0", "torch_cpu_rank1"]
    files = [load_file(written / f"optimizer.rank{r:05d}-of-00002.safetensors") for r in (0, 1)]
    for r in (0, 1):
        assert torch.equal(rng[f"torch_cpu_rank{r}"], seeded_state(100 + r)), r
        drew = torch.load(tmp_path / f"drew{r}.pt")
        assert drew["final"] == str(written) and drew["resumed"] == str(written)
        assert torch.equal(drew["draws"], draws_after(100 + r)), r
        assert sorted(drew["whole"]) == sorted(files[r]) and len(files[r]) == 4 * 3
        for key, value in drew["whole"].items():
            if key.endswith("::step"):  # the step count whole on every rank
                assert torch.equal(value, files[r][key]), key
            else:  # rank 0's rows, then rank 1's
                assert torch.equal(value, torch.cat([files[0][key], files[1][key]])), key
        assert {key for key, kind in drew["kinds"].items() if kind == "DTensor"} == {
            key for key in files[r] if not key.endswith("::step")
        }
