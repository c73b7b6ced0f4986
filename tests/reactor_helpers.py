"""Helpers shared by the Reactor test files (tests/test_reactor_*.py): frame shapes, the float64 default of their
textbook comparisons, and a batch of random sequences for the network and the loss."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import reactor

ATARI = (1, 84, 84)  # an Atari frame's shape
MINATAR = (4, 10, 10)  # a MinAtar frame's shape


@pytest.fixture(autouse=True)
def float64_by_default():
    """Textbook comparisons run in float64; the default is restored so other test files keep float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def float32(float64_by_default):
    torch.set_default_dtype(torch.float32)
    yield


def make_batch(B, T, A, H, rng, pad_at=None):
    term = torch.zeros(B, T + 1, dtype=torch.bool)
    pad = torch.zeros_like(term)
    first = torch.zeros_like(term)
    term[0, 3] = True
    first[0, 4] = True
    if pad_at is not None:
        pad[1, pad_at] = True
        first[1, pad_at + 1] = True
    mu = torch.softmax(torch.tensor(rng.normal(size=(B, T + 1, A)), dtype=torch.float32), -1)
    return reactor.Batch(
        torch.randint(0, 255, (B, T + 1, 84, 84), dtype=torch.uint8),
        torch.tensor(rng.integers(0, A, (B, T + 1))),
        torch.randn(B, T + 1, dtype=torch.float32),
        term,
        pad,
        first,
        mu,
        tuple(torch.zeros(B, H, dtype=torch.float32) for _ in range(4)),
        torch.ones(B, dtype=torch.float32),
    )


# ----------------------------------------------------------------------------------------------------------------
# reactor.py run as a script with spies on its loop (tests/test_reactor_runs.py)
REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "reactor.py"


def run_probed(cwd, flags, episode_limit=None, timeout=300):
    """`python reactor.py FLAGS` in `cwd`, through `probed_main` (the script itself, run as __main__, with spies
    on its loop; `episode_limit`: the actors' MinAtar episodes truncated after that many steps, so that truncations
    and their pad slots happen in a tiny run). Returns (the completed process, the spies' records)."""
    out = Path(cwd) / f"probe_{time.time_ns()}.pt"
    code = f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]; import reactor_helpers; "
    code += f"reactor_helpers.probed_main({str(out)!r}, {episode_limit!r})"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code, *flags], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    records = torch.load(out, weights_only=False) if out.exists() else None
    return r, records


