"""train.batch_ramp = "auto": the global batch grows toward the measured gradient noise scale.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training") find the critical batch, past
which a larger batch buys little speed-up per step, close to the noise scale B_simple, and that it grows
as the loss falls. So the ramp starts from train.grad_accum and follows
the smoothed B_simple (fivefold.train.noise_scale) up:

- Through grad_accum only, so the batch keeps the same tokens in the same order whatever the layout
  (as train.batch_schedule does); never shrinking; never above train.max_grad_accum.
- Every settle_steps(train.gns_ema) steps (the EMA's horizon: 20 steps at 0.95, so each decision rests on
  mostly fresh evidence), once that many steps have been measured: the target is the largest grad_accum
  whose batch does not exceed B_simple, floor(B_simple / target tokens per unit of grad_accum), rounded
  down to the schedule's granularity (pp under the interleaved pipeline), capped at max_grad_accum and
  at twice the current grad_accum. The batch grows to it if it is larger than the current one. Growing
  only when the noise scale holds at least one more whole unit of grad_accum keeps the batch at or below
  B_simple; at most doubling per decision keeps a noisy estimate (the smoothed |G|^2 near zero makes
  B_simple shoot up) from throwing the batch far past the noise scale before fresh evidence arrives.
- Every rank proposes its target and the maximum over ranks is taken (one all-reduce of an integer), so
  all ranks change batch at the same step even if their floats differed in the last bit.
- The learning rate follows through train.lr_scaling against base_batch_tokens, exactly as for
  train.batch_schedule (fivefold.train.optim.lr_at reads the step's batch).
- A checkpoint keeps the global batch in sequences (layout-independent) and the estimator's EMAs, so a
  resumed run continues with the same batch and the same evidence.
"""

from __future__ import annotations

from fivefold.config import ConfigError, TrainConfig
from fivefold.train.noise_scale import NoiseScale, settle_steps


class AutoBatchRamp:
    def __init__(self, cfg: TrainConfig, dp: int, granularity: int = 1):
        self.grad_accum = cfg.grad_accum
        self.max_grad_accum = cfg.max_grad_accum
        self.every = settle_steps(cfg.gns_ema)
        self.sequences_per_accum = cfg.micro_batch_size * dp  # global sequences one unit of grad_accum adds
        self.granularity = granularity

    def due(self, step: int) -> bool:
        """Whether the batch is reconsidered after `step` (a function of the step alone: every rank agrees)."""
        return step % self.every == 0

    def target(self, noise: NoiseScale, tokens_per_accum: float) -> int:
        """This rank's proposal: the largest allowed grad_accum whose batch is at most the noise scale, at
        most twice the current one (the current one while the estimate has not settled or is undefined)."""
        gns = noise.value
        if noise.count < self.every or gns is None or tokens_per_accum <= 0:
            return self.grad_accum
        fits = int(gns // tokens_per_accum) // self.granularity * self.granularity
        return max(self.grad_accum, min(self.max_grad_accum, 2 * self.grad_accum, fits))

    def grow(self, agreed: int) -> bool:
        """Take the agreed target (the maximum of every rank's); returns whether the batch grew."""
        if agreed <= self.grad_accum:
            return False
        self.grad_accum = min(agreed, self.max_grad_accum)
        return True

    def state_dict(self) -> dict:
        return {"batch_sequences": self.grad_accum * self.sequences_per_accum}

    def load_state_dict(self, state: dict) -> None:
        """The saved global batch (sequences) under this run's layout; the layout may have changed."""
        sequences = int(state["batch_sequences"])
        accum, rest = divmod(sequences, self.sequences_per_accum)
        if rest or accum < 1:
            raise ConfigError(f"the run's batch ramp reached {sequences} sequences per step, which "
                              f"micro_batch_size x dp = {self.sequences_per_accum} does not divide; choose "
                              f"train.micro_batch_size and parallel.dp whose product divides {sequences}")
        if accum > self.max_grad_accum:
            raise ConfigError(f"the run's batch ramp reached grad_accum={accum} ({sequences} sequences) under this "
                              f"layout, above train.max_grad_accum={self.max_grad_accum}; the ramp never shrinks "
                              f"the batch: raise train.max_grad_accum to at least {accum}")
        self.grad_accum = accum
