"""Re-run the classes of hostile cases of issue 11 through the real CLI, and classify every outcome.

Each case runs ``vlmreg ...`` in a subprocess (or, for the server, sends one raw HTTP request to a ``vlmreg serve``
subprocess) with a timeout, and ends in one of:

- **clear error**: the refusal that was due: exit status != 0 (or the HTTP status expected), no traceback, and the
  message names what the case says it must (the file, the key, the record, the flag);
- **correct success**: exit 0 where success was due, with what the case checks (a file written, valid JSON, ...);
- **unhandled**: a traceback, ``unexpected ... please report it``, an HTTP 500, or a connection dropped where an
  answer was owed;
- **hang**: the case's timeout passed;
- **silent acceptance**: exit 0 (or HTTP 2xx) where an error was due;
- **unclear error**: refused, but the message does not name what it must (or the exit status is not the one due);
- **wrong refusal**: an error where success was due;
- **damage**: refused, but the case's check found something changed or applied that must not have been.

Only the first two are good. The table of totals is printed at the end, then each case that was not good; the
exit status is 1 when any case was not good. Runs in a few minutes on 2 cores with the tiny random model:

    .venv/bin/python benchmarks/reliability_corpus.py            # all cases, 2 at a time
    .venv/bin/python benchmarks/reliability_corpus.py --only serve --jobs 1 -v
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLMREG = str(Path(sys.executable).with_name("vlmreg"))
TINY = ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml"
GOOD = ("clear error", "correct success")
OUTCOMES = (*GOOD, "unhandled", "hang", "silent acceptance", "unclear error", "wrong refusal", "damage")
UNHANDLED = re.compile(r"Traceback \(most recent call last\)|please report|error: unexpected [A-Z]\w*|MarkupError")
# One small training setup: 1-2 steps of 2 prompts x 2 samples, no eval, no warm-up.
FAST = [
    "--set",
    "trainer.format_warmup_steps=0",
    "--set",
    "trainer.prompts_per_step=2",
    "--set",
    "rollout.group_size=2",
    "--set",
    "eval.every=0",
    "--set",
    "logging.rollout_page_every=0",
]
HTTP_TIMEOUT_S = 2.0  # the image fetch deadline the HTTP cases configure
SERVE_READ_TIMEOUT_S = 2.0


@dataclass
class Result:
    rc: int | None  # exit status; for HTTP cases the status code (None: closed without an answer)
    out: str = ""
    err: str = ""
    seconds: float = 0.0
    timed_out: bool = False


@dataclass
class Case:
    area: str
    name: str
    expect: str  # "error" or "success"
    argv: list[str] = field(default_factory=list)  # after `vlmreg`
    names: tuple[str, ...] = ()  # what the output must contain (an error: what it must name)
    exit_code: int | None = None  # an error's exact exit status, where one is due (2: usage)
    timeout: float = 60.0
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    check: Callable[[Result], str | None] | None = None  # extra: a problem, or None
    run: Callable[[Case], Result] | None = None  # instead of running argv (the HTTP cases)
    outcome: str = ""
    detail: str = ""
    seconds: float = 0.0


# -- running and judging ----------------------------------------------------------------------------------------
def run_cli(case: Case) -> Result:
    env = {**os.environ, "VLMREG_PLUGINS": "qwen3_vl", "HF_HUB_OFFLINE": "1", "COLUMNS": "200", **case.env}
    env.pop("VLMREG_DEBUG", None)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [VLMREG, *case.argv],
            cwd=case.cwd,
            env=env,
            capture_output=True,
            timeout=case.timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        return Result(None, _text(exc.stdout), _text(exc.stderr), time.monotonic() - started, timed_out=True)
    return Result(done.returncode, _text(done.stdout), _text(done.stderr), time.monotonic() - started)


def _text(data: bytes | str | None) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")


def judge(case: Case, r: Result) -> tuple[str, str]:
    text = r.out + "\n" + r.err
    flat = " ".join(text.split())
    if r.timed_out:
        return "hang", f"no end after {case.timeout:g} s"
    if UNHANDLED.search(text) or (case.run is not None and r.rc == 500):
        line = next((x for x in text.splitlines() if UNHANDLED.search(x)), text.strip()[-300:])
        return "unhandled", line[:300]
    missing = [n for n in case.names if n not in text and n not in flat]
    if case.expect == "error":
        if r.rc == 0 or (case.run is not None and r.rc is not None and 200 <= r.rc < 300):
            return "silent acceptance", f"status {r.rc}: {flat[-200:]}"
        if case.exit_code is not None and r.rc != case.exit_code:
            return "unclear error", f"status {r.rc}, {case.exit_code} was due: {flat[-200:]}"
        if missing:
            return "unclear error", f"does not name {missing}: {flat[-300:]}"
        problem = case.check(r) if case.check else None
        return ("damage", problem) if problem else ("clear error", flat[-160:])
    if r.rc != 0:
        return "wrong refusal", f"status {r.rc}: {flat[-300:]}"
    problem = case.check(r) if case.check else None
    if missing or problem:
        return "wrong refusal", problem or f"output lacks {missing}: {flat[-200:]}"
    return "correct success", flat[-160:]


def execute(case: Case, verbose: bool) -> Case:
    try:
        r = case.run(case) if case.run is not None else run_cli(case)
        case.outcome, case.detail, case.seconds = *judge(case, r), r.seconds
    except Exception as exc:  # the harness itself failed: counted, never hidden
        case.outcome, case.detail = "unhandled", f"corpus harness: {type(exc).__name__}: {exc}"
    if verbose:
        print(f"  {case.outcome:<17} {case.seconds:5.1f} s  {case.area} / {case.name}: {case.detail[:160]}", flush=True)
    return case


# -- files the cases read ---------------------------------------------------------------------------------------
def png(width: int = 8, height: int = 8, rgb: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    """A real PNG, written by hand (no Pillow needed to build the corpus)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def bomb_png() -> bytes:
    """A PNG header claiming 100000 x 100000 pixels, with almost no data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
        + chunk(b"IEND", b"")
    )


def record(*images: str, text: str = "What colour is it?") -> str:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images] + [{"type": "text", "text": text}]
    return json.dumps({"messages": [{"role": "user", "content": parts}], "answer": "Red"})


DATA_CONFIG = """[model]
init = "random"
family = "qwen3_vl"
size = "tiny"

