"""The recipes of README.md and docs/server.md run as written.

Each fenced code block of README.md carries a marker on the line before it (every block must),
and so do the recipe blocks of docs/server.md:

* ``<!-- recipe: run python -->``: the block runs as a script (``python recipe.py``, from the
  repository root), and must exit 0 and print something;
* ``<!-- recipe: run python, server -->`` / ``<!-- recipe: run shell, server -->``: the same, or
  the block run by ``bash -euo pipefail``, against a real `bregman-serve` on loopback (one per
  module). ``curl`` there runs with ``--fail-with-body`` so that an HTTP error fails the recipe;
* ``<!-- recipe: run session NAME -->``: the blocks of one session run in order, statement by
  statement, in one namespace, as pasted into Python's prompt; an expression whose comment
  starts with a value (``# tensor([0.6000, 0.4000])``, ``# (1, 150): ...``) must print that
  value;
* ``<!-- recipe: check (why) -->``: what cannot run here (a GPU, a Docker engine, a fixed port,
  a long evaluation) is checked: ``bash -n``, then every command by the parser of the program it
  calls: ``make -n``, the server's CLI parser and vLLM's parser as `bregman-serve` calls it,
  vLLM's own server parser (which must load the Bregman middleware), lm-evaluation-harness's
  parser, JSON bodies of curl; a command no check knows fails the test.

Two substitutions, also stated in README.md: ``models/tiny-llama`` (the tests' model) for
``models/smollm2-135m-instruct``, with ``enforce_eager=True`` added to ``LLM(...)`` (no
torch.compile on a cold CI machine), and the module's server address for ``127.0.0.1:8000``.
Costs: one `bregman-serve` start and one offline ``LLM`` (two vLLM CPU engines, 20-60 s each).
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bregman_server.engine
import pytest
from bregman_server.engine import MIDDLEWARE_PATH, vllm_namespace

from .test_deploy import parse_server, vllm_serve_parse
from .test_server_support import (
    ServerProcess,
    require_tiny_model,
    server_environment,
    shut_down,
)

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = {"README.md": True, "docs/server.md": False}  # path -> every block needs a marker
README_MODEL = "models/smollm2-135m-instruct"
TEST_MODEL = "models/tiny-llama"
README_ADDRESS = "127.0.0.1:8000"
MARKER = re.compile(r"^<!-- recipe: (run|check)\b\s*(.*?)\s*-->$")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    document: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None  # "run python", "run shell, server", "run session core", "check (...)"

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"

    @property
    def server(self) -> bool:
        return self.marker is not None and self.marker.startswith("run ") and (
            self.marker.endswith(", server"))


def blocks(document: str) -> list[Block]:
    lines = (ROOT / document).read_text().splitlines()
    found = []
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        previous = lines[index - 1] if index else ""
        marker = MARKER.match(previous)
        found.append(Block(document, index + 1, fence.group(1), "\n".join(lines[index + 1:end])
                           + "\n", f"{marker.group(1)} {marker.group(2)}".strip()
                           if marker else None))
        index = end + 1
    return found


ALL_BLOCKS = [block for document in DOCUMENTS for block in blocks(document)]
MARKED = [block for block in ALL_BLOCKS if block.marker]


def of_kind(prefix: str, server: bool | None = None) -> list[Any]:
    chosen = [block for block in MARKED if block.marker.startswith(prefix)
              and (server is None or block.server == server)]
    return [pytest.param(block, id=block.id) for block in chosen]


def substituted(code: str, url: str | None = None) -> str:
    code = code.replace(f'LLM("{README_MODEL}")', f'LLM("{TEST_MODEL}", enforce_eager=True)')
    code = code.replace(README_MODEL, TEST_MODEL)
    if url is not None:
        code = code.replace(f"http://{README_ADDRESS}", url).replace(
            README_ADDRESS, url.removeprefix("http://"))
    return code


def test_every_block_is_marked_and_the_markers_are_known() -> None:
    for document, every in DOCUMENTS.items():
        found = blocks(document)
        assert found, document
        if every:
            assert not [b.id for b in found if b.marker is None], (
                f"{document}: every code block needs a recipe marker (this module's docstring)")
    kinds = re.compile(r"^(run (python|python, server|shell, server|session \w+)|check \(.+\))$")
    assert not [(b.id, b.marker) for b in MARKED if not kinds.match(b.marker)]
    for block in MARKED:
        language = {"python": "python", "shell": "bash"}.get(block.marker.split()[1].rstrip(","))
        if block.marker.startswith("run") and language:
            assert block.language == language, block.id
    # What this module promises to run, it finds.
    assert len(of_kind("run python", server=False)) >= 2  # the offline LLM and Hugging Face
    assert of_kind("run python", server=True) and of_kind("run shell", server=True)
    assert of_kind("run session") and len(of_kind("check")) >= 4


# --- scripts and sessions without a server -----------------------------------------------------

def run_script(code: str, tmp_path: Path, env: dict[str, str], timeout: float = 480
               ) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "recipe.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)


def script_environment() -> dict[str, str]:
    """This machine's environment as a user's shell has it: no test settings, and no KV-cache
    size, which the offline recipe must set itself."""
    env = server_environment()
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


@pytest.mark.engine
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", of_kind("run python", server=False))
def test_python_recipe_runs_as_a_script(block: Block, tmp_path: Path) -> None:
    require_tiny_model()
    result = run_script(substituted(block.code), tmp_path, script_environment())
    assert result.returncode == 0, f"{block.id}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert result.stdout.strip(), f"{block.id}: printed nothing"


def value_claim(comment: str) -> str | None:
    """The value a comment claims an expression prints, if it starts with one."""
    text = comment.lstrip("#").strip()
    if re.match(r"^([(\[{'\"\d-]|tensor\(|True\b|False\b|None\b)", text):
        return text
    return None


def session_statements(code: str) -> Iterator[tuple[ast.stmt, str, str | None]]:
    """Top-level statements, their source, and the value claimed by a comment on their lines."""
    tree = ast.parse(code)
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    for statement in tree.body:
        lines = range(statement.lineno, (statement.end_lineno or statement.lineno) + 1)
        claims = [claim for line in lines if (claim := value_claim(comments.get(line, "")))]
        yield statement, ast.get_source_segment(code, statement) or "", (
            claims[0] if claims else None)


SESSIONS = sorted({block.marker.split()[2] for block in MARKED
                   if block.marker.startswith("run session ")})


@pytest.mark.parametrize("session", SESSIONS)
def test_session_recipes_run_and_print_what_they_say(session: str) -> None:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    checked = 0
    for block in MARKED:
        if block.marker != f"run session {session}":
            continue
        code = substituted(block.code)
        for statement, source, claim in session_statements(code):
            where = f"{block.id}: {source.splitlines()[0]}"
            if isinstance(statement, ast.Expr):
                value = eval(compile(ast.Expression(statement.value), block.id, "eval"),
                             namespace)
                if claim is not None:
                    shown = repr(value)
                    assert claim.startswith(shown) and claim[len(shown):][:1] in ("", ":", " "), (
                        f"{where}: prints {shown}, the comment says {claim}")
                    checked += 1
            else:  # a comment on an assignment describes it (`# [batch, vocab]`)
                exec(compile(ast.Module([statement], []), block.id, "exec"), namespace)
    assert checked >= 2, "the session's printed values are compared"


# --- check blocks ------------------------------------------------------------------------------

def strip_comments(code: str) -> str:
    """``code`` without its shell comments (a ``#`` that starts a word outside quotes, to the end
    of the line)."""
    out, quote, previous = [], "", "\n"
    index = 0
    while index < len(code):
        char = code[index]
        if quote:
            if char == "\\" and quote == '"':
                out.append(code[index:index + 2])
                index += 2
                continue
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and previous in " \t\n;&|(":
            while index < len(code) and code[index] != "\n":
                index += 1
            continue
        out.append(char)
        previous = char
        index += 1
    return "".join(out)


def shell_commands(code: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment assignments, words) of every simple command of a shell block: commands end
    at newlines (outside quotes), ``;``, ``&``, ``|`` and parentheses."""
    lexer = shlex.shlex(strip_comments(code).replace("\\\n", " "), posix=True,
                        punctuation_chars=";&|()\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set(";&|()\n"):
            commands.append([])
        else:
            commands[-1].append(token)
    found = []
    for words in commands:
        env = {}
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words:
            found.append((env, words))
    return found


def check_command(env: dict[str, str], words: list[str], monkeypatch: pytest.MonkeyPatch
                  ) -> str:
    """Check one command with the parser of the program it calls; return what was checked."""
    program = words[0]
    if program == "make":
        result = subprocess.run(["make", "-n", "-C", str(ROOT), *words[1:]], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, f"make -n {shlex.join(words[1:])}:\n{result.stderr}"
        return "make"
    if program == "bregman-serve" or words[:3] == ["python", "-m", "bregman_server.cli"]:
        argv = words[1:] if program == "bregman-serve" else words[3:]
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        settings, vllm_args = parse_server(argv)
        monkeypatch.setattr(bregman_server.engine, "vllm_is_cpu_build", lambda: True)
        try:
            args = vllm_namespace(settings, vllm_args)
        except SystemExit as exc:
            pytest.fail(f"vLLM refuses {shlex.join(vllm_args)} (exit {exc.code})")
        assert MIDDLEWARE_PATH in args.middleware
        return "bregman-serve"
    if words[:2] == ["vllm", "serve"] or words[:3] == [
            "python", "-m", "vllm.entrypoints.openai.api_server"]:
        argv = words[2:] if program == "vllm" else words[3:]
        args = vllm_serve_parse(argv)
        assert MIDDLEWARE_PATH in args.middleware, f"{shlex.join(words)}: without the middleware"
        assert args.model, shlex.join(words)
        return "vllm"
    if Path(program).name in ("lm_eval", "lm-eval"):
        from lm_eval._cli import HarnessCLI

        try:
            args = HarnessCLI()._parser.parse_args(["run", *words[1:]])
        except SystemExit as exc:
            pytest.fail(f"lm-eval refuses {shlex.join(words)} (exit {exc.code})")
        assert (ROOT / args.include_path).is_dir()
        tasks = args.tasks if isinstance(args.tasks, list) else args.tasks.split(",")
        for task in tasks:
            assert list((ROOT / args.include_path).rglob(f"{task}.yaml")), task
        return "lm-eval"
    if program == "curl":
        bodies = [words[i + 1] for i, word in enumerate(words) if word in ("-d", "--data")]
        for body in bodies:
            json.loads(body)
        return "curl"
    if program == "docker":
        if words[1] == "build":
            dockerfile = words[words.index("-f") + 1] if "-f" in words else "Dockerfile"
            assert (ROOT / dockerfile).is_file(), dockerfile
        return "docker"
    if program == "pip" and words[1:3] == ["install", "--no-deps"]:
        return "pip"
    if program in ("cd", "cp"):
        return "shell"
    pytest.fail(f"no check knows {shlex.join(words)}: add one to tests/test_readme.py")


@pytest.mark.parametrize("block", of_kind("check"))
def test_check_recipes_parse(block: Block, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("BREGMAN_"):
            monkeypatch.delenv(name)
    syntax = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True,
                            timeout=30)
    assert syntax.returncode == 0, f"{block.id}: {syntax.stderr}"
    commands = shell_commands(block.code)
    assert commands, block.id
    checked = {check_command(env, words, monkeypatch) for env, words in commands}
    assert checked, block.id


def test_vllm_check_sees_a_missing_middleware(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks are not vacuous: a plain `vllm serve` fails them, as does an unknown flag."""
    with pytest.raises(AssertionError, match="without the middleware"):
        check_command({}, ["vllm", "serve", "m"], monkeypatch)
    with pytest.raises(pytest.fail.Exception):
        check_command({}, ["bregman-serve", "--model", "m", "--no-such-flag"], monkeypatch)
    with pytest.raises(pytest.fail.Exception):
        check_command({}, ["rm", "-rf", "x"], monkeypatch)


# --- against a real server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`bregman-serve` on the tiny model, no key (the recipes send none), as `make run` starts it
    (``python -m bregman_server.cli --model ...``)."""
    require_tiny_model()
    logs = tmp_path_factory.mktemp("readme-server")
    process = ServerProcess(["--model", TEST_MODEL, "--enforce-eager", "--max-num-seqs", "8",
                             "--max-model-len", "256"], logs / "server.log")
    try:
        process.start()
        process.wait_healthy(timeout=480)
        yield process
    finally:
        shut_down(process)


@pytest.mark.server
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", of_kind("run python", server=True))
def test_python_recipe_runs_against_the_server(block: Block, server: ServerProcess,
                                               tmp_path: Path) -> None:
    code = substituted(block.code, server.url)
    assert server.url in code, f"{block.id}: the recipe names no server address"
    result = run_script(code, tmp_path, script_environment(), timeout=300)
    assert result.returncode == 0, f"{block.id}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    assert result.stdout.strip(), f"{block.id}: printed nothing"


@pytest.mark.server
@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", of_kind("run shell", server=True))
def test_shell_recipe_runs_against_the_server(block: Block, server: ServerProcess) -> None:
    code = substituted(block.code, server.url)
    assert server.url in code, f"{block.id}: the recipe names no server address"
    harness = 'curl() { command curl --silent --show-error --fail-with-body "$@"; }\n'
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", harness + code], cwd=ROOT,
                            env=script_environment(), capture_output=True, text=True,
                            timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{block.id}:\n{result.stdout[-2000:]}\n{result.stderr}"
    completions = sum(1 for line in shell_commands(code) if line[1][0] == "curl")
    assert result.stdout.count('"choices"') >= completions, result.stdout[-2000:]
    if "stream" in code:
        assert "data: [DONE]" in result.stdout, result.stdout[-2000:]
