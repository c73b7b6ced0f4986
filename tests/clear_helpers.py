"""Helpers shared by the CLEAR test files (tests/test_clear_*.py): the textbook V-trace and CLEAR loss, the real actor
loop run in threads with the test as its learner, a stand-in for the ALE that records what the emulator did, the
textbook cumulative return, and the subprocess runs (with a spy on the resumed learner)."""

import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.stats
import torch

import clear_impala as ci

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "clear_impala.py")


def textbook_vtrace(log_rhos, discounts, rewards, values, bootstrap, clip_rho, clip_pg_rho):
    """Deliberately slow, straight from IMPALA Eq. (1) with per-step discounts gamma_t:
    v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i c_i) rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)),
    pg_adv_s = rho_pg_s (r_s + gamma_s v_{s+1} - V(x_s)), with V(x_T) = v_T = bootstrap."""
    T, B = log_rhos.shape
    rhos = np.exp(log_rhos)
    vs = np.zeros((T, B))
    adv = np.zeros((T, B))
    for b in range(B):
        v_next = lambda t: values[t + 1, b] if t + 1 < T else bootstrap[b]  # noqa: E731
        for s in range(T):
            total = values[s, b]
            for t in range(s, T):
                prod = 1.0
                for i in range(s, t):
                    prod *= discounts[i, b] * min(1.0, rhos[i, b])
                rho_t = rhos[t, b] if clip_rho is None else min(clip_rho, rhos[t, b])
                total += prod * rho_t * (rewards[t, b] + discounts[t, b] * v_next(t) - values[t, b])
            vs[s, b] = total
        for s in range(T):
            vs_next = vs[s + 1, b] if s + 1 < T else bootstrap[b]
            rho_pg = rhos[s, b] if clip_pg_rho is None else min(clip_pg_rho, rhos[s, b])
            adv[s, b] = rho_pg * (rewards[s, b] + discounts[s, b] * vs_next - values[s, b])
    return vs, adv


def unroll_with_id(i, T=3, obs_shape=(2, 2), A=2):
    return {k: np.full(shape, i % 100, dtype=dtype) for k, (shape, dtype) in ci.unroll_specs(obs_shape, A, T).items()}


def chi2_upper(df, p=0.9995):
    """The chi-square quantile a goodness-of-fit statistic with `df` degrees of freedom exceeds with probability 1 - p."""
    return float(scipy.stats.chi2.ppf(p, df))


def act_like_an_actor(model, T, B, obs_shape, seed=0):
    """Build a stored batch the way actor_loop writes it: row t+1 holds mu(.|x_t), V_mu(x_t), a_t, ..."""
    g = torch.Generator().manual_seed(seed)
    specs = ci.unroll_specs(obs_shape, 7, T)
    batch = {
        k: torch.zeros((shape[0], B, *shape[1:]), dtype=getattr(torch, np.dtype(d).name if d != np.bool_ else "bool"))
        for k, (shape, d) in specs.items()
    }
    batch["obs"] = torch.randint(0, 11, (T + 1, B, *obs_shape), generator=g, dtype=torch.uint8)
    with torch.no_grad():
        logits, values = model(batch["obs"].reshape(-1, *obs_shape))
    logits = logits.view(T + 1, B, -1)
    values = values.view(T + 1, B)
    batch["logits"][1:] = logits[:-1]
    batch["baseline"][1:] = values[:-1]
    batch["action"][1:] = torch.randint(0, 7, (T, B), generator=g)
    batch["reward"][1:] = torch.rand(T, B, generator=g)
    return batch


def check_direct_rollout(env, obs, new, network, T):
    """The new half of a published pair against a direct rollout of `env` from `obs` with the stored actions: each
    frame, reward and end flag, and mu, V_mu of `network` at frame r - 1 in row r. Returns the env's last obs."""
    with torch.no_grad():
        logits, values = network(new["obs"][:T])
    torch.testing.assert_close(new["logits"][1:], logits)
    torch.testing.assert_close(new["baseline"][1:], values)
    for r in range(1, T + 1):
        obs, reward, term, trunc, _ = env.step(int(new["action"][r]))
        assert float(new["reward"][r]) == pytest.approx(reward)
        assert bool(new["done"][r]) == (term or trunc)
        if term or trunc:
            obs, _ = env.reset()
        assert (new["obs"][r] == torch.from_numpy(obs)).all(), r
    return obs


