"""Where a step's generation time goes in vLLM (issue 25 item 7): the 2B config's rollout workload, timed several ways.

Needs a GPU and vLLM importable (benchmarks/vllm_session.sh part0, part1, part2 install). For each server variant
(vLLM's default flags as `vlmreg train` launches it, then each ``--variants`` entry's extra flags), it launches vLLM on
the GPU the way the trainer does (`VllmServer`: the trainer's checkpoint, flags, key), syncs the initial weights, and
runs the workload of one training step: ``--prompts`` prompts (a 448x448 image and the colour question) x
``--group`` samples of ``--max-tokens`` tokens at temperature 1, ``ignore_eos`` so every completion is exactly
``--max-tokens`` long (the random model rarely stops anyway, and the floor below counts that many decode steps).
Each request carries a fresh cache salt per repeat, as the trainer's do after every weight sync.

Client-side workloads (each ``--repeats`` times after one warm-up; the median is printed):
- ``vlmreg``: vlmreg's own OpenAI engine (`OpenAIEngine.chat`) with ``share_prompts`` off: one request per sample;
- ``vlmreg-shared``: the same engine as a training step runs it (``share_prompts`` on): a group's samples as one
  request with ``n = group``, answers parsed and checked;
- ``grouped``: the same samples as one request per prompt with ``n = group`` (the image processed once per group);
- ``no-logprobs``: ``vlmreg`` without logprobs and token ids (what the trainer needs, taken away to price it);
- ``text-only``: ``vlmreg`` without the image (prefill and the image encoder out of the way).

Server-side: vLLM's Prometheus counters (``/metrics``) before and after each workload give the time its requests spent
queued, in prefill and in decode, and the number of engine steps; ``decode_step_ms`` is decode time per decode step.

The floor: every decode step reads the weights once, so ``max_tokens`` steps take at least
``max_tokens x weight bytes / HBM read bandwidth`` (bandwidth measured here, by a device-to-device copy of 4 GiB,
counting its read half). One JSON line per (variant, workload); run it with nothing else on the GPU.

    python benchmarks/rollout_profile.py --variants="--async-scheduling;--enforce-eager"
    python benchmarks/rollout_profile.py --variants="" --torch-profile /dev/shm/engine_trace

``--torch-profile DIR`` (``--only-profiled``: and no other variant) adds a last variant: the default flags with
vLLM's torch profiler on (``--profiler-config``,
traces under DIR), whose ``vlmreg-shared`` workload runs once more between ``/start_profile`` and ``/stop_profile``
after its timed repeats; each trace is summarised by benchmarks/engine_trace.py (GPU busy share, the gaps between
kernels, the CPU's phases), one JSON line each with ``"phase": "trace"``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import re
import statistics
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import torch

import vlmreg
from vlmreg.config import load_config
from vlmreg.config.resolve import resolve_config
from vlmreg.data.prompts import vision_token_ids
from vlmreg.data.store import ImageStore
from vlmreg.inference.cache_scope import CacheScope
from vlmreg.inference.openai_client import OpenAIEngine
from vlmreg.inference.vllm_server import VllmServer
from vlmreg.sdk.engine import SamplingParams
from vlmreg.testing.parity import noise_image

QUESTION = "What colour is this image? Answer with one word."
#: vLLM's histograms whose sums (seconds) and counts are read before and after each workload
HISTOGRAMS = (
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
)
COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:iteration_tokens_total_count",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:mm_cache_hits_total",
    "vllm:mm_cache_queries_total",
    "vllm:num_preemptions_total",
)
WANTED = frozenset([h + "_sum" for h in HISTOGRAMS] + [h + "_count" for h in HISTOGRAMS] + list(COUNTERS))


def read_metrics(url: str, key: str | None) -> dict[str, float]:
    """Sum every series of the histograms' ``_sum`` / ``_count`` and of the counters (all engines, all labels)."""
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if not match:
            continue
        name, value = match.group(1), float(match.group(3))
        if name in WANTED:
            totals[name] = totals.get(name, 0.0) + value
    return totals


def hbm_read_gbps(device: torch.device) -> float:
    """Read bandwidth from one device-to-device copy of 4 GiB (the copy reads and writes each byte: 2 x bytes)."""
    source = torch.empty(4 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - started) / 10
    del source, target
    torch.cuda.empty_cache()
    return 2 * (4 << 30) / seconds / 1e9


def grouped(
    engine: OpenAIEngine, conversations: list[list[dict]], params: SamplingParams, group: int, extra: dict[str, Any]
) -> int:
    """One request per prompt with ``n = group``: returns the completion tokens."""
    model = engine.model or engine._first_model()
    payloads = []
    for conversation in conversations[::group]:
        payload = engine._payload(conversation, params, None, model, {}) | extra
        payload["n"] = group
        payloads.append(payload)
    with ThreadPoolExecutor(len(payloads)) as pool:
        bodies = list(pool.map(lambda p: engine._post_with_retries("/v1/chat/completions", p, "grouped"), payloads))
    return sum(body["usage"]["completion_tokens"] for body in bodies)


