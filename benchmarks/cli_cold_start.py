"""Cold start of `vlmreg families` against `python -c "import torch, transformers"`.

Each command runs in a fresh interpreter, alternating, `--runs` times; the medians and their ratio are printed as
JSON. Target (issue 2): `vlmreg families` under 15% of the torch + transformers import.

    .venv/bin/python benchmarks/cli_cold_start.py --runs 10
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time


def timed(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    families = [sys.executable, "-m", "vlmreg", "families", "--json"]
    imports = [sys.executable, "-c", "import torch, transformers"]
    timed(families), timed(imports)  # warm the OS file cache once
    a, b = [], []
    for _ in range(args.runs):
        a.append(timed(families))
        b.append(timed(imports))
    result = {
        "families_median_s": round(statistics.median(a), 3),
        "import_torch_transformers_median_s": round(statistics.median(b), 3),
        "ratio": round(statistics.median(a) / statistics.median(b), 3),
        "runs": args.runs,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
