"""SSJR: the Standardized Sparse-Joint Representation of HoRD (paper Sec. 3.2).

load (G1 CSV, BeyondMimic/mjlab npz, PHC pkl, AMASS npz + the user's SMPL model, BVH) -> clean (root quaternions,
IK flips, joint limits) -> resample to 30 fps -> segment into 2-10 s clips -> FK of the G1 MJCF -> one float32 .npz
packet per segment (PACKET_KEYS). Robot sources give full packets; human sources (AMASS, BVH) give keypoint commands
scaled to the G1. The student's command Y_t is the sparse keypoint set KEYPOINT_NAMES in the robot's heading frame.

  python ssjr.py convert ../shared/data/g1_moves --out data/packets/g1_moves
  python ssjr.py show data/packets/g1_moves/M_Move7_seg00.npz --out clip.png   # or .mp4 / .gif
"""
from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import tyro

REPO = pathlib.Path(__file__).resolve().parent
SAMPLES = REPO / "data" / "samples"  # the motions shipped with the code (data/samples/README.md: licences)
DATA_ROOT = pathlib.Path(os.environ.get("HORD_DATA", REPO.parent / "shared" / "data"))  # the full data sets
ASSETS = REPO / "assets"
MJLAB_WHEEL = "mjlab==1.6.0"  # Apache-2.0 wheel that ships the Unitree G1 29-DoF MJCF (model BSD-3, Unitree)

TEST_CLIPS = ("B_WiggleDance", "J_Dance3_Woah",  # the held-out G1 Moves test split: evaluated on, never trained on
              "J_Dance21_Blunt", "J_ShortDance14_Disco", "B_SpinKarate", "M_Move7", "M_ShortMove13", "B_HandsUp")

DOF_NAMES = tuple(f"{side}_{j}_joint" for side in ("left", "right")  # MuJoCo / Unitree SDK / G1 CSV joint order
                  for j in ("hip_pitch", "hip_roll", "hip_yaw", "knee", "ankle_pitch", "ankle_roll")) + (
    "waist_yaw_joint", "waist_roll_joint", "waist_pitch_joint") + tuple(
    f"{side}_{j}_joint" for side in ("left", "right")
    for j in ("shoulder_pitch", "shoulder_roll", "shoulder_yaw", "elbow", "wrist_roll", "wrist_pitch", "wrist_yaw"))
NUM_DOF = len(DOF_NAMES)  # 29
BODY_NAMES = ("pelvis",) + tuple(n.replace("_joint", "_link") for n in DOF_NAMES[:14]) + ("torso_link",) + tuple(
    n.replace("_joint", "_link") for n in DOF_NAMES[15:])  # MJCF tree order: body i+1 is the link DOF_NAMES[i] moves


def g1_mjcf_path() -> pathlib.Path:  # fetched once from PyPI (the mjlab wheel, not installed) into assets/
    xml = ASSETS / "unitree_g1" / "xmls" / "g1.xml"
    if xml.exists():
        return xml
    print(f"[ssjr] downloading the G1 model ({MJLAB_WHEEL} wheel, model files only) into {ASSETS}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        if subprocess.call([sys.executable, "-m", "pip", "download", "-q", "--no-deps", MJLAB_WHEEL, "-d", tmp]):
            raise RuntimeError(f"could not download {MJLAB_WHEEL}; place its unitree_g1 folder at {ASSETS}")
        prefix = "mjlab/asset_zoo/robots/unitree_g1/"
        ASSETS.mkdir(exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(dir=ASSETS))
        with zipfile.ZipFile(next(pathlib.Path(tmp).glob("mjlab-*.whl"))) as zf:
            zf.extractall(staging, [n for n in zf.namelist() if n.startswith(prefix + "xmls/")])
        with contextlib.suppress(OSError):  # atomic; when another process got there first, its copy stays
            (staging / prefix).rename(ASSETS / "unitree_g1")
        shutil.rmtree(staging)
    return xml


# --- 1. The SSJR sparse joint set J: bodies whose origins a human mocap also measures well. torso_link is left out: its
#    origin sits 4.4 cm above the pelvis, while the two shoulders fix the torso's lean and twist.
KEYPOINT_NAMES = ("pelvis", "left_knee_link", "right_knee_link", "left_ankle_roll_link", "right_ankle_roll_link",
                  "left_shoulder_roll_link", "right_shoulder_roll_link", "left_elbow_link", "right_elbow_link",
                  "left_wrist_yaw_link", "right_wrist_yaw_link")
KEYPOINT_BODY_IDS = tuple(BODY_NAMES.index(n) for n in KEYPOINT_NAMES)
# Parent of each body (pelvis: -1), as G1Kinematics reads it from the MJCF (tested equal); drawing skips the XML.
BODY_PARENTS = (-1, 0, 1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 11, 0, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                15, 23, 24, 25, 26, 27, 28)
KEYPOINT_EDGES = ((0, 1), (1, 3), (0, 2), (2, 4), (0, 5), (0, 6), (5, 6), (5, 7), (7, 9), (6, 8), (8, 10))


# --- 2. Rotation math. Quaternions are wxyz, unit, torch, any leading dims; rotation matrices act on column vectors.
def quat_normalize(q: torch.Tensor) -> torch.Tensor:  # q / |q|, for any last dim
    return q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def quat_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # Hamilton product a * b (apply b first, then a)
    (aw, ax, ay, az), (bw, bx, by, bz) = a.unbind(-1), b.unbind(-1)
    return torch.stack((aw * bw - ax * bx - ay * by - az * bz,
                        aw * bx + ax * bw + ay * bz - az * by,
                        aw * by - ax * bz + ay * bw + az * bx,
                        aw * bz + ax * by - ay * bx + az * bw), dim=-1)


def quat_conj(q: torch.Tensor) -> torch.Tensor:
    return torch.cat((q[..., :1], -q[..., 1:]), dim=-1)  # the conjugate = the inverse of a unit quaternion


def quat_apply(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # rotates v [...,3] by q [...,4], broadcasting
    u, v = torch.broadcast_tensors(q[..., 1:], v)
    t = 2.0 * torch.linalg.cross(u, v, dim=-1)
    return v + q[..., :1] * t + torch.linalg.cross(u, t, dim=-1)


def quat_to_rotmat(q: torch.Tensor) -> torch.Tensor:  # [...,4] -> [...,3,3]
    w, x, y, z = q.unbind(-1)
    return torch.stack((1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)), -1).unflatten(-1, (3, 3))


def quat_from_axis_angle(axis: torch.Tensor, angle_rad: torch.Tensor) -> torch.Tensor:  # axis [...,3]: normalized here
    half = 0.5 * angle_rad[..., None]
    return torch.cat((torch.cos(half), torch.sin(half) * quat_normalize(axis)), dim=-1)


def quat_from_rotvec(rotvec: torch.Tensor) -> torch.Tensor:  # exp map: axis * angle [...,3] -> [...,4], exact near 0
    angle = rotvec.norm(dim=-1, keepdim=True)
    k = torch.where(angle > 1e-6, torch.sin(0.5 * angle) / angle.clamp_min(1e-6), 0.5 - angle ** 2 / 48.0)
    return torch.cat((torch.cos(0.5 * angle), k * rotvec), dim=-1)


def quat_to_rotvec(q: torch.Tensor) -> torch.Tensor:  # log map: [...,4] -> axis * angle [...,3], angle in [0, pi]
    q = torch.where(q[..., :1] < 0, -q, q)
    s = q[..., 1:].norm(dim=-1, keepdim=True)
    angle = 2.0 * torch.atan2(s, q[..., :1])
    k = torch.where(s > 1e-6, angle / s.clamp_min(1e-6), 2.0 / q[..., :1].clamp_min(1e-6))
    return k * q[..., 1:]


def quat_slerp(q0: torch.Tensor, q1: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """Spherical interpolation along the shorter arc; t [...] (broadcast to q0[..., 0]) in [0, 1]."""
    t = torch.as_tensor(t, dtype=q0.dtype, device=q0.device)[..., None]
    dot = (q0 * q1).sum(-1, keepdim=True)
    q1 = torch.where(dot < 0, -q1, q1)
    theta = torch.acos(dot.abs().clamp(max=1.0))
    sin_theta = torch.sin(theta)
    near = sin_theta < 1e-4  # nearly equal: plain lerp is exact enough and avoids 0/0
    s0, s1 = (torch.where(near, w, torch.sin(w * theta) / sin_theta.clamp_min(1e-4)) for w in (1 - t, t))
    return quat_normalize(s0 * q0 + s1 * q1)


def yaw_rad(q: torch.Tensor) -> torch.Tensor:  # the heading of q [...,4]: its rotation about world z
    w, x, y, z = q.unbind(-1)
    return torch.atan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))


