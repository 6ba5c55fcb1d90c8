"""Reference evaluation backend: a Hugging Face model directory run by transformers on CPU.

It answers the same two questions as the vLLM backend (jobscripts/eval_vllm.py), with the
same inputs (token ids, never text, so tokenization and windows are decided once in
jobscripts/eval_metrics.py): the log-probabilities of window tokens, and sampled
completions. Sampling mirrors vLLM's defaults (no top-k, top-p 1) so the temperatures mean
the same on both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TransformersBackend:
    name = "transformers"

    def __init__(self, model_dir: str, batch_size: int = 8, num_threads: int | None = None):
        from transformers import AutoModelForCausalLM

        if num_threads:
            torch.set_num_threads(num_threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.model.eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def window_logprobs(self, windows: list[list[int]]) -> list[list[float]]:
        """Per window, log p(token_i | tokens_<i) for i >= 1, in float32.

        Windows of a batch are right-padded: a causal model's outputs at real positions do
        not depend on padding that comes after them, and padded positions are dropped.
        """
        results: list[list[float]] = []
        for start in range(0, len(windows), self.batch_size):
            batch = windows[start:start + self.batch_size]
            width = max(len(w) for w in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, window in enumerate(batch):
                ids[row, :len(window)] = torch.tensor(window)
                mask[row, :len(window)] = 1
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
            logprobs = F.log_softmax(logits[:, :-1], dim=-1)
            picked = logprobs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            for row, window in enumerate(batch):
                results.append(picked[row, :len(window) - 1].tolist())
        return results

    @torch.no_grad()
    def complete(self, prompts: list[list[int]], temperature: float, max_new_tokens: int,
                 seed: int, eos_id: int | None) -> list[list[int]]:
        """Generated token ids per prompt (prompt excluded); stops at ``eos_id``."""
        outputs = []
        for prompt in prompts:
            torch.manual_seed(seed)  # each prompt's sample is reproducible on its own
            kwargs = {"do_sample": False} if temperature == 0 else {
                "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            generated = self.model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)),
                                                                  dtype=torch.long),
                max_new_tokens=max_new_tokens, eos_token_id=eos_id, pad_token_id=eos_id,
                **kwargs)
            outputs.append(generated[0, len(prompt):].tolist())
        return outputs
