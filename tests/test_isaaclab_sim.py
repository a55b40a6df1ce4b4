"""IsaacLabSim (Isaac Lab 3.0 kit-less, Newton/MuJoCo-Warp on CPU) against the engine-adapter contract.

Isaac Lab's SimulationContext is a process-wide singleton, so at most one IsaacLabSim lives at a time: a
module-scoped holder builds the flat-ground sim once and swaps it for the terrain sim only for the last test
(close() + a new instance works in one process; the second build takes ~1-2 s). Every test needs the ~20 s
(warm caches) to ~3 min (cold Warp kernel cache) build, hence the whole module is marked slow.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import mujoco

import ssjr
from envs import IsaacLabSim

pytestmark = pytest.mark.slow
N = 4
STANCE = {"hip_pitch": -0.312, "knee": 0.669, "ankle_pitch": -0.363, "elbow": 0.6}
KP = torch.tensor([200.0 if ("hip" in n or "knee" in n or "waist" in n) else 60.0 for n in ssjr.DOF_NAMES])
KD = 0.05 * KP


def _stance(n: int) -> torch.Tensor:
    q = torch.zeros(n, 29)
    for name, value in STANCE.items():
        for side in ("left", "right"):
            q[:, ssjr.DOF_NAMES.index(f"{side}_{name}_joint")] = value
    return q


def _flat_terrain():
    return SimpleNamespace(heights_m=np.zeros((8, 8), np.float32), cell_m=0.5, origin_m=(-2.0, -2.0))


def _platform_terrain():
    heights = np.zeros((41, 41), np.float32)
    heights[10:31, 10:31] = 0.2  # a 2 m x 2 m step, 0.2 m high, centred on the origin
    return SimpleNamespace(heights_m=heights, cell_m=0.1, origin_m=(-2.0, -2.0))


def _reset(sim, z_m=0.78, q=None, ids=None):
    """Upright at height z_m, bent-knee stance, at rest, armature 0.02, earth gravity, default masses."""
    ids = torch.arange(sim.num_envs) if ids is None else torch.as_tensor(ids)
    n = len(ids)
    zeros = torch.zeros(n, 29)
    sim.set_gravity(ids, torch.tensor([[0.0, 0.0, -9.81]]).repeat(n, 1))
    sim.set_body_mass(ids, sim.default_body_mass_kg[ids])
    sim.set_joint_params(ids, torch.full((n, 29), 0.02), zeros, zeros)
    sim.set_friction(ids, torch.ones(n))
    sim.write_state(ids, torch.tensor([[0.0, 0.0, z_m]]).repeat(n, 1), torch.tensor([[1.0, 0, 0, 0]]).repeat(n, 1),
                    torch.zeros(n, 3), torch.zeros(n, 3), _stance(n) if q is None else q, zeros)


def _pd_step(sim, target):
    q, qd = sim.dof_state()
    sim.step((KP * (target - q) - KD * qd).clamp(-100.0, 100.0))


class _Holder:
    def __init__(self):
        self.sim, self.kind = None, None

    def get(self, kind):
        if self.kind != kind:
            self.close()
            self.sim = IsaacLabSim(N, "cpu", _flat_terrain() if kind == "flat" else _platform_terrain())
            self.kind = kind
        return self.sim

    def close(self):
        if self.sim is not None:
            self.sim.close()
        self.sim, self.kind = None, None


@pytest.fixture(scope="module")
def holder():
    h = _Holder()
    yield h
    h.close()


@pytest.fixture
def sim(holder):
    return holder.get("flat")


def test_joint_and_body_order_by_name(sim):
    assert sim.dof_names == ssjr.DOF_NAMES and sim.body_names == ssjr.BODY_NAMES
    joints, bodies = list(sim.robot.joint_names), list(sim.robot.body_names)
    assert [joints[i] for i in sim.isaac_index_of_dof.tolist()] == list(ssjr.DOF_NAMES)
    assert [bodies[i] for i in sim.isaac_index_of_body.tolist()] == list(ssjr.BODY_NAMES)
    assert sim.default_body_mass_kg.shape == (N, 30)
    assert abs(float(sim.default_body_mass_kg[0].sum()) - 33.34) < 0.05


def test_write_state_matches_fk(sim):
    """After write_state, body_state = ssjr's FK (and MuJoCo's mj_kinematics) of the same generalized state."""
    model = mujoco.MjModel.from_xml_path(str(ssjr.g1_mjcf_path()))
    data = mujoco.MjData(model)
    gen = torch.Generator().manual_seed(0)
    lo, hi = (torch.tensor(model.jnt_range[1:, k], dtype=torch.float32) for k in (0, 1))
    q = lo + (hi - lo) * (0.1 + 0.8 * torch.rand(N, 29, generator=gen))
    pos = torch.randn(N, 3, generator=gen) * 0.5 + torch.tensor([0.0, 0.0, 1.5])
    quat = torch.nn.functional.normalize(torch.randn(N, 4, generator=gen), dim=-1)
    sim.write_state(torch.arange(N), pos, quat, torch.zeros(N, 3), torch.zeros(N, 3), q, torch.zeros(N, 29))
    body_pos, body_quat, _, _ = sim.body_state()
    dof_q, _ = sim.dof_state()
    root_pos, root_quat, _, _ = sim.root_state()
    torch.testing.assert_close(dof_q, q, atol=1e-5, rtol=0)
    torch.testing.assert_close(root_pos, pos, atol=1e-5, rtol=0)
    assert ((root_quat * quat).sum(-1).abs() > 0.99999).all()
    fk_pos, fk_quat = ssjr.G1Kinematics().forward(pos, quat, q)
    assert (body_pos - fk_pos).norm(dim=-1).max() < 0.02, (body_pos - fk_pos).norm(dim=-1).max()
    assert (body_quat * fk_quat).sum(-1).abs().min() > 0.9999  # wxyz both; q and -q are the same rotation
    ids = [mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, n) for n in ssjr.BODY_NAMES]
    for i in range(N):
        data.qpos[:] = np.concatenate([pos[i].numpy(), quat[i].numpy(), q[i].numpy()])
        mujoco.mj_kinematics(model, data)
        err_m = np.abs(body_pos[i].numpy() - data.xpos[ids]).max()
        assert err_m < 0.02, f"env {i}: body position error {err_m:.4f} m vs MuJoCo"


def test_standing_pd_hold(sim):
    _reset(sim)
    target = _stance(N)
    heights = []
    for _ in range(100):  # 0.5 s
        _pd_step(sim, target)
        heights.append(sim.root_state()[0][:, 2])
    heights = torch.stack(heights)
    assert heights.min() > 0.72 and heights.max() < 0.785, (heights.min(), heights.max())
    assert (heights[-1] - 0.75).abs().max() < 0.02, heights[-1]


def test_per_env_gravity_free_fall(sim):
    _reset(sim, z_m=3.0)
    g = torch.tensor([[0.0, 0.0, -9.81], [0.0, 0.0, -3.0], [0.0, 0.0, 0.0], [2.0, -1.0, -5.0]])
    sim.set_gravity(torch.arange(N), g)
    steps = 20
    for _ in range(steps):
        sim.step(torch.zeros(N, 29))
    _, _, lin_vel, _ = sim.root_state()
    torch.testing.assert_close(lin_vel, g * steps * sim.dt_s, atol=0.01, rtol=0.01)


def test_set_root_velocity(sim):
    _reset(sim, z_m=3.0)
    sim.set_gravity(torch.arange(N), torch.zeros(N, 3))
    lin = torch.tensor([[0.5, -0.3, 0.2]])
    ang = torch.tensor([[0.0, 0.0, 1.0]])
    sim.set_root_velocity(torch.tensor([2]), lin, ang)
    _, _, v, w = sim.root_state()
    torch.testing.assert_close(v[2:3], lin, atol=1e-5, rtol=0)
    torch.testing.assert_close(w[2:3], ang, atol=1e-5, rtol=0)
    assert v[[0, 1, 3]].abs().max() < 1e-6
    sim.step(torch.zeros(N, 29))
    _, _, v, _ = sim.root_state()
    torch.testing.assert_close(v[2:3], lin, atol=0.02, rtol=0)


def test_torque_direction_and_body_mass(sim):
    """+tau on the left elbow raises its angle, -tau on the right knee lowers it; a heavier forearm (env 1) turns
    slower under the same torque, and the mass shows in the articulation data."""
    elbow, knee = ssjr.DOF_NAMES.index("left_elbow_joint"), ssjr.DOF_NAMES.index("right_knee_joint")
    q_start = torch.zeros(N, 29)
    q_start[:, knee] = 1.0  # away from the knee's joint limits
    _reset(sim, z_m=3.0, q=q_start)
    sim.set_gravity(torch.arange(N), torch.zeros(N, 3))
    forearm = [ssjr.BODY_NAMES.index(n) for n in ("left_elbow_link", "left_wrist_roll_link",
                                                    "left_wrist_pitch_link", "left_wrist_yaw_link")]
    mass = sim.default_body_mass_kg[1:2].clone()
    mass[0, forearm] *= 4.0
    sim.set_body_mass(torch.tensor([1]), mass)
    data_mass = sim.robot.data.body_mass.torch[:, sim.isaac_index_of_body]
    torch.testing.assert_close(data_mass[1], mass[0])
    torch.testing.assert_close(data_mass[0], sim.default_body_mass_kg[0])
    q0, _ = sim.dof_state()
    tau = torch.zeros(N, 29)
    tau[:, elbow], tau[:, knee] = 1.0, -2.0
    for _ in range(10):
        sim.step(tau)
    q1, _ = sim.dof_state()
    d_elbow, d_knee = q1[:, elbow] - q0[:, elbow], q1[:, knee] - q0[:, knee]
    assert (d_elbow > 1e-3).all() and (d_knee < -1e-3).all(), (d_elbow, d_knee)
    assert d_elbow[1] < 0.85 * d_elbow[0], d_elbow  # armature 0.02 dilutes the forearm inertia


def test_friction_com_and_joint_params(sim):
    """Low ground-foot friction lets a pushed robot's feet slide further; COM offset and joint params land."""
    _reset(sim)
    target = _stance(N)
    for _ in range(40):
        _pd_step(sim, target)
    sim.set_friction(torch.arange(N), torch.tensor([0.05, 1.0, 1.0, 1.0]))
    feet = [ssjr.BODY_NAMES.index(n) for n in ("left_ankle_roll_link", "right_ankle_roll_link")]
    x0 = sim.body_state()[0][:, feet, 0]
    sim.set_root_velocity(torch.arange(N), torch.tensor([[1.5, 0.0, 0.0]]).repeat(N, 1), torch.zeros(N, 3))
    for _ in range(30):
        _pd_step(sim, target)
    slide_m = (sim.body_state()[0][:, feet, 0] - x0).mean(-1)
    assert slide_m[0] > slide_m[1] + 0.02, slide_m

    sim.set_com_offset(torch.tensor([3]), torch.tensor([[0.05, 0.0, 0.0]]))
    com = sim.robot.data.body_com_pos_b.torch[:, sim.isaac_index_of_body[ssjr.BODY_NAMES.index("torso_link")]]
    torch.testing.assert_close(com[3] - com[2], torch.tensor([0.05, 0.0, 0.0]), atol=1e-6, rtol=0)

    arm = torch.full((N, 29), 0.02)
    arm[1] = 0.05
    damping = torch.zeros(N, 29)
    damping[1] = 1.0
    friction = torch.zeros(N, 29)
    friction[1] = 0.3
    sim.set_joint_params(torch.arange(N), arm, damping, friction)
    data = sim.robot.data
    perm = sim.isaac_index_of_dof
    torch.testing.assert_close(data.joint_armature.torch[:, perm], arm)
    torch.testing.assert_close(data.joint_viscous_friction_coeff.torch[:, perm], damping)
    torch.testing.assert_close(data.joint_friction_coeff.torch[:, perm], friction)
    # damping shows in the dynamics: a spinning elbow slows down in zero gravity only where damped
    _reset(sim, z_m=3.0)
    sim.set_gravity(torch.arange(N), torch.zeros(N, 3))
    sim.set_joint_params(torch.arange(N), torch.full((N, 29), 0.02), damping, torch.zeros(N, 29))
    elbow = ssjr.DOF_NAMES.index("left_elbow_joint")
    q, qd = sim.dof_state()
    qd[:, elbow] = 2.0
    root_pos, root_quat, _, _ = sim.root_state()
    sim.write_state(torch.arange(N), root_pos, root_quat, torch.zeros(N, 3), torch.zeros(N, 3), q, qd)
    for _ in range(10):
        sim.step(torch.zeros(N, 29))
    _, qd = sim.dof_state()
    assert qd[1, elbow] < 0.5 * qd[0, elbow], qd[:, elbow]


