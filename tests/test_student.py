"""student.py: the DAgger regression, the shared HCDR, checkpoints, the teacher checks and the ONNX export on
synthetic observations (fast), and, marked slow, a short distillation on one real clip with one shared Genesis env."""
from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import envs  # noqa: E402
import model  # noqa: E402
import ssjr  # noqa: E402
import export  # noqa: E402
import student  # noqa: E402
import teacher  # noqa: E402
from conftest import read_log  # noqa: E402

J = len(ssjr.KEYPOINT_NAMES)
LAYOUT = {"proprio": [5, 535], "future": [8, 569], "ref_dof_pos": [29], "terrain": [121], "history": [16, 93],
          "history_mask": [16], "student_proprio": [8, 93], "student_keypoints": [12, 3 * J], "psi": [1, 11],
          "critic": [535 + 8 * 569 + 121 + len(envs.PSI_KEYS)]}  # the envs.py observation table
TEACHER_CPU = teacher.PRESETS["cpu"]
CPU = dataclasses.replace(student.PRESETS["cpu"], **{k: getattr(TEACHER_CPU, k) for k in student.MODEL_SIZES})


def random_obs(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    obs = {k: torch.randn(n, *shape, generator=g) for k, shape in LAYOUT.items() if k != "history_mask"}
    obs["history_mask"] = torch.rand(n, 16, generator=g) > 0.3
    obs["history_mask"][0] = False  # a fresh episode: no history at all
    return obs


def perturb_heads(module: torch.nn.Module, seed: int = 1):
    """TokenPolicy starts with a zero head (constant output): give it weights so outputs depend on the inputs."""
    torch.manual_seed(seed)
    for m in module.modules():
        if isinstance(m, model.TokenPolicy):
            torch.nn.init.normal_(m.head[-1].weight, std=0.05)
            torch.nn.init.normal_(m.head[-1].bias, std=0.05)


def make_teacher_ckpt(path, layout=LAYOUT, env_cfg=None, perturb=True) -> pathlib.Path:
    torch.manual_seed(0)
    agent = model.Agent(layout, TEACHER_CPU)
    if perturb:
        perturb_heads(agent)
    torch.save({
        "kind": "teacher", "args": dataclasses.asdict(TEACHER_CPU), "obs_layout": layout, "model": agent.state_dict(),
        "env_cfg": env_cfg or {"sim": "genesis", "motions": "x.npz", "terrain": "flat", "dr": "default"},
        "global_step": 0}, path)
    return pathlib.Path(path)


def make_student_ckpt(path, args=CPU) -> tuple[pathlib.Path, student.StudentPolicy]:
    torch.manual_seed(0)
    policy = student.StudentPolicy(LAYOUT, args)
    perturb_heads(policy)
    policy.actor.update_norms(random_obs(64, seed=5))
    policy.alpha_0.normal_(0.0, 0.3)
    torch.save({
        "kind": "student", "args": dataclasses.asdict(args), "obs_layout": LAYOUT, "model": policy.state_dict(),
        "env_cfg": {"sim": "genesis", "motions": "x.npz", "terrain": "flat", "dr": "default"}, "global_step": 7,
        "rng": []}, path)
    return pathlib.Path(path), policy.eval()


# ---------------------------------------------------------------------------------------------------------------------
# Fast: no simulator.
# ---------------------------------------------------------------------------------------------------------------------
def test_dagger_loss_decreases_on_a_fixed_batch():
    torch.manual_seed(0)
    agent = model.Agent(LAYOUT, TEACHER_CPU)
    perturb_heads(agent)
    obs = random_obs(128)
    # as in the env, the reference joint positions (the centre of the teacher's action) show in the keypoints
    obs["ref_dof_pos"] = 0.5 * obs["student_keypoints"][:, -1, :29]
    agent.actor.update_norms(obs)
    labels = agent.act(obs)
    policy = student.StudentPolicy(LAYOUT, CPU)
    policy.actor.update_norms(obs)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    args = dataclasses.replace(CPU, update_epochs=40, minibatch_size=32)
    batch = {k: obs[k] for k in student.STUDENT_OBS}
    losses = student.dagger_update(policy, optimizer, batch, labels, len(labels), args)
    assert losses[-1] < 0.2 * losses[0], losses
    assert not policy.training  # back in eval mode for the next rollout


def test_checkpoint_round_trip(tmp_path):
    path, policy = make_student_ckpt(tmp_path / "s.pt")
    loaded, ckpt = student.load_policy(path)
    obs = random_obs(9, seed=3)
    assert ckpt["kind"] == "student" and not loaded.training
    torch.testing.assert_close(loaded.act(obs), policy.act(obs), rtol=0, atol=0)
    assert torch.equal(loaded.alpha_0, policy.alpha_0)
    import evaluate  # evaluate.py dispatches on the checkpoint kind
    via_eval, _ = evaluate.load_policy(path, "cpu")
    torch.testing.assert_close(via_eval.act(obs), policy.act(obs), rtol=0, atol=0)


def test_bad_teacher_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(ssjr.InputError, match="nope.pt: checkpoint not found"):
        model.load_teacher(tmp_path / "nope.pt", "cpu")
    s_path, _ = make_student_ckpt(tmp_path / "s.pt")
    with pytest.raises(ValueError, match="s.pt: expected a teacher checkpoint, found 'student'"):
        student.train(dataclasses.replace(CPU, teacher_ckpt=str(s_path)))
    with pytest.raises(ValueError, match="--teacher-ckpt: give the teacher to distil"):
        student.train(dataclasses.replace(CPU, teacher_ckpt=""))
    t_path = make_teacher_ckpt(tmp_path / "t.pt")
    with pytest.raises(ValueError, match="t.pt: expected a student checkpoint, found 'teacher'"):
        student.load_policy(t_path)
    with pytest.raises(ValueError, match="t.pt: expected a student"):  # train --resume with a teacher checkpoint
        student.train(dataclasses.replace(CPU, teacher_ckpt=str(t_path), resume=str(t_path)))
    # a student resumed after its teacher's file was overwritten by a longer teacher run
    distilled = torch.load(s_path, weights_only=False)
    distilled["args"]["teacher_ckpt"], distilled["teacher"] = str(t_path), {"path": str(t_path), "global_step": 5}
    torch.save(distilled, s_path)
    with pytest.raises(ValueError, match=r"s.pt: distilled from .*t.pt at teacher step 5, but that file now holds "
                                         r"step 0"):
        student.train(dataclasses.replace(CPU, resume=str(s_path)))


def test_env_cfg_comes_from_the_teacher():
    tckpt = {"env_cfg": {"sim": "genesis", "motions": "a", "terrain": "mix", "dr": "default"}}
    assert student.student_env_cfg(CPU, tckpt) == tckpt["env_cfg"]
    other = student.student_env_cfg(dataclasses.replace(CPU, sim="isaaclab", motions="b"), tckpt)
    assert other == {"sim": "isaaclab", "motions": "b", "terrain": "mix", "dr": "default"}


def test_the_student_shares_the_teachers_hcdr(tmp_path):
    agent, _ = model.load_teacher(make_teacher_ckpt(tmp_path / "t.pt"), "cpu")
    agent.actor.history_norm.update(torch.randn(100, 93))
    policy = student.StudentPolicy(LAYOUT, CPU)  # sizes: the teacher's
    student.share_teacher_hcdr(policy, agent, "t.pt")
    for k, v in agent.actor.hcdr.state_dict().items():
        assert torch.equal(policy.actor.hcdr.state_dict()[k], v)
    obs = random_obs(8)
    torch.testing.assert_close(policy.actor.hcdr(policy.actor.history_norm(obs["history"]), obs["history_mask"]),
                               agent.actor.hcdr(agent.actor.history_norm(obs["history"]), obs["history_mask"]))
    assert all(p.requires_grad for p in policy.actor.hcdr.parameters())  # --hcdr finetune: it trains on
    # --hcdr teacher, frozen: no gradient and no normalizer update reach it; the rest of the student learns
    policy = student.StudentPolicy(LAYOUT, dataclasses.replace(CPU, hcdr="teacher"))
    student.share_teacher_hcdr(policy, agent, "t.pt")
    mean = policy.actor.history_norm.mean.clone()
    policy.actor.update_norms(random_obs(64, seed=4))
    assert torch.equal(policy.actor.history_norm.mean, mean)
    assert not any(p.requires_grad for p in policy.actor.hcdr.parameters())
    assert all(p.requires_grad for p in policy.actor.head.parameters())
    with pytest.raises(ValueError, match="t.pt: the teacher's HCDR has other sizes"):
        student.share_teacher_hcdr(student.StudentPolicy(LAYOUT, dataclasses.replace(CPU, hcdr_dim=16)), agent,
                                   "t.pt")


def deploy_inputs(obs: dict, keypoints_w: torch.Tensor, root_pos_w: torch.Tensor, root_quat_w: torch.Tensor) -> dict:
    return {"student_proprio": obs["student_proprio"], "keypoints_w": keypoints_w, "root_pos_w": root_pos_w,
            "root_quat_w": root_quat_w, "terrain": obs["terrain"], "history": obs["history"],
            "history_mask": obs["history_mask"]}


@pytest.mark.parametrize("hcdr", ["teacher", "none"])
def test_onnx_export_matches_pytorch(tmp_path, hcdr):
    import json

    import onnx
    import onnxruntime as ort
    path, policy = make_student_ckpt(tmp_path / "s.pt", dataclasses.replace(CPU, hcdr=hcdr))
    out = export.export(export.Args(ckpt=str(path), onnx=str(tmp_path / "s.onnx")))
    meta = {p.key: json.loads(p.value) for p in onnx.load(str(out)).metadata_props}
    session = ort.InferenceSession(str(out))
    names = [i.name for i in session.get_inputs()]
    assert names == list(meta["inputs"])
    assert names == list(export.DEPLOY_INPUTS)[:5 if hcdr == "none" else 7]
    assert meta["dof_names"] == list(ssjr.DOF_NAMES) and meta["control_dt_s"] == envs.CONTROL_DT_S
    for n, seed in ((1, 0), (7, 1), (64, 2)):  # dynamic batch
        obs = random_obs(n, seed)
        g = torch.Generator().manual_seed(seed)
        kp_w, root_pos = torch.randn(n, 12, J, 3, generator=g), torch.randn(n, 3, generator=g)
        root_quat = ssjr.quat_normalize(torch.randn(n, 4, generator=g))
        obs["student_keypoints"] = ssjr.keypoint_command(kp_w, root_pos, root_quat)
        inputs = deploy_inputs(obs, kp_w, root_pos, root_quat)
        alpha, y = session.run(None, {k: inputs[k].numpy() for k in names})
        np.testing.assert_allclose(y, obs["student_keypoints"].numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(alpha, policy.act(obs).numpy(), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Slow: one Genesis env (16 envs, one real clip) shared by the module; the teacher is an untrained model.Agent whose
# zero head makes alpha_1 = the reference joint positions: a fixed expert the student must infer from its keypoints.
# ---------------------------------------------------------------------------------------------------------------------
N_ENVS = 16


@pytest.fixture(scope="module")
def sim_setup(train_packet, tmp_path_factory):
    cfg = {"sim": "genesis", "motions": str(train_packet), "terrain": "flat", "dr": "default"}
    env = envs.make_env(**cfg, num_envs=N_ENVS, device="cpu", seed=0)
    env.reset()
    tmp = tmp_path_factory.mktemp("student")
    t_path = make_teacher_ckpt(tmp / "teacher.pt", env.obs_layout, cfg, perturb=False)
    args = dataclasses.replace(CPU, teacher_ckpt=str(t_path), num_envs=N_ENVS, num_steps=24,
                               total_env_steps=N_ENVS * 24 * 8, torch_threads=1, checkpoint_every=4,
                               run_dir=str(tmp / "run"), update_epochs=6, minibatch_size=128)  # 18 steps/iteration
    return env, t_path, args


@pytest.fixture(scope="module")
def trained(sim_setup) -> pathlib.Path:
    """The short distillation run (8 iterations of 16 envs x 24 steps) every slow test starts from."""
    env, _, args = sim_setup
    return student.train(args, env=env)


def clean_action_mse(env, policy, agent, steps=24) -> float:
    """MSE(alpha_2, alpha_1) on the states the (noise-free) student visits."""
    obs, errs = env.reset(), []
    for _ in range(steps):
        with torch.no_grad():
            a2, a1 = policy.act(obs), agent.act(obs)
        errs.append((a2 - a1).pow(2).mean().item())
        obs = env.step(a2)[0]
    return float(np.mean(errs))


@pytest.mark.slow
def test_short_distillation_reduces_action_mse(sim_setup, trained):
    env, t_path, args = sim_setup
    mse = read_log(args.run_dir)["charts/action_mse"]
    assert len(mse) == 8 and np.isfinite(mse).all()
    assert np.mean(mse[-2:]) < 0.5 * mse[0], mse  # rollout MSE to the teacher on the student's own states
    agent, _ = model.load_teacher(t_path, "cpu")
    policy, ckpt = student.load_policy(trained)
    untrained = copy.deepcopy(policy)  # the same normalizers, the initial zero head: alpha_2 = alpha_0
    torch.nn.init.zeros_(untrained.actor.head[-1].weight)
    torch.nn.init.zeros_(untrained.actor.head[-1].bias)
    before, after = clean_action_mse(env, untrained, agent), clean_action_mse(env, policy, agent)
    assert after < 0.5 * before, (before, after)
    log = read_log(args.run_dir)  # the rollouts' tracking figures (success: NaN while no episode ended)
    success, g_mpjpe_mm = log["charts/success_rate"], log["charts/gt_err_mm"]
    assert all(0.0 <= s <= 1.0 for s in success if s == s) and all(0 < g < 1000 for g in g_mpjpe_mm), log
    print(f"\nrollout action MSE per iteration {np.round(mse, 4).tolist()}; clean MSE {before:.4f} -> {after:.4f}; "
          f"success {np.round(success, 2).tolist()}, g-mpjpe {np.round(g_mpjpe_mm).tolist()} mm")
    assert ckpt["kind"] == "student" and ckpt["global_step"] == N_ENVS * 24 * 8
    assert ckpt["env_cfg"] == torch.load(t_path, weights_only=False)["env_cfg"]
    assert torch.equal(policy.alpha_0, env.motions.mean_dof_pos)  # nominal pose of the motions


@pytest.mark.slow
def test_resume_continues_the_run(sim_setup, trained):
    env, _, args = sim_setup
    path = trained
    saved = torch.load(path, weights_only=False)
    # same budget: nothing to do; the checkpoint is written back unchanged (model, optimizer, counters)
    student.train(dataclasses.replace(CPU, resume=str(path), total_env_steps=saved["global_step"]), env=env)
    again = torch.load(path, weights_only=False)
    assert again["global_step"] == saved["global_step"]
    assert {**again["args"], "resume": ""} == saved["args"]  # only the resume path is new
    assert all(torch.equal(again["model"][k], v) for k, v in saved["model"].items())
    # a larger budget: two more iterations from where it stopped, same run folder and settings
    more = saved["global_step"] + 2 * N_ENVS * 24
    student.train(dataclasses.replace(CPU, resume=str(path), total_env_steps=more), env=env)
    resumed = torch.load(path, weights_only=False)
    assert resumed["global_step"] == more and resumed["iteration"] == saved["iteration"] + 2
    assert resumed["args"]["total_env_steps"] == more and resumed["args"]["lr"] == args.lr
    assert any(not torch.equal(resumed["model"][k], v) for k, v in saved["model"].items())


@pytest.mark.slow
def test_teacher_with_another_observation_layout_is_rejected(sim_setup, tmp_path):
    env, _, args = sim_setup
    layout = {**env.obs_layout, "future": [8, 500]}
    bad = make_teacher_ckpt(tmp_path / "old_teacher.pt", layout, perturb=False)
    with pytest.raises(ValueError, match="old_teacher.pt: observation layout mismatch for 'future'"):
        student.train(dataclasses.replace(args, teacher_ckpt=str(bad), run_dir=str(tmp_path / "r")), env=env)
    # the teacher's critic observation plays no part in distillation: a teacher whose critic differs is fine
    other_critic = make_teacher_ckpt(tmp_path / "t2.pt", {**env.obs_layout, "critic": [99]}, perturb=False)
    out = student.train(dataclasses.replace(args, teacher_ckpt=str(other_critic), total_env_steps=0,
                                            run_dir=str(tmp_path / "r2")), env=env)
    assert out == tmp_path / "r2" / "student.pt" and not out.exists()  # accepted; a 0-step budget saves nothing


@pytest.mark.slow
def test_env_evaluate_and_export_read_one_keypoint_command(train_packet, tmp_path):
    """An evaluation env (evaluate.opened_env) and the ONNX graph compute Y_t from the same state through
    ssjr.keypoint_command: the command's world keypoints and the robot's root pose."""
    import evaluate
    import onnxruntime as ort
    path, policy = make_student_ckpt(tmp_path / "s.pt")
    session = ort.InferenceSession(str(export.export(export.Args(ckpt=str(path), onnx=str(tmp_path / "s.onnx")))))
    env_cfg = {"sim": "genesis", "motions": str(train_packet), "terrain": "flat", "dr": "default"}
    with evaluate.opened_env(env_cfg, evaluate.parse_setting("genesis", "genesis"), [train_packet], 2, "cpu",
                             seed=0) as env:
        obs = env.reset()
        for _ in range(5):
            obs = env.step(obs["ref_dof_pos"])[0]
        pos, quat = env.sim.body_state()[:2]
        window = env.STUDENT_PAST + env.STUDENT_FUTURE  # the command's frames t-7..t+4
        kp_w = env.reference(env.window_steps)["body_pos"][:, :window, env.keypoint_ids]
        y = ssjr.keypoint_command(kp_w, pos[:, 0], quat[:, 0])
        torch.testing.assert_close(obs["student_keypoints"], y, rtol=0, atol=1e-6)
        inputs = deploy_inputs(obs, kp_w, pos[:, 0], quat[:, 0])
        alpha, y_onnx = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        np.testing.assert_allclose(y_onnx, y.numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(alpha, policy.act(obs).numpy(), rtol=0, atol=1e-5)


def test_a_crash_keeps_the_last_finished_iteration(tmp_path):
    """An exception in the DAgger loop (the env's, in iteration 3) still writes the checkpoint: iteration 2."""
    from conftest import FakeEnv
    t_path = make_teacher_ckpt(tmp_path / "teacher.pt")
    args = dataclasses.replace(CPU, teacher_ckpt=str(t_path), num_envs=8, num_steps=4, minibatch_size=16,
                               total_env_steps=10 * 32, checkpoint_every=100, torch_threads=1,
                               run_dir=str(tmp_path / "run"))
    with pytest.raises(RuntimeError, match="the engine died"):
        student.train(args, env=FakeEnv(LAYOUT, 8, crash_at=2 * 4 + 3))
    ckpt = torch.load(tmp_path / "run" / "student.pt", weights_only=False)
    assert ckpt["kind"] == "student" and ckpt["iteration"] == 2 and ckpt["global_step"] == 2 * 32


def test_action_noise_moves_the_executed_targets(tmp_path):
    """--action-std: the env receives the student's targets plus N(0, std^2) noise on every joint."""
    from conftest import FakeEnv

    class Recording(FakeEnv):
        def step(self, alpha):
            self.sent.append(alpha.clone())
            return super().step(alpha)
    t_path = make_teacher_ckpt(tmp_path / "teacher.pt")
    sent = {}
    for std in (0.0, 0.1):
        env = Recording(LAYOUT, 8)
        env.sent = sent[std] = []
        args = dataclasses.replace(CPU, teacher_ckpt=str(t_path), num_envs=8, num_steps=4, minibatch_size=16,
                                   total_env_steps=32, torch_threads=1, action_std=std,
                                   run_dir=str(tmp_path / f"{std}"))
        student.train(args, env=env)
    noise = sent[0.1][0] - sent[0.0][0]  # same seed: the same first observation and student, the same clean targets
    assert 0.07 < noise.std() < 0.13 and abs(noise.mean()) < 0.03


@pytest.mark.slow
def test_stage_two_runs_from_its_own_files(train_packet, tmp_path):
    """Stage II copied into another project: a folder with only student.py, model.py, envs.py, ssjr.py, hcdr.py, the
    MuJoCo scene, one motion packet and a teacher checkpoint (no teacher.py, nothing downloaded) distils a student."""
    repo = pathlib.Path(__file__).resolve().parents[1]
    for name in ("student.py", "model.py", "envs.py", "ssjr.py", "hcdr.py", "g1_scene.xml", "models/teacher.pt"):
        shutil.copy(repo / name, tmp_path)
    shutil.copy(train_packet, tmp_path / "clip.npz")
    out = subprocess.run([sys.executable, "student.py", "--preset", "cpu", "--teacher-ckpt", "teacher.pt", "--sim",
                          "mujoco", "--motions", "clip.npz", "--num-envs", "8", "--num-steps", "4", "--minibatch-size",
                          "16", "--total-env-steps", "96", "--run-dir", "run"], cwd=tmp_path, capture_output=True,
                         text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "downloading" not in out.stderr and not (tmp_path / "assets").exists()
    ckpt = torch.load(tmp_path / "run" / "student.pt", weights_only=False)
    assert ckpt["iteration"] == 3 and ckpt["env_cfg"]["sim"] == "mujoco"
    assert sorted(read_log(tmp_path / "run")["iteration"]) == [1, 2, 3]