[trainer]
device = "cpu"

[data]
paths = ["{data}"]
{extra}

[reward]
functions = {{ exact_match = 1.0 }}
"""


class Workspace:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.n = 0

    def folder(self, name: str) -> Path:
        self.n += 1
        path = self.root / f"{self.n:03d}-{re.sub(r'[^a-z0-9]+', '-', name.lower())[:40]}"
        path.mkdir(parents=True)
        return path

    def dataset(
        self,
        name: str,
        lines: list[str] | bytes,
        extra: str = "",
        files: dict[str, bytes] | None = None,
        data_name: str = "d.jsonl",
    ) -> Path:
        """A folder with a dataset file, its images and a config naming it; returns the config."""
        folder = self.folder(name)
        for rel, data in (files or {}).items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
        body = lines if isinstance(lines, bytes) else ("\n".join(lines) + "\n").encode()
        (folder / data_name).write_bytes(body)
        config = folder / "c.toml"
        config.write_text(DATA_CONFIG.format(data=data_name, extra=extra))
        return config

    def config(self, name: str, text: str | bytes, filename: str = "c.toml") -> Path:
        path = self.folder(name) / filename  # "[/x].toml": a folder "[" holding "x].toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path


def tiny_with(*lines: str) -> str:
    """The tiny example config with lines appended to its sections (``[section] key = value``)."""
    text = TINY.read_text()
    for line in lines:
        section, assignment = line.split("] ", 1)
        header = f"{section}]\n"
        text = (
            text.replace(header, header + assignment + "\n", 1)
            if header in text
            else text + f"\n{header}{assignment}\n"
        )
    return text


# -- an HTTP image server with hostile routes -------------------------------------------------------------------
class ImageServer:
    """``/ok.png``; ``/to?u=URL`` (302 there); ``/drip-headers``, ``/drip-body``, ``/silent``, ``/huge``, ``/404``."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    self._answer(self.path)
                except OSError:  # the client gave up (what the deadline cases want): nothing to report
                    pass

            def _answer(self, path: str) -> None:
                if path.startswith("/to?u="):
                    self.send_response(302)
                    self.send_header("Location", urllib.parse.unquote(path[len("/to?u=") :]))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif path == "/ok.png":
                    self._image(png())
                elif path == "/drip-headers":
                    for byte in b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nX-Pad: " + b"a" * 3000:  # 300 s
                        if outer.stop.wait(0.1):
                            return
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                elif path == "/drip-body":
                    data = png()
                    self.wfile.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: %d\r\n\r\n" % len(data)
                    )
                    for i in range(len(data)):
                        if outer.stop.wait(0.1):
                            return
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                elif path == "/silent":
                    outer.stop.wait(60)
                elif path == "/huge":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(10**10))
                    self.end_headers()
                    self.wfile.write(b"\x89PNG" + b"\0" * 65536)
                else:
                    self.send_error(404)

            def _image(self, data: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(2)]
        for server in self.servers:
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

    def url(self, path: str, which: int = 0, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.servers[which].server_address[1]}{path}"

    def redirect(self, target: str) -> str:
        return self.url("/to?u=" + urllib.parse.quote(target, safe=""))

    def close(self) -> None:
        self.stop.set()
        for server in self.servers:
            server.shutdown()
            server.server_close()


