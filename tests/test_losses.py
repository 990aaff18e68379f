"""Tests for rlhfkit.losses against naive loops, hand-derived values, and micro-batch / DP invariance."""

from __future__ import annotations

import math

import pytest
import torch
from _gloo import run_gloo

from rlhfkit.losses import (
    aggregate,
    entropy_from_logits,
    kl_loss,
    model_logprobs,
    packed_logprobs,
    policy_loss,
    shift_to_tokens,
    token_logprobs,
    value_loss,
)
from rlhfkit.packing import (
    global_counts,
    pack_sequences,
    packed_logits,
    pad_packed,
    partition_by_token_budget,
    select_sequences,
)

MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def _batch(seed: int, num: int = 6, low: int = 2, high: int = 12, pad: int = 8):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (num,), generator=gen).tolist()
    seqs = [torch.randint(0, 40, (n,), generator=gen) for n in lengths]
    masks = []
    for n in lengths:
        prompt = int(torch.randint(1, n, (1,), generator=gen))
        masks.append(torch.arange(n) >= prompt)
    return pack_sequences(seqs, loss_masks=masks, pad_to_multiple_of=pad), gen


def _tokens(batch, gen, scale=1.0, dtype=torch.float64):
    return (torch.randn(batch.num_tokens, generator=gen, dtype=dtype) * scale)


def _segments(batch):
    cu = batch.cu_seqlens.tolist()
    return [range(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


# ------------------------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("temperature,chunk_size", [(1.0, None), (0.7, 3), (1.3, 1), (1.0, 100)])
def test_token_logprobs_and_gradients_match_log_softmax(dtype, temperature, chunk_size):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(11, 37, generator=gen) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 37, (11,), generator=gen)
    weights = torch.randn(11, generator=gen)
    got = token_logprobs(logits, labels, temperature=temperature, chunk_size=chunk_size)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    reference = torch.log_softmax(logits.double() / temperature, -1).gather(1, labels[:, None])[:, 0]
    torch.testing.assert_close(got.double(), reference, atol=1e-5, rtol=1e-5)
    (grad,) = torch.autograd.grad((got * weights).sum(), logits)
    (want,) = torch.autograd.grad((reference * weights.double()).sum(), logits)
    assert grad.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(grad.double(), want.double(), atol=tol, rtol=tol)


def test_inplace_backward_gives_same_gradient_and_reuses_logits_memory():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(9, 13, generator=gen, requires_grad=True)
    labels = torch.randint(0, 13, (9,), generator=gen)
    (want,) = torch.autograd.grad(token_logprobs(base * 2, labels, chunk_size=4).sum(), base)
    logits = base * 2  # a non-leaf, like a model's output
    lp = token_logprobs(logits, labels, chunk_size=4, inplace_backward=True)
    seen = []
    logits.register_hook(lambda g: seen.append(g.data_ptr()))
    (grad,) = torch.autograd.grad(lp.sum(), base)
    torch.testing.assert_close(grad, want)
    assert seen == [logits.data_ptr()], "the gradient should live in the logits' own memory"
    # A consumer of the same logits whose backward runs later notices the overwrite instead of using corrupted
    # values (autograd runs backward nodes in reverse creation order: sin was recorded first, so it runs last).
    logits = base * 2
    total = logits.sin().sum() + token_logprobs(logits, labels, inplace_backward=True).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        total.backward()


def test_no_full_float32_tensor_is_saved_for_backward():
    vocab, rows = 1000, 64
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,))
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tensor.numel()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(logits, labels, chunk_size=8).sum()
        entropy_from_logits(logits, chunk_size=8).sum()
    big_float32 = [s for s in saved if s[0] == torch.float32 and s[1] >= rows * vocab // 4]
    assert big_float32 == [] and (torch.bfloat16, rows * vocab) in saved


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_and_gradient_match_naive(temperature):
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(10, 23, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    weights = torch.randn(10, generator=gen, dtype=torch.float64)
    got = entropy_from_logits(logits, temperature=temperature, chunk_size=3)
    logp = torch.log_softmax(logits / temperature, -1)
    reference = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(got.double(), reference, atol=1e-6, rtol=1e-6)
    (grad,) = torch.autograd.grad((got * weights).sum(), logits)
    (want,) = torch.autograd.grad((reference * weights).sum(), logits)
    torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-6)
    uniform = entropy_from_logits(torch.zeros(2, 50))
    torch.testing.assert_close(uniform, torch.full((2,), math.log(50.0)))


def test_packed_logprobs_match_per_sequence_loop():
    batch, gen = _batch(3)
    logits = torch.randn(batch.num_tokens, 40, generator=gen, dtype=torch.float64)
    got = packed_logprobs(logits, batch, temperature=0.9, chunk_size=5)
    want = torch.zeros(batch.num_tokens, dtype=torch.float64)
    for segment in _segments(batch):
        for t in list(segment)[1:]:
            want[t] = torch.log_softmax(logits[t - 1] / 0.9, -1)[batch.input_ids[t]]
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    assert bool((got[batch.cu_seqlens[:-1].long()] == 0).all()) and bool((got[int(batch.cu_seqlens[-1]):] == 0).all())


def test_shift_to_tokens_hand_derived():
    batch = pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], pad_to_multiple_of=7)
    rows = torch.tensor([10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0])
    assert shift_to_tokens(rows, batch).tolist() == [0.0, 10.0, 11.0, 0.0, 13.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="per_row must be a \\[T\\] tensor with T=7"):
        shift_to_tokens(rows[:5], batch)


