"""``[rollout] thinking_budget``: after N thinking tokens the embedded engine writes the family's thinking end marker.

Checked on the logits processor alone (a two-token marker, rows that open, close or never think, a finished row,
thinking tokens the prompt already holds), then on the real engine with the tiny Qwen3.5 (whose template opens
``<think>`` in the generation prompt when thinking is on, and closes it when off), the thinking tokens counted
independently off the tokenizer's own encoding of ``<think>`` and ``</think>``; the rule a server engine counts hits
by (`budget_ended`); which engines the config lets set a budget; and through a training run's metrics.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import attrs
import pytest
import torch

import vlmreg
from vlmreg import Engine, hookimpl
from vlmreg.cli import main
from vlmreg.config import ConfigError, parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder
from vlmreg.inference.embedded import EmbeddedEngine
from vlmreg.inference.thinking import (
    ThinkingBudget,
    budget_ended,
    forced_marker_positions,
    forced_markers,
    opens_thinking,
    thinking_so_far,
)
from vlmreg.sdk.engine import PromptRequest, SamplingParams
from vlmreg.sdk.registry import get_registry

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
        [1, *START, 7, 8],  # the prompt holds 2 thinking tokens already: one more is sampled
        [*START, 4, 5, 6, 7],  # the prompt holds more than the budget: the marker comes first
    ]
    sampled = {3: {1: START[0]}, 4: {1: STOP}}
    budget = ThinkingBudget(3, START, END, prompts, {STOP})
    rows = run_processor(budget, prompts, lambda r, step: sampled.get(r, {}).get(step, 10 + step), steps=9)
    assert rows[0] == [10, 11, 12, *END, 15, 16, 17, 18]
    assert rows[1] == [10 + s for s in range(9)] and rows[2] == rows[1]
    assert rows[3] == [10, START[0], 12, 13, 14, *END, 17, 18]  # 3 tokens after its own start marker
    assert rows[4][:2] == [10, STOP]
    assert rows[5] == [10, *END, 13, 14, 15, 16, 17, 18]
    assert rows[6] == [*END, 12, 13, 14, 15, 16, 17, 18]
    assert budget.forced == {0, 3, 5, 6}


def test_a_marker_the_model_samples_itself_ends_the_block_without_forcing():
    prompts = [[1, *START]]
    own = {0: 20, 1: END[0], 2: END[1]}
    budget = ThinkingBudget(3, START, END, prompts, {STOP})
    rows = run_processor(budget, prompts, lambda r, step: own.get(step, 30 + step), steps=8)
    assert rows[0] == [20, *END, 33, 34, 35, 36, 37] and not budget.forced


def test_a_block_opened_again_after_a_forced_end_gets_the_budget_again_and_every_forced_marker_is_found():
    """The row samples the start marker after its forced end: a new block, whose end is forced in turn. Both forced
    markers are the engine's tokens: the processor records both, and `forced_markers` finds both in the returned ids."""
    prompts = [[1, *START]]
    budget = ThinkingBudget(2, START, END, prompts, {STOP})
    rows = run_processor(budget, prompts, lambda r, step: START[0] if step == 4 else 30 + step, steps=12)
    assert rows[0] == [30, 31, *END, START[0], 35, 36, *END, 39, 40, 41]
    assert budget.forced == {0} and budget.forced_at == {0: [2, 7]}
    logprobs = [0.0 if i in (2, 3, 7, 8) else -1.5 for i in range(12)]
    assert forced_markers(prompts[0], rows[0], logprobs, 2, START, END) == [2, 7]
    assert forced_marker_positions([2, 7], len(END), 12) == (2, 3, 7, 8)
    assert forced_marker_positions([2, 7], len(END), 8) == (2, 3, 7)  # the second marker cut by max_tokens
    # the second marker sampled by the model (its second token not a point mass): only the first was forced
    sampled = [-0.7 if i == 8 else lp for i, lp in enumerate(logprobs)]
    assert forced_markers(prompts[0], rows[0], sampled, 2, START, END) == [2]


