"""The deployment files, checked offline: docker-compose.yml against the Compose
Specification's schema (after compose's own variable interpolation), the Kubernetes manifests
against Kubernetes' schemas and the KubeRay RayCluster against its CRD, every file and command
they name against the tree and the virtualenv, and the image's command run the way compose
configures it (auth on; refused without a token).

Nothing here is skipped: a missing schema, file or executable is a failure.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
KUBE_FILES = sorted((ROOT / "deploy" / "kuberay").glob("*.yaml"))
# KubeRay v1.7.0's RayCluster CRD, ray.io/v1 openAPIV3Schema (schemas/README.md).
RAYCLUSTER_SCHEMA = Path(__file__).parent / "schemas" / "kuberay-v1.7.0-raycluster-v1.json"
# The executables the deployment commands name come from the virtualenv running the tests.
BIN = Path(sys.executable).parent
KUBERNETES_VERSION = "1.33"
TOKEN = secrets.token_hex(16)  # 32 characters

# --- compose's variable interpolation (a port of compose-go's template package) -----------

_TEMPLATE = re.compile(
    r"\$(?i:(?P<escaped>\$)|(?P<named>[_a-z][_a-z0-9]*)"
    r"|\{(?:(?P<braced>[_a-z][_a-z0-9]*(?::?[-+?](.*))?)\}|(?P<invalid>)))"
)
_OPERATORS = (":?", "?", ":-", "-", ":+", "+")


class InterpolationError(Exception):
    pass


def substitute(template: str, env: Mapping[str, str]) -> str:
    """`template` with `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR:?error}`, ... replaced
    as `docker compose` does; a missing required variable raises with compose's message."""
    return _TEMPLATE.sub(lambda match: _replace(match.group(0), env), template)


def _replace(text: str, env: Mapping[str, str]) -> str:
    # The operator is chosen on the whole match, then the match is cut at the brace that
    # closes `${` (the pattern is greedy) and what follows is interpolated on its own.
    operator = min((op for op in _OPERATORS if op in text), key=text.index, default=None)
    rest = ""
    close = _closing_brace(text)
    if close > -1:
        text, rest = text[: close + 1], text[close + 1 :]
    match = _TEMPLATE.match(text)
    assert match is not None
    if match["escaped"]:
        return "$"
    if match["named"]:
        return env.get(match["named"], "")
    expression = match["braced"]
    if not expression:
        raise InterpolationError(f"invalid interpolation format: {text!r}")
    if operator is None or operator not in expression:
        return env.get(expression, "")
    name, _, argument = expression.partition(operator)
    value = env.get(name)
    if operator in (":?", "?"):
        if value is None or (operator == ":?" and value == ""):
            reason = substitute(argument, env)
            raise InterpolationError(f"required variable {name} is missing a value: {reason}")
    elif operator in (":-", "-"):
        if value is None or (operator == ":-" and value == ""):
            value = substitute(argument, env)
    elif value is not None and (operator == "+" or value != ""):
        value = substitute(argument, env)
    return (value or "") + substitute(rest, env)


def _closing_brace(text: str) -> int:
    depth = 0
    i = 0
    while i < len(text):
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        if text[i] == "{":
            depth += 1
            i += 1
        i += 1
    return -1


def interpolate(node: Any, env: Mapping[str, str]) -> Any:
    """Every string value of a parsed compose file interpolated (keys are left alone)."""
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(value, env) for value in node]
    if isinstance(node, str):
        return substitute(node, env)
    return node


def load_compose(env: Mapping[str, str]) -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())  # resolves the `<<:` merge keys, as compose
    loaded: dict[str, Any] = interpolate(raw, env)
    return loaded


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """docker-compose.yml as `ELASTRAIN_API_TOKEN=<32 chars> docker compose config` sees it."""
    return load_compose({"ELASTRAIN_API_TOKEN": TOKEN})


def compose_schema() -> dict[str, Any]:
    # The Compose Specification's schema as check-jsonschema vendors it (Apache-2.0).
    text = (
        resources.files("check_jsonschema.builtin_schemas.vendor")
        .joinpath("compose-spec.json")
        .read_text()
    )
    schema: dict[str, Any] = json.loads(text)
    return schema


