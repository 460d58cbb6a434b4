"""Full-parameter ORPO (train.method: full): frozen modules on the oracle ladder (every weight's rungs are in
test_engine_ladder.py), the float32-master update, the predicted memory, and runs that resume, replay, shard
over ranks and leave a model folder mlx-lm loads."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm import load
from mlx_lm.utils import load_model
from test_engine_ladder import ENGINES, LAM, assert_close, naive
from test_engine_stack import random_pairs, tiny_model

from conftest import TINY_TRAIN, shortest_pairs
from orpo.train.settings import train_settings
from orpo.engine.head import lm_head_of
from orpo.io import sha256_file
from orpo.optim import FlatAdamW, join_float32, split_float32
from orpo.train.checkpoint import read_index, step_dir
from orpo.train.footprint import parameter_bytes
from orpo.train.full import BUCKET_ELEMENTS, apply_full, frozen_modules, full_adamw
from orpo.train.session import build_session
from orpo.train.step import pair_value_and_grad
from orpo.train.trainer import replay, train


def full_model(family: str, freeze: list[str] | None = None, **overrides):
    """A 3-layer tiny model with every weight trainable but `freeze`, as train.method full has it."""
    model = tiny_model(family, num_hidden_layers=3, **overrides)
    apply_full(model, {"freeze": freeze or []})
    model.train()
    return model


@pytest.mark.parametrize("freeze", [["embed_tokens"], ["lm_head"], ["embed_tokens", "lm_head"], ["layers.0", "norm"]])
@pytest.mark.parametrize("engine", ["all", "segments_1", "all_compiled_overlap"])
def test_frozen_modules_get_no_gradient_and_the_rest_match(freeze, engine):
    """train.full.freeze: the frozen modules are absent from the gradients (a frozen head's fused path gives h's
    cotangent only; a frozen embedding stops the segmented backward at the lowest trainable layer)."""
    model = full_model("llama", freeze, tie_word_embeddings=False)
    got = pair_value_and_grad(model, random_pairs(2, 3), LAM, ENGINES[engine])
    names = {k for k, _ in tree_flatten(got[1])}
    for module in frozen_modules(model, freeze):
        assert not any(k.startswith(module + ".") for k in names), module
    assert_close(got, naive(model, random_pairs(2, 3)))


def test_freeze_names_are_checked():
    tied = tiny_model("llama")
    with pytest.raises(ValueError, match="'lm_head' names no module .*tied model.embed_tokens"):
        apply_full(tied, {"freeze": ["lm_head"]})
    with pytest.raises(ValueError, match="'encoder' names no module"):
        apply_full(tied, {"freeze": ["encoder"]})
    with pytest.raises(ValueError, match="freezes every weight"):
        apply_full(tied, {"freeze": ["model"]})
    assert frozen_modules(tied, ["norm"]) == ["model.norm"]  # a last part, not input_layernorm's
    record = apply_full(tied, {"freeze": ["embed_tokens"]})
    assert record["frozen_modules"] == ["model.embed_tokens"] and not lm_head_of(tied).trainable


# --- the update: float32 masters under bf16 weights ---


def test_lr_5e6_updates_on_bf16_weights_add_up_as_in_float32():
    """100 AdamW steps at lr 5e-6 on a bf16 layer: FlatAdamW's float32 masters give exactly the bf16 rounding of
    a float32 reference (mlx.optimizers.AdamW on float32 weights); updating the bf16 weights in place loses them.

    An Adam step moves a weight by about lr; a bf16 weight of magnitude ~0.05 has an ulp of 2^-12 = 2.4e-4, so
    a 5e-6 step rounds back to the same value: in place, after 100 steps (a 5e-4 drift in float32) most weights
    have not moved at all.
    """
    mx.random.seed(0)
    layer = nn.Linear(64, 48)
    layer.set_dtype(mx.bfloat16)
    reference = {k: v.astype(mx.float32) for k, v in tree_flatten(layer.parameters())}
    inplace = optim.AdamW(5e-6, weight_decay=0.01)
    inplace_weights = dict(tree_flatten(layer.parameters()))
    reference_opt = optim.AdamW(5e-6, weight_decay=0.01)
    ours = FlatAdamW([5e-6], 0.01, lambda name: 0, master_dtype=mx.float32, bucket_elements=1000)
    ours.attach(layer)
    assert len(ours.buckets) == 2  # the 3072-element weight alone, the bias in a bucket of its own
    start = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(layer.parameters())}
    for step in range(100):
        k = mx.random.split(mx.random.key(step))
        grads = {"weight": mx.random.normal((48, 64), key=k[0]).astype(mx.bfloat16),
                 "bias": mx.random.normal((48,), key=k[1]).astype(mx.bfloat16)}
        ours.update(layer, grads, 0.0)
        reference = reference_opt.apply_gradients({n: g.astype(mx.float32) for n, g in grads.items()}, reference)
        inplace_weights = inplace.apply_gradients(grads, inplace_weights)
        mx.eval(layer.parameters(), ours.state, reference, inplace_weights, reference_opt.state, inplace.state)
    for name, w in tree_flatten(layer.parameters()):
        assert w.dtype == mx.bfloat16
        assert np.array_equal(np.array(w.astype(mx.float32)), np.array(reference[name].astype(mx.bfloat16).astype(mx.float32))), name
        master = ours.state_dict()[f"{name}.master"]
        np.testing.assert_allclose(np.array(master), np.array(reference[name]), rtol=1e-6, atol=1e-9)
        drift = np.abs(np.array(reference[name]) - start[name])
        moved_ours = np.array(w.astype(mx.float32)) != start[name]
        moved_inplace = np.array(inplace_weights[name].astype(mx.float32)) != start[name]
        assert drift.mean() > 1e-4  # the float32 reference did move
        assert moved_ours.mean() > 0.5 and moved_inplace.mean() < 0.5 * moved_ours.mean(), (name, moved_ours.mean(),
                                                                                            moved_inplace.mean())


def test_split_float32_holds_a_float32_exactly_and_its_high_half_is_the_bf16_rounding():
    """split_float32 / join_float32 round-trip every float32 bit for bit (signs, zero, tiny and huge values, values
    whose rounding carries into the exponent); the high half is mlx's bf16 cast but at exact ties (low half 0x8000),
    where it rounds away from zero instead of to even."""
    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
                           np.array([0, 0x80000000, 0x3F7FFFFF, 0xBF7FFFFF, 0x3F808000, 0x3F818000, 0x00008000,
                                     0x0000FFFF, 0x7F7F0000], np.uint32)])
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    high, low = split_float32(mx.array(x))
    assert high.dtype == mx.bfloat16 and low.dtype == mx.uint16
    assert np.array_equal(np.array(join_float32(high, low)).view(np.uint32), x.view(np.uint32))
    cast = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    ours = np.array(high.astype(mx.float32))
    tie = (x.view(np.uint32) & 0xFFFF) == 0x8000
    assert np.array_equal(ours[~tie], cast[~tie]) and tie.sum() >= 2
    assert np.all(np.abs(ours[tie]) >= np.abs(x[tie]))  # away from zero


def _bf16_layer_and_grads(seed: int):
    mx.random.seed(seed)
    layer = nn.Linear(64, 48)
    layer.set_dtype(mx.bfloat16)
    grads = []
    for step in range(60):
        k = mx.random.split(mx.random.key(100 + step))
        grads.append({"weight": mx.random.normal((48, 64), key=k[0]).astype(mx.bfloat16),
                      "bias": mx.random.normal((48,), key=k[1]).astype(mx.bfloat16)})
    return layer, grads


@pytest.mark.parametrize("bias_correction", [False, True])
def test_split_masters_follow_a_float32_copy_bit_for_bit(bias_correction):
    """The split master (the bf16 weight plus its low 16 bits) runs the same float32 arithmetic as a float32 copy:
    after 60 steps at lr 5e-6 with clipping, masters and moments are bit-identical, bucketwise or whole."""
    runs = []
    for split, bucketwise in [(True, True), (False, False), (True, False)]:
        layer, grads = _bf16_layer_and_grads(3)
        opt = FlatAdamW([5e-6], 0.01, lambda name: 0, master_dtype=mx.float32, bucket_elements=1000,
                        bias_correction=bias_correction, bucketwise=bucketwise)
        if not split:
            opt._split = lambda b: False  # the float32 copy, as a float16 model's master is held
        opt.attach(layer)
        for g in grads:
            opt.update(layer, g, 1.0)
            mx.eval(layer.parameters(), opt.state)
        assert opt.nbytes() == (2 if split else 4) * 3120 + 8 * 3120
        runs.append({k: np.array(v) for k, v in opt.state_dict().items()})
    for other in runs[1:]:
        assert runs[0].keys() == other.keys()
        for k in runs[0]:
            assert np.array_equal(runs[0][k].view(np.uint32) if runs[0][k].dtype == np.float32 else runs[0][k],
                                  other[k].view(np.uint32) if other[k].dtype == np.float32 else other[k]), k


def test_bias_correction_is_torchs_adamw():
    """With bias_correction, FlatAdamW on float32 weights is torch.optim.AdamW's algorithm (its documented update,
    in float64 numpy): lr/(1 - b1^t) * m / (sqrt(v)/sqrt(1 - b2^t) + eps) after the decoupled decay; without it,
    the first update of a weight is (1 - b1)/sqrt(1 - b2) = 3.16x as large."""
    lr, wd, (b1, b2), eps = 1e-2, 0.1, (0.9, 0.999), 1e-8
    rng = np.random.default_rng(1)
    w0, grads = rng.normal(size=(16,)), [rng.normal(size=(16,)) for _ in range(5)]
    p, m, v = w0.copy(), np.zeros(16), np.zeros(16)
    for t, g in enumerate(grads, 1):
        p *= 1 - lr * wd
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p -= lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
    steps = {}
    for corrected in (True, False):
        layer = nn.Linear(16, 1, bias=False)
        layer.weight = mx.array(w0[None].astype(np.float32))
        opt = FlatAdamW([lr], wd, lambda name: 0, bias_correction=corrected)
        opt.attach(layer)
        for g in grads:
            opt.update(layer, {"weight": mx.array(g[None].astype(np.float32))}, 0.0)
            mx.eval(layer.parameters())
            steps.setdefault(corrected, np.array(layer.weight[0]) - w0 * (1 - lr * wd))
        if corrected:
            np.testing.assert_allclose(np.array(layer.weight[0]), p, rtol=1e-5, atol=1e-6)
    ratio = np.abs(steps[False]) / np.abs(steps[True])
    np.testing.assert_allclose(ratio, (1 - b1) / np.sqrt(1 - b2), rtol=1e-3)


def test_bucketwise_update_needs_one_buckets_temporaries():
    """Full training's update, one bucket at a time in place: its peak above the steady state (weights, low
    halves, moments, gradients) is a fraction of a byte per weight with 24 buckets, where one compiled update of
    every bucket (how a LoRA update runs) holds the old and the new state together (12 bytes more per weight)."""
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(512, 512, bias=False) for _ in range(24)]

    peaks = {}
    for bucketwise in (True, False):
        model = Stack()
        model.set_dtype(mx.bfloat16)
        opt = FlatAdamW([5e-6], 0.0, lambda name: 0, master_dtype=mx.float32, bucket_elements=512 * 512,
                        bucketwise=bucketwise)
        opt.attach(model)
        grads = tree_map(mx.ones_like, model.trainable_parameters())
        state = [model.state, opt.state]
        update = (lambda g: opt.update(model, g, 1.0)) if bucketwise else \
            mx.compile(lambda g: opt.update(model, g, 1.0), inputs=state, outputs=state)
        mx.eval(update(grads), opt.state, model.parameters())  # traces and compiles first
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(update(grads), opt.state, model.parameters())
        peaks[bucketwise] = (mx.get_peak_memory() - base) / (24 * 512 * 512)
    assert peaks[True] < 2 and peaks[False] > 10, peaks


def test_checkpointed_state_restores_the_masters(tmp_path):
    """state_dict holds masters and moments per weight; a fresh optimizer loading it continues bit for bit."""
    mx.random.seed(1)
    layer = nn.Linear(16, 8)
    layer.set_dtype(mx.bfloat16)
    a = full_adamw("constant", 1e-3, 10, 0, 0.0)
    a.attach(layer)
    grads = lambda s: {"weight": mx.random.normal((8, 16), key=mx.random.key(s)).astype(mx.bfloat16),  # noqa: E731
                       "bias": mx.random.normal((8,), key=mx.random.key(s + 99)).astype(mx.bfloat16)}
    for s in range(3):
        a.update(layer, grads(s), 1.0)
    state = a.state_dict()
    assert {"step", "weight.m", "weight.v", "weight.master", "bias.m", "bias.v", "bias.master"} == set(state)
    mx.save_safetensors(str(tmp_path / "opt.safetensors"), state)
    copy = nn.Linear(16, 8)
    copy.set_dtype(mx.bfloat16)
    copy.update(layer.parameters())
    b = full_adamw("constant", 1e-3, 10, 0, 0.0)
    b.load_state_dict(copy, mx.load(str(tmp_path / "opt.safetensors")))
    for s in range(3, 6):
        a.update(layer, grads(s), 1.0)
        b.update(copy, grads(s), 1.0)
    for (k, x), (_, y) in zip(tree_flatten(layer.parameters()) + tree_flatten(a.state), tree_flatten(copy.parameters()) + tree_flatten(b.state)):
        assert np.array_equal(np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))), k
    assert BUCKET_ELEMENTS >= 2**20


# --- runs ---


@pytest.fixture(scope="module")
def bf16_base(tiny_base, tmp_path_factory):
    """The tiny base model in bfloat16 (what a full run's masters are for), as a model folder."""
    out = tmp_path_factory.mktemp("bf16") / "model"
    shutil.copytree(tiny_base, out)
    model, _ = load_model(tiny_base)
    model.set_dtype(mx.bfloat16)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    return out


@pytest.fixture(scope="module")
def short(tiny_rendered, tmp_path_factory):
    return shortest_pairs(tiny_rendered, tmp_path_factory.mktemp("short") / "rendered", 16, 4)


FULL = {**TINY_TRAIN, "method": "full", "lr": 1e-4, "batch_size": 2, "grad_accum": 2, "epochs": 2, "max_steps": 6,
        "checkpoint_every": 2, "log_every": 1, "engine": {"head": "fused", "segment_layers": 1, "compile": True}}


@pytest.fixture(scope="module")
def full_run(bf16_base, short, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    train(bf16_base, short, out, train_settings(FULL), dtype="bfloat16")
    return out


def test_a_full_run_leaves_a_model_folder_and_checkpoints(full_run, bf16_base, short):
    index = read_index(full_run)
    assert sorted(map(int, index["checkpoints"])) == [2, 4, 6]
    for step in (2, 4, 6):
        d = step_dir(full_run, step)
        assert sha256_file(d / "model.safetensors") == index["checkpoints"][str(step)]["sha256"]
        assert (d / "optimizer.safetensors").is_file() == (step != 6)  # nothing resumes from the last step
    opt = mx.load(str(step_dir(full_run, 4) / "optimizer.safetensors"))
    assert {"model.embed_tokens.weight.master", "model.norm.weight.m", "model.layers.0.mlp.up_proj.weight.v"} <= set(opt)
    assert opt["model.embed_tokens.weight.master"].dtype == mx.float32
    assert not (full_run / "adapters.safetensors").exists()
    assert sha256_file(full_run / "model" / "model.safetensors") == index["checkpoints"]["6"]["sha256"]
    base, tok = load(str(bf16_base))
    tuned, _ = load(str(full_run / "model"))
    assert all(v.dtype == mx.bfloat16 for _, v in tree_flatten(tuned.parameters()))
    start = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(base.parameters())}
    moved = {k for k, v in tree_flatten(tuned.parameters()) if not np.array_equal(start[k], np.array(v.astype(mx.float32)))}
    assert "model.embed_tokens.weight" in moved  # the (tied) head and the embedding train
    # Every weight's float32 master moved; in bf16 the norms' (~1.0, an ulp of 2^-7) have not, at lr 1e-4.
    assert all(not np.array_equal(start[k], np.array(opt[f"{k}.master"])) for k in start)
    assert moved == set(start) - {k for k in start if k.endswith("norm.weight")}
    ids = mx.array([tok.encode("<|im_start|>user\nTell me about the cat.<|im_end|>\n<|im_start|>assistant\n")])
    assert float(mx.abs(base(ids).astype(mx.float32) - tuned(ids).astype(mx.float32)).max()) > 1e-3
    memory = index["run"]["memory_predicted"]
    assert memory["master_weights"] > 0 and memory["peak"] > memory["weights"] + memory["moments"]
    # The activations are an estimate: the whole prediction within 2x of the measured peak here. The peak counts
    # every array of this process: what earlier tests left alive is what was resident beyond the run's own state.
    measured = index["run"]["memory"]
    own = memory["weights"] + memory["master_weights"] + memory["moments"]
    left_alive = max(0.0, measured["resident_gb"] - own)
    assert 0.5 < memory["peak"] / (measured["peak_gb"] - left_alive) < 2, (memory, measured)


def test_a_prediction_past_the_device_or_the_plans_budget_is_a_warning():
    from orpo.train.footprint import GB, memory_warning
    from orpo.train.memory import device_memory

    assert memory_warning({"peak": 1.0, "bytes": {"peak": GB}}) is None
    assert memory_warning({"peak": 1.0, "bytes": {"peak": GB}, "budget_gb": 1.0}) is None
    past = device_memory() + GB
    assert "segment_layers 2" in memory_warning({"peak": past / GB, "bytes": {"peak": past}, "segment_layers": 2})
    over = memory_warning({"peak": 1.5, "bytes": {"peak": 1.5 * GB}, "budget_gb": 1.0, "segment_layers": 1,
                           "mlp_chunks": 8})
    assert "no memory plan fits the budget of 1.0 GB" in over and "mlp_chunks 8" in over
    # Memory another process holds counts against the device: a peak that fits alone no longer does beside it.
    fits = device_memory() - 2 * GB
    assert memory_warning({"peak": fits / GB, "bytes": {"peak": fits}}, outside=GB) is None
    shared = memory_warning({"peak": fits / GB, "bytes": {"peak": fits}, "segment_layers": 0}, outside=3 * GB)
    assert "beside 3.0 GB in use outside this run" in shared and "segment_layers 0" in shared


@pytest.mark.parametrize("start", ["zero", "previous"])
def test_a_full_run_replays_bit_for_bit(full_run, bf16_base, short, start):
    record = replay(full_run, bf16_base, short, 6 if start == "previous" else 4, start)
    assert record["equal"], record
    assert record["from_step"] == (4 if start == "previous" else 0)


def test_a_killed_full_run_resumes_to_the_same_model(full_run, bf16_base, short, tmp_path, capsys):
    """Killed after step 4's checkpoint: the resumed run restores masters and moments and ends bit-identical."""

    def killed(name: str):
        partial = tmp_path / f"{name}.partial"
        shutil.copytree(full_run, partial)
        shutil.rmtree(partial / "model")
        shutil.rmtree(step_dir(partial, 6))
        (partial / "complete.json").unlink()
        return step_dir(partial, 4) / "optimizer.safetensors"

    killed("run")
    train(bf16_base, short, tmp_path / "run", train_settings(FULL), dtype="bfloat16")
    assert "resumed from step 4/" in capsys.readouterr().err
    final = sha256_file(full_run / "model" / "model.safetensors")
    assert sha256_file(tmp_path / "run" / "model" / "model.safetensors") == final
    # The control: resumed without the masters (from the bf16 weights alone), the run ends elsewhere.
    opt_file = killed("other")
    mx.save_safetensors(str(opt_file), {k: v for k, v in mx.load(str(opt_file)).items() if not k.endswith(".master")})
    train(bf16_base, short, tmp_path / "other", train_settings(FULL), dtype="bfloat16")
    assert "resumed from step 4/" in capsys.readouterr().err
    assert sha256_file(tmp_path / "other" / "model" / "model.safetensors") != final


def test_generate_takes_a_full_run_for_its_adapter(full_run, bf16_base, tmp_path):
    """`orpo generate --adapter <run>` (what the workflow passes) generates with the run's model, at a checkpoint too."""
    from orpo.eval.generate import generate
    from orpo.generation import load_generator, trained_model_folder

    assert trained_model_folder(full_run) == full_run / "model"
    assert trained_model_folder(step_dir(full_run, 4)) == step_dir(full_run, 4)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"key": 1, "prompt": "Tell me about the cat.", "instruction_id_list": [], "kwargs": []}) + "\n")
    settings = {"max_tokens": 12}
    responses = {}
    for name, model, adapter in (("base", bf16_base, None), ("final", bf16_base, full_run),
                                 ("model", full_run / "model", None)):
        generate(model, prompts, tmp_path / f"{name}.jsonl", settings, adapter=adapter)
        responses[name] = json.loads((tmp_path / f"{name}.jsonl").read_text().splitlines()[0])["response"]
    assert responses["final"] == responses["model"] != responses["base"], responses
    done = subprocess.run([sys.executable, "-m", "orpo.cli", "generate", "--model", str(bf16_base), "--prompts",
                           str(prompts), "--out", str(tmp_path / "step4.jsonl"), "--settings", json.dumps(settings),
                           "--adapter", str(full_run), "--checkpoint", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "step4.jsonl").read_text().splitlines()[0])["response"]
    gen = load_generator(bf16_base, step_dir(full_run, 4))
    weights = dict(tree_flatten(gen.model.parameters()))
    saved = mx.load(str(step_dir(full_run, 4) / "model.safetensors"))
    assert all(np.array_equal(np.array(weights[k].astype(mx.float32)), np.array(v.astype(mx.float32))) for k, v in saved.items())