def rotate_z(v: torch.Tensor, angle_rad: torch.Tensor) -> torch.Tensor:  # about world z: 4x cheaper than quat_apply
    c, s = torch.cos(angle_rad), torch.sin(angle_rad)
    x, y, z = v.unbind(-1)
    rx, ry = c * x - s * y, s * x + c * y
    return torch.stack((rx, ry, z.expand_as(rx)), -1)


def z_quat(angle_rad: torch.Tensor) -> torch.Tensor:  # the rotation about world z by angle_rad [...] -> [...,4]
    zero = torch.zeros_like(angle_rad)
    return torch.stack((torch.cos(0.5 * angle_rad), zero, zero, torch.sin(0.5 * angle_rad)), dim=-1)


def quat_angle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # geodesic angle between a and b, in [0, pi]
    d = quat_mul(quat_conj(a), b)
    return 2.0 * torch.atan2(d[..., 1:].norm(dim=-1), d[..., 0].abs())


def rot6d(q: torch.Tensor) -> torch.Tensor:  # continuous 6D feature: rotation matrix [col0, col1] -> [...,6]
    return torch.cat(quat_to_rotmat(q)[..., :2].unbind(-1), dim=-1)


def root_relative(points_w: torch.Tensor, root_pos_w: torch.Tensor, root_quat_w: torch.Tensor) -> torch.Tensor:
    """Points [...,J,3] in the heading-aligned root frame: origin at the root, x forward, z = world up."""
    return rotate_z(points_w - root_pos_w[..., None, :], -yaw_rad(root_quat_w)[..., None])


# --- 3. Forward kinematics straight from the MJCF tree (no physics engine): world pose of body i = parent pose * offset
#    (pos, quat in the parent frame) * rotation about its hinge axis (the pinned G1 MJCF: hinges at the body origins).
class G1Kinematics:
    def __init__(self, device: str | torch.device = "cpu"):
        root = ET.parse(g1_mjcf_path()).getroot()
        defaults: dict[str, dict[str, dict[str, str]]] = {}  # <default> class name -> tag -> attributes
        names, parents, pos, quat, axis, limits, dof_names = [], [], [], [], [], [], []
        geoms: list[tuple[int, np.ndarray, float]] = []  # collision geoms: body, end points [2,3], radius
        vec = lambda text, default: np.array([float(v) for v in text.split()] if text else default, float)  # noqa: E731
        def add_defaults(node: ET.Element, inherited: dict[str, dict[str, str]]) -> None:  # nested classes inherit
            own = defaults[node.get("class", "main")] = {tag: dict(attrs) for tag, attrs in inherited.items()}
            for child in node:
                if child.tag != "default":
                    own.setdefault(child.tag, {}).update(child.attrib)
            for child in node.findall("default"):
                add_defaults(child, own)
        def attrs(el: ET.Element, cls: str) -> dict[str, str]:  # the element's class defaults, then its own
            return {**defaults.get(el.get("class", cls), {}).get(el.tag, {}), **el.attrib}
        def visit(body: ET.Element, parent: int, cls: str) -> None:
            cls, i = body.get("childclass", cls), len(names)
            names.append(body.get("name"))
            parents.append(parent)
            pos.append(vec(body.get("pos"), (0, 0, 0)))
            quat.append(vec(body.get("quat"), (1, 0, 0, 0)))
            if parent >= 0:  # every body but the root: one hinge (radians)
                j = attrs(body.find("joint"), cls)
                dof_names.append(j["name"])
                axis.append(vec(j.get("axis"), (0, 0, 1)))
                limits.append(vec(j.get("range"), (-np.inf, np.inf)))
            for g in body.findall("geom"):
                a = attrs(g, cls)
                if a.get("contype", "1") == "0" and a.get("conaffinity", "1") == "0":
                    continue  # visual only
                ends = vec(a["fromto"], ()) if "fromto" in a else np.tile(vec(a.get("pos"), (0, 0, 0)), 2)  # sphere
                geoms.append((i, ends.reshape(2, 3), vec(a.get("size"), (0,))[0]))
            for child in body.findall("body"):
                visit(child, i, cls)

        for top in root.findall("default"):
            add_defaults(top, {})
        visit(root.find("worldbody").find("body"), -1, "main")
        f32 = dict(dtype=torch.float32, device=device)
        self.body_names, self.dof_names, self.parents = tuple(names), tuple(dof_names), tuple(parents)
        self.offset_pos = torch.tensor(np.stack(pos), **f32)                  # [B,3] in the parent frame
        self.offset_quat = quat_normalize(torch.tensor(np.stack(quat), **f32))  # [B,4]
        self.joint_axis = torch.tensor(np.stack(axis), **f32)                 # [29,3] hinge of body i+1
        self.dof_lower_rad, self.dof_upper_rad = torch.tensor(np.stack(limits).T, **f32)  # [29] each
        self.geom_body = torch.tensor([g[0] for g in geoms], dtype=torch.long, device=device)
        self.geom_ends = torch.tensor(np.stack([g[1] for g in geoms]), **f32)  # [G,2,3]
        self.geom_radius = torch.tensor([g[2] for g in geoms], **f32)
        self.default_root_pos = self.offset_pos[0].clone()  # the MJCF's standing pelvis position

    def local_rot(self, dof_pos: torch.Tensor) -> torch.Tensor:  # [...,29] -> [...,29,4]: body i+1 in its parent
        return quat_mul(self.offset_quat[1:], quat_from_axis_angle(self.joint_axis, dof_pos))

    def forward(self, root_pos: torch.Tensor, root_quat: torch.Tensor, dof_pos: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """root_pos [...,3], root_quat [...,4] wxyz, dof_pos [...,29] -> body_pos [...,B,3], body_quat [...,B,4]."""
        batch = torch.broadcast_shapes(root_pos.shape[:-1], root_quat.shape[:-1], dof_pos.shape[:-1])
        local = self.local_rot(dof_pos.expand(batch + (NUM_DOF,)))
        body_pos, body_quat = [root_pos.expand(batch + (3,))], [quat_normalize(root_quat).expand(batch + (4,))]
        for i, p in enumerate(self.parents[1:], 1):
            body_pos.append(body_pos[p] + quat_apply(body_quat[p], self.offset_pos[i]))
            body_quat.append(quat_mul(body_quat[p], local[..., i - 1, :]))
        return torch.stack(body_pos, dim=-2), torch.stack(body_quat, dim=-2)

    def lowest_point_z(self, body_pos: torch.Tensor, body_quat: torch.Tensor) -> torch.Tensor:
        """Height of the lowest point of all collision geoms (capsules, spheres): [...,B,3], [...,B,4] -> [...]."""
        ends = body_pos[..., self.geom_body, None, :] + quat_apply(body_quat[..., self.geom_body, None, :],
                                                                   self.geom_ends)
        return (ends[..., 2] - self.geom_radius[:, None]).amin(dim=(-1, -2))


# --- 4. SSJR command Y_t (the one place it is computed: env, evaluate, ONNX export): the command's keypoints over the
#    window t-7..t+4 in the heading frame of the ROBOT's root at t, so root drift is observable and corrected; the
#    price is that deployment needs a root pose estimate (odometry or mocap, yaw from the IMU) in the command's frame.
def keypoint_command(keypoints_w: torch.Tensor, root_pos_w: torch.Tensor, root_quat_w: torch.Tensor) -> torch.Tensor:
    """Y_t [...,H,J*3] (metres) from the command's world keypoints [...,H,J,3] (KEYPOINT_NAMES order, z up) and the
    robot's root pose at t (pelvis position [...,3], quaternion wxyz [...,4]; only its yaw is used)."""
    return root_relative(keypoints_w.flatten(-3, -2), root_pos_w, root_quat_w).reshape(keypoints_w.shape[:-2] + (-1,))


# --- 5. Loading: every loader turns one file into RobotMotion (G1) or HumanMotion clips (source frame rate, z-up, m).
class InputError(ValueError):
    """A user's mistake (bad file, flag or checkpoint): every script prints `error: <path or flag>: <problem>`."""
    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(f"{path}: {problem}")


@dataclass
class RobotMotion:
    name: str
    fps: float
    root_pos: np.ndarray   # [T,3] m, world z-up
    root_quat: np.ndarray  # [T,4] wxyz
    dof_pos: np.ndarray    # [T,29] rad, DOF_NAMES order
    source: str
    notes: list[str] = field(default_factory=list)


WRIST_DOF_IDS = tuple(i for i, n in enumerate(DOF_NAMES) if "wrist" in n)  # the 6 wrist joints a 23-DoF G1 lacks
DOF23_IDS = tuple(i for i in range(NUM_DOF) if i not in WRIST_DOF_IDS)
# The human joints a mocap source must provide to become SSJR keypoint commands.
HUMAN_JOINTS = ("pelvis", "left_hip", "right_hip", "left_knee", "right_knee", "left_ankle", "right_ankle",
                "left_shoulder", "right_shoulder", "left_elbow", "right_elbow", "left_wrist", "right_wrist")
SMPL_JOINT_IDS = (0, 1, 2, 4, 5, 7, 8, 16, 17, 18, 19, 20, 21)  # HUMAN_JOINTS in the SMPL/SMPL+H/SMPL-X body tree


@dataclass
class HumanMotion:
    name: str
    fps: float
    joints: np.ndarray  # [T,13,3] HUMAN_JOINTS positions, m, z-up
    source: str
    notes: list[str] = field(default_factory=list)


def detect_format(path: pathlib.Path) -> str:  # by content, not name: an .npz may hold AMASS or mjlab motion
    with open(path, "rb") as f:
        head = f.read(256)
    if not head:
        raise InputError(path, "empty file")
    if head.startswith(b"PK"):
        try:
            with np.load(path, allow_pickle=False) as npz:
                keys = set(npz.files)
        except Exception as e:
            raise InputError(path, f"corrupt npz ({type(e).__name__}: {e})") from None
        if keys & {"poses", "joint_pos"}:
            return "amass" if "poses" in keys else "mjlab"
        raise InputError(path, f"npz is neither AMASS (poses) nor BeyondMimic/mjlab (joint_pos): keys {sorted(keys)}")
    if head.lstrip().upper().startswith(b"HIERARCHY"):
        return "bvh"
    if all(c in b"0123456789.,-+eE \t\r\ninfaINFA" for c in head):
        return "g1csv"
    if head[:1] == b"\x80" or head[:2] in (b"\x78\x9c", b"\x78\x01", b"\x78\xda", b"\x1f\x8b", b"BZ") or \
            head[:4] in (b"\xfd7zX", b"\x04\x22\x4d\x18"):  # a pickle, raw or compressed by joblib
        return "phc"
    raise InputError(path, "unrecognized content (expected G1 CSV, mjlab/AMASS npz, PHC pkl or BVH)")


def _fps(path: pathlib.Path, value, flag_fps: float | None) -> float:
    fps = flag_fps if value is None else float(np.asarray(value).reshape(-1)[0])
    if fps is None:
        raise InputError(path, "frame rate unknown: the file carries none; pass --fps (G1 Moves 60, LAFAN1-G1 30)")
    if not np.isfinite(fps) or fps <= 0:
        raise InputError(path, f"invalid frame rate {fps}")
    return fps


def _robot_motion(path: pathlib.Path, name: str, fps: float, root_pos, root_quat_wxyz, dof, allow_23dof: bool
                  ) -> RobotMotion:  # the robot loaders' tail: float64; 23-DoF data mapped to 29 (wrists 0)
    dof, notes = np.asarray(dof, np.float64), []
    if dof.shape[1] not in (len(DOF23_IDS), NUM_DOF):
        raise InputError(path, f"expected {NUM_DOF} (or {len(DOF23_IDS)}) joint angles per frame, found {dof.shape[1]}")
    if dof.shape[1] == len(DOF23_IDS):
        if not allow_23dof:
            raise InputError(path, "23-DoF data where 29 are required; pass --allow-23dof to map it (wrists set to 0)")
        dof, dof23 = np.zeros((len(dof), NUM_DOF)), dof
        dof[:, DOF23_IDS] = dof23
        notes.append("23-DoF source: the 6 wrist joints are set to 0")
    return RobotMotion(name, fps, np.asarray(root_pos, np.float64), np.asarray(root_quat_wxyz, np.float64), dof,
                       str(path), notes)


def load_g1_csv(path: pathlib.Path, fps: float | None = None, allow_23dof: bool = False) -> list[RobotMotion]:
    """Retargeted G1 CSV (G1 Moves, Unitree LAFAN1-G1): no header, per row root xyz, root quat xyzw, 29 joints."""
    data = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)  # not numeric: load_motions' InputError
    if data.shape[1] not in (7 + NUM_DOF, 7 + len(DOF23_IDS)):
        raise InputError(path, f"wrong column count {data.shape[1]}: expected 36 (root xyz, quat xyzw, 29 joints) or "
                                f"30 (23 joints)")
    manifest_fps = None  # G1 Moves ships manifest.json (in a parent folder) with each clip's fps; else --fps
    manifest = next((d / "manifest.json" for d in list(path.parents)[:3] if (d / "manifest.json").exists()), None)
    with contextlib.suppress(AttributeError, KeyError, ValueError, TypeError):
        manifest_fps = float(json.loads(manifest.read_text())["clips"][path.stem]["fps"])
    fps = _fps(path, manifest_fps, fps)
    return [_robot_motion(path, path.stem, fps, data[:, :3], data[:, [6, 3, 4, 5]], data[:, 7:], allow_23dof)]


