"""The deployable student: its ONNX graph, and the contract a robot (or deploy.py in MuJoCo) feeds it by.

    python export.py --ckpt runs/<run>/student.pt --onnx student.onnx
    python deploy.py --onnx student.onnx --motion data/packets/g1_moves/M_ShortMove14_seg00.npz   # run it in MuJoCo

The graph takes the raw readings of DEPLOY_INPUTS (the SSJR command Y_t is computed inside it, by the function the env
trains with) and returns alpha, the absolute PD targets. Its metadata holds DEPLOY_INPUTS, DEPLOY_CONTRACT (every
choice a deployment must make: frames, units, joint order, windows, what fills them before the first step), the joint
gains and limits: deploy.py is written from the metadata alone.
"""
from __future__ import annotations

import json
import pathlib
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import tyro

import envs
import ssjr
import student
from ssjr import InputError


@dataclass
class Args:
    """python export.py --ckpt runs/<run>/student.pt --onnx student.onnx"""
    ckpt: str  # student checkpoint
    onnx: str = "student.onnx"  # output ONNX file
    opset: int = 17  # ONNX opset


# What a deployment feeds the ONNX graph, per input (also written into its metadata). Joint order: ssjr.DOF_NAMES;
# keypoint order: ssjr.KEYPOINT_NAMES; stacks oldest first; control at 50 Hz (one row per control step).
DEPLOY_INPUTS = {
    "student_proprio": "[N, 8, 93] steps t-7..t: joint pos (29, rad), joint vel (29, rad/s), IMU angular velocity in "
                       "the pelvis frame (3, rad/s), gravity direction in the pelvis frame (3, unit), the PD target "
                       "alpha sent in the step before (29, rad)",
    "keypoints_w": "[N, 12, J, 3] the command's keypoints at t-7..t+4 (m, world frame, z up), 30 fps SSJR packets "
                   "resampled to 50 Hz",
    "root_pos_w": "[N, 3] the robot's pelvis position at t (m), estimated in the command's world frame",
    "root_quat_w": "[N, 4] the robot's pelvis orientation at t (wxyz; only its yaw is used), same frame",
    "terrain": "[N, 121] pelvis height above the ground on an 11x11 grid, 0.1 m apart, around the pelvis in its "
               "heading frame (m; flat ground: the pelvis height everywhere)",
    "history": "[N, 16, 93] H_t: the last 16 (state, PD target) pairs, each the first 64 numbers of a student_proprio "
               "row and the alpha then chosen",
    "history_mask": "[N, 16] bool, True where the history entry exists (after the episode start)",
}


# How a deployment builds those inputs and applies alpha: every choice, stated with the env's own numbers ("contract").
DEPLOY_CONTRACT = {
    "physics_dt_s": envs.PHYSICS_DT_S, "decimation": envs.DECIMATION,
    "pd_law": "at every physics step: tau = clip(kp (alpha - q) - kd qdot, -effort_limit_nm, effort_limit_nm) with q, "
              "qdot read at that step (kp N m/rad, kd N m s/rad, effort_limit_nm N m: lists in dof_names order); alpha "
              "held for the decimation steps of the control step",
    "delay": f"trained with {envs.DR.delay_steps[0]}-{envs.DR.delay_steps[1]} physics steps "
             f"({1000 * envs.DR.delay_steps[1] * envs.PHYSICS_DT_S:.0f} ms at most) of delay before alpha "
             f"reaches the motors (alpha_(t-1) meanwhile) and kp, kd scaled by U{list(envs.DR.kp_scale)}: a robot's "
             f"own latency should fall in that range; deploy.py applies alpha at once",
    "clipping": "metadata alpha_clamp_rad null: none, training applied alpha as the policy outputs it, even beyond the "
                "joint ranges (the scene's joint limits stop the joints; clamping alpha costs tracking, evaluate.py's "
                ":clipped settings measure it); [lower, upper] (rad, dof_names order, the MJCF ranges): clamp alpha to "
                "them before the PD law, as training did (--clamp-targets), and record the clamped alpha. The torque "
                "is always clipped to effort_limit_nm",
    "training_engine": "env_cfg's sim (its contact and friction: envs.py's engine table); ground friction is the "
                       f"feet's (max of the pair), U{list(envs.DR.friction)} in training; MuJoCo contact time "
                       f"constant U{list(envs.DR.contact_timeconst_s)} s",
    "joints": "q, qdot: the hinge angles of g1_scene.xml's joints in dof_names order (its zero pose and axis signs)",
    "episode_start": "the robot at the motion's frame-0 state (root pose and velocities, joint positions and "
                     "velocities, all from the motion), control step t = 0 there; tick k of the command is the "
                     "motion at time k * control_dt_s; the episode ends after the step that reaches the last tick",
    "command_frame": "keypoints_w and the root pose share one world frame (z up, floor at z = 0): the training env "
                     "shifts the clip horizontally so that its frame-0 pelvis is where the robot starts (on uneven "
                     "ground each tick is raised by the ground height under that tick's reference pelvis)",
    "keypoints": "keypoint j = the world position of the origin of the MJCF body keypoint_names[j]",
    "proprio_steps": envs.TrackingEnv.STUDENT_PAST,
    "proprio_rows": "row t = [s_t, alpha_(t-1)], s = joint pos (29), joint vel (29), gyro (3), gravity direction (3); "
                    "before step 0 every row is row 0, with alpha_(-1) = the motion's frame-0 joint positions; alpha = "
                    "the target actually sent (after any safety clipping)",
    "gravity_direction": "R_pelvis^T (0, 0, -1), unit: (0, 0, -1) when upright (minus the world z axis in the pelvis "
                         "frame, g1_scene.xml sensor imu_upvector); gyro: sensor imu_ang_vel, pelvis frame",
    "history_len": envs.TrackingEnv.HISTORY_LEN,
    "history": "entry K-1 = (s_(t-1), alpha_(t-1)), oldest first: step t is not in it; entries before the start are "
               "0 with history_mask False (at step t the last min(t, K) entries are True)",
    "keypoint_steps": list(range(1 - envs.TrackingEnv.STUDENT_PAST, envs.TrackingEnv.STUDENT_FUTURE + 1)),
    "keypoint_resampling": "n frames at fps -> ticks k = 0 .. floor((n - 1) / (fps control_dt_s) + 1e-4): x = k "
                           "control_dt_s fps, linear between frames floor(x) and floor(x) + 1; window ticks before 0 "
                           "read tick 0, past the end the last tick",
    "terrain_grid": "index 11 i + j: the point (-0.5 + 0.1 i, -0.5 + 0.1 j) m in the pelvis heading frame (x forward, "
                    "y left); value: pelvis z minus the ground z there",
    "root_pose": "the origin of the MJCF body pelvis (the floating base, not the IMU site) and its Hamilton wxyz "
                 "quaternion rotating pelvis-frame vectors into the command frame (MuJoCo qpos[0:7]); on a robot an "
                 "estimate",
    "noise": "none added at deployment (training noise models the robot's sensors)",
    "scene": "g1_scene.xml (MuJoCo: the G1 with the joint armature, damping and friction the training envs use)",
}