def test_logprob_bad_inputs():
    logits = torch.randn(4, 5)
    with pytest.raises(ValueError, match="labels has 3 entries but logits has 4 rows"):
        token_logprobs(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, 5\)"):
        token_logprobs(logits, torch.tensor([0, 1, 5, 2]))
    with pytest.raises(ValueError, match="labels must be a \\[T\\] int64"):
        token_logprobs(logits, torch.zeros(4))
    with pytest.raises(ValueError, match="logits must be a floating \\[T, V\\]"):
        token_logprobs(torch.randn(4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs(logits, torch.zeros(4, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="chunk_size=0"):
        entropy_from_logits(logits, chunk_size=0)
    batch = pack_sequences([torch.tensor([1, 2, 3])])
    with pytest.raises(ValueError, match="logits has 4 rows but batch has 3 tokens"):
        packed_logprobs(logits, batch)


def _poison_outside_the_loss(batch, vocab: int) -> torch.Tensor:
    """``[T, V]``: zero, but NaN / +inf / a row of -inf on logits rows whose prediction no loss reads (rows that
    predict a prompt token, and the padding tail)."""
    mask = batch.loss_mask
    rows = [t for t in range(batch.num_tokens - 1) if not mask[t + 1]] + [batch.num_tokens - 1]
    poison = torch.zeros(batch.num_tokens, vocab)
    poison[rows[0], 3] = math.nan
    poison[rows[1], 5] = math.inf
    poison[rows[2]] = -math.inf
    poison[rows[3:], 7] = math.nan
    return poison


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("temperature,chunk_size", [(1.0, None), (0.7, None), (1.0, 1), (0.7, 3)])
def test_non_finite_logits_outside_the_loss_mask_never_reach_the_parameters(temperature, chunk_size,
                                                                            inplace_backward):
    """Regression (issue 50 item 9): a NaN or inf logit on a row no loss reads (a prompt row, padding) made the
    head's gradient NaN through the log-softmax backward (0 * NaN). Now the parameters' gradients are finite and
    equal, bit for bit, those with finite logits there; for log-probs (one chunk or several, gradient in place or
    not) and entropy alike."""
    batch, gen = _batch(4, pad=8)
    hidden = torch.randn(batch.num_tokens, 8, generator=gen)
    old = -torch.rand(batch.num_tokens, generator=gen)
    advantages = torch.randn(batch.num_tokens, generator=gen)
    poison = _poison_outside_the_loss(batch, 40)
    grads = []
    for extra in (torch.zeros_like(poison), poison):
        head = torch.randn(8, 40, generator=torch.Generator().manual_seed(9), requires_grad=True)
        logits = hidden @ head + extra
        logprobs = packed_logprobs(logits, batch, temperature=temperature, chunk_size=chunk_size,
                                   inplace_backward=inplace_backward)
        loss, _ = policy_loss(logprobs, old, advantages, batch.loss_mask, batch.cu_seqlens)
        (grad,) = torch.autograd.grad(loss, head)
        logits = hidden @ head + extra
        entropy = shift_to_tokens(entropy_from_logits(logits, temperature=temperature, chunk_size=chunk_size), batch)
        (entropy_grad,) = torch.autograd.grad(aggregate(entropy, batch.loss_mask, batch.cu_seqlens), head)
        grads.append((grad, entropy_grad))
    for clean, dirty in zip(grads[0], grads[1], strict=True):
        assert torch.isfinite(dirty).all() and clean.abs().sum() > 0
        assert torch.equal(dirty, clean)


@pytest.mark.parametrize("return_entropy", [False, True])
def test_model_logprobs_gradient_ignores_a_nan_logit_on_a_prompt_row(tiny_llama_path, return_entropy):
    """Regression (issue 50 item 9): a real model whose head gives NaN / inf on prompt rows; every parameter's
    gradient of a policy loss (plus entropy) equals the one with finite logits there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, attn_implementation="sdpa", dtype=torch.float32)
    gen = torch.Generator().manual_seed(12)
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (9, 5, 12)]
    masks = [torch.arange(len(s)) >= p for s, p in zip(seqs, (4, 2, 6), strict=True)]
    batch = pack_sequences(seqs, loss_masks=masks, pad_to_multiple_of=8)
    old = -torch.rand(batch.num_tokens, generator=gen)
    advantages = torch.randn(batch.num_tokens, generator=gen)
    poison = _poison_outside_the_loss(batch, model.config.vocab_size)
    grads = []
    for extra in (torch.zeros_like(poison), poison):
        hook = model.lm_head.register_forward_hook(lambda _module, _args, out, extra=extra: out + extra)
        model.zero_grad()
        out = model_logprobs(model, batch, return_entropy=return_entropy)
        logprobs, entropy = out if return_entropy else (out, torch.zeros(batch.num_tokens))
        loss, _ = policy_loss(logprobs, old, advantages, batch.loss_mask, batch.cu_seqlens)
        (loss - 0.01 * aggregate(entropy, batch.loss_mask, batch.cu_seqlens)).backward()
        hook.remove()
        grads.append({name: param.grad.clone() for name, param in model.named_parameters()})
    for name, clean in grads[0].items():
        assert torch.isfinite(grads[1][name]).all(), name
        torch.testing.assert_close(grads[1][name], clean, rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------------ real tiny models


def _padded_reference(model, batch, temperature=1.0):
    """Per-sequence log-probs from an ordinary right-padded forward, scattered back to the packed layout."""
    ids = pad_packed(batch.input_ids, batch.cu_seqlens)
    attention = pad_packed(torch.ones_like(batch.input_ids), batch.cu_seqlens)
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
    out = torch.zeros(batch.num_tokens, dtype=logp.dtype, device=logp.device)
    for i, segment in enumerate(_segments(batch)):
        n = len(segment)
        out[segment.start + 1: segment.stop] = logp[i, : n - 1]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_logprobs_packed_equal_padded_values_and_gradients(arch, tiny_llama_path, tiny_qwen2_path):
    from transformers import AutoModelForCausalLM

    path = tiny_llama_path if arch == "llama" else tiny_qwen2_path
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (9, 3, 14, 6)]
    masks = [torch.arange(len(s)) >= 2 for s in seqs]
    batch = pack_sequences(seqs, loss_masks=masks, pad_to_multiple_of=8)
    weights = torch.randn(batch.num_tokens, generator=gen) * batch.loss_mask
    for temperature in (1.0, 0.8):
        model.zero_grad()
        packed = model_logprobs(model, batch, temperature=temperature)
        (packed * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        padded = _padded_reference(model, batch, temperature)
        (padded * weights).sum().backward()
        torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)
    logprobs, entropy = model_logprobs(model, batch, return_entropy=True)
    with torch.no_grad():
        logits = model(input_ids=seqs[2][None], use_cache=False).logits[0]
    start = int(batch.cu_seqlens[2])
    want = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(entropy[start + 1: start + len(seqs[2])], want[:-1], atol=1e-5, rtol=1e-5)
    assert entropy[start] == 0 and bool((entropy[int(batch.cu_seqlens[-1]):] == 0).all())


class _NoLogitsToKeep(torch.nn.Module):
    """A wrapper whose forward does not take ``logits_to_keep``: packed_logits must compute every row and index."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, input_ids, position_ids, attention_mask=None, use_cache=False):
        return self.inner(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                          use_cache=use_cache)


def test_model_logprobs_on_loss_tokens_only_equal_full_and_run_the_head_on_those_rows(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, attn_implementation="sdpa", dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (9, 3, 14, 6)]
    masks = [torch.arange(len(s)) >= p for s, p in zip(seqs, (4, 1, 9, 2), strict=True)]
    batch = pack_sequences(seqs, loss_masks=masks, pad_to_multiple_of=8)
    mask = batch.loss_mask
    weights = torch.randn(batch.num_tokens, generator=gen) * mask
    head_rows = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _out: head_rows.append(args[0].shape[1]))
    results = {}
    wrapped = _NoLogitsToKeep(model)
    for name, target, only in (("full", model, False), ("loss", model, True), ("wrapped", wrapped, True)):
        model.zero_grad()
        logprobs, entropy = model_logprobs(target, batch, temperature=0.8, return_entropy=True,
                                           loss_tokens_only=only)
        ((logprobs + 0.1 * entropy) * weights).sum().backward()
        results[name] = (logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    hook.remove()
    assert head_rows == [batch.num_tokens, int(mask.sum()), batch.num_tokens]  # K rows through the head, else T
    full_lp, full_ent, full_grads = results["full"]
    for name in ("loss", "wrapped"):
        logprobs, entropy, grads = results[name]
        torch.testing.assert_close(logprobs[mask], full_lp[mask], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[mask], full_ent[mask], atol=1e-5, rtol=1e-5)
        assert bool((logprobs[~mask] == 0).all()) and bool((entropy[~mask] == 0).all())
        for param, grad in grads.items():
            torch.testing.assert_close(grad, full_grads[param], atol=1e-5, rtol=1e-4, msg=param)
    with pytest.raises(ValueError, match="rows must be a"):
        packed_logits(model, batch, rows=torch.tensor([0.5]))


# ----------------------------------------------------------------------------------------- aggregation


def _naive_aggregate(x, batch, mode, num_tokens=None, num_seqs=None):
    mask = batch.loss_mask
    if mode == "token_mean":
        total = sum(x[t] for t in range(len(x)) if mask[t])
        return total / (num_tokens or int(mask.sum()))
    per_seq = []
    for segment in _segments(batch):
        tokens = [t for t in segment if mask[t]]
        if tokens:
            s = sum(x[t] for t in tokens)
            per_seq.append(s / len(tokens) if mode == "seq_mean_token_mean" else s)
    return sum(per_seq) / (num_seqs or len(per_seq))


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_naive(mode):
    batch, gen = _batch(7)
    x = _tokens(batch, gen)
    x[~batch.loss_mask] = float("nan")  # outside the mask nothing leaks, not even NaN
    got = aggregate(x, batch.loss_mask, batch.cu_seqlens, mode=mode)
    torch.testing.assert_close(got, torch.as_tensor(_naive_aggregate(x, batch, mode), dtype=got.dtype))
    got = aggregate(x, batch.loss_mask, batch.cu_seqlens, mode=mode, num_tokens=100.0, num_seqs=20.0)
    want = _naive_aggregate(x, batch, mode, num_tokens=100.0, num_seqs=20.0)
    torch.testing.assert_close(got, torch.as_tensor(want, dtype=got.dtype))


def test_aggregate_hand_derived_and_empty_mask():
    batch = pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, 5])],
                           loss_masks=[torch.tensor([False, True, True]), torch.tensor([False, True])])
    x = torch.tensor([9.0, 1.0, 3.0, 9.0, 5.0])
    assert aggregate(x, batch.loss_mask, batch.cu_seqlens, mode="token_mean").item() == pytest.approx(3.0)
    assert aggregate(x, batch.loss_mask, batch.cu_seqlens, mode="seq_mean_token_mean").item() == pytest.approx(3.5)
    assert aggregate(x, batch.loss_mask, batch.cu_seqlens, mode="seq_mean_token_sum").item() == pytest.approx(4.5)
    x = torch.randn(5, requires_grad=True)
    empty = aggregate(x, torch.zeros(5, dtype=torch.bool), batch.cu_seqlens, mode="seq_mean_token_mean")
    assert empty.item() == 0.0
    empty.backward()
    assert torch.equal(x.grad, torch.zeros(5))


