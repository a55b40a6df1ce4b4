"""envs.py on every engine: reset, kinematic replay, domain randomization, termination, observations, NaN safety.

Each engine's scene is built once per module (Genesis ~50 s cold compile, ~8 s warm; Isaac Lab ~20 s)."""
import time

import numpy as np
import pytest
import torch

import envs
import ssjr

pytestmark = pytest.mark.slow
SIMS = ["genesis", "isaaclab", "mujoco"]
N = 8


@pytest.fixture(scope="module")
def built(train_packet):
    """Every engine, built once for the module (they coexist in one process); Isaac Lab's is closed at the end."""
    made = {sim: envs.make_env(sim, N, "cpu", train_packet, dr=envs.DR(), terrain="flat", seed=0) for sim in SIMS}
    yield made
    for e in made.values():
        e.close()


@pytest.fixture(params=SIMS)
def env(request, built):
    return built[request.param]


def all_ids(env):
    return torch.arange(env.num_envs)


def test_observation_layout_matches_the_documented_table(env):
    obs = env.reset()
    p, f, j = 535, 569, len(ssjr.KEYPOINT_NAMES)
    expected = {"proprio": [5, p], "future": [8, f], "ref_dof_pos": [29], "terrain": [121], "history": [16, 93],
                "history_mask": [16], "student_proprio": [8, 93], "student_keypoints": [12, 3 * j],
                "psi": [1, len(envs.PSI_KEYS)], "critic": [p + f + 121 + len(envs.PSI_KEYS)]}
    assert env.obs_layout == expected
    assert {k: list(v.shape[1:]) for k, v in obs.items()} == expected
    assert not obs["history_mask"].any()  # a fresh episode has no history yet


def test_reset_matches_reference_bodies(env):
    env.reset()
    ref = env.reference()
    err = (env.sim.body_state()[0] - ref["body_pos"]).norm(dim=-1)
    assert err.max() < 0.02


def test_kinematic_replay_earns_near_maximal_reward(env):
    """Overwrite the physics with the reference at every control step: tracking terms ~1, no termination."""
    env.reset()
    step, substeps = env.sim.step, [0]

    def replay(tau):
        step(tau)
        substeps[0] += 1
        if substeps[0] % envs.DECIMATION == 0:  # the state the env will read: the reference one control step on
            ref = env.reference(1)
            env.sim.write_state(all_ids(env), ref["body_pos"][:, 0], ref["body_quat"][:, 0],
                                ref["body_lin_vel"][:, 0], ref["body_ang_vel"][:, 0], ref["dof_pos"],
                                ref["dof_vel"])
    env.sim.step = replay
    try:
        obs = env.reset()
        for _ in range(30):
            obs, reward, done, info = env.step(obs["ref_dof_pos"])
            assert not info["failed"].any()
            for k in ("gt", "gr", "gv", "gav", "rh", "rt"):
                assert info["reward_terms"][k].min() > 0.95, (k, info["reward_terms"][k].min())
            assert info["metrics"]["gt_err_m"].max() < 0.02
    finally:
        env.sim.step = step


def test_noise_only_dr_is_the_nominal_dynamics_without_pushes_and_with_the_sensor_noise():
    gen, noise_only = torch.Generator().manual_seed(0), envs.DR.noise_only()
    drawn, nominal = envs.sample_psi(noise_only, 5, gen, "cpu"), envs.sample_psi(None, 5, gen, "cpu")
    assert all(torch.equal(drawn[k], nominal[k]) for k in envs.PSI_KEYS)
    assert torch.equal(noise_only.sensor_std(), envs.DR().sensor_std()) and noise_only.noise_keypoint_m > 0
    assert min(noise_only.push_interval_s) > 1e6  # seconds between pushes: none in any clip


def test_psi_differs_across_envs_fixed_in_episode_resampled_at_reset(env):
    obs = env.reset()
    psi0 = {k: v.clone() for k, v in env.psi.items()}
    assert len(set(psi0["mass_scale"].tolist())) == N
    assert psi0["delay_steps"].min() >= 0 and psi0["delay_steps"].max() <= 3
    assert ((psi0["gravity_mps2"] >= 9.7) & (psi0["gravity_mps2"] <= 9.9)).all()
    for _ in range(5):
        obs, _, done, info = env.step(obs["ref_dof_pos"])
        alive = ~done
        for k in envs.PSI_KEYS:
            assert torch.equal(info["psi"][k][alive], psi0[k][alive])
    env.reset(torch.tensor([0, 1]))
    assert env.psi["gravity_mps2"][0] != psi0["gravity_mps2"][0]  # redrawn every episode
    assert env.psi["mass_scale"][0] == psi0["mass_scale"][0]  # the body part: once per env (DR.body_psi_per_episode)
    assert torch.equal(env.psi["gravity_mps2"][2:], psi0["gravity_mps2"][2:])
    env.dr.body_psi_per_episode = True
    try:
        env.reset(torch.tensor([0, 1]))
    finally:
        env.dr.body_psi_per_episode = False
    assert env.psi["mass_scale"][0] != psi0["mass_scale"][0]
    assert torch.equal(env.psi["mass_scale"][2:], psi0["mass_scale"][2:])


