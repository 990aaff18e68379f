"""Tests for rlhfkit.packing: layout, round trips, selection, partitioning, global counts, packed HF forwards."""

from __future__ import annotations

import random

import pytest
import torch
from _gloo import run_gloo

from rlhfkit.packing import (
    VARLEN_ATTENTION,
    global_counts,
    pack_rollouts,
    pack_sequences,
    packed_logits,
    pad_packed,
    partition_by_token_budget,
    register_varlen_attention,
    select_sequences,
    unpack,
    unpad_to_packed,
)
from rlhfkit.types import PackedBatch, Rollout


def _random_sequences(seed: int, num: int = 5, low: int = 1, high: int = 9, vocab: int = 50):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (num,), generator=gen).tolist()
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    masks = [torch.rand(n, generator=gen) > 0.4 for n in lengths]
    for mask in masks:
        mask[0] = False
    return seqs, masks


# ----------------------------------------------------------------------------------------------- layout


def test_pack_sequences_hand_derived_layout():
    batch = pack_sequences([torch.tensor([5, 6, 7]), torch.tensor([8, 9])],
                           loss_masks=[torch.tensor([False, True, True]), torch.tensor([False, True])],
                           pad_to_multiple_of=4, pad_token_id=99)
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 99, 99, 99]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == [0, 3, 5]
    assert batch.loss_mask.tolist() == [False, True, True, False, True, False, False, False]
    assert batch.num_padding_tokens == 3


def test_pack_sequences_no_padding_when_already_multiple_and_default_mask():
    batch = pack_sequences([torch.tensor([1, 2]), torch.tensor([3, 4])], pad_to_multiple_of=2)
    assert batch.num_tokens == 4 and batch.num_padding_tokens == 0
    assert not batch.loss_mask.any()


def test_pack_matches_naive_loop_and_unpack_round_trips():
    for seed in range(5):
        seqs, masks = _random_sequences(seed, num=7)
        batch = pack_sequences(seqs, loss_masks=masks, pad_to_multiple_of=8)
        # naive reference: concatenate with python loops
        ids, pos, lm, cu = [], [], [], [0]
        for s, m in zip(seqs, masks):
            ids += s.tolist()
            pos += list(range(len(s)))
            lm += m.tolist()
            cu.append(cu[-1] + len(s))
        pad = (-len(ids)) % 8
        assert batch.input_ids.tolist() == ids + [0] * pad
        assert batch.position_ids.tolist() == pos + list(range(pad))
        assert batch.loss_mask.tolist() == lm + [False] * pad
        assert batch.cu_seqlens.tolist() == cu
        for got, want in zip(unpack(batch.input_ids, batch.cu_seqlens), seqs):
            assert torch.equal(got, want)
        for got, want in zip(unpack(batch.loss_mask, batch.cu_seqlens), masks):
            assert torch.equal(got, want)


def test_pack_rollouts_masks_response_tokens():
    rollouts = [Rollout(prompt_token_ids=torch.tensor([1, 2]), response_token_ids=torch.tensor([3, 4, 5])),
                Rollout(prompt_token_ids=torch.tensor([6]), response_token_ids=torch.tensor([], dtype=torch.long)),
                Rollout(prompt_token_ids=torch.tensor([7, 8, 9]), response_token_ids=torch.tensor([10]))]
    batch = pack_rollouts(rollouts, pad_to_multiple_of=4, pad_token_id=99)
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 99, 99]
    assert batch.loss_mask.tolist() == [False, False, True, True, True, False, False, False, False, True,
                                        False, False]
    assert batch.cu_seqlens.tolist() == [0, 5, 6, 10]


@pytest.mark.parametrize("side", ["right", "left"])
def test_pad_packed_matches_loop_and_unpad_inverts(side):
    seqs, _ = _random_sequences(3, num=6)
    batch = pack_sequences(seqs, pad_to_multiple_of=16)
    values = torch.randn(batch.num_tokens, 2)
    padded = pad_packed(values, batch.cu_seqlens, padding_value=-7.0, side=side)
    max_len = max(len(s) for s in seqs)
    expected = torch.full((len(seqs), max_len, 2), -7.0)
    cu = batch.cu_seqlens.tolist()
    for i in range(len(seqs)):
        n = cu[i + 1] - cu[i]
        cols = slice(0, n) if side == "right" else slice(max_len - n, max_len)
        expected[i, cols] = values[cu[i]:cu[i + 1]]
    assert torch.equal(padded, expected)
    back = unpad_to_packed(padded, batch.seq_lens, side=side)
    assert torch.equal(back, values[: cu[-1]])


def test_pad_and_unpad_are_differentiable():
    seqs, _ = _random_sequences(4, num=4)
    batch = pack_sequences(seqs)
    values = torch.randn(batch.num_tokens, requires_grad=True)
    weights = torch.randn(len(seqs), max(len(s) for s in seqs))
    (pad_packed(values, batch.cu_seqlens) * weights).sum().backward()
    expected = torch.cat([weights[i, : len(s)] for i, s in enumerate(seqs)])
    torch.testing.assert_close(values.grad, expected)


def test_unpad_to_packed_with_wider_left_padding():
    padded = torch.tensor([[0, 0, 0, 1, 2], [0, 3, 4, 5, 6]])
    assert unpad_to_packed(padded, [2, 4], side="left").tolist() == [1, 2, 3, 4, 5, 6]
    assert unpad_to_packed(padded, [2, 4], side="right").tolist() == [0, 0, 0, 3, 4, 5]


