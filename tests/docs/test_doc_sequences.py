"""The docs' command sequences run as written, in order, as a user runs them.

A sequence is a page's walk-through: the lines of its ``bash`` blocks run one by one through ``bash`` (``cd DIR``
moves the sequence's working directory), from a fresh temporary working directory, with ``HF_HUB_OFFLINE=1``; in
between, the test does what the page's prose has the reader do (save a code block as a file; take the finished
example plugin where the page describes edits in fragments). A line the page shows failing, with its error in the
``text`` block after it, must fail with that error. A ``python`` block runs as a file named after the page, its lines
numbered as the page's, so a traceback names the page's file and line. Any other failure names the page's file and
line and shows the command's output.

The commands run as a user's do, in an activated virtual environment: a throwaway one layered over the environment
running these tests (a ``.pth`` file adds that one's site-packages), whose ``bin`` holds the ``vlmreg``, ``pip`` and
``pytest`` entry points installed there (the same scripts, run by the throwaway environment's interpreter), first on
``PATH``. So what the pages ``pip install`` goes into the throwaway environment, never into the one the rest of the
suite uses. pip runs offline (``PIP_NO_INDEX``, no build isolation: the build backend is the environment's own
setuptools); ``VLMREG_CACHE_DIR`` stays the suite's (tests/conftest.py), ``VLMREG_PLUGINS`` is unset.

Every command line of every page (the pages of test_doc_commands.py) is either run by a sequence or listed in
`NOT_RUN` with the reason (it needs a GPU, vLLM or the network, a server that runs until stopped, a placeholder
config, minutes of training, or it is the suite or setup itself); each listed one is reported as a skip saying
what and why, and `test_every_doc_command_is_run_or_listed` fails on a line that is neither and on a listing the
docs no longer show.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import attrs
import pytest

from tests.docs.test_doc_commands import PAGES, blocks

ROOT = Path(__file__).resolve().parents[2]
#: Seconds one command may take (a loaded 2-core machine is several times slower than an idle one).
TIMEOUT = 900


@attrs.frozen
class DocLine:
    """One command line of a page's ``bash`` block: continuation lines (a trailing ``\\``, an open quotation) joined
    as bash reads them."""

    page: str
    line: int
    text: str

    @property
    def first(self) -> str:
        """The line's first physical line, without a trailing ``\\`` or comment: how the lists below name it."""
        text = self.text.split("\n", 1)[0].removesuffix("\\")
        for at in [m.start() for m in re.finditer(r"\s#", text)]:
            if closed(text[:at]):
                return text[:at].strip()
        return text.strip()

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: `{self.first}`"


@attrs.frozen
class Block:
    page: str
    line: int
    lines: tuple[DocLine, ...]


def bash_blocks(page: str) -> list[Block]:
    out = []
    for start, body in blocks(page, "(?:bash|sh)"):
        physical = body.rstrip("\n").split("\n")
        lines, index = [], 0
        while index < len(physical):
            first, text = index, physical[index]
            index += 1
            if not text.strip() or text.lstrip().startswith("#"):  # blank, a comment, a shebang
                continue
            while index < len(physical) and (text.endswith("\\") or not closed(text)):
                text, index = text + "\n" + physical[index], index + 1
            lines.append(DocLine(page, start + first, text))
        out.append(Block(page, start, tuple(lines)))
    return out


def closed(text: str) -> bool:
    """Whether ``text`` closes every quotation it opens."""
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


# --- what a sequence does --------------------------------------------------------------------------------------------


@attrs.frozen
class Run:
    """The ``bash`` block whose first line is ``first``, every line in order (a line in `NOT_RUN` is left out);
    ``fails``: its line the page shows failing, with the error the ``text`` block after the block quotes."""

    first: str
    fails: str | None = None


@attrs.frozen
class Save:
    """The reader saves code blocks of the page (named by their first lines, appended in order) as ``path``."""

    path: str
    firsts: tuple[str, ...]


