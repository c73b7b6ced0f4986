"""clear_impala.py, the loop's contract. Each clause names its tests; [runs] are real runs in tests/test_clear_runs.py,
[wiring] and [oracles] are in tests/test_clear_wiring.py and tests/test_clear_oracles.py; the rest are here.

W. The weights the actors act with
  W1. Every unroll of a training actor is played with the latest weights its network had published when the unroll
      started: the mu and V_mu stored in it are that network's outputs and the version it records
      (SlotInfo.policy_version) is theirs. sequential / simultaneous: the one network; separate: the network of the
      process's task.
  W2. [runs] With one pair per env in each batch (envs = B per network), every batch lags the learner by at most
      one update: a slot is freed by the batch that took its pair, and the network's next batch needs every env's
      next pair. So the versions rise within every task, per network in separate mode.
  W3. An actor's copy of a network is one published state, whole, and the version it records is that state's: the
      learner publishes under a seqlock (publish_weights) and an actor retries a copy the learner wrote into during
      it (read_weights); training and test actors read through it.
L. One learner step (learner_step)
  L1. The gradient of this batch's loss alone, clipped to a global norm of --max-grad-norm, one RMSProp step in
      torchbeast's form with the lr of annealed_learning_rate (lr_0 (1 - steps before the batch / the run's
      steps)) and the flags' alpha and eps; the actors' shared copy then holds the new weights, version + 1.
  L2. [wiring] The loss is CLEAR's: V-trace's policy-gradient, value and entropy terms on every column, the two
      cloning terms on replay columns only, with the flags' weights (values and gradients against a slow loop).
  L3. [runs] --mode separate: every network is trained on its own task's batches only, with its own optimizer, and
      --save-model keeps every network.
B. Each batch
  B1. [oracles, wiring, runs] B pairs from distinct envs of the network's queue; floor or ceil of --replay-fraction x B
      replay halves (select_pairs), each a stored unroll of the same actor process; every new unroll on the task its
      start step designates (charts/task_mismatch 0); B x T new steps counted before the slots are freed.
M. Modes: [oracles, wiring] sequential switches every actor at the designated step; simultaneous: env i plays task
   i mod K; separate: process p plays task p mod K with network p mod K.
T. The test actors
  T1. A test actor samples its actions from pi of its own task's network (a chi-square test), reloads those weights
      every T steps, plays its own task, and reports each episode's return; on Atari, the game's score, not a life's.
F. The forgetting statistics
  F1. [oracles, runs] cumulative_returns is the time average of the binned test returns over [0, the steps the run
      reached] (CLEAR App. C); summary.json's final_cumulative_return equals it recomputed from eval_records.json,
      also for a run stopped early; the test episodes still queued when the loop stops join that history and the
      summary (summarize_test_episodes).
E. What the network sees, per env family [wiring]
  E1. Atari through common/atari_env.py: 4 x 84 x 84 uint8 frames, the full 18 actions, sticky probability 0
      unless given; a lost life ends the learning episode (terminated) but not the game; rewards clipped to their
      sign; training and test returns per game; the Nature CNN or the ResNet reads pixels / 255.
  E2. MinAtar: channels padded to 10, sticky probability 0.1 unless given (0 included); its torso reads the 0/1
      planes as they are.
  E3. MiniGrid: the 7 x 7 x 3 view, indices / 10, channels first.
R. Replay persistence and resume
  R1. With --checkpoint-replay each actor saves its buffer at every checkpoint, the final one included (also when it
      sees the stop before its next unroll); a resumed actor restores it and continues its keep/drop stream.
  R2. A new run's actor streams are seeded by seed + 1000 i alone (never by timing); a run started with --resume
      draws new streams from the checkpoint's step, for training and test actors.
  R3. [runs] At its first learner step a resumed run holds what the checkpoint holds: the weights and their
      versions, the optimizer's statistics, the global step and learner steps, the test-episode history, the
      pair-selection stream and every global RNG state; its lr continues the schedule from the restored step.
  R4. [runs] Every flag of APPLIED_ON_RESUME given a new value on --resume is the value in effect at the resumed
      run's first learner step (a probe per flag; the probe table is the class).
  R5. [oracles, runs] A resume this script cannot continue exactly is refused in one `error: --resume: ...` line
      before any run folder is opened: a checkpoint of another form (an entry missing, another number of
      networks, other parameter names or shapes, e.g. weights written before they carried their version;
      check_checkpoint_fits), or --checkpoint-replay buffers that have dropped unrolls and would grow to a larger
      capacity (check_restored_buffers; ReservoirBuffer.load refuses them too). A buffer that dropped none grows and
      continues as a buffer of the larger capacity would.
"""