def _micro_batches(batch, num_micro_batches):
    bins = partition_by_token_budget(batch.seq_lens.tolist(), num_micro_batches=num_micro_batches)
    return [select_sequences(batch, b) for b in bins]


def _assert_microbatch_invariant(batch, leaves, loss_fn, num_micro_batches=3):
    """loss_fn(sub_batch, index, num_tokens, num_seqs) -> scalar; compare summed micro-batch grads to whole batch."""
    num_tokens, num_seqs = global_counts(batch)
    whole_index = torch.arange(batch.num_tokens)
    whole = loss_fn(batch, whole_index, None, None)
    want = torch.autograd.grad(whole, leaves)
    total = 0.0
    grads = [torch.zeros_like(leaf) for leaf in leaves]
    for sub, index in _micro_batches(batch, num_micro_batches):
        loss = loss_fn(sub, index, num_tokens, num_seqs)
        total = total + loss.detach()
        for acc, grad in zip(grads, torch.autograd.grad(loss, leaves, allow_unused=True)):
            if grad is not None:
                acc += grad
    torch.testing.assert_close(total, whole.detach(), atol=1e-6, rtol=1e-6)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_microbatch_invariance(mode):
    batch, gen = _batch(8, num=9)
    x = _tokens(batch, gen).requires_grad_()
    _assert_microbatch_invariant(
        batch, [x], lambda b, i, nt, ns: aggregate(x[i].square(), b.loss_mask, b.cu_seqlens, mode=mode,
                                                   num_tokens=nt, num_seqs=ns))


