"""Stage II of HoRD: online DAgger distillation of the teacher into the deployable student, in one file (CleanRL style).

    python student.py --teacher-ckpt runs/<teacher>/teacher.pt          # the paper's configuration (GPU)
    torchrun --standalone --nproc_per_node 2 student.py --preset cpu --teacher-ckpt t.pt   # 2 CPU cores: 2 ranks
    python student.py --preset cpu --resume runs/<run>/student.pt      # continue (only --total-env-steps may change)
    python student.py export --ckpt runs/<run>/student.pt --onnx student.onnx
    python evaluate.py --ckpt runs/<run>/student.pt --motions data/keypoints/cmu_bvh --settings genesis   # play

Student. alpha_2 = f2(m_t, s_sparse, g_t, Y_sparse) sees only what the robot has: s_sparse = `student_proprio` (joint
positions and velocities, IMU angular velocity and projected gravity, last PD target; steps t-7..t), the terrain context
g_t, the SSJR sparse keypoint command Y_sparse = `student_keypoints` (root-relative keypoints at t-7..t+4: 8 past + 4
future steps; ssjr.keypoint_command) and m_t, the HCDR token over the (s, alpha) history H_t. The backbone is the
teacher's (teacher.TokenPolicy, the teacher's sizes unless overridden). The student cannot see the reference joint
positions the teacher's residual action is centred on, so it outputs the absolute PD target alpha.

Online DAgger. Each iteration the student drives `num_envs` x `num_steps` control steps, its PD targets perturbed by
Gaussian noise (`action_std`, as rsl_rl samples its student; with probability beta per env and step the executed action
is the teacher's instead; beta = beta_0 * beta_decay^(iteration-1), default 0 as in the authors' earlier code), the
frozen teacher labels every visited state with alpha_1 = teacher.act(obs) from the privileged observations the env
returns alongside, and the student regresses onto the labels: loss = MSE(alpha_2, alpha_1). DAgger aggregates its data
set: the regression draws its minibatches from the samples of the last `buffer_iterations` rollouts (1: the newest
only), `update_epochs` x one rollout's worth of samples per iteration, with the learning rate decayed linearly to 0 over
the budget (the last weights average many small steps).

Choices where the paper is silent:
- Nominal pose: TokenPolicy zero-initializes its head, so the student adds a fixed bias alpha_0 = the mean reference
  joint position of its training motions (a buffer: in checkpoints and the ONNX graph). An untrained student then
  holds the clips' average (standing) pose instead of all joints at 0 rad: the first labels come from upright states.
- HCDR (paper: one shared module, the student "uses the same m_t"): the student starts from the teacher's HCDR and
  history normalizer and trains them on with the DAgger loss (it outlived a frozen one in all four test settings,
  docs/experiments.md); --hcdr teacher keeps it frozen, scratch: its own (ablation), none: no HCDR.
- Observation noise: the env's, part of its DR (envs.DR); the student and its teacher read the same noisy readings,
  the teacher also its clean privileged ones.
- The env: the teacher checkpoint's (its engine and motions unless --sim / --motions say otherwise); the observations
  the teacher's actor reads must have the layout it was trained on.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import sys
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import tyro

import envs
import ssjr
import teacher
from ssjr import InputError
from teacher import (all_reduce_grads, broadcast_from_rank0, build_env, check_layout, dist, load_checkpoint, restore,
                     run_session, start_run)


@dataclass
class Args(teacher.RunArgs):
    """Online DAgger distillation of a teacher.py checkpoint into the deployable student."""
    exp_name: str = "student"
    num_envs: int = 256
    total_env_steps: int = 100_000_000
    minibatch_size: int = 2048
    update_epochs: int = 6
    max_grad_norm: float = 1.0
    buffer_iterations: int = 1
    """DAgger's data set: the (student inputs, teacher label) samples of the last this many rollouts (not checkpointed:
    a resumed run refills it)"""
    teacher_ckpt: str = ""
    """the frozen teacher (teacher.py checkpoint); it also fixes the env configuration"""
    sim: str = ""
    """engine to distil on: isaaclab | genesis | mujoco ('' = the teacher's)"""
    motions: str = ""
    """SSJR packet folder or file ('' = the teacher's motions)"""
    hcdr: Literal["finetune", "teacher", "scratch", "none"] = "finetune"
    """m_t of the student: the teacher's HCDR trained on with the DAgger loss | the teacher's, frozen | its own from
    scratch (ablation) | none (the 'w/o HCDR' ablation)"""
    lr: float = 2e-5
    """Adam learning rate at the start, decayed linearly to 0 at total_env_steps"""
    beta: float = 0.0
    """beta_0: probability that the executed action is the teacher's (0: the student drives from the start)"""
    beta_decay: float = 1.0
    """beta of iteration i = beta_0 * beta_decay^(i-1)"""
    action_std: float = 0.1
    """std (rad) of Gaussian noise on the student's executed PD targets in the rollouts (rsl_rl samples its student
    with std 0.1): the student visits states off its own path and the teacher labels them (0: deterministic)"""
    d_model: int | None = None
    """transformer width (None: the teacher's, as all sizes below: the paper's student has the teacher's backbone)"""
    num_layers: int | None = None
    """transformer encoder layers"""
    num_heads: int | None = None
    """attention heads"""
    ff_dim: int | None = None
    """transformer feed-forward width"""
    head_dim: int | None = None
    """action head MLP width (3 layers)"""
    terrain_dim: int | None = None
    """terrain encoder MLP width (2 layers)"""
    hcdr_queries: int | None = None
    """HCDR learnable query tokens N"""
    hcdr_dim: int | None = None
    """HCDR token size d_m"""
    hcdr_layers: int | None = None
    """HCDR Q-Former layers"""


PRESETS = {
    "paper": Args(),
    # the teacher preset's envs and performance mode (about its env-steps/s); 8 rollouts of samples to regress on
    "cpu": Args(preset="cpu", device="cpu", num_envs=64, performance_mode=True, total_env_steps=900_000, num_steps=24,
                buffer_iterations=8, update_epochs=2, minibatch_size=512, lr=1e-3, checkpoint_every=20,
                torch_threads=1),
}
MODEL_SIZES = ("d_model", "num_layers", "num_heads", "ff_dim", "head_dim", "terrain_dim", "hcdr_queries", "hcdr_dim",
               "hcdr_layers")  # None in Args: the teacher checkpoint's value
# The student's inputs (env observation keys).
STUDENT_OBS = ("student_proprio", "student_keypoints", "terrain", "history", "history_mask")
# What the teacher's actor reads to label a state (its critic's observation plays no part in distillation).
TEACHER_ACTOR_OBS = ("proprio", "future", "ref_dof_pos", "terrain", "history", "history_mask")


class StudentPolicy(nn.Module):
    """alpha_2 = alpha_0 + TokenPolicy(student_proprio, student_keypoints, g_t, m_t): absolute PD targets [N, 29]."""

    def __init__(self, layout: dict, args: Args):
        super().__init__()
        self.actor = teacher.TokenPolicy(layout, ("student_proprio", "student_keypoints"), args,
                                         hcdr=args.hcdr != "none")
        self.register_buffer("alpha_0", torch.zeros(ssjr.NUM_DOF))  # nominal pose (see the module docstring)

    def forward(self, obs: dict) -> torch.Tensor:
        return self.alpha_0 + self.actor(obs)

    @torch.no_grad()
    def act(self, obs: dict) -> torch.Tensor:
        """Deterministic PD targets (evaluation, deployment)."""
        return self(obs)


def share_teacher_hcdr(policy: StudentPolicy, teacher_agent, path):
    """The student's HCDR (and its history normalizer) := the teacher's (freeze_hcdr keeps them so)."""
    src, dst = teacher_agent.actor, policy.actor
    if src.hcdr is None:
        raise InputError(path, "the teacher has no HCDR to share: use the student's --hcdr scratch or none")
    try:
        dst.hcdr.load_state_dict(src.hcdr.state_dict())
    except RuntimeError:  # missing/unexpected keys or other shapes
        raise InputError(path, "the teacher's HCDR has other sizes than the student's: leave --hcdr-* and --d-model "
                               "at their defaults (the teacher's)") from None
    dst.history_norm.load_state_dict(src.history_norm.state_dict())


def freeze_hcdr(policy: StudentPolicy):
    """A frozen HCDR keeps its weights and its history normalizer (TokenPolicy.update_norms skips it)."""
    policy.actor.hcdr.requires_grad_(False)
    policy.actor.history_frozen = True


def dagger_update(policy: StudentPolicy, optimizer, b_obs: dict, b_labels: torch.Tensor, per_epoch: int,
                  args: Args, amp=contextlib.nullcontext, world: int = 1) -> list[float]:
    """update_epochs passes of minibatch MSE(alpha_2, alpha_1), each over `per_epoch` samples drawn without replacement
    from the data set (b_obs, b_labels); returns the mean loss of each pass (read from the device once, at the end)."""
    policy.train()
    epoch_losses = []
    for _ in range(args.update_epochs):
        perm = torch.randperm(len(b_labels), device=b_labels.device)[:per_epoch]
        losses = []
        for start in range(0, per_epoch, args.minibatch_size):
            mb = perm[start:start + args.minibatch_size]
            with amp():
                loss = (policy({k: v[mb] for k, v in b_obs.items()}) - b_labels[mb]).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            all_reduce_grads(policy.parameters(), world)
            nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            optimizer.step()
            losses.append(loss.detach())
        epoch_losses.append(torch.stack(losses).mean())
    policy.eval()
    epoch_losses = torch.stack(epoch_losses)
    if world > 1:  # the mean over the ranks
        dist.all_reduce(epoch_losses)
    return (epoch_losses / world).tolist()


# --- checkpoints ----------------------------------------------------------------------------------------------------
def load_teacher(path, device):
    """The frozen teacher (teacher.load_policy names a missing file or a non-teacher checkpoint)."""
    if not path:
        raise InputError("--teacher-ckpt", "give the teacher to distil: --teacher-ckpt <teacher.pt>")
    agent, ckpt = teacher.load_policy(path, device)
    for p in agent.parameters():
        p.requires_grad_(False)
    return agent, ckpt


def student_env_cfg(args: Args, teacher_ckpt: dict) -> dict:
    """The teacher's make_env settings; only the engine and the motions may differ."""
    cfg = dict(teacher_ckpt["env_cfg"])
    cfg.update({k: v for k, v in (("sim", args.sim), ("motions", args.motions)) if v})
    return cfg


def load_policy(path, device="cpu"):
    """(student policy in eval mode with act(obs) -> alpha [N, 29], checkpoint dict) for evaluation and export."""
    ckpt = load_checkpoint(path, "student")
    policy = StudentPolicy(ckpt["obs_layout"], teacher.checkpoint_args(path, ckpt, Args)).to(device)
    teacher.load_weights(path, policy, ckpt["model"])
    return policy.eval(), ckpt


def train(args: Args, env=None) -> pathlib.Path:
    """Online DAgger. `env`: an env already built from the teacher's env_cfg (tests share one); None builds it."""
    args, resume, device, rank, world = start_run(args, "student")
    if args.buffer_iterations < 1:
        raise InputError("--buffer-iterations", f"must be at least 1 (the newest rollout): {args.buffer_iterations}")
    teacher_agent, tckpt = load_teacher(args.teacher_ckpt, device)
    args = dataclasses.replace(args, **{k: tckpt["args"][k] for k in MODEL_SIZES if getattr(args, k) is None})
    if resume is not None and resume["teacher"]["global_step"] != tckpt["global_step"]:
        raise InputError(args.resume, f"distilled from {args.teacher_ckpt} at teacher step "
                                      f"{resume['teacher']['global_step']:,}, but that file now holds step "
                                      f"{tckpt['global_step']:,} (the teacher run went on): start a new student")
    env_cfg = student_env_cfg(args, tckpt)
    own_env = env is None
    if own_env:
        env = build_env(env_cfg, args.num_envs, device, args.seed + rank, terrain_seed=args.seed,  # one terrain
                        performance_mode=args.performance_mode)  # make_env applies it to Genesis only
    if resume is not None and resume["rng"] is not None:  # this rank's env stream, before the first reset
        env.gen.set_state(resume["rng"]["env"]["gen"])
    obs = env.reset()
    layout = env.obs_layout
    check_layout(args.teacher_ckpt, tckpt["obs_layout"], layout, TEACHER_ACTOR_OBS)
    policy = StudentPolicy(layout, args).to(device)
    if args.hcdr == "teacher":  # before the optimizer: it gets the trained parameters only
        freeze_hcdr(policy)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=args.lr, eps=1e-5)
    global_step, iteration = 0, 0
    if resume is not None:
        check_layout(args.resume, resume["obs_layout"], layout, STUDENT_OBS)
        global_step, iteration = restore(resume, args.resume, policy, {"optimizer": optimizer}, device, rank)
    else:
        policy.alpha_0.copy_(env.motions.mean_dof_pos)
        if args.hcdr in ("teacher", "finetune"):
            share_teacher_hcdr(policy, teacher_agent, args.teacher_ckpt)
        policy.actor.update_norms(obs)
    broadcast_from_rank0(policy, world)
    policy.eval()
    state = lambda: {"args": dataclasses.asdict(args), "env_cfg": env_cfg, "obs_layout": layout,
                     "model": policy.state_dict(), "optimizer": optimizer.state_dict(),
                     "teacher": {"path": str(args.teacher_ckpt), "global_step": tckpt["global_step"]}}
    curves = {"charts/action_mse": "action MSE to the teacher (rad^2)", "charts/gt_err_mm": "g-mpjpe (mm)",
              "charts/success_rate": "success rate (episodes reaching the clip end)"}
    amp = lambda: torch.autocast(device.type, torch.bfloat16, enabled=args.amp)

    # ALGO LOGIC: storage (DAgger's data set: student inputs and teacher labels of the last buffer_iterations rollouts)
    n, T = args.num_envs, args.num_steps
    capacity = args.buffer_iterations * T * n
    data_obs = {k: torch.zeros((capacity, *layout[k]), dtype=obs[k].dtype, device=device) for k in STUDENT_OBS}
    data_labels = torch.zeros(capacity, ssjr.NUM_DOF, device=device)
    ep_len = torch.zeros(n, device=device)
    per_iteration = n * T * world  # env-steps of one iteration, all ranks together
    collected = 0  # rollouts in the data set since this process started (a resumed run refills it)

    with run_session(args, "student", state, policy, env, device, rank, world, global_step, iteration, curves,
                     "distillation_curve.png") as (stopping, end_iteration), \
            contextlib.closing(env) if own_env else contextlib.nullcontext():
        while global_step + per_iteration <= args.total_env_steps and not stopping():
            iteration += 1
            beta = args.beta * args.beta_decay ** (iteration - 1)
            for group in optimizer.param_groups:
                group["lr"] = args.lr * (1.0 - global_step / args.total_env_steps)
            oldest = collected % args.buffer_iterations * T * n  # this rollout replaces the oldest one
            # per-iteration sums on the device (read once per iteration): action mse, g-mpjpe, teacher-driven steps
            step_sums = torch.zeros(3, device=device)
            episode_sums = torch.zeros(3, device=device)  # episodes, length, successes
            for step in range(T):
                with torch.no_grad(), amp():
                    alpha_2 = policy(obs)
                    alpha_1 = teacher_agent.act(obs)  # DAgger label of the visited state (privileged observations)
                rows = slice(oldest + step * n, oldest + (step + 1) * n)
                for k in STUDENT_OBS:
                    data_obs[k][rows] = obs[k]
                data_labels[rows] = alpha_1
                use_teacher = torch.rand(n, device=device) < beta
                explored = alpha_2 + args.action_std * torch.randn_like(alpha_2) if args.action_std else alpha_2
                obs, _, done, info = env.step(torch.where(use_teacher[:, None], alpha_1, explored))
                ep_len += 1
                ended = done.float()
                step_sums += torch.stack([(alpha_2 - alpha_1).pow(2).mean(), info["metrics"]["gt_err_m"].nanmean(),
                                          use_teacher.float().mean()])
                episode_sums += torch.stack([ended.sum(), (ep_len * ended).sum(),
                                             (info["time_out"].float() * ended).sum()])
                ep_len *= 1.0 - ended
            global_step += per_iteration
            collected += 1

            # ALGO LOGIC: regress alpha_2 onto alpha_1 over the data set (the rollouts collected so far, at most
            # buffer_iterations)
            filled = min(collected, args.buffer_iterations) * T * n
            epoch_losses = dagger_update(policy, optimizer, {k: v[:filled] for k, v in data_obs.items()},
                                         data_labels[:filled], T * n, args, amp, world)
            # observation statistics: after the update (it regressed with the rollout's normalization), from every 4th
            # step of the rollout, as the teacher does (under torchrun every update is an all-reduce)
            rollout = {k: v[oldest:oldest + T * n].view(T, n, *v.shape[1:])[::4] for k, v in data_obs.items()}
            policy.actor.update_norms(rollout)

            # logging: one host read (means over the ranks, episode sums over all)
            totals = torch.cat([episode_sums, env.nan_resets.float()[None]])
            if world > 1:
                dist.all_reduce(step_sums)
                dist.all_reduce(totals)
            (action_mse, gt_err_m, teacher_fraction), (episodes, *ep, nan_resets) = ((step_sums / T / world).tolist(),
                                                                                     totals.tolist())
            length, success = (x / episodes if episodes else float("nan") for x in ep)
            scalars = {"charts/action_mse": action_mse, "charts/success_rate": success,
                       "charts/episode_length": length, "charts/gt_err_mm": 1000 * gt_err_m, "charts/beta": beta,
                       "charts/teacher_action_fraction": teacher_fraction, "charts/nan_resets": nan_resets,
                       "losses/dagger_mse_first_epoch": epoch_losses[0], "losses/dagger_mse": epoch_losses[-1],
                       "losses/lr": optimizer.param_groups[0]["lr"]}
            end_iteration(global_step, iteration, scalars,
                          f"action mse {action_mse:.4f} | loss {epoch_losses[0]:.4f}->{epoch_losses[-1]:.4f} | "
                          f"success {success:.2f} | g-mpjpe {1000 * gt_err_m:.0f} mm | beta {beta:.2f}")
    return pathlib.Path(args.run_dir) / "student.pt"