import copy
import math
import threading

import numpy as np
import pytest
import torch
from clear_helpers import (
    act_like_an_actor,
    chi2_upper,
    recording_make_env,
    run_actor_loops,
    unroll_with_id,
    versioned_networks,
)

import clear_impala as ci


# ----------------------------------------------------------------------------------------------------------------
# W. The weights the actors act with
@pytest.mark.parametrize("mode", ["sequential", "simultaneous", "separate"])
def test_training_actors_act_with_the_latest_weights_of_their_network(tmp_path, mode):
    """Clause W1 on the real actor loop: the test is the learner and publishes new weights (distinct random networks,
    version v + 1) after every pair it takes, before it frees the pair's slot. One actor process per network, so the
    weights an unroll must be played with are known exactly: the k-th unroll of a process with E envs starts after
    k x E publications. Its recorded version must be k x E, and its stored mu and V_mu that network's outputs on
    its frames. Sequential: tasks switch every second unroll (the learner counts the steps), so unrolls within a
    task are checked too; separate: each process's network only."""
    E = 2
    num_nets = 2 if mode == "separate" else 1
    args = ci.Args(
        env_ids=["MiniGrid-Empty-5x5-v0", "MiniGrid-LavaGapS5-v0"],
        mode=mode,
        minigrid_max_steps=6,
        num_actors=num_nets,
        envs_per_actor=E,
        batch_size=E,
        unroll_length=5,
        steps_per_task=2 * E * 5,
        seed=4,
    )
    obs_shape, num_actions, _ = ci.probe_envs(args)
    unrolls = 6
    networks = [versioned_networks(obs_shape, num_actions, "minigrid", unrolls * E + 1, seed=10 * net) for net in range(2)]
    shared = [ci.SharedWeights.share(copy.deepcopy(networks[net][0])) for net in range(num_nets)]
    published = [0] * num_nets

    def publish(net, slot, handles):
        published[net] += 1
        ci.publish_weights(networks[net][published[net]], shared[net])

    pairs, _, _ = run_actor_loops(
        args, obs_shape, num_actions, shared, unrolls, tmp_path, on_pair=publish, count_steps=mode == "sequential"
    )
    tasks_played = set()
    for slot, slot_pairs in pairs.items():
        process = slot // E
        for k, pair in enumerate(slot_pairs):
            net = pair["queue"]
            tasks_played.add((process, pair["info"]["task"]))
            assert net == (process if mode == "separate" else 0)
            version = pair["info"]["policy_version"]
            assert version == k * E, (slot, k, version)
            with torch.no_grad():
                logits, values = networks[net][version](pair["obs"][0, : args.unroll_length])
            torch.testing.assert_close(pair["logits"][0, 1:], logits)
            torch.testing.assert_close(pair["baseline"][0, 1:], values)
    expected_tasks = {"sequential": {(0, 0), (0, 1)}, "simultaneous": {(0, 0), (0, 1)}, "separate": {(0, 0), (1, 1)}}
    assert tasks_played == expected_tasks[mode]


def fill_state(network, value):
    """Every entry of `network`'s state (weights, biases, version) set to `value`: the state published as version
    `value`, recognisable in any copy."""
    with torch.no_grad():
        for tensor in network.state_dict().values():
            tensor.fill_(value)


def assert_whole_state(network, version):
    """`network`'s state is exactly the published state of `version` (fill_state), entry by entry."""
    for name, tensor in network.state_dict().items():
        assert (tensor == version).all(), (name, version, tensor.flatten()[:3])