def load_mjlab_npz(path: pathlib.Path, fps: float | None = None, allow_23dof: bool = False) -> list[RobotMotion]:
    """BeyondMimic/mjlab npz: fps, joint_pos [T,29] (+ body_pos_w/body_quat_w for the root) or [T,36] (root first).
    Joints are in MuJoCo order unless joint_names says otherwise (an Isaac Lab export needs its joint_names)."""
    with np.load(path, allow_pickle=False) as npz:
        d = dict(npz)
    fps = _fps(path, d.get("fps"), fps)
    joint_pos = np.asarray(d["joint_pos"], dtype=np.float64)
    if joint_pos.shape[1] == 36:
        root_pos, root_quat, dof = joint_pos[:, :3], joint_pos[:, 3:7], joint_pos[:, 7:]
    else:
        if "body_pos_w" not in d or "body_quat_w" not in d:
            raise InputError(path, "no root pose: joint_pos has no root columns and body_pos_w/body_quat_w are missing")
        root = next((k for k, n in enumerate(d.get("body_names", [])) if str(n) == "pelvis"), 0)
        root_pos, root_quat, dof = d["body_pos_w"][:, root], d["body_quat_w"][:, root], joint_pos
    if "joint_names" in d and dof.shape[1] == NUM_DOF:  # without names, joints are taken to be in MuJoCo order
        names = [str(n) for n in d["joint_names"]]
        dof = dof[:, [names.index(n) for n in DOF_NAMES]]
    return [_robot_motion(path, path.stem, fps, root_pos, root_quat, dof, allow_23dof)]


def load_phc_pkl(path: pathlib.Path, fps: float | None = None, allow_23dof: bool = False) -> list[RobotMotion]:
    """PHC motion library pkl (joblib): {clip: {root_trans_offset [T,3], root_rot [T,4] xyzw, dof [T,23|29], fps}}."""
    import joblib
    try:
        lib = joblib.load(path)
    except Exception as e:
        raise InputError(path, f"corrupt pkl ({type(e).__name__}: {e})") from None
    if isinstance(lib, dict) and "dof" in lib:
        lib = {path.stem: lib}
    if not isinstance(lib, dict) or not lib or not all(isinstance(c, dict) for c in lib.values()):
        raise InputError(path, "not a PHC motion library (a dict of clips, each a dict with root_rot, dof, ...)")
    return [_robot_motion(path, "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(key)),
                          _fps(path, c.get("fps"), fps), c["root_trans_offset"],
                          np.asarray(c["root_rot"])[:, [3, 0, 1, 2]], np.asarray(c["dof"]).reshape(len(c["dof"]), -1),
                          allow_23dof) for key, c in lib.items()]


