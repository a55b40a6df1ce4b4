"""Stage II of HoRD: online DAgger distillation of the teacher into the deployable student, in one file (CleanRL style).

    python student.py --teacher-ckpt runs/<teacher>/teacher.pt          # the paper's configuration (GPU)
    torchrun --standalone --nproc_per_node 2 student.py --preset cpu --teacher-ckpt t.pt   # 2 CPU cores: 2 ranks
    python student.py --preset cpu --resume runs/<run>/student.pt      # continue (only --total-env-steps may change)
    python export.py --ckpt runs/<run>/student.pt --onnx student.onnx   # the deployable ONNX (export.py)
    python evaluate.py --ckpt runs/<run>/student.pt --motions data/keypoints/cmu_bvh --settings genesis   # play

Student. alpha_2 = f2(m_t, s_sparse, g_t, Y_sparse) sees only what the robot has: s_sparse = `student_proprio` (joint
positions and velocities, IMU angular velocity and projected gravity, last PD target; steps t-7..t), the terrain context
g_t, the SSJR sparse keypoint command Y_sparse = `student_keypoints` (root-relative keypoints at t-7..t+4: 8 past + 4
future steps; ssjr.keypoint_command) and m_t, the HCDR token over the (s, alpha) history H_t. The backbone is the
teacher's (model.TokenPolicy, the teacher's sizes unless overridden). The student cannot see the reference joint
positions the teacher's residual action is centred on, so it outputs the absolute PD target alpha.

Online DAgger. Each iteration the student drives `num_envs` x `num_steps` control steps, its PD targets perturbed by
Gaussian noise (`action_std`, as rsl_rl samples its student; with probability beta per env and step the executed action
is the teacher's instead; beta = beta_0 * beta_decay^(iteration-1), default 0 as in the authors' earlier code), the
frozen teacher labels every visited state with alpha_1 = teacher.act(obs) from its privileged observations, and the
student regresses onto the labels: loss = MSE(alpha_2, alpha_1). DAgger aggregates its data set: each iteration's
`update_epochs` x one rollout's worth of minibatch samples are drawn from the last `buffer_iterations` rollouts (1: the
newest only); the learning rate decays linearly to 0 over the budget (the last weights average many small steps).

Choices where the paper is silent:
- Nominal pose: TokenPolicy zero-initializes its head, so the student adds a fixed bias alpha_0 = the mean reference
  joint position of its training motions (a buffer: in checkpoints and the ONNX graph). An untrained student then
  holds the clips' average (standing) pose instead of all joints at 0 rad: the first labels come from upright states.
- HCDR (paper: one shared module, the student "uses the same m_t"): the student starts from the teacher's HCDR and
  history normalizer and trains them on with the DAgger loss (it outlived a frozen one in all four test settings,
  docs/experiments.md); --hcdr teacher keeps it frozen, scratch: its own (ablation), none: no HCDR.
- Observation noise: the env's, part of its DR (envs.DR); the student and its teacher read the same noisy readings,
  the teacher also its clean privileged ones.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import tyro

import envs
import ssjr
import model  # the network both stages share (TokenPolicy), the teacher's (Agent) and the checkpoint readers
from ssjr import InputError


@dataclass
class Args:
    """Online DAgger distillation of a teacher.py checkpoint into the deployable student."""
    preset: str = "paper"  # 'paper' (the defaults below, GPU) or 'cpu' (a 2-core CPU)
    teacher_ckpt: str = ""  # the frozen teacher (teacher.py checkpoint); it also fixes the env configuration
    exp_name: str = "student"  # name of this experiment (run folder prefix)
    seed: int = 0  # seed of torch, numpy, random and the env (rank r of a torchrun job uses seed + r)
    device: str = ""  # torch / simulation device ('': cuda, or a resumed run's own; cuda without a GPU is an error)
    amp: bool = False  # bf16 autocast of the forward passes (CUDA)
    torch_threads: int = 0  # intra-op CPU threads of torch (0: torch's default)
    num_envs: int = 256  # parallel environments per rank
    performance_mode: bool = False
    """Genesis: kernels compiled for this num_envs (2x faster CPU physics; ~70 s compile at every start)"""
    total_env_steps: int = 100_000_000  # control steps to distil for (all envs together)
    num_steps: int = 32  # rollout length per env per iteration
    minibatch_size: int = 2048  # samples per gradient step and rank (gradients averaged over ranks)
    update_epochs: int = 6  # passes per iteration, each over one rollout's worth of samples drawn from the data set
    max_grad_norm: float = 1.0  # gradient clipping
    checkpoint_every: int = 50  # iterations between checkpoints
    resume: str = ""  # checkpoint of this script to continue (only the budget and the device may change)
    run_dir: str = ""  # where logs and checkpoints go (default runs/{exp_name}_{sim}_{seed}_{time})
    buffer_iterations: int = 1
    """DAgger's data set: the (student inputs, teacher label) samples of the last this many rollouts (not checkpointed:
    a resumed run refills it)"""
    sim: str = ""  # engine to distil on: isaaclab | genesis | mujoco ('' = the teacher's)
    motions: str = ""  # SSJR packet folder or file ('' = the teacher's motions)
    hcdr: Literal["finetune", "teacher", "scratch", "none"] = "finetune"
    """m_t of the student: the teacher's HCDR trained on with the DAgger loss | the teacher's, frozen | its own from
    scratch (ablation) | none (the 'w/o HCDR' ablation)"""
    lr: float = 2e-5  # Adam learning rate at the start, decayed linearly to 0 at total_env_steps
    beta: float = 0.0  # beta_0: probability that the executed action is the teacher's (0: only the student drives)
    beta_decay: float = 1.0  # beta of iteration i = beta_0 * beta_decay^(i-1)
    action_std: float = 0.1
    """std (rad) of Gaussian noise on the student's executed PD targets in the rollouts (rsl_rl samples its student
    with std 0.1): the student visits states off its own path and the teacher labels them (0: deterministic)"""
    d_model: int | None = None  # transformer width (None, as all sizes below: the teacher's backbone, as in the paper)
    num_layers: int | None = None  # transformer encoder layers
    num_heads: int | None = None  # attention heads
    ff_dim: int | None = None  # transformer feed-forward width
    head_dim: int | None = None  # action head MLP width (3 layers)
    terrain_dim: int | None = None  # terrain encoder MLP width (2 layers)
    hcdr_queries: int | None = None  # HCDR learnable query tokens N
    hcdr_dim: int | None = None  # HCDR token size d_m
    hcdr_layers: int | None = None  # HCDR Q-Former layers


PRESETS = {
    "paper": Args(),
    # the teacher preset's envs and performance mode (about its env-steps/s); 8 rollouts of samples to regress on
    "cpu": Args(preset="cpu", device="cpu", num_envs=64, performance_mode=True, total_env_steps=900_000, num_steps=24,
                buffer_iterations=8, update_epochs=2, minibatch_size=512, lr=1e-3, checkpoint_every=20,
                torch_threads=1),
}


@dataclass
class Preset:
    preset: str = "paper"  # the defaults: paper (the paper's configuration, GPU) or cpu (a 2-core CPU); flags override


MODEL_SIZES = ("d_model", "num_layers", "num_heads", "ff_dim", "head_dim", "terrain_dim", "hcdr_queries", "hcdr_dim",
               "hcdr_layers")  # None in Args: the teacher checkpoint's value
STUDENT_OBS = ("student_proprio", "student_keypoints", "terrain", "history", "history_mask")  # the student's inputs


class StudentPolicy(nn.Module):
    """alpha_2 = alpha_0 + TokenPolicy(student_proprio, student_keypoints, g_t, m_t): absolute PD targets [N, 29]."""

    def __init__(self, layout: dict, args: Args):
        super().__init__()
        self.actor = model.TokenPolicy(layout, ("student_proprio", "student_keypoints"), args, hcdr=args.hcdr != "none")
        self.register_buffer("alpha_0", torch.zeros(ssjr.NUM_DOF))  # nominal pose (see the module docstring)
        if args.hcdr == "teacher":  # the teacher's HCDR (share_teacher_hcdr), frozen with its history normalizer
            self.actor.hcdr.requires_grad_(False)
            self.actor.history_frozen = True

    def forward(self, obs: dict) -> torch.Tensor:
        return self.alpha_0 + self.actor(obs)

    @torch.no_grad()
    def act(self, obs: dict) -> torch.Tensor:
        """Deterministic PD targets (evaluation, deployment)."""
        return self(obs)


def share_teacher_hcdr(policy: StudentPolicy, teacher, path):
    """The student's HCDR and history normalizer := the teacher's (frozen by StudentPolicy for --hcdr teacher)."""
    src, dst = teacher.actor, policy.actor
    if src.hcdr is None:
        raise InputError(path, "the teacher has no HCDR to share: use the student's --hcdr scratch or none")
    try:
        dst.hcdr.load_state_dict(src.hcdr.state_dict())
    except RuntimeError:  # missing/unexpected keys or other shapes
        raise InputError(path, "the teacher's HCDR has other sizes than the student's: leave --hcdr-* and --d-model "
                               "at their defaults (the teacher's)") from None
    dst.history_norm.load_state_dict(src.history_norm.state_dict())


def dagger_update(policy: nn.Module, optimizer, b_obs: dict, b_labels: torch.Tensor, per_epoch: int,
                  args: Args, amp=contextlib.nullcontext, world: int = 1) -> list[float]:
    """update_epochs passes of minibatch MSE(alpha_2, alpha_1), each over `per_epoch` samples drawn without replacement
    from the data set (b_obs, b_labels); returns the mean loss of each pass (read from the device once, at the end).
    `policy`: the StudentPolicy, or under torchrun its DDP wrapper (which averages the gradients over the ranks)."""
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
            nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
            optimizer.step()
            losses.append(loss.detach())
        epoch_losses.append(torch.stack(losses).mean())
    policy.eval()
    return (model.all_reduce(torch.stack(epoch_losses)) / world).tolist()  # the mean over the ranks


def student_env_cfg(args: Args, teacher_ckpt: dict) -> dict:
    """The teacher's make_env settings; only the engine and the motions may differ."""
    return {**teacher_ckpt["env_cfg"], **{k: v for k, v in (("sim", args.sim), ("motions", args.motions)) if v}}