def test_opens_thinking_reads_the_last_markers():
    assert opens_thinking([*START, 1, *END, 2, *START], START, END)
    assert not opens_thinking([*START, 1, *END], START, END) and not opens_thinking([1, 2], START, END)
    assert (
        thinking_so_far([*START, 1, *END, 2, *START, 5, 6], START, END) == 2
        and thinking_so_far([1, 2], START, END) is None
    )


def test_a_hit_is_an_end_marker_drawn_as_a_point_mass_exactly_budget_thinking_tokens_after_its_start():
    """`budget_ended` on what a server returns: the processor's own rows are hits, and what differs from one is not."""
    prompts = [[1, 2, *START], [1, 2, 3], [1, *START, 7, 8]]
    budget = ThinkingBudget(3, START, END, prompts, {STOP})
    rows = run_processor(budget, prompts, lambda r, step: START[0] if (r, step) == (1, 0) else 10 + step, steps=8)
    for r, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        forced_at = next(i for i in range(len(row)) if row[i : i + 2] == END)
        logprobs = [0.0 if i in (forced_at, forced_at + 1) else -1.5 for i in range(len(row))]
        assert r in budget.forced and budget_ended(prompt, row, logprobs, 3, START, END)
        assert not budget_ended(prompt, row, logprobs, 2, START, END) and not budget_ended(
            prompt, row, logprobs, 4, START, END
        )
        # the model wrote the marker itself
        sampled = [-0.7 if i == forced_at + 1 else lp for i, lp in enumerate(logprobs)]
        assert not budget_ended(prompt, row, sampled, 3, START, END)
    # no open block: a marker 3 tokens after nothing is not a hit; a block closed in the prompt is not either
    assert not budget_ended([1, 2], [10, 11, 12, *END], [0.0] * 5, 3, START, END)
    assert not budget_ended([*START, 5, *END], [10, 11, 12, *END], [0.0] * 5, 3, START, END)
    # a second block the completion opens and the budget ends counts, after a first one the model closed itself
    row = [10, *END, 20, *START, 30, 31, 32, *END]
    assert budget_ended([*START], row, [-1.0] * 8 + [0.0, 0.0], 3, START, END)


# -- the real engine -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_5():
    torch.manual_seed(0)
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": "qwen3_5"}, "trainer": {"device": "cpu"}}))
    store = ImageStore()
    return loaded, EmbeddedEngine(
        loaded.model, loaded.processor, store, torch.device("cpu"), descriptor=loaded.resolved.descriptor
    )


def sample(engine, loaded, thinking: bool, budget: int | None, n: int = 6):
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    prompt = encoder.encode([{"role": "user", "content": "How many?"}], template_kwargs={"enable_thinking": thinking})
    torch.manual_seed(1)
    params = SamplingParams(max_tokens=10, stop_token_ids=tuple(encoder.stop_ids), thinking_budget=budget)
    return engine.generate([PromptRequest.of(prompt)] * n, params)


def thinking_tokens(tokenizer, prompt_ids: list[int], token_ids: list[int]) -> tuple[int, bool]:
    """Counted off the tokenizer alone: the tokens after the prompt's last ``<think>`` up to the completion's first
    ``</think>`` (both single tokens in this tokenizer), and whether that marker was written."""
    [start] = tokenizer.encode("<think>", add_special_tokens=False)
    [end] = tokenizer.encode("</think>", add_special_tokens=False)
    opened = len(prompt_ids) - 1 - prompt_ids[::-1].index(start)
    closed = token_ids.index(end) if end in token_ids else len(token_ids)
    return len(prompt_ids) - opened - 1 + closed, end in token_ids


