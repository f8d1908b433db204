"""Seed 000: a relational recurrent network (RRN) whose LSTM state is ``(num_layers, B, H)``, unchanged, under dpfast.

The seed (a user's blog post, not part of this repository) puts this model under ``torch.nn.DataParallel`` and gets::

    RuntimeError: Expected hidden[0] size (1, 2500, 50), got (1, 10000, 50)

The LSTM is ``batch_first=True``, but its state ``h = (h0, c0)`` is ``(num_layers, B, H)`` whatever ``batch_first``
says. torch splits every input on ``dim=0``: the layer axis of ``h``, which has size 1, so it yields one chunk, only
one replica runs (the other three quarters of the batch are silently dropped by torch's scatter), and that replica
gets ``x`` of 2500 rows with the whole 10000-row state. The blog's fix is to rewrite the model: keep the state
batch-first and ``permute(1, 0, 2).contiguous()`` it around every LSTM call (see ``rrn_fused_state.py``).

With dpfast the model stays as it is; the wrapper says where the batch is::

    dpfast.DataParallel(model, in_dims={"h": 1}, out_dims=(0, 0, 1))

``in_dims={"h": 1}``: the argument named ``h`` in ``forward(x, hidden, h, edge_attribute=None)`` has its batch on
axis 1 (both ``h0`` and ``c0``); everything else uses axis 0. ``out_dims=(0, 0, 1)``: ``forward`` returns
``(out, hidden, h)``; the returned state is gathered on axis 1, so it can be fed straight back into the next call.

Run: ``python examples/rrn.py`` (``--help`` for options). Without a GPU it rehearses a 4-GPU run on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn import LSTM

import dpfast

try:
    from ._common import Report, add_example_args, home_device, pick_devices, sgd_step, show_scatter_error, title
except ImportError:  # run as a script: python examples/rrn.py
    from _common import Report, add_example_args, home_device, pick_devices, sgd_step, show_scatter_error, title  # type: ignore[import-not-found,no-redef]

# The one-line fix: the LSTM state `h` has its batch on axis 1, in and out.
IN_DIMS = {"h": 1}
OUT_DIMS = (0, 0, 1)  # (out, hidden, h)
State = tuple[Tensor, Tensor]  # the LSTM's (h, c), each (g_layers, B, dim_hidden)
Call = tuple[Tensor, Tensor, State]  # what one RRN call returns: (out, hidden, h)
SEED_ERROR = "RuntimeError: Expected hidden[0] size (1, 2500, 50), got (1, 10000, 50)"


# ---- the seed's model --------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """``src.models.MLP`` of the RRN project (not shown in the seed): Linear + ReLU per hidden size, then a Linear.

    ``dropout=True`` adds dropout after each hidden layer (the seed builds its output MLP ``o`` with it).
    """

    def __init__(
        self, input_dim: int, hidden_dims: Sequence[int], output_dim: int, dropout: bool = False, dropout_p: float = 0.5
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        last = input_dim
        for dim in hidden_dims:
            layers += [nn.Linear(last, dim), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout_p))
            last = dim
        layers.append(nn.Linear(last, output_dim))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.layers(x)
        return out


class RRN(nn.Module):
    """The seed's RRN (its appendix), unchanged: the LSTM ``g`` keeps torch's ``(g_layers, B, H)`` state."""

    def __init__(
        self,
        dim_hidden: int,
        message_dim: int,
        output_dim: int,
        f_dims: Sequence[int],
        o_dims: Sequence[int],
        device: torch.device,
        g_layers: int = 1,
        edge_attribute_dim: int = 0,
        single_output: bool = False,
    ) -> None:
        """
        :param edge_attribute_dim: 0 if edges have no attributes, else an integer. Default 0.
        :param single_output: True if RRN emits only one output at a time, False if it emits as many outputs as
            units. Default False.
        """

        super().__init__()

        self.dim_hidden = dim_hidden
        self.dim_input = dim_hidden
        self.message_dim = message_dim
        self.output_dim = output_dim

        self.device = device

        self.f_dims = f_dims
        self.o_dims = o_dims
        self.g_layers = g_layers

        self.edge_attribute_dim = edge_attribute_dim
        self.single_output = single_output

        input_f_dim = 2 * self.dim_hidden + self.edge_attribute_dim
        self.f = MLP(input_f_dim, self.f_dims, self.message_dim)

        input_gmlp_dim = self.dim_input + self.message_dim
        output_gmlp_dim = 128
        self.g_mlp = MLP(input_gmlp_dim, self.f_dims, output_gmlp_dim)
        self.g = LSTM(output_gmlp_dim, self.dim_hidden, num_layers=self.g_layers, batch_first=True)

        input_o_dim = self.dim_hidden
        self.o = MLP(input_o_dim, self.o_dims, self.output_dim, dropout=True)

    def forward(self, x: Tensor, hidden: Tensor, h: State, edge_attribute: Tensor | None = None) -> Call:
        """
        This can be called repeatedly after hidden states are set.
        :param x: inputs to the RRN nodes
        :param hidden: hidden states of RRN nodes (B, N_facts, H)
        :param h: hidden and cell states of g
        :param edge_attributes: (B, Q_dim) tensor containing edge attribute or None if edges have no attributes.
            Default None.
        """

        n_facts = hidden.size(1)

        hi = hidden.repeat(1, n_facts, 1)
        hj = hidden.unsqueeze(2)
        hj = hj.repeat(1, 1, n_facts, 1).view(hidden.size(0), -1, hidden.size(2))
        if edge_attribute is not None:
            ea = edge_attribute.unsqueeze(1)
            ea = ea.repeat(1, hi.size(1), 1)
            input_f = torch.cat((hj, hi, ea), dim=2)
        else:
            input_f = torch.cat((hi, hj), dim=2)

        messages = self.f(input_f)

        messages = messages.view(hidden.size(0), hidden.size(1), hidden.size(1), self.message_dim)

        # sum_messages[i] contains the sum of the messages incoming to node i
        sum_messages = torch.sum(messages, dim=2)  # B, N_facts, Message_dim

        input_g_mlp = torch.cat((x, sum_messages), dim=2)

        input_g = self.g_mlp(input_g_mlp)

        out, h = self.g(input_g, h)

        hidden = out.clone()

        if self.single_output:
            sum_hidden = torch.sum(hidden, dim=1)
            out = self.o(sum_hidden)
        else:
            out = self.o(hidden)

        return out, hidden, h

    def reset_g(self, b: int) -> State:
        # hidden is composed by hidden and cell state vectors
        self.batch_size = b
        h = (
            torch.zeros(self.g_layers, b, self.dim_hidden, device=self.device, requires_grad=True),
            torch.zeros(self.g_layers, b, self.dim_hidden, device=self.device, requires_grad=True),
        )
        return h


# ---- synthetic data and training -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    batch: int = 10  # 10 rows over 4 replicas: an uneven 3/3/2/2 split
    n_facts: int = 5
    dim_hidden: int = 32
    message_dim: int = 32
    output_dim: int = 4
    f_dims: tuple[int, ...] = (64, 64)
    o_dims: tuple[int, ...] = (64,)
    g_layers: int = 1
    reasoning_steps: int = 3  # calls per batch, each feeding (hidden, h) back in
    train_steps: int = 5
    lr: float = 0.2


def build_model(cfg: Config, device: str | torch.device = "cpu") -> RRN:
    device = torch.device(device)
    return RRN(
        cfg.dim_hidden,
        cfg.message_dim,
        cfg.output_dim,
        list(cfg.f_dims),
        list(cfg.o_dims),
        device,
        g_layers=cfg.g_layers,
    ).to(device)


def make_batch(
    cfg: Config, generator: torch.Generator, device: str | torch.device = "cpu", batch: int | None = None
) -> tuple[Tensor, Tensor]:
    """Facts ``x`` of shape (B, N_facts, dim_hidden) and a label per fact, which depends on the other facts."""
    b = cfg.batch if batch is None else batch
    x = torch.randn(b, cfg.n_facts, cfg.dim_hidden, generator=generator)
    context = x.mean(dim=1, keepdim=True)
    target = (x[..., : cfg.output_dim] + context[..., : cfg.output_dim]).argmax(-1)
    return x.to(device), target.to(device)


def reason(net: nn.Module, x: Tensor, h: State, steps: int) -> list[Call]:
    """``steps`` calls of the RRN, feeding the returned node states and LSTM state back in, as the project does."""
    hidden = x
    results: list[Call] = []
    for _ in range(steps):
        out, hidden, h = net(x, hidden, h)
        results.append((out, hidden, h))
    return results


def train(dp: nn.Module, model: RRN, cfg: Config, x: Tensor, target: Tensor, report: Report) -> list[float]:
    """``cfg.train_steps`` steps on one batch (so the falling loss is visible), through ``dp``."""
    model.train()
    losses = []
    for step in range(1, cfg.train_steps + 1):
        t0 = time.perf_counter()
        h = model.reset_g(x.size(0))
        results = reason(dp, x, h, cfg.reasoning_steps)
        loss = torch.stack(
            [F.cross_entropy(out.reshape(-1, cfg.output_dim), target.reshape(-1)) for out, _, _ in results]
        ).sum()
        loss.backward()
        sgd_step(model, cfg.lr)
        losses.append(loss.item())
        report.say(f"  step {step}: loss {loss.item():.4f}   ({1e3 * (time.perf_counter() - t0):.0f} ms)")
    return losses


# ---- the check: dpfast == the unwrapped model ----------------------------------------------------------------------


def check_against_plain(
    model: RRN,
    device_ids: Sequence[int | str],
    x: Tensor,
    target: Tensor,
    steps: int,
    report: Report,
    in_dims: dict[str, int] = IN_DIMS,
    out_dims: tuple[int, ...] = OUT_DIMS,
) -> bool:
    """Run float64 copies of ``model`` (eval mode: dropout off) with and without dpfast on the same batch for
    ``steps`` calls, each feeding the returned state back; outputs, states, and the gradients of every parameter and
    input must be equal. The initial LSTM state is random, not reset_g's zeros, so a wrongly split state would show."""
    plain = copy.deepcopy(model).double().eval()
    wrapped = copy.deepcopy(model).double().eval()
    dp = dpfast.DataParallel(wrapped, device_ids, in_dims=in_dims, out_dims=out_dims)
    gen = torch.Generator().manual_seed(1234)
    h0 = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in model.reset_g(x.size(0))]

    def leaves() -> tuple[Tensor, State]:
        h, c = (t.to(x.device).clone().requires_grad_() for t in h0)
        return x.detach().double().clone().requires_grad_(), (h, c)

    (xa, ha), (xb, hb) = leaves(), leaves()
    got, want = reason(dp, xa, ha, steps), reason(plain, xb, hb, steps)
    ok = True
    for k, ((o1, n1, s1), (o2, n2, s2)) in enumerate(zip(got, want), 1):
        ok &= report.compare(f"call {k}: out, hidden, h=(h_n, c_n)", (o1, n1, s1), (o2, n2, s2))

    def loss_of(results: list[Call]) -> Tensor:
        out_loss = torch.stack(
            [F.cross_entropy(o.reshape(-1, o.size(-1)), target.reshape(-1)) for o, _, _ in results]
        ).sum()
        h_n, c_n = results[-1][2]
        return out_loss + h_n.pow(2).mean() + c_n.sin().mean()

    loss_of(got).backward()
    loss_of(want).backward()

    def grads(m: nn.Module) -> list[Tensor | None]:
        return [p.grad for p in m.parameters()]

    n_params = sum(1 for _ in plain.parameters())
    ok &= report.compare(f"gradients of all {n_params} parameters", grads(wrapped), grads(plain))
    ok &= report.compare(
        "gradients of x and of the initial (h0, c0)",
        (xa.grad, ha[0].grad, ha[1].grad),
        (xb.grad, hb[0].grad, hb[1].grad),
    )
    return ok


