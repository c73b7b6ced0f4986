"""Helpers shared by the PLR test files (tests/test_plr_*.py): the real `__main__` of plr_ppo.py run in this process
with spies on the module's functions and classes (`Recorder`), textbook versions written from the papers (GAE,
Algorithm 4's scores and commits, the PPO update, Adam, return normalisation) and the checks of a recorded run against
them, synthetic rollouts for the sampler, the real tiny MiniGrid run and its resumption that several test files read
(run once per session), and the deterministic fake envs."""

import ast
import contextlib
import copy
import io
import math
import random
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import plr_ppo
from common import processes
from common.minigrid_env import MiniGridVecEnv

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "plr_ppo.py"


# ----------------------------------------------------------------------------------------------------------------
# The real __main__ in this process, with spies
def main_code():
    """The body of plr_ppo.py's `if __name__ == "__main__":` block, compiled with the file's line numbers."""
    tree = ast.parse(SCRIPT.read_text())
    # the last one: the first holds only install_stop_handling(), before the heavy imports
    *_, block = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"]
    return compile(ast.Module(body=block.body, type_ignores=[]), str(SCRIPT), "exec")


def run_main(argv, recorder=None):
    """Runs the `__main__` block of plr_ppo.py with `argv` in a copy of the module's namespace (so functions and classes
    patched on the module before the call are the ones it uses) and returns that namespace. The signal handlers and
    torch's thread count are restored afterwards."""
    namespace = dict(vars(plr_ppo))
    namespace["__name__"] = "__main__"
    if recorder is not None:
        recorder.namespace = namespace
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    threads = torch.get_num_threads()
    argv_before = sys.argv
    sys.argv = [str(SCRIPT), *argv]
    try:
        exec(main_code(), namespace)
    finally:
        sys.argv = argv_before
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
        torch.set_num_threads(threads)
    return namespace


def snapshot_params(module):
    return [p.detach().clone() for p in module.parameters()]