def test_control_delay_shifts_the_torque_step_by_d_physics_steps(env):
    env.reset()
    delays = [0, 1, 2, 3, 4, 5, 6, 8]  # up to two control periods (envs.MAX_DELAY_STEPS)
    env.psi["delay_steps"][:] = torch.tensor(delays, dtype=torch.float)
    env.psi["kp_scale"][:] = 1.0
    elbow = ssjr.DOF_NAMES.index("left_elbow_joint")
    hold = env.sim.dof_state()[0].clone()
    env.alpha_line[:] = hold[:, None]  # the targets before: hold the pose
    target = hold.clone()
    target[:, elbow] += 1.0  # a 1 rad step of the PD target: kp 60 -> saturates at the 25 N m effort limit
    tau = []
    for _ in range(2):  # the new target, held for two control steps: 8 physics steps
        env.step(target)
        tau.append(env.substep_tau[:, :, elbow].abs())
    tau = torch.cat(tau)  # [physics step, env]
    for i, d in enumerate(delays):
        assert (tau[:d, i] < 10.0).all() and (tau[d:, i] > 20.0).all(), (d, tau[:, i])


def test_contact_time_constant_is_per_episode_on_mujoco_and_one_scene_value_elsewhere(env):
    obs = env.reset()
    tc = env.psi["contact_timeconst_s"]
    assert torch.equal(obs["psi"][:, 0, envs.PSI_KEYS.index("contact_timeconst_s")], tc)  # psi says what runs
    if not isinstance(env.sim, envs.MuJoCoSim):
        scene = 0.01 if isinstance(env.sim, envs.GenesisSim) else envs.CONTACT_TIMECONST_S  # Genesis' own default
        assert env.sim.contact_timeconst_s == pytest.approx(scene) and torch.all(tc == env.sim.contact_timeconst_s)
        return
    assert ((tc >= 0.01) & (tc <= 0.03)).all() and len(set(tc.tolist())) == N
    assert all(np.allclose(m.geom_solref[:, 0], t) for m, t in zip(env.sim.models, tc.tolist()))
    # softer contact, deeper penetration: one standing state on every env, the feet sink further at 0.04 s
    ids = all_ids(env)
    env.sim.set_contact_timeconst(ids, torch.tensor([0.01, 0.04] * (N // 2)))
    ref = {k: v[:1].expand(N, *v.shape[1:]) for k, v in env.reference().items()}
    zeros = torch.zeros(N, 3)
    env.sim.write_state(ids, ref["body_pos"][:, 0], ref["body_quat"][:, 0], zeros, zeros, ref["dof_pos"],
                        torch.zeros(N, 29))
    for _ in range(20):
        env.sim.step(torch.zeros(N, 29))
    depth_m = torch.tensor([-min(d.contact.dist[:d.ncon], default=0.0) for d in env.sim.datas])
    assert (depth_m[1::2] > 2 * depth_m[0::2]).all() and (depth_m[0::2] > 0).all(), depth_m
    env.reset()


def test_gravity_and_mass_reach_the_engine(env):
    env.reset()
    ids = all_ids(env)
    if isinstance(env.sim, envs.GenesisSim):  # inertia scales with the mass ratio against the default, not cumulatively
        env.sim.set_body_mass(ids, env.default_mass)
        inertia0 = torch.as_tensor(env.sim.robot.get_links_inertia(env.sim.links)).clone()
        env.sim.set_body_mass(ids, env.default_mass * 1.3)
        env.sim.set_body_mass(ids, env.default_mass * 0.8)
        inertia = torch.as_tensor(env.sim.robot.get_links_inertia(env.sim.links))
        assert torch.allclose(inertia, inertia0 * 0.8, rtol=1e-4, atol=1e-8)
    heavy = env.default_mass * 1.1
    env.sim.set_body_mass(ids, heavy)
    if isinstance(env.sim, envs.GenesisSim):  # read the masses back from the engine
        engine_mass = torch.as_tensor(env.sim.robot.get_links_mass(env.sim.links))
    elif isinstance(env.sim, envs.MuJoCoSim):
        engine_mass = torch.tensor(np.stack([m.body_mass[env.sim.bodies] for m in env.sim.models])).float()
    else:
        engine_mass = env.sim.robot.data.body_mass.torch[:, env.sim.isaac_index_of_body]
    assert torch.allclose(engine_mass, heavy, rtol=1e-4)
    # free fall from 3 m under two gravities: the displacement ratio equals the gravity ratio
    z0 = 3.0
    pos, quat, _, _ = env.sim.root_state()
    q, _ = env.sim.dof_state()
    start = pos.clone()
    start[:, 2] = z0
    zeros = torch.zeros(N, 3)
    env.sim.write_state(ids, start, quat, zeros, zeros, q, torch.zeros_like(q))
    g = torch.tensor([5.0, 9.81] * (N // 2))
    env.sim.set_gravity(ids, torch.stack([torch.zeros(N), torch.zeros(N), -g], -1))
    for _ in range(40):  # 0.2 s
        env.sim.step(torch.zeros(N, 29))
    drop = z0 - env.sim.root_state()[0][:, 2]
    expected = 0.5 * g * (40 * envs.PHYSICS_DT_S) ** 2
    assert torch.allclose(drop, expected, rtol=0.05), (drop, expected)
    env.reset()


def test_push_kicks_the_root_velocity(env):
    obs = env.reset()
    before = env.sim.root_state()[2].clone()
    env.next_push_s[:N // 2] = 0.0  # push the first half now
    env.next_push_s[N // 2:] = 1e9
    env.step(obs["ref_dof_pos"])
    change = (env.sim.root_state()[2] - before)[:, :2].norm(dim=-1)
    assert change[:N // 2].mean() > change[N // 2:].mean() + 0.1
    assert (env.next_push_s[:N // 2] >= 5.0).all()  # the next push is 5-10 s later


def test_root_velocity_writes_are_world_frame(env):
    """write_state and set_root_velocity take world-frame velocities on both engines (Genesis' free joint stores the
    angular one in the root's frame): a tilted, turned root reads back what was written."""
    env.reset()
    pos, _, _, _ = env.sim.root_state()
    q, qd = env.sim.dof_state()
    turn = ssjr.quat_mul(ssjr.z_quat(torch.full((N,), 2.0)), torch.tensor([0.98, 0.2, 0.0, 0.0]).expand(N, 4))
    turn = turn / turn.norm(dim=-1, keepdim=True)
    lin, ang = torch.tensor([[0.3, -0.2, 0.1]]).expand(N, 3), torch.tensor([[1.0, -0.5, 0.25]]).expand(N, 3)
    env.sim.write_state(all_ids(env), pos + torch.tensor([0, 0, 0.5]), turn, lin, ang, q, qd)
    _, quat, v, w = env.sim.root_state()
    assert torch.allclose(quat.abs(), turn.abs(), atol=1e-4)
    assert torch.allclose(v, lin, atol=1e-3) and torch.allclose(w, ang, atol=1e-3), (v, w)
    env.sim.set_root_velocity(all_ids(env), 2 * lin, -ang)
    _, _, v, w = env.sim.root_state()
    assert torch.allclose(v, 2 * lin, atol=1e-3) and torch.allclose(w, -ang, atol=1e-3), (v, w)
    env.reset()


def test_termination_when_moved_far_from_reference(env):
    obs = env.reset()
    pos, quat, v, w = env.sim.root_state()
    q, qd = env.sim.dof_state()
    shifted = pos.clone()
    shifted[0, 0] += 0.6
    env.sim.write_state(all_ids(env), shifted, quat, v, w, q, qd)
    _, _, done, info = env.step(obs["ref_dof_pos"])
    assert done[0] and info["failed"][0]
    assert not info["failed"][1:].any()


def test_one_body_1m_off_ends_a_strict_episode_and_the_papers_test_lets_it_go_on(env):
    """A reference whose left wrist is 1 m above the robot's, the rest followed: the strict test (any body > 0.5 m,
    training) ends the episode at once; the paper's (the bodies' mean error, evaluation) lets it go on."""
    ticks, termination = env.motions.ticks["body_pos"], env.termination
    wrist = ssjr.BODY_NAMES.index("left_wrist_yaw_link")
    ticks[:, wrist, 2] += 1.0
    try:
        env.termination = "max"
        obs = env.reset()
        _, _, done, info = env.step(obs["ref_dof_pos"])
        assert done.all() and info["failed"].all()
        env.termination = "mean"
        obs = env.reset()
        for _ in range(10):
            obs, _, done, info = env.step(obs["ref_dof_pos"])
            assert not done.any()
            assert (info["metrics"]["max_body_err_m"] > 0.9).all() and (info["metrics"]["gt_err_m"] < 0.2).all()
    finally:
        ticks[:, wrist, 2] -= 1.0
        env.termination = termination


@pytest.fixture
def frame0_env(env):
    """The module's env in evaluation mode (frame-0 starts: one random stream per episode), restored after."""
    env.start, env.episode_gens = "frame0", [torch.Generator() for _ in range(env.num_envs)]
    yield env
    env.start, env.episode_gens = "random", None
    env.reseed(0)


def test_evaluation_episodes_draw_psi_pushes_and_noise_from_seed_clip_and_episode(frame0_env):
    """Frame-0 starts: every episode draws its own psi (body terms too), push times and noise, from (seed, clip,
    episode) alone: two policies meet the same draws (paired episodes), episodes differ from each other."""
    env = frame0_env
    draws = []
    for action_offset in (0.0, 0.2):  # two "policies"
        obs = env.reseed(7)
        psi = {k: v.clone() for k, v in env.psi.items()}
        pushes = env.next_push_s.clone()
        noise = []
        for _ in range(3):
            obs, _, done, _ = env.step(obs["ref_dof_pos"] + action_offset)
            q, qd = env.sim.dof_state()
            noise.append(obs["student_proprio"][:, -1, :envs.SPARSE_STATE_DIM]
                         - env.sparse_state(env.sim.body_state(), q, qd))
        draws.append((psi, pushes, torch.stack(noise), env.keypoint_noise.clone()))
    (psi_a, push_a, noise_a, kp_a), (psi_b, push_b, noise_b, kp_b) = draws
    for k in envs.PSI_KEYS:
        assert torch.equal(psi_a[k], psi_b[k]), k
        one_value = k == "delay_steps" or k == "contact_timeconst_s" and env.sim.contact_timeconst_s is not None
        assert one_value or len(set(psi_a[k].tolist())) == env.num_envs, k  # one draw per episode
    assert torch.equal(push_a, push_b) and torch.equal(kp_a, kp_b)
    assert torch.allclose(noise_a, noise_b, atol=1e-4)  # the same noise on other states (float32 rounding)
    assert noise_a[:, :, 29:58].std() > 0.3  # joint-velocity noise, 0.5 rad/s
    mass_0 = env.psi["mass_scale"][0].item()
    env.reset(torch.tensor([0]))  # env 0's next start is episode N of the clip: new body terms
    assert env.psi["mass_scale"][0].item() != mass_0 and env.start_count[0] == 2 * env.num_envs


def test_noise_scale_multiplies_the_same_sensor_draws(frame0_env):
    """DR.noise_scale k scales the very draws of the full noise (evaluate.py's +noise<k>): psi and pushes stay."""
    env = frame0_env

    def first_step(scale):
        env.dr.noise_scale = scale
        obs = env.reseed(3)
        pushes = env.next_push_s.clone()
        obs, _, _, _ = env.step(obs["ref_dof_pos"])  # the reference pose: the same states whatever the noise
        q, qd = env.sim.dof_state()
        err = obs["student_proprio"][:, -1, :envs.SPARSE_STATE_DIM] - env.sparse_state(env.sim.body_state(), q, qd)
        return err, env.keypoint_noise.clone(), {k: v.clone() for k, v in env.psi.items()}, pushes
    try:
        full, tenth = first_step(1.0), first_step(0.1)
    finally:
        env.dr.noise_scale = 1.0
    assert full[0].abs().max() > 0.5 and torch.allclose(tenth[0], 0.1 * full[0], atol=1e-4)
    assert torch.allclose(tenth[1], 0.1 * full[1], atol=1e-7)
    assert all(torch.equal(full[2][k], tenth[2][k]) for k in envs.PSI_KEYS) and torch.equal(full[3], tenth[3])


def test_command_keypoint_noise_is_one_draw_per_frame_carried_as_the_window_slides(env):
    obs = env.reset()
    before = env.keypoint_noise.clone()
    env.step(obs["ref_dof_pos"])
    assert torch.equal(env.keypoint_noise[:, :-1], before[:, 1:])  # frames t-6..t+4 keep their draws
    assert 0.5 * env.dr.noise_keypoint_m < env.keypoint_noise.std() < 1.5 * env.dr.noise_keypoint_m


def test_random_actions_never_produce_nan(env):
    obs = env.reset()
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        alpha = obs["ref_dof_pos"] + 0.3 * torch.randn(N, 29, generator=gen)
        obs, reward, done, info = env.step(alpha)
        assert torch.isfinite(reward).all()
        for k, v in obs.items():
            assert torch.isfinite(v.float()).all(), k
    assert info["nan_resets"] == 0


def test_nan_envs_are_reset_and_counted(env):
    obs = env.reset()
    before, is_nan = int(env.nan_resets), env.sim.nan_envs
    env.sim.nan_envs = lambda: torch.arange(N) == 3  # the engine reports env 3 as blown up
    try:
        obs, reward, done, info = env.step(obs["ref_dof_pos"])
    finally:
        env.sim.nan_envs = is_nan
    assert done[3] and info["nan"][3] and int(info["nan_resets"]) == before + 1 and reward[3] == 0
    assert info["nan"].sum() == 1 and info["failed"][3]  # only env 3 blew up; a blow-up counts as a failure
    assert env.step_count[3] == 0  # it starts a new episode


def test_the_env_counts_its_physics_and_dr_write_time(env):
    """`python envs.py bench` reads these counters (no patching): a control step is DECIMATION physics steps, a DR
    reset writes psi; both take host time, and less than the whole step."""
    obs = env.reset()
    physics_s, dr_write_s, start = env.physics_s, env.dr_write_s, time.perf_counter()
    env.reset(torch.tensor([0]))
    env.step(obs["ref_dof_pos"])
    wall_s = time.perf_counter() - start
    assert 0 < env.physics_s - physics_s < wall_s and 0 < env.dr_write_s - dr_write_s < wall_s


def test_joint_and_body_order_is_mujoco_order(env):
    assert tuple(env.sim.dof_names) == ssjr.DOF_NAMES
    assert tuple(env.sim.body_names) == ssjr.BODY_NAMES
    # a joint moved alone moves exactly its own child body (and those below it)
    env.reset()
    pos, quat, v, w = env.sim.root_state()
    q, qd = env.sim.dof_state()
    elbow = ssjr.DOF_NAMES.index("right_elbow_joint")
    before = env.sim.body_state()[0].clone()
    q2 = q.clone()
    q2[:, elbow] += 0.5
    env.sim.write_state(all_ids(env), pos, quat, v, w, q2, qd)
    moved = (env.sim.body_state()[0] - before).norm(dim=-1)[0] > 1e-3
    assert moved.nonzero().squeeze(-1).tolist() == [ssjr.BODY_NAMES.index("right_wrist_roll_link"),
                                                   ssjr.BODY_NAMES.index("right_wrist_pitch_link"),
                                                   ssjr.BODY_NAMES.index("right_wrist_yaw_link")]
    env.reset()


def test_terrain_height_scan_sees_slopes():
    terrain = envs.make_terrain("mix")
    types = np.array(terrain.tile_types)
    spawn = torch.as_tensor(terrain.spawn_xy_m)
    h = terrain.height_at(spawn)
    assert (h[types == "flat"] == 0).all()
    assert (h[types == "smooth_slope"] > 0.1).all()  # half-way up a pyramid face
    assert envs.make_terrain("flat").is_flat


def test_terrain_mix_is_per_terrain_type_not_per_tile():
    terrain = envs.make_terrain("mix")  # half of its tiles are flat
    w = envs.tile_weights(terrain.tile_types, envs.TERRAIN_MIX)
    types = np.array(terrain.tile_types)
    for t, share in envs.TERRAIN_MIX.items():
        assert (w[torch.as_tensor(types == t)].sum() / w.sum()).item() == pytest.approx(share)


def test_bad_env_arguments_are_clear_errors(train_packet, packets, capsys):
    with pytest.raises(ssjr.InputError, match="unknown start 'adaptive'"):  # before any engine is built
        envs.make_env("isaaclab", N, "cpu", train_packet, start="adaptive")
    with pytest.raises(ssjr.InputError, match="unknown terrain"):  # after the split, before the engine
        envs.make_env("genesis", N, "cpu", packets, terrain="moon")
    assert "not trained on: B_HandsUp_seg00.npz" in capsys.readouterr().out  # a held-out clip is never dropped silently
    with pytest.raises(ssjr.InputError, match="at least 1"):
        envs.make_env("genesis", 0, "cpu", train_packet)


def test_same_pd_hold_gives_close_trajectories_on_every_engine(built):
    """Cross-engine sanity: the same initial state (reference frame 0) and the same PD hold of that pose, nominal
    dynamics, 0.3 s. Loose tolerance: the engines differ in contact models and solvers (that is the point of the
    zero-shot evaluation), but the same robot, gains and joint order must give the same gross motion."""
    traj = {}
    for sim, env in built.items():
        dr, env.dr = env.dr, None
        env.reseed(0)  # same clips, start times and tiles on both
        env.dr = dr
        hold = env.sim.dof_state()[0].clone()
        start = env.sim.root_state()[0].clone()
        pelvis = []
        for _ in range(15):
            env.step(hold)
            pelvis.append(env.body_pos_w[:, 0] - start)
        traj[sim] = torch.stack(pelvis)
        env.reset()
    for other in ("isaaclab", "mujoco"):
        gap = (traj["genesis"] - traj[other]).norm(dim=-1)
        assert gap.max() < 0.05, (other, gap.max(-1).values)


def test_resetting_some_envs_leaves_the_others_observations_alone(env):
    obs = env.reset()
    for _ in range(3):
        obs, *_ = env.step(obs["ref_dof_pos"])
    stacks = {k: obs[k].clone() for k in ("proprio", "student_proprio", "history", "history_mask")}
    obs = env.reset(torch.tensor([0]))
    for k, before in stacks.items():
        assert torch.equal(obs[k][1:], before[1:]), k
    assert not obs["history_mask"][0].any() and obs["history_mask"][1:].any()
    assert torch.equal(obs["proprio"][0, 0], obs["proprio"][0, -1])  # a fresh stack repeats its first frame


def test_without_the_root_velocity_the_actor_reads_the_bodies_velocities_relative_to_the_root(env, monkeypatch):
    """root_velocity=False (teacher.py --no-root-velocity): the actor's proprio holds every body's linear velocity
    minus the root's (zero for the root itself); the critic still reads them as they are, like the default actor."""
    B = envs.NUM_BODIES
    lin = slice(1 + (B - 1) * 3 + B * 6, 1 + (B - 1) * 3 + B * 9)  # after root height, body positions and rot6d
    obs = env.reset()
    for root_velocity in (True, False):
        monkeypatch.setattr(env, "root_velocity", root_velocity)  # the module's env gets its default back after
        obs, *_ = env.step(obs["ref_dof_pos"])
        actor, critic = obs["proprio"][:, -1, lin].view(-1, B, 3), obs["critic"][:, lin].view(-1, B, 3)
        assert critic[:, 0].norm(dim=-1).min() > 1e-3  # the root moves
        expected = critic if root_velocity else critic - critic[:, :1]
        assert torch.allclose(actor, expected, atol=1e-6)


def test_sensor_noise_is_one_draw_per_reading_carried_through_the_stacks(env):
    """Under DR every reading of s (encoders, IMU) gets one noise draw, and every stack holding it holds the same
    numbers: student_proprio's rows, the history's (s, alpha) pairs and the teacher's joint fields."""
    prev = env.reset()
    for _ in range(3):
        obs, _, done, _ = env.step(prev["ref_dof_pos"])
        assert not done.any()
        reading = prev["student_proprio"][:, -1, :envs.SPARSE_STATE_DIM]
        assert torch.equal(obs["student_proprio"][:, -2, :envs.SPARSE_STATE_DIM], reading)
        assert torch.equal(obs["history"][:, -1, :envs.SPARSE_STATE_DIM], reading)
        assert torch.equal(obs["proprio"][:, -1, -87:-29], obs["student_proprio"][:, -1, :58])  # q, qd readings
        prev = obs
    q, qd = env.sim.dof_state()
    err = obs["student_proprio"][:, -1, :envs.SPARSE_STATE_DIM] - env.sparse_state(env.sim.body_state(), q, qd)
    for field, std in ((slice(0, 29), env.dr.noise_dof_pos_rad), (slice(29, 58), env.dr.noise_dof_vel_rad_s)):
        assert 0.7 * std < err[:, field].std() < 1.3 * std
    assert torch.equal(obs["student_proprio"][:, -1, 64:], env.last_alpha)  # the PD target is known exactly


def test_motion_lib_tick_table_matches_the_packet_frames(train_packet):
    """The 50 Hz tick table: a tick on a 30 fps frame (every 5th) is that frame; a tick between two frames is their
    lerp (positions) / slerp (rotations); ticks clamp to the clip; two clips are indexed apart."""
    lib = envs.MotionLib([train_packet, train_packet], "cpu")
    packet = ssjr.load_packet(train_packet)
    frame = lambda key, i: torch.as_tensor(packet[key][i], dtype=torch.float32)
    last = int(lib.num_ticks[0]) - 1
    assert last * envs.CONTROL_DT_S <= float(lib.length_s[0]) < (last + 1) * envs.CONTROL_DT_S
    on_frames = lib.at_tick(torch.tensor([0, 1, 0]), torch.tensor([0, 5, 10]))  # frames 0, 3, 6
    for j, i in enumerate((0, 3, 6)):
        assert torch.allclose(on_frames["body_pos"][j], frame("body_pos_w", i), atol=1e-6)
        assert torch.allclose(on_frames["body_quat"][j], frame("body_quat_w", i), atol=1e-6)
        assert torch.allclose(on_frames["dof_vel"][j], frame("dof_vel", i), atol=1e-6)
    between = lib.at_tick(torch.tensor([1]), torch.tensor([7]))  # t = 0.14 s = frame 4.2
    assert torch.allclose(between["dof_pos"][0], 0.8 * frame("dof_pos", 4) + 0.2 * frame("dof_pos", 5), atol=1e-5)
    slerp = ssjr.quat_slerp(frame("body_quat_w", 4), frame("body_quat_w", 5), torch.full((30,), 0.2))
    assert torch.allclose(between["body_quat"][0], slerp, atol=1e-5)
    clamped = lib.at_tick(torch.tensor([0, 0]), torch.tensor([last, last + 5]))
    assert torch.equal(clamped["body_pos"][0], clamped["body_pos"][1])


def test_random_starts_cover_the_clip_up_to_the_last_start_tick(built):
    """`start="random"` draws start ticks 0 .. MotionLib.last_start_tick of the clip (START_MARGIN_S before its end).
    Last in the module: it advances the shared env's generator."""
    env = built["genesis"]
    ticks = []
    for _ in range(60):
        env.reset()
        ticks.append(env.tick0.clone())
    ticks, last = torch.cat(ticks), int(env.motions.last_start_tick[0])
    assert ticks.min() >= 0 and ticks.max() <= last
    assert ticks.min() <= 15 and ticks.max() >= last - 15  # 480 uniform draws reach both ends of the range


def write_nan_joint_velocity(env, i):
    """A real non-finite state in env i, written into the engine (not a mocked nan_envs)."""
    nan = torch.full((1, 29), float("nan"))
    ids = torch.tensor([i])
    if isinstance(env.sim, envs.GenesisSim):
        env.sim.robot.set_dofs_velocity(nan, env.sim.dofs, envs_idx=ids)
    elif isinstance(env.sim, envs.MuJoCoSim):  # MuJoCo resets it at once (its check after each step), with a warning
        env.sim.datas[i].qvel[6:] = nan[0].numpy()
        env.sim._refresh(i)
    else:
        env.sim.robot.write_joint_velocity_to_sim_index(velocity=nan, env_ids=ids.to(torch.int32))


def test_real_blow_ups_at_every_substep_phase_are_reset_and_counted(env):
    """Genesis checks its error flags every 10 physics substeps and raises once an env is non-finite. Blow-ups at
    every phase against that check (substep k of the control step, control steps apart by 2: 20 injections cover
    every pair of k and the check's position) leave the run going: each is reset and counted once, and the other
    envs and the next step stay finite."""
    obs = env.reset()
    engine_step = env.sim.step
    for i in range(20):
        substep, calls = i % envs.DECIMATION, []

        def step_then_blow_up(tau):
            engine_step(tau)
            calls.append(1)
            if len(calls) == substep + 1:
                write_nan_joint_velocity(env, 1)

        before = int(env.nan_resets)
        env.sim.step = step_then_blow_up
        try:
            obs, reward, done, info = env.step(obs["ref_dof_pos"])
        finally:
            env.sim.step = engine_step
        assert bool(info["nan"][1]) and bool(done[1]) and int(env.nan_resets) == before + 1, i
        assert not info["nan"][torch.arange(N) != 1].any()
        obs, reward, done, info = env.step(obs["ref_dof_pos"])
        assert torch.isfinite(reward).all() and not info["nan"].any(), i
        assert all(torch.isfinite(v.float()).all() for v in obs.values()), i


@pytest.mark.parametrize("sim", ["genesis", "mujoco"])
def test_the_terrain_mix_heightfield_builds_and_steps(train_packet, sim):
    """The paper preset's terrain (flat, smooth and rough slopes) as a heightfield, a few envs on the CPU: the robots
    spawn on it, stand on it (root 0.5-1.1 m above the ground under it) and stay finite."""
    env = envs.make_env(sim, 4, "cpu", train_packet, dr=envs.DR(), terrain="mix", seed=0)
    obs = env.reset()
    for _ in range(25):
        obs, reward, done, info = env.step(obs["ref_dof_pos"])
        assert torch.isfinite(reward).all() and not info["nan"].any()
    height = obs["proprio"][:, -1, 0]  # root height above the terrain under it
    assert ((height > 0.5) & (height < 1.1)).all(), height
    assert len(set(env.terrain.tile_types)) == 3


def test_the_shipped_mujoco_scene_is_the_g1_model_with_our_joint_constants():
    """g1_scene.xml (loaded by the MuJoCo env and by deploy.py) is what `python envs.py scene` writes today."""
    assert envs.SCENE_XML.read_text() == envs.mujoco_scene_xml()


def test_mujoco_threads_step_the_same_numbers_as_one_loop(train_packet, monkeypatch):
    """The MuJoCo env steps slices of its envs on threads (one per core of this process): the same states, bit for bit,
    as one loop over all of them, DR and resets included."""
    def rollout(cores: int):
        monkeypatch.setattr(envs.os, "sched_getaffinity", lambda pid: set(range(cores)))
        env = envs.make_env("mujoco", 6, "cpu", train_packet, dr=envs.DR(), seed=0)
        assert len(env.sim._slices) == cores
        obs, resets = env.reset(), 0
        for _ in range(40):
            obs, reward, done, info = env.step(obs["ref_dof_pos"] + 0.5)  # off the reference: they fall and reset
            resets += int(done.sum())
        env.close()
        return obs, resets
    (one, resets), (three, _) = rollout(1), rollout(3)
    assert resets > 0 and all(torch.equal(one[k], three[k]) for k in one)


def test_mujoco_counts_every_blow_up_of_the_same_env(train_packet):
    """MuJoCo resets a bad state by itself, zeroing its warning counts and then counting 1: a second blow-up of the
    same env must still be reported (an acceleration blown up inside the engine leaves no NaN for the env to see)."""
    env = envs.make_env("mujoco", 2, "cpu", train_packet, seed=0)
    env.reset()
    for _ in range(3):
        env.sim.datas[1].qvel[6:] = float("nan")
        env.sim.step(torch.zeros(2, 29))
        assert env.sim.nan_envs().tolist() == [False, True]
        state = [x[1:] for x in (*env.sim.root_state(), *env.sim.dof_state())]
        env.sim.write_state(torch.tensor([1]), *state)
        assert not env.sim.nan_envs().any() and torch.isfinite(env.sim.dof_state()[1]).all()
    env.close()


def test_training_levers_frame0_share_clip_weights_and_grace_steps(packets):
    """The authors' training levers (teacher.py sets them): every start at frame 0 with frame0_share 1, only the
    weighted clip with weights (0, 1), and no failure within grace_steps of a reset (a 0.6 m offset fails at once
    without them)."""
    env = envs.make_env("mujoco", 8, "cpu", packets, dr=envs.DR(), seed=0, exclude_test=False)
    env.reset()
    assert (env.tick0 > 0).any() and len(set(env.clip.tolist())) == 2  # uniform clips and start ticks by default
    env.frame0_share, env.clip_weights, env.grace_steps = 1.0, torch.tensor([0.0, 1.0]), 5
    for grace in (5, 0):
        env.grace_steps = grace
        obs = env.reset()
        assert (env.tick0 == 0).all() and (env.clip == 1).all()
        pos, quat, v, w = env.sim.root_state()
        env.sim.write_state(all_ids(env), pos + torch.tensor([0.6, 0.0, 0.0]), quat, v, w, *env.sim.dof_state())
        _, _, done, info = env.step(obs["ref_dof_pos"])
        assert info["failed"].all() if grace == 0 else not info["failed"].any()
    env.close()


def test_clamp_targets_plays_and_remembers_targets_within_the_joint_ranges(train_packet):
    """make_env(clamp_targets=True): a target beyond its joint's range is played (PD law, delay line) and remembered
    (proprio, history) at the range's end; without it, as given."""
    kin = ssjr.G1Kinematics()
    beyond = kin.dof_upper_rad + 0.3
    for clamp in (False, True):
        env = envs.make_env("mujoco", 2, "cpu", train_packet, seed=0, clamp_targets=clamp)
        env.reset()
        q, qd = (x.clone() for x in env.sim.dof_state())
        env.step(beyond.expand(2, -1))
        played = kin.dof_upper_rad if clamp else beyond
        torch.testing.assert_close(env.alpha_line[:, -1], played.expand(2, -1))
        torch.testing.assert_close(env.history[:, -1, -envs.NUM_DOF:], played.expand(2, -1))
        tau = (env.kp * (played - q) - env.kd * qd).clamp(-env.effort_limit_nm, env.effort_limit_nm)  # no DR, no delay
        torch.testing.assert_close(env.substep_tau[0], tau, rtol=1e-4, atol=1e-4)
        env.close()