def schema_errors(schema: dict[str, Any], document: Any) -> list[str]:
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema)
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in validator.iter_errors(document)
    ]


def test_interpolation_matches_compose() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert substitute("a$$b ${SET} $SET ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d}", env) == "a$b x x d d "
    assert (
        substitute("${SET:+alt} ${EMPTY:+alt} ${EMPTY+alt} ${UNSET:-${SET}}", env) == "alt  alt x"
    )
    assert substitute("${SET:?no} $(not a variable)", env) == "x $(not a variable)"
    with pytest.raises(InterpolationError, match="required variable EMPTY is missing a value: no"):
        substitute("${EMPTY:?no}", env)
    with pytest.raises(InterpolationError, match="invalid interpolation"):
        substitute("${-x}", env)


# --- a. docker-compose.yml -------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, ""], ids=["unset", "empty"])
def test_compose_refuses_to_start_without_a_token(token: str | None) -> None:
    env = {} if token is None else {"ELASTRAIN_API_TOKEN": token}
    with pytest.raises(InterpolationError, match="ELASTRAIN_API_TOKEN") as refused:
        load_compose(env)
    # The message tells the operator how to make one.
    assert "openssl rand" in str(refused.value)
    # ... and the header comment says to export it first.
    header = COMPOSE_FILE.read_text().partition("\nx-")[0]
    assert "export ELASTRAIN_API_TOKEN=" in header


def test_compose_file_matches_the_compose_specification(compose: dict[str, Any]) -> None:
    assert schema_errors(compose_schema(), compose) == []


def test_compose_schema_refuses_what_compose_refuses(compose: dict[str, Any]) -> None:
    """The schema is the real, closed one: a misspelt key or a value of the wrong type fails."""
    misspelt = json.loads(json.dumps(compose))
    misspelt["services"]["elastrain"]["enviroment"] = {}
    misspelt["services"]["ray-head"]["ports"] = "127.0.0.1:8265:8265"  # not a list
    errors = schema_errors(compose_schema(), misspelt)
    assert any("enviroment" in error for error in errors), errors
    assert any(error.startswith("services/ray-head/ports") for error in errors), errors


def test_compose_configures_auth_and_logging(compose: dict[str, Any]) -> None:
    env = compose["services"]["elastrain"]["environment"]
    assert env["ELASTRAIN_API_TOKEN"] == TOKEN
    assert {"localhost", "127.0.0.1", "elastrain"} <= set(env["ELASTRAIN_ALLOWED_HOSTS"].split(","))
    assert env["ELASTRAIN_LOG_FORMAT"] == "json"
    assert env["ELASTRAIN_STORAGE_PATH"] == "/shared/elastrain"  # merged in from the anchor


def _published_host_ip(port: str | dict[str, Any]) -> str:
    """The host address a `ports:` entry binds ("" for every interface)."""
    if isinstance(port, dict):
        return str(port.get("host_ip", ""))
    spec = str(port).partition("/")[0]
    if spec.startswith("["):
        return spec[1 : spec.index("]")]
    parts = spec.split(":")
    return parts[0] if len(parts) == 3 else ""