def test_an_actor_retries_a_copy_the_learner_published_into(monkeypatch):
    """Clause W3, with the interleaving forced: the learner stand-in publishes versions 1 and 2 (publish_weights)
    while the actor's read_weights is half-way through copying (a pre-hook on the reader's value head: the version
    and the torso are copied, the head not yet). The copy read_weights returns is whole and its version is the one
    published last; a reader that kept the first attempt would hold version 0's torso with version 2's head."""
    learner = ci.Agent((7, 7, 3), 7, "minigrid")
    fill_state(learner, 0)
    shared = ci.SharedWeights.share(copy.deepcopy(learner))
    reader = ci.Agent((7, 7, 3), 7, "minigrid")
    published = []

    def publish_during_the_copy(*_):
        if len(published) < 2:
            published.append(len(published) + 1)
            fill_state(learner, published[-1])
            ci.publish_weights(learner, shared)

    reader.baseline.register_load_state_dict_pre_hook(publish_during_the_copy)
    version = ci.read_weights(reader, shared)
    assert published == [1, 2] and version == 2
    assert_whole_state(reader, version)


def test_every_copy_read_while_the_learner_publishes_in_a_tight_loop_is_one_published_version():
    """Clause W3, concurrently: a learner stand-in thread publishes versions 1..300 as fast as it can (publish_weights;
    torch copies release the GIL, so the two threads interleave within copies) while the actor stand-in reads
    (read_weights) until the last one is out; every copy it accepts equals exactly the published state of the
    version it records, and the versions it records never go back."""
    learner = ci.Agent((7, 7, 3), 7, "minigrid")
    fill_state(learner, 0)
    shared = ci.SharedWeights.share(copy.deepcopy(learner))
    reader = ci.Agent((7, 7, 3), 7, "minigrid")
    last = 300
    errors = []
    stop = threading.Event()

    def learn():
        try:
            for version in range(1, last + 1):
                if stop.is_set():
                    return
                fill_state(learner, version)
                ci.publish_weights(learner, shared)
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=learn, daemon=True)
    thread.start()
    versions = [0]
    try:
        while versions[-1] < last and not errors:
            version = ci.read_weights(reader, shared)
            assert_whole_state(reader, version)
            assert version >= versions[-1]
            versions.append(version)
    finally:
        # a failed assertion stops the learner before the test ends
        stop.set()
        thread.join(timeout=30)
    assert not errors and not thread.is_alive()


class SequenceOfAWriteUnderWay:
    """A stand-in for a SharedWeights' sequence, read while the learner's write of `whole` into `shared_model` is under
    way: the sequence is odd (1) at the reader's first two looks, the write then completes (`whole`'s state copied in)
    and the sequence is even (2) from the third look on. Until then `shared_model` holds what the test put there."""

    def __init__(self, shared_model, whole):
        self.shared_model = shared_model
        self.whole = whole
        self.looks = 0

    def __int__(self):
        self.looks += 1
        if self.looks <= 2:
            return 1
        if self.looks == 3:
            self.shared_model.load_state_dict(self.whole.state_dict())
        return 2


def torn_copy(old, new):
    """What a write of `new` over `old` leaves half-way: `new`'s version and torso, `old`'s policy and value heads."""
    torn = copy.deepcopy(old)
    with torch.no_grad():
        torn.version.copy_(new.version)
        for name, tensor in new.torso.state_dict().items():
            torn.torso.state_dict()[name].copy_(tensor)
    return torn