def test_select_sequences_matches_loop():
    seqs, masks = _random_sequences(5, num=6)
    batch = pack_sequences(seqs, loss_masks=masks, pad_to_multiple_of=8)
    per_token = torch.randn(batch.num_tokens)
    indices = [4, 0, 2]
    selected, index = select_sequences(batch, indices)
    want = pack_sequences([seqs[i] for i in indices], loss_masks=[masks[i] for i in indices])
    for name in ("input_ids", "position_ids", "cu_seqlens", "loss_mask"):
        assert torch.equal(getattr(selected, name), getattr(want, name)), name
    pieces = unpack(per_token, batch.cu_seqlens)
    assert torch.equal(per_token[index], torch.cat([pieces[i] for i in indices]))
    assert index.dtype == torch.int64
    selected_t, index_t = select_sequences(batch, torch.tensor(indices))
    assert torch.equal(index_t, index) and torch.equal(selected_t.input_ids, selected.input_ids)


# ------------------------------------------------------------------------------------------- bad input


def test_bad_input_errors_name_the_argument():
    ok = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="sequences must be a non-empty"):
        pack_sequences([])
    with pytest.raises(ValueError, match=r"sequences\[1\] is empty"):
        pack_sequences([ok, torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match=r"sequences\[0\] must be a 1-D int64"):
        pack_sequences([torch.tensor([1.0, 2.0])])
    with pytest.raises(ValueError, match="loss_masks has 1 entries but sequences has 2"):
        pack_sequences([ok, ok], loss_masks=[ok > 0])
    with pytest.raises(ValueError, match=r"loss_masks\[0\] must be a bool tensor of shape \(3,\)"):
        pack_sequences([ok], loss_masks=[torch.tensor([False, True])])
    with pytest.raises(ValueError, match=r"loss_masks\[0\]\[0\] is True"):
        pack_sequences([ok], loss_masks=[torch.tensor([True, True, False])])
    with pytest.raises(ValueError, match="pad_to_multiple_of=0"):
        pack_sequences([ok], pad_to_multiple_of=0)
    with pytest.raises(ValueError, match="rollouts must be a non-empty"):
        pack_rollouts([])
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        unpack(torch.zeros(5), torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be strictly increasing.*sequence 1 has length 0"):
        pad_packed(torch.zeros(5), torch.tensor([0, 3, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=6 exceeds the 5 tokens"):
        pad_packed(torch.zeros(5), torch.tensor([0, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="describes no sequence"):
        unpack(torch.zeros(5), torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="must be a 1-D int32/int64"):
        unpack(torch.zeros(5), torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match="side='middle'"):
        pad_packed(torch.zeros(5), torch.tensor([0, 5], dtype=torch.int32), side="middle")
    with pytest.raises(ValueError, match="seq_lens has 3 entries but padded has 2 rows"):
        unpad_to_packed(torch.zeros(2, 4), [1, 2, 3])
    with pytest.raises(ValueError, match=r"seq_lens=\[1, 5\] must be in \[1, 4\]"):
        unpad_to_packed(torch.zeros(2, 4), [1, 5])
    batch = pack_sequences([ok, ok])
    with pytest.raises(ValueError, match=r"indices=\[2\] must be in \[0, 2\)"):
        select_sequences(batch, [2])
    with pytest.raises(ValueError, match="indices must be a non-empty"):
        select_sequences(batch, [])


# -------------------------------------------------------------------------------------------- partition


def _check_partition(bins, lengths, max_tokens=None):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths))), "every sequence exactly once"
    assert all(b == sorted(b) and b for b in bins)
    loads = [sum(lengths[i] for i in b) for b in bins]
    if max_tokens is not None:
        assert max(loads) <= max_tokens
    return loads


@pytest.mark.parametrize("num_seqs,num_micro_batches", [(64, 4), (64, 8), (128, 8), (256, 16), (100, 7)])
def test_partition_balance_on_realistic_lengths(num_seqs, num_micro_batches):
    for seed in range(5):
        rng = random.Random(seed)
        lengths = [rng.randint(16, 512) for _ in range(num_seqs)]
        bins = partition_by_token_budget(lengths, num_micro_batches=num_micro_batches)
        assert len(bins) == num_micro_batches
        loads = _check_partition(bins, lengths)
        assert max(loads) / (sum(loads) / len(loads)) <= 1.1


def test_partition_by_budget_uses_few_bins_and_respects_budget():
    for seed in range(5):
        rng = random.Random(seed)
        lengths = [rng.randint(16, 512) for _ in range(96)]
        for max_tokens in (1024, 4096, 8192):
            bins = partition_by_token_budget(lengths, max_tokens=max_tokens)
            loads = _check_partition(bins, lengths, max_tokens)
            lower_bound = -(-sum(lengths) // max_tokens)
            assert len(bins) <= lower_bound + 1
            assert max(loads) / (sum(loads) / len(loads)) <= 1.1
        bins = partition_by_token_budget(lengths, max_tokens=8192, num_micro_batches=10)
        assert len(bins) == 10
        _check_partition(bins, lengths, 8192)


def test_partition_hand_cases_and_errors():
    assert partition_by_token_budget([5, 5, 5, 5], num_micro_batches=2) in ([[0, 1], [2, 3]], [[0, 2], [1, 3]],
                                                                            [[0, 3], [1, 2]])
    # LPT alone gives {8,1,1}=10 vs {7,2}=9? check that the result is optimal here: loads 9 and 10 are best possible
    bins = partition_by_token_budget([8, 7, 2, 1, 1], num_micro_batches=2)
    loads = sorted(sum([8, 7, 2, 1, 1][i] for i in b) for b in bins)
    assert loads == [9, 10]
    assert partition_by_token_budget([3, 3, 3], max_tokens=6) in ([[0, 1], [2]], [[0], [1, 2]], [[0, 2], [1]])
    assert partition_by_token_budget(torch.tensor([4, 4]), max_tokens=4) == [[0], [1]]
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=9 exceeds max_tokens=8"):
        partition_by_token_budget([1, 9], max_tokens=8)
    with pytest.raises(ValueError, match="give max_tokens, num_micro_batches, or both"):
        partition_by_token_budget([1, 2])
    with pytest.raises(ValueError, match="num_micro_batches=3 exceeds the 2 sequences"):
        partition_by_token_budget([1, 2], num_micro_batches=3)
    with pytest.raises(ValueError, match="seq_lens is empty"):
        partition_by_token_budget([], num_micro_batches=1)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=0"):
        partition_by_token_budget([0, 2], num_micro_batches=1)
    with pytest.raises(ValueError, match="max_tokens=0"):
        partition_by_token_budget([1], max_tokens=0)


# -------------------------------------------------------------------------------------------- counts


def test_global_counts_local_matches_loop():
    seqs, masks = _random_sequences(7, num=9)
    masks[2][:] = False  # a sequence with no loss token does not count
    batch = pack_sequences(seqs, loss_masks=masks, pad_to_multiple_of=8)
    num_tokens, num_seqs = global_counts(batch)
    assert num_tokens == float(sum(int(m.sum()) for m in masks))
    assert num_seqs == float(sum(bool(m.any()) for m in masks))
    assert global_counts(batch.loss_mask, batch.cu_seqlens) == (num_tokens, num_seqs)
    with pytest.raises(ValueError, match="cu_seqlens is required"):
        global_counts(batch.loss_mask)
    with pytest.raises(ValueError, match="cu_seqlens must be None"):
        global_counts(batch, batch.cu_seqlens)
    bad = batch.loss_mask.clone()
    bad[-1] = True
    with pytest.raises(ValueError, match="padding"):
        global_counts(bad, batch.cu_seqlens)


def _counts_worker(rank: int, world: int):
    import torch.distributed as dist

    seqs, masks = _random_sequences(11, num=8)
    shard = list(range(rank, 8, world))
    batch = pack_sequences([seqs[i] for i in shard], loss_masks=[masks[i] for i in shard], pad_to_multiple_of=4)
    return global_counts(batch, group=dist.group.WORLD), global_counts(batch)


def test_global_counts_all_reduce_over_two_gloo_processes():
    seqs, masks = _random_sequences(11, num=8)
    whole = global_counts(pack_sequences(seqs, loss_masks=masks))
    results = run_gloo(_counts_worker, 2)
    for reduced, local in results:
        assert reduced == whole
        assert local != whole
    assert sum(local[0] for _, local in results) == whole[0]


# ---------------------------------------------------------------------------------------- HF forwards


def _load(path, attn):
    from transformers import AutoModelForCausalLM

    if attn == VARLEN_ATTENTION:
        assert register_varlen_attention() == VARLEN_ATTENTION
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_path(request, tiny_llama_path, tiny_qwen2_path):
    return tiny_llama_path if request.param == "llama" else tiny_qwen2_path


def _model_batch(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [7, 1, 13, 4, 10]
    seqs = [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]
    return seqs, pack_sequences(seqs, pad_to_multiple_of=8)


@pytest.mark.parametrize("attn", ["eager", "sdpa", VARLEN_ATTENTION])
def test_packed_logits_equal_separate_runs(model_path, attn):
    model = _load(model_path, attn)
    seqs, batch = _model_batch(model.config.vocab_size)
    assert batch.num_padding_tokens > 0
    with torch.no_grad():
        packed = packed_logits(model, batch)
        assert packed.shape == (batch.num_tokens, model.config.vocab_size)
        for seq, got in zip(seqs, unpack(packed, batch.cu_seqlens)):
            want = model(input_ids=seq[None], use_cache=False).logits[0]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # Negative control: an all-ones mask lets sequences attend to each other, which the comparison catches.
        leaky = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                      attention_mask=torch.ones_like(batch.input_ids)[None], use_cache=False).logits[0]
        assert (leaky[: int(batch.cu_seqlens[-1])] - packed[: int(batch.cu_seqlens[-1])]).abs().max() > 1e-3


@pytest.mark.parametrize("attn", ["sdpa", VARLEN_ATTENTION])
def test_packed_gradients_equal_padded(model_path, attn):
    model = _load(model_path, attn)
    seqs, batch = _model_batch(model.config.vocab_size, seed=1)
    weights = torch.randn(batch.num_tokens, model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    weights[int(batch.cu_seqlens[-1]):] = 0
    model.zero_grad()
    (packed_logits(model, batch) * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    padded_ids = pad_packed(batch.input_ids, batch.cu_seqlens, padding_value=0)
    attention_mask = pad_packed(torch.ones_like(batch.input_ids), batch.cu_seqlens)
    logits = model(input_ids=padded_ids, attention_mask=attention_mask, use_cache=False).logits
    padded_weights = pad_packed(weights, batch.cu_seqlens)
    (logits * padded_weights).sum().backward()
    assert packed_grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_varlen_attention_takes_each_tokens_padded_place_once_per_forward(tiny_llama_path):
    """packed_inputs computes the padded batch's (row, column) of every token once and passes it down; every layer
    then uses it instead of recomputing it (6 operations per layer fewer, in a host-bound step) with bit-identical
    log-probs and gradients. An index that does not match the batch is ignored."""
    from rlhfkit.packing import packed_inputs
    from rlhfkit.packing._attention import PADDED_INDEX_KWARG, padded_index

    model = _load(tiny_llama_path, VARLEN_ATTENTION)
    _, batch = _model_batch(model.config.vocab_size, seed=4)
    inputs = packed_inputs(model, batch)
    row, column = inputs[PADDED_INDEX_KWARG]
    expected = padded_index(inputs["cu_seq_lens_q"], batch.num_tokens)
    assert torch.equal(row, expected[0]) and torch.equal(column, expected[1])
    assert PADDED_INDEX_KWARG not in packed_inputs(_load(tiny_llama_path, "sdpa"), batch)

    def run(**overrides):
        model.zero_grad()
        logits = model(**(inputs | overrides)).logits[0]
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    given, recomputed = run(), run(**{PADDED_INDEX_KWARG: None})
    assert torch.equal(given[0], recomputed[0]) and all(map(torch.equal, given[1], recomputed[1]))
    stale = (row[:-1], column[:-1])  # another batch's index: ignored, recomputed
    assert torch.equal(run(**{PADDED_INDEX_KWARG: stale})[0], given[0])
    scrambled = (row.flip(0), column.flip(0))  # the right size: used as given (so the test can fail)
    assert not torch.equal(run(**{PADDED_INDEX_KWARG: scrambled})[0], given[0])


def test_varlen_attention_delegates_to_sdpa_for_padded_batches_and_generation(tiny_llama_path):
    varlen, sdpa = _load(tiny_llama_path, VARLEN_ATTENTION), _load(tiny_llama_path, "sdpa")
    seqs, batch = _model_batch(varlen.config.vocab_size, seed=3)
    ids = pad_packed(batch.input_ids, batch.cu_seqlens, side="left")
    attention_mask = pad_packed(torch.ones_like(batch.input_ids), batch.cu_seqlens, side="left")
    with torch.no_grad():
        want = sdpa(input_ids=ids, attention_mask=attention_mask).logits
        got = varlen(input_ids=ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(varlen.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))
        # packed rows without explicit boundaries fall back to sdpa's block-diagonal mask: still exact
        plain = varlen(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                       use_cache=False).logits[0]
        torch.testing.assert_close(plain, packed_logits(varlen, batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra", [{"sliding_window": 3}, {"softcap": 30.0}])
def test_varlen_attention_leaves_windowed_and_softcapped_layers_to_sdpa(monkeypatch, extra):
    from transformers.integrations import sdpa_attention

    from rlhfkit.packing._attention import _varlen_sdpa_forward

    calls = []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(k) or ("sdpa", None))
    module = torch.nn.Module().eval()
    q = torch.randn(1, 2, 6, 4)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    common = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 4}
    assert _varlen_sdpa_forward(module, q, q, q, None, **common, **extra)[0] == "sdpa"
    assert calls and all(calls[0][k] == v for k, v in extra.items())
    output, _ = _varlen_sdpa_forward(module, q, q, q, None, **common, sliding_window=None)  # no window: packed path
    assert output.shape == (1, 6, 2, 4) and len(calls) == 1


def test_varlen_attention_equals_per_sequence_sdpa_with_grouped_heads():
    from rlhfkit.packing._attention import _varlen_sdpa_forward

    gen = torch.Generator().manual_seed(4)
    lengths = [3, 1, 7, 5]
    cu = torch.tensor([0, 3, 4, 11, 16], dtype=torch.int32)
    q, k, v = (torch.randn(1, h, 16, 8, generator=gen) for h in (4, 2, 2))  # 4 query heads share 2 kv heads
    module = torch.nn.Module().eval()
    got, _ = _varlen_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)  # max length derived
    given, _ = _varlen_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7)
    assert torch.equal(got, given) and got.shape == (1, 16, 4, 8)
    start = 0
    for length in lengths:
        part = slice(start, start + length)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, part], k[:, :, part].repeat_interleave(2, 1), v[:, :, part].repeat_interleave(2, 1),
            is_causal=True)
        torch.testing.assert_close(got[:, part], want.transpose(1, 2), atol=1e-6, rtol=1e-5)
        start += length
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        bad = torch.tensor([0, 3, 20], dtype=torch.int32)
        _varlen_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=bad, cu_seq_lens_k=bad)


def test_packed_logits_refuses_unknown_attention_and_non_batches():
    class Fake(torch.nn.Module):
        class config:  # noqa: N801 - mimics a HF config attribute
            _attn_implementation = "my_custom_kernel"

    batch = pack_sequences([torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="attn_implementation='my_custom_kernel'"):
        packed_logits(Fake(), batch)
    with pytest.raises(TypeError, match="batch must be a PackedBatch"):
        packed_logits(Fake(), batch.input_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", VARLEN_ATTENTION, "flex_attention", "flash_attention_2"])
def test_packed_logits_on_gpu_equal_separate_runs(tiny_llama_path, attn):
    from transformers import AutoModelForCausalLM

    if attn == "flash_attention_2":
        pytest.importorskip("flash_attn")
    if attn == VARLEN_ATTENTION:
        register_varlen_attention()
    dtype = torch.bfloat16 if attn == "flash_attention_2" else torch.float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, attn_implementation=attn, dtype=dtype).cuda()
    seqs, batch = _model_batch(model.config.vocab_size)
    batch = batch.to("cuda")
    with torch.no_grad():
        packed = packed_logits(model.eval(), batch).float()
        for seq, got in zip(seqs, unpack(packed, batch.cu_seqlens)):
            want = model(input_ids=seq.cuda()[None], use_cache=False).logits[0].float()
            torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_packed_batch_type_is_reused():
    assert isinstance(pack_sequences([torch.tensor([1])]), PackedBatch)


def test_select_sequences_refuses_duplicates_naming_the_index():
    """Review defect: select_sequences(batch, [0, 0]) duplicated a sequence silently (its tokens counted twice)."""
    batch = pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7])])
    with pytest.raises(ValueError, match=r"indices=\[2, 0, 2\] name sequence 2 more than once"):
        select_sequences(batch, [2, 0, 2])
    selected, index = select_sequences(batch, [2, 0])
    assert selected.input_ids.tolist() == [6, 7, 1, 2, 3] and index.tolist() == [5, 6, 0, 1, 2]


