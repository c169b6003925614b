"""Wrap the lines ruff format leaves longer than the line length: comments, docstrings and string literals.

    python scripts/wrap_long_lines.py [--length 120] PATH...

ruff format wraps code but never prose: a long comment, docstring line or string literal stays as it is. This wraps
those at word boundaries, keeping what they mean:
- a comment line becomes several at the same indentation; a comment after code moves above its line first (one
  holding ``noqa`` or ``type:`` stays, and is reported);
- a docstring line (module, class or function) is wrapped at its own indentation;
- a one-line string literal is split into adjacent literals (implicit concatenation, the same value), in parentheses
  where it is not already inside brackets; an f-string is split only between its replacement fields.
Anything else it cannot wrap is printed as ``path:line: length`` for a person to shorten; the exit status is 1 then.
Run ``ruff format`` after it (scripts/format.sh does both).
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import textwrap
import tokenize
import tomllib
from pathlib import Path


def docstring_lines(tree: ast.Module) -> set[int]:
    """1-based line numbers inside docstrings."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def wrap_comment(line: str, length: int) -> list[str] | None:
    indent = line[: len(line) - len(line.lstrip())]
    body = line.strip()[1:].strip()
    wrapped = textwrap.wrap(body, width=length - len(indent) - 2, break_long_words=False, break_on_hyphens=False)
    if not wrapped or any(len(indent) + 2 + len(w) > length for w in wrapped):
        return None
    return [f"{indent}# {w}" for w in wrapped]


def wrap_docstring_line(line: str, length: int) -> list[str] | None:
    indent = line[: len(line) - len(line.lstrip())]
    text = line.strip()
    lead = ""
    for quote in ('"""', "'''", 'r"""', "r'''"):
        if text.startswith(quote):
            lead, text = quote, text[len(quote) :]
            break
    first_width = length - len(indent) - len(lead)
    pieces = textwrap.wrap(text, width=first_width, break_long_words=False, break_on_hyphens=False)
    if len(pieces) < 2:
        return None
    rest = textwrap.wrap(
        " ".join(pieces[1:]), width=length - len(indent), break_long_words=False, break_on_hyphens=False
    )
    out = [f"{indent}{lead}{pieces[0]}"] + [f"{indent}{p}" for p in rest]
    return out if all(len(o) <= length for o in out) else None


def split_literal(token: str, room: int) -> list[str] | None:
    """``token`` (one single-quoted string literal) as two or more literals of the same value, the first at most
    ``room`` characters long, each of the rest as long as it can be."""
    prefix_end = 0
    while token[prefix_end] not in "'\"":
        prefix_end += 1
    prefix, quote = token[:prefix_end], token[prefix_end]
    if token[prefix_end : prefix_end + 3] == quote * 3:
        return None
    body = token[prefix_end + 1 : -1]
    is_f = "f" in prefix.lower()
    # the places where the literal may be cut: after a space, outside {...} in an f-string, not after a backslash
    cuts = []
    depth = 0
    for i, ch in enumerate(body):
        if is_f and ch == "{":
            depth += 1 if body[i : i + 2] != "{{" or depth else 0
        elif is_f and ch == "}" and depth:
            depth -= 1
        elif ch == " " and depth == 0 and (i == 0 or body[i - 1] != "\\"):
            cuts.append(i + 1)
    pieces, start, width = [], 0, room
    overhead = len(prefix) + 2
    while len(body) - start + overhead > width:
        fitting = [c for c in cuts if start < c <= start + width - overhead]
        if not fitting:
            return None
        cut = fitting[-1]
        pieces.append(body[start:cut])
        start, width = cut, room
    pieces.append(body[start:])
    if len(pieces) < 2:
        return None

    def literal(piece: str) -> str:
        p = prefix
        if is_f and "{" not in piece and "}" not in piece:
            p = p.replace("f", "").replace("F", "")
        return f"{p}{quote}{piece}{quote}"

    return [literal(p) for p in pieces]


