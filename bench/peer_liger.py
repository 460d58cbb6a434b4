"""The peer a user would pick instead: PyTorch + transformers Llama + peft LoRA + Liger's fused ORPO loss.

Same shapes, batch and counting as bench/engine.py (bench/engine_shapes.py: `--shape NAME` runs every
step shape of that suite): a random-init LlamaForCausalLM from a LlamaConfig (seeded, the shape's dtype),
peft LoRA (rank 16, alpha 32, the seven projections, no dropout), the same random token pairs, and per
step one forward of [chosen; rejected] through the decoder, Liger's LigerFusedLinearORPOLoss on the
final hidden states and the tied head weight (logits computed per chunk of pairs, never whole), and
loss.backward(); W warm-up steps (torch.compile of Liger's chunk and of the decoder happen there), then
K timed ones. One subprocess per variant. Tokens/s counts 2 * (P + R) per pair; peak memory is
torch.cuda.max_memory_allocated over the timed steps ("extra": minus what was allocated before them).

The default peer is the strongest configuration found (H200, Llama-3.2-1B shape): LoRA adapters in the
model's bf16 (peft's autocast_adapter_dtype=False; its default puts them and their inputs in float32),
the decoder (the LlamaModel) under torch.compile, Liger's loss compiled; `liger` and `liger-ckpt` (with
gradient checkpointing, non-reentrant) per shape; bench/README.md has its numbers and those of the weaker
configurations, which `--variants` runs (`liger-bf16-eager`, `liger-fp32-eager`, each with a `-ckpt` twin). Each row's path
(adapter dtype/comp or eager decoder/liger-c or liger/ckpt) and the JSON say how the peer ran.

On CUDA this is the comparison bench/README.md reports. On a CPU (no CUDA), it is a plumbing smoke test only:
memory is the process's max RSS, not an allocator peak, the decoder runs eager unless `--compile-decoder
yes` (as Liger's loss unless `--compiled yes`), and `--loss torch` swaps Liger for a plain
full-logits ORPO loss written from the paper (Hong et al. 2024), labelled as such (Liger's chunked
loss is plain torch and runs on CPU too; `--check` proves both losses agree on one batch).
Needs torch, transformers, peft and liger-kernel (not in the project's venv; see bench/gpu_wheels.md).

`--method full` is full-parameter ORPO instead (no peft: every weight trains, torch's AdamW at lr 5e-6, fused
on CUDA), and each timed step then includes the optimizer's step, as `bench/trainer.py --method full` does.
Two precisions, each without and with gradient checkpointing: `liger-full`, the model, its gradients and
AdamW's moments in bf16, updated in place (8 bytes per parameter; at lr 5e-6 most bf16 weights do not
move); `liger-full-fp32master`, float32 weights, gradients and moments under bf16 autocast (16 bytes per
parameter: the precision `orpo train`'s full mode keeps, its masters float32 under bf16 weights).

    python bench/peer_liger.py --shape h200 --json $OUT/peer.json          # on the GPU
    /tmp/peervenv/bin/python bench/peer_liger.py --shape cpu-small --check  # CPU smoke
    python bench/peer_liger.py --shape h200 --variants all                 # the weaker configurations too
    python bench/peer_liger.py --shape mistral-7b --method full --json $OUT/peer-full-7b.json
    python bench/peer_liger.py --shape h200 --lengths ultrafeedback --pairs 512 --json $OUT/peer-uf.json

`--lengths ultrafeedback` trains `--epochs` passes (default one) over `--pairs` UltraFeedback-like pairs
(bench/trainer.py's draw: the same lengths) as the peer would with transformers' Trainer: micro-batches of 4 pairs ordered by its
LengthGroupedSampler (group_by_length, the faster order), [chosen; rejected] rows right-padded to the longest row
rounded up to a multiple of `--pad-multiple` (TRL's pad_to_multiple_of; right padding needs no attention mask under
causal attention), the loss divided over 8 micro-batches a step, then clip to norm 1 and AdamW (fused on CUDA) at
lr 1e-5, 32 pairs a step as `orpo train` does there. Timed per optimizer step; tokens/s count 2 x prompt + chosen +
rejected per pair, without padding, over the steps after `--skip`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine_shapes import (
    SUITES,
    Case,
    Shape,
    format_table,
    random_pair_tokens,
    step_shapes,
    ultrafeedback_lengths,
    warn_busy_device,
)

LAMBDA = 0.1  # ORPO's lambda (Liger calls it beta): the same weight as bench/engine.py
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GB = 1e9


# The peer's configurations, by the part of the variant's name after the loss: Case.engine options.
# adapter_dtype: "model" keeps the LoRA adapters in the model's dtype (peft's autocast_adapter_dtype=False),
# "fp32" is peft's default (adapters of a bf16/fp16 model upcast to float32); compile_decoder: torch.compile
# of the LlamaModel (where --compile-decoder allows it). The names say bf16: the GPU shapes' dtype.
CONFIGS = {
    "": {"adapter_dtype": "model", "compile_decoder": True},  # the strongest found: the default
    "-bf16-eager": {"adapter_dtype": "model", "compile_decoder": False},
    "-fp32-eager": {"adapter_dtype": "fp32", "compile_decoder": False},
}


# Full-parameter training (--method full): which dtype the weights, gradients and moments are kept in.
# "model": the model's (bf16), updated in place; "fp32": float32 under torch.autocast of the forward to bf16.
FULL_CONFIGS = {
    "-full": {"method": "full", "master": "model", "compile_decoder": True},
    "-full-fp32master": {"method": "full", "master": "fp32", "compile_decoder": True},
}
FULL_LR = 5e-6  # the ORPO paper's


def peer_cases(suite_name: str, loss: str, method: str = "lora") -> list[Case]:
    """Per step shape of the suite, each configuration without and with gradient checkpointing.

    Every variant's ratios are taken against the default configuration without checkpointing (`liger`, or
    `liger-full` with method full) of its shape; which of them run by default is `is_default`.
    """
    shapes = step_shapes(SUITES[suite_name])
    configs = CONFIGS if method == "lora" else FULL_CONFIGS
    cases = []
    for label, shape in shapes.items():
        if shape.prompt_spread:
            print(f"peer_liger: skipping {label}: its rows differ in length, and the peer's batch is unpadded")
            continue
        suffix = f"-{label}" if len(shapes) > 1 else ""
        best = f"{loss}{next(iter(configs))}{suffix}"
        for config, opts in configs.items():
            for ckpt in (False, True):
                name = f"{loss}{config}{'-ckpt' if ckpt else ''}{suffix}"
                cases.append(Case(name, shape, engine={**opts, "checkpointing": ckpt}, baseline=best))
    return cases


def is_default(case: Case) -> bool:
    """Whether the variant is of the default configuration (what runs without --variants): for full-parameter
    training both precisions, whose memory differs by 2x."""
    opts = {k: v for k, v in case.engine.items() if k != "checkpointing"}
    return opts == CONFIGS[""] or opts in FULL_CONFIGS.values()


def peer_config(case: Case, loss: str, liger_compiled: bool, compile_decoder: str, cuda: bool) -> dict[str, Any]:
    """How the variant runs: its Case.engine options resolved against --compiled and --compile-decoder.

    compile_decoder "auto": the variant's compile_decoder where CUDA is available, never on a CPU (smoke
    runs stay fast); "yes" / "no": for every variant.
    """
    opts = case.engine
    adapters = opts.get("adapter_dtype", "model")
    compile_it = (bool(opts.get("compile_decoder")) and cuda) if compile_decoder == "auto" else compile_decoder == "yes"
    method, master = opts.get("method", "lora"), opts.get("master", "model")
    weights = "float32" if method == "full" and master == "fp32" else case.shape.dtype
    return {"model_dtype": case.shape.dtype, "adapter_dtype": adapters, "autocast_adapter_dtype": adapters == "fp32",
            "compile_decoder": compile_it, "checkpointing": bool(opts["checkpointing"]), "loss": loss,
            "liger_compiled": loss == "liger" and liger_compiled, "method": method, "weights_dtype": weights,
            "autocast": weights != case.shape.dtype}


def build_model(shape: Shape, seed: int, device: str, checkpointing: bool, adapter_dtype: str = "model",
                method: str = "lora", weights_dtype: str | None = None) -> Any:
    """Random-init LlamaForCausalLM (seeded, shape's dtype) with peft LoRA; gradient checkpointing if asked.

    adapter_dtype "model": the adapters in the model's dtype; "fp32": peft's default autocast, which puts
    the adapters of a bf16/fp16 model (and so their inputs) in float32. method "full": no peft, every weight
    trainable, in `weights_dtype` (default the shape's).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape.llama_config(), max_position_embeddings=max(4096, shape.prompt + 2 * shape.response))
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, weights_dtype or shape.dtype))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method == "full":
        model.train()
        return model
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, bias="none",
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora, autocast_adapter_dtype=adapter_dtype == "fp32")
    model.train()
    return model


