"""teacher.py: GAE, PPO loss, model shapes, checkpoints (round trip, resume, bad files) and a short real run."""
import dataclasses

import pytest
import torch

import envs
import ssjr
import model
import teacher
from conftest import read_log

LAYOUT = {"proprio": [5, 535], "future": [8, 569], "ref_dof_pos": [29], "terrain": [121], "history": [16, 93],
          "history_mask": [16], "psi": [1, 11], "critic": [1236]}


def small_args(**kw):
    return dataclasses.replace(teacher.PRESETS["cpu"], **kw)


def fake_obs(n, gen=None):
    obs = {k: torch.randn(n, *shape, generator=gen) for k, shape in LAYOUT.items() if k != "history_mask"}
    obs["history_mask"] = torch.arange(16).expand(n, 16) >= 16 - torch.randint(0, 17, (n, 1), generator=gen)
    return obs


def test_gae_matches_a_hand_computed_example():
    # two steps, one env; the episode ends after step 0 (done), so step 0 does not bootstrap from step 1
    rewards = torch.tensor([[1.0], [2.0]])
    values = torch.tensor([[0.5], [1.0]])
    dones = torch.tensor([[1.0], [0.0]])
    next_value = torch.tensor([3.0])
    g, lam = 0.9, 0.8
    adv = teacher.compute_gae(rewards, values, dones, next_value, g, lam)
    a1 = 2.0 + g * 3.0 - 1.0  # = 3.7
    a0 = 1.0 - 0.5  # terminal: no bootstrap, no carry-over of a1
    assert torch.allclose(adv, torch.tensor([[a0], [a1]]))
    dones[0] = 0.0
    adv = teacher.compute_gae(rewards, values, dones, next_value, g, lam)
    assert torch.allclose(adv[0], torch.tensor([1.0 + g * 1.0 - 0.5 + g * lam * a1]))


def test_policy_shapes_and_residual_action():
    torch.manual_seed(0)
    agent = model.Agent(LAYOUT, small_args())
    obs = fake_obs(6)
    dist = agent.dist(obs)
    assert dist.mean.shape == (6, 29) and agent.value(obs).shape == (6,)
    assert torch.allclose(dist.stddev, torch.full((6, 29), torch.tensor(-2.0).exp()))
    # the head starts at zero: the first PD targets are the reference joint positions
    assert torch.allclose(agent.act(obs), obs["ref_dof_pos"])
    no_hcdr = model.Agent(LAYOUT, small_args(no_hcdr=True))
    assert no_hcdr.actor.hcdr is None and no_hcdr.dist(obs).mean.shape == (6, 29)


def test_the_psi_reading_teacher_acts_on_psi_and_the_others_do_not():
    torch.manual_seed(0)
    obs, other = fake_obs(4), fake_obs(4)
    for psi_actor in (True, False):
        agent = model.Agent(LAYOUT, small_args(psi_actor=psi_actor))
        torch.nn.init.normal_(agent.actor.head[-1].weight, std=0.1)
        moved = agent.act({**obs, "psi": other["psi"]}) - agent.act(obs)
        assert (moved.abs().max() > 1e-3) == psi_actor
        assert ("psi" in agent.actor_obs) == psi_actor