class Recorder:
    """Spies on one run: every env reset and step (training or evaluation), every call to the sampler, the return
    normaliser, torch.randperm, each optimizer step (the parameters, gradients and Adam moments just before it) and
    each evaluation, as one ordered list of events (kind, data)."""

    def __init__(self, monkeypatch, env_class):
        self.events = []
        self.namespace = None
        self.in_eval = False
        self.last_obs = {}
        self.resume_states = []
        self.first_step_states = []
        self.checkpoint_states = []
        self.stop_after_checkpoint = False
        self._after_reset = False
        recorder = self
        self.train_env = None
        orig_reset = env_class.reset
        orig_step = env_class.step
        orig_close = env_class.close

        def reset(env, levels):
            obs = orig_reset(env, levels)
            recorder.last_obs[id(env)] = obs.copy()
            role = "eval" if recorder.in_eval else "train"
            recorder.events.append(("reset", dict(role=role, levels=np.array(levels), obs=obs.copy())))
            if role == "train":
                recorder.train_env = id(env)
                recorder.resume_states.append(recorder.run_state())
                recorder._after_reset = True
            return obs

        def step(env, actions, next_level=None):
            role = "eval" if recorder.in_eval else "train"
            if role == "train" and recorder._after_reset:
                recorder._after_reset = False
                namespace = recorder.namespace
                normalizer = namespace["normalizer"]
                sampler = namespace["sampler"]
                recorder.first_step_states.append(
                    dict(
                        partial_steps=sampler.partial_steps.copy(),
                        partial_score=sampler.partial_score.copy(),
                        normalizer_ret=None if normalizer is None else normalizer.ret.copy(),
                    )
                )
            obs_in = recorder.last_obs[id(env)]
            out = orig_step(env, actions, next_level)
            obs, reward, terminated, truncated, info = out
            recorder.last_obs[id(env)] = obs.copy()
            event = dict(
                role=role,
                obs=obs_in,
                actions=np.array(actions).copy(),
                reward=np.array(reward, np.float64).copy(),
                terminated=np.array(terminated).copy(),
                truncated=np.array(truncated).copy(),
                level=np.array(info["level_seed"]).copy(),
                next_level=np.array(info["next_level_seed"]).copy(),
                final_obs=np.array(info["final_obs"]).copy(),
                next_obs=obs.copy(),
            )
            recorder.events.append(("step", event))
            return out

        def close(env):
            recorder.events.append(("close", dict(train=id(env) == recorder.train_env)))
            return orig_close(env)

        def sample(sampler, actor):
            level = orig_sample(sampler, actor)
            recorder.events.append(("sample", dict(actor=actor, level=level)))
            return level

        def update_with_rollouts(sampler, scores, dones, levels):
            recorder.events.append(("update_with_rollouts", {}))
            return orig_update(sampler, scores, dones, levels)

        def commit_score(sampler, level, score):
            recorder.events.append(("commit", dict(level=level, score=score)))
            return orig_commit(sampler, level, score)

        def after_update(sampler):
            recorder.events.append(("after_update", {}))
            return orig_after_update(sampler)

        def normalize(normalizer, rewards, dones):
            out = orig_normalize(normalizer, rewards, dones)
            recorder.events.append(("normalize", dict(rewards=np.array(rewards).copy(), out=np.array(out).copy())))
            return out

        def randperm(*args, **kwargs):
            permutation = orig_randperm(*args, **kwargs)
            recorder.events.append(("randperm", dict(permutation=permutation.clone())))
            return permutation

        def evaluate(agent, envs, level_sets, num_episodes, args, device):
            params = snapshot_params(agent)
            recorder.events.append(
                ("evaluate", dict(num_episodes=num_episodes, num_envs=envs.num_envs, agent=agent, params=params))
            )
            recorder.in_eval = True
            try:
                return orig_evaluate(agent, envs, level_sets, num_episodes, args, device)
            finally:
                recorder.in_eval = False

        def save_run_checkpoint(*args, **kwargs):
            recorder.checkpoint_states.append(recorder.run_state())
            orig_save(*args, **kwargs)
            if recorder.stop_after_checkpoint:
                # as a SIGTERM arriving right after the checkpoint (the handler only records it)
                processes._received_signals.append(signal.SIGTERM)

        orig_save = plr_ppo.save_run_checkpoint
        orig_sample = plr_ppo.LevelSampler.sample
        orig_update = plr_ppo.LevelSampler.update_with_rollouts
        orig_commit = plr_ppo.LevelSampler._commit_score
        orig_after_update = plr_ppo.LevelSampler.after_update
        orig_normalize = plr_ppo.ReturnNormalizer.__call__
        orig_randperm = torch.randperm
        orig_evaluate = plr_ppo.evaluate
        monkeypatch.setattr(env_class, "reset", reset)
        monkeypatch.setattr(env_class, "step", step)
        monkeypatch.setattr(env_class, "close", close)
        monkeypatch.setattr(plr_ppo.LevelSampler, "sample", sample)
        monkeypatch.setattr(plr_ppo.LevelSampler, "update_with_rollouts", update_with_rollouts)
        monkeypatch.setattr(plr_ppo.LevelSampler, "_commit_score", commit_score)
        monkeypatch.setattr(plr_ppo.LevelSampler, "after_update", after_update)
        monkeypatch.setattr(plr_ppo.ReturnNormalizer, "__call__", normalize)
        monkeypatch.setattr(torch, "randperm", randperm)
        monkeypatch.setattr(plr_ppo, "evaluate", evaluate)
        monkeypatch.setattr(plr_ppo, "save_run_checkpoint", save_run_checkpoint)

    def optimizer_pre_hook(self, optimizer, args, kwargs):
        (group,) = optimizer.param_groups
        params = group["params"]
        moments = []
        for p in params:
            state = optimizer.state.get(p, {})
            if state:
                moments.append((float(state["step"]), state["exp_avg"].clone(), state["exp_avg_sq"].clone()))
            else:
                moments.append((0.0, torch.zeros_like(p), torch.zeros_like(p)))
        settings = {name: value for name, value in group.items() if name != "params"}
        event = dict(params=[p.detach().clone() for p in params], grads=[p.grad.clone() for p in params])
        event |= dict(moments=moments, settings=settings)
        self.events.append(("adam", event))

    def first_levels(self):
        """The levels of the first training reset (the run's start or its resume)."""
        for kind, data in self.events:
            if kind == "reset" and data["role"] == "train":
                return data["levels"]
        raise AssertionError("no training reset")

    def run_state(self):
        """What a resume restores, read from the run's namespace (at a training env's reset)."""
        namespace = self.namespace
        normalizer = namespace["normalizer"]
        state = dict(
            global_step=namespace["global_step"],
            update=namespace["update"],
            model=copy.deepcopy(namespace["agent"].state_dict()),
            optimizer=copy.deepcopy(namespace["optimizer"].state_dict()),
            sampler=copy.deepcopy(namespace["sampler"].state_dict()),
            normalizer=None if normalizer is None else copy.deepcopy(normalizer.state_dict()),
            eval_rng=copy.deepcopy(namespace["eval_rng"].bit_generator.state),
            rng=dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state()),
        )
        return state


def record_run(argv, env_class=MiniGridVecEnv, stop_after_checkpoint=False):
    """Runs `argv` with a Recorder; returns (the run's namespace, the recorder). `stop_after_checkpoint`: a SIGTERM
    arrives right after the first checkpoint (the run then stops with exit code 143)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(processes, "_received_signals", [])
        recorder = Recorder(monkeypatch, env_class)
        recorder.stop_after_checkpoint = stop_after_checkpoint
        handle = register_optimizer_step_pre_hook(recorder.optimizer_pre_hook)
        try:
            namespace = run_main(argv, recorder)
        finally:
            handle.remove()
    return namespace, recorder


class Update:
    """One update of a recorded run: its rollout's training steps and the events of its learning phase."""

    def __init__(self):
        self.steps = []
        self.samples = []  # (step index, actor, level) of the sample calls made inside env.step
        self.normalized = []
        self.events = []  # everything after the rollout, in order

    def adam_events(self):
        return [data for kind, data in self.events if kind == "adam"]


