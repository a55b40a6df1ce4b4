"""The network both HoRD stages share, and its checkpoints (nanoGPT's model.py): teacher.py trains `Agent`, student.py
distils it into a `TokenPolicy` of its own and reads the teacher with `load_teacher`; evaluate.py and export.py read
both; both trainers start their ranks here. Nothing here runs an env or a training loop.

The policy reads one token per stacked proprio step, one per future reference step (the student: its sparse keypoint
steps), a terrain token g_t and the HCDR token m_t; a transformer encoder mixes them and the output of token 0 (the
current state s_t) goes through an MLP head to 29 action means. The teacher's action is a residual around the next
reference joint positions, alpha = q_ref(t+1) + action_scale * a; its critic is a separate MLP on the privileged critic
observation (which includes psi).
"""
from __future__ import annotations

import dataclasses
import pathlib
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

import ssjr
from hcdr import HCDR
from ssjr import InputError


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """x summed over the torchrun ranks, in place (a plain run: x as it is); returns x."""
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


class RunningNorm(nn.Module):
    """Running mean/std of an observation (saved with the model; frozen at evaluation)."""

    def __init__(self, shape):
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("var", torch.ones(shape))
        self.register_buffer("count", torch.tensor(1e-4))

    @torch.no_grad()
    def update(self, x: torch.Tensor):
        x = x.reshape(-1, *self.mean.shape)
        x = x[torch.isfinite(x).flatten(1).all(-1)]
        # the batch of every rank (two passes): all ranks keep the same statistics
        sums = all_reduce(torch.stack([torch.full_like(self.mean, len(x)), x.sum(0)]))
        n = int(sums[0].flatten()[0])
        if n == 0:
            return
        batch_mean = sums[1] / n
        batch_var = all_reduce((x - batch_mean).pow(2).sum(0)) / n
        delta, total = batch_mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.var = (self.var * self.count + batch_var * n + delta.pow(2) * self.count * n / total) / total
        self.count = total

    def forward(self, x, clip: float = 10.0):
        # one new tensor, then in place: these stacks are the largest tensors of a CPU forward pass
        return (x - self.mean).div_(self.var.sqrt() + 1e-5).clamp_(-clip, clip)

    def denormalize(self, x):
        return x * (self.var.sqrt() + 1e-5) + self.mean


def mlp(sizes, act=nn.ELU, last_act=False):
    layers = [m for i in range(len(sizes) - 1) for m in (nn.Linear(sizes[i], sizes[i + 1]), act())]
    return nn.Sequential(*(layers if last_act else layers[:-1]))


