"""HCDR: the History-Conditioned Dynamics Representation of HoRD (paper, subsection "HCDR").

m_t = QFormer(m_0, H_t): N learnable query tokens m_0 read the last K (state, action) pairs H_t by cross-attention
and are pooled into one token m_t, which the teacher and student append to their transformer input.

`python hcdr.py probe --sim genesis --motions data/packets/g1_moves` checks that m_t carries the episode's hidden
dynamics psi: a linear head on m_t regresses psi from random-action rollouts, against the same head without history.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


class QFormerLayer(nn.Module):
    """Pre-norm block: the queries attend to each other, then to the history memory, then a feed-forward."""

    def __init__(self, d_m: int, num_heads: int):
        super().__init__()
        self.norm_self, self.norm_cross, self.norm_ff = nn.LayerNorm(d_m), nn.LayerNorm(d_m), nn.LayerNorm(d_m)
        self.self_attn = nn.MultiheadAttention(d_m, num_heads, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d_m, num_heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d_m, 4 * d_m), nn.GELU(), nn.Linear(4 * d_m, d_m))

    def forward(self, q: torch.Tensor, memory: torch.Tensor, ignore: torch.Tensor) -> torch.Tensor:
        x = self.norm_self(q)
        q = q + self.self_attn(x, x, x, need_weights=False)[0]
        q = q + self.cross_attn(self.norm_cross(q), memory, memory, key_padding_mask=ignore, need_weights=False)[0]
        return q + self.ff(self.norm_ff(q))


class HCDR(nn.Module):
    """Q-Former history encoder: history [B,K,S+A] (oldest first), mask [B,K] (True = valid) -> m_t [B,out_dim].

    Sizes (the paper leaves N, d_m, K open; all configurable):
    - history_len K=16: 0.32 s at 50 Hz. The 0-3 physics-step control delay and contact transients show within one or
      two control steps, the response to actuator gains and link masses within ~0.1-0.2 s; 16 steps hold a few such
      responses while the cross-attention stays cheap for thousands of envs.
    - num_queries N=4: roughly one query per kind of hidden dynamics (delay, inertia, actuator gains, gravity/contact).
    - d_m=128, num_layers=2, num_heads=4: a "lightweight Q-Former" (paper App.) next to the d=512 policy; d_m is
      about the size of one (s, a) entry, and the second layer lets each query refine its read after seeing the others.
    - kernel_steps=4: each token sees its step and the 3 before (the response to an action within ~80 ms).
    - out_dim: the policy's token width d_model (512 in the paper); the N output tokens are concatenated and projected.
    Inputs are expected normalized (the policy normalizes observations). Invalid entries (before the episode start)
    are zeroed and hidden from attention; an always-valid learned null slot in the memory keeps the attention defined
    when the whole history is invalid, so that m_t is then a learned default instead of NaN.
    """

    def __init__(self, state_dim: int, action_dim: int = 29, history_len: int = 16, num_queries: int = 4,
                 d_m: int = 128, num_layers: int = 2, num_heads: int = 4, kernel_steps: int = 4, out_dim: int = 512):
        super().__init__()
        # One token per step of H_t. A causal convolution over `kernel_steps` consecutive (s, a) pairs lets a token
        # express how the state answered the last actions (the evidence for delay, gains, mass); cross-attention alone
        # only averages per-step linear embeddings and is poor at such cross-step comparisons.
        self.kernel_steps = kernel_steps
        self.embed_conv = nn.Conv1d(state_dim + action_dim, d_m, kernel_steps)
        self.embed_mlp = nn.Sequential(nn.GELU(), nn.Linear(d_m, d_m))
        self.time_emb = nn.Parameter(0.02 * torch.randn(history_len, d_m))  # learned position of each step in H_t
        self.null = nn.Parameter(0.02 * torch.randn(1, 1, d_m))          # always-valid memory slot
        self.memory_norm = nn.LayerNorm(d_m)
        self.m_0 = nn.Parameter(0.02 * torch.randn(num_queries, d_m))    # the prior tokens m_0 [N, d_m]
        self.layers = nn.ModuleList(QFormerLayer(d_m, num_heads) for _ in range(num_layers))
        self.out_norm = nn.LayerNorm(d_m)
        self.out = nn.Linear(num_queries * d_m, out_dim)                 # pool N tokens into one m_t

    def forward(self, history: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch = history.shape[0]
        x = torch.where(mask[..., None], history, 0.0).transpose(1, 2)  # [B, S+A, K], invalid entries zeroed
        x = nn.functional.pad(x, (self.kernel_steps - 1, 0))             # causal: token k sees k-kernel_steps+1..k
        tokens = self.embed_mlp(self.embed_conv(x).transpose(1, 2)) + self.time_emb
        memory = self.memory_norm(torch.cat([self.null.expand(batch, -1, -1), tokens], dim=1))
        ignore = torch.cat([mask.new_zeros(batch, 1), ~mask], dim=1)  # key_padding_mask: True = not attended
        m = self.m_0.expand(batch, -1, -1)
        for layer in self.layers:
            m = layer(m, memory, ignore)
        return self.out(self.out_norm(m).flatten(1))


def fit_psi_probe(histories: torch.Tensor, masks: torch.Tensor, psi: dict[str, torch.Tensor], action_dim: int,
                  iters: int = 600, batch_size: int = 256, lr: float = 1e-3, eval_every: int = 100, seed: int = 0,
                  **hcdr_kwargs) -> dict[str, dict[str, float]]:
    """Held-out R^2 of psi regressed by a linear head on m_t, with and without history.

    histories [E,T,K,D], masks [E,T,K], psi {name: [E,T]}: T samples from each of E envs. HCDR and a linear head on
    m_t are trained end-to-end (MSE on standardized psi) on the first 3/8 of the envs; each psi component is read at
    the iterate with its lowest error on the next 1/8 (early stopping: with few episodes the model soon recognizes
    each training episode and memorizes its psi); R^2 is measured on the other half. The "no_history" baseline is the
    same model and head with the mask cut to the last entry (the last played pair (s_{t-1}, alpha_{t-1})). psi
    components that are constant in the training envs get R^2 = nan.
    Returns {"hcdr": {name: r2}, "no_history": {name: r2}}.
    """
    samples_per_env = histories.shape[1]
    fit, val = histories.shape[0] * 3 // 8 * samples_per_env, histories.shape[0] // 2 * samples_per_env
    x, m = histories.flatten(0, 1).float(), masks.flatten(0, 1).bool()
    y = torch.stack([v.flatten().float() for v in psi.values()], dim=-1)
    # Standardize inputs over the valid entries of the fit + early-stopping envs, targets over their samples (the test
    # half plays no part).
    valid = x[:val][m[:val]]
    x = (x - valid.mean(0)) / valid.std(0).clamp_min(1e-6)
    varies = y[:val].std(0) > 1e-6
    y = y[:, varies]
    y = (y - y[:val].mean(0)) / y[:val].std(0)
    last_only = torch.zeros_like(m)
    last_only[:, -1] = True

    results = {}
    for name, probe_mask in (("hcdr", m), ("no_history", m & last_only)):
        torch.manual_seed(seed)
        encoder = HCDR(x.shape[-1] - action_dim, action_dim, history_len=x.shape[1], **hcdr_kwargs)
        model = nn.ModuleDict({"encoder": encoder, "head": nn.Linear(encoder.out.out_features, y.shape[-1])})

        def predict(rows: slice) -> torch.Tensor:  # in chunks, to bound memory
            with torch.no_grad():
                return torch.cat([model.head(encoder(x[rows][i:i + 4096], probe_mask[rows][i:i + 4096]))
                                  for i in range(0, len(x[rows]), 4096)])

        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        best_val_mse = torch.full((y.shape[-1],), float("inf"))
        test_pred = torch.zeros_like(y[val:])
        for i in range(iters):
            idx = torch.randint(fit, (batch_size,))
            loss = (model.head(encoder(x[idx], probe_mask[idx])) - y[idx]).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if (i + 1) % eval_every == 0:  # early stopping per psi component, on the validation envs
                val_mse = (predict(slice(fit, val)) - y[fit:val]).square().mean(0)
                better = val_mse < best_val_mse
                if better.any():
                    best_val_mse = torch.minimum(val_mse, best_val_mse)
                    test_pred[:, better] = predict(slice(val, None))[:, better]
        test_y = y[val:]
        r2 = 1 - (test_pred - test_y).square().sum(0) / (test_y - test_y.mean(0)).square().sum(0)
        r2_iter = iter(r2.tolist())
        results[name] = {k: next(r2_iter) if v else float("nan") for k, v in zip(psi, varies.tolist())}
    return results


def synthetic_rollouts(num_envs: int, steps: int, history_len: int = 16, record_every: int = 4, seed: int = 0):
    """1-D damped spring-mass systems driven by random forces, with a hidden psi per episode (mass, control delay).

    Mirrors the env's history buffer (oldest first, mask False before the episode start). The current (x, v, force)
    says little about psi; how x and v respond to the past forces reveals it.
    Returns histories [E,T,K,3], masks [E,T,K], psi {name: [E,T]} with T = steps // record_every.
    """
    g = torch.Generator().manual_seed(seed)
    dt_s, damping, stiffness = 0.02, 0.5, 4.0
    mass_kg = 0.5 + 1.5 * torch.rand(num_envs, generator=g)
    delay_steps = torch.randint(0, 4, (num_envs,), generator=g)
    x_m, v_m_s = torch.zeros(num_envs), torch.zeros(num_envs)
    past_forces = torch.zeros(num_envs, 4)  # the last 4 commands, newest last: the delayed one is applied
    history, mask = torch.zeros(num_envs, history_len, 3), torch.zeros(num_envs, history_len, dtype=torch.bool)
    histories, masks = [], []
    for t in range(steps):
        force = torch.randn(num_envs, generator=g)
        past_forces = torch.cat([past_forces[:, 1:], force[:, None]], dim=1)
        applied = past_forces.gather(1, (3 - delay_steps)[:, None])[:, 0]
        history = torch.cat([history[:, 1:], torch.stack([x_m, v_m_s, force], -1)[:, None]], dim=1)
        mask = torch.cat([mask[:, 1:], mask.new_ones(num_envs, 1)], dim=1)
        v_m_s = v_m_s + dt_s * (applied - damping * v_m_s - stiffness * x_m) / mass_kg
        x_m = x_m + dt_s * v_m_s
        if t % record_every == record_every - 1:
            histories.append(history)
            masks.append(mask)
    psi = {"mass_kg": mass_kg, "delay_steps": delay_steps.float()}
    num_records = len(histories)
    return (torch.stack(histories, 1), torch.stack(masks, 1),
            {k: v[:, None].expand(-1, num_records) for k, v in psi.items()})


@dataclass
class Args:
    sim: Literal["genesis", "isaaclab", "synthetic"] = "genesis"
    """physics engine of envs.make_env, or 'synthetic' (spring-mass systems, no robot)"""
    num_envs: int = 1024
    """parallel envs; 3/8 fit the probe, 1/8 early-stop it, the other half tests it (random actions fall in ~1 s, so
    each env plays several episodes; fewer than ~1000 training episodes let the probe memorize them instead)"""
    steps: int = 100
    """control steps (50 Hz) to roll out"""
    record_every: int = 2
    """record (history, mask, psi) every this many control steps"""
    action_noise_rad: float = 0.2
    """std of the random PD-target offsets around the reference joint positions"""
    motions: str = "data/packets/g1_moves"
    """SSJR packet folder (or file) for envs.make_env"""
    iters: int = 600
    """probe training iterations (Adam, minibatch 256)"""
    seed: int = 0
    """seed of the env, the actions and the probe"""
    torch_threads: int = 1
    """torch CPU threads (more only spin on a busy machine: the probe's matmuls are small)"""


def env_rollouts(args: Args):
    """Random-action rollouts of envs.make_env: histories [E,T,K,D], masks [E,T,K], psi {name: [E,T]}."""
    import envs  # imported here so that the module and its tests need no simulator

    env = envs.make_env(sim=args.sim, num_envs=args.num_envs, device="cpu", motions=args.motions, dr=envs.DR(),
                        terrain="flat", seed=args.seed)
    obs = env.reset()
    g = torch.Generator().manual_seed(args.seed)
    histories, masks, psis = [], [], []
    for t in range(args.steps):
        history, mask = obs["history"], obs["history_mask"]
        noise = args.action_noise_rad * torch.randn(obs["ref_dof_pos"].shape, generator=g)
        obs, _, _, info = env.step(obs["ref_dof_pos"] + noise)  # PD targets: the reference joints plus noise
        if t % args.record_every == args.record_every - 1:
            histories.append(history)  # H_t paired with the psi of the step played from it (resets resample psi)
            masks.append(mask)
            psis.append(info["psi"])
    psi = {k: torch.stack([p[k] for p in psis], 1) for k in psis[0]}
    return torch.stack(histories, 1), torch.stack(masks, 1), psi


def probe(args: Args) -> dict[str, dict[str, float]]:
    """Collect rollouts, fit the psi probe, print the R^2 table."""
    torch.set_num_threads(args.torch_threads)
    if args.sim == "synthetic":
        histories, masks, psi = synthetic_rollouts(args.num_envs, args.steps, record_every=args.record_every,
                                                   seed=args.seed)
        action_dim = 1
    else:
        histories, masks, psi = env_rollouts(args)
        action_dim = 29
    r2 = fit_psi_probe(histories, masks, psi, action_dim, iters=args.iters, seed=args.seed)
    print(f"psi probe R^2 on held-out envs ({args.sim}, {args.num_envs} envs, {args.steps} steps)")
    print(f"{'psi':<16}{'HCDR m_t':>10}{'no history':>12}")
    for k in psi:
        print(f"{k:<16}{r2['hcdr'][k]:>10.3f}{r2['no_history'][k]:>12.3f}")
    return r2


if __name__ == "__main__":
    import sys
    import tyro
    from ssjr import InputError
    try:
        probe(tyro.extras.subcommand_cli_from_dict({"probe": Args}))
    except InputError as e:
        sys.exit(f"error: {e}")
