"""docker-compose.yml, docker/Dockerfile and docker/nginx.conf.

- The compose file's structure (PyYAML; always runs).
- ``docker compose config`` (skipped when the docker compose plugin is absent; no engine needed).
- nginx.conf through a real nginx (skipped without the nginx binary): SSE is not buffered and
  WebSocket upgrades pass through.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib

import pytest
import yaml   # PyYAML comes with gguf, a pinned dependency
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(120)

COMPOSE = ROOT / "docker-compose.yml"
NGINX_CONF = ROOT / "docker" / "nginx.conf"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
KAITEN_SERVICES = {"model-init", "tokenizer", "engine", "engine-cpu", "gateway"}
MONITORING = ROOT / "docker" / "monitoring"


def _cmd_text(test) -> str:
    return " ".join(test) if isinstance(test, list) else str(test)


def check_config(cfg: dict) -> None:
    """Assertions shared by the raw file and `docker compose config`'s normalized output."""
    services = cfg["services"]
    assert {"redis", "tokenizer", "engine", "engine-cpu", "gateway", "nginx"} <= set(services)

    # Ports: only nginx (and the monitoring profile's UIs) publish one; the gateway must not (so
    # --scale gateway=3 works).
    for name, svc in services.items():
        if name not in ("nginx", "prometheus", "grafana"):
            assert not svc.get("ports"), f"{name} publishes a host port"
    assert services["nginx"]["ports"], "nginx publishes no port"
    assert "8000" in json.dumps(services["gateway"].get("expose", []))

    # Healthchecks.
    for name in ("redis", "tokenizer", "engine", "engine-cpu", "gateway", "nginx"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    assert "/ready" in _cmd_text(services["gateway"]["healthcheck"]["test"])
    assert "/health" in _cmd_text(services["tokenizer"]["healthcheck"]["test"])
    assert "shared.healthcheck engine" in _cmd_text(services["engine"]["healthcheck"]["test"])

    # GPU reservation on the engine, a CPU engine in the cpu profile.
    devices = services["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)
    assert services["engine"]["profiles"] == ["gpu"]
    assert services["engine-cpu"]["profiles"] == ["cpu"]
    assert "deploy" not in services["engine-cpu"]
    assert services["engine-cpu"]["environment"]["KAITEN_DEVICE"] == "cpu"
    assert services["engine"]["environment"]["KAITEN_DEVICE"] == "cuda"
    # Three images, each a build target of docker/Dockerfile: the slim one (no torch) for the gateway,
    # the tokenizer service and model-init; the CPU engine's with CPU torch; the GPU engine's on a CUDA
    # base with the flash-attn extra.
    for name in ("gateway", "tokenizer", "model-init"):
        assert services[name]["image"] == "kaiten:latest", name
        assert services[name]["build"]["target"] == "slim", name
        assert not {"TORCH_INDEX_URL", "EXTRAS", "FIND_LINKS"} & set(services[name]["build"]["args"]), name
    gpu, cpu = services["engine"]["build"], services["engine-cpu"]["build"]
    assert services["engine"]["image"] == "kaiten-gpu:latest" and gpu["target"] == "engine"
    assert gpu["args"]["EXTRAS"] == "gpu" and gpu["args"]["ENGINE_DEVICE"] == "cuda"
    assert "cuda" in gpu["args"]["BASE_IMAGE"]
    assert services["engine-cpu"]["image"] == "kaiten-cpu:latest" and cpu["target"] == "engine"
    assert cpu["args"]["ENGINE_DEVICE"] == "cpu" and "EXTRAS" not in cpu["args"]
    assert "download.pytorch.org/whl/cpu" in cpu["args"]["TORCH_INDEX_URL"]     # the CPU torch wheel
    assert "download.pytorch.org" not in gpu["args"].get("TORCH_INDEX_URL", "")   # PyPI's CUDA torch

    # All configuration from the environment.
    for name in KAITEN_SERVICES & set(services):
        env = services[name]["environment"]
        assert env["REDIS_URL"] in ("redis://redis:6379/0", "${KAITEN_REDIS_URL:-redis://redis:6379/0}"), name
        assert env["KAITEN_MODELS_DIR"] == "/models", name
    # Prompts tokenized in-process unless KAITEN_TOKENIZER_URL names the (optional) tokenizer service.
    assert services["gateway"]["environment"].get("TOKENIZER_URL") in (None, "", "${KAITEN_TOKENIZER_URL:-}")
    assert services["tokenizer"]["profiles"] == ["tokenizer"]
    assert services["gateway"]["environment"]["KAITEN_HOST"] == "0.0.0.0"
    assert services["gateway"]["environment"]["KAITEN_ROUTING"] in ("prefix", "${KAITEN_ROUTING:-prefix}")
    assert services["tokenizer"]["environment"]["KAITEN_HOST"] == "0.0.0.0"

    # Commands.
    for name, sub in (("tokenizer", "tokenizer"), ("engine", "engine"), ("engine-cpu", "engine"),
                      ("gateway", "gateway"), ("model-init", "convert")):
        assert services[name]["command"][0] == sub, name


def check_monitoring(cfg: dict) -> None:
    """The monitoring profile: Prometheus scrapes the engines' own /metrics port and the gateways'
    (by service name, so replicas are found); Grafana gets the datasource and the dashboard."""
    services = cfg["services"]
    assert services["prometheus"]["profiles"] == ["monitoring"] and services["grafana"]["profiles"] == ["monitoring"]
    for name in ("engine", "engine-cpu", "engine-cpu-2"):
        if name not in services:                 # `docker compose config` drops inactive profiles
            continue
        env = services[name]["environment"]
        assert (env["KAITEN_METRICS_HOST"], str(env["KAITEN_METRICS_PORT"])) == ("0.0.0.0", "8002"), name
        assert "8002" in json.dumps(services[name].get("expose", [])), name
    mounts = json.dumps(services["prometheus"]["volumes"]) + json.dumps(services["grafana"]["volumes"])
    for path in ("docker/monitoring/prometheus.yml", "docker/monitoring/grafana/provisioning",
                 "docker/monitoring/grafana/dashboards"):
        assert path in mounts, path
    for name in ("prometheus", "grafana"):
        assert services[name].get("healthcheck", {}).get("test"), name

    prom = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    sd = {name: (j["dns_sd_configs"][0]["names"], j["dns_sd_configs"][0]["port"]) for name, j in jobs.items()}
    assert sd == {"kaiten-gateway": (["gateway"], 8000), "kaiten-engine": (["engine", "engine-cpu", "engine-cpu-2"], 8002)}
    ds = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert [(d["uid"], d["url"]) for d in ds] == [("kaiten-prometheus", "http://prometheus:9090")]
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/kaiten.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def check_ha(cfg: dict) -> None:
    """The ha profile: two replicas of `redis` and three sentinels watching it (quorum 2, the
    primary down after 1 s), each with a healthcheck; no host port."""
    services = cfg["services"]
    replicas, sentinels = ["redis-replica-1", "redis-replica-2"], ["sentinel-1", "sentinel-2", "sentinel-3"]
    for name in replicas + sentinels:
        assert services[name]["profiles"] == ["ha"] and services[name].get("healthcheck", {}).get("test"), name
        assert not services[name].get("ports"), name
    for name in replicas:
        assert "--replicaof redis 6379" in _cmd_text(services[name]["command"]), name
    for name in sentinels:
        cmd = _cmd_text(services[name]["command"])
        assert "--sentinel monitor kaiten redis 6379 2" in cmd and "down-after-milliseconds kaiten 1000" in cmd
        assert "--sentinel" in _cmd_text(services[name]["entrypoint"]) and "26379" in _cmd_text(
            services[name]["healthcheck"]["test"])


def test_compose_file_structure():
    cfg = yaml.safe_load(COMPOSE.read_text())
    check_config(cfg)
    check_monitoring(cfg)
    check_ha(cfg)
    check_second_model(cfg)
    assert "models" in cfg["volumes"]


def check_second_model(cfg: dict) -> None:
    """Profile second-model: another model with its own CPU engine pool, converted by its own
    model-init; the gateways find it in its engines' heartbeats."""
    services = cfg["services"]
    engine, init = services["engine-cpu-2"], services["model-init-2"]
    assert engine["profiles"] == init["profiles"] == ["second-model"]
    env = engine["environment"]
    assert env["KAITEN_MODEL"] == init["environment"]["KAITEN_MODEL"] == "${KAITEN_MODEL_2:-}"
    assert env["KAITEN_SERVED_MODEL_NAME"] == "${KAITEN_SERVED_MODEL_NAME_2:-second}"
    assert engine["command"] == ["engine"] and init["command"] == ["convert"]
    assert "model-init-2" in engine["depends_on"] and "shared.healthcheck engine" in _cmd_text(
        engine["healthcheck"]["test"])


def _compose_cmd() -> list[str] | None:
    """`docker compose` (v2 plugin) where present, else Debian's `docker-compose` (v1.29); both parse
    the file without a Docker engine."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def _published(port) -> tuple[str, str]:
    """(host ip, host port) of a normalized port: v2 writes a mapping, v1 "IP:PORT:TARGET/tcp"."""
    if isinstance(port, dict):
        return port.get("host_ip", ""), str(port["published"])
    ip, published, _ = port.rsplit(":", 2)
    return ip, published


def test_docker_compose_config(tmp_path):
    compose = _compose_cmd()
    if compose is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (scripts/setup.sh installs "
                    "Debian's docker-compose); the structural checks ran in test_compose_file_structure")
    base = [*compose, "--project-directory", str(ROOT), "-f", str(COMPOSE)]
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(tmp_path)}

    def config(*args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run([*base, *args], capture_output=True, text=True, env={**env, **(extra_env or {})},
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out

    def active(cfg: dict, profiles: set[str]) -> set[str]:
        # v2 drops inactive services from `config`; v1 keeps them with their `profiles`.
        return {n for n, svc in cfg["services"].items() if not svc.get("profiles") or set(svc["profiles"]) & profiles}

    both = yaml.safe_load(config("--profile", "cpu", "--profile", "gpu", "--profile", "tokenizer", "config").stdout)
    check_config(both)
    # Each engine has its profile: `--profile cpu up` starts no GPU engine, and no profile starts neither.
    # The tokenizer service is optional (profile tokenizer): gateways tokenize in-process.
    with_cpu = active(yaml.safe_load(config("--profile", "cpu", "config").stdout), {"cpu"})
    assert {"engine-cpu", "gateway", "redis", "nginx"} <= with_cpu and not {"engine", "tokenizer"} & with_cpu
    with_gpu = active(yaml.safe_load(config("--profile", "gpu", "config").stdout), {"gpu"})
    assert "engine" in with_gpu and "engine-cpu" not in with_gpu
    default = active(yaml.safe_load(config("config").stdout), set())
    assert {"gateway", "redis", "nginx"} <= default and not {"engine", "engine-cpu", "tokenizer"} & default
    with_tok = active(yaml.safe_load(config("--profile", "tokenizer", "config").stdout), {"tokenizer"})
    assert {"tokenizer", "gateway"} <= with_tok and not {"engine", "engine-cpu"} & with_tok
    assert not {"prometheus", "grafana"} & default
    # --profile monitoring adds Prometheus and Grafana, on 127.0.0.1 unless told otherwise.
    monitored = yaml.safe_load(config("--profile", "cpu", "--profile", "monitoring", "config").stdout)
    assert {"prometheus", "grafana", "engine-cpu"} <= active(monitored, {"cpu", "monitoring"})
    check_monitoring(monitored)
    svc = monitored["services"]
    assert svc["prometheus"]["image"].startswith("prom/prometheus:")
    assert svc["grafana"]["image"].startswith("grafana/grafana:")
    assert _published(svc["prometheus"]["ports"][0]) == ("127.0.0.1", "9090")
    assert _published(svc["grafana"]["ports"][0]) == ("127.0.0.1", "3000")
    svc = yaml.safe_load(config("--profile", "monitoring", "config", extra_env={
        "PROMETHEUS_IMAGE": "kaiten-local/prometheus:2", "GRAFANA_IMAGE": "kaiten-local/grafana:11",
        "KAITEN_GRAFANA_PORT": "3111"}).stdout)["services"]
    assert (svc["prometheus"]["image"], svc["grafana"]["image"]) == ("kaiten-local/prometheus:2",
                                                                     "kaiten-local/grafana:11")
    assert _published(svc["grafana"]["ports"][0]) == ("127.0.0.1", "3111")
    # --profile ha adds the replicas and sentinels; KAITEN_REDIS_URL points every service at them.
    sentinel_url = "redis+sentinel://sentinel-1:26379,sentinel-2:26379,sentinel-3:26379/kaiten/0"
    ha = yaml.safe_load(config("--profile", "cpu", "--profile", "ha", "config",
                               extra_env={"KAITEN_REDIS_URL": sentinel_url}).stdout)
    check_ha(ha)
    for name in ("gateway", "engine-cpu", "model-init"):
        assert ha["services"][name]["environment"]["REDIS_URL"] == sentinel_url, name
    assert not {"sentinel-1", "redis-replica-1"} & default
    # Environment overrides reach the services.
    cfg = yaml.safe_load(config("--profile", "gpu", "config", extra_env={"KAITEN_HTTP_PORT": "9123",
                                                                       "KAITEN_KV_CACHE_MEMORY": "3GiB"}).stdout)
    assert cfg["services"]["engine"]["environment"]["KAITEN_KV_CACHE_MEMORY"] == "3GiB"
    logs = yaml.safe_load(config("--profile", "cpu", "--profile", "tokenizer", "config",
                                 extra_env={"KAITEN_LOG_FORMAT": "json", "KAITEN_LOG_LEVEL": "WARNING"}).stdout)
    for name in ("gateway", "engine-cpu", "tokenizer", "model-init"):
        env = logs["services"][name]["environment"]
        assert (env["KAITEN_LOG_FORMAT"], env["KAITEN_LOG_LEVEL"]) == ("json", "WARNING"), name
    assert _published(cfg["services"]["nginx"]["ports"][0]) == ("0.0.0.0", "9123")
    # Official images by default; scripts/compose-check.sh's local stand-ins and wheels by variable.
    svc = cfg["services"]
    assert svc["redis"]["image"] == "redis:7-alpine" and svc["nginx"]["image"].startswith("nginx:")
    assert svc["gateway"]["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim"
    cpu = yaml.safe_load(config("--profile", "cpu", "config").stdout)["services"]["engine-cpu"]["build"]["args"]
    assert not cpu["FIND_LINKS"] and cpu["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert cpu["BASE_IMAGE"] == "python:3.11-slim"
    local = {"REDIS_IMAGE": "kaiten-local/redis:7", "NGINX_IMAGE": "kaiten-local/nginx:1.22",
             "PYTHON_IMAGE": "kaiten-local/python:3.11", "KAITEN_FIND_LINKS": "/wheels",
             "KAITEN_HTTP_HOST": "127.0.0.1"}
    svc = yaml.safe_load(config("--profile", "cpu", "--profile", "tokenizer", "config", extra_env=local).stdout)["services"]
    assert svc["redis"]["image"] == "kaiten-local/redis:7" and svc["nginx"]["image"] == "kaiten-local/nginx:1.22"
    for name in ("gateway", "engine-cpu", "tokenizer", "model-init"):
        assert svc[name]["build"]["args"]["BASE_IMAGE"] == "kaiten-local/python:3.11", name
    assert svc["engine-cpu"]["build"]["args"]["FIND_LINKS"] == "/wheels"
    assert _published(svc["nginx"]["ports"][0])[0] == "127.0.0.1"


def _stages(text: str) -> dict[str, str]:
    """Each build stage's instructions (no comments) by its name (FROM ... AS name)."""
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    parts = re.split(r"^FROM \S+ AS (\w+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _install_deps():
    spec = importlib.util.spec_from_file_location("install_deps", ROOT / "docker" / "install_deps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dockerfile_matches_the_package():
    text = DOCKERFILE.read_text()
    install_deps = (ROOT / "docker" / "install_deps.py").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    stages = _stages(text)
    assert list(stages) == ["base", "src", "slim", "torch", "engine"]
    assert torch_pin in stages["torch"], f"{torch_pin} not pinned in the torch stage"
    # Every package goes into the src stage's tree, and both images copy that tree.
    for pkg in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        pkg = pkg.rstrip("*")
        assert re.search(rf"^COPY {pkg} /app/{pkg}$", stages["src"], re.M), f"the src stage does not copy {pkg}/"
    for image in ("slim", "engine"):
        assert "COPY --from=src /app ./" in stages[image], f"the {image} image does not copy the sources"
        assert 'ENTRYPOINT ["kaiten"]' in stages[image] and "USER kaiten" in stages[image]
    # The slim image installs no torch and no compiler; the engine copies the torch stage's venv,
    # so the local wheels (COPY docker/wheels/) stay in the torch stage.
    assert "torch" not in stages["slim"] and "g++" not in stages["slim"]
    assert "RUN python install_deps.py slim" in stages["slim"]
    assert "COPY --from=torch /opt/venv /opt/venv" in stages["engine"] and "install_deps.py engine" in stages["engine"]
    assert "COPY docker/wheels/ /wheels/" in stages["torch"] and "/wheels" not in stages["engine"]
    # The CPU engine image carries the C++ CPU ops built, after the package is installed.
    engine = stages["engine"]
    assert "kaiten kernels" in engine and engine.index("kaiten kernels") > engine.index("pip install --no-deps .")
    # EXTRAS (the GPU image's flash-attn) come from pyproject's optional dependencies, installed
    # with the other dependencies: the package itself goes in with --no-deps, which skips extras.
    assert 'project["optional-dependencies"][e]' in install_deps and 'os.environ.get("EXTRAS"' in install_deps
    # The classic builder (no BuildKit) builds it too: no heredocs, no syntax frontend from Docker Hub.
    assert "<<" not in text and "# syntax=" not in text and "--mount" not in text
    # Local wheels only with FIND_LINKS; by default torch comes from the index.
    assert re.search(r'^ARG FIND_LINKS=""$', stages["torch"], re.M) and 'if [ -n "$FIND_LINKS" ]' in stages["torch"]


def test_image_dependencies():
    """The slim image gets every dependency but the engine's; the engine image every one."""
    module = _install_deps()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    slim = {module.name(d) for d in module.requirements("slim", project)}
    engine = {module.name(d) for d in module.requirements("engine", project)}
    assert not {"torch", "xgrammar", "ninja"} & slim
    assert {"starlette", "uvicorn", "redis", "msgpack", "transformers", "jinja2", "gguf", "prometheus-client"} <= slim
    assert engine == {module.name(d) for d in project["dependencies"]} - {"torch"}
    # Every pin survives as written.
    assert set(module.requirements("engine", project)) <= set(project["dependencies"])


def test_slim_image_modules_import_no_engine_dependency():
    """What the slim image runs (gateway, tokenizer service, healthchecks, conversion, the CLI)
    imports neither torch nor xgrammar, triton or ninja: the image has none of them."""
    code = ("import sys, gateway.app, gateway.core, tokenizer_service.service, shared.healthcheck, shared.cli, "
            "shared.model_source, shared.gguf_convert, shared.launcher; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'xgrammar', 'triton', 'ninja'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_nginx_conf_directives():
    text = NGINX_CONF.read_text()
    for needle in ("proxy_buffering off", "proxy_request_buffering off", "proxy_http_version 1.1",
                   "proxy_set_header Upgrade $http_upgrade", "proxy_set_header Connection $connection_upgrade",
                   "http://gateway:8000", "proxy_read_timeout", "resolver 127.0.0.11"):
        assert needle in text, needle


# ---------------------------------------------------------------------- nginx, for real
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(port: int):
    """A stand-in gateway: SSE with pauses between events, a WebSocket echo, /health."""
    import asyncio

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route, WebSocketRoute

    async def sse(request):
        async def gen():
            for i in range(4):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.5)
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def ws(websocket):
        await websocket.accept()
        while True:
            try:
                text = await websocket.receive_text()
            except Exception:
                return
            await websocket.send_text("echo:" + text)

    async def health(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/sse", sse), Route("/health", health), WebSocketRoute("/ws", ws)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    return server, t


@pytest.fixture
def nginx_proxy(tmp_path):
    exe = shutil.which("nginx") or (shutil.which("nginx", path="/usr/sbin:/usr/local/sbin"))
    if exe is None:
        pytest.skip("nginx is not installed (apt-get install nginx-light); the directive checks still ran")
    backend_port, port = _free_port(), _free_port()
    server, thread = _backend(backend_port)
    conf = NGINX_CONF.read_text()
    conf = conf.replace("resolver 127.0.0.11 valid=5s ipv6=off;", "")
    conf = conf.replace("http://gateway:8000", f"http://127.0.0.1:{backend_port}")
    conf = conf.replace("listen 80;", f"listen 127.0.0.1:{port};")
    conf = conf.replace("pid /tmp/nginx.pid;", f"pid {tmp_path}/nginx.pid;")
    conf = conf.replace("access_log /dev/stdout kaiten;", f"access_log {tmp_path}/access.log kaiten;")
    conf = conf.replace("error_log /dev/stderr warn;", f"error_log {tmp_path}/error.log warn;")
    conf = conf.replace("http {", f"http {{\n    client_body_temp_path {tmp_path}/body;\n"
                        f"    proxy_temp_path {tmp_path}/proxy;\n", 1)
    (tmp_path / "nginx.conf").write_text(conf)
    test = subprocess.run([exe, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                          capture_output=True, text=True)
    assert test.returncode == 0, test.stderr
    proc = subprocess.Popen([exe, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"],
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError(f"nginx did not start: {proc.stderr.read() if proc.poll() is not None else ''}")
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        server.should_exit = True
        thread.join(5)


def test_nginx_streams_sse_without_buffering(nginx_proxy):
    import httpx
    with httpx.Client(timeout=10) as client:
        assert client.get(f"http://127.0.0.1:{nginx_proxy}/nginx-health").text == "ok\n"
        assert client.get(f"http://127.0.0.1:{nginx_proxy}/health").text == "ok"
        t0 = time.monotonic()
        arrivals = []
        with client.stream("GET", f"http://127.0.0.1:{nginx_proxy}/sse") as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    arrivals.append((line, time.monotonic() - t0))
    assert [a[0] for a in arrivals] == ["data: 0", "data: 1", "data: 2", "data: 3", "data: [DONE]"]
    # The first event arrives at once, not when the 2 s stream ends.
    assert arrivals[0][1] < 1.0, arrivals
    assert arrivals[-1][1] - arrivals[0][1] > 1.5, arrivals


def test_nginx_passes_websocket_upgrades(nginx_proxy):
    from websockets.sync.client import connect
    with connect(f"ws://127.0.0.1:{nginx_proxy}/ws", open_timeout=5) as ws:
        ws.send("hello")
        assert ws.recv(timeout=5) == "echo:hello"
        ws.send("again")
        assert ws.recv(timeout=5) == "echo:again"
