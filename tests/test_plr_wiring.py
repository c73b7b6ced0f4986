"""plr_ppo.py's wiring: the MiniGrid network against the authors' MinigridPolicy, the per-domain defaults
(DOMAIN_DEFAULTS), level plumbing through the vector adapters and the CLI's one-line errors."""

import numpy as np
import pytest
import torch

import plr_ppo
from plr_ppo import (
    Args,
    resolve_defaults,
    validate_args,
)

# ----------------------------------------------------------------------------------------------------------------
# MiniGrid network (the authors' MinigridPolicy) and the per-domain defaults
# Expected sizes from the authors' level_replay/model.py MinigridPolicy, by hand (7 actions, 3 input channels):
# conv 2x2 3->16: 3*16*4 + 16 = 208; conv 2x2 16->32: 16*32*4 + 32 = 2,080; conv 2x2 32->F: 32*F*4 + F;
# embedding E = F * ((H-1)//2 - 2) * ((W-1)//2 - 2) (2x2 conv: -1, max-pool: //2, two 2x2 convs: -2);
# actor Linear(E, 64) + head Linear(64, 7): 64 E + 64 and 64*7 + 7 = 455;
# critic Linear(E, 64) + Linear(64, 1): 64 E + 64 and 64 + 1 = 65.
# MultiRoom-N4-Random, 14x14 grid, F = 32: conv3 4,128; E = 32*4*4 = 512; actor 512*64+64 = 32,832 and 64*7+7 = 455;
#   critic 32,832 and 64+1 = 65; total 208 + 2,080 + 4,128 + 32,832 + 455 + 32,832 + 65 = 72,600.
# ObstructedMazeGamut, 19x19 grid, F = 64: conv3 8,256; E = 64*7*7 = 3,136; actor 3,136*64+64 = 200,768 and 455;
#   critic 200,768 and 65; total 208 + 2,080 + 8,256 + 200,768 + 455 + 200,768 + 65 = 412,600.
MINIGRID_NETWORKS = [
    ("MultiRoom-N4-Random", (14, 14, 3), 32, 4, 72_600),
    ("ObstructedMazeGamut-Easy", (19, 19, 3), 64, 7, 412_600),
    ("ObstructedMazeGamut-Medium", (19, 19, 3), 64, 7, 412_600),
]


def authors_minigrid_forward(params, obs):
    """MinigridPolicy.act of the authors' code with functional calls: image_conv (conv 2x2, ReLU, max-pool 2x2, conv 2x2,
    ReLU, conv 2x2, ReLU), flatten, actor_base (Linear, Tanh) and the Categorical head's Linear, critic (Linear, Tanh,
    Linear). params: the 14 weight / bias tensors in that order; obs (B, H, W, 3) as channels-first floats."""
    import torch.nn.functional as F

    conv1_w, conv1_b, conv2_w, conv2_b, conv3_w, conv3_b = params[:6]
    actor_w, actor_b, head_w, head_b, critic_w, critic_b, value_w, value_b = params[6:]
    x = obs.permute(0, 3, 1, 2).float()
    x = F.max_pool2d(F.relu(F.conv2d(x, conv1_w, conv1_b)), 2)
    x = F.relu(F.conv2d(x, conv2_w, conv2_b))
    x = F.relu(F.conv2d(x, conv3_w, conv3_b)).flatten(1)
    logits = F.linear(torch.tanh(F.linear(x, actor_w, actor_b)), head_w, head_b)
    value = F.linear(torch.tanh(F.linear(x, critic_w, critic_b)), value_w, value_b)
    return logits, value.squeeze(-1)


@pytest.mark.parametrize("env_id,obs_shape,final_channels,embedding_side,num_params", MINIGRID_NETWORKS)
def test_minigrid_network_shapes_and_parameter_counts(env_id, obs_shape, final_channels, embedding_side, num_params):
    from common.minigrid_env import make_minigrid_env

    env = make_minigrid_env(env_id)
    assert env.observation_space.shape == obs_shape and env.action_space.n == 7
    env.close()
    agent = plr_ppo.make_agent(resolve_defaults(Args(env_id=env_id)), obs_shape, 7)
    convs = [m for m in agent.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(16, (2, 2)), (32, (2, 2)), (final_channels, (2, 2))]
    assert sum(p.numel() for p in agent.parameters()) == num_params
    embedding = agent.trunk(torch.zeros(1, *obs_shape).permute(0, 3, 1, 2))
    assert embedding.shape == (1, final_channels * embedding_side * embedding_side)
    logits, value = agent(torch.zeros(5, *obs_shape, dtype=torch.uint8))
    assert logits.shape == (5, 7) and value.shape == (5,)


