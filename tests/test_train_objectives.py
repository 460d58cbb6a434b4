"""train.objective against a float64 numpy reference (value and gradient by finite differences), each engine path
against the naive one for each objective, DPO's reference forward, and the λ controller."""

import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_engine_ladder import ENGINES, assert_close, lora_model
from test_engine_stack import random_pairs, tiny_model

from orpo.engine.head import response_mean_logps
from orpo.train.data import pair_batch, scored_counts
from orpo.train.lambdas import LambdaController, lambda_schedule
from orpo.train.lora import adapters_off
from orpo.train.objectives import OBJECTIVES, Objective, PairLoss, pair_objective
from orpo.train.settings import train_settings
from orpo.train.step import naive_pair_loss, pair_value_and_grad, prepare, reference_logps

BETA, GAMMA, DPO_BETA, LAM = 2.0, 0.7, 0.3, 0.4


def np_log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def np_objective(name, logps, counts, ref, nll_logp=None):
    """Reference objectives in float64, straight from their papers' formulas; batch mean."""
    n = len(logps) // 2
    lw, lr = logps[:n], logps[n:]
    nll = -lw if nll_logp is None else -nll_logp
    odds = lambda lp: lp - np.log(-np.expm1(lp))  # noqa: E731
    simpo = -np_log_sigmoid(BETA * (lw - lr) - GAMMA)
    s, s_ref = logps * counts, ref * counts
    terms = {
        "orpo": nll + LAM * -np_log_sigmoid(odds(lw) - odds(lr)),
        "simpo": simpo,
        "orpo_margin": nll + LAM * simpo,
        "sft_simpo": nll + simpo,
        "dpo": -np_log_sigmoid(DPO_BETA * ((s[:n] - s_ref[:n]) - (s[n:] - s_ref[n:]))),
    }
    return terms[name].mean()


def _case(seed, n=4):
    rng = np.random.default_rng(seed)
    logps = -rng.uniform(0.2, 3.0, 2 * n)
    counts = rng.integers(1, 9, 2 * n).astype(np.float64)
    ref = logps + rng.normal(scale=0.3, size=2 * n)
    nll_logp = -rng.uniform(0.2, 3.0, n)
    return logps, counts, np.minimum(ref, -1e-3), nll_logp


def _ours(name, logps, counts, ref, nll_logp):
    loss = PairLoss(Objective(name, BETA, GAMMA, DPO_BETA), LAM, mx.array(ref.astype(np.float32)))
    f32 = lambda a: mx.array(a.astype(np.float32))  # noqa: E731
    nll = None if nll_logp is None else f32(nll_logp)
    return pair_objective(loss, f32(logps), f32(counts), nll)


@pytest.mark.parametrize("name", OBJECTIVES)
@pytest.mark.parametrize("nll_span", ["response", "prompt_and_response"])
def test_each_objective_matches_numpy_in_value_and_gradient(name, nll_span):
    logps, counts, ref, nll_logp = _case(OBJECTIVES.index(name))
    nll_logp = None if nll_span == "response" else nll_logp
    loss, metrics = _ours(name, logps, counts, ref, nll_logp)
    assert loss.item() == pytest.approx(np_objective(name, logps, counts, ref, nll_logp), rel=1e-5)
    assert metrics["margin"].item() == pytest.approx(np.mean(logps[:4] - logps[4:]), rel=1e-5)

    def ours(lp, nl):
        return pair_objective(PairLoss(Objective(name, BETA, GAMMA, DPO_BETA), LAM, mx.array(ref.astype(np.float32))),
                              lp, mx.array(counts.astype(np.float32)), nl)[0]

    lp = mx.array(logps.astype(np.float32))
    if nll_logp is None:
        g_lp = mx.grad(lambda lp: ours(lp, None))(lp)
    else:
        g_lp, g_nl = mx.grad(ours, argnums=(0, 1))(lp, mx.array(nll_logp.astype(np.float32)))
    eps = 1e-6
    fd = np.array([(np_objective(name, logps + eps * e, counts, ref, nll_logp)
                    - np_objective(name, logps - eps * e, counts, ref, nll_logp)) / (2 * eps) for e in np.eye(8)])
    assert np.abs(fd).max() > 1e-3  # the check is not vacuous
    np.testing.assert_allclose(np.array(g_lp), fd, rtol=1e-4, atol=1e-6)
    if nll_logp is not None:
        f = lambda nl: np_objective(name, logps, counts, ref, nl)  # noqa: E731
        fd_nl = np.array([(f(nll_logp + eps * e) - f(nll_logp - eps * e)) / (2 * eps) for e in np.eye(4)])
        np.testing.assert_allclose(np.array(g_nl), fd_nl, rtol=1e-4, atol=1e-6)
        assert (np.abs(fd_nl).max() > 0) == (name in ("orpo", "orpo_margin", "sft_simpo"))


def test_the_margin_keeps_simpos_gradient_alive_where_orpos_fades():
    """Past a separation of 0 ORPO's push fades; SimPO's γ keeps it until β·margin passes γ (the reason for
    orpo_margin)."""
    logps = np.array([-1.0, -1.05])  # chosen just ahead
    counts = np.ones(2)
    g = {name: np.array(mx.grad(lambda lp: _pair(name, lp, counts))(mx.array(logps.astype(np.float32))))
         for name in ("orpo", "orpo_margin")}
    # d/d l_r of the preference term: ORPO's is LAM · σ(-log_odds) ≈ LAM/2 (measured 0.30); with γ, β 5: 1.70.
    assert g["orpo_margin"][1] > 4 * g["orpo"][1] > 0


