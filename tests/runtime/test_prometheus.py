"""Prometheus metrics of a real `flowgraph run`: scraped over HTTP, read back through a
real Prometheus server, and the Grafana dashboard's queries checked against them.

One short GRPO run (3 steps, an evaluation after the last) serves `/metrics` for the
whole module; `--metrics-hold` keeps it serving after the last step until the module
is done, and Ctrl-C (SIGINT) then ends it cleanly.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flowgraph.cli import main
from flowgraph.runtime.prometheus import Exporter

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "flowgraph.json"
STEPS = 3
EVAL_SET = [("reverse 123", "321"), ("reverse 4070", "0704"), ("reverse 981", "189"),
            ("reverse 5512", "2155")]
SMALL = ["dims.Bp=2", "dims.N=2", "nodes.update_actor.params.mini_batch_size=4",
         f"trainer.steps={STEPS}", f"trainer.eval_every={STEPS}"]
"""GRPO at its smallest: 2 prompts × 2 samples, one evaluation after the last step."""
TARGET_LABELS = {"job", "instance"}
"""Labels Prometheus adds to every scraped series."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def value(samples: dict[str, list[tuple[dict[str, str], float]]], metric: str, /,
          **labels: str) -> float:
    found = [v for got, v in samples.get(metric, []) if labels.items() <= got.items()]
    assert len(found) == 1, f"{metric}{labels}: {found} in {samples.get(metric)}"
    return found[0]


@dataclass
class LiveRun:
    port: int
    run_dir: Path
    seen: list[float]
    """flowgraph_training_steps_total at each scrape while the run trained."""
    final: dict[str, list[tuple[dict[str, str], float]]]
    """The scrape after the last step."""


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    tmp = tmp_path_factory.mktemp("live")
    eval_set = tmp / "eval.jsonl"
    eval_set.write_text("".join(json.dumps(
        {"prompt": [{"role": "user", "content": q}], "ground_truth": a}) + "\n"
        for q, a in EVAL_SET))
    port, run_dir, log = free_port(), tmp / "run", tmp / "run.log"
    cmd = [sys.executable, "-m", "flowgraph", "run", str(ROOT / "graphs" / "grpo.yaml"),
           *SMALL, f"trainer.run_dir={run_dir}", f"data.train.eval_path={eval_set}",
           "--metrics-port", str(port), "--metrics-hold", "300"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
    try:
        seen, final = _follow(proc, port, log)
        yield LiveRun(port, run_dir, seen, final)
        _wait_for(lambda: "serving the final metrics" in log.read_text(), 60, log)
        proc.send_signal(signal.SIGINT)  # ends the hold; the run exits cleanly
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _follow(proc: subprocess.Popen[bytes], port: int, log: Path
            ) -> tuple[list[float], dict[str, list[tuple[dict[str, str], float]]]]:
    """Scrape every 0.1 s until the last step shows; the step counts seen on the way."""
    seen: list[float] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before its last step was "
                        f"scraped:\n{log.read_text()[-3000:]}")
        try:
            samples = scrape(port)
        except OSError:  # not serving yet
            time.sleep(0.1)
            continue
        steps = samples.get("flowgraph_training_steps_total", [({}, 0.0)])[0][1]
        if not seen or steps != seen[-1]:
            seen.append(steps)
        if steps >= STEPS:
            return seen, samples
        time.sleep(0.1)
    pytest.fail(f"no step {STEPS} on /metrics within 240 s:\n{log.read_text()[-3000:]}")


