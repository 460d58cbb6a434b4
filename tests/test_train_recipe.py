"""The ORPO authors' recipe as options: the NLL over prompt and response (train.nll_span), training without a
validation split, and checkpoints at each epoch's end with the best validation loss selected among them."""

import json

import mlx.core as mx
import numpy as np
import polars as pl
import pytest
from test_engine_ladder import ENGINES, LAM, assert_close, lora_model, resolved
from test_engine_stack import random_pairs, with_unshared_pair

from conftest import MATMUL_TOL, TINY_TRAIN, shortest_pairs
from orpo.train.step import PLAIN, naive_pair_loss, pair_scores, pair_value_and_grad, plain_batch
from orpo.train.settings import train_settings
from orpo.train.trainer import replay, train

# --- the NLL span --------------------------------------------------------------------------------------------


def np_log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_orpo_spans(model, pairs, lam: float) -> dict[str, float]:
    """float64 numpy ORPO of each pair's two sequences, one forward each, from the model's logits.

    The odds ratio compares the responses' mean log-probs (scored tokens); the NLL is the chosen sequence's mean
    -log p over its scored response tokens (response) or over those and every prompt token but the first
    (prompt_and_response), then the batch mean of NLL + lam * L_OR.
    """
    out = {"response": [], "prompt_and_response": [], "or": []}
    for i in range(len(pairs)):
        means = []
        for response, mask in ((pairs.chosen[i], pairs.chosen_mask[i]), (pairs.rejected[i], pairs.rejected_mask[i])):
            seq = pairs.prompt[i] + response
            logits = np.array(model(mx.array([seq[:-1]])).astype(mx.float32), np.float64)[0]
            logp = np.take_along_axis(np_log_softmax(logits), np.array(seq[1:])[:, None], -1)[:, 0]  # token t at t-1
            p = len(pairs.prompt[i])
            scored = [t for t in range(1, len(seq)) if t >= p and mask[t - p]]
            means.append(np.mean([logp[t - 1] for t in scored]))
            if len(means) == 1:
                out["response"].append(-means[0])
                spanned = list(range(1, p)) + scored
                out["prompt_and_response"].append(-np.mean([logp[t - 1] for t in spanned]))
        lw, lr = means
        log_odds = (lw - np.log(-np.expm1(lw))) - (lr - np.log(-np.expm1(lr)))
        out["or"].append(np.log1p(np.exp(-log_odds)))
    return {span: float(np.mean(np.array(out[span]) + lam * np.array(out["or"]))) for span in
            ("response", "prompt_and_response")} | {f"nll_{s}": float(np.mean(out[s])) for s in
                                                     ("response", "prompt_and_response")}


@pytest.mark.parametrize("span", ["response", "prompt_and_response"])
def test_the_naive_loss_of_each_span_is_the_numpy_orpo(span):
    model, _ = lora_model("llama")
    model.eval()  # no dropout: the oracle's forwards are the loss's
    pairs = random_pairs(4, 3)
    want = np_orpo_spans(model, pairs, LAM)
    (loss, metrics), _ = pair_value_and_grad(model, pairs, LAM, resolved(PLAIN), span)
    assert loss.item() == pytest.approx(want[span], rel=1e-5)
    assert metrics["nll"].item() == pytest.approx(want[f"nll_{span}"], rel=1e-5)
    # The spans give different losses here (prompts of 3-11 tokens), so the test tells them apart.
    assert abs(want["response"] - want["prompt_and_response"]) > 100 * 1e-5 * want["response"]


def naive_with_span(model, pairs):
    """Rung 0 with the prompt in the NLL: the full-logits loss with the chosen rows' NLL mask."""
    import mlx.nn as nn

    tokens, mask, nll = plain_batch(pairs, None, "prompt_and_response")
    return nn.value_and_grad(model, naive_pair_loss)(model, tokens, mask, len(pairs), LAM, nll)


@pytest.mark.parametrize("engine", ["fused", "segments_1", "prefix", "prefix_exclusion", "all", "all_width_128",
                                    "fused_compiled", "prefix_compiled", "all_compiled_overlap",
                                    "all_compiled_mlp_chunks_2"])
def test_every_engine_path_scores_the_prompt_span_as_the_naive_loss(engine):
    """The oracle ladder for prompt_and_response: loss, metrics and every LoRA gradient, shared prompts or not."""
    model, _ = lora_model("llama")
    pairs = with_unshared_pair(random_pairs(5, 3), 6)
    want = naive_with_span(model, pairs)
    got = pair_value_and_grad(model, pairs, LAM, ENGINES[engine], "prompt_and_response")
    assert_close(got, want)
    response = pair_value_and_grad(model, pairs, LAM, ENGINES[engine], "response")
    assert abs(response[0][0].item() - got[0][0].item()) > 100 * MATMUL_TOL * abs(got[0][0].item())
    # Validation's scores give the same NLL without gradients.
    chosen, rejected, nll_logp = pair_scores(model, pairs, ENGINES[engine], "prompt_and_response")
    assert (-nll_logp.mean()).item() == pytest.approx(want[0][1]["nll"].item(), rel=10 * MATMUL_TOL)
    assert pair_scores(model, pairs, ENGINES[engine], "response")[2] is None


