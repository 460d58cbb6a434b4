"""OpenBLAS vs the mlx[cpu] wheel's bundled reference BLAS, measured in one run (Linux CPU only).

Each variant runs in its own process (the BLAS is chosen at load time): an fp32 1024^3 matmul and one
naive ORPO step (forward + backward, LoRA) of a 4-layer, 256-wide llama on 4 pairs of 2 x 512 tokens.
Prints a table with each variant's numbers and the ratio to the bundled BLAS.

    .venv/bin/python bench/blas_speedup.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, time
import mlx.core as mx, mlx.nn as nn
from mlx_lm.models import llama
from orpo.engine.head import response_mean_logps
from orpo.train.lora import apply_lora
from orpo.train.settings import lora_settings
from orpo.train.objectives import orpo_loss

a = mx.random.normal((1024, 1024)); b = mx.random.normal((1024, 1024)); mx.eval(a, b)
mx.eval(a @ b)
t = time.perf_counter(); n = 5
for _ in range(n): mx.eval(a @ b)
gflops = 2 * 1024**3 * n / (time.perf_counter() - t) / 1e9

args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=768,
                       num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=4096)
model = llama.Model(args); mx.eval(model.parameters())
apply_lora(model, lora_settings({"rank": 16, "alpha": 32, "dropout": 0.0, "num_layers": -1}), 0)
tokens = mx.random.randint(0, 4096, (8, 1024)); mask = mx.concatenate([mx.zeros((8, 512)), mx.ones((8, 512))], 1)
def loss(m, t, k):
    lp = response_mean_logps(m, t, k); return orpo_loss(lp[:4], lp[4:], 0.1)[0]
step = nn.value_and_grad(model, loss)
mx.eval(step(model, tokens, mask))
t = time.perf_counter(); mx.eval(step(model, tokens, mask)); secs = time.perf_counter() - t
print(json.dumps({"matmul_gflops": gflops, "orpo_step_s": secs}))
"""


def run(openblas: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "_ORPO_BLAS_DONE")}
    if openblas:
        from orpo.blas import preload_value

        env["LD_PRELOAD"] = preload_value()
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from orpo.blas import find_openblas

    if not find_openblas():
        sys.exit("no OpenBLAS here (or not the Linux CPU build): nothing to compare")
    t0 = time.time()
    ref, fast = run(False), run(True)
    print(f"{'variant':<22}{'fp32 matmul GFLOP/s':>22}{'ORPO step (s)':>16}{'step speedup':>14}")
    print(f"{'bundled reference':<22}{ref['matmul_gflops']:>22.1f}{ref['orpo_step_s']:>16.2f}{1.0:>14.2f}")
    print(f"{'OpenBLAS':<22}{fast['matmul_gflops']:>22.1f}{fast['orpo_step_s']:>16.2f}"
          f"{ref['orpo_step_s'] / fast['orpo_step_s']:>14.2f}")
    print(f"(measured in {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