def slow_clear_loss(learner, half_per_column, which, args):
    """CLEAR's loss terms written per element from the papers, for stored unrolls (row r = 1..T holds a_{r-1}, r_{r-1},
    done_{r-1}, mu(.|x_{r-1}), V_mu(x_{r-1}); row r's frame is x_r), as float64 tensors with autograd back to the
    learner's parameters: IMPALA Eq. (1) V-trace targets (`textbook_vtrace`, constants: no gradient flows through v_s
    or the advantage) with gamma cut at every episode end and a truncation bootstrapped through V_mu(final obs);
    pg = -sum log pi(a_t|x_t) adv_t, value = 1/2 sum (v_t - V(x_t))^2, entropy = sum pi log pi, and on replay columns
    KL(mu || pi) and (V - V_mu)^2 (CLEAR Sec. 3). Returns the unweighted terms and the weighted total."""
    T = args.unroll_length
    B = len(half_per_column)
    g = args.gamma
    log_rhos, disc, rew, vals = (np.zeros((T, B)) for _ in range(4))
    boot = np.zeros(B)
    log_pi = {}
    mu = {}
    act = {}
    vmu = {}
    value_of = {}
    for b, u in enumerate(half_per_column):
        lg, v = learner(u["obs"])
        for t in range(T + 1):
            if t == T:
                boot[b] = v[T].item()
                break
            log_pi[t, b] = torch.log_softmax(lg[t].double(), -1)
            mu[t, b] = torch.softmax(u["logits"][t + 1].double(), -1)
            act[t, b] = int(u["action"][t + 1])
            vmu[t, b] = float(u["baseline"][t + 1])
            value_of[t, b] = v[t].double()
            vals[t, b] = v[t].item()
            log_rhos[t, b] = log_pi[t, b][act[t, b]].item() - math.log(mu[t, b][act[t, b]].item())
            done = bool(u["done"][t + 1])
            trunc = bool(u["truncated"][t + 1])
            disc[t, b] = 0.0 if done else g
            rew[t, b] = float(u["reward"][t + 1]) + (g * float(u["final_value"][t + 1]) if trunc else 0.0)
    vs, adv = textbook_vtrace(log_rhos, disc, rew, vals, boot, args.clip_rho_threshold, args.clip_pg_rho_threshold)
    pg = torch.zeros((), dtype=torch.float64)
    value = torch.zeros((), dtype=torch.float64)
    entropy = torch.zeros((), dtype=torch.float64)
    pc = torch.zeros((), dtype=torch.float64)
    vc = torch.zeros((), dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            pg = pg - log_pi[t, b][act[t, b]] * adv[t, b]
            value = value + 0.5 * (vs[t, b] - value_of[t, b]) ** 2
            entropy = entropy + (log_pi[t, b].exp() * log_pi[t, b]).sum()
            if which[b]:
                pc = pc + (mu[t, b] * (mu[t, b].log() - log_pi[t, b])).sum()
                vc = vc + (value_of[t, b] - vmu[t, b]) ** 2
    total = args.pg_cost * pg + args.baseline_cost * value + args.entropy_cost * entropy
    if args.behavior_cloning:
        total = total + args.policy_cloning_cost * pc + args.value_cloning_cost * vc
    return {
        "losses/pg_loss": pg,
        "losses/value_loss": value,
        "losses/policy_cloning_loss": pc,
        "losses/value_cloning_loss": vc,
        "losses/total_loss": total,
        "entropy_sum": entropy,
    }


def gradients(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    zero = torch.zeros((), dtype=torch.float64)
    return {name: zero if p.grad is None else p.grad.double().clone() for name, p in model.named_parameters()}


# each term alone through the real loss (its cost 1, every other 0), then the paper's weights
ONE_TERM = {
    "losses/pg_loss": "pg_cost",
    "losses/value_loss": "baseline_cost",
    "entropy_sum": "entropy_cost",
    "losses/policy_cloning_loss": "policy_cloning_cost",
    "losses/value_cloning_loss": "value_cloning_cost",
}


# ----------------------------------------------------------------------------------------------------------------
# The real actor loop in threads, the test as its learner
def run_actor_loops(
    args,
    obs_shape,
    num_actions,
    shared_weights,
    unrolls,
    tmp_path,
    start_step=0,
    resume_step=0,
    on_pair=None,
    count_steps=False,
    final_checkpoint=False,
):
    """Run the real `actor_loop` of every actor process in a thread with the script's shared structures (a slot per
    env, its SlotInfo entries, one full queue per network, a semaphore per slot) and collect `unrolls` published pairs
    per slot: {slot: [{field: [2, T+1, ...], "info": {SlotInfo field: int}, "queue": the network it came through}, ...]}.
    The test is the learner: for each pair it calls `on_pair(net, slot, handles)` (e.g. to publish new weights), adds the
    unroll's T steps to the global step if `count_steps` (release_slots's count), then frees the slot. It ends by
    freeing every slot and stopping the actors; with `final_checkpoint` as the script's learner ends after its last
    checkpoint instead: it requests a buffer save and stops the actors without freeing their slots.
    Returns (pairs, slots, handles)."""
    A = args.num_actors
    T = args.unroll_length
    N = args.num_actors * args.envs_per_actor
    slots = {
        k: torch.from_numpy(np.zeros((N, 2, *shape), dtype=dtype))
        for k, (shape, dtype) in ci.unroll_specs(obs_shape, num_actions, T).items()
    }
    slot_info = ci.SlotInfo.zeros(N)
    full_queues = [queue.SimpleQueue() for _ in shared_weights]
    slot_free = [threading.Semaphore(1) for _ in range(N)]
    stop = threading.Event()
    handles = ci.ActorHandles(
        shared_weights=shared_weights,
        slots=slots,
        slot_info=slot_info,
        full_queues=full_queues,
        slot_free=slot_free,
        global_step=SimpleNamespace(value=start_step),
        resume_step=resume_step,
        steps_done=[0] * A,
        stop=stop,
        stats_queue=queue.SimpleQueue(),
        checkpoint_request=SimpleNamespace(value=0),
        run_dir=str(tmp_path),
    )
    threads = [
        threading.Thread(target=ci.actor_loop, daemon=True, args=(i, args, obs_shape, num_actions, handles)) for i in range(A)
    ]
    for th in threads:
        th.start()
    pairs = {i: [] for i in range(N)}
    deadline = time.time() + 60
    try:
        while min(len(p) for p in pairs.values()) < unrolls:
            assert time.time() < deadline, "the actors published too few unrolls"
            for net, full in enumerate(full_queues):
                if full.empty():
                    continue
                i = full.get()
                info = {name: int(entries[i]) for name, entries in slot_info._asdict().items()}
                pairs[i].append({k: v[i].clone() for k, v in slots.items()} | {"info": info, "queue": net})
                if on_pair is not None:
                    on_pair(net, i, handles)
                if count_steps:
                    handles.global_step.value += T
                if len(pairs[i]) < unrolls:
                    slot_free[i].release()
            time.sleep(0.001)
    finally:
        if final_checkpoint:
            handles.checkpoint_request.value += 1
        else:
            for i in range(N):
                slot_free[i].release()
        stop.set()
        for th in threads:
            th.join(timeout=30)
    assert not any(th.is_alive() for th in threads), "an actor did not stop"
    return pairs, slots, handles


def versioned_networks(obs_shape, num_actions, torso, count, seed):
    """`count` networks with distinct random weights, network v carrying version v (what the learner publishes)."""
    networks = []
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for version in range(count):
            network = ci.Agent(obs_shape, num_actions, torso)
            network.version.fill_(version)
            networks.append(network)
    return networks


# ----------------------------------------------------------------------------------------------------------------
# Atari: what the emulator did, recorded below gymnasium's AtariEnv
class RecordingALE:
    """Stands in for an AtariEnv's `ale` (an ALEInterface): forwards every call and records what the emulator did:
    the raw reward of every frame since `take_frames()` and each finished game's score (a game ends at the
    `reset_game()` that starts the next one). Install with `env.unwrapped.ale = RecordingALE(env.unwrapped.ale)`."""

    def __init__(self, ale):
        self._ale = ale
        self.frame_rewards = []
        self.score = 0.0
        self.frames_in_game = 0
        self.game_scores = []

    def act(self, *action):
        reward = self._ale.act(*action)
        self.frame_rewards.append(float(reward))
        self.score += float(reward)
        self.frames_in_game += 1
        return reward

    def reset_game(self):
        if self.frames_in_game:
            self.game_scores.append(self.score)
        self.score = 0.0
        self.frames_in_game = 0
        return self._ale.reset_game()

    def take_frames(self) -> list[float]:
        rewards = self.frame_rewards
        self.frame_rewards = []
        return rewards

    def __getattr__(self, name):
        return getattr(self._ale, name)


def recording_make_env(monkeypatch):
    """Patch `clear_impala.make_env` so that every Atari env it builds records its emulator (`RecordingALE`); returns
    the list the recorders are appended to, in the order the envs are built."""
    recorders = []
    real_make_env = ci.make_env

    def make_env(*a, **kw):
        env = real_make_env(*a, **kw)
        recorder = RecordingALE(env.unwrapped.ale)
        env.unwrapped.ale = recorder
        recorders.append(recorder)
        return env

    monkeypatch.setattr(ci, "make_env", make_env)
    return recorders


# ----------------------------------------------------------------------------------------------------------------
# Forgetting statistics, from the paper
def textbook_cumulative_return(records, task, total, num_bins=100):
    """CLEAR App. C, slowly: [0, total] in `num_bins` equal bins, bin k = [k total / n, (k + 1) total / n) (the last
    one closed); a bin's value is the mean return of the task's test episodes recorded in it, an empty bin keeps the
    value before it (bins before the first episode are left out); the cumulative return is the mean of the values,
    i.e. the time average of the test return over the steps the run reached. None when the task has no episode."""
    values = []
    current = None
    for k in range(num_bins):
        returns = []
        for step, record_task, episode_return in records:
            in_bin = min(int(step) * num_bins // total, num_bins - 1) == k
            if record_task == task and in_bin:
                returns.append(episode_return)
        if returns:
            current = sum(returns) / len(returns)
        if current is not None:
            values.append(current)
    return sum(values) / len(values) if values else None


# ----------------------------------------------------------------------------------------------------------------
# Subprocess runs
def environment():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


def run_script(tmp_path, *flags, timeout=120):
    return subprocess.run(
        [sys.executable, SCRIPT, *flags], cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=timeout
    )


# Runs clear_impala.py once per entry of a JSON list [cwd, stdout file, stderr file, flags], each in a child forked from
# this process once torch, gymnasium and minigrid are imported: a child is `python clear_impala.py FLAGS` run in `cwd`
# (as __main__, its SystemExit or traceback handled by the interpreter as at the command line) whose imports were
# already done. Prints the children's exit codes as a JSON list.
PRELOADED_RUNS = r"""
import json, os, runpy, sys
import gymnasium, minigrid, numpy, torch

script = sys.argv[1]
children = []
for cwd, out_path, err_path, flags in json.loads(sys.argv[2]):
    pid = os.fork()
    if pid == 0:
        os.chdir(cwd)
        os.dup2(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.argv = [script, *flags]
        runpy.run_path(script, run_name="__main__")
        sys.exit(0)
    children.append(pid)
print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]))
"""


def run_script_starts(runs, timeout=180):
    """clear_impala.py once per (folder, flags) of `runs`, each as `run_script(folder, *flags)` would but sharing one
    import of torch (PRELOADED_RUNS), for runs that stop at start-up; returns per run its returncode, stdout, stderr."""
    entries = [[str(folder), str(folder / "run.out"), str(folder / "run.err"), list(flags)] for folder, flags in runs]
    r = subprocess.run(
        [sys.executable, "-c", PRELOADED_RUNS, SCRIPT, json.dumps(entries)],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [
        SimpleNamespace(returncode=code, stdout=Path(out).read_text(), stderr=Path(err).read_text())
        for code, (_, out, err, _) in zip(json.loads(r.stdout), entries)
    ]


# a log record per learner step and episodes of <= 8 steps: the run lasts about a second, so wall-clock logging could
# skip task 0 and a test actor could finish no 100-step episode before the end; num_actors x envs_per_actor = B, so
# every batch holds one pair of every env (the lag bound of clause W2)
TINY = (
    "--env-ids MiniGrid-Empty-5x5-v0 MiniGrid-LavaGapS5-v0 --steps-per-task 240 --num-actors 2 --batch-size 2 "
    "--unroll-length 20 --num-test-actors 1 --test-actor-max-sps 300 --start-method forkserver --no-progress "
    "--no-cuda --log-every-seconds 0 --minigrid-max-steps 8"
).split()


# a test episode (task, return, length) no MiniGrid task can produce (its returns lie in [0, 1]), queued by RESUME_SPY
# once the loop has stopped
QUEUED_AT_STOP = (1, 4242.5, 7)

# Runs clear_impala.py as __main__ (runpy: actor processes import it by its path, as in a plain run) with a profile
# hook installed once the optimizers exist. At the first learner step it records what the learner holds and uses:
# the arguments of learner_step and of the functions it calls (clear_loss, impala_losses, clip_grad_norm_), the
# optimizer before and after the step, the loop's counters and history (the __main__ namespace), every global RNG
# state, the pair-selection stream at its first draw and the global step at the first release_slots (the batch
# copied, its steps not yet counted); then it saves
# them to the file named by its first argument and removes the hook. When the loop's ProcessGroup.stop (called from
# __main__) has stopped every process, it puts the test episode given as its second argument on __main__'s
# eval_queue from a forked child that exits before stop returns (a process's queue data is in the pipe once it has
# exited), so that the episode is queued, whatever the scheduling, when the loop moves on to its summary.
RESUME_SPY = r"""
import copy, json, multiprocessing, os, random, runpy, sys
import numpy as np
import torch

from common.processes import ProcessGroup

out_path = sys.argv.pop(1)
queued_at_stop = tuple(json.loads(sys.argv.pop(1)))
script = sys.argv[1]
sys.argv = sys.argv[1:]
seen = {}


def spy(frame, event, arg):
    name = frame.f_code.co_name
    if event == "call" and name == "select_pairs" and "pair_rng" not in seen:
        seen["pair_rng"] = copy.deepcopy(frame.f_locals["rng"].bit_generator.state)
    elif event == "call" and name == "release_slots" and "global_step" not in seen:
        seen["global_step"] = frame.f_locals["global_step"].value
    elif event == "call" and name == "learner_step" and "learner_step" not in seen:
        local = frame.f_locals
        loop = frame.f_back.f_globals
        seen["learner_step"] = {
            "model": {k: v.detach().cpu().clone() for k, v in local["model"].state_dict().items()},
            "optimizer": copy.deepcopy(local["optimizer"].state_dict()),
            "learning_rate": local["learning_rate"],
            "batch_size": local["batch"]["action"].shape[1],
            "args": dict(vars(local["args"])),
            "learner_steps": list(loop["learner_steps"]),
            "eval_records": [tuple(r) for r in loop["eval_records"]],
            "end_step": loop["end_step"],
            "test_actors": sorted(p.name for p in loop["processes"].procs if p.name.startswith("test-")),
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        }
    elif event == "call" and name in ("clear_loss", "impala_losses", "clip_grad_norm_") and "learner_step" in seen:
        seen.setdefault(name, {k: v for k, v in frame.f_locals.items() if isinstance(v, (int, float, bool))})
        if name == "clear_loss":
            seen[name]["args"] = dict(vars(frame.f_locals["args"]))
    elif event == "return" and name == "learner_step" and "learner_step" in seen:
        seen["param_groups"] = [
            {k: v for k, v in group.items() if k != "params"} for group in frame.f_locals["optimizer"].param_groups
        ]
        sys.setprofile(None)
        # whole or absent: the test stops the run as soon as the file exists
        torch.save(seen, out_path + ".tmp")
        os.replace(out_path + ".tmp", out_path)


real_init = torch.optim.RMSprop.__init__


def init_then_spy(self, *a, **kw):
    real_init(self, *a, **kw)
    sys.setprofile(spy)


def put_and_flush(q, item):
    q.put(item)
    q.close()
    q.join_thread()


real_stop = ProcessGroup.stop
queued = []


def stop_then_queue_an_episode(self, *a, **kw):
    real_stop(self, *a, **kw)
    loop = sys._getframe(1).f_globals
    if loop.get("__name__") == "__main__" and "eval_queue" in loop and not queued:
        queued.append(queued_at_stop)
        fork = multiprocessing.get_context("fork")
        child = fork.Process(target=put_and_flush, args=(loop["eval_queue"], queued_at_stop))
        child.start()
        child.join()


torch.optim.RMSprop.__init__ = init_then_spy
ProcessGroup.stop = stop_then_queue_an_episode
runpy.run_path(script, run_name="__main__")
"""


def start_spied_run(tmp_path, spy_out, *flags):
    """clear_impala.py with `flags` under RESUME_SPY (its records go to `spy_out`; it queues QUEUED_AT_STOP once the
    loop has stopped), in its own session, output to files."""
    stdout = open(tmp_path / "spied.out", "w")
    stderr = open(tmp_path / "spied.err", "w")
    return subprocess.Popen(
        [sys.executable, "-c", RESUME_SPY, str(spy_out), json.dumps(QUEUED_AT_STOP), SCRIPT, *flags],
        cwd=tmp_path,
        env=environment(),
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )
