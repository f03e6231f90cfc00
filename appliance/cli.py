"""The ``appliance`` command line. Each subcommand is a thin shell over a module that does the work."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import yaml

from appliance.settings import ConfigError, Settings, load_settings

EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.handler(args) or 0)
    except ConfigError as exc:
        print(f"appliance: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="Observability-first LLM inference appliance")
    sub = parser.add_subparsers(title="commands")

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", type=Path, help="YAML settings file (APPLIANCE_* environment wins)")
        return p

    p = with_config(sub.add_parser("serve", help="gateway + engine replicas; drains on SIGTERM"))
    p.set_defaults(handler=cmd_serve)

    p = with_config(sub.add_parser("up", help="the embedded default: demo model if none configured, serve, plus "
                                              "local Prometheus and Alertmanager when installed"))
    p.add_argument("--no-monitoring", action="store_true",
                   help="do not start local Prometheus/Alertmanager (compose runs its own)")
    p.set_defaults(handler=cmd_up)

    p = with_config(sub.add_parser("monitoring-config", help="render Prometheus' and Alertmanager's configuration "
                                                             "and the alert rules into a folder (compose init)"))
    p.add_argument("--out", type=Path, required=True, help="folder to write (created if missing)")
    p.add_argument("--gateway", default="127.0.0.1:8000", help="gateway host:port as Prometheus reaches it")
    p.add_argument("--alertmanager", default="127.0.0.1:9093", help="Alertmanager host:port; empty: none")
    p.add_argument("--prometheus", default="localhost:9090", help="Prometheus' own host:port (self-scrape)")
    p.add_argument("--shared", action="store_true", help="make every file world-readable (other containers' users)")
    p.set_defaults(handler=cmd_monitoring_config)

    p = with_config(sub.add_parser("config", help="print the effective configuration as YAML"))
    p.add_argument("--show-secrets", action="store_true", help="print api_keys and admin_token in clear")
    p.add_argument("--engines", action="store_true", help="also print each replica's engine command line")
    p.set_defaults(handler=cmd_config)

    p = sub.add_parser("status", help="replicas, state, load, KV usage, restarts (admin API)")
    _admin_flags(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(handler=cmd_status)

    p = sub.add_parser("drain", help="take a replica out of routing; in-flight requests finish")
    _admin_flags(p)
    p.add_argument("replica", help="e.g. replica-0")
    p.add_argument("--undo", action="store_true", help="return a drained replica to routing")
    p.set_defaults(handler=cmd_drain)

    p = sub.add_parser("restart", help="drain a replica, let it finish, restart, warm and return it; or --rolling")
    _admin_flags(p)
    p.add_argument("replica", nargs="?", help="e.g. replica-0")
    p.add_argument("--rolling", action="store_true", help="restart every replica, one at a time (a rolling restart)")
    p.set_defaults(handler=cmd_restart)

    p = sub.add_parser("demo-model", help="build the tiny demo Llama (offline, deterministic)")
    p.add_argument("dir", type=Path)
    p.add_argument("--int8", action="store_true", help="quantize it to W8A8 INT8 after building")
    p.add_argument("--train-seconds", type=float, default=60.0, help="training time budget")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(handler=cmd_demo_model)

    from appliance.loadtest.cli import register as register_loadtest

    register_loadtest(sub)

    from appliance.monitoring.snapshot import register as register_snapshot

    register_snapshot(sub)

    p = sub.add_parser("quantize", help="BF16/FP16 HF checkpoint -> W8A8 INT8 compressed-tensors checkpoint")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--no-eval", action="store_true", help="skip the quality comparison on held-out text")
    p.set_defaults(handler=cmd_quantize)
    return parser


def _admin_flags(p: argparse.ArgumentParser) -> None:
    from appliance.admin_client import DEFAULT_URL, TOKEN_ENV

    p.add_argument("--url", default=DEFAULT_URL, help=f"gateway URL (default {DEFAULT_URL}); token from ${TOKEN_ENV}")


def _admin(action):
    """Run an admin action; its failures are one clear line on stderr and exit code 1."""
    from appliance.admin_client import AdminError

    try:
        return action()
    except AdminError as exc:
        print(f"appliance: {exc}", file=sys.stderr)
        return None


def cmd_status(args: argparse.Namespace) -> int:
    from appliance.admin_client import call, format_status

    status = _admin(lambda: call(args.url, "GET", "/admin/status"))
    if status is None:
        return 1
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    from appliance.admin_client import call

    action = "undrain" if args.undo else "drain"
    result = _admin(lambda: call(args.url, "POST", f"/admin/replicas/{args.replica}/{action}"))
    if result is None:
        return 1
    print(f"{result['name']}: {result['state']}, {result['outstanding']} request(s) in flight")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    from appliance.admin_client import call

    if bool(args.rolling) == bool(args.replica):
        print("appliance restart: give a REPLICA or --rolling (not both)", file=sys.stderr)
        return EXIT_USAGE
    path = "/admin/rolling-restart" if args.rolling else f"/admin/replicas/{args.replica}/restart"
    result = _admin(lambda: call(args.url, "POST", path))
    if result is None:
        return 1
    what = "rolling restart of " + ", ".join(result.get("replicas", [])) if args.rolling else args.replica
    print(f"{what}: accepted (each replica drains first); follow with `appliance status`")
    return 0


def _settings(args: argparse.Namespace) -> Settings:
    return load_settings(getattr(args, "config", None))


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "debug":  # libraries that log every request or job at INFO drown the appliance's own lines
        for noisy in ("httpx", "apscheduler"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_serve(args: argparse.Namespace) -> int:
    from appliance.serve import serve

    settings = _settings(args)
    if settings.engine_urls:
        _setup_logging(settings.log_level)
        return serve(settings)
    if settings.model is None:
        raise ConfigError("model is not set (APPLIANCE_MODEL or `model:` in --config); "
                          "`appliance up` builds and serves the demo model")
    if not (settings.model / "config.json").is_file():
        raise ConfigError(f"model {settings.model} is not a Hugging Face checkpoint directory (no config.json)")
    _setup_logging(settings.log_level)
    return serve(settings)


def cmd_up(args: argparse.Namespace) -> int:
    from appliance.serve import serve

    settings = _settings(args)
    _setup_logging(settings.log_level)
    if settings.model is None:
        settings = settings.model_copy(update={"model": ensure_demo_model(settings.state_dir / "models")})
    if settings.admin_token is None:
        settings = settings.model_copy(update={"admin_token": ensure_admin_token(settings.state_dir)})
        print(f"appliance: admin token in {settings.state_dir / 'admin-token'} (status/drain/restart read it there; "
              "Alertmanager posts alerts with it)")
    monitoring = None
    if settings.monitoring.local and not args.no_monitoring:
        from appliance.monitoring.local import LocalMonitoring

        monitoring = LocalMonitoring(settings)
        for service in monitoring.start():
            print(f"appliance: {service.name:<12} {service.url}")
    base = f"http://{settings.host}:{settings.port}"
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
    from appliance.monitoring.bundle import write_bundle

    settings = _settings(args)
    bundle = write_bundle(args.out, settings, gateway=args.gateway, alertmanager=args.alertmanager or None,
                          prometheus=args.prometheus, shared=args.shared)
    print(f"appliance: wrote {bundle.prometheus_config}, {bundle.alertmanager_config} and {bundle.rules_dir}/")
    return 0


def ensure_admin_token(state_dir: Path) -> str:
    """The embedded default's admin token: generated once into the state dir (owner-only), so that the local
    stack's operator commands and Alertmanager's webhook work without setting one up."""
    import secrets

    from appliance.admin_client import TOKEN_FILE

    path = state_dir / TOKEN_FILE
    if path.is_file() and (token := path.read_text().strip()):
        return token
    state_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    tmp = path.with_name(f".{TOKEN_FILE}.tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(token + "\n")
    tmp.replace(path)
    return token


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


def cmd_config(args: argparse.Namespace) -> int:
    settings = _settings(args)
    data = settings.model_dump(mode="json")
    if not args.show_secrets:
        data["api_keys"] = ["<redacted>"] * len(settings.api_keys)
        data["admin_token"] = "<redacted>" if settings.admin_token else None
        data["maintenance"]["grafana_token"] = "<redacted>" if settings.maintenance.grafana_token else None
    print(yaml.safe_dump(data, sort_keys=False), end="")
    if args.engines and settings.model is not None:
        from appliance.engine.supervisor import build_specs

        for spec in build_specs(settings, settings.model):
            env = " ".join(f"{k}={v}" for k, v in spec.env.items())
            print(f"# {spec.name}: {env} {' '.join(spec.command)}")
    return 0


def cmd_demo_model(args: argparse.Namespace) -> int:
    from appliance.model.demo import build_demo_model
    from appliance.model.quantize import QuantizeError, quantize_checkpoint

    target: Path = args.dir
    try:
        if args.int8:
            bf16 = target.with_name(target.name + ".bf16")
            summary = {"bf16": build_demo_model(bf16, train_seconds=args.train_seconds, overwrite=args.overwrite)}
            summary["int8"] = quantize_checkpoint(bf16, target)
        else:
            summary = build_demo_model(target, train_seconds=args.train_seconds, overwrite=args.overwrite)
    except (QuantizeError, ValueError, FileExistsError) as exc:
        print(f"appliance demo-model: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from appliance.model.quantize import QuantizeError, quantize_checkpoint

    try:
        summary = quantize_checkpoint(args.src, args.dst, evaluate=not args.no_eval)
    except QuantizeError as exc:
        print(f"appliance quantize: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
