"""``[rollout] thinking_budget``: after N thinking tokens the embedded engine writes the family's thinking end marker.

Checked on the logits processor alone (a two-token marker, rows that open, close or never think, a finished row),
then on the real engine with the tiny Qwen3.5 (whose template opens ``<think>`` in the generation prompt when
thinking is on, and closes it when off), the marker's ids being the tokenizer's own encoding of ``</think>``, and
through a training run's metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vlmreg
from vlmreg.cli import main
from vlmreg.config import ConfigError, parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder
from vlmreg.rollout import PromptRequest, SamplingParams
from vlmreg.rollout.embedded import EmbeddedEngine
from vlmreg.rollout.thinking import ThinkingBudget, opens_thinking

START, END, STOP = [90], [91, 92], 99  # a two-token end marker


def run_processor(budget: ThinkingBudget, prompts: list[list[int]], choose, steps: int) -> list[list[int]]:
    """A generation loop: each step the processor's scores decide the token when it forces one, else ``choose``."""
    width = max(map(len, prompts))
    rows = [[0] * (width - len(p)) + p for p in prompts]  # left-padded, as generate's input
    for step in range(steps):
        scores = torch.zeros(len(rows), 100)
        out = budget(torch.tensor(rows), scores)
        for r, row in enumerate(rows):
            forced = torch.isfinite(out[r]).sum() == 1
            row.append(int(out[r].argmax()) if forced else choose(r, step))
    return [row[width:] for row in rows]


def test_the_marker_is_forced_after_the_budget_only_inside_an_open_block():
    prompts = [
        [1, 2, *START],  # opened by the prompt: thinking from the first token
        [1, *START, 5, *END, 3],  # closed in the prompt (thinking off): never touched
        [1, 2, 3],  # never opened: not touched ...
        [1, 2, 3],  # ... until the row samples the start marker itself
        [1, *START],  # stops (STOP) before its budget: left alone afterwards
    ]
    sampled = {3: {1: START[0]}, 4: {1: STOP}}
    budget = ThinkingBudget(3, START, END, prompts, {STOP})
    rows = run_processor(budget, prompts, lambda r, step: sampled.get(r, {}).get(step, 10 + step), steps=9)
    assert rows[0] == [10, 11, 12, *END, 15, 16, 17, 18]
    assert rows[1] == [10 + s for s in range(9)] and rows[2] == rows[1]
    assert rows[3] == [10, START[0], 12, 13, 14, *END, 17, 18]  # 3 tokens after its own start marker
    assert rows[4][:2] == [10, STOP]
    assert budget.forced == {0, 3}


def test_a_marker_the_model_samples_itself_ends_the_block_without_forcing():
    prompts = [[1, *START]]
    own = {0: 20, 1: END[0], 2: END[1]}
    budget = ThinkingBudget(3, START, END, prompts, {STOP})
    rows = run_processor(budget, prompts, lambda r, step: own.get(step, 30 + step), steps=8)
    assert rows[0] == [20, *END, 33, 34, 35, 36, 37] and not budget.forced


def test_opens_thinking_reads_the_last_markers():
    assert opens_thinking([*START, 1, *END, 2, *START], START, END)
    assert not opens_thinking([*START, 1, *END], START, END) and not opens_thinking([1, 2], START, END)


# -- the real engine -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_5():
    torch.manual_seed(0)
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": "qwen3_5"}, "trainer": {"device": "cpu"}}))
    store = ImageStore()
    return loaded, EmbeddedEngine(loaded.model, loaded.processor, store, torch.device("cpu"), descriptor=loaded.resolved.descriptor)


def sample(engine, loaded, thinking: bool, budget: int | None, n: int = 6):
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    prompt = encoder.encode([{"role": "user", "content": "How many?"}], template_kwargs={"enable_thinking": thinking})
    torch.manual_seed(1)
    params = SamplingParams(max_tokens=10, stop_token_ids=tuple(encoder.stop_ids), thinking_budget=budget)
    return engine.generate([PromptRequest.of(prompt)] * n, params)


def test_the_engine_ends_the_thinking_with_the_tokenizers_own_marker(qwen3_5):
    loaded, engine = qwen3_5
    marker = loaded.processor.tokenizer("</think>", add_special_tokens=False)["input_ids"]
    free, capped = sample(engine, loaded, True, None), sample(engine, loaded, True, 3)
    for plain, cut in zip(free, capped, strict=True):
        assert cut.token_ids[:3] == plain.token_ids[:3]  # nothing changes before the budget
        if len(plain.token_ids) > 3 and marker[0] not in plain.token_ids[:3]:
            assert cut.thinking_forced and cut.token_ids[3 : 3 + len(marker)] == marker
            assert cut.logprobs[3] == 0.0  # forced: drawn from a point mass
            text = loaded.processor.tokenizer.decode(cut.token_ids)
            assert text.startswith(loaded.processor.tokenizer.decode(cut.token_ids[:3]) + "</think>")
    assert sum(c.thinking_forced for c in capped) >= 4


def test_thinking_off_is_untouched_by_the_budget(qwen3_5):
    loaded, engine = qwen3_5
    free, capped = sample(engine, loaded, False, None), sample(engine, loaded, False, 2)
    assert [c.token_ids for c in capped] == [c.token_ids for c in free] and not any(c.thinking_forced for c in capped)


# -- the config and a run --------------------------------------------------------------------------------------------
def test_the_config_refuses_a_budget_it_cannot_apply():
    base = {"model": {"init": "random", "family": "qwen3_5"}, "data": {"task": "colour"}}
    resolve_config(parse_config({**base, "rollout": {"thinking_budget": 4}}))  # the embedded engine: fine
    with pytest.raises(ConfigError, match=r"rollout\.thinking_budget: only the embedded engine"):
        resolve_config(parse_config({**base, "rollout": {"thinking_budget": 4, "engine": "openai", "url": "http://127.0.0.1:1"},
                                     "broadcast": {"transport": "filesystem"}}))
    with pytest.raises(ConfigError, match=r"rollout\.thinking_budget: family qwen2_5_vl declares no thinking markers|has no thinking modes"):
        resolve_config(parse_config({"model": {"init": "random", "family": "qwen2_5_vl"}, "rollout": {"thinking_budget": 4}}))


def test_a_run_counts_the_budget_hits(tmp_path):
    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_5_tiny.toml"
    out = tmp_path / "run"
    sets = ["trainer.format_warmup_steps=0", "eval.every=0", "logging.rollout_page_every=0", "trainer.prompts_per_step=2",
            "rollout.group_size=2", "trainer.steps=1", "rollout.max_tokens=8", "rollout.thinking_mode=on"]
    argv = ["train", str(config), *[a for s in sets for a in ("--set", s)], "--output-dir", str(out)]
    assert main([*argv, "--set", "rollout.thinking_budget=2"]) == 0
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert 1 <= record["thinking_budget_hits"] <= 4  # 4 episodes; one that stops within 2 tokens is not cut
    assert main([*argv, "--overwrite"]) == 0
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["thinking_budget_hits"] == 0
