"""Train a ByteLevel BPE on the JSONL shards, or adopt a given tokenizer.

    python -m jobscripts.train_tokenizer --output-dir TOK
        (--input OUT/jsonl --vocab-size 32768 [--min-frequency 2] [--max-train-chars N]
         | --from-dir DIR | --from-hub NAME [--hub-revision REV])
        [--no-verify] [--result PATH]

The trained tokenizer is GPT-2 style (ByteLevel pre-tokenizer with the GPT-2
regex, no prefix space), with ``<|endoftext|>`` as id 0 serving as BOS, EOS and
EOD, and ``<|pad|>`` as id 1: a pad distinct from EOD, because Megatron's
GPTDataset masks the loss on pad tokens and would otherwise never train EOD.
The directory holds ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json`` and Megatron's ``tokenizer_metadata.json``, so that
``AutoTokenizer.from_pretrained`` and megatron-core's ``MegatronTokenizer`` /
``HuggingFaceTokenizer`` both load it. Verification loads it through Megatron
exactly as ``preprocess_data`` does and round-trips sample texts.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

from jobscripts.common import StepError, entry_point, log
from jobscripts.megatron_tokenizer import sha256_file
from jobscripts.results import write_json_atomic

EOT, PAD = "<|endoftext|>", "<|pad|>"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer_metadata.json",
    "vocab.json",
    "merges.txt",
)
PROBE = "Hello world! Ünïcödé, 日本語, emoji 🎉, tabs\tand\nnewlines  <|endoftext|> 12345."


def jsonl_texts(paths: list[Path], text_key: str, max_chars: int) -> Iterator[str]:
    """Texts in file order, stopping after ``max_chars`` characters (0: all)."""
    total = 0
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                text = json.loads(line).get(text_key)
                if not isinstance(text, str) or not text:
                    continue
                yield text
                total += len(text)
                if max_chars and total >= max_chars:
                    return


def train(args: argparse.Namespace, out: Path) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    source = Path(args.input)
    paths = sorted(source.glob("*.jsonl")) if source.is_dir() else [source]
    if not paths:
        raise StepError(f"no *.jsonl file in {source}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        special_tokens=[EOT, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    counted = {"docs": 0, "chars": 0}

    def texts():
        for text in jsonl_texts(paths, args.text_key, args.max_train_chars):
            counted["docs"] += 1
            counted["chars"] += len(text)
            if counted["docs"] % 10_000 == 0:
                log(f"training on document {counted['docs']} ({counted['chars']} chars)")
            yield text

    tokenizer.train_from_iterator(texts(), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    write_json_atomic(out / "tokenizer_config.json", config)
    write_json_atomic(
        out / "special_tokens_map.json", {"bos_token": EOT, "eos_token": EOT, "pad_token": PAD}
    )
    log(f"trained on {counted['docs']} documents: vocabulary {tokenizer.get_vocab_size()}")
    return {"trained_on_docs": counted["docs"], "trained_on_chars": counted["chars"]}


def adopt(args: argparse.Namespace, out: Path) -> dict:
    """Copy a given tokenizer's files into ``out``, from a directory or the hub."""
    if args.from_hub:
        from huggingface_hub import snapshot_download

        from jobscripts.hf_fetch import check_online

        check_online()
        source = Path(
            snapshot_download(
                repo_id=args.from_hub,
                revision=args.hub_revision,
                allow_patterns=list(TOKENIZER_FILES),
            )
        )
    else:
        source = Path(args.from_dir)
    if not (source / "tokenizer.json").is_file():
        raise StepError(f"{source}: no tokenizer.json (only HF fast tokenizers are supported)")
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and (source / name).resolve() != (out / name).resolve():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    return {"given": str(args.from_hub or args.from_dir), "copied": copied}


def verify(path: Path) -> dict:
    """Load as preprocess_data and AutoTokenizer do; EOD must exist; text must round-trip."""
    from transformers import AutoTokenizer

    from jobscripts.megatron_tokenizer import load

    auto = AutoTokenizer.from_pretrained(str(path))
    megatron = load(path)
    if megatron.eod is None:
        raise StepError(f"{path}: no eos_token in tokenizer_config.json, so Megatron has no EOD")
    ids = megatron.tokenize(PROBE)
    if auto.decode(ids) != PROBE:
        raise StepError(f"{path}: {PROBE!r} does not survive encode/decode: {auto.decode(ids)!r}")
    if auto.encode(PROBE, add_special_tokens=False) != ids:
        raise StepError(f"{path}: AutoTokenizer and Megatron's tokenizer disagree on {PROBE!r}")
    return {
        "eod_id": megatron.eod,
        "bos_id": megatron.bos,
        "pad_id": megatron.pad,
        "vocab_size": megatron.vocab_size,
    }


def run(args: argparse.Namespace) -> dict:
    out = Path(args.output_dir)
    if bool(args.input) + bool(args.from_dir) + bool(args.from_hub) != 1:
        raise StepError("give exactly one of --input (train), --from-dir or --from-hub")
    details = train(args, out) if args.input else adopt(args, out)
    if not (out / "tokenizer_metadata.json").exists():
        # Lets MegatronTokenizer.from_pretrained(path) work without a metadata argument.
        write_json_atomic(
            out / "tokenizer_metadata.json",
            {
                "library": "huggingface",
                "class_name": None,
                "class_path": None,
                "model_type": "default",
                "chat_template": None,
            },
        )
    from jobscripts.fast_encoder import Unsupported, tiktoken_spec

    try:
        tiktoken_spec(out / "tokenizer.json")
        fast = "tiktoken"
    except Unsupported as exc:
        fast = f"hf (tiktoken cannot express it: {exc})"
    payload = {
        "tokenizer_dir": str(out),
        "tokenizer_sha256": sha256_file(out / "tokenizer.json"),
        "source": "trained" if args.input else "given",
        "fast_encoder": fast,
        **details,
    }
    if args.verify:
        payload.update(verify(out))
        log(f"verified: vocab {payload['vocab_size']}, eod {payload['eod_id']}")
    return payload


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobscripts.train_tokenizer", description=__doc__)
    p.add_argument("--output-dir", required=True, help="the tokenizer directory to write")
    p.add_argument("--input", help="JSONL directory or file to train on")
    p.add_argument("--from-dir", help="use this tokenizer directory (with tokenizer.json)")
    p.add_argument("--from-hub", help="download this Hugging Face tokenizer (needs network)")
    p.add_argument("--hub-revision")
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--max-train-chars", type=int, default=0, help="train on a prefix (0: all)")
    p.add_argument("--text-key", default="text")
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip loading through Megatron/transformers (saves ~20 s of imports)",
    )
    return p


main = entry_point("train_tokenizer", parser, run, "train_tokenizer.json")


if __name__ == "__main__":
    raise SystemExit(main())