def test_a_training_actor_never_acts_with_a_copy_the_learner_is_writing(tmp_path):
    """Clause W3 on the real actor loop, with no timing: when the actor reloads its network's weights for its first
    unroll, the learner's write of version 1 over version 0 is under way (SequenceOfAWriteUnderWay: the shared copy
    holds version 1's version and torso with version 0's heads, the sequence odd for two looks). The unroll's stored
    mu and V_mu are those of version 1 whole and it records version 1: an actor that copied the shared module
    without the seqlock, acted with it directly, or kept a copy taken while the sequence was odd, acts with the torn
    state (its heads are version 0's)."""
    args = ci.Args(
        env_ids=["MiniGrid-Empty-5x5-v0"],
        minigrid_max_steps=6,
        num_actors=1,
        envs_per_actor=1,
        batch_size=1,
        unroll_length=5,
        seed=4,
    )
    obs_shape, num_actions, _ = ci.probe_envs(args)
    old, new = versioned_networks(obs_shape, num_actions, "minigrid", 2, seed=3)
    shared_model = torn_copy(old, new)
    shared = ci.SharedWeights(shared_model, SequenceOfAWriteUnderWay(shared_model, new))
    pairs, _, _ = run_actor_loops(args, obs_shape, num_actions, [shared], 1, tmp_path)
    (pair,) = pairs[0]
    assert pair["info"]["policy_version"] == 1
    with torch.no_grad():
        logits, values = new(pair["obs"][0, : args.unroll_length])
        torn_logits, _ = torn_copy(old, new)(pair["obs"][0, : args.unroll_length])
    assert not torch.allclose(torn_logits, logits)
    torch.testing.assert_close(pair["logits"][0, 1:], logits)
    torch.testing.assert_close(pair["baseline"][0, 1:], values)


# ----------------------------------------------------------------------------------------------------------------
# L. One learner step
def textbook_rmsprop_step(params, square_avgs, gradient, learning_rate, args):
    """One update from the papers, in float64: g <- g min(1, max_norm / (||g|| + 1e-6)) over all parameters (global
    norm clip, IMPALA Table G.1), then torchbeast's RMSProp: v <- alpha v + (1 - alpha) g^2,
    theta <- theta - lr g / (sqrt(v) + eps). Returns the new (params, square_avgs) and the norm before clipping."""
    norm = math.sqrt(sum(float((g**2).sum()) for g in gradient.values()))
    coefficient = min(1.0, args.max_grad_norm / (norm + 1e-6))
    new_params = {}
    new_square_avgs = {}
    for name, theta in params.items():
        g = gradient[name] * coefficient
        v = args.rmsprop_alpha * square_avgs[name] + (1 - args.rmsprop_alpha) * g**2
        new_params[name] = theta - learning_rate * g / (v.sqrt() + args.rmsprop_eps)
        new_square_avgs[name] = v
    return new_params, new_square_avgs, norm


def test_one_learner_step_is_the_textbook_update_and_publishes_it():
    """Clause L1: two consecutive `learner_step`s on two stored batches against `textbook_rmsprop_step` on the
    gradient of each batch's loss alone (torch.autograd.grad on a copy of the network, so nothing accumulates),
    parameter by parameter after each step (accumulated gradients show on the second). The clip acts (the norm is
    far above --max-grad-norm and the unclipped update is far from the clipped one); the optimizer was built with
    other settings than the flags', and the lr of each step comes from `annealed_learning_rate`. After each step the
    shared copy holds the new weights and the version counts the steps."""
    torch.manual_seed(0)
    T = 6
    B = 3
    obs_shape = (7, 7, 3)
    args = ci.Args(
        env_ids=["MiniGrid-Empty-5x5-v0"],
        steps_per_task=1000,
        num_cycles=1,
        unroll_length=T,
        batch_size=B,
        max_grad_norm=0.05,
        learning_rate=2e-3,
        rmsprop_alpha=0.9,
        rmsprop_eps=0.01,
        bootstrap_truncation=True,
    )
    actor = ci.Agent(obs_shape, 7, "minigrid")
    model = ci.Agent(obs_shape, 7, "minigrid")
    oracle = copy.deepcopy(model)
    shared = ci.SharedWeights.share(ci.Agent(obs_shape, 7, "minigrid"))
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1.0, alpha=0.5, eps=1.0)
    halves = torch.tensor([1, 0, 1])
    cpu = torch.device("cpu")
    params = {name: p.detach().double().clone() for name, p in oracle.named_parameters()}
    square_avgs = {name: torch.zeros_like(p) for name, p in params.items()}
    end_step = ci.total_steps(args)
    for k, step in enumerate((0, T * B)):
        batch = act_like_an_actor(actor, T, B, obs_shape, seed=k)
        learning_rate = ci.annealed_learning_rate(step, end_step, args)
        assert learning_rate == pytest.approx(args.learning_rate * (1 - step / end_step))
        loss = ci.learner_loss(oracle, batch, halves, args, cpu).loss
        names = [name for name, _ in oracle.named_parameters()]
        grads = torch.autograd.grad(loss, list(oracle.parameters()))
        gradient = {name: g.double() for name, g in zip(names, grads)}
        no_clip = ci.Args(**{**vars(args), "max_grad_norm": 1e9})
        unclipped = textbook_rmsprop_step(params, square_avgs, gradient, learning_rate, no_clip)[0]
        params, square_avgs, norm = textbook_rmsprop_step(params, square_avgs, gradient, learning_rate, args)
        assert norm > 20 * args.max_grad_norm
        grad_norm = ci.learner_step(model, optimizer, shared, batch, halves, learning_rate, args, cpu).grad_norm
        assert float(grad_norm) == pytest.approx(norm, rel=1e-4)
        for group in optimizer.param_groups:
            assert (group["lr"], group["alpha"], group["eps"]) == (learning_rate, args.rmsprop_alpha, args.rmsprop_eps)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach().double(), params[name], rtol=1e-5, atol=1e-7, msg=f"step {k}: {name}")
        assert max(float((unclipped[n] - params[n]).abs().max()) for n in params) > 1e-4
        assert int(model.version) == k + 1
        for key, value in model.state_dict().items():
            assert torch.equal(shared.model.state_dict()[key], value), key
        with torch.no_grad():
            for name, p in oracle.named_parameters():
                p.copy_(params[name])