@pytest.mark.parametrize("env_id,obs_shape", [network[:2] for network in MINIGRID_NETWORKS[:2]])
def test_minigrid_network_matches_the_authors_forward(env_id, obs_shape):
    """Tanh hidden layers, ReLU convs and the max-pool: the network equals the authors' forward on its own weights,
    on MiniGrid-like integer cell encodings (0..10) large enough that a ReLU hidden layer would differ from tanh."""
    torch.manual_seed(0)
    agent = plr_ppo.make_agent(resolve_defaults(Args(env_id=env_id)), obs_shape, 7)
    obs = torch.randint(0, 11, (6, *obs_shape), dtype=torch.uint8)
    with torch.no_grad():
        logits, value = agent(obs)
        want_logits, want_value = authors_minigrid_forward(list(agent.parameters()), obs)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(value, want_value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "env_id,num_levels,epochs,lr,rho,bootstrap",
    [
        ("bigfish", 200, 3, 5e-4, 0.1, True),
        ("MultiRoom-N4-Random", 4000, 4, 7e-4, 0.3, False),
        ("ObstructedMazeGamut-Easy", 3000, 4, 7e-4, 0.3, False),
        ("ObstructedMazeGamut-Medium", 6000, 4, 7e-4, 0.3, False),
        ("MiniGrid-Empty-5x5-v0", 1000, 4, 7e-4, 0.3, False),
    ],
)
def test_resolved_defaults_per_domain(env_id, num_levels, epochs, lr, rho, bootstrap):
    """Table 3 / App. A.2 per domain; a MiniGrid timeout terminates (authors' code), a Procgen one bootstraps."""
    args = resolve_defaults(Args(env_id=env_id))
    resolved = (args.num_train_levels, args.update_epochs, args.learning_rate, args.plr_staleness_coef)
    assert resolved == (num_levels, epochs, pytest.approx(lr), pytest.approx(rho))
    assert args.bootstrap_truncation is bootstrap
    # flags given on the command line are kept, including 0 / False
    given = dict(
        num_train_levels=0, update_epochs=7, learning_rate=1e-3, plr_staleness_coef=0.0, bootstrap_truncation=not bootstrap
    )
    args = resolve_defaults(Args(env_id=env_id, **given))
    assert {k: getattr(args, k) for k in given} == given


# |Λ_train| of the paper's MiniGrid envs (App. A.2), as the sentinel rule had them
MINIGRID_PAPER_LEVELS = {"MultiRoom-N4-Random": 4000, "ObstructedMazeGamut-Easy": 3000, "ObstructedMazeGamut-Medium": 6000}


def sentinel_resolve_defaults(args):
    """resolve_defaults as it was before DOMAIN_DEFAULTS (the reference the table must reproduce): the flags' -1 / None
    sentinels filled with the paper's per-domain values."""
    procgen = plr_ppo.is_procgen(args.env_id)
    paper = {
        "num_train_levels": 200 if procgen else MINIGRID_PAPER_LEVELS.get(args.env_id, 1000),
        "update_epochs": 3 if procgen else 4,
        "learning_rate": 5e-4 if procgen else 7e-4,
        "plr_staleness_coef": 0.1 if procgen else 0.3,
        "bootstrap_truncation": procgen,
    }
    for name, value in paper.items():
        if getattr(args, name) is None or getattr(args, name) == -1:
            setattr(args, name, value)
    return args


# the sentinel defaults of the per-domain flags before DOMAIN_DEFAULTS
SENTINELS = dict(num_train_levels=-1, update_epochs=-1, learning_rate=-1.0, plr_staleness_coef=-1.0, bootstrap_truncation=None)


def every_accepted_env_id():
    """Each env family the script accepts: every Procgen game, the paper's MiniGrid envs, and every registered MiniGrid
    id, with and without its `MiniGrid-` prefix."""
    import gymnasium as gym

    from common.procgen_env import PROCGEN_GAMES

    registered = sorted(name for name in gym.registry if name.startswith("MiniGrid-"))
    short = [name[len("MiniGrid-") :] for name in registered]
    return [*PROCGEN_GAMES, *plr_ppo.MINIGRID_TRAIN_LEVELS, *registered, *short]


def test_the_domain_table_resolves_to_the_sentinel_rules_values():
    """For every accepted env id, the per-domain flags left out resolve to exactly the values (and types) the sentinel
    rule gave, and every other flag is untouched; flags given (0 and False included) are kept by both."""
    env_ids = every_accepted_env_id()
    assert len(env_ids) > 40
    for env_id in env_ids:
        plr_ppo.validate_args(resolve_defaults(Args(env_id=env_id)))
        resolved = vars(resolve_defaults(Args(env_id=env_id)))
        want = vars(sentinel_resolve_defaults(Args(env_id=env_id, **SENTINELS)))
        assert resolved == want, env_id
        assert [type(value) for value in resolved.values()] == [type(value) for value in want.values()], env_id
        given = dict(
            num_train_levels=0, update_epochs=7, learning_rate=1e-3, plr_staleness_coef=0.0, bootstrap_truncation=False
        )
        assert vars(resolve_defaults(Args(env_id=env_id, **given))) == vars(
            sentinel_resolve_defaults(Args(env_id=env_id, **given))
        )