def test_ppo_loss_on_a_toy_batch():
    torch.manual_seed(0)
    agent = model.Agent(LAYOUT, small_args())
    nn_init = torch.nn.init
    nn_init.normal_(agent.actor.head[-1].weight, std=0.1)
    obs = fake_obs(32)
    with torch.no_grad():
        dist = agent.dist(obs)
        actions = dist.sample()
        old_logprob = dist.log_prob(actions).sum(-1)
    adv, ret = torch.randn(32), torch.randn(32)
    pg, v, kl, clipfrac = teacher.ppo_losses(agent, obs, actions, old_logprob, adv, ret, ret, 0.2, False)
    # unchanged policy: ratio 1, KL 0, nothing clipped, surrogate = -mean(normalized advantage) = 0
    assert abs(kl) < 1e-6 and clipfrac == 0.0 and abs(pg.item()) < 1e-5
    assert torch.isclose(v, 0.5 * (agent.value(obs) - ret).pow(2).mean())
    # a policy far from the old one gets clipped, and the gradient of the surrogate is finite
    pg2, _, kl2, clipfrac2 = teacher.ppo_losses(agent, obs, actions, old_logprob - 1.0, adv, ret, ret, 0.2, False)
    assert clipfrac2 == 1.0 and kl2 > 0.1
    pg2.backward()
    assert all(torch.isfinite(p.grad).all() for p in agent.actor.parameters() if p.grad is not None)
    # the clipped value loss: the rollout's value was 1 above today's, the target is today's; the clipped loss keeps
    # the value within 0.2 of the rollout's, so it still sees 0.8 of error where the free one sees none
    with torch.no_grad():
        value = agent.value(obs)
    _, v_free, _, _ = teacher.ppo_losses(agent, obs, actions, old_logprob, adv, value, value + 1, 0.2, False)
    _, v_clipped, _, _ = teacher.ppo_losses(agent, obs, actions, old_logprob, adv, value, value + 1, 0.2, True)
    assert v_free.item() < 1e-10 and torch.isclose(v_clipped, torch.tensor(0.5 * 0.8 ** 2))


def test_value_normalization_denormalizes_the_critic_for_gae():
    """--value-norm: the critic outputs normalized returns (the loss), V in return units for GAE."""
    torch.manual_seed(0)
    agent = model.Agent(LAYOUT, small_args(value_norm=True))
    agent.value_norm.update(50.0 + 10.0 * torch.randn(4096, 1))
    obs = fake_obs(6)
    raw = agent.value(obs, normalized=True)
    assert torch.allclose(agent.value(obs), raw * agent.value_norm.var.sqrt() + agent.value_norm.mean, atol=1e-3)
    assert abs(agent.value_norm.mean.item() - 50.0) < 1.0 and abs(agent.value_norm.var.sqrt().item() - 10.0) < 1.0
    assert agent.value_norm(torch.tensor([1000.0]), 5.0).item() == 5.0  # targets clamped at 5


def test_bad_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(ssjr.InputError, match="missing.pt: checkpoint not found"):
        model.load_checkpoint(tmp_path / "missing.pt", "teacher")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pt: not a readable checkpoint"):
        model.load_checkpoint(junk, "teacher")
    other = tmp_path / "student.pt"
    torch.save({"kind": "student"}, other)
    with pytest.raises(ValueError, match="student.pt: expected a teacher checkpoint, found 'student'"):
        model.load_checkpoint(other, "teacher")
    with pytest.raises(ValueError, match="t.pt: observation layout mismatch for 'future'"):
        model.check_layout("t.pt", LAYOUT, {**LAYOUT, "future": [8, 500]}, teacher.TEACHER_OBS)
    ckpt = {"kind": "teacher", "args": {**dataclasses.asdict(small_args()), "warp_drive": 1}}  # another version's
    with pytest.raises(ValueError, match=r"newer.pt: settings \['warp_drive'\] are unknown"):
        model.checkpoint_args("newer.pt", ckpt, teacher.Args)


def test_minibatch_larger_than_the_rollout_is_refused():
    with pytest.raises(ssjr.InputError, match="larger than a rollout"):
        teacher.main(small_args(num_envs=8, num_steps=4, minibatch_size=64))