def batch(shape: Shape, seed: int, device: str) -> tuple[Any, Any]:
    """Tokens [2B, P+R] ([chosen; rejected]) and next-token targets [2B, P+R-1] with -100 on prompt positions."""
    import torch

    prompts, chosen, rejected = random_pair_tokens(shape, seed)
    rows = [p + c for p, c in zip(prompts, chosen)] + [p + r for p, r in zip(prompts, rejected)]
    tokens = torch.tensor(rows, dtype=torch.long, device=device)
    targets = tokens[:, 1:].clone()
    targets[:, : shape.prompt - 1] = -100  # target t is token t+1: the first scored one is token P
    return tokens, targets


def plain_orpo_loss(head_weight: Any, hidden: Any, targets: Any, lam: float) -> Any:
    """ORPO from the paper's math on full logits: mean_rows(-l_w + lam * -log sigmoid(log odds)), l = mean token log-prob.

    The smoke path only (it materialises [2B, T, V] float32 logits); log odds = (l_w - l_r) - (log(1-e^l_w) - log(1-e^l_r)).
    """
    import torch
    import torch.nn.functional as F

    logits = (hidden @ head_weight.T).float()
    scored = targets != -100
    token_logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    mean_logp = (token_logp * scored).sum(-1) / scored.sum(-1)
    n = targets.shape[0] // 2
    lw, lr = mean_logp[:n], mean_logp[n:]
    log_odds = (lw - lr) - (torch.log1p(-torch.exp(lw)) - torch.log1p(-torch.exp(lr)))
    return (-lw - lam * F.logsigmoid(log_odds)).mean()