# ----------------------------------------------------------------------------------------------------------------
# T. The test actors
class FixedObservationTask:
    """A stand-in task for a test actor (built by a patched `make_env`): always the same MiniGrid-shaped observation;
    records the seed it was built with, its reset seeds and the actions it receives; an episode lasts `length` steps
    and its return is the sum of its actions, reported in info["episode"] as the adapters do; `on_step(n)` runs after
    the n-th step."""

    def __init__(self, env_id, seed, length=10, on_step=None):
        self.env_id = env_id
        self.seed = seed
        self.length = length
        self.on_step = on_step
        self.obs = np.random.default_rng(0).integers(0, 11, (7, 7, 3)).astype(np.uint8)
        self.reset_seeds = []
        self.actions = []
        self.episode_returns = []
        self.episode_return = 0.0
        self.episode_length = 0

    def reset(self, seed=None, options=None):
        self.reset_seeds.append(seed)
        self.episode_return = 0.0
        self.episode_length = 0
        return self.obs, {}

    def step(self, action):
        self.actions.append(action)
        self.episode_return += action
        self.episode_length += 1
        terminated = self.episode_length == self.length
        info = {}
        if terminated:
            info["episode"] = {"r": self.episode_return, "l": self.episode_length}
            self.episode_returns.append(self.episode_return)
        if self.on_step is not None:
            self.on_step(len(self.actions))
        return self.obs, 0.0, terminated, False, info

    def close(self):
        pass


class StopAfter:
    """An eval queue that sets `stop` once it has received `count` reports (the test actor then returns)."""

    def __init__(self, count, stop):
        self.count = count
        self.stop = stop
        self.reports = []

    def put(self, report):
        self.reports.append(report)
        if len(self.reports) == self.count:
            self.stop.set()


def fixed_policy(probabilities):
    """A network whose pi is `probabilities` on every observation (policy weights 0, biases log p)."""
    network = ci.Agent((7, 7, 3), len(probabilities), "minigrid")
    with torch.no_grad():
        network.policy.weight.zero_()
        network.policy.bias.copy_(torch.log(torch.tensor(probabilities, dtype=torch.float32)))
    return network


