"""Engine capabilities in the router (pure: the fleet as values), the needs a job's
sampling makes, and the n > 1 deltas merged per choice as the engine host merges them."""

from __future__ import annotations

import pytest

from tasks.payloads import GeneratePayload, Sampling
from tidegate import capabilities as cap
from tidegate.lanes import Lane
from tidegate.records import WorkerState
from tidegate.router import NoRoute, WorkerView, route
from workers.engine import ChoiceDelta, Delta
from workers.host import merge
from workers.sim_engine import SimEngine
from workers.trtllm_engine import TrtllmEngine
from workers.vllm_engine import VllmEngine

LANE = Lane(name="chat", queue="chat", pools=["trtllm", "vllm"])


def worker(name: str, pool: str, capabilities: frozenset[str] | None) -> WorkerView:
    return WorkerView(name=name, pool=pool, lanes=frozenset({"chat"}),
                      state=WorkerState.ACTIVE, slots=4, capabilities=capabilities)


def direct(name: str) -> str:
    return f"direct.{name}"


def test_a_job_goes_to_the_pool_whose_engines_can_run_it() -> None:
    fleet = [worker("t", "trtllm", TrtllmEngine.capabilities),
             worker("v", "vllm", VllmEngine.capabilities)]
    assert route(LANE, fleet, {}, direct).queue == "chat.trtllm"  # the preferred pool
    got = route(LANE, fleet, {}, direct, needs={cap.LOGPROBS: "logprobs"})
    assert got.queue == "chat.vllm"


def test_a_need_no_worker_of_the_lane_has_is_refused_naming_the_field() -> None:
    fleet = [worker("s", "vllm", SimEngine.capabilities)]
    with pytest.raises(NoRoute) as caught:
        route(LANE, fleet, {}, direct, needs={cap.STOP: "stop", cap.N: "n"})
    assert caught.value.field == "n" and "'n' capability" in str(caught.value)
    assert route(LANE, fleet, {}, direct, needs={cap.STOP: "stop"}).queue == "chat.vllm"


def test_no_healthy_worker_stays_a_503_and_an_older_worker_is_taken_as_able() -> None:
    with pytest.raises(NoRoute) as caught:
        route(LANE, [], {}, direct, needs={cap.N: "n"})
    assert caught.value.field is None  # unavailable, not the request's fault
    old = [worker("o", "vllm", None)]
    assert route(LANE, old, {}, direct, needs={cap.N: "n"}).queue == "chat.vllm"


def test_the_needs_of_a_payloads_sampling_survive_its_json() -> None:
    sampling = Sampling(max_tokens=4, n=2, logprobs=0, presence_penalty=0.0,
                        repetition_penalty=1.0, logit_bias=((42, 5.0),), top_k=-1, min_p=0.1)
    payload = GeneratePayload(job_id="j", lane="chat", prompt="p", prompt_tokens=1,
                              sampling=sampling)
    back = GeneratePayload.from_dict(payload.to_dict()).sampling
    assert back == sampling
    assert cap.needs(back) == {cap.N: "n", cap.LOGPROBS: "logprobs",
                               cap.LOGIT_BIAS: "logit_bias", cap.SAMPLING_EXTRAS: "min_p"}
    assert cap.needs(Sampling(max_tokens=4)) == {}


def test_choices_merge_per_index_and_count_every_token() -> None:
    steps = [Delta(text="a", token_ids=(1,), choices=(
                 ChoiceDelta(0, "a", (1,)), ChoiceDelta(1, "x", (7,)))),
             Delta(text="", token_ids=(), choices=(
                 ChoiceDelta(1, "y", (8,), finish_reason="length"),)),
             Delta(text="b", token_ids=(2,), finished=True, finish_reason="length",
                   choices=(ChoiceDelta(0, "b", (2,), finish_reason="length"),))]
    merged = merge(steps)
    assert merged.text == "ab" and merged.other_tokens == 2 and not merged.empty
    assert [(c.index, c.text, c.finish_reason) for c in merged.choices] == [
        (0, "ab", "length"), (1, "xy", "length")]
    assert [c["tokens"] for c in merged.event_data()["choices"]] == [2, 2]
    assert Delta(text="", token_ids=()).empty
