"""CUDA check of the four scripts, for a machine with a GPU (the CI and development machines have none):

1. each script's tiny run (tests/test_lifecycle.py's TINY + SHORT flags, without --no-cuda) with the learner on CUDA,
   then `--resume` of its checkpoint on CUDA and, from a copy, on the CPU (`--no-cuda`): all exit 0, and the main
   process (the learner) allocated CUDA memory while the CPU resume allocated none;
2. Reactor's fused LSTM on cuDNN against the same network on the CPU (outputs, final state, gradients) with episode
   starts inside the sequences, and `reactor_loss` (loss, priorities) on CUDA against the CPU on one batch.

    python tests/benchmarks/cuda_check.py [--out DIR]   # needs requirements.txt's packages (any CUDA torch)

Exits 1 on the first failed check; prints one line per check.
"""
import argparse
import copy
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

# imported by every Python process started with this folder on PYTHONPATH: the main process (the learner) writes the
# CUDA memory it allocated to $CUDA_CHECK_FILE at exit (actors are child processes and write nothing)
SITECUSTOMIZE = """
import atexit, os, sys
def _report():
    import multiprocessing
    if multiprocessing.parent_process() is None and "torch" in sys.modules and os.environ.get("CUDA_CHECK_FILE"):
        import torch
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0
        open(os.environ["CUDA_CHECK_FILE"], "w").write(str(peak))
atexit.register(_report)
"""


