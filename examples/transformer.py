"""Seed 004: a Transformer whose ``(T, T)`` target mask gets chopped per GPU, unchanged, under dpfast.

The seed (a user's Q&A thread, not in this repository) trains this model under ``torch.nn.DataParallel`` on 6 GPUs::

    pred = model(X, y_input, tgt_mask=tgt_mask, src_pad_mask=src_pad_mask, tgt_pad_mask=tgt_pad_mask)
    RuntimeError: The shape of the 2D attn_mask is torch.Size([538, 3225]), but should be (3225, 3225).

torch splits every tensor on ``dim=0``, including the causal mask ``(T, T)``, which has no batch axis at all: each
replica gets 538 of its 3225 rows. The answer in the thread: repeat the mask to ``(N, T, T)`` by hand and reshape it
back inside the model.

With dpfast the model stays as it is; the wrapper says which argument is shared and where the output's batch is::

    dpfast.DataParallel(model, in_dims={"tgt_mask": None}, out_dims=1)

``in_dims={"tgt_mask": None}``: every replica gets the whole mask (the name is ``forward``'s parameter name, so it
works whether the mask is passed by keyword, as in the seed, or by position). ``out_dims=1``: the model returns
``(T, B, tgt_tokens)`` (sequence first, as ``nn.Transformer`` without ``batch_first``), so the outputs are
concatenated on axis 1. Without it the replicas' ``(T, B_i, V)`` outputs would be glued along ``T``.

Run: ``python examples/transformer.py`` (``--help`` for options). Without a GPU it rehearses a 4-GPU run on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import dpfast

try:
    from ._common import Report, add_example_args, home_device, pick_devices, sgd_step, show_scatter_error, title
except ImportError:  # run as a script: python examples/transformer.py
    from _common import Report, add_example_args, home_device, pick_devices, sgd_step, show_scatter_error, title  # type: ignore[import-not-found,no-redef]

# The one-line fix: the (T, T) mask is shared by every replica; the output is (T, B, V).
IN_DIMS = {"tgt_mask": None}
OUT_DIMS = 1
SEED_ERROR = "RuntimeError: The shape of the 2D attn_mask is torch.Size([538, 3225]), but should be (3225, 3225)."
PAD = 1  # the seed's pad token: create_pad_mask(X, 1)


# ---- the seed's model --------------------------------------------------------------------------------------------


class PositionalEncoding(nn.Module):
    """Sinusoidal positional encoding of the guide the seed's model comes from (D. Melchor, "A detailed guide to
    Pytorch's nn.Transformer() module"), for the ``(batch, sequence, dim_model)`` embeddings the model passes in.

    The guide's version slices its ``(max_len, 1, dim_model)`` table with ``token_embedding.size(0)``: on these
    batch-first embeddings that is the *batch* size, so sample ``i`` gets position ``i``'s encoding for every token.
    That makes each sample's output depend on where it sits in the batch, which no data parallelism (torch's or
    dpfast's) can reproduce: each replica would number its chunk from 0. Here the table is indexed by sequence
    position, as the guide intends; ``batch_index_bug=True`` restores the guide's behaviour (see the tests).
    """

    pos_encoding: Tensor  # a buffer, (max_len, 1, dim_model)

    def __init__(self, dim_model: int, dropout_p: float, max_len: int, batch_index_bug: bool = False) -> None:
        super().__init__()
        # Modified version from: https://pytorch.org/tutorials/beginner/transformer_tutorial.html
        # max_len determines how far the position can have an effect on a token (window)
        self.batch_index_bug = batch_index_bug

        # Info
        self.dropout = nn.Dropout(dropout_p)

        # Encoding - From formula
        pos_encoding = torch.zeros(max_len, dim_model)
        positions_list = torch.arange(0, max_len, dtype=torch.float).view(-1, 1)  # 0, 1, 2, 3, 4, 5
        division_term = torch.exp(
            torch.arange(0, dim_model, 2).float() * (-math.log(10000.0)) / dim_model
        )  # 1000^(2i/dim_model)

        # PE(pos, 2i) = sin(pos/1000^(2i/dim_model))
        pos_encoding[:, 0::2] = torch.sin(positions_list * division_term)

        # PE(pos, 2i + 1) = cos(pos/1000^(2i/dim_model))
        pos_encoding[:, 1::2] = torch.cos(positions_list * division_term)

        # Saving buffer (same as parameter without gradients needed)
        pos_encoding = pos_encoding.unsqueeze(0).transpose(0, 1)  # (max_len, 1, dim_model)
        self.register_buffer("pos_encoding", pos_encoding)

    def forward(self, token_embedding: Tensor) -> Tensor:
        # Residual connection + pos encoding
        if self.batch_index_bug:  # the guide's line: size(0) is the batch size here
            out: Tensor = self.dropout(token_embedding + self.pos_encoding[: token_embedding.size(0), :])
            return out
        # (batch, seq, dim) + (1, seq, dim)
        out = self.dropout(token_embedding + self.pos_encoding[: token_embedding.size(1)].transpose(0, 1))
        return out


class Transformer(nn.Module):
    """
    Model from "A detailed guide to Pytorch's nn.Transformer() module.", by
    Daniel Melchor: https://medium.com/@danielmelchor/a-detailed-guide-to-pytorchs-nn-transformer-module-c80afbc9ffb1
    """

    # Constructor
    def __init__(
        self,
        src_tokens: int,
        tgt_tokens: int,
        dim_model: int,
        num_heads: int,
        num_encoder_layers: int,
        num_decoder_layers: int,
        dropout_p: float,
    ) -> None:
        super().__init__()

        # INFO
        self.model_type = "Transformer"
        self.dim_model = dim_model

        # LAYERS
        self.positional_encoder = PositionalEncoding(dim_model=dim_model, dropout_p=dropout_p, max_len=5000)
        self.src_embedding = nn.Embedding(src_tokens, dim_model)
        self.tgt_embedding = nn.Embedding(tgt_tokens, dim_model)
        self.transformer = nn.Transformer(
            d_model=dim_model,
            nhead=num_heads,
            num_encoder_layers=num_encoder_layers,
            num_decoder_layers=num_decoder_layers,
            dropout=dropout_p,
        )
        self.out = nn.Linear(dim_model, tgt_tokens)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        tgt_mask: Tensor | None = None,
        src_pad_mask: Tensor | None = None,
        tgt_pad_mask: Tensor | None = None,
    ) -> Tensor:
        # Src size must be (batch_size, src sequence length)
        # Tgt size must be (batch_size, tgt sequence length)

        # Embedding + positional encoding - Out size = (batch_size, sequence length, dim_model)

        src = self.src_embedding(src) * math.sqrt(self.dim_model)
        tgt = self.tgt_embedding(tgt) * math.sqrt(self.dim_model)
        src = self.positional_encoder(src)
        tgt = self.positional_encoder(tgt)

        # We could use the parameter batch_first=True, but our KDL version doesn't support it yet, so we permute
        # to obtain size (sequence length, batch_size, dim_model),
        src = src.permute(1, 0, 2)
        tgt = tgt.permute(1, 0, 2)
        # (the seed printed the three mask shapes here: that is how it saw tgt_mask arrive as (538, 3225))

        # Transformer blocks - Out size = (sequence length, batch_size, num_tokens)
        transformer_out = self.transformer(
            src, tgt, tgt_mask=tgt_mask, src_key_padding_mask=src_pad_mask, tgt_key_padding_mask=tgt_pad_mask
        )
        out: Tensor = self.out(transformer_out)

        return out


def get_tgt_mask(size: int) -> Tensor:
    """The guide's causal mask: 0 on and below the diagonal, -inf above."""
    mask = torch.tril(torch.ones(size, size) == 1)  # Lower triangular matrix
    mask = mask.float()
    mask = mask.masked_fill(mask == 0, float("-inf"))  # Convert zeros to -inf
    mask = mask.masked_fill(mask == 1, 0.0)  # Convert ones to 0
    return mask