def test_negative_token_ids_are_refused_naming_the_sample():
    """Review defect: negative token ids (e.g. -100 left from HF labels) were packed; now refused with the sample
    index and position, in pack_sequences/PackedBatch, Rollout, and for a negative pad_token_id."""
    from rlhfkit.types import Rollout

    with pytest.raises(ValueError, match=r"PackedBatch\.input_ids\[4\]=-100 in sequence \(sample index\) 1, "
                                         r"position 1; token ids are >= 0"):
        pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, -100])])
    with pytest.raises(ValueError, match=r"pad_token_id=-1; must be a token id >= 0"):
        pack_sequences([torch.tensor([1, 2, 3])], pad_to_multiple_of=4, pad_token_id=-1)
    with pytest.raises(ValueError, match=r"Rollout\(prompt_index=3, sample_index=1\)\.response_token_ids\[1\]=-100"):
        Rollout(prompt_token_ids=torch.tensor([1]), response_token_ids=torch.tensor([2, -100]), prompt_index=3,
                sample_index=1)


def test_positive_engine_logprobs_are_refused_naming_sample_and_position():
    """Review defect: positive engine log-probs were accepted; Rollout and policy_loss refuse them (> 1e-3)."""
    from rlhfkit.losses import policy_loss
    from rlhfkit.types import Rollout

    with pytest.raises(ValueError, match=r"Rollout\.response_logprobs\[1\]=0\.5 > 0 \(prompt_index=0, "
                                         r"sample_index=2\); log-probs are <= 0"):
        Rollout(prompt_token_ids=torch.tensor([1]), response_token_ids=torch.tensor([2, 3]),
                response_logprobs=torch.tensor([-0.1, 0.5]), sample_index=2)
    Rollout(prompt_token_ids=torch.tensor([1]), response_token_ids=torch.tensor([2]),
            response_logprobs=torch.tensor([1e-6]))  # float32 rounding just above 0 is tolerated
    batch = pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, 5])],
                           loss_masks=[torch.tensor([False, True, True]), torch.tensor([False, True])])
    lp = torch.tensor([0.0, -0.1, -0.2, 0.0, -0.3])
    engine = lp.clone()
    engine[4] = 0.25
    with pytest.raises(ValueError, match=r"engine_logprobs is 0\.25 > 0 at sequence 1, position 1 \(packed position "
                                         r"4\); log-probs are <= 0"):
        policy_loss(lp, lp, lp, batch.loss_mask, batch.cu_seqlens, engine_logprobs=engine)


