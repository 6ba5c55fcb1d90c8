"""Check the fast encoder against Megatron's tokenizer in a forked process, while tokenizing.

Building Megatron's tokenizer takes seconds (transformers rebuilds the vocabulary
in Python), longer than encoding a small corpus. So tokenization starts at once
with tiktoken and the EOD id and vocabulary size read from the tokenizer files,
while a forked child (it inherits the imports: no re-import) builds Megatron's
tokenizer, receives the sample documents and the parent's encoder spec, checks
those two numbers and the ids on them. No shard is marked done before the child's
verdict; a verdict against the guess makes the caller redo the shards with the
encoder the child found correct.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from jobscripts.common import StepError


def verdict(reference, tokenizer_dir: Path, sample: list, requested: str, legacy: bool,
            builders: dict | None = None) -> dict:
    """Megatron's vocabulary size and EOD, and the first encoder that reproduces its ids."""
    from jobscripts.doc_encoder import choose

    if reference.eod is None:
        raise StepError(f"{tokenizer_dir}: the tokenizer has no eos_token, so no EOD to append")
    _encoder, report = choose(tokenizer_dir, reference, sample, requested, legacy, builders)
    return {"vocab_size": reference.vocab_size, "eod": reference.eod, "report": report}


def _child(connection, inputs, tokenizer_dir: Path, requested: str, legacy: bool) -> None:
    from jobscripts.fast_encoder import TiktokenEncoder
    from jobscripts.megatron_tokenizer import load

    def tiktoken_of_parent():
        return TiktokenEncoder(inputs.get()).encode  # the very spec the parent encodes with

    try:
        # First what needs no input: Megatron's tokenizer. Meanwhile the parent reads the
        # sample and builds its encoder, so each side spends these ~0.2 s on its own core.
        reference = load(tokenizer_dir, legacy=legacy)
        sample = inputs.get()
        if sample is None:
            return  # the parent gave up on the fast start
        connection.send(verdict(reference, tokenizer_dir, sample, requested, legacy,
                                {"tiktoken": tiktoken_of_parent}))
    except Exception as exc:  # the parent turns this into the step's error
        connection.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        connection.close()


class BackgroundCheck:
    """``verdict`` computed in a forked child; ``result()`` waits for it (once).

    The child is forked first thing, before the parent has read a document or built its
    encoder, and builds Megatron's tokenizer at once: on 2 cores the check then runs
    mostly while the parent's start-up is serial, not against the encoding threads
    (measured before: 0.35 CPU-s of the check, all of it beside the encoding). The parent
    then sends, in this order, the sample (:meth:`send_sample`) and the tiktoken spec it
    encodes with (:meth:`send_spec`); the child checks an encoder built from that spec.
    """

    def __init__(self, tokenizer_dir: Path, requested: str, legacy: bool):
        # Import megatron (~18 s) before forking, so that parent and child import it once;
        # and transformers, which Megatron's HF tokenizer library imports: in the child it
        # took most of the check's CPU time, away from the encoding threads.
        import megatron.core.datasets.indexed_dataset  # noqa: F401
        import megatron.core.tokenizers  # noqa: F401
        import megatron.core.tokenizers.text.libraries.huggingface_tokenizer  # noqa: F401

        # fork, not spawn: the child must not pay megatron's ~18 s import again. Forking is
        # safe here: the parent has started no thread of its own yet (encoding threads, the
        # queue's feeder, pyarrow's pools all start after), and the child uses none of them.
        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        # A queue, not a pipe: its feeder thread writes, so the parent never blocks on a
        # child still building its tokenizer. Nothing is left to flush at exit: a child
        # that died must not hold the parent's exit on a full pipe.
        self._inputs = context.Queue()
        self._inputs.cancel_join_thread()
        self._process = context.Process(
            target=_child,
            args=(send, self._inputs, tokenizer_dir, requested, legacy),
            daemon=True,
        )
        self._process.start()
        send.close()
        self._verdict: dict | None = None

    def send_sample(self, sample: list) -> None:
        self._inputs.put(sample)

    def send_spec(self, spec) -> None:
        self._inputs.put(spec)

    def cancel(self) -> None:
        """The fast start is off: stop the child, wherever it is."""
        self._process.terminate()
        self._process.join()
        self._inputs.close()

    def ready(self) -> bool:
        return self._verdict is not None or self._receive.poll()

    def result(self) -> dict:
        if self._verdict is None:
            try:
                self._verdict = self._receive.recv()
            except EOFError:
                self._verdict = {"error": f"the check process died (exit {self._process.exitcode})"}
            self._process.join()
            self._inputs.close()
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
