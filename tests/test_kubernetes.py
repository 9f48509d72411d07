"""Checks of the Kubernetes manifests (deploy/kubernetes/), without a cluster: none can run on
these machines, so what can be checked offline is checked here, with the real tools.

* the Kubernetes schemas: ``python -m kubernetes_validate --strict`` (PyPI kubernetes-validate,
  which ships the schemas: no network) on every manifest and example, for the oldest and the
  newest Kubernetes version we claim; a manifest with a misspelt field fails it;
* the replicas: the server's own CLI parser (`bregman_server.cli.parse_args`) and vLLM's own
  argument parser (`bregman_server.engine.vllm_namespace`, as the server runs it) accept the
  container's arguments and environment, as tests/test_deploy.py does for compose; the probes
  ask /health on the server's port, with timings that fit a model that loads for minutes; the
  grace period leaves room for the drain; secrets come from the Secret whose keys the example
  and deploy/README.md document; the volumes are directories the image gives its user;
* the router: its own parser (`vllm_router.launch_router.parse_router_args`) accepts the
  arguments; its selector picks the replicas' pods and not its own; the Services select their
  Deployments' pods; RBAC is a Role that reads pods in the namespace, nothing more; the image
  is docker/Dockerfile.router at the pinned version;
* the router's Kubernetes service discovery, live: the real vllm-router, started with the
  manifest's arguments, against a stand-in for the Kubernetes API (a cluster cannot run here)
  that grants exactly what the manifest's Role grants. It must find the Ready replica pods, and
  only those, pass a request on to them, and drop a pod as soon as it is deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import bregman_server.engine
import httpx
import pytest
import yaml
from bregman_server.engine import MIDDLEWARE_PATH, vllm_namespace

from .test_deploy import (
    ENGINE_STOP_SECONDS,
    GPU_DOCKERFILE,
    ROOT,
    ROUTER_DOCKERFILE,
    SECRET_NAME,
    ImageDirectories,
    dockerfile_args,
    dockerfile_env,
    dockerfile_healthcheck,
    dockerfile_user,
    duration_seconds,
    parse_server,
    router_parse,
    vllm_version_pin,
)
from .test_server_support import free_port

KUBE = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(KUBE.glob("*.yaml"))
EXAMPLES = sorted((KUBE / "examples").glob("*.yaml"))
DEPLOY_README = ROOT / "deploy" / "README.md"
#: The oldest Kubernetes we claim (deploy/README.md) and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
NAMESPACE = "bregman"
SECRET = "bregman-secrets"


# --- reading the manifests --------------------------------------------------------------------

def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def resources() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> resource, for everything `kubectl apply -f deploy/kubernetes/` applies."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path in MANIFESTS:
        for doc in documents(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{key} defined twice"
            found[key] = doc
    return found


def deployment(name: str) -> dict[str, Any]:
    return resources()[("Deployment", name)]


def pod_spec(name: str) -> dict[str, Any]:
    return deployment(name)["spec"]["template"]["spec"]


def pod_labels(name: str) -> dict[str, str]:
    return deployment(name)["spec"]["template"]["metadata"]["labels"]


def container(name: str) -> dict[str, Any]:
    containers = pod_spec(name)["containers"]
    assert len(containers) == 1, f"{name}: one container"
    return containers[0]


def container_port(spec: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port, resolved by name against the container's ports."""
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in spec["ports"]], port
        return port
    named = [p["containerPort"] for p in spec["ports"] if p.get("name") == port]
    assert len(named) == 1, f"no container port named {port!r}"
    return named[0]


def literal_env(spec: dict[str, Any], namespace: str) -> dict[str, str]:
    """The container's environment as Kubernetes gives it, secrets excepted (``value`` entries and
    the pod's namespace from the downward API)."""
    env = {}
    for entry in spec.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == (
                "metadata.namespace"):
            env[entry["name"]] = namespace
    return env


def expand(argument: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in args (``$$`` escapes; unknown names stay)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  argument)


