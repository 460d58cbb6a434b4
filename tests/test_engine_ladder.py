"""The oracle ladder: naive two-forward ORPO -> each engine technique alone -> all together.

Rung 0 is the plain path (full logits of [chosen; rejected] rows under nn.value_and_grad,
itself checked against a numpy ORPO in test_train_loss.py). Every engine setting must give its loss
within LOSS_TOL (relative) and every LoRA gradient (every weight's, in full-parameter training) within
GRAD_TOL in relative norm. Float32 on the CPU:
the rungs differ only in summation order (measured: <= 2e-6 relative on the gradients).
"""

import dataclasses
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from test_engine_stack import random_pairs, tiny_model, with_unshared_pair

from conftest import MATMUL_TOL, shortest_pairs
from orpo.base.quantize import QuantizeSettings, quantize_in_memory
from orpo.engine.embedding import with_summed_embeddings
from orpo.engine.head import response_mean_logps
from orpo.train.data import pair_batch
from orpo.train.keys import DropoutKeys
from orpo.train.lora import adapter_weights, apply_lora
from orpo.train.settings import engine_settings, lora_settings, train_settings
from orpo.train.step import PLAIN, pair_scores, pair_value_and_grad, resolve_engine
from orpo.train.step import naive_pair_loss as pair_loss
from orpo.train.trainer import replay, train


def resolved(engine):
    """The engine settings of a mapping (schema defaults under it), resolved on this machine as a run does."""
    return resolve_engine(engine_settings(engine))


LOSS_TOL = 10 * MATMUL_TOL
GRAD_TOL = 20 * MATMUL_TOL
LAM = 0.25
# Each rung turns on exactly its technique(s) over the plain path (the schema's defaults turn some on).
ENGINES = {name: resolved({**PLAIN, **e}) for name, e in {
    "fused": {"head": "fused", "head_chunk": 7},
    "fused_auto_chunk": {"head": "fused", "head_chunk": 0},
    "segments_1": {"segment_layers": 1},
    "segments_2_of_3": {"segment_layers": 2},  # 3 layers: segments [0, 2) and [2, 3)
    "prefix": {"prefix_sharing": True},
    "all": {"head": "fused", "head_chunk": 7, "segment_layers": 2, "prefix_sharing": True},
    # Padded widths (what CUDA's cuDNN attention needs): padding is neither scored nor attended to.
    "width_128": {"width_multiple": 128},
    "prefix_width_24": {"prefix_sharing": True, "width_multiple": 24},  # split aligned to 24: prompt-tail queries
    # The other ways shared rows attend (train.engine.prefix_attention; split is the default).
    "prefix_exclusion": {"prefix_sharing": True, "prefix_attention": "exclusion"},
    "all_width_128": {"head": "fused", "head_chunk": 7, "segment_layers": 2, "prefix_sharing": True,
                      "width_multiple": 128},
    # Under mx.compile (whole step; per segment, with evaluations queued one ahead).
    "fused_compiled": {"head": "fused", "head_chunk": 7, "compile": True},
    "prefix_compiled": {"prefix_sharing": True, "compile": True},
    "all_compiled_overlap": {"head": "fused", "head_chunk": 7, "segment_layers": 2, "prefix_sharing": True,
                             "compile": True, "overlap": 1},
    # The attention's backward in a fixed order (a GPU's default): shared rows split, tight, and segmented.
    "prefix_ordered": {"prefix_sharing": True, "attention_backward": "ordered"},
    "prefix_exclusion_ordered": {"prefix_sharing": True, "prefix_attention": "exclusion",
                                 "attention_backward": "ordered"},
    "all_compiled_ordered": {"head": "fused", "head_chunk": 7, "segment_layers": 2, "prefix_sharing": True,
                             "compile": True, "attention_backward": "ordered"},
    # Each layer's MLP differentiated in token chunks (3 chunks: the last one shorter).
    "segments_1_mlp_chunks_3": {"segment_layers": 1, "mlp_chunks": 3},
    "all_compiled_mlp_chunks_2": {"head": "fused", "head_chunk": 7, "segment_layers": 1, "prefix_sharing": True,
                                  "compile": True, "overlap": 1, "mlp_chunks": 2},
    # Gated MLPs keeping gate and up alone (orpo.engine.mlp): eager, compiled, and segmented in MLP chunks; each with
    # the fused head, as the plain path runs mlx-lm's own model.
    "fused_gated_mlp": {"head": "fused", "head_chunk": 7, "gated_mlp": True},
    "prefix_compiled_gated_mlp": {"prefix_sharing": True, "compile": True, "gated_mlp": True},
    "all_compiled_mlp_chunks_2_gated": {"head": "fused", "head_chunk": 7, "segment_layers": 1, "prefix_sharing": True,
                                        "compile": True, "mlp_chunks": 2, "gated_mlp": True},
}.items()}