# -- the cases, by area -----------------------------------------------------------------------------------------
def config_cases(ws: Workspace) -> list[Case]:
    def validate(
        name: str,
        text: str | bytes,
        names: tuple[str, ...],
        filename: str = "c.toml",
        expect: str = "error",
        extra: list[str] | None = None,
        exit_code: int | None = None,
    ) -> Case:
        path = ws.config(name, text, filename)
        return Case("config", name, expect, ["validate", str(path), *(extra or [])], names=names, exit_code=exit_code)

    nested = "a = " + "[" * 5000 + "]" * 5000 + "\n"
    return [
        validate("invalid TOML", "[model\ninit = 'random'\n", ("c.toml", "line 1")),
        validate("not UTF-8", b'[model]\ninit = "random"\n# \xff\xfe\n', ("c.toml", "not UTF-8", "line 3")),
        validate("deeply nested TOML", nested, ("c.toml",)),
        validate("empty file", "", ("model",)),
        Case(
            "config",
            "config file missing",
            "error",
            ["validate", str(ws.root / "nowhere.toml")],
            names=("nowhere.toml",),
        ),
        Case("config", "config is a directory", "error", ["validate", str(ws.folder("a-dir"))], names=("a-dir",)),
        validate("file named [/x].toml, invalid", "[model\n", ("[/x].toml",), filename="[/x].toml"),
        validate(
            "file named [bold]c[/bold].toml, valid",
            TINY.read_text(),
            ("[bold]c[/bold].toml",),
            filename="[bold]c[/bold].toml",
            expect="success",
        ),
        validate(
            "learning_rate = inf",
            tiny_with("[trainer] learning_rate = inf").replace("learning_rate = 3e-3\n", ""),
            ("trainer.learning_rate", "finite"),
        ),
        validate(
            "temperature = nan",
            tiny_with("[rollout] temperature = nan").replace("temperature = 1.0\n", ""),
            ("rollout.temperature", "finite"),
        ),
        validate("seed = 2**70", tiny_with("[trainer] seed = 1180591620717411303424"), ("trainer.seed",)),
        validate("seed = -1", tiny_with("[trainer] seed = -1"), ("trainer.seed",)),
        validate("seed = 1.5", tiny_with("[trainer] seed = 1.5"), ("trainer.seed",)),
        validate("http_timeout_s = inf", tiny_with("[data] http_timeout_s = inf"), ("data.http_timeout_s", "finite")),
        validate("http_timeout_s = 0", tiny_with("[data] http_timeout_s = 0"), ("data.http_timeout_s",)),
        validate(
            "http_redirect_hosts with a URL",
            tiny_with('[data] http_redirect_hosts = ["http://cdn.example.com"]'),
            ("data.http_redirect_hosts", "item [0]"),
        ),
        validate("max_image_pixels = -1", tiny_with("[data] max_image_pixels = -1"), ("data.max_image_pixels",)),
        validate("steps = 0", TINY.read_text().replace("steps = 100", "steps = 0"), ("trainer.steps",)),
        validate("a misspelt key", tiny_with("[trainer] learning_rat = 0.1"), ("learning_rat", "learning_rate")),
        validate("an unknown section", TINY.read_text() + "\n[trainr]\nsteps = 1\n", ("trainr",)),
        validate(
            "paths without [reward]",
            DATA_CONFIG.format(data="d.jsonl", extra="").split("[reward]")[0],
            ("reward.functions",),
        ),
        validate("an unknown task", TINY.read_text().replace('task = "colour"', 'task = "colur"'), ("colur", "colour")),
        validate(
            "--set learning_rate=inf",
            TINY.read_text(),
            ("trainer.learning_rate",),
            extra=["--set", "trainer.learning_rate=inf"],
        ),
        validate(
            "--set without '='",
            TINY.read_text(),
            ("--set", "trainer.steps", "key.path=value"),
            extra=["--set", "trainer.steps"],
        ),
        validate("--set an unknown key", TINY.read_text(), ("nosuch",), extra=["--set", "trainer.nosuch=1"]),
        validate(
            "a value of the wrong type", TINY.read_text().replace("steps = 100", 'steps = "many"'), ("trainer.steps",)
        ),
    ]


def data_cases(ws: Workspace) -> list[Case]:
    def preview(name: str, config: Path, names: tuple[str, ...], expect: str = "error", check=None) -> Case:
        return Case(
            "data files and images",
            name,
            expect,
            ["data", "preview", str(config), "--n", "2"],
            names=names,
            cwd=config.parent,
            check=check,
            timeout=90,
        )

    ok = {"red.png": png()}
    outside = ws.folder("outside")
    (outside / "secret.png").write_bytes(png())
    linked = ws.dataset("symlink outside", [record("link.png")])
    (linked.parent / "link.png").symlink_to(outside / "secret.png")
    fifo = ws.dataset("a FIFO as image", [record("pipe.png")])
    os.mkfifo(fifo.parent / "pipe.png")
    missing = ws.folder("data file missing") / "c.toml"
    missing.write_text(DATA_CONFIG.format(data="nowhere.jsonl", extra=""))
    as_dir = ws.dataset("data path is a folder", [record("red.png")], files=ok)
    (as_dir.parent / "sub.jsonl").mkdir()
    as_dir.write_text(DATA_CONFIG.format(data="sub.jsonl", extra=""))
    return [
        preview(
            "a good dataset (control)",
            ws.dataset("good", [record("red.png")], files=ok),
            ("1 examples",),
            expect="success",
        ),
        preview("data file missing", missing, ("nowhere.jsonl",)),
        preview("data path is a folder", as_dir, ("sub.jsonl",)),
        preview("garbage bytes in the JSONL", ws.dataset("garbage jsonl", b"\x00\xff\x10garbage\n"), ("d.jsonl:1",)),
        preview(
            "a partial last line",
            ws.dataset("partial line", [record("red.png"), record("red.png")[:40]], files=ok),
            ("d.jsonl:2",),
        ),
        preview("an empty dataset", ws.dataset("empty", b""), ("d.jsonl",)),
        preview("a record that is a list", ws.dataset("list record", ["[1, 2]"]), ("d.jsonl:1",)),
        preview(
            "a record without messages", ws.dataset("no messages", ['{"answer": "Red"}']), ("d.jsonl:1", "messages")
        ),
        preview(
            "garbage Parquet", ws.dataset("garbage parquet", b"PAR1 not really", data_name="d.parquet"), ("d.parquet",)
        ),
        preview("an image file missing", ws.dataset("image missing", [record("nope.png")]), ("d.jsonl:1", "nope.png")),
        preview(
            "image of garbage bytes",
            ws.dataset("garbage image", [record("bad.png")], files={"bad.png": b"\x89PNGjunkjunk"}),
            ("d.jsonl:1",),
        ),
        preview(
            "a truncated PNG",
            ws.dataset("truncated png", [record("cut.png")], files={"cut.png": png(64, 64)[:60]}),
            ("d.jsonl:1",),
        ),
        preview(
            "a decompression bomb",
            ws.dataset("bomb", [record("bomb.png")], files={"bomb.png": bomb_png()}),
            ("d.jsonl:1", "max_image_pixels"),
        ),
        preview(
            "image path ../ escaping",
            ws.dataset("dotdot", [record(f"../{outside.name}/secret.png")]),
            ("d.jsonl:1", "image_roots"),
        ),
        preview(
            "absolute path /etc/passwd", ws.dataset("etc passwd", [record("/etc/passwd")]), ("d.jsonl:1", "/etc/passwd")
        ),
        preview(
            "file:///etc/passwd", ws.dataset("file uri", [record("file:///etc/passwd")]), ("d.jsonl:1", "/etc/passwd")
        ),
        preview("a symlink pointing outside", linked, ("d.jsonl:1", "link.png")),
        preview("a FIFO as an image", fifo, ("d.jsonl:1", "pipe.png")),
        preview(
            "17 images in a message",
            ws.dataset("17 images", [record(*["red.png"] * 17)], files=ok),
            ("d.jsonl:1", "17", "16"),
        ),
        preview(
            "on_bad_image = skip",
            ws.dataset(
                "skip",
                [record("red.png"), record("bad.png")],
                'on_bad_image = "skip"',
                files={**ok, "bad.png": b"junk"},
            ),
            ("1 skipped",),
            expect="success",
        ),
        preview(
            "an image URL with allow_http off",
            ws.dataset("http off", [record("http://127.0.0.1:9/a.png")]),
            ("allow_http",),
        ),
    ]


