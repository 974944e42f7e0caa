#!/usr/bin/env python3
"""End-to-end check of the dashboard and the rules against a real daemon and a real
Prometheus, all on loopback:

 1. start kvcached on free ports and wait until it reports kvcache_serving 1;
 2. start Prometheus (temporary storage, scrape and rule evaluation every 1s) scraping the
    daemon's metrics port as job "kvcached", with the rules of the chart loaded;
 3. run kvcache-loadgen against the daemon for a few seconds (eviction-quality
    diagnostics on for every step), then let a few scrapes pass;
 4. check that the daemon exports exactly the kvcache_ names of docs/METRICS.md and every
    name the dashboard and the rules reference;
 5. evaluate every query of the dashboard (as Grafana would: range query, $__rate_interval
    and the template variables substituted) and every rule expression through the HTTP
    API, failing on any error, and on a dashboard query with no data (error counters
    aside); check that Prometheus evaluated every loaded rule without error;
 6. stop the daemon with SIGTERM and expect a clean exit within its drain deadline.

Usage: e2e_prometheus.py --kvcached BIN --loadgen BIN [--prometheus BIN] [--promtool BIN]
       e2e_prometheus.py --scrape-target HOST:PORT   (a daemon you started; no load)
       e2e_prometheus.py --scrape-self   (harness development only: no daemon, Prometheus
                                          scrapes itself; the name checks then fail)
"""

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import deploylib as dl  # noqa: E402

NAMESPACE, POD = "kvcache-e2e", "kvcached-e2e-0"
RATE_INTERVAL = "15s"
# Counters that only get series once something goes wrong: no data is expected.
MAY_BE_EMPTY = {"kvcache_errors_total"}
E2E_TOKENS_PER_BLOCK = 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def api(base, path, **params):
    url = f"{base}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        body = http_get(url, timeout=20)
    except urllib.error.HTTPError as e:  # 400/422 carry the PromQL error in JSON
        body = e.read().decode()
    return json.loads(body)


