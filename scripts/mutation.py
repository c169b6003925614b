#!/usr/bin/env python
"""Mutation testing of the core modules with mutmut 3, one module at a time, each with its own tests only.

    python scripts/mutation.py                      # every module below, in order (slow: not for CI)
    python scripts/mutation.py batching losses      # some of them
    python scripts/mutation.py --sample 60 prompts  # at most 60 mutants of the module, drawn with a fixed seed
    python scripts/mutation.py --survivors prompts  # only the mutants that survived the module's last run, again
    python scripts/mutation.py --list               # the modules and the tests each runs with

Each module runs in its own folder ``.mutation/<module>/`` (links to src/, tests/, plugins/, examples/ and a copy of
pyproject.toml, plus a setup.cfg holding that module's mutmut settings), so runs never share state and the
repository's own files are never touched. mutmut copies the tree into ``mutants/`` there, mutates only the module's
file(s), maps each mutated function to the tests (of the listed files) that call it, and runs only those per mutant,
forked from a process that has already imported them. A summary line per module (killed / survived / no tests /
timeouts) is appended to ``.mutation/results.tsv``; the surviving mutants' diffs go to
``.mutation/<module>/survived.txt``.

Requires mutmut 3.x (``pip install -e '.[mutation]'``). Torch and BLAS threads are limited to one per process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutation"
LINKED = ("src", "tests", "plugins", "examples", "docs", "scripts", "README.md")

#: module name -> (files mutated, test files it runs with); in the order a full run takes them
MODULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "batching": (
        ("src/vlmreg/train/batching.py",),
        # the prefix-LM marks are checked against PaliGemma's processor in its plugin's tests
        (
            "tests/train/test_batching.py",
            "tests/train/test_packing.py",
            "plugins/vlmreg-paligemma/tests/test_paligemma.py",
        ),
    ),
    "losses": (
        ("src/vlmreg/train/losses.py", "src/vlmreg/builtin/objectives.py"),
        ("tests/train/test_losses.py", "tests/train/test_objective_formulas.py", "tests/train/test_objectives.py"),
    ),
    "logprobs": (
        ("src/vlmreg/modeling/logprobs.py",),
        ("tests/modeling/test_logprobs.py", "tests/train/test_packing.py"),
    ),
    "samples": (("src/vlmreg/train/samples.py",), ("tests/train/test_samples.py",)),
    "checkpoint": (
        ("src/vlmreg/train/checkpoint.py",),
        (
            "tests/train/test_checkpoint.py",
            "tests/train/test_checkpoint_durability.py",
            "tests/train/test_checkpoint_files.py",
            "tests/train/test_checkpoint_rng.py",
            "tests/train/test_run_safety.py",
            # the sharded layout's save (`_save_sharded`) runs in the in-process threaded ranks
            "tests/train/test_shard_checkpoint_ranks.py",
        ),
    ),
    # sharded (FSDP2) checkpoints: two ranks as threads of the test's process (torch's threaded process group), where
    # mutmut sees the code run; the torchrun tests run it in subprocesses, which import the unmutated tree, so only
    # test_shard_checkpoint.py's in-process checks of their files are listed beside them (test_distributed.py has none)
    "checkpoint-shards": (
        ("src/vlmreg/train/shard_checkpoint.py",),
        ("tests/train/test_shard_checkpoint_ranks.py", "tests/train/test_shard_checkpoint.py"),
    ),
    # a sharded checkpoint read by another number of processes (or one without FSDP2): the same in-process ranks
    "checkpoint-reshard": (
        ("src/vlmreg/train/reshard.py",),
        ("tests/train/test_shard_checkpoint_ranks.py", "tests/train/test_shard_checkpoint.py"),
    ),
    "broadcast-plan": (
        ("src/vlmreg/broadcast/plan.py",),
        ("tests/broadcast/test_plan.py", "tests/broadcast/test_adapters.py"),
    ),
    "broadcast-buckets": (("src/vlmreg/broadcast/buckets.py",), ("tests/broadcast/test_buckets.py",)),
    "broadcast-copy-plan": (("src/vlmreg/broadcast/copy_plan.py",), ("tests/broadcast/test_copy_plan.py",)),
    "prompts": (
        ("src/vlmreg/data/prompts.py",),
        # prefix-LM prompts are checked against PaliGemma's processor in its plugin's tests, a processor that refuses
        # text alone in test_processor_contract, video prompts against Qwen2-VL's processor and in video episodes
        (
            "tests/data/test_prompts.py",
            "tests/data/test_prompt_edges.py",
            "tests/data/test_images_per_message.py",
            "tests/data/test_processor_contract.py",
            "tests/rollout/test_video_episodes.py",
            "plugins/vlmreg-paligemma/tests/test_paligemma.py",
            "plugins/vlmreg-qwen2-vl/tests/test_qwen2_vl.py",
        ),
    ),
    "image-store": (
        ("src/vlmreg/data/store.py",),
        ("tests/data/test_prompts.py", "tests/data/test_store.py", "tests/data/test_video.py"),
    ),
    "rewards": (
        ("src/vlmreg/rewards/*.py",),
        ("tests/rewards/test_rewards.py", "tests/rewards/test_reward_registry.py"),
    ),
    "config-resolve": (
        ("src/vlmreg/config/resolve.py",),
        (
            "tests/config/test_resolve.py",
            "tests/config/test_load_and_resolve.py",
            "tests/config/test_checkpoint_dirs.py",
            "tests/config/test_vllm_unsupported.py",
            "tests/config/test_bad_configs.py",
            "tests/config/test_set_errors.py",
            "tests/config/test_properties.py",
        ),
    ),
}

THREADS = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
THREADS["TOKENIZERS_PARALLELISM"] = "false"

STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no_tests",
    33: "no_tests",
    34: "skipped",
    36: "timeout",
    -24: "timeout",
    24: "timeout",
    152: "timeout",
    255: "timeout",
    37: "type_check",
}


def setup_cfg(sources: tuple[str, ...], tests: tuple[str, ...]) -> str:
    lines = "\n    ".join
    return (
        "[mutmut]\n"
        "source_paths = src\n"
        f"only_mutate =\n    {lines(sources)}\n"
        f"pytest_add_cli_args_test_selection =\n    {lines(tests)}\n"
        # scripts/mutation_order.py: the selected tests fastest first (mutmut's fork server keeps them unordered)
        "pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -p\n    scripts.mutation_order\n    -q\n"
        "also_copy =\n    plugins\n    examples\n    docs\n    scripts\n    README.md\n"
        # torch is not fork-safe once it has run: fork each mutant from a server that has only imported the tests
        "process_isolation = forkserver\n"
        "use_git_change_detection = false\n"
        "timeout_multiplier = 5.0\n"
        "timeout_constant = 5.0\n"
    )


def prepare(name: str) -> Path:
    sources, tests = MODULES[name]
    present = tuple(t for t in tests if (ROOT / t).is_file())
    if not present:
        raise SystemExit(f"mutation.py: none of module {name!r}'s test files exists: {list(tests)}")
    if present != tests:  # an older checkout, measured for comparison
        print(
            f"   note: {name}: test files absent here, run without them: {sorted(set(tests) - set(present))}",
            flush=True,
        )
    folder = WORK / name
    shutil.rmtree(folder, ignore_errors=True)  # a fresh run every time: no results carried over
    folder.mkdir(parents=True)
    for entry in LINKED:
        if (ROOT / entry).exists():
            (folder / entry).symlink_to(ROOT / entry)
    shutil.copy2(ROOT / "pyproject.toml", folder / "pyproject.toml")  # pytest's settings; holds no [tool.mutmut]
    (folder / "setup.cfg").write_text(setup_cfg(sources, present))
    return folder


def mutmut(folder: Path, *args: str, log: Path | None = None) -> int:
    env = {**os.environ, **THREADS, "PYTHONPATH": ""}  # the mutated copy, never another checkout, is imported
    command = [sys.executable, "-m", "mutmut", *args]
    if log is None:
        return subprocess.run(command, cwd=folder, env=env).returncode
    with open(log, "a") as out:
        return subprocess.run(command, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT).returncode


def results(folder: Path) -> dict[str, str]:
    """Mutant name -> status, read from mutmut's per-file ``.meta`` records."""
    found: dict[str, str] = {}
    for meta in (folder / "mutants").rglob("*.py.meta"):
        for key, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            found[key] = "not_checked" if code is None else STATUS.get(code, "suspicious")
    return found