def _wait_for(ready: Callable[[], bool], seconds: float, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting after {seconds} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _rows(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --- the endpoint of a real run ---------------------------------------------------------


def test_metrics_are_scraped_while_the_run_trains(live_run: LiveRun) -> None:
    # the endpoint is up before the first step ends, and counts every step once
    assert live_run.seen[0] == 0.0 and live_run.seen[-1] == STEPS
    assert live_run.seen == sorted(live_run.seen)
    s = live_run.final
    assert value(s, "flowgraph_training_steps_total", worker="local") == STEPS
    assert value(s, "flowgraph_last_step", worker="local") == STEPS - 1
    assert value(s, "flowgraph_run_info", graph="grpo", target="local") == 1.0


def test_stage_histograms_count_every_node_of_every_step(live_run: LiveRun) -> None:
    s, rows = live_run.final, _rows(live_run.run_dir)
    stages = sorted(k.removeprefix("timing_s/") for k in rows[0]
                    if k.startswith("timing_s/") and k != "timing_s/step")
    # One optimizer step per rollout: pass `on_policy` elides old_logprob.
    assert stages == ["adv", "gen", "ref_logprob", "reward", "train", "update_actor"]
    for stage in stages:
        assert value(s, "flowgraph_stage_seconds_count", stage=stage) == STEPS
        total = sum(r[f"timing_s/{stage}"] for r in rows)
        assert value(s, "flowgraph_stage_seconds_sum", stage=stage) == pytest.approx(total)
    assert value(s, "flowgraph_stage_seconds_count", stage="gen", kind="generate") == STEPS
    assert value(s, "flowgraph_stage_seconds_bucket", stage="gen", le="+Inf") == STEPS
    assert value(s, "flowgraph_step_seconds_count") == STEPS


def test_tokens_reward_kl_and_memory_follow_metrics_jsonl(live_run: LiveRun) -> None:
    s, rows = live_run.final, _rows(live_run.run_dir)
    # 2 prompts × 2 samples × T = 8 tokens at most, per step
    generated = sum(r["perf/response_tokens"] for r in rows)
    assert 0 < generated <= STEPS * 4 * 8
    assert value(s, "flowgraph_generated_tokens_total") == generated
    assert value(s, "flowgraph_tokens_total") == sum(r["perf/tokens"] for r in rows)
    last = rows[-1]
    assert value(s, "flowgraph_reward_mean") == pytest.approx(last["critic/score/mean"])
    assert value(s, "flowgraph_kl") == pytest.approx(last["actor/kl_loss"])  # GRPO: no kl node
    assert value(s, "flowgraph_ppo_kl") == pytest.approx(last["actor/ppo_kl"])
    assert value(s, "flowgraph_step_metric", name="actor/pg_loss") == pytest.approx(
        last["actor/pg_loss"])
    assert value(s, "flowgraph_device_memory_bytes", worker="local", device="cpu") > 1e6


def test_held_out_metrics_reach_jsonl_tensorboard_and_prometheus(live_run: LiveRun) -> None:
    rows = _rows(live_run.run_dir)
    # grpo.yaml evaluates before training too (val_before_train): the first row
    assert [any(k.startswith("val/") for k in r) for r in rows] == [True, False, True]
    val = {k: v for k, v in rows[-1].items() if k.startswith("val/")}
    expected = {"val/accuracy", "val/log_ratio_to_ref", "val/response_length/mean",
                "val/score/mean",
                "val/diversity/distinct_1", "val/diversity/distinct_2",
                "val/diversity/entropy_1", "val/diversity/entropy_2",
                "val/diversity/repetition_2"}
    assert expected <= set(val)
    assert 0.0 <= val["val/accuracy"] <= 1.0 and 0.0 < val["val/diversity/distinct_1"] <= 1.0
    assert 0.0 < val["val/response_length/mean"] <= 8 and math.isfinite(val["val/log_ratio_to_ref"])
    for key, v in val.items():
        name = key.removeprefix("val/")
        assert value(live_run.final, "flowgraph_val", name=name) == pytest.approx(v), key
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(live_run.run_dir / "tensorboard"))
    events.Reload()
    assert expected <= set(events.Tags()["scalars"])


# --- the Grafana dashboard ------------------------------------------------------------------


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target and query variable."""
    board = json.loads(DASHBOARD.read_text())
    queries = [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]
    queries += [(f"variable {v['name']}", v["query"]["query"])
                for v in board["templating"]["list"] if v["type"] == "query"]
    return queries


def test_every_dashboard_query_names_served_metrics(live_run: LiveRun) -> None:
    served = {name: set().union(*(labels for labels, _ in samples))
              for name, samples in live_run.final.items()}
    queries = dashboard_queries()
    assert len(queries) >= 10
    for title, expr in queries:
        names = re.findall(r"\bflowgraph_\w+", expr)
        assert names, f"panel `{title}` queries no flowgraph metric: {expr}"
        for name in names:
            assert name in served, f"panel `{title}`: `{name}` is not served; served: " \
                                   f"{sorted(served)}"
        for name, selector in re.findall(r"\b(flowgraph_\w+)\{([^}]*)\}", expr):
            used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector))
            assert used <= served[name] | TARGET_LABELS, f"panel `{title}`: {name} has no " \
                f"label(s) {sorted(used - served[name])}"
    exprs = " ".join(e for _, e in queries)
    # the panels the dashboard promises
    assert "rate(flowgraph_training_steps_total" in exprs
    assert re.search(r'histogram_quantile\(0\.95, .*flowgraph_stage_seconds_bucket\{[^}]*'
                     r'kind="generate"', exprs)
    for name in ("flowgraph_device_memory_bytes", "flowgraph_reward_mean", "flowgraph_kl"):
        assert name in exprs


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["--metrics-port", "trainer.metrics_port="])
def test_a_busy_port_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      how: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        asked = [f"{how}{port}"] if how.endswith("=") else [how, str(port)]
        rc = main(["run", str(ROOT / "graphs" / "grpo.yaml"), f"trainer.run_dir={tmp_path}/r",
                   *asked])
    assert rc == 1  # the run failed to start: not a usage error
    err = capsys.readouterr().err
    assert f"port {port} is already in use" in err and "Traceback" not in err


def test_a_port_out_of_range_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "graphs/grpo.yaml", "--metrics-port", "70000"])
    assert exc.value.code == 2
    assert "`70000` is not a port number (0-65535)" in capsys.readouterr().err


def test_exporter_labels_each_worker() -> None:
    """What fsdp/ray feed: one endpoint; the step row once, from the process that owns
    it (rank 0), and each rank's own node seconds and memory under its label."""
    exporter = Exporter(stage_kinds={"gen": "generate"})
    exporter.observe_step(0, {"timing_s/gen": 1.5, "perf/response_tokens": 10.0,
                              "critic/score/mean": 0.25}, worker="rank0")
    for rank in range(2):
        exporter.observe_worker({"timing_s/gen": 0.5 + rank}, f"rank{rank}")
        exporter.set_memory(f"rank{rank}", f"cuda:{rank}", 1000 * (rank + 1))
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in exporter.registry.collect() for s in family.samples}
    assert got[("flowgraph_training_steps_total", (("worker", "rank0"),))] == 1.0
    assert got[("flowgraph_stage_seconds_sum",
                (("kind", "generate"), ("stage", "gen"), ("worker", "rank0")))] == 1.5
    assert got[("flowgraph_worker_stage_seconds_sum",
                (("kind", "generate"), ("stage", "gen"), ("worker", "rank1")))] == 1.5
    assert got[("flowgraph_generated_tokens_total", (("worker", "rank0"),))] == 10.0
    assert got[("flowgraph_reward_mean", (("worker", "rank0"),))] == 0.25
    assert got[("flowgraph_device_memory_bytes",
                (("device", "cuda:1"), ("worker", "rank1")))] == 2000
    # rank 1 owns no series of the row: no reward, KL, steps or tokens of its own
    assert {labels for _, labels in got if ("worker", "rank1") in labels} == {
        (("device", "cuda:1"), ("worker", "rank1"))} | {
        labels for name, labels in got if name.startswith("flowgraph_worker_stage_seconds")
        and ("worker", "rank1") in labels}


