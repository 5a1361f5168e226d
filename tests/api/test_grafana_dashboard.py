"""docs/grafana/umem-jax-dashboard.json against the served /metrics: every metric a panel or a
template variable queries exists in our output, with the labels the query selects or groups
by, and the dashboard charts what docs/grafana/README.md says it does.

Metric names come out of the PromQL expressions by a small lexer (strings, range selectors,
label matchers and grouping clauses taken out first, then every identifier not called as a
function and not a keyword is a metric name); its own test below pins what it finds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from _server_utils import MODEL
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "umem-jax-dashboard.json"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
            "inf", "nan"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
# what the dashboard is for (README.md): band bytes, held vs available, retractions, compactions,
# TTFT / ITL, running / waiting
REQUIRED = {"umem:arena_band_held_bytes", "umem:arena_band_held", "umem:arena_band_available",
            "umem:num_retractions_total", "umem:num_compactions_total", "umem:time_to_first_token_seconds_bucket",
            "umem:inter_token_latency_seconds_bucket", "umem:num_requests_running", "umem:num_requests_waiting"}


def parse_promql(expr: str) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """-> (metric names, {metric: label names its matchers use}, label names of grouping clauses)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values (may hold $vars, regexes)
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors and subqueries: [5m], [$__rate_interval]
    matchers: dict[str, set[str]] = {}
    bare = set()
    for name, body in SELECTOR.findall(e):
        labels = {m.group(0) for m in re.finditer(r"[A-Za-z_][A-Za-z0-9_]*(?=\s*(=~|!~|!=|=))", body)}
        if name:
            matchers.setdefault(name, set()).update(labels)
        else:
            bare |= labels
    e = SELECTOR.sub(lambda m: m.group(1) or "", e)
    grouping = set()
    for _, body in GROUPING.findall(e):
        grouping |= {t.strip() for t in body.split(",") if t.strip()}
    e = GROUPING.sub(" ", e)
    names = set()
    for m in IDENT.finditer(e):
        tok, rest = m.group(0), e[m.end():]
        if tok.lower() in KEYWORDS or re.match(r"\s*\(", rest) or re.fullmatch(r"\d.*", tok):
            continue
        if m.start() > 0 and (e[m.start() - 1].isdigit() or e[m.start() - 1] == "."):
            continue  # the exponent or unit tail of a number (1e3, 0.5)
        names.add(tok)
    assert not bare, f"label matchers without a metric name in {expr!r}"
    return names, matchers, grouping


def test_the_lexer_finds_names_labels_and_groupings():
    names, matchers, grouping = parse_promql(
        'histogram_quantile(0.99, sum by (le, band) (rate(umem:x_bucket{model_name=~"$m", band!="a{b}"}'
        '[$__rate_interval]))) / ignoring(kind) sum(rate(umem:y_total[5m] offset 1h)) > bool 1e3')
    assert names == {"umem:x_bucket", "umem:y_total"} and grouping == {"le", "band", "kind"}
    assert matchers == {"umem:x_bucket": {"model_name", "band"}}
    assert parse_promql("umem:z")[0] == {"umem:z"}


def _queries(dash: dict) -> list[str]:
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", ()):
            out.append(t["expr"])
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\)", q)
        assert m, q
        out.append(f"sum by ({m.group(2)}) ({m.group(1)})")  # the variable's label must be on the metric
    return out


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["schemaVersion"] >= 36
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["description"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            e = t["expr"]
            assert e.count("(") == e.count(")") and e.count("{") == e.count("}") and e.count("[") == e.count("]"), e
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "model_name", "band"} <= names
    used = set()
    for e in _queries(dash):
        used |= parse_promql(e)[0]
    assert REQUIRED <= used, REQUIRED - used


def _served(srv) -> tuple[set[str], dict[str, set[str]]]:
    """Series names /metrics exposes, or will once they have samples (a labelled counter shows
    only its HELP and TYPE until its first label set), and the labels seen on each."""
    names, labels = set(), {}
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}
    for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics", timeout=30).text):
        names |= {fam.name + s for s in suffixes.get(fam.type, ("",))}
        for s in fam.samples:
            names.add(s.name)
            labels.setdefault(s.name, set()).update(s.labels)
    return names, labels


def test_every_queried_metric_and_label_is_served(srv):
    # one finished request, so the labelled request counters have a series too
    r = srv.client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
    served, labels = _served(srv)
    assert "umem:num_retractions_total" in served and "umem:no_such_metric" not in served
    dash = json.loads(DASHBOARD.read_text())
    missing, bad_labels = set(), []
    for e in _queries(dash):
        names, matchers, grouping = parse_promql(e)
        missing |= names - served
        for name, used in matchers.items():
            if name in labels and not used <= labels[name]:
                bad_labels.append((e, used - labels[name]))
        seen = set().union(*(labels.get(n, set()) for n in names))
        if seen and not grouping <= seen:  # grouping by a label none of its series carries
            bad_labels.append((e, grouping - seen))
    assert not missing, f"the dashboard queries metrics /metrics does not serve: {sorted(missing)}"
    assert not bad_labels, bad_labels
    assert all(n.startswith("umem:") for e in _queries(dash) for n in parse_promql(e)[0])


@pytest.mark.parametrize("metric", sorted(REQUIRED))
def test_required_metrics_have_samples(srv, metric):
    _, labels = _served(srv)
    assert metric in labels, f"{metric} has no sample in /metrics"
