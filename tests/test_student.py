"""student.py: the DAgger regression, observation noise, checkpoints, the teacher checks and the ONNX export on
synthetic observations (fast), and, marked slow, a short distillation on one real clip with one shared Genesis env."""
from __future__ import annotations

import copy
import dataclasses
import pathlib
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import envs  # noqa: E402
import ssjr  # noqa: E402
import student  # noqa: E402
import teacher  # noqa: E402

J = len(ssjr.KEYPOINT_NAMES)
LAYOUT = {"proprio": [5, 535], "future": [8, 569], "ref_dof_pos": [29], "terrain": [121], "history": [16, 93],
          "history_mask": [16], "student_proprio": [8, 93], "student_keypoints": [10, 3 * J],
          "critic": [535 + 8 * 569 + 121 + len(envs.PSI_KEYS)]}  # the envs.py observation table
CPU = student.PRESETS["cpu"]
TEACHER_CPU = teacher.PRESETS["cpu"]


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
        if isinstance(m, teacher.TokenPolicy):
            torch.nn.init.normal_(m.head[-1].weight, std=0.05)
            torch.nn.init.normal_(m.head[-1].bias, std=0.05)


def make_teacher_ckpt(path, layout=LAYOUT, env_cfg=None, perturb=True) -> pathlib.Path:
    torch.manual_seed(0)
    agent = teacher.Agent(layout, TEACHER_CPU)
    if perturb:
        perturb_heads(agent)
    teacher.save_checkpoint(pathlib.Path(path), {
        "kind": "teacher", "args": dataclasses.asdict(TEACHER_CPU), "obs_layout": layout, "model": agent.state_dict(),
        "env_cfg": env_cfg or {"sim": "genesis", "motions": "x.npz", "terrain": "flat", "dr": "default"},
        "global_step": 0})
    return pathlib.Path(path)


def make_student_ckpt(path, args=CPU) -> tuple[pathlib.Path, student.StudentPolicy]:
    torch.manual_seed(0)
    policy = student.StudentPolicy(LAYOUT, args)
    perturb_heads(policy)
    policy.actor.update_norms(random_obs(64, seed=5))
    policy.alpha_0.normal_(0.0, 0.3)
    teacher.save_checkpoint(pathlib.Path(path), {
        "kind": "student", "args": dataclasses.asdict(args), "obs_layout": LAYOUT, "model": policy.state_dict(),
        "env_cfg": {"sim": "genesis", "motions": "x.npz", "terrain": "flat", "dr": "default"}, "global_step": 7})
    return pathlib.Path(path), policy.eval()


# ---------------------------------------------------------------------------------------------------------------------
# Fast: no simulator.
# ---------------------------------------------------------------------------------------------------------------------
def test_dagger_loss_decreases_on_a_fixed_batch():
    torch.manual_seed(0)
    agent = teacher.Agent(LAYOUT, TEACHER_CPU)
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
    losses = student.dagger_update(policy, optimizer, batch, labels, args)
    assert losses[-1] < 0.2 * losses[0], losses
    assert not policy.training  # back in eval mode for the next rollout