def loss_function(kind: str, compiled: bool) -> Any:
    """(head weight, hidden [2B, T, H], targets [2B, T]) -> scalar ORPO loss: Liger's fused one or the plain smoke one."""
    if kind == "torch":
        return lambda w, h, t: plain_orpo_loss(w, h, t, LAMBDA)
    from liger_kernel.chunked_loss import LigerFusedLinearORPOLoss

    liger = LigerFusedLinearORPOLoss(ignore_index=-100, beta=LAMBDA, compiled=compiled)
    return lambda w, h, t: liger(w, h, t)[0]


def step_loss(model: Any, tokens: Any, targets: Any, loss_fn: Any, decoder: Any = None) -> Any:
    """One forward of the decoder and the ORPO loss on its final hidden states (shifted to predict the next token).

    `decoder`: what to call for the LlamaModel (its torch.compile'd wrapper); the model's own by default.
    """
    base = base_of(model)
    hidden = (base.model if decoder is None else decoder)(input_ids=tokens, use_cache=False).last_hidden_state
    return loss_fn(base.lm_head.weight, hidden[:, :-1], targets)


def base_of(model: Any) -> Any:
    """The LlamaForCausalLM under peft's wrapper (or the model itself, trained in full)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _rss_bytes() -> int:
    """This process's resident set now (Linux /proc), for the CPU smoke path."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def describe(config: dict[str, Any]) -> str:
    """The table's path column: adapter dtype (F16/F32 training every weight), decoder compiled or eager, the loss
    (-c: compiled), checkpointing.

    At most 22 characters, so bench/engine.py's 'torch PATH' keeps the first three parts.
    """
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(config["lora_param_dtype"], "mixed")
    if config.get("method") == "full":  # F: every weight trains, kept in the model's 16-bit dtype or in float32
        dtype = "F32" if config["autocast"] or config["weights_dtype"] == "float32" else "F16"
    loss_part = ("liger-c" if config["liger_compiled"] else "liger") if config["loss"] == "liger" else "smoke"
    parts = [dtype, "comp" if config["compile_decoder"] else "eager", loss_part]
    return "/".join(parts + (["ckpt"] if config["checkpointing"] else []))


