"""SSJR tests: rotation math, FK against MuJoCo (random poses and real packets), loaders on the shared data, the
cleaning steps, packets, keypoint commands, drawing, and one test per kind of bad input."""
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import ssjr  # noqa: E402

torch.set_num_threads(1)  # tiny tensors on a shared 2-core machine: threads only cost time
G1_MOVES = ssjr.DATA_ROOT / "g1_moves"
needs_data = pytest.mark.skipif(not ssjr.DATA_ROOT.is_dir(), reason=f"shared data not found at {ssjr.DATA_ROOT}")


def rand_quat(*shape, seed=0):
    return ssjr.quat_normalize(torch.randn(*shape, 4, generator=torch.Generator().manual_seed(seed),
                                           dtype=torch.float64))


@pytest.fixture(scope="module")
def kin():
    return ssjr.G1Kinematics()


@pytest.fixture(scope="module")
def mj():
    import mujoco
    model = mujoco.MjModel.from_xml_path(str(ssjr.g1_mjcf_path()))
    return mujoco, model, mujoco.MjData(model)


def engine_fk(mj, root_pos, root_quat, dof_pos):
    """MuJoCo body positions / quaternions [T,30,·] for qpos = (xyz, wxyz, 29 dofs)."""
    mujoco, model, data = mj
    pos, quat = [], []
    for rp, rq, q in zip(root_pos, root_quat, dof_pos):
        data.qpos[:] = np.concatenate((rp, rq, q))
        mujoco.mj_kinematics(model, data)
        pos.append(data.xpos[1:].copy())
        quat.append(data.xquat[1:].copy())
    return np.array(pos), np.array(quat)


def convert_args(tmp_path, *src, **kw):
    return ssjr.Convert(src=tuple(pathlib.Path(s) for s in src), out=tmp_path / "out", **kw)


def g1_clip(name):
    return next(G1_MOVES.rglob(f"{name}.csv"))


def standing_rows(seconds=3.0, fps=30.0):
    """A synthetic G1 CSV body: standing at the MJCF pelvis height with a gentle knee/arm sway, quat xyzw."""
    t = np.arange(int(seconds * fps)) / fps
    rows = np.zeros((len(t), 36))
    rows[:, 2] = 0.793
    rows[:, 6] = 1.0
    rows[:, 7 + 3] = rows[:, 7 + 9] = 0.05 + 0.05 * np.sin(2 * np.pi * t)  # knees: inside their limits
    rows[:, 7 + 15] = 0.3 * np.sin(np.pi * t)  # left shoulder pitch
    return rows


def write_csv(path, rows):
    np.savetxt(path, rows, delimiter=",", fmt="%.6f")
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Rotation math
def test_quat_ops_agree_with_rotation_matrices():
    a, b = rand_quat(2, 3, seed=1), rand_quat(2, 3, seed=2)
    v = torch.randn(2, 3, 3, dtype=torch.float64)
    ra, rb = ssjr.quat_to_rotmat(a), ssjr.quat_to_rotmat(b)
    assert torch.allclose(ssjr.quat_apply(a, v), (ra @ v[..., None])[..., 0], atol=1e-12)
    assert torch.allclose(ssjr.quat_to_rotmat(ssjr.quat_mul(a, b)), ra @ rb, atol=1e-12)
    assert torch.allclose(ssjr.quat_to_rotmat(ssjr.quat_conj(a)), ra.transpose(-1, -2), atol=1e-12)
    assert torch.allclose(ra @ ra.transpose(-1, -2), torch.eye(3, dtype=torch.float64).expand(2, 3, 3, 3), atol=1e-12)


