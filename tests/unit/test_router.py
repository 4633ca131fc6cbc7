"""Router decisions as tables of inputs and expected routes."""

from __future__ import annotations

import re

import pytest

from tidegate.lanes import Lane
from tidegate.router import NoRoute, WorkerView, estimated_wait_ms, route

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


# --- work-conserving lanes: borrowing another lane's idle slot ----------------------

FINANCE = Lane(name="finance", queue="finance", pools=["vllm"], kv_cache_dtype="auto",
               lend_to=["chat"])
CHAT = Lane(name="chat", queue="chat", pools=["vllm"], kv_cache_dtype="fp8",
            quantization="fp8", lend_to=["finance"])
LANES = {"finance": FINANCE, "chat": CHAT}
CHAT_FULL = w("c1", "vllm", running=4, lanes=("chat",))


def f(name: str = "f1", running: int = 0, borrowed: int = 0, slots: int = 4) -> WorkerView:
    return WorkerView(name=name, pool="vllm", lanes=frozenset({"finance"}), state="active",
                      slots=slots, running=running, borrowed=borrowed, mean_job_ms=1000.0)


BORROW_CASES = [
    # (case, lane, fleet, backlog, lent, expected queue, words in the reason)
    ("own pool has a free slot: no borrowing", CHAT, [w("c1", "vllm"), f()], {}, {},
     "chat.vllm", "preferred pool vllm"),
    ("own pool full, finance idle: borrowed", CHAT, [CHAT_FULL, f()], {}, {}, "direct.f1",
     "borrowed an idle slot of f1"),
    ("the lender with the most room", CHAT, [CHAT_FULL, f("f1", running=3), f("f2", running=1)],
     {}, {}, "direct.f2", "of f2"),
    ("finance's own jobs wait: its slots are not idle", CHAT, [CHAT_FULL, f()],
     {"finance.vllm": 1}, {}, "chat.vllm", "preferred pool"),
    ("every slot busy at the last beat", CHAT, [CHAT_FULL, f(running=4)], {}, {}, "chat.vllm",
     "preferred pool"),
    ("slots sent since the beat count as taken", CHAT, [CHAT_FULL, f(running=2)], {},
     {"f1": 2}, "chat.vllm", "preferred pool"),
    ("finance lends to chat, not to support", Lane(name="support", queue="support",
                                                    pools=["vllm"]),
     [w("s1", "vllm", running=4, lanes=("support",)), f()], {}, {}, "support.vllm",
     "preferred pool"),
    # chat lends to finance, but finance would run at FP8 there: not without its consent
    ("a lower precision needs the borrower's consent", FINANCE,
     [w("f9", "vllm", running=4, lanes=("finance",)), w("c1", "vllm", lanes=("chat",))], {}, {},
     "finance.vllm", "preferred pool"),
    ("with consent it borrows", FINANCE.model_copy(update={"borrow_lower_precision": True}),
     [w("f9", "vllm", running=4, lanes=("finance",)), w("c1", "vllm", lanes=("chat",))], {}, {},
     "direct.c1", "borrowed an idle slot of c1"),
]


@pytest.mark.parametrize(("case", "lane", "fleet", "backlog", "lent", "queue", "why"),
                         BORROW_CASES, ids=[c[0] for c in BORROW_CASES])
def test_borrowing(case, lane, fleet, backlog, lent, queue, why) -> None:  # type: ignore[no-untyped-def]
    decision = route(lane, fleet, backlog, direct, lanes={**LANES, lane.name: lane}, lent=lent)
    assert decision.queue == queue
    assert why in decision.reason
    assert decision.borrowed == queue.startswith("direct.")


def test_lending_stops_at_the_lenders_share() -> None:
    half = {**LANES, "finance": FINANCE.model_copy(update={"lend_max_share": 0.5})}
    lent = {"f1": 0}
    queues = []
    for _ in range(4):  # four chat jobs in a row while chat's worker is full
        decision = route(CHAT, [CHAT_FULL, f()], {}, direct, lanes=half, lent=lent)
        queues.append(decision.queue)
        if decision.borrowed:
            lent["f1"] += 1
    assert queues == ["direct.f1", "direct.f1", "chat.vllm", "chat.vllm"]
    # already lending two (its beat says so): nothing more
    assert route(CHAT, [CHAT_FULL, f(running=2, borrowed=2)], {}, direct, lanes=half,
                 lent={}).queue == "chat.vllm"


def test_no_lanes_no_borrowing() -> None:
    """The reconciler's resends route without `lanes`: back to the lane's own pool."""
    assert route(CHAT, [CHAT_FULL, f()], {}, direct).queue == "chat.vllm"


def test_a_lane_without_workers_is_served_by_lenders_alone() -> None:
    """An idle lent slot now; every lent slot busy: the lane's own pool queue of the
    lender's pool, which the lending workers pull from; no lender at all: 503 as before."""
    idle = route(CHAT, [f()], {}, direct, lanes=LANES, lent={})
    assert (idle.queue, idle.borrowed) == ("direct.f1", True)
    assert "has no active worker of its own" in idle.reason
    busy = route(CHAT, [f(running=4)], {}, direct, lanes=LANES, lent={})
    assert (busy.queue, busy.borrowed) == ("chat.vllm", False)
    assert "first slot a lending worker of pool vllm frees" in busy.reason
    with pytest.raises(NoRoute):
        route(CHAT, [f()], {}, direct, lanes={**LANES, "finance": FINANCE.model_copy(
            update={"lend_to": []})}, lent={})
    with pytest.raises(NoRoute):
        route(CHAT, [f()], {}, direct)  # no lanes given: no borrowing


@pytest.mark.parametrize(("body", "words"), [
    ('[lanes.finance]\nqueue = "finance"\nlend_to = ["chatt"]\n', "'chatt' is not another lane"),
    ('[lanes.finance]\nqueue = "finance"\nlend_to = ["finance"]\n', "'finance' is not another"),
    ('[lanes.chat]\nqueue = "chat"\n[lanes.batch]\nqueue = "chat"\nruns_on = "chat"\n'
     'lend_to = ["chat"]\n', "runs on 'chat''s workers has none of its own to lend"),
    ('[lanes.chat]\nqueue = "chat"\nlend_max_share = 0\n', "lend_max_share"),
], ids=["unknown lane", "itself", "a lane without workers", "a share of nothing"])
def test_a_bad_lending_rule_is_refused_naming_lane_and_field(tmp_path, body, words) -> None:  # type: ignore[no-untyped-def]
    from tidegate.lanes import LanesConfigError, load_lanes

    path = tmp_path / "lanes.toml"
    path.write_text(body)
    with pytest.raises(LanesConfigError, match=re.escape(words)):
        load_lanes(path)


def test_precision_decides_who_may_borrow_and_consent_overrides_it() -> None:
    from tidegate.lanes import may_borrow

    assert may_borrow(CHAT, FINANCE)  # FP8 job on FP16: at least its precision
    assert not may_borrow(FINANCE, CHAT)  # FP16 job on FP8 KV and weights
    assert may_borrow(FINANCE.model_copy(update={"borrow_lower_precision": True}), CHAT)
    assert not may_borrow(CHAT, FINANCE.model_copy(update={"lend_to": []}))  # no consent
