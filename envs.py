"""The randomized G1 motion-tracking environment of HoRD, on Isaac Lab, Genesis and MuJoCo, one interface.

    env = make_env(sim="genesis", num_envs=64, motions="data/packets/g1_moves", dr=DR(), terrain="mix")
    obs = env.reset()
    obs, reward, done, info = env.step(alpha)          # alpha: PD targets [N, 29] rad (MuJoCo joint order)

The task (reference motion, observations, rewards, termination, episode-level domain randomization psi) is written
once, in batched torch, above a thin per-engine adapter (`GenesisSim`, `IsaacLabSim`, `MuJoCoSim`) that only steps
physics, applies joint torques and reads/writes state. Physics runs at 200 Hz, the policy at 50 Hz (decimation 4); the
PD law tau = kp * (alpha - q) - kd * qdot, the delay line and the gain randomization are computed here at every physics
step, identically on every engine. On a CPU, Genesis and Isaac Lab step on one core, MuJoCo on this process's
share of the cores (slices of its envs on threads); the trainers scale out with torchrun.
Isaac Lab 3.0 steps MuJoCo-Warp: MuJoCo and Isaac Lab are near twins (the in-domain family; the cpu preset trains
on MuJoCo), Genesis is the different physics, the zero-shot engine, with its own defaults. Every engine loads the same
MJCF with our joint table (gains, armature, damping, friction), floor friction and no self-collision; what differs:
| engine          | integrator               | constraint solver (Newton)                | contact time constant       |
|-----------------|--------------------------|-------------------------------------------|-----------------------------|
| MuJoCo          | implicitfast             | 100 / 50 line search, tol 1e-8, pyramidal | psi: U[0.01, 0.03] s (+DR)  |
| Isaac Lab       | implicitfast (MJWarp)    | 100 / 50, tolerance 1e-6, pyramidal cones | MJCF solref 0.02 s          |
| Genesis         | approximate implicitfast | 25 iterations, 50 line search             | Genesis' default 0.01 s     |
| genesis_aligned | as Genesis               | as Genesis                                | CONTACT_TIMECONST_S 0.02 s  |
Collision: Genesis runs its own narrow phase on the MJCF capsules; Isaac Lab and MuJoCo run MuJoCo's. Genesis' loader
defaults (armature 0.1, no joint damping or friction, self-collision) are overridden like every engine's.

Observations per env (P=535, F=569, S=64, J=len(ssjr.KEYPOINT_NAMES); heading frame = root frame with yaw only):
| key               | shape      | content                                                                         |
|-------------------|------------|---------------------------------------------------------------------------------|
| proprio           | [5, P]     | teacher, privileged, steps t-4..t: root height above terrain (1), body pos rel. |
|                   |            | root w/o pelvis (29x3), body rot6d (30x6), body lin vel (30x3; root_velocity=   |
|                   |            | False: minus the root's), body ang vel (30x3), dof pos (29), dof vel (29), last |
|                   |            | PD target alpha (29)                                                            |
| future            | [8, F]     | teacher, reference at t+1..t+8 per body: pos rel. robot root (3), pos minus     |
|                   |            | current body pos (3), rot6d (6), lin vel (3), ang vel (3) = 30x18; dof pos (29) |
| ref_dof_pos       | [29]       | teacher, reference joint positions at t+1 (centre of the residual action)       |
| terrain           | [121]      | g_t: 11x11 height scan, 0.1 m grid around the root, root z minus ground z       |
| history           | [K, S+29]  | H_t for HCDR, oldest first: sparse state s (dof pos, dof vel, root ang vel in   |
|                   |            | root frame, projected gravity) and the PD target alpha chosen in it             |
| history_mask      | [K]        | True where the history entry exists (False before the episode start)            |
| student_proprio   | [8, S+29]  | student, steps t-7..t: sparse state s and last alpha (no privileged terms)      |
| student_keypoints | [12, J*3]  | student, SSJR keypoints Y at t-7..t+4, relative to the robot root (heading)     |
| psi               | [1, 11]    | privileged: the episode's dynamics (PSI_KEYS), for a teacher that reads them    |
| critic            | [1236]     | privileged: proprio_t (with the root's velocity), future at t+1, terrain, psi   |
"""
import concurrent.futures
import contextlib
import copy
import hashlib
import logging
import math
import os
import pathlib
import shutil
import tempfile
import time
import warnings
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import numpy as np
import torch

import ssjr
from ssjr import InputError, quat_apply, quat_conj, quat_mul, rot6d, rotate_z, yaw_rad, z_quat

PHYSICS_DT_S = 0.005  # 200 Hz physics
MAX_DELAY_STEPS = 8  # the longest control delay the delay line holds, physics steps (two control periods)
NUM_DOF, NUM_BODIES = ssjr.NUM_DOF, len(ssjr.BODY_NAMES)
SPARSE_STATE_DIM = 2 * NUM_DOF + 3 + 3  # s: dof pos, dof vel, gyro, gravity direction (the table above)
PROPRIO_DIM = 1 + (NUM_BODIES - 1) * 3 + NUM_BODIES * (6 + 3 + 3) + 2 * NUM_DOF + NUM_DOF  # P in the table above
DECIMATION = 4  # 50 Hz policy
CONTROL_DT_S = PHYSICS_DT_S * DECIMATION
# episode starts: uniform (training) | frame 0 (evaluation): env i plays clips i, i+N, ...; each episode draws psi,
# tile, pushes and noise from a stream seeded by (seed, clip, episode): independent episodes, paired across policies
START_MODES = ("random", "frame0")
SIMS = ("isaaclab", "genesis", "genesis_aligned", "mujoco")  # the engines (adapters below; the table above)
START_MARGIN_S = 1.0  # episodes start at least this long before their clip ends (shorter clips: at frame 0)

# joint-name fragment: (PD gains kp N m/rad, kd N m s/rad, effort limit N m). Paper: hips 100, knees 200, waist 400,
# shoulders 60-90, damping 0.1-5; the rest follows the authors' earlier code (ankles 20/0.2, wrists 4/0.2).
# Effort limits are the G1 motors' (7520-14: 88, 7520-22: 139, 5020: 25, 2x5020: 50, 4010: 5).
GAINS = {"hip_pitch": (100.0, 2.5, 88.0), "hip_roll": (100.0, 2.5, 139.0), "hip_yaw": (100.0, 2.5, 88.0),
    "knee": (200.0, 5.0, 139.0), "ankle_pitch": (20.0, 0.2, 50.0), "ankle_roll": (20.0, 0.2, 50.0),
    "waist_yaw": (400.0, 5.0, 88.0), "waist_roll": (400.0, 5.0, 50.0), "waist_pitch": (400.0, 5.0, 50.0),
    "shoulder_pitch": (90.0, 2.0, 25.0), "shoulder_roll": (60.0, 2.0, 25.0), "shoulder_yaw": (20.0, 1.0, 25.0),
    "elbow": (60.0, 1.0, 25.0), "wrist_roll": (4.0, 0.2, 25.0), "wrist_pitch": (4.0, 0.2, 5.0),
    "wrist_yaw": (4.0, 0.2, 5.0)}
ARMATURE = 0.03  # kg m^2, every joint (authors' earlier code)
JOINT_FRICTION = 0.03  # N m, dry friction (frictionloss)
JOINT_DAMPING = 0.05  # N m s/rad, passive joint damping (on top of the PD's kd)
FEET = ("left_ankle_roll_link", "right_ankle_roll_link")  # the links whose friction is the ground-foot friction
GROUND_FRICTION = 0.01  # every engine: contact friction = max of the pair, so the feet's friction decides
CONTACT_TIMECONST_S = 0.02  # s, MuJoCo's default solref time constant: nominal psi (per engine: the table above)
SELF_COLLISION = False  # faster, and retargeted dance clips often pass a hand through the torso (untrackable anyway)
# The MuJoCo scene that envs.py and deploy.py both load: shipped, so a deployment steps the physics training saw.
SCENE_XML = pathlib.Path(__file__).resolve().parent / "g1_scene.xml"


def joint_range_rad(device="cpu") -> torch.Tensor:
    """[2, 29]: the lower and upper ends of the joint ranges (rad, ssjr.DOF_NAMES order): g1_scene.xml's, the MJCF's."""
    ranges = {j.get("name"): j.get("range") for j in ET.parse(SCENE_XML).iter("joint")}
    return torch.tensor([[float(x) for x in ranges[n].split()] for n in ssjr.DOF_NAMES], device=device).T.contiguous()


IMU_SENSORS = ("imu_ang_vel", "imu_upvector")  # the pelvis IMU: gyro (pelvis frame), world z axis in the pelvis frame
_XYZW_FROM_WXYZ, _WXYZ_FROM_XYZW = [1, 2, 3, 0], [3, 0, 1, 2]  # quaternion component orders: Isaac Lab's xyzw, ours


def joint_table(device="cpu"):
    """kp, kd, effort limit as [29] tensors in ssjr.DOF_NAMES order."""
    rows = [next(v for k, v in GAINS.items() if name.endswith(k + "_joint")) for name in ssjr.DOF_NAMES]
    return tuple(torch.tensor(rows, device=device).T)


# Reward (paper App. C): r = sum_i w_i exp(c_i * err_i) - 5e-6 * sum |tau * qdot|; err_i: mean squared errors over
# bodies and x/y/z (or angle) components (paper: "mean_err"; ProtoMotions sums x/y/z, a 3x stricter kernel). Ours where
# the paper is silent: RT's weight 0.2 (as RH; the paper gives its coefficient), GV/GAV coefficients (ProtoMotions').
REWARD_WEIGHTS = {"gt": 0.5, "gr": 0.4, "gv": 0.1, "gav": 0.1, "rh": 0.2, "rt": 0.2}
REWARD_COEFFS = {"gt": -100.0, "gr": -10.0, "gv": -0.5, "gav": -0.1, "rh": -100.0, "rt": -120.0}
POWER_PENALTY = 5e-6
TERMINATION_ERR_M = 0.5  # global body-position error that ends an episode (irreversible divergence)
# which error: "max" over the bodies (training, as the authors' code; a strict test) | "mean" over the bodies (the
# paper's GTE_t, whose max over the episode decides success: evaluation). Keypoint commands: over their keypoints.
TERMINATIONS = ("max", "mean")