def test_predicted_parameter_memory_is_exact(bf16_base, short):
    """Weights, gradients, master weights and moments as predicted equal the bytes of the arrays a step holds."""
    sess = build_session(bf16_base, short, train_settings({**FULL, "grad_accum": 1}), dtype="bfloat16")
    predicted = parameter_bytes(sess.model, sess.opt.master_dtype, 1)
    batch = sess.prepare(1)[0]
    from orpo.train.step import batch_value_and_grad

    _, grads = batch_value_and_grad(sess.model, batch, 0.1, sess.engine)
    sess.update_fn()(grads)
    mx.eval(sess.model.parameters(), sess.opt.state)
    n = sum(v.size for _, v in tree_flatten(sess.model.parameters()))
    assert predicted["weights"] == sum(v.nbytes for _, v in tree_flatten(sess.model.parameters())) == 2 * n
    assert predicted["gradients"] == sum(v.nbytes for _, v in tree_flatten(grads)) == 2 * n
    # float32 masters held as the bf16 weights plus their low halves (2 bytes), float32 moments (8)
    assert predicted["master_weights"] + predicted["moments"] == sess.opt.nbytes() == 10 * n
    lora = build_session(bf16_base, short, train_settings({**TINY_TRAIN, "grad_accum": 2}), dtype="bfloat16")
    lora.step(1)
    predicted = parameter_bytes(lora.model, lora.opt.master_dtype, 2)
    adapters = sum(v.nbytes for _, v in tree_flatten(lora.model.trainable_parameters()))
    assert predicted["master_weights"] == 0 and predicted["moments"] == lora.opt.nbytes() == 2 * adapters
    assert predicted["gradients"] == 2 * adapters