def peer_model(case: Case, seed: int, loss: str, compiled: bool, compile_decoder: str) -> tuple[Any, ...]:
    """(config, device, model, decoder, trained parameters) of a variant: its model built as `peer_config` says,
    the decoder torch.compile'd where it says so (lazily: it compiles in the first step, as Liger's chunk does)."""
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = peer_config(case, loss, compiled, compile_decoder, cuda)
    model = build_model(case.shape, seed, device, config["checkpointing"], config["adapter_dtype"], config["method"],
                        config["weights_dtype"])
    base = base_of(model)
    decoder = torch.compile(base.model) if config["compile_decoder"] else base.model
    trained = [p for n, p in model.named_parameters() if config["method"] == "full" or "lora_" in n]
    config["lora_param_dtype"] = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in trained}))
    return config, device, model, decoder, trained


def run_case(case: Case, steps: int, warmup: int, seed: int, loss: str, compiled: bool,
             compile_decoder: str) -> dict[str, Any]:
    """Time one variant in this process: warm-up (compilation included), then `steps` forward+backward steps
    (and, training every weight, the optimizer's step)."""
    import contextlib
    import resource

    import torch

    config, device, model, decoder, _ = peer_model(case, seed, loss, compiled, compile_decoder)
    cuda, full = device == "cuda", config["method"] == "full"
    tokens, targets = batch(case.shape, seed, device)
    loss_fn = loss_function(loss, compiled)
    # The AdamW state is allocated in the first warm-up step, so it is in the resident memory measured after them.
    opt = torch.optim.AdamW(model.parameters(), lr=FULL_LR, fused=cuda) if full else None
    dtype = getattr(torch, case.shape.dtype)
    autocast = (lambda: torch.autocast(device, dtype=dtype)) if config["autocast"] else contextlib.nullcontext

    def step() -> float:
        model.zero_grad(set_to_none=True)
        with autocast():
            value = step_loss(model, tokens, targets, loss_fn, decoder)
        value.backward()
        if opt is not None:
            opt.step()
        return value

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        resident = _rss_bytes()
    t0 = time.perf_counter()
    for _ in range(steps):
        value = step()
    if cuda:
        torch.cuda.synchronize()
    secs = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_s": secs, "tokens_per_s": case.shape.two_forward_tokens() / secs, "peak_gb": peak / GB,
            "extra_gb": (peak - resident) / GB, "resident_gb": resident / GB, "loss": float(value.item()),
            "path": describe(config), "config": config, "memory": "cuda allocator" if cuda else "max RSS"}


