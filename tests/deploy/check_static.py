#!/usr/bin/env python3
"""Static checks of deploy/ that need no cluster and no daemon.

  check_static.py copies                  the chart's dashboard/rules and their copies agree
  check_static.py dashboard --promtool P  units, $__rate_interval, variables, metric names,
                                          PromQL syntax (promtool check rules)
  check_static.py rules                   metric names, labels, annotations, unit-test coverage
  check_static.py docker [BINARY...]      Dockerfiles against the chart, install-deps.sh and
                                          the shared libraries of the built binaries
"""

import argparse
import filecmp
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import deploylib as dl  # noqa: E402

ROOT = dl.ROOT


def rel(p):
    return pathlib.Path(p).resolve().relative_to(ROOT)


def check_copies(_args):
    f = dl.Failures()
    for canonical, copy in dl.COPIES:
        if not f.check(canonical.exists(), f"{rel(canonical)} is missing"):
            continue
        if not f.check(copy.exists(), f"{rel(copy)} is missing (copy of {rel(canonical)})"):
            continue
        f.check(filecmp.cmp(canonical, copy, shallow=False),
                f"{rel(copy)} differs from {rel(canonical)}: edit the canonical file, then "
                f"cp {rel(canonical)} {rel(copy)}")
    f.exit("copies in sync")