def test_losses_refuse_a_loss_mask_on_a_sequence_first_token():
    """Review defect: a loss mask True on a sequence's first token (which has no log-prob) was accepted by the
    losses; every loss now refuses it naming the sequence and the alignment convention."""
    from rlhfkit.losses import aggregate, kl_loss, policy_loss, value_loss

    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    mask = torch.tensor([False, True, True, True, True])  # sequence 1 starts at packed position 3
    x = torch.tensor([0.0, -0.1, -0.2, -0.3, -0.4])
    pattern = (r"mask is True on the first token of sequence 1 \(packed position 3\); the first token of a sequence "
               r"is a prompt token and has no log-prob \(rlhfkit aligns a token's log-prob at the token's own position")
    for call in (lambda: policy_loss(x, x, x, mask, cu), lambda: value_loss(x, x, x, mask, cu),
                 lambda: kl_loss(x, x, mask, cu), lambda: aggregate(x, mask, cu)):
        with pytest.raises(ValueError, match=pattern):
            call()


def test_hf_shifted_and_padded_shapes_get_the_convention_and_the_conversion():
    """Review defect: HF-style shifted log-probs ([T - N] or [B, L - 1]) and padded [B, L] masks were reported only as
    a length mismatch; the error now states rlhfkit's alignment and names the conversion helpers."""
    from rlhfkit.advantages import discounted_returns
    from rlhfkit.losses import policy_loss

    batch = pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, 5])],
                           loss_masks=[torch.tensor([False, True, True]), torch.tensor([False, True])])
    lp = torch.tensor([0.0, -0.1, -0.2, 0.0, -0.3])
    with pytest.raises(ValueError, match=r"old_logprobs has 5 - 2 entries, one fewer per sequence: HF-style shifted "
                                         r"log-probs .*log p\(token_t \| tokens_<t\) is stored at index t, and index 0 "
                                         r"of each sequence is unused.*Insert a 0 at each sequence start"):
        policy_loss(lp, torch.tensor([-0.1, -0.2, -0.3]), lp, batch.loss_mask, batch.cu_seqlens)
    with pytest.raises(ValueError, match=r"mask looks like a padded \[B, L\] batch \(2, 3\).*rlhfkit\.packing\."
                                         r"pack_padded\(input_ids, attention_mask"):
        policy_loss(lp, lp, lp, torch.ones(2, 3, dtype=torch.bool), batch.cu_seqlens)
    with pytest.raises(ValueError, match=r"advantages looks like a padded \[B, L\] batch.*unpad_to_packed"):
        policy_loss(lp, lp, torch.zeros(2, 2), batch.loss_mask, batch.cu_seqlens)
    with pytest.raises(ValueError, match=r"mask looks like a padded \[B, L\] batch"):
        discounted_returns(torch.zeros(5), torch.ones(2, 3, dtype=torch.bool), batch.cu_seqlens, gamma=1.0)