POLICY_CASES = [
    dict(),
    dict(clip_low=0.1, clip_high=0.28),
    dict(dual_clip=3.0),
    dict(ratio_level="sequence", clip_low=3e-2, clip_high=4e-2),
    dict(mismatch="tis", mismatch_threshold=1.5),
    dict(mismatch="token_mask", mismatch_threshold=1.3),
    dict(mismatch="seq_mask", mismatch_threshold=1.1),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", POLICY_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "ppo")
def test_policy_loss_microbatch_and_dp_invariance(mode, case):
    batch, gen = _batch(9, num=10)
    logprobs = (-_tokens(batch, gen).abs() - 0.5).requires_grad_()
    old = logprobs.detach() + _tokens(batch, gen, 0.4)
    advantages = _tokens(batch, gen)
    engine = (old + _tokens(batch, gen, 0.3)).clamp(max=0.0)  # engine log-probs are <= 0 (checked)

    def loss_fn(b, i, nt, ns):
        return policy_loss(logprobs[i], old[i], advantages[i], b.loss_mask, b.cu_seqlens, engine_logprobs=engine[i],
                           aggregation=mode, num_tokens=nt, num_seqs=ns, **case)[0]

    _assert_microbatch_invariant(batch, [logprobs], loss_fn)


@pytest.mark.parametrize("mode", MODES)
def test_value_and_kl_loss_microbatch_invariance(mode):
    batch, gen = _batch(10, num=8)
    values = _tokens(batch, gen).requires_grad_()
    old_values, returns = _tokens(batch, gen), _tokens(batch, gen)
    logprobs = (-_tokens(batch, gen).abs()).requires_grad_()
    ref = -_tokens(batch, gen).abs()

    def loss_fn(b, i, nt, ns):
        v = value_loss(values[i], old_values[i], returns[i], b.loss_mask, b.cu_seqlens, clip=0.3, aggregation=mode,
                       num_tokens=nt, num_seqs=ns)[0]
        k = kl_loss(logprobs[i], ref[i], b.loss_mask, b.cu_seqlens, estimator="k3", aggregation=mode,
                    num_tokens=nt, num_seqs=ns)[0]
        return v + k

    _assert_microbatch_invariant(batch, [values, logprobs], loss_fn)


# ------------------------------------------------------------------------------- losses vs naive loops


def _naive_policy_token(lp, old, adv, eng, seq_log_ratio, *, clip_low=0.2, clip_high=0.2, dual_clip=None,
                        ratio_level="token", mismatch="none", mismatch_threshold=2.0, seq_engine_log_ratio=0.0):
    ratio = math.exp(seq_log_ratio if ratio_level == "sequence" else lp - old)
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - clip_low), 1 + clip_high))
    if dual_clip is not None and adv < 0:
        loss = min(loss, -adv * dual_clip)
    w = math.exp(old - eng)
    if mismatch == "tis":
        loss *= min(w, mismatch_threshold)
    elif mismatch == "token_mask" and not 1 / mismatch_threshold <= w <= mismatch_threshold:
        loss = 0.0
    elif mismatch == "seq_mask" and not 1 / mismatch_threshold <= math.exp(seq_engine_log_ratio) <= mismatch_threshold:
        loss = 0.0
    return loss