def test_no_nan_under_random_torques(sim):
    _reset(sim)
    limit = torch.tensor([88.0 if ("hip_pitch" in n or "hip_yaw" in n or "waist_yaw" in n) else
                          139.0 if ("hip_roll" in n or "knee" in n) else
                          50.0 if ("ankle" in n or "waist" in n) else
                          5.0 if ("wrist_pitch" in n or "wrist_yaw" in n) else 25.0 for n in ssjr.DOF_NAMES])
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        sim.step((2 * torch.rand(N, 29, generator=gen) - 1) * limit)
        assert not sim.nan_envs().any()
    for state in (*sim.dof_state(), *sim.root_state(), *sim.body_state()):
        assert torch.isfinite(state).all()
    # a diverged env is reported alone and comes back with write_state (solver warm-start is reset too)
    tau = torch.zeros(N, 29)
    tau[0] = float("nan")
    sim.step(tau)
    assert sim.nan_envs().tolist() == [True] + [False] * (N - 1)
    _reset(sim, ids=[0])
    for _ in range(5):
        sim.step(torch.zeros(N, 29))
    assert not sim.nan_envs().any()


def test_heightfield_terrain_supports_the_robot(holder):
    """Non-flat terrain = a Newton heightfield (MuJoCo hfield): the robot stands on a 0.2 m platform."""
    sim = holder.get("platform")
    _reset(sim, z_m=0.98)
    target = _stance(N)
    for _ in range(100):
        _pd_step(sim, target)
    z = sim.root_state()[0][:, 2]
    assert ((z - 0.95).abs() < 0.02).all(), z
