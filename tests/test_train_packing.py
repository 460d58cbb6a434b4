"""Packed rows (train.engine.pack_width): several pairs per row, each attending only within itself.

Oracles: each pair's hidden states equal those of the pair alone in its own shared row; a packed step's loss,
metrics and gradients equal the naive two-forward ORPO over the step's pairs; a packed training run ends near the
naive run and replays bit-exactly.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from test_engine_attention import bounds_mask
from test_engine_ladder import LAM, PLAIN, adapters, assert_close, lora_model, naive, resolved
from test_engine_stack import random_pairs, tiny_model, with_unshared_pair
from test_train_recipe import naive_with_span

from conftest import MATMUL_TOL, shortest_pairs
from orpo.batching import first_fit
from orpo.engine.attention import ExclusionMask
from orpo.engine.stack import Stack
from orpo.train.accumulate import accumulate_grads
from orpo.train.objectives import Objective, PairLoss
from orpo.train.rows import block_lengths, packed_rows, shared_rows
from orpo.train.settings import train_settings
from orpo.train.step import batch_value_and_grad, check_attention, prepare_packed_step
from orpo.train.trainer import replay, train


def test_first_fit_places_longest_first_into_the_first_bin_with_room():
    assert first_fit([5, 4, 3, 3, 1], 8, 8) == [[0, 2], [1, 3, 4]]
    assert first_fit([1, 1, 1, 1, 1], 8, 2) == [[0, 1], [2, 3], [4]]  # at most 2 a bin
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 50, 200).tolist()
    bins = first_fit(lengths, 64, 8)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 64 and len(b) <= 8 for b in bins)
    # A loose bound on first fit decreasing: fewer than twice the bins the lengths need at the least.
    assert len(bins) <= 2 * sum(lengths) / 64 + 1
    with pytest.raises(ValueError, match="an item of 65 does not fit a bin of 64"):
        first_fit([65], 64, 8)


def packed_case():
    """Eight pairs (one whose prompts differ) in three rows of 48 positions (3, 3 and 2 pairs)."""
    pairs = with_unshared_pair(random_pairs(11, 7), 12)
    return pairs, [3, 3, 2], 48


@pytest.mark.parametrize("variant", ["llama", "gemma2", "llama_sliding"])
def test_each_packed_pair_sees_only_itself(variant):
    """Tokens, positions and visibility as a numpy oracle of the block mask lays them out; each pair's hidden states
    at its scored positions equal those of the pair alone in its own shared row (gemma2: its array mask; sliding
    windows: Layout.visible cut by position)."""
    model = tiny_model(variant)
    pairs, per_row, width = packed_case()
    packed = packed_rows(pairs, per_row, width)
    lay = packed.layout
    assert lay.tokens.shape == (3, width) and packed.fallbacks == 1
    lengths = block_lengths(pairs)
    expected = np.zeros((3, width, width), bool)
    q, k = np.arange(width)[:, None], np.arange(width)[None, :]
    i = 0
    for r, count in enumerate(per_row):
        at = 0
        for _ in range(count):
            alone = shared_rows(pairs.select([i]), attention="exclusion").layout
            first, start = (int(x) for x in np.array(alone.hidden_spans[0]))
            n = lengths[i]
            assert np.array_equal(np.array(lay.tokens[r, at:at + n]), np.array(alone.tokens[0, :n]))
            assert np.array_equal(np.array(lay.positions[r, at:at + n]), np.array(alone.positions[0, :n]))
            inside = (q >= at) & (q < at + n) & (k >= at) & (k <= q)
            hidden = (q >= at + start) & (k >= at + first) & (k < at + start)
            expected[r] |= inside & ~hidden
            at, i = at + n, i + 1
        assert (np.array(lay.tokens)[r, at:] == 0).all()  # sliced in numpy: an empty MLX slice fails on CUDA
    got = np.array(lay.visible())
    real = expected.any(axis=2)  # padding's queries (never scored) see only padding
    assert np.array_equal(got[real], expected[real])
    assert np.array_equal(bounds_mask(np.array(lay.key_bounds))[:, 0][real], expected[real])  # our kernels' bounds
    stack = Stack(model)
    if variant == "llama":
        assert all(isinstance(m, ExclusionMask) for m in stack.masks(lay, stack.embed(lay.tokens)))
    h = stack.hidden(lay)
    got_rows = np.array(h.reshape(-1, h.shape[-1])[packed.index])
    chosen, rejected = [], []  # the targets' order: every pair's chosen tokens, then every pair's rejected ones
    for i in range(len(pairs)):
        alone = shared_rows(pairs.select([i]), attention="exclusion")
        ha = stack.hidden(alone.layout)
        rows = np.array(ha.reshape(-1, ha.shape[-1])[alone.index])
        nc, nr = (int(x) for x in (np.array(alone.weights) > 0).sum(axis=1))
        chosen.append(rows[:nc])
        rejected.append(rows[nc:nc + nr])
    want = np.concatenate(chosen + rejected)
    np.testing.assert_allclose(got_rows[:len(want)], want, rtol=10 * MATMUL_TOL, atol=10 * MATMUL_TOL)


ENGINES = {
    "exclusion": {"prefix_sharing": True},
    "all_compiled": {"head": "fused", "head_chunk": 7, "segment_layers": 2, "prefix_sharing": True, "compile": True},
    "ordered_overlap": {"head": "fused", "head_chunk": 7, "segment_layers": 1, "prefix_sharing": True,
                        "attention_backward": "ordered", "overlap": 1},
}


def accumulated(model, batches, e):
    """((loss, metrics), grads) of a packed step's micro-batches, accumulated by their shares as Session.run does."""
    loss = PairLoss(Objective(), LAM)

    def micro(j, sums):
        (_, metrics), grads = batch_value_and_grad(model, batches[j], loss, e, sums)
        return metrics, grads

    grads, metrics = accumulate_grads(micro, len(batches), [b.packed.share for b in batches])
    return (metrics["loss"], metrics), grads


