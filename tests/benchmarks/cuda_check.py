"""CUDA check of the four scripts, for a machine with a GPU (the CI and development machines have none):

1. each script's tiny run (tests/test_lifecycle.py's TINY + SHORT flags, without --no-cuda) with the learner on CUDA,
   then `--resume` of its checkpoint on CUDA and, from a copy, on the CPU (`--no-cuda`): each completes past the
   checkpoint's step; the learner's peak CUDA memory is above 32 MiB on CUDA (more than its weights, gradients and
   Adam state could take) and 0 on the CPU;
2. Reactor's learner as `make_learner` builds it (fused Adam, fused LSTM on cuDNN) against the same weights on the
   CPU: outputs and gradients with episode starts inside the sequences (a one-frame piece among them), the LSTM states
   after a one-frame call (acting); `reactor_loss` (loss, priorities, gradients) for Reactor, ND and TISLR on one
   batch with unequal IS weights.

    python tests/benchmarks/cuda_check.py [--out DIR]   # needs requirements.txt's packages (any CUDA torch)

Prints one line per check (ok or FAIL); exits 1 if any failed.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

# imported by every Python process started with this folder on PYTHONPATH: the script's main process (the learner;
# not the actors, not a forkserver, which runs with -c) writes the CUDA memory it allocated to $CUDA_CHECK_FILE at exit
SITECUSTOMIZE = """
import atexit, os, sys
def _report():
    import multiprocessing
    if (multiprocessing.parent_process() is None and sys.argv and sys.argv[0].endswith(".py")
            and "torch" in sys.modules and os.environ.get("CUDA_CHECK_FILE")):
        import torch
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0
        open(os.environ["CUDA_CHECK_FILE"], "w").write(str(peak))
atexit.register(_report)
"""
MIN_LEARNER_BYTES = 32 * 2**20  # tiny runs peaked at 65-86 MiB; weights, grads, Adam, target: at most 10 MiB
GPU = torch.device("cuda")
RESUME_TO = {"reactor.py": ["--total-timesteps", "700"]}  # past the replay refill (360 steps), so that it learns


def run_script(script, flags, cwd, hook_dir, tag):
    """Run a script in cwd; returns (error or None, peak CUDA bytes of its main process, its summary.json)."""
    peak_file = os.path.join(cwd, f"cuda_peak_{tag}")
    pythonpath = os.pathsep.join([hook_dir, ROOT, os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1", CUDA_CHECK_FILE=peak_file)
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *flags], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    peak = int(open(peak_file).read()) if os.path.exists(peak_file) else -1
    (run_dir,) = os.listdir(os.path.join(cwd, "runs")) if os.path.isdir(os.path.join(cwd, "runs")) else [None]
    summary_path = os.path.join(cwd, "runs", run_dir or "", "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    if r.returncode != 0 or summary.get("stop_reason") != "completed":
        return f"rc {r.returncode}, stop_reason {summary.get('stop_reason')}\n{r.stderr[-2000:]}", peak, summary
    return None, peak, summary


def check_script(script, out, hook_dir):
    """Run on CUDA, resume on CUDA, resume a copy of the first checkpoint on the CPU: each completes, goes past the
    checkpoint's step, and (on CUDA) its learner allocates more CUDA memory than its weights could."""
    from test_lifecycle import RESUME_TO as LIFECYCLE_RESUME_TO
    from test_lifecycle import SHORT, TINY

    tiny = [f for f in TINY[script] if f != "--no-cuda"]
    resume_to = RESUME_TO.get(script, LIFECYCLE_RESUME_TO[script])
    work = os.path.join(out, script.removesuffix(".py"))
    os.makedirs(work)
    error, peak, _ = run_script(script, [*tiny, *SHORT[script]], work, hook_dir, "first")
    if error or peak < MIN_LEARNER_BYTES:
        return f"FAIL {script} first run on CUDA: CUDA bytes {peak}; {error}"
    (run_dir,) = os.listdir(os.path.join(work, "runs"))
    ckpt = os.path.join(work, "runs", run_dir, "checkpoint.pt")
    ckpt_step = torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]
    cpu_copy = os.path.join(work, "cpu_resume.pt")
    shutil.copy(ckpt, cpu_copy)
    error, peak2, summary2 = run_script(script, ["--resume", ckpt, *resume_to], work, hook_dir, "resume_cuda")
    if error or peak2 < MIN_LEARNER_BYTES or summary2["global_step"] <= ckpt_step:
        return f"FAIL {script} resume on CUDA: CUDA bytes {peak2}, step {summary2.get('global_step')}; {error}"
    error, peak3, summary3 = run_script(script, ["--resume", cpu_copy, *resume_to, "--no-cuda"], work, hook_dir, "resume_cpu")
    if error or peak3 != 0 or summary3["global_step"] <= ckpt_step:
        return (
            f"FAIL {script} resume of a CUDA checkpoint on the CPU: CUDA bytes {peak3}, "
            f"step {summary3.get('global_step')}; {error}"
        )
    return (
        f"ok   {script}: run, CUDA resume, CPU resume, each completed (checkpoint at step {ckpt_step:,}, resumed "
        f"to {summary2['global_step']:,}); learner peak CUDA memory {peak / 2**20:.0f} / {peak2 / 2**20:.0f} MiB"
    )


