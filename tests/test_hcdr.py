"""Tests of HCDR (m_t = QFormer(m_0, H_t)), and the psi probe: on a synthetic dynamical system with hidden parameters
psi, a linear head on m_t recovers psi, the same model without history does not."""
import torch
from torch import nn

from hcdr import HCDR

STATE_DIM, ACTION_DIM, K = 10, 29, 16


def make(seed=0):
    torch.manual_seed(seed)
    model = HCDR(STATE_DIM, ACTION_DIM, history_len=K, d_m=32, out_dim=64)
    history = torch.randn(3, K, STATE_DIM + ACTION_DIM)
    mask = torch.ones(3, K, dtype=torch.bool)
    mask[1, :5] = False  # env 1 started 11 steps ago: its 5 oldest entries are padding
    return model, history, mask


def test_output_shape():
    model, history, mask = make()
    assert model(history, mask).shape == (3, 64)
    assert HCDR(STATE_DIM)(history, mask).shape == (3, 512)  # defaults: action_dim 29, K 16, out_dim d_model 512


def test_padding_does_not_change_m_t():
    model, history, mask = make()
    garbage = history.clone()
    garbage[~mask] = torch.randn_like(garbage[~mask]) * 1e3
    garbage[1, 0] = float("nan")
    assert torch.equal(model(history, mask), model(garbage, mask))
    changed = history.clone()
    changed[1, 7] += 1.0  # a valid entry does matter
    assert not torch.allclose(model(history, mask)[1], model(changed, mask)[1])


def test_time_order_matters():
    model, history, mask = make()
    reversed_history = history.flip(1)  # same (s, a) pairs, opposite time order (rows 0 and 2 are fully valid)
    m_t, m_t_reversed = model(history, mask), model(reversed_history, mask)
    assert not torch.allclose(m_t[[0, 2]], m_t_reversed[[0, 2]], atol=1e-4)


def test_gradients_reach_queries():
    model, history, mask = make()
    model(history, mask).square().sum().backward()
    for p in (model.m_0, model.time_emb, model.embed_conv.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_all_invalid_history_gives_a_finite_learned_default():
    model, history, _ = make()
    mask = torch.zeros(3, K, dtype=torch.bool)
    m_t = model(history, mask)
    assert torch.isfinite(m_t).all()
    assert torch.allclose(m_t, m_t[:1].expand_as(m_t))  # independent of the (padding) content
    m_t.square().sum().backward()
    assert model.null.grad.abs().sum() > 0 and model.m_0.grad.abs().sum() > 0  # the default is learned


# --- the psi probe -------------------------------------------------------------------------------------------------
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


def test_probe_history_reveals_psi():
    """On spring-mass systems with hidden mass and delay, m_t predicts psi; the current state alone does not."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: 2 threads spin and crawl on a busy shared 2-core machine
    histories, masks, psi = synthetic_rollouts(num_envs=256, steps=64, history_len=K, record_every=8, seed=0)
    r2 = fit_psi_probe(histories, masks, psi, action_dim=1, iters=200, batch_size=128, lr=3e-3, seed=0,
                       d_m=32, out_dim=32)
    torch.set_num_threads(threads)
    print(r2)
    for k in psi:  # seeds 0-2 give HCDR >= 0.81, no history <= 0.19
        assert r2["hcdr"][k] > 0.6, r2
        assert r2["hcdr"][k] > r2["no_history"][k] + 0.4, r2
