"""Real Hugging Face models under dpfast.DataParallel on the CPU rehearsal: tiny BERT, GPT-2 and T5 (2 layers,
hidden 32, float64, no dropout, nothing downloaded). Outputs (ModelOutput with its None fields), hidden states and
gradients equal the unwrapped model's; eval without labels; a two-step decode that feeds the KV cache back; a
BatchEncoding batch; and the unwrap helpers of accelerate and transformers."""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import dpfast  # noqa: E402

from dp_testing import DT, check_against_module  # noqa: E402

V = 50

pytestmark = pytest.mark.usefixtures("one_thread")
transformers.logging.set_verbosity_error()


def bert():
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(cfg)


def gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def t5():
    cfg = transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def _ids(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V, shape, generator=g)


def _mask(b, t):
    mask = torch.ones(b, t, dtype=torch.long)
    for i in range(b):
        mask[i, t - (i % 3) :] = 0  # some padding, different per row
    return mask


def test_unwrap_helpers_return_the_module():
    from accelerate.utils import extract_model_from_parallel
    from transformers.modeling_utils import unwrap_model

    m = bert()
    dp = dpfast.DataParallel(m, ["cpu"] * 2)
    assert extract_model_from_parallel(dp) is m  # was the wrapper: isinstance(dp, nn.DataParallel) was False
    assert unwrap_model(dp) is m


def test_bert_outputs_hidden_states_and_gradients_equal_the_model():
    ids, mask, labels = _ids(7, 6), _mask(7, 6), torch.arange(7) % 3
    out = check_against_module(
        bert, (ids,), {"attention_mask": mask, "labels": labels, "output_hidden_states": True}, n=3,
        out_dims={"loss": "mean"},
    )  # fmt: skip
    assert type(out).__name__ == "SequenceClassifierOutput"
    assert list(out.keys()) == ["loss", "logits", "hidden_states"] and out.attentions is None


def test_bert_eval_without_labels_with_a_loss_spec():
    torch.manual_seed(0)
    m = bert().to(DT).eval()
    dp = dpfast.DataParallel(m, ["cpu"] * 4, out_dims={"loss": "mean"})
    ids, mask = _ids(9, 5), _mask(9, 5)
    with torch.no_grad():
        out = dp(ids, attention_mask=mask)  # was ValueError: out_dims for output names ['loss'] ...
        ref = m(ids, attention_mask=mask)
    assert out.loss is None and list(out.keys()) == ["logits"]
    torch.testing.assert_close(out.logits, ref.logits)


def test_bert_batch_encoding_is_split_like_a_dict():
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert().to(DT)

        def forward(self, batch, labels):
            return self.bert(**batch, labels=labels).logits

    torch.manual_seed(0)
    m = Wrapper()
    batch = transformers.BatchEncoding({"input_ids": _ids(8, 5), "attention_mask": _mask(8, 5)})
    labels = torch.arange(8) % 3
    out = dpfast.DataParallel(m, ["cpu"] * 4)(batch, labels)
    assert out.shape == (8, 3)  # was (32, 3): every replica ran the whole BatchEncoding
    torch.testing.assert_close(out, m(batch, labels))


def test_gpt2_outputs_hidden_states_and_gradients_equal_the_model():
    ids, mask = _ids(5, 6), _mask(5, 6)
    kwargs = {"attention_mask": mask, "output_hidden_states": True, "use_cache": False}
    out = check_against_module(gpt2, (ids,), kwargs, n=2)
    assert list(out.keys()) == ["logits", "hidden_states"]


def _decode_twice(model, ids, call):
    """Two greedy steps feeding the returned cache back; returns both outputs."""
    first = call(model, ids, None)
    nxt = first.logits[:, -1:].argmax(-1)
    second = call(model, nxt, first.cache)
    return first, second


@pytest.fixture(params=["by attributes", "pytree-registered"])
def cache_walk(request):
    """transformers 5 registers DynamicCache with torch's pytree only for export (then dpfast uses that
    registration); otherwise dpfast walks the cache by its attributes. Both must round-trip."""
    if request.param == "by attributes":
        yield request.param
        return
    import torch.fx._pytree as fx_pytree
    import torch.utils._pytree as pytree
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    register_dynamic_cache_export_support()
    assert transformers.DynamicCache in pytree.SUPPORTED_NODES
    try:
        yield request.param
    finally:
        pytree._deregister_pytree_node(transformers.DynamicCache)
        fx_pytree._deregister_pytree_flatten_spec(transformers.DynamicCache)


def test_gpt2_two_step_decode_feeds_the_cache_back(cache_walk):
    torch.manual_seed(0)
    m = gpt2().to(DT).eval()
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    ids = _ids(7, 4)

    def call(model, x, cache):
        with torch.no_grad():
            return model(x, cache=cache, use_cache=True)

    first, second = _decode_twice(dp, ids, call)
    ref_first, ref_second = _decode_twice(m, ids, call)
    cache = first.cache
    assert type(cache) is type(ref_first.cache)  # was a list of 3 caches, and feeding it back raised
    # the plain model updated its cache in place (ref_first.cache is ref_second.cache); the replicas updated their
    # own copies, so the cache dpfast returned holds the first step only, and the second step returned a new one
    assert len(cache.layers) == 2 and cache.layers[0].keys.shape == (7, 2, 4, 16)
    torch.testing.assert_close(first.logits, ref_first.logits)
    torch.testing.assert_close(second.logits, ref_second.logits)
    for a, b in zip(second.cache.layers, ref_second.cache.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    assert second.cache.get_seq_length() == 5


def test_fresh_empty_cache_passed_in_gives_each_replica_its_own(cache_walk):
    torch.manual_seed(0)
    m = gpt2().to(DT).eval()
    ids = _ids(6, 4)
    with torch.no_grad():
        out = dpfast.DataParallel(m, ["cpu"] * 3)(ids, cache=transformers.DynamicCache(config=m.config), use_cache=True)
        ref = m(ids, use_cache=True)
    assert out.cache.get_seq_length() == 4
    torch.testing.assert_close(out.cache.layers[1].values, ref.cache.layers[1].values)


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).to(DT).eval()