def lora_model(family: str, dropout: float = 0.0, num_layers: int = -1, quantize: QuantizeSettings | None = None):
    """A 3-layer tiny model (its weights quantized first with `quantize`) with LoRA on attention and MLP; B non-zero
    so every LoRA weight gets a gradient."""
    model = tiny_model(family, num_hidden_layers=3)
    if quantize:
        model, _ = quantize_in_memory(model, {}, quantize)
        model.freeze()
    keys = DropoutKeys(7)
    lora = lora_settings({"rank": 4, "alpha": 8, "num_layers": num_layers, "dropout": dropout,
                          "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]})
    apply_lora(model, lora, 7, keys)
    rng = np.random.default_rng(0)
    model.load_weights([(k, mx.array(rng.normal(scale=0.05, size=v.shape).astype(np.float32)))
                        for k, v in adapter_weights(model).items() if k.endswith("lora_b")], strict=False)
    model.train()
    keys.at(3, 1)
    return model, keys


def naive(model, pairs):
    """Rung 0: the trainer's original loss and gradients."""
    tokens, mask = pair_batch(pairs, list(range(len(pairs))))
    return nn.value_and_grad(model, pair_loss)(model, tokens, mask, len(pairs), LAM)


def assert_close(got, want, tol=GRAD_TOL):
    (loss, metrics), grads = got
    (want_loss, want_metrics), want_grads = want
    assert tree_map(lambda _: 0, grads) == tree_map(lambda _: 0, want_grads)  # nn.value_and_grad's tree
    assert loss.item() == pytest.approx(want_loss.item(), rel=LOSS_TOL)
    for k in want_metrics:
        assert metrics[k].item() == pytest.approx(want_metrics[k].item(), rel=LOSS_TOL, abs=LOSS_TOL), k
    flat = dict(tree_flatten(grads))
    for k, w in tree_flatten(want_grads):
        w, g = np.array(w), np.array(flat[k])
        assert np.linalg.norm(w) > 0, k  # a real gradient, not a zero that anything matches
        assert np.linalg.norm(g - w) <= tol * np.linalg.norm(w), (k, np.linalg.norm(g - w) / np.linalg.norm(w))


def test_plain_engine_is_the_trainer_path_bit_for_bit():
    model, _ = lora_model("llama", dropout=0.1)
    pairs = random_pairs(0, 3)
    (loss, metrics), grads = pair_value_and_grad(model, pairs, LAM, resolved(PLAIN))
    (want_loss, _), want = naive(model, pairs)
    assert loss.item() == want_loss.item() and metrics["prefix_fallbacks"].item() == 0
    for (k, g), (_, w) in zip(tree_flatten(grads), tree_flatten(want)):
        assert np.array_equal(np.array(g), np.array(w)), k


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_each_rung_matches_the_naive_two_forward_orpo(family, engine):
    model, _ = lora_model(family)
    pairs = random_pairs(1, 3)
    got = pair_value_and_grad(model, pairs, LAM, ENGINES[engine])
    assert_close(got, naive(model, pairs))
    assert got[0][1]["prefix_fallbacks"].item() == 0


# Full-parameter training: every weight trainable, tied (llama, gemma2 with its logit softcap) and untied heads.
FULL_FAMILIES = {"llama": {}, "llama_untied": {"tie_word_embeddings": False}, "gemma2": {}}


@pytest.mark.parametrize("family", list(FULL_FAMILIES))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_each_rung_gives_every_weights_gradient_when_all_train(family, engine):
    """No LoRA, every weight trainable (embedding, final norm and head included): each rung's loss and every
    gradient equal the naive path's (full logits under nn.value_and_grad, both uses of a tied embedding summed by
    autodiff; the rung's embedding summed by SummedEmbedding's one-hot matmul) within the ladder's tolerance:
    the fused head's dW, the segmented backward's two ends."""
    model = tiny_model(family.removesuffix("_untied"), num_hidden_layers=3, **FULL_FAMILIES[family])
    model.unfreeze()
    model.train()
    pairs = random_pairs(1, 3)
    want = naive(model, pairs)  # the embedding's gradient by autodiff's scatter-add
    names = {k for k, _ in tree_flatten(want[1])}
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= names
    assert ("lm_head.weight" in names) == family.endswith("_untied")
    assert len(names) == len(tree_flatten(model.parameters()))
    assert with_summed_embeddings(model) == ["model.embed_tokens"]  # as train.method full trains it
    assert_close(pair_value_and_grad(model, pairs, LAM, ENGINES[engine]), want)


@pytest.mark.parametrize("multiple", [24, 128])
def test_width_multiple_pads_the_model_inputs_to_a_multiple(multiple):
    from orpo.train.step import pack
    pairs = random_pairs(1, 3)
    for sharing in (False, True):
        tokens = pack(pairs, resolved({**PLAIN, "prefix_sharing": sharing, "width_multiple": multiple})).layout.tokens
        assert tokens.shape[1] % multiple == 0
        unpadded = pack(pairs, resolved({**PLAIN, "prefix_sharing": sharing})).layout.tokens
        assert unpadded.shape[1] % multiple != 0  # the control: these pairs need padding to get there
    tokens, _ = pair_batch(pairs, [0, 1, 2], multiple)
    assert (tokens.shape[1] - 1) % multiple == 0


def test_width_multiple_is_checked():
    with pytest.raises(ValueError, match="train.engine.width_multiple: -1 is less than the minimum of 0"):
        engine_settings({"width_multiple": -1})


def test_auto_settings_are_decided_by_the_device():
    from orpo.device import on_cuda
    e = resolved({})
    assert e.prefix_sharing is True  # on everywhere (bench/README.md)
    assert e.prefix_attention == "auto"  # decided per batch by the rows (orpo.train.rows.shared_rows)
    with pytest.raises(ValueError, match="train.engine.prefix_attention"):
        engine_settings({"prefix_attention": "dims"})
    assert e.input_multiple == (128 if on_cuda() else None)
    assert e.compile is on_cuda()
    assert resolved({"prefix_sharing": False}).prefix_sharing is False
    assert resolve_engine(e) == e  # deciding again changes nothing
    with pytest.raises(ValueError, match="prefix_sharing"):
        engine_settings({"prefix_sharing": "yes"})
    with pytest.raises(ValueError, match="train.engine.compile"):
        engine_settings({"compile": "yes"})
    with pytest.raises(ValueError, match="train.engine.overlap"):
        engine_settings({"overlap": -1})
    with pytest.raises(ValueError, match="memory_limit_gb"):
        engine_settings({"memory_limit_gb": -1})
    with pytest.raises(ValueError, match="train.engine has auto values left"):  # the step never decides them
        pair_scores(lora_model("llama")[0], random_pairs(1, 2), engine_settings({}))


def test_mlp_chunks_refuse_lora_dropout_on_the_mlp():
    model, _ = lora_model("llama", dropout=0.1)
    with pytest.raises(ValueError, match=r"mlp_chunks > 1 with LoRA dropout on the MLP \(down_proj"):
        pair_value_and_grad(model, random_pairs(1, 2), LAM, ENGINES["segments_1_mlp_chunks_3"])


@pytest.mark.parametrize("engine", ["fused_compiled", "all_compiled_overlap"])
def test_a_compiled_step_reads_the_current_weights_and_dropout_keys(engine):
    """A trace is reused across steps, so nothing it reads may be a stale constant: after the LoRA weights
    and the dropout keys move, the compiled step still equals the uncompiled one, with no new trace."""
    from orpo.engine.compiled import kept_count
    model, keys = lora_model("llama", dropout=0.3)
    pairs = random_pairs(8, 3)
    compiled, eager = ENGINES[engine], dataclasses.replace(ENGINES[engine], compile=False)
    first = pair_value_and_grad(model, pairs, LAM, compiled)
    assert_close(first, pair_value_and_grad(model, pairs, LAM, eager))
    traces = kept_count(model)
    rng = np.random.default_rng(1)
    model.load_weights([(k, v + mx.array(rng.normal(scale=0.05, size=v.shape).astype(np.float32)))
                        for k, v in adapter_weights(model).items()], strict=False)
    keys.at(4, 0)
    second = pair_value_and_grad(model, pairs, LAM, compiled)
    assert_close(second, pair_value_and_grad(model, pairs, LAM, eager))
    assert kept_count(model) == traces > 0
    # Control: the step really moved (new weights and masks give another loss and other gradients).
    assert abs(second[0][0].item() - first[0][0].item()) > 100 * LOSS_TOL * abs(first[0][0].item())


@pytest.mark.parametrize("engine", ["segments_1", "all", "all_compiled_overlap"])
def test_segmented_recompute_redraws_the_dropout_masks(engine):
    """LoRA dropout 0.3: the segmented backward equals the plain backward of the same rows and masks."""
    model, keys = lora_model("llama", dropout=0.3)
    pairs = random_pairs(2, 3)
    settings = ENGINES[engine]
    unsegmented = dataclasses.replace(settings, segment_layers=0)  # same layout, so the same dropout masks
    want = pair_value_and_grad(model, pairs, LAM, unsegmented)
    if not settings.prefix_sharing:
        assert_close(want, naive(model, pairs))  # rows [chosen; rejected]: the trainer's very masks
    assert_close(pair_value_and_grad(model, pairs, LAM, settings), want)
    # Control: other keys draw other masks, and that moves the gradient far beyond the tolerance
    # (relative changes of order 1; on a GPU the tolerance itself is 0.02, hence the fixed 0.2 floor).
    keys.at(3, 2)
    other = dict(tree_flatten(pair_value_and_grad(model, pairs, LAM, unsegmented)[1]))
    diffs = [np.linalg.norm(np.array(other[k]) - np.array(w)) / np.linalg.norm(np.array(w))
             for k, w in tree_flatten(want[1])]
    assert max(diffs) > max(0.2, 10 * GRAD_TOL)


@pytest.mark.parametrize("engine", ["fused_gated_mlp", "prefix_compiled_gated_mlp"])
def test_gated_mlps_recompute_through_the_same_dropout_masks(engine):
    """LoRA dropout 0.3 on down_proj: the gated backward recomputes down's input under the same keyed masks, so the
    step equals mlx-lm's MLPs' with the same masks (test_segmented_recompute_redraws_the_dropout_masks shows
    that other masks move the gradients far beyond the tolerance)."""
    model, _ = lora_model("llama", dropout=0.3)
    pairs = random_pairs(2, 3)
    settings = ENGINES[engine]
    assert_close(pair_value_and_grad(model, pairs, LAM, settings),
                 pair_value_and_grad(model, pairs, LAM, dataclasses.replace(settings, gated_mlp=False)))


def test_unshared_prompts_fall_back_are_counted_and_stay_exact():
    model, _ = lora_model("qwen3")
    pairs = with_unshared_pair(random_pairs(3, 3), 4)
    # A pair given as two full sequences whose prompts agree is detected as shared, not counted.
    p, c, r = pairs.prompt[0], pairs.chosen[0], pairs.rejected[0]
    pairs.ids.append("full_but_shared")
    pairs.prompt.append([])
    pairs.chosen.append(p + c)
    pairs.rejected.append(p + r)
    pairs.chosen_mask.append([0] * len(p) + pairs.chosen_mask[0])
    pairs.rejected_mask.append([0] * len(p) + pairs.rejected_mask[0])
    want = naive(model, pairs)
    for engine in ("prefix", "all"):
        got = pair_value_and_grad(model, pairs, LAM, ENGINES[engine])
        assert got[0][1]["prefix_fallbacks"].item() == 1
        assert_close(got, want)


def test_lora_on_the_last_layer_only():
    """Segments below the lowest LoRA layer are skipped in the backward; gradients still match."""
    model, _ = lora_model("gemma2", num_layers=1)
    pairs = random_pairs(5, 2)
    for engine in ("segments_1", "all"):
        assert_close(pair_value_and_grad(model, pairs, LAM, ENGINES[engine]), naive(model, pairs))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_validation_logps_match_the_naive_head(engine):
    model, _ = lora_model("gemma3_text")
    model.eval()
    pairs = with_unshared_pair(random_pairs(6, 3), 7)
    want = np.array(response_mean_logps(model, *pair_batch(pairs, list(range(len(pairs))))))
    chosen, rejected, _ = pair_scores(model, pairs, ENGINES[engine])
    np.testing.assert_allclose(np.concatenate([chosen, rejected]), want, rtol=LOSS_TOL)


def test_engine_settings_are_checked():
    with pytest.raises(ValueError, match="train.engine.head: 'flash' is not one of"):
        engine_settings({"head": "flash"})
    with pytest.raises(ValueError, match=r"unknown key train.engine.segments \(allowed here: attention_backward, cache_limit_gb"):
        engine_settings({"segments": 2})


ALL_ON = {"head": "fused", "head_chunk": 64, "segment_layers": 1, "prefix_sharing": True, "compile": True, "overlap": 1}


def adapters(run) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in mx.load(str(run / "adapters.safetensors")).items()}


@pytest.fixture(scope="module")
def short_rendered(tiny_rendered, tmp_path_factory):
    return shortest_pairs(tiny_rendered, tmp_path_factory.mktemp("engine") / "rendered")


def test_training_with_every_engine_option_ends_near_the_naive_run(tiny_base, short_rendered, tmp_path):
    """Same settings, engine all on vs off: adapters and logged losses agree; the engine run replays bit-exactly."""
    settings = {"batch_size": 2, "grad_accum": 2, "max_steps": 6, "checkpoint_every": 3, "log_every": 1,
                "lr": 0.003, "lora": {"rank": 4, "alpha": 8}}
    runs = {}
    for name, engine in (("naive", PLAIN), ("engine", ALL_ON)):
        runs[name] = tmp_path / name
        train(tiny_base, short_rendered, runs[name], train_settings({**settings, "engine": engine}))
    a, b = adapters(runs["naive"]), adapters(runs["engine"])
    for k in a:
        # Measured 6.5e-6 on the CPU (summation order, through Adam); TF32 on CUDA is looser.
        assert np.linalg.norm(b[k] - a[k]) <= 100 * MATMUL_TOL * np.linalg.norm(a[k]), k
    logs = {n: [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()] for n, r in runs.items()}
    train_logs = {n: [x for x in v if x["split"] == "train"] for n, v in logs.items()}
    assert all(x["prefix_fallbacks"] == 0 for x in train_logs["engine"])
    for x, y in zip(train_logs["naive"], train_logs["engine"], strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4) and y["tokens"] == x["tokens"]
    assert replay(runs["engine"], tiny_base, short_rendered, "final", "zero")["equal"]


def test_training_with_dropout_and_every_engine_option_replays(tiny_base, short_rendered, tmp_path):
    """Dropout 0.2 + all engine options (a memory limit too) + accumulation: deterministic (replay from scratch is
    bit-exact), and B moves off zero."""
    settings = {"batch_size": 2, "grad_accum": 2, "max_steps": 4, "checkpoint_every": 2, "log_every": 1,
                "lr": 0.01, "lora": {"rank": 4, "alpha": 8, "dropout": 0.2},
                "engine": {**ALL_ON, "memory_limit_gb": 0.05}}  # a limit the steps keep running into
    run = tmp_path / "run"
    train(tiny_base, short_rendered, run, train_settings(settings))
    assert replay(run, tiny_base, short_rendered, "final", "zero")["equal"]
    assert max(np.abs(v).max() for k, v in adapters(run).items() if k.endswith("lora_b")) > 1e-3
