"""End to end: on-policy distillation through the REST API. A tiny random student learns from a teacher (the same
tiny model after a few SFT steps on the addition task): from a teacher engine the rollout service asks (opd_type
sglang) and from a teacher model in the trainer (opd_type megatron, on the fsdp backend). The reward is 0
(opd_only), so the teacher's log-probs are the only signal, and the student's reverse KL to the teacher falls."""

from __future__ import annotations

import json

import pytest
import torch

from testkit.engines import start_engines, stop_engines
from tests.e2e.test_loop import job_spec, run

SFT_STEPS = 40


def answer_batch(model_dir, train_path):
    """The first 32 task rows as one right-padded batch: (input ids [32, L], labels [32, L], -100 off the answers)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in train_path.read_text().splitlines()[:32]]
    pairs = [(tokenizer(r["input"])["input_ids"], tokenizer(r["label"])["input_ids"] + [tokenizer.eos_token_id])
             for r in rows]
    width = max(len(p) + len(a) for p, a in pairs)
    pad = [tokenizer.eos_token_id]
    ids = torch.tensor([p + a + pad * (width - len(p) - len(a)) for p, a in pairs])
    labels = torch.tensor([[-100] * len(p) + a + [-100] * (width - len(p) - len(a)) for p, a in pairs])
    return ids, labels


def causal_lm(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reverse_kl(student_dir, teacher_dir, train_path) -> float:
    """Exact KL(student || teacher) of the next-token distributions at every answer position of the task rows
    (the answers teacher-forced), averaged: what on-policy distillation minimizes, without sampling noise."""
    ids, labels = answer_batch(student_dir, train_path)
    student = torch.log_softmax(causal_lm(student_dir)(input_ids=ids).logits, -1)
    teacher = torch.log_softmax(causal_lm(teacher_dir)(input_ids=ids).logits, -1)
    per_position = (student.exp() * (student - teacher)).sum(-1)
    predicts_answer = (labels != -100).roll(-1, dims=1).float()  # position t predicts token t + 1
    return float((per_position * predicts_answer).sum() / predicts_answer.sum())


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, addition_task, tmp_path_factory):
    """The tiny model after SFT_STEPS of NLL on `a+b=` -> the sum and eos (32 fixed rows, AdamW lr 3e-3)."""
    from transformers import AutoTokenizer

    train_path, _ = addition_task
    model = causal_lm(tiny_model_dir).train()
    ids, labels = answer_batch(tiny_model_dir, train_path)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a tiny model on a busy machine: more threads only contend
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(SFT_STEPS):  # one padded batch (right padding never reaches a real token under causal attention)
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def teacher_engine(teacher_dir, tmp_path_factory):
    engines = start_engines(teacher_dir, tmp_path_factory.mktemp("teacher-engine"), 1)
    yield engines[0][1]
    stop_engines(engines)


def distill(local_stack, tiny_model_dir, teacher_dir, train_path, tmp_path, job_id: str, **teacher):
    """A 3-rollout distillation job; asserts the student's exact reverse KL to the teacher fell."""
    # 4 optimizer steps per rollout on whitened advantages (the reverse KL's spread, not its level, ranks tokens)
    spec = job_spec(tiny_model_dir, train_path, job_id=job_id, num_rollout=3, global_batch_size=4,
                    rollout_max_response_len=4, lr=2e-3, normalize_advantages=True, use_opd=True, opd_kl_coef=1.0,
                    opd_only=True, save_hf=str(tmp_path / "student"), **teacher)
    job, events = run(local_stack, spec)
    assert job["state"] == "SUCCEEDED", job["error"]
    steps = [e["metrics"] for e in events if "train/opd_reverse_kl" in e["metrics"]]
    assert len(steps) == 3 and steps[0]["train/opd_reverse_kl"] > 1.0  # a random student, far from the teacher
    assert all(m["rollout/reward_mean"] == 0.0 for m in steps)  # opd_only: the teacher is the only signal
    before = reverse_kl(tiny_model_dir, teacher_dir, train_path)
    after = reverse_kl(tmp_path / "student", teacher_dir, train_path)
    print(f"{job_id}: KL(student || teacher) {before:.3f} -> {after:.3f}")
    assert after < before - 0.02, (before, after)  # measured: 5.69 -> 5.56..5.62


def test_distillation_from_a_teacher_engine(local_stack, tiny_model_dir, addition_task, teacher_dir, teacher_engine,
                                            tmp_path):
    distill(local_stack, tiny_model_dir, teacher_dir, addition_task[0], tmp_path, "e2e-opd-sglang",
            opd_type="sglang", opd_teacher_url=f"{teacher_engine}/generate")


def test_distillation_from_a_teacher_model_in_the_trainer(local_stack, tiny_model_dir, addition_task, teacher_dir,
                                                          tmp_path):
    distill(local_stack, tiny_model_dir, teacher_dir, addition_task[0], tmp_path, "e2e-opd-megatron",
            opd_type="megatron", opd_teacher_load=str(teacher_dir))