@attrs.frozen
class Take:
    """The reader's ``dest`` becomes the finished example ``source`` of this repository: the edits the page describes
    in fragments (a field here, a function there), made."""

    source: str
    dest: str


@attrs.frozen
class Python:
    """The ``python`` block whose first line is ``first``, run as ``python PAGE``; its output must match ``shows``."""

    first: str
    shows: str


@attrs.frozen
class Sequence:
    page: str
    steps: tuple[Run | Save | Take | Python, ...]
    #: Folders of this repository copied into the working directory first (the page's paths are relative to a clone).
    clone: tuple[str, ...] = ()


SEQUENCES = [
    Sequence(
        "docs/tutorial.md",
        (
            Run("vlmreg new-family my_llava --from-model-type llava"),  # 1
            Run("pip install -e vlmreg-my-llava"),  # 3
            Run("pip uninstall -y vlmreg-my-llava"),  # part 2: the folder
            Save("pyproject.toml", ("[build-system]",)),  # 4
            Save("src/vlmreg_tiny_llava/processor.py", ("# src/vlmreg_tiny_llava/processor.py",)),  # 5 says: now
            Save(
                "src/vlmreg_tiny_llava/__init__.py",
                ("def tiny_config():", "from vlmreg import FamilyDescriptor, hookimpl"),
            ),
            Run("pip install -e .", fails="vlmreg check --tiny llava"),  # 6: the first draft's error
            Take("examples/plugins/vlmreg-tiny-llava/src", "src"),  # 6-8: the paths fixed, the fields and processor
            Save("tests/test_conformance.py", ("# tests/test_conformance.py",)),  # 9
            Run("pytest tests"),
            Save("colour.toml", ("# colour.toml",)),  # 10
            Run("vlmreg validate colour.toml"),
            Run("vlmreg families --json | python -c"),  # 11
        ),
    ),
    Sequence(
        "README.md",
        # the on_step callback's line for each step, then the checkpoint
        (Python("import vlmreg", shows=r"(?m)^1 \S+\n2 \S+\ncheckpoint runs/py/checkpoints/step_000002$"),),
        clone=("examples/configs",),
    ),
    Sequence(
        "docs/data.md",
        (Run("vlmreg data preview examples/configs/qwen3_vl_tiny.toml --n 2"),),
        clone=("examples/configs",),
    ),
]


# --- what is not run, and why ----------------------------------------------------------------------------------------

GPU = "needs GPUs (CUDA, NCCL"
MAIN_JOB = (
    "the README's main job: 100 steps of training, 35 s on 2 idle cores and 7-9 minutes under load, over this test's "
    "budget (the README's Python block runs the same config for two steps)"
)
PLUGIN_README = (
    "pip-installs the example plugin into the reader's environment, then lists and checks it, runs its tests, and "
    "trains its configs where the README does (20-100 steps: minutes); {test} installs it into a private folder and "
    "runs the same, each train for two steps"
)
BUNDLED_README = (
    "installs a bundled plugin (./scripts/setup.sh has), checks it and trains its tiny config for 100 steps "
    "(minutes); the suite runs its tests (plugins/*/tests) and tests/examples/test_configs.py validates the config"
)


@attrs.frozen
class NotRun:
    page: str
    first: str  # the command line's first line; with ``block``, the block's first line, for the whole block
    reason: str
    block: bool = False


