"""plr_ppo.py's training loop as a contract (issue 50), each clause checked on the real `__main__` run in this process
(its code executed in the module's namespace, so that spies on the module's functions and classes see every call),
against textbook versions written here from the papers:

1. Acting: each action is a sample of π_θ(·|s_t) with the parameters θ of the rollout's start, not its argmax.
2. The rollout the update sees: the env's transitions; rewards divided by the running std of the discounted return
   (γ; its statistics restored on --resume, each env's running return restarted with its episode); a timeout
   terminates (MiniGrid) or bootstraps from V(final obs) (--bootstrap-truncation).
3. One PPO update: --update-epochs passes, each over a fresh permutation of the batch in --num-minibatches
   minibatches; each step's gradient is that of the clipped surrogate (the ratio against the rollout's log-probs,
   with its gradient), the clipped value loss and the entropy bonus, with GAE advantages (γ, λ) normalised over the
   whole batch, clipped to --max-grad-norm after backward; then one Adam step (lr, eps) from the previous moments.
4. What the sampler is told, and when: each new episode starts on the level `sample` returned for its env;
   `update_with_rollouts` once per update, before the PPO update, with the behaviour policy's scores: every finished
   episode committed once, on the level it was played, with the mean |GAE| over its own steps stitched across
   rollouts (--plr-commit episode); with --plr-commit update also every unfinished one, by `after_update`, once per
   update after the PPO update.
5. Evaluation: the current network; actions sampled from its policy; each env's first episodes, as many as its share
   (`episodes_per_env`), whatever their lengths; a stop signal ends it (tests/test_plr_ppo.py).
6. Resume: at its first update, counters, optimizer state, normaliser statistics, every RNG and the sampler equal the
   checkpoint's (the partial scores and running returns of the restarted episodes dropped) and every flag of
   APPLIED_ON_RESUME has its new value in effect; a run interrupted where every env starts a new episode and resumed
   equals the uninterrupted run bit for bit.
7. Start-up: a rollout too large for memory is one `error:` line before the run folder; the labelling of the training
   levels' difficulties stops at a stop signal.
"""

import ast
import contextlib
import copy
import io
import json
import math
import random
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from test_plr_ppo import textbook_gae
from torch.optim.optimizer import register_optimizer_step_pre_hook

import plr_ppo
from common import processes
from common.args import flag as flag_name
from common.minigrid_env import MiniGridVecEnv

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "plr_ppo.py"


