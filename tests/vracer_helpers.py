"""Helpers shared by the V-RACER test files (tests/test_vracer_*.py): textbook Retrace targets, a memory of random
episodes, a CPU learner, and the probe that runs the real `__main__` of vracer_refer.py in a subprocess and records
what its loop hands the learner step, the actors, the checkpoints and the evaluation."""

import ast
import atexit
import copy
import os
import shutil
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import torch

import vracer_refer as vr
from common.checkpoint import rng_state

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "vracer_refer.py")
TESTS = str(Path(__file__).resolve().parent)


# ----------------------------------------------------------------------------------------------------------------
# Textbook Retrace (paper notation, slow)
def textbook_vtbc(rewards, values, rhos, gamma, terminated):
    """Eq. (8) as a backward loop: V^tbc_t = V_t + min(1, rho_t) [r_{t+1} + gamma V^tbc_{t+1} - V_t]."""
    L = len(rewards)
    nxt = 0.0 if terminated else values[L]  # V^tbc_L: bootstrap V(s_L) on truncation, 0 on termination
    out = np.zeros(L)
    for t in reversed(range(L)):
        rho_bar = min(1.0, rhos[t])
        out[t] = values[t] + rho_bar * (rewards[t] + gamma * nxt - values[t])
        nxt = out[t]
    return out


def textbook_qret(rewards, values, rhos, gamma, terminated):
    """Q^ret_t = r_{t+1} + gamma V^tbc_{t+1} (from Eqs. (6)-(7))."""
    vt = textbook_vtbc(rewards, values, rhos, gamma, terminated)
    tail = 0.0 if terminated else values[len(rewards)]
    return np.array([rewards[t] + gamma * (vt[t + 1] if t + 1 < len(rewards) else tail) for t in range(len(rewards))])


def textbook_memory_qret(rm):
    """Q^ret of every stored step by the textbook loop over each episode, from the memory's rewards r / sigma_r,
    latest V and rho, and V(s_L); slots that hold no step are 0."""
    qret = np.zeros(rm.capacity)
    for start, length in rm.episodes:
        steps = slice(start, start + length)
        last = start + length - 1
        values = np.append(rm.value[steps], rm.boot_value[last])
        rewards = rm.reward[steps] / rm.reward_scale
        qret[steps] = textbook_qret(rewards, values, rm.rho[steps], rm.gamma, not rm.truncated_last[last])
    return qret


def stored_qret(rm, idx):
    """Q^ret_t of the stored steps `idx`, as the learner reads it."""
    return rm.qret_at(np.asarray(idx))


def check_qret_consistent(rm):
    """Stored Q^ret equals the full Eq. (8) recursion over the stored V, rho and V(s_L) of every episode."""
    for s, L in rm.episodes:
        sl = slice(s, s + L)
        term = not rm.truncated_last[s + L - 1]
        vals = np.append(rm.value[sl], rm.boot_value[s + L - 1])
        np.testing.assert_allclose(
            stored_qret(rm, np.arange(s, s + L)),
            textbook_qret(rm.scaled_reward[sl], vals, rm.rho[sl], rm.gamma, term),
            rtol=1e-9,
            atol=1e-9,
        )


def random_episode(rng, L, terminated):
    rewards = rng.normal(size=L)
    values = rng.normal(size=L + 1)
    if terminated:
        values[L] = 0.0
    rhos = np.exp(rng.normal(scale=1.0, size=L))
    return rewards, values, rhos


# ----------------------------------------------------------------------------------------------------------------
# A memory of random episodes, a CPU learner
def fill(rm, rng, n_episodes, lmin=1, lmax=40, obs_dim=3, act_dim=2):
    lens = []
    for _ in range(n_episodes):
        L = int(rng.integers(lmin, lmax + 1))
        term = bool(rng.uniform() < 0.5)
        rm.add_episode(
            rng.normal(size=(L, obs_dim)),
            rng.normal(size=(L, act_dim)),
            np.zeros((L, act_dim)),
            np.ones((L, act_dim)),
            rng.normal(size=L),
            rng.normal(size=L),
            term,
            final_value=float(rng.normal()),
            final_obs=rng.normal(size=obs_dim),
        )
        lens.append(L)
    return lens


