"""The service loop's baseline: the same job in one process, no services. The trainer's own backend (same model,
same batch, same loss and optimizer) trains on samples from `transformers` `generate` with that backend's model,
scored by the same verifier. Used by bench/loop_vs_inprocess.py, and to choose the demo's settings quickly
(bench/demo_sweep.py); it is not how Physarum runs.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.samples import Sample, Status  # noqa: E402
from services.reward.verifiers import exact_match  # noqa: E402


class InProcessLoop:
    """One job (a JobSpec dict) trained in this process: `rollout` -> `backend.train_rollout`, as the driver does."""

    def __init__(self, spec: dict, *, num_threads: int = 2) -> None:
        import torch
        from tokenizers import Tokenizer

        from services.trainer.api.spec import parse_spec
        from services.trainer.distributed.parallel import World
        from services.trainer.driver.loop import make_backend

        torch.set_num_threads(num_threads)
        self.spec = parse_spec(spec)
        self.backend = make_backend(self.spec, World(), num_threads)
        self.model = self.backend.model
        self.tokenizer = Tokenizer.from_file(str(Path(self.spec.hf_checkpoint) / "tokenizer.json"))
        self.eos_id = self.model.config.eos_token_id
        self.rows = [json.loads(line) for line in Path(self.spec.prompt_data).read_text().splitlines()]
        self.order: list[int] = []
        self.rng = random.Random(self.spec.rollout_seed)
        # the baseline scores in-process like the demo job; an SFT job is not scored
        if self.spec.loss_type != "sft_loss" and self.spec.rm_type != "exact_match":
            raise ValueError(f"in-process loop: rm_type exact_match only, got {self.spec.rm_type!r}")
        self.score = exact_match

    def next_prompts(self) -> list[dict]:
        """rollout_batch_size rows, epoch by epoch, shuffled as rollout_shuffle asks."""
        out = []
        for _ in range(self.spec.rollout_batch_size):
            if not self.order:
                self.order = list(range(len(self.rows)))
                if self.spec.rollout_shuffle:
                    self.rng.shuffle(self.order)
            out.append(self.rows[self.order.pop()])
        return out

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def generate(self, prompts: list[list[int]], *, greedy: bool) -> list[tuple[list[int], list[float]]]:
        """(response ids up to and including EOS, their log-probs) per prompt; prompts of one length per call."""
        import torch

        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(prompts):
            by_length.setdefault(len(ids), []).append(i)
        out: list[tuple[list[int], list[float]]] = [([], [])] * len(prompts)
        self.model.eval()
        with torch.inference_mode():
            for indices in by_length.values():
                input_ids = torch.tensor([prompts[i] for i in indices])
                result = self.model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), do_sample=not greedy,
                    temperature=None if greedy else self.spec.rollout_temperature, top_k=0 if not greedy else None,
                    top_p=None, max_new_tokens=self.spec.rollout_max_response_len, return_dict_in_generate=True,
                    output_logits=True, pad_token_id=self.eos_id, eos_token_id=self.eos_id)
                tokens = result.sequences[:, input_ids.shape[1]:]
                logprobs = torch.log_softmax(torch.stack(result.logits, 1).float(), -1).gather(
                    -1, tokens.unsqueeze(-1)).squeeze(-1)
                for row, i in enumerate(indices):
                    ids = tokens[row].tolist()
                    length = ids.index(self.eos_id) + 1 if self.eos_id in ids else len(ids)
                    out[i] = (ids[:length], logprobs[row, :length].tolist())
        self.model.train()
        return out

    def rollout(self) -> list[Sample]:
        """One rollout's samples: for sft_loss prompt + label + EOS, else n_samples_per_prompt generated answers."""
        rows = self.next_prompts()
        samples = []
        if self.spec.loss_type == "sft_loss":
            for row in rows:
                prompt, response = self.encode(row["input"]), self.encode(row["label"]) + [self.eos_id]
                samples.append(Sample(tokens=prompt + response, response_length=len(response), label=row["label"],
                                      loss_mask=[1] * len(response), rollout_log_probs=[0.0] * len(response),
                                      status=Status.COMPLETED))
            return samples
        n = self.spec.n_samples_per_prompt
        prompts = [self.encode(row["input"]) for row in rows for _ in range(n)]
        for j, (prompt, (response, logprobs)) in enumerate(zip(prompts, self.generate(prompts, greedy=False),
                                                                strict=True)):
            label = rows[j // n]["label"]
            text = self.tokenizer.decode([t for t in response if t != self.eos_id])
            finished = bool(response) and response[-1] == self.eos_id
            samples.append(Sample(tokens=prompt + response, response_length=len(response), response=text, label=label,
                                  reward=self.score(text, label), loss_mask=[1] * len(response),
                                  rollout_log_probs=logprobs, group_index=j // n, index=j,
                                  status=Status.COMPLETED if finished else Status.TRUNCATED))
        return samples

    def step(self) -> list[Sample]:
        samples = self.rollout()
        self.backend.train_rollout(samples)
        return samples

    def evaluate(self, rows: list[dict]) -> float:
        """Held-out mean reward of greedy answers, as the demo measures it."""
        answers = self.generate([self.encode(row["input"]) for row in rows], greedy=True)
        texts = [self.tokenizer.decode([t for t in ids if t != self.eos_id]) for ids, _ in answers]
        return sum(self.score(text, row["label"]) for text, row in zip(texts, rows, strict=True)) / len(rows)
