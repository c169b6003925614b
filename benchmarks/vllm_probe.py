"""After a weight sync, vLLM's logprobs are the trainer's, and no prefix cached under the old weights survives.

Needs a GPU and vLLM importable (see benchmarks/vllm_session.sh). It launches vLLM on the trainer's GPU the way
`vlmreg train` does, then for one fixed prompt (a long system prompt and an image, so the prefix cache holds full
blocks of it):

1. syncs the initial weights and asks vLLM for 16 sampled tokens with their logprobs;
2. computes the same tokens' logprobs with a plain transformers forward of the trainer's model (the reference);
3. changes every language-model weight a lot, syncs, asks again and compares again (the prefix is now cached),
   ``--syncs`` times (from the third sync on, a worker replays its recorded copy plan: each of those is checked too);
4. control: changes the weights again and syncs, but asks in the old weights' cache scope (the cache salt and
   image uuid the trainer's requests carried before the sync), to show the check can fail.

Requests carry the server's `CacheScope` as the trainer's engine does, so syncs clear no cache: the new scope is what
keeps old prefixes out. With ``--direct`` and ``vllm_push`` (the default) syncs from the fourth on are pushed: the
trainer replays the worker's exported copy plan into vLLM's weights itself; the probe then times those syncs, and the
replay alone two ways (the chunked-copy kernel, and ``_foreach_copy_`` groups only), against one device copy of the
bytes.

    python benchmarks/vllm_probe.py --family qwen3_vl --size 2b
Prints one JSON line per phase: the mean and max absolute logprob difference.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

import vlmreg
from vlmreg.broadcast import WeightPlan
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.data.prompts import vision_token_ids
from vlmreg.data.store import image_id_of
from vlmreg.http.client import post_json
from vlmreg.inference.openai_client import png_data_uri
from vlmreg.inference.vllm_server import VllmServer
from vlmreg.testing.parity import noise_image, processor_inputs, transformers_sdpa


def ask(
    url: str, conversation_openai: list[dict], suppress: list[int], key: str | None, salt: str, uuid: str
) -> tuple[list[int], list[float], list[int]]:
    messages = json.loads(json.dumps(conversation_openai))
    for part in messages[-1]["content"]:
        if part["type"] == "image_url":
            part["uuid"] = uuid
    body = {
        "model": "vlmreg-policy",
        "messages": messages,
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "seed": 1234,
        "logprobs": True,
        "return_token_ids": True,
        "logit_bias": {str(t): -100 for t in suppress},
        "cache_salt": salt,
    }
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=auth), timeout=30) as response:
        body["model"] = json.loads(response.read())["data"][0]["id"]
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **auth},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"{exc.code}: {exc.read()[:2000]!r}") from None
    choice = answer["choices"][0]
    return (
        choice["token_ids"],
        [e["logprob"] for e in choice["logprobs"]["content"]],
        answer.get("prompt_token_ids", []),
    )


def reference(model, processor, conversation, completion, suppress) -> tuple[torch.Tensor, list[int]]:
    inputs = processor_inputs(processor, conversation, completion)
    inputs = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad(), transformers_sdpa(model):
        logits = model(**inputs, use_cache=False).logits.float()
    logits[..., suppress] = float("-inf")
    ids = inputs["input_ids"][0]
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
    prompt = ids[: len(ids) - len(completion)].tolist()
    return logp[-len(completion) :].cpu(), prompt


def perturb(model, language_attr: str, seed: int) -> None:
    generator = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(language_attr) and p.dim() >= 2:
                noise = torch.randn(p.shape, generator=generator, device=p.device, dtype=torch.float32)
                p.add_((0.5 * p.float().std() * noise).to(p.dtype))


def time_pushes(server: VllmServer, payload: int, device: torch.device) -> None:
    """A pushed sync as the trainer runs it (``server.sync``), and the replay alone three ways, against one copy."""

    def timed(fn, iters: int = 10) -> list[float]:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(iters):
            started = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(round(1e3 * (time.perf_counter() - started), 3))
        return out

    source = torch.empty(payload, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    report = {
        "phase": "push-timing",
        "bytes": payload,
        "copies": len(server.pushed.copies),
        "one_copy_ms": timed(functools.partial(target.copy_, source)),
    }
    del source, target
    step = iter(range(1000, 2000))
    report["sync_ms"] = timed(lambda: server.sync(next(step)))
    pushed = server.pushed
    for name, kernel in (("replay_kernel_ms", True), ("replay_foreach_ms", False)):
        pushed.regroup(kernel=kernel)
        report[name] = timed(pushed.replay)
    pushed.regroup()
    report["chunked_copies"] = len(pushed.chunked.pairs) if pushed.chunked is not None else 0
    report["pushes"] = server.pushes
    print(json.dumps(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="qwen3_vl")
    parser.add_argument("--size", default="2b")
    parser.add_argument("--transport", default="ipc")
    parser.add_argument("--server-args", default="", help="extra vLLM arguments, space-separated")
    parser.add_argument("--output", default="/tmp/vllm-probe")
    parser.add_argument("--launch-gpu", default="same", choices=("same", "next"))
    parser.add_argument("--quick", action="store_true", help="only the initial and one changed phase")
    parser.add_argument(
        "--syncs", type=int, default=5, help="changed phases, each a large change of every language-model weight"
    )
    parser.add_argument(
        "--direct",
        action="store_true",
        help='[broadcast] vllm_load = "direct" (the worker extension, no layerwise reload)',
    )
    args = parser.parse_args()
    config = parse_config(
        {
            "model": {
                "init": "random",
                "family": args.family,
                "size": args.size,
                "dtype": "bfloat16",
                "attn_implementation": "sdpa",
            },
            "trainer": {"device": "cuda", "seq_len": 2048},
            "rollout": {
                "engine": "openai",
                "server": "vllm",
                "launch": True,
                "launch_gpu": args.launch_gpu,
                "gpu_memory_fraction": 0.3,
                "server_args": args.server_args.split(),
                "max_tokens": 64,
            },
            "broadcast": {"transport": args.transport, "vllm_load": "direct" if args.direct else "reload"},
        }
    )
    rc = resolve_config(config)
    loaded = vlmreg.load(rc)
    model, processor, resolved = loaded.model, loaded.processor, loaded.resolved
    model.eval()
    suppress = sorted(vision_token_ids(processor, resolved.descriptor))
    image = noise_image((224, 224), seed=3)
    system = " ".join(f"Rule {i}: colours are named plainly and answers are short." for i in range(24))
    conversation = [
        {"role": "system", "content": [{"type": "text", "text": system}]},
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "Which colour dominates?"}],
        },
    ]
    openai_messages = [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": png_data_uri(image)}},
                {"type": "text", "text": "Which colour dominates?"},
            ],
        },
    ]
    started = time.perf_counter()
    server = VllmServer(rc, resolved, processor, loaded.device, Path(args.output), print)
    scope = server.cache_scope
    scope.applied = True  # the probe's requests carry the scope, as the trainer's engine's do
    image_id = image_id_of(image)
    print(
        json.dumps(
            {
                "phase": "launch",
                "seconds": round(time.perf_counter() - started, 1),
                "api": server.api,
                "workers": server._workers(),
            }
        ),
        flush=True,
    )
    for path in ("/v1/models", "/update_weights", "/collective_rpc"):  # the key guards every endpoint, weights included
        try:
            post_json(f"{server.url}{path}", {}, 30)
            status = 200
        except Exception as exc:  # noqa: BLE001
            status = getattr(exc, "status", str(exc))
        print(json.dumps({"phase": "no-key", "path": path, "status": status}), flush=True)
    payload = sum(
        t.numel() * t.element_size()
        for _, t in WeightPlan.from_resolved(resolved, include_frozen_vision=False).tensors()
    )
    source = torch.empty(payload, dtype=torch.uint8, device=loaded.device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    copied = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    torch.cuda.synchronize()
    print(
        json.dumps({"phase": "d2d-copy", "bytes": payload, "seconds": round((time.perf_counter() - copied) / 10, 5)}),
        flush=True,
    )
    del source, target
    try:
        phases = [("initial", 0)] + [("changed", step) for step in range(1, 2 if args.quick else 1 + args.syncs)]
        if not args.quick:
            phases.append(("changed-old-scope", len(phases)))
        for phase, step in phases:
            if step:
                perturb(model, resolved.descriptor.language_model_attr, seed=step)
            old = (scope.salt, scope.image_uuid(image_id))
            pushes = server.pushes
            synced = time.perf_counter()
            server.sync(step, full=step == 0)
            sync_s = time.perf_counter() - synced
            # the control asks as before the sync
            salt, uuid = old if phase == "changed-old-scope" else (scope.salt, scope.image_uuid(image_id))
            tokens, logprobs, prompt_ids = ask(server.url, openai_messages, suppress, server.api_key, salt, uuid)
            ref, prompt = reference(model, processor, conversation, tokens, suppress)
            diff = (torch.tensor(logprobs) - ref).abs()
            print(
                json.dumps(
                    {
                        "phase": phase,
                        "step": step,
                        "family": args.family,
                        "size": args.size,
                        "sync_s": round(sync_s, 4),
                        "pushed": server.pushes > pushes,
                        "tokens": len(tokens),
                        "same_prompt_ids": prompt_ids == prompt,
                        "prompt_tokens": len(prompt),
                        "mean_abs_diff": round(float(diff.mean()), 5),
                        "max_abs_diff": round(float(diff.max()), 5),
                    }
                ),
                flush=True,
            )
        if server.pushed is not None:
            time_pushes(server, payload, loaded.device)
        elif server.push_refused:
            print(json.dumps({"phase": "push", "refused": server.push_refused}), flush=True)
        log = Path(args.output) / "vllm.log"
        for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
            if "vlmreg worker" in line:  # how each sync was loaded: load_weights, recorded, replayed
                print(line.split("vlmreg worker", 1)[1].strip()[:160], flush=True)
    finally:
        server.close()


if __name__ == "__main__":
    main()