def _pair(name, lp, counts):
    return pair_objective(PairLoss(Objective(name, 5.0, 2.0, DPO_BETA), LAM), lp,
                          mx.array(counts.astype(np.float32)))[0]


# One of each engine path: fused head, segmented backward, prefix sharing, all together, compiled.
PATHS = ["fused", "segments_2_of_3", "prefix_exclusion", "all", "prefix_compiled", "all_compiled_overlap"]


def naive_objective(model, pairs, objective):
    tokens, mask = pair_batch(pairs, list(range(len(pairs))))
    ref = None
    if objective.needs_reference:
        with adapters_off(model):
            ref = mx.stop_gradient(response_mean_logps(model, tokens, mask))
    loss = PairLoss(objective, LAM, ref)
    return nn.value_and_grad(model, naive_pair_loss)(model, tokens, mask, len(pairs), loss)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_every_engine_path_serves_every_objective(name):
    model, _ = lora_model("llama")
    pairs = random_pairs(1, 3)
    objective = Objective(name, BETA, GAMMA, DPO_BETA)
    want = naive_objective(model, pairs, objective)
    assert want[0][0].item() != pytest.approx(math.log(2)), "the reference equals the policy: a vacuous DPO"
    for path in PATHS:
        assert_close(pair_value_and_grad(model, pairs, PairLoss(objective, LAM), ENGINES[path]), want)


def test_dpo_reference_is_the_model_without_adapters():
    model, _ = lora_model("llama")
    pairs = random_pairs(2, 3)
    base = tiny_model("llama", num_hidden_layers=3)  # the same seed's weights, no adapters
    tokens, mask = pair_batch(pairs, list(range(3)))
    want = np.array(response_mean_logps(base, tokens, mask))
    for path in ("fused", "prefix_compiled"):
        got = np.array(reference_logps(model, prepare(pairs, ENGINES[path]), ENGINES[path]))
        np.testing.assert_allclose(got, want, rtol=1e-5)
    with_adapters = np.array(response_mean_logps(model, tokens, mask))
    assert np.abs(with_adapters - want).max() > 1e-4  # the adapters are back on after it
    counts = np.array(scored_counts(pairs))
    np.testing.assert_array_equal(counts, np.array(mask[:, 1:].sum(axis=-1)))
    with pytest.raises(ValueError, match="has none .*train.method full passes its frozen copy"):
        with adapters_off(base):
            pass


# --- the λ controller ---

def np_controller(nlls, lam0, kp, ki, kd, window, target, lo, hi):
    """The controller's λ after each step, written out in float64 from its definition."""
    out, hist, ref, integral, prev, lam = [], [], None, 0.0, None, lam0
    for x in nlls:
        hist = (hist + [x])[-window:]
        if ref is None and len(hist) == window:
            ref = np.mean(hist)
        if ref is not None:
            e = target - (np.mean(hist) - ref)
            raw = lam0 + kp * e + ki * (integral + e) + kd * (0.0 if prev is None else e - prev)
            if not ((raw > hi and e > 0) or (raw < lo and e < 0)):
                integral += e
            lam, prev = min(max(raw, lo), hi), e
        out.append(lam)
    return out


CONTROLLER = {"kp": 4.0, "ki": 0.5, "kd": 2.0, "window": 3, "target_drift": 0.02, "lambda_min": 0.05,
              "lambda_max": 0.6}


def _controller():
    return lambda_schedule(train_settings({"lambda": 0.2, "lambda_schedule": "controller", "controller": CONTROLLER}))


def test_the_controller_is_its_pid_law_and_resumes_from_its_state():
    rng = np.random.default_rng(0)
    nlls = list(1.5 - 0.02 * np.arange(30) + rng.normal(scale=0.03, size=30)) + list(1.0 + 0.05 * np.arange(20))
    c = _controller()
    got = []
    for x in nlls:
        c.observe(x)
        got.append(c.value)
    want = np_controller(nlls, 0.2, **{k: CONTROLLER[k] for k in ("kp", "ki", "kd", "window")},
                         target=CONTROLLER["target_drift"], lo=0.05, hi=0.6)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[:2] == [0.2, 0.2] and min(got) == 0.05 and max(got) == 0.6  # held, then both bounds reached
    # NLL falling (headroom): λ rises; NLL rising past the target: λ falls.
    assert got[5] > 0.2 and got[-1] < got[30]
    first = _controller()
    for x in nlls[:17]:
        first.observe(x)
    resumed = _controller()
    resumed.load(json.loads(json.dumps(first.state())))  # a checkpoint's state.json, read back
    replayed = got[:17]
    for x in nlls[17:]:
        resumed.observe(x)
        replayed.append(resumed.value)
    assert replayed == got  # bit for bit


def test_the_controller_is_refused_where_lambda_does_nothing():
    with pytest.raises(ValueError, match="objective simpo does not use"):
        lambda_schedule(train_settings({"objective": "simpo", "lambda_schedule": "controller"}))
    with pytest.raises(ValueError, match="outside the controller's bounds"):
        lambda_schedule(train_settings({"lambda": 2.0, "lambda_schedule": "controller"}))
    with pytest.raises(ValueError, match="no controller state"):
        LambdaController(0.1, train_settings({}).controller).load(None)