@pytest.mark.slow
def test_real_run_learns_resumes_and_is_deterministic(train_packet, tmp_path):
    """One clip on Genesis CPU. (1) Same seed, same device -> same first-iteration losses. (2) A checkpoint round-trips
    and --resume continues its step counter, run folder and weights. (3) Learning happens in the real env: over a
    dozen iterations the critic's value loss falls and its explained variance rises (the tracking reward: the test
    below)."""
    common = dict(motions=str(train_packet), num_envs=32, num_steps=24, checkpoint_every=100, minibatch_size=768,
                  performance_mode=False, torch_threads=1, update_epochs=2)  # fast to build; 2 epochs:
    per_it = 32 * 24                                                              # the critic margin below needs them
    run_a = teacher.main(small_args(run_dir=str(tmp_path / "a"), total_env_steps=2 * per_it, **common))
    teacher.main(small_args(run_dir=str(tmp_path / "b"), total_env_steps=per_it, **common))
    log_a, log_b = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    for k in ("losses/policy_loss", "losses/value_loss", "charts/mean_reward"):
        assert log_b[k][0] == log_a[k][0], k

    policy, ckpt = model.load_teacher(run_a)
    assert ckpt["global_step"] == 2 * per_it and ckpt["obs_layout"]["critic"] == [1236]
    obs = fake_obs(4, torch.Generator().manual_seed(1))
    again = model.Agent(ckpt["obs_layout"], teacher.Args(**ckpt["args"]))
    again.load_state_dict(ckpt["model"])
    assert torch.allclose(again.eval().act(obs), policy.act(obs), atol=1e-6)

    resumed = teacher.main(small_args(resume=str(run_a), total_env_steps=14 * per_it))
    after = torch.load(resumed, weights_only=False)
    assert after["global_step"] == 14 * per_it and after["iteration"] == 14
    assert resumed == run_a
    log = read_log(tmp_path / "a")
    assert log["iteration"] == list(range(1, 15))
    value_loss, explained = log["losses/value_loss"], log["losses/explained_variance"]
    assert sum(value_loss[-3:]) < 0.5 * sum(value_loss[:3]), value_loss
    assert sum(explained[-3:]) / 3 > 0.5 and sum(explained[-3:]) > sum(explained[:3]) + 0.5, explained



@pytest.mark.slow
def test_tracking_reward_improves_in_a_short_real_run(train_packet, tmp_path):
    """The cpu preset as users run it (torchrun, 2 ranks x 64 MuJoCo envs) on one clip for 38
    iterations (117k env-steps, ~3 minutes here): the mean tracking reward per step and the mean episode return of
    iterations 31-38 beat those of iterations 3-10 (iterations 1-2 only see the short episodes that ended first). The
    effect seen on this schedule is reward ~0.89 -> ~0.92 and return x1.07-1.10; the margins (+0.01, x1.04) are under
    half of it."""
    from test_distributed import launch
    launch(2, "teacher.py", "--preset", "cpu", "--motions", str(train_packet), "--total-env-steps",
           str(38 * 128 * 24), "--run-dir", str(tmp_path), "--checkpoint-every", "100")
    log = read_log(tmp_path)
    assert log["iteration"][-1] == 38 and small_args().num_envs == 64
    assert torch.load(tmp_path / "teacher.pt", weights_only=False)["env_cfg"]["root_velocity"] is False  # cpu recipe
    mean = lambda xs: sum(xs) / len(xs)
    reward, ret = log["charts/mean_reward"], log["charts/episode_return"]
    print(f"\nreward {mean(reward[2:10]):.3f} -> {mean(reward[30:38]):.3f}, return {mean(ret[2:10]):.1f} -> "
          f"{mean(ret[30:38]):.1f}")
    assert mean(reward[30:38]) > mean(reward[2:10]) + 0.01, reward
    assert mean(ret[30:38]) > 1.04 * mean(ret[2:10]), ret


def test_a_crash_keeps_the_last_finished_iteration_and_resumes(tmp_path, monkeypatch):
    """An exception in the loop (here the env's, in iteration 4) still writes the checkpoint (no --checkpoint-every
    reached): it holds iteration 3, and a bare --resume continues from there to the run's own budget (not to the
    preset's default), keeping its copies every --keep-every iterations."""
    from conftest import FakeEnv
    per_it = 8 * 4
    args = small_args(num_envs=8, num_steps=4, minibatch_size=16, total_env_steps=10 * per_it, checkpoint_every=100,
                      keep_every=2, run_dir=str(tmp_path), torch_threads=1)
    monkeypatch.setattr(teacher, "robot_motions", lambda motions: motions)  # no motion files: a FakeEnv plays
    monkeypatch.setattr(envs, "make_env", lambda **k: FakeEnv(LAYOUT, 8, crash_at=3 * 4 + 2))
    with pytest.raises(RuntimeError, match="the engine died"):
        teacher.main(args)
    ckpt = torch.load(tmp_path / "teacher.pt", weights_only=False)
    assert ckpt["iteration"] == 3 and ckpt["global_step"] == 3 * per_it
    monkeypatch.setattr(envs, "make_env", lambda **k: FakeEnv(LAYOUT, 8))
    teacher.main(small_args(resume=str(tmp_path / "teacher.pt")))  # the preset's 200k steps are not named
    assert torch.load(tmp_path / "teacher.pt", weights_only=False)["iteration"] == 10
    kept = {p.name: torch.load(p, weights_only=False)["iteration"] for p in tmp_path.glob("teacher_it*.pt")}
    assert kept == {f"teacher_it{i}.pt": i for i in (2, 4, 6, 8, 10)}  # --keep-every 2, kept by the bare --resume
    assert read_log(tmp_path)["iteration"] == list(range(1, 11))