# ---------------------------------------------------------------------- padded HF batches <-> packed (review item 6)

def _generate_like(gen):
    """A model.generate-style batch: prompts left-padded to width 4, responses right-padded to width 3."""
    prompts = [[5, 6], [7, 8, 9, 10], [11]]
    responses = [[12, 13, 14], [15], [16, 17]]
    rows, masks = [], []
    for prompt, response in zip(prompts, responses):
        rows.append([0] * (4 - len(prompt)) + prompt + response + [0] * (3 - len(response)))
        masks.append([0] * (4 - len(prompt)) + [1] * (len(prompt) + len(response)) + [0] * (3 - len(response)))
    return torch.tensor(rows), torch.tensor(masks), prompts, responses


def test_pack_padded_generate_output_with_per_generated_token_logprobs():
    """pack_padded on left-padded prompts + right-padded responses: sequences, loss mask on the responses, and
    generated-token log-probs ([B, R]) placed at each token's own position."""
    from rlhfkit.packing import pack_padded

    ids, attention, prompts, responses = _generate_like(None)
    generated = -torch.arange(1, 10, dtype=torch.float32).reshape(3, 3) / 10  # [B, R]; padding columns ignored
    batch, logprobs = pack_padded(ids, attention, prompt_length=4, logprobs=generated)
    expected = [p + r for p, r in zip(prompts, responses)]
    assert batch.input_ids.tolist() == sum(expected, [])
    assert batch.cu_seqlens.tolist() == [0, 5, 10, 13]
    assert batch.loss_mask.tolist() == sum([[False] * len(p) + [True] * len(r) for p, r in zip(prompts, responses)], [])
    # row 0 response tokens 12, 13, 14 -> -0.1, -0.2, -0.3; row 1 token 15 -> -0.4; row 2 tokens 16, 17 -> -0.7, -0.8
    assert logprobs.tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3, 0, 0, 0, 0, -0.4, 0, -0.7, -0.8])
    same, _ = pack_padded(ids, attention, response_mask=torch.zeros_like(ids, dtype=torch.bool).index_fill(
        1, torch.arange(4, 7), True))
    assert torch.equal(same.loss_mask, batch.loss_mask)