@pytest.mark.parametrize("case", POLICY_CASES + [dict(dual_clip=1.5, clip_high=0.5)],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "ppo")
def test_policy_loss_matches_naive_loop(case):
    batch, gen = _batch(11, num=7)
    lp = -_tokens(batch, gen).abs() - 0.3
    old = lp + _tokens(batch, gen, 0.5)
    adv = _tokens(batch, gen)
    eng = (old + _tokens(batch, gen, 0.3)).clamp(max=0.0)  # engine log-probs are <= 0 (checked)
    mask = batch.loss_mask
    per_token = torch.zeros(batch.num_tokens, dtype=torch.float64)
    for segment in _segments(batch):
        tokens = [t for t in segment if mask[t]]
        seq_lr = sum(float(lp[t] - old[t]) for t in tokens) / max(len(tokens), 1)
        seq_eng = sum(float(old[t] - eng[t]) for t in tokens) / max(len(tokens), 1)
        for t in tokens:
            per_token[t] = _naive_policy_token(float(lp[t]), float(old[t]), float(adv[t]), float(eng[t]), seq_lr,
                                               seq_engine_log_ratio=seq_eng, **case)
    for mode in MODES:
        loss, stats = policy_loss(lp, old, adv, mask, batch.cu_seqlens, engine_logprobs=eng, aggregation=mode,
                                  **case)
        want = _naive_aggregate(per_token, batch, mode)
        assert loss.item() == pytest.approx(float(want), abs=1e-9)
        assert stats["loss"] == pytest.approx(float(want), abs=1e-9)
    ratios = (lp - old).exp()[mask]
    if case.get("ratio_level") != "sequence":
        assert stats["ratio_min"] == pytest.approx(ratios.min().item())
        assert stats["ratio_max"] == pytest.approx(ratios.max().item())
    assert stats["approx_kl"] == pytest.approx((ratios - 1 - ratios.log()).mean().item())
    assert stats["num_loss_tokens"] == int(mask.sum())
    engine_ratio = (old - eng).exp()[mask]
    assert stats["mismatch_ratio_mean"] == pytest.approx(engine_ratio.mean().item())
    if case.get("mismatch") == "token_mask":
        expect = ((engine_ratio > 1.3) | (engine_ratio < 1 / 1.3)).double().mean().item()
        assert stats["mismatch_affected_fraction"] == pytest.approx(expect)
        assert 0 < expect < 1


