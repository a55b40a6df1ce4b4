"""The paper-scale path on a CUDA GPU: `pytest -m cuda -s` (skipped without CUDA, so CI stays green on CPUs).

Both engines at 4096 envs with DR and the terrain mix, two iterations of the teacher's paper preset and one of the
student's, a blow-up injected on the GPU; each prints its env-steps/s and the peak GPU memory."""
import dataclasses
import math
import time

import pytest
import torch

import envs
import student
import teacher
from conftest import read_log
from test_envs import write_nan_joint_velocity

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SIMS = ["genesis", "isaaclab"]
N = 4096


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30


def engine_or_skip(sim):
    pytest.importorskip("genesis" if sim == "genesis" else "isaaclab")


@pytest.mark.parametrize("sim", SIMS)
def test_4096_envs_step_with_dr_on_the_terrain_mix_and_survive_a_blow_up(sim, train_packet):
    engine_or_skip(sim)
    torch.cuda.reset_peak_memory_stats()
    env = envs.make_env(sim, N, "cuda", train_packet, dr=envs.DR(), terrain="mix", seed=0)
    try:
        obs = env.reset()
        for _ in range(5):  # warm-up (kernel compiles)
            obs = env.step(obs["ref_dof_pos"])[0]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            obs, reward, done, info = env.step(obs["ref_dof_pos"])
        torch.cuda.synchronize()
        rate = N * 20 / (time.perf_counter() - start)
        assert obs["proprio"].is_cuda and torch.isfinite(reward).all()
        before = int(env.nan_resets)
        write_nan_joint_velocity(env, 7)
        obs, reward, done, info = env.step(obs["ref_dof_pos"])
        assert bool(info["nan"][7]) and bool(done[7]) and int(env.nan_resets) == before + 1
        obs, reward, done, info = env.step(obs["ref_dof_pos"])
        assert torch.isfinite(reward).all()
        print(f"\n{sim} CUDA, {N} envs, DR, terrain mix: {rate:,.0f} env-steps/s (PD on the reference), peak GPU "
              f"memory {peak_gib():.1f} GiB")
    finally:
        env.close()


@pytest.mark.parametrize("amp", [False, True])
def test_paper_presets_teacher_two_iterations_student_one(amp, train_packet, tmp_path):
    """teacher.py --num-envs 4096 (the paper preset; Genesis, which fits the lent GPUs) for 2 iterations, then
    student.py --teacher-ckpt for 1."""
    engine_or_skip("genesis")
    torch.cuda.reset_peak_memory_stats()
    per_it = N * teacher.Args().num_steps
    start = time.perf_counter()
    t_path = teacher.main(dataclasses.replace(teacher.Args(), sim="genesis", motions=str(train_packet), amp=amp,
                                              total_env_steps=2 * per_it, run_dir=str(tmp_path / "teacher")))
    log = read_log(tmp_path / "teacher")
    assert log["iteration"] == [1, 2] and all(math.isfinite(v) for v in log["losses/value_loss"])
    print(f"\nteacher paper preset (amp={amp}): {log['charts/SPS'][-1]:,.0f} env-steps/s incl. learning, "
          f"{time.perf_counter() - start:.0f} s for 2 iterations, peak GPU memory {peak_gib():.1f} GiB")
    torch.cuda.reset_peak_memory_stats()
    s_args = student.Args(teacher_ckpt=str(t_path), num_envs=N, amp=amp, total_env_steps=N * student.Args().num_steps,
                          run_dir=str(tmp_path / "student"))
    student.train(s_args)
    s_log = read_log(tmp_path / "student")
    assert s_log["iteration"] == [1] and math.isfinite(s_log["losses/dagger_mse"][0])
    print(f"student paper preset (amp={amp}): {s_log['charts/SPS'][-1]:,.0f} env-steps/s incl. learning, peak GPU "
          f"memory {peak_gib():.1f} GiB")