def test_axis_angle_rotvec_slerp_yaw_angle_rot6d():
    z90 = ssjr.quat_from_axis_angle(torch.tensor([0.0, 0.0, 2.0]), torch.tensor(math.pi / 2))
    assert torch.allclose(ssjr.quat_apply(z90, torch.tensor([1.0, 0.0, 0.0])), torch.tensor([0.0, 1.0, 0.0]),
                          atol=1e-6)
    rv = torch.tensor([[0.3, -0.2, 0.9], [1e-9, 0.0, 0.0], [0.0, 3.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(ssjr.quat_to_rotvec(ssjr.quat_from_rotvec(rv)), rv, atol=1e-9)
    q0, q1 = rand_quat(5, seed=3), rand_quat(5, seed=4)
    assert torch.allclose(ssjr.quat_angle(ssjr.quat_slerp(q0, q1, 0.0), q0), torch.zeros(5, dtype=torch.float64),
                          atol=1e-6)
    mid = ssjr.quat_slerp(q0, -q1, 0.5)  # sign of q1 must not matter: shortest arc
    total = ssjr.quat_angle(q0, q1)
    assert torch.allclose(ssjr.quat_angle(q0, mid), total / 2, atol=1e-6)
    assert torch.allclose(ssjr.quat_angle(mid, q1), total / 2, atol=1e-6)
    yaw = ssjr.quat_from_axis_angle(torch.tensor([0.0, 0, 1]), torch.tensor(2.5))
    pitch = ssjr.quat_from_axis_angle(torch.tensor([0.0, 1, 0]), torch.tensor(0.7))
    assert ssjr.quat_angle(ssjr.z_quat(ssjr.yaw_rad(ssjr.quat_mul(yaw, pitch))), yaw) < 1e-5
    assert abs(ssjr.quat_angle(yaw, ssjr.quat_mul(yaw, pitch)) - 0.7) < 1e-5
    m = ssjr.quat_to_rotmat(q0)
    assert torch.allclose(ssjr.rot6d(q0), torch.cat((m[..., :, 0], m[..., :, 1]), -1))


def test_root_relative_is_heading_frame_and_the_command_uses_it():
    pts = torch.randn(7, 4, 3, dtype=torch.float64)
    root_pos = torch.randn(7, 3, dtype=torch.float64)
    root_quat = rand_quat(7, seed=5)
    rel = ssjr.root_relative(pts, root_pos, root_quat)
    # moving and turning the whole scene about z changes nothing; the root's tilt is ignored (heading frame)
    turn = ssjr.quat_from_axis_angle(torch.tensor([0.0, 0, 1], dtype=torch.float64), torch.tensor(1.1,
                                                                                                 dtype=torch.float64))
    shift = torch.tensor([3.0, -2.0, 0.5], dtype=torch.float64)
    moved = ssjr.root_relative(ssjr.quat_apply(turn, pts) + shift, ssjr.quat_apply(turn, root_pos) + shift,
                               ssjr.quat_mul(turn, root_quat))
    assert torch.allclose(moved, rel, atol=1e-9)
    assert torch.allclose(ssjr.root_relative(pts, root_pos, ssjr.z_quat(ssjr.yaw_rad(root_quat))), rel, atol=1e-9)
    assert torch.allclose(rel[..., 2], pts[..., 2] - root_pos[:, None, 2])  # z stays world up
    # Y_t: every step of the window [H, J, 3] in the frame of the one root pose at t
    y = ssjr.keypoint_command(pts[:3], root_pos[0], root_quat[0])
    assert y.shape == (3, 12)
    assert torch.allclose(y[2], ssjr.root_relative(pts[2], root_pos[0], root_quat[0]).reshape(-1))


# ---------------------------------------------------------------------------------------------------------------------
# Forward kinematics
def test_mjcf_tree_matches_constants(kin):
    assert kin.body_names == ssjr.BODY_NAMES and kin.dof_names == ssjr.DOF_NAMES
    assert kin.parents == ssjr.BODY_PARENTS
    assert [ssjr.BODY_NAMES[i] for i in ssjr.KEYPOINT_BODY_IDS] == list(ssjr.KEYPOINT_NAMES)
    assert (kin.dof_lower_rad < kin.dof_upper_rad).all() and torch.isfinite(kin.dof_lower_rad).all()


def test_fk_matches_mujoco_random_poses(kin, mj):
    rng = np.random.default_rng(0)
    n = 64
    root_pos = rng.normal(size=(n, 3))
    root_quat = rand_quat(n, seed=6).numpy()
    dof = rng.uniform(kin.dof_lower_rad.numpy(), kin.dof_upper_rad.numpy(), size=(n, 29))
    pos, quat = kin.forward(*(torch.tensor(x, dtype=torch.float32) for x in (root_pos, root_quat, dof)))
    ref_pos, ref_quat = engine_fk(mj, root_pos, root_quat, dof)
    assert np.abs(pos.numpy() - ref_pos).max() < 1e-4  # far below the 1 mm requirement (float32)
    assert ssjr.quat_angle(quat, torch.tensor(ref_quat, dtype=torch.float32)).max() < 1e-3
    # lowest collision point: MuJoCo capsule end points (pos +- half length along the geom z) minus the radius
    mujoco, model, data = mj
    collide = [g for g in range(model.ngeom) if model.geom_contype[g] or model.geom_conaffinity[g]]
    lowest = []
    for k in range(4):
        data.qpos[:] = np.concatenate((root_pos[k], root_quat[k], dof[k]))
        mujoco.mj_kinematics(model, data)
        z = [data.geom_xpos[g, 2] - model.geom_size[g, 0] - (abs(data.geom_xmat[g].reshape(3, 3)[2, 2]) *
             model.geom_size[g, 1] if model.geom_type[g] == mujoco.mjtGeom.mjGEOM_CAPSULE else 0.0) for g in collide]
        lowest.append(min(z))
    assert len(collide) == len(kin.geom_radius)
    assert np.allclose(kin.lowest_point_z(pos[:4], quat[:4]).numpy(), lowest, atol=1e-4)


@needs_data
def test_g1_moves_packets_match_mujoco_and_segments(kin, mj, tmp_path):
    """B_Fence2 (10.6 s, one IK flip) -> two 5.3 s segments; M_ShortMove14 (6.5 s) -> one."""
    reports = ssjr.convert(convert_args(tmp_path, g1_clip("B_Fence2"), g1_clip("M_ShortMove14")))
    assert [r.kept for r in reports] == [2, 1] and not any(r.error for r in reports)
    assert reports[0].glitch_frames > 0  # the flip was found and repaired
    paths = sorted((tmp_path / "out").glob("*.npz"))
    assert [p.name for p in paths] == ["B_Fence2_seg00.npz", "B_Fence2_seg01.npz", "M_ShortMove14_seg00.npz"]
    src = np.loadtxt(g1_clip("B_Fence2"), delimiter=",")
    seg0, seg1 = ssjr.load_packet(paths[0]), ssjr.load_packet(paths[1])
    assert len(seg0["dof_pos"]) + len(seg1["dof_pos"]) == (len(src) - 1) // 2 + 1  # 60 -> 30 fps, nothing lost
    assert np.allclose(seg0["body_pos_w"][:, 0], src[0:2 * len(seg0["dof_pos"]):2, :3], atol=1e-6)
    for path in paths:
        p = ssjr.load_packet(path)
        T = len(p["dof_pos"])
        assert p["fps"] == 30.0 and 2.0 <= T / 30.0 <= 10.0 and p["kind"] == "robot"
        assert "CC-BY-4.0" in p["license"] and p["source"].endswith(".csv")
        shapes = dict(body_pos_w=(T, 30, 3), body_rotmat_w=(T, 30, 3, 3), body_quat_w=(T, 30, 4),
                      body_lin_vel_w=(T, 30, 3), body_ang_vel_w=(T, 30, 3), local_rot=(T, 29, 4),
                      root_lin_vel_w=(T, 3), root_ang_vel_w=(T, 3), dof_pos=(T, 29), dof_vel=(T, 29))
        for key, shape in shapes.items():
            assert p[key].shape == shape and p[key].dtype == np.float32, key
        assert np.abs(p["dof_vel"]).max() < 25.0  # no IK flips left
        frames = np.arange(0, T, 7)
        ref_pos, ref_quat = engine_fk(mj, p["body_pos_w"][frames, 0], p["body_quat_w"][frames, 0],
                                      p["dof_pos"][frames])
        assert np.abs(p["body_pos_w"][frames] - ref_pos).max() < 1e-3  # the requirement: < 1 mm vs the engine
        assert ssjr.quat_angle(torch.tensor(p["body_quat_w"][frames]), torch.tensor(ref_quat,
                                                                                   dtype=torch.float32)).max() < 1e-3
    # velocities: central differences; angular velocity integrates back to the next rotation
    p, t = seg0, 40
    assert np.allclose(p["body_lin_vel_w"][t], (p["body_pos_w"][t + 1] - p["body_pos_w"][t - 1]) * 15, atol=1e-4)
    assert np.allclose(p["dof_vel"][t], (p["dof_pos"][t + 1] - p["dof_pos"][t - 1]) * 15, atol=1e-4)
    q = torch.tensor(p["body_quat_w"])
    step = ssjr.quat_from_rotvec(torch.tensor(p["body_ang_vel_w"][t]) * (2 / 30))
    assert ssjr.quat_angle(ssjr.quat_mul(step, q[t - 1]), q[t + 1]).max() < 1e-3
    assert np.allclose(p["root_ang_vel_w"], p["body_ang_vel_w"][:, 0])
    # local rotations compose to the world rotations
    parent, child = ssjr.BODY_NAMES.index("left_knee_link") - 1, ssjr.BODY_NAMES.index("left_knee_link")
    composed = ssjr.quat_mul(q[:, parent], torch.tensor(p["local_rot"][:, child - 1]))
    assert ssjr.quat_angle(composed, q[:, child]).max() < 1e-3


def test_train_test_split_by_clip_prefix():
    paths = [pathlib.Path(f"x/{n}.npz") for n in ("M_Move7_seg00", "M_Move70_seg00", "B_HandsUp_seg00",
                                                    "M_Move1_seg03", "J_Dance3_Woah", "J_Dance3_Woah2_seg00")]
    train, test = ssjr.train_test_split(paths)
    assert [p.stem for p in test] == ["M_Move7_seg00", "B_HandsUp_seg00", "J_Dance3_Woah"]
    assert [p.stem for p in train] == ["M_Move70_seg00", "M_Move1_seg03", "J_Dance3_Woah2_seg00"]


# ---------------------------------------------------------------------------------------------------------------------
# Cleaning steps
def test_glitch_repair_resample_and_segments():
    fps = 60.0
    t = np.arange(600) / fps
    dof = np.zeros((600, 29))
    dof[:, 22] = 0.5 * np.sin(t)
    dof[300:, 22] -= 1.2  # an IK flip: a 1.2 rad step in one frame (72 rad/s)
    dof[400:, 23] = np.where(np.arange(200) % 2, 0.6, 0.0)  # 3.3 s of flicker: no short window can fix it
    fixed, n_changed, bad = ssjr.repair_glitches(dof, fps, max_rad_s=25.0, max_window_s=0.25)
    assert np.abs(np.diff(fixed[:, 22])).max() * fps < 25.0 and 0 < n_changed < 15
    assert np.allclose(fixed[:290, 22], dof[:290, 22]) and np.allclose(fixed[310:400, 22], dof[310:400, 22])
    assert bad[450] and not bad[:390].any()
    # resampling: 60 -> 30 fps keeps every other frame; 50 -> 30 fps interpolates linearly; slerp for the root
    i0, i1, w = ssjr.resample_times(600, 60.0, 30.0)
    assert (i0 == np.arange(0, 600, 2)).all() and np.allclose(w, 0)
    ramp = np.linspace(0, 1, 51)[:, None].repeat(29, 1)
    angle = np.linspace(0, 2.0, 51)
    quat = np.stack((np.cos(angle / 2), 0 * angle, 0 * angle, np.sin(angle / 2)), 1)
    out = ssjr.resample(dict(root_quat=quat, dof_pos=ramp), 50.0, 30.0, ("root_quat",))
    assert len(out["dof_pos"]) == 31 and np.allclose(out["dof_pos"][:, 0], np.linspace(0, 1, 31))
    yaw = 2 * np.arctan2(out["root_quat"][:, 3], out["root_quat"][:, 0])
    assert np.allclose(yaw, np.linspace(0, 2.0, 31), atol=1e-6)
    assert ssjr.segment_bounds(300, 30.0) == [(0, 300)]
    assert ssjr.segment_bounds(301, 30.0) == [(0, 150), (150, 301)]
    assert all(60 <= b - a <= 300 for a, b in ssjr.segment_bounds(3585, 30.0))
    with pytest.raises(ValueError, match="too short"):
        ssjr.segment_bounds(59, 30.0)
    # quaternion signs are made continuous, norms fixed
    q = np.tile([0.5, 0.5, 0.5, 0.5], (4, 1)) * np.array([[1], [-1], [1.001], [-1]])
    clean = ssjr.clean_quaternions("x", q)
    assert (clean @ clean[0] > 0.99).all() and np.allclose(np.linalg.norm(clean, axis=1), 1)


def test_limits_and_ground_penetration_drop_segments(tmp_path):
    ok = standing_rows(3.0)
    slightly = ok.copy()
    slightly[:, 7 + 3] = -0.1  # knee 13 mrad past its lower limit (-0.087): clipped, kept
    far = ok.copy()
    far[:, 7 + 3] = -0.4  # 0.31 rad past it: dropped
    sunk = ok.copy()
    sunk[:, 2] -= 0.1  # the whole robot 10 cm into the ground: dropped
    files = [write_csv(tmp_path / f"{n}.csv", rows) for n, rows in
             (("ok", ok), ("slightly", slightly), ("far", far), ("sunk", sunk))]
    reports = {r.clip: r for r in ssjr.convert(convert_args(tmp_path, *files, fps=30.0))}
    assert reports["ok"].kept == 1 and not reports["ok"].dropped
    assert reports["slightly"].kept == 1 and reports["slightly"].clipped_frames == 90
    knee = ssjr.load_packet(tmp_path / "out" / "slightly_seg00.npz")["dof_pos"][:, 3]
    assert np.allclose(knee, -0.087267, atol=1e-6)
    assert reports["far"].kept == 0 and reports["far"].dropped == {"joint limits": 1}
    assert reports["sunk"].kept == 0 and reports["sunk"].dropped == {"ground penetration": 1}
    assert "dropped {'ground penetration': 1}" in str(reports["sunk"])


# ---------------------------------------------------------------------------------------------------------------------
# Other sources
@needs_data
def test_phc_pkl_needs_the_23dof_flag_then_maps_wrists_to_zero(tmp_path):
    pkl = sorted((ssjr.DATA_ROOT / "asap_phc_g1_23dof").glob("*squat_level1*.pkl"))[0]
    with pytest.raises(ssjr.InputError, match="--allow-23dof") as e:
        ssjr.load_motions(pkl)
    assert str(e.value).startswith(str(pkl))
    (m,) = ssjr.load_motions(pkl, allow_23dof=True)
    assert m.fps == 30 and m.dof_pos.shape[1] == 29 and (m.dof_pos[:, list(ssjr.WRIST_DOF_IDS)] == 0).all()
    assert np.abs(m.dof_pos[:, list(ssjr.DOF23_IDS)]).max() > 0.1 and "wrist" in m.notes[0]
    (r,) = ssjr.convert(convert_args(tmp_path, pkl, allow_23dof=True))
    assert r.kept == 1 and r.kind == "robot"
    p = ssjr.load_packet(next((tmp_path / "out").glob("*.npz")))
    assert p["body_pos_w"].shape[1:] == (30, 3) and "MIT" in p["license"]


def test_bvh_becomes_g1_sized_keypoint_commands(kin, tmp_path):
    bvh = ssjr.SAMPLES / "cmu_bvh" / "131_02.bvh"
    (m,) = ssjr.load_motions(bvh)
    assert isinstance(m, ssjr.HumanMotion) and m.fps == pytest.approx(120, rel=1e-3)
    thigh = np.linalg.norm(m.joints[:, 1] - m.joints[:, 3], axis=-1)
    assert 0.3 < thigh.mean() < 0.6 and thigh.std() < 1e-6  # metres, a rigid bone
    assert 0.7 < m.joints[0, 7, 2] - m.joints[0, 5, 2] < 1.6  # z-up: shoulders well above the ankles
    (r,) = ssjr.convert(convert_args(tmp_path, bvh))
    assert r.kind == "human" and r.kept == 2  # 10.4 s -> two segments
    p = ssjr.load_packet(tmp_path / "out" / "131_02_seg00.npz")
    kp = p["keypoints_w"]
    assert p["kind"] == "human_keypoints" and p["keypoint_names"] == list(ssjr.KEYPOINT_NAMES)
    assert kp.shape == (len(kp), len(ssjr.KEYPOINT_NAMES), 3) and 2 <= len(kp) / p["fps"] <= 10
    zero_pos, _ = kin.forward(kin.default_root_pos, torch.tensor([1.0, 0, 0, 0]), torch.zeros(29))
    names = ssjr.KEYPOINT_NAMES
    shin = np.linalg.norm(kp[:, names.index("left_knee_link")] - kp[:, names.index("left_ankle_roll_link")], axis=-1)
    g1_shin = (zero_pos[ssjr.BODY_NAMES.index("left_knee_link")] -
               zero_pos[ssjr.BODY_NAMES.index("left_ankle_roll_link")]).norm().item()
    assert np.allclose(shin, g1_shin, atol=1e-4)  # the G1's bone lengths, not the human's
    ankles = kp[:, [names.index("left_ankle_roll_link"), names.index("right_ankle_roll_link")], 2].min(1)
    assert 0.0 < np.percentile(ankles, 10) < 0.1  # feet on the ground
    assert np.allclose(p["root_pos_w"], kp[:, 0]) and np.allclose(p["root_quat_w"][:, 1:3], 0)


def synthetic_smpl_model(path, n_verts=40, seed=0):
    """Same layout as the licensed SMPL npz (v_template, shapedirs, J_regressor, kintree_table), random values."""
    rng = np.random.default_rng(seed)
    parents = [-1, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 12, 13, 14, 16, 17, 18, 19, 20, 21]
    regressor = rng.random((24, n_verts))
    np.savez(path, v_template=rng.normal(size=(n_verts, 3)), shapedirs=0.01 * rng.normal(size=(n_verts, 3, 10)),
             J_regressor=regressor / regressor.sum(1, keepdims=True),
             kintree_table=np.array([[2 ** 32 - 1] + parents[1:], list(range(24))]), f=np.zeros((1, 3), int))
    return path


def test_smpl_joints_with_a_synthetic_model(tmp_path):
    model = ssjr.load_smpl_model(synthetic_smpl_model(tmp_path / "smpl.npz"))
    rest = model["J_regressor"] @ model["v_template"]
    trans = np.array([[1.0, 2.0, 3.0]])
    assert np.allclose(ssjr.smpl_joints(model, np.zeros((1, 72)), trans, np.zeros(10))[0], rest + trans)
    poses = np.zeros((1, 72))
    poses[0, :3] = [0, 0, np.pi / 2]  # root turned 90 deg about z: every joint turns about the root joint
    joints = ssjr.smpl_joints(model, poses, trans, np.zeros(10))[0]
    rz = np.array([[0, -1, 0], [1, 0, 0], [0, 0, 1.0]])
    assert np.allclose(joints, (rest - rest[0]) @ rz.T + rest[0] + trans, atol=1e-9)
    poses = np.zeros((1, 72))
    poses[0, 3 * 4:3 * 5] = [1.0, 0.2, 0.0]  # bend the left knee: the ankle moves, the bone keeps its length
    joints = ssjr.smpl_joints(model, poses, np.zeros((1, 3)), np.zeros(10))[0]
    assert not np.allclose(joints[7], rest[7])
    assert np.isclose(np.linalg.norm(joints[7] - joints[4]), np.linalg.norm(rest[7] - rest[4]))
    assert np.allclose(joints[:7], rest[:7])


@needs_data
def test_amass_needs_a_model_and_converts_with_one(tmp_path):
    npz = ssjr.DATA_ROOT / "asap_amass_smpl" / "video_APT_level1_amass.npz"
    with pytest.raises(ssjr.InputError, match="SMPL body model.*licensed.*--smpl-model") as e:
        ssjr.load_motions(npz)
    assert str(e.value).startswith(str(npz))
    reports = ssjr.convert(convert_args(tmp_path, npz, smpl_model=synthetic_smpl_model(tmp_path / "m.npz")))
    assert reports[0].kind == "human" and reports[0].kept == 1  # 7.7 s of (random-body) SMPL joints
    p = ssjr.load_packet(next((tmp_path / "out").glob("*.npz")))
    assert p["kind"] == "human_keypoints" and np.isfinite(p["keypoints_w"]).all()


def test_mjlab_npz_layouts(tmp_path):
    rows = standing_rows(2.5)
    q29 = rows[:, 7:].copy()
    wxyz = rows[:, [6, 3, 4, 5]]
    np.savez(tmp_path / "a.npz", fps=np.array([50]), joint_pos=np.concatenate((rows[:, :3], wxyz, q29), 1))
    order = np.random.default_rng(0).permutation(29)  # joints stored in another order, with their names
    np.savez(tmp_path / "b.npz", fps=50, joint_pos=q29[:, order], joint_names=np.array(ssjr.DOF_NAMES)[order],
             body_pos_w=rows[:, None, :3].repeat(3, 1), body_quat_w=wxyz[:, None].repeat(3, 1))
    (a,) = ssjr.load_motions(tmp_path / "a.npz")
    (b,) = ssjr.load_motions(tmp_path / "b.npz")
    for m in (a, b):
        assert m.fps == 50 and np.allclose(m.dof_pos, q29) and np.allclose(m.root_quat, wxyz)
    np.savez(tmp_path / "c.npz", fps=50, joint_pos=q29)
    with pytest.raises(ssjr.InputError, match="no root pose") as e:
        ssjr.load_motions(tmp_path / "c.npz")
    assert str(e.value).startswith(f"{tmp_path / 'c.npz'}: ")


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: one line naming the file and the problem; a bad file in a folder is skipped, the rest converts.
def bad_inputs(tmp_path):
    ok = standing_rows(3.0)
    cases = {}

    def csv(name, rows, problem):
        cases[name] = (write_csv(tmp_path / f"{name}.csv", rows), problem)

    csv("columns", ok[:, :35], "wrong column count 35")
    nan = ok.copy()
    nan[10, 9] = np.nan
    csv("nan", nan, "NaN/inf in dof_pos at frame 10")
    inf = ok.copy()
    inf[5, 0] = np.inf
    csv("inf", inf, "NaN/inf in root_pos at frame 5")
    scaled = ok.copy()
    scaled[20, 3:7] *= 1.5
    csv("nonunit", scaled, "non-unit root quaternion at frame 20")
    zero = ok.copy()
    zero[3, 3:7] = 0
    csv("zeroquat", zero, "zero root quaternion at frame 3")
    csv("short", ok[:45], "too short: 1.50 s")
    csv("dof23", np.delete(ok, [7 + i for i in ssjr.WRIST_DOF_IDS], axis=1), "--allow-23dof")
    (tmp_path / "empty.csv").write_text("")
    cases["empty"] = (tmp_path / "empty.csv", "empty file")
    (tmp_path / "corrupt.npz").write_bytes(b"PK\x03\x04" + os.urandom(200))
    cases["corrupt_npz"] = (tmp_path / "corrupt.npz", "corrupt npz")
    (tmp_path / "corrupt.pkl").write_bytes(b"\x80\x04\x95" + os.urandom(200))
    cases["corrupt_pkl"] = (tmp_path / "corrupt.pkl", "corrupt pkl")
    (tmp_path / "broken.bvh").write_text("HIERARCHY\nROOT Hips\n{\n OFFSET 0 0 0\n CHANNELS 3 Xposition Yposition "
                                         "Zposition\n JOINT LeftHip\n {\n OFFSET 1 0 0\n}\nMOTION\nFrames: 1\n"
                                         "Frame Time: 0.01\n0 0 0 0\n")
    cases["bvh"] = (tmp_path / "broken.bvh", "broken BVH hierarchy")
    np.savez(tmp_path / "amass.npz", poses=np.zeros((90, 72)), trans=np.zeros((90, 3)), mocap_framerate=30.0)
    cases["amass"] = (tmp_path / "amass.npz", "SMPL body model")
    return cases


def test_each_bad_input_gets_a_one_line_error(tmp_path):
    cases = bad_inputs(tmp_path)
    fps_file = write_csv(tmp_path / "nofps.csv", standing_rows(3.0))
    with pytest.raises(ssjr.InputError, match="frame rate unknown") as e:
        ssjr.load_motions(fps_file)
    assert str(e.value).startswith(str(fps_file))
    reports = ssjr.convert(convert_args(tmp_path, *(path for path, _ in cases.values()), fps=30.0))
    assert len(reports) == len(cases)
    for (name, (path, problem)), r in zip(cases.items(), reports):
        assert r.error.startswith(f"{path}: ") and problem in r.error and "\n" not in r.error, (name, r.error)
        assert r.kept == 0


def test_folder_with_a_bad_file_converts_the_rest(tmp_path):
    folder = tmp_path / "clips"
    folder.mkdir()
    write_csv(folder / "good.csv", standing_rows(4.0))
    write_csv(folder / "bad.csv", standing_rows(4.0)[:, :30])
    (folder / "notes.txt").write_text("not a motion")
    reports = {r.clip: r for r in ssjr.convert(convert_args(tmp_path, folder, fps=30.0))}
    assert set(reports) == {"good", "bad"}
    assert reports["good"].kept == 1 and (tmp_path / "out" / "good_seg00.npz").exists()
    assert reports["bad"].error.startswith(f"{folder / 'bad.csv'}: 23-DoF data where 29 are required; pass "
                                           "--allow-23dof") and reports["bad"].kept == 0


def test_bvh_with_an_infinite_frame_time_is_a_clear_error(tmp_path):
    text = (ssjr.SAMPLES / "cmu_bvh" / "131_02.bvh").read_text()
    start = text.index("Frame Time:")
    bad = tmp_path / "inf.bvh"
    bad.write_text(text[:start] + "Frame Time: inf" + text[text.index("\n", start):])
    with pytest.raises(ssjr.InputError, match=r"invalid frame rate \(Frame Time inf\)") as e:
        ssjr.load_motions(bad)
    assert str(e.value).startswith(f"{bad}: ")


def test_two_sources_of_one_clip_name_and_stale_segments(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        write_csv(tmp_path / folder / "clip.csv", standing_rows(4.0))
    (tmp_path / "out").mkdir()
    stale = tmp_path / "out" / "clip_seg07.npz"  # left by an earlier conversion of a longer "clip"
    stale.write_bytes(b"")
    first, second = ssjr.convert(convert_args(tmp_path, tmp_path / "a", tmp_path / "b", fps=30.0))
    assert first.kept == 1 and not first.error and not stale.exists()
    assert second.kept == 0 and "would overwrite" in second.error and second.error.startswith(str(tmp_path / "b"))


def test_unwritable_output_folder(tmp_path):
    (tmp_path / "file").write_text("")
    args = ssjr.Convert(src=(tmp_path,), out=tmp_path / "file" / "out")
    with pytest.raises(ssjr.InputError, match="output folder is not writable") as e:
        ssjr.convert(args)
    assert str(e.value).startswith(str(args.out))


def test_load_packet_rejects_non_packets(tmp_path):
    np.savez(tmp_path / "x.npz", fps=30.0)
    with pytest.raises(ssjr.InputError, match=r"x.npz: not an SSJR packet: missing \[.*'dof_pos'"):
        ssjr.load_packet(tmp_path / "x.npz")
    (tmp_path / "y.npz").write_bytes(b"garbage")
    with pytest.raises(ssjr.InputError, match="y.npz: cannot read packet"):
        ssjr.load_packet(tmp_path / "y.npz")
    # a keypoint command from before the stance reference was part of the packet
    old = {k: np.zeros((3, 11, 3)) if k == "keypoints_w" else np.array("x") for k in ssjr.HUMAN_KEYS[:6]}
    np.savez(tmp_path / "old.npz", **{**old, "kind": np.array("human_keypoints")})
    with pytest.raises(ssjr.InputError, match=r"missing \['body_pos_w'.*re-convert"):
        ssjr.load_packet(tmp_path / "old.npz")


def test_cli_prints_one_line_without_traceback(tmp_path):
    bad = write_csv(tmp_path / "bad.csv", standing_rows(3.0)[:, :20])
    run = subprocess.run([sys.executable, str(REPO / "ssjr.py"), "convert", str(bad), "--out", str(tmp_path / "o"),
                          "--fps", "30"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip() == (f"{bad}: wrong column count 20: expected 36 (root xyz, quat xyzw, 29 joints) or 30 "
                                  f"(23 joints)")
    assert "clips: 1 in, 0 kept" in run.stdout


# ---------------------------------------------------------------------------------------------------------------------
# Drawing
def test_render_png_gif_mp4(kin, tmp_path):
    rows = standing_rows(2.0)
    bp, _ = kin.forward(torch.tensor(rows[:, :3], dtype=torch.float32),
                        torch.tensor(rows[:, [6, 3, 4, 5]], dtype=torch.float32),
                        torch.tensor(rows[:, 7:], dtype=torch.float32))
    body = bp.numpy()
    png = ssjr.render_motion(body, tmp_path / "a.png", 30, body[:, ssjr.KEYPOINT_BODY_IDS], title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    gif = ssjr.render_motion(body[:3], tmp_path / "a.gif", 30)
    assert gif.read_bytes()[:6] == b"GIF89a"
    mp4 = ssjr.render_motion(body[:3, ssjr.KEYPOINT_BODY_IDS], tmp_path / "a.mp4", 30)
    assert mp4.read_bytes()[4:8] == b"ftyp"
    with pytest.raises(ValueError, match="png"):
        ssjr.render_motion(body, tmp_path / "a.jpg", 30)
    (r,) = ssjr.convert(convert_args(tmp_path, write_csv(tmp_path / "stand.csv", rows), fps=30.0))
    p = ssjr.load_packet(tmp_path / "out" / "stand_seg00.npz")
    assert r.kept == 1 and p["body_pos_w"].shape == (60, 30, 3) and p["fps"] == 30.0


@pytest.mark.slow
def test_fk_matches_genesis(kin):
    """The second engine, through the project's own Genesis adapter: link positions for random poses."""
    import envs
    sim = envs.GenesisSim(4, "cpu", envs.make_terrain("flat"))
    rng = np.random.default_rng(1)
    root_pos = rng.normal(size=(4, 3)) + [0, 0, 1]
    root_quat = rand_quat(4, seed=7).numpy()
    dof = rng.uniform(kin.dof_lower_rad.numpy(), kin.dof_upper_rad.numpy(), size=(4, 29))
    state = [torch.tensor(x, dtype=torch.float32) for x in (root_pos, root_quat, dof)]
    zeros = torch.zeros(4, 3)
    sim.write_state(torch.arange(4), state[0], state[1], zeros, zeros, state[2], torch.zeros(4, 29))
    engine = sim.body_state()[0].numpy()
    pos, _ = kin.forward(*state)
    assert np.abs(pos.numpy() - engine).max() < 1e-3
