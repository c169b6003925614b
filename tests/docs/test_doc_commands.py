"""Every command and run config the documentation shows is checked, so the docs cannot drift from the code.

Each ``bash`` block of README.md, CONTRIBUTING.md, docs/*.md and the plugins' READMEs is split into its simple
commands (continuation lines joined, comments dropped, ``&&`` / ``;`` / ``|`` separated). A ``vlmreg`` command
(``vlmreg``, ``.venv/bin/vlmreg``, ``python -m vlmreg``, ``torchrun ... -m vlmreg``) is parsed by vlmreg's own
argument parser; one that reads a run config (``train``, ``eval``, ``serve``, ``validate``, ``config``,
``data preview``) is validated as ``vlmreg validate CONFIG --set ...`` would, completely. The config is a file of
this repository, one the page has you write (a ``toml`` block whose first line is ``# NAME.toml``), or one of
`PLACEHOLDERS`, whose ``--set`` overrides are then validated on the tiny Qwen3-VL config. The plugins the page
builds in its ``python`` blocks, or the example plugin it uses (`PAGE_PLUGINS`, an example plugin's own config), are
registered first. Train commands that write into one output folder must not follow each other without
``--resume`` / ``--overwrite`` (a later one would be refused: "already holds a run"). ``pip install``, ``pytest``
and ``python`` name files or folders that exist (or extras and packages pyproject.toml declares). Every ``toml``
block of docs/*.md that shows run-config sections is completed with the tiny config's other sections and validated
(its data files are created empty first: the docs show config, not data).

The commands themselves run in order in test_doc_sequences.py, or are listed there with the reason they are not
run (a GPU, the network, minutes of training: the tests that cite them run them shortened).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import shutil
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from vlmreg.cli import build_parser
from vlmreg.config.validate import validate_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    "README.md",
    "CONTRIBUTING.md",
    *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
    *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("examples/plugins/*/README.md")),
    *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("plugins/*/README.md")),
]
STAND_IN = ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml"
#: Config names the docs use for "your own config": not files here.
PLACEHOLDERS = {"run.toml", "my_run.toml", "CONFIG.toml", "CONFIG"}
#: Programs whose commands are not vlmreg's and name nothing of this repository to check.
OTHER_PROGRAMS = {"cd", "mkdir", "grep", "curl", "umask", "export", "for", "do", "done", "srun", "scontrol", "openssl"}
#: Commands that read a run config.
CONFIG_COMMANDS = {"train", "eval", "serve", "validate", "config", "preview"}
RUN_SECTIONS = {"model", "data", "rollout", "trainer", "reward", "eval", "logging", "broadcast"}
# An example plugin's config needs that plugin: its folder -> (its package, whether it must load alone: the tiny
# Gemma 3 and Idefics3 families take the names of bundled ones).
EXAMPLE_PLUGINS = {
    "vlmreg-example-extras": ("vlmreg_example_extras", False),
    "vlmreg-tiny-gemma3": ("vlmreg_tiny_gemma3", True),
    "vlmreg-tiny-idefics3": ("vlmreg_tiny_idefics3", True),
    "vlmreg-tiny-pixtral": ("vlmreg_tiny_pixtral", False),
    "vlmreg-tiny-llava": ("vlmreg_tiny_llava", False),
}
#: Pages whose commands use an example plugin's family (the tutorial builds the tiny LLaVA one).
PAGE_PLUGINS = {"docs/tutorial.md": "vlmreg-tiny-llava"}
#: What the shell variables of docs/scaling.md's Slurm script hold there (a --set value naming one is read with it).
SHELL_VALUES = {"$urls": '"http://node2:8000","http://node2:8001"', "$head": "node0"}


@attrs.frozen
class Command:
    page: str
    line: int
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.words)}"


def blocks(page: str, language: str) -> Iterator[tuple[int, str]]:
    """``(line, body)`` of each fenced block of ``language`` in ``page``."""
    text = (ROOT / page).read_text()
    for match in re.finditer(rf"^```{language}\n(.*?)^```", text, re.M | re.S):
        yield text[: match.start()].count("\n") + 2, match.group(1)


def simple_commands(page: str) -> Iterator[Command]:
    for start, body in blocks(page, "(?:bash|sh)"):
        lines = body.split("\n")
        index = 0
        while index < len(lines):
            line, first = lines[index], index
            index += 1
            while True:
                if line.endswith("\\") and index < len(lines):  # a continuation line
                    line, index = line[:-1] + " " + lines[index], index + 1
                    continue
                arithmetic = re.sub(r"\$\(\([^)]*\)\)", "0", line)  # $((8000 + g)): a number
                lexer = shlex.shlex(arithmetic, posix=True, punctuation_chars=";&|<>()")
                lexer.whitespace_split = True
                try:
                    tokens = list(lexer)
                except ValueError:  # a quotation that goes on over the next lines
                    if index == len(lines):
                        raise
                    line, index = line + "\n" + lines[index], index + 1
                    continue
                break
            words: list[str] = []
            for token in [*tokens, ";"]:
                if set(token) <= set(";&|()$"):  # separators; `$(` opens a command of its own
                    if words:
                        yield Command(page, start + first, tuple(words))
                    words = []
                else:
                    words.append(token)


def commands() -> list[Command]:
    out = []
    for page in PAGES:
        for command in simple_commands(page):
            words = list(command.words)
            while ">" in words or ">>" in words:
                at = next(i for i, w in enumerate(words) if w in (">", ">>"))
                del words[at : at + 2]
            while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):  # VAR=value before a command
                words.pop(0)
            if words:
                out.append(attrs.evolve(command, words=tuple(words)))
    return out


def vlmreg_argv(words: tuple[str, ...]) -> list[str] | None:
    """The arguments after ``vlmreg`` (or ``-m vlmreg``), or None when the command does not run vlmreg."""
    for i, word in enumerate(words):
        if (word == "vlmreg" or word.endswith("/vlmreg")) and (i == 0 or words[i - 1] == "-m"):
            return list(words[i + 1 :])
    return None


ALL = commands()
VLMREG = [(c, vlmreg_argv(c.words)) for c in ALL if vlmreg_argv(c.words) is not None]
OTHERS = [c for c in ALL if vlmreg_argv(c.words) is None]


def test_the_docs_show_commands():
    """The extraction finds what it should (a regression guard for the parser above)."""
    assert len(VLMREG) > 40 and len(OTHERS) > 20
    shown = {str(c) for c, _ in VLMREG}
    assert "README.md:19: .venv/bin/vlmreg train examples/configs/qwen3_vl_tiny.toml" in shown
    # in a Slurm script
    assert any(c.page == "docs/scaling.md" and argv[:2] == ["train", "run.toml"] for c, argv in VLMREG)


@pytest.mark.parametrize(("command", "argv"), VLMREG, ids=[f"{c.page}:{c.line}" for c, _ in VLMREG])
def test_every_vlmreg_command_parses(command, argv, capsys):
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{command}: {capsys.readouterr().err.strip()}")


def config_commands() -> list[tuple[Command, list[str]]]:
    out = []
    for command, argv in VLMREG:
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                args = build_parser().parse_args(argv)
        except SystemExit:  # test_every_vlmreg_command_parses names it (here, at collection, it would stop pytest)
            continue
        if getattr(args, "data_command", args.command) in CONFIG_COMMANDS and getattr(args, "config", None):
            out.append((command, argv))
    return out


@pytest.fixture
def example_plugin(vlmreg_add_plugin, monkeypatch, tmp_path):
    """``register(folder)``: only that example plugin (no installed ones), registered in this process from a copy of
    its package (so metadata an install left in its source tree does not register it twice)."""

    def register(folder: str) -> None:
        package, alone = EXAMPLE_PLUGINS[folder]
        shutil.copytree(ROOT / "examples" / "plugins" / folder / "src" / package, tmp_path / "site" / package)
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        if alone:
            monkeypatch.setenv("VLMREG_PLUGINS", "")
        vlmreg_add_plugin(__import__(package), package)

    yield register
    for name in [m for m in sys.modules if m.split(".")[0] in {p for p, _ in EXAMPLE_PLUGINS.values()}]:
        del sys.modules[name]


@pytest.fixture
def page_plugins(vlmreg_add_plugin, tmp_path):
    """``register(page)``: the plugins a page builds in its ``python`` blocks (those with ``@hookimpl`` that run as they
    are: a block needing a package not installed here, showing only a fragment, or naming what another block
    defines, is left out)."""

    loaded: list[str] = []

    def register(page: str) -> None:
        for line, body in blocks(page, "python"):
            if "@hookimpl" not in body:
                continue
            name = f"doc_plugin_{Path(page).stem}_{line}"
            path = tmp_path / f"{name}.py"
            path.write_text(body)
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            loaded.append(name)
            try:
                spec.loader.exec_module(module)
                for hook in [getattr(module, n) for n in dir(module) if n.startswith("vlmreg_register_")]:
                    hook(lambda *args, **kwargs: None)  # an illustration naming what another block defines fails here
            except (ImportError, SyntaxError, NameError):
                continue
            vlmreg_add_plugin(module, name)

    yield register
    for name in loaded:
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("command", "argv"), config_commands(), ids=[f"{c.page}:{c.line}" for c, _ in config_commands()]
)
def test_every_config_a_command_reads_validates(command, argv, example_plugin, page_plugins, monkeypatch, tmp_path):
    args = build_parser().parse_args(argv)
    sets = [with_shell_values(s) for s in getattr(args, "sets", [])]
    config = Path(args.config)
    written = page_configs(command.page)
    monkeypatch.chdir(ROOT)
    if config.name in PLACEHOLDERS:
        config = STAND_IN
    elif str(config) in written:  # a config the page shows and has you write
        config = tmp_path / config
        config.write_text(written[args.config])
        monkeypatch.chdir(tmp_path)
    elif not (ROOT / config).is_file():
        pytest.fail(
            f"{command}: {config} is neither a file of this repository, one the page writes (a toml block "
            f"starting with '# {config.name}'), nor a placeholder ({sorted(PLACEHOLDERS)})"
        )
    else:
        config = ROOT / config
    parts = config.relative_to(ROOT).parts if config.is_relative_to(ROOT) else ()
    if parts[:2] == ("examples", "plugins"):
        example_plugin(parts[2])
    if command.page in PAGE_PLUGINS:
        example_plugin(PAGE_PLUGINS[command.page])
    page_plugins(command.page)
    validation = validate_config(config, sets)
    assert validation.problems == [], f"{command}: {validation.problems}"


def page_configs(page: str) -> dict[str, str]:
    """The configs a page has you write: its toml blocks whose first line is ``# NAME.toml``."""
    found = {}
    for _, body in blocks(page, "toml"):
        match = re.match(r"# (\S+\.toml)\b", body)
        if match:
            found[match.group(1)] = body
    return found


