"""The seed models of examples/ through dpfast on a CPU rehearsal, and `python -m dpfast info|demo|bench`.

Each model (small sizes, float64, eval mode so dropout is off) runs wrapped in ``dpfast.DataParallel(["cpu"] * n)``
and unwrapped on copies of the same inputs; outputs, returned states and every gradient must be equal. For the
RRN the returned LSTM state is fed back as the next call's state for several calls, as the seed's project does.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dpfast
from dpfast.__main__ import load_example

from dp_testing import DT

ROOT = Path(dpfast.__file__).resolve().parent.parent  # the folder holding the dpfast under test
rrn = load_example("rrn")
transformer = load_example("transformer")
fused = load_example("rrn_fused_state")


def _close(actual, expected, what=""):
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-11, msg=lambda m: f"{what}: {m}")


def _squash(text: str) -> str:
    """Table text with runs of spaces collapsed, so assertions do not depend on column widths."""
    return "\n".join(" ".join(line.split()) for line in text.splitlines())


def _grads(module):
    return [p.grad for p in module.parameters()]


# ---- seed 000: the RRN ----------------------------------------------------------------------------------------------


def _rrn_cfg(**kw):
    base = dict(batch=7, n_facts=3, dim_hidden=8, message_dim=8, output_dim=3, f_dims=(16,), o_dims=(16,))
    base.update(kw)
    return rrn.Config(**base)


def _rrn_case(cfg, factory=None, seed=0, dtype=DT):
    """Model (eval mode) and batch; float32 where the seed's reset_g (float32 zeros) is used as the state."""
    torch.manual_seed(seed)
    model = (factory or rrn.build_model)(cfg).to(dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    x, target = rrn.make_batch(cfg, gen)
    return model, x.to(dtype), target


def _run_rrn(net, x, h, steps):
    """``steps`` calls; each call's returned (hidden, h) is the next call's input. Returns every call's outputs."""
    hidden, results = x, []
    for _ in range(steps):
        out, hidden, h = net(x, hidden, h)
        results.append((out, hidden, h))
    return results


def _rrn_loss(results, target):
    loss = sum(F.cross_entropy(o.reshape(-1, o.size(-1)), target.reshape(-1)) for o, _, _ in results)
    h_n, c_n = results[-1][2]
    return loss + h_n.pow(2).mean() + c_n.sin().mean()


@pytest.mark.parametrize("n, g_layers, batch", [(2, 1, 7), (3, 2, 7), (4, 1, 10), (4, 2, 3), (5, 1, 2)])
def test_rrn_matches_plain_module_with_state_fed_back(n, g_layers, batch):
    cfg = _rrn_cfg(g_layers=g_layers, batch=batch)
    model, x, target = _rrn_case(cfg)
    plain = copy.deepcopy(model)
    dp = dpfast.DataParallel(model, ["cpu"] * n, in_dims=rrn.IN_DIMS, out_dims=rrn.OUT_DIMS)
    h0 = [torch.randn(g_layers, batch, cfg.dim_hidden, dtype=DT) for _ in range(2)]  # random: a bad split shows
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ha = tuple(t.clone().requires_grad_() for t in h0)
    hb = tuple(t.clone().requires_grad_() for t in h0)
    steps = 4
    got, want = _run_rrn(dp, xa, ha, steps), _run_rrn(plain, xb, hb, steps)
    for k, ((o1, n1, s1), (o2, n2, s2)) in enumerate(zip(got, want)):
        assert s1[0].shape == (g_layers, batch, cfg.dim_hidden)  # gathered back on axis 1, ready to feed back
        _close(o1, o2, f"out, call {k}")
        _close(n1, n2, f"hidden, call {k}")
        _close(s1, s2, f"h, call {k}")
    _rrn_loss(got, target).backward()
    _rrn_loss(want, target).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None, name
        _close(p.grad, q.grad, f"grad of {name}")
    _close(xa.grad, xb.grad, "grad of x")
    _close([t.grad for t in ha], [t.grad for t in hb], "grad of the initial (h0, c0)")


def test_rrn_reset_g_state_runs_unchanged():
    """The seed's own reset_g (zeros, requires_grad) and its training-mode forward run under the spec."""
    cfg = _rrn_cfg()
    model, x, target = _rrn_case(cfg, dtype=torch.float32)
    model.train()
    dp = dpfast.DataParallel(model, ["cpu"] * 4, in_dims=rrn.IN_DIMS, out_dims=rrn.OUT_DIMS)
    results = _run_rrn(dp, x, model.reset_g(cfg.batch), 3)
    out, hidden, (h, c) = results[-1]
    assert out.shape == (cfg.batch, cfg.n_facts, cfg.output_dim)
    assert h.shape == c.shape == (1, cfg.batch, cfg.dim_hidden)
    _rrn_loss(results, target).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_rrn_without_spec_raises_scatter_error_before_running():
    cfg = _rrn_cfg(batch=10, g_layers=1)
    model, x, _ = _rrn_case(cfg, dtype=torch.float32)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    dp = dpfast.DataParallel(model, ["cpu"] * 4)
    with pytest.raises(dpfast.ScatterError) as info:
        dp(x, x, model.reset_g(10))
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "h[0] (1, 10, 8) 0 0 1 <- expected 10; axis 1 has size 10" in _squash(msg)
    assert msg.endswith("suggested fix: DataParallel(..., in_dims={'h': 1})")
    assert calls == []  # nothing ran


def test_rrn_plan_shows_state_split_on_axis_one():
    cfg = _rrn_cfg(batch=10)
    model, x, _ = _rrn_case(cfg, dtype=torch.float32)
    dp = dpfast.DataParallel(model, ["cpu"] * 4, in_dims=rrn.IN_DIMS, out_dims=rrn.OUT_DIMS)
    text = _squash(str(dp.plan(x, x, model.reset_g(10))))
    assert text.startswith("dpfast plan: B = 10 split [3, 3, 2, 2] over 4 replicas")
    assert "h[1] (1, 10, 8) 1 (1, 3, 8) (1, 3, 8) (1, 2, 8) (1, 2, 8)" in text


@pytest.mark.parametrize("n, g_layers", [(2, 1), (4, 2)])
def test_rrn_fused_state_under_default_dim_matches_seed_model(n, g_layers):
    cfg = _rrn_cfg(g_layers=g_layers)
    model, x, target = _rrn_case(cfg, factory=fused.build_model)
    seed = fused.as_seed_model(model).to(DT).eval()
    dp = dpfast.DataParallel(model, ["cpu"] * n)  # no in_dims/out_dims: the state is batch-first
    h0 = [torch.randn(cfg.batch, g_layers, cfg.dim_hidden, dtype=DT) for _ in range(2)]
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ha = tuple(t.clone().requires_grad_() for t in h0)
    hb = tuple(t.transpose(0, 1).contiguous().requires_grad_() for t in h0)
    got, want = _run_rrn(dp, xa, ha, 3), _run_rrn(seed, xb, hb, 3)
    for (o1, n1, s1), (o2, n2, s2) in zip(got, want):
        assert isinstance(s1, tuple) and s1[0].shape == (cfg.batch, g_layers, cfg.dim_hidden)
        _close((o1, n1), (o2, n2), "out, hidden")
        _close([t.transpose(0, 1) for t in s1], list(s2), "state")
    _rrn_loss(got, target).backward()
    _rrn_loss(want, target).backward()
    _close(_grads(model), _grads(seed), "parameter grads")
    _close(xa.grad, xb.grad, "grad of x")
    _close([t.grad.transpose(0, 1) for t in ha], [t.grad for t in hb], "grad of the initial state")


def test_rrn_fused_state_calls_the_fused_ops(monkeypatch):
    seen = []
    for name in ("state_to_layer_first", "state_to_batch_first"):
        original = getattr(dpfast.ops, name)
        monkeypatch.setattr(dpfast.ops, name, lambda s, _f=original, _n=name: seen.append(_n) or _f(s))
    cfg = _rrn_cfg()
    model, x, _ = _rrn_case(cfg, factory=fused.build_model, dtype=torch.float32)
    model(x, x, model.reset_g(cfg.batch))
    assert seen == ["state_to_layer_first", "state_to_batch_first"]


# ---- seed 004: the Transformer ------------------------------------------------------------------------------------


def _tf_cfg(**kw):
    base = dict(
        batch=7, src_len=6, tgt_len=5, tokens=9, dim_model=8, num_heads=2, num_encoder_layers=1, num_decoder_layers=1
    )
    base.update(kw)
    return transformer.Config(**base)


def _tf_case(cfg, seed=0, **model_kw):
    torch.manual_seed(seed)
    with pytest.warns(UserWarning, match="enable_nested_tensor"):  # nn.Transformer without batch_first, as the seed
        model = transformer.build_model(cfg)
    model = model.to(DT).eval()
    for k, v in model_kw.items():
        setattr(model.positional_encoder, k, v)
    X, y = transformer.make_batch(cfg, torch.Generator().manual_seed(seed))
    args, kwargs, y_expected = transformer.model_inputs(X, y)
    kwargs["tgt_mask"] = kwargs["tgt_mask"].to(DT)
    return model, args, kwargs, y_expected


@pytest.mark.filterwarnings("ignore:.*mismatched key_padding_mask")
@pytest.mark.parametrize("n, batch, by", [(2, 7, "keyword"), (4, 7, "keyword"), (4, 10, "position"), (3, 2, "keyword")])
def test_transformer_matches_plain_module(n, batch, by):
    cfg = _tf_cfg(batch=batch)
    model, args, kwargs, y_expected = _tf_case(cfg)
    plain = copy.deepcopy(model)
    if by == "position":
        args, kwargs = args + (kwargs["tgt_mask"], kwargs["src_pad_mask"], kwargs["tgt_pad_mask"]), {}
    dp = dpfast.DataParallel(model, ["cpu"] * n, in_dims=transformer.IN_DIMS, out_dims=transformer.OUT_DIMS)
    got, want = dp(*args, **kwargs), plain(*args, **kwargs)
    assert got.shape == (cfg.tgt_len, batch, cfg.tokens)
    _close(got, want, "output")
    transformer.loss_fn(got, y_expected).backward()
    transformer.loss_fn(want, y_expected).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None, name
        _close(p.grad, q.grad, f"grad of {name}")


def test_transformer_without_spec_raises_scatter_error():
    cfg = _tf_cfg(batch=7)
    model, args, kwargs, _ = _tf_case(cfg)
    with pytest.raises(dpfast.ScatterError) as info:
        dpfast.DataParallel(model, ["cpu"] * 4)(*args, **kwargs)
    msg = str(info.value)
    assert "tgt_mask (5, 5) 0 0 5 <- expected 7; no axis has size 7: replicate it with None" in _squash(msg)
    assert msg.endswith("suggested fix: DataParallel(..., in_dims={'tgt_mask': None})")


@pytest.mark.filterwarnings("ignore:.*mismatched key_padding_mask")
def test_transformer_guide_positional_encoding_depends_on_batch_position():
    """The guide's PositionalEncoding indexes its table by batch index: a data-parallel run then differs from one
    device, whoever splits the batch. The example's (sequence-indexed) version does not."""
    cfg = _tf_cfg(batch=8)
    model, args, kwargs, _ = _tf_case(cfg, batch_index_bug=True)
    dp = dpfast.DataParallel(
        copy.deepcopy(model), ["cpu"] * 4, in_dims=transformer.IN_DIMS, out_dims=transformer.OUT_DIMS
    )
    with torch.no_grad():
        got, want = dp(*args, **kwargs), model(*args, **kwargs)
    assert not torch.allclose(got, want)
    _close(got[:, :2], want[:, :2], "replica 0's rows start at index 0 either way")


# ---- the example scripts and the CLI --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rrn", "transformer", "rrn_fused_state"])
def test_example_main_passes_quietly(name, capsys):
    module = load_example(name)
    assert module.main(["--devices", "cpu:3", "--quiet", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"[{name}] PASS"), out


def _cli(*args, timeout=120):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "dpfast", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_cli_info():
    proc = _cli("info")
    assert proc.returncode == 0, proc.stderr
    for line in ("torch", "version", "devices", "dpfast._C (the compiled extension)", "loaded", "ops backend"):
        assert line in proc.stdout
    facts = dpfast.build_info()
    assert facts["torch_version"] in proc.stdout
    if facts["extension_loaded"]:
        assert "kernels registered transpose01 (CPU" in proc.stdout
    else:
        assert "dpfast.reference" in proc.stdout


def test_cli_info_json_is_build_info(capsys):
    import dpfast.__main__ as cli

    assert cli.main(["info", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert set(facts) == set(dpfast.build_info())
    assert facts["torch_version"] == torch.__version__


def test_cli_demo_prints_both_plans_and_passes():
    proc = _cli("demo")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "dpfast demo: 3/3 examples passed" in out
    assert out.count("dpfast plan: B = 10 split") == 3
    assert "suggested fix: DataParallel(..., in_dims={'h': 1})" in out
    assert "suggested fix: DataParallel(..., in_dims={'tgt_mask': None})" in out
    assert "MISMATCH" not in out


def test_cli_demo_fails_when_an_example_fails(monkeypatch, capsys):
    import dpfast.__main__ as cli

    monkeypatch.setattr(rrn, "main", lambda argv=None: 1)
    monkeypatch.setattr(transformer, "main", lambda argv=None: 1 / 0)
    assert cli.main(["demo", "--only", "rrn", "--only", "transformer"]) == 1
    out = capsys.readouterr().out
    assert "0/2 examples passed" in out and "ZeroDivisionError" in out


def test_cli_bench_runs_scripts_and_forwards_arguments(tmp_path, monkeypatch, capsys):
    import dpfast.__main__ as cli

    (tmp_path / "bench_ops.py").write_text("def main(argv=None):\n    print('ops got', argv)\n    return 0\n")
    monkeypatch.setattr(cli, "BENCHMARKS_DIR", tmp_path)
    assert cli.main(["bench", "ops", "--quick", "--sizes", "1", "2"]) == 0
    assert "ops got ['--quick', '--sizes', '1', '2']" in capsys.readouterr().out
    # bench_dp.py is missing: a clear message, a failing exit code, the other script still runs
    assert cli.main(["bench", "--quick"]) == 1
    captured = capsys.readouterr()
    assert "ops got ['--quick']" in captured.out
    assert "bench_dp.py not found" in captured.err


def test_cli_rejects_unknown_arguments(capsys):
    import dpfast.__main__ as cli

    with pytest.raises(SystemExit) as info:
        cli.main(["info", "--bogus"])
    assert info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