def weights(model) -> dict:
    """A copy of a network's state dict."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


class LoopSpies:
    """Spies in the running script's globals `g` (the loop looks its functions up there at each call): they record
    and call the real function, changing nothing.
    - `first_step`: the loop's state at its first step (its first `store_chunk` or `learner_may_learn` call): counters,
      ratio base, the actors' shared counters, the networks, the optimizer, the replay, every RNG;
    - `chunks`: per stored chunk, the actor, its env steps before it, the learner's step count, the slots' versions;
    - `learning_steps`: per learning step, the counters before it, the optimizer's settings, the batch size and the
      loss's settings, the gradient norm Adam applied, the priorities written back;
    - `publishes`: per `publish_weights`, what the actors read and what became of the target network;
    - `evaluations`: whether `evaluate` played the online network;
    - `end`: the loop's state when the script is done."""

    def __init__(self, g: dict):
        self.g = g
        self.records = {
            "first_step": None,
            "chunks": [],
            "learning_steps": [],
            "publishes": [],
            "evaluations": [],
            "end": None,
        }
        self.store_chunk = g["store_chunk"]
        self.learner_may_learn = g["learner_may_learn"]
        self.learning_step = g["learning_step"]
        self.reactor_loss = g["reactor_loss"]
        self.publish_weights = g["publish_weights"]
        self.evaluate = g["evaluate"]
        self.update_priorities = g["replay"].update_priorities
        g["store_chunk"] = self.store_chunk_spy
        g["learner_may_learn"] = self.learner_may_learn_spy
        g["learning_step"] = self.learning_step_spy
        g["reactor_loss"] = self.reactor_loss_spy
        g["publish_weights"] = self.publish_weights_spy
        g["evaluate"] = self.evaluate_spy
        g["replay"].update_priorities = self.update_priorities_spy
        g["optimizer"].register_step_pre_hook(self.grad_norm_hook)

    def state(self) -> dict:
        import copy

        from common.checkpoint import rng_state

        g = self.g
        handles = g["handles"]
        return {
            "global_step": g["global_step"],
            "learn_steps": g["learn_steps"],
            "episodes": g["episodes_done"],
            "actor_steps": g["actor_env_steps"].tolist(),
            "ratio_base": tuple(g["ratio_base"]),
            "weights_version": handles.weights_version.value,
            "learner_steps": handles.learner_steps.value,
            "shared_actor_steps": list(handles.actor_steps[:]),
            "model": weights(g["net"]),
            "target_model": weights(g["target_net"]),
            "shared_model": weights(handles.shared_net),
            "optimizer": copy.deepcopy(g["optimizer"].state_dict()),
            "np_rng": copy.deepcopy(g["rng"].bit_generator.state),
            "rng": rng_state(),
            "replay": copy.deepcopy(g["replay"].state_dict()),
            "replay_uniform_eps": g["replay"].index.eps,
            "args": dict(vars(g["args"])),
        }

    def at_first_step(self):
        if self.records["first_step"] is None:
            self.records["first_step"] = self.state()

    def store_chunk_spy(self, channel, message, replay):
        self.at_first_step()
        actor_id, versions = self.store_chunk(channel, message, replay)
        chunk = {"actor": actor_id, "steps_before": int(self.g["actor_env_steps"][actor_id]), "versions": versions}
        self.records["chunks"].append(chunk | {"learn_steps": self.g["learn_steps"]})
        return actor_id, versions

    def learner_may_learn_spy(self, *args, **kwargs):
        self.at_first_step()
        return self.learner_may_learn(*args, **kwargs)

    def learning_step_spy(self, *args, **kwargs):
        g = self.g
        group = g["optimizer"].param_groups[0]
        step = {"global_step": g["global_step"], "learn_steps": g["learn_steps"], "ratio_base": tuple(g["ratio_base"])}
        step |= {"lr": group["lr"], "betas": tuple(group["betas"]), "num_sequences": len(g["replay"])}
        self.records["learning_steps"].append(step)
        return self.learning_step(*args, **kwargs)

    def reactor_loss_spy(self, net, target_net, batch, support, args):
        step = self.records["learning_steps"][-1]
        step["batch_size"] = batch.obs.shape[0]
        for name in ("retrace_lambda", "beta_loo_c", "tislr_c", "entropy_coef"):
            step[name] = getattr(args, name)
        return self.reactor_loss(net, target_net, batch, support, args)

    def grad_norm_hook(self, optimizer, args, kwargs):
        grads = [p.grad.norm() for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.records["learning_steps"][-1]["grad_norm"] = float(torch.stack(grads).norm())

    def update_priorities_spy(self, keys, priorities, exponent=1.0):
        self.update_priorities(keys, priorities, exponent)
        keys = np.asarray(keys).copy()
        step = self.records["learning_steps"][-1]
        step["priorities"] = (keys, np.asarray(priorities, np.float64).copy())
        step["stored_priorities"] = self.g["replay"].index.priority[keys].copy()

    def publish_weights_spy(self, net, target_net, shared_net, weights_version, learner_steps, learn_steps, args):
        target_before = weights(target_net)
        self.publish_weights(net, target_net, shared_net, weights_version, learner_steps, learn_steps, args)
        online = weights(net)
        self.records["publishes"].append(
            {
                "learn_steps": learn_steps,
                "weights_version": weights_version.value,
                "learner_steps": learner_steps.value,
                "shared_is_online": same_weights(weights(shared_net), online),
                "target_is_online": same_weights(weights(target_net), online),
                "target_unchanged": same_weights(weights(target_net), target_before),
            }
        )

    def evaluate_spy(self, net, args, episodes, device, seed, greedy=False):
        record = {"is_online": net is self.g["net"], "episodes": episodes, "seed": seed}
        self.records["evaluations"].append(record)
        return self.evaluate(net, args, episodes, device, seed, greedy)


def actor_loop_with_episode_limit(episode_limit, *actor_args):
    """In an actor process (reactor.py is its module __mp_main__): the script's `actor_loop` in envs whose episodes
    are truncated after `episode_limit` steps (MinAtar's time limit, `MinAtarEnv.max_episode_steps`)."""
    actor_loop = sys.modules["__mp_main__"].actor_loop
    # the globals the script's functions read (spawn runs the script in a module whose globals it then copies)
    script_globals = actor_loop.__globals__
    make_env = script_globals["make_env"]

    def make_env_with_limit(*args, **kwargs):
        env = make_env(*args, **kwargs)
        env.max_episode_steps = episode_limit
        return env

    script_globals["make_env"] = make_env_with_limit
    actor_loop(*actor_args)


def probed_main(out_path, episode_limit=None):
    """Run reactor.py as __main__ (runpy; its spawned actors import it as the script, as in a real run) with this
    process's command line, and `LoopSpies` installed when the script asks torch for its process context (after the
    set-up and the restoration, before any actor starts); with `episode_limit`, its actors start as
    `actor_loop_with_episode_limit`. The records go to `out_path` however the run ends."""
    import atexit
    import functools
    import runpy

    import torch.multiprocessing

    get_context = torch.multiprocessing.get_context
    spies = []

    def get_context_spy(method=None):
        if not spies:
            # the script's live globals: runpy runs it as the module sys.modules["__main__"]
            spies.append(LoopSpies(vars(sys.modules["__main__"])))
            # the actors define its classes in their module "__mp_main__" (what a script's parent process aliases)
            sys.modules["__mp_main__"] = sys.modules["__main__"]
            if episode_limit is not None:
                spies[0].g["actor_loop"] = functools.partial(actor_loop_with_episode_limit, episode_limit)
        return get_context(method)

    saved = []

    def save_records():
        if spies and not saved:
            spies[0].records["end"] = spies[0].state()
            torch.save(spies[0].records, out_path)
            saved.append(True)

    # a run's end leaves the process in common.processes.exit_now, never returning here; it runs the atexit functions
    atexit.register(save_records)
    torch.multiprocessing.get_context = get_context_spy
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        save_records()