def http_cases(ws: Workspace, images: ImageServer) -> list[Case]:
    extra = f"allow_http = true\nhttp_timeout_s = {HTTP_TIMEOUT_S}"

    def fetch(name: str, url: str, names: tuple[str, ...], expect: str = "error", more: str = "") -> Case:
        config = ws.dataset(name, [record(url)], extra + more)

        def in_time(r: Result) -> str | None:  # without a deadline the drips take 300 s (the case's timeout: a hang)
            return f"took {r.seconds:.1f} s" if r.seconds > 90 else None

        return Case(
            "HTTP images",
            name,
            expect,
            ["data", "preview", str(config), "--n", "1"],
            names=names,
            cwd=config.parent,
            timeout=120,
            check=in_time,
        )

    other = images.url("/ok.png", which=1)
    return [
        fetch("a good URL (control)", images.url("/ok.png"), ("1 examples",), expect="success"),
        fetch(
            "a redirect on the same host (control)",
            images.redirect(images.url("/ok.png")),
            ("1 examples",),
            expect="success",
        ),
        fetch(
            "headers dripped a byte at a time",
            images.url("/drip-headers"),
            ("d.jsonl:1", f"timed out after {HTTP_TIMEOUT_S:g} s"),
        ),
        fetch(
            "a body dripped a byte at a time",
            images.url("/drip-body"),
            ("d.jsonl:1", f"timed out after {HTTP_TIMEOUT_S:g} s"),
        ),
        fetch("a server that never answers", images.url("/silent"), ("d.jsonl:1", "timed out")),
        fetch("a redirect to another port", images.redirect(other), ("d.jsonl:1", "http_redirect_hosts")),
        fetch(
            "a redirect to another host name",
            images.redirect(images.url("/ok.png", 1, "localhost")),
            ("d.jsonl:1", "http_redirect_hosts"),
        ),
        fetch(
            "a redirect to an allowed host",
            images.redirect(other),
            ("1 examples",),
            expect="success",
            more=f'\nhttp_redirect_hosts = ["127.0.0.1:{images.servers[1].server_address[1]}"]',
        ),
        fetch("a redirect to file:///etc/passwd", images.redirect("file:///etc/passwd"), ("d.jsonl:1", "only http(s)")),
        fetch(
            "six redirects",
            images.redirect(
                images.redirect(
                    images.redirect(images.redirect(images.redirect(images.redirect(images.url("/ok.png")))))
                )
            ),
            ("d.jsonl:1", "more than 5 redirects"),
        ),
        fetch("HTTP 404", images.url("/missing.png"), ("d.jsonl:1", "404")),
        fetch("a body larger than max_image_bytes", images.url("/huge"), ("d.jsonl:1", "max_image_bytes")),
        fetch("an ftp:// URL", "ftp://127.0.0.1/a.png", ("d.jsonl:1", "ftp://")),
    ]


