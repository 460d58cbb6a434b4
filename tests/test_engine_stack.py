"""Our stack forward equals the model's for every family; prefix-shared rows give the hidden states of separate forwards."""

import dataclasses
import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import _get_classes, quantize_model
from test_train_models import COMMON, FAMILIES

from conftest import MATMUL_TOL
from orpo.engine.head import head_logits, lm_head_of
from orpo.engine.forward import UnsupportedModel, rope_at
from orpo.engine.stack import Layout, Stack
from orpo.train.data import Pairs
from orpo.train.rows import plain_rows, shared_rows

VOCAB = COMMON["vocab_size"]
WINDOW = 8  # shorter than the test rows, so sliding-window layers really cut attention
VARIANTS = {
    **{f: {} for f in FAMILIES},
    "gemma3_text": {"sliding_window": WINDOW},
    "llama_sliding": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                      "sliding_window": WINDOW, "num_hidden_layers": 3},
}


def tiny_model(variant: str, **overrides) -> nn.Module:
    """A tiny random mlx-lm model of a family (or variant), built with mlx-lm's own classes."""
    family = "llama" if variant == "llama_sliding" else variant
    config = {**COMMON, **FAMILIES[family], **VARIANTS[variant], **overrides}
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    model.freeze()  # as training has it: the head is frozen
    return model


def random_pairs(seed: int, n: int = 3) -> Pairs:
    """n pairs of random ids with differing prompt/response lengths; responses end in an unscored token."""
    rng = np.random.default_rng(seed)

    def ids(k: int) -> list[int]:
        return [int(x) for x in rng.integers(1, VOCAB, k)]

    prompts = [ids(int(rng.integers(3, 12))) for _ in range(n)]
    chosen = [ids(int(rng.integers(2, 10))) for _ in range(n)]
    rejected = [ids(int(rng.integers(2, 10))) for _ in range(n)]
    scored = [[1] * (len(r) - 1) + [0] for r in chosen], [[1] * (len(r) - 1) + [0] for r in rejected]
    return Pairs([f"p{i}" for i in range(n)], prompts, chosen, rejected, *scored)


def prompt_groups(prompts: list[int]) -> tuple[tuple[int, int, int], ...]:
    """(first row, end row, prompt length) of each run of consecutive rows with one prompt length."""
    groups, first = [], 0
    for p, run in itertools.groupby(prompts):
        size = len(list(run))
        groups.append((first, first + size, p))
        first += size
    return tuple(groups)


def with_unshared_pair(pairs: Pairs, seed: int) -> Pairs:
    """`pairs` plus one pair given as two full sequences whose prompts differ (prefix sharing must fall back)."""
    extra = random_pairs(seed, 2)
    prompt_c, prompt_r = extra.prompt
    return Pairs(pairs.ids + ["unshared"], pairs.prompt + [[]],
                 pairs.chosen + [prompt_c + extra.chosen[0]], pairs.rejected + [prompt_r + extra.rejected[1]],
                 pairs.chosen_mask + [[0] * len(prompt_c) + extra.chosen_mask[0]],
                 pairs.rejected_mask + [[0] * len(prompt_r) + extra.rejected_mask[1]])