def field_docstrings(cls):
    """{field: the docstring under it} of a dataclass in plr_ppo.py, read from the source (what --help shows)."""
    import ast
    import inspect

    (node,) = ast.parse(inspect.getsource(cls)).body
    docs = {}
    for field, doc in zip(node.body, node.body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


def test_each_per_domain_flag_defaults_to_none_and_its_help_shows_the_table():
    """Every flag of DOMAIN_DEFAULTS defaults to None and its help text says `Default: per domain: Procgen V (...),
    MiniGrid V (...)` with the table's values (the paper's MiniGrid envs' |Λ_train| too), so that --help and the file
    show the real values, not a sentinel."""
    docs = field_docstrings(Args)
    procgen = plr_ppo.DOMAIN_DEFAULTS["procgen"]
    minigrid = plr_ppo.DOMAIN_DEFAULTS["minigrid"]
    assert set(procgen) == set(minigrid)
    for name in procgen:
        assert getattr(Args(), name) is None, name
        doc = docs[name]
        assert "Default: per domain: Procgen " in doc, name
        for domain, value in (("Procgen", procgen[name]), ("MiniGrid", minigrid[name])):
            shown = doc.split(f"{domain} ", 1)[1].split(" ", 1)[0].rstrip(",")
            parsed = shown == "True" if isinstance(value, bool) else type(value)(float(shown))
            assert parsed == value, (name, domain, shown)
    for env_id, num_levels in plr_ppo.MINIGRID_TRAIN_LEVELS.items():
        assert f"{env_id} {num_levels}" in docs["num_train_levels"]


# ----------------------------------------------------------------------------------------------------------------
# Level plumbing through the vector adapters
def _check_plumbing(envs, max_steps, min_ends=2):
    chosen = iter(range(100, 100_000, 7))
    returned = {}

    def next_level(i):
        returned[i] = next(chosen)
        return returned[i]

    envs.reset([1, 2])
    prev = np.array([1, 2])
    ends = 0
    for _ in range(max_steps):
        returned.clear()
        _, _, term, trunc, info = envs.step(np.zeros(2, int), next_level=next_level)
        np.testing.assert_array_equal(info["level_seed"], prev)  # transitions are played on the current level
        done = term | trunc
        assert set(returned) == set(np.flatnonzero(done).tolist())
        for i, lvl in returned.items():  # after an episode end each env is on the level the sampler returned
            assert info["next_level_seed"][i] == lvl and envs.levels[i] == lvl
        prev = info["next_level_seed"]
        ends += int(done.sum())
        if ends >= min_ends:
            break
    assert ends >= min_ends


def test_level_plumbing_minigrid_and_procgen():
    from common.minigrid_env import MiniGridVecEnv
    from common.procgen_env import ProcgenVecEnv

    mg = MiniGridVecEnv("MiniGrid-Empty-5x5-v0", 2, num_workers=1, max_steps=3)
    try:
        _check_plumbing(mg, 20, min_ends=6)
    finally:
        mg.close()
    pg = ProcgenVecEnv("bigfish", 2, num_threads=0)
    try:
        _check_plumbing(pg, 600)
    finally:
        pg.close()


# ----------------------------------------------------------------------------------------------------------------
# CLI validation
@pytest.mark.parametrize(
    "flags,needle",
    [
        (dict(env_id="nope"), "unknown MiniGrid env id"),
        (dict(plr_temperature=0.0), "--plr-temperature must be > 0"),
        (dict(plr_staleness_coef=1.5), "--plr-staleness-coef must be in [0, 1], got 1.5"),
        (dict(num_train_levels=2**31), "--num-train-levels"),
        (dict(num_train_levels=0), "needs --plr-replay-schedule fixed"),
        (dict(num_envs=3, num_steps=5, num_minibatches=2), "divisible"),
        (dict(num_workers=-1), "--num-workers must be >= 0"),
    ],
)
def test_validate_args_one_line(flags, needle):
    """The ranges, then the checks between flags (in-process; the subprocess cases are in tests/test_lifecycle.py)."""
    args = resolve_defaults(Args(**flags))
    with pytest.raises(SystemExit) as e:
        validate_args(args)
    msg = str(e.value)
    assert msg.startswith("error: ") and needle in msg and "\n" not in msg
