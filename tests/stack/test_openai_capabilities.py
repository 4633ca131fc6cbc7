"""Engine capabilities, with the official `openai` SDK, against a lane that only a `sim`
worker serves: a real `tidegate worker --engine sim` process (its heartbeat says what its
engine can do), the API in this process on its own Redis database and a SQLite database of its own.
What the sim engine lacks is refused at admission, a 400 naming the field, with no row
and no message (the worker never sees the job); what it has (stop strings) works; and a
lane with `strict_fields` refuses unknown fields where other lanes ignore them.

The sim engine is the subject here (its capabilities and stop strings), not a stand-in
for vLLM: tests/stack/test_openai_sampling.py runs the same fields on vLLM."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import api_of_its_own, metric, own_db
from tidegate.fleet import read_heartbeat
from tidegate_tools.procs import Proc, start_worker, wait_until
from tidegate_tools.stack import api_ready

REDIS_DB = own_db(__name__, "19")
WORKER = "chat-sim@simcap"
MODEL = "tidegate-test"
USER = [{"role": "user", "content": "Where is my parcel?"}]


@dataclass
class SimLane:
    api: Any  # tests.helpers.ApiOfItsOwn
    key: str
    worker: Proc

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.api.base_url}/v1", api_key=self.key,
                             max_retries=0, timeout=60)

    def finished(self) -> float:
        """Jobs the sim worker ended (its own /metrics)."""
        text = httpx.get(f"http://127.0.0.1:{self.worker.metrics_port}/metrics", timeout=5).text
        return metric(text, "tidegate_jobs_finished_total")


def strict_lanes(tmp_root: Path) -> Path:
    """The tests' lanes file, its chat lane refusing unknown fields."""
    text = (Path(__file__).parents[1] / "lanes.toml").read_text()
    path = tmp_root / "simcap-lanes.toml"
    path.write_text(text.replace("[lanes.chat]\n", "[lanes.chat]\nstrict_fields = true\n", 1))
    return path


@pytest.fixture(scope="module")
def sim(redis_server: str, model_path: Path, tmp_root: Path) -> Iterator[SimLane]:
    lanes = strict_lanes(tmp_root)
    with api_of_its_own(redis_server, tmp_root, "simcap", REDIS_DB, [],
                        lanes_file=lanes) as api:
        _, key = api.store.tenants.create_tenant("simcap", ["chat"])
        settings = api.app.state.deps.settings
        env = {**os.environ, "TIDEGATE_REDIS_URL": settings.redis_url,
               "TIDEGATE_NAMESPACE": api.namespace, "TIDEGATE_LANES_FILE": str(lanes),
               "TIDEGATE_DATABASE_URL": settings.database_url}
        worker = start_worker(env, "chat", WORKER, tmp_root / "logs", pool="vllm",
                              engine="sim")
        try:
            wait_until(lambda: api_ready(api.base_url, [WORKER]), 300, "the sim worker",
                       [worker])
            yield SimLane(api, key, worker)
        finally:
            worker.stop()


def test_the_heartbeat_says_what_the_engine_can_do(sim: SimLane) -> None:
    beat = read_heartbeat(sim.api.redis, sim.api.namespace, WORKER)
    assert beat is not None and beat.engine == "sim"
    assert beat.capabilities == ("lora", "stop")


LACKING = [  # (the request's fields, the param the 400 names, the capability)
    ({"n": 2}, "n", "n"),
    ({"logprobs": True}, "logprobs", "logprobs"),
    ({"logprobs": True, "top_logprobs": 2}, "logprobs", "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty", "penalties"),
    ({"frequency_penalty": -0.5}, "frequency_penalty", "penalties"),
    ({"logit_bias": {"42": 5}}, "logit_bias", "logit_bias"),
    ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty", "penalties"),
    ({"extra_body": {"top_k": 5}}, "top_k", "sampling_extras"),
    ({"extra_body": {"min_p": 0.1}}, "min_p", "sampling_extras"),
]


def test_what_the_sim_engine_lacks_is_refused_naming_the_field(sim: SimLane) -> None:
    client = sim.sdk()
    rows, finished = sim.api.store.jobs.count_jobs(), sim.finished()
    for fields, param, capability in LACKING:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, **fields)
        assert caught.value.param == param, fields
        assert f"'{capability}' capability" in caught.value.message, caught.value.message
        assert sim.api.store.jobs.count_jobs() == rows, fields  # no row
    # Neutral values need nothing: accepted, and the one job the worker runs.
    done = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, n=1,
                                          presence_penalty=0, logit_bias={})
    assert done.choices[0].message.content and sim.api.store.jobs.count_jobs() == rows + 1
    # The worker ended that one job and no other: no message of a refused one reached it.
    wait_until(lambda: sim.finished() == finished + 1, 30, "the worker to count its job")
    assert sim.finished() == finished + 1


def test_the_sim_engine_honours_stop_strings(sim: SimLane) -> None:
    client = sim.sdk()
    whole = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12,
                                           temperature=0).choices[0].message.content
    assert whole and len(whole) > 12 and whole[8:11].strip()
    stop = whole[8:11]
    cut = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12,
                                         temperature=0, stop=[stop, "\x01never"])
    assert cut.choices[0].message.content == whole[:whole.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12,
                                              temperature=0, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole[:whole.find(stop)]


def test_a_strict_lane_refuses_unknown_fields_naming_them(sim: SimLane) -> None:
    rows = sim.api.store.jobs.count_jobs()
    with pytest.raises(openai.BadRequestError) as caught:
        sim.sdk().chat.completions.create(model=MODEL, messages=USER, max_tokens=3,
                                          extra_body={"bogus": 1})
    assert caught.value.param == "bogus" and "strict_fields" in caught.value.message
    assert sim.api.store.jobs.count_jobs() == rows