def create_pad_mask(matrix: Tensor, pad_token: int) -> Tensor:
    return matrix == pad_token


# ---- synthetic data and training -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    batch: int = 10  # 10 rows over 4 replicas: an uneven 3/3/2/2 split
    src_len: int = 9
    tgt_len: int = 8  # y has tgt_len + 1 tokens: y_input = y[:, :-1], y_expected = y[:, 1:]
    tokens: int = 12  # 0: SOS, 1: PAD (the seed's pad token), 2..: words
    dim_model: int = 32
    num_heads: int = 4
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    dropout_p: float = 0.1
    train_steps: int = 5
    lr: float = 0.05


def build_model(cfg: Config, device: str | torch.device = "cpu") -> Transformer:
    return Transformer(
        src_tokens=cfg.tokens,
        tgt_tokens=cfg.tokens,
        dim_model=cfg.dim_model,
        num_heads=cfg.num_heads,
        num_encoder_layers=cfg.num_encoder_layers,
        num_decoder_layers=cfg.num_decoder_layers,
        dropout_p=cfg.dropout_p,
    ).to(device)


def make_batch(
    cfg: Config, generator: torch.Generator, device: str | torch.device = "cpu", batch: int | None = None
) -> tuple[Tensor, Tensor]:
    """A copy task with padding: X (B, S) random words with a padded tail, y = SOS + the first words of X."""
    b = cfg.batch if batch is None else batch
    X = torch.randint(2, cfg.tokens, (b, cfg.src_len), generator=generator)
    lengths = torch.randint(cfg.src_len // 2, cfg.src_len + 1, (b,), generator=generator)
    X[torch.arange(cfg.src_len)[None, :] >= lengths[:, None]] = PAD
    y = torch.cat([torch.zeros(b, 1, dtype=torch.long), X[:, : cfg.tgt_len]], dim=1)
    return X.to(device), y.to(device)


def model_inputs(X: Tensor, y: Tensor) -> tuple[tuple[Tensor, ...], dict[str, Tensor], Tensor]:
    """The seed's train_loop, up to the model call: positional (X, y_input), keyword masks."""
    y_input = y[:, :-1]
    y_expected = y[:, 1:]
    sequence_length = y_input.size(1)
    src_pad_mask = create_pad_mask(X, PAD)
    tgt_pad_mask = create_pad_mask(y_input, PAD)
    tgt_mask = get_tgt_mask(sequence_length).to(X.device)
    kwargs = dict(tgt_mask=tgt_mask, src_pad_mask=src_pad_mask, tgt_pad_mask=tgt_pad_mask)
    return (X, y_input), kwargs, y_expected


def loss_fn(pred: Tensor, y_expected: Tensor) -> Tensor:
    # Permute pred to have batch size first again: (T, B, V) -> (B, V, T)
    return F.cross_entropy(pred.permute(1, 2, 0), y_expected, ignore_index=PAD)


def train(dp: nn.Module, model: Transformer, cfg: Config, X: Tensor, y: Tensor, report: Report) -> list[float]:
    """``cfg.train_steps`` steps on one batch (so the falling loss is visible), through ``dp``."""
    model.train()
    losses = []
    for step in range(1, cfg.train_steps + 1):
        t0 = time.perf_counter()
        args, kwargs, y_expected = model_inputs(X, y)
        pred = dp(*args, **kwargs)
        loss = loss_fn(pred, y_expected)
        loss.backward()
        sgd_step(model, cfg.lr)
        losses.append(loss.item())
        report.say(f"  step {step}: loss {loss.item():.4f}   ({1e3 * (time.perf_counter() - t0):.0f} ms)")
    return losses


# ---- the check: dpfast == the unwrapped model ----------------------------------------------------------------------


def check_against_plain(
    model: Transformer,
    device_ids: Sequence[int | str],
    X: Tensor,
    y: Tensor,
    report: Report,
    in_dims: dict[str, None] = IN_DIMS,
    out_dims: int = OUT_DIMS,
    call_with_keywords: bool = True,
) -> bool:
    """Run float64 copies of ``model`` (eval mode: dropout off) with and without dpfast on the same batch; the
    output and the gradients of every parameter must be equal. ``call_with_keywords=False`` passes the masks by
    position instead, which ``in_dims`` keyed by name must treat alike."""
    plain = copy.deepcopy(model).double().eval()
    wrapped = copy.deepcopy(model).double().eval()
    dp = dpfast.DataParallel(wrapped, device_ids, in_dims=in_dims, out_dims=out_dims)
    args, kwargs, y_expected = model_inputs(X, y)
    kwargs["tgt_mask"] = kwargs["tgt_mask"].double()
    if not call_with_keywords:
        args = args + (kwargs["tgt_mask"], kwargs["src_pad_mask"], kwargs["tgt_pad_mask"])
        kwargs = {}
    got, want = dp(*args, **kwargs), plain(*args, **kwargs)
    how = "keyword" if call_with_keywords else "position"
    ok = report.compare(f"output (T, B, V), masks by {how}", got, want)
    loss_fn(got, y_expected).backward()
    loss_fn(want, y_expected).backward()

    def grads(m: nn.Module) -> list[Tensor | None]:
        return [p.grad for p in m.parameters()]

    n_params = sum(1 for _ in plain.parameters())
    ok &= report.compare(f"gradients of all {n_params} parameters", grads(wrapped), grads(plain))
    return ok


# ---- main ------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="examples/transformer.py", description=__doc__.split("\n\n")[0])
    add_example_args(parser, Config.batch, Config.train_steps)
    args = parser.parse_args(argv)
    report = Report(quiet=args.quiet)
    cfg = Config(batch=args.batch, train_steps=args.steps)
    if cfg.batch == cfg.tgt_len:
        parser.error(f"--batch {cfg.batch} equals the target length: a (T, T) mask would then look like a batch")
    device_ids, why = pick_devices(args.devices)
    device = home_device(device_ids)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    # nn.Transformer warns that a bool padding mask with a float attn_mask is deprecated (the seed does exactly that)
    # and that its nested-tensor fast path needs batch_first (the seed's model is sequence-first): both are the
    # seed's choices, not dpfast's
    warnings.filterwarnings("ignore", message=".*mismatched key_padding_mask and attn_mask.*")
    warnings.filterwarnings("ignore", message=".*enable_nested_tensor is True.*")

    report.say(
        "=" * 100,
        "Seed 004: Transformer whose (T, T) tgt_mask has no batch axis  [examples/transformer.py]",
        "=" * 100,
        f"devices: {why}",
    )
    model = build_model(cfg, device)
    X, y = make_batch(cfg, gen, device)
    margs, mkwargs, _ = model_inputs(X, y)

    title(report, "Problem: every input split on dim 0, as torch.nn.DataParallel does")
    report.say(
        "torch.nn.DataParallel fails on the seed (quoted from the seed's report: its (3225, 3225) mask on 6 GPUs):",
        f"  {SEED_ERROR}",
    )
    error = show_scatter_error(report, dpfast.DataParallel(model, device_ids), margs, mkwargs)

    title(report, f"Fix, one line: dpfast.DataParallel(model, in_dims={IN_DIMS}, out_dims={OUT_DIMS})")
    dp = dpfast.DataParallel(model, device_ids, in_dims=IN_DIMS, out_dims=OUT_DIMS)
    report.say(str(dp.plan(*margs, **mkwargs)), "", f"training: {cfg.train_steps} steps")
    losses = train(dp, model, cfg, X, y, report)

    title(report, "Check: dpfast == the unwrapped model (float64, eval mode)")
    ok = check_against_plain(model, device_ids, X, y, report)
    ok &= check_against_plain(model, device_ids, X, y, report, call_with_keywords=False)
    ok = ok and error is not None and all(v == v for v in losses)  # the loss is never NaN
    what = "one device, nothing split" if error == "one device" else "ScatterError without the spec"
    print(
        f"[transformer] {'PASS' if ok else 'FAIL'}: {what}, {len(losses)} training steps "
        f"(loss {losses[0]:.3f} -> {losses[-1]:.3f}), {report.passed} equality checks"
        + ("" if ok else f"; failures: {report.failures}")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