def split_updates(recorder):
    """The recorded training events as a list of `Update`s: a new one starts with the first training step, or the
    first level drawn inside it, after an optimizer step (the initial draws, before the first reset, are not in any)."""
    updates = []
    current = None
    learning = False
    started = False
    for kind, data in recorder.events:
        if kind == "reset":
            started = started or data["role"] == "train"
            continue
        if not started or (kind == "step" and data["role"] == "eval"):
            continue
        if kind in ("step", "sample") and (current is None or learning):
            current = Update()
            updates.append(current)
            learning = False
        if current is None:
            continue
        if kind == "step":
            current.steps.append(data)
        elif kind == "sample":
            current.samples.append((len(current.steps), data["actor"], data["level"]))
        elif kind == "normalize":
            current.normalized.append(data["out"])
        else:
            learning = learning or kind in ("randperm", "adam")
            current.events.append((kind, data))
    return updates


class RecordedRun:
    def __init__(self, namespace, recorder):
        self.namespace = namespace
        self.recorder = recorder
        self.updates = split_updates(recorder)


# ----------------------------------------------------------------------------------------------------------------
# Textbook versions (the papers' forms)
def textbook_gae(rewards, values, next_value, terminated, truncated, final_values, gamma, lam):
    """A_t = Σ_{k=t}^{end} (γλ)^{k-t} δ_k with δ_k = r_k + γ V(s_{k+1}) - V(s_k), V(s_{end+1}) = 0 on termination,
    V(final obs) on truncation, V(s_T) at the rollout's end."""
    T, N = rewards.shape
    A = np.zeros((T, N))
    delta = np.zeros((T, N))
    for n in range(N):
        for k in range(T):
            if terminated[k, n]:
                v_next = 0.0
            elif truncated[k, n]:
                v_next = final_values[k, n]
            else:
                v_next = values[k + 1, n] if k + 1 < T else next_value[n]
            delta[k, n] = rewards[k, n] + gamma * v_next - values[k, n]
        for t in range(T):
            total = 0.0
            for k in range(t, T):
                total += (gamma * lam) ** (k - t) * delta[k, n]
                if terminated[k, n] or truncated[k, n]:
                    break
            A[t, n] = total
    return A, delta


def textbook_scores(rollouts, num_levels, alpha=1.0, flush_each_update=False):
    """Algorithm 4: per actor, the trajectory τ of the current episode grows across rollouts; at d_t the level's
    score is the mean per-step score over the whole episode (S~ stitching). With flush_each_update (authors' code),
    the partial τ is committed at the end of each rollout and τ restarts."""
    S = np.zeros(num_levels)
    scored = np.zeros(num_levels, bool)
    tau = {}

    def commit(level, value):
        S[level] = value if not scored[level] else (1 - alpha) * S[level] + alpha * value
        scored[level] = True

    for scores, dones, levels in rollouts:
        T, N = scores.shape
        for a in range(N):  # actor-major commit order, as the sampler (and the authors' code)
            for t in range(T):
                tau.setdefault(a, []).append((levels[t, a], scores[t, a]))
                if dones[t, a]:
                    commit(levels[t, a], np.mean([s for _, s in tau[a]]))
                    tau[a] = []
            if flush_each_update and tau.get(a):
                commit(tau[a][-1][0], np.mean([s for _, s in tau[a]]))
                tau[a] = []
    return S, scored


def random_rollouts(rng, num_rollouts, T, N, levels_per_actor, p_done=0.15):
    """Synthetic rollouts where actor a plays only levels of its own set (so commit order is unambiguous)."""
    out = []
    cur = [int(rng.integers(levels_per_actor)) + a * levels_per_actor for a in range(N)]
    for _ in range(num_rollouts):
        scores = rng.normal(size=(T, N))
        dones = rng.random((T, N)) < p_done
        levels = np.zeros((T, N), np.int64)
        for a in range(N):
            for t in range(T):
                levels[t, a] = cur[a]
                if dones[t, a]:
                    cur[a] = int(rng.integers(levels_per_actor)) + a * levels_per_actor
        out.append((scores, dones, levels))
    return out


def textbook_forward(agent, params, obs):
    named = dict(zip([name for name, _ in agent.named_parameters()], params))
    return torch.func.functional_call(agent, named, (torch.as_tensor(obs),))