def wait_for(what, fn, timeout, procs=()):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        for name, p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode} while waiting for {what}")
        try:
            last = fn()
            if last:
                return last
        except (OSError, ValueError) as e:
            last = e
        time.sleep(0.25)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def exported_names(text):
    """Series names of a Prometheus text exposition."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


class Run:
    def __init__(self, args):
        self.args = args
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvcm-e2e-"))
        self.procs = []  # (name, Popen, log path)
        self.f = dl.Failures()

    def start(self, name, cmd):
        log = self.tmp / f"{name}.log"
        print(f"$ {' '.join(cmd)}", flush=True)
        p = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, cwd=self.tmp)
        self.procs.append((name, p, log))
        return p

    def dump_logs(self):
        for name, _, log in self.procs:
            text = log.read_text(errors="replace") if log.exists() else ""
            tail = "\n".join(text.splitlines()[-25:])
            print(f"---- last lines of {name}'s output ----\n{tail}")

    def stop_all(self):
        for name, p, _ in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def main(self):
        a = self.args
        grpc_port, metrics_port, prom_port = free_port(), free_port(), free_port()
        prom = f"http://127.0.0.1:{prom_port}"
        daemon = None
        if a.scrape_self:
            target = f"127.0.0.1:{prom_port}"
        elif a.scrape_target:
            target = a.scrape_target
        else:
            target = f"127.0.0.1:{metrics_port}"
            daemon = self.start("kvcached", [
                a.kvcached, f"--listen=127.0.0.1:{grpc_port}",
                f"--metrics_listen=127.0.0.1:{metrics_port}", "--backend=host",
                f"--drain_deadline={a.drain_seconds}s",
                # Small host KV pools, so that the pool panels and rules see leased blocks.
                "--tp_ranks=2", "--pool_memory_bytes=16777216", "--kv_layers=4", "--kv_heads=2",
                "--kv_head_dim=16", f"--kv_tokens_per_block={E2E_TOKENS_PER_BLOCK}",
                "--kv_shared_memory=false",
                # Eviction-quality diagnostics on every scoring step of every sequence, so
                # that the dashboard's "Eviction quality" row has data.
                "--diagnostics_every=1", "--diagnostics_sample=1.0"])
            wait_for("kvcached to report kvcache_serving 1",
                     lambda: any(l.startswith("kvcache_serving") and l.split()[-1] in ("1", "1.0")
                                 for l in http_get(f"http://{target}/metrics").splitlines()),
                     30, [("kvcached", daemon)])

        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(dl.RULES)],
            "scrape_configs": [{
                "job_name": "kvcached",
                "static_configs": [{"targets": [target],
                                    "labels": {"namespace": NAMESPACE, "pod": POD}}],
            }],
        }
        (self.tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prometheus = self.start("prometheus", [
            a.prometheus, f"--config.file={self.tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.tmp / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn"])
        watched = [("prometheus", prometheus)] + ([("kvcached", daemon)] if daemon else [])
        wait_for("Prometheus to be ready", lambda: "Ready" in http_get(f"{prom}/-/ready"), 60, watched)
        load_start = time.time()

        if daemon:
            loadgen = [a.loadgen, f"--server=127.0.0.1:{grpc_port}", "--sequences=8", "--streams=2",
                       "--layers=4", "--context=256", "--compression_ratio=0.9", "--dtype=float16",
                       "--policy=inertia", f"--duration={a.load_seconds}s"]
            print(f"$ {' '.join(loadgen)}", flush=True)
            r = subprocess.run(loadgen, capture_output=True, text=True, timeout=a.load_seconds + 60)
            print("\n".join((r.stdout + r.stderr).strip().splitlines()[-10:]))
            self.f.check(r.returncode == 0, f"kvcache-loadgen exited with code {r.returncode}")
            self.f.check(daemon.poll() is None, f"kvcached exited (code {daemon.returncode}) under load")
        else:
            time.sleep(a.load_seconds)

        # A few scrapes after the load, and every rule evaluated at least once since.
        wait_for("5 scrapes of the daemon",
                 lambda: float(self.scalar(prom, 'count_over_time(up{job="kvcached"}[5m])') or 0) >= 5
                 and time.time() - load_start >= a.load_seconds + 3, 60, watched)
        targets = api(prom, "/api/v1/targets")["data"]["activeTargets"]
        for t in targets:
            self.f.check(t["health"] == "up" and not t["lastError"],
                         f"target {t['scrapeUrl']}: health {t['health']}, error {t['lastError']!r}")
        self.f.check(len(targets) == 1, f"{len(targets)} scrape targets")

        self.check_names(prom, target)
        self.check_dashboard(prom, load_start)
        self.check_rules(prom)

        if daemon:
            for expr in ('kvcache_serving{job="kvcached"} == 1',
                         'sum(kvcache_steps_total{job="kvcached", policy="inertia"}) > 0',
                         'sum(kvcache_requests_total{job="kvcached"}) > 0',
                         'sum(kvcache_diag_steps_total{job="kvcached", policy="inertia"}) > 0',
                         'sum(kvcache_diag_evicted_total{job="kvcached", policy="inertia"}) > 0',
                         'kvcache_build_info{job="kvcached"}'):
                r = api(prom, "/api/v1/query", query=expr)
                self.f.check(r.get("status") == "success" and r["data"]["result"],
                             f"after the load, {expr} has no result: the load did not reach the engine")
            self.check_capacity(prom)
            daemon.send_signal(signal.SIGTERM)
            try:
                rc = daemon.wait(timeout=a.drain_seconds + 10)
                self.f.check(rc == 0, f"kvcached exited with code {rc} on SIGTERM (expected 0)")
            except subprocess.TimeoutExpired:
                self.f.fail(f"kvcached did not exit within {a.drain_seconds + 10}s of SIGTERM "
                            f"(--drain_deadline={a.drain_seconds}s)")

    def check_capacity(self, prom):
        """The capacity series (docs/METRICS.md "Capacity") against the flags and the load:
        each expression holds for both ranks (it has one result per rank)."""
        job = 'job="kvcached"'
        for expr in (f"kvcache_pool_block_tokens{{{job}}} == {E2E_TOKENS_PER_BLOCK}",
                     # The load's sequences held tokens in both ranks' pools.
                     f"max_over_time(kvcache_pool_cached_tokens{{{job}}}[5m]) > 0",
                     # Each rank caches what the open sequences hold, counted apart by the
                     # sequence table (the load is over: nothing moves between the two reads).
                     f"kvcache_pool_cached_tokens{{{job}}} == on (job) group_left "
                     f"sum by (job) (kvcache_tokens_retained{{{job}}})",
                     f"kvcache_pool_cached_tokens{{{job}}} <= kvcache_pool_used_blocks{{{job}}} "
                     f"* kvcache_pool_block_tokens{{{job}}}"):
            r = api(prom, "/api/v1/query", query=expr)
            ranks = sorted(x["metric"].get("rank", "") for x in r.get("data", {}).get("result", []))
            self.f.check(ranks == ["0", "1"], f"after the load, {expr} holds for ranks {ranks}, not 0 and 1")
        # The pools are far larger than the load: nothing refused for lack of blocks.
        refused = self.scalar(prom, f"sum(kvcache_pool_refused_total{{{job}}})")
        self.f.check(refused is not None and float(refused) == 0,
                     f"kvcache_pool_refused_total is {refused} with pools larger than the load")

    def scalar(self, prom, expr):
        r = api(prom, "/api/v1/query", query=expr)
        res = r.get("data", {}).get("result", [])
        return res[0]["value"][1] if res else None

    def check_names(self, prom, target):
        text = http_get(f"http://{target}/metrics")
        (self.tmp / "metrics.txt").write_text(text)
        exported = exported_names(text)
        stored = set(api(prom, "/api/v1/label/__name__/values")["data"])
        documented = dl.series_names(dl.documented_metrics())
        if not self.args.scrape_self:
            for n in sorted(documented - exported):
                self.f.fail(f"docs/METRICS.md lists {n}, the daemon does not export it")
            for n in sorted(n for n in exported - documented if n.startswith("kvcache")):
                self.f.fail(f"the daemon exports {n}, which docs/METRICS.md does not list")
        rules = dl.load_rules()
        recorded = dl.recorded_names(rules)
        referenced = {}
        for where, expr in dl.dashboard_queries(dl.load_dashboard()):
            for n in dl.referenced_metrics(expr):
                referenced.setdefault(n, where)
        for name, q in dl.dashboard_variable_queries(dl.load_dashboard()):
            for n in dl.referenced_metrics(q):
                referenced.setdefault(n, f"variable {name}")
        for _, r in dl.rule_entries(rules):
            for n in dl.referenced_metrics(r["expr"]):
                referenced.setdefault(n, f"rule {r.get('record') or r.get('alert')}")
        for n, where in sorted(referenced.items()):
            if n in recorded:
                self.f.check(n in stored, f"{where}: recorded series {n} was never written by Prometheus")
            elif n in dl.FOREIGN_METRICS:  # up: written by Prometheus for each scrape
                self.f.check(n in stored, f"{where}: Prometheus has no series {n}")
            else:
                self.f.check(n in exported and n in stored,
                             f"{where}: {n} is not among the names the daemon exported")
        if shutil.which(self.args.promtool):
            r = subprocess.run([self.args.promtool, "check", "metrics"], input=text,
                               capture_output=True, text=True)
            lint = (r.stdout + r.stderr).strip()
            print(f"promtool check metrics: {lint or 'no remarks'}")
        print(f"names: {len(exported)} exported, {len(referenced)} referenced by the dashboard and rules")

    def check_dashboard(self, prom, load_start):
        d = dl.load_dashboard()
        variables = {"namespace": NAMESPACE, "pod": POD}
        end = time.time()
        n_empty = 0
        for where, expr in dl.dashboard_queries(d):
            q = dl.substitute(expr, RATE_INTERVAL, variables)
            r = api(prom, "/api/v1/query_range", query=q, start=f"{load_start:.3f}",
                    end=f"{end:.3f}", step="1")
            if not self.f.check(r.get("status") == "success",
                                f"{where}: {r.get('errorType')}: {r.get('error')}\n    {q}"):
                continue
            self.f.check(not r.get("warnings"), f"{where}: warnings {r.get('warnings')}")
            empty = not r["data"]["result"]
            if empty:
                n_empty += 1
                if dl.referenced_metrics(expr) & MAY_BE_EMPTY:
                    print(f"no data (expected without errors): {where}")
                elif not self.args.scrape_self:
                    self.f.fail(f"{where}: no data after the load\n    {q}")
        for name, query in dl.dashboard_variable_queries(d):
            q = dl.label_values_to_promql(dl.substitute(query, RATE_INTERVAL, variables))
            r = api(prom, "/api/v1/query", query=q)
            if self.f.check(r.get("status") == "success", f"variable {name}: {r.get('error')}\n    {q}"):
                values = {s["metric"].get(name) for s in r["data"]["result"]}
                if not self.args.scrape_self:
                    self.f.check(variables[name] in values, f"variable {name} offers {values}, not {variables[name]}")
        print(f"dashboard: {len(dl.dashboard_queries(d))} queries evaluated, {n_empty} without data")

    def check_rules(self, prom):
        rules = dl.load_rules()
        for _, r in dl.rule_entries(rules):
            res = api(prom, "/api/v1/query", query=r["expr"])
            self.f.check(res.get("status") == "success",
                         f"rule {r.get('record') or r.get('alert')}: {res.get('error')}")
        loaded = [r for g in api(prom, "/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        self.f.check(len(loaded) == len(dl.rule_entries(rules)),
                     f"Prometheus loaded {len(loaded)} rules, the file has {len(dl.rule_entries(rules))}")
        for r in loaded:
            self.f.check(r.get("health") == "ok" and not r.get("lastError"),
                         f"rule {r['name']}: health {r.get('health')}, error {r.get('lastError')!r}")
        firing = [r["name"] for r in loaded if r.get("type") == "alerting" and r.get("state") != "inactive"]
        print(f"rules: {len(loaded)} evaluated by Prometheus; alerts pending or firing: {firing or 'none'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvcached")
    ap.add_argument("--loadgen")
    ap.add_argument("--prometheus", default="prometheus")
    ap.add_argument("--promtool", default="promtool")
    ap.add_argument("--load-seconds", type=int, default=8)
    ap.add_argument("--drain-seconds", type=int, default=2)
    ap.add_argument("--scrape-target", metavar="HOST:PORT",
                    help="check a kvcached you started yourself (its metrics address): "
                         "no daemon is started, no load generated")
    ap.add_argument("--scrape-self", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, metrics)")
    a = ap.parse_args()
    if not shutil.which(a.prometheus):
        sys.exit(f"{a.prometheus} not found: install the Debian package prometheus (scripts/install-deps.sh)")
    if not (a.scrape_self or a.scrape_target):
        for flag, path in (("--kvcached", a.kvcached), ("--loadgen", a.loadgen)):
            if not path or not os.access(path, os.X_OK):
                sys.exit(f"{flag}: {path or 'not given'} is not an executable: build the kvcached and "
                         f"kvcache-loadgen targets first (cmake --build build)")
    run = Run(a)
    ok = False
    try:
        run.main()
        ok = not run.f.items
    except Exception as e:  # a harness or process failure: report it with the logs
        run.f.fail(f"{type(e).__name__}: {e}")
    finally:
        run.stop_all()
        if not ok:
            run.dump_logs()
        if a.keep or not ok:
            print(f"logs and scraped metrics kept in {run.tmp}")
        else:
            shutil.rmtree(run.tmp, ignore_errors=True)
    run.f.exit("end-to-end dashboard and rules against kvcached")


if __name__ == "__main__":
    main()
