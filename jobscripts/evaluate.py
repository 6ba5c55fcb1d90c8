"""Evaluate an exported Hugging Face model: held-out perplexity, bits per byte, samples.

    python -m jobscripts.evaluate --model HF_DIR --max-model-len 4096
        (--manifest DATA/manifest.json | --dataset PREFIX ... | --data heldout.jsonl)
        [--split 95,5,0] [--heldout-split auto|test|valid]
        [--backend transformers|vllm|vllm-server] [--server-url URL | --server-port P]
        [--max-documents N] [--max-tokens N] [--text-field text]
        [--prompt TEXT ...] [--prompts-file prompts.json] [--temperatures 0 0.8]
        [--max-new-tokens 64] [--seed 0] [--batch-size 8] [--num-threads N]
        [--lm-eval-tasks a,b --lm-eval-include DIR [--lm-eval-limit N]]
        [--output-dir DIR] [--result PATH]

``transformers`` is the CPU reference (tests, the local cluster); ``vllm`` is the production
path in the vLLM container; ``vllm-server`` asks an OpenAI-compatible ``vllm serve`` (given by
``--server-url``, or started here on ``--server-port``). All three are fed the same token
windows and their log-probabilities go through jobscripts/eval_metrics.py, so the figures
mean the same whichever computed them. ``--max-model-len`` must be the training sequence
length: documents longer than that are cut into windows the model was trained on.

What is evaluated: with ``--manifest`` (its prefixes) or ``--dataset`` (Megatron prefixes), the
documents of each prefix that training never saw under ``--split`` (the training's
``data.split``): the test split when it has documents, else the validation split
(jobscripts/eval_data.py), read as token ids from the ``.bin/.idx``; bits per byte counts the
bytes of their decoded text. ``--data`` is a separate held-out JSONL instead, tokenized here.
Several prefixes are interleaved; ``--max-documents``/``--max-tokens`` take the first
documents of the split(s).

Result JSON (default <output dir>/eval.json): ok, error, model, backend, data, heldout,
max_model_len, window_len, nll_per_token, perplexity, bits_per_token, bits_per_byte,
tokens_evaluated, bytes_evaluated, documents_evaluated, documents_truncated, samples
[{prompt, temperature, completion}], lm_eval ({task: {metric: value}} or null), step, seconds.
``heldout`` (null with ``--data``): split_weights, split ("test"/"valid", or "mixed" when
prefixes differ), datasets [{prefix, split, documents, split_range [begin, end),
split_documents, evaluated_documents, evaluated_range [first, last + 1)}]; documents of the
evaluated range that are not counted had no token besides the EOD.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

from jobscripts.common import StepError, entry_point, log
from jobscripts.eval_data import HELDOUT_CHOICES
from jobscripts.eval_metrics import Document, prepare_documents, score, take_documents

BACKENDS = ("transformers", "vllm", "vllm-server")
SERVED_NAME = "model"


def read_texts(path: Path, field: str) -> Iterator[str]:
    """Texts of a JSONL file, lazily (the caps stop reading early); errors name file:line."""
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 (a generator owns it)
    except OSError as exc:
        raise StepError(f"--data {path}: {exc.strerror}") from exc
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise StepError(f"{path}:{number}: not JSON ({exc})") from exc
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise StepError(f"{path}:{number}: no string field {field!r}")
            yield text


def dataset_prefixes(args: argparse.Namespace, eod: int) -> list[str]:
    """The Megatron prefixes to take held-out documents from: ``--dataset``, or the manifest's
    (which must have been tokenized with this model's EOD, or every window is off by it)."""
    if args.dataset:
        return list(args.dataset)
    from jobscripts import manifest as manifests

    try:
        manifest = manifests.load(args.manifest)
    except manifests.ManifestError as exc:
        raise StepError(str(exc)) from exc
    if manifest["settings"]["eod_id"] != eod:
        raise StepError(f"{args.manifest}: tokenized with EOD {manifest['settings']['eod_id']}, "
                        f"the model's tokenizer has EOD {eod}")
    return manifests.data_prefixes(manifest, Path(args.manifest).parent)


def split_documents(args: argparse.Namespace, tokenizer, eod: int):
    """(documents, the result JSON's ``heldout`` record) from the datasets' held-out splits."""
    from jobscripts.eval_data import heldout_documents, open_heldout

    prefixes = dataset_prefixes(args, eod)
    try:
        opened = open_heldout(prefixes, args.split, args.heldout_split)
    except (OSError, ValueError) as exc:
        raise StepError(f"held-out data: {exc}") from exc
    for heldout, _ in opened:
        log(f"{heldout.prefix}: {heldout.split} split = documents [{heldout.begin}, "
            f"{heldout.end}) of {heldout.documents} (split {args.split})")
    items = ((ids, None, (number, index)) for number, index, ids in heldout_documents(opened, eod))
    documents = take_documents(items, tokenizer.decode, args.max_documents, args.max_tokens)
    splits = {heldout.split for heldout, _ in opened}
    record = {"split_weights": args.split,
              "split": splits.pop() if len(splits) == 1 else "mixed",
              "datasets": [heldout.record([d.source[1] for d in documents
                                           if d.source[0] == number])
                           for number, (heldout, _) in enumerate(opened)]}
    return documents, record


def load_documents(args: argparse.Namespace, tokenizer, eod: int
                   ) -> tuple[list[Document], dict | None]:
    if args.data is None:
        return split_documents(args, tokenizer, eod)
    documents = prepare_documents(
        read_texts(Path(args.data), args.text_field),
        encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
        decode=tokenizer.decode, max_documents=args.max_documents, max_tokens=args.max_tokens)
    return documents, None


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            loaded = json.loads(Path(args.prompts_file).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StepError(f"--prompts-file {args.prompts_file}: {exc}") from exc
        if not (isinstance(loaded, list) and all(isinstance(p, str) for p in loaded)):
            raise StepError(f"--prompts-file {args.prompts_file}: expected a JSON list of strings")
        prompts += loaded
    return prompts


def open_backend(args: argparse.Namespace, stack: contextlib.ExitStack, server: dict):
    """The backend ``--backend`` names; a server started here fills ``server`` (its record)."""
    if args.backend == "transformers":
        from jobscripts.eval_hf import TransformersBackend

        return TransformersBackend(args.model, args.batch_size, args.num_threads)
    from jobscripts.eval_vllm import VllmBackend, engine_settings

    if args.backend == "vllm":
        return VllmBackend(args.model, args.max_model_len, seed=args.seed)
    from jobscripts.eval_vllm_server import ServedModel, ServerBackend

    url = args.server_url
    if url is None:
        engine, cpu = engine_settings(args.model, args.max_model_len, args.seed)
        url = stack.enter_context(ServedModel(
            engine, args.server_port, SERVED_NAME, Path(args.output_dir) / "vllm-serve.log", cpu,
            record=server)).base_url
    return ServerBackend(url, SERVED_NAME, args.batch_size)


def write_logprobs(path: str, windows: list[list[int]], logprobs: list[list[float]]) -> None:
    """``--logprobs-out``: every scored window and its per-token log-probs (cross-checks)."""
    from jobscripts.results import write_json_atomic

    write_json_atomic(path, {"windows": windows, "logprobs": logprobs})


def sample(backend, tokenizer, prompts: list[str], args, eod: int) -> list[dict]:
    """Completions at each temperature; prompts start after an EOD, as documents do."""
    if not prompts:
        return []
    encoded = [[eod, *tokenizer.encode(p, add_special_tokens=False)] for p in prompts]
    longest = max(len(e) for e in encoded)
    max_new = min(args.max_new_tokens, args.max_model_len - longest)
    if max_new < 1:
        raise StepError(f"a prompt has {longest - 1} tokens: no room left to generate within "
                        f"--max-model-len {args.max_model_len}")
    samples = []
    for temperature in args.temperatures:
        outputs = backend.complete(encoded, temperature, max_new, args.seed, eod)
        for prompt, ids in zip(prompts, outputs, strict=True):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            samples.append({"prompt": prompt, "temperature": temperature, "completion": text})
            log(f"sample T={temperature}: {prompt!r} -> {text[:200]!r}")
    return samples


def run_lm_eval(args: argparse.Namespace) -> dict:
    if args.backend == "transformers":
        raise StepError("--lm-eval-tasks needs --backend vllm or vllm-server (lm-eval runs vLLM)")
    from jobscripts.eval_vllm import lm_eval_command, run_lm_eval_child

    output = Path(args.output_dir) / "lm_eval.json"
    command = lm_eval_command(args.model, args.lm_eval_tasks.split(","), args.lm_eval_include,
                              args.max_model_len, str(output), args.lm_eval_limit, args.seed)
    return run_lm_eval_child(command, output)


def evaluate(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    if args.max_model_len < 2:
        raise StepError("--max-model-len must be at least 2")
    try:  # first, before any engine starts: a missing tokenizer costs no GPU minute
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except (OSError, ValueError) as exc:
        raise StepError(f"{args.tokenizer or args.model}: cannot load the tokenizer: {exc}"
                        ) from exc
    eod = tokenizer.eos_token_id
    if eod is None:
        raise StepError(f"{args.tokenizer or args.model}: the tokenizer defines no EOS/EOD token")
    documents, heldout = load_documents(args, tokenizer, eod)
    if not documents:
        raise StepError(f"{args.data or 'the held-out split'}: no document with tokens to "
                        "evaluate")
    log(f"{len(documents)} documents, {sum(len(d.token_ids) for d in documents)} tokens; "
        f"backend {args.backend}")
    lm_eval = run_lm_eval(args) if args.lm_eval_tasks else None  # first: it needs the GPU
    window_len = args.max_model_len - 1
    server: dict = {}
    timings: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        started = time.monotonic()
        backend = open_backend(args, stack, server)
        timings["backend_start_s"] = round(time.monotonic() - started, 2)

        def logprobs_of(windows: list[list[int]]) -> list[list[float]]:
            started = time.monotonic()
            values = backend.window_logprobs(windows)
            timings["scoring_s"] = round(time.monotonic() - started, 3)
            if args.logprobs_out:
                write_logprobs(args.logprobs_out, windows, values)
            return values

        summary = score(documents, eod, window_len, logprobs_of).summary()
        log(f"perplexity {summary['perplexity']:.4f}, bits/byte {summary['bits_per_byte']}, "
            f"nll/token {summary['nll_per_token']:.4f} over {summary['tokens_evaluated']} tokens")
        samples = sample(backend, tokenizer, read_prompts(args), args, eod)
    return {"model": str(args.model), "backend": args.backend, "data": args.data,
            "heldout": heldout, "max_model_len": args.max_model_len, "window_len": window_len,
            **summary, "samples": samples, "lm_eval": lm_eval, "timings": timings,
            "server": server or None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobscripts.evaluate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--manifest", help="the tokenized dataset's manifest.json: its prefixes")
    source.add_argument("--dataset", action="append",
                        help="a Megatron prefix (PATH_text_document; repeatable)")
    source.add_argument("--data", help="a held-out JSONL of texts instead")
    p.add_argument("--split", default="969,30,1",
                   help="the training's train,valid,test weights (data.split)")
    p.add_argument("--heldout-split", choices=HELDOUT_CHOICES, default="auto",
                   help="auto: test when it has documents, else valid")
    p.add_argument("--text-field", default="text", help="--data: the JSONL text field")
    p.add_argument("--max-model-len", type=int, required=True,
                   help="the training sequence length")
    p.add_argument("--backend", choices=BACKENDS, default="transformers")
    p.add_argument("--server-url", help="vllm-server: an already running server")
    p.add_argument("--server-port", type=int, default=0,
                   help="vllm-server: port to start it on (0: a free one)")
    p.add_argument("--max-documents", type=int)
    p.add_argument("--max-tokens", type=int, help="stop after this many scored tokens")
    p.add_argument("--prompt", action="append", help="a sampling prompt (repeatable)")
    p.add_argument("--prompts-file", help="JSON list of sampling prompts")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-threads", type=int, help="transformers: torch CPU threads")
    p.add_argument("--lm-eval-tasks", help="comma-separated lm-evaluation-harness tasks")
    p.add_argument("--lm-eval-include", help="directory of local lm-eval task YAMLs")
    p.add_argument("--lm-eval-limit", type=int, help="examples per lm-eval task")
    p.add_argument("--logprobs-out", help="write every window's per-token log-probs here")
    p.add_argument("--output-dir", default=".", help="where eval.json (and server logs) go")
    return p


main = entry_point("evaluate", build_parser, evaluate, "eval.json")

if __name__ == "__main__":
    raise SystemExit(main())