def load_smpl_model(path: pathlib.Path) -> dict[str, np.ndarray]:
    """The user's SMPL-family body model (.npz as shipped for AMASS, or a chumpy-free .pkl): rest joints + parents."""
    keys = ("v_template", "shapedirs", "J_regressor", "kintree_table")
    try:
        if path.suffix == ".pkl":
            import pickle
            with open(path, "rb") as f:
                model = pickle.load(f, encoding="latin1")
        else:
            with np.load(path, allow_pickle=False) as npz:
                model = dict(npz)
        model = {k: model[k] for k in keys}
    except Exception as e:  # a pickle that needs chumpy: ModuleNotFoundError
        raise InputError(path, f"cannot read the SMPL model ({type(e).__name__}: {e}); it needs {', '.join(keys)} "
                               f"(save a chumpy pickle as .npz)") from None
    if hasattr(model["J_regressor"], "toarray"):  # scipy-sparse in some pickles
        model["J_regressor"] = model["J_regressor"].toarray()
    return {**{k: np.asarray(model[k], np.float64) for k in ("v_template", "shapedirs", "J_regressor")},
            "parents": np.r_[-1, np.asarray(model["kintree_table"], np.int64)[0, 1:]]}  # the root's parent: -1


def smpl_joints(model: dict[str, np.ndarray], poses: np.ndarray, trans: np.ndarray, betas: np.ndarray) -> np.ndarray:
    """Joints [T,NJ,3]: rest joints J_regressor (v_template + shapedirs betas), FK of the axis-angle poses, + trans."""
    nb = min(model["shapedirs"].shape[-1], len(betas))
    rest = model["J_regressor"] @ (model["v_template"] + model["shapedirs"][..., :nb] @ betas[:nb])  # [NJ,3]
    nj = min(len(model["parents"]), poses.shape[1] // 3)
    rot = quat_from_rotvec(torch.tensor(poses[:, :3 * nj].reshape(len(poses), nj, 3), dtype=torch.float64))
    rest_t = torch.tensor(rest, dtype=torch.float64)
    glob_q, glob_p = [rot[:, 0]], [rest_t[0] + torch.tensor(trans, dtype=torch.float64)]
    for j, p in enumerate(model["parents"][1:nj], 1):
        glob_p.append(glob_p[p] + quat_apply(glob_q[p], rest_t[j] - rest_t[p]))
        glob_q.append(quat_mul(glob_q[p], rot[:, j]))
    return torch.stack(glob_p, dim=1).numpy()


def load_amass_npz(path: pathlib.Path, fps: float | None = None, smpl_model: pathlib.Path | None = None
                   ) -> list[HumanMotion]:
    """AMASS npz (poses [T,72|156|165], trans [T,3], betas, mocap_framerate|mocap_frame_rate, gender), z-up."""
    with np.load(path, allow_pickle=False) as npz:
        d = dict(npz)
    if smpl_model is None:
        raise InputError(path, "AMASS/SMPL poses need the SMPL body model, which is licensed and not shipped; "
                                "download it (smpl.is.tue.mpg.de) and pass --smpl-model /path/to/model.npz")
    fps = _fps(path, d.get("mocap_framerate", d.get("mocap_frame_rate")), fps)
    poses, trans = np.asarray(d["poses"], np.float64), np.asarray(d["trans"], np.float64)
    if poses.ndim != 2 or poses.shape[1] < 66 or trans.shape != (len(poses), 3):
        raise InputError(path, f"AMASS poses must be [T,>=66] with trans [T,3], got {poses.shape} and {trans.shape}")
    betas = np.asarray(d.get("betas", np.zeros(0)), np.float64).reshape(-1)
    joints = smpl_joints(load_smpl_model(smpl_model), poses, trans, betas)[:, SMPL_JOINT_IDS]
    return [HumanMotion(path.stem, fps, joints, str(path), [f"SMPL joints from {smpl_model.name} (clip gender "
                                                             f"{d.get('gender', 'unknown')})"])]


# BVH joint names per HUMAN_JOINTS, first match wins (CMU/cgspeed, Mixamo/LAFAN1, Poser). Mixamo's 'LeftShoulder' is
# the clavicle, so 'LeftArm' (its shoulder joint) is tried first.
BVH_NAMES = {
    "pelvis": ("Hips", "pelvis", "Root"), "left_hip": ("LeftHip", "LeftUpLeg", "lThigh"),
    "right_hip": ("RightHip", "RightUpLeg", "rThigh"), "left_knee": ("LeftKnee", "LeftLeg", "lShin"),
    "right_knee": ("RightKnee", "RightLeg", "rShin"), "left_ankle": ("LeftAnkle", "LeftFoot", "lFoot"),
    "right_ankle": ("RightAnkle", "RightFoot", "rFoot"), "left_shoulder": ("LeftArm", "LeftShoulder", "lShldr"),
    "right_shoulder": ("RightArm", "RightShoulder", "rShldr"), "left_elbow": ("LeftElbow", "LeftForeArm", "lForeArm"),
    "right_elbow": ("RightElbow", "RightForeArm", "rForeArm"), "left_wrist": ("LeftWrist", "LeftHand", "lHand"),
    "right_wrist": ("RightWrist", "RightHand", "rHand")}


def load_bvh(path: pathlib.Path, scale_m: float = 0.056444, up: str = "y") -> list[HumanMotion]:
    """BVH -> joint positions (FK of the hierarchy); scale_m: metres per file unit (CMU/cgspeed 0.056444), `up` -> z."""
    tokens = path.read_text(errors="replace").split()
    names, parents, offsets, channels, stack = [], [], [], [], []  # stack: the open joints, innermost last
    try:
        i = 1  # after HIERARCHY
        while tokens[i].upper() != "MOTION":
            tok = tokens[i]
            if tok in ("ROOT", "JOINT", "End"):  # NAME { OFFSET x y z [CHANNELS n c1 .. cn]
                names.append(tokens[i + 1] if tok != "End" else f"{names[stack[-1]]}_end")
                parents.append(stack[-1] if stack else -1)
                offsets.append([float(v) for v in tokens[i + 4:i + 7]])
                n = int(tokens[i + 8]) if tokens[i + 7] == "CHANNELS" else None  # an End Site has no CHANNELS
                channels.append(tokens[i + 9:i + 9 + n] if n is not None else [])
                i += 7 if n is None else 9 + n
                stack.append(len(names) - 1)
            elif tok == "}":
                stack.pop()
                i += 1
            else:
                raise ValueError(f"unexpected token {tok!r}")
        if stack or not names:
            raise ValueError("unbalanced braces" if stack else "no joints")
        n_frames, frame_time = int(tokens[i + 2]), float(tokens[i + 5])  # MOTION Frames: n Frame Time: dt
        values = np.array(tokens[i + 6:], dtype=np.float64)
    except (IndexError, ValueError) as e:
        raise InputError(path, f"broken BVH hierarchy ({type(e).__name__}: {e})") from None
    n_chan = sum(len(c) for c in channels)
    if n_frames <= 0 or values.size != n_frames * n_chan:
        raise InputError(path, f"BVH motion has {values.size} numbers, expected {n_frames} frames x {n_chan} channels")
    if not np.isfinite(frame_time) or frame_time <= 0:
        raise InputError(path, f"invalid frame rate (Frame Time {frame_time})")
    motion, axes = torch.tensor(values.reshape(n_frames, n_chan)), torch.eye(3, dtype=torch.float64)
    glob_p, glob_q, col = [], [], 0
    for offset, chans, p in zip(offsets, channels, parents):
        local_p = torch.tensor(offset, dtype=torch.float64).expand(n_frames, 3).clone()
        local_q = torch.tensor([1.0, 0, 0, 0], dtype=torch.float64).expand(n_frames, 4)
        for c in chans:  # rotations compose in the listed order (intrinsic), positions replace the offset
            axis = "XYZ".index(c[0].upper())
            if c.endswith("rotation"):
                local_q = quat_mul(local_q, quat_from_axis_angle(axes[axis], torch.deg2rad(motion[:, col])))
            else:
                local_p[:, axis] = motion[:, col]
            col += 1
        glob_p.append(local_p if p < 0 else glob_p[p] + quat_apply(glob_q[p], local_p))
        glob_q.append(local_q if p < 0 else quat_mul(glob_q[p], local_q))
    pos = torch.stack(glob_p, dim=1).numpy() * scale_m
    if up == "y":  # (x, y, z) y-up -> (x, -z, y) z-up: a proper rotation about x
        pos = np.stack((pos[..., 0], -pos[..., 2], pos[..., 1]), axis=-1)
    lower = {n.lower(): k for k, n in enumerate(names)}
    found = {joint: [lower[c.lower()] for c in tried if c.lower() in lower] for joint, tried in BVH_NAMES.items()}
    if missing := next((joint for joint, ks in found.items() if not ks), None):
        raise InputError(path, f"BVH has no joint for {missing} (tried {', '.join(BVH_NAMES[missing])})")
    return [HumanMotion(path.stem, 1.0 / frame_time, pos[:, [ks[0] for ks in found.values()]], str(path))]


def load_motions(path: pathlib.Path, fmt: str = "auto", fps: float | None = None, allow_23dof: bool = False,
                 smpl_model: pathlib.Path | None = None, bvh_scale_m: float = 0.056444, bvh_up: str = "y"
                 ) -> list[RobotMotion | HumanMotion]:
    path = pathlib.Path(path)
    if not path.is_file():
        raise InputError(path, "no such file")
    fmt = detect_format(path) if fmt == "auto" else fmt
    try:
        if fmt in ("g1csv", "mjlab", "phc"):
            return dict(g1csv=load_g1_csv, mjlab=load_mjlab_npz, phc=load_phc_pkl)[fmt](path, fps, allow_23dof)
        return load_amass_npz(path, fps, smpl_model) if fmt == "amass" else load_bvh(path, bvh_scale_m, bvh_up)
    except InputError:
        raise
    except (OSError, ValueError, KeyError, IndexError, TypeError, zipfile.BadZipFile, EOFError) as e:
        raise InputError(path, f"cannot read as {fmt} ({type(e).__name__}: {e})") from None


# --- 6. Cleaning (at the source rate), resampling to 30 fps, segmentation into 2-10 s clips.
def clean_quaternions(path: str, quat: np.ndarray, tol: float = 1e-2) -> np.ndarray:
    """Reject zero / clearly non-unit quaternions, renormalize the rest, flip signs so q_t . q_{t-1} >= 0."""
    norm = np.linalg.norm(quat, axis=-1)
    if (norm < 1e-6).any():
        raise InputError(path, f"zero root quaternion at frame {int(np.argmax(norm < 1e-6))}")
    if (np.abs(norm - 1) > tol).any():
        k = int(np.argmax(np.abs(norm - 1) > tol))
        raise InputError(path, f"non-unit root quaternion at frame {k} (|q| = {norm[k]:.4f}; expected 1)")
    quat = quat / norm[:, None]
    flips = np.cumsum(np.r_[0, (quat[1:] * quat[:-1]).sum(-1) < 0]) % 2 == 1
    return np.where(flips[:, None], -quat, quat)


def repair_glitches(dof: np.ndarray, fps: float, max_rad_s: float, max_window_s: float
                    ) -> tuple[np.ndarray, int, np.ndarray]:
    """IK flips: joint speed > max_rad_s between two frames. Each is repaired by widening a window around the jump until
    a straight line between its ends stays under max_rad_s / 2 and replacing the inside by that line; jumps needing a
    window over max_window_s stay and mark their frames bad (segment dropped). -> (dof, frames changed, bad mask)"""
    dof = dof.copy()
    fast = np.abs(np.diff(dof, axis=0)) * fps > max_rad_s  # [T-1,29]
    (changed, bad), last = np.zeros((2, len(dof)), bool), len(dof) - 1
    for j in np.nonzero(fast.any(axis=0))[0]:
        covered = -1
        for k in np.nonzero(fast[:, j])[0]:
            if k < covered:
                continue
            a, b = k, k + 1
            while True:
                gentle = abs(dof[b, j] - dof[a, j]) * fps / (b - a) <= 0.5 * max_rad_s
                if gentle and not (a > 0 and fast[a - 1, j]) and not (b < last and fast[b, j]):
                    dof[a:b + 1, j] = np.linspace(dof[a, j], dof[b, j], b - a + 1)
                    changed[a + 1:b] = True
                    break
                if (b - a) / fps > max_window_s or (a == 0 and b == last):
                    bad[a:b + 1] = True
                    break
                a, b = max(a - 1, 0), min(b + 1, last)
            covered = b
    return dof, int(changed.sum()), bad


def resample_times(n: int, fps_in: float, fps_out: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Output frame k (at k / fps_out, up to the last source frame) lies between source frames i0, i1 = i0 + 1 at w."""
    dt_out_s = 1.0 / fps_out
    n_out = int(np.floor((n - 1) / fps_in / dt_out_s + 1e-4)) + 1
    x = np.minimum(np.arange(n_out) * dt_out_s * fps_in, n - 1)
    i0 = np.floor(x + 1e-6).astype(np.int64)  # + 1e-6: an output time on a source frame reads that frame exactly
    return i0, np.minimum(i0 + 1, n - 1), np.clip(x - i0, 0.0, 1.0)


def resample(frames: dict, fps_in: float, fps_out: float, quat_keys: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Arrays [T,...] at fps_in -> the same at fps_out (in their own dtype): linear interpolation, slerp for the
    quaternions named in quat_keys. The one resampler: 30 fps packets here, 50 Hz control ticks in envs.MotionLib."""
    i0, i1, w = (torch.from_numpy(a) for a in resample_times(len(next(iter(frames.values()))), fps_in, fps_out))
    out = {}
    for k, x in frames.items():
        x = torch.as_tensor(x)
        wk = w.to(x.dtype).view(-1, *[1] * (x.dim() - 1))
        out[k] = quat_slerp(x[i0], x[i1], wk[..., 0]) if k in quat_keys else x[i0] + wk * (x[i1] - x[i0])
    return out


def segment_bounds(n: int, fps: float, min_s: float = 2.0, max_s: float = 10.0, where: str = "clip"
                   ) -> list[tuple[int, int]]:  # the fewest equal segments of <= max_s seconds (paper: clips of 2-10 s)
    if n < min_s * fps:
        raise InputError(where, f"too short: {n / fps:.2f} s after cleaning (< {min_s:g} s)")
    k = int(np.ceil(n / (max_s * fps) - 1e-9))
    edges = np.round(np.linspace(0, n, k + 1)).astype(int)
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


# --- 7. The SSJR packet: FK of the cleaned 30 fps motion, finite-difference velocities, sparse keypoints.
FPS = 30.0
PACKET_KEYS = ("fps", "body_names", "dof_names", "body_pos_w", "body_rotmat_w", "body_quat_w", "body_lin_vel_w",
               "body_ang_vel_w", "local_rot", "root_lin_vel_w", "root_ang_vel_w", "dof_pos", "dof_vel",
               "keypoint_names", "text", "source", "license")
HUMAN_KEYS = ("fps", "kind", "keypoint_names", "keypoints_w", "root_pos_w", "root_quat_w", "body_pos_w", "body_quat_w",
              "body_lin_vel_w", "body_ang_vel_w", "dof_pos", "dof_vel", "text", "source", "license")
STANCE_RAD = {"hip_pitch": -0.31, "knee": 0.67, "ankle_pitch": -0.36, "shoulder_pitch": 0.2, "elbow": 0.6,
              "left_shoulder_roll": 0.2, "right_shoulder_roll": -0.2}  # rad; a human motion gives no joint angles


def robot_packet(kin: G1Kinematics, root_pos: np.ndarray, root_quat: np.ndarray, dof_pos: np.ndarray) -> dict:
    """FK + velocities for a [T] motion (T >= 2) -> packet arrays (float32; metadata is added by the caller)."""
    f32, dt_s = dict(dtype=torch.float32), 1.0 / FPS
    rp, rq, q = torch.tensor(root_pos, **f32), torch.tensor(root_quat, **f32), torch.tensor(dof_pos, **f32)
    body_pos, body_quat = kin.forward(rp, rq, q)
    lin_vel = torch.gradient(body_pos, spacing=dt_s, dim=0)[0]
    # world angular velocity: central differences log(q_t+1 q_t-1^-1) / 2dt inside, one-sided at the two ends
    ends = quat_to_rotvec(quat_mul(body_quat[1:], quat_conj(body_quat[:-1]))) / dt_s
    inner = quat_to_rotvec(quat_mul(body_quat[2:], quat_conj(body_quat[:-2]))) / (2 * dt_s)
    ang_vel = torch.cat((ends[:1], inner, ends[-1:]), dim=0)
    packet = dict(body_pos_w=body_pos, body_rotmat_w=quat_to_rotmat(body_quat), body_quat_w=body_quat,
                  body_lin_vel_w=lin_vel, body_ang_vel_w=ang_vel, local_rot=kin.local_rot(q),
                  root_lin_vel_w=lin_vel[:, 0], root_ang_vel_w=ang_vel[:, 0], dof_pos=q,
                  dof_vel=torch.gradient(q, spacing=dt_s, dim=0)[0])
    return {k: v.numpy() for k, v in packet.items()}


def human_to_g1_keypoints(kin: G1Kinematics, joints: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale a human motion (HUMAN_JOINTS [T,13,3], z-up) to the G1: keep the human's pelvis and torso frames and
    limb directions, take the G1's own offsets and bone lengths (zero pose), scale the root path by the leg-length
    ratio, put the feet on the ground. -> keypoints_w [T,J,3] (KEYPOINT_NAMES), root pos [T,3], heading quat [T,4]."""
    h = {n: torch.tensor(joints[:, k], dtype=torch.float32) for k, n in enumerate(HUMAN_JOINTS)}
    zero_pos, zero_quat = kin.forward(kin.default_root_pos, torch.tensor([1.0, 0, 0, 0]), torch.zeros(NUM_DOF))
    g = {n: zero_pos[BODY_NAMES.index(n)] - zero_pos[0] for n in BODY_NAMES}  # G1 zero pose, pelvis frame = world
    unit = lambda v: v / v.norm(dim=-1, keepdim=True).clamp_min(1e-9)  # noqa: E731
    length = lambda a, b: (g[a] - g[b]).norm()  # noqa: E731
    up = unit(0.5 * (h["left_shoulder"] + h["right_shoulder"]) - h["pelvis"])
    def frame(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:  # columns: forward, left, up
        y = unit(left - right)
        x = unit(torch.linalg.cross(y, up, dim=-1))
        return torch.stack((x, y, torch.linalg.cross(x, y, dim=-1)), dim=-1)
    pelvis_rot, torso_rot = frame(h["left_hip"], h["right_hip"]), frame(h["left_shoulder"], h["right_shoulder"])
    leg_h = ((h["left_knee"] - h["left_hip"]).norm(dim=-1) + (h["left_ankle"] - h["left_knee"]).norm(dim=-1) +
             (h["right_knee"] - h["right_hip"]).norm(dim=-1) + (h["right_ankle"] - h["right_knee"]).norm(dim=-1))
    leg_g1 = 2 * (length("left_knee_link", "left_hip_roll_link") + length("left_ankle_roll_link", "left_knee_link"))
    pelvis = h["pelvis"] * (leg_g1 / leg_h.median())
    torso = pelvis + pelvis_rot @ g["torso_link"]
    kp = {"pelvis": pelvis}
    for side in ("left", "right"):
        def bone(start, link, parent_link, joint, parent_joint):  # the G1's bone along the human's
            return start + length(f"{side}_{link}", f"{side}_{parent_link}") * unit(
                h[f"{side}_{joint}"] - h[f"{side}_{parent_joint}"])
        hip = pelvis + pelvis_rot @ g[f"{side}_hip_roll_link"]
        shoulder = kp[f"{side}_shoulder_roll_link"] = torso + torso_rot @ (g[f"{side}_shoulder_roll_link"] -
                                                                           g["torso_link"])
        knee = kp[f"{side}_knee_link"] = bone(hip, "knee_link", "hip_roll_link", "knee", "hip")
        kp[f"{side}_ankle_roll_link"] = bone(knee, "ankle_roll_link", "knee_link", "ankle", "knee")
        elbow = kp[f"{side}_elbow_link"] = bone(shoulder, "elbow_link", "shoulder_roll_link", "elbow", "shoulder")
        kp[f"{side}_wrist_yaw_link"] = bone(elbow, "wrist_yaw_link", "elbow_link", "wrist", "elbow")
    keypoints = torch.stack([kp[n] for n in KEYPOINT_NAMES], dim=1)
    # Ground: the G1's standing ankle height above its soles, at the clip's typical lowest ankle (5th percentile).
    ankle_height = zero_pos[BODY_NAMES.index("left_ankle_roll_link"), 2] - kin.lowest_point_z(zero_pos, zero_quat)
    lowest_ankle = torch.minimum(kp["left_ankle_roll_link"][:, 2], kp["right_ankle_roll_link"][:, 2])
    keypoints[..., 2] += ankle_height - torch.quantile(lowest_ankle, 0.05)
    heading = z_quat(torch.atan2(pelvis_rot[:, 1, 0], pelvis_rot[:, 0, 0]))
    return keypoints.numpy(), keypoints[:, 0].numpy(), heading.numpy()


def stance_reference(kin: G1Kinematics, keypoints_w: np.ndarray, root_quat_w: np.ndarray) -> dict:
    """A keypoint command as a reference the env can start from and run: the stance at the command's root pose, its
    SSJR keypoint bodies moved to the command's points; only those count (the env scores and ends by keypoint error)."""
    stance = [next((v for k, v in STANCE_RAD.items() if name.endswith(k + "_joint")), 0.0) for name in DOF_NAMES]
    dof = np.broadcast_to(np.array(stance, np.float32), (len(keypoints_w), NUM_DOF)).copy()
    pos, quat = kin.forward(torch.as_tensor(keypoints_w[:, KEYPOINT_NAMES.index("pelvis")]),
                            torch.as_tensor(root_quat_w), torch.as_tensor(dof))
    pos = pos.numpy().copy()
    pos[:, list(KEYPOINT_BODY_IDS)] = keypoints_w
    return {"body_pos_w": pos, "body_quat_w": quat.numpy(), "body_lin_vel_w": np.gradient(pos, 1.0 / FPS, axis=0),
            "body_ang_vel_w": np.zeros_like(pos), "dof_pos": dof, "dof_vel": np.zeros_like(dof)}


def write_atomic(path: str | os.PathLike, writer) -> pathlib.Path:
    """writer(tmp_path) writes the file, which then replaces `path` in one step: readers never see half a file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")  # same suffix: writers that go by it still work
    try:
        writer(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def save_packet(path: str | os.PathLike, packet: dict) -> pathlib.Path:
    """Write a packet as an uncompressed .npz: numbers as float32, the rest (names, text, kind) as strings."""
    arrays = {k: np.asarray(v) for k, v in packet.items()}
    arrays = {k: v.astype(np.float32 if v.dtype.kind in "fiu" and k != "kind" else str) for k, v in arrays.items()}
    def write(tmp):
        with open(tmp, "wb") as f:  # a file handle keeps np.savez from appending a second '.npz'
            np.savez(f, **arrays)
    return write_atomic(path, write)


def packet_kind(path: str | os.PathLike) -> str:  # 'robot' or 'human_keypoints': the file's `kind` (absent: robot)
    try:
        with np.load(path) as z:
            kind = str(z["kind"]) if "kind" in z.files else "robot"
    except Exception as e:
        raise InputError(path, f"not a readable motion file ({type(e).__name__}: {e})") from None
    if kind not in ("robot", "human_keypoints"):
        raise InputError(path, f"unknown motion kind {kind!r}, expected 'robot' or 'human_keypoints'")
    return kind


def load_packet(path: str | os.PathLike) -> dict:
    """Read a packet: dict of np arrays (float32), with fps a float, text/source/license/kind str, names lists."""
    try:
        with np.load(path, allow_pickle=False) as d:
            raw = {k: d[k] for k in d.files}
    except Exception as e:
        raise InputError(path, f"cannot read packet ({type(e).__name__}: {e})") from None
    kind = str(raw.get("kind", "robot"))
    if missing := [k for k in (HUMAN_KEYS if kind == "human_keypoints" else PACKET_KEYS) if k not in raw]:
        raise InputError(path, f"not an SSJR packet: missing {missing} (re-convert it: python ssjr.py convert)")
    def plain(v: np.ndarray):  # scalars -> float / str, name arrays -> lists of str, the rest stays an array
        return (float(v) if v.dtype.kind == "f" else str(v)) if v.ndim == 0 else \
            v.tolist() if v.dtype.kind == "U" else v
    return {**{k: plain(v) for k, v in raw.items()}, "kind": kind}


# --- 8. The conversion pipeline: load -> clean -> resample -> segment -> FK -> checks -> packets, with a summary.
@dataclass
class Convert:
    """Convert motion files (or folders of them) into SSJR packets / human keypoint commands."""
    src: tyro.conf.Positional[tuple[pathlib.Path, ...]]
    """motion files or folders (searched recursively for .csv .npz .pkl .bvh)"""
    out: pathlib.Path = REPO / "data" / "packets"  # output folder (one .npz per 2-10 s segment, named <clip>_segNN.npz)
    format: Literal["auto", "g1csv", "mjlab", "phc", "amass", "bvh"] = "auto"  # loader; auto: by the file content
    fps: float | None = None  # frame rate of files that carry none (CSV; G1 Moves: read from its manifest.json)
    allow_23dof: bool = False  # map 23-DoF G1 data into the 29-DoF order with the 6 wrist joints at 0
    smpl_model: pathlib.Path | None = None  # SMPL-family body model (.npz/.pkl, licensed, not shipped) needed for AMASS
    bvh_scale_m: float = 0.056444  # metres per BVH unit (CMU/cgspeed 0.056444)
    bvh_up: Literal["y", "z"] = "y"  # up axis of the BVH files
    glitch_rad_s: float = 25.0  # joint speed above which a frame transition counts as an IK glitch
    glitch_window_s: float = 0.25  # longest window a glitch repair may rewrite; longer -> the segment is dropped
    limit_tol_rad: float = 0.05  # joint-limit excess clipped silently; beyond it the segment is dropped (paper)
    penetration_m: float = 0.02  # a frame penetrates the ground when its lowest collision point is this far below z = 0
    max_penetration_frac: float = 0.05  # drop a segment when a larger fraction of its frames penetrates (paper: 5%)
    min_s: float = 2.0  # shortest segment kept (paper: 2 s)
    max_s: float = 10.0  # longest segment (paper: 10 s); longer clips are split evenly
    text: str = ""  # optional text description stored in every packet
    license: str = ""  # license string stored in every packet; default: the SOURCE.txt found next to / above the file


@dataclass
class ClipReport:  # what convert did with one clip
    source: str
    clip: str
    kind: str = ""
    seconds: float = 0.0
    kept: int = 0
    kept_s: float = 0.0
    dropped: dict[str, int] = field(default_factory=dict)
    glitch_frames: int = 0
    clipped_frames: int = 0
    notes: list[str] = field(default_factory=list)
    error: str = ""  # the one-line InputError that stopped the clip

    def __str__(self) -> str:
        return self.error or "; ".join([f"{self.clip} ({self.kind}, {self.seconds:.1f} s): kept {self.kept} segments "
                                        f"({self.kept_s:.1f} s), dropped {self.dropped or 'none'}, IK-glitch frames "
                                        f"repaired {self.glitch_frames}, clipped {self.clipped_frames}"] + self.notes)


def _check_finite(where: str, **arrays: np.ndarray) -> None:
    for key, a in arrays.items():
        if len(a) == 0:
            raise InputError(where, "empty clip (no frames)")
        if not (ok := np.isfinite(a).reshape(len(a), -1).all(axis=1)).all():
            raise InputError(where, f"NaN/inf in {key} at frame {int(np.argmin(ok))}")


def _where(m: RobotMotion | HumanMotion) -> str:  # errors name a clip's file, plus its name if the file has several
    return m.source if m.name == pathlib.Path(m.source).stem else f"{m.source} [{m.name}]"


def write_segments(m: RobotMotion | HumanMotion, args: Convert, report: ClipReport, meta: dict, arrays: dict,
                   bounds: list[tuple[int, int]], reasons: list[str] | None = None) -> None:
    """One packet <clip>_segNN.npz per segment [a, b) of `arrays`; a segment with a reason to drop it is counted."""
    found = [d / "SOURCE.txt" for d in list(pathlib.Path(m.source).parents)[:3] if (d / "SOURCE.txt").exists()]
    meta = dict(fps=FPS, **meta, text=args.text, source=m.source, license=args.license or (
        " ".join(found[0].read_text().split()) if found else "unknown (not stated by the source)"))
    for s, (a, b) in enumerate(bounds):
        if reasons and reasons[s]:
            report.dropped[reasons[s]] = report.dropped.get(reasons[s], 0) + 1
            continue
        save_packet(args.out / f"{m.name}_seg{s:02d}.npz", {**meta, **{k: v[a:b] for k, v in arrays.items()}})
        report.kept += 1
        report.kept_s += (b - a) / FPS


def convert_robot(m: RobotMotion, kin: G1Kinematics, args: Convert, report: ClipReport) -> None:
    shapes = (m.root_pos.shape, m.root_quat.shape, m.dof_pos.shape)
    if shapes != ((len(m.dof_pos), 3), (len(m.dof_pos), 4), (len(m.dof_pos), NUM_DOF)):
        raise InputError(_where(m), f"root pos / root quat / dof shapes {shapes} do not match [T,3] [T,4] [T,29]")
    _check_finite(_where(m), root_pos=m.root_pos, root_quat=m.root_quat, dof_pos=m.dof_pos)
    quat = clean_quaternions(_where(m), m.root_quat)
    dof, report.glitch_frames, bad = repair_glitches(m.dof_pos, m.fps, args.glitch_rad_s, args.glitch_window_s)
    x = {k: v.numpy() for k, v in resample(dict(root_pos=m.root_pos, root_quat=quat, dof_pos=dof), m.fps, FPS,
                                            ("root_quat",)).items()}
    i0, i1, _ = resample_times(len(dof), m.fps, FPS)
    bad = bad[i0] | bad[i1]  # an output frame is bad when either of its source frames is
    bounds = segment_bounds(len(x["dof_pos"]), FPS, args.min_s, args.max_s, _where(m))
    lo, hi = kin.dof_lower_rad.numpy(), kin.dof_upper_rad.numpy()
    excess = np.maximum(lo - x["dof_pos"], x["dof_pos"] - hi).max(axis=1)
    beyond_limits = excess > args.limit_tol_rad
    report.clipped_frames = int(((excess > 1e-3) & ~beyond_limits).sum())  # below 1 mrad: the source's rounding
    packet = robot_packet(kin, x["root_pos"], x["root_quat"], np.clip(x["dof_pos"], lo, hi))
    lowest = kin.lowest_point_z(torch.from_numpy(packet["body_pos_w"]), torch.from_numpy(packet["body_quat_w"]))
    penetrating = (lowest < -args.penetration_m).numpy()
    reasons = ["unrepairable glitch" if bad[a:b].any() else "joint limits" if beyond_limits[a:b].any() else
               "ground penetration" if penetrating[a:b].mean() > args.max_penetration_frac else "" for a, b in bounds]
    write_segments(m, args, report, dict(kind="robot", body_names=BODY_NAMES, dof_names=DOF_NAMES,
                                         keypoint_names=KEYPOINT_NAMES), packet, bounds, reasons)


def convert_human(m: HumanMotion, kin: G1Kinematics, args: Convert, report: ClipReport) -> None:
    _check_finite(_where(m), joints=m.joints)
    joints = resample(dict(joints=m.joints), m.fps, FPS)["joints"].numpy()
    bounds = segment_bounds(len(joints), FPS, args.min_s, args.max_s, _where(m))
    keypoints, root_pos, root_quat = human_to_g1_keypoints(kin, joints)
    write_segments(m, args, report, dict(kind="human_keypoints", keypoint_names=KEYPOINT_NAMES),
                   dict(keypoints_w=keypoints, root_pos_w=root_pos, root_quat_w=root_quat,
                        **stance_reference(kin, keypoints, root_quat)), bounds)


def convert(args: Convert) -> list[ClipReport]:  # a line per clip; a bad file or clip is reported (stderr), skipped
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as e:
        raise InputError(args.out, f"output folder is not writable ({e.strerror or e})") from None
    kin, reports = G1Kinematics(), []
    written_from: dict[str, str] = {}  # output clip name -> its source: two sources must not share a name
    files = [f for s in args.src for f in ([s] if not s.is_dir() else sorted(  # folders: their motion files, sorted
        p for p in s.rglob("*") if p.suffix.lower() in (".csv", ".npz", ".pkl", ".bvh") and p.is_file()))]
    for path in files:
        try:
            motions = load_motions(path, args.format, args.fps, args.allow_23dof, args.smpl_model, args.bvh_scale_m,
                                   args.bvh_up)
        except InputError as e:
            print(e, file=sys.stderr)
            reports.append(ClipReport(str(path), path.stem, error=str(e)))
            continue
        for m in motions:
            robot = isinstance(m, RobotMotion)
            report = ClipReport(m.source, m.name, "robot" if robot else "human",
                                len(m.dof_pos if robot else m.joints) / m.fps, notes=m.notes)
            try:
                if written_from.setdefault(m.name, m.source) != m.source:
                    raise InputError(m.source, f"clip name '{m.name}' is also {written_from[m.name]}'s: its packets "
                                                f"would overwrite those (rename one file)")
                for stale in args.out.glob(f"{glob.escape(m.name)}_seg[0-9][0-9].npz"):  # from an earlier conversion
                    stale.unlink()
                (convert_robot if robot else convert_human)(m, kin, args, report)
            except InputError as e:
                report.error = str(e)
            reports.append(report)
            print(report, file=sys.stderr if report.error else sys.stdout)
    return reports


def train_test_split(packet_paths) -> tuple[list, list]:  # (train, test); test: TEST_CLIPS and their <clip>_segNN
    paths = list(packet_paths)
    test = [any(s == c or s.startswith(c + "_seg") for c in TEST_CLIPS) for s in (pathlib.Path(p).stem for p in paths)]
    return [p for p, t in zip(paths, test) if not t], [p for p, t in zip(paths, test) if t]


# --- 9. Looking at a motion: a strip of skeleton frames (.png) or an animation (.mp4 / .gif), z-up, equal axes.
def render_motion(body_pos: np.ndarray, out_path: str | os.PathLike, fps: float,
                  extra_points: np.ndarray | None = None, title: str = "") -> pathlib.Path:
    """Draw body_pos [T,B,3] (lines along the G1 tree when B = 30, along KEYPOINT_EDGES when B = J) with
    extra_points [T,J,3] as orange dots: .png = a strip of 8 frames, else an animation. The view follows point 0."""
    from matplotlib import animation, rcParams
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    out_path = pathlib.Path(out_path)
    if out_path.suffix.lower() not in (".png", ".mp4", ".gif"):
        raise InputError(out_path, "render to .png, .mp4 or .gif")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    pos = np.asarray(body_pos, dtype=np.float64)
    edges = {len(BODY_NAMES): [(p, i) for i, p in enumerate(BODY_PARENTS) if p >= 0],
             len(KEYPOINT_NAMES): KEYPOINT_EDGES}.get(pos.shape[1], ())
    every = pos if extra_points is None else np.concatenate((pos, extra_points), axis=1)
    half = max(0.5, np.abs(every[..., :2] - pos[:, :1, :2]).max() + 0.05, 0.5 * every[..., 2].max() + 0.05)
    def draw(ax, t: int) -> None:
        ax.cla()
        for a, b in edges:
            ax.plot(*pos[t, [a, b]].T, color="tab:blue", lw=2.5, solid_capstyle="round")
        ax.scatter(*pos[t].T, s=5, color="0.2", depthshade=False)
        if extra_points is not None:
            ax.scatter(*np.asarray(extra_points[t]).T, s=45, color="orange", edgecolors="k", linewidths=0.6,
                       depthshade=False)
        cx, cy = pos[t, 0, :2]  # the floor pane of the box is the ground, z = 0
        ax.set(xlim=(cx - half, cx + half), ylim=(cy - half, cy + half), zlim=(0, 2 * half), box_aspect=(1, 1, 1))
        ax.view_init(elev=10, azim=-60)
        ax.tick_params(labelsize=6, pad=-3)
        ax.set_title(f"t = {t / fps:.2f} s", fontsize=9, pad=-2)
    png = out_path.suffix.lower() == ".png"
    n = min(8, len(pos)) if png else 1
    cols, rows = min(n, 4), int(np.ceil(n / 4))
    fig = Figure(figsize=(3.3 * cols, 3.5 * rows + 0.6) if png else (5, 5.4))
    FigureCanvasAgg(fig)
    fig.suptitle(f"{title} (z up, m{'; orange: SSJR keypoints' if extra_points is not None else ''})", fontsize=9)
    fig.subplots_adjust(left=0, right=1, bottom=0.02, top=0.9, wspace=0.05, hspace=0.1)
    axes = [fig.add_subplot(rows, cols, k + 1, projection="3d") for k in range(n)]
    if png:
        for ax, t in zip(axes, np.linspace(0, len(pos) - 1, n).round().astype(int)):
            draw(ax, t)
        fig.savefig(out_path, dpi=110)
        return out_path
    if mp4 := out_path.suffix.lower() == ".mp4":
        import imageio_ffmpeg
        rcParams["animation.ffmpeg_path"] = imageio_ffmpeg.get_ffmpeg_exe()
    writer = animation.FFMpegWriter(fps=fps, bitrate=1800) if mp4 else animation.PillowWriter(fps=fps)
    animation.FuncAnimation(fig, lambda t: draw(axes[0], t), frames=len(pos)).save(out_path, writer=writer, dpi=100)
    return out_path


# --- 10. Command line: convert / show.
def show(packet: tyro.conf.Positional[pathlib.Path], out: pathlib.Path = pathlib.Path("clip.png"),
         start_s: float = 0.0, duration_s: float | None = None) -> str:
    """Draw a packet: a strip of frames (.png) or an animation (.mp4 / .gif).
    Args:
        packet: an SSJR packet or human keypoint command (.npz)
        out: output picture or animation
        start_s: first second drawn
        duration_s: seconds drawn (None: to the end)
    """
    p = load_packet(packet)
    first = int(round(start_s * p["fps"]))
    window = slice(first, None if duration_s is None else first + max(1, int(round(duration_s * p["fps"]))))
    body = p["body_pos_w"][window] if p["kind"] == "robot" else p["keypoints_w"][window]
    if len(body) == 0:
        raise InputError(packet, f"no frames after {start_s} s")
    keypoints = body[:, KEYPOINT_BODY_IDS] if p["kind"] == "robot" else body
    return f"wrote {render_motion(body, out, p['fps'], keypoints, title=packet.stem + ' (' + p['kind'] + ')')}"


if __name__ == "__main__":
    torch.set_num_threads(1)  # small tensors: threads only add overhead
    try:
        out = tyro.extras.subcommand_cli_from_dict({"convert": Convert, "show": show})
        if isinstance(out, Convert):
            start, reports = time.perf_counter(), convert(out)
            kept = sum(1 for r in reports if r.kept)
            dropped = dict(sum((collections.Counter(r.dropped) for r in reports), collections.Counter()))
            print(f"clips: {len(reports)} in, {kept} kept, {len(reports) - kept} dropped; segments: "
                  f"{sum(r.kept for r in reports)} kept, dropped {dropped or 'none'}; motion: "
                  f"{sum(r.seconds for r in reports) / 60:.1f} min in, {sum(r.kept_s for r in reports) / 60:.1f} min "
                  f"kept; took {time.perf_counter() - start:.1f} s")
            sys.exit(int(bool(reports) and not any(r.kept for r in reports)))
        print(out)
    except InputError as e:
        sys.exit(f"error: {e}")