def test_a_test_actor_samples_from_pi_of_its_tasks_latest_weights(monkeypatch):
    """Clause T1 on the real test actor loop (--mode separate, the test actor of task 1; a stand-in task with a fixed
    observation): it builds task 1's env; its actions follow pi of network 1 (a chi-square test against that pi, not
    the other network's uniform one; this pi never plays action 5); after its 2,001st action network 1 is replaced by
    one that always plays 5: the actions up to its next reload (step 2,004, the next multiple of T = 4) still follow
    the old weights (no 5) and every action from that reload on is 5. 2,001 is a multiple of no reload period, so a
    reload every 2 T or 10 T steps, or at every step, fails. Each reported episode return is the task's own (its
    actions' sum here), reported as task 1."""
    T = 4
    switch_at = 2001
    next_reload = (switch_at // T + 1) * T
    total = next_reload + 500
    args = ci.Args(
        env_ids=["MiniGrid-Empty-5x5-v0", "MiniGrid-LavaGapS5-v0"],
        mode="separate",
        num_actors=2,
        batch_size=1,
        unroll_length=T,
    )
    first = np.array([0.3, 0.1, 0.2, 0.1, 0.15, 1e-12, 0.15])
    always_five = np.full(7, 1e-12)
    always_five[5] = 1.0
    shared = [ci.SharedWeights.share(fixed_policy(np.full(7, 1 / 7))), ci.SharedWeights.share(fixed_policy(first))]
    next_network = fixed_policy(always_five)
    stop = threading.Event()
    built = []

    def on_step(n):
        if n == switch_at:
            ci.publish_weights(next_network, shared[1])
        if n == total:
            stop.set()

    def make_env(env_id, seed, args, *rest):
        built.append(FixedObservationTask(env_id, seed, on_step=on_step))
        return built[-1]

    monkeypatch.setattr(ci, "make_env", make_env)
    eval_queue = StopAfter(10**9, stop)
    ci.test_actor_loop(0, 1, args, (7, 7, 3), 7, shared, 0, stop, eval_queue)
    (task,) = built
    assert task.env_id == "MiniGrid-LavaGapS5-v0" and len(task.actions) == total
    # the old weights: pi of network 1 over the actions it plays (df 5), and never action 5
    played = [0, 1, 2, 3, 4, 6]
    counts = np.bincount(task.actions[:next_reload], minlength=7)
    assert counts[5] == 0, counts
    expected = next_reload * first[played] / first[played].sum()
    chi2 = float(((counts[played] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_upper(len(played) - 1), (counts, chi2)
    uniform = np.full(len(played), next_reload / len(played))
    assert float(((uniform - expected) ** 2 / expected).sum()) > chi2_upper(len(played) - 1)
    # the new weights from the next reload on
    assert set(task.actions[next_reload:]) == {5}
    assert [report[0] for report in eval_queue.reports] == [1] * len(task.episode_returns)
    assert [report[1] for report in eval_queue.reports] == task.episode_returns


def test_a_test_actor_never_acts_with_a_copy_the_learner_is_writing(monkeypatch):
    """Clause W3 on the real test actor loop, with no timing: at its first reload the learner's write of a network
    that always plays action 5 over one that never does is under way (SequenceOfAWriteUnderWay: the shared copy
    holds the new version and torso with the old heads). Its first T actions, played before its next reload, are
    all 5: a test actor that copied the shared module without the seqlock, acted with it directly, or kept a copy
    taken while the sequence was odd, plays the old heads' pi (never 5)."""
    T = 4
    args = ci.Args(env_ids=["MiniGrid-Empty-5x5-v0"], num_actors=1, batch_size=1, unroll_length=T)
    never_five = np.full(7, 1 / 6)
    never_five[5] = 1e-12
    always_five = np.full(7, 1e-12)
    always_five[5] = 1.0
    old = fixed_policy(never_five)
    new = fixed_policy(always_five)
    new.version.fill_(1)
    shared_model = torn_copy(old, new)
    shared = ci.SharedWeights(shared_model, SequenceOfAWriteUnderWay(shared_model, new))
    stop = threading.Event()
    built = []

    def on_step(n):
        if n == T:
            stop.set()

    def make_env(env_id, seed, args, *rest):
        built.append(FixedObservationTask(env_id, seed, on_step=on_step))
        return built[-1]

    monkeypatch.setattr(ci, "make_env", make_env)
    ci.test_actor_loop(0, 0, args, (7, 7, 3), 7, [shared], 0, stop, StopAfter(10**9, stop))
    (task,) = built
    assert task.actions == [5] * T


def test_a_test_actor_reports_an_atari_games_score_not_a_lifes(monkeypatch):
    """Clauses T1 and E1 on the real test actor loop and clear_impala's own Atari env (SpaceInvaders, 3 lives): its
    first two reports are the scores of the first two whole games as the emulator counted them (RecordingALE)."""
    recorders = recording_make_env(monkeypatch)
    args = ci.Args(env_ids=["ALE/SpaceInvaders-v5"], num_actors=1, batch_size=1)
    torch.manual_seed(0)
    shared = [ci.SharedWeights.share(ci.Agent((4, 84, 84), 18, "nature"))]
    stop = threading.Event()
    eval_queue = StopAfter(2, stop)
    ci.test_actor_loop(0, 0, args, (4, 84, 84), 18, shared, 0, stop, eval_queue)
    (recorder,) = recorders
    assert [report[1] for report in eval_queue.reports] == recorder.game_scores[:2]
    assert min(recorder.game_scores[:2]) > 1


# ----------------------------------------------------------------------------------------------------------------
# R. Replay persistence and resume (the actors' side)
REPLAY_ARGS = dict(
    env_ids=["MiniGrid-Empty-5x5-v0"],
    minigrid_max_steps=6,
    num_actors=1,
    envs_per_actor=2,
    batch_size=2,
    unroll_length=4,
    steps_per_task=10_000,
    checkpoint_replay=True,
    seed=6,
)


def saved_new_halves(path, pairs):
    """Assert the buffer saved at `path` holds exactly the new halves of `pairs` (every unroll offered so far: the
    buffer is larger than the run); returns its num_seen."""
    with np.load(path) as saved:
        stored = [saved["obs"][row] for row in range(len(saved["keys"]))]
        num_seen = int(saved["num_seen"])
    published = [pair["obs"][0].numpy() for slot_pairs in pairs.values() for pair in slot_pairs]
    assert len(stored) == num_seen
    for obs in published[:num_seen]:
        assert any(np.array_equal(obs, row) for row in stored)
    return num_seen


def test_an_actor_saves_its_buffer_at_each_checkpoint_the_last_one_after_the_stop(tmp_path):
    """Clause R1 on the real actor loop (1 process, 2 envs, --checkpoint-replay): a checkpoint requested while the
    learner holds the second unroll's pairs is saved before the actor's third unroll (4 unrolls seen); a final
    checkpoint requested as the learner stops, without freeing the slots (the script's end), is saved on the way
    out (all 4 unrolls of a 2-unroll run)."""
    args = ci.Args(**REPLAY_ARGS)
    obs_shape, num_actions, _ = ci.probe_envs(args)
    shared = [ci.SharedWeights.share(ci.Agent(obs_shape, num_actions, "minigrid"))]
    path = "replay_actor0.npz"
    received = []

    def checkpoint_after_two_unrolls(net, slot, handles):
        received.append(slot)
        if len(received) == 4:
            handles.checkpoint_request.value += 1

    (tmp_path / "mid").mkdir()
    (tmp_path / "end").mkdir()
    pairs, _, _ = run_actor_loops(
        args, obs_shape, num_actions, shared, 3, tmp_path / "mid", on_pair=checkpoint_after_two_unrolls
    )
    assert saved_new_halves(tmp_path / "mid" / path, {slot: slot_pairs[:2] for slot, slot_pairs in pairs.items()}) == 4
    pairs, _, _ = run_actor_loops(args, obs_shape, num_actions, shared, 2, tmp_path / "end", final_checkpoint=True)
    assert saved_new_halves(tmp_path / "end" / path, pairs) == 4


def test_a_resumed_actor_restores_its_buffer_and_continues_its_stream(tmp_path):
    """Clause R1: an actor of a run started with --resume and --checkpoint-replay loads replay_actor0.npz from the
    checkpoint's folder (a full buffer of 5 unrolls that has seen 12): for each of its first unrolls, the SlotInfo
    buffer size and the replay half are those of a copy of the saved buffer offered the same new unrolls (the
    restored keep/drop and sampling stream, not a fresh one)."""
    args = ci.Args(**{**REPLAY_ARGS, "envs_per_actor": 1, "batch_size": 1})
    obs_shape, num_actions, _ = ci.probe_envs(args)
    T = args.unroll_length
    args.buffer_size = 5 * T
    capacity = ci.buffer_capacity_per_actor(args)
    assert capacity == 5
    saved = ci.ReservoirBuffer(capacity, obs_shape, num_actions, T, np.random.default_rng(123))
    for i in range(12):
        saved.add(unroll_with_id(i, T, obs_shape, num_actions), task=0)
    (tmp_path / "first_run").mkdir()
    saved.save(str(tmp_path / "first_run" / "replay_actor0.npz"))
    args.resume = str(tmp_path / "first_run" / "checkpoint.pt")
    shared = [ci.SharedWeights.share(ci.Agent(obs_shape, num_actions, "minigrid"))]
    pairs, _, _ = run_actor_loops(args, obs_shape, num_actions, shared, 4, tmp_path, start_step=480, resume_step=480)
    twin = ci.ReservoirBuffer(capacity, obs_shape, num_actions, T, np.random.default_rng(0))
    twin.load(str(tmp_path / "first_run" / "replay_actor0.npz"))
    for pair in pairs[0]:
        twin.add({k: pair[k][0].numpy() for k in ci.UNROLL_FIELDS}, 0)
        row = twin.sample()
        assert pair["info"]["buffer_unrolls"] == twin.size == capacity
        for k in ci.UNROLL_FIELDS:
            assert np.array_equal(pair[k][1].numpy(), twin.data[k][row].astype(pair[k].numpy().dtype)), k


def test_actor_streams_depend_on_the_resume_not_on_the_step_an_actor_starts_at(tmp_path, monkeypatch):
    """Clause R2: a training actor of a new run plays the same first unroll whether it starts at step 0 or late, at
    step 480 (one actor: the torch stream is not shared between threads); in a run resumed at step 480 it plays
    another one, the same whether it starts at 480 or late, at 720; resumed at step 960, another again. A test actor
    of a new run builds and resets its env with the same seeds every time; resumed, with others."""
    args = ci.Args(
        env_ids=["MiniGrid-LavaGapS5-v0"], num_actors=1, batch_size=1, unroll_length=10, steps_per_task=10_000, seed=2
    )
    obs_shape, num_actions, _ = ci.probe_envs(args)
    torch.manual_seed(0)
    shared = [ci.SharedWeights.share(ci.Agent(obs_shape, num_actions, "minigrid"))]
    resumed = ci.Args(**{**vars(args), "resume": str(tmp_path / "checkpoint.pt")})
    first_unrolls = []
    starts = ((args, 0, 0), (args, 480, 0), (resumed, 480, 480), (resumed, 720, 480), (resumed, 960, 960))
    for run_args, start_step, resume_step in starts:
        pairs, _, _ = run_actor_loops(
            run_args, obs_shape, num_actions, shared, 1, tmp_path, start_step=start_step, resume_step=resume_step
        )
        first_unrolls.append(pairs[0][0])

    def same(a, b):
        return all(torch.equal(first_unrolls[a][k], first_unrolls[b][k]) for k in ci.UNROLL_FIELDS)

    assert same(0, 1) and same(2, 3)
    assert not same(0, 2) and not same(0, 4) and not same(2, 4)
    built = []

    def make_env(env_id, seed, args, *rest):
        built.append(FixedObservationTask(env_id, seed))
        return built[-1]

    monkeypatch.setattr(ci, "make_env", make_env)
    for run_args, resume_step in ((args, 0), (args, 0), (resumed, 480)):
        stop = threading.Event()
        ci.test_actor_loop(0, 0, run_args, obs_shape, num_actions, shared, resume_step, stop, StopAfter(2, stop))
    seeds = [(task.seed, task.reset_seeds[0]) for task in built]
    assert seeds[0] == seeds[1] and seeds[2][0] != seeds[0][0] and seeds[2][1] != seeds[0][1]
