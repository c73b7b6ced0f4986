"""common/args.py (range checks, the resume rule) and RunLogger's resume mode."""

import dataclasses
import json
import sys
from typing import Literal

import pytest

from common.args import CommonArgs, explicit_flags, require, resume_args
from common.logger import RunLogger, read_metrics


@dataclasses.dataclass
class Args:
    env_id: str = "Pong"
    seed: int = 1
    total_timesteps: int = 1000
    learning_rate: float = 1e-3
    gamma: float = 0.99
    env_ids: tuple = ("a", "b")
    cuda: bool = True
    resume: str | None = None
    mode: str = "sequential"


def test_require_gives_one_error_line():
    require(0 <= 0.99 <= 1, "--gamma must be in [0, 1], got 0.99")
    with pytest.raises(SystemExit) as e:
        require(0 <= 1.5 <= 1, "--gamma must be in [0, 1], got 1.5")
    assert str(e.value) == "error: --gamma must be in [0, 1], got 1.5"


def test_explicit_flags_reads_tyro_style_command_lines():
    fields = [f.name for f in dataclasses.fields(Args)]
    argv = ["--total-timesteps", "5", "--gamma=0.9", "--no-cuda", "--resume", "x.pt", "--unknown", "3", "-h"]
    assert explicit_flags(argv, fields) == {"total_timesteps", "gamma", "cuda", "resume"}


def test_resume_takes_the_checkpoints_flags_and_only_given_ones_override():
    ckpt = dataclasses.asdict(Args(total_timesteps=65536, learning_rate=5e-4, env_ids=["x", "y"], cuda=False))
    ckpt["removed_flag"] = 3  # a flag the script no longer has is ignored
    cli = Args(total_timesteps=200_000, resume="c.pt")  # parsed command line: defaults + given flags
    args, given = resume_args(cli, ["--resume", "c.pt", "--total-timesteps", "200000"], ckpt, fixed=("env_id",))
    assert given == ["total_timesteps"]
    assert args.total_timesteps == 200_000 and args.learning_rate == 5e-4 and args.cuda is False
    assert args.env_ids == ("x", "y") and args.resume == "c.pt"
    args, _ = resume_args(Args(resume="c.pt"), ["--resume", "c.pt"], ckpt, fixed=("env_id",))
    assert args.total_timesteps == 65536  # not the default 1000: the checkpoint's budget


def test_resume_refuses_a_given_flag_that_changes_the_experiment():
    ckpt = dataclasses.asdict(Args(env_id="Pong", env_ids=["a", "b"]))
    with pytest.raises(SystemExit, match="error: --resume: --env-id 'Breakout' differs from the checkpoint's 'Pong'"):
        resume_args(Args(env_id="Breakout"), ["--env-id", "Breakout"], ckpt, fixed=("env_id", "env_ids"))
    args, given = resume_args(Args(env_id="Pong"), ["--env-id", "Pong"], ckpt, fixed=("env_id",))  # same: fine
    assert args.env_id == "Pong" and given == ["env_id"]
    args, _ = resume_args(Args(env_ids=("a", "b")), ["--env-ids", "a", "b"], ckpt, fixed=("env_ids",))
    assert args.env_ids == ("a", "b")  # a list in the checkpoint equals the same tuple


