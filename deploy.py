"""The robot side of the student's deployment contract: the exported ONNX student run in MuJoCo from its metadata alone.

    python export.py --ckpt runs/<run>/student.pt --onnx student.onnx
    python deploy.py --onnx student.onnx --motion data/packets/g1_moves/M_ShortMove14_seg00.npz
    python evaluate.py --onnx student.onnx --motions <packets>                # scored like any other setting
    python evaluate.py --onnx student.onnx --motions <packet> --parity       # inputs vs the training env's

It imports numpy, mujoco and onnxruntime only (no torch, nothing of this project): copy it into robot code and replace
`Robot` (MuJoCo here) with the SDK's readings and motor commands. Every number and choice it uses comes from the ONNX
metadata (`contract`, written by export.py): joint order by name, the 50 Hz control step and the 200 Hz PD law,
the windows and what fills them before the first step, the frames and signs of the IMU readings, the command's
resampling. The scene is g1_scene.xml, the file the MuJoCo training env loads (same armature, friction, floor).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import mujoco
import numpy as np
import onnxruntime as ort

SCENE_XML = pathlib.Path(__file__).resolve().parent / "g1_scene.xml"


class Policy:
    """The ONNX student and its contract (the metadata)."""

    def __init__(self, path: str | pathlib.Path):
        try:
            self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as e:
            raise SystemExit(f"error: {path}: not a readable ONNX model ({type(e).__name__})")
        meta = {k: json.loads(v) for k, v in self.session.get_modelmeta().custom_metadata_map.items()}
        if meta.get("kind") != "hord_student" or "contract" not in meta:
            raise SystemExit(f"error: {path}: not a HoRD student export with a deployment contract "
                             "(re-export it with `python export.py`)")
        self.meta, self.contract = meta, meta["contract"]
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.kp, self.kd, self.effort_limit_nm = (np.asarray(meta[k]) for k in ("kp", "kd", "effort_limit_nm"))
        self.alpha_clamp_rad = meta.get("alpha_clamp_rad")  # the contract's clipping (None in older exports: none)
        self.keypoint_steps = np.asarray(self.contract["keypoint_steps"])
        self.proprio_len, self.history_len = self.contract["proprio_steps"], self.contract["history_len"]

    def __call__(self, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """alpha [29] as sent (clamped where the contract says so) and the command Y_t the graph computed."""
        feed = {k: inputs[k][None] for k in self.input_names}
        alpha, keypoints = self.session.run(["alpha", "student_keypoints"], feed)
        alpha = alpha[0].astype(np.float64)
        return (alpha if self.alpha_clamp_rad is None else np.clip(alpha, *self.alpha_clamp_rad)), keypoints[0]


class Command:
    """The keypoint command of a motion file (an SSJR packet, .npz) on the 50 Hz control ticks of the contract."""

    def __init__(self, path: str | pathlib.Path, policy: Policy):
        try:
            with np.load(path, allow_pickle=False) as z:
                packet = {k: z[k] for k in z.files}
        except Exception as e:
            raise SystemExit(f"error: {path}: not a readable motion packet ({type(e).__name__})")
        if str(packet.get("kind", "robot")) != "robot":
            raise SystemExit(f"error: {path}: a human keypoint command has no robot start state: deploy plays robot "
                             "motions (SSJR packets from `python ssjr.py convert`)")
        bodies, meta = list(packet["body_names"]), policy.meta
        order = [bodies.index(n) for n in meta["body_names"]]  # the contract's body order, by name
        fps, n, dt = float(packet["fps"]), len(packet["dof_pos"]), meta["control_dt_s"]
        # tick k at time k * control_dt_s, linear between the two nearest frames, up to the last frame (the contract)
        x = np.minimum(np.arange(int(np.floor((n - 1) / fps / dt + 1e-4)) + 1) * dt * fps, n - 1)
        i0 = np.floor(x + 1e-6).astype(int)
        i1, w = np.minimum(i0 + 1, n - 1), np.clip(x - i0, 0.0, 1.0)[:, None, None]
        pos = packet["body_pos_w"][:, order]
        self.body_pos_w = pos[i0] + w.astype(np.float32) * (pos[i1] - pos[i0])  # [ticks, bodies, 3], for scoring
        self.keypoints_w = self.body_pos_w[:, [meta["body_names"].index(n) for n in meta["keypoint_names"]]]
        self.num_ticks = len(self.body_pos_w)
        dofs = [list(packet["dof_names"]).index(n) for n in meta["dof_names"]]
        pelvis = bodies.index("pelvis")
        self.start = {k: packet[k][0, pelvis] for k in ("body_pos_w", "body_quat_w", "body_lin_vel_w",
                                                          "body_ang_vel_w")}
        self.start_q, self.start_qd = packet["dof_pos"][0][dofs], packet["dof_vel"][0][dofs]

    def window(self, t: int, steps: np.ndarray) -> np.ndarray:
        """Keypoints [len(steps), J, 3] at ticks t + steps, clamped to the clip (before 0: tick 0)."""
        return self.keypoints_w[np.clip(t + steps, 0, self.num_ticks - 1)]


class Robot:
    """The G1 in MuJoCo as a robot SDK shows it: encoders, the pelvis IMU, a root pose estimate, torque commands."""

    def __init__(self, policy: Policy, scene: str | pathlib.Path = SCENE_XML):
        self.model = mujoco.MjModel.from_xml_path(str(scene))
        self.data = mujoco.MjData(self.model)
        self.qpos_idx = np.array([self.model.joint(n).qposadr[0] for n in policy.meta["dof_names"]])
        self.qvel_idx = np.array([self.model.joint(n).dofadr[0] for n in policy.meta["dof_names"]])
        self.pelvis = self.model.body("pelvis").id  # the floating base: qpos[0:7], qvel[0:6]
        self.decimation = policy.contract["decimation"]
        assert abs(self.model.opt.timestep - policy.contract["physics_dt_s"]) < 1e-9

    def place(self, command: Command) -> None:
        """The motion's frame-0 state (free joint: world position, wxyz, world linear and local angular velocity)."""
        d, s = self.data, command.start
        mujoco.mj_resetData(self.model, d)
        d.qpos[:3], d.qpos[3:7] = s["body_pos_w"], s["body_quat_w"]
        d.qpos[self.qpos_idx], d.qvel[self.qvel_idx] = command.start_q, command.start_qd
        mujoco.mj_kinematics(self.model, d)
        d.qvel[:3], d.qvel[3:6] = s["body_lin_vel_w"], d.xmat[self.pelvis].reshape(3, 3).T @ s["body_ang_vel_w"]
        mujoco.mj_step1(self.model, d)

    def read(self, data: mujoco.MjData | None = None) -> dict[str, np.ndarray]:
        """The readings now (`data` current: after mj_step1 or mj_forward); on a robot the root pose is an estimate."""
        d = self.data if data is None else data
        return {"q": d.qpos[self.qpos_idx].copy(), "qd": d.qvel[self.qvel_idx].copy(),
                "gyro": d.sensor("imu_ang_vel").data.copy(),  # pelvis frame, rad/s
                "gravity": -d.sensor("imu_upvector").data,  # the unit gravity direction in the pelvis frame
                "root_pos_w": d.qpos[:3].copy(), "root_quat_w": d.qpos[3:7].copy()}

    def apply(self, alpha: np.ndarray, policy: Policy) -> None:
        """One control step: the PD law of the contract at every physics step (q, qd read at that step)."""
        d = self.data
        for _ in range(self.decimation):
            q, qd = d.qpos[self.qpos_idx], d.qvel[self.qvel_idx]
            d.qfrc_applied[self.qvel_idx] = np.clip(policy.kp * (alpha - q) - policy.kd * qd,
                                                    -policy.effort_limit_nm, policy.effort_limit_nm)
            mujoco.mj_step(self.model, d)
        mujoco.mj_step1(self.model, d)  # the readings of the new state


class Controller:
    """What the robot keeps between control steps: its past readings and PD targets, stacked as the contract says."""

    def __init__(self, policy: Policy, reading: dict[str, np.ndarray], start_q: np.ndarray):
        self.policy, self.t = policy, 0
        row = np.concatenate([self.state(reading), start_q])  # before the start: alpha_(-1) = the motion's frame 0
        self.proprio = np.tile(row, (policy.proprio_len, 1))  # rows t-7..t, oldest first
        self.history = np.zeros((policy.history_len, row.size))  # (s, alpha) of steps t-16..t-1, oldest first
        self.history_mask = np.zeros(policy.history_len, bool)

    @staticmethod
    def state(reading: dict[str, np.ndarray]) -> np.ndarray:
        """s: joint positions, joint velocities, gyro, gravity direction (64)."""
        return np.concatenate([reading["q"], reading["qd"], reading["gyro"], reading["gravity"]])

    def inputs(self, reading: dict[str, np.ndarray], command: Command) -> dict[str, np.ndarray]:
        """The ONNX inputs at control step t (float32)."""
        f = np.float32
        return {"student_proprio": self.proprio.astype(f),
                "keypoints_w": command.window(self.t, self.policy.keypoint_steps).astype(f),
                "root_pos_w": reading["root_pos_w"].astype(f), "root_quat_w": reading["root_quat_w"].astype(f),
                "terrain": np.full(self.policy.meta["terrain_points"], reading["root_pos_w"][2], f),  # flat floor
                "history": self.history.astype(f), "history_mask": self.history_mask.copy()}

    def advance(self, alpha: np.ndarray, reading_before: dict[str, np.ndarray], reading: dict[str, np.ndarray]):
        """After alpha was applied for a step: H_t gains (s_t, alpha_t); the proprio rows gain (s_t+1, alpha_t)."""
        self.history = np.roll(self.history, -1, 0)
        self.history[-1] = np.concatenate([self.state(reading_before), alpha])
        self.history_mask = np.roll(self.history_mask, -1)
        self.history_mask[-1] = True
        self.proprio = np.roll(self.proprio, -1, 0)
        self.proprio[-1] = np.concatenate([self.state(reading), alpha])
        self.t += 1


def run_episode(policy: Policy, command: Command, robot: Robot, root_drift_mps: float = 0.0,
                seed: int = 0) -> dict[str, np.ndarray]:
    """Play the command from its frame 0 to its end, or until the bodies' mean distance to the reference exceeds
    failure_m (the paper's 0.5 m). root_drift_mps: the root position estimate drifts at this speed in a random
    horizontal direction (a robot's state estimator is never exact). Returns the recorded body poses per step."""
    robot.place(command)
    reading = robot.read()
    controller = Controller(policy, reading, command.start_q)
    heading = np.random.default_rng(seed).uniform(0, 2 * np.pi)
    drift = root_drift_mps * np.array([np.cos(heading), np.sin(heading), 0.0])
    bodies = [robot.model.body(n).id for n in policy.meta["body_names"]]
    record = {"body_pos_w": [], "body_quat_w": [], "ref_body_pos_w": []}
    for t in range(command.num_ticks - 1):
        reading["root_pos_w"] = reading["root_pos_w"] + drift * t * policy.meta["control_dt_s"]
        alpha, _ = policy(controller.inputs(reading, command))
        robot.apply(alpha, policy)
        before, reading = reading, robot.read()
        controller.advance(alpha, before, reading)
        record["body_pos_w"].append(robot.data.xpos[bodies].copy())
        record["body_quat_w"].append(robot.data.xquat[bodies].copy())
        record["ref_body_pos_w"].append(command.body_pos_w[t + 1])
        error = np.linalg.norm(record["body_pos_w"][-1] - record["ref_body_pos_w"][-1], axis=-1).mean()
        if not np.isfinite(error) or error > policy.meta["failure_m"]:
            break
    return {k: np.stack(v) for k, v in record.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--onnx", required=True, help="the exported student (python export.py)")
    parser.add_argument("--motion", required=True, help="an SSJR robot-motion packet (.npz) to track")
    parser.add_argument("--scene", default=str(SCENE_XML), help="MuJoCo scene with the G1 on a flat floor at z = 0")
    parser.add_argument("--root-drift-mps", type=float, default=0.0, help="drift of the root position estimate")
    args = parser.parse_args(argv)
    policy = Policy(args.onnx)
    command = Command(args.motion, policy)
    episode = run_episode(policy, command, Robot(policy, args.scene), args.root_drift_mps)
    gte = np.linalg.norm(episode["body_pos_w"] - episode["ref_body_pos_w"], axis=-1).mean(-1)
    done = len(gte) == command.num_ticks - 1 and gte.max() < policy.meta["failure_m"]
    print(f"{pathlib.Path(args.motion).stem}: {len(gte)} of {command.num_ticks - 1} steps, "
          f"{'success' if done else 'failed'} (max GTE {gte.max():.2f} m, g-mpjpe {1000 * gte.mean():.0f} mm)")


if __name__ == "__main__":
    main(sys.argv[1:])
