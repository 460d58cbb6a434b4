"""λ per step (train.lambda_schedule): constant, or a PID controller on the drift of the chosen NLL.

The controller treats training as a control problem: the chosen sequences' NLL is the process variable, λ (the
weight of the preference term) the actuator. For the first `window` steps λ is train.lambda and the NLL's mean
over them is the reference level. After every later step t, with m_t the mean NLL of the last `window` steps,

    e_t = target_drift - (m_t - reference)          (positive: the NLL has headroom for more preference push)
    λ_{t+1} = clip(lambda + kp e_t + ki Σ e + kd (e_t - e_{t-1}), lambda_min, lambda_max)

The sum skips an error that would push λ further past a bound it already sits at (no wind-up). The state is
plain floats in JSON (every value round-trips exactly), saved in each checkpoint's state.json, so a resumed
or replayed run sets the same λ at every step.
"""

from __future__ import annotations

from typing import Any

from orpo.train.objectives import LAMBDA_WEIGHTED
from orpo.train.settings import ControllerSettings, TrainSettings


class ConstantLambda:
    """train.lambda at every step."""

    def __init__(self, lam: float):
        self.value = lam

    def observe(self, nll: float) -> None:
        """Nothing moves λ."""

    def state(self) -> dict[str, Any] | None:
        return None

    def load(self, state: dict[str, Any] | None) -> None:
        """Nothing to restore."""


class LambdaController:
    """The PID law above; `value` is the λ of the next step, `observe` takes each step's chosen NLL in order."""

    def __init__(self, lam: float, c: ControllerSettings):
        if not c.lambda_min <= lam <= c.lambda_max:
            raise ValueError(f"train.lambda {lam:g} is outside the controller's bounds [train.controller.lambda_min "
                             f"{c.lambda_min:g}, lambda_max {c.lambda_max:g}]: the controller starts from it")
        self.start = lam
        self.c = c
        self.value = lam
        self.nlls: list[float] = []
        self.reference: float | None = None
        self.integral = 0.0
        self.error: float | None = None

    def observe(self, nll: float) -> None:
        """One step's chosen NLL (the global batch's mean): λ of the next step."""
        c = self.c
        self.nlls = (self.nlls + [float(nll)])[-c.window:]
        if self.reference is None:
            if len(self.nlls) < c.window:
                return
            self.reference = sum(self.nlls) / c.window
        e = c.target_drift - (sum(self.nlls) / c.window - self.reference)
        derivative = 0.0 if self.error is None else e - self.error
        integral = self.integral + e
        lam = self.start + c.kp * e + c.ki * integral + c.kd * derivative
        pinned = (lam > c.lambda_max and e > 0) or (lam < c.lambda_min and e < 0)
        if not pinned:
            self.integral = integral
        self.value = min(max(lam, c.lambda_min), c.lambda_max)
        self.error = e

    def state(self) -> dict[str, Any]:
        return {"lambda": self.value, "nlls": list(self.nlls), "reference": self.reference,
                "integral": self.integral, "error": self.error}

    def load(self, state: dict[str, Any] | None) -> None:
        """Restore the state a checkpoint saved (after the step it was taken at)."""
        if not state:
            raise ValueError("train.lambda_schedule controller: the checkpoint holds no controller state (was it "
                             "written by a run of another lambda_schedule?)")
        self.value = float(state["lambda"])
        self.nlls = [float(x) for x in state["nlls"]]
        self.reference = state["reference"]
        self.integral = float(state["integral"])
        self.error = state["error"]


def lambda_schedule(s: TrainSettings) -> ConstantLambda | LambdaController:
    """The λ schedule a run's settings name; the controller only where λ weights the objective's preference term."""
    if s.lambda_schedule == "constant":
        return ConstantLambda(s.lambda_)
    if s.objective not in LAMBDA_WEIGHTED:
        raise ValueError(f"train.lambda_schedule controller sets λ, which train.objective {s.objective} does not "
                         f"use: use it with {' or '.join(LAMBDA_WEIGHTED)}, or lambda_schedule constant")
    return LambdaController(s.lambda_, s.controller)
