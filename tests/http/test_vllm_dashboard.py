"""vLLM's Grafana dashboard reads hotlora: every metric its PromQL queries name is in a real
/metrics scrape, with the `model_name` label its queries select by.

`data/vllm_grafana.json` holds the panels and queries of vLLM's
`examples/online_serving/prometheus_grafana/grafana.json` (vLLM commit 004f771f), layout left out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).parent / "data" / "vllm_grafana.json"
# PromQL words that are not metric names: grouping and matching keywords, set operators.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
KEYWORDS |= {"and", "or", "unless"}


def queries(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery selectors
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        called = expr[match.end() :].lstrip().startswith("(")  # a function or an aggregation
        if not called and match.group() not in KEYWORDS:
            names.add(match.group())
    return names


def test_the_parser_finds_names_not_functions():
    expr = (
        'histogram_quantile(0.99, sum by(le) (rate(vllm:x_bucket{model_name="$m"}'
        "[$__rate_interval])))\n/\nrate(vllm:y_count[5m]) and on(model_name) z"
    )
    assert metric_names(expr) == {"vllm:x_bucket", "vllm:y_count", "z"}


def test_every_metric_the_dashboard_queries_is_scraped(client: TestClient):
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "the cat"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    scraped = client.get("/metrics")
    assert scraped.status_code == 200
    labels: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(scraped.text):
        for sample in family.samples:
            labels.setdefault(sample.name, []).append(sample.labels)

    wanted = set().union(
        *(metric_names(expr) for expr in queries(json.loads(DASHBOARD.read_text())))
    )
    assert len(wanted) >= 15  # the dashboard's twelve panels name this many
    missing = sorted(name for name in wanted if name not in labels)
    assert not missing, f"the dashboard queries metrics /metrics lacks: {missing}"
    # Its queries select `model_name="$model_name"`, a value its variable reads from vllm:* series.
    unlabelled = sorted(
        name for name in wanted if not any(s.get("model_name") == "tiny" for s in labels[name])
    )
    assert not unlabelled, f"no series with model_name='tiny': {unlabelled}"