def test_policy_loss_hand_derived_values_and_gradients():
    batch = pack_sequences([torch.tensor([1, 2, 3, 4, 5])], loss_masks=[torch.tensor([0, 1, 1, 1, 1]).bool()])
    old = torch.zeros(5, dtype=torch.float64)
    lp = torch.tensor([0.0, math.log(1.5), math.log(0.5), math.log(5.0), math.log(1.1)], dtype=torch.float64)
    adv = torch.tensor([0.0, 1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    lp.requires_grad_()
    loss, stats = policy_loss(lp, old, adv, batch.loss_mask, batch.cu_seqlens, dual_clip=3.0,
                              aggregation="seq_mean_token_sum")
    # token 1: A=1, r=1.5 -> clipped at 1.2: loss -1.2, no gradient
    # token 2: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8 (clipped), no gradient
    # token 3: A=-1, r=5 -> max(5, 1.2) = 5, dual clip caps at 3, no gradient
    # token 4: A=1, r=1.1 -> -1.1 unclipped, d/dlp = -r = -1.1
    assert loss.item() == pytest.approx(-1.2 + 0.8 + 3.0 - 1.1)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, 0.0, 0.0, 0.0, -1.1], dtype=torch.float64))
    assert stats["clip_fraction"] == pytest.approx(2 / 4)
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 4)
    assert stats["ratio_max"] == pytest.approx(5.0) and stats["ratio_min"] == pytest.approx(0.5)


def test_gspo_gradient_equals_sequence_objective():
    """GSPO with a sequence advantage: grad equals that of min(s A, clip(s) A), s = exp(mean log-ratio)."""
    batch, gen = _batch(12, num=5)
    lp = (-_tokens(batch, gen).abs()).requires_grad_()
    old = lp.detach() + _tokens(batch, gen, 0.02)
    seq_adv = torch.randn(5, generator=gen, dtype=torch.float64)
    adv = torch.zeros(batch.num_tokens, dtype=torch.float64)
    objective = 0.0
    segments = _segments(batch)
    for i, segment in enumerate(segments):
        tokens = [t for t in segment if batch.loss_mask[t]]
        adv[tokens] = seq_adv[i]
        s = torch.exp(torch.stack([lp[t] - old[t] for t in tokens]).mean())
        objective = objective + torch.maximum(-seq_adv[i] * s, -seq_adv[i] * s.clamp(1 - 0.01, 1 + 0.01))
    objective = objective / len(segments)
    loss, _ = policy_loss(lp, old, adv, batch.loss_mask, batch.cu_seqlens, ratio_level="sequence", clip_low=0.01,
                          clip_high=0.01, aggregation="seq_mean_token_mean")
    torch.testing.assert_close(loss, objective)
    torch.testing.assert_close(torch.autograd.grad(loss, lp)[0], torch.autograd.grad(objective, lp)[0])


def test_value_and_kl_loss_match_naive():
    batch, gen = _batch(13, num=6)
    mask = batch.loss_mask
    values, old, returns = _tokens(batch, gen), _tokens(batch, gen), _tokens(batch, gen)
    for clip in (None, 0.25):
        per_token = torch.zeros(batch.num_tokens, dtype=torch.float64)
        clipped = 0
        for t in range(batch.num_tokens):
            if mask[t]:
                error = (values[t] - returns[t]) ** 2
                if clip is not None:
                    v_clip = old[t] + min(max(values[t] - old[t], -clip), clip)
                    clipped += int((v_clip - returns[t]) ** 2 > error)
                    error = max(error, (v_clip - returns[t]) ** 2)
                per_token[t] = 0.5 * error
        loss, stats = value_loss(values, old, returns, mask, batch.cu_seqlens, clip=clip)
        assert loss.item() == pytest.approx(_naive_aggregate(per_token, batch, "token_mean").item())
        assert stats["value_clip_fraction"] == pytest.approx(clipped / int(mask.sum()))
    r, v = returns[mask], values[mask]
    explained = 1 - (r - v).var(unbiased=False) / r.var(unbiased=False)
    assert stats["explained_variance"] == pytest.approx(explained.item())
    lp, ref = -_tokens(batch, gen).abs(), -_tokens(batch, gen).abs()
    naive = {"k1": lambda d: d, "k2": lambda d: 0.5 * d * d, "k3": lambda d: math.exp(-d) - 1 + d}
    for estimator, fn in naive.items():
        per_token = torch.tensor([fn(float(lp[t] - ref[t])) if mask[t] else 0.0 for t in range(batch.num_tokens)],
                                 dtype=torch.float64)
        for mode in MODES:
            loss, stats = kl_loss(lp, ref, mask, batch.cu_seqlens, estimator=estimator, aggregation=mode)
            assert loss.item() == pytest.approx(_naive_aggregate(per_token, batch, mode).item())
        assert stats["kl_max"] == pytest.approx(per_token[mask].max().item())


# ----------------------------------------------------------------------------------------- bad input


