"""A run saved and resumed continues exactly as the same run uninterrupted: weights, optimizer state and RNG.

The reference is a plain torch loop (AdamW, data drawn from the global RNG) that never stops; the resumed run
writes a checkpoint halfway, rebuilds its model and optimizer from scratch and loads it. Every optimizer tensor
(each moment and the step count) and every weight must be bitwise those of the uninterrupted run.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlmreg.train import checkpoint as checkpoint_module
from vlmreg.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        # frozen (as pretrained weights are): the same in every process, neither saved nor restored
        model[0].bias.fill_(0.1)
    model[0].bias.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)
    return model, optimizer


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(5, 4)  # drawn from the global RNG: a resumed run must draw the same batches
        scale = random.random()  # and from Python's
        loss = (model(x) * scale).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def steps_of(loss: Callable[[torch.nn.Module], torch.Tensor]) -> Callable[..., None]:
    """``steps(model, optimizer, n)``: n optimizer steps on ``loss(model)``."""

    def steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
        for _ in range(n):
            value = loss(model)
            optimizer.zero_grad()
            value.backward()
            optimizer.step()

    return steps


def optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {f"{names[id(p)]}:{k}": v for p, state in optimizer.state.items() for k, v in state.items()}


@pytest.fixture
def uninterrupted():
    random.seed(7)
    model, optimizer = build(0)
    torch.manual_seed(1)
    train_steps(model, optimizer, 6)
    return model, optimizer


def interrupted(tmp_path, resume) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    random.seed(7)
    model, optimizer = build(0)
    torch.manual_seed(1)
    train_steps(model, optimizer, 3)
    save_checkpoint(tmp_path, 3, model, optimizer, {"note": "halfway"})
    train_steps(model, optimizer, 2)  # work after the checkpoint, lost with the process
    random.seed(99)
    model, optimizer = build(5)  # a fresh process: other initial weights, an empty optimizer, another RNG state
    state = resume(model, optimizer)
    assert state["step"] == 3 and state["note"] == "halfway"
    train_steps(model, optimizer, 3)
    return model, optimizer


@pytest.mark.parametrize("how", ["resume_checkpoint", "load_checkpoint"])
def test_resumed_run_equals_the_uninterrupted_one_tensor_by_tensor(tmp_path, uninterrupted, how):
    def resume(model, optimizer):
        if how == "resume_checkpoint":
            path, state = resume_checkpoint(tmp_path, model, optimizer)
            assert path == tmp_path / "step_000003"
            return state
        return load_checkpoint(tmp_path / "step_000003", model, optimizer)

    model, optimizer = interrupted(tmp_path, resume)
    reference, reference_optimizer = uninterrupted
    expected = optimizer_tensors(reference, reference_optimizer)
    got = optimizer_tensors(model, optimizer)
    assert sorted(got) == sorted(expected) and len(expected) == 3 * 3  # exp_avg, exp_avg_sq, step of 3 weights
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if a.requires_grad:
            assert torch.equal(a, b), name


def test_the_optimizer_state_is_what_changes_the_outcome(tmp_path, uninterrupted):
    """The check above can fail: resuming the weights alone (a fresh AdamW) gives other weights."""
    model, optimizer = interrupted(tmp_path, lambda m, o: load_checkpoint(tmp_path / "step_000003", m, None))
    reference, _ = uninterrupted
    assert not torch.equal(model[2].weight, reference[2].weight)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003"


def test_optimizer_state_for_a_weight_the_model_lacks_is_refused(tmp_path):
    model, optimizer = build(0)
    train_steps(model, optimizer, 1)
    path = save_checkpoint(tmp_path, 1, model, optimizer, {})
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    other[2].weight.requires_grad_(False)
    with pytest.raises(
        CheckpointError, match=r"trainable.safetensors: the checkpoint's trainable weights do not match"
    ):
        load_checkpoint(path, other, torch.optim.AdamW([p for p in other.parameters() if p.requires_grad]))


def test_a_checkpoint_with_other_weights_names_at_most_three_of_each(tmp_path):
    wide = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(5)))
    path = save_checkpoint(tmp_path, 1, wide, torch.optim.AdamW(wide.parameters()), {})
    narrow = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, narrow, None)
    message = str(caught.value)
    assert message.startswith(
        f"{path / 'trainable.safetensors'}: the checkpoint's trainable weights do not match this model's"
    )
    assert "(missing ['bias', 'weight'], unexpected ['0.bias', '0.weight', '1.bias'])" in message
    assert message.endswith("was it written with another [model] config?")


def test_a_write_that_lost_tensors_is_an_error_and_latest_still_names_the_good_one(tmp_path, monkeypatch):
    model, optimizer = build(0)
    train_steps(model, optimizer, 1)
    save_checkpoint(tmp_path, 1, model, optimizer, {})

    def lossy(tensors, path, *args, **kwargs):  # the file is whole, but a tensor is not in it
        save_file(
            dict(list(tensors.items())[1:]) if path.name == "trainable.safetensors" else tensors, path, *args, **kwargs
        )

    monkeypatch.setattr(checkpoint_module, "save_file", lossy)
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(tmp_path, 2, model, optimizer, {})
    assert str(caught.value) == (
        f"could not write checkpoint {tmp_path / 'step_000002'}: trainable.safetensors is missing tensors after "
        f"writing; is the disk full?; the partial .tmp-step_000002 was removed and {tmp_path / 'latest'} still names "
        "step_000001"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]


def test_a_checkpoint_folder_that_cannot_be_made_is_an_error_naming_it(tmp_path):
    model, optimizer = build(0)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(
        CheckpointError,
        match=rf"could not write checkpoint {blocker / 'step_000001'}: .* there is no earlier checkpoint",
    ):
        save_checkpoint(blocker, 1, model, optimizer, {})


def test_a_module_named_with_double_colons_resumes_its_optimizer_state(tmp_path):
    """``::`` joins a weight's name and its state's key in optimizer.safetensors; module names may hold it too."""

    def named(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential()
        model.add_module("encoder::in", torch.nn.Linear(4, 8))
        model.add_module("act", torch.nn.Tanh())
        model.add_module("out", torch.nn.Linear(8, 3))
        return model, torch.optim.AdamW(model.parameters(), lr=0.05)

    random.seed(7)
    reference, reference_optimizer = named(0)
    torch.manual_seed(1)
    train_steps(reference, reference_optimizer, 4)
    random.seed(7)
    model, optimizer = named(0)
    torch.manual_seed(1)
    train_steps(model, optimizer, 2)
    path = save_checkpoint(tmp_path, 2, model, optimizer, {})
    model, optimizer = named(5)
    load_checkpoint(path, model, optimizer)
    train_steps(model, optimizer, 2)
    expected, got = optimizer_tensors(reference, reference_optimizer), optimizer_tensors(model, optimizer)
    assert sorted(got) == sorted(expected) and len(expected) == 4 * 3
    assert all(torch.equal(got[key], value) for key, value in expected.items())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_an_optimizer_that_keeps_python_numbers_resumes_exactly(tmp_path):
    """SparseAdam keeps its step count as a Python int, and computes its bias correction from it in float64: given
    back as a tensor, the resumed run's arithmetic changed (float32) and its weights left the uninterrupted run's."""

    def sparse(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Embedding(10, 4, sparse=True)
        return model, torch.optim.SparseAdam(model.parameters(), lr=0.1)

    steps = steps_of(lambda model: model(torch.randint(0, 10, (5,))).pow(2).sum())

    reference, reference_optimizer = sparse(0)
    torch.manual_seed(1)
    steps(reference, reference_optimizer, 4)
    model, optimizer = sparse(0)
    torch.manual_seed(1)
    steps(model, optimizer, 2)
    path = save_checkpoint(tmp_path, 2, model, optimizer, {})
    model, optimizer = sparse(5)
    load_checkpoint(path, model, optimizer)
    assert optimizer.state[model.weight]["step"] == 2 and type(optimizer.state[model.weight]["step"]) is int
    steps(model, optimizer, 2)
    expected, got = reference_optimizer.state[reference.weight], optimizer.state[model.weight]
    assert sorted(got) == sorted(expected) == ["exp_avg", "exp_avg_sq", "step"]
    assert got["step"] == expected["step"] == 4 and type(got["step"]) is int
    assert torch.equal(got["exp_avg"], expected["exp_avg"]) and torch.equal(got["exp_avg_sq"], expected["exp_avg_sq"])
    assert torch.equal(model.weight, reference.weight)


def test_a_trainable_weight_the_optimizer_has_not_stepped_yet_resumes_as_uninterrupted(tmp_path):
    """A weight no loss has reached has no optimizer state yet (AdamW skips it): none is saved, none is restored."""

    def with_spare(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model, _ = build(seed)
        model.add_module("spare", torch.nn.Linear(2, 2))  # trainable, outside the forward
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)

    forward_steps = steps_of(lambda model: model[2](model[1](model[0](torch.randn(5, 4)))).pow(2).mean())

    reference, reference_optimizer = with_spare(0)
    torch.manual_seed(1)
    forward_steps(reference, reference_optimizer, 4)
    model, optimizer = with_spare(0)
    torch.manual_seed(1)
    forward_steps(model, optimizer, 2)
    path = save_checkpoint(tmp_path, 2, model, optimizer, {})
    assert not [k for k in load_file(path / "optimizer.safetensors") if k.startswith("spare.")]
    model, optimizer = with_spare(5)
    load_checkpoint(path, model, optimizer)
    forward_steps(model, optimizer, 2)
    expected, got = optimizer_tensors(reference, reference_optimizer), optimizer_tensors(model, optimizer)
    assert sorted(got) == sorted(expected) and len(expected) == 3 * 3
    assert all(torch.equal(got[key], value) for key, value in expected.items())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