@pytest.mark.parametrize("side", ["right", "left"])
def test_unpack_to_padded_and_pack_padded_round_trip(side):
    """packed -> padded (either side) -> packed gives back the batch and the token-aligned log-probs exactly."""
    from rlhfkit.packing import pack_padded, unpack_to_padded

    gen = torch.Generator().manual_seed(0)
    lengths = [3, 7, 2, 5]
    seqs = [torch.randint(1, 50, (n,), generator=gen) for n in lengths]
    masks = [torch.arange(n) >= 1 + int(torch.randint(0, n - 1, (1,), generator=gen)) for n in lengths]
    batch = pack_sequences(seqs, loss_masks=masks, pad_to_multiple_of=8)
    logprobs = torch.where(batch.loss_mask, -torch.rand(batch.num_tokens, generator=gen), torch.zeros(()))
    padded = unpack_to_padded(batch, logprobs, side=side, pad_token_id=99)
    assert padded.input_ids.shape == (4, 7) and padded.side == side
    for row, seq in enumerate(seqs):
        real = padded.attention_mask[row].bool()
        assert padded.input_ids[row][real].tolist() == seq.tolist()
        assert (padded.input_ids[row][~real] == 99).all()
        assert real.tolist() == ([True] * len(seq) + [False] * (7 - len(seq)) if side == "right"
                                 else [False] * (7 - len(seq)) + [True] * len(seq))
    back, back_logprobs = pack_padded(padded.input_ids, padded.attention_mask, response_mask=padded.loss_mask,
                                      logprobs=padded.values[0], pad_to_multiple_of=8)
    for name in ("input_ids", "position_ids", "cu_seqlens", "loss_mask"):
        assert torch.equal(getattr(back, name).long(), getattr(batch, name).long()), name
    assert torch.equal(back_logprobs, logprobs)


