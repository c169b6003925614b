"""Rewards are a registry filled through ``vlmreg_register_rewards``; a reward may be ``async def`` (issue 12, items 1,
6).

A plugin's sync and async rewards are listed, checked with suggestions and used by a real training run; async rewards
of one batch are awaited concurrently (bounded), may call a real HTTP server, and a timeout or an exception is a
`RewardError` naming the reward and the sample.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import vlmreg
from vlmreg import PluginError, RegistryConflictError, Reward, RewardError, Task, hookimpl
from vlmreg.cli import main
from vlmreg.cli.data import task_records
from vlmreg.envs.single_turn import SingleTurnEnvironment
from vlmreg.rewards import combine, get_reward, reward_names
from vlmreg.rollout.episodes import run_episodes
from vlmreg.sdk.engine import ChatTurn, Completion, EncodedPrompt, SamplingParams
from vlmreg.sdk.example import Example
from vlmreg.tasks import colour

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml")
BUILTIN = ["exact_match", "first_word", "format", "math", "multiple_choice"]


def reward_plugin(*rewards: Reward) -> types.SimpleNamespace:
    def register_all(register):
        for reward in rewards:
            register(reward)

    return types.SimpleNamespace(vlmreg_register_rewards=hookimpl(register_all))


@pytest.fixture
def in_process(vlmreg_add_plugin):
    return vlmreg_add_plugin


class Scores(BaseHTTPRequestHandler):
    """A reward-model server: POST /score {"completion", "answer"} -> {"score"}; counts requests and overlap."""

    lock = threading.Lock()
    seen: list[str] = []
    scores: list[float] = []
    in_flight = 0
    most_in_flight = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        try:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(0.05)  # a model takes a while: concurrent requests overlap here
            score = 0.75 if body["completion"].strip().lower().startswith(str(body["answer"]).lower()) else 0.25
            with cls.lock:
                cls.seen.append(body["completion"])
                cls.scores.append(score)
            data = json.dumps({"score": score}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        finally:
            with cls.lock:
                cls.in_flight -= 1

    def log_message(self, *args):
        pass


@pytest.fixture
def score_server():
    handler = type(
        "Handler", (Scores,), {"seen": [], "scores": [], "in_flight": 0, "most_in_flight": 0, "lock": threading.Lock()}
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], handler
    server.shutdown()
    server.server_close()


async def post_json(port: int, path: str, payload: dict) -> dict:
    """A real HTTP/1.1 POST over asyncio streams (no client library needed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(payload).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    response = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, data = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head
    return json.loads(data)


def http_reward(port: int, name: str = "judge") -> Reward:
    async def judge(completion: str, answer) -> float:
        return (await post_json(port, "/score", {"completion": completion, "answer": str(answer)}))["score"]

    return Reward(name=name, fn=judge, description="asks a reward-model server", timeout_s=10)


class ScriptedEngine:
    """A rollout engine that answers with given texts, in order (no model): run_episodes' message path."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = list(texts)

    def chat(self, conversations, params, template_kwargs=None, names=None):
        out = []
        for _ in conversations:
            text = self.texts.pop(0)
            out.append(ChatTurn(EncodedPrompt([1, 2], [], [], "prompt"), Completion([3], [-0.5], "stop"), text))
        return out


def episodes(weights: dict, texts: list[str], answers: list[str], **combine_kwargs):
    reward = combine(weights, **combine_kwargs)
    examples = [
        (Example(f"colour:{k}", [{"role": "user", "content": "What colour?"}], answer=a), k)
        for k, a in enumerate(answers)
    ]
    return run_episodes(
        examples,
        lambda example: SingleTurnEnvironment(reward),
        ScriptedEngine(texts),
        SamplingParams(max_tokens=4),
        max_images_per_message=1,
    )


# -- a plugin's rewards in a real run ----------------------------------------------------------------------
def test_a_plugin_s_sync_and_async_rewards_are_listed_checked_and_used_by_a_run(
    in_process, score_server, tmp_path, capsys
):
    port, server = score_server
    sync_scores: list[float] = []

    def says_a_colour(completion: str, answer) -> float:
        score = 1.0 if completion.strip().split(" ")[0].strip(".,!").lower() in {"red", "green", "blue"} else 0.0
        sync_scores.append(score)
        return score

    judge = http_reward(port, "colour_judge")
    in_process(
        reward_plugin(Reward(name="says_a_colour", fn=says_a_colour, description="names any colour"), judge),
        "my-rewards",
    )

    assert main(["plugins", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert records["my-rewards"]["rewards"] == ["colour_judge", "says_a_colour"]
    assert records["my-rewards"]["hooks"] == ["vlmreg_register_rewards"]
    assert records["vlmreg.rewards"]["rewards"] == BUILTIN
    assert main(["validate", MAIN, "--set", "reward.functions={says_a_colur = 1.0}"]) == 1
    # reported against the --set that caused it
    assert (
        "--set reward.functions={says_a_colur = 1.0}: unknown reward 'says_a_colur'. Did you mean 'says_a_colour'?"
        in capsys.readouterr().err
    )

    out = tmp_path / "run"
    quick = [
        "--set",
        "trainer.format_warmup_steps=0",
        "--set",
        "eval.every=0",
        "--set",
        "logging.rollout_page_every=0",
        "--set",
        "trainer.steps=2",
        "--set",
        "trainer.prompts_per_step=2",
        "--set",
        "rollout.group_size=2",
    ]
    functions = "reward.functions={says_a_colour = 1.0, colour_judge = 2.0}"
    assert main(["train", MAIN, *quick, "--set", functions, "--output-dir", str(out)]) == 0
    assert len(sync_scores) == len(server.seen) == 8  # 2 steps x 2 prompts x 2 samples, each scored by both
    assert server.most_in_flight > 1  # a step's 4 requests overlapped
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # the run trained on the plugin's rewards: each step's mean is (says_a_colour + 2 * judge) over its 4 samples
    for k, record in enumerate(records):
        expected = (sum(sync_scores[4 * k : 4 * k + 4]) + 2 * sum(server.scores[4 * k : 4 * k + 4])) / 4
        assert record["reward_mean"] == pytest.approx(expected)


def test_a_plugin_s_reward_serves_as_a_task_s_reward(in_process, capsys):
    async def judge(completion, answer):
        return 1.0

    in_process(reward_plugin(Reward(name="always_one", fn=judge)), "my-rewards")
    task = Task(name="colour_judged", generate=colour.TASK.generate, reward={"always_one": 1.0, "first_word": 0.5})
    in_process(types.SimpleNamespace(vlmreg_register_tasks=hookimpl(lambda register: register(task))), "my-tasks")
    assert "colour_judged" in {r["name"] for r in task_records()}  # not refused as naming an unknown reward
    assert main(["validate", MAIN, "--set", "data.task=colour_judged"]) == 0
    capsys.readouterr()
    vlmreg.unregister_plugin("my-rewards")
    assert main(["validate", MAIN, "--set", "data.task=colour_judged"]) == 1
    assert (
        "--set data.task=colour_judged: the reward of task 'colour_judged': unknown reward 'always_one'"
        in capsys.readouterr().err
    )


def test_a_reward_name_registered_twice_names_both_plugins(make_distribution):
    source = """
        from vlmreg import Reward, hookimpl

        @hookimpl
        def vlmreg_register_rewards(register):
            register(Reward(name="shared_name", fn=lambda completion, answer: 0.0))
    """
    make_distribution("rewards-one", source)
    make_distribution("rewards-two", source)
    with pytest.raises(RegistryConflictError) as info:
        vlmreg.get_reward_registry()
    message = str(info.value)
    assert "reward 'shared_name' is registered twice" in message
    assert "rewards-one" in message and "rewards-two" in message


def test_a_builtin_name_taken_again_and_a_wrong_object_are_refused(in_process):
    in_process(reward_plugin(Reward(name="math", fn=lambda c, a: 1.0)), "shadows-math")
    with pytest.raises(RegistryConflictError) as info:
        vlmreg.get_reward_registry()
    assert (
        "reward 'math' is registered twice: by plugin 'shadows-math' (registered in process) and by distribution "
        "'vlmreg'" in str(info.value)
    )
    vlmreg.unregister_plugin("shadows-math")
    in_process(
        types.SimpleNamespace(vlmreg_register_rewards=hookimpl(lambda register: register(lambda c, a: 1.0))),
        "bare-function",
    )
    with pytest.raises(
        PluginError, match=r"plugin 'bare-function' .*called register\(\) with a function; it takes a vlmreg.Reward"
    ):
        vlmreg.get_reward_registry()


def test_reward_values_are_checked():
    with pytest.raises(vlmreg.DescriptorError, match=r"Reward 'x': field 'timeout_s' must be a positive number"):
        Reward(name="x", fn=lambda c, a: 0.0, timeout_s=0)
    with pytest.raises(vlmreg.DescriptorError, match=r"Reward 'x': field 'fn' must be a callable"):
        Reward(name="x", fn=0.5)
    with pytest.raises(vlmreg.DescriptorError, match=r"field 'name' must be a lower-case name"):
        Reward(name="My Reward", fn=lambda c, a: 0.0)

    async def judged(completion, answer):
        return 1.0

    class Judge:
        async def __call__(self, completion, answer):
            return 1.0

    assert Reward(name="a", fn=judged).is_async and Reward(name="b", fn=Judge()).is_async
    assert not Reward(name="c", fn=lambda c, a: 1.0).is_async
    assert Reward(name="d", fn=judged).timeout_s == 30.0


def test_the_bundled_rewards_come_from_the_built_in_plugin(vlmreg_fresh_registry):
    registry = vlmreg.get_reward_registry()
    assert reward_names() == BUILTIN == registry.names()
    assert {registry.plugin_of(name).name for name in BUILTIN} == {"vlmreg.rewards"}
    assert get_reward("first_word") is registry.get("first_word").fn  # a sync reward is called as it is: no wrapper


# -- async rewards ------------------------------------------------------------------------------------------
def test_an_async_reward_calls_a_real_http_server_and_a_batch_s_calls_overlap(in_process, score_server):
    port, server = score_server
    in_process(reward_plugin(http_reward(port)), "judges")
    texts = ["Red", "blue", "Green!", "red, surely", "Blue", "green"]
    answers = ["red", "red", "green", "red", "green", "blue"]
    trajectories = episodes({"judge": 1.0, "first_word": 0.1}, texts, answers)
    assert [t.reward for t in trajectories] == pytest.approx([0.85, 0.25, 0.85, 0.85, 0.25, 0.25])
    # once per sample: the environments' own calls used the prefetched scores
    assert sorted(server.seen) == sorted(texts)
    assert server.most_in_flight > 1
    assert get_reward("judge")("Red", "red") == 0.75  # called on its own, outside a batch


def test_async_rewards_of_a_batch_are_awaited_concurrently_within_the_bound(in_process):
    in_flight, most = [0], [0]

    async def slow(completion, answer):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(0.1)
        in_flight[0] -= 1
        return float(len(completion))

    in_process(reward_plugin(Reward(name="slow", fn=slow)), "slow")
    started = time.perf_counter()
    trajectories = episodes({"slow": 1.0}, ["a" * k for k in range(1, 10)], ["x"] * 9, max_concurrency=3)
    elapsed = time.perf_counter() - started
    assert [t.reward for t in trajectories] == [float(k) for k in range(1, 10)]
    assert most[0] == 3  # bounded, and concurrent
    assert elapsed < 0.9 * 0.9  # 9 calls of 0.1 s, three at a time: about 0.3 s, not 0.9 s


def test_an_async_reward_over_its_timeout_names_the_reward_and_the_sample(in_process):
    async def stuck(completion, answer):
        await asyncio.sleep(30)
        return 1.0

    in_process(reward_plugin(Reward(name="stuck_judge", fn=stuck, timeout_s=0.2)), "stuck")
    started = time.perf_counter()
    with pytest.raises(RewardError) as info:
        episodes(
            {"stuck_judge": 1.0, "first_word": 1.0},
            ["Red", "Blue", "Green is my final answer, no doubt about it, none at all really"],
            ["red"] * 3,
        )
    assert time.perf_counter() - started < 5
    message = str(info.value)
    assert message.startswith("reward 'stuck_judge' timed out after 0.2 s (Reward.timeout_s) on sample ")
    assert info.value.reward == "stuck_judge" and info.value.sample in {0, 1, 2}
    k = info.value.sample
    assert f"on sample {k} (example colour:{k}, completion " in message


def test_a_reward_that_raises_names_the_reward_and_the_sample(in_process):
    def picky(completion, answer):
        if completion.startswith("Green"):
            raise ValueError("cannot score green")
        return 1.0

    async def picky_async(completion, answer):
        if "purple" in completion:
            raise ConnectionError("reward server refused")
        return 1.0

    in_process(reward_plugin(Reward(name="picky", fn=picky), Reward(name="picky_async", fn=picky_async)), "picky")
    long_green = "Green, because the shape is clearly a shade of green and nothing else, I am sure"
    with pytest.raises(RewardError) as info:
        episodes({"picky": 1.0}, ["Red", "Blue", long_green], ["red"] * 3)
    assert str(info.value) == (
        "reward 'picky' raised ValueError: cannot score green on sample 2 "
        f"(example colour:2, completion {long_green[:60]!r}...)"
    )
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RewardError) as info:
        episodes({"picky_async": 1.0, "first_word": 1.0}, ["Red", "purple rain"], ["red"] * 2)
    assert (
        str(info.value)
        == "reward 'picky_async' raised ConnectionError: reward server refused on sample 1 (example colour:1, "
        "completion 'purple rain')"
    )
    in_process(reward_plugin(Reward(name="wordy", fn=lambda c, a: "high")), "wordy")
    with pytest.raises(
        RewardError,
        match=r"^reward 'wordy' returned 'high', not a number on sample 0 \(example colour:0, completion 'Red'\)$",
    ):
        episodes({"wordy": 1.0}, ["Red"], ["red"])


def test_a_failing_reward_stops_a_run_with_one_line_naming_it(in_process, tmp_path, capsys):
    def broken(completion, answer):
        raise KeyError("no judge configured")

    in_process(reward_plugin(Reward(name="broken", fn=broken)), "broken")
    quick = [
        "--set",
        "trainer.format_warmup_steps=0",
        "--set",
        "eval.every=0",
        "--set",
        "logging.rollout_page_every=0",
        "--set",
        "trainer.steps=1",
        "--set",
        "trainer.prompts_per_step=1",
        "--set",
        "rollout.group_size=2",
    ]
    code = main(
        ["train", MAIN, *quick, "--set", "reward.functions={broken = 1.0}", "--output-dir", str(tmp_path / "run")]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "reward 'broken' raised KeyError: 'no judge configured' on sample 0 (example colour:" in err
    assert "Traceback" not in err


def test_the_reward_plugin_examples_in_docs_tasks_md_register(make_distribution):
    doc = (ROOT / "docs" / "tasks.md").read_text()
    blocks = [
        block for block in re.findall(r"```python\n(.*?)```", doc, re.DOTALL) if "vlmreg_register_rewards" in block
    ]
    assert len(blocks) == 2
    make_distribution("short-answer-reward", blocks[0])
    make_distribution("judge-reward", blocks[1])
    registry = vlmreg.get_reward_registry()
    assert registry.plugin_of("short_answer").distribution == "short-answer-reward"
    assert (
        combine({"short_answer": 1.0})("Red", "red") == 1.0
        and combine({"short_answer": 1.0})("it is red I think", "red") == 0.0
    )
    judge = registry.get("judge")
    assert judge.is_async and judge.timeout_s == 10.0 and registry.plugin_of("judge").distribution == "judge-reward"


def test_a_reward_s_own_timeout_error_is_reported_as_raised_not_as_its_time_limit(in_process):
    async def flaky(completion, answer):
        raise TimeoutError("the judge's backend is slow")

    in_process(reward_plugin(Reward(name="flaky_judge", fn=flaky, timeout_s=30)), "flaky")
    with pytest.raises(RewardError) as info:
        combine({"flaky_judge": 1.0})("Red", "red")
    assert str(info.value).startswith("reward 'flaky_judge' raised TimeoutError: the judge's backend is slow")
    assert isinstance(info.value.__cause__, TimeoutError)


def test_a_plain_function_returning_a_coroutine_is_awaited_once_on_one_reward_thread(in_process):
    calls = []

    async def judge(completion):
        await asyncio.sleep(0)
        return 0.25 if completion == "Red" else 0.0

    def plain(completion, answer):  # not `async def`, but hands back a coroutine
        calls.append(completion)
        return judge(completion)

    async def native(completion, answer):
        return 0.5

    in_process(
        reward_plugin(Reward(name="plain_judge", fn=plain), Reward(name="native_judge", fn=native)), "coroutines"
    )
    reward = combine({"plain_judge": 1.0, "native_judge": 2.0})
    assert reward.scores("Red", "red") == {"plain_judge": 0.25, "native_judge": 0.5}
    assert reward("Blue", "red") == 1.0
    assert calls == ["Red", "Blue"]  # each coroutine made once and awaited, never made again
    threads = [t for t in threading.enumerate() if t.name == "vlmreg-rewards"]
    assert len(threads) == 1 and threads[0].daemon  # one loop thread serves every async reward of the process
