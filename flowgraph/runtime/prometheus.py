"""Trainer metrics for Prometheus: one `/metrics` endpoint per run, fed from step rows.

`flowgraph run --metrics-port PORT` (or `trainer.metrics_port`) serves it on 127.0.0.1
(`--metrics-host 0.0.0.0` to let other machines scrape). The executor hands each
step's metrics dict — the row that goes to `metrics.jsonl` — to `observe_step`; every
series is derived from those verl names, so the endpoint, the JSONL file and
TensorBoard always agree.

Series (every one carries a `worker` label):

    flowgraph_training_steps_total        counter    steps finished
    flowgraph_last_step                   gauge      index of the latest step (survives --resume)
    flowgraph_skipped_steps_total         counter    batches skipped for a NaN (`skipped`,
                                                     trainer.on_nonfinite=skip)
    flowgraph_stage_seconds{stage,kind}   histogram  `timing_s/<node>`: stage = node or data
                                                     source name, kind = its registry kind
    flowgraph_worker_stage_seconds{stage,kind}
                                          histogram  a worker's own seconds in a node (fsdp
                                                     ranks, Ray pool workers; see below)
    flowgraph_step_seconds                histogram  `timing_s/step`, one whole step
    flowgraph_generated_tokens_total      counter    `perf/response_tokens`: valid response tokens
    flowgraph_tokens_total                counter    `perf/tokens`: prompt + response tokens
    flowgraph_reward_mean                 gauge      `critic/score/mean` (the mean score the
                                                     advantage trains on), else
                                                     `critic/rewards/mean`
    flowgraph_kl                          gauge      KL(π ‖ π_ref) of the step, see below
    flowgraph_ppo_kl                      gauge      `actor/ppo_kl`: rollout vs updated policy
    flowgraph_step_metric{name}           gauge      every other number of the row, by verl
                                                     name (`actor/pg_loss`, `critic/vf_loss`, …)
    flowgraph_val{name}                   gauge      held-out metrics, `val/` dropped from name
    flowgraph_device_memory_bytes{device} gauge      CUDA: `torch.cuda.memory_reserved` per
                                                     device; CPU: the process's resident set
    flowgraph_run_info{graph,target}      info
    process_*                                        prometheus_client's process collector

`flowgraph_kl` is the KL to the reference policy, the quantity a KL coefficient is
tuned against: `actor/reward_kl_penalty` when the graph has a `kl_penalty` node (PPO:
the per-token estimate of KL(π_old ‖ π_ref) subtracted from the reward), else
`actor/kl_loss` (GRPO: the KL term of the actor's loss, with its `kl_loss_type`
estimator). `actor/ppo_kl` measures something else — how far one update moved the
policy — and has its own gauge.

Distributed executors (fsdp, ray) keep ONE endpoint per run, on the process that owns
the training loop (fsdp: rank 0; ray: the driver). The step row is the run's, so its
series are exported once, by that owner (`worker="rank0"`, `"driver"`, `"local"`):
`observe_step(step, row, worker=...)`. A worker exports only what it measures itself —
its seconds in each node (`observe_worker`: `flowgraph_worker_stage_seconds`) and its
memory (`set_memory(worker, device, nbytes)`), under its own `worker` label (`rank1`,
or the Ray actor's `<pool>/<rank>`) — never a series of the row: a worker's reward or
KL gauge at 0 beside the driver's would make every `avg` over `worker` a fraction of
the truth. Prometheus scrapes one target per run; a dashboard needs no `worker`
filter (`max` of the step rate, `sum` of token rates, memory `by (worker, device)`).
The local executor reports as `worker="local"`.
"""

from __future__ import annotations

import errno
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, TextIO

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    start_http_server,
)

from flowgraph.errors import FlowgraphError
from flowgraph.spelling import option

if TYPE_CHECKING:
    from threading import Thread
    from wsgiref.simple_server import WSGIServer

    from flowgraph.plan import ExecutionPlan

__all__ = ["STAGE_BUCKETS", "Exporter", "process_memory"]

STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0, 300.0, 600.0, math.inf)
"""Seconds: a tiny model's CPU stage (ms) up to a large model's rollout (minutes)."""

REWARD_KEYS = ("critic/score/mean", "critic/rewards/mean")
KL_KEYS = ("actor/reward_kl_penalty", "actor/kl_loss")
_FED_ELSEWHERE = frozenset({"perf/tokens", "perf/response_tokens", "actor/ppo_kl", "skipped"})