def test_a_resumed_run_changes_only_its_budget_device_and_kept_copies():
    """--resume takes the checkpoint's settings; the budget and --keep-every only when named (not the preset's). In
    an older checkpoint a setting since retired (--ema-decay) is ignored, one added since takes its value of then."""
    saved = {"args": {**dataclasses.asdict(small_args(total_env_steps=1000, keep_every=2, actor_lr_max=5e-3, seed=3)),
                      "ema_decay": 0.0}}
    cpu = dataclasses.replace(teacher.PRESETS["cpu"], resume="run/teacher.pt")
    bare = model.resumed_args(cpu, saved, teacher.PRESETS)
    assert (bare.total_env_steps, bare.keep_every, bare.actor_lr_max, bare.run_dir) == (1000, 2, 5e-3, "run")
    named = model.resumed_args(dataclasses.replace(cpu, total_env_steps=2000, keep_every=3, actor_lr_max=1e-2, seed=1),
                               saved, teacher.PRESETS)
    assert (named.total_env_steps, named.keep_every, named.actor_lr_max, named.seed) == (2000, 3, 5e-3, 3)
    older = {"args": {k: v for k, v in saved["args"].items() if k != "actor_lr_max"}}  # from before the setting
    assert model.resumed_args(cpu, older, teacher.PRESETS).actor_lr_max == 1e-3 != teacher.Args().actor_lr_max


def test_clip_reweighting_follows_the_fall_rates(tmp_path, monkeypatch):
    """--reweight-every: each clip's sampling weight is its fall rate over the episodes that ended since the last
    re-weighting, floored at 0.05: a clip whose episodes all fail gets 1, one whose episodes all reach the end 0.05;
    the weights and the returns' statistics (--value-norm) go into the checkpoint, and --resume restores the weights."""
    from conftest import FakeEnv

    class TwoClips(FakeEnv):  # every step ends an episode; env i plays clip i % 2, whose episodes all fail if it is 0
        def __init__(self, *args):
            super().__init__(*args)
            self.motions = type("Motions", (), {"mean_dof_pos": torch.zeros(29), "__len__": lambda self: 2})()

        def step(self, alpha):
            obs, reward, _, info = super().step(alpha)
            info["clip"] = torch.arange(self.num_envs) % 2
            info["failed"], info["time_out"] = info["clip"] == 0, info["clip"] == 1
            return obs, reward, torch.ones(self.num_envs, dtype=torch.bool), info

    env = TwoClips(LAYOUT, 8)
    monkeypatch.setattr(teacher, "robot_motions", lambda motions: motions)
    monkeypatch.setattr(envs, "make_env", lambda **k: env)
    teacher.main(small_args(num_envs=8, num_steps=4, minibatch_size=16, total_env_steps=2 * 8 * 4, reweight_every=1,
                            value_norm=True, run_dir=str(tmp_path), torch_threads=1))
    assert env.clip_weights.tolist() == pytest.approx([1.0, 0.05])
    ckpt = torch.load(tmp_path / "teacher.pt", weights_only=False)
    assert ckpt["rng"][0]["env"]["clip_weights"].tolist() == pytest.approx([1.0, 0.05])
    assert ckpt["model"]["value_norm.count"] > 60  # two rollouts of 32 returns
    resumed = TwoClips(LAYOUT, 8)
    monkeypatch.setattr(envs, "make_env", lambda **k: resumed)
    teacher.main(small_args(resume=str(tmp_path / "teacher.pt"), total_env_steps=2 * 8 * 4))  # nothing left to run
    assert resumed.clip_weights.tolist() == pytest.approx([1.0, 0.05])  # a resumed run samples as the run did


