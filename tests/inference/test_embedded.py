"""The embedded engine's logprobs are those of the distribution it sampled from; episodes and image limits."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data import Example, ImageStore, image_part, text_part
from vlmreg.data.prompts import PromptEncoder, vision_token_ids
from vlmreg.inference.embedded import EmbeddedEngine
from vlmreg.rollout.episodes import EnvironmentFailure, run_episodes
from vlmreg.sdk.engine import PromptRequest, SamplingParams
from vlmreg.sdk.environment import EnvStep
from vlmreg.testing.parity import processor_inputs

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def setup(request):
    torch.manual_seed(0)
    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": request.param}, "trainer": {"device": "cpu"}})
    )
    store = ImageStore()
    engine = EmbeddedEngine(loaded.model, loaded.processor, store, CPU)
    return loaded, store, engine


def requests_for(loaded, store):
    """Prompts as vlmreg encodes them, each with the same conversation holding PIL images (for the processor)."""
    out = []
    encoder = PromptEncoder(loaded.processor, store, loaded.resolved.descriptor)
    for colour in ["red", "green", "blue"]:
        image = Image.new("RGB", (64, 64), colour)
        conversation = [{"role": "user", "content": [image_part(store.add(image)), text_part("What colour?")]}]
        pil = [{"role": "user", "content": [{"type": "image", "image": image}, text_part("What colour?")]}]
        out.append((PromptRequest.of(encoder.encode(conversation)), pil))
    text = [{"role": "user", "content": "text only, longer than the others"}]
    out.append((PromptRequest.of(encoder.encode(text)), text))
    return out


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.5)])
def test_logprobs_are_those_of_the_sampling_distribution(setup, temperature, top_p):
    loaded, store, engine = setup
    suppress = vision_token_ids(loaded.processor, loaded.resolved.descriptor)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=6, suppress_token_ids=suppress)
    pairs = requests_for(loaded, store)
    requests = [r for r, _ in pairs]
    for (request, conversation), completion in zip(pairs, engine.generate(requests, params), strict=True):
        assert all(t not in suppress for t in completion.token_ids)
        inputs = processor_inputs(loaded.processor, conversation, completion.token_ids)
        assert inputs["input_ids"][0].tolist() == request.input_ids + completion.token_ids
        with torch.no_grad():
            logits = (
                loaded.model(**inputs, use_cache=False).logits[0, len(request.input_ids) - 1 : -1].float() / temperature
            )
        logits[:, list(suppress)] = float("-inf")
        if top_p < 1.0:  # the nucleus the sampler kept: renormalised over it
            probs = logits.softmax(-1)
            sorted_probs, order = probs.sort(-1, descending=True)
            keep_sorted = sorted_probs.cumsum(-1) - sorted_probs < top_p
            keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
            logits = logits.masked_fill(~keep, float("-inf"))
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
        assert torch.allclose(expected, torch.tensor(completion.logprobs), atol=1e-4)


def test_greedy_is_deterministic(setup):
    loaded, store, engine = setup
    requests = [r for r, _ in requests_for(loaded, store)]
    a = engine.generate(requests, SamplingParams(max_tokens=5, greedy=True))
    b = engine.generate(requests, SamplingParams(max_tokens=5, greedy=True))
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


class ShowTwice:
    """A two-turn environment: after the first answer it shows a new image and asks again."""

    def __init__(self, store, fail: bool = False):
        self.store, self.fail, self.turn = store, fail, 0

    def reset(self, example):
        return list(example.messages)

    def step(self, completion):
        self.turn += 1
        if self.fail:
            raise RuntimeError("the game crashed")
        if self.turn == 1:
            image = self.store.add(Image.new("RGB", (64, 64), "blue"))
            return EnvStep(
                reward=0.25,
                done=False,
                messages=[{"role": "user", "content": [image_part(image), image_part(image), text_part("and now?")]}],
            )
        return EnvStep(reward=0.5, done=True)


def test_multi_turn_episodes_see_new_images_and_drop_extras_with_a_count(setup):
    loaded, store, engine = setup
    red = store.add(Image.new("RGB", (64, 64), "red"))
    example = Example("game:0", [{"role": "user", "content": [image_part(red), text_part("colour?")]}], answer="red")
    dropped = []
    trajectories = run_episodes(
        [(example, 0), (example, 0)],
        lambda ex: ShowTwice(store),
        engine,
        SamplingParams(max_tokens=4),
        max_images_per_message=1,
        on_drop=lambda example_id, n: dropped.append((example_id, n)),
    )
    assert [len(t.turns) for t in trajectories] == [2, 2]
    second = trajectories[0].turns[1]
    assert len(second.image_ids) == 2 and second.image_ids[0] == red  # one of the two new images was dropped
    assert trajectories[0].images_dropped == 1 and dropped == [("game:0", 1), ("game:0", 1)]
    assert trajectories[0].reward == pytest.approx(0.75)


def test_a_crashing_environment_names_the_example(setup):
    loaded, store, engine = setup
    example = Example("game:7", [{"role": "user", "content": "hi"}], answer="x")
    with pytest.raises(EnvironmentFailure, match="ShowTwice.step failed on game:7: RuntimeError: the game crashed"):
        run_episodes(
            [(example, 0)],
            lambda ex: ShowTwice(store, fail=True),
            engine,
            SamplingParams(max_tokens=2),
            max_images_per_message=1,
        )
