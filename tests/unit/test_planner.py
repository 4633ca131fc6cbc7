"""The pre-warm planner as tables of inputs and expected worker counts, its queueing
model against an independent Erlang C, and the lead time."""

from __future__ import annotations

import math

import pytest

from scheduler.planner import (
    Capacity,
    capacity_from,
    lead_time_s,
    plan,
    servers_per_worker,
    wait_quantile_s,
)
from tidegate.router import WorkerView

SERVICE_S = 1.5
SLOTS = 64
CAPACITY = SLOTS / SERVICE_S  # 42.7 jobs/s: every slot busy


def erlang_c(n: int, a: float) -> float:
    """P(wait) in M/M/n, straight from the textbook sum (in logs: n reaches hundreds)."""
    terms = [k * math.log(a) - math.lgamma(k + 1) for k in range(n)]
    top = n * math.log(a) - math.lgamma(n + 1) + math.log(n / (n - a))
    peak = max([*terms, top])
    below = sum(math.exp(t - peak) for t in terms)
    return math.exp(top - peak) / (below + math.exp(top - peak))


def erlang_b(n: int, a: float) -> float:
    b = 1.0
    for k in range(1, n + 1):
        b = a * b / (k + a * b)
    return b


@pytest.mark.parametrize(("n", "a"), [(1, 0.5), (2, 1.5), (64, 50.0), (128, 120.0),
                                      (512, 480.0), (512, 200.0)])
def test_wait_quantile_matches_the_textbook(n: int, a: float) -> None:
    c = erlang_c(n, a)
    expected = 0.0 if c <= 0.01 else math.log(c / 0.01) * SERVICE_S / (n - a)
    assert wait_quantile_s(n, a, erlang_b(n, a), SERVICE_S) == pytest.approx(expected, abs=1e-9)


def test_wait_quantile_of_mm1() -> None:
    # M/M/1 at rho 0.9, mean service 1 s: P(W > t) = 0.9 e^{-0.1 t}.
    assert wait_quantile_s(1, 0.9, erlang_b(1, 0.9), 1.0) == pytest.approx(10 * math.log(90))
    assert wait_quantile_s(1, 1.0, erlang_b(1, 1.0), 1.0) == math.inf


@pytest.mark.parametrize(
    ("case", "rate", "capacity", "objective_ms", "min_w", "max_w", "headroom", "expected"),
    [
        ("no traffic keeps the minimum", 0.0, CAPACITY, 2000, 1, 8, 0.2, 1),
        ("light load, one worker", 20.0, CAPACITY, 2000, 1, 8, 0.2, 1),
        ("headroom tips into a second worker", 40.0, CAPACITY, 2000, 1, 8, 0.2, 2),
        ("same load without headroom", 40.0, CAPACITY, 2000, 1, 8, 0.0, 1),
        ("100 jobs/s", 100.0, CAPACITY, 2000, 1, 8, 0.2, 3),
        ("clamped to the minimum", 5.0, CAPACITY, 2000, 3, 8, 0.2, 3),
        ("clamped to the maximum", 1000.0, CAPACITY, 2000, 1, 8, 0.2, 8),
        ("a 10x peak", 250.0, CAPACITY, 2000, 1, 20, 0.2, 8),
        # Throughput flattens at 20 jobs/s: 30 sequences a worker, not 64.
        ("capacity below the slots", 100.0, 20.0, 2000, 1, 20, 0.0, 6),
        ("minimum zero, some traffic", 1.0, CAPACITY, 2000, 0, 8, 0.0, 1),
        ("minimum zero, no traffic", 0.0, CAPACITY, 2000, 0, 8, 0.0, 0),
    ],
)
def test_plan(case: str, rate: float, capacity: float, objective_ms: float, min_w: int,
              max_w: int, headroom: float, expected: int) -> None:
    got = plan(rate, capacity, SERVICE_S, SLOTS, objective_ms, min_w, max_w, headroom)
    assert got == expected, case


def test_a_tight_objective_needs_more_workers() -> None:
    # Single-sequence workers (no batching) near saturation: the wait, not throughput,
    # decides.
    loose = plan(9.0, 1.0, 1.0, 1, 2000, 1, 100, headroom=0.0)
    tight = plan(9.0, 1.0, 1.0, 1, 100, 1, 100, headroom=0.0)
    assert (loose, tight) == (11, 17)
    # The prefill eats into the objective.
    assert plan(9.0, 1.0, 1.0, 1, 2000, 1, 100, headroom=0.0, prefill_ms=1900) == tight


def test_more_load_never_means_fewer_workers() -> None:
    counts = [plan(rate, CAPACITY, SERVICE_S, SLOTS, 2000, 1, 40, 0.2)
              for rate in range(0, 1201, 5)]
    assert counts == sorted(counts)
    assert counts[0] == 1 and counts[-1] == 34  # 1200 jobs/s * 1.2 * 1.5 s / 64 slots


@pytest.mark.parametrize("objective_ms", [100, 500, 2000, 10000])
def test_tighter_objective_never_means_fewer_workers(objective_ms: float) -> None:
    looser = plan(150.0, CAPACITY, SERVICE_S, SLOTS, objective_ms * 2, 1, 40, 0.0)
    assert plan(150.0, CAPACITY, SERVICE_S, SLOTS, objective_ms, 1, 40, 0.0) >= looser


def test_min_above_max_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="min_workers 3 > max_workers 2"):
        plan(1.0, CAPACITY, SERVICE_S, SLOTS, 2000, 3, 2)


@pytest.mark.parametrize(("capacity", "service_s", "slots", "servers"),
                         [(CAPACITY, SERVICE_S, 64, 64), (100.0, SERVICE_S, 64, 64),
                          (20.0, SERVICE_S, 64, 30), (0.1, SERVICE_S, 64, 1)])
def test_servers_per_worker(capacity: float, service_s: float, slots: int,
                            servers: int) -> None:
    assert servers_per_worker(capacity, service_s, slots) == servers


def test_capacity_from_heartbeats() -> None:
    def view(name: str, state: str, mean_job_ms: float | None, lanes: str = "chat"
             ) -> WorkerView:
        return WorkerView(name=name, pool="vllm", lanes=frozenset({lanes}), state=state,
                          slots=64, mean_job_ms=mean_job_ms)

    fleet = [view("a", "active", 1200.0), view("b", "active", 1800.0),
             view("c", "standby", 100.0), view("d", "active", 100.0, lanes="finance")]
    assert capacity_from(fleet, "chat") == Capacity(per_worker_rps=64 / 1.5,
                                                    mean_service_s=1.5, slots=64)
    assert capacity_from(fleet, "support") is None
    # A worker without a finished job counts at the router's default (1 s).
    assert capacity_from([view("e", "active", None)], "chat") == Capacity(64.0, 1.0, 64)


@pytest.mark.parametrize(("activation_s", "margin_s", "lead_s"),
                         [(10.0, 30.0, 40.0), (135.0, 60.0, 195.0), (0.0, 0.0, 0.0)])
def test_lead_time(activation_s: float, margin_s: float, lead_s: float) -> None:
    assert lead_time_s(activation_s, margin_s) == lead_s


def test_lead_time_refuses_negative_figures() -> None:
    with pytest.raises(ValueError):
        lead_time_s(-1.0, 30.0)