def plugin_cases(ws: Workspace) -> list[Case]:
    def plugin(
        name: str, dist: str, source: str, argv: list[str], expect: str, names: tuple[str, ...], check=None
    ) -> Case:
        site = ws.folder(name)
        module = dist.replace("-", "_") + "_mod"
        (site / f"{module}.py").write_text(source)
        info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[vlmreg]\n{dist.replace('-', '_')} = {module}\n")
        env = {"PYTHONPATH": str(site), "VLMREG_PLUGINS": f"qwen3_vl,{dist}"}
        return Case("plugins", name, expect, argv, names=names, env=env, check=check)

    def json_with_qwen(r: Result) -> str | None:
        try:
            names = {f["name"] for f in json.loads(r.out)}
        except ValueError as exc:
            return f"stdout is not JSON ({exc}): {r.out[:120]!r}"
        return None if "qwen3_vl" in names else f"qwen3_vl not listed: {names}"

    family = (
        "from vlmreg import FamilyDescriptor, hookimpl\n\ndef tiny_config():\n    raise "
        "NotImplementedError\n\n@hookimpl\ndef vlmreg_register_families(register):\n    "
        "register(FamilyDescriptor(name='acme', model_types=['acme_vl'], vision_encoder_attr='model.visual', "
        "language_model_attr='model.language_model', lm_head_attr='LM HEAD', tiny_config=tiny_config))\n"
    )
    task = (
        "from vlmreg import Task, hookimpl\n\n@hookimpl\ndef vlmreg_register_tasks(register):\n"
        "    register(Task(name='acme_task', generate=lambda n, seed, store: [], reward={'no_such_reward': 1.0}))\n"
    )
    return [
        plugin(
            "sys.exit(0) at import",
            "quitter-vlm",
            "import sys\nsys.exit(0)\n",
            ["families"],
            "error",
            ("quitter-vlm", "SystemExit"),
        ),
        plugin(
            "sys.exit(3) at import, --json",
            "quitter3-vlm",
            "import sys\nsys.exit(3)\n",
            ["families", "--json"],
            "error",
            ("quitter3-vlm",),
        ),
        plugin(
            "KeyboardInterrupt at import",
            "ctrlc-vlm",
            "raise KeyboardInterrupt\n",
            ["families"],
            "error",
            ("ctrlc-vlm",),
        ),
        plugin(
            "prints at import, families --json",
            "chatty-vlm",
            "print('hello from import')\n" + family.replace("LM HEAD", "lm_head"),
            ["families", "--json"],
            "success",
            (),
            check=json_with_qwen,
        ),
        plugin(
            "writes to fd 1 at import, families --json",
            "fd-vlm",
            "import os\nos.write(1, b'raw bytes on fd 1\\n')\n" + family.replace("LM HEAD", "lm_head"),
            ["families", "--json"],
            "success",
            (),
            check=json_with_qwen,
        ),
        plugin(
            "raises markup text at import",
            "markup-vlm",
            "raise RuntimeError('[/x] and [bold]b[/bold]')\n",
            ["families"],
            "error",
            ("markup-vlm", "[/x] and [bold]b[/bold]"),
        ),
        plugin(
            "raises markup text, vlmreg check",
            "markup2-vlm",
            "raise RuntimeError('[data] gone [/]')\n",
            ["check", "qwen3_vl"],
            "error",
            ("markup2-vlm", "[data] gone [/]"),
        ),
        plugin(
            "raises in its hook",
            "hook-vlm",
            "from vlmreg import hookimpl\n\n@hookimpl\ndef vlmreg_register_families(register):\n    {}['missing']\n",
            ["families"],
            "error",
            ("hook-vlm", "KeyError"),
        ),
        plugin(
            "a bad descriptor field", "badfield-vlm", family, ["families"], "error", ("badfield-vlm", "lm_head_attr")
        ),
        plugin(
            "a task naming an unknown reward",
            "task-vlm",
            task,
            ["data", "tasks"],
            "error",
            ("acme_task", "no_such_reward"),
        ),
        plugin(
            "a misspelt hook",
            "typo-vlm",
            "from vlmreg import hookimpl\n\n@hookimpl\ndef vlmreg_register_familes(register):\n    pass\n",
            ["families"],
            "error",
            ("typo-vlm", "vlmreg_register_families"),
        ),
        Case(
            "plugins",
            "VLMREG_PLUGINS naming nothing installed",
            "error",
            ["families"],
            names=("nosuch",),
            env={"VLMREG_PLUGINS": "qwen3_vl,nosuch"},
        ),
    ]