@dataclass
class DR:
    """Episode-level domain randomization ranges (paper Table 5): psi is sampled per env at reset, fixed for the
    episode. Sensor noise (the paper's "observation noise", gaussian std): one draw per reading of s (encoders, IMU)
    and of the command, kept in every stack that holds it; the last PD target is exact, privileged states are clean."""
    delay_steps: tuple[int, int] = (0, 3)  # control delay, physics steps (inclusive integer range)
    mass_scale: tuple[float, float] = (0.9, 1.1)  # scale of every body's mass
    joint_scale: tuple[float, float] = (0.9, 1.1)  # scale of joint damping, armature and friction
    kp_scale: tuple[float, float] = (0.9, 1.1)  # scale of the PD stiffness
    kd_scale: tuple[float, float] = (0.9, 1.1)  # scale of the PD damping
    gravity_mps2: tuple[float, float] = (9.7, 9.9)  # magnitude of gravity (down)
    friction: tuple[float, float] = (0.6, 1.2)  # ground-foot friction (the paper names the term, not its range)
    # the paper's "contact stiffness": solref time constant, s (floor: 2 physics steps); per scene except on MuJoCo
    contact_timeconst_s: tuple[float, float] = (0.01, 0.03)
    com_offset_m: float = 0.03  # torso centre-of-mass shift, uniform in +-this per axis
    push_interval_s: tuple[float, float] = (5.0, 10.0)  # time between pushes
    push_vel_mps: float = 0.8  # largest horizontal root-velocity kick (uniform direction, size U[0, this])
    noise_dof_pos_rad: float = 0.01  # sensor noise of a joint-position reading
    noise_dof_vel_rad_s: float = 0.5  # of a joint-velocity reading
    noise_ang_vel_rad_s: float = 0.1  # of the IMU angular velocity
    noise_gravity: float = 0.03  # of the IMU projected gravity (unit vector)
    noise_keypoint_m: float = 0.01  # of each command keypoint reading (one draw per frame, kept while it is in view)
    noise_scale: float = 1.0  # every sensor-noise std above times this (the same draws, scaled: evaluate.py +noise<k>)
    # Redraw the body masses, torso CoM and joint armature/damping/friction at every reset, not once per env at the
    # start (as Isaac Lab's 'startup' mode); on Isaac Lab each such write recomputes every world's model constants.
    body_psi_per_episode: bool = False

    @classmethod
    def noise_only(cls) -> "DR":
        """Nominal dynamics, no pushes, sensor noise: nominal behaviour as a rate over episodes, not one trajectory."""
        return cls(**{k: (v, v) for k, v in NOMINAL_PSI.items()}, com_offset_m=0.0, push_interval_s=(1e9, 1e9))

    def sensor_std(self) -> torch.Tensor:
        """Noise std of each field of s [64]: dof pos (29), dof vel (29), root ang vel (3), projected gravity (3)."""
        return torch.tensor([self.noise_dof_pos_rad] * NUM_DOF + [self.noise_dof_vel_rad_s] * NUM_DOF
                            + [self.noise_ang_vel_rad_s] * 3 + [self.noise_gravity] * 3)


PSI_KEYS = ("delay_steps", "mass_scale", "joint_scale", "kp_scale", "kd_scale", "gravity_mps2", "friction",
            "com_offset_x_m", "com_offset_y_m", "com_offset_z_m", "contact_timeconst_s")  # drawn in this order
BODY_PSI_KEYS = ("mass_scale", "joint_scale", "com_offset_x_m", "com_offset_y_m", "com_offset_z_m")  # see DR
NOMINAL_PSI = dict(delay_steps=0, mass_scale=1.0, joint_scale=1.0, kp_scale=1.0, kd_scale=1.0, gravity_mps2=9.81,
                   friction=1.0, contact_timeconst_s=CONTACT_TIMECONST_S)


def uniform(lo_hi: tuple[float, float], n: int, gen: torch.Generator, device) -> torch.Tensor:
    lo, hi = lo_hi  # n draws of U[lo, hi]
    return lo + (hi - lo) * torch.rand(n, generator=gen, device=device)


def sample_psi(dr: DR | None, n: int, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    """psi ~ P(Psi) for n episodes; dr=None gives the nominal dynamics (the 'w/o DR' ablation, and clean evaluation)."""
    if dr is None:
        return {k: torch.full((n,), float(NOMINAL_PSI.get(k, 0.0)), device=device) for k in PSI_KEYS}
    lo, hi = dr.delay_steps
    if not 0 <= lo <= hi <= MAX_DELAY_STEPS:
        raise InputError("delay_steps", f"{dr.delay_steps}: the delay line holds 0..{MAX_DELAY_STEPS} physics steps")
    return {"delay_steps": torch.randint(lo, hi + 1, (n,), generator=gen, device=device).float(),
            **{k: uniform(getattr(dr, k), n, gen, device) for k in PSI_KEYS[1:7]},
            **{f"com_offset_{a}_m": uniform((-dr.com_offset_m, dr.com_offset_m), n, gen, device) for a in "xyz"},
            "contact_timeconst_s": uniform(dr.contact_timeconst_s, n, gen, device)}


# --- Terrain: one heightfield of square tiles shared by all envs; each env spawns on a tile drawn from the mix.
TERRAIN_TYPES = ("flat", "smooth_slope", "rough_slope")
TERRAIN_MIX = {"flat": 0.5, "smooth_slope": 0.25, "rough_slope": 0.25}  # paper's training mix
SCAN_XY_M = torch.cartesian_prod(*[torch.linspace(-0.5, 0.5, 11)] * 2)  # g_t sample points in the heading frame


@dataclass
class Terrain:
    """A heightfield (z up) made of `tiles` (row-major types), and the spawn point of each tile."""
    heights_m: np.ndarray  # [nx, ny]
    cell_m: float
    origin_m: tuple[float, float]  # world xy of heights_m[0, 0]
    tile_types: list[str]
    spawn_xy_m: np.ndarray  # [tiles, 2]
    is_flat = property(lambda self: not np.any(self.heights_m))

    def height_at(self, xy: torch.Tensor) -> torch.Tensor:
        """Ground height under world points xy [..., 2] (bilinear)."""
        if self.is_flat:
            return torch.zeros(xy.shape[:-1], device=xy.device)
        cache = self.__dict__.setdefault("_heights", {})  # the heightfield, copied once to each device
        if (h := cache.get(xy.device)) is None:
            h = cache[xy.device] = torch.as_tensor(self.heights_m, device=xy.device)
        g = (xy - torch.tensor(self.origin_m, device=xy.device)) / self.cell_m
        g0 = g.floor().long()
        fx, fy = (g - g0).unbind(-1)
        (nx, ny), (gx, gy) = h.shape, g0.unbind(-1)
        ix0, iy0 = gx.clamp(0, nx - 1), gy.clamp(0, ny - 1)
        ix1, iy1 = (ix0 + 1).clamp(max=nx - 1), (iy0 + 1).clamp(max=ny - 1)
        return (h[ix0, iy0] * (1 - fx) * (1 - fy) + h[ix1, iy0] * fx * (1 - fy)
                + h[ix0, iy1] * (1 - fx) * fy + h[ix1, iy1] * fx * fy)


def make_terrain(kind: str, seed: int = 0, tile_m: float = 8.0, cols: int = 4, cell_m: float = 0.1) -> Terrain:
    """kind: TERRAIN_TYPES or mix. Slope tiles are pyramids (edges at 0 m, so tiles join without steps) whose faces
    get steeper by column (slope 0.1 .. 0.4); rough tiles add +-3 cm uniform noise. Robots spawn half-way up a face."""
    if kind not in (*TERRAIN_TYPES, "mix"):
        raise InputError("--terrain", f"unknown terrain '{kind}': choose one of {TERRAIN_TYPES + ('mix',)}")
    rows = ["flat", "flat", "smooth_slope", "rough_slope"] if kind == "mix" else [kind]
    rng, n = np.random.default_rng(seed), int(round(tile_m / cell_m))  # n: cells per tile side
    heights = np.zeros((len(rows) * n, cols * n), np.float32)
    u = (np.arange(n) + 0.5) / n - 0.5  # tile-local coordinate in [-0.5, 0.5)
    dist_to_edge = (0.5 - np.maximum(np.abs(u)[:, None], np.abs(u)[None, :])) * tile_m
    for r, c in np.ndindex(len(rows), cols):  # flat tiles: slope 0
        noise = rng.uniform(-0.03, 0.03, (n, n)) if rows[r] == "rough_slope" else 0.0
        heights[r * n:(r + 1) * n, c * n:(c + 1) * n] = (rows[r] != "flat") * (0.1 * (c + 1)) * dist_to_edge + noise
    origin = (-len(rows) * tile_m / 2, -cols * tile_m / 2)
    spawn = [((r + 0.5) * tile_m - tile_m / 4, (c + 0.5) * tile_m) for r in range(len(rows)) for c in range(cols)]
    spawn_xy = np.asarray(spawn, np.float32) + np.asarray(origin, np.float32)
    return Terrain(heights, cell_m, origin, [t for t in rows for _ in range(cols)], spawn_xy)


# --- Motion library: SSJR packets (30 fps), resampled once to the 50 Hz control ticks the env reads.
PACKET_FIELDS = {"body_pos": "body_pos_w", "body_quat": "body_quat_w", "body_lin_vel": "body_lin_vel_w",
                 "body_ang_vel": "body_ang_vel_w", "dof_pos": "dof_pos", "dof_vel": "dof_vel"}  # MotionLib: packet key


class MotionLib:
    """All clips concatenated on the device, resampled once to the control rate (`ssjr.resample`): episodes start on
    a control tick, so the env reads the reference by indexing (`at_tick`) instead of interpolating every step."""

    def __init__(self, packet_paths: list[pathlib.Path], device, dt_s: float = CONTROL_DT_S):
        packets = [ssjr.load_packet(p) for p in packet_paths]  # a keypoint command carries a stance reference too
        self.keypoints_only = torch.tensor([p["kind"] == "human_keypoints" for p in packets], device=device)
        self.length_s = torch.tensor([(len(p["dof_pos"]) - 1) / float(p["fps"]) for p in packets], device=device)
        self.last_start_tick = ((self.length_s - START_MARGIN_S).clamp(min=0.0) / dt_s + 1e-4).long()  # starts: 0..this
        # the control-tick table: tick k of a clip is its state at k * dt_s, k = 0 .. num_ticks - 1 (<= the clip end)
        frames = [{k: torch.as_tensor(p[v], dtype=torch.float32) for k, v in PACKET_FIELDS.items()} for p in packets]
        ticks = [ssjr.resample(f, float(p["fps"]), 1.0 / dt_s, ("body_quat",)) for f, p in zip(frames, packets)]
        self.num_ticks = torch.tensor([len(t["dof_pos"]) for t in ticks], device=device)
        self.tick_start = torch.cumsum(self.num_ticks, 0) - self.num_ticks
        self.ticks = {k: torch.cat([t[k] for t in ticks]).to(device) for k in PACKET_FIELDS}
        self.mean_dof_pos = self.ticks["dof_pos"].mean(0)  # the motions' average pose (the student's nominal action)

    def __len__(self):
        return len(self.num_ticks)

    def at_tick(self, clip: torch.Tensor, tick: torch.Tensor) -> dict[str, torch.Tensor]:
        """Reference state of `clip` [M] at control tick `tick` [M] (clamped to the clip): a gather, no arithmetic."""
        i = torch.minimum(tick.clamp(min=0), self.num_ticks[clip] - 1) + self.tick_start[clip]
        return {k: v[i] for k, v in self.ticks.items()}


def resolve_motions(motions) -> list[pathlib.Path]:
    """A packet folder, a packet file, or a list of packet files -> sorted packet paths."""
    if isinstance(motions, (list, tuple)):
        return [pathlib.Path(m) for m in motions]
    path = pathlib.Path(motions)
    if path.is_dir() and not any(path.glob("*.npz")):
        raise InputError(path, "no SSJR packets (*.npz); convert motions with `python ssjr.py convert`")
    if not path.exists():
        raise InputError(path, "no such motion packet or folder")
    return sorted(path.glob("*.npz")) if path.is_dir() else [path]


# --- Engine adapters: step physics with given joint torques, read and write state. Nothing task-specific.
class EngineSim:
    """What the adapters share: states in MuJoCo joint and body order, as float32 tensors on the env's device. DR writes
    per env: body masses [n,30] (inertias scale alike: a heavier body of the same shape), torso CoM offset [n,3] (body
    frame), ground-foot friction [n], joint armature, damping and frictionloss [n,29]. nan_envs(): the envs blown up
    since its last call. contact_timeconst_s: the scene's one value; None: set per env by set_contact_timeconst."""
    dof_names, body_names = ssjr.DOF_NAMES, ssjr.BODY_NAMES
    contact_timeconst_s: float | None = CONTACT_TIMECONST_S

    def _t(self, x) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.float32, device=self.device)


