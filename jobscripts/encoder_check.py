"""Check the fast encoder against Megatron's tokenizer in a forked process, while tokenizing.

Building Megatron's tokenizer takes seconds (transformers rebuilds the vocabulary
in Python), longer than encoding a small corpus. So tokenization starts at once
with tiktoken and the EOD id and vocabulary size read from the tokenizer files,
while a forked child (it inherits the imports: no re-import) builds Megatron's
tokenizer, draws the sample documents, checks those two numbers and the ids on
them. No shard is marked done before the child's verdict; a verdict against the
guess makes the caller redo the shards with the encoder the child found correct.
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable
from pathlib import Path

from jobscripts.common import StepError


def files_view(tokenizer_dir: Path) -> tuple[int, int | None]:
    """(vocabulary size with added tokens, id of eos_token) from tokenizer.json and its config."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    eos = config.get("eos_token")
    if isinstance(eos, dict):  # older configs store AddedToken dicts
        eos = eos.get("content")
    eod = tokenizer.token_to_id(eos) if isinstance(eos, str) else None
    return tokenizer.get_vocab_size(with_added_tokens=True), eod


def verdict(tokenizer_dir: Path, sample: list, requested: str, legacy: bool, prebuilt=None) -> dict:
    """Megatron's vocabulary size and EOD, and the first encoder that reproduces its ids."""
    from jobscripts.doc_encoder import choose
    from jobscripts.megatron_tokenizer import load

    reference = load(tokenizer_dir, legacy=legacy)
    if reference.eod is None:
        raise StepError(f"{tokenizer_dir}: the tokenizer has no eos_token, so no EOD to append")
    _encoder, report = choose(tokenizer_dir, reference, sample, requested, legacy, prebuilt)
    return {"vocab_size": reference.vocab_size, "eod": reference.eod, "report": report}


def _child(connection, tokenizer_dir, draw_sample, requested, legacy, prebuilt) -> None:
    try:
        connection.send(verdict(tokenizer_dir, draw_sample(), requested, legacy, prebuilt))
    except Exception as exc:  # the parent turns this into the step's error
        connection.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        connection.close()


class BackgroundCheck:
    """``verdict`` computed in a forked child; ``result()`` waits for it (once).

    ``prebuilt`` (name -> encode function) reaches the child by the fork, not by pickling.
    ``draw_sample`` runs in the child: reading the sample documents (a row group of every
    Parquet shard: 0.3 s of 3.9 on the benchmark corpus) is no longer a serial start-up step.
    The parent must not have used pyarrow before the fork (its thread pools do not survive
    one); the caller forks before it reads a document.
    """

    def __init__(self, tokenizer_dir: Path, draw_sample: Callable[[], list], requested: str,
                 legacy: bool, prebuilt: dict | None = None):  # fmt: skip
        # Import megatron (~18 s) before forking, so that parent and child import it once;
        # and transformers, which Megatron's HF tokenizer library imports: in the child it
        # took most of the check's CPU time, away from the encoding threads.
        import megatron.core.datasets.indexed_dataset  # noqa: F401
        import megatron.core.tokenizers  # noqa: F401
        import megatron.core.tokenizers.text.libraries.huggingface_tokenizer  # noqa: F401

        # fork, not spawn: the child must not pay megatron's ~18 s import again. Forking is
        # safe here: the encoding threads start after it, and pyarrow's thread pools, which
        # start on first use, have not started in the parent (see the class docstring).
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_child,
            args=(send, tokenizer_dir, draw_sample, requested, legacy, prebuilt),
            daemon=True,
        )
        self._process.start()
        send.close()
        self._verdict: dict | None = None

    def ready(self) -> bool:
        return self._verdict is not None or self._receive.poll()

    def result(self) -> dict:
        if self._verdict is None:
            try:
                self._verdict = self._receive.recv()
            except EOFError:
                self._verdict = {"error": f"the check process died (exit {self._process.exitcode})"}
            self._process.join()
        if "error" in self._verdict:
            raise StepError(
                f"checking the encoder against Megatron failed: {self._verdict['error']}"
            )
        return self._verdict


class GuessRejected(Exception):
    """Megatron's tokenizer disagrees with the encoder or numbers tokenization started with."""


class Guess:
    """(encoder name, vocabulary size, EOD) that tokenization started with, being checked."""

    def __init__(self, check: BackgroundCheck, expected: tuple):
        self.check, self.expected = check, expected

    def ready(self) -> bool:
        return self.check.ready()

    def confirm(self) -> None:
        verdict = self.check.result()
        got = (verdict["report"].get("encoder"), verdict["vocab_size"], verdict["eod"])
        if got != self.expected:
            raise GuessRejected(verdict)