def secret_refs(spec: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Environment variable -> (Secret, key) for every secretKeyRef of the container."""
    return {entry["name"]: (ref["name"], ref["key"]) for entry in spec.get("env", [])
            if (ref := entry.get("valueFrom", {}).get("secretKeyRef"))}


def readme_section() -> str:
    text = DEPLOY_README.read_text()
    assert "\n## Kubernetes\n" in text, "deploy/README.md has a Kubernetes section"
    return text.split("\n## Kubernetes\n", 1)[1].split("\n## ", 1)[0]


# --- the schemas ----------------------------------------------------------------------------------

def kubernetes_validate(paths: list[Path], kubernetes_version: str
                        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--kubernetes-version",
         kubernetes_version, *map(str, paths)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(kubernetes_version: str) -> None:
    paths = MANIFESTS + EXAMPLES
    result = kubernetes_validate(paths, kubernetes_version)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    expected = sum(len(documents(path)) for path in paths)
    assert output.count(" passed for resource ") == expected, output
    assert "warn" not in output.lower(), output


def test_schema_validation_catches_mistakes(tmp_path: Path) -> None:
    """The validator is not vacuous: a misspelt field and a wrong type both fail it."""
    text = (KUBE / "10-bregman.yaml").read_text()
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text(text.replace("readinessProbe:", "readinesProbe:", 1))
    wrong_type = tmp_path / "wrong-type.yaml"
    wrong_type.write_text(text.replace("replicas: 2", "replicas: two", 1))
    for path in (misspelt, wrong_type):
        assert path.read_text() != text
        result = kubernetes_validate([path], KUBERNETES_VERSIONS[-1])
        assert result.returncode != 0, f"{path.name} passed:\n{result.stdout}"


def test_layout_namespace_and_apply_order() -> None:
    """`kubectl apply -f deploy/kubernetes/` applies the files in name order: the namespace
    first. Every resource lives in it; the example Secret is not applied (a sub-folder)."""
    assert MANIFESTS[0].name == "00-namespace.yaml"
    found = resources()
    assert ("Namespace", NAMESPACE) in found
    for (kind, name), doc in found.items():
        if kind != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{kind}/{name}"
    assert not [key for key in found if key[0] in ("Secret", "ClusterRole",
                                                    "ClusterRoleBinding")]
    for path in EXAMPLES:
        for doc in documents(path):
            assert doc["metadata"]["namespace"] == NAMESPACE, path.name


# --- the replicas ------------------------------------------------------------------------------

@pytest.fixture
def server_parse(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The server's settings and vLLM's namespace for the replica container, as the GPU image
    runs it: the image's ENV, then the container's env (the Secret's values stood in for)."""
    spec = container("bregman-vllm")
    for name in list(os.environ):
        if name.startswith("BREGMAN_"):
            monkeypatch.delenv(name)
    env = {**dockerfile_env(GPU_DOCKERFILE), **literal_env(spec, NAMESPACE)}
    env.update({name: f"secret:{key}" for name, (_, key) in secret_refs(spec).items()})
    for key, value in env.items():
        if key.startswith("BREGMAN_"):
            monkeypatch.setenv(key, value)
    assert "command" not in spec, "the image's entrypoint (bregman-serve) runs"
    settings, vllm_args = parse_server([expand(arg, env) for arg in spec["args"]])
    monkeypatch.setattr(bregman_server.engine, "vllm_is_cpu_build", lambda: False)
    try:
        args = vllm_namespace(settings, vllm_args)
    except SystemExit as exc:
        pytest.fail(f"vLLM refuses {shlex.join(vllm_args)} (exit {exc.code})")
    return settings, args, env


def test_replica_arguments_parse_with_the_server_and_vllm(server_parse: Any) -> None:
    settings, args, _env = server_parse
    assert settings.model == args.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert settings.host == "0.0.0.0" and settings.port == container_port(
        container("bregman-vllm"), "http")
    assert (args.host, args.port) == (settings.host, settings.port), "one port: the server's"
    assert MIDDLEWARE_PATH in args.middleware
    assert args.api_key is None, "the key is the middleware's, never on a command line"
    assert settings.api_key_value() == "secret:api-key", "the key comes from the Secret"
    # The compose deployment's sizing (deploy/README.md explains it for one L40S).
    assert (args.dtype, args.gpu_memory_utilization, args.max_model_len, args.max_num_seqs) == (
        "bfloat16", 0.90, 16384, 64)


def test_replica_image_and_user() -> None:
    spec, pod = container("bregman-vllm"), pod_spec("bregman-vllm")
    project = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert project
    assert spec["image"].endswith(f"/bregman-vllm:{project.group(1)}"), (
        "the tag docker/Dockerfile's build command gives")
    uid, gid = dockerfile_user(GPU_DOCKERFILE)
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True
    assert (context["runAsUser"], context["runAsGroup"]) == (uid, gid)
    assert spec["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False, "the server never calls the API"


def test_replica_requests_one_gpu() -> None:
    resources_ = container("bregman-vllm")["resources"]
    assert resources_["limits"]["nvidia.com/gpu"] == 1
    assert resources_.get("requests", {}).get("nvidia.com/gpu", 1) == 1


def test_pods_get_no_service_link_variables() -> None:
    """Kubernetes sets ``<SERVICE>_PORT=tcp://...`` for every Service of the namespace unless
    told not to: a Service named ``bregman`` or ``vllm`` would set BREGMAN_PORT or VLLM_PORT,
    which the server and vLLM read as their own settings."""
    for name in ("bregman-vllm", "vllm-router"):
        assert pod_spec(name)["enableServiceLinks"] is False, name


def test_probes_ask_health_on_the_servers_port(server_parse: Any) -> None:
    settings, _args, _env = server_parse
    spec = container("bregman-vllm")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = spec[kind]
        assert probe["httpGet"]["path"] == "/health", kind
        assert container_port(spec, probe["httpGet"]["port"]) == settings.port, kind
        assert probe["timeoutSeconds"] < probe["periodSeconds"], kind

    def window(probe: dict[str, Any]) -> float:
        return probe["periodSeconds"] * probe["failureThreshold"]

    # A first start downloads 16 GB and compiles: at least the image's own start period.
    options, _ = dockerfile_healthcheck(GPU_DOCKERFILE)
    assert window(spec["startupProbe"]) >= duration_seconds(options["start-period"])
    # A replica that answers 503 (drain, dead engine) leaves the endpoints quickly...
    assert window(spec["readinessProbe"]) <= 15
    # ...and a drain never looks like a hung server.
    assert window(spec["livenessProbe"]) > settings.graceful_timeout + ENGINE_STOP_SECONDS


def test_grace_period_leaves_room_for_the_drain(server_parse: Any) -> None:
    settings, _args, env = server_parse
    assert env["BREGMAN_GRACEFUL_TIMEOUT"] == "10"
    pre_stop = container("bregman-vllm")["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = pod_spec("bregman-vllm")["terminationGracePeriodSeconds"]
    assert grace >= float(pre_stop[1]) + settings.graceful_timeout + ENGINE_STOP_SECONDS, (
        "preStop, then the server's drain, then vLLM stopping its engine, before SIGKILL")


def test_secrets_come_from_the_documented_secret() -> None:
    """Every secret-looking variable comes from the Secret (never a literal); the keys read are
    those of the example Secret and of deploy/README.md's `kubectl create secret` line."""
    refs: dict[str, tuple[str, str]] = {}
    for name in ("bregman-vllm", "vllm-router"):
        spec = container(name)
        for entry in spec.get("env", []):
            if SECRET_NAME.search(entry["name"]):
                assert "secretKeyRef" in entry.get("valueFrom", {}), f"{name}: {entry['name']}"
        refs |= secret_refs(spec)
    assert set(refs) == {"BREGMAN_API_KEY", "HF_TOKEN"}
    assert {secret for secret, _ in refs.values()} == {SECRET}
    used = {key for _, key in refs.values()}
    example = documents(KUBE / "examples" / "bregman-secrets.yaml")[0]
    assert (example["kind"], example["metadata"]["name"]) == ("Secret", SECRET)
    assert set(example["stringData"]) == used
    commands = [line for line in " ".join(readme_section().replace("\\\n", " ").split(
        "\n")).split("kubectl") if " create secret generic " in line]
    assert commands, "deploy/README.md shows how to create the Secret"
    for command in commands:
        assert SECRET in command and set(re.findall(r"--from-literal=([\w.-]+)=", command)) == (
            used), command


def test_volumes_are_directories_the_image_gives_its_user() -> None:
    """An emptyDir or a claim mounted on a path the image lacks would still be writable, but
    the image's caches must land in the volumes: HF_HOME and VLLM_CACHE_ROOT are mounted."""
    spec, pod = container("bregman-vllm"), pod_spec("bregman-vllm")
    env = dockerfile_env(GPU_DOCKERFILE)
    image = ImageDirectories(GPU_DOCKERFILE)
    user = dockerfile_user(GPU_DOCKERFILE)
    mounts = {mount["mountPath"]: mount["name"] for mount in spec["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert set(mounts.values()) == set(volumes)
    assert {env["HF_HOME"], env["VLLM_CACHE_ROOT"]} <= set(mounts)
    for path, name in mounts.items():
        if path == "/dev/shm":
            assert volumes[name]["emptyDir"]["medium"] == "Memory"
            continue
        assert not image.problems(path, user), image.problems(path, user)
        assert "sizeLimit" in volumes[name]["emptyDir"], f"{name}: bounded"
    claim = documents(KUBE / "examples" / "hf-cache-pvc.yaml")[0]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "replicas on several nodes"
    assert claim["metadata"]["name"] in readme_section()


def test_services_and_selectors_match_the_pods() -> None:
    found = resources()
    for name in ("bregman-vllm", "vllm-router"):
        labels = pod_labels(name)
        selector = deployment(name)["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), name
        service = found[("Service", name)]
        assert service["spec"]["selector"].items() <= labels.items(), name
        assert service["spec"]["type"] == "ClusterIP", name
        for port in service["spec"]["ports"]:
            container_port(container(name), port["targetPort"])
        other = "vllm-router" if name == "bregman-vllm" else "bregman-vllm"
        assert not service["spec"]["selector"].items() <= pod_labels(other).items()
    budget = found[("PodDisruptionBudget", "bregman-vllm")]
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels(
        "bregman-vllm").items()


# --- the router ---------------------------------------------------------------------------------

def router_argv() -> list[str]:
    spec = container("vllm-router")
    assert "command" not in spec, "the image's entrypoint (vllm-router) runs"
    env = literal_env(spec, deployment("vllm-router")["metadata"]["namespace"])
    argv = [expand(arg, env) for arg in spec["args"]]
    assert not [arg for arg in argv if "$(" in arg], "every $(VAR) is defined"
    return argv


def test_router_arguments_parse_with_the_routers_parser() -> None:
    args = router_parse(router_argv())
    spec = container("vllm-router")
    assert args.service_discovery and not args.worker_urls
    assert args.selector and args.selector.items() <= pod_labels("bregman-vllm").items()
    assert not args.selector.items() <= pod_labels("vllm-router").items(), (
        "the router must not route to itself")
    assert args.service_discovery_namespace == NAMESPACE, "a namespace: a Role suffices"
    assert args.service_discovery_port == container_port(container("bregman-vllm"), "http")
    assert args.host == "0.0.0.0" and args.port == container_port(spec, "http")
    assert args.prometheus_host == "0.0.0.0"
    assert args.prometheus_port == container_port(spec, "metrics")
    assert args.api_key is None, "the router gets no key (deploy/README.md says why)"
    for kind, path in (("readinessProbe", "/readiness"), ("livenessProbe", "/liveness")):
        assert spec[kind]["httpGet"]["path"] == path
        assert container_port(spec, spec[kind]["httpGet"]["port"]) == args.port


def test_router_rbac_reads_pods_in_its_namespace_only() -> None:
    found = resources()
    pod = pod_spec("vllm-router")
    account = pod["serviceAccountName"]
    assert ("ServiceAccount", account) in found
    bindings = [doc for (kind, _), doc in found.items() if kind == "RoleBinding"]
    assert len(bindings) == 1
    binding = bindings[0]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": NAMESPACE}]
    assert binding["roleRef"]["kind"] == "Role"
    role = found[("Role", binding["roleRef"]["name"])]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]


def test_router_image_is_the_pinned_build() -> None:
    pinned = vllm_version_pin(ROOT / "requirements" / "dev.txt", "vllm-router")
    assert version("vllm-router") == pinned, "the tests run the router the image runs"
    assert dockerfile_args(ROUTER_DOCKERFILE)["VLLM_ROUTER_VERSION"] == pinned
    assert container("vllm-router")["image"].endswith(f"/bregman-vllm-router:{pinned}")
    assert f"-t <registry>/bregman-vllm-router:{pinned}" in ROUTER_DOCKERFILE.read_text()
    assert json.loads(ROUTER_DOCKERFILE.read_text().split("ENTRYPOINT ", 1)[1].splitlines()[0]
                      ) == ["vllm-router"]
    uid, gid = dockerfile_user(ROUTER_DOCKERFILE)
    context = pod_spec("vllm-router")["securityContext"]
    assert uid != 0 and (context["runAsUser"], context["runAsGroup"]) == (uid, gid)
    assert context["runAsNonRoot"] is True


# --- the router's service discovery, live ------------------------------------------------------

class FakeKubernetesAPI:
    """A stand-in for the Kubernetes API server (none can run here): the pods of the namespace
    for list and watch requests, RBAC as the manifest's Role grants it (anything else is 403),
    and every request recorded. Events pushed with `send` go to the open watches."""

    def __init__(self, role: dict[str, Any], namespace: str, token: str) -> None:
        self.role, self.namespace, self.token = role, namespace, token
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 1
        self.requests: list[tuple[str, str, int]] = []  # (verb, path, status)
        self.watches: list[list[dict[str, Any]]] = []
        self.lock = threading.Condition()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                api.handle(self)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def allowed(self, verb: str, namespace: str | None, resource: str) -> bool:
        return namespace == self.role["metadata"]["namespace"] and any(
            "" in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
            for rule in self.role["rules"])

    def pod(self, name: str, ip: str, labels: dict[str, str], ready: bool) -> dict[str, Any]:
        self.version += 1
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": self.namespace, "uid": name,
                             "labels": labels, "resourceVersion": str(self.version)},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
                "status": {"phase": "Running", "podIP": ip, "conditions": [
                    {"type": "Ready", "status": "True" if ready else "False"}]}}

    def send(self, kind: str, pod: dict[str, Any]) -> None:
        with self.lock:
            self.pods[pod["metadata"]["name"]] = pod
            for queue in self.watches:
                queue.append({"type": kind, "object": pod})
            self.lock.notify_all()

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        url = urlsplit(request.path)
        query = parse_qs(url.query)
        match = re.fullmatch(r"/api/v1(?:/namespaces/([^/]+))?/(\w+)(?:/([^/]+))?", url.path)
        watch = query.get("watch", [""])[0] in ("true", "1")
        verb = "get" if match and match.group(3) else "watch" if watch else "list"
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            status = 401
        elif not match or not self.allowed(verb, match.group(1), match.group(2)):
            status = 403
        else:
            status = 200
        self.requests.append((verb, url.path, status))
        if status != 200:
            body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                               "code": status, "reason": "Forbidden"}).encode()
            request.send_response(status)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(body)))
            request.end_headers()
            request.wfile.write(body)
            return
        if not watch:
            with self.lock:
                items = list(self.pods.values())
            body = json.dumps({"apiVersion": "v1", "kind": "PodList", "items": items,
                               "metadata": {"resourceVersion": str(self.version)}}).encode()
            request.send_response(200)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(body)))
            request.end_headers()
            request.wfile.write(body)
            return
        queue: list[dict[str, Any]] = []
        with self.lock:
            self.watches.append(queue)
        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Transfer-Encoding", "chunked")
        request.end_headers()
        deadline = time.monotonic() + float(query.get("timeoutSeconds", ["60"])[0])
        try:
            while time.monotonic() < deadline:
                with self.lock:
                    self.lock.wait_for(lambda: queue, timeout=1)
                    events, queue[:] = list(queue), []
                for event in events:
                    line = json.dumps(event).encode() + b"\n"
                    request.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                request.wfile.flush()
            request.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            with self.lock:
                self.watches.remove(queue)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class StandInReplica:
    """A replica's HTTP surface for the router (its /health, and a completion that reports what
    reached it): the discovery under test is the router's, and real replicas behind vllm-router
    are tested with bregman-serve by the router tests."""

    def __init__(self, host: str, port: int) -> None:
        self.seen: list[dict[str, Any]] = []
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def reply(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.reply({})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                replica.seen.append({"path": self.path, "body": body,
                                     "authorization": self.headers.get("Authorization")})
                self.reply({"id": "x", "object": "text_completion", "host": host,
                            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def running_router(argv: list[str], env: dict[str, str], log: Path) -> Iterator[None]:
    router = Path(sys.executable).with_name("vllm-router")
    with open(log, "wb") as out:
        process = subprocess.Popen([str(router), *argv], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_for(predicate: Any, what: str, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}; router log:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)


def test_router_discovers_the_ready_replicas_through_the_kubernetes_api(tmp_path: Path) -> None:
    """The real router, with the manifest's arguments (its ports, the pods' port and the
    listening addresses moved to free loopback ones), against the API stand-in."""
    found = resources()
    role = found[("Role", "vllm-router-pod-reader")]
    api = FakeKubernetesAPI(role, NAMESPACE, token="service-account-token")
    port = free_port()
    replicas = [StandInReplica(host, port) for host in ("127.0.0.2", "127.0.0.3", "127.0.0.4")]
    server_labels, router_labels = pod_labels("bregman-vllm"), pod_labels("vllm-router")
    api.send("ADDED", api.pod("bregman-vllm-a", "127.0.0.2", server_labels, ready=True))
    api.send("ADDED", api.pod("bregman-vllm-b", "127.0.0.3", server_labels, ready=False))
    api.send("ADDED", api.pod("vllm-router-x", "127.0.0.4", router_labels, ready=True))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": api.url}}],
        "users": [{"name": "router", "user": {"token": api.token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "router",
                                                  "namespace": NAMESPACE}}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = str(kubeconfig)
    router_port, metrics_port = free_port(), free_port()
    overrides = {"--host": "127.0.0.1", "--port": str(router_port),
                 "--service-discovery-port": str(port), "--prometheus-host": "127.0.0.1",
                 "--prometheus-port": str(metrics_port)}
    argv = router_argv()
    for flag, value in overrides.items():
        argv[argv.index(flag) + 1] = value
    url = f"http://127.0.0.1:{router_port}"
    log = tmp_path / "router.log"

    def workers() -> list[str]:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            return sorted(httpx.get(url + "/list_workers", timeout=2).json()["urls"])
        return ["(no answer)"]

    try:
        with running_router(argv, env, log):
            wait_for(lambda: workers() == [f"http://127.0.0.2:{port}"],
                     "the Ready replica pod, and only it, becomes a worker", log)
            response = httpx.post(url + "/v1/completions", timeout=30,
                                  headers={"Authorization": "Bearer client-key"},
                                  json={"model": "m", "prompt": "x", "bregman_top_k": 2})
            assert response.status_code == 200 and response.json()["host"] == "127.0.0.2"
            # cache_aware renders the prompt on a replica first (/v1/completions/render, a route
            # the middleware honours), then sends the completion: both with the client's key.
            assert [seen["path"] for seen in replicas[0].seen][-1] == "/v1/completions"
            for seen in replicas[0].seen:
                assert seen["authorization"] == "Bearer client-key", seen
                assert seen["body"]["bregman_top_k"] == 2, seen
            # The second replica becomes Ready: it joins.
            api.send("MODIFIED", api.pod("bregman-vllm-b", "127.0.0.3", server_labels,
                                         ready=True))
            wait_for(lambda: workers() == [f"http://127.0.0.2:{port}",
                                           f"http://127.0.0.3:{port}"],
                     "a replica that turns Ready joins", log)
            # The first is deleted (still Ready: its preStop runs): it leaves at once.
            deleted = api.pod("bregman-vllm-a", "127.0.0.2", server_labels, ready=True)
            deleted["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
            api.send("MODIFIED", deleted)
            wait_for(lambda: workers() == [f"http://127.0.0.3:{port}"],
                     "a deleted pod leaves before its server stops", log)
    finally:
        api.close()
        for replica in replicas:
            replica.close()
    assert not replicas[2].seen, "the router never routes to itself"
    assert {status for _, _, status in api.requests} == {200}, api.requests
    assert {(verb, path) for verb, path, _ in api.requests} == {
        ("list", f"/api/v1/namespaces/{NAMESPACE}/pods"),
        ("watch", f"/api/v1/namespaces/{NAMESPACE}/pods")}, "what the Role grants is used"