def test_the_engine_ends_the_thinking_with_the_tokenizers_own_marker(qwen3_5):
    loaded, engine = qwen3_5
    tokenizer = loaded.processor.tokenizer
    prompt = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor).encode(
        [{"role": "user", "content": "How many?"}], template_kwargs={"enable_thinking": True}
    )
    assert tokenizer.decode(prompt.input_ids).endswith("<think>\n")  # one thinking token (the newline) in the prompt
    held, _ = thinking_tokens(tokenizer, prompt.input_ids, [])
    assert held == 1
    [marker] = tokenizer.encode("</think>", add_special_tokens=False)
    free, capped = sample(engine, loaded, True, None), sample(engine, loaded, True, 3)
    for plain, cut in zip(free, capped, strict=True):
        assert cut.token_ids[:2] == plain.token_ids[:2]  # nothing changes before the budget
        count, closed = thinking_tokens(tokenizer, prompt.input_ids, cut.token_ids)
        assert count <= 3
        if len(plain.token_ids) > 2 and marker not in plain.token_ids[:2]:
            assert cut.thinking_forced and closed and count == 3 and cut.token_ids[2] == marker
            assert cut.logprobs[2] == 0.0  # forced: drawn from a point mass
            assert cut.forced == (2,)  # the engine's token, where the tokenizer's marker stands: kept out of the loss
            assert budget_ended(prompt.input_ids, cut.token_ids, cut.logprobs, 3, *engine.thinking_markers)
        else:
            assert not cut.thinking_forced and cut.forced == ()
    assert sum(c.thinking_forced for c in capped) >= 4


def test_every_block_the_engine_ends_is_kept_out_of_the_loss(qwen3_5):
    """Every token but ``<think>`` suppressed: the model opens a new block after each forced ``</think>``, and the
    budget ends each one. ``Completion.forced`` must list every ``</think>`` (the tokenizer's id), none of which the
    model could sample; left in, each would count the policy's -log p(</think>) in ``mismatch_kl``."""
    loaded, engine = qwen3_5
    tokenizer = loaded.processor.tokenizer
    [start] = tokenizer.encode("<think>", add_special_tokens=False)
    [end] = tokenizer.encode("</think>", add_special_tokens=False)
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    prompt = encoder.encode([{"role": "user", "content": "How many?"}], template_kwargs={"enable_thinking": True})
    others = tuple(t for t in range(loaded.model.config.text_config.vocab_size) if t != start)
    params = SamplingParams(
        max_tokens=10, stop_token_ids=tuple(encoder.stop_ids), suppress_token_ids=others, thinking_budget=2
    )
    for c in engine.generate([PromptRequest.of(prompt)] * 2, params):
        # the prompt's newline and one <think>, then 2 after each <think> the model opens
        assert c.token_ids == [start, end, start, start, start, end, start, start, start, end]
        ends = tuple(i for i, t in enumerate(c.token_ids) if t == end)
        assert c.forced == ends and all(c.logprobs[i] == 0.0 for i in ends) and c.thinking_forced
        assert forced_markers(prompt.input_ids, c.token_ids, c.logprobs, 2, [start], [end]) == list(ends)


def test_thinking_off_is_untouched_by_the_budget(qwen3_5):
    loaded, engine = qwen3_5
    free, capped = sample(engine, loaded, False, None), sample(engine, loaded, False, 2)
    assert [c.token_ids for c in capped] == [c.token_ids for c in free] and not any(c.thinking_forced for c in capped)


# -- the config and a run --------------------------------------------------------------------------------------------
OPENAI = {"engine": "openai", "url": "http://127.0.0.1:1"}


def in_trainer_engine(thinking_budget: bool) -> Engine:
    """A plugin's engine that runs in the trainer and declares whether it applies a thinking budget."""
    return Engine(name=f"plain{int(thinking_budget)}", build=lambda ctx: None, thinking_budget=thinking_budget)