def assert_same_gradients(net_cpu, net_gpu, what):
    """Every parameter has a gradient on both devices, equal to 1e-4 of the largest entry of that parameter's."""
    for (name, p), q in zip(net_cpu.named_parameters(), net_gpu.parameters()):
        assert p.grad is not None and q.grad is not None, f"{what}: {name} has no gradient"
        scale = p.grad.abs().max().clamp_min(1e-30)
        torch.testing.assert_close(
            q.grad.cpu() / scale, p.grad / scale, rtol=0, atol=1e-4, msg=lambda m: f"{what}, {name}: {m}"
        )


def check_reactor_cuda_vs_cpu():
    """The learner as the main loop builds it (`make_learner`: fused Adam) on CUDA and on the CPU with
    the same weights: network outputs and gradients with episode starts inside the sequences; then reactor_loss
    (loss, priorities, gradients) for Reactor, Reactor ND and TISLR on one batch with unequal IS weights."""
    from reactor_helpers import make_batch

    import reactor

    # compare float32 with float32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    tol = dict(rtol=1e-4, atol=1e-5)
    A = 4
    K = 51
    H = 32
    B = 3
    L = 12
    cpu = torch.device("cpu")
    gpu = GPU

    def learners(args):
        torch.manual_seed(0)
        net_cpu, target_cpu, _ = reactor.make_learner(args, A, (1, 84, 84), cpu)
        net_gpu, target_gpu, _ = reactor.make_learner(args, A, (1, 84, 84), gpu)
        net_gpu.load_state_dict(net_cpu.state_dict())
        target_gpu.load_state_dict(target_cpu.state_dict())
        return net_cpu, target_cpu, net_gpu, target_gpu

    net_cpu, _, net_gpu, _ = learners(reactor.Args(num_atoms=K, lstm_size=H))
    obs = torch.randint(0, 255, (B, L, 1, 84, 84), dtype=torch.uint8)
    first = torch.zeros(B, L, dtype=torch.bool)
    first[0, 0] = True
    first[1, 5] = True
    first[2, 11] = True
    # two starts in a row: a one-frame piece among the padded pieces of one fused call
    first[2, 3] = True
    first[2, 4] = True
    state = tuple(torch.randn(B, H) for _ in range(4))
    out_cpu = net_cpu(obs, first, state)
    out_gpu = net_gpu(obs.to(gpu), first.to(gpu), tuple(s.to(gpu) for s in state))
    for x, y in zip((out_cpu.q, out_cpu.pi), (out_gpu.q, out_gpu.pi)):
        torch.testing.assert_close(y.cpu(), x, **tol)
    for out in (out_cpu, out_gpu):  # gradients through both LSTMs (the policy's sees a detached torso)
        (out.q.square().mean() + out.pi.log().mean()).backward()
    assert_same_gradients(net_cpu, net_gpu, "network")
    # acting's one-frame call returns the LSTM states
    step_cpu = net_cpu(obs[:, :1], first[:, :1], state)
    step_gpu = net_gpu(obs[:, :1].to(gpu), first[:, :1].to(gpu), tuple(s.to(gpu) for s in state))
    for x, y in zip(step_cpu.state, step_gpu.state):
        torch.testing.assert_close(y.cpu(), x, **tol)
    lines = [
        "ok   reactor network on cuDNN = CPU (q, pi, every parameter's gradient; episode starts, a one-frame piece; "
        "a one-frame call's LSTM states)"
    ]

    batch = make_batch(B, 8, A, H, np.random.default_rng(0), pad_at=2)
    batch = batch._replace(obs=batch.obs[:, :, None], weights=torch.tensor([1.0, 0.3, 0.7]))
    batch_gpu = batch._replace(
        **{f: (tuple(s.to(gpu) for s in v) if isinstance(v, tuple) else v.to(gpu)) for f, v in batch._asdict().items()}
    )
    for distributional, pg in ((True, "beta-loo"), (False, "beta-loo"), (True, "tislr")):
        args = reactor.Args(num_atoms=K, lstm_size=H, distributional=distributional, policy_gradient=pg)
        net_cpu, target_cpu, net_gpu, target_gpu = learners(args)
        support = torch.linspace(args.v_min, args.v_max, K)
        loss_cpu, prio_cpu, _ = reactor.reactor_loss(net_cpu, target_cpu, batch, support, args)
        loss_gpu, prio_gpu, _ = reactor.reactor_loss(net_gpu, target_gpu, batch_gpu, support.to(gpu), args)
        torch.testing.assert_close(loss_gpu.cpu(), loss_cpu, **tol)
        torch.testing.assert_close(prio_gpu.cpu(), prio_cpu, **tol)
        loss_cpu.backward()
        loss_gpu.backward()
        what = f"reactor_loss ({'distributional' if distributional else 'ND'}, {pg})"
        assert_same_gradients(net_cpu, net_gpu, what)
        lines.append(f"ok   {what} on CUDA = CPU: loss {loss_cpu.item():.5f}, priorities, gradients")
    return lines