def vlmreg_path(
    engine: OpenAIEngine,
    params: SamplingParams,
    conversations: list[list[dict]],
    extra: dict[str, Any],
    share: bool = False,
) -> int:
    """vlmreg's own path (``engine.chat``), with ``extra`` added to each request's payload."""
    payload = engine._payload
    engine._payload = lambda *a, **k: payload(*a, **k) | extra  # type: ignore[method-assign]
    engine.share_prompts = share
    try:
        return sum(len(turn.completion.token_ids) for turn in engine.chat(conversations, params))
    finally:
        engine._payload = payload  # type: ignore[method-assign]


def no_logprobs(
    engine: OpenAIEngine, params: SamplingParams, conversations: list[list[dict]], extra: dict[str, Any]
) -> int:
    """The same requests without logprobs or token ids: what they cost."""
    model = engine.model or engine._first_model()
    payloads = [
        engine._payload(c, params, None, model, {}) | extra | {"logprobs": False, "return_token_ids": False}
        for c in conversations
    ]
    with ThreadPoolExecutor(len(payloads)) as pool:
        bodies = list(pool.map(lambda p: engine._post_with_retries("/v1/chat/completions", p, "no-logprobs"), payloads))
    return sum(body["usage"]["completion_tokens"] for body in bodies)