@pytest.mark.parametrize("variant", [*VARIANTS, "llama_4bit"])
def test_stack_forward_equals_the_model(variant):
    model = tiny_model("llama" if variant == "llama_4bit" else variant)
    if variant == "llama_4bit":
        model, _ = quantize_model(model, {**COMMON, **FAMILIES["llama"]}, group_size=32, bits=4)
    tokens = mx.array(np.random.default_rng(1).integers(0, VOCAB, (3, 2 * WINDOW + 5)), mx.int32)
    stack = Stack(model)
    hidden = stack.hidden(Layout(tokens))
    # On plain rows every layer gets the model's own mask object: bit-identical hidden states.
    assert np.array_equal(np.array(hidden), np.array(model.model(tokens)))
    np.testing.assert_allclose(np.array(head_logits(lm_head_of(model), hidden)), np.array(model(tokens)),
                               rtol=MATMUL_TOL, atol=MATMUL_TOL)
    if variant in ("gemma3_text", "llama_sliding"):
        assert WINDOW in stack.windows and None in stack.windows


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_shared_rows_give_the_hidden_states_of_separate_forwards(variant):
    """Oracle: the plain [chosen; rejected] rows, i.e. two separate causal forwards per pair."""
    model = tiny_model(variant)
    pairs = with_unshared_pair(random_pairs(2, 4), 3)
    stack = Stack(model)
    plain, shared = plain_rows(pairs), shared_rows(pairs)
    assert shared.fallbacks == 1 and plain.fallbacks == 0
    assert np.array_equal(np.array(shared.targets), np.array(plain.targets))
    np.testing.assert_allclose(np.array(shared.weights), np.array(plain.weights), rtol=1e-7)

    def gathered(packed) -> np.ndarray:
        h = stack.hidden(packed.layout)
        return np.array(h.reshape(-1, h.shape[-1])[packed.index])

    want = gathered(plain)
    np.testing.assert_allclose(gathered(shared), want, rtol=10 * MATMUL_TOL, atol=10 * MATMUL_TOL)
    # The prompt is computed once: each shared row is shorter than its pair's two sequences.
    lengths = [len(p) + len(c) - 1 + len(r) - 1 for p, c, r in zip(pairs.prompt, pairs.chosen, pairs.rejected)]
    assert shared.layout.tokens.shape[0] == len(pairs) and shared.layout.tokens.shape[1] < 2 * max(lengths)

    # Controls: rejected positions not restarted, or rejected seeing chosen, change the hidden states.
    lay = shared.layout
    physical = mx.broadcast_to(mx.arange(lay.tokens.shape[1], dtype=mx.int32)[None], lay.positions.shape)
    for broken in (Layout(lay.tokens, physical, lay.hidden_spans),
                   Layout(lay.tokens, lay.positions, mx.zeros_like(lay.hidden_spans))):
        h = stack.hidden(broken)
        assert np.abs(np.array(h.reshape(-1, h.shape[-1])[shared.index]) - want).max() > 1e-3


@pytest.mark.parametrize("multiple", [None, 32])
@pytest.mark.parametrize("attention", ["split", "exclusion"])
def test_shared_rows_layout_and_its_attentions(multiple, attention):
    """Aligned prefix rows ([prompt; chosen[:-1]; pad | rejected own; pad], rejected's block at one column, a
    rung of the width multiple) or tight ones ([prompt; chosen[:-1]; rejected own; pad]): tokens and
    visibility equal a numpy oracle of the block mask; the default masks (SplitRows on aligned rows, the
    exclusion dims on tight ones) give the hidden states of the additive block mask, and so do the exclusion
    dims on aligned rows."""
    from orpo.batching import ladder
    from orpo.engine.attention import ExclusionMask, SplitRows
    model = tiny_model("llama")
    pairs = with_unshared_pair(random_pairs(6, 4), 2)
    packed = shared_rows(pairs, multiple, attention)
    lay = packed.layout
    m, n = multiple or 16, lay.tokens.shape[1]
    prompts = [0 if pairs.ids[i] == "unshared" else len(pairs.prompt[i]) for i in range(len(pairs))]  # unshared: none
    heads = [pairs.prompt[i] + pairs.chosen[i][:-1] for i in range(len(pairs))]
    tails = [(pairs.prompt[i] + pairs.rejected[i])[p:-1] for i, p in enumerate(prompts)]
    if attention == "split":
        starts = [ladder(max(map(len, heads)), m)] * len(pairs)
        assert lay.split.rejected_start == starts[0] and n == starts[0] + ladder(max(map(len, tails)), m)
    else:
        starts = [len(h) for h in heads]
        assert lay.split is None and n == ladder(max(len(h) + len(t) for h, t in zip(heads, tails)), m)
    expected = np.zeros((len(pairs), n, n), bool)
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    for i, (p, start) in enumerate(zip(prompts, starts)):
        row = heads[i] + [0] * (start - len(heads[i])) + tails[i]
        assert np.array_equal(np.array(lay.tokens[i]), row + [0] * (n - len(row)))
        expected[i] = (k <= q) & ~((q >= start) & (k >= p) & (k < start))
    assert np.array_equal(np.array(lay.visible()), expected)
    if attention == "split":  # consecutive rows with one prompt length share one attention for rejected's queries
        assert lay.split.groups == prompt_groups(prompts) and len(lay.split.groups) < len(pairs)
    stack = Stack(model)
    h0 = stack.embed(lay.tokens)
    default = SplitRows if attention == "split" else ExclusionMask
    assert all(isinstance(mask, default) for mask in stack.masks(lay, h0))
    additive = mx.where(lay.visible(), mx.array(0.0), mx.array(-mx.inf))[:, None]
    by_mask = stack.norm(stack.run(h0, [additive] * len(stack.layers), 0, len(stack.layers), lay.positions))
    want = np.array(by_mask.reshape(-1, by_mask.shape[-1])[packed.index])
    layouts = [lay]
    if attention == "split":  # the same aligned rows without their SplitRows: attended with the exclusion dims
        layouts.append(Layout(lay.tokens, lay.positions, lay.hidden_spans))
        assert all(isinstance(mask, ExclusionMask) for mask in stack.masks(layouts[-1], h0))
    for each in layouts:
        h = stack.hidden(each)
        np.testing.assert_allclose(np.array(h.reshape(-1, h.shape[-1])[packed.index]), want,
                                   rtol=10 * MATMUL_TOL, atol=10 * MATMUL_TOL, err_msg=str(each.split))