def train_cases(ws: Workspace) -> tuple[list[Case], list[Case]]:
    """Cases on a finished run; the first list makes that run (and must come first), the second uses copies of it."""
    base = ws.folder("finished run")
    run_dir = base / "run"
    setup = Case(
        "runs and checkpoints",
        "a 2-step run with a checkpoint per step (control)",
        "success",
        [
            "train",
            str(TINY),
            "--set",
            "trainer.steps=2",
            "--set",
            "trainer.save_every=1",
            *FAST,
            "--output-dir",
            str(run_dir),
        ],
        names=("done: step 2",),
        timeout=300,
        check=lambda r: (
            None
            if (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
            and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 2
            else "no step_000002 or metrics"
        ),
    )

    def copy(name: str, damage: Callable[[Path], None] | None = None) -> Path:
        target = ws.folder(name) / "run"
        if (run_dir / "checkpoints").is_dir():
            shutil.copytree(run_dir, target, ignore=shutil.ignore_patterns(".lock"))
            if damage is not None:
                damage(target)
        return target

    def later(
        name: str,
        expect: str,
        make_argv: Callable[[], list[str]],
        names: tuple[str, ...],
        check=None,
        exit_code: int | None = None,
    ) -> Case:
        case = Case(
            "runs and checkpoints", name, expect, [], names=names, timeout=300, check=check, exit_code=exit_code
        )

        def run(c: Case) -> Result:
            c.argv = make_argv()
            return run_cli(c)

        case.run = run
        return case

    def step(folder: Path, n: int) -> Path:
        return folder / "checkpoints" / f"step_{n:06d}"

    def truncate(path: Path) -> None:
        path.write_bytes(path.read_bytes()[:100])

    def resume(target_name: str, damage, steps: int = 2) -> list[str]:
        folder = copy(target_name, damage)
        return [
            "train",
            str(TINY),
            "--set",
            f"trainer.steps={steps}",
            "--set",
            "trainer.save_every=1",
            *FAST,
            "--output-dir",
            str(folder),
            "--resume",
        ]

    snapshot: dict[str, bytes] = {}

    def fresh_into_finished() -> list[str]:
        folder = copy("fresh run into a finished one")
        snapshot["metrics"] = (folder / "metrics.jsonl").read_bytes()
        snapshot["folder"] = str(folder).encode()
        return ["train", str(TINY), "--set", "trainer.steps=1", *FAST, "--output-dir", str(folder)]

    def untouched(r: Result) -> str | None:
        folder = Path(snapshot["folder"].decode())
        if (folder / "metrics.jsonl").read_bytes() != snapshot["metrics"]:
            return "metrics.jsonl changed"
        return None if step(folder, 1).is_dir() and step(folder, 2).is_dir() else "a checkpoint was removed"

    def eval_damaged(name: str, damage) -> list[str]:
        folder = copy(name, damage)
        return ["eval", str(TINY), "--set", "eval.num_samples=2", "--checkpoint", str(step(folder, 2)), "--json"]

    a_file = ws.folder("output under a file") / "a-file"
    a_file.write_text("not a folder")
    cases = [
        later(
            "a fresh run into a finished run",
            "error",
            fresh_into_finished,
            ("--resume", "--overwrite"),
            check=untouched,
        ),
        Case(
            "runs and checkpoints",
            "--resume with --overwrite",
            "error",
            ["train", str(TINY), "--resume", "--overwrite"],
            names=("--overwrite",),
            exit_code=2,
        ),
        Case(
            "runs and checkpoints",
            "an output path under a file",
            "error",
            ["train", str(TINY), "--set", "trainer.steps=1", *FAST, "--output-dir", str(a_file / "run")],
            names=("a-file",),
            timeout=120,
        ),
        Case(
            "runs and checkpoints",
            "trainer.seq_len = 8 drops every sample",
            "error",
            [
                "train",
                str(TINY),
                "--set",
                "trainer.steps=1",
                "--set",
                "trainer.seq_len=8",
                *FAST,
                "--output-dir",
                str(ws.folder("seq len 8") / "run"),
            ],
            names=("trainer.seq_len",),
            timeout=300,
        ),
        Case(
            "runs and checkpoints",
            "--resume with no checkpoint",
            "error",
            [
                "train",
                str(TINY),
                "--set",
                "trainer.steps=1",
                *FAST,
                "--output-dir",
                str(ws.folder("resume nothing")),
                "--resume",
            ],
            names=("checkpoint",),
            timeout=120,
        ),
        later(
            "eval of truncated weights",
            "error",
            lambda: eval_damaged("eval truncated", lambda f: truncate(step(f, 2) / "trainable.safetensors")),
            ("trainable.safetensors",),
        ),
        later(
            "eval of a garbage state.json",
            "error",
            lambda: eval_damaged("eval garbage state", lambda f: (step(f, 2) / "state.json").write_text("{garbage")),
            ("state.json",),
        ),
        Case(
            "runs and checkpoints",
            "eval of a checkpoint that does not exist",
            "error",
            ["eval", str(TINY), "--checkpoint", str(ws.root / "no" / "step_000009")],
            names=("step_000009",),
            timeout=120,
        ),
        later(
            "resume: latest has no optimizer file",
            "success",
            lambda: resume("no optimizer", lambda f: (step(f, 2) / "optimizer.safetensors").unlink()),
            ("skipped checkpoint step_000002", "optimizer"),
        ),
        later(
            "resume: latest names a path outside the run",
            "success",
            lambda: resume("latest outside", lambda f: (f / "checkpoints" / "latest").write_text("/etc\n")),
            ("latest",),
        ),
        later(
            "resume: every checkpoint damaged",
            "error",
            lambda: resume("all damaged", lambda f: [truncate(step(f, n) / "trainable.safetensors") for n in (1, 2)]),
            ("step_000001", "step_000002", "trainable.safetensors"),
        ),
        later(
            "resume: a partial last metrics line",
            "success",
            lambda: resume("partial metrics", lambda f: (f / "metrics.jsonl").open("a").write('{"step": 3, "rew')),
            ("metrics.jsonl",),
        ),
    ]
    return [setup], cases


class Served:
    """A `vlmreg serve` subprocess of the tiny model, started on first use."""

    def __init__(self, ws: Workspace) -> None:
        self.ws, self.proc, self.port, self.lock, self.log = ws, None, 0, threading.Lock(), None

    def ensure(self) -> int:
        with self.lock:
            if self.proc is None:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", 0))
                    self.port = probe.getsockname()[1]
                self.log = (self.ws.folder("serve") / "serve.log").open("wb")
                env = {**os.environ, "VLMREG_PLUGINS": "qwen3_vl", "HF_HUB_OFFLINE": "1"}
                self.proc = subprocess.Popen(
                    [VLMREG, "serve", str(TINY), "--port", str(self.port), "--read-timeout", str(SERVE_READ_TIMEOUT_S)],
                    stdout=self.log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
                deadline = time.monotonic() + 240
                while time.monotonic() < deadline:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"vlmreg serve exited with {self.proc.returncode}")
                    status, _ = raw_request(
                        self.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 5
                    )
                    if status == 200:
                        break
                    time.sleep(0.5)
            return self.port

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def raw_request(
    port: int, data: bytes, timeout: float, then: Callable[[socket.socket], None] | None = None
) -> tuple[int | None, str]:
    """Send ``data``; the status and body of the answer, or (None, why) when the connection ended without one."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(data)
            if then is not None:
                then(sock)
            answer = b""
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
    except ConnectionRefusedError:
        return None, "refused"
    except ConnectionResetError:
        return None, "reset"
    except TimeoutError:
        raise
    if not answer:
        return None, "closed without an answer"
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode("utf-8", "replace")


def serve_cases(ws: Workspace) -> list[Case]:
    served = Served(ws)
    config = str(TINY)
    chat = {"model": "qwen3_vl-tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    def post(body: bytes, path: str = "/v1/chat/completions", headers: str = "") -> bytes:
        return (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    def http(
        name: str,
        data: bytes | Callable[[], bytes],
        expect_status: int | None,
        names: tuple[str, ...] = (),
        then: Callable[[socket.socket], None] | None = None,
        within: float = 30.0,
    ) -> Case:
        """``expect_status`` None: the server must end the connection (dropped, or an error status) within ``within``
        s."""

        def run(case: Case) -> Result:
            port = served.ensure()
            started = time.monotonic()
            try:
                status, body = raw_request(port, data() if callable(data) else data, within, then)
            except TimeoutError:
                return Result(None, "", "", time.monotonic() - started, timed_out=True)
            seconds = time.monotonic() - started
            if expect_status is None:  # a drop is the refusal due here (an error status would do too)
                return Result(1 if status is None else status, body, "", seconds)
            if status is None:
                return Result(500, "", f"connection {body}: an answer was owed", seconds)  # counted as unhandled
            return Result(0 if status == 200 else status, body, "", seconds)

        expect = "success" if expect_status == 200 else "error"
        exit_code = expect_status if expect_status not in (None, 200) else None  # another status: an unclear error
        return Case("serve", name, expect, names=names, timeout=within, run=run, exit_code=exit_code)

    def stall(sock: socket.socket) -> None:
        pass  # send the head and part of the body, then nothing

    def drip(sock: socket.socket) -> None:
        def go() -> None:
            try:
                for _ in range(2000):
                    time.sleep(SERVE_READ_TIMEOUT_S / 4)
                    sock.sendall(b" ")
            except OSError:
                pass

        threading.Thread(target=go, daemon=True).start()

    def alive(case: Case) -> Result:
        port = served.ensure()
        status, body = raw_request(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 10)
        log = served.output()
        served.close()
        return Result(0 if status == 200 else 1, body, log)

    usage_dir = ws.folder("serve usage")
    open_key = usage_dir / "key-open"
    open_key.write_text("sk-0123456789abcdef0123\n")
    open_key.chmod(0o644)
    cases = [
        Case("serve", "--port 70000", "error", ["serve", config, "--port", "70000"], names=("70000",), exit_code=2),
        Case(
            "serve",
            "--max-connections 0",
            "error",
            ["serve", config, "--max-connections", "0"],
            names=("--max-connections",),
            exit_code=2,
        ),
        Case(
            "serve",
            "--read-timeout inf",
            "error",
            ["serve", config, "--read-timeout", "inf"],
            names=("--read-timeout",),
            exit_code=2,
        ),
        Case(
            "serve",
            "--weights-timeout nan",
            "error",
            ["serve", config, "--weights-from", "127.0.0.1:9", "--weights-timeout", "nan"],
            names=("--weights-timeout",),
            exit_code=2,
        ),
        Case(
            "serve",
            "--weights-rank -3",
            "error",
            ["serve", config, "--weights-from", "127.0.0.1:9", "--weights-rank", "-3"],
            names=("--weights-rank",),
            exit_code=2,
        ),
        Case(
            "serve",
            "--weights-from without a port",
            "error",
            ["serve", config, "--weights-from", "127.0.0.1"],
            names=("--weights-from",),
            exit_code=2,
        ),
        Case(
            "serve",
            "--host 0.0.0.0 without a key",
            "error",
            ["serve", config, "--host", "0.0.0.0"],
            names=("0.0.0.0", "key"),
        ),
        Case(
            "serve",
            "a key file readable by others",
            "error",
            ["serve", config, "--api-key-file", str(open_key)],
            names=("key-open", "chmod"),
        ),
        Case(
            "serve",
            "a key file that does not exist",
            "error",
            ["serve", config, "--api-key-file", str(usage_dir / "nokey")],
            names=("nokey",),
        ),
        http("a chat request (control)", post(json.dumps(chat).encode()), 200, ("chat.completion",), within=120),
        http("a body that is not JSON", post(b"{not json"), 400, ("not valid JSON",)),
        http("a body that is not UTF-8", post(b'{"model": "\xff\xfe"}'), 400, ("JSON",)),
        http("JSON nested 100000 deep", post(b"[" * 100_000 + b"]" * 100_000), 400, ("JSON",)),
        http("messages missing", post(json.dumps({"model": chat["model"]}).encode()), 400, ("messages",)),
        http("max_tokens = -1", post(json.dumps({**chat, "max_tokens": -1}).encode()), 400, ("max_tokens",)),
        http(
            "temperature = NaN", post(json.dumps({**chat, "temperature": float("nan")}).encode()), 400, ("temperature",)
        ),
        http("temperature = 1e-300", post(json.dumps({**chat, "temperature": 1e-300}).encode()), 400, ("temperature",)),
        http("seed = 2**70", post(json.dumps({**chat, "seed": 2**70}).encode()), 400, ("seed",)),
        http(
            "a stop token id of 10**12",
            post(json.dumps({**chat, "stop_token_ids": [10**12]}).encode()),
            400,
            ("stop_token_ids",),
        ),
        http("a client that connects and sends nothing", b"", None, then=stall, within=15),
        http(
            "an image that is not an image",
            post(
                json.dumps(
                    {
                        **chat,
                        "messages": [
                            {
                                "role": "user",
                                "content": [
                                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAAAAAA"}}
                                ],
                            }
                        ],
                    }
                ).encode()
            ),
            400,
            ("image",),
        ),
        http(
            "an image URL naming a local file",
            post(
                json.dumps(
                    {
                        **chat,
                        "messages": [
                            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}
                        ],
                    }
                ).encode()
            ),
            400,
            ("image",),
        ),
        http(
            "a Content-Length of 300 MB",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 300000000\r\n\r\n{",
            413,
            ("more than",),
            within=SERVE_READ_TIMEOUT_S,
        ),
        http(
            "101 headers",
            b"GET /health HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n",
            431,
        ),
        http("a 70 kB header line", b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        http("a 70 kB request line", b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
        http(
            "a chunked body",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n",
            411,
        ),
        http("no Content-Length", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 411),
        http(
            "a client that stalls mid-body",
            b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{"m',
            None,
            then=stall,
            within=SERVE_READ_TIMEOUT_S + 5,
        ),
        http(
            "a client that drips its body",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n",
            None,
            then=drip,
            within=SERVE_READ_TIMEOUT_S + 5,
        ),
        http(
            "a client that drips its headers",
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ",
            None,
            then=drip,
            within=SERVE_READ_TIMEOUT_S + 5,
        ),
        http(
            "POST /v1/weights on a server without a key",
            post(json.dumps({"path": "/etc"}).encode(), "/v1/weights"),
            403,
            ("weights",),
        ),
        http(
            "an unknown route",
            b"GET /v1/../../etc/passwd HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            404,
            ("no route",),
        ),
        http("a wrong method", b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 501, ()),
        http(
            "an unknown model",
            b"GET /v1/models/[bold]x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            404,
            ("[bold]x",),
        ),
    ]
    cases.append(Case("serve", "after all that: /health answers and the log has no traceback", "success", run=alive))
    return cases


# -- main ----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    parser.add_argument(
        "--only", default="", help="run only cases whose area or name contains one of these (comma-separated) texts"
    )
    parser.add_argument("--json", type=Path, help="also write every case and its outcome to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each case as it ends")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (printed)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="vlmreg-corpus-"))
    ws, images = Workspace(root), ImageServer()
    try:
        first, runs = train_cases(ws)
        serve = serve_cases(ws)
        parallel = config_cases(ws) + data_cases(ws) + http_cases(ws, images) + plugin_cases(ws)
        patterns = [part.strip().lower() for part in args.only.split(",")]
        selected = lambda cases: [c for c in cases if any(p in f"{c.area} / {c.name}".lower() for p in patterns)]  # noqa: E731
        first, runs, serve, parallel = selected(first), selected(runs), selected(serve), selected(parallel)
        if runs and not first:  # the run cases copy the finished run: make it even when not selected
            first = train_cases(Workspace(root / "base"))[0]
        every = first + runs + serve + parallel
        print(f"{len(every)} cases, {args.jobs} at a time (work folder {root})", flush=True)
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            # the finished run and the server first (the slow ones), the quick CLI cases beside them
            base = [pool.submit(execute, case, args.verbose) for case in first]
            quick = [pool.submit(execute, case, args.verbose) for case in parallel]
            for f in base:
                f.result()
            later = [pool.submit(execute, case, args.verbose) for case in runs]
            for case in serve[:-1]:  # serve cases one after another: they share one server
                execute(case, args.verbose)
            if serve:
                execute(serve[-1], args.verbose)
            for f in quick + later:
                f.result()
    finally:
        images.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return report(every, time.monotonic() - started, args.json)


def report(cases: list[Case], seconds: float, json_path: Path | None) -> int:
    areas = list(dict.fromkeys(c.area for c in cases))
    counts = {(a, o): sum(1 for c in cases if c.area == a and c.outcome == o) for a in areas for o in OUTCOMES}
    width = max(len(a) for a in [*areas, "all"]) + 2
    print(f"\n{'area':<{width}}" + "".join(f"{o:>19}" for o in OUTCOMES) + f"{'cases':>8}")
    for area in [*areas, "all"]:
        row = [sum(counts[(a, o)] for a in areas) if area == "all" else counts[(area, o)] for o in OUTCOMES]
        print(f"{area:<{width}}" + "".join(f"{n:>19}" for n in row) + f"{sum(row):>8}")
    bad = [c for c in cases if c.outcome not in GOOD]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # every vlmreg process run, the server included
    print(
        f"\n{len(cases)} cases in {seconds:.0f} s ({children.ru_utime + children.ru_stime:.0f} s of CPU in vlmreg "
        f"processes): {len(cases) - len(bad)} good, {len(bad)} not"
    )
    for case in bad:
        print(f"- {case.outcome}: {case.area} / {case.name}: {case.detail}")
    if json_path is not None:
        json_path.write_text(
            json.dumps(
                [
                    {
                        "area": c.area,
                        "name": c.name,
                        "expect": c.expect,
                        "outcome": c.outcome,
                        "seconds": round(c.seconds, 2),
                        "detail": c.detail,
                    }
                    for c in cases
                ],
                indent=2,
            )
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