def wrap_string_line(source_lines: list[str], index: int, length: int) -> list[str] | None:
    """Split the string literal that crosses the limit on line ``index`` (0-based) of a file."""
    line = source_lines[index]
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    stack, previous = _open_brackets(source_lines, index)
    strings = [t for t in tokens if t.type == tokenize.STRING and t.start[0] == t.end[0] == 1]
    crossing = [t for t in strings if t.end[1] > length] or strings[-1:]
    for tok in tokens:
        depth = len(stack)
        if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            continue
        if tok.type == tokenize.OP and tok.string in "([{":
            stack.append((tok.string, _is_call(tok, previous)))
            previous = tok
            continue
        elif tok.type == tokenize.OP and tok.string in ")]}":
            stack = stack[:-1]
            previous = tok
            continue
        if not (crossing and tok is crossing[0]):
            previous = tok
            continue
        if True:
            start = tok.start[1]
            rest_len = len(line) - tok.end[1]
            # a literal that is a whole item of a list or set keeps parentheses (ruff's ISC004)
            starts_item = previous is not None and previous.string in ("[", "{", ",")
            wrap = not depth or (stack[-1][0] in "[{" and not stack[-1][1] and starts_item)
            room = max(length - start - (1 if wrap else 0) - rest_len, 20)
            parts = split_literal(tok.string, room)
            if parts is None:
                return None
            rest = line[tok.end[1] :]
            following = source_lines[index + 1] if index + 1 < len(source_lines) else ""
            merged = _merge(parts[-1], following.lstrip()) if depth and not wrap and not rest.strip() else None
            if merged is not None:  # the tail joins the literal on the next line: the text re-flows, no stub line
                parts, rest = parts[:-1], "\n" + following[: len(following) - len(following.lstrip())] + merged
            column = start + (1 if wrap else 0)
            joined = ("\n" + " " * column).join(parts)
            replacement = f"({joined})" if wrap else joined
            new = (line[:start] + replacement + rest).split("\n")
            return new + (["\0drop-next"] if merged is not None else [])
    return None


def _is_call(bracket: tokenize.TokenInfo, previous: tokenize.TokenInfo | None) -> bool:
    """Whether ``bracket`` opens a call's arguments or a subscript (after a name or a closing bracket)."""
    if previous is None or bracket.string == "{":
        return False
    return (previous.type == tokenize.NAME and previous.string not in KEYWORDS) or previous.string in (")", "]")


KEYWORDS = {"in", "not", "and", "or", "return", "yield", "if", "else", "for", "assert", "await", "lambda", "is"}


def _literal_parts(text: str) -> tuple[str, str, str, str] | None:
    """``(prefix, quote, body, after)`` of the one-line string literal that starts ``text``, or None."""
    try:
        tok = next(t for t in tokenize.generate_tokens(io.StringIO(text + "\n").readline) if t.type != tokenize.INDENT)
    except (tokenize.TokenError, StopIteration, IndentationError, SyntaxError):
        return None
    if tok.type != tokenize.STRING or tok.start[0] != tok.end[0] or tok.start[1] != 0:
        return None
    literal = tok.string
    i = 0
    while literal[i] not in "'\"":
        i += 1
    prefix, quote = literal[:i], literal[i]
    if literal[i : i + 3] == quote * 3 or "b" in prefix.lower() or "r" in prefix.lower():
        return None
    return prefix, quote, literal[i + 1 : -1], text[tok.end[1] :]


def _merge(tail: str, following: str) -> str | None:
    """The literal ``tail`` joined to the literal that starts ``following`` (and what follows it), or None."""
    a, b = _literal_parts(tail), _literal_parts(following)
    if a is None or b is None or a[1] != b[1]:
        return None
    f = "f" in (a[0] + b[0]).lower()

    def body(parts: tuple[str, str, str, str]) -> str:
        return parts[2].replace("{", "{{").replace("}", "}}") if f and "f" not in parts[0].lower() else parts[2]

    return f"{'f' if f else ''}{a[1]}{body(a)}{body(b)}{a[1]}{b[3]}"


def _open_brackets(lines: list[str], index: int) -> tuple[list[tuple[str, bool]], tokenize.TokenInfo | None]:
    """The brackets open at the start of line ``index`` (each with whether it opens a call's arguments) and the last
    token before the line (tokenizing up to it)."""
    text = "\n".join(lines[:index]) + "\n"
    stack: list[tuple[str, bool]] = []
    previous = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
                continue
            if tok.type == tokenize.OP and tok.string in "([{":
                stack.append((tok.string, _is_call(tok, previous)))
            elif tok.type == tokenize.OP and tok.string in ")]}":
                stack = stack[:-1]
            previous = tok
    except tokenize.TokenError:
        pass  # the text stops inside brackets: what is open so far is the answer
    return stack, previous