def test_static_cache_counters_are_each_replicas_own():
    """A StaticCache's layers count the positions written in a 0-dim tensor the model increments in place: replicas
    sharing one counter prefilled at positions k * L (silently wrong logits) and advanced the caller's cache."""
    m = llama()
    dp = dpfast.DataParallel(m, ["cpu"] * 4)
    ids = _ids(6, 8)

    def static():
        return transformers.StaticCache(config=m.config, max_cache_len=16)

    with torch.no_grad():
        out, ref = dp(input_ids=ids, cache=static(), use_cache=True), m(input_ids=ids, cache=static(), use_cache=True)
        torch.testing.assert_close(out.logits, ref.logits)
        assert out.cache.layers[0].cumulative_length.item() == 8 == ref.cache.layers[0].cumulative_length.item()
        filled = static()
        nxt = m(input_ids=ids, cache=filled, use_cache=True).logits[:, -1:].argmax(-1)
        want = m(input_ids=nxt, cache=copy.deepcopy(filled), use_cache=True)
        got = dp(input_ids=nxt, cache=filled, use_cache=True)
    torch.testing.assert_close(got.logits, want.logits)
    assert filled.layers[0].cumulative_length.item() == 8  # the cache passed in is not updated in place
    assert got.cache.layers[0].cumulative_length.item() == 9


def test_linear_attention_cache_states_are_split_and_gathered():
    """Mamba-style layers keep their conv and recurrent states in dicts by layer index: they were neither split nor
    gathered (the returned cache held replica 0's 2 rows of 6, and feeding it back raised)."""
    torch.manual_seed(0)
    cfg = transformers.FalconMambaConfig(
        vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=3, use_mambapy=False
    )
    m = transformers.FalconMambaForCausalLM(cfg).to(DT).eval()
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    ids = _ids(6, 5)
    with torch.no_grad():
        ref, out = m(input_ids=ids, use_cache=True), dp(input_ids=ids, use_cache=True)
        torch.testing.assert_close(out.logits, ref.logits)
        for name in ("conv_states", "recurrent_states"):
            torch.testing.assert_close(getattr(out.cache.layers[0], name), getattr(ref.cache.layers[0], name))
        nxt = ref.logits[:, -1:].argmax(-1)
        want = m(input_ids=nxt, cache=copy.deepcopy(ref.cache), use_cache=True)
        got = dp(input_ids=nxt, cache=out.cache, use_cache=True)
    torch.testing.assert_close(got.logits, want.logits)


def test_t5_outputs_and_gradients_equal_the_model():
    ids, mask, dec = _ids(5, 6), _mask(5, 6), _ids(5, 3, seed=1)
    kwargs = {"attention_mask": mask, "decoder_input_ids": dec, "output_hidden_states": True, "use_cache": False}
    out = check_against_module(t5, (ids,), kwargs, n=3)
    assert out.decoder_hidden_states is not None and out.loss is None


def test_t5_two_step_decode_feeds_the_encoder_decoder_cache_back():
    torch.manual_seed(0)
    m = t5().to(DT).eval()
    dp = dpfast.DataParallel(m, ["cpu"] * 2)
    ids, mask = _ids(5, 6), _mask(5, 6)
    start = torch.zeros(5, 1, dtype=torch.long)

    def call(model, x, cache):
        with torch.no_grad():
            return model(ids, attention_mask=mask, decoder_input_ids=x, cache=cache, use_cache=True)

    first, second = _decode_twice(dp, start, call)
    ref_first, ref_second = _decode_twice(copy.deepcopy(m), start, call)
    assert type(first.cache) is type(ref_first.cache)
    torch.testing.assert_close(second.logits, ref_second.logits)
    assert second.cache.get_seq_length() == 2


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide state; each test (and Trainer, later) needs its own settings."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerate_prepare_backward_and_unwrap(mixed_precision, fresh_accelerate_state):
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    m = torch.nn.Linear(4, 2)
    ref = copy.deepcopy(m)
    dp, opt = accelerator.prepare(dpfast.DataParallel(m, ["cpu"] * 3), torch.optim.SGD(m.parameters(), lr=0.1))
    assert accelerator.unwrap_model(dp) is m
    x = torch.randn(7, 4)
    out = dp(x)  # prepare() wraps forward in autocast (and casts the output to float32): every replica runs under it
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed_precision == "bf16"):
        expected = ref(x).float()
    torch.testing.assert_close(out, expected)
    accelerator.backward(out.pow(2).mean())
    expected.pow(2).mean().backward()
    tol = {"atol": 1e-2, "rtol": 1e-2} if mixed_precision == "bf16" else {}  # bf16 sums of chunks vs of the batch
    torch.testing.assert_close(m.weight.grad, ref.weight.grad, **tol)