NOT_RUN = [
    NotRun(
        "README.md",
        "./scripts/setup.sh && .venv/bin/vlmreg train examples/configs/qwen3_vl_tiny.toml",
        f"setup is CI's own first command, not rerun here; then {MAIN_JOB}",
    ),
    NotRun(
        "README.md", "./scripts/setup.sh && .venv/bin/python -m pytest", "the command CI runs (.ci/run): this suite"
    ),
    NotRun("CONTRIBUTING.md", "./scripts/setup.sh", "the README's test command, which CI runs", block=True),
    NotRun(
        "CONTRIBUTING.md",
        "./scripts/format.sh",
        "rewrites the checkout's files; tests/test_habits.py runs the checks (ruff check, ruff format --check, mypy)",
        block=True,
    ),
    NotRun(
        "docs/broadcast.md",
        "vlmreg bench broadcast --family qwen3_vl --size tiny --backend gloo",
        "a benchmark of the next line's kind (its code runs in tests/broadcast)",
    ),
    NotRun(
        "docs/broadcast.md",
        "vlmreg bench broadcast --family qwen3_vl --size 2b --backend nccl --iters 20",
        f"{GPU}) for a 2B model",
    ),
    NotRun(
        "docs/broadcast.md",
        "vlmreg bench broadcast --family qwen3_vl_moe --size 30b-a3b --backend nccl --shards 3",
        f"{GPU}: four of 141 GB) for a 31B model; tests/broadcast/test_bench_cli.py runs --shards 2 on CPU",
    ),
    NotRun(
        "docs/environments.md",
        "VLMREG_ENV_API_KEY=... vlmreg env serve colour_turns --port 8100",
        "a server that runs until stopped, then a 100-step train (minutes); tests/envs/test_cli_env.py serves an "
        "environment and trains against it, shortened",
        block=True,
    ),
    NotRun(
        "docs/environments.md",
        "vlmreg env serve arrows --port 8100",
        "a server that runs until stopped, then a train of the reader's own config (my_run.toml)",
        block=True,
    ),
    NotRun(
        "docs/environments.md",
        'pip install "vlmreg[crafter]"',
        "installs from the package index (network), then trains a Crafter run for minutes",
        block=True,
    ),
    NotRun(
        "docs/scaling.md",
        "torchrun --standalone --nproc_per_node 2 -m vlmreg train CONFIG.toml",
        f"{GPU}, vLLM) and the reader's own config",
    ),
    NotRun(
        "docs/scaling.md",
        'nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        "a Slurm batch script: 3 nodes of 8 GPUs, vLLM",
        block=True,
    ),
    NotRun(
        "docs/serving.md",
        "vlmreg serve run.toml --port 8000",
        "a server that runs until stopped, of the reader's own config (run.toml)",
    ),
    NotRun(
        "docs/serving.md",
        "curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{",
        "needs a running server; tests/serve/test_server.py sends this very body to one",
    ),
    NotRun(
        "docs/serving.md",
        'umask 077; python -c "import secrets; print(secrets.token_urlsafe(32))" > server.key',
        "a key file for the next line, a server that runs until stopped, of the reader's own config (run.toml)",
        block=True,
    ),
    NotRun("docs/testing.md", ".venv/bin/python -m pytest", "this very suite, and one file of it", block=True),
    NotRun(
        "docs/testing.md",
        ".venv/bin/python -m pip install -e '.[mutation]'",
        "installs from the package index (network); mutation runs take hours",
        block=True,
    ),
    NotRun(
        "docs/training.md",
        "vlmreg train examples/configs/qwen3_vl_tiny.toml",
        f"{MAIN_JOB}; the lines after it name the reader's own config (run.toml)",
        block=True,
    ),
    NotRun(
        "docs/training.md",
        "torchrun --standalone --nproc_per_node 4 -m vlmreg train run.toml",
        f"{GPU}) and several machines, of the reader's own config",
        block=True,
    ),
    NotRun(
        "docs/tutorial.md",
        "vlmreg train colour.toml",
        "100 steps: about 8 minutes on 2 busy cores, over this test's budget; the two-step try before it runs",
    ),
    *(
        NotRun(
            f"examples/plugins/{folder}/README.md",
            f"pip install ./examples/plugins/{folder}",
            PLUGIN_README.format(test=test),
            block=True,
        )
        for folder, test in [
            ("vlmreg-example-extras", "tests/examples/test_extras_plugin.py"),
            ("vlmreg-tiny-gemma3", "tests/examples/test_family_plugins.py"),
            ("vlmreg-tiny-idefics3", "tests/examples/test_family_plugins.py"),
            ("vlmreg-tiny-pixtral", "tests/examples/test_family_plugins.py"),
            ("vlmreg-tiny-llava", "tests/examples/test_third_party_plugin.py"),
        ]
    ),
    *(
        NotRun(
            f"examples/plugins/{folder}/README.md",
            f"pip install ./examples/plugins/{folder}",
            f"installs the sink and {package} into the reader's environment (from the package index where absent); "
            f"{test} installs it into a private folder and runs a run and its resume with it",
        )
        for folder, package, test in [
            ("vlmreg-mlflow", "mlflow-skinny", "tests/examples/test_mlflow_sink.py"),
            ("vlmreg-wandb", "wandb", "tests/examples/test_wandb_sink.py"),
        ]
    ),
    *(
        NotRun(f"plugins/{folder}/README.md", f"pip install {flags}plugins/{folder}", BUNDLED_README, block=True)
        for folder, flags in [
            ("vlmreg-glm4v", "-e "),
            ("vlmreg-internvl", "-e "),
            ("vlmreg-llava-onevision", "--no-deps -e "),
        ]
    ),
]