class GenesisSim(EngineSim):
    """Genesis (gs.Scene + the G1 MJCF entity). CPU here, CUDA where available; every DR term batched per env."""
    performance_mode = False  # the mode gs.init ran with in this process (one per process)

    def __init__(self, num_envs: int, device: str, terrain: Terrain, performance_mode: bool = False,
                 contact_timeconst_s: float | None = None):
        import genesis as gs
        import quadrants  # Genesis' kernel compiler (imported by genesis)
        if not getattr(gs, "_initialized", False):
            cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser()
            if not (cache / "quadrants").exists():
                print(f"Genesis: first run on this machine: compiling its physics kernels, a few minutes on 2 cores "
                      f"(once; cached in {cache}/quadrants and {cache}/genesis)", flush=True)
            elif performance_mode:
                print(f"Genesis: compiling kernels for {num_envs} envs (performance mode: about a minute at every "
                      f"start)", flush=True)
            gs.init(backend=gs.cpu if device == "cpu" else gs.gpu, logging_level="warning", precision="32",
                    performance_mode=performance_mode)
            GenesisSim.performance_mode = performance_mode
            quadrants.set_logging_level("error")  # compiler notes (loop_config, implicit int32 casts): not for users
            # the MJCF gives every body's inertia, yet Genesis estimates one from each mesh and warns that it can't
            logging.getLogger("genesis").addFilter(lambda record: "not watertight" not in record.getMessage())
        elif GenesisSim.performance_mode != performance_mode:
            raise ValueError(f"Genesis runs with performance_mode={GenesisSim.performance_mode} in this process")
        self.num_envs, self.device = num_envs, torch.device(device)
        contact = {} if contact_timeconst_s is None else {"constraint_timeconst": contact_timeconst_s}
        rigid = gs.options.RigidOptions(batch_links_info=True, batch_dofs_info=True, batch_joints_info=True,
                                        enable_self_collision=SELF_COLLISION, **contact)
        self.contact_timeconst_s = rigid.constraint_timeconst
        self.scene = gs.Scene(sim_options=gs.options.SimOptions(dt=PHYSICS_DT_S, substeps=1), rigid_options=rigid,
                              show_viewer=False)
        ground = gs.morphs.Plane() if terrain.is_flat else gs.morphs.Terrain(
            height_field=terrain.heights_m, horizontal_scale=terrain.cell_m, vertical_scale=1.0,
            pos=(*terrain.origin_m, 0.0))
        self.scene.add_entity(ground, material=gs.materials.Rigid(friction=GROUND_FRICTION))
        self.robot = self.scene.add_entity(gs.morphs.MJCF(file=str(ssjr.g1_mjcf_path())))
        self.scene.build(n_envs=num_envs)
        links = [self.robot.get_link(b) for b in ssjr.BODY_NAMES]
        self.links, self.links_global = [k.idx_local for k in links], [k.idx for k in links]  # entity's, solver's index
        self.dofs = [self.robot.get_joint(j).dofs_idx_local[0] for j in ssjr.DOF_NAMES]
        self.torso = self.links[ssjr.BODY_NAMES.index("torso_link")]
        self.feet = [self.links[ssjr.BODY_NAMES.index(f)] for f in FEET]
        self.default_body_mass_kg = self._t(self.robot.get_links_mass(self.links))
        self.default_torso_com = self._t(self.robot.get_links_COM([self.torso]))[:, 0]
        self.robot.set_dofs_kp(torch.zeros(num_envs, NUM_DOF), self.dofs)
        self.robot.set_dofs_kv(torch.zeros(num_envs, NUM_DOF), self.dofs)
        from genesis.utils.array_class import ErrorCode
        from genesis.utils.misc import qd_to_torch
        self._errno = qd_to_torch(self.scene.rigid_solver._errno, copy=False)  # the per-env error flags, a live view
        self._nan_bits = ErrorCode.INVALID_CONTACT_NAN | ErrorCode.INVALID_FORCE_NAN | ErrorCode.INVALID_ACC_NAN
        self._blown_up = torch.zeros(num_envs, dtype=torch.bool, device=self.device)

    def step(self, tau_nm: torch.Tensor):
        self.robot.control_dofs_force(tau_nm, self.dofs)
        self.scene.step()
        # Genesis raises at its next error check (every 10 substeps) once an env has gone non-finite, maybe before the
        # task's check: those flags move here (no host sync) for nan_envs(); capacity overflows stay Genesis' errors.
        self._blown_up |= (self._errno & self._nan_bits) != 0
        self._errno &= ~self._nan_bits

    def dof_state(self):
        return self._t(self.robot.get_dofs_position(self.dofs)), self._t(self.robot.get_dofs_velocity(self.dofs))

    def root_state(self):
        r = self.robot
        return self._t(r.get_pos()), self._t(r.get_quat()), self._t(r.get_vel()), self._t(r.get_ang())

    def body_state(self):
        r, idx = self.robot, self.links
        return tuple(self._t(get(idx)) for get in (r.get_links_pos, r.get_links_quat, r.get_links_vel, r.get_links_ang))

    def write_state(self, env_ids, root_pos, root_quat, root_lin_vel, root_ang_vel, q, qd):
        qs = [0, 1, 2, 3, 4, 5, 6] + [d + 1 for d in self.dofs]  # free joint: 3 pos + 4 quat in qpos, 6 dofs in qvel
        self.robot.set_qpos(torch.cat([root_pos, root_quat, q], -1), qs, envs_idx=env_ids, zero_velocity=True)
        ang_vel_b = quat_apply(quat_conj(root_quat), root_ang_vel)  # free joint: ang vel in the root frame (as MuJoCo)
        self.robot.set_dofs_velocity(torch.cat([root_lin_vel, ang_vel_b, qd], -1), [0, 1, 2, 3, 4, 5] + self.dofs,
                                     envs_idx=env_ids)

    def set_root_velocity(self, env_ids, lin_vel_w, ang_vel_w):
        ang_vel_b = quat_apply(quat_conj(self._t(self.robot.get_quat(envs_idx=env_ids))), ang_vel_w)
        self.robot.set_dofs_velocity(torch.cat([lin_vel_w, ang_vel_b], -1), [0, 1, 2, 3, 4, 5], envs_idx=env_ids)

    def set_gravity(self, env_ids, g_w):
        self.scene.sim.set_gravity(g_w, envs_idx=env_ids)

    def set_body_mass(self, env_ids, mass_kg):
        self.scene.sim.rigid_solver.set_links_mass(mass_kg, self.links_global, envs_idx=env_ids, scale_inertia=True)

    def set_com_offset(self, env_ids, offset_m):
        self.robot.set_links_COM((self.default_torso_com[env_ids] + offset_m)[:, None], [self.torso], envs_idx=env_ids)

    def set_friction(self, env_ids, mu):
        """Ground-foot friction: the feet's friction ratio (their geoms have friction 1, the ground 0.01)."""
        self.robot.set_friction_ratio(mu[:, None].expand(-1, len(self.feet)), self.feet, envs_idx=env_ids)

    def set_joint_params(self, env_ids, armature, damping, frictionloss):
        self.robot.set_dofs_armature(armature, self.dofs, envs_idx=env_ids)
        self.robot.set_dofs_damping(damping, self.dofs, envs_idx=env_ids)
        self.robot.set_dofs_frictionloss(frictionloss, self.dofs, envs_idx=env_ids)

    def nan_envs(self):
        blown_up, self._blown_up = self._blown_up, torch.zeros_like(self._blown_up)
        return blown_up

    def close(self):
        """Nothing to release: several Genesis scenes may live in one process."""


def _g1_usd_path() -> pathlib.Path:
    """The G1 MJCF converted to USD once (MuJoCo physics variant), cached in assets/. Must run before any other USD
    stage exists in the process (else the converter misses the PhysxJointAPI schema)."""
    xml = ssjr.g1_mjcf_path()
    settings = dict(fix_base=False, physics_variant="mujoco", self_collision=SELF_COLLISION)
    digest = hashlib.sha1(xml.read_bytes() + repr(sorted(settings.items())).encode()).hexdigest()[:10]
    out = ssjr.ASSETS / f"g1_usd_{digest}"
    if not (out / "g1" / "g1.usda").exists():
        from isaaclab.sim.converters import MjcfConverter, MjcfConverterCfg
        staging = pathlib.Path(tempfile.mkdtemp(prefix=".g1_usd_", dir=ssjr.ASSETS))
        staging.chmod(0o755)
        MjcfConverter(MjcfConverterCfg(asset_path=str(xml), usd_dir=str(staging), force_usd_conversion=True,
                                       **settings))
        try:
            staging.rename(out)
        except OSError:  # another process won the race: keep its copy
            shutil.rmtree(staging, ignore_errors=True)
    return out / "g1" / "g1.usda"


