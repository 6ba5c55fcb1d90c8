"""A campaign's plan in numbers, as markdown for the DAG's ``doc_md``.

The figures a reviewer checks before spending GPU hours: tokens planned, parameters,
epochs over the dataset, tokens per parameter against Chinchilla's ~20 (Hoffmann et al.
2022: compute-optimal training sees about 20 tokens per parameter), and the checkpoint
interval against Young/Daly's optimum (render/plan.py ``checkpoint_interval``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from operators.campaign.render.plan import checkpoint_interval
from operators.campaign.schema.rules import KNOWN_RECIPES

if TYPE_CHECKING:
    from operators.campaign.schema.config import Campaign

CHINCHILLA_TOKENS_PER_PARAM = 20.0


def reference_params(ref, vocab_size: int | None) -> tuple[int, bool]:
    """Parameters of the reference Llama (untied embeddings, as jobscripts/trainer_state.py
    builds it); (count, whether the embeddings are included: they need the vocab size)."""
    h = ref.hidden_size
    kv_dim = h // ref.num_attention_heads * ref.num_key_value_heads  # grouped-query K and V
    per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * ref.ffn_hidden_size + 2 * h  # + 2 norms
    count = ref.num_layers * per_layer + h  # + the final norm
    if vocab_size is None:
        return count, False
    return count + 2 * vocab_size * h, True


def model_params(campaign: Campaign) -> tuple[float | None, str]:
    """(parameter count or None, how it was obtained)."""
    model = campaign.model
    if model.reference is not None:
        train = campaign.data.tokenizer.train
        count, full = reference_params(model.reference, train.vocab_size if train else None)
        return float(count), ("computed" if full else "computed, without embeddings "
                                                        "(vocab size unknown)")
    known = KNOWN_RECIPES.get(model.recipe)
    return (known.params, "published size") if known else (None, "unknown recipe size")


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g}"


def summary(campaign: Campaign, dataset_tokens: int | None = None, history=()) -> str:
    """``history``: the segment records so far (segment.json payloads), from which the
    checkpoint interval takes the measured save and step times and the failures seen."""
    c, t, k, s = campaign.cluster, campaign.training, campaign.checkpoint, campaign.segments
    interval = checkpoint_interval(campaign, history)
    tokens = t.train_iters * t.global_batch_size * t.seq_length
    params, how = model_params(campaign)
    dp = campaign.data_parallel_size
    accumulation = t.global_batch_size // (t.micro_batch_size * dp)
    model = (f"recipe `{campaign.model.recipe}` (`{campaign.model.recipe_function}`)"
             if campaign.model.recipe else "reference Llama (CPU)")
    hardware = (f"{c.nodes} node(s) x {c.gpus_per_node} GPU(s)" if c.gpus_per_node
                else f"{c.nodes} node(s), CPU")
    precision = t.precision if campaign.model.recipe else "fp32 (CPU)"
    runtime = f"container `{c.container.image}`" if c.container else "host environment"
    rows = [
        ("Model", f"{model}, {_human(params) if params else '?'} parameters ({how})"),
        ("Cluster", f"{hardware}, partition {c.partition or 'default'}, "
                    f"{c.time_limit_minutes} min per segment, {runtime}"),
        ("Parallelism", f"TP {t.tensor_parallel_size} x PP {t.pipeline_parallel_size} x CP "
                        f"{t.context_parallel_size}, data-parallel {dp}"),
        ("Batch", f"global {t.global_batch_size} = micro {t.micro_batch_size} x DP {dp} x "
                  f"{accumulation} accumulation step(s); sequence {t.seq_length}"),
        ("Tokens planned", f"{t.train_iters:,} iters x {t.global_batch_size} x {t.seq_length} "
                           f"= {_human(tokens)}"),
    ]
    if dataset_tokens:
        rows.append(("Epochs", f"{tokens / dataset_tokens:.2f} over {_human(dataset_tokens)} "
                               "dataset tokens"))
    else:
        rows.append(("Epochs", "unknown until the data stage reports the dataset's tokens"))
    if params:
        ratio, chinchilla = tokens / params, CHINCHILLA_TOKENS_PER_PARAM
        rows.append(("Tokens per parameter",
                     f"{ratio:.3g} (Chinchilla ~{chinchilla:.0f}: {ratio / chinchilla:.0%})"))
    rows += [
        ("Learning rate", f"{t.lr:g} -> {t.min_lr:g}, {t.lr_decay_style}, warmup "
                          f"{t.lr_warmup_iters}; precision {precision}"),
        ("Checkpoints", f"every {interval.iterations} iters"
                        + (" (auto)" if interval.auto else "") + f", keep last {k.keep_last}"
                        + (f" and every {k.keep_every}" if k.keep_every else "")),
        ("Checkpoint interval", interval.describe()),
        ("Segments", f"up to {s.max_per_run} per DAG run"
                     + (f", {s.iters_per_segment} iters each at most" if s.iters_per_segment
                        else "")),
        ("Pre-queued", f"{s.prequeue_depth} segment job(s) ahead, afterok (docs/prequeue.md)"
                       if s.prequeue_depth else "none: each segment submitted after the last"),
    ]
    body = "\n".join(f"| {name} | {value} |" for name, value in rows)
    head = f"### Campaign `{campaign.name}`\n\n"
    if campaign.description:
        head += campaign.description.strip() + "\n\n"
    return head + "| | |\n|---|---|\n" + body + "\n"