class Exporter:
    """The run's Prometheus series on a private registry, optionally served over HTTP."""

    def __init__(self, *, stage_kinds: Mapping[str, str] | None = None,
                 graph: str = "", target: str = "local") -> None:
        self.registry = CollectorRegistry()
        self.stage_kinds = dict(stage_kinds or {})
        """Stage (node or data source name) -> its kind, the histogram's `kind` label."""
        self.url: str | None = None
        self._server: tuple[WSGIServer, Thread] | None = None
        r = self.registry
        ProcessCollector(registry=r)
        Info("flowgraph_run", "The graph this endpoint reports on.", registry=r).info(
            {"graph": graph, "target": target})
        self.steps = Counter("flowgraph_training_steps", "Training steps finished.",
                             ["worker"], registry=r)
        self.last_step = Gauge("flowgraph_last_step", "Index of the latest finished step.",
                               ["worker"], registry=r)
        self.skipped = Counter("flowgraph_skipped_steps", "Steps whose batch was skipped "
                               "for a non-finite value.", ["worker"], registry=r)
        self.stage_seconds = Histogram(
            "flowgraph_stage_seconds", "Seconds spent in one stage (node) of a step.",
            ["worker", "stage", "kind"], buckets=STAGE_BUCKETS, registry=r)
        self.worker_stage_seconds = Histogram(
            "flowgraph_worker_stage_seconds", "Seconds one worker spent in one stage "
            "(node) of a step.", ["worker", "stage", "kind"], buckets=STAGE_BUCKETS,
            registry=r)
        self.step_seconds = Histogram("flowgraph_step_seconds", "Seconds of one whole step.",
                                      ["worker"], buckets=STAGE_BUCKETS, registry=r)
        self.generated_tokens = Counter("flowgraph_generated_tokens",
                                        "Valid response tokens generated.", ["worker"],
                                        registry=r)
        self.tokens = Counter("flowgraph_tokens", "Prompt + response tokens processed.",
                              ["worker"], registry=r)
        self.reward = Gauge("flowgraph_reward_mean", "Mean reward (score) of the step's batch.",
                            ["worker"], registry=r)
        self.kl = Gauge("flowgraph_kl", "KL to the reference policy of the step's batch.",
                        ["worker"], registry=r)
        self.ppo_kl = Gauge("flowgraph_ppo_kl", "Approximate KL between the rollout and the "
                            "updated policy (actor/ppo_kl).", ["worker"], registry=r)
        self.step_metric = Gauge("flowgraph_step_metric", "A number of the latest step row, "
                                 "by its verl name.", ["worker", "name"], registry=r)
        self.val = Gauge("flowgraph_val", "A held-out (validation) metric of the latest "
                         "evaluation.", ["worker", "name"], registry=r)
        self.memory = Gauge("flowgraph_device_memory_bytes", "Device memory in use: CUDA "
                            "memory reserved per device, or the process's resident set on "
                            "CPU.", ["worker", "device"], registry=r)

    @classmethod
    def for_plan(cls, plan: ExecutionPlan, *, target: str = "local") -> Exporter:
        kinds = {n.name: n.kind for n in plan.nodes}
        return cls(stage_kinds=kinds, graph=plan.name, target=target)

    @classmethod
    def start(cls, plan: ExecutionPlan, port: int, host: str = "127.0.0.1", *,
              target: str = "local", out: TextIO | None = None) -> Exporter:
        """An exporter for `plan`, serving at once; prints `metrics: <url>` to `out`."""
        exporter = cls.for_plan(plan, target=target)
        url = exporter.serve(port, host)
        print(f"metrics: {url}", file=out or sys.stdout, flush=True)
        return exporter

    # -- feeding ------------------------------------------------------------------------

    def observe_step(self, step: int, metrics: Mapping[str, float],
                     worker: str = "local") -> None:
        """The step row (verl names, as written to metrics.jsonl) of the run, from the
        process that owns it; a series is set only from a key the row has."""
        self.steps.labels(worker).inc()
        self.last_step.labels(worker).set(step)
        for key, raw in metrics.items():
            value = float(raw)
            if key.startswith("val/"):
                self.val.labels(worker, key.removeprefix("val/")).set(value)
            elif key == "timing_s/step":
                _observe(self.step_seconds.labels(worker), value)
            elif key.startswith("timing_s/"):
                stage = key.removeprefix("timing_s/")
                _observe(self.stage_seconds.labels(worker, stage,
                                                   self.stage_kinds.get(stage, "")), value)
            elif key not in _FED_ELSEWHERE:
                self.step_metric.labels(worker, key).set(value)
        _increase(self.generated_tokens, worker, metrics.get("perf/response_tokens"))
        _increase(self.tokens, worker, metrics.get("perf/tokens"))
        _increase(self.skipped, worker, metrics.get("skipped", 0.0))  # 0 from the start
        _set_first(self.reward, worker, metrics, REWARD_KEYS)
        _set_first(self.kl, worker, metrics, KL_KEYS)
        _set_first(self.ppo_kl, worker, metrics, ("actor/ppo_kl",))

    def observe_worker(self, timings: Mapping[str, float], worker: str) -> None:
        """One worker's own seconds in the step's nodes (`timing_s/<node>`)."""
        for key, value in timings.items():
            stage = key.removeprefix("timing_s/")
            _observe(self.worker_stage_seconds.labels(worker, stage,
                                                      self.stage_kinds.get(stage, "")),
                     float(value))

    def set_memory(self, worker: str, device: str, nbytes: int) -> None:
        """Memory in use on one device of one worker (`cuda:0`, `cpu`, …), in bytes."""
        self.memory.labels(worker, device).set(nbytes)

    def record_memory(self, worker: str = "local") -> None:
        """This process's memory: every CUDA device it sees, else its resident set."""
        for device, used in process_memory():
            self.set_memory(worker, device, used)

    # -- serving ------------------------------------------------------------------------

    def serve(self, port: int, host: str = "127.0.0.1") -> str:
        """Serve `/metrics` on a background thread; the URL (port 0 picks a free port)."""
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise FlowgraphError(_bind_error(port, host, exc)) from exc
        self._server = (server, thread)
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{server.server_port}/metrics"
        return self.url

    def hold(self, seconds: float, out: TextIO | None = None) -> None:
        """Keep serving after the run, so a scraper reads the final values; Ctrl-C ends it."""
        if self._server is None or seconds <= 0:
            return
        print(f"serving the final metrics at {self.url} for {seconds:g}s (Ctrl-C to stop)",
              file=out or sys.stdout, flush=True)
        try:
            time.sleep(seconds)
        except KeyboardInterrupt:
            return

    def close(self) -> None:
        if self._server is None:
            return
        server, thread = self._server
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        self._server = None