def test_an_unknown_span_is_refused():
    with pytest.raises(ValueError, match="train.nll_span"):
        train_settings({"nll_span": "prompt"})


# --- no hold-out; checkpoints at each epoch's end -------------------------------------------------------------


def test_no_validation_split_trains_end_to_end(tiny_raw, tiny_base, tmp_path, capfd):
    """curate.validation_fraction 0 -> an empty validation split -> a run with no validation and no best
    checkpoints, said once; final replays bit-exactly; a best_* checkpoint is refused with the reason."""
    from orpo.curate import curate
    from orpo.render.pairs import render_pairs
    from orpo.report import sources

    manifest = curate([str(tiny_raw)], tmp_path / "curated", {"validation_fraction": 0},
                      tokenizer=str(tiny_base / "tokenizer.json"))
    assert pl.read_parquet(tmp_path / "curated" / "validation.parquet").height == 0
    assert manifest["output_rows"]["validation"] == 0
    assert pl.read_parquet(tmp_path / "curated" / "train.parquet").height == manifest["output_rows"]["total"] > 0
    render_pairs(tiny_base, tmp_path / "curated", tmp_path / "rendered", {"max_length": 256, "max_prompt_length": 96})
    rendered = shortest_pairs(tmp_path / "rendered", tmp_path / "short", n_train=12, n_val=0)
    run = tmp_path / "run"
    index = train(tiny_base, rendered, run, train_settings({**TINY_TRAIN, "max_steps": 0, "epochs": 2, "checkpoint_every": 3,
                                             "nll_span": "prompt_and_response"}))
    err = capfd.readouterr().err
    assert err.count("no validation pairs (curate.validation_fraction 0") == 1
    assert "baseline" not in index and "best_loss_step" not in index and "best_margin_step" not in index
    assert sorted(map(int, index["checkpoints"])) == [3, 6] and index["final_step"] == 6
    assert all(c["validation"] is None for c in index["checkpoints"].values())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {x["split"] for x in lines} == {"train"} and len(lines) == 6
    assert sources.validation_points(run) == []
    assert replay(run, tiny_base, rendered, "final", "previous")["equal"]
    with pytest.raises(ValueError, match="best_loss: the run had no validation pairs.*use final or a step number"):
        replay(run, tiny_base, rendered, "best_loss")


def test_config_refuses_a_validation_choice_without_validation_pairs():
    from orpo.config import PROJECT_ROOT, ConfigError, validate_config

    for key, section in (("checkpoint", "replay"), ("adapter", "generate")):
        with pytest.raises(ConfigError, match=f"{section}.{key}: best_margin is chosen by validation"):
            validate_config({"curate": {"validation_fraction": 0}, "replay": {"checkpoint": "final"},
                             section: {key: "best_margin"}}, PROJECT_ROOT)
    cfg = validate_config({"curate": {"validation_fraction": 0}, "replay": {"checkpoint": "final"}}, PROJECT_ROOT)
    assert cfg["generate"]["adapter"] == "final"


@pytest.mark.parametrize("every, expected", [(0, [4, 8, 12]), (3, [3, 4, 6, 8, 9, 12])])
def test_each_epoch_ends_in_a_validated_checkpoint_and_best_loss_picks_among_them(
        tiny_base, tiny_rendered, tmp_path, every, expected):
    """16 pairs, 4 per step: epochs end at steps 4, 8, 12; best_loss is the checkpoint of least validation loss."""
    rendered = shortest_pairs(tiny_rendered, tmp_path / "short", n_train=17, n_val=4)  # one pair sits each epoch out
    settings = {**TINY_TRAIN, "max_steps": 0, "epochs": 3, "checkpoint_every": every, "checkpoint_each_epoch": True}
    index = train(tiny_base, rendered, tmp_path / "run", train_settings(settings))
    assert sorted(map(int, index["checkpoints"])) == expected
    losses = {int(k): v["validation"]["loss"] for k, v in index["checkpoints"].items()}
    assert index["best_loss_step"] == min(sorted(losses), key=losses.get)
    states = {k: json.loads((tmp_path / "run" / "checkpoints" / f"step-{k:06d}" / "state.json").read_text())
              for k in (4, 8, 12)}
    assert [states[k]["epoch_of_step"] for k in (4, 8, 12)] == [0, 1, 2]
    if every == 0:  # per-epoch selection: what the authors' load_best_model_at_end does with eval loss
        assert index["best_loss_step"] in (4, 8, 12)


def test_the_summary_says_a_run_had_no_validation_pairs():
    from orpo.report.summary import METRIC_NAMES, markdown

    iv = {"estimate": 0.5, "lo": 0.4, "hi": 0.6}
    e = {"name": "", "folder": "results", "prompts": 541, "models": {"orpo": dict.fromkeys(METRIC_NAMES, iv)},
         "differences": {}, "accuracy": {"start": None, "step": 6, "checkpoint": "final", "value": None},
         "replay": {"equal": True, "step": 6, "checkpoint": "final", "from_step": 3}}
    assert "| none: no validation pairs (step 6, final, scored) | equal: step 6 (final) retrained from step 3 |" \
        in markdown([e])
    e["accuracy"] = {"start": 0.41, "step": 6, "checkpoint": "final", "value": 0.67}
    assert "0.410 at step 0 → 0.670 at step 6 (final, scored)" in markdown([e])
