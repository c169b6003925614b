"""Are two training runs the same run? For a refactoring that must not change behaviour.

    python scripts/compare_runs.py RUN_BEFORE RUN_AFTER [--logs LOG_BEFORE LOG_AFTER]

Compares, and prints every difference:
- ``metrics.jsonl``: the same number of lines, and each line the same keys with equal values, except timings
  (keys ending in ``_s``, ``tokens_per_s``) and peak memory (``*_peak_gib``);
- every checkpoint folder: ``state.json`` equal, and each ``*.safetensors`` file the same tensors, bit for bit;
- with ``--logs``: the two runs' printed lines equal once the run directories, tokens per second and seconds are
  masked.
Exits 0 when they match, 1 otherwise. Reads the files only (safetensors, json): no model, no training.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from safetensors.torch import load_file

TIMING = re.compile(r"(_s|tokens_per_s|_peak_gib)$")


def compare_metrics(before: Path, after: Path) -> list[str]:
    a = [json.loads(line) for line in before.read_text().splitlines() if line]
    b = [json.loads(line) for line in after.read_text().splitlines() if line]
    problems = [f"metrics.jsonl: {len(a)} lines before, {len(b)} after"] if len(a) != len(b) else []
    for number, (x, y) in enumerate(zip(a, b, strict=False), 1):
        if list(x) != list(y):
            problems.append(f"metrics.jsonl:{number}: keys differ: {list(x)} vs {list(y)}")
        for key in x.keys() | y.keys():
            if not TIMING.search(key) and x.get(key, "(absent)") != y.get(key, "(absent)"):
                problems.append(
                    f"metrics.jsonl:{number}: {key}: {x.get(key, '(absent)')!r} before, {y.get(key, '(absent)')!r} "
                    "after"
                )
    return problems


def compare_checkpoints(before: Path, after: Path) -> list[str]:
    names = sorted({p.name for p in before.glob("step_*")} | {p.name for p in after.glob("step_*")})
    problems = [] if names else ["no checkpoints in either run"]
    for name in names:
        x, y = before / name, after / name
        files = sorted({p.name for p in x.glob("*")} | {p.name for p in y.glob("*")})
        for file in files:
            if not (x / file).exists() or not (y / file).exists():
                problems.append(f"{name}/{file}: only in one run")
            elif file.endswith(".safetensors"):
                ta, tb = load_file(x / file), load_file(y / file)
                if ta.keys() != tb.keys():
                    problems.append(f"{name}/{file}: tensor names differ")
                problems += [
                    f"{name}/{file}: {key} differs" for key in ta.keys() & tb.keys() if not ta[key].equal(tb[key])
                ]
            elif file.endswith(".json"):
                if json.loads((x / file).read_text()) != json.loads((y / file).read_text()):
                    problems.append(f"{name}/{file} differs")
            elif (x / file).read_bytes() != (y / file).read_bytes():
                problems.append(f"{name}/{file} differs")
    return problems


def masked_lines(log: Path, run: Path) -> list[str]:
    text = log.read_text().replace(str(run), "RUN")
    text = re.sub(r"\d+ tok/s", "N tok/s", text)
    text = re.sub(r"\(\d+\.\d+ s\)", "(N s)", text)
    return [line for line in text.splitlines() if line.strip() and not line.startswith(("real", "user", "sys"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--logs", nargs=2, type=Path, metavar=("LOG_BEFORE", "LOG_AFTER"))
    args = parser.parse_args(argv)
    problems = compare_metrics(args.before / "metrics.jsonl", args.after / "metrics.jsonl")
    problems += compare_checkpoints(args.before / "checkpoints", args.after / "checkpoints")
    if args.logs:
        x, y = masked_lines(args.logs[0], args.before), masked_lines(args.logs[1], args.after)
        problems += [
            f"log line {i}: {a!r} before, {b!r} after" for i, (a, b) in enumerate(zip(x, y, strict=False), 1) if a != b
        ]
        if len(x) != len(y):
            problems.append(f"log: {len(x)} lines before, {len(y)} after")
    for problem in problems:
        print(problem)
    lines = sum(1 for line in (args.before / "metrics.jsonl").read_text().splitlines() if line)
    print("different" if problems else f"same: {lines} metrics lines, checkpoints and logs equal (timings aside)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
