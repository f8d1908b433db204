"""Seed 000, the blog's rewrite: the RRN keeps its LSTM state batch-first and converts it around the LSTM call.

The blog's fix for ``Expected hidden[0] size (1, 2500, 50), got (1, 10000, 50)`` is to change the model so that
the plain ``dim=0`` split of ``torch.nn.DataParallel`` is right for the state too: ``reset_g`` returns
``(B, g_layers, H)`` and ``forward`` transposes the state around the LSTM by hand::

    hidden0 = [x.permute(1, 0, 2).contiguous() for x in h]
    out, hidden0 = self.g(input_g, hidden0)
    h = [x.permute(1, 0, 2).contiguous() for x in hidden0]

That is four transposes and four copies per call. This variant does the same with dpfast's fused ops, which move
``h`` and ``c`` together in one kernel launch (and are differentiable)::

    hidden0 = dpfast.ops.state_to_layer_first(h)
    out, hidden0 = self.g(input_g, hidden0)
    h = dpfast.ops.state_to_batch_first(hidden0)

and runs under ``dpfast.DataParallel`` with the default ``dim=0``: no ``in_dims``/``out_dims`` at all. (With
``dpfast.nn.LSTM(..., state_batch_first=True)`` as ``self.g`` the two conversion lines disappear as well; and with
``rrn.py``'s ``in_dims={"h": 1}`` the model needs no change in the first place.)

The check: this model under dpfast equals the *seed's* unwrapped RRN with the same weights, state transposed.

Run: ``python examples/rrn_fused_state.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

import dpfast

try:
    from ._common import Report, add_example_args, home_device, pick_devices, title
    from .rrn import RRN, Call, Config, State, make_batch, reason, train
except ImportError:  # run as a script: python examples/rrn_fused_state.py
    from _common import Report, add_example_args, home_device, pick_devices, title  # type: ignore[import-not-found,no-redef]
    from rrn import RRN, Call, Config, State, make_batch, reason, train  # type: ignore[import-not-found,no-redef]


class RRNFusedState(RRN):
    """The seed's RRN with the blog's batch-first LSTM state, converted with ``dpfast.ops``. Same parameters (and
    state dict keys) as :class:`RRN`."""

    def forward(self, x: Tensor, hidden: Tensor, h: State, edge_attribute: Tensor | None = None) -> Call:
        """
        :param x: inputs to the RRN nodes
        :param hidden: hidden states of RRN nodes (B, N_facts, H)
        :param h: hidden and cell states of g, batch-first: ((B, g_layers, H), (B, g_layers, H))
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
        # the blog: hidden0 = [x.permute(1, 0, 2).contiguous() for x in h]; here h and c move in one launch
        hidden0 = dpfast.ops.state_to_layer_first(tuple(h))

        out, hidden0 = self.g(input_g, hidden0)
        # the blog: h = [x.permute(1, 0, 2).contiguous() for x in hidden0]
        h = dpfast.ops.state_to_batch_first(hidden0)

        hidden = out.clone()

        if self.single_output:
            sum_hidden = torch.sum(hidden, dim=1)
            out = self.o(sum_hidden)
        else:
            out = self.o(hidden)

        return out, hidden, h

    def reset_g(self, b: int) -> State:
        # hidden is composed by hidden and cell state vectors, batch first (the blog's reset_g)
        h = (
            torch.zeros(b, self.g_layers, self.dim_hidden, device=self.device, requires_grad=True),
            torch.zeros(b, self.g_layers, self.dim_hidden, device=self.device, requires_grad=True),
        )
        return h


def build_model(cfg: Config, device: str | torch.device = "cpu") -> RRNFusedState:
    device = torch.device(device)
    return RRNFusedState(
        cfg.dim_hidden,
        cfg.message_dim,
        cfg.output_dim,
        list(cfg.f_dims),
        list(cfg.o_dims),
        device,
        g_layers=cfg.g_layers,
    ).to(device)