def last_survivors(name: str) -> list[str]:
    """The mutants listed in ``.mutation/<name>/survived.txt`` by the module's last run."""
    listed = WORK / name / "survived.txt"
    if not listed.is_file():
        raise SystemExit(f"mutation.py: --survivors: no earlier run of {name!r} to take survivors from ({listed})")
    return [line.split()[1].rstrip(":") for line in listed.read_text().splitlines() if line.startswith("# ")]


def run_module(name: str, sample: int | None, seed: int, survivors: bool = False) -> dict[str, object]:
    earlier = last_survivors(name) if survivors else []
    if survivors and not earlier:
        return {"module": name, "mutants": "0 survivors to run again"}
    folder = prepare(name)
    log = folder / "mutmut.log"
    started = datetime.datetime.now(datetime.UTC)
    names: list[str] = earlier
    total = None
    if survivors:
        total = f"survivors of the last run: {len(earlier)}"
    elif sample is not None:
        # generate the mutants and the test map, running none (no mutant has this name: mutmut stops with an error)
        mutmut(folder, "run", "--max-children", "1", "__no_such_mutant__", log=log)
        every = sorted(results(folder))
        total = len(every)
        if total > sample:
            names = sorted(random.Random(seed).sample(every, sample))
    code = mutmut(folder, "run", "--max-children", "1", *names, log=log)
    statuses = results(folder)
    if names:
        statuses = {k: v for k, v in statuses.items() if k in set(names)}
    counts = {s: sum(1 for v in statuses.values() if v == s) for s in sorted(set(statuses.values()))}
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    tried = killed + counts.get("survived", 0) + counts.get("no_tests", 0)  # a mutant no test runs is not caught
    survived = sorted(k for k, v in statuses.items() if v in ("survived", "no_tests"))
    if code != 0:  # mutmut stopped before testing (a failing clean run, say): the asked-for mutants stay listed
        print(f"   mutmut exited with {code}: see {log}", flush=True)
        listed = "".join(f"# {key}: not run (mutmut exited with {code})\n" for key in names)
        (folder / "survived.txt").write_text(listed)
        survived = []
    with open(folder / "survived.txt", "a" if code != 0 else "w") as out:
        for key in survived:
            shown = subprocess.run(
                [sys.executable, "-m", "mutmut", "show", key],
                cwd=folder,
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": ""},
            )
            out.write(shown.stdout + "\n")
    return {
        "module": name,
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "mutmut": _mutmut_version(),
        "mutants": len(statuses) if total is None else f"{len(statuses)} of {total}",
        "seconds_per_mutant": _seconds_per_mutant(log),
        "killed": killed,
        "survived": counts.get("survived", 0),
        "no_tests": counts.get("no_tests", 0),
        "other": {k: v for k, v in counts.items() if k not in ("killed", "timeout", "survived", "no_tests")},
        "kill_rate": f"{100 * killed / tried:.0f}%" if tried else "-",
        "minutes": round((datetime.datetime.now(datetime.UTC) - started).total_seconds() / 60, 1),
        "exit": code,
    }


