"""torch.distributed scale-out (gloo on the CPU): gradient averaging and merged normalizer statistics across 2 ranks
(fast, no simulator), and, marked slow, the trainers under torchrun: same seed and world size -> same numbers, a
2-rank checkpoint resumes on 2 ranks and on 1, a failing rank ends the job with its own error."""
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import model
import teacher
from conftest import read_log
from test_teacher import LAYOUT, fake_obs, small_args

REPO = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_update(agent, rank_obs, batch_obs, world):
    """The teacher's update on one rank, set up as teacher.main does: normalizer statistics from this rank's
    observations, then DDP (rank 0's weights to every rank) and one PPO step on `batch_obs` through it."""
    torch.manual_seed(0)
    agent.update_norms(rank_obs)
    learner = torch.nn.parallel.DistributedDataParallel(agent, forward_sync_buffers=False) if world > 1 else agent
    opt = torch.optim.SGD(agent.parameters(), lr=0.1)  # Adam would blow float noise on ~0 gradients up to lr
    n = len(batch_obs["critic"])
    g = torch.Generator().manual_seed(3)
    pg, v, _, _ = teacher.ppo_losses(learner, batch_obs, torch.randn(n, 29, generator=g), torch.randn(n, generator=g),
                                     torch.randn(n, generator=g), torch.randn(n, generator=g), torch.zeros(n), 0.2,
                                     False)
    (pg + v).backward()
    opt.step()
    return agent.state_dict()


def rank_obs(rank):
    obs = fake_obs(16, torch.Generator().manual_seed(10 + rank))
    obs["critic"][:, 0] = 9.81  # a constant feature (gravity without DR): its merged variance must stay >= 0
    return obs


def rank_main(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(rank)  # ranks are seeded apart, as in teacher.main: DDP starts them from rank 0's weights
    agent = model.Agent(LAYOUT, small_args())
    state = one_update(agent, rank_obs(rank), fake_obs(32, torch.Generator().manual_seed(99)), world)
    torch.save(state, pathlib.Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_two_ranks_average_gradients_and_merge_normalizer_statistics(tmp_path):
    """Two gloo ranks, each with its own observations for the normalizers and the same minibatch for the loss, end
    with identical weights and statistics, equal to one process that saw both ranks' observations and that batch."""
    mp.spawn(rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # every rank holds the same model
    torch.manual_seed(0)
    single = model.Agent(LAYOUT, small_args())
    both = [rank_obs(r) for r in (0, 1)]
    ref = one_update(single, {k: torch.cat([b[k] for b in both]) for k in both[0]},
                     fake_obs(32, torch.Generator().manual_seed(99)), 1)
    for k in ref:
        assert torch.allclose(r0[k].float(), ref[k].float(), rtol=1e-4, atol=1e-5), k
    assert r0["actor.norms.proprio.count"] == 1e-4 + 2 * 16 * 5  # both ranks' samples counted
    assert (r0["critic_norm.var"] >= 0).all()


# ---------------------------------------------------------------------------------------------------------------------
# Slow: the trainers under torchrun on Genesis (2 ranks x 8 envs).
# ---------------------------------------------------------------------------------------------------------------------
def launch(nproc, script, *flags, expect_ok=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *flags]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if expect_ok:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def first_row(run_dir) -> dict:
    return {k: v[0] for k, v in read_log(run_dir).items()}


@pytest.mark.slow
def test_torchrun_teacher_is_deterministic_and_resumes_on_2_and_on_1_ranks(train_packet, tmp_path):
    per_it = 2 * 8 * 8
    flags = ["--preset", "cpu", "--motions", str(train_packet), "--num-envs", "8", "--num-steps", "8",
             "--minibatch-size", "32", "--no-performance-mode", "--checkpoint-every", "100"]
    for run in ("a", "b"):
        launch(2, "teacher.py", *flags, "--total-env-steps", str(2 * per_it), "--run-dir", str(tmp_path / run))
    a, b = first_row(tmp_path / "a"), first_row(tmp_path / "b")
    for k in ("losses/policy_loss", "losses/value_loss", "charts/mean_reward"):
        assert a[k] == b[k], k  # same seed, same world size -> same numbers
    ckpt = torch.load(tmp_path / "a" / "teacher.pt", weights_only=False)
    assert ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2 and ckpt["global_step"] == 2 * per_it
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    launch(2, "teacher.py", "--preset", "cpu", "--resume", str(tmp_path / "a" / "teacher.pt"), "--total-env-steps",
           str(3 * per_it))
    assert torch.load(tmp_path / "a" / "teacher.pt", weights_only=False)["iteration"] == 3
    # no --preset cpu and no --device: a resumed CPU run stays on the CPU (its checkpoint's device)
    out = subprocess.run([sys.executable, "teacher.py", "--resume", str(tmp_path / "c" / "teacher.pt"),
                          "--total-env-steps", str(2 * per_it + 8 * 8)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    one = torch.load(tmp_path / "c" / "teacher.pt", weights_only=False)
    assert one["iteration"] == 3 and one["world_size"] == 1 and one["global_step"] == 2 * per_it + 8 * 8


@pytest.mark.slow
def test_a_failing_rank_ends_the_job_with_its_own_error(train_packet, tmp_path):
    """Rank 1's env fails while rank 0 goes on to its first collective: the job ends (no hang) with rank 1's error;
    a user error on every rank ends it with the one-line message."""
    script = tmp_path / "rank1_fails.py"
    script.write_text(f"""import os, sys
sys.path.insert(0, {str(REPO)!r})
import runpy
import envs
if os.environ["RANK"] == "1":
    def broken(**kwargs):
        raise RuntimeError("rank 1: the engine did not start")
    envs.make_env = broken
runpy.run_path({str(REPO / 'teacher.py')!r}, run_name="__main__")
""")
    out = launch(2, str(script), "--preset", "cpu", "--motions", str(train_packet), "--num-envs", "8",
                 "--minibatch-size", "64", "--no-performance-mode", "--run-dir", str(tmp_path / "run"), expect_ok=False)
    assert out.returncode != 0 and "rank 1: the engine did not start" in out.stderr
    out = launch(2, "teacher.py", "--preset", "cpu", "--motions", str(tmp_path / "missing.npz"), expect_ok=False)
    assert out.returncode != 0
    assert "error: " + str(tmp_path / "missing.npz") + ": no such motion packet or folder" in out.stderr