def test_noise_touches_only_the_student_sensor_fields():
    obs = random_obs(4000)
    clean = {k: v.clone() for k, v in obs.items()}
    std = student.state_noise_std(CPU, 64)
    out = student.noisy(obs, std, 0.01)
    assert set(out) == set(student.STUDENT_OBS)
    assert all(torch.equal(obs[k], clean[k]) for k in obs)  # the teacher's observations stay clean
    d = out["student_proprio"] - obs["student_proprio"]
    assert d[..., :29].std().item() == pytest.approx(0.01, rel=0.05)      # joint positions
    assert d[..., 29:58].std().item() == pytest.approx(0.5, rel=0.05)     # joint velocities
    assert torch.equal(d[..., 64:], torch.zeros_like(d[..., 64:]))        # the last PD target is known exactly
    assert (out["history"] - obs["history"])[..., :29].std().item() == pytest.approx(0.01, rel=0.05)
    assert (out["student_keypoints"] - obs["student_keypoints"]).std().item() == pytest.approx(0.01, rel=0.05)
    assert torch.equal(out["history_mask"], obs["history_mask"]) and torch.equal(out["terrain"], obs["terrain"])
    assert student.state_noise_std(dataclasses.replace(CPU, noise_scale=0.0), 64).abs().sum() == 0
    with pytest.raises(ValueError, match="sparse state"):
        student.state_noise_std(CPU, 60)


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
    with pytest.raises(ssjr.InputError, match="nope.pt"):
        student.load_teacher(tmp_path / "nope.pt", "cpu")
    s_path, _ = make_student_ckpt(tmp_path / "s.pt")
    with pytest.raises(ValueError, match="expected a teacher checkpoint, found 'student'"):
        student.load_teacher(s_path, "cpu")
    with pytest.raises(ValueError, match="--teacher-ckpt"):
        student.load_teacher("", "cpu")
    t_path = make_teacher_ckpt(tmp_path / "t.pt")
    with pytest.raises(ValueError, match="expected a student checkpoint, found 'teacher'"):
        student.load_policy(t_path)
    with pytest.raises(ValueError, match="expected a student"):  # train --resume with a teacher checkpoint
        student.train(dataclasses.replace(CPU, teacher_ckpt=str(t_path), resume=str(t_path)))
    # a student resumed after its teacher's file was overwritten by a longer teacher run
    distilled = torch.load(s_path, weights_only=False)
    distilled["args"]["teacher_ckpt"], distilled["teacher"] = str(t_path), {"path": str(t_path), "global_step": 5}
    torch.save(distilled, s_path)
    with pytest.raises(ValueError, match="teacher step 5, but that file now holds step 0"):
        student.train(dataclasses.replace(CPU, resume=str(s_path)))


def test_env_cfg_comes_from_the_teacher():
    tckpt = {"env_cfg": {"sim": "genesis", "motions": "a", "terrain": "mix", "dr": "default"}}
    assert student.student_env_cfg(CPU, tckpt) == tckpt["env_cfg"]
    other = student.student_env_cfg(dataclasses.replace(CPU, sim="isaaclab", motions="b"), tckpt)
    assert other == {"sim": "isaaclab", "motions": "b", "terrain": "mix", "dr": "default"}


def test_hcdr_from_teacher(tmp_path):
    agent, _ = student.load_teacher(make_teacher_ckpt(tmp_path / "t.pt"), "cpu")
    agent.actor.history_norm.update(torch.randn(100, 93))
    policy = student.StudentPolicy(LAYOUT, CPU)  # the cpu presets share the HCDR sizes and d_model
    student.init_hcdr_from_teacher(policy, agent, "t.pt")
    for k, v in agent.actor.hcdr.state_dict().items():
        assert torch.equal(policy.actor.hcdr.state_dict()[k], v)
    assert torch.equal(policy.actor.history_norm.mean, agent.actor.history_norm.mean)
    with pytest.raises(ValueError, match="other sizes"):
        student.init_hcdr_from_teacher(student.StudentPolicy(LAYOUT, dataclasses.replace(CPU, hcdr_dim=16)), agent,
                                       "t.pt")
    with pytest.raises(ValueError, match="another structure"):
        student.init_hcdr_from_teacher(student.StudentPolicy(LAYOUT, dataclasses.replace(CPU, hcdr_layers=2)), agent,
                                       "t.pt")