def test_pack_padded_hf_shifted_logprobs_match_rlhfkit_packed_logprobs(tiny_llama_path):
    """HF-style shifted log-probs of a padded forward ([B, L - 1], entry j = log p(token j+1)) packed by pack_padded
    equal rlhfkit's own token-aligned packed log-probs of the same model on the loss tokens."""
    from rlhfkit.losses import model_logprobs
    from rlhfkit.packing import pack_padded

    model = _load(tiny_llama_path, "sdpa")
    for side in ("right", "left"):
        ids, attention, _, _ = _generate_like(None)
        if side == "right":  # move every row's real tokens to the left edge
            order = torch.argsort(1 - attention, dim=1, stable=True)
            ids, attention = ids.gather(1, order), attention.gather(1, order)
        positions = (attention.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
            shifted = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            response = torch.zeros_like(attention, dtype=torch.bool)
            if side == "left":
                response[:, 4:] = True
            else:
                for row, length in enumerate((2, 4, 1)):
                    response[row, length:] = True
            batch, packed = pack_padded(ids, attention, response_mask=response, logprobs=shifted)
            ours = model_logprobs(model, batch)
        mask = batch.loss_mask
        assert mask.sum() == 6
        torch.testing.assert_close(packed[mask], ours[mask], atol=1e-5, rtol=1e-5)


def test_pack_padded_bad_input_names_row_and_fix():
    from rlhfkit.packing import pack_padded

    ids, attention, _, _ = _generate_like(None)
    holes = attention.clone()
    holes[0, 4] = 0
    with pytest.raises(ValueError, match=r"attention_mask row 0 has padding between real tokens \(columns 2..6 hold 4"):
        pack_padded(ids, holes, prompt_length=4)
    with pytest.raises(ValueError, match=r"row 2: its first real token \(column 3\) is a response token"):
        pack_padded(ids, attention, prompt_length=3)
    with pytest.raises(ValueError, match=r"logprobs has 2 columns; expected 7, 6 or 3"):
        pack_padded(ids, attention, prompt_length=4, logprobs=torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"logprobs at row 0, token column 5 is 0\.5"):
        pack_padded(ids, attention, prompt_length=4, logprobs=torch.tensor([[-0.1, 0.5, -0.1]] * 3))
    with pytest.raises(ValueError, match=r"give prompt_length or response_mask, not both"):
        pack_padded(ids, attention, prompt_length=4, response_mask=attention.bool())


def test_docs_packing_padded_snippet_runs(capsys):
    """The docs/packing.md 'Padded HF batches' snippet runs, and engine and trainer log-probs agree in it."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "docs" / "packing.md").read_text()
    section = text[text.index("## Padded HF batches"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/packing.md", "exec"), {"__name__": "docs_snippet"})
    gap = re.search(r"^tensor\(([-\d.e]+)\)$", capsys.readouterr().out, re.M)
    assert gap is not None and float(gap.group(1)) < 1e-4


@pytest.mark.parametrize("attn", ["sdpa", VARLEN_ATTENTION])
def test_a_long_packed_row_under_a_dense_mask_attention_warns_with_the_fix(tiny_llama_path, attn):
    """Regression (issue 22, an H100 out of memory): a plain HF model (sdpa) given 51k packed tokens built a dense
    T x T mask. packed_inputs now warns at DENSE_MASK_WARN_TOKENS and names the varlen attention; varlen is silent."""
    import warnings

    from rlhfkit.packing import DENSE_MASK_WARN_TOKENS, packed_inputs

    model = _load(tiny_llama_path, attn)
    half = DENSE_MASK_WARN_TOKENS // 2
    long_batch = pack_sequences([torch.ones(half, dtype=torch.long), torch.ones(half, dtype=torch.long)])
    short_batch = pack_sequences([torch.ones(64, dtype=torch.long)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        packed_inputs(model, short_batch)
        packed_inputs(model, long_batch)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if attn == "sdpa":
        assert len(messages) == 1 and f"{DENSE_MASK_WARN_TOKENS} tokens" in messages[0]
        assert "register_varlen_attention" in messages[0]
    else:
        assert not messages


def test_a_batch_moved_to_a_device_reads_its_boundaries_from_the_host():
    """Every read of a GPU tensor's values (a boundary, a count, a bound) waits for all queued kernels. A batch moved
    with ``PackedBatch.to`` is not checked again on the device, and its moved tensors keep their host copies, which
    the boundaries, counts and shapes are read from. The meta device stands in for the GPU here: it holds no values,
    so any read of one raises."""
    from rlhfkit._cu_seqlens import attach_host_copy, check_cu_seqlens, cu_end, host_copy
    from rlhfkit.losses._aggregate import reduce_tokens
    from rlhfkit.packing import _varlen_kwargs

    batch = pack_sequences([torch.arange(1, 4), torch.arange(1, 6), torch.arange(1, 3)], pad_to_multiple_of=4,
                           loss_masks=[torch.tensor([0, 1, 1]).bool(), torch.tensor([0, 0, 1, 1, 1]).bool(),
                                       torch.tensor([0, 1]).bool()])
    moved = batch.to("meta")  # no re-check: each would read the device
    assert moved.input_ids.device.type == "meta" and host_copy(moved.cu_seqlens) is batch.cu_seqlens
    assert moved.num_padding_tokens == batch.num_padding_tokens == 2 and cu_end(moved.cu_seqlens) == 10
    assert moved.seq_ids.device.type == "meta"
    assert _varlen_kwargs(moved)["max_length_q"] == _varlen_kwargs(batch)["max_length_q"] == 5
    cu = check_cu_seqlens(moved.cu_seqlens, moved.num_tokens)
    assert cu.dtype == torch.int64 and host_copy(cu).tolist() == batch.cu_seqlens.tolist()
    per_token = torch.randn(batch.num_tokens, device="meta")
    for mode in ("token_mean", "seq_mean_token_mean"):  # the count checks read the host copies of mask and cu
        reduce_tokens(per_token, moved.loss_mask, cu, mode=mode, num_tokens=6.0, num_seqs=3.0)
    with pytest.raises(ValueError, match="less than the 6 loss tokens"):
        reduce_tokens(per_token, moved.loss_mask, cu, mode="token_mean", num_tokens=5.0, num_seqs=None)
    with pytest.raises(ValueError, match="less than the 3 sequences"):
        reduce_tokens(per_token, moved.loss_mask, cu, mode="seq_mean_token_mean", num_tokens=None, num_seqs=2.0)
    bad = attach_host_copy(torch.empty(4, dtype=torch.int32, device="meta"), torch.tensor([0, 3, 3, 5]))
    with pytest.raises(ValueError, match="sequence 1 has length 0"):  # the checks still hold, on the host copy
        check_cu_seqlens(bad, 5)
    # A copy is valid until either side changes in place; then the values are read from the device again.
    stale = batch.to("meta")
    stale.cu_seqlens.add_(0)
    assert host_copy(stale.cu_seqlens) is None
    with pytest.raises(RuntimeError, match="meta"):
        cu_end(stale.cu_seqlens)
    source = batch.loss_mask.clone()
    copy = attach_host_copy(torch.empty(source.shape, dtype=torch.bool, device="meta"), source)
    source[0] = True
    assert host_copy(copy) is None


@pytest.mark.gpu
def test_a_batch_moved_to_the_gpu_is_checked_and_shaped_without_a_sync():
    """The same as the meta-device test above, on a GPU: with CUDA's sync debug mode set to "error", moving a batch
    and reading its boundaries, its padding, its longest sequence and the loss's count checks never synchronise."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from rlhfkit._cu_seqlens import check_cu_seqlens
    from rlhfkit.losses._aggregate import reduce_tokens
    from rlhfkit.packing import _varlen_kwargs

    batch = pack_sequences([torch.arange(1, 4), torch.arange(1, 6)], pad_to_multiple_of=4,
                           loss_masks=[torch.tensor([0, 1, 1]).bool(), torch.tensor([0, 0, 1, 1, 1]).bool()])
    per_token = torch.randn(batch.num_tokens, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = batch.to("cuda")
        cu = check_cu_seqlens(moved.cu_seqlens, moved.num_tokens)
        assert moved.num_padding_tokens == 0 or moved.num_padding_tokens == batch.num_padding_tokens
        assert _varlen_kwargs(moved)["max_length_q"] == 5
        reduce_tokens(per_token, moved.loss_mask, cu, mode="seq_mean_token_mean", num_tokens=5.0, num_seqs=2.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --- the per-sequence repeat of the packing helpers ----------------------------------------------------------------
@pytest.mark.parametrize("values", [torch.tensor([4, 7, 1, 9]), torch.tensor([0.5, -1.0, 2.0, 3.5]),
                                    torch.tensor([True, False, True, True]), torch.tensor([4, 7, 1, 9],
                                                                                          dtype=torch.int32)])
@pytest.mark.parametrize("numpy", [True, False])
def test_repeat_counts_equals_repeat_interleave_with_and_without_numpy(values, numpy, monkeypatch):
    from rlhfkit import _cu_seqlens

    if not numpy:
        monkeypatch.setattr(_cu_seqlens, "_numpy", lambda: None)
    counts = torch.tensor([2, 0, 3, 1])
    out = _cu_seqlens.repeat_counts(values, counts, total=6)
    assert out.dtype == values.dtype and torch.equal(out, torch.repeat_interleave(values, counts))
    assert torch.equal(_cu_seqlens.segment_ids(torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)),
                       torch.tensor([0, 0, 2, 2, 2, 3]))


def test_repeat_counts_keeps_gradients_and_the_cpu_helpers_avoid_torchs_kernel(monkeypatch):
    """Values that need gradients take torch's kernel (autograd); the packing helpers on CPU tensors do not call it
    (its OpenMP team waited milliseconds per call on a busy machine)."""
    from rlhfkit._cu_seqlens import repeat_counts

    per_seq = torch.tensor([1.0, 2.0], requires_grad=True)
    repeat_counts(per_seq, torch.tensor([2, 3])).sum().backward()
    assert per_seq.grad.tolist() == [2.0, 3.0]

    batch = pack_sequences([torch.arange(1, 4), torch.arange(1, 6), torch.arange(1, 3)])

    def refused(*args, **kwargs):
        raise AssertionError("torch.repeat_interleave called on CPU tensors")

    monkeypatch.setattr(torch, "repeat_interleave", refused)
    selected, index = select_sequences(batch, [2, 0])
    assert selected.input_ids.tolist() == [1, 2, 1, 2, 3] and index.tolist() == [8, 9, 0, 1, 2]
    assert batch.seq_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2]
