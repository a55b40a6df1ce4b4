"""Stage I of HoRD: the PPO teacher (expert) with privileged observations, dense future reference, episode-level DR
and HCDR, in one file (CleanRL style).

    python teacher.py --num-envs 4096                  # the paper's configuration (GPU)
    torchrun --standalone --nproc_per_node 2 teacher.py --preset cpu   # small model: a 2-core CPU, one rank per core
    torchrun --standalone --nproc_per_node 8 teacher.py               # 8 GPUs: one rank each, gradients all-reduced
    python teacher.py --preset cpu --resume runs/<run>/teacher.pt

The network (model.Agent: the token policy with its HCDR token m_t, and the privileged critic) is in model.py, which
student.py shares; this file is the PPO loop: set-up, rollout, GAE, update, log, checkpoint.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import tyro

import envs
import model
import ssjr
from ssjr import InputError


@dataclass
class Args:
    """PPO training of the HoRD teacher."""
    preset: str = "paper"  # 'paper' (the defaults below: the paper's, GPU) or 'cpu' (small: minutes on a CPU)
    exp_name: str = "teacher"  # name of this experiment (run folder prefix)
    seed: int = 0  # seed of torch, numpy, random and the env (rank r of a torchrun job uses seed + r)
    device: str = ""  # torch / simulation device ('': cuda, or a resumed run's own; cuda without a GPU is an error)
    amp: bool = False  # bf16 autocast of the forward passes (CUDA; fp32 matmuls use TF32 there anyway)
    torch_threads: int = 0  # intra-op CPU threads of torch (0: torch's default)
    num_envs: int = 4096  # parallel environments per rank (torchrun: each process runs this many)
    performance_mode: bool = False
    """Genesis: kernels compiled for this num_envs (2x faster CPU physics; ~70 s compile at every start)"""
    total_env_steps: int = 1_000_000_000  # control steps to train for (all envs together)
    num_steps: int = 32  # rollout length per env per iteration
    minibatch_size: int = 16384
    """samples per gradient step and rank (gradients averaged over ranks). Default: the paper's table (4096 envs,
    batch 16384, 1 mini-epoch) read as ProtoMotions' batch_size: 8 steps per 131,072 samples, 61k steps per 1e9
    env-steps. The authors' released config: --num-envs 512 --minibatch-size 1024, 16 steps per 16,384 samples, 977k
    per 1e9"""
    update_epochs: int = 1  # passes over each rollout (the paper's 'mini-epochs')
    max_grad_norm: float = 50.0  # gradient clipping
    checkpoint_every: int = 50  # iterations between checkpoints
    keep_every: int = 0
    """iterations between kept copies teacher_it<N>.pt (0: none): checkpoints a few hundred k steps apart can differ
    by tens of points from frame 0 under DR, so pick one by evaluation on held seeds (docs/experiments.md)"""
    resume: str = ""  # checkpoint of this script to continue (only the budget, device and --keep-every may change)
    init_ckpt: str = ""  # a teacher checkpoint whose actor starts this run (fine-tuning; the critic starts afresh)
    run_dir: str = ""  # where logs and checkpoints go (default runs/{exp_name}_{sim}_{seed}_{time})
    sim: str = "isaaclab"
    """simulator: isaaclab (the paper's training engine), mujoco (its CPU twin, the cpu preset's), genesis,
    genesis_aligned (Genesis at MuJoCo's contact time constant)"""
    motions: str = "data/packets/g1_moves"  # SSJR packet folder or file (the held-out test clips are excluded)
    terrain: str = "mix"  # flat | smooth_slope | rough_slope | mix (paper: 0.5 flat, 0.25 each slope)
    no_dr: bool = False  # the 'w/o DR' ablation: nominal dynamics every episode
    clamp_targets: bool = False  # PD targets clamped to the joint ranges in the env (a robot's safety layer)
    no_hcdr: bool = False  # the 'w/o HCDR' ablation: no history token
    psi_actor: bool = False  # the actor also reads the true psi (an oracle, not HoRD): any history encoder's headroom
    root_velocity: bool = True
    """the actor reads the root's linear velocity (privileged, as in the paper); --no-root-velocity (the cpu preset):
    the bodies' velocities relative to the root's, which encoders and an IMU give, so that a student can follow its
    actions (the critic keeps it; docs/experiments.md)"""
    actor_lr: float = 2e-5  # actor learning rate (the paper's table; with --desired-kl the first one, then adapted)
    critic_lr: float = 1e-4  # critic learning rate
    gamma: float = 0.99  # discount
    gae_lambda: float = 0.95  # GAE lambda
    clip_coef: float = 0.2  # PPO clip range
    vf_coef: float = 1.0  # value loss weight
    desired_kl: float = 0.01
    """the update rule. > 0: before each actor step, scale the actor lr by 1/1.5 (KL > 2x this) or 1.5 (KL < this/2)
    (rsl_rl): each iteration moves the policy by about this KL, however many samples it has. 0: the fixed --actor-lr
    (the paper's table read literally; it barely moves the policy per iteration: docs/experiments.md)"""
    actor_lr_max: float = 1e-2  # the ceiling of that adaptive lr (rsl_rl's; the cpu preset keeps the older 1e-3)
    log_std: float = -2.9  # fixed log standard deviation of the Gaussian policy
    action_scale: float = 1.0  # alpha = q_ref(t+1) + action_scale * a (rad)
    d_model: int = 512  # transformer width
    num_layers: int = 6  # transformer encoder layers
    num_heads: int = 8  # attention heads
    ff_dim: int = 1536  # transformer feed-forward width (paper text: 3x d_model)
    head_dim: int = 1024  # actor head MLP width (3 layers)
    terrain_dim: int = 256  # terrain encoder MLP width (2 layers)
    critic_dim: int = 1024  # critic MLP width (4 layers)
    hcdr_queries: int = 4  # HCDR learnable query tokens N
    hcdr_dim: int = 128  # HCDR token size d_m
    hcdr_layers: int = 2  # HCDR Q-Former layers
    # levers of the authors' released code that the paper does not state (off by default; docs/experiments.md)
    frame0_share: float = 0.0  # share of training episodes that start at the clip's frame 0 (the rest: uniform)
    reweight_every: int = 0  # iterations between re-weightings of the clips by their fall rate (0: uniform clips)
    grace_steps: int = 0  # control steps after a reset before the 0.5 m failure test applies
    value_norm: bool = False  # the critic regresses normalized returns (clamped at 5), its loss clipped like PPO's
    body_dr_per_episode: bool = False  # redraw the body terms of psi (masses, CoM, joints) at every reset


PRESETS = {
    "paper": Args(),
    "cpu": Args(preset="cpu", sim="mujoco", device="cpu", terrain="flat", num_envs=64, root_velocity=False,
                performance_mode=True, total_env_steps=200_000, num_steps=24, minibatch_size=384, update_epochs=1,
                actor_lr=1e-4, actor_lr_max=1e-3, critic_lr=3e-4, log_std=-2.0,
                d_model=64, num_layers=2, num_heads=4, ff_dim=128, head_dim=256, terrain_dim=64, critic_dim=256,
                hcdr_dim=32, hcdr_layers=1, checkpoint_every=20, torch_threads=1),
}


@dataclass
class Preset:
    preset: str = "paper"  # the defaults: paper (the paper's configuration, GPU) or cpu (a small model); flags override


# The env keys the teacher reads; their shapes are checked against the checkpoint's observation layout.
TEACHER_OBS = ("proprio", "future", "ref_dof_pos", "terrain", "history", "history_mask", "psi", "critic")


def compute_gae(rewards, values, dones, next_value, gamma: float, lam: float) -> torch.Tensor:
    """Generalized advantage estimation over a [T, N] rollout; dones[t] = the episode ended after step t."""
    advantages, last_gae = torch.zeros_like(rewards), torch.zeros_like(next_value)
    for t in reversed(range(len(rewards))):
        next_v = next_value if t == len(rewards) - 1 else values[t + 1]
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_v * not_done - values[t]
        last_gae = delta + gamma * lam * not_done * last_gae
        advantages[t] = last_gae
    return advantages


def ppo_losses(agent, obs, actions, old_logprob, advantages, returns, old_values, clip_coef: float, clip_value: bool):
    """Clipped surrogate and value loss on one minibatch; also approx-KL and the clip fraction (for logging)."""
    pi, value = agent(obs)
    log_ratio = pi.log_prob(actions).sum(-1) - old_logprob
    ratio = log_ratio.exp()
    adv = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()
    v_loss = 0.5 * (value - returns).pow(2)
    if clip_value:  # the value moves at most clip_coef from the rollout's per update, as the policy's ratio
        clipped = old_values + (value - old_values).clamp(-clip_coef, clip_coef)
        v_loss = torch.max(v_loss, 0.5 * (clipped - returns).pow(2))
    v_loss = v_loss.mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    return pg_loss, v_loss, approx_kl, clipfrac


def robot_motions(motions: str) -> str | list[str]:
    """--motions for a teacher, whose reward and observations use the robot's bodies and joints: human keypoint
    commands in a folder are skipped (and named); a file or folder of nothing else is an error."""
    paths = envs.resolve_motions(motions)
    human = [p for p in paths if ssjr.packet_kind(p) == "human_keypoints"]
    if len(human) == len(paths):
        raise InputError(motions, "only human keypoint commands: a teacher needs robot motions (G1 SSJR packets)")
    if human:
        print(f"skipping human keypoint commands in {motions} (a teacher needs robot motions): "
              f"{', '.join(p.name for p in human)}")
    return [str(p) for p in paths if p not in human] if human else motions


def start_rank(args):
    """This process's device, world size and rank, checked before any engine starts: torchrun starts one rank per GPU
    or CPU core (nccl on CUDA, gloo on the CPU); cuda without a GPU is an error, not a silent fallback to the CPU.
    Ranks are seeded apart (seed + rank) and start from rank 0's weights (DDP broadcasts them)."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda", f"CUDA is not available on this machine (torch {torch.__version__}); to "
                                          f"run on the CPU on purpose pass --device cpu, or --preset cpu")
    if args.amp and device.type != "cuda":
        raise InputError("--amp", "bf16 autocast is for CUDA devices; the CPU learner stays in fp32")
    if device.type == "cuda":  # fp32 matmuls in TF32 there; the CPU stays exact fp32
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if device.index is None else device.index)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = "tf32"
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(args.seed + rank)
    print(f"rank {rank} of {world}: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
          f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")
    return device, world, rank


def random_streams(env, device, world: int) -> list[dict]:
    """Every rank's random streams in rank order, as a checkpoint holds them: the learner's (torch's global stream:
    sampling, minibatch order; CUDA's) and the env's (resets, DR draws, a teacher's clip weights)."""
    mine = {"torch": torch.get_rng_state(), "env": {"gen": env.gen.get_state(), "clip_weights": env.clip_weights},
            **({"cuda": torch.cuda.get_rng_state(device)} if device.type == "cuda" else {})}
    out = [mine] * world
    if world > 1:
        dist.all_gather_object(out, mine)
    return out


def main(args: Args) -> pathlib.Path:
    # --- set-up: a resumed run takes its checkpoint's settings (only the budget, device and kept copies may change)
    resume = model.load_checkpoint(args.resume, "teacher") if args.resume else None
    if resume is not None and "rng" not in resume:
        raise InputError(args.resume, "weights only (a shipped model): it can be evaluated, distilled from or "
                                      "fine-tuned (--init-ckpt), not resumed")
    if resume is not None:
        args = model.resumed_args(args, resume, PRESETS)
    if args.minibatch_size > args.num_envs * args.num_steps:
        raise InputError("--minibatch-size", f"{args.minibatch_size} is larger than a rollout ({args.num_envs} envs "
                                             f"x {args.num_steps} steps)")
    init = model.load_checkpoint(args.init_ckpt, "teacher") if args.init_ckpt and resume is None else None
    device, world, rank = start_rank(args)
    # a resumed rank goes on with its own random streams (if the checkpoint has them for this rank and device type)
    same_kind = resume is not None and torch.device(resume["args"]["device"]).type == device.type
    rng = resume["rng"][rank] if same_kind and rank < len(resume["rng"]) else None

    env_cfg = dict(sim=args.sim, motions=robot_motions(args.motions), terrain=args.terrain,  # the student's env too
                   dr=None if args.no_dr else "default", root_velocity=args.root_velocity,
                   clamp_targets=args.clamp_targets)
    env = envs.make_env(**env_cfg, num_envs=args.num_envs, device=str(device), seed=args.seed + rank,
                        terrain_seed=args.seed, performance_mode=args.performance_mode)  # one terrain for all ranks
    env.frame0_share, env.grace_steps = args.frame0_share, args.grace_steps
    if env.dr is not None:
        env.dr.body_psi_per_episode = args.body_dr_per_episode
    clip_stats = torch.zeros(2, len(env.motions), device=device)  # per clip: episodes ended, falls (re-weighting)
    if rng is not None:  # the env stream and clip weights, before the first reset (fall counts start anew)
        env.gen.set_state(rng["env"]["gen"])
        if rng["env"].get("clip_weights") is not None:
            env.clip_weights = rng["env"]["clip_weights"].to(device)
    obs, layout = env.reset(), env.obs_layout
    agent = model.Agent(layout, args).to(device)
    agent.update_norms(obs)
    actor_opt = torch.optim.Adam(agent.actor.parameters(), lr=args.actor_lr, eps=1e-5)
    critic_opt = torch.optim.Adam(agent.critic.parameters(), lr=args.critic_lr, eps=1e-5)
    global_step, iteration = 0, 0
    if init is not None:  # fine-tuning: its actor; a fresh critic, optimizers and counters
        model.check_layout(args.init_ckpt, init["obs_layout"], layout, agent.actor_obs)
        model.load_weights(args.init_ckpt, agent.actor, {k[6:]: v for k, v in init["model"].items()
                                                         if k.startswith("actor.")})
    if resume is not None:
        model.check_layout(args.resume, resume["obs_layout"], layout, TEACHER_OBS)
        for module, key in ((agent, "model"), (actor_opt, "actor_opt"), (critic_opt, "critic_opt")):
            model.load_weights(args.resume, module, resume[key])
        global_step, iteration = resume["global_step"], resume["iteration"]
        print(f"rank {rank}: resumed from {args.resume} at step {global_step:,} (iteration {iteration})")
    if rng is not None:  # the learner streams (sampling, minibatch order), after the weights were drawn
        torch.set_rng_state(rng["torch"])
        if device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
    # under torchrun the update runs through DDP: rank 0's weights to every rank now, averaged gradients in backward
    learner = nn.parallel.DistributedDataParallel(agent, forward_sync_buffers=False) if world > 1 else agent
    amp = lambda: torch.autocast(device.type, torch.bfloat16, enabled=args.amp)

    # --- the run folder (rank 0 writes it), TensorBoard, checkpoints, Ctrl-C / torchrun's SIGTERM
    run_dir = [args.run_dir or f"runs/{args.exp_name}_{args.sim}_{args.seed}_{int(time.time())}"]
    if world > 1:
        dist.broadcast_object_list(run_dir, 0)
    args.run_dir, run_dir = run_dir[0], pathlib.Path(run_dir[0])
    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter
        run_dir.mkdir(parents=True, exist_ok=True)
        print("configuration:\n" + "\n".join(f"  {k} = {v}" for k, v in dataclasses.asdict(args).items()))
        writer = SummaryWriter(run_dir, purge_step=global_step + 1)  # a resumed run hides what came after its step
    first_iteration, start_step = iteration, global_step
    finished = dict(global_step=global_step, iteration=iteration, rng=random_streams(env, device, world))

    def save(keep: bool = False):  # the weights now with the counters and streams of the last whole iteration
        if rank == 0 and finished["iteration"] > first_iteration:
            ckpt = {"kind": "teacher", "args": dataclasses.asdict(args), "env_cfg": env_cfg, "obs_layout": layout,
                    "model": agent.state_dict(), "actor_opt": actor_opt.state_dict(),
                    "critic_opt": critic_opt.state_dict(), **finished, "world_size": world}
            for path in [run_dir / "teacher.pt"] + [run_dir / f"teacher_it{finished['iteration']}.pt"] * keep:
                ssjr.write_atomic(path, lambda tmp: torch.save(ckpt, tmp))

    stop = torch.zeros((), device=device)  # set by a signal on any rank; the ranks agree on it every iteration
    previous = {sig: signal.signal(sig, lambda *_: stop.fill_(1.0)) for sig in (signal.SIGINT, signal.SIGTERM)}

    # ALGO LOGIC: storage (preallocated rollout buffers)
    n, T = args.num_envs, args.num_steps
    buf_obs = {k: torch.zeros((T, n, *layout[k]), dtype=obs[k].dtype, device=device) for k in TEACHER_OBS}
    actions = torch.zeros(T, n, ssjr.NUM_DOF, device=device)
    logprobs, rewards, dones, time_outs, values = (torch.zeros(T, n, device=device) for _ in range(5))
    ep_return, ep_len = torch.zeros(n, device=device), torch.zeros(n, device=device)
    per_iteration = n * T * world  # env-steps of one iteration, all ranks together
    start_time = time.time()
    try:
        while global_step + per_iteration <= args.total_env_steps:
            if model.all_reduce(stop).item():  # a signal on any rank stops every rank
                break
            iteration += 1
            # per-iteration statistics stay on the device (a host read stalls a GPU): sums over steps, over episodes
            step_sums = dict.fromkeys(("gt_err_m", "mpjpe_m", *envs.REWARD_COEFFS), 0.0)
            episode_sums = dict.fromkeys(("episodes", "return", "length", "successes"), 0.0)
            agent.eval()
            for step in range(T):
                for k in TEACHER_OBS:
                    buf_obs[k][step] = obs[k]
                with torch.no_grad(), amp():
                    pi = agent.dist(obs)
                    actions[step] = a = pi.sample()
                    logprobs[step] = pi.log_prob(a).sum(-1)
                    values[step] = agent.value(obs)
                obs, reward, done, info = env.step(agent.to_alpha(obs, a))
                rewards[step], dones[step], time_outs[step] = reward, done.float(), info["time_out"].float()
                ep_return += reward
                ep_len += 1
                for k in step_sums:  # nanmean: a blown-up env is NaN
                    step_sums[k] += (info["reward_terms"] if k in envs.REWARD_COEFFS else info["metrics"])[k].nanmean()
                ended = done.float()
                clip_stats.index_add_(1, info["clip"], torch.stack([ended, info["failed"].float()]))
                for k, v in (("episodes", ended), ("return", ep_return * ended), ("length", ep_len * ended),
                             ("successes", info["time_out"].float() * ended)):
                    episode_sums[k] += v.sum()
                ep_return *= 1.0 - ended
                ep_len *= 1.0 - ended
            global_step += per_iteration

            # ALGO LOGIC: GAE. A clip end is a time limit, not a failure: it is bootstrapped with V(s_t) (rsl_rl),
            # since the critic cannot tell how much of the clip is left
            with torch.no_grad(), amp():
                next_value = agent.value(obs)
                advantages = compute_gae(rewards + args.gamma * values * time_outs, values, dones, next_value,
                                         args.gamma, args.gae_lambda)
                returns = advantages + values

            # ALGO LOGIC: PPO update (clipped surrogate + value loss)
            agent.train()
            flat = lambda x: x.reshape(n * T, *x.shape[2:])
            b_obs = {k: flat(v) for k, v in buf_obs.items()}
            b_actions, b_logprobs, b_adv, b_returns, b_values = map(flat, (actions, logprobs, advantages, returns,
                                                                          values))
            if agent.value_norm is not None:  # targets clamped at 5; old values unclamped: the critic's own outputs
                b_returns, b_values = agent.value_norm(b_returns, 5.0), agent.value_norm(b_values, float("inf"))
            clipfracs, approx_kls = [], []
            for epoch in range(args.update_epochs):
                perm = torch.randperm(n * T, device=device)
                for start in range(0, n * T - args.minibatch_size + 1, args.minibatch_size):  # full minibatches only
                    mb = perm[start:start + args.minibatch_size]
                    mb_obs = {k: v[mb] for k, v in b_obs.items()}
                    with amp():
                        pg_loss, v_loss, approx_kl, clipfrac = ppo_losses(learner, mb_obs, b_actions[mb],
                                                                          b_logprobs[mb], b_adv[mb], b_returns[mb],
                                                                          b_values[mb], args.clip_coef, args.value_norm)
                    approx_kls.append(approx_kl)
                    clipfracs.append(clipfrac)
                    # adaptive step size (not on the first minibatch: the policy is still the rollout's, KL 0); the
                    # KL is the mean over the ranks, so every rank steps its lr alike
                    if args.desired_kl > 0 and (epoch > 0 or start > 0):
                        kl = model.all_reduce(approx_kl.clone()).item() / world
                        for group in actor_opt.param_groups:
                            if kl > 2.0 * args.desired_kl:
                                group["lr"] = max(group["lr"] / 1.5, 1e-6)
                            elif kl < 0.5 * args.desired_kl:
                                group["lr"] = min(group["lr"] * 1.5, args.actor_lr_max)
                    loss = pg_loss + args.vf_coef * v_loss
                    agent.zero_grad()
                    loss.backward()
                    for part, opt in ((agent.actor, actor_opt), (agent.critic, critic_opt)):  # each clipped on its own
                        nn.utils.clip_grad_norm_(part.parameters(), args.max_grad_norm)
                        opt.step()

            # observation statistics: updated after the PPO update (the update must see the rollout's normalization),
            # from every 4th rollout step (consecutive steps are nearly the same states: a quarter of the cost)
            agent.update_norms({k: v[::4] for k, v in buf_obs.items()})
            if agent.value_norm is not None:
                agent.value_norm.update(returns.reshape(-1, 1))
            # clip re-weighting: the clips that fail get the episodes (the authors: every 500 epochs, the failed clips)
            if args.reweight_every and iteration % args.reweight_every == 0:
                model.all_reduce(clip_stats)
                env.clip_weights = (clip_stats[1] / clip_stats[0].clamp(min=1)).clamp(min=0.05)
                clip_stats.zero_()

            # logging: one host read of everything (means over the ranks, episode sums over all of them)
            means = {"mean_reward": rewards.mean(), "policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(),
                     "approx_kl": torch.stack(approx_kls).mean(), "clipfrac": torch.stack(clipfracs).mean(),
                     "explained_variance": 1 - (b_returns - b_values).var() / b_returns.var(),
                     **{k: v / T for k, v in step_sums.items()}, **{k: v.float().mean() for k, v in env.psi.items()}}
            totals = {**episode_sums, "nan_resets": env.nan_resets}
            stack = lambda d: torch.stack([torch.as_tensor(v, device=device).float() for v in d.values()])
            mean_t, total_t = model.all_reduce(stack(means)), model.all_reduce(stack(totals))
            mean, total = dict(zip(means, (mean_t / world).tolist())), dict(zip(totals, total_t.tolist()))
            per_episode = {k: total[k] / total["episodes"] if total["episodes"] else float("nan")
                           for k in ("return", "length", "successes")}
            sps = (global_step - start_step) / (time.time() - start_time)
            clip_weights = [] if env.clip_weights is None else env.clip_weights.tolist()
            scalars = {"charts/mean_reward": mean["mean_reward"], "charts/episode_return": per_episode["return"],
                       "charts/episode_length": per_episode["length"], "charts/success_rate": per_episode["successes"],
                       "charts/gt_err_mm": 1000 * mean["gt_err_m"], "charts/mpjpe_mm": 1000 * mean["mpjpe_m"],
                       "charts/nan_resets": total["nan_resets"], "charts/SPS": sps, "iteration": iteration,
                       "charts/physics_time_fraction": env.physics_s / (time.time() - start_time),
                       "losses/actor_lr": actor_opt.param_groups[0]["lr"],
                       **{f"losses/{k}": mean[k] for k in ("policy_loss", "value_loss", "approx_kl", "clipfrac",
                                                           "explained_variance")},
                       **{f"rewards/{k}": mean[k] for k in envs.REWARD_COEFFS},
                       **{f"dr/{k}": mean[k] for k in env.psi},
                       **{f"clip_weight/{i}": w for i, w in enumerate(clip_weights)}}
            finished = dict(global_step=global_step, iteration=iteration, rng=random_streams(env, device, world))
            if writer is not None:
                for k, v in scalars.items():
                    writer.add_scalar(k, v, global_step)
                print(f"it {iteration} step {global_step:,}/{args.total_env_steps:,} | {sps:,.0f} env-steps/s | "
                      f"reward {mean['mean_reward']:.3f} | success {per_episode['successes']:.2f} | g-mpjpe "
                      f"{1000 * mean['gt_err_m']:.0f} mm | kl {mean['approx_kl']:.4f} | nan resets "
                      f"{total['nan_resets']:.0f} | ETA "
                      f"{(args.total_env_steps - global_step) / sps / 60:.1f} min", flush=True)
            keep = args.keep_every > 0 and iteration % args.keep_every == 0  # a crash does not rewrite a kept copy
            if keep or iteration % args.checkpoint_every == 0:
                save(keep)
    except BaseException:  # a crash still leaves the last whole iteration on disk (unless the weights went bad)
        if all(p.isfinite().all() for p in agent.parameters()):
            save()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if writer is not None:
            writer.close()
        env.close()
    save()
    if rank == 0:
        print(f"saved teacher.pt and the TensorBoard log in {run_dir}")
    return run_dir / "teacher.pt"


if __name__ == "__main__":
    try:
        preset, argv = tyro.cli(Preset, return_unknown_args=True, add_help=False)  # --preset NAME: the defaults
        if preset.preset not in PRESETS:
            raise InputError("--preset", f"unknown preset '{preset.preset}': choose one of {list(PRESETS)}")
        main(tyro.cli(Args, default=PRESETS[preset.preset], args=argv))
    except InputError as e:
        sys.exit(f"error: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
