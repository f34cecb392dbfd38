"""Fitting the step-time model to measured trials: a MAP estimate (Gauss-Newton with a Huber loss
and Gaussian priors from the device table), the misfit with its degrees of freedom, and Laplace
intervals for every prediction."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tuner.perf.model import COEF_NAMES, Features, predict_log, prior
from tuner.perf.priors import DevicePriors

HUBER_K = 1.345  # residuals beyond this many sd count linearly: one wild trial cannot drag the fit
NOISE_PRIOR = 0.12  # prior sd (log) of a prediction's misfit, and its weight in pseudo-points
NOISE_PRIOR_POINTS = 3.0
Z90 = 1.6449  # two-sided 90% interval of a normal


@dataclass(frozen=True)
class Prediction:
    """Predicted log step time per row, its uncertainty from the coefficients, and in all."""

    mean: np.ndarray
    sd_coef: np.ndarray
    sd: np.ndarray  # coefficients and misfit together: what a new measurement scatters by

    def step_time(self) -> np.ndarray:
        return np.exp(self.mean)

    def interval(self, z: float = Z90) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) step time of the 90% interval by default."""
        return np.exp(self.mean - z * self.sd), np.exp(self.mean + z * self.sd)


@dataclass(frozen=True)
class Fit:
    theta: np.ndarray
    cov: np.ndarray
    sigma: float  # misfit sd (log units)
    n: int  # observations it was fitted to
    dof: float  # n minus the effective number of fitted coefficients
    # A new measurement's own scatter (log units): the median of the fitted trials' measurement sds.
    # `sigma` is the misfit beyond them, so the interval of a measurement needs both.
    measurement_sd: float = 0.0

    def coefficients(self) -> dict[str, float]:
        return dict(zip(COEF_NAMES, (float(v) for v in self.theta), strict=True))

    def predict(self, f: Features) -> Prediction:
        mean = predict_log(self.theta, f)
        jac = _jacobian(self.theta, f, mean)
        var = np.einsum("ij,jk,ik->i", jac, self.cov, jac)
        sd_coef = np.sqrt(np.maximum(var, 0.0))
        return Prediction(mean, sd_coef, np.sqrt(sd_coef**2 + self.sigma**2 + self.measurement_sd**2))


def _jacobian(theta: np.ndarray, f: Features, base: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    out = np.empty((len(base), len(theta)))
    for j in range(len(theta)):
        step = theta.copy()
        step[j] += eps
        out[:, j] = (predict_log(step, f) - base) / eps
    return out


def _huber(z: np.ndarray) -> np.ndarray:
    a = np.abs(z)
    return np.where(a <= HUBER_K, 0.5 * z**2, HUBER_K * a - 0.5 * HUBER_K**2)


def fit(
    f: Features,
    log_step: np.ndarray,
    rel_sd: np.ndarray,
    priors: DevicePriors,
    start: Fit | None = None,
) -> Fit:
    """MAP coefficients for measured log step times `log_step` (rows of `f`), each with a
    measurement sd `rel_sd` (relative, from its interval or spread) on top of the misfit.
    `start` (an earlier fit, e.g. before the latest trial) only speeds up the search."""
    mu, sd = prior(priors)
    lam = 1.0 / sd**2
    theta, sigma = (mu.copy(), NOISE_PRIOR) if start is None else (start.theta.copy(), start.sigma)
    n = len(log_step)
    if n == 0:
        return Fit(theta, np.diag(sd**2), sigma, 0, 0.0)
    a = np.diag(lam)
    for _ in range(2):  # alternate the coefficients and the misfit scale
        var = sigma**2 + rel_sd**2
        theta, a, w = _map(f, log_step, var, theta, mu, lam)
        r = log_step - predict_log(theta, f)
        jac = _jacobian(theta, f, predict_log(theta, f))
        p_eff = float(np.trace(np.linalg.solve(a, jac.T @ (jac * (w / var)[:, None]))))
        dof = max(0.0, n - p_eff)
        # Squared residuals beyond their measurement noise, shrunk towards the prior misfit.
        excess = float(np.sum(w * np.maximum(r**2 - rel_sd**2, 0.0)))
        sigma = math.sqrt((excess + NOISE_PRIOR_POINTS * NOISE_PRIOR**2) / (dof + NOISE_PRIOR_POINTS))
        sigma = max(sigma, 0.01)
    var = sigma**2 + rel_sd**2
    theta, a, _ = _map(f, log_step, var, theta, mu, lam)
    return Fit(theta, np.linalg.inv(a), sigma, n, dof, float(np.median(rel_sd)))


def _objective(theta, f, y, var, mu, lam) -> float:
    z = (y - predict_log(theta, f)) / np.sqrt(var)
    return float(np.sum(_huber(z)) + 0.5 * np.sum(lam * (theta - mu) ** 2))


def _map(f, y, var, theta, mu, lam, iters: int = 40):
    """Levenberg-damped Gauss-Newton on the Huber loss (IRLS weights) plus the Gaussian prior.
    Returns the coefficients, the posterior precision there, and the Huber weights."""
    damping = 1e-3
    best = _objective(theta, f, y, var, mu, lam)
    for _ in range(iters):
        pred = predict_log(theta, f)
        r = y - pred
        z = r / np.sqrt(var)
        w = np.minimum(1.0, HUBER_K / np.maximum(np.abs(z), 1e-12))
        jac = _jacobian(theta, f, pred)
        a = jac.T @ (jac * (w / var)[:, None]) + np.diag(lam)
        g = jac.T @ (w * r / var) - lam * (theta - mu)
        while True:
            step = np.linalg.solve(a + damping * np.diag(np.diag(a)), g)
            trial = theta + step
            value = _objective(trial, f, y, var, mu, lam)
            if value <= best or damping > 1e6:
                break
            damping *= 10
        if value > best:
            break
        converged = best - value < 1e-9 * (1 + abs(best))
        theta, best, damping = trial, value, max(damping / 10, 1e-6)
        if converged:
            break
    pred = predict_log(theta, f)
    z = (y - pred) / np.sqrt(var)
    w = np.minimum(1.0, HUBER_K / np.maximum(np.abs(z), 1e-12))
    jac = _jacobian(theta, f, pred)
    return theta, jac.T @ (jac * (w / var)[:, None]) + np.diag(lam), w