def run_script(script, flags, cwd, hook_dir, tag):
    peak_file = os.path.join(cwd, f"cuda_peak_{tag}")
    path = os.pathsep.join([hook_dir, ROOT, os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", CUDA_CHECK_FILE=peak_file)
    r = subprocess.run([sys.executable, os.path.join(ROOT, script), *flags], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)
    peak = int(open(peak_file).read()) if os.path.exists(peak_file) else -1
    return r, peak


def check_script(script, out, hook_dir):
    from test_lifecycle import RESUME_TO, SHORT, TINY
    tiny = [f for f in TINY[script] if f != "--no-cuda"]
    work = os.path.join(out, script.removesuffix(".py"))
    os.makedirs(work)
    r, peak = run_script(script, [*tiny, *SHORT[script]], work, hook_dir, "first")
    if r.returncode != 0 or peak <= 0:
        return f"FAIL {script} first run on CUDA: rc {r.returncode}, CUDA bytes {peak}\n{r.stderr[-2000:]}"
    (run_dir,) = os.listdir(os.path.join(work, "runs"))
    ckpt = os.path.join(work, "runs", run_dir, "checkpoint.pt")
    cpu_copy = os.path.join(work, "cpu_resume.pt")
    shutil.copy(ckpt, cpu_copy)
    r2, peak2 = run_script(script, ["--resume", ckpt, *RESUME_TO[script]], work, hook_dir, "resume_cuda")
    r3, peak3 = run_script(script, ["--resume", cpu_copy, *RESUME_TO[script], "--no-cuda"], work, hook_dir,
                           "resume_cpu")
    if r2.returncode != 0 or peak2 <= 0:
        return f"FAIL {script} resume on CUDA: rc {r2.returncode}, CUDA bytes {peak2}\n{r2.stderr[-2000:]}"
    if r3.returncode != 0 or peak3 != 0:
        return f"FAIL {script} resume of a CUDA checkpoint on the CPU: rc {r3.returncode}, CUDA bytes {peak3}\n" \
               f"{r3.stderr[-2000:]}"
    summary = json.load(open(os.path.join(work, "runs", run_dir, "summary.json")))
    return f"ok   {script}: run, CUDA resume, CPU resume (learner peak CUDA memory {peak / 2**20:.1f} MiB; " \
           f"summary keys {len(summary)})"


def check_reactor_cuda_vs_cpu():
    import reactor
    from test_reactor import make_batch
    lines = []
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # compare float32 with float32
    torch.manual_seed(0)
    A, K, H, B, L = 4, 51, 32, 3, 12
    net_cpu = reactor.ReactorNetwork(A, (1, 84, 84), K, H)
    net_gpu = copy.deepcopy(net_cpu).cuda()
    obs = torch.randint(0, 255, (B, L, 1, 84, 84), dtype=torch.uint8)
    first = torch.zeros(B, L, dtype=torch.bool)
    first[0, 0] = first[1, 5] = first[2, 11] = True
    state = tuple(torch.randn(B, H) for _ in range(4))
    out_cpu = net_cpu(obs, first, state)
    out_gpu = net_gpu(obs.cuda(), first.cuda(), tuple(s.cuda() for s in state))
    tol = dict(rtol=1e-4, atol=1e-5)
    for name in out_cpu._fields:
        a, b = getattr(out_cpu, name), getattr(out_gpu, name)
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            torch.testing.assert_close(y.cpu(), x, **tol)
    for out in (out_cpu, out_gpu):  # gradients through both LSTMs (the policy's sees a detached torso)
        (out.q.square().mean() + out.pi.log().mean() + sum(s.sum() for s in out.state)).backward()
    for (n, p), q in zip(net_cpu.named_parameters(), net_gpu.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-3, atol=1e-4, msg=lambda m: f"{n}: {m}")
    lines.append("ok   reactor network on cuDNN = CPU (outputs q and pi, LSTM states, gradients of every parameter)")

    args = reactor.Args(num_atoms=K, lstm_size=H)
    batch = make_batch(B, 8, A, H, np.random.default_rng(0), pad_at=2)
    batch = batch._replace(obs=batch.obs[:, :, None])
    target_cpu = reactor.ReactorNetwork(A, (1, 84, 84), K, H)
    target_gpu = copy.deepcopy(target_cpu).cuda()
    support = torch.linspace(args.v_min, args.v_max, K)
    loss_cpu, prio_cpu, _ = reactor.reactor_loss(net_cpu, target_cpu, batch, support, args)
    to_gpu = batch._replace(**{f: (tuple(s.cuda() for s in v) if isinstance(v, tuple) else v.cuda())
                               for f, v in batch._asdict().items()})
    loss_gpu, prio_gpu, _ = reactor.reactor_loss(net_gpu, target_gpu, to_gpu, support.cuda(), args)
    torch.testing.assert_close(loss_gpu.cpu(), loss_cpu, **tol)
    torch.testing.assert_close(prio_gpu.cpu(), prio_cpu, **tol)
    lines.append(f"ok   reactor_loss on CUDA = CPU (loss {loss_cpu.item():.5f}, priorities {prio_cpu.tolist()})")
    return lines


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
    try:
        import procgen  # noqa: F401
    except ImportError:  # procgen2 has cp311 wheels only; plr_ppo.py's MiniGrid run never calls it
        os.makedirs(os.path.join(hook_dir, "procgen"), exist_ok=True)
        open(os.path.join(hook_dir, "procgen", "__init__.py"), "w").write("ProcgenGym3Env = None  # stub\n")
        print("procgen not installed: a stub module stands in (plr_ppo.py runs MiniGrid here)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, numpy {np.__version__}, runs under {out}")
    failed = False
    try:
        for line in check_reactor_cuda_vs_cpu():
            print(line, flush=True)
    except AssertionError as e:
        print(f"FAIL reactor CUDA vs CPU: {e}", flush=True)
        failed = True
    scripts = ["clear_impala.py", "reactor.py", "plr_ppo.py", "vracer_refer.py"]
    with ThreadPoolExecutor(len(scripts)) as pool:  # the four scripts at once (a GPU machine has the cores)
        for line in pool.map(lambda s: check_script(s, out, hook_dir), scripts):
            print(line, flush=True)
            failed |= line.startswith("FAIL")
    sys.exit(1 if failed else 0)
