"""CompensatedAdamW against torch.optim.AdamW: the same steps in fp32, and bf16 weights that follow an fp32 run where
plain bf16 AdamW loses its updates to rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vlmreg
from vlmreg.train import optim as module
from vlmreg.train.optim import CompensatedAdamW


def _weights(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter((0.02 * torch.randn(shape, generator=g)).to(dtype)) for shape in ((64, 48), (48,), (3, 5, 7))
    ]


def _gradients(step: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [0.5 + torch.randn(p.shape, generator=g) * (1 + 0.01 * step) for p in like]  # a drift, so weights travel


def _run(optimizer_cls, params, steps: int, **options) -> list[torch.Tensor]:
    optimizer = optimizer_cls(params, **options)
    for step in range(steps):
        for p, grad in zip(params, _gradients(step, params), strict=True):
            p.grad = grad.to(p.dtype)
        optimizer.step()
    return [p.detach().float().clone() for p in params]


@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_fp32_steps_are_torch_adamw_s(decay):
    options = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": decay}
    ours = _run(CompensatedAdamW, _weights(torch.float32), 25, **options)
    torch_s = _run(torch.optim.AdamW, _weights(torch.float32), 25, **options)
    for a, b in zip(ours, torch_s, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_bf16_weights_follow_fp32_where_plain_bf16_adamw_does_not_move():
    """lr 2e-6 on weights of size 0.02 (bf16 spacing there: 1.2e-4): torch's AdamW on bf16 rounds every update away,
    while the compensated weights move as fp32 AdamW's do: the bf16 weight plus its compensation is the fp32 run's
    weight (up to the bf16 moments), and the bf16 weight alone is within its own rounding of it."""
    options = {"lr": 2e-6, "weight_decay": 0.0}
    start = [p.detach().float().clone() for p in _weights(torch.bfloat16)]
    reference = _run(torch.optim.AdamW, [torch.nn.Parameter(w.clone()) for w in start], 300, **options)
    plain = _run(torch.optim.AdamW, _weights(torch.bfloat16), 300, **options)
    params = _weights(torch.bfloat16)
    optimizer = CompensatedAdamW(params, **options)
    for step in range(300):
        for p, grad in zip(params, _gradients(step, params), strict=True):
            p.grad = grad.to(p.dtype)
        optimizer.step()
    ours = [p.detach().float() for p in params]
    effective = [p.detach().float() + optimizer.state[p]["compensation"].float() for p in params]

    def error(values):
        return float(torch.cat([(v - r).flatten() for v, r in zip(values, reference, strict=True)]).norm() / moved)

    moved = torch.cat([(r - s).flatten() for r, s in zip(reference, start, strict=True)]).norm()
    assert error(plain) > 0.95  # plain bf16 AdamW: nothing moved
    assert error(effective) < 0.02, error(effective)
    assert error(ours) < 0.3, error(ours)  # at most half a bf16 step per weight from the fp32 run


def test_large_parameters_step_in_pieces_as_they_would_whole(monkeypatch):
    whole = _run(CompensatedAdamW, _weights(torch.bfloat16), 5, lr=1e-4)
    monkeypatch.setattr(module, "PIECE", 100)
    pieces = _run(CompensatedAdamW, _weights(torch.bfloat16), 5, lr=1e-4)
    for a, b in zip(whole, pieces, strict=True):
        assert torch.equal(a, b)


def test_a_torch_adamw_checkpoint_loads_and_state_round_trips():
    params = _weights(torch.bfloat16)
    first = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    first.step()
    ours = CompensatedAdamW(params, lr=1e-3)
    ours.load_state_dict(first.state_dict())
    ours.step()
    state = ours.state_dict()
    assert float(state["state"][0]["step"]) == 2 and "compensation" in state["state"][0]
    again = CompensatedAdamW(params, lr=1e-3)
    again.load_state_dict(state)
    assert torch.equal(again.state[params[0]]["compensation"], ours.state[params[0]]["compensation"])


def test_a_bf16_run_steps_with_compensation(tmp_path):
    """The trainer picks CompensatedAdamW for bf16 weights: after a supervised warm-up step at lr 1e-6 (updates far
    below a bf16 weight's spacing) the checkpoint holds the rounding errors carried forward; plain AdamW is one
    setting away."""

    main = Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_vl_tiny.toml"
    quick = [
        "trainer.format_warmup_steps=1",
        "eval.every=0",
        "logging.rollout_page_every=0",
        "trainer.prompts_per_step=2",
        "rollout.group_size=2",
        "model.dtype=bfloat16",
        "trainer.learning_rate=1e-6",
        "trainer.steps=1",
    ]
    result = vlmreg.train(main, overrides=quick, output_dir=tmp_path / "a", log=lambda m: None)
    state = load_file(result.checkpoint / "optimizer.safetensors")
    carried = [value for key, value in state.items() if key.endswith("::compensation")]
    assert carried and any(bool(value.abs().max() > 0) for value in carried)
    plain = vlmreg.train(
        main, overrides=[*quick, "trainer.compensated_updates=false"], output_dir=tmp_path / "b", log=lambda m: None
    )
    assert not any(key.endswith("::compensation") for key in load_file(plain.checkpoint / "optimizer.safetensors"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton step is for GPUs")
def test_the_gpu_kernel_step_is_the_eager_arithmetic(monkeypatch):
    """One Triton kernel per parameter on a GPU: the same weights, moments and compensation as the eager step (up to
    fp32 rounding: the weights at most one bf16 step apart), for bf16 and fp32 parameters."""
    options = {"lr": 3e-4, "weight_decay": 0.1}
    runs = {}
    for compiled in (True, False):
        module._kernel.cache_clear()
        monkeypatch.setenv("VLMREG_COMPILED_OPTIMIZER", "1" if compiled else "0")
        params = [
            torch.nn.Parameter(p.detach().cuda()) for p in _weights(torch.bfloat16) + _weights(torch.float32, seed=1)
        ]
        optimizer = CompensatedAdamW(params, **options)
        for step in range(20):
            # the fp32 ones drawn as `_run` draws them
            grads = _gradients(step, params[:3]) + _gradients(step, params[3:])
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad.to(p.dtype).cuda()
            optimizer.step()
        runs[compiled] = [
            (p.detach().float().cpu(), {k: v.float().cpu() for k, v in optimizer.state[p].items() if k != "step"})
            for p in params
        ]
    module._kernel.cache_clear()
    monkeypatch.setenv("VLMREG_COMPILED_OPTIMIZER", "1")
    assert module._kernel() is not None
    # the fp32 weights (no compensation) against torch's own AdamW, the independent reference
    reference = _run(torch.optim.AdamW, _weights(torch.float32, seed=1), 20, **options)
    for (w, _), expected in zip(runs[True][3:], reference, strict=True):
        torch.testing.assert_close(w, expected, rtol=1e-5, atol=1e-7)
    for (w, state), (w_eager, state_eager) in zip(runs[True], runs[False], strict=True):
        # one bf16 step
        assert bool(((w - w_eager).abs() <= 2.0**-7 * torch.maximum(w.abs(), w_eager.abs()) + 3e-5).all())
        for name in state_eager:
            torch.testing.assert_close(
                state[name] + (w if name == "compensation" else 0),
                state_eager[name] + (w_eager if name == "compensation" else 0),
                rtol=1e-2,
                atol=1e-6,
            )