def post(url: str, path: str, key: str | None, timeout: float = 600) -> None:
    request = urllib.request.Request(
        f"{url}{path}", data=b"", method="POST", headers={"Authorization": f"Bearer {key}"} if key else {}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()


def summarise_traces(directory: Path) -> None:
    """benchmarks/engine_trace.py's summary of every trace under ``directory``, as JSON lines."""
    spec = importlib.util.spec_from_file_location("engine_trace", Path(__file__).with_name("engine_trace.py"))
    assert spec is not None and spec.loader is not None
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)
    files = trace.trace_files([str(directory)])
    if not files:
        print(json.dumps({"phase": "trace", "error": f"vLLM wrote no trace under {directory}"}), flush=True)
    for path in files:
        summary = trace.summarise(trace.load(path))
        print(json.dumps({"phase": "trace", "file": path.name, **summary}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/configs/qwen3_vl_2b_gpu.toml")
    parser.add_argument(
        "--variants",
        default="--async-scheduling;--enforce-eager",
        help="server variants after the default, ';'-separated, each space-separated extra vLLM flags",
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--output", default="/dev/shm/rollout_profile")
    parser.add_argument("--torch-profile", default="", help="a folder: add a profiled variant (see above)")
    parser.add_argument("--only-profiled", action="store_true", help="with --torch-profile: that variant alone")
    args = parser.parse_args()
    base = load_config(Path(args.config))
    rollout = attrs.evolve(
        base.rollout,
        engine="openai",
        server="vllm",
        launch=True,
        launch_gpu="same",
        gpu_memory_fraction=0.5,
        max_tokens=args.max_tokens,
    )
    config = attrs.evolve(base, rollout=rollout, broadcast=attrs.evolve(base.broadcast, transport="ipc"))
    rc = resolve_config(config)
    loaded = vlmreg.load(rc)
    resolved, processor, device = loaded.resolved, loaded.processor, loaded.device
    weight_bytes = sum(p.numel() * p.element_size() for p in resolved.model.parameters())
    gbps = hbm_read_gbps(device)
    floor_s = args.max_tokens * weight_bytes / (gbps * 1e9)
    print(
        json.dumps(
            {
                "phase": "floor",
                "weight_bytes": weight_bytes,
                "hbm_read_gbps": round(gbps, 1),
                "max_tokens": args.max_tokens,
                "floor_s": round(floor_s, 3),
                "gpu": torch.cuda.get_device_name(device),
            }
        ),
        flush=True,
    )
    store = ImageStore()
    ids = [store.add(noise_image((args.image_size, args.image_size), seed=i)) for i in range(args.prompts)]
    with_image = [
        [{"role": "user", "content": [{"type": "image", "image": i}, {"type": "text", "text": QUESTION}]}]
        for i in ids
        for _ in range(args.group)
    ]
    text_only = [
        [{"role": "user", "content": [{"type": "text", "text": f"Prompt {n}: {QUESTION}"}]}]
        for n in range(args.prompts)
        for _ in range(args.group)
    ]
    params = SamplingParams(
        temperature=1.0,
        max_tokens=args.max_tokens,
        suppress_token_ids=tuple(vision_token_ids(processor, resolved.descriptor)),
    )
    variants: list[str | list[str]] = [""] + [v.strip() for v in args.variants.split(";") if v.strip()]
    trace_dir = Path(args.torch_profile).resolve() if args.torch_profile else None
    if trace_dir is not None:  # vLLM 0.24's ProfilerConfig: the torch profiler, no Python stacks, plain JSON
        profiler = {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False}
        variants = [*([] if args.only_profiled else variants), ["--profiler-config", json.dumps(profiler)]]
    for number, variant in enumerate(variants):
        extra = variant if isinstance(variant, list) else variant.split()
        profiled = isinstance(variant, list)
        variant = " ".join(extra)
        vrc = resolve_config(
            attrs.evolve(config, rollout=attrs.evolve(rollout, server_args=[*rollout.server_args, *extra]))
        )
        started = time.perf_counter()
        server = VllmServer(vrc, resolved, processor, device, Path(args.output) / f"variant-{number}", print)
        try:
            launch_s = time.perf_counter() - started
            server.sync(0, full=True)
            scope = CacheScope(images=True, applied=True)  # a new salt per repeat, as after a sync
            engine = OpenAIEngine(
                server.url,
                processor,
                store,
                api_key=server.api_key,
                cache_scope=scope,
                descriptor=resolved.descriptor,
                max_concurrent=256,
                timeout_s=600,
            )
            engine.cache_scope = scope
            eos = {"ignore_eos": True}
            workloads: dict[str, Callable[[], int]] = {
                "vlmreg": functools.partial(vlmreg_path, engine, params, with_image, eos),
                "vlmreg-shared": functools.partial(vlmreg_path, engine, params, with_image, eos, share=True),
                "grouped": functools.partial(grouped, engine, with_image, params, args.group, eos),
                "no-logprobs": functools.partial(no_logprobs, engine, params, with_image, eos),
                "text-only": functools.partial(vlmreg_path, engine, params, text_only, eos),
            }
            if profiled:
                workloads = {"vlmreg-shared": workloads["vlmreg-shared"]}
            for name, work in workloads.items():
                work()  # warm-up (and compiles, for a first request shape)
                times, server_side, tokens = [], [], 0
                for _ in range(args.repeats):
                    scope.advance()
                    before = read_metrics(server.url, server.api_key)
                    t0 = time.perf_counter()
                    tokens = work()
                    times.append(time.perf_counter() - t0)
                    after = read_metrics(server.url, server.api_key)
                    server_side.append({k: after.get(k, 0.0) - before.get(k, 0.0) for k in after})
                median = statistics.median(times)
                middle = server_side[times.index(median)] if median in times else server_side[-1]
                # one first token per request as vLLM counts them (the e2e histogram's count moved by 1 per workload on
                # vLLM 0.24, so its per-request means were sums)
                requests = middle.get("vllm:time_to_first_token_seconds_count", 0.0) or 1.0
                decode_steps = args.max_tokens  # every completion is max_tokens long (ignore_eos), all in one batch
                print(
                    json.dumps(
                        {
                            "variant": variant or "(default)",
                            "workload": name,
                            "launch_s": round(launch_s, 1),
                            "seconds": round(median, 3),
                            "all_seconds": [round(t, 3) for t in times],
                            "completion_tokens": tokens,
                            "tokens_per_s": round(tokens / median, 1),
                            "x_floor": round(median / floor_s, 2),
                            "mean_queue_s": round(middle.get("vllm:request_queue_time_seconds_sum", 0.0) / requests, 4),
                            "mean_prefill_s": round(
                                middle.get("vllm:request_prefill_time_seconds_sum", 0.0) / requests, 4
                            ),
                            "mean_decode_s": round(
                                middle.get("vllm:request_decode_time_seconds_sum", 0.0) / requests, 4
                            ),
                            "mean_ttft_s": round(
                                middle.get("vllm:time_to_first_token_seconds_sum", 0.0)
                                / max(middle.get("vllm:time_to_first_token_seconds_count", 0.0), 1.0),
                                4,
                            ),
                            "mean_itl_ms": round(
                                1000
                                * middle.get("vllm:inter_token_latency_seconds_sum", 0.0)
                                / max(middle.get("vllm:inter_token_latency_seconds_count", 0.0), 1.0),
                                3,
                            ),
                            "engine_steps": middle.get("vllm:iteration_tokens_total_count"),
                            "decode_step_ms_if_batched": round(
                                1000
                                * middle.get("vllm:request_decode_time_seconds_sum", 0.0)
                                / requests
                                / decode_steps,
                                3,
                            ),
                            "prompt_tokens": middle.get("vllm:prompt_tokens_total"),
                            "requests": requests,
                            "prefix_cache_hit": round(
                                middle.get("vllm:prefix_cache_hits_total", 0.0)
                                / max(middle.get("vllm:prefix_cache_queries_total", 0.0), 1.0),
                                3,
                            ),
                            "mm_cache_hit": round(
                                middle.get("vllm:mm_cache_hits_total", 0.0)
                                / max(middle.get("vllm:mm_cache_queries_total", 0.0), 1.0),
                                3,
                            ),
                            "preemptions": middle.get("vllm:num_preemptions_total"),
                        }
                    ),
                    flush=True,
                )
            if profiled and trace_dir is not None:
                scope.advance()
                post(server.url, "/start_profile", server.api_key)
                started = time.perf_counter()
                workloads["vlmreg-shared"]()
                profiled_s = time.perf_counter() - started
                post(server.url, "/stop_profile", server.api_key)
                print(json.dumps({"phase": "profiled run", "seconds": round(profiled_s, 3)}), flush=True)
                summarise_traces(trace_dir)
        finally:
            server.close()


if __name__ == "__main__":
    main()