def with_shell_values(text: str) -> str:
    for name, value in SHELL_VALUES.items():
        text = text.replace(name, value)
    assert "$" not in text, f"{text}: a shell variable SHELL_VALUES does not give"
    return text


def output_dir(command: Command, argv: list[str]) -> str | None:
    """Where a train command writes (None: a placeholder config without --output-dir)."""
    args = build_parser().parse_args(argv)
    if args.output_dir is not None:
        return str(args.output_dir)
    if Path(args.config).name in PLACEHOLDERS:
        return None
    written = page_configs(command.page)
    if args.config in written:
        return tomllib.loads(written[args.config])["trainer"]["output_dir"]
    return validate_config(
        ROOT / args.config, [with_shell_values(s) for s in args.sets]
    ).parsed.config.trainer.output_dir


def test_no_train_command_lands_in_a_folder_an_earlier_one_filled():
    """Run in the order shown (README first), a train command into a folder an earlier, different command trained in
    is refused ("already holds a run"): each needs its own --output-dir, or --resume / --overwrite."""
    first: dict[str, Command] = {}
    clashes = []
    seen: set[tuple[str, ...]] = set()
    for command, argv in VLMREG:
        if argv[:1] != ["train"] or "--resume" in argv or "--overwrite" in argv:
            continue
        if command.page.startswith(("examples/plugins/", "plugins/")) or "torchrun" in command.words:
            continue  # a plugin's README is read on its own; torchrun runs need GPUs and name their own folders
        key = tuple(argv)
        folder = output_dir(command, argv)
        if folder is None or key in seen:  # the same command shown twice is one run
            continue
        seen.add(key)
        if folder in first:
            clashes.append(f"{command} writes to {folder}, as {first[folder]} did")
        first.setdefault(folder, command)
    assert not clashes, "\n".join(clashes)


