"""Shared helpers of the deploy checks: where things are, the metric contract of
docs/METRICS.md, and the PromQL expressions of the dashboard and the rules.

Standard library and PyYAML only (Debian's python3-yaml)."""

import json
import pathlib
import re
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/kvcache-manager"
DASHBOARD = CHART / "dashboards/kvcache.json"  # canonical; deploy/grafana/ holds a copy
RULES = CHART / "rules/kvcache.rules.yaml"  # canonical; deploy/prometheus/ holds a copy
METRICS_DOC = ROOT / "docs/METRICS.md"
PROM_TESTS = ROOT / "deploy/prometheus/tests"

# Identical copies: (canonical, copy).
COPIES = [
    (DASHBOARD, ROOT / "deploy/grafana/kvcache.json"),
    (RULES, ROOT / "deploy/prometheus/kvcache.rules.yaml"),
    (ROOT / "deploy/docker/Dockerfile.dockerignore",
     ROOT / "deploy/docker/Dockerfile.cuda.dockerignore"),
]

# A metric name as our expressions write them: every series of the daemon starts with
# kvcache_, every recorded one with kvcache:.
METRIC_RE = re.compile(r"(?<![A-Za-z0-9_:$])kvcache[_:][A-Za-z0-9_:]*")
# Names of other exporters the rules may use on purpose.
FOREIGN_METRICS = {"up"}


class Failures:
    """Collects failed checks so that one run reports all of them."""

    def __init__(self):
        self.items = []

    def check(self, ok, message):
        if not ok:
            self.items.append(message)
        return ok

    def fail(self, message):
        self.items.append(message)

    def exit(self, what):
        if self.items:
            print(f"FAIL: {what}: {len(self.items)} problem(s)")
            for m in self.items:
                print(f"  - {m}")
            sys.exit(1)
        print(f"OK: {what}")


def documented_metrics():
    """{name: type} from the table of docs/METRICS.md."""
    metrics = {}
    row = re.compile(r"^\|\s*`([a-z_:][a-z0-9_:]*)`\s*\|\s*(counter|gauge|histogram|summary)\s*\|")
    for line in METRICS_DOC.read_text().splitlines():
        m = row.match(line)
        if m:
            metrics[m.group(1)] = m.group(2)
    if not metrics:
        raise SystemExit(f"no metric rows found in {METRICS_DOC.relative_to(ROOT)}")
    return metrics


def series_names(metrics):
    """The series names a scrape of the documented metrics yields."""
    names = set()
    for name, kind in metrics.items():
        if kind == "histogram":
            names |= {name + "_bucket", name + "_sum", name + "_count"}
        elif kind == "summary":
            names |= {name, name + "_sum", name + "_count"}
        else:
            names.add(name)
    return names


def referenced_metrics(expr):
    return set(METRIC_RE.findall(expr)) | {
        n for n in FOREIGN_METRICS if re.search(rf"(?<![A-Za-z0-9_:]){n}\s*[{{\[)]", expr)}


def load_dashboard(path=DASHBOARD):
    return json.loads(pathlib.Path(path).read_text())


def dashboard_panels(dashboard):
    """Every panel that is not a row, including those inside collapsed rows."""
    out = []
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def dashboard_queries(dashboard):
    """[(where, expr)] of every panel target."""
    out = []
    for p in dashboard_panels(dashboard):
        for t in p.get("targets", []):
            out.append((f'panel "{p.get("title")}" target {t.get("refId")}', t.get("expr", "")))
    return out


def dashboard_variable_queries(dashboard):
    """[(variable name, query string)] of the query variables."""
    out = []
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            out.append((v["name"], q.get("query") if isinstance(q, dict) else q))
    return out


def substitute(expr, rate_interval, variables):
    """Grafana's substitution of $__rate_interval and template variables ($x and ${x})."""
    expr = expr.replace("${__rate_interval}", rate_interval).replace("$__rate_interval", rate_interval)
    for name, value in variables.items():
        expr = re.sub(r"\$\{" + re.escape(name) + r"\}|\$" + re.escape(name) + r"\b", value, expr)
    return expr


def label_values_to_promql(query):
    """label_values(selector, label) -> an expression listing the label's values."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", query)
    if not m:
        raise ValueError(f"not a label_values() query: {query}")
    return f"count by ({m.group(2)}) ({m.group(1)})"


def load_rules(path=RULES):
    return yaml.safe_load(pathlib.Path(path).read_text())


def rule_entries(rules):
    """[(group, rule dict)] over every group."""
    return [(g["name"], r) for g in rules["groups"] for r in g["rules"]]


def recorded_names(rules):
    return {r["record"] for _, r in rule_entries(rules) if "record" in r}


class UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a mapping with the same key twice."""


def _construct_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_all_unique(text):
    return [d for d in yaml.load_all(text, Loader=UniqueKeyLoader) if d is not None]