def _write_ground_usd(path: pathlib.Path, terrain) -> None:
    """The local ground: an infinite collision plane, plus a heightfield-tagged mesh for non-flat terrain."""
    from pxr import Sdf, Usd, UsdGeom, UsdPhysics
    stage = Usd.Stage.CreateNew(str(path))
    UsdGeom.SetStageUpAxis(stage, UsdGeom.Tokens.z)
    UsdGeom.SetStageMetersPerUnit(stage, 1.0)
    stage.SetDefaultPrim(UsdGeom.Xform.Define(stage, "/Ground").GetPrim())
    plane = UsdGeom.Plane.Define(stage, "/Ground/Plane")
    plane.CreateAxisAttr(UsdGeom.Tokens.z)
    UsdPhysics.CollisionAPI.Apply(plane.GetPrim())
    heights = np.asarray(terrain.heights_m, dtype=np.float32)
    if np.any(heights != 0.0):
        plane.AddTranslateOp().Set((0.0, 0.0, float(heights.min())))
        (nx, ny), (x0, y0) = heights.shape, (float(v) for v in terrain.origin_m)
        gx, gy = np.meshgrid(x0 + terrain.cell_m * np.arange(nx), y0 + terrain.cell_m * np.arange(ny), indexing="ij")
        i, j = np.meshgrid(np.arange(nx - 1), np.arange(ny - 1), indexing="ij")
        a = (i * ny + j).ravel()
        # two counter-clockwise (seen from +z) triangles per cell: the heightfield rasterizer reads triangles only
        tris = np.concatenate([np.stack([a, a + ny, a + ny + 1], -1), np.stack([a, a + ny + 1, a + 1], -1)])
        mesh = UsdGeom.Mesh.Define(stage, "/Ground/Terrain")
        mesh.CreatePointsAttr(np.stack([gx, gy, heights], -1).reshape(-1, 3).astype(np.float32).tolist())
        mesh.CreateFaceVertexCountsAttr([3] * len(tris))
        mesh.CreateFaceVertexIndicesAttr(tris.ravel().tolist())
        UsdPhysics.CollisionAPI.Apply(mesh.GetPrim())
        # Isaac Lab's Newton manager rasterizes a mesh tagged like this into a Newton heightfield (MuJoCo hfield).
        mesh.GetPrim().CreateAttribute("newton:heightfield:resolution", Sdf.ValueTypeNames.Float).Set(
            float(terrain.cell_m))
    stage.GetRootLayer().Save()


class IsaacLabSim(EngineSim):
    """Isaac Lab 3.0, kit-less Newton/MuJoCo-Warp physics (PhysX needs Isaac Sim): the G1 USD cloned N times in one
    InteractiveScene at env spacing 0 (Newton worlds never collide); every joint has an implicit actuator with zero
    gains, so step(tau) is a pure torque step. Handled here: xyzw quaternions, Isaac Lab's joint/body order (remapped by
    name), link-frame velocities (d/dt body_pos, not the centres of mass'). Joints start at q = 0 with zero armature,
    damping and frictionloss: set_joint_params and write_state first."""

    def __init__(self, num_envs: int, device: str, terrain):
        import warp as wp
        wp.config.quiet = True  # Warp's banner; its native init warns on stderr where there is no CUDA driver:
        with open(os.devnull, "w") as null:  # neither is for users, so it runs with fd 2 on /dev/null
            saved_fd2 = os.dup(2)
            os.dup2(null.fileno(), 2)
            try:
                wp.init()
            finally:
                os.dup2(saved_fd2, 2)
                os.close(saved_fd2)
        import isaaclab.sim as sim_utils
        from isaaclab.actuators import ImplicitActuatorCfg
        from isaaclab.app import launch_simulation
        from isaaclab.assets import ArticulationCfg, AssetBaseCfg
        from isaaclab.scene import InteractiveScene, InteractiveSceneCfg
        from isaaclab.utils.timer import Timer
        from isaaclab_newton.physics import MJWarpSolverCfg, NewtonCfg
        from newton import ModelFlags
        Timer.enable_display_output = False  # "Finalize builder took: ..." at every build: not for users
        warnings.filterwarnings("ignore", "Newton shape color replacement", FutureWarning)  # Isaac Lab's own note
        if sim_utils.SimulationContext.instance() is not None:
            raise RuntimeError("an Isaac Lab SimulationContext already exists in this process: close() it first")
        self.num_envs, self.device, self.dt_s = num_envs, torch.device(device), PHYSICS_DT_S
        physics = NewtonCfg(solver_cfg=MJWarpSolverCfg(njmax=300, nconmax=60, ls_iterations=50,
                                                       cone="pyramidal", integrator="implicitfast"))
        sim_cfg = sim_utils.SimulationCfg(dt=PHYSICS_DT_S, device=str(device), physics=physics)
        self._launch = contextlib.ExitStack()
        self._launch.enter_context(launch_simulation(sim_cfg, {"headless": True, "device": str(device)}))
        usd = _g1_usd_path()  # before any other stage
        self._tmp = tempfile.TemporaryDirectory(prefix="hord_isaaclab_")
        ground_usd = pathlib.Path(self._tmp.name) / "ground.usda"
        _write_ground_usd(ground_usd, terrain)
        sim_utils.create_new_stage()
        self.sim = sim_utils.SimulationContext(sim_cfg)
        scene_cfg = InteractiveSceneCfg(num_envs=num_envs, env_spacing=0.0)
        scene_cfg.ground = AssetBaseCfg(prim_path="/World/ground", spawn=sim_utils.UsdFileCfg(usd_path=str(ground_usd)))
        scene_cfg.robot = ArticulationCfg(
            prim_path="{ENV_REGEX_NS}/Robot", spawn=sim_utils.UsdFileCfg(usd_path=str(usd)),
            # the USD keeps the MJCF pelvis offset (0.793 m): a spawn position of 0 puts the pelvis there
            init_state=ArticulationCfg.InitialStateCfg(pos=(0.0, 0.0, 0.0)),
            actuators={"g1": ImplicitActuatorCfg(joint_names_expr=[".*"], stiffness=0.0, damping=0.0)})
        self.scene = InteractiveScene(scene_cfg)
        self.sim.reset()
        self.robot = self.scene["robot"]
        # element i: the Isaac Lab index of MuJoCo joint / body i (q_mujoco = q_isaac[:, isaac_index_of_dof])
        joints, bodies = list(self.robot.joint_names), list(self.robot.body_names)
        self.isaac_index_of_dof = torch.tensor([joints.index(n) for n in self.dof_names], device=self.device)
        self.isaac_index_of_body = torch.tensor([bodies.index(n) for n in self.body_names], device=self.device)
        self._dof_inv, self._body_inv = torch.argsort(self.isaac_index_of_dof), torch.argsort(self.isaac_index_of_body)
        self._torso_isaac = bodies.index("torso_link")
        # ground friction -> 0 (contact friction = max of the pair = the foot's); live views of the foot shapes' mu
        # and of the per-world gravity rows (Newton keeps one per world, MJWarp's opt.gravity, and a global last row)
        model, self._model_flags = self.sim.physics_manager.get_model(), ModelFlags
        static = wp.to_torch(model.shape_body) == -1
        for arr in (model.shape_material_mu, model.shape_material_mu_torsional, model.shape_material_mu_rolling):
            wp.to_torch(arr)[static] = 0.0
        self.sim.physics_manager.add_model_change(ModelFlags.SHAPE_PROPERTIES)
        self._gravity = wp.to_torch(model.gravity)
        view, backend_bodies = self.robot.root_view, list(self.robot.backend_body_names)
        self._shape_mu = wp.to_torch(view.get_attribute("shape_material_mu", model)[:, 0])
        self._foot_shapes = torch.tensor(
            [s for foot in FEET for s in view.body_shapes[backend_bodies.index(foot)]], device=self.device)
        self._default_mass_isaac = self.robot.data.body_mass.torch.clone()
        self.default_body_mass_kg = self._default_mass_isaac[:, self.isaac_index_of_body].to(self.device)
        self._default_inertia = self.robot.data.body_inertia.torch.clone()
        self._default_com = self.robot.data.body_com_pos_b.torch.clone()

    def _ids(self, env_ids) -> torch.Tensor:
        return torch.as_tensor(env_ids, device=self.device).to(torch.int32)

    def _isaac(self, x: torch.Tensor, order=None) -> torch.Tensor:
        """x as float32 on the sim device, its last axis permuted by `order`, contiguous (as Warp needs)."""
        x = x.to(self.device, torch.float32)
        return (x if order is None else x[:, order]).contiguous()

    def step(self, tau_Nm: torch.Tensor) -> None:
        self.robot.actuators.target_command.set_effort_index(value=self._isaac(tau_Nm, self._dof_inv))
        self.robot.write_data_to_sim()
        self.sim.step(render=False)
        self.robot.update(self.dt_s)

    def dof_state(self):
        data = self.robot.data
        return data.joint_pos.torch[:, self.isaac_index_of_dof], data.joint_vel.torch[:, self.isaac_index_of_dof]

    def root_state(self):
        pose, vel = self.robot.data.root_link_pose_w.torch, self.robot.data.root_link_vel_w.torch
        return pose[:, :3].clone(), pose[:, 3:7][:, _WXYZ_FROM_XYZW], vel[:, :3].clone(), vel[:, 3:].clone()

    def body_state(self):
        pose = self.robot.data.body_link_pose_w.torch[:, self.isaac_index_of_body]
        vel = self.robot.data.body_link_vel_w.torch[:, self.isaac_index_of_body]
        return pose[..., :3], pose[..., 3:7][..., _WXYZ_FROM_XYZW], vel[..., :3], vel[..., 3:]

    def write_state(self, env_ids, root_pos, root_quat, root_lin_vel, root_ang_vel, q, qd) -> None:
        ids = self._ids(env_ids)
        pose = self._isaac(torch.cat([root_pos, root_quat[:, _XYZW_FROM_WXYZ]], -1))
        self.robot.write_root_link_pose_to_sim_index(root_pose=pose, env_ids=ids)
        self.set_root_velocity(env_ids, root_lin_vel, root_ang_vel)
        self.robot.write_joint_state_to_sim_index(position=self._isaac(q, self._dof_inv),
                                                  velocity=self._isaac(qd, self._dof_inv), env_ids=ids)

    def set_root_velocity(self, env_ids, lin_vel_w, ang_vel_w) -> None:
        vel = self._isaac(torch.cat([lin_vel_w, ang_vel_w], -1))
        self.robot.write_root_link_velocity_to_sim_index(root_velocity=vel, env_ids=self._ids(env_ids))

    def set_gravity(self, env_ids, g_w) -> None:
        self._gravity[torch.as_tensor(env_ids, device=self._gravity.device).long()] = g_w.to(self._gravity)
        self.sim.physics_manager.add_model_change(self._model_flags.MODEL_PROPERTIES)

    def set_body_mass(self, env_ids, mass_kg) -> None:
        ids, m = self._ids(env_ids), self._isaac(mass_kg, self._body_inv)
        inertia = self._default_inertia[ids.long()] * (m / self._default_mass_isaac[ids.long()])[..., None]
        self.robot.set_masses_index(masses=m, env_ids=ids)
        self.robot.set_inertias_index(inertias=inertia.contiguous(), env_ids=ids)

    def set_com_offset(self, env_ids, offset_m) -> None:
        ids = self._ids(env_ids)
        com = self._default_com[ids.long(), self._torso_isaac] + self._isaac(offset_m)
        self.robot.set_coms_index(coms=com[:, None].contiguous(), body_ids=[self._torso_isaac], env_ids=ids)

    def set_friction(self, env_ids, mu) -> None:
        self._shape_mu[self._ids(env_ids).long()[:, None], self._foot_shapes] = self._isaac(mu)[:, None]
        self.sim.physics_manager.add_model_change(self._model_flags.SHAPE_PROPERTIES)

    def set_joint_params(self, env_ids, armature, damping, frictionloss) -> None:
        ids, (a, b, c) = self._ids(env_ids), (self._isaac(x, self._dof_inv) for x in (armature, damping, frictionloss))
        self.robot.write_joint_armature_to_sim_index(armature=a, env_ids=ids)
        self.robot.write_joint_viscous_friction_coefficient_to_sim_index(joint_viscous_friction_coeff=b, env_ids=ids)
        self.robot.write_joint_friction_coefficient_to_sim_index(joint_friction_coeff=c, env_ids=ids)

    def nan_envs(self) -> torch.Tensor:
        data = self.robot.data  # envs with a non-finite joint or root state
        fields = (data.joint_pos, data.joint_vel, data.root_link_pose_w, data.root_com_vel_w)
        return ~torch.stack([torch.isfinite(f.torch).all(-1) for f in fields]).all(0)

    def close(self) -> None:
        self.sim.stop()
        type(self.sim).clear_instance()
        self._launch.close()
        self._tmp.cleanup()