# ---------------------------------------------------------------------------------------------------------------
# The real __main__ in this process, with spies
# ---------------------------------------------------------------------------------------------------------------
def main_code():
    """The body of plr_ppo.py's `if __name__ == "__main__":` block, compiled with the file's line numbers."""
    tree = ast.parse(SCRIPT.read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"]
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


# ---------------------------------------------------------------------------------------------------------------
# Textbook versions (the papers' forms)
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# A real tiny MiniGrid run, checkpointed, and its resumption with every applied flag changed (shared by the tests)
# ---------------------------------------------------------------------------------------------------------------
# the first run: settings that make every piece of the update act (the ratio and value clips, the gradient clip)
FIRST = dict(
    env_id="MultiRoom-N4-Random",
    num_envs=4,
    num_steps=48,
    num_minibatches=2,
    update_epochs=2,
    total_timesteps=384,
    num_train_levels=20,
    learning_rate=0.01,
    adam_eps=1e-5,
    gamma=0.99,
    gae_lambda=0.95,
    clip_coef=0.02,
    clip_vloss=True,
    ent_coef=0.01,
    vf_coef=0.5,
    max_grad_norm=0.1,
    norm_adv=True,
    eval_every=0,
    eval_episodes=10,
    final_eval_episodes=0,
    num_eval_envs=8,
    plr_temperature=0.1,
    plr_staleness_coef=0.3,
    plr_replay_prob=0.95,
    plr_min_fill=0.0,
    plr_score_alpha=1.0,
)
# every flag of APPLIED_ON_RESUME changed on --resume: three updates of 4 x 32 steps after the checkpoint's step 384
# (818 is not a multiple of the new batch: the run ends at its last whole batch, 768)
RESUMED = dict(
    total_timesteps=818,
    num_steps=32,
    num_minibatches=4,
    update_epochs=1,
    learning_rate=0.003,
    adam_eps=1e-7,
    gamma=0.9,
    gae_lambda=0.8,
    clip_coef=0.005,
    clip_vloss=False,
    ent_coef=0.1,
    vf_coef=0.25,
    max_grad_norm=0.02,
    norm_adv=False,
    eval_every=1,
    eval_episodes=3,
    final_eval_episodes=1,
    num_eval_envs=2,
    plr_temperature=0.5,
    plr_staleness_coef=0.7,
    plr_replay_prob=0.3,
    plr_min_fill=0.2,
    plr_score_alpha=0.5,
)
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


class RecordedRun:
    def __init__(self, namespace, recorder):
        self.namespace = namespace
        self.recorder = recorder
        self.updates = split_updates(recorder)


@pytest.fixture(scope="module")
def minigrid_runs(tmp_path_factory):
    """(the first run, the checkpoint it wrote, the resumed run, the run folder, the resumed run's output); both runs
    recorded."""
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
    return first, checkpoint, resumed, run_dir, output.getvalue()


def test_first_run_acts_updates_and_tells_the_sampler_as_the_textbook(minigrid_runs):
    """Clauses 1-4 on a real MiniGrid run (a timeout terminates, --plr-commit episode): the actions are samples of
    π_θold, each minibatch step's gradient and Adam step are the textbook's, the sampler's levels, calls and commits
    are Algorithm 4's with the behaviour policy's |GAE|, and the rewards are the textbook normalisation."""
    first, _, _, _, _ = minigrid_runs
    settings = settings_of(FIRST)
    check_initial_levels(first.recorder, FIRST["num_envs"])
    _, norms, lengths = check_run(first.namespace, first.recorder, settings)
    check_normalized_rewards(first.updates, settings)
    # the gradient clip acted; episodes finished, stitched across the two rollouts, and others are unfinished
    assert max(norms) > FIRST["max_grad_norm"]
    assert len(lengths) >= FIRST["num_envs"] and max(lengths) > FIRST["num_steps"]
    assert (first.namespace["sampler"].partial_steps > 0).any()


def test_resumed_run_acts_and_updates_with_the_new_flags(minigrid_runs):
    """Clauses 1-4 on the resumed run with every applied flag changed: the textbook with the new values holds, the
    restarted episodes are scored on their own steps only, and the rewards are normalised from the checkpoint's
    statistics with the new γ, every running return at 0."""
    _, checkpoint, resumed, _, _ = minigrid_runs
    settings = settings_of(FIRST | RESUMED, num_updates=3)
    _, norms, lengths = check_run(resumed.namespace, resumed.recorder, settings)
    normalizer = checkpoint["normalizer"]
    check_normalized_rewards(resumed.updates, settings, prior=(normalizer["count"], normalizer["mean"], normalizer["var"]))
    assert max(norms) > RESUMED["max_grad_norm"]
    assert len(lengths) >= FIRST["num_envs"]
    np.testing.assert_array_equal(resumed.recorder.first_levels(), checkpoint["env_levels"])


def test_the_runs_write_their_files_in_one_folder(minigrid_runs):
    """Both MiniGrid runs ran without procgen (it could not be imported); the first saved its model and logged Fig.
    4's replay mass by rooms once levels were scored; the resumed run said where it resumed and that its budget ends
    at the last whole batch, wrote into the same folder up to its end, every step logged once, and completed with
    its final evaluation."""
    first, _, resumed, run_dir, output = minigrid_runs
    assert (run_dir / "plr_ppo.model").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(name.startswith("plr/mass_rooms=") for row in rows for name in row)
    assert "resumed " in output and "at step 384" in output and "runs to step 768" in output
    assert "--total-timesteps 818 is not a multiple of one PPO batch (128 steps): the run ends at step 768" in output
    assert [row["global_step"] for row in rows if "losses/value_loss" in row] == [192, 384, 512, 640, 768]
    assert resumed.namespace["global_step"] == 768 and resumed.namespace["update"] == 5
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stop_reason"] == "completed" and summary["global_step"] == 768 and "final_test_success" in summary


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


def test_resume_restores_the_checkpoint_one_by_one(minigrid_runs):
    """Clause 6 as a property: the checkpoint holds the first run's state when it was written (its end), and the
    resumed process, at its first update (the reset of its envs on the checkpoint's levels), holds it again: step and
    update counters, network,
    Adam's moments and settings (lr and eps: the new flags), the normaliser's statistics, the sampler's state and
    RNG, the evaluation RNG and every global RNG; at its first step the restarted episodes' partial scores S~ and
    running returns are 0."""
    first, checkpoint, resumed, _, _ = minigrid_runs
    end_of_first = first.recorder.checkpoint_states[-1]
    state = resumed.recorder.resume_states[0]
    for name in ("global_step", "update", "model", "optimizer", "sampler", "normalizer", "eval_rng"):
        assert_same_state(checkpoint[name], end_of_first[name], f"checkpoint {name}")
    assert_same_state(checkpoint["rng"]["python"], end_of_first["rng"]["python"])
    assert_same_state(checkpoint["rng"]["numpy"], end_of_first["rng"]["numpy"])
    assert_same_state(checkpoint["rng"]["torch"], end_of_first["rng"]["torch"])
    assert state["global_step"] == checkpoint["global_step"] == 384
    assert state["update"] == checkpoint["update"] == 2
    assert_same_state(state["model"], checkpoint["model"], "model")
    assert_same_state(state["optimizer"]["state"], checkpoint["optimizer"]["state"], "Adam moments")
    (group,) = state["optimizer"]["param_groups"]
    (saved_group,) = checkpoint["optimizer"]["param_groups"]
    assert group["lr"] == RESUMED["learning_rate"] and group["eps"] == RESUMED["adam_eps"]
    for name in set(saved_group) - {"lr", "eps"}:
        assert_same_state(group[name], saved_group[name], f"Adam {name}")
    assert_same_state(state["normalizer"], checkpoint["normalizer"], "normalizer")
    assert_same_state(state["sampler"], checkpoint["sampler"], "sampler")
    assert_same_state(state["eval_rng"], checkpoint["eval_rng"], "eval_rng")
    for name in ("python", "numpy", "torch"):
        assert_same_state(state["rng"][name], checkpoint["rng"][name], f"rng {name}")
    # the checkpoint's episodes were unfinished, so their restart drops their S~ (MultiRoom's rewards are 0 until a
    # goal is reached: the running returns' restart is checked on the fake env's resumed run)
    assert (checkpoint["sampler"]["partial_steps"] > 0).all()
    restarted = resumed.recorder.first_step_states[0]
    assert (restarted["partial_steps"] == 0).all() and (restarted["partial_score"] == 0).all()
    assert (restarted["normalizer_ret"] == 0).all()


def update_follows_textbook(run, settings):
    """Whether every recorded update of `run` is the textbook PPO update with `settings` (clause 3)."""
    agent = run.namespace["agent"]
    for k, update in enumerate(run.updates):
        next_params = run.updates[k + 1].adam_events()[0]["params"] if k + 1 < len(run.updates) else None
        next_params = next_params or snapshot_params(agent)
        try:
            check_update(agent, update, settings, next_params)
        except AssertionError:
            return False
    return True


def normalizer_follows_textbook(run, checkpoint, settings):
    normalizer = checkpoint["normalizer"]
    try:
        check_normalized_rewards(run.updates, settings, prior=(normalizer["count"], normalizer["mean"], normalizer["var"]))
    except AssertionError:
        return False
    return True


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


def probe_table(checkpoint):
    """For each flag of APPLIED_ON_RESUME: whether the resumed run's behaviour shows a given value in effect."""
    settings = settings_of(FIRST | RESUMED, num_updates=3)

    def with_value(flag):
        return lambda run, value: update_follows_textbook(run, settings | {flag: value})

    def sampler_config(field):
        return lambda run, value: getattr(run.namespace["sampler"].config, field) == value

    def epochs(run):
        return [sum(kind == "randperm" for kind, _ in update.events) for update in run.updates]

    def minibatches(run):
        return [sum(kind == "adam" for kind, _ in update.events) // epochs(run)[0] for update in run.updates]

    def eval_updates(run):
        return [update for update, _ in periodic_evaluations(run)[0]]

    first_update = checkpoint["update"] + 1
    updates_after_resume = range(first_update, first_update + 3)
    return {
        "total_timesteps": lambda run, value: run.namespace["end_step"] == 384 + (value - 384) // 128 * 128,
        "num_steps": lambda run, value: all(len(update.steps) == value for update in run.updates),
        "num_minibatches": lambda run, value: set(minibatches(run)) == {value},
        "update_epochs": lambda run, value: set(epochs(run)) == {value},
        "learning_rate": with_value("learning_rate"),
        "adam_eps": with_value("adam_eps"),
        "gamma": lambda run, value: (
            update_follows_textbook(run, settings | {"gamma": value})
            and normalizer_follows_textbook(run, checkpoint, settings | {"gamma": value})
        ),
        "gae_lambda": with_value("gae_lambda"),
        "clip_coef": with_value("clip_coef"),
        "clip_vloss": with_value("clip_vloss"),
        "ent_coef": with_value("ent_coef"),
        "vf_coef": with_value("vf_coef"),
        "max_grad_norm": with_value("max_grad_norm"),
        "norm_adv": with_value("norm_adv"),
        "eval_every": lambda run, value: eval_updates(run) == [u for u in updates_after_resume if value and u % value == 0],
        "eval_episodes": lambda run, value: {data["num_episodes"] for _, data in periodic_evaluations(run)[0]} == {value},
        "final_eval_episodes": lambda run, value: periodic_evaluations(run)[1]["num_episodes"] == value,
        "num_eval_envs": lambda run, value: (
            {data["num_envs"] for _, data in periodic_evaluations(run)[0]} | {periodic_evaluations(run)[1]["num_envs"]}
            == {value}
        ),
        "plr_temperature": sampler_config("temperature"),
        "plr_staleness_coef": sampler_config("staleness_coef"),
        "plr_replay_prob": sampler_config("replay_prob"),
        "plr_min_fill": sampler_config("min_fill"),
        "plr_score_alpha": sampler_config("score_alpha"),
    }


def test_every_applied_flag_takes_effect_on_resume(minigrid_runs):
    """Clause 6's flags: the resumed run changed every flag of APPLIED_ON_RESUME, and for each the behaviour read back
    from the run (the textbook update and normalisation with that value, the optimizer's steps, the rollout and
    minibatch sizes, the evaluations, the sampler's settings) shows the new value, not the checkpoint's. The probe
    table covers the class exactly, so a flag added to it without a probe fails here."""
    _, checkpoint, resumed, _, _ = minigrid_runs
    probes = probe_table(checkpoint)
    assert set(probes) == set(plr_ppo.APPLIED_ON_RESUME) == set(RESUMED)
    for flag, holds in probes.items():
        assert FIRST[flag] != RESUMED[flag], flag
        assert checkpoint["args"][flag] == FIRST[flag], flag
        assert holds(resumed, RESUMED[flag]), f"{flag_name(flag)} {RESUMED[flag]} is not in effect"
        assert not holds(resumed, FIRST[flag]), f"{flag_name(flag)}: the checkpoint's {FIRST[flag]} is still in effect"


def test_evaluation_in_the_loop_plays_the_current_network(minigrid_runs):
    """Clause 5 in the loop: each evaluation gets the run's network with the parameters of the last update, and the
    final evaluation those of the run's end."""
    _, _, resumed, _, _ = minigrid_runs
    periodic, final = periodic_evaluations(resumed)
    assert len(periodic) == 3 and final is not None
    for (_, data), update in zip(periodic, resumed.updates[1:]):
        assert data["agent"] is resumed.namespace["agent"]
        assert_same_state(data["params"], update.adam_events()[0]["params"])
    assert_same_state(final["params"], snapshot_params(resumed.namespace["agent"]))


# ---------------------------------------------------------------------------------------------------------------
# The loop on a deterministic fake env: truncations that bootstrap, --plr-commit update, and a resume bit for bit
# ---------------------------------------------------------------------------------------------------------------
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


FAKE = dict(
    env_id="MultiRoom-N4-Random",
    num_envs=3,
    num_steps=8,
    num_minibatches=2,
    update_epochs=2,
    num_train_levels=20,
    learning_rate=0.01,
    adam_eps=1e-5,
    gamma=0.9,
    gae_lambda=0.95,
    clip_coef=0.05,
    clip_vloss=True,
    ent_coef=0.01,
    vf_coef=0.5,
    max_grad_norm=0.5,
    norm_adv=True,
    bootstrap_truncation=True,
    eval_every=1,
    eval_episodes=3,
    num_eval_envs=2,
    final_eval_episodes=2,
    plr_temperature=0.1,
    plr_staleness_coef=0.3,
    plr_replay_prob=0.95,
    plr_min_fill=0.0,
    plr_score_alpha=1.0,
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


def test_truncation_bootstrap_and_commit_after_update_on_a_resumed_run(tmp_path):
    """Clauses 1-4 with --bootstrap-truncation (a truncated episode bootstraps from V(final obs)) and --plr-commit
    update (`after_update` commits each unfinished episode after the PPO update), on episodes that run across
    rollouts; and clause 6's running returns: the resumed run normalises from the checkpoint's statistics, with the
    new --gamma and every env's running return restarted at 0 (the checkpoint's were not 0)."""
    first = record_fake_run(UnalignedLevelEnv, tmp_path, fake_argv(total_timesteps=48, plr_commit="update"))
    settings = settings_of(FAKE, bootstrap_truncation=True, plr_commit="update", num_updates=2)
    check_initial_levels(first.recorder, FAKE["num_envs"])
    check_run(first.namespace, first.recorder, settings)
    check_normalized_rewards(first.updates, settings)
    assert any(step["truncated"].any() for update in first.updates for step in update.steps)
    assert all(recorded_commits(update)[1] for update in first.updates)
    (run_dir,) = (tmp_path / "runs").iterdir()
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert (checkpoint["normalizer"]["ret"] != 0).any()
    # --gamma changed on resume: the normaliser's discount too (MultiRoom's zero rewards cannot show it)
    resume_argv = ["--resume", str(run_dir / "checkpoint.pt"), "--total-timesteps", "96", "--gamma", "0.8"]
    resumed = record_fake_run(UnalignedLevelEnv, tmp_path, resume_argv)
    settings["gamma"] = 0.8
    check_run(resumed.namespace, resumed.recorder, settings)
    normalizer = checkpoint["normalizer"]
    check_normalized_rewards(resumed.updates, settings, prior=(normalizer["count"], normalizer["mean"], normalizer["var"]))
    assert (resumed.recorder.first_step_states[0]["normalizer_ret"] == 0).all()
    # an episode ended on a rollout's first step (its one-step segment must be scored on its own level)
    assert any(t == 0 for run in (first, resumed) for update in run.updates for t, _, _ in update.samples)


METRICS_OF_TIME = {"time", "charts/SPS", "charts/collect_seconds", "charts/plr_seconds"}


def test_interrupted_and_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path):
    """Clause 6 in full: episodes of 4 steps in rollouts of 8, so that at the checkpoint every env starts a new episode
    and nothing is lost by the restart (env states are not saved; in general the episodes running at a checkpoint
    restart from their first frame, with their partial scores S~ and running returns dropped). A run of 4 updates,
    and one stopped by a SIGTERM after its checkpoint at 2 updates and resumed in a new process state, play the same
    actions and end with the same network, Adam state, sampler, normaliser, evaluation RNG, global RNGs, metrics
    (all but the clock's) and summary, bit for bit. The uninterrupted run also passes clauses 1-4 with truncations
    that bootstrap."""
    whole_dir = tmp_path / "whole"
    parts_dir = tmp_path / "parts"
    whole_dir.mkdir()
    parts_dir.mkdir()
    whole = record_fake_run(FakeLevelEnv, whole_dir, fake_argv(total_timesteps=96))
    check_run(whole.namespace, whole.recorder, settings_of(FAKE, bootstrap_truncation=True, num_updates=4))
    whole_state = whole.recorder.run_state()
    with pytest.raises(SystemExit) as stopped:
        record_fake_run(FakeLevelEnv, parts_dir, fake_argv(total_timesteps=96), stop_after_checkpoint=True)
    assert stopped.value.code == 143
    (run_dir,) = (parts_dir / "runs").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["stop_reason"] == "interrupted by SIGTERM"
    # the process state the resumed run starts from is not the first run's
    torch.manual_seed(12345)
    np.random.seed(12345)
    random.seed(12345)
    resumed = record_fake_run(FakeLevelEnv, parts_dir, ["--resume", str(run_dir / "checkpoint.pt")])
    resumed_state = resumed.recorder.run_state()
    for name in ("global_step", "update", "model", "optimizer", "sampler", "normalizer", "eval_rng"):
        assert_same_state(resumed_state[name], whole_state[name], name)
    for name in ("python", "numpy", "torch"):
        assert_same_state(resumed_state["rng"][name], whole_state["rng"][name], f"rng {name}")
    whole_actions = [step["actions"] for update in whole.updates for step in update.steps]
    resumed_actions = [step["actions"] for update in resumed.updates for step in update.steps]
    assert_same_state(resumed_actions, whole_actions[-len(resumed_actions) :], "actions")
    (whole_run,) = (whole_dir / "runs").iterdir()
    rows = [read_rows(run / "metrics.jsonl") for run in (whole_run, run_dir)]
    assert rows[0] == rows[1] and len(rows[0]) == 4 + 1
    summaries = [json.loads((run / "summary.json").read_text()) for run in (whole_run, run_dir)]
    for summary in summaries:
        del summary["wall_time_s"]
        del summary["run_name"]
    assert summaries[0] == summaries[1]


def read_rows(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{name: value for name, value in row.items() if name not in METRICS_OF_TIME} for row in rows]


# ---------------------------------------------------------------------------------------------------------------
# Clause 5: evaluation (with fake envs; the held-out levels and the stop signal: tests/test_plr_ppo.py)
# ---------------------------------------------------------------------------------------------------------------
class LevelOutcomeEnv:
    """The vector-env interface `evaluate` uses, with episodes whose length and return depend only on their level
    (`outcome(levels) -> (lengths, returns)`); `actions` holds every action it was given."""

    def __init__(self, num_envs, outcome):
        self.num_envs = num_envs
        self.outcome = outcome
        self.actions = []

    def reset(self, levels):
        self.levels = np.array(levels)
        self.t = np.zeros(self.num_envs, int)
        self.episodes = [[] for _ in range(self.num_envs)]
        return np.zeros((self.num_envs, 1))

    def step(self, actions, next_level):
        self.actions.append(np.array(actions))
        self.t += 1
        lengths, returns = self.outcome(self.levels)
        done = self.t >= lengths
        info = {"_episode": done, "episode_return": np.where(done, returns, 0.0)}
        for i in np.flatnonzero(done):
            self.episodes[i].append(int(self.levels[i]))
            self.levels[i] = next_level(i)
            self.t[i] = 0
        return np.zeros((self.num_envs, 1)), np.zeros(self.num_envs), done, done, info


def uniform_policy(obs):
    return torch.zeros(len(obs), 7), torch.zeros(len(obs))


def uniform_level_sets(rng):
    return {kind: (lambda: int(rng.integers(1000))) for kind in ("train", "test")}


def solved_in_5_or_timeout_at_20(levels):
    """The issue's first setup, in a quarter of the steps (the same order of episode ends): 1 level in 5 is solved
    with return 0.9, the others time out with 0 (true mean return 0.18, success 0.2)."""
    solved = levels % 5 == 0
    return np.where(solved, 5, 20), np.where(solved, 0.9, 0.0)


def win_in_1_or_lose_in_20(levels):
    """The issue's second setup: half the levels are won in 1 step (return 1), half lost in 20 (true mean 0.5)."""
    win = levels % 2 == 0
    return np.where(win, 1, 20), np.where(win, 1.0, 0.0)


@pytest.mark.parametrize(
    "outcome,true_return,true_success",
    [(solved_in_5_or_timeout_at_20, 0.18, 0.2), (win_in_1_or_lose_in_20, 0.5, 0.5)],
)
def test_evaluation_is_unbiased_when_short_episodes_are_better(outcome, true_return, true_success):
    """Clause 5: with 10 episodes on 8 envs (the defaults: not a whole number per env), where short episodes have the
    higher return, the mean over 200 evaluations is the true mean within 4 standard errors (counting the first 10
    episodes to finish measured 0.25 and 0.59 here)."""
    args = plr_ppo.Args(env_id="MultiRoom-N4-Random")
    rng = np.random.default_rng(0)
    returns = []
    successes = []
    for _ in range(100):
        metrics = plr_ppo.evaluate(uniform_policy, LevelOutcomeEnv(8, outcome), uniform_level_sets(rng), 10, args, "cpu")
        returns += [metrics["eval/train_return"], metrics["eval/test_return"]]
        successes += [metrics["eval/train_success"], metrics["eval/test_success"]]
    for values, truth in ((returns, true_return), (successes, true_success)):
        standard_error = np.std(values, ddof=1) / np.sqrt(len(values))
        assert abs(np.mean(values) - truth) <= 4 * standard_error, (np.mean(values), truth, standard_error)


def test_evaluation_counts_each_envs_first_episodes_in_a_fixed_order():
    """Clause 5 exactly: 10 episodes on 4 envs whose episode lengths differ (env i's episodes last i + 1 steps): the
    episodes counted are envs 0-1's first 3 and envs 2-3's first 2 (`episodes_per_env`), none of the later ones that
    the fast envs finish while the slow ones play."""
    assert plr_ppo.episodes_per_env(10, 4) == [3, 3, 2, 2]
    assert plr_ppo.episodes_per_env(3, 8) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert plr_ppo.episodes_per_env(16, 8) == [2] * 8
    args = plr_ppo.Args(env_id="MultiRoom-N4-Random")
    # env i's episodes last i + 1 steps; an episode's return is its level, a number drawn once
    envs = LevelOutcomeEnv(4, lambda levels: (np.arange(1, 5), levels.astype(float)))
    counter = iter(range(1, 10**6))
    metrics = plr_ppo.evaluate(uniform_policy, envs, {"train": counter.__next__, "test": counter.__next__}, 10, args, "cpu")
    counted = [level for episodes, share in zip(envs.episodes, [3, 3, 2, 2]) for level in episodes[:share]]
    assert len(envs.episodes[0]) > 3  # the fast env went on playing, uncounted
    assert metrics["eval/test_return"] == pytest.approx(np.mean(counted))
    assert metrics["eval/test_return_se"] == pytest.approx(np.std(counted, ddof=1) / np.sqrt(10))


def test_evaluation_samples_the_policy():
    """Clause 5's policy: evaluation's actions on a fixed observation are distributed as softmax(logits) (Pearson
    chi-square, p > 1e-4), not the argmax. Its samples come from a seeded torch stream (forked: the tests after it
    see the global RNG as it was), so the outcome does not depend on which tests ran before."""
    probs = np.array([0.05, 0.1, 0.15, 0.2, 0.5])
    logits = torch.log(torch.as_tensor(probs, dtype=torch.float32))

    def policy(obs):
        return logits.repeat(len(obs), 1), torch.zeros(len(obs))

    args = plr_ppo.Args(env_id="MultiRoom-N4-Random")
    envs = LevelOutcomeEnv(8, lambda levels: (np.full(len(levels), 50), np.zeros(len(levels))))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        plr_ppo.evaluate(policy, envs, uniform_level_sets(np.random.default_rng(1)), 8, args, "cpu")
    actions = np.concatenate(envs.actions)
    counts = np.bincount(actions, minlength=len(probs))
    assert len(actions) == 2 * 50 * 8
    assert stats.chisquare(counts, probs * len(actions)).pvalue > 1e-4


# ---------------------------------------------------------------------------------------------------------------
# Clause 7: start-up
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("env_id", ["MultiRoom-N4-Random", "bigfish"])
def test_a_rollout_too_large_for_memory_is_one_error_line_before_the_run_folder(tmp_path, monkeypatch, capsys, env_id):
    """A huge --num-steps (within the budget: 8 x 10^8 steps) stops the start with one `error:` line naming the flags
    that size the rollout, before any run folder or env exists; a rollout that fits passes the same check."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        run_main(["--env-id", env_id, "--num-envs", "8", "--num-steps", "100000000", "--total-timesteps", "800000000"])
    message = str(stopped.value)
    assert message.startswith("error: ") and "\n" not in message and "--num-steps" in message
    assert not (tmp_path / "runs").exists()
    plr_ppo.check_rollout_memory(plr_ppo.resolve_defaults(plr_ppo.Args(env_id=env_id, cuda=False)))
    assert "GiB" in capsys.readouterr().out


def test_labelling_the_training_levels_stops_at_a_stop_signal(tmp_path, monkeypatch):
    """The start-up labelling of every training level's difficulty (4,000 MultiRoom levels: seconds) checks for a stop
    at each level: a SIGINT recorded while the 3rd level is labelled stops the run before the 4th, with summary.json
    written and exit code 130."""
    labelled = []
    real_level_difficulty = plr_ppo.level_difficulty

    def level_difficulty(env_id, level):
        labelled.append(level)
        if len(labelled) == 3:
            processes._received_signals.append(signal.SIGINT)
        return real_level_difficulty(env_id, level)

    monkeypatch.setattr(plr_ppo, "level_difficulty", level_difficulty)
    monkeypatch.setattr(processes, "_received_signals", [])
    monkeypatch.setattr(plr_ppo, "MiniGridVecEnv", FakeLevelEnv)
    monkeypatch.chdir(tmp_path)
    try:
        run_main(["--env-id", "MultiRoom-N4-Random", "--num-envs", "2", "--num-steps", "8", "--no-progress", "--no-cuda"])
    except SystemExit as stopped:
        assert stopped.code == 130
    except KeyboardInterrupt:
        pytest.fail("the stop escaped the run's loop: a traceback and no summary.json")
    else:
        pytest.fail("the run did not stop")
    assert len(labelled) == 3
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "summary.json").read_text())["stop_reason"] == "interrupted by SIGINT"


def test_on_a_cuda_learner_the_rollout_is_checked_against_free_gpu_memory(monkeypatch):
    """With the learner on CUDA (faked here: no GPU in CI), the rollout's buffers are checked against the GPU's free
    memory (100 MiB here): one `error:` line when they do not fit (the paper's 64 x 256 Procgen rollout, 0.19 GiB), and the
    start goes on when they do."""
    monkeypatch.setattr(plr_ppo, "select_device", lambda cuda: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**20, 2**31))
    args = plr_ppo.resolve_defaults(plr_ppo.Args(env_id="bigfish", num_envs=64, num_steps=256))
    with pytest.raises(SystemExit) as stopped:
        plr_ppo.check_rollout_memory(args)
    assert str(stopped.value).startswith("error: the rollout needs") and "GPU memory" in str(stopped.value)
    plr_ppo.check_rollout_memory(plr_ppo.resolve_defaults(plr_ppo.Args(env_id="bigfish", num_envs=4, num_steps=16)))