def test_loss_bad_inputs_name_the_argument():
    batch, gen = _batch(14, num=3)
    mask, cu = batch.loss_mask, batch.cu_seqlens
    lp, old, adv = _tokens(batch, gen), _tokens(batch, gen), _tokens(batch, gen)
    with pytest.raises(ValueError, match=r"old_logprobs has 3 entries but mask has \d+"):
        policy_loss(lp, old[:3], adv, mask, cu)
    with pytest.raises(ValueError, match=r"advantages must be a \[T\] floating tensor"):
        policy_loss(lp, old, adv[None], mask, cu)
    with pytest.raises(ValueError, match=r"mask must be a \[T\] bool tensor"):
        policy_loss(lp, old, adv, mask.float(), cu)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        policy_loss(lp, old, adv, mask, cu + 1)
    with pytest.raises(ValueError, match="exceeds the"):
        policy_loss(lp, old, adv, mask, torch.tensor([0, batch.num_tokens + 1], dtype=torch.int32))
    bad = lp.clone()
    bad[mask.nonzero()[0]] = float("nan")
    with pytest.raises(ValueError, match="logprobs contain NaN or inf on loss tokens"):
        policy_loss(bad, old, adv, mask, cu)
    bad_engine = old.clone()
    bad_engine[mask.nonzero()[0]] = -float("inf")
    with pytest.raises(ValueError, match="engine_logprobs contain NaN or inf"):
        policy_loss(lp, old, adv, mask, cu, engine_logprobs=bad_engine, mismatch="tis")
    outside = lp.clone()
    outside[~mask] = float("nan")  # NaN outside the loss is fine
    assert math.isfinite(policy_loss(outside, old, adv, mask, cu)[0].item())
    with pytest.raises(ValueError, match="mismatch='tis' needs engine_logprobs"):
        policy_loss(lp, old, adv, mask, cu, mismatch="tis")
    for kwargs, message in [(dict(clip_low=1.0), "clip_low=1.0"), (dict(clip_high=-0.1), "clip_high=-0.1"),
                            (dict(dual_clip=1.0), "dual_clip=1.0"), (dict(ratio_level="seq"), "ratio_level='seq'"),
                            (dict(mismatch="is"), "mismatch='is'"), (dict(aggregation="mean"), "aggregation='mean'"),
                            (dict(mismatch_threshold=1.0), "mismatch_threshold=1.0"),
                            (dict(num_tokens=0), "num_tokens=0"), (dict(num_tokens=1.0), "num_tokens=1.0 is less"),
                            (dict(aggregation="seq_mean_token_mean", num_seqs=1), "num_seqs=1.0 is less")]:
        with pytest.raises(ValueError, match=message):
            policy_loss(lp, old, adv, mask, cu, **kwargs)
    with pytest.raises(ValueError, match="clip=0"):
        value_loss(lp, old, adv, mask, cu, clip=0)
    with pytest.raises(ValueError, match="returns has 2 entries"):
        value_loss(lp, old, adv[:2], mask, cu)
    with pytest.raises(ValueError, match="estimator='k4'"):
        kl_loss(lp, old, mask, cu, estimator="k4")
    with pytest.raises(ValueError, match="mode='sum'"):
        aggregate(lp, mask, cu, mode="sum")
    with pytest.raises(ValueError, match="describes no sequence"):
        aggregate(torch.zeros(0), torch.zeros(0, dtype=torch.bool), torch.tensor([0], dtype=torch.int32))
    padded_mask = mask.clone()
    padded_mask[-1] = True
    with pytest.raises(ValueError, match="mask is True after cu_seqlens"):
        aggregate(lp, padded_mask, cu)


# ------------------------------------------------------------------------------ real 2-process DP check


def _dp_worker(rank: int, world: int):
    import torch.distributed as dist

    batch, logprobs, old, adv = _dp_problem()
    shard, index = select_sequences(batch, list(range(rank, batch.num_seqs, world)))
    num_tokens, num_seqs = global_counts(shard, group=dist.group.WORLD)
    local = logprobs.detach()[index].requires_grad_()
    loss, _ = policy_loss(local, old[index], adv[index], shard.loss_mask, shard.cu_seqlens, dual_clip=3.0,
                          aggregation="seq_mean_token_mean", num_tokens=num_tokens, num_seqs=num_seqs)
    loss.backward()
    grad = torch.zeros(batch.num_tokens, dtype=torch.float64)
    grad[index] = local.grad
    dist.all_reduce(grad)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return grad, float(total)


def _dp_problem():
    batch, gen = _batch(15, num=8)
    logprobs = -_tokens(batch, gen).abs()
    return batch, logprobs, logprobs + _tokens(batch, gen, 0.5), _tokens(batch, gen)