def test_a_teacher_trains_on_robot_motions_only(tmp_path, capsys):
    """Human keypoint commands (BVH, AMASS) cannot be a teacher's reference: a folder mixing both keeps the robot
    motions and names the skipped files; a keypoint file or a folder of them alone is an error naming it."""
    import numpy as np
    for name, kind in (("walk_seg00.npz", "robot"), ("bvh_seg00.npz", "human_keypoints")):
        np.savez(tmp_path / name, kind=np.array(kind))
    assert teacher.robot_motions(str(tmp_path)) == [str(tmp_path / "walk_seg00.npz")]
    assert "bvh_seg00.npz" in capsys.readouterr().out
    assert teacher.robot_motions(str(tmp_path / "walk_seg00.npz")) == str(tmp_path / "walk_seg00.npz")
    (tmp_path / "walk_seg00.npz").unlink()
    for motions in (tmp_path, tmp_path / "bvh_seg00.npz"):
        with pytest.raises(ssjr.InputError, match="only human keypoint commands"):
            teacher.robot_motions(str(motions))


@pytest.mark.slow
def test_both_stages_run_on_mujoco(train_packet, tmp_path):
    """--sim mujoco through teacher.py and student.py (two iterations each, 16 envs): the checkpoints record the engine
    and the student distils on it."""
    import student
    t_path = teacher.main(small_args(sim="mujoco", motions=str(train_packet), num_envs=16, num_steps=8,
                                     minibatch_size=128, total_env_steps=2 * 16 * 8, performance_mode=False,
                                     torch_threads=1, run_dir=str(tmp_path / "t")))
    assert torch.load(t_path, weights_only=False)["env_cfg"]["sim"] == "mujoco"
    s_args = dataclasses.replace(student.PRESETS["cpu"], teacher_ckpt=str(t_path), num_envs=16, num_steps=8,
                                 minibatch_size=64, total_env_steps=2 * 16 * 8, torch_threads=1,
                                 run_dir=str(tmp_path / "s"))
    s_ckpt = torch.load(student.train(s_args), weights_only=False)
    assert s_ckpt["env_cfg"]["sim"] == "mujoco" and s_ckpt["global_step"] == 2 * 16 * 8
    assert read_log(tmp_path / "s")["iteration"] == [1, 2]


def test_init_ckpt_starts_from_another_runs_actor(tmp_path, monkeypatch):
    """--init-ckpt: the actor's weights of a teacher checkpoint, a fresh critic and counters (fine-tuning, e.g. with
    --clamp-targets); a missing file is an error naming it before any env is built."""
    from conftest import FakeEnv
    per_it = 8 * 4
    common = dict(num_envs=8, num_steps=4, minibatch_size=16, total_env_steps=per_it, torch_threads=1)
    monkeypatch.setattr(teacher, "robot_motions", lambda motions: motions)  # no motion files: a FakeEnv plays
    built = []
    monkeypatch.setattr(envs, "make_env", lambda **k: built.append(k) or FakeEnv(LAYOUT, 8))
    first = teacher.main(small_args(run_dir=str(tmp_path / "a"), seed=1, **common))
    tuned = teacher.main(small_args(run_dir=str(tmp_path / "b"), init_ckpt=str(first), clamp_targets=True,
                                    actor_lr=0.0, desired_kl=0.0, **common))  # the actor stays as it starts
    a, b = (torch.load(p, weights_only=False) for p in (first, tuned))
    assert built[-1]["clamp_targets"] and b["env_cfg"]["clamp_targets"] and not a["env_cfg"]["clamp_targets"]
    assert (b["iteration"], b["global_step"]) == (1, per_it)
    params = [k for k in a["model"] if k.startswith("actor.") and ".norms." not in k and "_norm." not in k]
    assert params and all(torch.equal(a["model"][k], b["model"][k]) for k in params)
    assert not torch.equal(a["model"]["critic.0.weight"], b["model"]["critic.0.weight"])  # trained afresh
    with pytest.raises(ssjr.InputError, match="missing.pt: checkpoint not found"):
        teacher.main(small_args(init_ckpt=str(tmp_path / "missing.pt"), **common))
    assert len(built) == 2