# --- export: the deployable artefact ---------------------------------------------------------------------------------
@dataclass
class Export:
    """python student.py export --ckpt runs/<run>/student.pt --onnx student.onnx"""
    ckpt: str
    """student checkpoint"""
    onnx: str = "student.onnx"
    """output ONNX file"""
    opset: int = 17
    """ONNX opset"""


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


# How a deployment builds those inputs and applies alpha: every choice, stated (metadata "contract"; deploy.py is
# written from it alone). The numbers are the env's own.
DEPLOY_CONTRACT = {
    "physics_dt_s": envs.PHYSICS_DT_S, "decimation": envs.DECIMATION,
    "pd_law": "at every physics step: tau = clip(kp (alpha - q) - kd qdot, -effort_limit_nm, effort_limit_nm) with q, "
              "qdot read at that step (kp N m/rad, kd N m s/rad); alpha held for the decimation steps of the control "
              "step; trained with 0-3 physics steps (0-15 ms) of delay before alpha reaches the motors (alpha_(t-1) "
              "meanwhile), kp and kd +-10 %",
    "joints": "q, qdot: the hinge angles of g1_scene.xml's joints in dof_names order (its zero pose and axis signs)",
    "episode_start": "the robot at the motion's frame-0 state, control step t = 0 there; tick k of the command is the "
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
    """The student with positional inputs (DEPLOY_INPUTS order); the SSJR command is computed inside the graph by
    ssjr.keypoint_command, the same function the env trains with. Outputs alpha and the command it read."""

    def __init__(self, policy: StudentPolicy):
        super().__init__()
        self.policy = policy

    def forward(self, student_proprio, keypoints_w, root_pos_w, root_quat_w, terrain, history, history_mask):
        y = ssjr.keypoint_command(keypoints_w, root_pos_w, root_quat_w)
        return self.policy({"student_proprio": student_proprio, "student_keypoints": y, "terrain": terrain,
                            "history": history, "history_mask": history_mask}), y


def export(args: Export) -> pathlib.Path:
    """Write the ONNX policy (inputs DEPLOY_INPUTS with a dynamic batch axis; outputs alpha [N, 29] rad and
    student_keypoints) with the deployment contract, the observation layout and the controller facts in its metadata.
    Uses the TorchScript exporter (dynamo=False: the dynamo exporter needs onnxscript) with the fused transformer fast
    path off, which it cannot export."""
    import onnx
    policy, ckpt = load_policy(args.ckpt, "cpu")
    layout = ckpt["obs_layout"]
    steps, j3 = layout["student_keypoints"]
    shapes = {"student_proprio": layout["student_proprio"], "keypoints_w": [steps, j3 // 3, 3], "root_pos_w": [3],
              "root_quat_w": [4], "terrain": layout["terrain"], "history": layout["history"],
              "history_mask": layout["history_mask"]}
    inputs = tuple(torch.zeros(2, *v, dtype=torch.bool if k == "history_mask" else torch.float32)
                   for k, v in shapes.items())
    kp, kd, limit = envs.joint_table()
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
                "effort_limit_nm": limit.tolist(), "env_cfg": ckpt["env_cfg"], "global_step": ckpt["global_step"],
                "source_ckpt": str(args.ckpt)}
        for k, v in meta.items():
            model.metadata_props.add(key=k, value=json.dumps(v))
        onnx.save(model, str(tmp))

    out = ssjr.write_atomic(args.onnx, write)
    print(f"wrote {out} (inputs {names}, outputs alpha [N, 29], student_keypoints)")
    return out


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["export"]:
            sys.argv.pop(1)
            export(tyro.cli(Export))
        else:
            train(teacher.parse_args(PRESETS))
    except InputError as e:
        sys.exit(f"error: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