def test_compose_publishes_only_the_authenticated_port_beyond_loopback(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    for name, service in services.items():
        for port in service.get("ports", []):
            if name == "elastrain":
                continue  # token required
            assert _published_host_ip(port) in ("127.0.0.1", "::1"), (name, port)
    assert "ports" not in services["postgres"]
    # PostgreSQL's networks are internal and shared only with the control plane: the Ray
    # nodes (which run job code) cannot reach the database.
    for network in _networks(services["postgres"]):
        assert compose.get("networks", {}).get(network, {}).get("internal") is True, network
        reach = {name for name, service in services.items() if network in _networks(service)}
        assert reach == {"postgres", "elastrain"}, network


def _networks(service: dict[str, Any]) -> set[str]:
    return set(service.get("networks") or ["default"])  # a list, or a mapping of names


# --- b. Kubernetes manifests -----------------------------------------------------------------


def kube_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    assert KUBE_FILES, "no manifests under deploy/kuberay"
    for path in KUBE_FILES:
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                yield f"{path.name}:{document['kind']}/{document['metadata']['name']}", document


KUBE_DOCUMENTS = dict(kube_documents())


def _closed(schema: Any) -> Any:
    """`schema` refusing unknown fields, as `kubectl apply` (strict field validation) does
    for a structural CRD schema; fields marked x-kubernetes-preserve-unknown-fields stay open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {key: _closed(value) for key, value in out["properties"].items()}
        if "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [_closed(item) for item in out[key]]
    return out


@functools.cache
def raycluster_schema() -> dict[str, Any]:
    schema: dict[str, Any] = _closed(json.loads(RAYCLUSTER_SCHEMA.read_text()))
    return schema


def raycluster_errors(document: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(raycluster_schema())  # OpenAPI v3 ~ draft 4
    return [
        f"{'/'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(document)
    ]


def pod_templates(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document["spec"]
    if document["kind"] == "RayCluster":
        groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
        return [group["template"] for group in groups]
    if "template" in spec:
        return [spec["template"]]
    return []


@pytest.mark.parametrize("name", KUBE_DOCUMENTS)
def test_manifest_matches_the_kubernetes_schemas(name: str) -> None:
    document = KUBE_DOCUMENTS[name]
    if document["apiVersion"].startswith("ray.io/"):
        assert document["apiVersion"] == "ray.io/v1", "the vendored CRD schema is ray.io/v1"
        assert document["kind"] == "RayCluster"
        assert raycluster_errors(document) == []
        # The CRD embeds a pod template without Kubernetes' own checks: run those too.
        for template in pod_templates(document):
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate"}
            pod_template |= {"metadata": {"name": "t"}, "template": template}
            kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)
    else:
        # Raises (failing the test) on an error, and on a kind it has no schema for.
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_schemas_refuse_unknown_fields() -> None:
    """Neither check passes a document vacuously: a misspelt field fails both."""
    (raycluster,) = [d for d in KUBE_DOCUMENTS.values() if d["kind"] == "RayCluster"]
    misspelt = json.loads(json.dumps(raycluster))
    misspelt["spec"]["headGroupSpec"]["rayStartParam"] = {}
    assert any("rayStartParam" in error for error in raycluster_errors(misspelt))
    (deployment,) = [d for d in KUBE_DOCUMENTS.values() if d["kind"] == "Deployment"]
    misspelt = json.loads(json.dumps(deployment))
    misspelt["spec"]["template"]["spec"]["containers"][0]["enviroment"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="enviroment"):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)


def _container_env(container: dict[str, Any], namespace: str) -> dict[str, Any]:
    """name -> value (or valueFrom), with `$(VAR)` expanded as the kubelet does."""
    env: dict[str, Any] = {}
    for var in container.get("env", []):
        if "valueFrom" in var:
            field = var["valueFrom"].get("fieldRef", {}).get("fieldPath")
            env[var["name"]] = namespace if field == "metadata.namespace" else var["valueFrom"]
        else:
            env[var["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: str(env.get(m[1], m[0])), var["value"]
            )
    return env


def test_elastrain_deployment_takes_its_token_from_a_secret() -> None:
    (deployment,) = [d for d in KUBE_DOCUMENTS.values() if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = _container_env(container, namespace="ml")
    secret = env["ELASTRAIN_API_TOKEN"]["secretKeyRef"]
    assert (secret["name"], secret["key"]) == ("elastrain-api", "token")
    assert not secret.get("optional"), "a missing Secret must stop the pod, not turn auth off"
    assert env["ELASTRAIN_LOG_FORMAT"] == "json"
    # How to make that Secret is written down next to it.
    text = (ROOT / "deploy" / "kuberay" / "elastrain.yaml").read_text()
    assert "kubectl create secret generic elastrain-api --from-literal=token=" in text

    services = [d for d in KUBE_DOCUMENTS.values() if d["kind"] == "Service"]
    (service,) = [s for s in services if s["spec"]["selector"] == {"app": "elastrain"}]
    name = service["metadata"]["name"]
    allowed = env["ELASTRAIN_ALLOWED_HOSTS"].split(",")
    for dns_name in (name, f"{name}.ml", f"{name}.ml.svc", f"{name}.ml.svc.cluster.local"):
        assert dns_name in allowed
    # The kubelet's probes send the pod IP as Host unless told otherwise: it must be allowed.
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if "httpGet" in container.get(probe, {}):
            headers = container[probe]["httpGet"].get("httpHeaders", [])
            hosts = [h["value"] for h in headers if h["name"].lower() == "host"]
            assert hosts and hosts[0] in allowed, f"{probe} would be refused by the host check"


def test_ray_is_not_exposed_outside_the_cluster() -> None:
    for name, document in KUBE_DOCUMENTS.items():
        if document["kind"] == "Service":
            assert document["spec"].get("type", "ClusterIP") == "ClusterIP", name
        if document["kind"] == "RayCluster":
            head = document["spec"]["headGroupSpec"]
            assert head.get("serviceType", "ClusterIP") == "ClusterIP", name
            assert not head.get("enableIngress"), name


# --- c. files and commands named ---------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    logical = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in logical.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, arguments = line.partition(" ")
            out.append((instruction.upper(), arguments.strip()))
    return out


def copy_sources() -> list[str]:
    sources: list[str] = []
    for instruction, arguments in dockerfile_instructions():
        if instruction not in ("COPY", "ADD"):
            continue
        words = json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)
        flags = [w for w in words if w.startswith("--")]
        if any(flag.startswith("--from") for flag in flags):
            continue  # from another stage, not the build context
        sources += [w for w in words if not w.startswith("--")][:-1]
    return sources


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_compose_build_context_and_dockerfile_exist(compose: dict[str, Any]) -> None:
    builds = [s["build"] for s in compose["services"].values() if "build" in s]
    assert builds
    for build in builds:
        context = ROOT / build["context"]
        assert context.is_dir(), build
        assert (context / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE


def test_every_copy_source_exists() -> None:
    sources = copy_sources()
    assert sources
    for source in sources:
        assert list(ROOT.glob(source)), f"COPY {source}: not in the build context"


def test_the_image_gets_every_package_and_extra() -> None:
    project = pyproject()
    sources = {source.rstrip("/") for source in copy_sources()}
    includes = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*").rstrip(".") for pattern in includes}
    # `elastrain/` links to the repository's top-level folders: the image needs both.
    linked = {p.name for p in (ROOT / "elastrain").iterdir() if p.is_symlink()}
    assert linked == {"api", "contracts", "service", "workers", "checkpoints"}
    assert (packages | linked) - sources == set(), (
        "packages pyproject.toml installs but the image lacks"
    )
    for package in packages | {f"elastrain/{name}" for name in linked}:
        assert (ROOT / package / "__init__.py").is_file(), package
    assert {"pyproject.toml", project["project"]["readme"]} <= sources
    extras = set(project["project"]["optional-dependencies"])
    for instruction, arguments in dockerfile_instructions():
        if instruction == "RUN":
            for named in re.findall(r"\.\[([\w,-]+)\]", arguments):
                assert set(named.split(",")) <= extras, arguments


def deployment_commands() -> dict[str, list[str]]:
    """Every command line the deployment files run, as argv."""
    commands: dict[str, list[str]] = {}
    (cmd,) = [args for instruction, args in dockerfile_instructions() if instruction == "CMD"]
    assert cmd.startswith("["), "CMD in exec form: signals reach the service, not a shell"
    commands["Dockerfile:CMD"] = json.loads(cmd)
    for name, service in load_compose({"ELASTRAIN_API_TOKEN": TOKEN})["services"].items():
        if "command" in service:
            command = service["command"]
            argv = shlex.split(command) if isinstance(command, str) else command
            commands[f"docker-compose.yml:{name}"] = argv
    for name, document in KUBE_DOCUMENTS.items():
        if document["kind"] == "RayCluster":
            # KubeRay runs `ray start` with rayStartParams as --key=value.
            spec = document["spec"]
            groups = {"head": spec["headGroupSpec"]}
            groups |= {g["groupName"]: g for g in spec.get("workerGroupSpecs", [])}
            for group_name, group in groups.items():
                argv = ["ray", "start", "--head" if group_name == "head" else "--address=x"]
                argv += [f"--{k}={v}" for k, v in group.get("rayStartParams", {}).items()]
                commands[f"{name}:{group_name}"] = argv
        for template in pod_templates(document):
            for container in template["spec"]["containers"]:
                if "command" in container:
                    argv = container["command"] + container.get("args", [])
                    commands[f"{name}:{container['name']}"] = argv
    return commands


COMMANDS = deployment_commands()


@functools.cache
def help_text(executable: str, subcommand: str) -> str:
    done = subprocess.run(
        [str(BIN / executable), subcommand, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"},
    )
    assert done.returncode == 0, f"{executable} {subcommand} --help: {done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.parametrize("where", COMMANDS)
def test_command_resolves_in_the_virtualenv(where: str) -> None:
    argv = COMMANDS[where]
    executable = BIN / argv[0]
    assert os.access(executable, os.X_OK), f"{argv[0]} is not in {BIN}"
    text = help_text(argv[0], argv[1])
    for option in (word.partition("=")[0] for word in argv[2:] if word.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), (
            f"{argv[0]} {argv[1]} has no option {option}"
        )


# --- d. the image's command, configured as compose configures it ---------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def service_env(compose: dict[str, Any], tmp_path: Path) -> dict[str, str]:
    """compose's environment for the elastrain service, on a SQLite file and without Ray."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTRAIN_", "RAY_"))}
    env |= {k: str(v) for k, v in compose["services"]["elastrain"]["environment"].items()}
    env["ELASTRAIN_DATABASE_URL"] = f"sqlite:///{tmp_path / 'elastrain.db'}"
    env["ELASTRAIN_STORAGE_PATH"] = str(tmp_path / "storage")
    del env["ELASTRAIN_RAY_ADDRESS"]
    return env


def image_command(port: int) -> list[str]:
    argv = COMMANDS["Dockerfile:CMD"]
    return [str(BIN / argv[0]), *argv[1:], "--port", str(port), "--no-scheduler"]


def test_image_command_refuses_to_serve_without_a_token(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    env = service_env(compose, tmp_path)
    env.pop("ELASTRAIN_API_TOKEN", None)
    done = subprocess.run(
        image_command(_free_port()), env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "refusing" in done.stderr


def test_image_command_serves_with_auth_on(compose: dict[str, Any], tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            image_command(port),
            env=service_env(compose, tmp_path),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            deadline = time.monotonic() + 30
            while True:
                assert server.poll() is None, f"exited {server.returncode}: {log.read_text()}"
                assert time.monotonic() < deadline, f"never answered: {log.read_text()}"
                try:
                    health = client.get("/healthz")
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            assert health.status_code == 200, health.text
            assert client.get("/v1/jobs").status_code == 401
            wrong = {"Authorization": f"Bearer {secrets.token_hex(16)}"}
            assert client.get("/v1/jobs", headers=wrong).status_code == 401
            right = {"Authorization": f"Bearer {TOKEN}"}
            jobs = client.get("/v1/jobs", headers=right)
            assert jobs.status_code == 200, jobs.text
            # ELASTRAIN_ALLOWED_HOSTS as compose sets it: the service name is answered,
            # another name is not.
            assert client.get("/healthz", headers={"Host": "elastrain:8000"}).status_code == 200
            assert client.get("/healthz", headers={"Host": "evil.example"}).status_code == 400
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    # ELASTRAIN_LOG_FORMAT=json: every line the service logged is one JSON object.
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert lines
    for line in lines:
        assert isinstance(json.loads(line), dict), line
