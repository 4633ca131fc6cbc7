"""Router decisions as tables of inputs and expected routes."""

from __future__ import annotations

import pytest

from scheduler.router import NoRoute, WorkerView, estimated_wait_ms, route
from tidegate.lanes import Lane

LANE = Lane(name="chat", queue="chat", pools=["trtllm", "vllm"], ttft_p99_objective_ms=2000)


def w(name: str, pool: str, state: str = "active", slots: int = 4, running: int = 0,
      waiting: int = 0, lora: tuple[str, ...] = (), job_ms: float | None = 1000.0,
      lanes: tuple[str, ...] = ("chat",)) -> WorkerView:
    return WorkerView(name=name, pool=pool, lanes=frozenset(lanes), state=state, slots=slots,
                      running=running, waiting=waiting, lora=frozenset(lora), mean_job_ms=job_ms)


def direct(name: str) -> str:
    return f"direct.{name}"


T1, T2, V1 = w("t1", "trtllm"), w("t2", "trtllm"), w("v1", "vllm")
FULL_T = w("t1", "trtllm", running=4, waiting=2)

CASES = [
    # (case, fleet, backlog, lora, session worker, expected queue, words in the reason)
    ("primary pool healthy", [T1, V1], {}, None, None, "chat.trtllm", "preferred pool trtllm"),
    ("primary pool empty", [V1], {}, None, None, "chat.vllm", "pool trtllm: no healthy"),
    ("primary worker not active", [w("t1", "trtllm", state="standby"), V1], {}, None, None,
     "chat.vllm", "fallback pool vllm"),
    ("primary worker of another lane", [w("t1", "trtllm", lanes=("finance",)), V1], {}, None,
     None, "chat.vllm", "pool trtllm: no healthy"),
    ("primary backlog breaks objective", [T1, V1], {"chat.trtllm": 40}, None, None,
     "chat.vllm", "breaks the 2000 ms objective"),
    ("every pool over objective: shortest wait", [T1, V1],
     {"chat.trtllm": 40, "chat.vllm": 20}, None, None, "chat.vllm", "shortest wait in vllm"),
    ("lora goes to the worker that has it", [T1, w("v2", "vllm", lora=("support",))], {},
     "support", None, "direct.v2", "LoRA adapter 'support' is on v2"),
    ("lora: least busy of two holders", [w("v1", "vllm", running=3, lora=("a",)),
                                         w("v2", "vllm", running=1, lora=("a",))], {}, "a",
     None, "direct.v2", "on v2"),
    ("session sticks to its healthy worker", [T1, T2, V1], {}, None, "t2", "direct.t2",
     "session affinity: t2"),
    ("session moves off a saturated worker", [FULL_T, T2], {}, None, "t1", "chat.trtllm",
     "session's worker t1 unavailable"),
    ("session moves off a dead worker", [T2, V1], {}, None, "t1", "chat.trtllm",
     "session's worker t1 unavailable"),
]


@pytest.mark.parametrize(("case", "fleet", "backlog", "lora", "session", "queue", "why"),
                         CASES, ids=[c[0] for c in CASES])
def test_route(case, fleet, backlog, lora, session, queue, why) -> None:  # type: ignore[no-untyped-def]
    decision = route(LANE, fleet, backlog, direct, lora=lora, session_worker=session)
    assert decision.queue == queue
    assert why in decision.reason


@pytest.mark.parametrize(("fleet", "lora", "field", "why"), [
    ([], None, None, "no healthy worker serves lane 'chat'"),
    ([w("t1", "trtllm", state="draining")], None, None, "no healthy worker"),
    ([T1, V1], "missing", "lora", "serves LoRA adapter 'missing'"),
])
def test_no_route(fleet, lora, field, why) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NoRoute) as err:
        route(LANE, fleet, {}, direct, lora=lora)
    assert err.value.field == field and why in str(err.value)


@pytest.mark.parametrize(("members", "queued", "expected"), [
    ([w("a", "p", slots=4)], 0, 0.0),  # free slots: no wait
    ([w("a", "p", slots=4, running=3)], 0, 0.0),
    ([w("a", "p", slots=4, running=4)], 0, 250.0),  # one job ahead of a full worker
    ([w("a", "p", slots=4, running=4)], 7, 2000.0),  # 8 ahead over 4 slots x 1000 ms
    ([w("a", "p", slots=2, running=2), w("b", "p", slots=2, running=2)], 3, 1000.0),
    ([w("a", "p", slots=1, running=1, job_ms=None)], 0, 1000.0),  # default service time
])
def test_estimated_wait(members, queued, expected) -> None:  # type: ignore[no-untyped-def]
    assert estimated_wait_ms(members, queued) == pytest.approx(expected)