def epoch_batches(shape: Shape, pairs: int, seed: int, batch: int, multiple: int, device: str) -> list[dict[str, Any]]:
    """One epoch of UltraFeedback-like pairs as the peer's micro-batches, in LengthGroupedSampler's order: tokens
    [2B, W] ([chosen; rejected] right-padded, W a multiple of `multiple`), targets with -100 on prompt and padding,
    and the pairs' two-forward tokens."""
    import numpy as np
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    lengths = ultrafeedback_lengths(pairs, 1)
    rng = np.random.default_rng(seed)
    rows = [(rng.integers(0, shape.vocab, p).tolist(), rng.integers(0, shape.vocab, c).tolist(),
             rng.integers(0, shape.vocab, r).tolist()) for p, c, r in lengths]
    sampler = LengthGroupedSampler(batch, lengths=[p + max(c, r) for p, c, r in lengths],
                                   generator=torch.Generator().manual_seed(seed))
    order = list(sampler)
    out = []
    for first in range(0, len(order) - len(order) % batch, batch):
        chunk = [rows[i] for i in order[first:first + batch]]
        seqs = [p + c for p, c, _ in chunk] + [p + r for p, _, r in chunk]
        width = -(-max(map(len, seqs)) // multiple) * multiple
        tokens = torch.zeros((len(seqs), width), dtype=torch.long)
        targets = torch.full((len(seqs), width - 1), -100, dtype=torch.long)
        for k, seq in enumerate(seqs):
            prompt = len(chunk[k % batch][0])
            tokens[k, :len(seq)] = torch.tensor(seq)
            targets[k, prompt - 1:len(seq) - 1] = tokens[k, prompt:len(seq)]
        out.append({"tokens": tokens.to(device), "targets": targets.to(device),
                    "two_forward": sum(2 * len(p) + len(c) + len(r) for p, c, r in chunk)})
    return out


def run_epoch(case: Case, epoch: dict[str, Any], seed: int, loss: str, compiled: bool,
              compile_decoder: str) -> dict[str, Any]:
    """Train `epoch`'s passes over its real-length pairs (module docstring), timed per optimizer step."""
    import resource
    import statistics

    import torch

    config, device, model, decoder, trained = peer_model(case, seed, loss, compiled, compile_decoder)
    cuda = device == "cuda"
    passes = epoch.get("epochs", 1)  # each pass in its own LengthGroupedSampler order, as the Trainer reshuffles
    per_pass = [epoch_batches(case.shape, epoch["pairs"], seed + e, epoch["batch"], epoch["pad_multiple"], device)
                for e in range(passes)]
    accum = epoch["accum"]
    micro = [b for batches in per_pass for b in batches[:len(batches) - len(batches) % accum]]
    loss_fn = loss_function(loss, compiled)
    opt = torch.optim.AdamW(trained, lr=1e-5, fused=cuda)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() if cuda else _rss_bytes()
    times, tokens, new_shapes, seen, value = [], [], [], set(), None
    for first in range(0, len(micro) - accum + 1, accum):
        group = micro[first:first + accum]
        widths = {tuple(b["tokens"].shape) for b in group} - seen
        seen |= widths
        t0 = time.perf_counter()
        for b in group:
            value = step_loss(model, b["tokens"], b["targets"], loss_fn, decoder) / accum
            value.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens.append(sum(b["two_forward"] for b in group))
        new_shapes.append(len(widths))
    skip = min(epoch["skip"], len(times) - 1)
    positions = sum(b["tokens"].numel() for b in micro[:len(times) * accum])
    last = len(times) - len(times) // passes  # the last pass alone: the shapes met before are compiled
    last_epoch = {"step_s": statistics.median(times[last:]), "tokens_per_s": sum(tokens[last:]) / sum(times[last:]),
                  "steps": len(times) - last} if passes > 1 else None
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_s": statistics.median(times[skip:]), "tokens_per_s": sum(tokens[skip:]) / sum(times[skip:]),
            "epoch_s": sum(times), "steps": len(times), "step_times": times, "new_shapes": new_shapes,
            **({"last_epoch": last_epoch} if last_epoch else {}),
            "shapes": len(seen), "padding": 1 - sum(tokens) / positions, "peak_gb": peak / GB,
            "extra_gb": (peak - resident) / GB, "resident_gb": resident / GB,
            "loss": float(value.item()) * accum, "path": describe(config) + "/uf", "config": config,
            "memory": "cuda allocator" if cuda else "max RSS"}


def run_subprocess(suite: str, opts: dict[str, Any], steps: int, warmup: int, seed: int, timeout: int) -> dict[str, Any]:
    """One variant's result from a fresh process; a crash (e.g. CUDA out of memory) or timeout becomes 'failed'."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--shape", suite, "--child", json.dumps(opts),
           "--steps", str(steps), "--warmup", str(warmup), "--seed", str(seed)]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"failed": f"exit {proc.returncode}: {tail[:160]}"}


def check_losses(shape: Shape, seed: int) -> dict[str, float]:
    """Liger's fused ORPO loss vs the plain one on one batch (float32, same model): loss and LoRA gradients.

    With every response of the same length, Liger's token-mean NLL over chosen tokens equals the mean of
    per-row means, so the two must agree to float32 rounding.
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = replace(shape, dtype="float32")
    model = build_model(shape, seed, device, False)
    with torch.no_grad():  # LoRA B starts at 0: give it values so the adapters' gradients are not trivial
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    tokens, targets = batch(shape, seed, device)
    out = {}
    for kind in ("liger", "torch"):
        model.zero_grad(set_to_none=True)
        value = step_loss(model, tokens, targets, loss_function(kind, compiled=False))
        value.backward()
        grads = torch.cat([p.grad.flatten() for _, p in sorted(model.named_parameters()) if p.requires_grad])
        out[kind] = (value.item(), grads)
    (l1, g1), (l2, g2) = out["liger"], out["torch"]
    return {"loss_liger": l1, "loss_torch": l2, "loss_rel_diff": abs(l1 - l2) / abs(l2),
            "grad_rel_norm_diff": float((g1 - g2).norm() / g2.norm())}