def test_dp_sharded_gradients_over_two_gloo_processes_equal_whole_batch():
    batch, logprobs, old, adv = _dp_problem()
    logprobs.requires_grad_()
    whole, _ = policy_loss(logprobs, old, adv, batch.loss_mask, batch.cu_seqlens, dual_clip=3.0,
                           aggregation="seq_mean_token_mean")
    whole.backward()
    results = run_gloo(_dp_worker, 2)
    for grad, total in results:
        torch.testing.assert_close(grad, logprobs.grad, atol=1e-9, rtol=1e-9)
        assert total == pytest.approx(whole.item(), abs=1e-12)


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_token_logprobs_peak_memory_on_gpu():
    rows, vocab = 2048, 151_936
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    token_logprobs(logits, labels).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    logits_bytes = rows * vocab * 2
    # the gradient buffer (bf16, same size as the logits) plus a float32 chunk or two of 16M elements
    assert extra <= logits_bytes + 3 * (1 << 24) * 4, extra / logits_bytes


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "rlhfkit_varlen_sdpa"])
def test_model_logprobs_packed_equal_padded_on_gpu(attn, tiny_qwen2_path):
    from transformers import AutoModelForCausalLM

    from rlhfkit.packing import register_varlen_attention

    register_varlen_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_path, attn_implementation=attn,
                                                 dtype=torch.float32).cuda()
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (9, 3, 14, 6)]
    batch = pack_sequences(seqs, loss_masks=[torch.arange(len(s)) >= 2 for s in seqs], pad_to_multiple_of=8)
    batch = batch.to("cuda")
    packed = model_logprobs(model, batch)
    reference = _padded_reference(model, batch)
    torch.testing.assert_close(packed, reference.to(packed.device), atol=1e-4, rtol=1e-4)


def test_masked_out_nan_never_reaches_a_gradient_of_any_masked_reduction():
    """Sibling of the whiten defect (review): NaN/inf outside the loss mask must not poison gradients of aggregate,
    policy_loss (token and sequence ratio), value_loss and kl_loss; gradients equal those with zeros there."""
    from rlhfkit.losses import aggregate, kl_loss, value_loss

    cu = torch.tensor([0, 4, 8])
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    gen = torch.Generator().manual_seed(3)
    ref = -torch.rand(8, dtype=torch.float64, generator=gen)
    ones = torch.ones(8, dtype=torch.float64)
    clean = torch.randn(8, dtype=torch.float64, generator=gen)
    clean[~mask] = 0.0
    losses = {
        "aggregate": lambda x: aggregate(x, mask, cu, mode="seq_mean_token_mean"),
        "policy_token": lambda x: policy_loss(-x.abs(), ref, ones, mask, cu)[0],
        "policy_sequence": lambda x: policy_loss(-x.abs(), ref, ones, mask, cu, ratio_level="sequence")[0],
        "value": lambda x: value_loss(x, clean + 0.01, ones, mask, cu, clip=0.2)[0],
        "kl": lambda x: kl_loss(-x.abs(), ref, mask, cu, estimator="k3")[0],
    }
    dirty = clean.clone()
    dirty[0], dirty[3], dirty[4] = math.nan, math.inf, -math.inf
    for name, loss in losses.items():
        grads = []
        for values in (clean, dirty):
            leaf = values.clone().requires_grad_()
            loss(leaf).backward()
            grads.append(leaf.grad)
        assert torch.isfinite(grads[1]).all(), (name, grads[1])
        torch.testing.assert_close(grads[1], grads[0], msg=name)
        assert grads[1][mask].abs().sum() > 0, name


def test_losses_raise_when_the_result_overflows_although_inputs_are_finite():
    """Review defect: policy_loss returned -inf for huge (finite) advantages without an error. The result of every
    loss is checked; the error names what overflowed and the fix. Siblings: value_loss, kl_loss, aggregate."""
    from rlhfkit.losses import aggregate, kl_loss, value_loss

    cu = torch.tensor([0, 4])
    mask = torch.tensor([False, True, True, True])
    logprobs = torch.tensor([0.0, -0.1, -0.2, -0.3])
    cases = [
        (lambda: policy_loss(logprobs, logprobs - 0.1, torch.full((4,), 3e38), mask, cu),
         r"policy_loss is -inf although its inputs are finite: the loss overflowed torch\.float32.*max \|advantages\| "
         r"on loss tokens = 3e\+38, ratio max = 1\.11\. Normalise or clip the advantages"),
        (lambda: policy_loss(logprobs, logprobs, torch.full((4,), 2e38), mask, cu),  # each term finite, the sum not
         r"policy_loss is -inf .*-A \* ratio, or its sum"),
        (lambda: value_loss(torch.full((4,), 1e20), torch.zeros(4), torch.zeros(4), mask, cu),
         r"value_loss is inf .*max \|values\| = 1e\+20.*Scale the rewards/returns down"),
        (lambda: kl_loss(torch.full((4,), -200.0), torch.zeros(4), mask, cu, clamp=None),
         r"kl_loss is inf .*max \|logprobs - ref_logprobs\| on loss tokens = 200, clamp=None\. Keep a clamp"),
        (lambda: aggregate(torch.full((4,), 3e38), mask, cu),
         r"aggregate: the token_mean of per_token is inf .*the sum overflowed torch\.float32"),
    ]
    for build, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            build()
    loss, stats = policy_loss(logprobs, logprobs - 0.1, torch.full((4,), 1e30), mask, cu)  # large but representable
    assert math.isfinite(stats["loss"]) and stats["loss"] < -1e30