class OnnxPolicy(nn.Module):
    """The student with positional inputs (DEPLOY_INPUTS order); returns alpha and the command Y_t it computed."""

    def __init__(self, policy: student.StudentPolicy):
        super().__init__()
        self.policy = policy

    def forward(self, student_proprio, keypoints_w, root_pos_w, root_quat_w, terrain, history, history_mask):
        y = ssjr.keypoint_command(keypoints_w, root_pos_w, root_quat_w)
        return self.policy({"student_proprio": student_proprio, "student_keypoints": y, "terrain": terrain,
                            "history": history, "history_mask": history_mask}), y


def export(args: Args) -> pathlib.Path:
    """Write the ONNX policy (DEPLOY_INPUTS, dynamic batch axis -> alpha [N, 29] rad, student_keypoints) with the
    contract and the controller facts in its metadata. The TorchScript exporter (dynamo=False: the dynamo exporter
    needs onnxscript), with the fused transformer fast path off, which it cannot export."""
    import onnx
    policy, ckpt = student.load_policy(args.ckpt, "cpu")
    layout = ckpt["obs_layout"]
    steps, j3 = layout["student_keypoints"]
    shapes = {"student_proprio": layout["student_proprio"], "keypoints_w": [steps, j3 // 3, 3], "root_pos_w": [3],
              "root_quat_w": [4], "terrain": layout["terrain"], "history": layout["history"],
              "history_mask": layout["history_mask"]}
    inputs = tuple(torch.zeros(2, *v, dtype=torch.bool if k == "history_mask" else torch.float32)
                   for k, v in shapes.items())
    kp, kd, limit = envs.joint_table()
    clamp = envs.joint_range_rad().tolist() if ckpt["env_cfg"].get("clamp_targets") else None
    names = []

    def write(tmp: pathlib.Path):
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TracerWarning / constant-folding notes; parity is tested
                outputs = ["alpha", "student_keypoints"]
                torch.onnx.export(OnnxPolicy(policy).eval(), inputs, str(tmp), dynamo=False, opset_version=args.opset,
                                  input_names=list(DEPLOY_INPUTS), output_names=outputs,
                                  dynamic_axes={k: {0: "batch"} for k in (*DEPLOY_INPUTS, *outputs)})
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)
        model = onnx.load(str(tmp))
        names.extend(i.name for i in model.graph.input)  # the history inputs are pruned from an --hcdr none student
        meta = {"kind": "hord_student", "inputs": {k: DEPLOY_INPUTS[k] for k in names},
                "output": "alpha: absolute PD targets [N, 29] rad; tau = kp (alpha - q) - kd qdot at 200 Hz, clamped "
                          "to effort_limit_nm; student_keypoints: the SSJR command Y_t the policy read",
                "contract": DEPLOY_CONTRACT, "dof_names": list(ssjr.DOF_NAMES), "body_names": list(ssjr.BODY_NAMES),
                "keypoint_names": list(ssjr.KEYPOINT_NAMES),
                "control_dt_s": envs.CONTROL_DT_S, "kp": kp.tolist(), "kd": kd.tolist(),
                "terrain_points": len(envs.SCAN_XY_M), "failure_m": envs.TERMINATION_ERR_M,
                "effort_limit_nm": limit.tolist(), "alpha_clamp_rad": clamp, "env_cfg": ckpt["env_cfg"],
                "global_step": ckpt["global_step"], "source_ckpt": str(args.ckpt)}
        for k, v in meta.items():
            model.metadata_props.add(key=k, value=json.dumps(v))
        onnx.save(model, str(tmp))

    out = ssjr.write_atomic(args.onnx, write)
    print(f"wrote {out} (inputs {names}, outputs alpha [N, 29], student_keypoints)")
    return out


if __name__ == "__main__":
    try:
        export(tyro.cli(Args))
    except InputError as e:
        sys.exit(f"error: {e}")