@pytest.mark.parametrize("family,engine,span", [
    *(("llama", e, "response") for e in ENGINES), *(("gemma2", e, "response") for e in ENGINES),
    ("llama", "exclusion", "prompt_and_response"), ("llama", "all_compiled", "prompt_and_response")])
def test_a_packed_step_equals_the_naive_step_over_its_pairs(family, engine, span):
    """prepare_packed_step's micro-batches (unequal pair counts, each loss scaled by its share) accumulated: the
    loss, metrics and every LoRA gradient of the naive two-forward ORPO over all the step's pairs (the NLL over
    the response, or over prompt and response)."""
    model, _ = lora_model(family)
    pairs = with_unshared_pair(random_pairs(1, 7), 3)
    e = resolved({**PLAIN, **ENGINES[engine], "pack_width": 48, "pack_rows": 2})
    batches = prepare_packed_step(pairs, block_lengths(pairs), e, span)
    assert len(batches) == 2 and len({b.n for b in batches}) == 2  # micro-batches of differing pair counts
    assert sum(b.packed.share.item() for b in batches) == pytest.approx(1.0)
    assert {b.packed.layout.tokens.shape[1] for b in batches} == {48}
    assert_close(accumulated(model, batches, e), naive(model, pairs) if span == "response" else
                 naive_with_span(model, pairs))


def test_a_packed_step_gives_every_weights_gradient_when_all_train():
    """Full-parameter training (embedding, norms and the tied head train): a packed step's loss and every gradient
    are the naive step's over its pairs."""
    from orpo.engine.embedding import with_summed_embeddings

    model = tiny_model("llama", num_hidden_layers=3)
    model.unfreeze()
    model.train()
    pairs = with_unshared_pair(random_pairs(1, 7), 3)
    want = naive(model, pairs)
    with_summed_embeddings(model)
    e = resolved({**PLAIN, **ENGINES["all_compiled"], "pack_width": 48, "pack_rows": 2})
    batches = prepare_packed_step(pairs, block_lengths(pairs), e)
    assert len({b.n for b in batches}) > 1
    assert_close(accumulated(model, batches, e), want)


def test_packed_rows_are_checked():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="pack_width 40: not a multiple of the rows' width multiple 16"):
        check_attention(model, resolved({"prefix_sharing": True, "pack_width": 40, "width_multiple": 16}))
    with pytest.raises(ValueError, match="packed rows are prefix-shared rows"):
        check_attention(model, resolved({"prefix_sharing": False, "pack_width": 48}))
    with pytest.raises(ValueError, match="packed rows are prefix-shared rows"):
        check_attention(model, resolved({"prefix_attention": "split", "pack_width": 48}))
    pairs, _, _ = packed_case()
    with pytest.raises(ValueError, match=r"rows of \[9\] pairs for 8 pairs \(at most 8 a row\)"):
        packed_rows(pairs, [9], 512)
    with pytest.raises(ValueError, match="more than the width 16"):
        packed_rows(pairs, [3, 3, 2], 16)