def mujoco_scene_xml() -> str:
    """The G1 MJCF as one self-contained MuJoCo scene with the physics every engine here runs (our joint constants,
    floor, 200 Hz implicitfast), visual meshes dropped (collision is capsules and spheres, inertias are explicit).
    `python envs.py scene` writes it to g1_scene.xml; a test checks the shipped file."""
    import mujoco
    spec = mujoco.MjSpec.from_file(str(ssjr.g1_mjcf_path()))
    for element in ([g for g in spec.geoms if g.type == mujoco.mjtGeom.mjGEOM_MESH] + list(spec.meshes)
                    + list(spec.materials) + [s for s in spec.sensors if s.name not in IMU_SENSORS]):
        spec.delete(element)
    for joint in spec.joints[1:]:  # joint 0: the free base
        joint.armature, joint.damping[0], joint.frictionloss = ARMATURE, JOINT_DAMPING, JOINT_FRICTION
    for geom in spec.geoms:
        geom.conaffinity = 0  # no self-collision: robot geoms touch only the floor
    spec.option.timestep, spec.option.integrator = PHYSICS_DT_S, mujoco.mjtIntegrator.mjINT_IMPLICITFAST
    spec.worldbody.add_geom(name="floor", type=mujoco.mjtGeom.mjGEOM_PLANE, size=[0, 0, 0.05],
                            friction=[GROUND_FRICTION, 0.005, 0.0001])
    return ("<!-- Unitree G1 29-DoF (BSD-3-Clause, Unitree Robotics; MJCF from the mjlab 1.6.0 wheel, Apache-2.0), "
            "written by `python envs.py scene`: do not edit -->\n" + spec.to_xml())