def environment() -> dict[str, Any]:
    """Device and versions the numbers were measured with."""
    import torch

    versions = {}
    for dist in ("torch", "transformers", "peft", "liger-kernel", "triton"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    cuda = torch.cuda.is_available()
    env = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "cuda_available": cuda,
           "python": platform.python_version(), "versions": versions, "cpu_count": os.cpu_count()}
    if cuda:
        free, total = torch.cuda.mem_get_info()  # creates this process's context first
        env["device_used_gb_at_start"] = round((total - free) / 1e9, 3)
        warn_busy_device(env["device_used_gb_at_start"])
    return env


def main() -> None:
    """Run the peer variants of a suite's shapes, print the table, optionally write --json."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="cpu-small", choices=sorted(n for n, s in SUITES.items() if s.peer))
    ap.add_argument("--variants", help="comma-separated variant names, or 'all' (default: the best configuration's, "
                                       "without and with checkpointing)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override the shape's dtype")
    ap.add_argument("--steps", type=int, help="timed steps per variant (default: the suite's)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default: the suite's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss", choices=["liger", "torch"], default="liger",
                    help="liger: LigerFusedLinearORPOLoss; torch: the plain full-logits smoke loss")
    ap.add_argument("--compiled", choices=["auto", "yes", "no"], default="auto",
                    help="Liger's torch.compile of its chunk (auto: on CUDA only, as a user would run it)")
    ap.add_argument("--compile-decoder", choices=["auto", "yes", "no"], default="auto",
                    help="torch.compile of the decoder (auto: as each variant says, on CUDA only; yes/no: every variant)")
    ap.add_argument("--check", action="store_true", help="first check Liger's loss and gradients against the plain loss")
    ap.add_argument("--method", choices=["lora", "full"], default="lora",
                    help="lora: peft LoRA rank 16 on the seven projections; full: every weight, with AdamW's step")
    ap.add_argument("--lengths", choices=["fixed", "ultrafeedback"], default="fixed",
                    help="fixed: the suite's step shapes; ultrafeedback: passes over real-length pairs (see above)")
    ap.add_argument("--pairs", type=int, default=512, help="pairs of the ultrafeedback epoch")
    ap.add_argument("--epochs", type=int, default=1, help="passes over the ultrafeedback pairs (the last one is also "
                    "reported alone)")
    ap.add_argument("--pad-multiple", type=int, default=128, help="rows padded to a multiple of this (ultrafeedback)")
    ap.add_argument("--skip", type=int, default=1, help="first optimizer steps left out of the ultrafeedback rates")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per variant before it is reported as failed")
    ap.add_argument("--json", help="write the machine-readable results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    suite = SUITES[a.shape]
    a.steps = a.steps or suite.steps
    a.warmup = suite.warmup if a.warmup is None else a.warmup
    if a.child:
        opts = json.loads(a.child)
        case = Case.from_json(opts["case"])
        if opts.get("epoch"):
            result = run_epoch(case, opts["epoch"], a.seed, opts["loss"], opts["compiled"], opts["compile_decoder"])
        else:
            result = run_case(case, a.steps, a.warmup, a.seed, opts["loss"], opts["compiled"], opts["compile_decoder"])
        print(json.dumps(result), flush=True)
        return
    try:
        env = environment()
    except ImportError as err:
        sys.exit(f"peer_liger.py needs torch, transformers, peft and liger-kernel ({err}); see bench/gpu_wheels.md")
    compiled = env["cuda_available"] if a.compiled == "auto" else a.compiled == "yes"
    print(f"torch {env['versions']['torch']}, transformers {env['versions']['transformers']}, peft "
          f"{env['versions']['peft']}, liger-kernel {env['versions']['liger-kernel']}, device {env['device']}, "
          f"Python {env['python']}", flush=True)
    if not env["cuda_available"]:
        print("NO CUDA: CPU smoke run of the plumbing only (memory is max RSS; not a comparison)", flush=True)

    check = None
    if a.check:
        check = check_losses(step_shapes(suite)[next(iter(step_shapes(suite)))], a.seed)
        ok = check["loss_rel_diff"] < 1e-5 and check["grad_rel_norm_diff"] < 1e-4
        print(f"check, Liger vs plain ORPO loss (float32): loss {check['loss_liger']:.6f} vs {check['loss_torch']:.6f} "
              f"(rel {check['loss_rel_diff']:.1e}), LoRA grads rel norm diff {check['grad_rel_norm_diff']:.1e}: "
              + ("agree" if ok else "DISAGREE"), flush=True)
        if not ok:
            sys.exit(1)

    cases = peer_cases(a.shape, a.loss, a.method)
    epoch = None
    if a.lengths == "ultrafeedback":
        if a.method != "lora":
            sys.exit("--lengths ultrafeedback: LoRA only")
        epoch = {"pairs": a.pairs, "batch": 4, "accum": 8, "pad_multiple": a.pad_multiple, "skip": a.skip,
                 "epochs": a.epochs}
        # The geometry of the suite's first shape; its batch is the epoch's.
        cases = [replace(c, name=c.name.split("-P")[0].split("-L")[0] + "-uf", baseline=f"{a.loss}-uf")
                 for c in cases if c.shape == cases[0].shape]
    if a.dtype:
        cases = [replace(c, shape=replace(c.shape, dtype=a.dtype)) for c in cases]
    if a.variants and a.variants.strip() != "all":
        wanted = {v.strip() for v in a.variants.split(",") if v.strip()}
        unknown = sorted(wanted - {c.name for c in cases})
        if unknown:
            sys.exit(f"--variants: {unknown} not among {', '.join(c.name for c in cases)}")
        cases = [c for c in cases if c.name in wanted]
    elif not a.variants:
        cases = [c for c in cases if is_default(c)]
    decoder_note = {"auto": "compiled where the variant says so" + ("" if env["cuda_available"] else
                                                                     " and CUDA is available: eager on this CPU"),
                    "yes": "compiled in every variant", "no": "eager in every variant"}[a.compile_decoder]
    print(f"decoder: {decoder_note}; Liger's loss: {'compiled' if compiled else 'eager'}", flush=True)
    t0 = time.time()

    def save(records: list[dict[str, Any]], complete: bool) -> None:
        if a.json:
            sys.path.insert(0, str(HERE.parent))
            from orpo.io import write_json  # stdlib only: fine in the torch environment

            write_json(a.json, {"bench": "peer_liger", "suite": a.shape, "method": a.method, "loss": a.loss,
                                "epoch": epoch,
                                "compiled": compiled,
                                "compile_decoder": a.compile_decoder,
                                "steps": a.steps, "warmup": a.warmup, "seed": a.seed, "lambda": LAMBDA,
                                "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": LORA_TARGETS},
                                "environment": env, "check": check, "cases": records, "complete": complete,
                                "seconds": time.time() - t0})

    rows, records = [], []
    for case in cases:
        opts = {"case": case.to_json(), "loss": a.loss, "compiled": compiled, "compile_decoder": a.compile_decoder,
                "epoch": epoch}
        result = run_subprocess(a.shape, opts, a.steps, a.warmup, a.seed, a.timeout)
        note = f"failed: {result['failed']}" if "failed" in result else None
        print(f"  {case.name}: " + (note or f"{result['tokens_per_s']:.0f} tokens/s, peak {result['peak_gb']:.3f} GB"),
              flush=True)
        rows.append({"name": case.name, "baseline": case.baseline, "note": note, **result})
        # "peer": how the variant was set to run (a failed one too); result["config"] adds the LoRA dtype peft made.
        records.append({**case.to_json(), "peer": peer_config(case, a.loss, compiled, a.compile_decoder,
                                                              env["cuda_available"]), "result": result})
        save(records, complete=False)  # a run cut short still leaves the variants it finished
    print()
    trains = "peft LoRA" if a.method == "lora" else "every weight + AdamW"
    print(format_table(rows, f"peer (torch + transformers + {trains} + {a.loss}), suite {a.shape} "
                             f"({time.time() - t0:.0f} s), ratios to the default configuration of the same shape "
                             "without checkpointing" + ("" if env["cuda_available"] else "; memory: max RSS")))
    save(records, complete=True)
    if a.json:
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