def test_auto_rows_are_aligned_only_where_that_costs_no_padding():
    """auto: one prompt length and no wider than tight rows -> aligned rows (split); otherwise tight rows.
    The targets are padded to a ladder rung with weight 0, and the token counts are the pairs' own."""
    rng = np.random.default_rng(5)
    ids = lambda k: [int(x) for x in rng.integers(1, VOCAB, k)]  # noqa: E731
    # One prompt length; [prompt; chosen[:-1]] and rejected[:-1] fill 16 columns each: aligned = tight width.
    same = Pairs([f"p{i}" for i in range(4)], [ids(10) for _ in range(4)], [ids(7) for _ in range(4)],
                 [ids(17) for _ in range(4)], [[1] * 7] * 4, [[1] * 17] * 4)
    assert shared_rows(same).layout.split is not None
    # A long chosen beside a short rejected: the aligned blocks add up to 48 columns, tight rows need 32.
    same.chosen[1], same.chosen_mask[1], same.rejected[1], same.rejected_mask[1] = ids(20), [1] * 20, ids(2), [1, 1]
    assert shared_rows(same).layout.split is None and shared_rows(same, attention="split").layout.split is not None
    varied = random_pairs(6, 4)
    assert len({len(p) for p in varied.prompt}) > 1 and shared_rows(varied).layout.split is None
    packed = shared_rows(varied)
    scored = sum(sum(c) + sum(r) for c, r in zip(varied.chosen_mask, varied.rejected_mask))
    m = packed.targets.shape[0]
    assert m >= scored and np.array(packed.weights)[:, scored:].sum() == 0 and packed.weights.shape == (8, m)
    full = [len(p) + len(c) + len(r) for p, c, r in zip(varied.prompt, varied.chosen, varied.rejected)]
    assert packed.two_forward_tokens == sum(full) + sum(map(len, varied.prompt))
    assert packed.row_tokens == sum(full)


