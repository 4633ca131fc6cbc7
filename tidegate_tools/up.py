"""`tidegate up` (`make up`): the whole stack on the embedded defaults, left running in the
foreground.

Redis at the settings' URL (a private one started when none answers), the database
migrated, one worker per lane with workers of its own, the API, the batch driver, the
webhook sender and Flower; one line per part (its pid, where it listens, its log), a
tenant created and its API key printed once, and three things to try. Ctrl-C or SIGTERM
stops every process it started, and so does one of them dying (its log is named).

The stack is started by tidegate_tools/stack.py's `running_stack`, as `make demo` starts
it; `make demo` stays the scripted tour that stops at its end.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import httpx

from store import Store, upgrade
from tidegate.settings import Settings, get_settings
from tidegate_tools.procs import (
    Proc,
    ensure_redis,
    free_port,
    start_flower,
    start_webhooks,
    wait_until,
)
from tidegate_tools.stack import RunningStack, WorkerSpec, running_stack

ENGINE_START_S = 600.0  # engines loading at once on a busy machine; `make demo` waits 300 s
FLOWER_START_S = 60.0
POLL_S = 0.5  # how often the parts are looked at while the stack runs
QUESTION = "What is the capital of France?"


def say(msg: str) -> None:
    print(f"[up] {msg}", flush=True)


def model_env(settings: Settings) -> dict[str, str]:
    """The model the stack serves, for its processes' environment: TIDEGATE_MODEL when set,
    else the real small model (fetched the first time) with lanes that fit it on a CPU,
    else the toy test checkpoint with a line saying why (as `make demo` picks it)."""
    from tidegate_tools.realmodel import demo_env

    return demo_env(settings, say)


def worker_specs(settings: Settings) -> list[WorkerSpec]:
    """One worker per lane with workers of its own (a `runs_on` lane runs on its host's),
    each engine on a core of its own on a CPU build, as `make demo` pins them."""
    cores = os.cpu_count() or 1
    lanes = [name for name, lane in settings.lanes.items() if lane.runs_on is None]
    host = socket.gethostname()
    return [WorkerSpec(lane, f"{lane}-up-{os.getpid()}@{host}", cpus=str((cores - 1 - i) % cores))
            for i, lane in enumerate(lanes)]


def port_or_free(host: str, port: int) -> int:
    """`port` when nothing listens there, else a free one (a demo or a second stack holds it)."""
    with socket.socket() as s:
        return free_port() if s.connect_ex((host, port)) == 0 else port


def stop_on_signals() -> None:
    """SIGINT (Ctrl-C) and SIGTERM both unwind the stack, which stops what it started; a
    second signal while it stops is ignored, so the stop runs to its end."""

    def stop(signum: int, _frame: FrameType | None) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def migrate(settings: Settings) -> None:
    if settings.db_url.startswith("sqlite:///"):
        Path(settings.db_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    upgrade(settings.db_url)


@contextlib.contextmanager
def stopped_at_exit(procs: list[Proc]) -> Iterator[list[Proc]]:
    """The processes started beside the stack's own, stopped last-first on the way out."""
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            proc.stop()


def flower_env(env: dict[str, str], settings: Settings) -> tuple[dict[str, str], str]:
    """Flower's environment, and how to log in. It starts only behind a password: one made
    up here, shown once, when the settings have none."""
    if settings.flower_password:
        return env, f"user {settings.flower_user}, the password in TIDEGATE_FLOWER_PASSWORD"
    password = secrets.token_urlsafe(12)
    return ({**env, "TIDEGATE_FLOWER_PASSWORD": password},
            f"user {settings.flower_user}, password {password} (made up for this run)")


def start_flower_now(env: dict[str, str], settings: Settings, logs: Path,
                     procs: list[Proc]) -> tuple[Proc, str, str]:
    """Flower, waited for until it answers (401 without its password): its process, URL
    and login."""
    from tidegate_tools.flower import flower_auth_problem

    env, login = flower_env(env, settings)
    problem = flower_auth_problem(settings.flower_user, env["TIDEGATE_FLOWER_PASSWORD"])
    if problem:
        raise SystemExit(f"tidegate up: Flower cannot start: {problem}")
    port = port_or_free(settings.flower_host, settings.flower_port)
    proc = start_flower(env, port, logs)
    procs.append(proc)
    url = f"http://{settings.flower_host}:{port}"
    wait_until(lambda: _answers(url), FLOWER_START_S, f"Flower at {url}", [proc], poll_s=0.5)
    return proc, url, login


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code in (200, 401)
    except httpx.HTTPError:
        return False


def print_parts(settings: Settings, redis: Proc | None, stack: RunningStack,
                specs: list[WorkerSpec], extra: list[Proc], flower_url: str) -> None:
    say("running (Ctrl-C stops everything below):")
    if redis is None:
        print(f"  {'redis':16} {'-':10}  {settings.redis_url} (already running: left alone)")
    else:
        _line("redis", redis, f"{settings.redis_url} (started here)")
    print(f"  {'store':16} {'-':10}  {_safe_db(settings.db_url)} (migrated to head)")
    workers = [p for p in stack.procs if p.name.startswith("worker:")]
    for spec, proc in zip(specs, workers, strict=True):
        _line(f"worker {spec.lane}", proc, f"{spec.name}, metrics "
              f"http://{settings.metrics_host}:{proc.metrics_port}/metrics")
    for proc in stack.procs:
        if proc.name.startswith("api:"):
            _line("api", proc, stack.base_url)
        elif proc not in workers:
            _line(proc.name, proc, "")
    for proc in extra:
        flower = proc.name.startswith("flower")
        _line("flower" if flower else proc.name, proc, flower_url if flower else "")


def _line(name: str, proc: Proc, where: str) -> None:
    print(f"  {name:16} pid {proc.popen.pid:<6}  {where + '  ' if where else ''}"
          f"log {proc.log_path}", flush=True)


def _safe_db(url: str) -> str:
    """The database URL without its password."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def try_next(base: str, key: str, flower_url: str, login: str) -> list[str]:
    """The three things to try, as lines to paste: a native submit and its SSE stream, the
    openai client, Flower."""
    auth = shlex.quote(f"Authorization: Bearer {key}")
    body = ('{"lane":"chat","messages":[{"role":"user","content":"' + QUESTION +
            '"}],"max_tokens":32,"temperature":0}')
    return [
        "1. submit a job and stream its tokens (the native API, POST /v1/jobs + SSE):",
        f"     JOB=$(curl -s {base}/v1/jobs -H {auth} -H 'Content-Type: application/json' "
        f"-d {shlex.quote(body)} | sed -E 's/.*\"job_id\": *\"([^\"]+)\".*/\\1/')",
        f"     curl -sN {base}/v1/jobs/$JOB/events -H {auth}",
        "2. the openai client (pip install openai), in Python:",
        "     from openai import OpenAI",
        f"     client = OpenAI(base_url={base + '/v1'!r}, api_key={key!r})",
        f"     reply = client.chat.completions.create(model='chat', messages=[{{'role': 'user', "
        f"'content': {QUESTION!r}}}], max_tokens=32, temperature=0)",
        "     print(reply.choices[0].message.content)",
        f"3. Flower, the Celery dashboard: {flower_url} ({login})",
    ]


def watch(procs: list[Proc]) -> Proc:
    """Waits until a part exits (returned) or a signal ends the wait (KeyboardInterrupt)."""
    while True:
        for proc in procs:
            if not proc.alive():
                return proc
        time.sleep(POLL_S)


def terminate_all(procs: list[Proc]) -> None:
    """SIGTERM to every part at once, so they shut down side by side; each one's stop
    then waits for it (and kills what is left of its group)."""
    for proc in procs:
        if proc.alive():
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGTERM)


def waiting_lines(every_s: float = 15.0) -> Callable[[float], None]:
    """What running_stack calls about once a second while the engines load: a line every
    `every_s`."""
    last = [0.0]

    def waiting(seconds: float) -> None:
        if seconds - last[0] >= every_s:
            last[0] = seconds
            say(f"  waiting for the engines to load... {seconds:.0f} s")

    return waiting


def main() -> int:
    stop_on_signals()
    settings = get_settings()
    logs = settings.data_dir / "up-logs"
    redis: Proc | None = None
    died: Proc | None = None
    try:
        env = {**os.environ, **model_env(settings)}  # this process keeps its lane names
        migrate(settings)
        redis = ensure_redis(settings.redis_url, logs)
        if redis is not None:
            say(f"no Redis answered at {settings.redis_url}: started one (pid {redis.popen.pid})")
        died = run(settings, env, logs, redis)
    except KeyboardInterrupt:
        say("stopping what had started")
    except (TimeoutError, RuntimeError) as exc:  # a part did not start (its log tail in exc)
        say(f"the stack did not start, and what had started is stopped: {exc}")
        return 1
    finally:
        if redis is not None:
            redis.stop()
    say("stopped")
    return 1 if died is not None else 0


def run(settings: Settings, env: dict[str, str], logs: Path, redis: Proc | None) -> Proc | None:
    """Starts the parts, prints them and what to try, and waits: returns the part that
    died, None when a signal stopped it. Every part is stopped on the way out."""
    specs = worker_specs(settings)
    api_port = port_or_free(settings.api_host, settings.api_port)
    say(f"starting {len(specs)} workers ({', '.join(s.lane for s in specs)}), the API, "
        f"the batch driver, the webhook sender and Flower; logs in {logs}")
    started = time.monotonic()
    with running_stack(env, specs, logs, api_port=api_port, timeout_s=ENGINE_START_S,
                       waiting=waiting_lines()) as stack, stopped_at_exit([]) as extra:
        extra.append(start_webhooks(env, logs))
        _, flower_url, login = start_flower_now(env, settings, logs, extra)
        say(f"ready after {time.monotonic() - started:.0f} s")
        print_parts(settings, redis, stack, specs, extra, flower_url)
        tenant, key = Store(settings.db_url).tenants.create_tenant(f"up-{int(time.time())}",
                                                            list(settings.lanes))
        say(f"tenant {tenant.name} created, lanes {','.join(tenant.lanes)}")
        say(f"API key (shown once): {key}")
        say("try next:")
        for line in try_next(stack.base_url, key, flower_url, login):
            print(f"  {line}", flush=True)
        parts = stack.procs + extra
        died = None
        try:
            died = watch(parts)
            say(f"{died.name} exited with code {died.popen.returncode}; its log: "
                f"{died.log_path}. Stopping everything")
        except KeyboardInterrupt:
            say("stopping everything it started")
        terminate_all(parts)
        return died


if __name__ == "__main__":
    sys.exit(main())
