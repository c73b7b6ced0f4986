"""Return normalization for numpy vector envs, as gym's NormalizeReward / baselines' VecNormalize(ret=True) (the
PLR paper's Table 3 "return normalization"; CleanRL's ppo_procgen wraps its envs in NormalizeReward).

- `ReturnNormalizer(num_envs, gamma)`: `normalizer(rewards, dones)` -> rewards / sqrt(Var[discounted return] + eps),
  clipped; the running mean/variance use Chan et al.'s parallel update over the envs' current discounted returns.
  `state_dict` / `load_state_dict` for checkpoints.
"""

import numpy as np


class ReturnNormalizer:
    """Divides each env's reward by the running std of its discounted return, clipped to ±clip (call it once per
    vector-env step with that step's rewards and episode ends)."""

    def __init__(self, num_envs, gamma, clip=10.0, eps=1e-8):
        self.gamma, self.clip, self.eps = gamma, clip, eps
        self.ret = np.zeros(num_envs)
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    def __call__(self, rewards, dones):
        self.ret = self.ret * self.gamma + rewards
        x = self.ret
        b_mean, b_var, b_count = x.mean(), x.var(), x.size  # parallel running mean/var (Chan et al.)
        delta, tot = b_mean - self.mean, self.count + b_count
        self.mean += delta * b_count / tot
        self.var = (self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / tot) / tot
        self.count = tot
        self.ret[dones] = 0.0
        return np.clip(rewards / np.sqrt(self.var + self.eps), -self.clip, self.clip).astype(np.float32)

    def state_dict(self):
        return {"ret": self.ret.copy(), "mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, d):
        self.__dict__.update(d, ret=d["ret"].copy())