def cpu_learner(agent, optimizer, rm, rng, obs_dim=3, k=0, beta=1.0):
    """A learner on the CPU at gradient step k with this beta, its state statistics mean 0 and std 1."""
    return vr.Learner(agent, optimizer, rm, torch.zeros(obs_dim), torch.ones(obs_dim), rng, torch.device("cpu"), k, beta)


# ----------------------------------------------------------------------------------------------------------------
# Real runs in a subprocess
def run_script(cwd, *flags, timeout=180):
    """vracer_refer.py as a user runs it (CPU, no progress line)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, SCRIPT, "--no-progress", "--no-cuda", *flags],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_probed(cwd, probe_dir, *flags, timeout=240):
    """vracer_refer.py's real `__main__` (as `run_script` runs it) under `probe_main`: returns the completed process;
    the records are in `probe_dir` (`load_records`)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), TESTS]), OMP_NUM_THREADS="1")
    code = "import sys, vracer_helpers; vracer_helpers.probe_main(sys.argv[1], sys.argv[2:])"
    return subprocess.run(
        [sys.executable, "-c", code, str(probe_dir), "--no-progress", "--no-cuda", *flags],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def load_records(probe_dir) -> dict:
    return torch.load(Path(probe_dir) / "records.pt", weights_only=False)


def main_block(path: str):
    """The body of the script's `if __name__ == "__main__":` block, compiled."""
    tree = ast.parse(Path(path).read_text())
    # the last one: the first holds only install_stop_handling(), before the heavy imports
    *_, block = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"]
    return compile(ast.Module(body=block.body, type_ignores=[]), path, "exec")


def probe_main(probe_dir: str, flags: list[str]) -> None:
    """Run vracer_refer.py's `__main__` block in this process, in the namespace of the module `vracer_refer` (its
    variables become the module's globals), with `train_step`, `publish_weights`, `save_run_checkpoint`, `evaluate`,
    the samplers and `ProcessGroup.start` wrapped to record what the loop hands them; each wrapper calls the real
    function unchanged. The records (`records.pt`) and a copy of every checkpoint (`checkpoint_<step>.pt`) go to
    `probe_dir`:
    - steps: per gradient step k, what the step starts from (beta, t, t0, statistics, memory size) and what it has
      set when it returns (lr, eps, c_max, beta, far fraction, the written-back rho of its batch);
    - first_step: at the first gradient step of this process, before it, every piece of the learner's state;
    - publishes: {version: (weights, obs_mean, obs_std, k)} of the last 400 publishes;
    - samples: (batch size, PER's P(rank 2) / P(rank 1) in effect = 2^-alpha, PER's beta) of each draw;
    - actors: (name, seed, args) of each started process; evaluations: (episodes, clip, obs_mean, obs_std) of each
      evaluation; stats: the memory's state statistics at each k = stats_every multiple; state_stats_calls: each call
      of the loop's `state_stats` (k, the stored states and rewards, its result)."""
    probe_dir = Path(probe_dir)
    probe_dir.mkdir(parents=True, exist_ok=True)
    sys.argv = [SCRIPT, *flags]
    records = {
        "steps": [],
        "first_step": None,
        "publishes": {},
        "samples": [],
        "actors": [],
        "evaluations": [],
        "stats": {},
        "state_stats_calls": [],
    }
    drawn = {}
    real = {
        "train_step": vr.train_step,
        "publish_weights": vr.publish_weights,
        "save_run_checkpoint": vr.save_run_checkpoint,
        "evaluate": vr.evaluate,
        "sample": vr.EpisodeReplay.sample,
        "sample_per": vr.EpisodeReplay.sample_per,
        "start": vr.ProcessGroup.start,
        "state_stats": vr.EpisodeReplay.state_stats,
    }
    published = deque()

    def train_step(learner, args):
        replay = learner.replay
        k = learner.k
        if records["first_step"] is None:
            records["first_step"] = {
                "state": {"k": learner.k, "beta": learner.beta},
                "global_step": vr.global_step,
                "t0": vr.t0,
                "model": copy.deepcopy(learner.agent.state_dict()),
                "optimizer": copy.deepcopy(learner.optimizer.state_dict()),
                "replay": copy.deepcopy(replay.state_dict()),
                "obs_mean": learner.obs_mean.clone(),
                "obs_std": learner.obs_std.clone(),
                "reward_scale": replay.reward_scale,
                "np_rng": copy.deepcopy(learner.rng.bit_generator.state),
                "rng": rng_state(),
            }
        if k > 0 and k % args.stats_every == 0:
            records["stats"][k] = real["state_stats"](replay)
        entry = {
            "k": k,
            "beta_before": learner.beta,
            "global_step": vr.global_step,
            "t0": vr.t0,
            "obs_mean": learner.obs_mean.clone(),
            "obs_std": learner.obs_std.clone(),
            "reward_scale": replay.reward_scale,
            "replay_size": replay.size,
            "weights_version": vr.published_version(vr.shared),
        }
        stats = real["train_step"](learner, args)
        group = learner.optimizer.param_groups[0]
        entry |= {
            "lr": group["lr"],
            "eps": group["eps"],
            "cmax": replay.cmax,
            "beta_after": learner.beta,
            "far_fraction": replay.far_fraction(),
            "rho": replay.rho[drawn["idx"]].copy(),
        }
        records["steps"].append(entry)
        return stats

    def publish_weights(shared, agent, obs_mean, obs_std):
        real["publish_weights"](shared, agent, obs_mean, obs_std)
        version = vr.published_version(shared)
        weights = shared.weights.clone()
        records["publishes"][version] = (weights, shared.obs_mean.clone(), shared.obs_std.clone(), vr.learner.k)
        published.append(version)
        while len(published) > 400:
            records["publishes"].pop(published.popleft(), None)

    def save_run_checkpoint(logger, script, args, global_step, **contents):
        real["save_run_checkpoint"](logger, script, args, global_step, **contents)
        shutil.copy(logger.dir / "checkpoint.pt", probe_dir / f"checkpoint_{global_step}.pt")

    def evaluate(agent, env_id, seed, episodes, obs_mean, obs_std, device, clip=False):
        records["evaluations"].append((episodes, clip, obs_mean.clone(), obs_std.clone()))
        return real["evaluate"](agent, env_id, seed, episodes, obs_mean, obs_std, device, clip)

    def sample(self, B, rng):
        idx = real["sample"](self, B, rng)
        records["samples"].append((len(idx), None, None))
        drawn["idx"] = idx
        return idx

    def sample_per(self, B, rng, beta_is):
        idx, weights = real["sample_per"](self, B, rng, beta_is)
        records["samples"].append((len(idx), self.per_rank_prob[1] / self.per_rank_prob[0], beta_is))
        drawn["idx"] = idx
        return idx, weights

    def state_stats(self):
        stored = self.valid[: self.high_water]
        result = real["state_stats"](self)
        call = {
            "k": vr.learner.k,
            "obs": self.obs[: self.high_water][stored],
            "reward": self.reward[: self.high_water][stored],
        }
        records["state_stats_calls"].append(call | {"result": result})
        return result

    def start(self, target, args, name):
        if target is vr.actor_loop:
            records["actors"].append((name, args[5], copy.deepcopy(args[1])))
        return real["start"](self, target, args, name)

    vr.train_step = train_step
    vr.publish_weights = publish_weights
    vr.save_run_checkpoint = save_run_checkpoint
    vr.evaluate = evaluate
    vr.EpisodeReplay.sample = sample
    vr.EpisodeReplay.sample_per = sample_per
    vr.ProcessGroup.start = start
    vr.EpisodeReplay.state_stats = state_stats
    saved = []

    def save_records():
        if not saved:
            torch.save(records, probe_dir / "records.pt")
            saved.append(True)

    # a run's end leaves the process in common.processes.exit_now, never returning here; it runs the atexit functions
    atexit.register(save_records)
    try:
        exec(main_block(SCRIPT), vr.__dict__)
    finally:
        save_records()
