"""dpfast.integrations.transformers.DataParallelTrainer against the plain single-device transformers.Trainer: after
3 steps the parameters are equal, whether Trainer sees one device (the CPU rehearsal) or believes it has 4 GPUs
(``TrainingArguments.n_gpu`` patched to 4: its DataParallel arithmetic then runs), for GPT-2 (whose loss uses
``num_items_in_batch``; padded labels, so replicas hold different token counts) and BERT (whose loss ignores it).
Eval and predict, with and without labels, equal the plain Trainer's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from dpfast.integrations.transformers import DataParallelTrainer  # noqa: E402

from dp_testing import DT  # noqa: E402

V = 40
B, T = 8, 6

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]
transformers.logging.set_verbosity_error()


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).to(DT)


def bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(cfg).to(DT)


def dataset(kind, n=3 * B, labels=True):
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(1, V, (T,), generator=g)
        keep = T - (i * 5 % 4)  # right padding of 0-3 tokens, so token counts differ between replicas
        mask = (torch.arange(T) < keep).long()
        row = {"input_ids": ids * mask, "attention_mask": mask}
        if labels:
            row["labels"] = torch.where(mask.bool(), ids, -100) if kind == "gpt2" else torch.tensor(i % 3)
        rows.append(row)
    return rows


def _args(tmp_path, batch, **kw):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=batch, per_device_eval_batch_size=batch, max_steps=3,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", seed=0, dataloader_num_workers=0, **kw,
    )  # fmt: skip


MODELS = {"gpt2": gpt2, "bert": bert}


def _pretend_gpus(monkeypatch, n_gpu):
    """n_gpu 1: the rehearsal (Trainer sees the CPU; one batch of B is split over the replicas). n_gpu 4: Trainer
    believes it has 4 GPUs, so it loads 4 x per_device batches and runs its DataParallel loss arithmetic."""
    if n_gpu > 1:
        monkeypatch.setattr(transformers.TrainingArguments, "n_gpu", property(lambda self: n_gpu))


def _same_parameters(model, reference):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, msg=lambda msg, name=name: f"{name}: {msg}")


@pytest.mark.parametrize("n_gpu", [1, 4], ids=["rehearsal", "n_gpu=4"])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_training_equals_the_plain_trainer(kind, n_gpu, tmp_path, monkeypatch):
    plain = transformers.Trainer(model=MODELS[kind](), args=_args(tmp_path / "plain", B), train_dataset=dataset(kind))
    plain.train()
    _pretend_gpus(monkeypatch, n_gpu)
    args = _args(tmp_path / "dp", B // n_gpu)
    trainer = DataParallelTrainer(model=MODELS[kind](), args=args, train_dataset=dataset(kind), device_ids=["cpu"] * 4)
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch.nn.DataParallel) and trainer.model_wrapped.module is trainer.model
    _same_parameters(trainer.model, plain.model)


def test_gradient_accumulation_equals_the_plain_trainer(tmp_path):
    kw = {"gradient_accumulation_steps": 2}
    plain = transformers.Trainer(model=gpt2(), args=_args(tmp_path / "p", B // 2, **kw), train_dataset=dataset("gpt2"))
    plain.train()
    args = _args(tmp_path / "dp", B // 2, **kw)
    trainer = DataParallelTrainer(model=gpt2(), args=args, train_dataset=dataset("gpt2"), device_ids=["cpu"] * 3)
    trainer.train()
    _same_parameters(trainer.model, plain.model)


def test_gradient_accumulation_on_a_model_ignoring_num_items_equals_the_whole_batch(tmp_path):
    """BERT accepts ``**kwargs`` but ignores ``num_items_in_batch``: the plain Trainer then skips its division by the
    accumulation steps (huggingface/transformers#47688), so its gradient grows with them. Here the accumulated
    steps add up to the whole batch's mean: training equals the plain Trainer without accumulation."""
    plain = transformers.Trainer(model=bert(), args=_args(tmp_path / "p", B), train_dataset=dataset("bert"))
    plain.train()
    args = _args(tmp_path / "dp", B // 2, gradient_accumulation_steps=2)
    trainer = DataParallelTrainer(model=bert(), args=args, train_dataset=dataset("bert"), device_ids=["cpu"] * 3)
    trainer.train()
    _same_parameters(trainer.model, plain.model)


@pytest.mark.parametrize("n_gpu", [1, 4], ids=["rehearsal", "n_gpu=4"])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_evaluate_and_predict_with_and_without_labels(kind, n_gpu, tmp_path, monkeypatch):
    model = MODELS[kind]()
    plain = transformers.Trainer(model=model, args=_args(tmp_path / "plain", B))
    ref_metrics = plain.evaluate(dataset(kind, n=2 * B))
    ref_pred = plain.predict(dataset(kind, n=2 * B, labels=False))
    _pretend_gpus(monkeypatch, n_gpu)
    trainer = DataParallelTrainer(model=model, args=_args(tmp_path / "dp", B // n_gpu), device_ids=["cpu"] * 4)
    metrics = trainer.evaluate(dataset(kind, n=2 * B))
    pred = trainer.predict(dataset(kind, n=2 * B, labels=False))
    assert metrics["eval_loss"] == pytest.approx(ref_metrics["eval_loss"], rel=1e-10)
    assert pred.label_ids is None and pred.predictions.shape == ref_pred.predictions.shape
    torch.testing.assert_close(torch.as_tensor(pred.predictions), torch.as_tensor(ref_pred.predictions))


def test_import_dpfast_does_not_import_transformers():
    code = (
        "import sys, dpfast, dpfast.integrations; dpfast.DataParallel; "
        "bad = [m for m in ('transformers', 'accelerate', 'torchvision') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