def find_block(page: str, first: str) -> Block:
    found = [b for b in bash_blocks(page) if b.lines and b.lines[0].first.startswith(first)]
    assert len(found) == 1, f"{page}: {len(found)} bash blocks begin with `{first}`"
    return found[0]


def code_block(page: str, first: str, language: str = r"\w+") -> tuple[int, str]:
    found = [(line, body) for line, body in blocks(page, language) if body.split("\n", 1)[0] == first]
    assert len(found) == 1, f"{page}: {len(found)} code blocks begin with `{first}`"
    return found[0]


def not_run(line: DocLine, block: Block) -> NotRun | None:
    for entry in NOT_RUN:
        if entry.page == line.page and entry.first == (block.lines[0].first if entry.block else line.first):
            return entry
    return None


def flat(text: str) -> str:
    return " ".join(text.split())


# --- running ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def user_env(tmp_path) -> dict[str, str]:
    """The environment of a user whose virtual environment is activated: a throwaway one layered over the one running
    these tests, holding copies of its ``vlmreg``, ``pip`` and ``pytest`` entry points."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    under = sysconfig.get_paths()["purelib"]  # the running environment's, with its own .pth files (editable installs)
    (Path(site) / "_under.pth").write_text(f"import site; site.addsitedir({under!r})\n")
    for name in ("vlmreg", "pip", "pytest"):
        script = Path(sys.executable).parent / name
        if not script.is_file():
            pytest.fail(f"no `{name}` entry point beside {sys.executable}: ./scripts/setup.sh installs it")
        lines = script.read_text().split("\n")
        assert lines[0].startswith("#!"), f"{script}: not a script"
        (venv / "bin" / name).write_text("\n".join([f"#!{venv / 'bin' / 'python'}", *lines[1:]]))
        (venv / "bin" / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("VLMREG_PLUGINS", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS")}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
        VIRTUAL_ENV=str(venv),
        HF_HUB_OFFLINE="1",
        PIP_NO_INDEX="1",  # offline; the build backend (setuptools) is the environment's own:
        PIP_NO_BUILD_ISOLATION="0",  # pip reads this as --no-build-isolation
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    return env


@attrs.define
class Reader:
    """Runs a sequence's steps as the page's reader would, from ``cwd``."""

    sequence: Sequence
    cwd: Path
    env: dict[str, str]
    seconds: list[tuple[str, float]] = attrs.Factory(list)

    def shell(self, line: DocLine) -> subprocess.CompletedProcess[str]:
        start = time.monotonic()
        try:
            done = subprocess.run(
                ["bash", "-o", "pipefail", "-c", line.text],
                cwd=self.cwd,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"{line}: still running after {TIMEOUT} s (in {self.cwd})")
        self.seconds.append((str(line), time.monotonic() - start))
        return done

    def run(self, step: Run) -> None:
        page = self.sequence.page
        block = find_block(page, step.first)
        for line in block.lines:
            if not_run(line, block):
                continue
            moved = re.fullmatch(r"cd (\S+)", line.text.split("#", 1)[0].strip())
            if moved:
                self.cwd = self.cwd / moved.group(1)
                assert self.cwd.is_dir(), f"{line}: no folder {self.cwd}"
                continue
            done = self.shell(line)
            output = (done.stdout + done.stderr)[-4000:]
            if line.first == step.fails:
                shown = next(body for at, body in blocks(page, "text") if at > line.line)
                assert done.returncode != 0, f"{line}: the page shows it failing; it exited 0:\n{output}"
                assert flat(done.stderr) == flat(shown), f"{line}: not the error the page shows:\n{output}"
            elif done.returncode != 0:
                pytest.fail(f"{line}: exited {done.returncode} (in {self.cwd}):\n{output}")

    def save(self, step: Save) -> None:
        path = self.cwd / step.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(code_block(self.sequence.page, first)[1] for first in step.firsts))

    def take(self, step: Take) -> None:
        shutil.copytree(
            ROOT / step.source,
            self.cwd / step.dest,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
        )

    def python(self, step: Python) -> None:
        page = self.sequence.page
        line, body = code_block(page, step.first, "python")
        script = self.cwd.parent / "doc" / page  # a traceback names the page's file, at the page's line
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text("\n" * (line - 1) + body)
        done = self.shell(DocLine(page, line, f"python {shlex.quote(str(script))}"))
        output = (done.stdout + done.stderr)[-4000:]
        if done.returncode != 0:  # the traceback's last line of the block, else the block's first
            at = re.findall(rf'File "{re.escape(str(script))}", line (\d+)', done.stderr)
            pytest.fail(f"{page}:{at[-1] if at else line}: the python block exited {done.returncode}:\n{output}")
        assert re.search(step.shows, done.stdout), f"{page}:{line}: its output lacks {step.shows!r}:\n{output}"


@pytest.mark.parametrize("sequence", SEQUENCES, ids=[s.page for s in SEQUENCES])
def test_the_page_s_commands_run_in_order(sequence, user_env, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for folder in sequence.clone:
        shutil.copytree(ROOT / folder, work / folder, ignore=shutil.ignore_patterns("__pycache__"))
    reader = Reader(sequence, work, user_env)
    for step in sequence.steps:
        {Run: reader.run, Save: reader.save, Take: reader.take, Python: reader.python}[type(step)](step)
    print("\n".join(f"{seconds:6.1f} s  {what}" for what, seconds in reader.seconds))


@pytest.mark.parametrize("entry", NOT_RUN, ids=[f"{e.page}:{e.first[:40]}" for e in NOT_RUN])
def test_not_run(entry):
    """Reported as a skip, saying what is not run and why."""
    lines = [line for block in bash_blocks(entry.page) for line in block.lines if not_run(line, block) == entry]
    assert lines, f"{entry.page}: NOT_RUN lists `{entry.first}`, which the page no longer shows"
    pytest.skip(f"{lines[0]}{' and the rest of its block' if entry.block else ''}: not run: {entry.reason}")


def test_every_doc_command_is_run_or_listed():
    """Each command line of every page is run by a sequence or listed in NOT_RUN; every step names a block the page
    shows."""
    run = set()
    for sequence in SEQUENCES:
        for step in sequence.steps:
            if isinstance(step, Run):
                block = find_block(sequence.page, step.first)
                run.add((block.page, block.line))
                assert step.fails is None or any(line.first == step.fails for line in block.lines), step
            elif isinstance(step, Save):
                for first in step.firsts:
                    code_block(sequence.page, first)
            elif isinstance(step, Python):
                code_block(sequence.page, step.first, "python")
    neither = [
        str(line)
        for page in PAGES
        for block in bash_blocks(page)
        for line in block.lines
        if (page, block.line) not in run and not_run(line, block) is None
    ]
    assert not neither, "neither run by a sequence of this file nor listed in NOT_RUN (with the reason):\n" + "\n".join(
        neither
    )