def test_full_settings_are_refused_where_they_cannot_work(bf16_base, short, tiny_base, tmp_path):
    with pytest.raises(ValueError, match="init_adapter warm-starts LoRA"):
        build_session(bf16_base, short, train_settings({**FULL, "init_adapter": str(tmp_path)}), dtype="bfloat16")
    from mlx_lm.utils import quantize_model, save_config

    model, config = load_model(tiny_base)
    model, config = quantize_model(model, json.loads((tiny_base / "config.json").read_text()), group_size=32, bits=4)
    q = tmp_path / "q4"
    shutil.copytree(tiny_base, q)
    mx.save_safetensors(str(q / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    (q / "model.safetensors.index.json").unlink(missing_ok=True)
    save_config(config, q / "config.json")
    with pytest.raises(ValueError, match="cannot train a quantized model"):
        build_session(q, short, train_settings(FULL))


def test_accumulated_full_gradients_equal_the_whole_batch(tiny_base, short):
    """grad_accum 4 x batch 2 through the engine equals the naive gradient of the 8 pairs at once, every weight."""
    from orpo.train.accumulate import accumulate_grads
    from orpo.train.settings import engine_settings
    from orpo.train.step import PLAIN, batch_value_and_grad, prepare, resolve_engine

    sess = build_session(tiny_base, short, train_settings({**FULL, "grad_accum": 4, "epochs": 1}))
    parts = sess.micro_batches(1)
    assert [len(p) for p in parts] == [2, 2, 2, 2]

    def micro(j, sums):
        (_, metrics), grads = batch_value_and_grad(sess.model, sess.prepare(1)[j], LAM, sess.engine, sums)
        return metrics, grads

    grads, metrics = accumulate_grads(micro, 4)
    plain = resolve_engine(engine_settings(PLAIN))
    whole = prepare(sess.train.select(sess.schedule[0]), plain)
    (loss, _), want = batch_value_and_grad(sess.model, whole, LAM, plain)
    assert metrics["loss"].item() == pytest.approx(loss.item(), rel=1e-5)
    got = dict(tree_flatten(grads))
    for k, w in tree_flatten(want):
        w, g = np.array(w), np.array(got[k])
        assert np.linalg.norm(w) > 0 and np.linalg.norm(g - w) <= 1e-4 * np.linalg.norm(w), k


def _orpo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orpo.cli", *args], capture_output=True, text=True, timeout=600)


def test_two_ranks_train_every_weight_as_one_process_with_twice_the_batch(tiny_base, short, tmp_path):
    """Data parallel, full mode (float32 model): 2 ring ranks of batch 2 equal 1 process of batch 4 within float
    rounding for every weight (embedding and head included), and the 2-rank run replays bit for bit on 2 ranks."""
    settings = {**FULL, "grad_accum": 1, "engine": {"head": "fused", "prefix_sharing": True, "segment_layers": 1}}
    one, two = tmp_path / "one", tmp_path / "two"
    train(tiny_base, short, one, train_settings({**settings, "batch_size": 4}))
    done = _orpo("train", "--model", str(tiny_base), "--rendered", str(short), "--out", str(two), "--settings",
                 json.dumps({**settings, "batch_size": 2, "distributed": {"processes": 2}}))
    assert done.returncode == 0, done.stderr
    base = mx.load(str(tiny_base / "model.safetensors"))
    a, b = (mx.load(str(run / "model" / "model.safetensors")) for run in (one, two))
    assert sorted(a) == sorted(b) and "model.embed_tokens.weight" in a
    for k in a:
        step_a, step_b = np.array(a[k]) - np.array(base[k]), np.array(b[k]) - np.array(base[k])
        # Measured <= 1.2e-5 relative (summation order, through Adam, whose step is ~lr whatever the gradient).
        assert np.linalg.norm(step_a) > 0 and np.linalg.norm(step_b - step_a) <= 1e-3 * np.linalg.norm(step_a), k
    out = tmp_path / "replay.json"
    done = _orpo("replay", "--run", str(two), "--model", str(tiny_base), "--rendered", str(short),
                 "--checkpoint", "6", "--from", "previous", "--out", str(out))
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["equal"] and record["processes"] == 2 and record["from_step"] == 4, record


DPO_FULL = {**FULL, "objective": "dpo", "max_steps": 4, "epochs": 1}


def test_full_dpo_takes_its_reference_from_a_frozen_copy_of_the_start(bf16_base, short, tmp_path):
    """train.method full with dpo: the reference is the starting weights, frozen, a second copy (predicted with the
    memory); its log-probs equal the base model's own (the oracle: mlx-lm's forward of the folder); the loss starts
    at ln 2 (policy = reference) and leaves it as the policy trains while the copy stays bit for bit; the run
    replays bit for bit."""
    import math

    from orpo.engine.head import response_mean_logps
    from orpo.train.data import pair_batch
    from orpo.train.footprint import predict_memory
    from orpo.train.step import reference_logps

    sess = build_session(bf16_base, short, train_settings(DPO_FULL), dtype="bfloat16")
    assert sess.reference is not None and not tree_flatten(sess.reference.trainable_parameters())
    start = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(sess.reference.parameters())}
    predicted = predict_memory(sess)
    assert predicted["bytes"]["reference"] == predicted["bytes"]["weights"]
    base, _ = load(str(bf16_base))
    batch = sess.prepare(1)[0]
    pairs = sess.train.select(sess.micro_batches(1)[0])
    want = np.array(response_mean_logps(base, *pair_batch(pairs, list(range(len(pairs))))).astype(mx.float32))
    got = np.array(reference_logps(sess.model, batch, sess.engine, sess.reference).astype(mx.float32))
    np.testing.assert_allclose(got, want, atol=0.05)  # bf16: two forwards' rounding (naive vs packed rows)
    losses = [sess.step(step)["loss"] for step in range(1, 5)]
    assert losses[0] == pytest.approx(math.log(2), abs=0.02) and abs(losses[-1] - math.log(2)) > 0.02, losses
    assert all(np.array_equal(start[k], np.array(v.astype(mx.float32)))
               for k, v in tree_flatten(sess.reference.parameters()))
    assert any(not np.array_equal(start[k], np.array(v.astype(mx.float32)))
               for k, v in tree_flatten(sess.model.parameters()))
    run = tmp_path / "run"
    train(bf16_base, short, run, train_settings(DPO_FULL), dtype="bfloat16")
    assert replay(run, bf16_base, short, 4, "zero")["equal"]