class MuJoCoSim(EngineSim):
    """MuJoCo on the CPU: one MjModel and MjData per env (each env's DR writes go to its own model), stepped in loops
    over slices of the envs, one per core this process may use (MuJoCo releases the GIL). Each step is mj_step2 then
    mj_step1, so positions, velocities and kinematics are always those of the current state. MuJoCo resets a bad state
    (non-finite, huge accelerations) itself, with a warning: nan_envs() reports it as a blow-up."""
    contact_timeconst_s = None

    def __init__(self, num_envs: int, device: str, terrain: Terrain):
        import mujoco
        mujoco.set_mju_user_warning(lambda text: None)  # bad states are counted (nan_envs), not appended to a log file
        self.mj, self.num_envs, self.device = mujoco, num_envs, torch.device(device)
        spec = mujoco.MjSpec.from_file(str(SCENE_XML))
        if not terrain.is_flat:  # MuJoCo hfield rows run along y: heights_m.T; elevation from the lowest point
            h = terrain.heights_m.astype(np.float64)
            (nx, ny), lo, span = h.shape, float(h.min()), max(float(np.ptp(h)), 1e-6)
            half = ((nx - 1) * terrain.cell_m / 2, (ny - 1) * terrain.cell_m / 2)
            spec.add_hfield(name="terrain", nrow=ny, ncol=nx, size=[*half, span, 0.1],
                            userdata=((h.T - lo) / span).ravel().tolist())
            spec.worldbody.add_geom(name="terrain", type=mujoco.mjtGeom.mjGEOM_HFIELD, hfieldname="terrain",
                                    pos=[terrain.origin_m[0] + half[0], terrain.origin_m[1] + half[1], lo],
                                    friction=[GROUND_FRICTION, 0.005, 0.0001])
            spec.geom("floor").pos = [0, 0, lo]  # the floor plane under it
        base = spec.compile()
        self.models = [base] + [copy.deepcopy(base) for _ in range(num_envs - 1)]
        self.datas = [mujoco.MjData(m) for m in self.models]
        self._scratch = mujoco.MjData(base)  # for mj_setConst after body writes (it overwrites the state it is given)
        ids = {name: mujoco.mj_name2id(base, mujoco.mjtObj.mjOBJ_BODY, name) for name in ssjr.BODY_NAMES}
        self.bodies = np.array([ids[name] for name in ssjr.BODY_NAMES])
        self.pelvis, self.torso = ids["pelvis"], ids["torso_link"]  # pelvis: the free base, root of the robot's tree
        assert [base.joint(i + 1).name for i in range(NUM_DOF)] == list(ssjr.DOF_NAMES)  # qpos 7.., qvel 6..: ours
        self.feet = np.flatnonzero(np.isin(base.geom_bodyid, [ids[f] for f in FEET]))
        self.default_body_mass_kg = self._t(base.body_mass[self.bodies]).expand(num_envs, -1).clone()
        self._default_inertia, self._default_torso_com = base.body_inertia.copy(), base.body_ipos[self.torso].copy()
        self._bad = [int(getattr(mujoco.mjtWarning, f"mjWARN_BAD{x}")) for x in ("QPOS", "QVEL", "QACC")]
        self._q, self._qd = np.zeros((num_envs, NUM_DOF)), np.zeros((num_envs, NUM_DOF))  # joint state, kept current
        for i in range(num_envs):
            self._refresh(i)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # macOS: none
        threads = max(1, min(num_envs, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        self._slices = [range(k * num_envs // threads, (k + 1) * num_envs // threads) for k in range(threads)]
        self._pool = concurrent.futures.ThreadPoolExecutor(threads - 1) if threads > 1 else None  # + this thread

    def _refresh(self, i: int, masses: bool = False) -> None:
        """After a write to env i: the constraints' inverse weights if `masses` or armature changed (mj_setConst),
        kinematics and velocities (a bad state is reset by MuJoCo, with a warning), the joint state's copy."""
        m, d = self.models[i], self.datas[i]
        if masses:
            self.mj.mj_setConst(m, self._scratch)
        self.mj.mj_step1(m, d)
        self._q[i], self._qd[i] = d.qpos[7:], d.qvel[6:]

    def _envs(self, env_ids, *xs, masses: bool = False):
        """(model, data, rows of xs in float64) of each env of env_ids, refreshed once the caller wrote it."""
        xs = [x.cpu().double().numpy() for x in xs]
        for k, i in enumerate(env_ids.tolist()):
            yield self.models[i], self.datas[i], *(x[k] for x in xs)
            self._refresh(i, masses)

    def step(self, tau_nm: torch.Tensor) -> None:
        tau = tau_nm.detach().cpu().double().numpy()

        def step_slice(envs: range) -> None:
            for i in envs:
                self.datas[i].qfrc_applied[6:] = tau[i]
                self.mj.mj_step2(self.models[i], self.datas[i])
                self._refresh(i)
        others = [self._pool.submit(step_slice, envs) for envs in self._slices[1:]]
        step_slice(self._slices[0])  # the first slice on this thread, the others on the pool's
        for future in others:
            future.result()

    def dof_state(self):
        return self._t(self._q), self._t(self._qd)

    def root_state(self):
        return tuple(x[:, 0] for x in self.body_state())  # the pelvis, body 0

    def body_state(self):
        """World positions, wxyz quaternions, and velocities of the body frames' origins (d/dt body_pos, as the other
        engines): cvel holds [angular; linear at the tree's centre of mass subtree_com[root]]."""
        b = self.bodies
        pos, quat, cvel = (np.stack([getattr(d, a)[b] for d in self.datas]) for a in ("xpos", "xquat", "cvel"))
        com = np.stack([d.subtree_com[self.pelvis] for d in self.datas])
        ang, lin = cvel[..., :3], cvel[..., 3:] + np.cross(cvel[..., :3], pos - com[:, None])
        return self._t(pos), self._t(quat), self._t(lin), self._t(ang)

    def write_state(self, env_ids, root_pos, root_quat, root_lin_vel, root_ang_vel, q, qd) -> None:
        # free joint: position, wxyz quaternion; linear velocity in the world frame, angular in the root's own frame
        qvel = torch.cat([root_lin_vel, quat_apply(quat_conj(root_quat), root_ang_vel), qd], -1)
        for _, d, qpos_k, qvel_k in self._envs(env_ids, torch.cat([root_pos, root_quat, q], -1), qvel):
            d.qpos[:], d.qvel[:], d.qacc_warmstart[:], d.qfrc_applied[:] = qpos_k, qvel_k, 0.0, 0.0

    def set_root_velocity(self, env_ids, lin_vel_w, ang_vel_w) -> None:
        for _, d, lin, ang in self._envs(env_ids, lin_vel_w, ang_vel_w):
            d.qvel[:3], d.qvel[3:6] = lin, d.xmat[self.pelvis].reshape(3, 3).T @ ang

    def set_gravity(self, env_ids, g_w) -> None:
        for m, _, g in self._envs(env_ids, g_w):
            m.opt.gravity[:] = g

    def set_body_mass(self, env_ids, mass_kg) -> None:
        for m, _, mass, default in self._envs(env_ids, mass_kg, self.default_body_mass_kg[env_ids], masses=True):
            m.body_mass[self.bodies] = mass
            m.body_inertia[self.bodies] = self._default_inertia[self.bodies] * (mass / default)[:, None]

    def set_com_offset(self, env_ids, offset_m) -> None:
        for m, _, offset in self._envs(env_ids, offset_m, masses=True):
            m.body_ipos[self.torso] = self._default_torso_com + offset

    def set_friction(self, env_ids, mu) -> None:
        for m, _, mu_k in self._envs(env_ids, mu):
            m.geom_friction[self.feet, 0] = mu_k

    def set_contact_timeconst(self, env_ids, timeconst_s) -> None:
        for k, i in enumerate(env_ids.tolist()):  # a contact's solref mixes its two geoms': the same on all of them
            self.models[i].geom_solref[:, 0] = float(timeconst_s[k])

    def set_joint_params(self, env_ids, armature, damping, frictionloss) -> None:
        for m, _, a, b, c in self._envs(env_ids, armature, damping, frictionloss, masses=True):
            m.dof_armature[6:], m.dof_damping[6:], m.dof_frictionloss[6:] = a, b, c

    def nan_envs(self) -> torch.Tensor:
        """Envs MuJoCo reset since the last call (a bad position, velocity or acceleration warning). The warning counts
        are zeroed after each read: a reset zeroes them too and counts 1, so a second blow-up would not raise them."""
        blown_up = np.array([d.warning.number[self._bad].any() for d in self.datas])
        for i in np.flatnonzero(blown_up):
            self.datas[i].warning.number[:] = 0
        return torch.as_tensor(blown_up, device=self.device)

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown()


# --- The tracking task, written once for every engine.
def shift_in(stack: torch.Tensor, new) -> torch.Tensor:
    """A per-env stack [N, T, ...], oldest first, moved one step on: `new` [N, ...] becomes its last entry."""
    stack = torch.roll(stack, -1, 1)
    stack[:, -1] = new
    return stack


class TrackingEnv:
    """Batched G1 motion tracking (paper Sec. 3): reference-state init, PD targets in, tracking reward out."""
    HISTORY_LEN = 16  # K for HCDR (see hcdr.py for the choice)
    PROPRIO_STEPS, FUTURE_STEPS, STUDENT_PAST, STUDENT_FUTURE = 5, 8, 8, 4

    def __init__(self, sim, motion_lib: MotionLib, terrain: Terrain, dr: DR | None, seed: int, start: str = "random",
                 termination: str = "max", root_velocity: bool = True, clamp_targets: bool = False):
        self.sim, self.motions, self.terrain, self.dr, self.start = sim, motion_lib, terrain, dr, start  # START_MODES
        self.termination, self.root_velocity = termination, root_velocity  # TERMINATIONS; see make_env
        # the authors' recipe's levers (off unless teacher.py sets them): frame-0 start share, clip weights, grace steps
        self.frame0_share, self.clip_weights, self.grace_steps = 0.0, None, 0
        self.num_envs, self.device = n, dev = sim.num_envs, sim.device
        self.kp, self.kd, self.effort_limit_nm = joint_table(dev)
        self.clamp_targets, self.joint_range_rad = clamp_targets, joint_range_rad(dev)  # make_env's clamp_targets
        self.keypoint_ids = torch.tensor(ssjr.KEYPOINT_BODY_IDS, device=dev)
        self.tile_weights = tile_weights(terrain.tile_types, TERRAIN_MIX).to(dev)
        self.scan_xy, self.spawn_xy = SCAN_XY_M.to(dev), torch.as_tensor(terrain.spawn_xy_m, device=dev)
        self.sensor_std = dr.sensor_std().to(dev) if dr is not None else None  # times dr.noise_scale where drawn
        self.default_mass = sim.default_body_mass_kg.clone()
        # per-env episode state; the clip's control tick now is tick0 (at the episode start) + step_count
        self.clip, self.tick0, self.step_count = (torch.zeros(n, dtype=torch.long, device=dev) for _ in range(3))
        self.ref_offset = torch.zeros(n, 3, device=dev)  # world offset of the reference (tile spawn point)
        self.next_push_s = torch.full((n,), float("inf"), device=dev)
        self.last_alpha = torch.zeros(n, NUM_DOF, device=dev)  # the PD target of the previous control step
        # the delay line: PD targets of the last control steps, oldest first (d physics steps reach ceil(d / 4) back)
        self.alpha_line = torch.zeros(n, -(-MAX_DELAY_STEPS // DECIMATION) + 1, NUM_DOF, device=dev)
        self.proprio_buf = torch.zeros(n, self.PROPRIO_STEPS, PROPRIO_DIM, device=dev)
        self.sparse_buf = torch.zeros(n, self.STUDENT_PAST, SPARSE_STATE_DIM + NUM_DOF, device=dev)
        self.history = torch.zeros(n, self.HISTORY_LEN, SPARSE_STATE_DIM + NUM_DOF, device=dev)
        self.history_mask = torch.zeros(n, self.HISTORY_LEN, dtype=torch.bool, device=dev)
        window = self.STUDENT_PAST + self.STUDENT_FUTURE
        self.keypoint_noise = torch.zeros(n, window, len(ssjr.KEYPOINT_BODY_IDS), 3, device=dev)  # command frames
        self.substep_tau = torch.zeros(DECIMATION, n, NUM_DOF, device=dev)  # torques of the last control step
        self.nan_resets = torch.zeros((), dtype=torch.long, device=dev)  # blown-up envs reset so far
        self.physics_s = self.dr_write_s = 0.0  # host seconds in the engine's physics steps and in DR writes so far
        self._fresh = torch.ones(n, dtype=torch.bool, device=dev)  # envs whose observation stacks restart
        self.obs_layout: dict[str, list[int]] = {}
        # one reference window per step: t-7..t (student past), t+1..t+4 (student future) / t+1..t+8 (teacher)
        self.window_steps = torch.arange(1 - self.STUDENT_PAST, self.FUTURE_STEPS + 1, device=dev)
        self.all_ids = torch.arange(n, device=dev)
        self.gen = torch.Generator(device=dev)  # every draw: clips, starts, psi, pushes, tiles, noise (checkpointed)
        self.episode_gens = [torch.Generator(device=dev) for _ in range(n)] if start == "frame0" else None
        self._seed(seed)

    def _seed(self, seed: int):
        """Restart the random streams at `seed`: the clip rotation and all of psi (see DR.body_psi_per_episode)."""
        self.seed = seed
        self.gen.manual_seed(seed)
        self.start_count = self.all_ids.clone()  # frame-0 starts: env i's k-th start is start i + k N of the rotation
        self.psi = sample_psi(self.dr, self.num_envs, self.gen, self.device)
        self._write_psi(self.all_ids, body=True)

    def close(self):
        self.sim.close()

    def _draw(self, ids: torch.Tensor, fn):
        """fn(m, generator) -> m draws (a tensor [m, ...] or a dict of them) for envs `ids`: one batched call on the
        env's stream, or with frame-0 starts one call per env on its episode's own stream."""
        if self.episode_gens is None:
            return fn(len(ids), self.gen)
        draws = [fn(1, self.episode_gens[i]) for i in ids.tolist()]
        if isinstance(draws[0], dict):
            return {k: torch.cat([d[k] for d in draws]) for k in draws[0]}
        return torch.cat(draws)

    def _randn(self, *shape: int) -> torch.Tensor:
        """Standard normal draws [N, *shape], one set per env (see _draw)."""
        return self._draw(self.all_ids, lambda m, g: torch.randn((m, *shape), generator=g, device=self.device))

    # --- reference ------------------------------------------------------------------------------------------------
    def reference(self, steps: int | torch.Tensor = 0, env_ids=None) -> dict[str, torch.Tensor]:
        """Reference state `steps` control steps from now, placed in the world (tile offset, terrain height under its
        root). steps: an int, or offsets [K] -> every field gets a window axis: [N, K, ...]."""
        ids = slice(None) if env_ids is None else env_ids
        clip, tick, offset = self.clip[ids], (self.tick0 + self.step_count)[ids], self.ref_offset[ids]
        if window := torch.is_tensor(steps):  # read all N*K (env, tick) pairs in one gather
            clip, tick = clip.repeat_interleave(len(steps)), (tick[:, None] + steps).flatten()
            offset = offset.repeat_interleave(len(steps), 0)
        ref = self.motions.at_tick(clip, tick + (0 if window else steps))
        ref["body_pos"] = pos = ref["body_pos"] + offset[:, None]
        pos[..., 2] += self.terrain.height_at(pos[:, 0, :2])[:, None]
        return {key: v.view(-1, len(steps), *v.shape[1:]) for key, v in ref.items()} if window else ref

    # --- reset ----------------------------------------------------------------------------------------------------
    def reseed(self, seed: int) -> dict[str, torch.Tensor]:
        """Restart every env from scratch as if built with `seed` (evaluation reuses one scene across seeds)."""
        self._seed(seed)
        return self.reset()

    def reset(self, env_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if len(ids := self.all_ids if env_ids is None else env_ids):
            self._reset_envs(ids)
        return self._observe(self.sim.body_state(), *self.sim.dof_state(), advance=False)

    def _reset_envs(self, ids: torch.Tensor):
        m, dev, lib = len(ids), self.device, self.motions
        if self.start == "frame0":  # start g of the rotation plays clip g mod C for the (g div C)-th time
            g = self.start_count[ids]
            self.clip[ids], self.tick0[ids], self.start_count[ids] = g % len(lib), 0, g + self.num_envs
            for i, c, e in zip(ids.tolist(), (g % len(lib)).tolist(), (g // len(lib)).tolist()):  # clip c, episode e
                self.episode_gens[i].manual_seed(int(np.random.SeedSequence([self.seed, c, e]).generate_state(1)[0]))
        else:  # reference-state init: a uniform clip, then a uniform start tick in it
            self.clip[ids] = (torch.randint(len(lib), (m,), generator=self.gen, device=dev) if self.clip_weights is None
                              else torch.multinomial(self.clip_weights, m, replacement=True, generator=self.gen))
            num_starts = lib.last_start_tick[self.clip[ids]] + 1
            self.tick0[ids] = (torch.rand(m, generator=self.gen, device=dev) * num_starts).long()
            if self.frame0_share:
                self.tick0[ids] *= torch.rand(m, generator=self.gen, device=dev) >= self.frame0_share
        self.step_count[ids] = 0
        tile = self._draw(ids, lambda k, g: torch.multinomial(self.tile_weights, k, replacement=True, generator=g))
        start = lib.at_tick(self.clip[ids], self.tick0[ids])
        self.ref_offset[ids, :2] = self.spawn_xy[tile] - start["body_pos"][:, 0, :2]
        # psi: this episode's hidden dynamics (without DR the nominal values written at start stay, and no pushes:
        # next_push_s stays inf); evaluation episodes redraw the body terms too: they must be independent
        if self.dr is not None:
            body = self.dr.body_psi_per_episode or self.episode_gens is not None
            for k, v in self._draw(ids, lambda k, g: sample_psi(self.dr, k, g, dev)).items():
                if body or k not in BODY_PSI_KEYS:
                    self.psi[k][ids] = v
            self._write_psi(ids, body)
            self.next_push_s[ids] = self._draw(ids, lambda k, g: uniform(self.dr.push_interval_s, k, g, dev))
        ref = self.reference(env_ids=ids)  # reference-state init; these envs' observation stacks restart (_fresh)
        self.sim.write_state(ids, ref["body_pos"][:, 0], ref["body_quat"][:, 0], ref["body_lin_vel"][:, 0],
                             ref["body_ang_vel"][:, 0], ref["dof_pos"], ref["dof_vel"])
        self.last_alpha[ids], self.alpha_line[ids], self.history[ids] = ref["dof_pos"], ref["dof_pos"][:, None], 0.0
        self.history_mask[ids], self._fresh[ids] = False, True

    def _write_psi(self, ids: torch.Tensor, body: bool):
        """psi of envs `ids` into the engine (body terms only if `body`); the PD gain scales and delay act in step()."""
        psi, start = {k: v[ids] for k, v in self.psi.items()}, time.perf_counter()
        if body:
            self.sim.set_body_mass(ids, self.default_mass[ids] * psi["mass_scale"][:, None])
            self.sim.set_com_offset(ids, torch.stack([psi[f"com_offset_{a}_m"] for a in "xyz"], -1))
            js = psi["joint_scale"][:, None].expand(len(ids), NUM_DOF)
            self.sim.set_joint_params(ids, ARMATURE * js, JOINT_DAMPING * js, JOINT_FRICTION * js)
        self.sim.set_friction(ids, psi["friction"])
        if self.sim.contact_timeconst_s is None:
            self.sim.set_contact_timeconst(ids, psi["contact_timeconst_s"])
        else:  # one value per scene: psi records the one the episode meets
            self.psi["contact_timeconst_s"][ids] = self.sim.contact_timeconst_s
        self.sim.set_gravity(ids, torch.nn.functional.pad(-psi["gravity_mps2"][:, None], (2, 0)))
        self.dr_write_s += time.perf_counter() - start

    # --- step -----------------------------------------------------------------------------------------------------
    def step(self, alpha: torch.Tensor):
        """One 50 Hz control step: PD targets alpha [N,29] -> (obs, reward [N], done [N], info)."""
        alpha, dev, psi = alpha.detach().to(self.device), self.device, self.psi
        if self.clamp_targets:  # the targets played, delayed and remembered are the clamped ones
            alpha = alpha.clamp(*self.joint_range_rad)
        s_before = self.sparse_buf[:, -1, :SPARSE_STATE_DIM]  # s_t, observed at the end of the last step
        kp, kd = self.kp * psi["kp_scale"][:, None], self.kd * psi["kd_scale"][:, None]
        push = self.step_count * CONTROL_DT_S >= self.next_push_s  # a kick every U[5, 10] s of episode time
        ids = push.nonzero().squeeze(-1)  # one of the two host reads of a step (the engine call needs the count)
        if len(ids):
            _, _, v, w = self.sim.root_state()
            direction, size = self._draw(ids, lambda k, g: torch.rand(k, 2, generator=g, device=dev)).T  # U[0, 1)
            angle_rad = 2 * math.pi * direction
            kick = size[:, None] * self.dr.push_vel_mps * torch.stack([angle_rad.cos(), angle_rad.sin()], -1)
            self.sim.set_root_velocity(ids, v[ids] + torch.nn.functional.pad(kick, (0, 1)), w[ids])
            self.next_push_s[ids] += self._draw(ids, lambda k, g: uniform(self.dr.push_interval_s, k, g, dev))
        power = torch.zeros(self.num_envs, device=dev)
        self.alpha_line = shift_in(self.alpha_line, alpha)
        for k in range(DECIMATION):
            # delay d physics steps: physics step k of this period plays the target ceil((d - k) / 4) control steps ago
            lag = torch.div(psi["delay_steps"].long() - k + DECIMATION - 1, DECIMATION, rounding_mode="floor").clamp(0)
            target = self.alpha_line[self.all_ids, -1 - lag]
            q, qd = self.sim.dof_state()
            tau = (kp * (target - q) - kd * qd).clamp(-self.effort_limit_nm, self.effort_limit_nm)
            start = time.perf_counter()
            self.sim.step(tau)
            self.physics_s += time.perf_counter() - start
            self.substep_tau[k] = tau
            power += (tau * qd).abs().sum(-1)
        self.last_alpha = alpha.clone()  # the caller keeps its tensor (resets write the reference pose here)
        self.step_count += 1
        body, (q, qd) = self.sim.body_state(), self.sim.dof_state()
        self.history = shift_in(self.history, torch.cat([s_before, alpha], -1))  # HCDR: the (s, alpha) pair played
        self.history_mask = shift_in(self.history_mask, True)
        ref = self.reference()  # reward and termination against the reference at the new time
        terms, metrics = tracking_terms(body, ref)
        kernels = {k: torch.exp(REWARD_COEFFS[k] * v) for k, v in terms.items()}
        power_w = power / DECIMATION  # mean mechanical power of the control step
        reward = sum(REWARD_WEIGHTS[k] * kernels[k] for k in REWARD_WEIGHTS) - POWER_PENALTY * power_w
        finite = torch.isfinite(torch.cat([x.flatten(1) for x in (*body, q, qd, reward[:, None])], 1)).all(-1)
        blown_up = self.sim.nan_envs() | ~finite
        reward = reward.masked_fill(blown_up, 0.0)
        # human keypoint commands define only the SSJR keypoints: they alone decide the failure there
        keypoint_err, body_err = (("max_keypoint_err_m", "max_body_err_m") if self.termination == "max" else
                                  ("keypoint_err_m", "gt_err_m"))
        err = torch.where(self.motions.keypoints_only[self.clip], metrics[keypoint_err], metrics[body_err])
        failed = ((err > TERMINATION_ERR_M) & (self.step_count > self.grace_steps)) | blown_up
        time_out = self.tick0 + self.step_count >= self.motions.num_ticks[self.clip] - 1
        done = failed | time_out
        self.body_pos_w, self.body_quat_w = body[0], body[1]
        self.ref_body_pos_w, self.ref_body_quat_w = ref["body_pos"], ref["body_quat"]
        self.nan_resets = self.nan_resets + blown_up.sum()  # a device counter: read once per iteration by the trainers
        info = {"metrics": metrics, "reward_terms": kernels, "power_w": power_w, "time_out": time_out & ~failed,
                "failed": failed, "nan": blown_up, "pushed": push, "psi": {k: v.clone() for k, v in psi.items()},
                "clip": self.clip.clone(), "nan_resets": self.nan_resets}
        if len(ids := done.nonzero().squeeze(-1)):  # the other host read: which envs reset
            self._reset_envs(ids)
            body, (q, qd) = self.sim.body_state(), self.sim.dof_state()
        return self._observe(body, q, qd, advance=True), reward, done, info

    # --- observations ---------------------------------------------------------------------------------------------
    @staticmethod
    def sparse_state(body, q, qd) -> torch.Tensor:
        """s [N, 64]: dof pos, dof vel, root ang vel and projected gravity (in the root frame, as an IMU gives them)."""
        inv_root, ang = quat_conj(body[1][:, 0]), body[3][:, 0]  # the root is body 0 (pelvis)
        down = torch.tensor([0.0, 0.0, -1.0], device=ang.device).expand_as(ang)
        return torch.cat([q, qd, quat_apply(inv_root, ang), quat_apply(inv_root, down)], -1)

    def _observe(self, body, q, qd, advance: bool) -> dict[str, torch.Tensor]:
        """Observations of the current state. advance: a control step passed (the stacks shift by one step);
        otherwise (a reset) only the freshly reset envs' stacks change (they are filled with their first frame)."""
        pos, quat, lin, ang = body
        root_pos, root_quat, yaw = pos[:, 0], quat[:, 0], yaw_rad(quat[:, 0])

        def heading(v):  # world vectors [N, ..., B, 3] -> the heading frame, [N, ..., B*3]
            return rotate_z(v, -yaw.view(-1, *[1] * (v.dim() - 2))).flatten(-2)

        def heading_rot6d(q):  # world rotations [N, ..., B, 4] -> rot6d in the heading frame, [N, ..., B*6]
            inv_heading = z_quat(-yaw).view(-1, *[1] * (q.dim() - 2), 4)
            return rot6d(quat_mul(inv_heading.expand_as(q), q)).flatten(-2)

        s = self.sparse_state(body, q, qd)  # readings s_t (encoders, IMU): one noise draw each, in every stack
        if self.dr is not None:
            s = s + self.sensor_std * self.dr.noise_scale * self._randn(s.shape[-1])
        before = [(root_pos[:, 2] - self.terrain.height_at(root_pos[:, :2]))[:, None],
                  heading(pos[:, 1:] - root_pos[:, None]), heading_rot6d(quat)]  # the body state around its velocities
        after = [heading(ang), s[:, :2 * NUM_DOF], self.last_alpha]
        critic_proprio = torch.cat([*before, heading(lin), *after], -1)  # the critic reads the world's velocities
        # the actor, without the root's linear velocity (no sensor reads it), reads the bodies' relative to the root's
        proprio = critic_proprio if self.root_velocity else torch.cat([*before, heading(lin - lin[:, :1]), *after], -1)
        for name, new in (("proprio_buf", proprio), ("sparse_buf", torch.cat([s, self.last_alpha], -1))):
            stack = shift_in(getattr(self, name), new) if advance else getattr(self, name)
            setattr(self, name, torch.where(self._fresh[:, None, None], new[:, None], stack))
        ref = self.reference(self.window_steps)  # teacher's future t+1..t+8, student's keypoints t-7..t+4
        fut = {k: v[:, self.STUDENT_PAST:] for k, v in ref.items()}
        future = torch.cat([heading(fut["body_pos"] - root_pos[:, None, None]), heading(fut["body_pos"] - pos[:, None]),
                            heading_rot6d(fut["body_quat"]), heading(fut["body_lin_vel"]),
                            heading(fut["body_ang_vel"]), fut["dof_pos"]], -1)
        kp_w = ref["body_pos"][:, :self.STUDENT_PAST + self.STUDENT_FUTURE, self.keypoint_ids]
        if self.dr is not None:  # one draw per keypoint of each command frame, kept while the window slides over it
            noise = self.dr.noise_keypoint_m * self.dr.noise_scale * self._randn(*kp_w.shape[1:])
            stack = shift_in(self.keypoint_noise, noise[:, -1]) if advance else self.keypoint_noise
            self.keypoint_noise = torch.where(self._fresh[:, None, None, None], noise, stack)
            kp_w = kp_w + self.keypoint_noise
        self._fresh[:] = False
        keypoints = ssjr.keypoint_command(kp_w, root_pos, root_quat)
        scan_w = rotate_z(torch.nn.functional.pad(self.scan_xy, (0, 1)), yaw[:, None])[..., :2]  # g_t: height scan
        terrain = root_pos[:, 2:3] - self.terrain.height_at(scan_w + root_pos[:, None, :2])
        psi = torch.stack([self.psi[k] for k in PSI_KEYS], -1)
        obs = {"proprio": self.proprio_buf.clone(), "future": future, "ref_dof_pos": fut["dof_pos"][:, 0],
               "terrain": terrain, "history": self.history.clone(), "history_mask": self.history_mask.clone(),
               "student_proprio": self.sparse_buf.clone(), "student_keypoints": keypoints, "psi": psi[:, None],
               "critic": torch.cat([critic_proprio, future[:, 0], terrain, psi], -1)}
        self.obs_layout = self.obs_layout or {k: list(v.shape[1:]) for k, v in obs.items()}
        return obs


def body_error_metrics(pos: torch.Tensor, ref_pos: torch.Tensor) -> dict[str, torch.Tensor]:
    """Distances (m) of the bodies and of the SSJR keypoint bodies to their reference positions, world frame, reduced
    over the bodies: [..., B, 3] -> [...] each. The failure test, training metrics and evaluate.py's errors use them."""
    err_b = (ref_pos - pos).norm(dim=-1)
    err_k = err_b[..., list(ssjr.KEYPOINT_BODY_IDS)]
    return {"gt_err_m": err_b.mean(-1), "keypoint_err_m": err_k.mean(-1), "max_keypoint_err_m": err_k.amax(-1),
            "max_body_err_m": err_b.amax(-1)}


def tracking_terms(body, ref):
    """Mean squared tracking errors (the exp-reward arguments) and the per-env metrics of the paper."""
    pos, quat, lin, ang = body
    dp, angle = ref["body_pos"] - pos, ssjr.quat_angle(quat, ref["body_quat"])
    rel = ((ref["body_pos"] - ref["body_pos"][:, :1]) - (pos - pos[:, :1])).norm(dim=-1)  # root-relative error
    terms = {"gt": dp.pow(2).mean((-1, -2)), "gr": angle.pow(2).mean(-1),
             "gv": (ref["body_lin_vel"] - lin).pow(2).mean((-1, -2)),
             "gav": (ref["body_ang_vel"] - ang).pow(2).mean((-1, -2)),
             "rh": (ref["body_pos"][:, 0, 2] - pos[:, 0, 2]).pow(2), "rt": dp[:, 0].pow(2).mean(-1)}
    metrics = {**body_error_metrics(pos, ref["body_pos"]), "mpjpe_m": rel.mean(-1), "gr_err_rad": angle.mean(-1)}
    return terms, metrics


def tile_weights(tile_types, mix: dict[str, float]) -> torch.Tensor:
    """Spawn weight of each tile: its type's share of the training mix, split evenly over the tiles of that type."""
    return torch.tensor([mix.get(t, 0.0) / tile_types.count(t) for t in tile_types])


def make_env(sim: str = "genesis", num_envs: int = 64, device: str = "cpu", motions="data/packets/g1_moves",
             dr: DR | str | None = None, terrain: str = "flat", seed: int = 0, start: str = "random",
             exclude_test: bool = True, performance_mode: bool = False, terrain_seed: int | None = None,
             termination: str = "max", root_velocity: bool = True,
             contact_timeconst_s: float | None = None, clamp_targets: bool = False) -> TrackingEnv:
    """Build the tracking env on `sim` (SIMS). motions: packet folder/file/list; the held-out test clips
    (ssjr.TEST_CLIPS) are dropped from a folder unless exclude_test=False (evaluation). dr: a DR, "default" (DR(): what
    a checkpoint's env_cfg records) or None (nominal dynamics). performance_mode (Genesis): kernels compiled for this
    exact num_envs (faster CPU physics, compiled at every start; one mode per process). terrain_seed: default seed.
    termination: TERMINATIONS. root_velocity: the teacher's proprio holds the root's linear velocity (False: the bodies'
    relative to it). contact_timeconst_s: Genesis' (None: its default; genesis_aligned: CONTACT_TIMECONST_S).
    clamp_targets: the PD targets clamped to the MJCF joint ranges, as a robot's safety layer does (off: a target
    beyond a range presses the joint into its stop)."""
    dr = DR() if dr == "default" else dr
    if num_envs < 1:
        raise InputError("--num-envs", f"must be at least 1, got {num_envs}")
    if sim not in SIMS:
        raise InputError("--sim", f"unknown sim '{sim}': choose one of {SIMS}")
    if start not in START_MODES:  # before the engine: Isaac Lab allows one simulation per process
        raise InputError("--start", f"unknown start '{start}': choose one of {START_MODES}")
    paths = resolve_motions(motions)
    if exclude_test and len(paths) > 1:
        paths, test = ssjr.train_test_split(paths)
        if not paths:
            raise InputError(motions, "only held-out test clips (ssjr.TEST_CLIPS): nothing to train on")
        if test:  # said aloud: a folder that mixes the splits is trained on fewer clips than it holds
            print(f"held out (ssjr.TEST_CLIPS), not trained on: {', '.join(p.name for p in test)}")
    motion_lib = MotionLib(paths, device)  # before the engine: a bad motion file leaves no simulator behind
    ground = make_terrain(terrain, seed if terrain_seed is None else terrain_seed)
    if sim.startswith("genesis"):
        aligned = CONTACT_TIMECONST_S if sim == "genesis_aligned" else None
        engine = GenesisSim(num_envs, device, ground, performance_mode=performance_mode,
                            contact_timeconst_s=contact_timeconst_s or aligned)
    else:
        engine = IsaacLabSim(num_envs, device, ground) if sim == "isaaclab" else MuJoCoSim(num_envs, device, ground)
    return TrackingEnv(engine, motion_lib, ground, dr, seed, start, termination, root_velocity, clamp_targets)


# --- Benchmark: our env vs the raw engine stepping the same scene (same adapter, same N, same run).
@dataclass
class Bench:
    """python envs.py bench --sim genesis --num-envs 64"""
    sim: str = "genesis"  # isaaclab | genesis | mujoco (mujoco: also our Genesis env on the same scene, same run)
    num_envs: int = 64  # parallel environments
    device: str = "cpu"  # simulation device
    steps: int = 100  # control steps timed (after 10 warm-up steps)
    motions: str = "data/packets/g1_moves"  # SSJR packet folder or file
    terrain: str = "flat"  # flat | smooth_slope | rough_slope | mix
    dr: bool = True  # domain randomization on
    torch_threads: int = 1  # torch intra-op threads
    performance_mode: bool = False  # Genesis performance mode (kernels compiled for this env count)


def bench_sim(args: Bench, sim: str) -> float:
    """Print and return our env's env-steps/s on `sim`, and the raw engine's (ours / the physics share of wall time,
    the env's own count). With DR, also the DR writes' share of step time, one env reset per step (as at 4096 envs)."""
    t0 = time.time()
    env = make_env(sim, args.num_envs, args.device, args.motions, DR() if args.dr else None, args.terrain,
                   performance_mode=args.performance_mode)
    obs, build_s, n = [env.reset()], time.time() - t0, args.num_envs

    def rate(reset_one: bool, steps: int) -> tuple[float, float, float]:
        """(env-steps/s, physics share, DR-write share) of `steps` env steps, after 10 warm-up steps."""
        for i in range(10 + steps):
            if i == 10:
                start, physics_s, dr_write_s = time.perf_counter(), env.physics_s, env.dr_write_s
            if reset_one:
                env.reset(torch.randint(n, (1,), device=env.device))
            obs[0] = env.step(obs[0]["ref_dof_pos"])[0]
        wall_s = time.perf_counter() - start
        return n * steps / wall_s, (env.physics_s - physics_s) / wall_s, (env.dr_write_s - dr_write_s) / wall_s

    ours, physics_share, _ = rate(False, args.steps)
    dr_pct = []
    if args.dr:
        for body_per_episode in (False, True):  # one env reset per step, its DR writes with and without the body terms
            env.dr.body_psi_per_episode = body_per_episode
            dr_pct.append(100 * rate(True, max(1, args.steps // 2))[2])
    env.close()
    print(f"{sim} ({args.device}), {n} envs, terrain {args.terrain}, DR {'on' if args.dr else 'off'}: "
          f"HoRD env {ours:,.0f} env-steps/s | raw engine, same scene {ours / physics_share:,.0f} | ratio "
          f"{physics_share:.2f} (build {build_s:.0f} s)")
    if dr_pct:
        print(f"DR resets: {dr_pct[0]:.0f} % of step time (one env reset per step; with DR.body_psi_per_episode: "
              f"{dr_pct[1]:.0f} %)")
    return ours


@dataclass
class Scene:
    """python envs.py scene: (re)write g1_scene.xml from the G1 MJCF and the joint constants above"""
    out: str = str(SCENE_XML)  # output file


if __name__ == "__main__":
    import tyro
    try:
        args = tyro.extras.subcommand_cli_from_dict({"bench": Bench, "scene": Scene})
        if isinstance(args, Scene):
            print(f"wrote {ssjr.write_atomic(args.out, lambda tmp: tmp.write_text(mujoco_scene_xml()))}")
        else:
            torch.set_num_threads(args.torch_threads)
            ours = bench_sim(args, args.sim)
            if args.sim == "mujoco":  # the engine it would replace on the CPU, same scene and loop, same run
                print(f"MuJoCo env / Genesis env: {ours / bench_sim(args, 'genesis'):.2f}x")
    except InputError as e:
        raise SystemExit(f"error: {e}")