@pytest.fixture(scope="module")
def short_rendered(tiny_rendered, tmp_path_factory):
    return shortest_pairs(tiny_rendered, tmp_path_factory.mktemp("packing") / "rendered")


def test_a_packed_run_ends_near_the_naive_run_and_replays(tiny_base, short_rendered, tmp_path, capsys):
    """The same steps' pairs packed into rows of 256 positions: logged losses and tokens as the naive run's, adapters
    within the ladder's drift, one width for every micro-batch, and a bit-exact replay; a width shorter than the
    longest pair is refused, naming the pair."""
    settings = {"batch_size": 2, "grad_accum": 2, "max_steps": 4, "checkpoint_every": 2, "log_every": 1,
                "lr": 0.003, "lora": {"rank": 4, "alpha": 8}}
    packed = {"prefix_sharing": True, "head": "fused", "pack_width": 256, "pack_rows": 1}
    runs = {}
    for name, engine in (("naive", PLAIN), ("packed", packed)):
        runs[name] = tmp_path / name
        train(tiny_base, short_rendered, runs[name], train_settings({**settings, "engine": engine}))
    assert "at a micro-batch of 1 rows x 256, pairs packed" in capsys.readouterr().err  # what the run says it does
    a, b = adapters(runs["naive"]), adapters(runs["packed"])
    for k in a:
        assert np.linalg.norm(b[k] - a[k]) <= 100 * MATMUL_TOL * np.linalg.norm(a[k]), k
    logs = {n: [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
            for n, r in runs.items()}
    for x, y in zip(logs["naive"], logs["packed"], strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4) and y["tokens"] == x["tokens"]
        assert y["positions"] % 256 == 0
    assert replay(runs["packed"], tiny_base, short_rendered, "final", "zero")["equal"]
    with pytest.raises(ValueError, match=r"train.engine.pack_width 16: pair '.+' takes \d+ positions"):
        train(tiny_base, short_rendered, tmp_path / "narrow",
              train_settings({**settings, "engine": {**packed, "pack_width": 16}}))


def test_auto_packs_on_cuda_where_packed_rows_attend_fused():
    """auto: on CUDA, rows of the longest pair's positions on the width ladder, rows a micro-batch nearest
    batch_size pairs of the mean length (a head dim of 128 in bf16 too: our kernels); off elsewhere, for pairs of
    one length, at a head dim of 128 in float32 and with split rows; set values stay."""
    from orpo.train.settings import engine_settings
    from orpo.train.step import plan_packing

    model = tiny_model("llama")
    lengths = [2056, 900, 700, 500] * 4
    auto = engine_settings({"width_multiple": 128})
    assert plan_packing(auto, model, lengths, 4, cuda=True) == {"pack_width": 2304, "pack_rows": 2}  # mean 1039
    assert plan_packing(auto, model, lengths, 4, cuda=False) == {"pack_width": 0, "pack_rows": 1}
    assert plan_packing(auto, model, [1534] * 8, 4, cuda=True)["pack_width"] == 0  # one length: one shape already
    assert plan_packing(engine_settings({"width_multiple": 128, "prefix_attention": "split"}), model, lengths, 4,
                        cuda=True)["pack_width"] == 0
    wide = tiny_model("llama", head_dim=128, num_attention_heads=2, num_key_value_heads=1, hidden_size=128)
    assert plan_packing(auto, wide, lengths, 4, cuda=True)["pack_width"] == 0  # float32: neither fits on CUDA
    wide.set_dtype(mx.bfloat16)  # our kernels take it
    assert plan_packing(auto, wide, lengths, 4, cuda=True) == {"pack_width": 2304, "pack_rows": 2}
    assert plan_packing(engine_settings({"pack_width": 4096}), model, lengths, 16, cuda=False) == {
        "pack_width": 4096, "pack_rows": round(16 * 1039 / 4096)}
