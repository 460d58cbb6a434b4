"""The peer a user would pick instead: PyTorch + transformers Llama + peft LoRA + Liger's fused ORPO loss.

Same shapes, batch and counting as bench/engine.py (bench/engine_shapes.py: `--shape NAME` runs every
step shape of that suite): a random-init LlamaForCausalLM from a LlamaConfig (seeded, the shape's dtype),
peft LoRA (rank 16, alpha 32, the seven projections, no dropout), the same random token pairs, and per
step one forward of [chosen; rejected] through the decoder, Liger's LigerFusedLinearORPOLoss on the
final hidden states and the tied head weight (logits computed per chunk of pairs, never whole), and
loss.backward(); W warm-up steps (torch.compile of Liger's chunk happens there), then K timed ones.
Two variants per shape: plain, and with gradient checkpointing (model.gradient_checkpointing_enable,
non-reentrant). One subprocess per variant. Tokens/s counts 2 * (P + R) per pair; peak memory is
torch.cuda.max_memory_allocated over the timed steps ("extra": minus what was allocated before them).

On CUDA this is the comparison the issue asks for. On a CPU (no CUDA), it is a plumbing smoke test only:
memory is the process's max RSS, not an allocator peak, and `--loss torch` swaps Liger for a plain
full-logits ORPO loss written from the paper (Hong et al. 2024), labelled as such (Liger's chunked
loss is plain torch and runs on CPU too; `--check` proves both losses agree on one batch).
Needs torch, transformers, peft and liger-kernel (not in the project's venv; see bench/gpu_wheels.md).

    python bench/peer_liger.py --shape h200 --json $OUT/peer.json          # on the GPU
    /tmp/peervenv/bin/python bench/peer_liger.py --shape cpu-small --check  # CPU smoke
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
)

LAMBDA = 0.1  # ORPO's lambda (Liger calls it beta): the same weight as bench/engine.py
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GB = 1e9


def peer_cases(suite_name: str, loss: str) -> list[Case]:
    """Per step shape of the suite: the plain variant and the gradient-checkpointing one (baseline: plain)."""
    shapes = step_shapes(SUITES[suite_name])
    cases = []
    for label, shape in shapes.items():
        if shape.prompt_spread:
            print(f"peer_liger: skipping {label}: its rows differ in length, and the peer's batch is unpadded")
            continue
        suffix = f"-{label}" if len(shapes) > 1 else ""
        plain = f"{loss}{suffix}"
        cases.append(Case(plain, shape, engine={"checkpointing": False}, baseline=plain))
        cases.append(Case(f"{loss}-ckpt{suffix}", shape, engine={"checkpointing": True}, baseline=plain))
    return cases


def build_model(shape: Shape, seed: int, device: str, checkpointing: bool) -> Any:
    """Random-init LlamaForCausalLM (seeded, shape's dtype) with peft LoRA; gradient checkpointing if asked."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape.llama_config(), max_position_embeddings=max(4096, shape.prompt + 2 * shape.response))
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, bias="none",
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
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


def step_loss(model: Any, tokens: Any, targets: Any, loss_fn: Any) -> Any:
    """One forward of the decoder and the ORPO loss on its final hidden states (shifted to predict the next token)."""
    base = model.get_base_model()
    hidden = base.model(input_ids=tokens, use_cache=False).last_hidden_state
    return loss_fn(base.lm_head.weight, hidden[:, :-1], targets)


def _rss_bytes() -> int:
    """This process's resident set now (Linux /proc), for the CPU smoke path."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(case: Case, steps: int, warmup: int, seed: int, loss: str, compiled: bool) -> dict[str, Any]:
    """Time one variant in this process: warm-up, then `steps` forward+backward steps."""
    import resource

    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = build_model(case.shape, seed, device, bool(case.engine["checkpointing"]))
    tokens, targets = batch(case.shape, seed, device)
    loss_fn = loss_function(loss, compiled)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        value = step_loss(model, tokens, targets, loss_fn)
        value.backward()
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
    path = ("liger" + (" compiled" if compiled else "") if loss == "liger" else "torch smoke") + \
        ("" if cuda else ", RSS")
    return {"step_s": secs, "tokens_per_s": case.shape.two_forward_tokens() / secs, "peak_gb": peak / GB,
            "extra_gb": (peak - resident) / GB, "resident_gb": resident / GB, "loss": float(value.item()), "path": path}


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
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "cuda_available": cuda,
            "python": platform.python_version(), "versions": versions, "cpu_count": os.cpu_count()}


def main() -> None:
    """Run the peer variants of a suite's shapes, print the table, optionally write --json."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="cpu-small", choices=sorted(n for n, s in SUITES.items() if s.peer))
    ap.add_argument("--variants", help="comma-separated variant names (default: all)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override the shape's dtype")
    ap.add_argument("--steps", type=int, help="timed steps per variant (default: the suite's)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default: the suite's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss", choices=["liger", "torch"], default="liger",
                    help="liger: LigerFusedLinearORPOLoss; torch: the plain full-logits smoke loss")
    ap.add_argument("--compiled", choices=["auto", "yes", "no"], default="auto",
                    help="Liger's torch.compile of its chunk (auto: on CUDA only, as a user would run it)")
    ap.add_argument("--check", action="store_true", help="first check Liger's loss and gradients against the plain loss")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per variant before it is reported as failed")
    ap.add_argument("--json", help="write the machine-readable results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    suite = SUITES[a.shape]
    a.steps = a.steps or suite.steps
    a.warmup = suite.warmup if a.warmup is None else a.warmup
    if a.child:
        opts = json.loads(a.child)
        print(json.dumps(run_case(Case.from_json(opts["case"]), a.steps, a.warmup, a.seed, opts["loss"],
                                  opts["compiled"])), flush=True)
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

    cases = peer_cases(a.shape, a.loss)
    if a.dtype:
        cases = [replace(c, shape=replace(c.shape, dtype=a.dtype)) for c in cases]
    if a.variants:
        wanted = {v.strip() for v in a.variants.split(",") if v.strip()}
        unknown = sorted(wanted - {c.name for c in cases})
        if unknown:
            sys.exit(f"--variants: {unknown} not among {', '.join(c.name for c in cases)}")
        cases = [c for c in cases if c.name in wanted]
    t0 = time.time()

    def save(records: list[dict[str, Any]], complete: bool) -> None:
        if a.json:
            sys.path.insert(0, str(HERE.parent))
            from orpo.io import write_json  # stdlib only: fine in the torch environment

            write_json(a.json, {"bench": "peer_liger", "suite": a.shape, "loss": a.loss, "compiled": compiled,
                                "steps": a.steps, "warmup": a.warmup, "seed": a.seed, "lambda": LAMBDA,
                                "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": LORA_TARGETS},
                                "environment": env, "check": check, "cases": records, "complete": complete,
                                "seconds": time.time() - t0})

    rows, records = [], []
    for case in cases:
        opts = {"case": case.to_json(), "loss": a.loss, "compiled": compiled}
        result = run_subprocess(a.shape, opts, a.steps, a.warmup, a.seed, a.timeout)
        note = f"failed: {result['failed']}" if "failed" in result else None
        print(f"  {case.name}: " + (note or f"{result['tokens_per_s']:.0f} tokens/s, peak {result['peak_gb']:.3f} GB"),
              flush=True)
        rows.append({"name": case.name, "baseline": case.baseline, "note": note, **result})
        records.append({**case.to_json(), "result": result})
        save(records, complete=False)  # a run cut short still leaves the variants it finished
    print()
    print(format_table(rows, f"peer (torch + transformers + peft LoRA + {a.loss}), suite {a.shape} "
                             f"({time.time() - t0:.0f} s), ratios to the same shape without checkpointing"))
    save(records, complete=True)
    if a.json:
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
