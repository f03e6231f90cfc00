"""``appliance serve``, ``up``, ``config`` and ``monitoring-config``: running the appliance and what it reads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from appliance.admin_token import ensure_admin_token
from appliance.cli.argtypes import host_port, optional_host_port
from appliance.cli.common import add_command, load, setup_logging
from appliance.config_view import config_dump, redact_argv
from appliance.settings import ConfigError


def register(sub: Any) -> None:
    add_command(sub, "serve", "gateway + engine replicas; drains on SIGTERM", cmd_serve, config=True)

    p = add_command(sub, "up", "the embedded default: demo model if none configured, serve, plus local Prometheus "
                               "and Alertmanager when installed", cmd_up, config=True)
    p.add_argument("--no-monitoring", action="store_true",
                   help="do not start local Prometheus/Alertmanager (compose runs its own)")

    p = add_command(sub, "monitoring-config", "render Prometheus' and Alertmanager's configuration and the alert "
                                              "rules into a folder (compose init)", cmd_monitoring_config, config=True)
    p.add_argument("--out", type=Path, required=True, help="folder to write (created if missing)")
    p.add_argument("--gateway", type=host_port, default="127.0.0.1:8000",
                   help="gateway HOST:PORT (or http://HOST:PORT) as Prometheus reaches it")
    p.add_argument("--alertmanager", type=optional_host_port, default="127.0.0.1:9093",
                   help="Alertmanager HOST:PORT; empty: none")
    p.add_argument("--prometheus", type=host_port, default="localhost:9090",
                   help="Prometheus' own HOST:PORT (self-scrape)")
    p.add_argument("--shared", action="store_true", help="make every file world-readable (other containers' users)")
    p.add_argument("--owner", type=uid_gid, default=None, metavar="UID:GID",
                   help="hand every file to this user (the monitoring containers'); secrets stay 0600, not shared")

    p = add_command(sub, "config", "print the effective configuration as YAML", cmd_config, config=True)
    p.add_argument("--show-secrets", action="store_true",
                   help="print api_keys, tokens and credentials in URLs and engine flags in clear")
    p.add_argument("--engines", action="store_true", help="also print each replica's engine command line")


def cmd_serve(args: argparse.Namespace) -> int:
    from appliance.serve import serve

    settings = load(args)
    if not settings.discovery.engine_urls and settings.role != "gateway":  # a gateway finds its engines, it runs none
        if settings.model is None:
            raise ConfigError("model is not set (APPLIANCE_MODEL or `model:` in --config); "
                              "`appliance up` builds and serves the demo model")
        if not (settings.model / "config.json").is_file():
            raise ConfigError(f"model {settings.model} is not a Hugging Face checkpoint directory (no config.json)")
    setup_logging(settings.log_level)
    return serve(settings)


def cmd_up(args: argparse.Namespace) -> int:
    from appliance.serve import serve

    settings = load(args)
    setup_logging(settings.log_level)
    if settings.model is None:
        settings = settings.model_copy(update={"model": ensure_demo_model(settings.state_dir / "models")})
    if settings.gateway.admin_token is None:
        settings = settings.replaced({"gateway.admin_token": ensure_admin_token(settings.state_dir)})
        print(f"appliance: admin token in {settings.state_dir / 'admin-token'} (status/drain/restart read it there; "
              "Alertmanager posts alerts with it)")
    monitoring = None
    if settings.monitoring.local and not args.no_monitoring:
        from appliance.composition.monitoring import local_monitoring

        monitoring = local_monitoring(settings)
        for service in monitoring.start():
            print(f"appliance: {service.name:<12} {service.url}")
    base = f"http://{settings.gateway.host}:{settings.gateway.port}"
    print(f"appliance: gateway      {base}/v1  (model '{settings.served_model_name}', {settings.replicas} replica(s))")
    print(f"appliance: metrics      {base}/metrics   health {base}/health/ready")
    print(f"appliance: logs         {settings.state_dir / 'logs'}")
    sys.stdout.flush()
    try:
        return serve(settings)
    finally:
        if monitoring is not None:
            monitoring.stop()


def cmd_monitoring_config(args: argparse.Namespace) -> int:
    from appliance.composition.monitoring import write_bundle

    settings = load(args)
    bundle = write_bundle(args.out, settings, gateway=args.gateway, alertmanager=args.alertmanager or None,
                          prometheus=args.prometheus, shared=args.shared, owner=args.owner)
    print(f"appliance: wrote {bundle.prometheus_config}, {bundle.alertmanager_config} and {bundle.rules_dir}/")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    settings = load(args)
    print(yaml.safe_dump(config_dump(settings, show_secrets=args.show_secrets), sort_keys=False), end="")
    if args.engines:
        if settings.model is None:
            print("# engines: no model set; `appliance serve` builds the demo model at start and runs that")
        else:
            from appliance.composition.fleet import build_specs
            from appliance.serve import engine_extra_env

            for spec in build_specs(settings, settings.model, engine_extra_env(settings)):
                env = [f"{k}={v}" for k, v in spec.env.items()]  # VLLM_API_KEY: the engine key
                env, command = (env, spec.command) if args.show_secrets else (redact_argv(env),
                                                                              redact_argv(spec.command))
                print(f"# {spec.name}: {' '.join(env)} {' '.join(command)}")
    return 0


def uid_gid(text: str) -> tuple[int, int]:
    """``UID:GID`` (numbers: the containers' users need not exist in this one)."""
    uid, sep, gid = text.partition(":")
    if not (uid.isdigit() and sep and gid.isdigit()):
        raise argparse.ArgumentTypeError(f"expected UID:GID (numbers), got {text!r}")
    return int(uid), int(gid)


def ensure_demo_model(models_dir: Path) -> Path:
    """The INT8 demo model under ``models_dir``, built once and reused."""
    from appliance.model.demo import build_demo_model
    from appliance.model.quantize import quantize_checkpoint

    bf16, int8 = models_dir / "demo-bf16", models_dir / "demo-int8"
    if not (int8 / "config.json").is_file():
        if not (bf16 / "config.json").is_file():
            print(f"appliance: building the demo model in {bf16} (about a minute, once)", flush=True)
            build_demo_model(bf16, overwrite=True)
        print(f"appliance: quantizing it to W8A8 INT8 in {int8}", flush=True)
        quantize_checkpoint(bf16, int8, evaluate=False)
    return int8