def test_the_config_takes_a_budget_for_the_engines_that_apply_it_and_refuses_it_for_others(vlmreg_add_plugin):
    vlmreg_add_plugin(
        types.SimpleNamespace(
            vlmreg_register_rollout_engines=hookimpl(
                lambda register: [register(in_trainer_engine(b)) for b in (False, True)]
            )
        ),
        "my-engines",
    )
    base = {"model": {"init": "random", "family": "qwen3_5"}, "data": {"task": "colour"}}
    for rollout, broadcast in [
        ({}, "none"),
        (OPENAI, "filesystem"),
        ({**OPENAI, "server": "vllm"}, "gloo"),
        ({"engine": "plain1"}, "none"),
    ]:
        rc = resolve_config(
            parse_config({**base, "rollout": {**rollout, "thinking_budget": 4}, "broadcast": {"transport": broadcast}})
        )
        assert rc.config.rollout.thinking_budget == 4
    with pytest.raises(
        ConfigError,
        match=r"rollout\.thinking_budget: engine 'plain0' cannot end the thinking after a budget \(its Engine "
        r"declares thinking_budget = False\)",
    ):
        resolve_config(parse_config({**base, "rollout": {"engine": "plain0", "thinking_budget": 4}}))
    with pytest.raises(
        ConfigError,
        match=r"rollout\.thinking_budget: family qwen2_5_vl declares no thinking markers|has no thinking modes",
    ):
        resolve_config(
            parse_config({"model": {"init": "random", "family": "qwen2_5_vl"}, "rollout": {"thinking_budget": 4}})
        )


def test_the_familys_default_budget_reaches_every_engine_that_applies_one(vlmreg_add_plugin):
    qwen3_5 = get_registry().get("qwen3_5")
    family = attrs.evolve(qwen3_5, name="budgeted", model_types=("budgeted_x",), default_thinking_budget=5)
    vlmreg_add_plugin(
        types.SimpleNamespace(
            vlmreg_register_families=hookimpl(lambda register: register(family)),
            vlmreg_register_rollout_engines=hookimpl(lambda register: register(in_trainer_engine(False))),
        ),
        "budgeted-family",
    )
    base = {"model": {"init": "random", "family": "budgeted"}, "data": {"task": "colour"}}

    def budget(**rollout) -> int | None:
        transport = (
            {"vllm": "gloo", "vlmreg": "filesystem"}[rollout.get("server", "vlmreg")]
            if rollout.get("engine") == "openai"
            else "none"
        )
        rc = resolve_config(parse_config({**base, "rollout": rollout, "broadcast": {"transport": transport}}))
        filled = "thinking_budget" not in rollout and rc.config.rollout.thinking_budget is not None
        assert rc.from_family.get("rollout.thinking_budget") == ("family budgeted" if filled else None)
        return rc.config.rollout.thinking_budget

    assert budget() == 5 and budget(**OPENAI) == 5 and budget(**OPENAI, server="vllm") == 5
    assert budget(engine="plain0") is None  # an engine that cannot apply it gets none, and no error
    assert budget(thinking_budget=2, **OPENAI) == 2


@pytest.mark.parametrize(
    "engine",
    [[], ["rollout.engine=openai", "rollout.launch=true", "broadcast.transport=filesystem"]],
    ids=["embedded", "openai-vlmreg-serve"],
)
def test_a_run_counts_the_budget_hits(tmp_path, engine):
    """With the embedded engine the logits processor records its hits; with a launched `vlmreg serve` the budget travels
    in each request and the hits are read off the returned ids (`budget_ended`)."""
    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_5_tiny.toml"
    sets = [
        "trainer.format_warmup_steps=0",
        "eval.every=0",
        "logging.rollout_page_every=0",
        "trainer.prompts_per_step=2",
        "rollout.group_size=4",
        "trainer.steps=1",
        "rollout.max_tokens=8",
        "rollout.thinking_mode=on",
        *engine,
    ]

    def metrics(*more: str) -> dict:
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        assert (
            main(["train", str(config), *[a for s in [*sets, *more] for a in ("--set", s)], "--output-dir", str(out)])
            == 0
        )
        return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])

    capped = metrics("rollout.thinking_budget=2")
    assert 4 <= capped["thinking_budget_hits"] <= 8  # 8 episodes; one that stops within 2 thinking tokens is not cut
    # the forced markers are the engine's tokens, not the policy's samples: left in, each would add the policy's
    # -log p(</think>) (several nats for a random init) to the mismatch, where the sampled tokens agree to round-off
    assert capped["mismatch_kl"] < 1e-4
    if not engine:  # (a second server launch would double the test's time; the engine's own test covers no budget)
        assert metrics()["thinking_budget_hits"] == 0