def test_a_row_without_a_reward_exports_no_reward() -> None:
    """DPO's rows have no score: no `flowgraph_reward_mean` at 0 saying there was one."""
    exporter = Exporter()
    exporter.observe_step(0, {"actor/dpo_loss": 0.7})
    names = {s.name for family in exporter.registry.collect() for s in family.samples}
    assert "flowgraph_reward_mean" not in names and "flowgraph_kl" not in names
    assert "flowgraph_skipped_steps_total" in names  # a counter at 0 from the start


def test_a_skipped_batch_is_counted_not_left_as_a_gauge() -> None:
    exporter = Exporter()
    exporter.observe_step(0, {"critic/score/mean": 0.5})
    exporter.observe_step(1, {"skipped": 1.0})
    samples = {s.name: s for family in exporter.registry.collect() for s in family.samples
               if s.labels.get("name") != "critic/score/mean"}
    assert samples["flowgraph_training_steps_total"].value == 2
    assert samples["flowgraph_skipped_steps_total"].value == 1
    assert "flowgraph_step_metric" not in samples
    assert samples["flowgraph_reward_mean"].value == 0.5  # the last batch that had one


# --- a real Prometheus server -----------------------------------------------------------------


@contextmanager
def prometheus(tmp_path: Path, jobs: dict[str, int]) -> Iterator[tuple[int, Path]]:
    """A real Prometheus scraping `127.0.0.1:<port>` of each job every second, ready;
    (its port, its log)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the `prometheus` binary is not on PATH: run `scripts/ensure-prometheus` "
                    "(Debian: apt-get install prometheus), or deselect with -m 'not prometheus'")
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": job, "static_configs": [
            {"targets": [f"127.0.0.1:{port}"]}]} for job, port in jobs.items()]}))
    port = free_port()
    log = tmp_path / "prometheus.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: _ready(port, server, log), 30, log)
        yield port, log
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.prometheus
def test_prometheus_scrapes_the_run(live_run: LiveRun, tmp_path: Path) -> None:
    with prometheus(tmp_path, {"flowgraph": live_run.port}) as (port, log):
        result = _query_until(port, "flowgraph_training_steps_total", log)
        metric, (_, count) = result[0]["metric"], result[0]["value"]
        assert float(count) == STEPS
        assert metric["job"] == "flowgraph" and metric["worker"] == "local"
        grafana = {"$__rate_interval": "1m", "$job": ".+"}
        for _, expr in dashboard_queries():  # every panel's PromQL parses and runs
            query = re.sub(r"\$\w+", lambda m: grafana[m.group(0)], expr)
            _query(port, query.replace("label_values(flowgraph_run_info, job)",
                                       "flowgraph_run_info"))
    check = subprocess.run(["promtool", "check", "config",
                            str(ROOT / "deploy" / "prometheus" / "prometheus.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def _ready(port: int, server: subprocess.Popen[bytes], log: Path) -> bool:
    if server.poll() is not None:
        pytest.fail(f"prometheus exited ({server.returncode}):\n{log.read_text()[-3000:]}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _query(port: int, promql: str) -> list[dict[str, object]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:  # a bad query: 400 with the reason in JSON
        body = json.loads(exc.read() or b"{}")
    assert body.get("status") == "success", f"{promql}: {body}"
    return list(body["data"]["result"])


def _query_until(port: int, promql: str, log: Path) -> list[dict[str, object]]:
    """Query until Prometheus has scraped the series (within 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = _query(port, promql)
        if result:
            return result
        time.sleep(0.25)
    pytest.fail(f"prometheus returned no `{promql}` within 30 s:\n{log.read_text()[-3000:]}")


# --- the dashboard of a distributed run ------------------------------------------------------

WORKERS = {"ray": {"driver", "actor_rollout_ref/0", "actor_rollout_ref/1"},
           "fsdp": {"rank0", "rank1"}}
"""Who reports memory in a run of 2 workers: the Ray driver and its pool's workers; the
fsdp ranks."""
Rows = list[dict[str, float]]


def _last(key: str) -> Callable[[Rows], float]:
    """The latest row's `key` (a gauge: the dashboard shows the latest value)."""
    return lambda rows: [r[key] for r in rows if key in r][-1]


def _total(key: str) -> Callable[[Rows], float]:
    """`key` summed over the rows: the counter a rate panel takes the slope of."""
    return lambda rows: sum(r[key] for r in rows)


def _stage_quantile(q: float, stages: Callable[[str], bool]) -> Callable[[Rows], object]:
    """`histogram_quantile(q, ...)` of the rows' `timing_s/<stage>`: per stage, or of the
    stages `stages` picks pooled (one value) when the panel sums over stage."""
    return lambda rows: bucket_quantile(q, [r[k] for r in rows for k in r
                                            if k.startswith("timing_s/") and stages(k[9:])])


def bucket_quantile(q: float, values: list[float]) -> float:
    """Prometheus' `histogram_quantile` of `values` observed into `STAGE_BUCKETS`: the
    bucket holding rank q·n, linearly interpolated between its bounds (the lowest bucket
    starts at 0; a rank in +Inf gives the highest finite bound)."""
    from flowgraph.runtime.prometheus import STAGE_BUCKETS

    counts = [sum(v <= le for v in values) for le in STAGE_BUCKETS]
    rank = q * len(values)
    b = next((i for i, c in enumerate(counts[:-1]) if c >= rank), len(counts) - 1)
    if b == len(counts) - 1:
        return STAGE_BUCKETS[-2]
    start, below = (STAGE_BUCKETS[b - 1], counts[b - 1]) if b else (0.0, 0)
    return start + (STAGE_BUCKETS[b] - start) * (rank - below) / (counts[b] - below)


def _by(label: str, keys: Callable[[str], bool], prefix: str = "") -> Callable[[Rows], object]:
    """A vector panel: label value -> the latest row's `<prefix><label value>`."""
    return lambda rows: {k.removeprefix(prefix): v for k, v in rows[-1].items()
                         if k.startswith(prefix) and keys(k.removeprefix(prefix))}


TRUTH: dict[tuple[str, str], Callable[[Rows], object]] = {
    ("Step", "A"): _last("step"),
    # 60 * rate(steps_total) -> 60 * steps_total: one count per row
    ("Steps / min", "A"): lambda rows: 60.0 * len(rows),
    ("Training step rate", "A"): lambda rows: 60.0 * len(rows),
    ("Generated tokens / s", "A"): _total("perf/response_tokens"),
    ("Tokens / s", "A"): _total("perf/response_tokens"),
    ("Tokens / s", "B"): _total("perf/tokens"),
    ("Reward (latest)", "A"): _last("critic/score/mean"),
    ("Reward", "A"): _last("critic/score/mean"),
    ("Reward", "B"): _last("val/score/mean"),
    ("Reward", "C"): _last("val/accuracy"),
    ("Held-out accuracy", "A"): _last("val/accuracy"),
    ("KL to reference (latest)", "A"): _last("actor/kl_loss"),  # GRPO: no kl_penalty node
    ("KL", "A"): _last("actor/kl_loss"),
    ("KL", "B"): _last("actor/ppo_kl"),
    ("KL", "C"): _last("val/log_ratio_to_ref"),
    ("Generation latency p50 / p95", "A"): _stage_quantile(0.95, lambda s: s == "gen"),
    ("Generation latency p50 / p95", "B"): _stage_quantile(0.5, lambda s: s == "gen"),
    ("Stage time p95", "A"): lambda rows: {
        k[9:]: bucket_quantile(0.95, [r[k] for r in rows]) for k in rows[0]
        if k.startswith("timing_s/") and k != "timing_s/step"},
    ("Losses", "A"): _by("name", lambda k: k in {"actor/pg_loss", "critic/vf_loss",
                                                 "actor/dpo_loss", "actor/kl_loss"}),
    ("Held-out diversity and length", "A"): _by(
        "name", lambda k: k.startswith("diversity/") or k == "response_length/mean", "val/"),
}
"""Each panel target's value, from metrics.jsonl. A rate panel is compared through its
counter (`rate(c[…])` read as `c`): its slope depends on when Prometheus scraped, its
total does not, and the total is what a worker's duplicate series would break."""


def _panel_targets() -> list[tuple[str, str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["refId"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def _evaluate(port: int, expr: str, job: str) -> object:
    """A panel's PromQL for one run (`$job`), a rate read as its counter: one number, or
    {label value: number} for a panel that keeps a label."""
    query = re.sub(r"rate\((.+?)\[\$__rate_interval\]\)", r"\1", expr).replace("$job", job)
    result = _query(port, query)
    kept = [k for k in ("stage", "name", "job") if f"by (le, {k})" in query
            or f"by ({k})" in query]
    if not kept:
        assert len(result) == 1, f"{query}: {result}"
        return float(result[0]["value"][1])  # type: ignore[index]
    return {r["metric"][kept[0]]: float(r["value"][1]) for r in result}  # type: ignore[index]


@pytest.mark.prometheus
@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["ray", "fsdp"])
def test_every_panel_of_a_distributed_run_shows_its_metrics_jsonl(
        target: str, tmp_path: Path) -> None:
    """ray(2) and fsdp(2), scraped by a real Prometheus: every panel of the dashboard
    evaluated through its HTTP API is the run's metrics.jsonl — no worker's series
    beside the driver's (rank 0's) pulls an `avg` down or adds to a `sum`."""
    targets = _panel_targets()
    assert {(t, r) for t, r, _ in targets} == set(TRUTH) | {("Memory per device", "A")}
    metrics_port, run_dir, log = free_port(), tmp_path / "run", tmp_path / "run.log"
    eval_set = tmp_path / "eval.jsonl"
    eval_set.write_text("".join(json.dumps(
        {"prompt": [{"role": "user", "content": q}], "ground_truth": a}) + "\n"
        for q, a in EVAL_SET))
    cmd = [sys.executable, "-m", "flowgraph", "run", str(ROOT / "graphs" / "grpo.yaml"),
           "--target", target, "--nproc", "2", *SMALL, f"trainer.run_dir={run_dir}",
           f"data.train.eval_path={eval_set}", "--metrics-port", str(metrics_port),
           "--metrics-hold", "120"]
    with prometheus(tmp_path, {target: metrics_port}) as (port, prom_log), \
            log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                start_new_session=True)
        try:
            _wait_for(lambda: "serving the final metrics" in log.read_text()
                      or proc.poll() is not None, 240, log)
            assert proc.poll() is None, log.read_text()[-3000:]
            held = time.time()  # the run is over: a scrape after this one is final
            _wait_for(lambda: float(_query_until(port, f'max(timestamp(flowgraph_last_step'
                                                 f'{{job="{target}"}}))', prom_log)[0]
                                    ["value"][1]) > held, 30, prom_log)  # type: ignore[index]
            rows = _rows(run_dir)
            assert len(rows) == STEPS and rows[-1]["critic/score/mean"] != 0
            assert rows[-1]["actor/kl_loss"] != 0, "a KL of 0 cannot show a fraction of it"
            for title, ref, expr in targets:
                if title == "Memory per device":  # not in metrics.jsonl: every worker's
                    memory = {r["metric"]["worker"]: float(r["value"][1])  # type: ignore[index]
                              for r in _query(port, expr.replace("$job", target))}
                    assert set(memory) == WORKERS[target] and min(memory.values()) > 1e6
                    continue
                got, want = _evaluate(port, expr, target), TRUTH[title, ref](rows)
                if "by (job)" in expr:
                    want = {target: want}
                assert got == pytest.approx(want, rel=1e-9), f"panel `{title}` ({ref}): {expr}"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