def textbook_batch(agent, update, settings):
    """The batch of one update from its recorded rollout and the parameters θ_old at the update's start: obs, actions,
    log π_θold(a|s), V_θold(s), GAE advantages A (Schulman et al. 2016; termination 0, truncation V(final obs)) and
    returns A + V, flattened over (t, i); also |A| per (t, i) for the value_l1 scores."""
    theta_old = update.adam_events()[0]["params"]
    steps = update.steps
    obs = np.stack([step["obs"] for step in steps])
    T, N = obs.shape[:2]
    actions = np.stack([step["actions"] for step in steps])
    with torch.no_grad():
        logits, values = textbook_forward(agent, theta_old, obs.reshape(T * N, *obs.shape[2:]))
        next_value = textbook_forward(agent, theta_old, steps[-1]["next_obs"])[1].double().numpy()
        final_values = np.zeros((T, N))
        for t, step in enumerate(steps):
            for i in np.flatnonzero(step["truncated"]):
                final_values[t, i] = textbook_forward(agent, theta_old, step["final_obs"][i : i + 1])[1].item()
    log_probs = torch.log_softmax(logits, -1)
    old_logprobs = log_probs.gather(1, torch.as_tensor(actions.reshape(-1))[:, None]).squeeze(1)
    values = values.double().numpy().reshape(T, N)
    terminated = np.stack([step["terminated"] for step in steps])
    truncated = np.stack([step["truncated"] for step in steps])
    if not settings["bootstrap_truncation"]:
        # the time limit is part of the task: a timeout is a termination
        terminated = terminated | truncated
        truncated = np.zeros_like(truncated)
    if settings["norm_reward"]:
        rewards = np.stack(update.normalized).astype(np.float64)
    else:
        rewards = np.stack([step["reward"] for step in steps])
    advantages, _ = textbook_gae(
        rewards, values, next_value, terminated, truncated, final_values, settings["gamma"], settings["gae_lambda"]
    )
    returns = advantages + values
    return dict(
        obs=torch.as_tensor(obs.reshape(T * N, *obs.shape[2:])),
        actions=torch.as_tensor(actions.reshape(-1)),
        old_logprobs=old_logprobs.detach(),
        old_values=torch.as_tensor(values.reshape(-1), dtype=torch.float32),
        advantages=advantages.reshape(-1),
        returns=torch.as_tensor(returns.reshape(-1), dtype=torch.float32),
        abs_advantages=np.abs(advantages),
        dones=terminated | truncated,
        levels=np.stack([step["level"] for step in steps]),
        probs=log_probs.exp().double().numpy(),
    )


def textbook_ppo_gradient(agent, params, batch, indices, settings):
    """The gradient at `params` of PPO's minimised loss on the minibatch `indices` (Schulman et al. 2017, Eq. (9)
    negated): −E[min(r A, clip(r, 1 − ε, 1 + ε) A)] + c1 E[½ max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²)]
    − c2 E[H(π_θ)] with r = π_θ(a|s) / π_θold(a|s) and A normalised over the whole batch (A − mean) / (std + 1e-5);
    then clipped to the global norm c as torch.nn.utils.clip_grad_norm_ defines it, g · min(1, c / (‖g‖ + 1e-6)).
    Returns (the clipped gradient, the norm before clipping)."""
    advantages = batch["advantages"]
    if settings["norm_adv"]:
        advantages = (advantages - advantages.mean()) / (advantages.std(ddof=1) + 1e-5)
    advantages = torch.as_tensor(advantages[indices], dtype=torch.float32)
    params = [p.detach().clone().requires_grad_(True) for p in params]
    logits, values = textbook_forward(agent, params, batch["obs"][indices])
    log_probs = torch.log_softmax(logits, -1)
    new_logprobs = log_probs.gather(1, batch["actions"][indices][:, None]).squeeze(1)
    ratio = torch.exp(new_logprobs - batch["old_logprobs"][indices])
    eps = settings["clip_coef"]
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - eps, 1 + eps) * advantages)
    returns = batch["returns"][indices]
    old_values = batch["old_values"][indices]
    squared_error = (values - returns) ** 2
    if settings["clip_vloss"]:
        clipped_values = old_values + torch.clamp(values - old_values, -eps, eps)
        squared_error = torch.maximum(squared_error, (clipped_values - returns) ** 2)
    value_loss = 0.5 * squared_error
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    loss = -surrogate.mean() + settings["vf_coef"] * value_loss.mean() - settings["ent_coef"] * entropy.mean()
    grads = torch.autograd.grad(loss, params)
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    scale = min(1.0, settings["max_grad_norm"] / (norm + 1e-6))
    return [g * scale for g in grads], norm


def textbook_adam(params, grads, moments, lr, eps, betas=(0.9, 0.999)):
    """Adam (Kingma & Ba 2015, Algorithm 1, ε added to the bias-corrected √v̂ as torch does): t ← t + 1,
    m ← β1 m + (1 − β1) g, v ← β2 v + (1 − β2) g², θ ← θ − lr m̂ / (√v̂ + ε) with m̂ = m / (1 − β1^t), v̂ = v / (1 − β2^t).
    Returns (new parameters, new moments)."""
    beta1, beta2 = betas
    new_params = []
    new_moments = []
    for p, g, (t, m, v) in zip(params, grads, moments):
        t = t + 1
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        new_params.append(p - lr * m_hat / (v_hat.sqrt() + eps))
        new_moments.append((t, m, v))
    return new_params, new_moments