class TokenPolicy(nn.Module):
    """`token_obs` names the [N, T_i, D_i] observation streams that become tokens (one Linear each), the first the
    proprio stack (oldest first in the env); it enters newest first, so that token 0, the one read out, is the current
    self-observation s_t (the paper's 'self-obs token')."""

    def __init__(self, layout: dict, token_obs: tuple[str, ...], args, hcdr: bool):
        super().__init__()
        d, self.token_obs = args.d_model, token_obs
        self.norms = nn.ModuleDict({k: RunningNorm(layout[k][-1]) for k in (*token_obs, "terrain")})
        self.embed = nn.ModuleDict({k: nn.Linear(layout[k][-1], d) for k in token_obs})
        self.terrain = nn.Sequential(nn.LayerNorm(layout["terrain"][0]),
                                     mlp([layout["terrain"][0], args.terrain_dim, args.terrain_dim], nn.ReLU, True),
                                     nn.Linear(args.terrain_dim, d))
        hist_dim = layout["history"][-1]
        self.hcdr = HCDR(hist_dim - ssjr.NUM_DOF, ssjr.NUM_DOF, layout["history"][0], args.hcdr_queries, args.hcdr_dim,
                         args.hcdr_layers, max(1, args.hcdr_dim // 32), out_dim=d) if hcdr else None
        self.history_norm = RunningNorm(hist_dim)
        self.history_frozen = False  # a student's shared, frozen HCDR keeps the teacher's history statistics
        n_tokens = sum(layout[k][0] for k in token_obs) + 1 + int(hcdr)
        self.pos = nn.Parameter(0.02 * torch.randn(n_tokens, d))
        layer = nn.TransformerEncoderLayer(d, args.num_heads, args.ff_dim, dropout=0.0, activation="relu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, args.num_layers, enable_nested_tensor=False)
        self.head = mlp([d, args.head_dim, args.head_dim, args.head_dim, ssjr.NUM_DOF], nn.ReLU)
        nn.init.zeros_(self.head[-1].weight)  # start at a = 0: alpha = the reference (teacher) / bias (student)
        nn.init.zeros_(self.head[-1].bias)

    def update_norms(self, obs):
        for k, norm in self.norms.items():
            norm.update(obs[k])
        if not self.history_frozen:
            self.history_norm.update(obs["history"][obs["history_mask"]])

    def forward(self, obs) -> torch.Tensor:
        tokens = [self.embed[k](self.norms[k](obs[k])) for k in self.token_obs]
        tokens[0] = tokens[0].flip(1)  # s_t, s_t-1, ...: token 0 is the current state
        tokens.append(self.terrain(self.norms["terrain"](obs["terrain"]))[:, None])
        if self.hcdr is not None:  # the HCDR token m_t
            tokens.append(self.hcdr(self.history_norm(obs["history"]), obs["history_mask"])[:, None])
        x = torch.cat(tokens, 1) + self.pos
        return self.head(self.encoder(x)[:, 0]).float()  # fp32 actions also under bf16 autocast


class Agent(nn.Module):
    """Teacher actor pi*(alpha | m_t, s_full, g_t, Y_full) and privileged critic V(s_critic)."""

    def __init__(self, layout: dict, args):
        super().__init__()
        self.actor = TokenPolicy(layout, ("proprio", "future") + ("psi",) * args.psi_actor, args, hcdr=not args.no_hcdr)
        # what the actor reads (to act, and to label a student's states; checked against a checkpoint's layout)
        self.actor_obs = (*self.actor.token_obs, "ref_dof_pos", "terrain", "history", "history_mask")
        self.critic_norm = RunningNorm(layout["critic"][0])
        self.critic = mlp([layout["critic"][0]] + [args.critic_dim] * 4 + [1])
        self.value_norm = RunningNorm(1) if args.value_norm else None  # statistics of the returns
        self.log_std, self.action_scale = args.log_std, args.action_scale

    def update_norms(self, obs):
        self.actor.update_norms(obs)
        self.critic_norm.update(obs["critic"])

    def value(self, obs, normalized: bool = False):
        """V(s) in return units (GAE), or as the critic outputs it (the loss: with --value-norm, normalized)."""
        v = self.critic(self.critic_norm(obs["critic"])).squeeze(-1).float()
        return v if normalized or self.value_norm is None else self.value_norm.denormalize(v)

    def dist(self, obs):
        mean = self.actor(obs)
        return torch.distributions.Normal(mean, torch.full_like(mean, self.log_std).exp())

    def forward(self, obs):
        """(pi, V) for the PPO loss: called as the module, so that under torchrun DDP averages the gradients."""
        return self.dist(obs), self.value(obs, normalized=True)

    def to_alpha(self, obs, a):
        return obs["ref_dof_pos"] + self.action_scale * a

    @torch.no_grad()
    def act(self, obs):
        """Deterministic PD targets (evaluation, DAgger labels)."""
        return self.to_alpha(obs, self.actor(obs))


# --- checkpoints: plain dicts (kind, args, env_cfg, obs_layout, model, ...) ------------------------------------------
def load_checkpoint(path, kind: str | tuple[str, ...] = ("teacher", "student")) -> dict:
    """A checkpoint of `kind` (one of them, for a tuple), or an error naming the file."""
    path, kinds = pathlib.Path(path), (kind,) if isinstance(kind, str) else kind
    if not path.is_file():
        raise InputError(path, "checkpoint not found")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        first_line = str(e).partition("\n")[0][:200]
        raise InputError(path, f"not a readable checkpoint ({type(e).__name__}: {first_line})")
    found = ckpt.get("kind") if isinstance(ckpt, dict) else type(ckpt).__name__
    if found not in kinds:
        raise InputError(path, f"expected a {' or '.join(kinds)} checkpoint, found {found!r}")
    if missing := [k for k in ("args", "obs_layout", "model", "env_cfg") if k not in ckpt]:
        raise InputError(path, f"{found} checkpoint without {missing} (from another version)")
    return ckpt


# Older checkpoints: a setting added since takes the value the code had before it (not today's default); a retired
# one (its lever measured no gain) is dropped.
ADDED_SETTINGS = {"actor_lr_max": 1e-3}
RETIRED_SETTINGS = ("ema_decay",)


def checkpoint_args(path, ckpt: dict, cls):
    """The checkpoint's settings as `cls` (teacher or student Args); a checkpoint of another version -> one line."""
    fields = {f.name for f in dataclasses.fields(cls)}
    saved = {k: v for k, v in ckpt["args"].items() if k not in RETIRED_SETTINGS}
    if unknown := sorted(set(saved) - fields):
        raise InputError(path, f"settings {unknown} are unknown to this version of {cls.__module__}.py")
    return cls(**{**{k: v for k, v in ADDED_SETTINGS.items() if k in fields}, **saved})


def resumed_args(args, ckpt: dict, presets: dict):
    """A resumed run's settings: its checkpoint's, in its folder, on this call's device and AMP, to its own budget and
    kept copies unless --total-env-steps or --keep-every name others (not the preset's defaults: a bare --resume
    finishes the run it continues, it does not stop at the cpu preset's 200k steps or go on to the paper's 1e9)."""
    saved = checkpoint_args(args.resume, ckpt, type(args))
    named = {k: getattr(args, k) for k in ("total_env_steps", "keep_every") if k in vars(saved)
             and getattr(args, k) != getattr(presets[args.preset], k)}
    return dataclasses.replace(saved, resume=args.resume, amp=args.amp, **named,
                               run_dir=str(pathlib.Path(args.resume).parent), device=args.device or saved.device)


def load_weights(path, module: nn.Module, state: dict):
    try:  # a checkpoint of another architecture (sizes, keys, optimizer groups) is one line naming the file
        module.load_state_dict(state)
    except (RuntimeError, ValueError) as e:
        raise InputError(path, f"the weights do not fit this version's model ({str(e).strip().splitlines()[-1][:90]})")


def check_layout(path, expected: dict, found: dict, keys):
    for k in keys:
        if list(expected.get(k, [])) != list(found.get(k, [])):
            raise InputError(path, f"observation layout mismatch for '{k}': checkpoint has {expected.get(k)}, this "
                                   f"env gives {found.get(k)} (different env version or settings)")


def load_teacher(path, device="cpu"):
    """(teacher Agent in eval mode, checkpoint dict): to evaluate, export or distil, with no teacher.py needed. The
    settings the network reads default to what a checkpoint from before they existed was trained with."""
    ckpt = load_checkpoint(path, "teacher")
    agent = Agent(ckpt["obs_layout"], SimpleNamespace(**{"psi_actor": False, **ckpt["args"]})).to(device)
    load_weights(path, agent, ckpt["model"])
    return agent.eval(), ckpt