def as_seed_model(model: RRNFusedState) -> RRN:
    """The seed's RRN with the same weights (the state dicts are interchangeable)."""
    seed = RRN(
        model.dim_hidden,
        model.message_dim,
        model.output_dim,
        model.f_dims,
        model.o_dims,
        model.device,
        g_layers=model.g_layers,
        edge_attribute_dim=model.edge_attribute_dim,
        single_output=model.single_output,
    )
    seed.load_state_dict(model.state_dict())
    return seed.to(next(model.parameters()).device)


def check_against_seed(
    model: RRNFusedState, device_ids: Sequence[int | str], x: Tensor, target: Tensor, steps: int, report: Report
) -> bool:
    """float64, eval mode: ``dpfast.DataParallel(model)`` (default dim=0) for ``steps`` calls feeding the state back
    equals the seed's unwrapped RRN with the same weights and the state transposed; gradients too."""
    mine = copy.deepcopy(model).double().eval()
    seed = as_seed_model(model).double().eval()
    dp = dpfast.DataParallel(mine, device_ids)  # no in_dims, no out_dims: everything is batch-first
    gen = torch.Generator().manual_seed(1234)
    h0 = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in model.reset_g(x.size(0))]  # (B, L, H)
    xa = x.detach().double().clone().requires_grad_()
    xb = x.detach().double().clone().requires_grad_()
    ha = _pair([t.to(x.device).clone().requires_grad_() for t in h0])
    hb = _pair([t.to(x.device).transpose(0, 1).contiguous().requires_grad_() for t in h0])  # (L, B, H)
    got, want = reason(dp, xa, ha, steps), reason(seed, xb, hb, steps)
    ok = True
    for k, ((o1, n1, s1), (o2, n2, s2)) in enumerate(zip(got, want), 1):
        ok &= report.compare(
            f"call {k}: out, hidden, h (transposed)", (o1, n1, [t.transpose(0, 1) for t in s1]), (o2, n2, s2)
        )

    def loss_of(results: list[Call]) -> Tensor:
        out_loss = torch.stack(
            [F.cross_entropy(o.reshape(-1, o.size(-1)), target.reshape(-1)) for o, _, _ in results]
        ).sum()
        h_n, c_n = results[-1][2]
        return out_loss + h_n.pow(2).mean() + c_n.sin().mean()

    loss_of(got).backward()
    loss_of(want).backward()
    ok &= report.compare(
        "gradients of all parameters", [p.grad for p in mine.parameters()], [p.grad for p in seed.parameters()]
    )
    ok &= report.compare(
        "gradients of x and of the initial (h0, c0)",
        (xa.grad, _transposed(ha[0].grad), _transposed(ha[1].grad)),
        (xb.grad, hb[0].grad, hb[1].grad),
    )
    return ok


def _pair(tensors: Sequence[Tensor]) -> State:
    h, c = tensors
    return h, c


def _transposed(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.transpose(0, 1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="examples/rrn_fused_state.py", description=__doc__.split("\n\n")[0])
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
        "Seed 000, the blog's rewrite: batch-first LSTM state around dpfast.ops  [examples/rrn_fused_state.py]",
        "=" * 100,
        f"devices: {why}",
    )
    model = build_model(cfg, device)
    x, target = make_batch(cfg, gen, device)
    h = model.reset_g(x.size(0))

    title(report, "dpfast.DataParallel(model) with the default dim=0: the state is batch-first now")
    dp = dpfast.DataParallel(model, device_ids)
    report.say(
        str(dp.plan(x, x, h)),
        "",
        f"training: {cfg.train_steps} steps x {cfg.reasoning_steps} RRN calls, the state fed back each call",
    )
    losses = train(dp, model, cfg, x, target, report)

    title(report, "Check: this model under dpfast == the seed's unwrapped RRN, same weights (float64, eval mode)")
    ok = check_against_seed(model, device_ids, x, target, cfg.reasoning_steps, report)
    ok = ok and all(v == v for v in losses)
    print(
        f"[rrn_fused_state] {'PASS' if ok else 'FAIL'}: {len(losses)} training steps "
        f"(loss {losses[0]:.3f} -> {losses[-1]:.3f}), {report.passed} equality checks, ops backend: "
        f"{dpfast.build_info()['ops_backend']}" + ("" if ok else f"; failures: {report.failures}")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
