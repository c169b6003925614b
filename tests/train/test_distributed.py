"""FSDP2 under torchrun on CPU (gloo): exact gradients, and `vlmreg train` with two processes, resumed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import vlmreg
from vlmreg.config import parse_config

HERE = Path(__file__).resolve().parent
MAIN = str(HERE.parents[1] / "examples" / "configs" / "qwen3_vl_tiny.toml")


def torchrun(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


CASES = [("qwen3_vl", "0"), ("qwen3_5_moe", "0"), ("qwen3_5_moe", "2")]


@pytest.mark.parametrize(("family", "prefetch"), CASES)
def test_sharded_gradients_equal_one_process(family, prefetch):
    """Prefetch 2: FSDP2 explicit prefetching (`shard_model`) wired to the neighbouring layers; the same gradients."""
    result = torchrun(str(HERE / "fsdp_gradients.py"), family, "cpu", prefetch)
    assert result.returncode == 0, result.stdout[-1000:] + "\n" + result.stderr[-3000:]
    assert result.stdout.count(": OK") == 2


def test_with_fsdp_the_checkpoint_written_for_vllm_is_gathered_from_every_rank(tmp_path):
    result = torchrun(str(HERE / "fsdp_export.py"), str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(": OK") == 3


def test_two_trainer_processes_against_two_launched_servers(tmp_path):
    """Each rank spreads its groups over both servers; one broadcast from rank 0 reaches both (their logprobs stay the
    trainer's: mismatch_kl 0 every step)."""
    out = tmp_path / "run"
    result = torchrun(
        "-m",
        "vlmreg",
        "train",
        MAIN,
        *QUICK_ARGS,
        "--set",
        "trainer.steps=2",
        "--set",
        "rollout.engine=openai",
        "--set",
        "rollout.launch=true",
        "--set",
        "rollout.servers=2",
        "--set",
        "broadcast.transport=gloo",
        "--output-dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["mismatch_kl"] < 1e-8 for r in records)
    for r in records:
        per_server = r["rollout_completions_per_server"]
        assert len(per_server) == 2 and min(per_server) > 0 and sum(per_server) == r["samples"], r
    # initial + 2 steps
    assert all((out / f"server-{k}.log").read_text().count("POST /v1/weights") == 3 for k in range(2))


def test_two_trainer_processes_against_a_launched_server(tmp_path):
    """FSDP shards are gathered on both ranks and rank 0 sends them; both ranks sample from the server."""
    out = tmp_path / "run"
    result = torchrun(
        "-m",
        "vlmreg",
        "train",
        MAIN,
        *QUICK_ARGS,
        "--set",
        "trainer.steps=2",
        "--set",
        "rollout.engine=openai",
        "--set",
        "rollout.launch=true",
        "--set",
        "broadcast.transport=gloo",
        "--output-dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["mismatch_kl"] < 1e-8 for r in records)
    assert (out / "server.log").read_text().count("POST /v1/weights") == 3  # the full sync, then one per step
    assert result.stdout.count("done: step 2") == 1


QUICK_ARGS = [
    "--set",
    "trainer.format_warmup_steps=0",
    "--set",
    "trainer.prompts_per_step=4",
    "--set",
    "rollout.group_size=4",
    "--set",
    "eval.every=0",
    "--set",
    "logging.rollout_page_every=0",
]


def mixed_dataset(folder: Path) -> Path:
    """A run config on four prompts, one with an image and three text only: each step takes all four and each rank
    two, so every step one rank's micro-batch carries the image and the other's none."""
    Image.new("RGB", (64, 64), "red").save(folder / "red.png")
    image = [{"type": "image_url", "image_url": {"url": "red.png"}}, {"type": "text", "text": "Which colour?"}]
    records = [{"messages": [{"role": "user", "content": image}], "answer": "Red"}] + [
        {"messages": [{"role": "user", "content": f"Say {word}."}], "answer": word} for word in ("Red", "Green", "Blue")
    ]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = folder / "run.toml"
    config.write_text(
        '[model]\ninit = "random"\nfamily = "qwen3_vl"\nsize = "tiny"\n\n[rollout]\ngroup_size = 4\nmax_tokens = 8\n\n'
        '[trainer]\ndevice = "cpu"\nsteps = 2\nprompts_per_step = 4\n\n[data]\npaths = ["data.jsonl"]\n\n'
        "[reward]\nfunctions = { exact_match = 1.0 }\n\n[eval]\nevery = 0\n\n[logging]\nrollout_page_every = 0\n"
    )
    return config


def test_train_with_two_processes_on_prompts_with_and_without_images(tmp_path):
    """Every step one rank's micro-batch has the image and the other's has none: the other runs its vision tower on a
    stand-in image segment without loss (`vlmreg.train.vision_ranks`), so FSDP2's gathers match and both steps train
    (before, the step stopped: "micro-batch 0 of this step carries images on rank(s) ...")."""
    out = tmp_path / "run"
    config = mixed_dataset(tmp_path)
    result = torchrun(
        "-m", "vlmreg", "train", str(config), "--set", "model.vlm.freeze_vision_encoder=false", "--output-dir", str(out)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["samples"] == 16 for r in records), records
    # the stand-in adds no loss token: each completion's tokens, and no more
    assert all(r["loss_tokens"] == r["samples"] * r["response_length"] > 0 for r in records), records


def test_train_with_two_processes_and_resume(tmp_path):
    out = tmp_path / "run"
    common = [
        "--set",
        "trainer.format_warmup_steps=2",
        "--set",
        "trainer.prompts_per_step=4",
        "--set",
        "rollout.group_size=4",
        "--set",
        "eval.every=2",
        "--set",
        "eval.num_samples=8",
        "--set",
        "trainer.save_every=2",
        "--output-dir",
        str(out),
    ]
    result = torchrun("-m", "vlmreg", "train", MAIN, "--set", "trainer.steps=2", *common)
    assert result.returncode == 0, result.stderr[-3000:]
    result = torchrun("-m", "vlmreg", "train", MAIN, "--set", "trainer.steps=4", *common, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # written once, by rank 0
    assert all(r["samples"] == 16 and 0.0 <= r["reward_mean"] <= 1.0 for r in records)
    assert records[1]["eval_samples"] == 8.0
    assert (out / "checkpoints" / "latest").read_text() == "step_000004"
    # every trainable weight trained, the ones FSDP keeps at the root (embeddings, final norm) included

    # a sharded checkpoint: each rank's rows (FSDP2 shards dim 0), together the whole weights
    ranks = [
        load_file(out / "checkpoints" / "step_000004" / f"trainable.rank{r:05d}-of-00002.safetensors") for r in (0, 1)
    ]
    trained = {name: torch.cat([shard[name] for shard in ranks]) for name in ranks[0]}
    torch.manual_seed(0)
    initial = dict(
        vlmreg.load(
            parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
        ).model.named_parameters()
    )
    for name in (
        "model.language_model.embed_tokens.weight",
        "model.language_model.norm.weight",
        "model.language_model.layers.0.mlp.up_proj.weight",
    ):
        assert not torch.equal(trained[name], initial[name].detach()), name


def test_a_rank_that_fails_says_why_at_once_and_the_job_ends(tmp_path):
    """Rank 1 fails while rank 0 waits in the sharded forward: rank 1 prints its error before anything else and aborts
    its process group instead of a graceful destroy (which, with NCCL, waited for rank 0 forever on two H200s)."""

    started = time.monotonic()
    result = torchrun(str(HERE / "fsdp_rank_fails.py"), MAIN, str(tmp_path / "run"), timeout=120)
    took = time.monotonic() - started
    assert result.returncode != 0
    assert "rank 1: failed: RuntimeError: injected failure on rank 1" in result.stderr, result.stderr[-3000:]
    assert took < 90, took


def test_compensated_adamw_steps_fsdp_shards_as_one_process_steps_the_whole():
    result = torchrun(str(HERE / "fsdp_optimizer.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(": OK") == 2


def test_train_with_two_processes_under_a_memory_budget(tmp_path):
    """trainer.memory_budget_gib under torchrun: each rank measures and plans for itself (here a budget nothing fits, so
    every layer and vision block recomputes on both), the step ends, and only rank 0 speaks."""
    out = tmp_path / "run"
    result = torchrun(
        "-m",
        "vlmreg",
        "train",
        MAIN,
        *QUICK_ARGS,
        "--set",
        "trainer.steps=1",
        "--set",
        "model.vlm.freeze_vision_encoder=false",
        "--set",
        "trainer.memory_budget_gib=0.000001",
        "--output-dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert (record["recompute_layers"], record["recompute_vision_blocks"]) == (2, 2), record
    assert record["predicted_peak_gib"] > 0 and record["samples"] == 16
    said = result.stdout + result.stderr
    assert said.count("warning: trainer.memory_budget_gib = ") == 1, said[-3000:]
    assert said.count(" GiB: at up to ") == 1 and said.count("objective grpo") == 1, said[-3000:]