def check_dashboard(args):
    f = dl.Failures()
    series = dl.series_names(dl.documented_metrics())
    d = dl.load_dashboard()
    f.check(bool(d.get("uid")) and bool(d.get("title")), "dashboard needs a uid and a title")

    variables = {v["name"]: v for v in d.get("templating", {}).get("list", [])}
    ds = variables.get("datasource")
    f.check(ds is not None and ds.get("type") == "datasource" and ds.get("query") == "prometheus",
            'needs a variable "datasource" of type datasource, query prometheus')
    for name in ("namespace", "pod"):
        v = variables.get(name)
        if f.check(v is not None and v.get("type") == "query", f'needs a query variable "{name}"'):
            f.check(v.get("datasource", {}).get("uid") == "${datasource}",
                    f'variable "{name}" must query the ${{datasource}} data source')

    panels = dl.dashboard_panels(d)
    f.check(len(panels) >= 10, f"only {len(panels)} panels")
    ids = [p.get("id") for p in d.get("panels", [])]
    ids += [c.get("id") for p in d.get("panels", []) if p.get("type") == "row" for c in p.get("panels", [])]
    f.check(len(ids) == len(set(ids)), "panel ids must be unique")
    for p in panels:
        where = f'panel "{p.get("title")}"'
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
        f.check(isinstance(unit, str) and unit, f"{where} has no unit")
        f.check(p.get("datasource", {}).get("uid") == "${datasource}",
                f"{where} must use the ${{datasource}} variable")
        f.check(bool(p.get("targets")), f"{where} has no query")
        for t in p.get("targets", []):
            f.check(t.get("datasource", {}).get("uid") == "${datasource}",
                    f"{where} target {t.get('refId')} must use the ${{datasource}} variable")

    queries = dl.dashboard_queries(d)
    titles = " ".join(p.get("title", "") for p in panels).lower()
    for topic in ("retained", "evicted", "retention ratio", "steps / s", "skipped", "p50 / p95 / p99",
                  "pool usage per rank", "errors / s by code", "refused for lack of kv blocks",
                  "tokens cached per block held", "fragmentation"):
        f.check(topic in titles, f'no panel about "{topic}"')
    rows = [p.get("title") for p in d.get("panels", []) if p.get("type") == "row"]
    for row in ("Retention", "Throughput", "Latency", "Pools", "Capacity", "Errors and health"):
        f.check(row in rows, f'no row "{row}"')
    for where, expr in queries:
        for rng in re.findall(r"\[([^\]]*)\]", expr):
            f.check(rng == "$__rate_interval", f"{where}: range [{rng}] must be [$__rate_interval]")
        for fn in re.findall(r"\b(rate|irate|increase|delta|idelta|deriv)\s*\(", expr):
            f.check(fn in ("rate", "increase"), f"{where}: use rate or increase, not {fn}")
        for m in re.finditer(r"histogram_quantile\(\s*([0-9.]+)\s*,\s*sum by \(([^)]*)\)\s*\(\s*rate\(\s*([a-z_:]+)", expr):
            f.check("le" in [s.strip() for s in m.group(2).split(",")],
                    f"{where}: histogram_quantile must keep le in its sum by")
            f.check(m.group(3).endswith("_bucket"), f"{where}: histogram_quantile over {m.group(3)}")
        f.check(expr.count("histogram_quantile") == len(re.findall(
            r"histogram_quantile\(\s*[0-9.]+\s*,\s*sum by \([^)]*\)\s*\(\s*rate\(", expr)),
            f"{where}: histogram_quantile must be over sum by (..., le) (rate(..._bucket[...]))")
        names = dl.referenced_metrics(expr)
        f.check(bool(names), f"{where}: references no kvcache metric")
        for n in sorted(names - series):
            f.fail(f"{where}: {n} is not a series of docs/METRICS.md")
        # Every selector of a kvcache metric filters on both template variables.
        for m in re.finditer(r"(kvcache_[a-z_]+)(\{[^}]*\})?", expr):
            sel = m.group(2) or ""
            f.check('namespace=~"$namespace"' in sel and 'pod=~"$pod"' in sel,
                    f"{where}: {m.group(1)} must select namespace=~\"$namespace\", pod=~\"$pod\"")
    quantiles = {q for _, e in queries if "kvcache_batch_duration_seconds_bucket" in e
                 for q in re.findall(r"histogram_quantile\(\s*([0-9.]+)", e)}
    f.check({"0.50", "0.95", "0.99"} <= quantiles,
            f"batch latency quantiles {sorted(quantiles)} must include 0.50, 0.95, 0.99")
    for name, q in dl.dashboard_variable_queries(d):
        for n in sorted(dl.referenced_metrics(q) - series):
            f.fail(f'variable "{name}": {n} is not a series of docs/METRICS.md')

    # PromQL syntax: promtool parses every query as the expression of a recording rule.
    subst = {"namespace": ".*", "pod": ".*"}
    labelled = [(where, dl.substitute(e, "1m", subst)) for where, e in queries]
    labelled += [(f'variable "{name}"', dl.label_values_to_promql(dl.substitute(q, "1m", subst)))
                 for name, q in dl.dashboard_variable_queries(d)]
    exprs = [e for _, e in labelled]
    for e in exprs:
        f.check("$" not in e, f"unsubstituted variable in: {e}")
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "dashboard.rules.yaml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
            {"record": f"dashboard:query{i}", "expr": e} for i, e in enumerate(exprs)]}]}))
        r = subprocess.run([args.promtool, "check", "rules", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            bad = sorted({int(i) for i in re.findall(r"dashboard:query(\d+)", r.stdout + r.stderr)})
            f.fail("promtool cannot parse the dashboard's queries:\n" + r.stdout + r.stderr + "".join(
                f"    query{i} is {labelled[i][0]}: {labelled[i][1]}\n" for i in bad))
    print(f"{len(panels)} panels, {len(queries)} queries")
    f.exit("dashboard")


def check_rules(_args):
    f = dl.Failures()
    series = dl.series_names(dl.documented_metrics())
    rules = dl.load_rules()
    recorded = dl.recorded_names(rules)
    alerts = []
    for group, r in dl.rule_entries(rules):
        name = r.get("record") or r.get("alert")
        where = f"{group}/{name}"
        names = dl.referenced_metrics(r["expr"])
        for n in sorted(names - series - recorded - dl.FOREIGN_METRICS):
            f.fail(f"{where}: {n} is neither a series of docs/METRICS.md nor recorded here")
        if "record" in r:
            f.check(re.fullmatch(r"kvcache:[a-z0-9_]+:[a-z0-9_]+", r["record"]) is not None,
                    f"{where}: recorded names follow level:metric:operations (kvcache:...)")
            continue
        alerts.append(name)
        f.check(r.get("labels", {}).get("severity") in ("critical", "warning", "info"),
                f"{where}: severity label must be critical, warning or info")
        ann = r.get("annotations", {})
        f.check(bool(ann.get("summary")) and bool(ann.get("description")),
                f"{where}: needs summary and description annotations")
        f.check("for" in r, f"{where}: needs a for: duration")
    for topic in ("DaemonDown", "NotServing", "StepLatencyHigh", "PoolNearlyFull", "ErrorRateHigh",
                  "SequencesReclaimedByIdleTimeout"):
        f.check(any(topic in a for a in alerts), f"no alert about {topic}")

    # Each alert has a unit test where it fires and one where it does not.
    fires, quiet = set(), set()
    tests = sorted(dl.PROM_TESTS.glob("*.yaml"))
    f.check(bool(tests), f"no unit tests in {rel(dl.PROM_TESTS)}")
    for path in tests:
        doc = yaml.safe_load(path.read_text())
        f.check(any(pathlib.Path(rf).name == dl.RULES.name for rf in doc.get("rule_files", [])),
                f"{rel(path)} must load {dl.RULES.name}")
        for t in doc.get("tests", []):
            for a in t.get("alert_rule_test", []):
                (fires if a.get("exp_alerts") else quiet).add(a["alertname"])
    for a in alerts:
        f.check(a in fires, f"alert {a} has no unit test where it fires")
        f.check(a in quiet, f"alert {a} has no unit test where it stays quiet")
    print(f"{len(recorded)} recording rules, {len(alerts)} alerts")
    f.exit("rules")


def dockerfile_stages(path):
    """{stage name: [instruction lines with continuations joined]}"""
    stages, current = {}, None
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        m = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            current = m.group(1) or f"stage{len(stages)}"
            stages[current] = []
        elif current:
            stages[current].append(line)
    return stages


def apt_packages(instructions):
    pkgs = []
    for line in instructions:
        for m in re.finditer(r"apt-get install ((?:\s*(?:-\S+|[a-z0-9][a-z0-9.+-]*))+)", line):
            pkgs += [w for w in m.group(1).split() if not w.startswith("-")]
    return pkgs


def install_deps_packages():
    text = (ROOT / "scripts/install-deps.sh").read_text()
    m = re.search(r"packages=\(([^)]*)\)", text)
    return m.group(1).split() if m else []


def instruction(stage, keyword):
    return [l[len(keyword):].strip() for l in stage if l.upper().startswith(keyword + " ")]


def depends_closure(packages):
    """Installed packages reachable from `packages` through Depends/Pre-Depends."""
    r = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\t${Depends}, ${Pre-Depends}\n"],
                       capture_output=True, text=True, check=True)
    deps = {}
    for line in r.stdout.splitlines():
        name, _, rest = line.partition("\t")
        deps.setdefault(name, set()).update(
            choice.strip().split(" ")[0].split(":")[0]
            for alt in rest.split(",") for choice in alt.split("|") if choice.strip())
    seen, todo = set(), list(packages)
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo.extend(deps.get(p, ()))
    return seen


def library_packages(binary, f):
    """Debian packages owning the shared libraries `binary` loads."""
    r = subprocess.run(["ldd", binary], capture_output=True, text=True)
    if not f.check(r.returncode == 0, f"ldd {binary} failed: {r.stderr.strip()}"):
        return set()
    patterns = {}
    for line in r.stdout.splitlines():
        if "not found" in line:
            f.fail(f"{binary}: {line.strip()}")
        m = re.search(r"=>\s+(/\S+)", line)
        # The CUDA toolkit's own (NCCL, which kvcached links when the build found it): the
        # host image builds without CUDA, and the CUDA image's runtime carries them.
        if m and re.match(r"lib(nccl|cuda|cudart|nv)", pathlib.Path(m.group(1)).name):
            continue
        if m:
            # dpkg may list the file under /lib or /usr/lib (merged /usr): match the last
            # directory and the file name of the resolved path.
            lib = pathlib.Path(os.path.realpath(m.group(1)))
            patterns[f"*/{lib.parent.name}/{lib.name}"] = lib
    s = subprocess.run(["dpkg", "-S"] + sorted(patterns), capture_output=True, text=True)
    pkgs, owned = set(), set()
    for line in s.stdout.splitlines():
        owners, _, path = line.partition(": ")
        owned.add(pathlib.Path(path.strip()).name)
        pkgs |= {o.strip().split(":")[0] for o in owners.split(",")}
    for lib in patterns.values():
        f.check(lib.name in owned, f"{binary}: no Debian package owns {lib}")
    return pkgs


def check_docker(args):
    f = dl.Failures()
    values = yaml.safe_load((dl.CHART / "values.yaml").read_text())
    ports = {str(values["ports"]["grpc"]), str(values["ports"]["metrics"])}
    uid = str(values["podSecurityContext"]["runAsUser"])
    deps = install_deps_packages()
    f.check(bool(deps), "cannot read the packages=(...) list of scripts/install-deps.sh")
    builder_pkgs = {}
    for name in ("Dockerfile", "Dockerfile.cuda"):
        path = ROOT / "deploy/docker" / name
        stages = dockerfile_stages(path)
        where = rel(path)
        if not f.check({"builder", "runtime"} <= set(stages), f"{where}: needs stages builder and runtime"):
            continue
        b, rt = stages["builder"], stages["runtime"]
        f.check(list(stages)[-1] == "runtime", f"{where}: the last stage must be runtime")
        builder_pkgs[name] = set(apt_packages(b))
        run = " ".join(instruction(b, "RUN"))
        f.check(re.search(r"cmake -S \. -B \S+ -G Ninja", run) is not None, f"{where}: builder must configure with CMake and Ninja")
        for target in ("kvcached", "kvcache-loadgen", "kvcache-replay"):
            f.check(re.search(rf"--target [^&]*\b{target}\b", run) is not None,
                    f"{where}: builder must build {target}")
            f.check(any(target in c for c in instruction(rt, "COPY")), f"{where}: runtime must copy {target}")
        for p in builder_pkgs[name]:
            f.check(p in deps, f"{where}: builder package {p} is not in scripts/install-deps.sh")
        f.check(instruction(rt, "USER") == [f"{uid}:{uid}"],
                f"{where}: runtime must run as USER {uid}:{uid} (the chart's runAsUser)")
        exposed = set(" ".join(instruction(rt, "EXPOSE")).split())
        f.check(exposed == ports, f"{where}: EXPOSE {sorted(exposed)} != the chart's ports {sorted(ports)}")
        f.check(instruction(rt, "ENTRYPOINT") == ['["/usr/local/bin/kvcached"]'],
                f"{where}: ENTRYPOINT must be [\"/usr/local/bin/kvcached\"]")
        cmd = " ".join(instruction(rt, "CMD"))
        for flag in (f"--listen=0.0.0.0:{values['ports']['grpc']}",
                     f"--metrics_listen=0.0.0.0:{values['ports']['metrics']}"):
            f.check(flag in cmd, f"{where}: CMD must default to {flag}")
        f.check(not any("-dev" in p for p in apt_packages(rt)), f"{where}: runtime installs a -dev package")
    if len(builder_pkgs) == 2:
        f.check(builder_pkgs["Dockerfile"] == builder_pkgs["Dockerfile.cuda"],
                "Dockerfile and Dockerfile.cuda must install the same build packages")
    needed = {p for p in deps if p.endswith("-dev") or p.startswith("protobuf-compiler")}
    needed -= {"libgtest-dev", "libgmock-dev", "libbenchmark-dev"}  # tests and benchmarks only
    for p in sorted(needed - builder_pkgs.get("Dockerfile", set())):
        f.fail(f"deploy/docker/Dockerfile: builder lacks {p} (in scripts/install-deps.sh)")

    # The runtime list covers what the binaries built here load (same distribution).
    runtime = set(apt_packages(dockerfile_stages(ROOT / "deploy/docker/Dockerfile")["runtime"]))
    if not shutil.which("dpkg-query"):
        f.fail("dpkg-query not found: the library check needs a Debian host")
    elif not args.binaries:
        f.fail("no binary given to check the runtime libraries against")
    else:
        covered = depends_closure(runtime | {"libc6"})
        used = set()
        for binary in args.binaries:
            pkgs = library_packages(binary, f)
            for p in sorted(pkgs - covered):
                f.fail(f"{pathlib.Path(binary).name} loads a library of {p}, which the runtime "
                       f"stage of deploy/docker/Dockerfile does not install")
            used |= depends_closure(pkgs) & runtime
            print(f"{pathlib.Path(binary).name}: {' '.join(sorted(pkgs))}")
        names = {pathlib.Path(b).name for b in args.binaries}
        if {"kvcached", "kvcache-loadgen", "kvcache-replay"} <= names:
            for p in sorted(runtime - used):
                f.fail(f"deploy/docker/Dockerfile installs {p}, which no binary loads")
        else:
            print("kvcached and kvcache-loadgen not built yet: unused runtime packages not checked")
    f.exit("docker")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("copies").set_defaults(fn=check_copies)
    p = sub.add_parser("dashboard")
    p.add_argument("--promtool", default="promtool")
    p.set_defaults(fn=check_dashboard)
    sub.add_parser("rules").set_defaults(fn=check_rules)
    p = sub.add_parser("docker")
    p.add_argument("binaries", nargs="*")
    p.set_defaults(fn=check_docker)
    args = ap.parse_args()
    if getattr(args, "promtool", None) and not shutil.which(args.promtool):
        sys.exit(f"{args.promtool} not found: install the Debian package prometheus "
                 "(scripts/install-deps.sh)")
    args.fn(args)


if __name__ == "__main__":
    main()
