"""``trellis serve --ray``: start or join a Ray cluster and deploy the entry point and engine replicas."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from pathlib import Path

from server.config import Settings
from server.model_loader import ModelSource, model_source

APP_NAME = "trellis"
REPLICA_DEPLOYMENT = "TrellisReplica"
ENTRY_DEPLOYMENT = "TrellisEntry"
_OBJECT_STORE_BYTES = 256 * 1024 * 1024  # responses are small; Ray's default takes 30% of memory


class ScaleoutError(ValueError):
    """A scale-out flag that cannot work (the CLI prints it and exits 2)."""


def check_settings(settings: Settings) -> None:
    """Refuse flag combinations that cannot work, naming the flag."""
    if settings.replicas < 1:
        raise ScaleoutError("--replicas must be at least 1")
    if settings.gpus_per_replica < 0 or settings.cpus_per_replica < 0:
        raise ScaleoutError("--gpus-per-replica and --cpus-per-replica must not be negative")
    if settings.autoscale_max and not 0 <= settings.autoscale_min <= settings.autoscale_max:
        raise ScaleoutError("--autoscale-min must be between 0 and --autoscale-max")
    if settings.autoscale_min and not settings.autoscale_max:
        raise ScaleoutError("--autoscale-min needs --autoscale-max")


def start_ray(settings: Settings) -> None:
    """Join ``--ray-address`` or start a small local Ray instance (no dashboard, small object store)."""
    import ray

    if ray.is_initialized():
        return
    if settings.ray_address:
        ray.init(address=settings.ray_address, namespace=APP_NAME, include_dashboard=False, log_to_driver=False)
        return
    _replicas_import_this_code()
    needed = math.ceil(max(settings.replicas, settings.autoscale_max) * settings.cpus_per_replica)
    ray.init(
        num_cpus=max(os.cpu_count() or 1, needed),
        namespace=APP_NAME,
        include_dashboard=False,
        object_store_memory=_OBJECT_STORE_BYTES,
        log_to_driver=settings.log_level == "debug",
    )


def _replicas_import_this_code() -> None:
    """Local workers import the ``server`` package this process runs (a checkout beats an install)."""
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


def build_application(settings: Settings, source: ModelSource | None = None):
    """The Ray Serve application: one entry deployment bound to the engine replicas' deployment."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from server.scaleout.entry import TrellisEntry
    from server.scaleout.replica import TrellisReplica
    from server.scaleout.router import ROUTERS

    per_replica = settings.max_batch_size + settings.max_waiting_seqs  # the engine queues and 429s itself
    options: dict = {
        "name": REPLICA_DEPLOYMENT,
        "ray_actor_options": {"num_cpus": settings.cpus_per_replica, "num_gpus": settings.gpus_per_replica},
        "max_ongoing_requests": per_replica,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": settings.drain_timeout,
    }
    if settings.autoscale_max:
        options["autoscaling_config"] = {
            "min_replicas": settings.autoscale_min,
            "initial_replicas": min(max(settings.replicas, settings.autoscale_min), settings.autoscale_max),
            "max_replicas": settings.autoscale_max,
            "target_ongoing_requests": settings.max_batch_size,  # a full batch per replica
        }
    else:
        options["num_replicas"] = settings.replicas
    if settings.ray_routing in ROUTERS:
        options["request_router_config"] = RequestRouterConfig(request_router_class=ROUTERS[settings.ray_routing])
    replica = serve.deployment(TrellisReplica).options(**options)
    most = max(settings.replicas, settings.autoscale_max)
    entry = serve.deployment(serve.ingress()(TrellisEntry)).options(
        name=ENTRY_DEPLOYMENT, num_replicas=1,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": router_probe_env()}},
        max_ongoing_requests=most * per_replica,
    )
    return entry.bind(replica.bind(settings, source), settings, APP_NAME)


# The entry's router asks a replica for its queue length before sending it a request, and takes
# the next replica in its ranking when no answer comes within the deadline. Ray's 0.1 s default is
# shorter than a busy engine replica sometimes takes to answer (its engine thread holds the GIL
# through a step), so requests would leave the replica holding their prefix exactly under load.
ROUTER_PROBE_DEADLINES = {
    "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0",
    "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5.0",
}


def router_probe_env() -> dict[str, str]:
    """The entry deployment's queue-probe deadlines (the operator's environment wins)."""
    return {name: os.environ.get(name, default) for name, default in ROUTER_PROBE_DEADLINES.items()}


def deploy(settings: Settings, source: ModelSource | None = None) -> str:
    """Start/join Ray, deploy, wait until every replica is up; returns the entry point's base URL."""
    from ray import serve

    check_settings(settings)
    start_ray(settings)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build_application(settings, source), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{settings.host}:{settings.port}"


def shutdown() -> None:
    """Remove the deployments and stop Ray (when this process started it)."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def run(settings: Settings) -> int:
    """``trellis serve --ray``: deploy, then wait for SIGTERM/SIGINT and take it all down."""
    try:
        import ray  # noqa: F401
    except ImportError:
        print("trellis: error: --ray needs Ray Serve: pip install 'trellis-server[ray]'", file=sys.stderr)
        return 2
    try:
        check_settings(settings)
    except ScaleoutError as exc:
        print(f"trellis: error: {exc}", file=sys.stderr)
        return 2
    source = None
    if not settings.ray_address:  # one machine: convert the model once here, replicas read the cache
        source = model_source(settings)
    url = deploy(settings, source)
    print(f"trellis: serving {settings.replicas} replica(s) via Ray Serve on {url}/v1", file=sys.stderr)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    shutdown()
    return 0
