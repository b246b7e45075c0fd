"""What operators see, in-process on the tiny model: /metrics, the access log, start-up phases."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from hotlora.server.telemetry.log_format import TEXT_FORMAT, JsonFormatter

from tests.http.conftest import wait_ready
from tests.support.adapter_builders import random_pairs, tiny_model, write_mlx_adapter
from tests.support.tiny import ENDOFTEXT_ID, EOS_TOKEN_ID

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}], "temperature": 0}
# Every choice runs to max_tokens: both of the tiny model's end-of-generation tokens held off.
NO_EOS = {str(EOS_TOKEN_ID): -100, str(ENDOFTEXT_ID): -100}
SECRET = "sk-test-7f3a9c41d2"
PROMPT = "my private words about zebras"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    model = tiny_model(quantize=True)
    write_mlx_adapter(root / "a", random_pairs(model, seed=1), scale=20.0)
    write_mlx_adapter(root / "b", random_pairs(model, seed=2), scale=20.0)
    return root


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of GET /metrics, by sample name and sorted labels."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def labelled(samples: dict[Any, float], name: str) -> list[dict[str, str]]:
    return [dict(labels) for sample, labels in samples if sample == name]


def usage(response: Any) -> dict[str, int]:
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_counters_follow_the_responses_usage_per_adapter(make_client, root: Path):
    client = make_client(adapter_root=root)
    assert client.post("/v1/adapters", json={"id": "a", "path": "a"}).status_code == 201
    assert client.post("/v1/adapters", json={"id": "a", "path": "a"}).status_code == 200
    assert (
        client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "b"}).status_code
        == 200
    )
    assert client.post("/v1/adapters", json={"id": "c", "path": "../c"}).status_code == 400
    assert client.delete("/v1/adapters/nope").status_code == 404

    base = usage(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5}))
    with_a = usage(
        client.post(
            "/v1/chat/completions",
            json={**CHAT, "adapter": "a", "n": 2, "max_tokens": 4, "logit_bias": NO_EOS},
        )
    )
    stacked = usage(
        client.post(
            "/v1/completions",
            json={"model": "tiny:a+b", "prompt": "the dog", "max_tokens": 3, "temperature": 0},
        )
    )
    assert client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}).status_code == 404
    assert client.delete("/v1/adapters/b").status_code == 200
    assert with_a["completion_tokens"] == 8

    m = scrape(client)
    everything = [base, with_a, stacked]
    model = {"model_name": "tiny"}
    assert value(m, "vllm:prompt_tokens_total", **model) == sum(
        u["prompt_tokens"] for u in everything
    )
    assert value(m, "vllm:generation_tokens_total", **model) == sum(
        u["completion_tokens"] for u in everything
    )
    assert value(m, "vllm:prefix_cache_queries_total", **model) == sum(
        u["prompt_tokens"] for u in everything
    )
    assert value(m, "vllm:prefix_cache_hits_total", **model) == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in everything
    )
    for adapter, served in {"tiny": [base], "a": [with_a, stacked], "b": [stacked]}.items():
        assert value(m, "hotlora_adapter_requests_total", adapter=adapter) == len(served)
        assert value(m, "hotlora_adapter_prompt_tokens_total", adapter=adapter) == sum(
            u["prompt_tokens"] for u in served
        )
        assert value(m, "hotlora_adapter_generation_tokens_total", adapter=adapter) == sum(
            u["completion_tokens"] for u in served
        )
    # Four choices finished, three requests ended; the refused one never ran.
    finished = {
        labels["finished_reason"]: m[("vllm:request_success_total", tuple(sorted(labels.items())))]
        for labels in labelled(m, "vllm:request_success_total")
    }
    assert sum(finished.values()) == 4 and finished.get("length", 0) >= 2
    assert value(m, "vllm:time_to_first_token_seconds_count", **model) == 4
    assert value(m, "vllm:e2e_request_latency_seconds_count", **model) == 3
    assert value(m, "vllm:inter_token_latency_seconds_count", **model) > 0
    assert value(m, "hotlora_decode_batch_size_count") > 0
    assert value(m, "hotlora_decode_batch_size_bucket", le="2.0") == value(
        m, "hotlora_decode_batch_size_count"
    )  # n=2 decodes two rows at most
    # Admin: a, b mounted (the same files again is no mount), b unmounted, two refusals.
    assert value(m, "hotlora_adapter_mounts_total") == 2
    assert value(m, "hotlora_adapter_unmounts_total") == 1
    assert (
        value(m, "hotlora_adapter_refusals_total", op="mount", reason="adapter_path_refused") == 1
    )
    assert value(m, "hotlora_adapter_refusals_total", op="unmount", reason="adapter_not_found") == 1
    # Nothing runs now; finished requests left their caches for reuse.
    assert value(m, "vllm:num_requests_running", **model) == 0
    assert value(m, "vllm:num_requests_waiting", **model) == 0
    assert value(m, "vllm:kv_cache_usage_perc", **model) == 0
    assert value(m, "hotlora_prompt_cache_entries", **model) > 0
    assert value(m, "hotlora_prompt_cache_bytes", **model) > 0
    assert value(m, "hotlora_adapters_mounted", **model) == 1
    [lora] = labelled(m, "vllm:lora_requests_info")
    assert lora == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}


def test_embeddings_count_in_the_prompt_and_adapter_counters(make_client, root: Path):
    client = make_client(adapter_root=root, startup_adapters={"a": "a"})
    model = {"model_name": "tiny"}
    before = scrape(client)
    used = [
        client.post("/v1/embeddings", json={"model": model_id, "input": ["the cat", "a dog"]})
        for model_id in ("tiny", "a")
    ]
    tokens = [answer.json()["usage"]["prompt_tokens"] for answer in used]
    after = scrape(client)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("vllm:prompt_tokens_total", **model) == sum(tokens)
    assert grew("hotlora_adapter_requests_total", adapter="tiny") == 1
    assert grew("hotlora_adapter_prompt_tokens_total", adapter="a") == tokens[1]
    # They generate nothing: no generation metric hears of them.
    assert grew("vllm:e2e_request_latency_seconds_count", **model) == 0
    assert grew("vllm:generation_tokens_total", **model) == 0


def test_running_and_waiting_gauges_follow_the_batch(make_client, root: Path):
    client = make_client(adapter_root=root, max_batch=1, startup_adapters={"a": "a", "b": "b"})
    scheduler = client.app.state.runtime.worker.scheduler
    gate = threading.Semaphore(0)
    step = scheduler.step

    def gated_step() -> None:
        gate.acquire()
        step()

    scheduler.step = gated_step  # each step of the generation thread waits for a permit
    results: list[Any] = []

    def ask(adapter: str) -> threading.Thread:
        body = {**CHAT, "adapter": adapter, "max_tokens": 4, "logit_bias": NO_EOS}
        thread = threading.Thread(
            target=lambda: results.append(client.post("/v1/chat/completions", json=body))
        )
        thread.start()
        return thread

    def gauges() -> tuple[float, float]:
        m = scrape(client)
        return (
            value(m, "vllm:num_requests_running", model_name="tiny"),
            value(m, "vllm:num_requests_waiting", model_name="tiny"),
        )

    def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)

    try:
        threads = [ask("a")]
        until(lambda: gauges() == (0, 1))
        threads.append(ask("b"))
        until(lambda: gauges() == (0, 2))
        gate.release(2)  # a is admitted and decodes twice; b waits for room (max_batch=1)
        until(lambda: scheduler.load.running == 1 and scheduler.load.waiting_adapters)
        m = scrape(client)
        assert gauges() == (1, 1)
        assert 0 < value(m, "vllm:kv_cache_usage_perc", model_name="tiny") <= 1
        [lora] = labelled(m, "vllm:lora_requests_info")
        assert lora["running_lora_adapters"] == "a" and lora["waiting_lora_adapters"] == "b"
    finally:
        gate.release(1000)
        for thread in threads:
            thread.join(timeout=30)
    assert [r.status_code for r in results] == [200, 200]
    until(lambda: gauges() == (0, 0))


def test_metrics_answer_before_the_model_is_ready(make_client, monkeypatch):
    from hotlora.server import runtime as runtime_module

    loading = threading.Event()
    load = runtime_module.load_model_dir

    def held_load(path: Path) -> Any:
        loading.wait(timeout=30)
        return load(path)

    monkeypatch.setattr(runtime_module, "load_model_dir", held_load)
    client = make_client(ready=False, api_key=SECRET)
    try:
        assert client.get("/ready").status_code == 503
        m = scrape(client)  # no key needed, as vLLM's
        assert value(m, "vllm:num_requests_running", model_name="tiny") == 0
        assert value(m, "vllm:num_requests_waiting", model_name="tiny") == 0
        assert value(m, "hotlora_adapters_mounted", model_name="tiny") == 0
    finally:
        loading.set()
    wait_ready(client)


def test_the_access_line_has_the_request_facts_and_no_secrets(make_client, root, caplog):
    client = make_client(adapter_root=root, api_key=SECRET, startup_adapters={"a": "a"})
    key = {"Authorization": f"Bearer {SECRET}"}
    caplog.set_level(logging.DEBUG, logger="hotlora")
    chat = {**CHAT, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
    answer = client.post(
        "/v1/chat/completions",
        json={**chat, "adapter": "a"},
        headers={**key, "x-request-id": "r-1"},
    )
    assert answer.status_code == 200
    streamed = client.post(
        "/v1/chat/completions",
        json={**chat, "stream": True, "stream_options": {"include_usage": True}},
        headers={**key, "x-request-id": "r-2"},
    )
    assert streamed.status_code == 200
    assert (
        client.post(
            "/v1/chat/completions",
            json={**chat, "model": "nope"},
            headers={**key, "x-request-id": "r-3"},
        ).status_code
        == 404
    )
    assert (
        client.post(
            "/v1/chat/completions",
            json=chat,
            headers={"Authorization": "Bearer wrong", "x-request-id": "r-4"},
        ).status_code
        == 401
    )
    embedded = client.post(
        "/v1/embeddings",
        json={"model": "tiny", "input": "the cat"},
        headers={**key, "x-request-id": "r-5"},
    )
    assert embedded.status_code == 200

    access = [r for r in caplog.records if r.name == "hotlora.access"]
    lines = {
        line["request_id"]: line for line in (json.loads(JsonFormatter().format(r)) for r in access)
    }
    served = lines["r-1"]
    assert served["method"] == "POST" and served["path"] == "/v1/chat/completions"
    assert served["route"] == "/v1/chat/completions" and served["status"] == 200
    assert served["model"] == "tiny:a" and served["adapters"] == ["a"]
    usage = answer.json()["usage"]
    assert served["prompt_tokens"] == usage["prompt_tokens"]
    assert served["completion_tokens"] == usage["completion_tokens"]
    assert served["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert served["finish_reason"] in ("stop", "length")
    assert 0 < served["ttft_ms"] <= served["duration_ms"]
    assert served["error"] is None and served["level"] == "INFO"
    stream = lines["r-2"]
    assert stream["model"] == "tiny" and stream["adapters"] == []
    assert stream["completion_tokens"] > 0 and stream["ttft_ms"] is not None
    assert lines["r-3"]["status"] == 404 and lines["r-3"]["error"] == "model_not_found"
    assert lines["r-3"]["prompt_tokens"] is None
    assert lines["r-4"]["status"] == 401 and lines["r-4"]["error"] == "invalid_api_key"

    text = logging.Formatter(TEXT_FORMAT).format(
        next(r for r in access if "id=r-1" in r.getMessage())
    )
    assert (
        "POST /v1/chat/completions 200" in text
        and "model=tiny:a adapters=a" in text
        and "ttft=" in text
        and f"cached={usage['prompt_tokens_details']['cached_tokens']}" in text
    )
    # A fact that does not apply is left out of the text line: embeddings cache nothing.
    text = logging.Formatter(TEXT_FORMAT).format(
        next(r for r in access if "id=r-5" in r.getMessage())
    )
    assert "POST /v1/embeddings 200" in text and "prompt=" in text and "cached=" not in text
    # Neither the key nor the prompt reaches any log line, in either format.
    for record in caplog.records:
        for line in (JsonFormatter().format(record), logging.Formatter(TEXT_FORMAT).format(record)):
            assert SECRET not in line and "zebras" not in line, line


def test_start_up_reports_each_phase(make_client, root: Path, caplog):
    caplog.set_level(logging.INFO, logger="hotlora")
    client = make_client(adapter_root=root, startup_adapters={"a": "a"})
    phases = {
        r.fields["phase"]: r.fields["seconds"]
        for r in caplog.records
        if r.name == "hotlora" and r.getMessage().startswith("start-up:")
    }
    assert {"model load", "adapter mounts", "warm-up"} <= set(phases)
    assert all(seconds >= 0 for seconds in phases.values())
    assert any("ready: serving tiny" in r.getMessage() for r in caplog.records)
    m = scrape(client)
    reported = {labels["phase"] for labels in labelled(m, "hotlora_startup_phase_seconds")}
    assert reported == set(phases)
    assert value(m, "hotlora_adapter_mounts_total") == 1


def test_a_start_up_phase_still_running_says_so_once(make_client, root: Path, caplog, monkeypatch):
    from hotlora.server import runtime

    monkeypatch.setattr(runtime, "PHASE_NOTICE_SECONDS", 0.001)
    caplog.set_level(logging.INFO, logger="hotlora")
    make_client(adapter_root=root, startup_adapters={"a": "a"})
    messages = [r.getMessage() for r in caplog.records if r.name == "hotlora"]
    notices = [m for m in messages if m.startswith("still starting:")]
    phases = [m.split("start-up: ")[1].split(" took")[0] for m in messages if " took " in m]
    assert "still starting: model load under way after 0.001s" in notices
    assert len(notices) == len(set(notices)) and len(notices) <= len(phases)
    assert {n.split(": ")[1].split(" under way")[0] for n in notices} <= set(phases)


def test_request_histograms_follow_usage_and_phases(client: TestClient):
    one = usage(
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5, "logit_bias": NO_EOS})
    )
    two = usage(
        client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": "the dog",
                "n": 2,
                "max_tokens": 3,
                "temperature": 0,
                "logit_bias": NO_EOS,
            },
        )
    )
    m = scrape(client)
    model = {"model_name": "tiny"}
    assert value(m, "vllm:request_prompt_tokens_count", **model) == 2
    assert value(m, "vllm:request_prompt_tokens_sum", **model) == (
        one["prompt_tokens"] + two["prompt_tokens"]
    )
    assert value(m, "vllm:request_generation_tokens_sum", **model) == 5 + 6
    # The longest choice of each: 5, then 3 of the two choices' 3 each.
    assert value(m, "vllm:request_max_num_generation_tokens_sum", **model) == 5 + 3
    assert value(m, "vllm:request_max_num_generation_tokens_bucket", le="5.0", **model) == 2
    # One per choice that made more than one token.
    assert value(m, "vllm:time_per_output_token_seconds_count", **model) == 3
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value(m, f"vllm:request_{phase}_time_seconds_count", **model) == 2
    phases = sum(
        value(m, f"vllm:request_{phase}_time_seconds_sum", **model)
        for phase in ("queue", "prefill", "decode")
    )
    inference = value(m, "vllm:request_inference_time_seconds_sum", **model)
    assert inference == pytest.approx(
        value(m, "vllm:request_prefill_time_seconds_sum", **model)
        + value(m, "vllm:request_decode_time_seconds_sum", **model)
    )
    assert 0 < phases <= value(m, "vllm:e2e_request_latency_seconds_sum", **model)
    assert value(m, "vllm:num_preemptions_total", **model) == 0
    assert value(m, "vllm:gpu_cache_usage_perc", **model) == value(
        m, "vllm:kv_cache_usage_perc", **model
    )
    [config] = labelled(m, "vllm:cache_config_info")
    assert config["enable_prefix_caching"] == "True" and int(config["kv_cache_bytes"]) > 0
