"""Prometheus metrics of a real `flowgraph run`: scraped over HTTP, read back through a
real Prometheus server, and the Grafana dashboard's queries checked against them.

One short GRPO run (3 steps, an evaluation after the last) serves `/metrics` for the
whole module; `--metrics-hold` keeps it serving after the last step until the module
is done, and Ctrl-C (SIGINT) then ends it cleanly.
"""

from __future__ import annotations

import json
import math
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
    """What fsdp/ray feed: one endpoint, a `worker` label per rank."""
    exporter = Exporter(stage_kinds={"gen": "generate"})
    for rank in range(2):
        exporter.observe_step(0, {"timing_s/gen": 0.5 + rank, "perf/response_tokens": 10.0,
                                  "critic/score/mean": 0.25 * rank}, worker=f"rank{rank}")
        exporter.set_memory(f"rank{rank}", f"cuda:{rank}", 1000 * (rank + 1))
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in exporter.registry.collect() for s in family.samples}
    assert got[("flowgraph_training_steps_total", (("worker", "rank1"),))] == 1.0
    assert got[("flowgraph_stage_seconds_sum",
                (("kind", "generate"), ("stage", "gen"), ("worker", "rank1")))] == 1.5
    assert got[("flowgraph_generated_tokens_total", (("worker", "rank0"),))] == 10.0
    assert got[("flowgraph_reward_mean", (("worker", "rank1"),))] == 0.25
    assert got[("flowgraph_device_memory_bytes",
                (("device", "cuda:1"), ("worker", "rank1")))] == 2000


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


@pytest.mark.prometheus
def test_prometheus_scrapes_the_run(live_run: LiveRun, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the `prometheus` binary is not on PATH: run `scripts/ensure-prometheus` "
                    "(Debian: apt-get install prometheus), or deselect with -m 'not prometheus'")
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "flowgraph", "static_configs": [
            {"targets": [f"127.0.0.1:{live_run.port}"]}]}]}))
    port = free_port()
    log = tmp_path / "prometheus.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: _ready(port, server, log), 30, log)
        result = _query_until(port, "flowgraph_training_steps_total", server, log)
        metric, (_, count) = result[0]["metric"], result[0]["value"]
        assert float(count) == STEPS
        assert metric["job"] == "flowgraph" and metric["worker"] == "local"
        grafana = {"$__rate_interval": "1m", "$job": ".+"}
        for _, expr in dashboard_queries():  # every panel's PromQL parses and runs
            query = re.sub(r"\$\w+", lambda m: grafana[m.group(0)], expr)
            _query(port, query.replace("label_values(flowgraph_run_info, job)",
                                       "flowgraph_run_info"))
    finally:
        server.terminate()
        server.wait(timeout=30)
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


def _query_until(port: int, promql: str, server: subprocess.Popen[bytes], log: Path
                 ) -> list[dict[str, object]]:
    """Query until Prometheus has scraped the series (within 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = _query(port, promql)
        if result:
            return result
        time.sleep(0.25)
    pytest.fail(f"prometheus returned no `{promql}` within 30 s:\n{log.read_text()[-3000:]}")