def declared_packages() -> tuple[set[str], set[str]]:
    """The extras and the package names pyproject.toml declares (dependencies and extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    names = {
        re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower()
        for spec in [*project["dependencies"], *sum(extras.values(), [])]
    }
    return set(extras), names


def repo_path(word: str) -> Path | None:
    """``word`` as a path of this repository, when its first part is one (else it is made by an earlier command)."""
    first = Path(word).parts[0] if word not in (".", "./") else "."
    return ROOT / word if first != "." and (ROOT / first).exists() or word.startswith("./") else None


@pytest.mark.parametrize("command", OTHERS, ids=[f"{c.page}:{c.line}" for c in OTHERS])
def test_every_other_command_names_what_exists(command):
    words = list(command.words)
    program = Path(words[0]).name
    if program == "srun" and "python" in words:  # srun [its options] python SCRIPT ...: check the script
        words = words[words.index("python") :]
        program = "python"
    if program.startswith("python") and words[1:3] == ["-m", "pip"]:  # python -m pip ...: checked as pip
        words, program = ["pip", *words[3:]], "pip"
    if program in OTHER_PROGRAMS or words[0] == "torchrun":
        return
    if program == "setup.sh":
        assert (ROOT / "scripts" / "setup.sh").is_file() and words[0] in ("./scripts/setup.sh", "scripts/setup.sh"), (
            str(command)
        )
        return
    if program == "format.sh":
        assert (ROOT / "scripts" / "format.sh").is_file() and words[0] in (
            "./scripts/format.sh",
            "scripts/format.sh",
        ), str(command)
        return
    if program.startswith("python") and words[1:2] == ["-m"] and words[2:3] in (["ruff"], ["mypy"]):
        assert words[2] in declared_packages()[1], f"{command}: {words[2]} is not pinned in pyproject.toml"
        for word in [w for w in words[3:] if not w.startswith("-") and w not in ("check", "format")]:
            assert list(ROOT.glob(word)), f"{command}: {word} matches nothing here"
        return
    if program == "pip" and words[1] == "uninstall":  # what an earlier `pip install FOLDER` of the page installed
        installed = {
            Path(w).name
            for c in OTHERS
            if c.page == command.page and c.line < command.line and c.words[:2] == ("pip", "install")
            for w in c.words[2:]
        }
        for word in [w for w in words[2:] if not w.startswith("-")]:
            assert word in installed, f"{command}: {word} is installed by no earlier command of the page"
        return
    if program == "pip":
        extras, names = declared_packages()
        for at, word in enumerate(words[2:], start=2):
            if word.startswith("-"):
                continue
            match = re.fullmatch(r"vlmreg\[(.+)\]", word)
            if words[at - 1] == "-e" or "/" in word or word.startswith("."):
                path = repo_path(word)
                assert path is None or (path / "pyproject.toml").is_file(), (
                    f"{command}: {word} is no installable folder here"
                )
            elif match:
                assert set(match.group(1).split(",")) <= extras, f"{command}: no such extra"
            else:
                assert word.lower() in names, (
                    f"{command}: {word} is not declared in pyproject.toml (pin it in an extra)"
                )
        return
    if program in ("pytest",) or words[:3] == [words[0], "-m", "pytest"]:
        for word in [w for w in words[1:] if not w.startswith("-") and w not in ("-m", "pytest")]:
            path = repo_path(word)
            assert path is None or path.exists(), f"{command}: {word} does not exist"
        return
    if program.startswith("python"):
        if words[1:2] == ["-c"]:
            return
        path = repo_path(words[1])
        assert path is not None and path.is_file(), f"{command}: {words[1]} does not exist"
        return
    pytest.fail(f"{command}: a program this test does not know; check it here or add it to OTHER_PROGRAMS")


def toml_blocks() -> list[tuple[str, int, str]]:
    out = []
    for page in [p for p in PAGES if p.startswith("docs/")]:
        for line, body in blocks(page, "toml"):
            if set(tomllib.loads(body)) & RUN_SECTIONS:
                out.append((page, line, body))
    return out


def without_sections(text: str, names: set[str]) -> str:
    """A TOML file's text without the tables ``names`` (and their sub-tables)."""
    kept, keep = [], True
    for line in text.splitlines():
        header = re.match(r"^\[+([^\]]+)\]+", line)
        if header:
            keep = header.group(1).strip().split(".")[0] not in names
        if keep:
            kept.append(line)
    return "\n".join(kept) + "\n"


@pytest.mark.parametrize(("page", "line", "body"), toml_blocks(), ids=[f"{p}:{n}" for p, n, _ in toml_blocks()])
def test_every_config_block_in_the_docs_validates(
    page, line, body, tmp_path, monkeypatch, page_plugins, example_plugin
):
    """The block, with the tiny config's other sections, in a folder holding the files and folders it names."""
    document = tomllib.loads(body)
    for section in ("data", "eval"):
        table = document.get(section, {})
        for key in ("paths", "image_roots"):
            for name in table.get(key, []):
                target = tmp_path / name.lstrip("/")
                if name.startswith("/"):  # an absolute folder of the reader's machine: one here instead
                    body = body.replace(f'"{name}"', f'"{target}"')
                if key == "paths":
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.touch()
                else:
                    target.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "run.toml"
    config.write_text(without_sections(STAND_IN.read_text(), set(document)) + "\n" + body)
    monkeypatch.chdir(tmp_path)
    page_plugins(page)
    if page in PAGE_PLUGINS:
        example_plugin(PAGE_PLUGINS[page])
    validation = validate_config(config)
    assert validation.problems == [], f"{page}:{line}: {validation.problems}"