def wrap_file(path: Path, length: int, *, comments_only: bool = False) -> list[str]:
    """Rewrite ``path`` in place; the lines still too long, as ``path:line: length``."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    left: list[str] = []
    for _ in range(200):  # one change per pass, then re-parse: line numbers move
        try:
            tree = ast.parse("\n".join(lines))
        except SyntaxError:
            return [f"{path}: does not parse"]
        docs = docstring_lines(tree)
        comment_lines = _comment_lines(lines)
        changed = False
        for i, line in enumerate(lines):
            if len(line) <= length:
                continue
            new = None
            if comments_only and ((i + 1) not in comment_lines or line.lstrip().startswith("#")):
                continue
            following = lines[i + 1] if i + 1 < len(lines) else ""
            joins = False
            if (i + 1) in comment_lines and line.lstrip().startswith("#"):
                joins = (i + 2) in comment_lines and _continues(line, following, "#")
                new = wrap_comment(_joined(line, following, "#") if joins else line, length)
            elif (i + 1) in comment_lines:
                new = _move_trailing_comment(line, comment_lines[i + 1], length)
            elif (i + 1) in docs:
                joins = (i + 2) in docs and _continues(line, following, "")
                new = wrap_docstring_line(_joined(line, following, "") if joins else line, length)
            else:
                new = wrap_string_line(lines, i, length)
            if new is not None and new != [line]:
                drop = 2 if joins else 1
                if new[-1] == "\0drop-next":
                    new, drop = new[:-1], 2
                candidate = lines[:i] + new + lines[i + drop :]
                if _same_code("\n".join(lines), "\n".join(candidate), docstring=(i + 1) in docs):
                    lines = candidate
                    changed = True
                    break
        if not changed:
            break
    for i, line in enumerate(lines):
        if len(line) > length:
            left.append(f"{path}:{i + 1}: {len(line)}")
    new_text = "\n".join(lines)
    if new_text != text:
        path.write_text(new_text, encoding="utf-8")
    return left


def _continues(line: str, following: str, mark: str) -> bool:
    """Whether ``following`` goes on with the paragraph of ``line``, so that a wrapped tail may join it: the same
    indentation, and neither blank, nor a new item, nor the docstring's closing quotes."""
    indent = len(line) - len(line.lstrip())
    if len(following) - len(following.lstrip()) != indent or line.rstrip().endswith((":", '"""', "'''")):
        return False
    text = following.strip()
    if mark:
        if not text.startswith(mark):
            return False
        text = text[len(mark) :].strip()
    new_item = (
        text.startswith(("-", "*", ">>>", ":", "|", "#", "`" * 3)) or text.split(" ", 1)[0].rstrip(".)").isdigit()
    )
    return bool(text) and not new_item and not text.startswith(('"""', "'''"))


def _joined(line: str, following: str, mark: str) -> str:
    text = following.strip()
    if mark:
        text = text[len(mark) :].strip()
    return f"{line.rstrip()} {text}"


def _comment_lines(lines: list[str]) -> dict[int, int]:
    """Line number -> the column of the comment on it."""
    out: dict[int, int] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
            if tok.type == tokenize.COMMENT:
                out[tok.start[0]] = tok.start[1]
    except (tokenize.TokenError, IndentationError):
        pass
    return out


def _move_trailing_comment(line: str, column: int, length: int) -> list[str] | None:
    code, comment = line[:column].rstrip(), line[column:]
    if "noqa" in comment or "type:" in comment or "pragma" in comment:
        return None
    indent = line[: len(line) - len(line.lstrip())]
    above = wrap_comment(indent + comment, length)
    return None if above is None else above + [code]


def _same_code(before: str, after: str, docstring: bool) -> bool:
    """The change kept the program: the same AST (docstrings may differ in their whitespace)."""
    try:
        a, b = ast.parse(before), ast.parse(after)
    except SyntaxError:
        return False
    if docstring:
        for tree in (a, b):
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    node.value = " ".join(node.value.split())
    return ast.dump(a) == ast.dump(b)


def _format_excluded() -> set[Path]:
    """The files ``[tool.ruff.format] exclude`` of ./pyproject.toml names: they keep their own layout."""
    pyproject = Path("pyproject.toml")
    if not pyproject.exists():
        return set()
    names = tomllib.loads(pyproject.read_text()).get("tool", {}).get("ruff", {}).get("format", {}).get("exclude", [])
    return {Path(name).resolve() for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=120)
    parser.add_argument(
        "--comments-only",
        action="store_true",
        help="only move trailing comments off long lines (before ruff format, which would otherwise "
        "wrap the code in parentheses to make room for them)",
    )
    parser.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args(argv)
    files = [p for root in args.paths for p in ([root] if root.is_file() else sorted(root.rglob("*.py")))]
    excluded = _format_excluded()
    left = []
    for path in files:
        if any(part in (".venv", "build", "__pycache__") for part in path.parts) or path.resolve() in excluded:
            continue
        left += wrap_file(path, args.length, comments_only=args.comments_only)
    for entry in left:
        print(entry)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