ROPES = {
    "plain": {},
    "traditional": {"traditional": True},
    "llama3": {"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}},
    "yarn": {"scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    "partial": {"dims": 8},
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_at_equals_the_rope_at_each_tokens_position(kind):
    """Oracle: the module's own rope called on each token alone at its own offset (an int)."""
    from mlx_lm.models.rope_utils import initialize_rope
    spec = ROPES[kind]
    b, h, length, d = 2, 3, 7, 16
    rope = initialize_rope(spec.get("dims", d), 10000.0, spec.get("traditional", False), spec.get("scaling"), 128)
    x = mx.random.normal((b, length, h, d), key=mx.random.key(3)).transpose(0, 2, 1, 3)  # as mlx-lm passes it
    positions = mx.array([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 1, 2, 3, 4]], mx.int32)  # row 1 restarts at 1
    got = rope_at(rope, x, positions.reshape(-1))
    want = mx.stack([mx.concatenate([rope(x[r : r + 1, :, t : t + 1], offset=int(positions[r, t]))
                                     for t in range(length)], axis=2)[0] for r in range(b)])
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6, rtol=0)
    assert np.abs(np.array(got[1, :, 3:]) - np.array(rope(x)[1, :, 3:])).max() > 1e-2  # the restart matters


def test_rope_at_in_several_calls_equals_one_call(monkeypatch):
    """Where CUDA's rope cannot take every row at once (fewer than 32 rotated dims), the rows go in calls of at most
    64 and give the bits of one call."""
    import orpo.engine.forward as forward
    from mlx_lm.models.rope_utils import initialize_rope
    assert forward.rope_rows_per_call(128, 32, True) is None and forward.rope_rows_per_call(16, 2, False) is None
    assert forward.rope_rows_per_call(16, 2, True) == 64 and forward.rope_rows_per_call(16, 32, True) == 8
    rope = initialize_rope(16, 10000.0, False, None, 512)
    x = mx.random.normal((2, 70, 3, 16), key=mx.random.key(4)).transpose(0, 2, 1, 3)
    positions = mx.concatenate([mx.arange(70), mx.arange(70) + 5]).astype(mx.int32)
    whole = forward.rope_at(rope, x, positions)
    calls = []
    counted = lambda rows, offset: calls.append(len(rows)) or rope(rows, offset=offset)  # noqa: E731
    counted.dims = 16
    monkeypatch.setattr(forward, "on_cuda", lambda: True)
    parts = forward.rope_at(counted, x, positions)
    assert calls == [64, 64, 12]
    assert np.array_equal(np.array(parts), np.array(whole))


def test_sliding_window_uses_logical_positions():
    """gemma3's local layers: a rejected token may see a prompt token within the window by logical distance only."""
    pairs = random_pairs(4, 1)
    pairs.prompt[0], pairs.chosen[0], pairs.chosen_mask[0] = pairs.prompt[0][:4], list(range(1, 20)), [1] * 19
    layout = shared_rows(pairs).layout
    pos, vis = np.array(layout.positions[0]), np.array(layout.visible()[0])
    q = int(layout.hidden_spans[0, 1])  # rejected's first own token
    assert pos[q] == 4 and q - 4 > WINDOW  # logically next to the prompt, physically far from it
    masks = Stack(tiny_model("gemma3_text")).masks(layout, mx.zeros((1, pos.size, 1)))
    local = np.array(masks[0])[0, 0] == 0  # additive for MLX's attention: 0 where visible, -inf elsewhere
    assert local[q, :4].all() and not local[q, 4:q].any() and np.array_equal(local & vis, local)


def test_unsupported_model_is_refused_with_its_type():
    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(2, 2)

    with pytest.raises(UnsupportedModel, match="Other.*supported: llama"):
        Stack(Other())


def test_tight_rows_only_where_their_attention_runs_fused(monkeypatch):
    """On CUDA our kernels take tight rows as hidden spans in bf16/fp16 at any head dim up to 128; in float32 the
    exclusion dims do where their 8 extra dims still fit the 128 MLX's fused attention takes (a head dim of 64,
    not of 128). Where neither fits, auto rows of pairs of their own lengths are the plain two-forward rows
    (nothing shared) and an explicit exclusion is refused with the reason."""
    import orpo.train.step as objective
    from orpo.engine import attention
    from orpo.engine.attention import ExclusionMask, HiddenSpans, exclusion_fits
    assert exclusion_fits(64, cuda=True) and exclusion_fits(120, cuda=True) and not exclusion_fits(128, cuda=True)
    assert exclusion_fits(128, cuda=False) and exclusion_fits(256, cuda=False)
    varied = random_pairs(6, 4)
    plain = shared_rows(varied, tight=False)
    assert plain.layout.plain and plain.layout.tokens.shape[0] == 2 * len(varied)
    assert np.array_equal(np.array(plain.targets), np.array(plain_rows(varied).targets))
    tight = shared_rows(varied).layout
    assert not tight.plain  # tight rows where they fit
    wide, wide_bf16 = tiny_model("llama", head_dim=128), tiny_model("llama", head_dim=128)
    wide_bf16.set_dtype(mx.bfloat16)
    for module in (objective, attention):  # the decisions as a CUDA machine takes them
        monkeypatch.setattr(module, "on_cuda", lambda: True)
    assert objective.tight_rows_fit(tiny_model("llama")) and objective.tight_rows_fit(wide_bf16)
    assert not objective.tight_rows_fit(wide)  # float32: neither the exclusion dims nor our kernels
    h = mx.zeros((*tight.tokens.shape, 1), mx.bfloat16)
    assert all(isinstance(m, HiddenSpans) for m in Stack(wide_bf16).masks(tight, h))
    assert all(isinstance(m, HiddenSpans) for m in Stack(tiny_model("llama")).masks(tight, h))
    h32 = h.astype(mx.float32)
    assert all(isinstance(m, ExclusionMask) for m in Stack(tiny_model("llama")).masks(tight, h32))
    from orpo.train.settings import engine_settings
    e = objective.resolve_engine(engine_settings({"prefix_attention": "exclusion"}))
    with pytest.raises(ValueError, match="exclusion rows of this model \\(head dim 128, mlx.core.float32\\)"):
        objective.check_attention(wide, e)
    objective.check_attention(wide_bf16, e)
    objective.check_attention(wide, dataclasses.replace(e, prefix_attention="auto"))