def guarded(check, *args):
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001 (a timeout, a missing run folder: one FAIL line, the other checks go on)
        return f"FAIL {args[0]}: {type(e).__name__}: {e}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary folder)")
    a = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device visible to torch")
    out = a.out or tempfile.mkdtemp(prefix="cuda_check_")
    hook_dir = os.path.join(out, "hook")
    os.makedirs(hook_dir, exist_ok=True)
    open(os.path.join(hook_dir, "sitecustomize.py"), "w").write(SITECUSTOMIZE)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, numpy {np.__version__}, runs under {out}")
    failed = False
    try:
        for line in check_reactor_cuda_vs_cpu():
            print(line, flush=True)
    except Exception as e:  # noqa: BLE001 (a device mismatch raises RuntimeError)
        print(f"FAIL reactor CUDA vs CPU: {type(e).__name__}: {e}", flush=True)
        failed = True
    scripts = ["clear_impala.py", "reactor.py", "plr_ppo.py", "vracer_refer.py"]
    with ThreadPoolExecutor(len(scripts)) as pool:  # the four scripts at once (a GPU machine has the cores)
        for line in pool.map(lambda s: guarded(check_script, s, out, hook_dir), scripts):
            print(line, flush=True)
            failed |= line.startswith("FAIL")
    sys.exit(1 if failed else 0)