def _seconds_per_mutant(log: Path) -> float | None:
    """The mean wall time of one mutant (fork, its selected tests, exit), from the rate mutmut logs at its end (the
    fork server records no per-mutant times)."""
    rates = re.findall(r"([0-9.]+) mutations/second", log.read_text(errors="replace")) if log.is_file() else []
    return round(1 / float(rates[-1]), 2) if rates and float(rates[-1]) > 0 else None


def _mutmut_version() -> str:
    return version("mutmut")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"modules to run (default: all): {', '.join(MODULES)}")
    parser.add_argument("--sample", type=int, help="run at most this many mutants per module, drawn with --seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--survivors", action="store_true", help="run only the mutants that survived each module's last run"
    )
    parser.add_argument("--list", action="store_true", help="print the modules and their tests, run nothing")
    args = parser.parse_args()
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {unknown}; known: {', '.join(MODULES)}")
    if args.list:
        for name, (sources, tests) in MODULES.items():
            print(f"{name}: {' '.join(sources)}\n    tests: {' '.join(tests)}")
        return 0
    try:
        major = int(_mutmut_version().split(".")[0])
    except Exception:  # not installed
        major = 0
    if major != 3:
        print("mutation.py needs mutmut 3.x: pip install -e '.[mutation]'", file=sys.stderr)
        return 2
    WORK.mkdir(exist_ok=True)
    table = WORK / "results.tsv"
    if not table.exists():
        table.write_text(
            "module\tdate\tmutmut\tmutants\tkilled\tsurvived\tno_tests\tother\tkill_rate\tminutes\ts_per_mutant\n"
        )
    for name in args.modules or list(MODULES):
        print(f"== {name}", flush=True)
        row = run_module(name, args.sample, args.seed, args.survivors)
        print("   " + json.dumps(row), flush=True)
        if "killed" not in row:
            continue
        with open(table, "a") as out:
            out.write(
                "\t".join(
                    str(row[k])
                    for k in (
                        "module",
                        "date",
                        "mutmut",
                        "mutants",
                        "killed",
                        "survived",
                        "no_tests",
                        "other",
                        "kill_rate",
                        "minutes",
                        "seconds_per_mutant",
                    )
                )
                + "\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
