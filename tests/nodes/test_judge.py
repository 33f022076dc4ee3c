"""The `judge` kind: the score format, a model of the graph as judge (against Hugging
Face's own greedy `generate`), and a judge behind an OpenAI-compatible URL (a fake
server on loopback: retries with backoff, the concurrency limit, the timeout's message,
the on-disk cache)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgraph.errors import FlowgraphError
from flowgraph.nodes.judge import SCORE_PATTERN, judge, parse_score
from flowgraph.nodes.models import load_model, load_tokenizer
from flowgraph.runtime import NodeContext

TEMPLATE = "Task: {prompt}\nAnswer: {response}\nReply `Score: <0-10>`."


@pytest.mark.parametrize(("reply", "score"), [
    ("Score: 7", 7.0),
    ("score=7.5", 7.5),
    ("The answer is right. SCORE: 9", 9.0),
    ("Score: 3 ... on reflection, Score: 4", 4.0),  # the last one counts
    ("Score: 11", None),  # over max_score
    ("Score: -1", None),  # under min_score
    ("I give it a 7", None),  # no `Score:`
    ("", None),
])
def test_parse_score(reply: str, score: float | None) -> None:
    assert parse_score(reply, SCORE_PATTERN, 0.0, 10.0) == score


def _batch(tok: Any) -> dict[str, torch.Tensor]:
    """Two left-padded prompts and their responses (the second with a padded tail)."""
    p = [tok("abc", add_special_tokens=False)["input_ids"],
         tok("hello world", add_special_tokens=False)["input_ids"]]
    r = [tok(" cba", add_special_tokens=False)["input_ids"],
         tok(" dlrow", add_special_tokens=False)["input_ids"]]
    P, T = max(map(len, p)), max(map(len, r)) + 1
    return {
        "prompts": torch.tensor([[0] * (P - len(x)) + x for x in p]),
        "prompt_mask": torch.tensor([[0] * (P - len(x)) + [1] * len(x) for x in p]),
        "responses": torch.tensor([x + [0] * (T - len(x)) for x in r]),
        "response_mask": torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in r]),
    }


def test_model_judge_replies_as_hf_greedy_generate() -> None:
    # reference: each rubric text through the judge's chat template, then Hugging Face's
    # generate (greedy, one row at a time: no padding), the reply parsed by parse_score
    tok = load_tokenizer("builtin:tiny-lm")
    model = load_model("builtin:tiny-lm")
    batch = _batch(tok)
    ctx = NodeContext(node="reward", kind="judge", step=0, seed=0, tokenizers={"actor": tok})
    pattern = r"(\d)()"  # any digit: the random judge writes some, so valid rows occur
    got = judge(**batch, ctx=ctx, model=model, tokenizer=tok, template=TEMPLATE,
                max_new_tokens=12, score_pattern=pattern, max_score=9.0)["scores"]
    want = []
    for prompt, response in (("abc", " cba"), ("hello world", " dlrow")):
        text = tok.apply_chat_template(
            [{"role": "user", "content": TEMPLATE.format(prompt=prompt, response=response)}],
            tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=12, pad_token_id=tok.pad_token_id)
        reply = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        want.append(parse_score(reply, pattern, 0.0, 9.0))
    assert got.tolist() == [0.0 if s is None else s for s in want]
    assert ctx.metrics["judge/invalid"] == want.count(None) / 2
    assert ctx.metrics["judge/mean"] == pytest.approx(got.mean().item())


def test_judge_names_a_missing_policy_tokenizer() -> None:
    tok = load_tokenizer("builtin:tiny-lm")
    ctx = NodeContext(node="reward", kind="judge", step=0, seed=0, tokenizers={"actor": tok})
    with pytest.raises(FlowgraphError, match="judge node `reward`: `policy` names model "
                                             "`policy`, which has no tokenizer"):
        judge(**_batch(tok), ctx=ctx, template=TEMPLATE, policy="policy", url="http://x")


class _Judge(BaseHTTPRequestHandler):
    """A fake OpenAI-compatible judge: `Score: <length of the answer>`; a reply without a
    score for an answer holding `?`. Its server's fields script failures and delays."""

    server: Any

    def do_POST(self) -> None:
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with s.lock:
            s.requests += 1
            s.in_flight += 1
            s.most = max(s.most, s.in_flight)
            failing, s.failures = s.failures > 0, max(0, s.failures - 1)
            s.times.append(time.monotonic())
            s.keys.append(self.headers.get("Authorization"))
        time.sleep(s.delay)
        with s.lock:
            s.in_flight -= 1
        if failing:
            self.send_response(503)
            self.end_headers()
            return
        answer = body["messages"][0]["content"].split("Answer: ")[1].split("\n")[0]
        content = "no idea" if "?" in answer else f"Score: {len(answer.strip())}"
        data = json.dumps({"choices": [{"message": {"role": "assistant",
                                                    "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Any]:
    s: Any = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    s.lock, s.requests, s.in_flight, s.most, s.failures = threading.Lock(), 0, 0, 0, 0
    s.delay, s.times, s.keys = 0.0, [], []
    s.url = f"http://127.0.0.1:{s.server_port}/v1"
    thread = threading.Thread(target=s.serve_forever, daemon=True)
    thread.start()
    yield s
    s.shutdown()
    s.server_close()


def _texts(answers: list[str]) -> dict[str, Any]:
    tok = load_tokenizer("builtin:tiny-lm")
    ids = [tok(a, add_special_tokens=False)["input_ids"] for a in answers]
    T = max(map(len, ids))
    prompt = tok("q", add_special_tokens=False)["input_ids"]
    return {"prompts": torch.tensor([prompt] * len(ids)),
            "prompt_mask": torch.ones(len(ids), len(prompt), dtype=torch.long),
            "responses": torch.tensor([x + [0] * (T - len(x)) for x in ids]),
            "response_mask": torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in ids]),
            "ctx": NodeContext(node="reward", kind="judge", step=0, seed=0,
                               tokenizers={"actor": tok})}


def test_url_judge_scores_and_invalid_replies(server: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    batch = _texts(["abc", "abcdef", "what?", "abcdefghijkl"])
    got = judge(**batch, template=TEMPLATE, url=server.url, api_key_env="JUDGE_KEY",
                invalid_score=-1.0, cache=False)["scores"]
    # lengths 3 and 6 score themselves; `?` gets no score, 12 is over max_score 10
    assert got.tolist() == [3.0, 6.0, -1.0, -1.0]
    assert batch["ctx"].metrics == {"judge/invalid": 0.5, "judge/mean": 1.75}
    assert server.keys == ["Bearer sk-test"] * 4


def test_url_judge_retries_with_backoff(server: Any) -> None:
    server.failures = 2  # the first two requests get 503
    batch = _texts(["abc"])
    got = judge(**batch, template=TEMPLATE, url=server.url, retries=2, backoff_s=0.2,
                cache=False)["scores"]
    assert got.tolist() == [3.0] and server.requests == 3
    waits = [b - a for a, b in zip(server.times, server.times[1:], strict=False)]
    assert waits[0] >= 0.2 and waits[1] >= 0.4  # backoff_s, then twice that


def test_url_judge_says_the_node_and_url_when_retries_run_out(server: Any) -> None:
    server.failures = 5
    with pytest.raises(FlowgraphError, match=rf"judge node `reward`: the judge server "
                                             rf"{server.url} failed 2 tries \(HTTPStatusError"):
        judge(**_texts(["abc"]), template=TEMPLATE, url=server.url, retries=1, backoff_s=0.0,
              cache=False)


def test_url_judge_timeout_names_the_node_and_url(server: Any) -> None:
    server.delay = 1.0
    with pytest.raises(FlowgraphError, match=rf"judge node `reward`: the judge server "
                                             rf"{server.url} failed 1 tries \(no answer "
                                             r"within request_timeout_s 0.2s\)"):
        judge(**_texts(["abc"]), template=TEMPLATE, url=server.url, retries=0,
              request_timeout_s=0.2, cache=False)


def test_url_judge_holds_its_concurrency_limit(server: Any) -> None:
    server.delay = 0.1
    judge(**_texts(["a", "ab", "abc", "abcd", "abcde", "abcdef"]), template=TEMPLATE,
          url=server.url, concurrency=2, cache=False)
    assert server.requests == 6 and server.most == 2


def test_url_judge_cache_answers_a_resumed_run(server: Any, tmp_path: Path) -> None:
    def run() -> list[float]:
        batch = _texts(["abc", "abcd"])
        batch["ctx"].run_dir = str(tmp_path)
        return list(judge(**batch, template=TEMPLATE, url=server.url)["scores"].tolist())

    assert run() == [3.0, 4.0] and server.requests == 2
    assert len(list((tmp_path / "judge_cache" / "reward").glob("*.json"))) == 2
    assert run() == [3.0, 4.0] and server.requests == 2  # both from the cache