def test_resumed_logger_drops_records_after_the_checkpoint_and_continues_time(tmp_path):
    logger = RunLogger("run", Args(), root=tmp_path, progress=False)
    for step in (100, 200, 300, 400):
        logger.log(step, {"charts/SPS": step})
    logger.close()
    times = {r["global_step"]: r["time"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    logger = RunLogger("run", Args(), root=tmp_path, progress=False, resume_step=250)  # checkpoint at 250
    logger.log(260, {"charts/SPS": 1.0})
    logger.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["global_step"] for r in rows] == [100, 200, 260]
    assert rows[2]["time"] >= times[200] and all(isinstance(json.dumps(r), str) for r in rows)


@dataclasses.dataclass
class DocumentedArgs:
    seed: int = 1
    """seed of the experiment"""
    env_ids: list[str] = dataclasses.field(default_factory=lambda: ["a", "b"])
    """the tasks, in order"""
    mode: Literal["sequential", "simultaneous"] = "sequential"
    """how the tasks are played"""
    cuda: bool = True
    """use CUDA when available"""


def test_cli_returns_the_args_with_their_help_and_one_line_errors(monkeypatch, capsys):
    from common.args import cli

    monkeypatch.setattr(sys, "argv", ["prog", "--seed", "3", "--env-ids", "x", "y", "z", "--no-cuda"])
    args = cli(DocumentedArgs)
    assert args == DocumentedArgs(seed=3, env_ids=["x", "y", "z"], cuda=False)
    monkeypatch.setattr(sys, "argv", ["prog", "--help"])
    with pytest.raises(SystemExit):
        cli(DocumentedArgs)
    out = capsys.readouterr().out
    assert out.index("--seed") < out.index("--env-ids") < out.index("--mode") < out.index("--cuda")
    assert "seed of the experiment" in out and "how the tasks are played" in out
    for argv, needle in [(["--mode", "separate"], "invalid choice 'separate'"), (["--sede", "3"], "--seed")]:
        monkeypatch.setattr(sys, "argv", ["prog", *argv])
        with pytest.raises(SystemExit) as e:
            cli(DocumentedArgs)
        assert str(e.value).startswith("error: ") and needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("script", ["clear_impala", "reactor", "plr_ppo", "vracer_refer"])
def test_every_flag_of_each_script_is_in_exactly_one_resume_class(script):
    """Read off the dataclass, so a flag added tomorrow fails here (and at every start of its script) until it is
    classified; each script's resume test changes every flag of its applied class and reads the value in effect."""
    import importlib

    from common.args import resume_classes

    module = importlib.import_module(script)
    classes = resume_classes(module.Args, module.FIXED_ON_RESUME, module.APPLIED_ON_RESUME, module.RUN_ONLY_ON_RESUME)
    assert sorted(classes) == sorted(f.name for f in dataclasses.fields(module.Args))
    assert classes["seed"] == classes["env_ids" if script == "clear_impala" else "env_id"] == "fixed"


@pytest.mark.parametrize("script", ["clear_impala", "reactor", "plr_ppo", "vracer_refer"])
def test_readme_names_exactly_the_flags_a_resume_refuses(script):
    """README's Conventions say what a resume may change: every flag but the common fixed ones (named in its text) and
    the script's row of the "fixed on resume" table, which must equal the script's FIXED_ON_RESUME, flag for flag."""
    import importlib
    import re
    from pathlib import Path

    from common.args import COMMON_FIXED_ON_RESUME

    module = importlib.import_module(script)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    resume_bullet = readme[readme.index("- **Resume**:") : readme.index("- **Seeding**:")]
    (row,) = [line for line in resume_bullet.splitlines() if line.strip().startswith(f"| `{script}.py` |")]
    listed = re.findall(r"`--([a-zA-Z0-9-]+)`", row)
    assert listed == [name.replace("_", "-") for name in module.FIXED_ON_RESUME]
    common_sentence = resume_bullet[resume_bullet.index("every flag except") :].splitlines()[0]
    assert re.findall(r"`--([a-zA-Z0-9-]+)`", common_sentence) == [name.replace("_", "-") for name in COMMON_FIXED_ON_RESUME]


@dataclasses.dataclass
class ScriptArgs(CommonArgs):
    env_id: str = "Pong"
    env_ids: tuple = ("a", "b")
    mode: str = "sequential"
    gamma: float = 0.99
    learning_rate: float = 1e-3
    total_timesteps: int = 1000


def test_resume_classes_name_an_unclassified_a_doubly_classified_and_an_unknown_flag():
    from common.args import resume_classes

    classes = resume_classes(ScriptArgs, ("env_id", "env_ids", "mode"), ("gamma", "learning_rate", "total_timesteps"), ())
    assert classes["learning_rate"] == "applied" and classes["seed"] == "fixed" and classes["progress"] == "run_only"
    with pytest.raises(TypeError) as e:
        resume_classes(ScriptArgs, ["env_id", "gamma"], ["gamma", "total_timesteps", "nonsense"], ["learning_rate"])
    message = str(e.value)
    assert "env_ids in no class" in message and "mode in no class" in message
    assert "gamma in fixed and applied" in message and "nonsense is not a flag" in message


def test_parse_run_args_refuses_a_changed_fixed_flag_and_applies_the_others(tmp_path, monkeypatch):
    """The whole start of a resumed script: the checkpoint's flags, a changed common fixed flag (--seed) refused in
    one line, a changed applied flag taken."""
    import torch

    from common.args import parse_run_args

    path = tmp_path / "checkpoint.pt"
    saved = dataclasses.asdict(ScriptArgs(exp_name="x", learning_rate=5e-4, seed=7))
    torch.save({"script": "x.py", "args": saved, "global_step": 10, "run_name": "r"}, path)
    classes = (("env_id", "env_ids", "mode"), ("gamma", "learning_rate", "total_timesteps"), ())
    for argv, lr in ((["--resume", str(path)], 5e-4), (["--resume", str(path), "--learning-rate", "1e-4"], 1e-4)):
        monkeypatch.setattr(sys, "argv", ["x.py", *argv])
        args, ckpt, given = parse_run_args(ScriptArgs, "x.py", *classes)
        assert (args.seed, args.learning_rate, ckpt["global_step"]) == (7, lr, 10)
    monkeypatch.setattr(sys, "argv", ["x.py", "--resume", str(path), "--seed", "8"])
    with pytest.raises(SystemExit, match="error: --resume: --seed 8 differs from the checkpoint's 7"):
        parse_run_args(ScriptArgs, "x.py", *classes)


def test_parse_run_args_resumes_a_renamed_flag_under_its_new_name_and_refuses_a_flag_it_no_longer_has(tmp_path, monkeypatch):
    """A checkpoint written before `learning_rate` was renamed (its args say `lr`): the value comes back under the
    new name, and a fixed flag's old value is still compared; a flag the script has under no name: one error line."""
    import torch

    from common.args import parse_run_args

    saved = dataclasses.asdict(ScriptArgs(exp_name="x", learning_rate=5e-4, env_id="Old"))
    saved["lr"] = saved.pop("learning_rate")
    saved["id_of_env"] = saved.pop("env_id")
    path = tmp_path / "checkpoint.pt"
    torch.save({"script": "x.py", "args": saved, "global_step": 10, "run_name": "r"}, path)
    classes = (("env_id", "env_ids", "mode"), ("gamma", "learning_rate", "total_timesteps"), ())
    renamed = {"lr": "learning_rate", "id_of_env": "env_id"}
    monkeypatch.setattr(sys, "argv", ["x.py", "--resume", str(path)])
    args, ckpt, given = parse_run_args(ScriptArgs, "x.py", *classes, renamed=renamed)
    assert (args.learning_rate, args.env_id, given) == (5e-4, "Old", [])
    assert "learning_rate" in ckpt["args"] and "lr" not in ckpt["args"]
    monkeypatch.setattr(sys, "argv", ["x.py", "--resume", str(path), "--env-id", "New"])
    with pytest.raises(SystemExit, match="error: --resume: --env-id 'New' differs from the checkpoint's 'Old'"):
        parse_run_args(ScriptArgs, "x.py", *classes, renamed=renamed)
    monkeypatch.setattr(sys, "argv", ["x.py", "--resume", str(path)])
    with pytest.raises(SystemExit) as e:
        parse_run_args(ScriptArgs, "x.py", *classes, renamed={"lr": "learning_rate"})
    assert str(e.value) == (
        f"error: --resume: {path} was written with --id-of-env, which this script no longer has; resume it with "
        "the version of the script that wrote it"
    )
    with pytest.raises(TypeError, match="RENAMED_FLAGS"):
        parse_run_args(ScriptArgs, "x.py", *classes, renamed={"lr": "no_such_flag", "id_of_env": "env_id"})


def test_metric_averager_means_each_name_over_the_steps_that_added_it_and_starts_over():
    import torch

    from common.logger import MetricAverager

    averager = MetricAverager()
    first = torch.tensor(1.0, requires_grad=True) * 1
    averager.add({"losses/a": first, "charts/b": 2})
    averager.add({"losses/a": torch.tensor(3.0), "charts/b": 4.0, "losses/c": torch.tensor(5.0, dtype=torch.float64)})
    assert len(averager) == 2
    # the caller's tensor is not the sum
    assert float(first.detach()) == 1.0
    assert averager.means() == {"losses/a": 2.0, "charts/b": 3.0, "losses/c": 5.0}
    assert len(averager) == 0 and averager.means() == {}
    averager.add({"losses/a": torch.tensor(0.1)})
    assert averager.means()["losses/a"] == float(torch.tensor(0.1))