def load_policy(path, device="cpu"):
    """(student policy in eval mode with act(obs) -> alpha [N, 29], checkpoint dict) for evaluation and export."""
    ckpt = model.load_checkpoint(path, "student")
    policy = StudentPolicy(ckpt["obs_layout"], model.checkpoint_args(path, ckpt, Args)).to(device)
    model.load_weights(path, policy, ckpt["model"])
    return policy.eval(), ckpt


def train(args: Args, env=None) -> pathlib.Path:
    """Online DAgger. `env`: an env already built from the teacher's env_cfg (tests share one); None builds it."""
    # --- set-up: a resumed run takes its checkpoint's settings (only the budget and the device may change)
    resume = model.load_checkpoint(args.resume, "student") if args.resume else None
    if resume is not None and "rng" not in resume:
        raise InputError(args.resume, "weights only (a shipped model): it can be evaluated or exported, not resumed")
    if resume is not None:
        args = model.resumed_args(args, resume, PRESETS)
    if args.buffer_iterations < 1:
        raise InputError("--buffer-iterations", f"must be at least 1 (the newest rollout): {args.buffer_iterations}")
    if not args.teacher_ckpt:
        raise InputError("--teacher-ckpt", "give the teacher to distil: --teacher-ckpt <teacher.pt>")
    # the device and ranks (torchrun: one rank per GPU or CPU core), checked before any engine starts
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda", "CUDA is not available on this machine: --preset cpu (or --device cpu) runs "
                                          "on the CPU")
    if args.amp and device.type != "cuda":
        raise InputError("--amp", "bf16 autocast is for CUDA devices; the CPU learner stays in fp32")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if device.index is None else device.index)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "tf32"
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed + rank)  # ranks are seeded apart; they start from rank 0's weights (DDP)
    same_kind = resume is not None and torch.device(resume["args"]["device"]).type == device.type
    rng = resume["rng"][rank] if same_kind and rank < len(resume["rng"]) else None  # the rank's own streams

    # --- the frozen teacher fixes the env and, unless set, the student's sizes
    teacher, tckpt = model.load_teacher(args.teacher_ckpt, device)
    args = dataclasses.replace(args, **{k: tckpt["args"][k] for k in MODEL_SIZES if getattr(args, k) is None})
    if resume is not None and resume["teacher"]["global_step"] != tckpt["global_step"]:
        raise InputError(args.resume, f"distilled from {args.teacher_ckpt} at teacher step "
                                      f"{resume['teacher']['global_step']:,}, but that file now holds step "
                                      f"{tckpt['global_step']:,} (the teacher run went on): start a new student")
    env_cfg = student_env_cfg(args, tckpt)
    own_env = env is None
    if own_env:
        env = envs.make_env(**env_cfg, num_envs=args.num_envs, device=str(device), seed=args.seed + rank,
                            terrain_seed=args.seed, performance_mode=args.performance_mode)  # one terrain for all
    if rng is not None:  # this rank's env stream, before the first reset
        env.gen.set_state(rng["env"]["gen"])
    obs, layout = env.reset(), env.obs_layout
    model.check_layout(args.teacher_ckpt, tckpt["obs_layout"], layout, teacher.actor_obs)
    policy = StudentPolicy(layout, args).to(device)
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=args.lr, eps=1e-5)
    global_step, iteration = 0, 0
    if resume is not None:
        model.check_layout(args.resume, resume["obs_layout"], layout, STUDENT_OBS)
        model.load_weights(args.resume, policy, resume["model"])
        model.load_weights(args.resume, optimizer, resume["optimizer"])
        global_step, iteration = resume["global_step"], resume["iteration"]
        print(f"rank {rank}: resumed from {args.resume} at step {global_step:,} (iteration {iteration})")
    else:
        policy.alpha_0.copy_(env.motions.mean_dof_pos)
        if args.hcdr in ("teacher", "finetune"):
            share_teacher_hcdr(policy, teacher, args.teacher_ckpt)
        policy.actor.update_norms(obs)
    if rng is not None:  # this rank's learner streams (minibatch order, exploration noise)
        torch.set_rng_state(rng["torch"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
    # under torchrun the update runs through DDP: rank 0's weights to every rank now, averaged gradients in backward
    learner = nn.parallel.DistributedDataParallel(policy, forward_sync_buffers=False) if world > 1 else policy
    policy.eval()
    amp = lambda: torch.autocast(device.type, torch.bfloat16, enabled=args.amp)

    # --- the run folder (rank 0 writes it), TensorBoard, checkpoints, Ctrl-C / torchrun's SIGTERM
    run_dir = [args.run_dir or f"runs/{args.exp_name}_{env_cfg['sim']}_{args.seed}_{int(time.time())}"]
    if world > 1:
        dist.broadcast_object_list(run_dir, 0)
    args.run_dir, run_dir = run_dir[0], pathlib.Path(run_dir[0])
    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter
        run_dir.mkdir(parents=True, exist_ok=True)
        print("configuration:\n" + "\n".join(f"  {k} = {v}" for k, v in dataclasses.asdict(args).items()))
        writer = SummaryWriter(run_dir, purge_step=global_step + 1)  # a resumed run hides what came after its step

    def random_streams() -> list[dict]:  # every rank's learner and env streams, in rank order
        mine = {"torch": torch.get_rng_state(), "env": {"gen": env.gen.get_state()},
                **({"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {})}
        out = [mine] * world
        if world > 1:
            dist.all_gather_object(out, mine)
        return out

    def save():  # the weights now with the counters and streams of the last whole iteration, written by rank 0
        if rank == 0 and finished["iteration"] > first_iteration:
            ckpt = {"kind": "student", "args": dataclasses.asdict(args), "env_cfg": env_cfg, "obs_layout": layout,
                    "model": policy.state_dict(), "optimizer": optimizer.state_dict(), **finished,
                    "teacher": {"path": args.teacher_ckpt, "global_step": tckpt["global_step"]}, "world_size": world}
            ssjr.write_atomic(run_dir / "student.pt", lambda tmp: torch.save(ckpt, tmp))

    first_iteration, start_step = iteration, global_step
    finished = dict(global_step=global_step, iteration=iteration, rng=random_streams())
    stop = torch.zeros((), device=device)  # set by a signal on any rank; the ranks agree on it every iteration
    previous = {sig: signal.signal(sig, lambda *_: stop.fill_(1.0)) for sig in (signal.SIGINT, signal.SIGTERM)}

    # ALGO LOGIC: storage (DAgger's data set: student inputs and teacher labels of the last buffer_iterations rollouts)
    n, T = args.num_envs, args.num_steps
    capacity = args.buffer_iterations * T * n
    data_obs = {k: torch.zeros((capacity, *layout[k]), dtype=obs[k].dtype, device=device) for k in STUDENT_OBS}
    data_labels = torch.zeros(capacity, ssjr.NUM_DOF, device=device)
    ep_len = torch.zeros(n, device=device)
    per_iteration = n * T * world  # env-steps of one iteration, all ranks together
    start_time = time.time()
    try:
        while global_step + per_iteration <= args.total_env_steps:
            if model.all_reduce(stop).item():  # a signal on any rank stops every rank
                break
            iteration += 1
            beta = args.beta * args.beta_decay ** (iteration - 1)
            for group in optimizer.param_groups:
                group["lr"] = args.lr * (1.0 - global_step / args.total_env_steps)
            oldest = (iteration - 1 - first_iteration) % args.buffer_iterations * T * n  # replaces the oldest rollout
            step_sums = dict.fromkeys(("action_mse", "gt_err_m", "teacher_fraction"), 0.0)  # on the device, read once
            episode_sums = dict.fromkeys(("episodes", "length", "successes"), 0.0)
            for step in range(T):
                with torch.no_grad(), amp():
                    alpha_2 = policy(obs)
                    alpha_1 = teacher.act(obs)  # DAgger label of the visited state (privileged observations)
                rows = slice(oldest + step * n, oldest + (step + 1) * n)
                for k in STUDENT_OBS:
                    data_obs[k][rows] = obs[k]
                data_labels[rows] = alpha_1
                use_teacher = torch.rand(n, device=device) < beta
                explored = alpha_2 + args.action_std * torch.randn_like(alpha_2) if args.action_std else alpha_2
                obs, _, done, info = env.step(torch.where(use_teacher[:, None], alpha_1, explored))
                ep_len += 1
                ended = done.float()
                step_sums["action_mse"] += (alpha_2 - alpha_1).pow(2).mean()
                step_sums["gt_err_m"] += info["metrics"]["gt_err_m"].nanmean()  # nanmean: a blown-up env is NaN
                step_sums["teacher_fraction"] += use_teacher.float().mean()
                episode_sums["episodes"] += ended.sum()
                episode_sums["length"] += (ep_len * ended).sum()
                episode_sums["successes"] += (info["time_out"].float() * ended).sum()
                ep_len *= 1.0 - ended
            global_step += per_iteration

            # ALGO LOGIC: regress alpha_2 onto alpha_1 over the data set (the last buffer_iterations rollouts at most)
            filled = min(iteration - first_iteration, args.buffer_iterations) * T * n  # a resumed run refills it
            epoch_losses = dagger_update(learner, optimizer, {k: v[:filled] for k, v in data_obs.items()},
                                         data_labels[:filled], T * n, args, amp, world)
            # observation statistics: after the update (it regressed with the rollout's normalization), from every 4th
            # step of the rollout, as the teacher does (under torchrun every update is an all-reduce)
            rollout = {k: v[oldest:oldest + T * n].view(T, n, *v.shape[1:])[::4] for k, v in data_obs.items()}
            policy.actor.update_norms(rollout)

            # logging: one host read (means over the ranks, episode sums over all of them)
            totals = {**episode_sums, "nan_resets": env.nan_resets}
            stack = lambda d: torch.stack([torch.as_tensor(v, device=device).float() for v in d.values()])
            mean_t, total_t = model.all_reduce(stack(step_sums) / T), model.all_reduce(stack(totals))
            mean, total = dict(zip(step_sums, (mean_t / world).tolist())), dict(zip(totals, total_t.tolist()))
            per_episode = {k: total[k] / total["episodes"] if total["episodes"] else float("nan")
                           for k in ("length", "successes")}
            sps = (global_step - start_step) / (time.time() - start_time)
            scalars = {"charts/action_mse": mean["action_mse"], "charts/success_rate": per_episode["successes"],
                       "charts/episode_length": per_episode["length"], "charts/gt_err_mm": 1000 * mean["gt_err_m"],
                       "charts/beta": beta, "charts/teacher_action_fraction": mean["teacher_fraction"],
                       "charts/nan_resets": total["nan_resets"], "charts/SPS": sps, "iteration": iteration,
                       "losses/dagger_mse_first_epoch": epoch_losses[0], "losses/dagger_mse": epoch_losses[-1],
                       "losses/lr": optimizer.param_groups[0]["lr"]}
            finished = dict(global_step=global_step, iteration=iteration, rng=random_streams())
            if writer is not None:
                for k, v in scalars.items():
                    writer.add_scalar(k, v, global_step)
                print(f"it {iteration} step {global_step:,}/{args.total_env_steps:,} | {sps:,.0f} env-steps/s | "
                      f"action mse {mean['action_mse']:.4f} | loss {epoch_losses[0]:.4f}->{epoch_losses[-1]:.4f} | "
                      f"success {per_episode['successes']:.2f} | g-mpjpe {1000 * mean['gt_err_m']:.0f} mm | beta "
                      f"{beta:.2f} | ETA {(args.total_env_steps - global_step) / sps / 60:.1f} min", flush=True)
            if iteration % args.checkpoint_every == 0:
                save()
    except BaseException:  # a crash still leaves the last whole iteration on disk (unless the weights went bad)
        if all(p.isfinite().all() for p in policy.parameters()):
            save()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if writer is not None:
            writer.close()
        if own_env:
            env.close()
    save()
    if rank == 0:
        print(f"saved student.pt and the TensorBoard log in {run_dir}")
    return run_dir / "student.pt"


if __name__ == "__main__":
    try:
        preset, argv = tyro.cli(Preset, return_unknown_args=True, add_help=False)  # --preset: the defaults
        if preset.preset not in PRESETS:
            raise InputError("--preset", f"unknown preset '{preset.preset}': choose one of {list(PRESETS)}")
        train(tyro.cli(Args, default=PRESETS[preset.preset], args=argv))
    except InputError as e:
        sys.exit(f"error: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