# ---- main ------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="examples/rrn.py", description=__doc__.split("\n\n")[0])
    add_example_args(parser, Config.batch, Config.train_steps)
    args = parser.parse_args(argv)
    report = Report(quiet=args.quiet)
    cfg = Config(batch=args.batch, train_steps=args.steps)
    device_ids, why = pick_devices(args.devices)
    device = home_device(device_ids)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    report.say(
        "=" * 100,
        "Seed 000: RRN whose LSTM state h = (h0, c0) is (num_layers, B, H)  [examples/rrn.py]",
        "=" * 100,
        f"devices: {why}",
    )
    model = build_model(cfg, device)
    x, target = make_batch(cfg, gen, device)
    h = model.reset_g(x.size(0))

    title(report, "Problem: every input split on dim 0, as torch.nn.DataParallel does")
    report.say(
        "torch.nn.DataParallel fails on the seed (quoted from the seed's report: its batch of 10,000 on 4 GPUs):",
        f"  {SEED_ERROR}",
    )
    error = show_scatter_error(report, dpfast.DataParallel(model, device_ids), (x, x, h), {})

    title(report, f"Fix, one line: dpfast.DataParallel(model, in_dims={IN_DIMS}, out_dims={OUT_DIMS})")
    dp = dpfast.DataParallel(model, device_ids, in_dims=IN_DIMS, out_dims=OUT_DIMS)
    report.say(
        str(dp.plan(x, x, h)),
        "",
        f"training: {cfg.train_steps} steps x {cfg.reasoning_steps} RRN calls, the state fed back each call",
    )
    losses = train(dp, model, cfg, x, target, report)

    title(
        report,
        f"Check: dpfast == the unwrapped model (float64, eval mode, {cfg.reasoning_steps} calls feeding "
        "the state back)",
    )
    ok = check_against_plain(model, device_ids, x, target, cfg.reasoning_steps, report)
    ok = ok and error is not None and all(map(lambda v: v == v, losses))  # the loss is never NaN
    what = "one device, nothing split" if error == "one device" else "ScatterError without the spec"
    print(
        f"[rrn] {'PASS' if ok else 'FAIL'}: {what}, {len(losses)} training steps "
        f"(loss {losses[0]:.3f} -> {losses[-1]:.3f}), {report.passed} equality checks"
        + ("" if ok else f"; failures: {report.failures}")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