def _observe(histogram: Histogram, value: float) -> None:
    if math.isfinite(value) and value >= 0:
        histogram.observe(value)


def _increase(counter: Counter, worker: str, value: float | None) -> None:
    """Count `value` (a row's key; None: the row has none, and no series is made)."""
    if value is None:
        return
    child = counter.labels(worker)
    if math.isfinite(value) and value > 0:
        child.inc(value)


def _set_first(gauge: Gauge, worker: str, metrics: Mapping[str, float],
               keys: tuple[str, ...]) -> None:
    """The gauge from the first of `keys` the row has; none: no series (a DPO run has no
    reward, and a series at 0 would say it had)."""
    for key in keys:
        if key in metrics:
            gauge.labels(worker).set(float(metrics[key]))
            return


def _bind_error(port: int, host: str, exc: OSError) -> str:
    where = f"{option('metrics_port', port)} (host {host})"
    if exc.errno == errno.EADDRINUSE:
        return (f"{where}: port {port} is already in use (another run or exporter?); "
                f"pick a free port, or {option('metrics_port', 0)} to let the system choose "
                "one")
    if exc.errno == errno.EACCES:
        return f"{where}: no permission to bind port {port}; ports below 1024 need root"
    return f"{where}: cannot serve metrics: {exc.strerror or exc}"


def process_memory() -> list[tuple[str, int]]:
    """(device, bytes in use) for this process: CUDA devices when torch sees any (the
    caching allocator's reserved memory, close to what nvidia-smi shows), else the
    resident set size as device `cpu`."""
    torch = sys.modules.get("torch")  # never import torch just to look at memory
    if torch is not None and torch.cuda.is_available():
        return [(f"cuda:{i}", int(torch.cuda.memory_reserved(i)))
                for i in range(torch.cuda.device_count())]
    return [("cpu", _resident_bytes())]


def _resident_bytes() -> int:
    try:  # Linux: current resident pages
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        # Elsewhere only the peak is known: kilobytes on Linux, bytes on macOS.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if sys.platform == "darwin" else int(peak) * 1024