def vectors_close(got, want, rtol, reference=None):
    """‖got − want‖ ≤ rtol ‖reference‖ over the concatenated tensors (reference: `want`)."""
    got = torch.cat([x.reshape(-1).double() for x in got])
    want = torch.cat([x.reshape(-1).double() for x in want])
    reference = want if reference is None else torch.cat([x.reshape(-1).double() for x in reference])
    return float((got - want).norm()) <= rtol * float(reference.norm()) + 1e-12


def check_update(agent, update, settings, next_params):
    """Clause 3 on one recorded update: the epochs and minibatches, each step's gradient and each Adam step against
    the textbook; `next_params`: the parameters after the update's last step. Returns the textbook pre-clip norms."""
    batch = textbook_batch(agent, update, settings)
    batch_size = len(batch["actions"])
    minibatch_size = batch_size // settings["num_minibatches"]
    kinds = [kind for kind, _ in update.events if kind in ("randperm", "adam")]
    assert kinds == (["randperm"] + ["adam"] * settings["num_minibatches"]) * settings["update_epochs"]
    permutations = [data["permutation"] for kind, data in update.events if kind == "randperm"]
    adams = update.adam_events()
    norms = []
    for k, adam in enumerate(adams):
        permutation = permutations[k // settings["num_minibatches"]]
        assert sorted(permutation.tolist()) == list(range(batch_size))
        start = (k % settings["num_minibatches"]) * minibatch_size
        indices = permutation[start : start + minibatch_size]
        want_grads, norm = textbook_ppo_gradient(agent, adam["params"], batch, indices, settings)
        norms.append(norm)
        assert vectors_close(adam["grads"], want_grads, 1e-4), f"minibatch step {k}: gradient"
        want_params, want_moments = textbook_adam(
            adam["params"], adam["grads"], adam["moments"], settings["learning_rate"], settings["adam_eps"]
        )
        after = adams[k + 1] if k + 1 < len(adams) else None
        got_params = after["params"] if after else next_params
        step = [p - q for p, q in zip(want_params, adam["params"])]
        assert vectors_close(got_params, want_params, 1e-4, reference=step), f"minibatch step {k}: Adam"
        if after:
            # the moments carry over from step to step
            assert [t for t, _, _ in after["moments"]] == [t for t, _, _ in want_moments]
            assert vectors_close([m for _, m, _ in after["moments"]], [m for _, m, _ in want_moments], 1e-5)
            assert vectors_close([v for _, _, v in after["moments"]], [v for _, _, v in want_moments], 1e-5)
    return batch, norms


def textbook_commits(batches, mode):
    """Algorithm 4's commits, update by update: per actor the current episode's per-step scores |A| grow across
    rollouts; at an episode end the level it was played on gets the mean over the episode's steps. --plr-commit
    update (the authors' code) also commits each unfinished episode's mean after the update and restarts it. Returns
    per update (commits inside update_with_rollouts, commits after the PPO update), each a list of (level, score), and
    the lengths of the finished episodes."""
    out = []
    episode = {}
    lengths = []
    for batch in batches:
        T, N = batch["abs_advantages"].shape
        during = []
        after = []
        for actor in range(N):
            for t in range(T):
                episode.setdefault(actor, []).append((int(batch["levels"][t, actor]), batch["abs_advantages"][t, actor]))
                if batch["dones"][t, actor]:
                    during.append((episode[actor][-1][0], float(np.mean([s for _, s in episode[actor]]))))
                    lengths.append(len(episode[actor]))
                    episode[actor] = []
        if mode == "update":
            for actor in range(N):
                if episode.get(actor):
                    after.append((episode[actor][-1][0], float(np.mean([s for _, s in episode[actor]]))))
                    episode[actor] = []
        out.append((during, after))
    return out, lengths


def recorded_commits(update):
    """(commits inside update_with_rollouts, commits after the PPO update) of one recorded update."""
    during = []
    after = []
    phase = None
    for kind, data in update.events:
        if kind == "update_with_rollouts":
            phase = "during"
        elif kind in ("randperm", "adam"):
            phase = "learning"
        elif kind == "after_update":
            phase = "after"
        elif kind == "commit":
            assert phase in ("during", "after"), "a score committed outside update_with_rollouts / after_update"
            (during if phase == "during" else after).append((int(data["level"]), float(data["score"])))
    return during, after


def assert_commits_equal(got, want):
    assert [level for level, _ in got] == [level for level, _ in want]
    np.testing.assert_allclose([score for _, score in got], [score for _, score in want], rtol=1e-4, atol=1e-6)


def check_sampler_calls(update, num_envs, first_levels):
    """Clause 4's levels: the sampler is asked exactly for the envs whose episode ended at a step, and each env's next
    step is played on the level returned; `first_levels`: the levels of the rollout's first step."""
    np.testing.assert_array_equal(update.steps[0]["level"], first_levels)
    for t, step in enumerate(update.steps):
        done = step["terminated"] | step["truncated"]
        asked = [(actor, level) for k, actor, level in update.samples if k == t]
        assert [actor for actor, _ in asked] == np.flatnonzero(done).tolist(), f"step {t}"
        expected_next = step["level"].copy()
        for actor, level in asked:
            expected_next[actor] = level
        np.testing.assert_array_equal(step["next_level"], expected_next)
        if t + 1 < len(update.steps):
            np.testing.assert_array_equal(update.steps[t + 1]["level"], expected_next)
    return update.steps[-1]["next_level"]


def check_phase_order(update, mode):
    """Clause 4's timing: update_with_rollouts once, before the first optimizer step; after_update once, after the
    last one."""
    kinds = [kind for kind, _ in update.events if kind in ("update_with_rollouts", "adam", "after_update")]
    assert kinds.count("update_with_rollouts") == 1 and kinds.count("after_update") == 1
    assert kinds[0] == "update_with_rollouts" and kinds[-1] == "after_update"


def check_acting(batch, actions):
    """Clause 1 as statistics over a rollout, with π_t = π_θold(·|s_t): each action a is taken Σ_t π_t(a) times in
    expectation, and the log-likelihood Σ_t log π_t(a_t) has mean −Σ_t H(π_t) (5-sigma bounds; Poisson-binomial
    variances). A near-uniform policy cannot tell sampling from uniform actions: the fake-env runs start peaked."""
    probs = batch["probs"]
    actions = actions.reshape(-1)
    for action in range(probs.shape[1]):
        taken = (actions == action).sum()
        expected = probs[:, action].sum()
        assert abs(taken - expected) <= 5 * math.sqrt((probs[:, action] * (1 - probs[:, action])).sum()) + 1, action
    log_probs = np.log(probs)
    chosen = log_probs[np.arange(len(actions)), actions]
    mean = (probs * log_probs).sum(-1)
    variance = (probs * log_probs**2).sum(-1) - mean**2
    assert abs(chosen.sum() - mean.sum()) <= 5 * math.sqrt(variance.sum()) + 1e-6


def textbook_normalized_rewards(rewards, dones, gamma, prior, clip=10.0):
    """Return normalisation (Table 3) as gym's NormalizeReward defines it: each env's discounted return G ← γ G + r,
    the reward divided by √(Var + 1e-8) of every G so far pooled with the prior (count, mean, var), clipped to ±10;
    G restarts after an episode end. rewards, dones: (T, N)."""
    count, mean, var = prior
    pooled_values = []
    running = np.zeros(rewards.shape[1])
    out = np.zeros_like(rewards)
    for t in range(len(rewards)):
        running = gamma * running + rewards[t]
        pooled_values.extend(running.tolist())
        values = np.array(pooled_values)
        total = count + len(values)
        pooled_mean = (count * mean + values.sum()) / total
        pooled_var = (count * (var + (mean - pooled_mean) ** 2) + ((values - pooled_mean) ** 2).sum()) / total
        out[t] = np.clip(rewards[t] / np.sqrt(pooled_var + 1e-8), -clip, clip)
        running[dones[t]] = 0.0
    return out


def check_run(namespace, recorder, settings):
    """Clauses 1-4 on every update of a recorded run. Returns (the textbook batches, the pre-clip gradient norms, the
    lengths of the finished episodes)."""
    agent = namespace["agent"]
    updates = split_updates(recorder)
    assert len(updates) == settings["num_updates"]
    batches = []
    norms = []
    levels = recorder.first_levels()
    for k, update in enumerate(updates):
        assert len(update.steps) == settings["num_steps"]
        next_params = updates[k + 1].adam_events()[0]["params"] if k + 1 < len(updates) else snapshot_params(agent)
        batch, update_norms = check_update(agent, update, settings, next_params)
        batches.append(batch)
        norms += update_norms
        check_acting(batch, np.stack([step["actions"] for step in update.steps]))
        levels = check_sampler_calls(update, settings["num_envs"], levels)
        check_phase_order(update, settings["plr_commit"])
    commits, lengths = textbook_commits(batches, settings["plr_commit"])
    for update, (want_during, want_after) in zip(updates, commits):
        got_during, got_after = recorded_commits(update)
        assert_commits_equal(got_during, want_during)
        assert_commits_equal(got_after, want_after)
    return batches, norms, lengths


def check_initial_levels(recorder, num_envs):
    """A fresh run starts env i on the level of the sampler's i-th draw."""
    draws = []
    for kind, data in recorder.events:
        if kind == "sample":
            draws.append((data["actor"], data["level"]))
        if kind == "reset":
            break
    assert [actor for actor, _ in draws] == list(range(num_envs))
    np.testing.assert_array_equal(recorder.first_levels(), [level for _, level in draws])


def check_normalized_rewards(updates, settings, prior=(1e-4, 0.0, 1.0)):
    """Clause 2's rewards: what the update sees is the textbook normalisation of the env's rewards over the whole run
    (from `prior`: (count, mean, var), and every running return at 0)."""
    rewards = np.concatenate([np.stack([step["reward"] for step in update.steps]) for update in updates])
    dones = np.concatenate([np.stack([step["terminated"] | step["truncated"] for step in update.steps]) for update in updates])
    got = np.concatenate([np.stack(update.normalized) for update in updates])
    want = textbook_normalized_rewards(rewards, dones, settings["gamma"], prior)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def assert_same_state(got, want, where=""):
    """Equal nested checkpoint states: tensors and arrays element for element, everything else by ==."""
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            assert_same_state(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for k, (a, b) in enumerate(zip(got, want)):
            assert_same_state(a, b, f"{where}[{k}]")
    elif torch.is_tensor(want):
        assert torch.equal(got, want), where
    elif isinstance(want, np.ndarray):
        np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert got == want, where


def periodic_evaluations(run):
    """The update numbers after which the run evaluated during training, and the final evaluation (or None)."""
    update = run.namespace["ckpt"]["update"] if run.namespace["ckpt"] else 0
    periodic = []
    final = None
    training = True
    for kind, data in run.recorder.events:
        if kind == "after_update":
            update += 1
        elif kind == "close" and data["train"]:
            training = False
        elif kind == "evaluate" and training:
            periodic.append((update, data))
        elif kind == "evaluate":
            final = data
    return periodic, final


# ----------------------------------------------------------------------------------------------------------------
# A real tiny MiniGrid run, checkpointed, and its resumption with every applied flag changed (shared by the tests)
# every flag of APPLIED_ON_RESUME: (its value in the first run, its value on --resume). The first values make every
# piece of the update act (the ratio and value clips, the gradient clip); the resumed run changes them all: three updates
# of 4 x 32 steps after the checkpoint's step 384 (818 is not a multiple of the new batch: the run ends at its last
# whole batch, 768)
APPLIED_VALUES = dict(
    total_timesteps=(384, 818),
    num_steps=(48, 32),
    num_minibatches=(2, 4),
    update_epochs=(2, 1),
    learning_rate=(0.01, 0.003),
    adam_eps=(1e-5, 1e-7),
    gamma=(0.99, 0.9),
    gae_lambda=(0.95, 0.8),
    clip_coef=(0.02, 0.005),
    clip_vloss=(True, False),
    ent_coef=(0.01, 0.1),
    vf_coef=(0.5, 0.25),
    max_grad_norm=(0.1, 0.02),
    norm_adv=(True, False),
    eval_every=(0, 1),
    eval_episodes=(10, 3),
    final_eval_episodes=(0, 1),
    num_eval_envs=(8, 2),
    plr_temperature=(0.1, 0.5),
    plr_staleness_coef=(0.3, 0.7),
    plr_replay_prob=(0.95, 0.3),
    plr_min_fill=(0.0, 0.2),
    plr_score_alpha=(1.0, 0.5),
)
# the first run: the flags a resume cannot change, then the first values
FIRST = dict(env_id="MultiRoom-N4-Random", num_envs=4, num_train_levels=20)
FIRST |= {flag: first for flag, (first, _) in APPLIED_VALUES.items()}
# the resumed run's flags
RESUMED = {flag: resumed for flag, (_, resumed) in APPLIED_VALUES.items()}
RUN_FLAGS = ["--num-workers", "1", "--no-progress", "--no-cuda", "--save-model", "--checkpoint-every", "384"]


def cli_flags(values):
    out = []
    for name, value in values.items():
        if isinstance(value, bool):
            out.append(f"--{'' if value else 'no-'}{name.replace('_', '-')}")
        else:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def settings_of(values, **extra):
    """The settings the textbook checks use (the test's own values, never read from the run)."""
    settings = dict(values, bootstrap_truncation=False, norm_reward=True, plr_commit="episode") | extra
    settings["num_updates"] = extra.get("num_updates", 2)
    return settings


_SHARED_RUNS = {}


def shared_minigrid_runs(tmp_path_factory):
    """(the first run, the checkpoint it wrote, the resumed run, the run folder, the resumed run's output); both runs
    recorded. Run once per session: the test files' `minigrid_runs` fixtures all return these."""
    if "runs" in _SHARED_RUNS:
        return _SHARED_RUNS["runs"]
    folder = tmp_path_factory.mktemp("plr_loop")
    output = io.StringIO()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(folder)
        # a MiniGrid run needs no procgen: importing it fails during these runs
        monkeypatch.setitem(sys.modules, "procgen", None)
        first = RecordedRun(*record_run(cli_flags(FIRST) + RUN_FLAGS))
        (run_dir,) = (folder / "runs").iterdir()
        checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
        with contextlib.redirect_stdout(output):
            resumed = RecordedRun(*record_run(["--resume", str(run_dir / "checkpoint.pt"), *cli_flags(RESUMED)]))
    _SHARED_RUNS["runs"] = (first, checkpoint, resumed, run_dir, output.getvalue())
    return _SHARED_RUNS["runs"]


# ----------------------------------------------------------------------------------------------------------------
# A deterministic fake env: truncations that bootstrap, episodes across rollouts, a resume bit for bit
class FakeLevelEnv:
    """A deterministic stand-in for MiniGridVecEnv (same interface): 7x7x3 observations that encode (level, t), an
    episode length set by the level (`LENGTHS[level % len(LENGTHS)]`), reward 0.5, or 1.5 when the action is
    (level + t) % 7;
    an episode on an even level terminates, one on an odd level is truncated (a time limit)."""

    LENGTHS = (4,)

    def __init__(self, env_id, num_envs, *, num_workers=None, fully_observable=True, seed=0, start_method="spawn"):
        import gymnasium as gym

        self.num_envs = num_envs
        # as one MiniGrid worker: the learner updates on the other cores (one thread on 2 cores)
        self.num_workers = 1
        self.single_observation_space = gym.spaces.Box(0, 255, (7, 7, 3), np.uint8)
        self.single_action_space = gym.spaces.Discrete(7)
        self.levels = np.zeros(num_envs, np.int64)
        self.t = np.zeros(num_envs, np.int64)
        self.episode_return = np.zeros(num_envs)

    def _obs(self):
        cells = np.arange(7 * 7 * 3)
        codes = (self.levels[:, None] * 31 + self.t[:, None] * 7 + cells) % 11
        return codes.astype(np.uint8).reshape(self.num_envs, 7, 7, 3)

    def reset(self, levels):
        self.levels = np.array(levels, np.int64)
        self.t[:] = 0
        self.episode_return[:] = 0.0
        return self._obs()

    def step(self, actions, next_level=None):
        reward = 0.5 + (np.asarray(actions) == (self.levels + self.t) % 7).astype(np.float32)
        self.t += 1
        self.episode_return += reward
        lengths = np.array([self.LENGTHS[level % len(self.LENGTHS)] for level in self.levels])
        done = self.t >= lengths
        terminated = done & (self.levels % 2 == 0)
        truncated = done & ~terminated
        info = {
            "level_seed": self.levels.copy(),
            "_episode": done.copy(),
            "episode_return": np.where(done, self.episode_return, 0.0),
            "episode_length": np.where(done, self.t, 0),
            "final_obs": self._obs(),
        }
        for i in np.flatnonzero(done):
            self.levels[i] = next_level(int(i))
            self.t[i] = 0
            self.episode_return[i] = 0.0
        info["next_level_seed"] = self.levels.copy()
        return self._obs(), reward, terminated, truncated, info

    def close(self):
        pass


class UnalignedLevelEnv(FakeLevelEnv):
    """Episodes of 3 or 9 steps: they run across the 8-step rollouts, and a 9-step first episode ends on the second
    rollout's first step."""

    LENGTHS = (3, 9)


# the fake-env runs: FIRST's PPO and PLR settings with 3 envs x 8 steps, γ 0.9, looser clips (ratio 0.05, gradient
# norm 0.5), truncations that bootstrap and an evaluation after every update (each run sets its --total-timesteps)
FAKE = FIRST | dict(
    num_envs=3,
    num_steps=8,
    gamma=0.9,
    clip_coef=0.05,
    max_grad_norm=0.5,
    bootstrap_truncation=True,
    eval_every=1,
    eval_episodes=3,
    num_eval_envs=2,
    final_eval_episodes=2,
)
FAKE_RUN_FLAGS = ["--no-progress", "--no-cuda", "--checkpoint-every", "48"]


real_make_agent = plr_ppo.make_agent


def make_peaked_agent(args, obs_shape, num_actions):
    """plr_ppo.make_agent's network with its policy head biased to a peaked initial policy (π from 0.49 down to 0.01
    over the 7 actions), so that clause 1's statistics can tell sampling from other ways of acting."""
    agent = real_make_agent(args, obs_shape, num_actions)
    with torch.no_grad():
        agent.actor[-1].bias.copy_(torch.linspace(3.0, -1.0, num_actions))
    return agent


def record_fake_run(env_class, folder, argv, stop_after_checkpoint=False):
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(plr_ppo, "MiniGridVecEnv", env_class)
        monkeypatch.setattr(plr_ppo, "make_agent", make_peaked_agent)
        monkeypatch.chdir(folder)
        return RecordedRun(*record_run(argv, env_class, stop_after_checkpoint))


def fake_argv(**changes):
    values = FAKE | changes
    argv = cli_flags({name: value for name, value in values.items() if name != "bootstrap_truncation"})
    return argv + ["--bootstrap-truncation", str(values["bootstrap_truncation"])] + FAKE_RUN_FLAGS