@pytest.mark.parametrize("no_hcdr", [False, True])
def test_onnx_export_matches_pytorch(tmp_path, no_hcdr):
    import json

    import onnx
    import onnxruntime as ort
    path, policy = make_student_ckpt(tmp_path / "s.pt", dataclasses.replace(CPU, no_hcdr=no_hcdr))
    out = student.export(student.Export(ckpt=str(path), onnx=str(tmp_path / "s.onnx")))
    meta = {p.key: json.loads(p.value) for p in onnx.load(str(out)).metadata_props}
    session = ort.InferenceSession(str(out))
    names = [i.name for i in session.get_inputs()]
    assert names == meta["inputs"]
    assert names == (["student_proprio", "student_keypoints", "terrain"] if no_hcdr else list(student.STUDENT_OBS))
    assert meta["obs_layout"] == {k: LAYOUT[k] for k in names}
    assert meta["dof_names"] == list(ssjr.DOF_NAMES) and meta["control_dt_s"] == envs.CONTROL_DT_S
    for n, seed in ((1, 0), (7, 1), (64, 2)):  # dynamic batch
        obs = random_obs(n, seed)
        got = session.run(None, {k: obs[k].numpy() for k in names})[0]
        np.testing.assert_allclose(got, policy.act(obs).numpy(), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Slow: one Genesis env (16 envs, one real clip) shared by the module; the teacher is an untrained teacher.Agent whose
# zero head makes alpha_1 = the reference joint positions: a fixed expert the student must infer from its keypoints.
# ---------------------------------------------------------------------------------------------------------------------
N_ENVS = 16


@pytest.fixture(scope="module")
def sim_setup(train_packet, tmp_path_factory):
    cfg = {"sim": "genesis", "motions": str(train_packet), "terrain": "flat", "dr": "default"}
    env = teacher.build_env(cfg, N_ENVS, "cpu", seed=0)
    env.reset()
    tmp = tmp_path_factory.mktemp("student")
    t_path = make_teacher_ckpt(tmp / "teacher.pt", env.obs_layout, cfg, perturb=False)
    args = dataclasses.replace(CPU, teacher_ckpt=str(t_path), num_envs=N_ENVS, num_steps=24,
                               total_env_steps=N_ENVS * 24 * 8, torch_threads=1, checkpoint_every=4,
                               run_dir=str(tmp / "run"))
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
    assert (pathlib.Path(args.run_dir) / "distillation_curve.png").exists()
    mse = teacher.read_log(args.run_dir)["charts/action_mse"]
    assert len(mse) == 8 and np.isfinite(mse).all()
    assert np.mean(mse[-2:]) < 0.5 * mse[0], mse  # rollout MSE to the teacher on the student's own states
    agent, _ = student.load_teacher(t_path, "cpu")
    policy, ckpt = student.load_policy(trained)
    untrained = copy.deepcopy(policy)  # the same normalizers, the initial zero head: alpha_2 = alpha_0
    torch.nn.init.zeros_(untrained.actor.head[-1].weight)
    torch.nn.init.zeros_(untrained.actor.head[-1].bias)
    before, after = clean_action_mse(env, untrained, agent), clean_action_mse(env, policy, agent)
    assert after < 0.5 * before, (before, after)
    episodes = student.rollout_episodes(env, policy, env.reset())  # tracking success on the clip (random start times)
    success = np.mean([e["success"] for e in episodes])
    assert len(episodes) == N_ENVS and 0.0 <= success <= 1.0
    assert all(e["success"] != e["failed"] and e["keypoint_err_m"] > 0 for e in episodes)
    print(f"\nrollout action MSE per iteration {np.round(mse, 4).tolist()}; clean MSE {before:.4f} -> {after:.4f}; "
          f"success {success:.2f}, mean episode {np.mean([e['steps'] for e in episodes]):.0f} steps")
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
    student.train(dataclasses.replace(args, teacher_ckpt=str(other_critic), total_env_steps=0,
                                      run_dir=str(tmp_path / "r2")), env=env)


@pytest.mark.slow
def test_play_on_human_keypoints(trained, tmp_path):
    bvh = ssjr.DATA_ROOT / "cmu_bvh" / "131_02.bvh"
    if not bvh.exists():
        pytest.skip(f"CMU BVH data not found at {bvh} (set HORD_DATA)")
    ssjr.convert(ssjr.Convert(src=(bvh,), out=tmp_path))
    command = sorted(tmp_path.glob("*.npz"))[0]
    assert ssjr.load_packet(command)["kind"] == "human_keypoints"
    (episode,) = student.play(student.Play(ckpt=str(trained), motions=str(command), num_envs=1))
    assert episode["steps"] > 0 and np.isfinite(episode["keypoint_err_m"]) and episode["failed"] != episode["success"]


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
