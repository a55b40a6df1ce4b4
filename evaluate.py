"""Evaluate HoRD checkpoints the way the paper does (App. D metrics, Table 1 layout) with one command.

    python evaluate.py --ckpt runs/<run>/teacher.pt                               # teacher or student
    python evaluate.py --ckpt hord.pt no_hcdr.pt no_dr.pt --labels HoRD "HoRD w/o HCDR" "HoRD w/o DR"
    python evaluate.py --ckpt s.pt --motions data/keypoints/cmu_bvh --settings genesis   # human keypoint commands
    python evaluate.py --ckpt s.pt --settings genesis --seeds 0 --episodes 1 --max-steps 100   # smoke run
    python evaluate.py --ckpt t.pt s0.pt s1.pt s2.pt --labels teacher student student student   # training runs

Settings: `<engine>[+dr|+noise][<k>][@<terrain>][:<cell>...]`; engine in ENGINES, in_domain (the first checkpoint's
env_cfg["sim"]) or zero_shot (ZERO_SHOT); +dr = envs.DR() (paper Table 5: dynamics psi, pushes, sensor noise);
+noise = envs.DR.noise_only() (the sensor noise alone: the nominal setting as a rate); k: every sensor-noise std times k
(the same draws scaled: `genesis+noise0.1`); terrain in envs.TERRAIN_TYPES. Cells: with +dr, GRID cells
(`mujoco+dr:delay8`; `grid`: every cell on the in-domain engine, `genesis+dr:grid` on Genesis, and their mean) and the
m_t diagnostics M_T_PROBES (`mujoco+dr:mt_shuffled`: does the policy use its history?); with any setting, CLIPPED.

Episodes. Under +dr (and +noise) every episode draws its own psi (body terms included), tile, pushes and sensor noise
from a stream seeded by (seed, clip, episode) alone (envs.START_MODES): the episodes are independent samples, and those
of two checkpoints with the same key met the same draws (pairs). Without DR an episode is fixed by its clip and tile,
and the deterministic policy plays it the same way every time: one episode per clip and seed, reported as near-identical
starts without an interval. Checkpoints sharing a label are training runs (e.g. seeds) of one method: the run is their
unit.

A human keypoint command commands only the SSJR keypoint bodies: its own report section scores it by the keypoint
error and the falls; its full-body metrics are NaN. An episode runs from frame 0 until its clip ends, its simulation
blows up, or GTE_t > 0.5 m (keypoint command: the mean keypoint error; env termination="mean"): an early end is never a
success. The errors are of the states the env judged, after every step. Per episode of T steps (50 Hz), B=30 bodies:

  GTE_t        = mean_b ||p_ref_tb - p_tb||  (the per-frame g-mpjpe)         (world frame, m)
  success      = max_t GTE_t < 0.5 m and every error finite                   (the paper's success, %)
  success_strict = max_t max_b ||p_ref_tb - p_tb|| < 0.5 m       (every body within 0.5 m: the training termination, %)
  steps        = control steps survived (the clip's length for a success)
  g-mpjpe      = mean_t GTE_t                                                 (world frame, mm)
  mpjpe        = mean_t mean_b ||L_ref_t (p_ref_tb - p_ref_t0) - L_t (p_tb - p_t0)||   (mm; body 0 = pelvis, L_t =
                 inverse heading (yaw) rotation of that pose's root: ProtoMotions' cartesian_err, ssjr.root_relative;
                 a rigid translation or a turn about the vertical gives 0, tilts and limb errors count)
  gr_err       = mean_t mean_b angle(q_tb, q_ref_tb)                          (geodesic, rad; also degrees)
  <x>_rew      = mean_t exp(-c_x err_t), c_x in REWARD_C (ProtoMotions' mimic coefficients), err_t of
    dv   sum_j (qdot_tj - qdot_ref_tj)^2       joint velocity (rad/s), j = the 29 hinges
    kb   mean_k ||b_tk - b_ref_tk||^2          key bodies = ssjr.KEYPOINT_BODY_IDS, world frame
    lr   mean_j angle(lr_tj, lr_ref_tj)        local rotation of body j+1 in its parent's frame
    rv   ||v_t - v_ref_t||^2                   root linear velocity, world frame (m/s)
    rav  ||w_t - w_ref_t||^2                   root angular velocity, world frame (rad/s)
  keypoint_err = mean_t mean_k ||b_tk - b_ref_tk||, k = the SSJR keypoint bodies   (world frame, mm; every command)
  fell         = the env ended the episode early: its failure test or a blown-up simulation   (%; every command)
  targets_outside_pct = the share of steps with a PD target beyond its MJCF joint range; target_excess_deg: by how
  much, over those joint-steps; at_stop_pct: steps with a joint within AT_STOP_RAD of its stop; stop_torque_nm: the
  mean |torque| of those joints (env episodes; `:clipped` clamps the targets to the ranges, as a robot's safety layer)
  Velocities are one-step finite differences (dt = envs.CONTROL_DT_S), the same for robot and reference:
  v_t = (p_t+1,0 - p_t,0)/dt, w_t = rotvec(q_t+1,0 q_t,0^-1)/dt, |qdot - qdot_ref| = angle(lr_t^-1 lr_t+1,
  lr_ref_t^-1 lr_ref_t+1)/dt (exact for hinges); NaN if T < 2.

Aggregation (a blown-up episode fails and its errors are left out of the means): one checkpoint: the mean over its
episodes with a 95 % interval over the independent ones (rates: Wilson; other metrics: Student t); several runs: the
mean of the runs' means, Student-t interval over the runs. Push recovery (+dr): the success rate of the episodes pushed
at least once. Comparisons against the first label, per setting and metric: the paired difference (episodes paired by
(clip, seed, episode)), McNemar's exact test for the 0/1 metrics and scipy.stats.ttest_rel for the others; for runs, the
per-run paired differences (runs paired in the order given; one reference run serves them all), their mean, t-interval
and one-sample t-test over the runs. p < --alpha is flagged `*`. Pictures of a motion: `python ssjr.py show <packet>`.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import math
import pathlib
import re
import sys
import warnings

import numpy as np
import torch
import tyro
from scipy import stats

import envs
import model
import ssjr
import student

SUCCESS_THRESHOLD_M = 0.5  # paper: an episode fails once the global translation error exceeds 0.5 m
REWARD_C = {"dv": 0.002, "kb": 10.0, "lr": 0.2, "rv": 0.5, "rav": 0.1}  # c of exp(-c * err); ProtoMotions' values
METRICS = ("success", "success_strict", "g_mpjpe_mm", "mpjpe_mm", "gr_err_rad", "gr_err_deg",
           "dv_rew", "kb_rew", "lr_rew", "rv_rew", "rav_rew")  # full body: NaN for human keypoint commands
KEYPOINT_METRICS = ("keypoint_err_mm", "fell", "steps")  # every command
JOINT_METRICS = ("targets_outside_pct", "target_excess_deg", "at_stop_pct", "stop_torque_nm")  # env episodes
ALL_METRICS = METRICS + KEYPOINT_METRICS + JOINT_METRICS
PERCENT = {"success", "success_strict", "fell"}  # 0/1 per episode, reported in % (McNemar's test)
LOWER_IS_BETTER = {"g_mpjpe_mm", "mpjpe_mm", "gr_err_rad", "gr_err_deg", "keypoint_err_mm", "fell", *JOINT_METRICS}
TABLE1_METRICS = (("success", "Succ. (%)↑"), ("steps", "steps↑"), ("g_mpjpe_mm", "g-mpjpe (mm)↓"),
                  ("mpjpe_mm", "mpjpe (mm)↓"))
KEYPOINT_TABLE = (("keypoint_err_mm", "keypoint err (mm)↓"), ("fell", "falls (%)↓"), ("steps", "steps↑"))
ROBOT, HUMAN_KEYPOINTS = "robot", "human_keypoints"  # the packet kinds (ssjr.packet_kind)
ENGINES = {"isaaclab": "IsaacLab", "genesis": "Genesis", "genesis_aligned": "Genesis aligned", "mujoco": "MuJoCo"}
# zero_shot: the engine least like the training one (Isaac Lab 3.0 steps MuJoCo-Warp: MuJoCo and Isaac Lab are twins)
ZERO_SHOT = {"isaaclab": "genesis", "genesis": "isaaclab", "genesis_aligned": "isaaclab", "mujoco": "genesis"}
# The grid of unseen dynamics: +DR with one psi term set beyond its training range (envs.DR: delay 0-3 physics steps,
# gains, masses x0.9-1.1, friction 0.6-1.2, contact 0.01-0.03 s), declared in docs/experiments.md before any result
GRID = {"delay5-6": {"delay_steps": (5, 6)}, "delay8": {"delay_steps": (8, 8)},
        **{f"gains{x}": {"kp_scale": (x, x), "kd_scale": (x, x)} for x in (0.75, 1.25)},
        **{f"mass{x}": {"mass_scale": (x, x)} for x in (0.8, 1.2)},
        **{f"friction{x}": {"friction": (x, x)} for x in (0.3, 1.5)},
        "contact0.04": {"contact_timeconst_s": (0.04, 0.04)}}
# m_t diagnostics: the policy's history H_t emptied (m_t from no evidence) or rolled across the envs (another episode's)
M_T_PROBES = ("mt_empty", "mt_shuffled")
CLIPPED = "clipped"  # cell: the env clamps the PD targets to the joint ranges (envs.make_env's clamp_targets)
AT_STOP_RAD = 0.01  # a joint this close to an end of its range sits at its stop
PROBE_STEPS = (20, 160)  # --probe: the control steps of each episode whose features are collected
RECORDED = ("body_pos_w", "ref_body_pos_w", "body_quat_w", "ref_body_quat_w")
# per step and joint [T,29]: how far the played target lies beyond the joint's range (> 0: outside), how far the joint
# the policy read lies from its nearer stop, and the torque of the first physics step (whose PD law read that joint)
JOINT_RECORDED = ("target_excess_rad", "stop_gap_rad", "joint_torque_nm")
Z95 = stats.norm.ppf(0.975)


@dataclasses.dataclass
class Args:
    ckpt: tuple[str, ...] = ()  # teacher.py / student.py checkpoints: the rows of one table, the first its reference
    labels: tuple[str, ...] = ()  # one row name per checkpoint (default: file stems); shared labels: runs of one method
    settings: tuple[str, ...] = ("isaaclab", "isaaclab+dr", "genesis", "genesis+dr",
                                 "zero_shot@smooth_slope", "zero_shot@rough_slope")
    """evaluation settings, `<engine>[+dr|+noise][<k>][@<terrain>][:<cell>]` or `grid` (see the module docstring)"""
    motions: str = ""  # '' = the test split (ssjr.TEST_CLIPS); else a folder/file of packets and/or keypoint commands
    packet_dir: str = str(ssjr.REPO / "data" / "packets" / "g1_moves")  # searched recursively for test-split packets
    seeds: tuple[int, ...] = (0, 1, 2)  # they seed each episode's psi, tile, pushes and noise (with its clip and index)
    episodes: int = 2  # episodes per clip and seed under +dr (without DR one: they would be near-identical)
    num_envs: int = 16  # parallel envs (capped at clips x episodes)
    device: str = "cpu"  # torch / simulation device
    max_steps: int = 0  # cap on each rollout's control steps; unfinished episodes are recorded as truncated (0 = none)
    out_dir: str = "results/eval"  # where table.md, episodes.csv and summary.json go
    alpha: float = 0.01  # significance level of the paired tests
    onnx: tuple[str, ...] = ()  # ONNX students (export.py) played by deploy.py in MuJoCo: settings deploy[+drift<v>]
    onnx_labels: tuple[str, ...] = ()  # ONNX row names (default: stems); a checkpoint's label puts the export beside it
    root_drift_mps: tuple[float, ...] = (0.0,)
    """deploy settings: drift speed of the root position estimate (a random horizontal direction per seed)"""
    render: str = ""  # draw the first episode (.png: 8 frames, .gif, .mp4): robot blue, reference keypoints orange
    parity: bool = False
    """instead of evaluating: on the first motion, compare deploy.py's inputs with the MuJoCo env's and the ONNX
    (--onnx) actions with the student's (--ckpt); print the first term beyond tolerance or 'all inputs match'"""
    probe: bool = False
    """instead of evaluating: on the first setting (+dr) and motion, R² on held-out episodes of a ridge regression of
    each psi term from the policy's m_t, from the current sparse state s_t alone and from the raw history H_t"""


# --- 1. Metrics: pure functions over one episode's arrays, positions [T,B,3] (m), quaternions [T,B,4] (wxyz). ---
def reward_terms(pos: torch.Tensor, quat: torch.Tensor, ref_pos: torch.Tensor, ref_quat: torch.Tensor, dt_s: float):
    """The reward-aligned terms dv/kb/lr/rv/rav_rew = mean_t exp(-REWARD_C * err_t) (errors: module docstring)."""
    lr, ref_lr = (ssjr.quat_mul(ssjr.quat_conj(q[:, list(ssjr.BODY_PARENTS[1:])]), q[:, 1:]) for q in (quat, ref_quat))
    err = {"kb": (pos - ref_pos)[:, list(ssjr.KEYPOINT_BODY_IDS)].pow(2).sum(-1).mean(-1),
           "lr": ssjr.quat_angle(lr, ref_lr).mean(-1)}
    if len(pos) > 1:  # one-step finite differences [T-1]: joint, root linear and root angular (world) velocities
        step, ref_step = (ssjr.quat_mul(ssjr.quat_conj(q[:-1]), q[1:]) for q in (lr, ref_lr))
        err["dv"] = (ssjr.quat_angle(step, ref_step) / dt_s).pow(2).sum(-1)
        v, v_ref = ((p[1:, 0] - p[:-1, 0]) / dt_s for p in (pos, ref_pos))
        w, w_ref = (ssjr.quat_to_rotvec(ssjr.quat_mul(q[1:, 0], ssjr.quat_conj(q[:-1, 0]))) / dt_s
                    for q in (quat, ref_quat))
        err["rv"], err["rav"] = (v - v_ref).pow(2).sum(-1), (w - w_ref).pow(2).sum(-1)
    return {f"{k}_rew": float(torch.exp(-REWARD_C[k] * err[k]).mean()) if k in err else math.nan for k in REWARD_C}


def episode_metrics(rec: dict, dt_s: float = envs.CONTROL_DT_S, command: str = ROBOT) -> dict[str, float]:
    """The metrics of a recorded episode (RECORDED arrays [T,B,.], JOINT_RECORDED [T,29] if recorded; numpy or torch):
    ALL_METRICS but fell, plus max_gte_m, max_keypoint_err_m; the full-body ones are NaN for a keypoint command."""
    pos, ref_pos, quat, ref_quat = (torch.as_tensor(np.asarray(rec[k]), dtype=torch.float64) for k in RECORDED)
    err = envs.body_error_metrics(pos, ref_pos)  # per step [T]; the env's info["metrics"] are the same functions
    gte = err["gt_err_m"]  # GTE_t: the mean over the bodies
    within = lambda e: float(bool(torch.isfinite(e).all() and e.max() < SUCCESS_THRESHOLD_M))  # noqa: E731
    local, ref_local = (ssjr.root_relative(p, p[:, 0], q[:, 0]) for p, q in ((pos, quat), (ref_pos, ref_quat)))
    gr = float(ssjr.quat_angle(quat, ref_quat).mean())
    out = {"success": within(gte), "success_strict": within(err["max_body_err_m"]), "max_gte_m": float(gte.max()),
           "g_mpjpe_mm": 1000 * float(gte.mean()), "mpjpe_mm": 1000.0 * float((ref_local - local).norm(dim=-1).mean()),
           "gr_err_rad": gr, "gr_err_deg": math.degrees(gr), **reward_terms(pos, quat, ref_pos, ref_quat, dt_s)}
    if command == HUMAN_KEYPOINTS:
        out.update(dict.fromkeys((*METRICS, "max_gte_m"), math.nan))
    out.update(dict.fromkeys(JOINT_METRICS, math.nan))
    if "stop_gap_rad" in rec:  # the joints against their ranges: targets_outside and at_stop are shares of the steps
        excess, gap, tau = (np.asarray(rec[k], np.float64) for k in JOINT_RECORDED)
        outside, at_stop = excess > 0, gap < AT_STOP_RAD
        out.update(targets_outside_pct=100 * outside.any(-1).mean(), at_stop_pct=100 * at_stop.any(-1).mean())
        if outside.any():
            out["target_excess_deg"] = math.degrees(excess[outside].mean())
        if at_stop.any():
            out["stop_torque_nm"] = np.abs(tau[at_stop]).mean()
    return {**out, "keypoint_err_mm": 1000.0 * float(err["keypoint_err_m"].mean()), "steps": float(len(pos)),
            "max_keypoint_err_m": float(err["max_keypoint_err_m"].max())}


# --- 2. Statistics over episode rows (dicts: label, ckpt, setting, seed, clip, episode, metrics...). ---
def group(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def wilson(k: float, n: int) -> tuple[float, float]:
    """95 % Wilson score interval of a rate, k successes in n > 0 independent trials."""
    p, z2 = k / n, Z95 ** 2
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_rate_difference(a, b) -> tuple[float, float, float]:
    """(mean(a) - mean(b), 95 % interval) of paired 0/1 outcomes: Newcombe's hybrid score interval (method 10 of
    Newcombe 1998, Stat. Med. 17:2635), built from the two Wilson intervals and the pairs' correlation phi."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    if not (n := len(a)):
        return math.nan, math.nan, math.nan
    both, only_a, only_b, neither = (a & b).sum(), (a & ~b).sum(), (~a & b).sum(), (~a & ~b).sum()
    (p1, (l1, u1)), (p2, (l2, u2)) = ((x.mean(), wilson(int(x.sum()), n)) for x in (a, b))
    denominator = float((both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither))
    phi = float(both * neither - only_a * only_b) / math.sqrt(denominator) if denominator > 0 else 0.0
    d = float(p1 - p2)
    lo = d - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    hi = d + math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return d, lo, hi


def t_interval(xs) -> tuple[float, float, float]:
    """(mean, 95 % Student-t interval) of independent samples; NaN interval for fewer than 2."""
    xs = np.asarray(xs, np.float64)
    mean = float(xs.mean()) if len(xs) else math.nan
    if len(xs) < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf(0.975, len(xs) - 1) * xs.std(ddof=1) / math.sqrt(len(xs)))
    return mean, mean - half, mean + half


def estimate(rows: list[dict], metric: str, independent: bool) -> dict:
    """`metric` over the rows of one label and setting (Aggregation): {mean, lo, hi (95 %), n, runs}; rates in %."""
    scale = 100.0 if metric in PERCENT else 1.0  # runs: the finite values, one list per checkpoint, in the given order
    runs = [xs for sel in group(rows, "ckpt").values()  # a metric a row lacks (an older episodes.csv): NaN
            if (xs := [x for r in sel if math.isfinite(x := r.get(metric, math.nan))])]
    if not runs:
        return {"mean": math.nan, "lo": math.nan, "hi": math.nan, "n": 0, "runs": 0}
    if len(runs) > 1:
        mean, lo, hi = t_interval([np.mean(xs) for xs in runs])
        if metric in PERCENT:  # a rate stays within 0..100 %
            lo, hi = max(lo, 0.0), min(hi, 1.0)
    elif not independent:
        mean, lo, hi = float(np.mean(runs[0])), math.nan, math.nan
    elif metric in PERCENT:
        mean, (lo, hi) = float(np.mean(runs[0])), wilson(sum(runs[0]), len(runs[0]))
    else:
        mean, lo, hi = t_interval(runs[0])
    return {"mean": scale * mean, "lo": scale * lo, "hi": scale * hi, "n": sum(map(len, runs)), "runs": len(runs)}


def paired_ttest(a, b) -> tuple[float, float, int]:
    """Two-sided paired t-test (scipy.stats.ttest_rel) of a vs b over the pairs without a NaN -> (t, p, df): NaN for
    fewer than 2 pairs; identical samples give t=0, p=1 (scipy: 0/0 = NaN), a constant difference t=+-inf, p=0."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    keep = np.isfinite(a - b)
    if keep.sum() < 2:
        return math.nan, math.nan, max(int(keep.sum()) - 1, 0)
    if np.all(a[keep] == b[keep]):
        return 0.0, 1.0, int(keep.sum()) - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a constant difference: 'precision loss' (sd = 0)
        r = stats.ttest_rel(a[keep], b[keep])
    return float(r.statistic), float(r.pvalue), int(r.df)


def mcnemar(a, b) -> float:
    """McNemar's exact test of paired 0/1 outcomes: the two-sided binomial p of the discordant pairs (1 if none)."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    only_a, only_b = int((a & ~b).sum()), int((~a & b).sum())
    return float(stats.binomtest(only_a, only_a + only_b).pvalue) if only_a + only_b else 1.0


def pairs(rows: list[dict], ref_rows: list[dict], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, reference values) of the episodes both have, paired by (clip, seed, episode), without NaN."""
    key = lambda r: (r["clip"], r["seed"], r["episode"])  # noqa: E731
    ref = {key(r): r[metric] for r in ref_rows}
    both = np.array([(r[metric], ref[key(r)]) for r in rows if key(r) in ref], np.float64).reshape(-1, 2)
    both = both[np.isfinite(both).all(1)]
    return both[:, 0], both[:, 1]


def compare(rows: list[dict], ref_rows: list[dict], metric: str, independent: bool) -> dict:
    """`rows` - `ref_rows` of one setting (Aggregation): {diff, lo, hi (95 % interval), p, test, n (pairs), runs}, rates
    in points. Several runs against one reference run leave out that run's own spread: the test says so."""
    scale = 100.0 if metric in PERCENT else 1.0
    runs, ref_runs = list(group(rows, "ckpt").values()), list(group(ref_rows, "ckpt").values())
    if not runs or not ref_runs or 1 not in (len(runs), len(ref_runs)) and len(runs) != len(ref_runs):
        return {**dict.fromkeys(("diff", "lo", "hi", "p"), math.nan), "test": "runs not pairable", "n": 0, "runs": 0}
    k = max(len(runs), len(ref_runs))
    paired = [pairs(runs[i % len(runs)], ref_runs[i % len(ref_runs)], metric) for i in range(k)]
    n = sum(len(a) for a, _ in paired)
    if k > 1:
        diffs = [float(np.mean(a - b)) for a, b in paired if len(a)]
        diff, lo, hi = t_interval(diffs)
        if metric in PERCENT:  # a difference of rates stays within -100..100 points
            lo, hi = max(lo, -1.0), min(hi, 1.0)
        p = float(stats.ttest_1samp(diffs, 0.0).pvalue) if len(diffs) > 1 and np.ptp(diffs) > 0 else math.nan
        test = f"t over {len(diffs)} runs" + ("" if len(runs) == len(ref_runs) else " (vs one run)")
    else:
        (a, b), = paired
        if metric in PERCENT:
            (diff, lo, hi), p, test = paired_rate_difference(a, b), mcnemar(a, b), "McNemar"
        else:
            (diff, lo, hi), p, test = t_interval(a - b), paired_ttest(a, b)[1], "paired t"
        if not independent:
            lo, hi, p, test = math.nan, math.nan, math.nan, "near-identical starts"
    return {"diff": scale * diff, "lo": scale * lo, "hi": scale * hi, "p": p, "test": test, "n": n, "runs": len(runs)}


def comparison_rows(rows: list[dict], labels: list[str], settings: list[Setting], alpha: float,
                    metrics=ALL_METRICS) -> list[dict]:
    """Every label against every label before it (w/o HCDR vs teacher and vs student), per setting and finite metric."""
    by = group(rows, "label", "setting")
    out = [{"label": label, "reference": reference, "setting": s.name, "metric": m,
            **compare(by.get((label, s.name), []), by.get((reference, s.name), []), m, s.dr)}
           for j, label in enumerate(labels) for reference in labels[:j] for s in settings
           for m in metrics if any(math.isfinite(r.get(m, math.nan)) for r in rows)]
    return [{**c, "significant": bool(c["p"] < alpha)} for c in out]


# --- 3. Reports: markdown tables, CSV, JSON (every file through ssjr.write_atomic). ---
def _fmt(x: float, metric: str) -> str:
    digits = 0 if metric.endswith("_mm") or metric == "steps" else 1 if metric in PERCENT or metric.endswith(
        ("_pct", "_deg", "_nm")) else 3
    return f"{x:.{digits}f}"


def _cell(rows: list[dict], metric: str, independent: bool) -> str:
    """mean [95 % interval]; for several runs also their number; a rate of near-identical starts says so."""
    e = estimate(rows, metric, independent)
    if e["n"] == 0:
        return "n/a"
    text = _fmt(e["mean"], metric)
    if math.isfinite(e["lo"]):
        text += f" [{_fmt(e['lo'], metric)}, {_fmt(e['hi'], metric)}]"
    return text + (f" ({e['runs']} runs)" if e["runs"] > 1 else f" ({e['n']} near-identical starts)"
                   if metric in PERCENT and not independent else "")


def _md(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body]) + "\n"


def table1_markdown(rows: list[dict], labels: list[str], settings: list[Setting], alpha: float,
                    columns=TABLE1_METRICS) -> str:
    """Paper Table 1: one row per label, the `columns` per setting; `*` = p < alpha against the first label."""
    by = group(rows, "label", "setting")
    tests = comparison_rows(rows, labels, settings, alpha, [m for m, _ in columns])
    star = {(c["label"], c["setting"], c["metric"]) for c in tests if c["significant"] and c["reference"] == labels[0]}
    body = [[label] + [_cell(by.get((label, s.name), []), m, s.dr) + (" *" if (label, s.name, m) in star else "")
                       for s in settings for m, _ in columns] for label in labels]
    return _md(["Method"] + [f"{s.title} {name}" for s in settings for _, name in columns], body)


def per_motion_markdown(rows: list[dict], labels: list[str], setting: Setting, columns=TABLE1_METRICS) -> str:
    """Per motion (all segments of one source clip) or per keypoint command: the `columns` per label."""
    by = group(rows, "label", "setting", "motion")
    body = [[motion] + [_cell(by.get((label, setting.name, motion), []), m, setting.dr) for label in labels
                        for m, _ in columns] for motion in dict.fromkeys(r["motion"] for r in rows)]
    return _md(["Motion"] + [f"{label} {name}" for label in labels for _, name in columns], body)


def push_markdown(rows: list[dict], labels: list[str], settings: list[Setting], metric: str = "success",
                  name: str = "push succ. (%)↑") -> str:
    """Push recovery: `metric` over the episodes pushed at least once, [pushed / all episodes] after each cell."""
    by = group(rows, "label", "setting")

    def cell(sel: list[dict], s: Setting) -> str:
        pushed = [r for r in sel if r["pushes"] > 0]
        if sel and not pushed:  # pushes come every push_interval_s: a policy that falls sooner is never pushed
            return f"n/a: every episode ended before its first push [0/{len(sel)}]"
        return f"{_cell(pushed, metric, s.dr)} [{len(pushed)}/{len(sel)}]"
    body = [[label] + [cell(by.get((label, s.name), []), s) for s in settings] for label in labels]
    return _md(["Method"] + [f"{s.title} {name} [pushed/all episodes]" for s in settings], body)


def comparison_markdown(rows: list[dict], labels: list[str], settings: list[Setting], alpha: float, metrics) -> str:
    """comparison_rows as a table: method - reference [95 % interval], the test, p, pairs of episodes, runs."""
    def interval(c):
        return f"[{_fmt(c['lo'], c['metric'])}, {_fmt(c['hi'], c['metric'])}]" if math.isfinite(c["lo"]) else ""
    body = [[c["label"], c["reference"], c["setting"], c["metric"], f"{_fmt(c['diff'], c['metric'])} {interval(c)}",
             c["test"], f"{c['p']:.2e}" if math.isfinite(c["p"]) else "", str(c["n"]), str(c["runs"]),
             "yes" if c["significant"] else "no"] for c in comparison_rows(rows, labels, settings, alpha, metrics)]
    return _md(["Method", "vs", "Setting", "Metric", "difference [95 % interval]", "test", "p", "pairs", "runs",
                f"p < {alpha}"], body)


def _counts(rows: list[dict], settings: list[Setting]) -> str:
    cut = (f"; {truncated} of all {len(rows)} recorded episodes were cut short by --max-steps (a success there only "
           f"means no failure so far)") if (truncated := sum(r["truncated"] for r in rows)) else ""
    per = group(rows, "ckpt", "setting")
    counts = ", ".join(f"{s.name} {max((len(v) for (_, name), v in per.items() if name == s.name), default=0)} "
                       f"{'independent episodes' if s.dr else 'near-identical starts'}" for s in settings)
    return (f"{len({r['motion'] for r in rows})} motions ({len({r['clip'] for r in rows})} clips), "
            f"{len({r['seed'] for r in rows})} seed(s); per checkpoint: {counts}{cut}")


def report_markdown(rows: list[dict], labels: list[str], settings: list[Setting], alpha: float, notes=()) -> str:
    """table.md: `notes`, the paper's tables of the robot motions, keypoint error and falls of the keypoint commands."""
    robot, human = ([r for r in rows if r["command"] == c] for c in (ROBOT, HUMAN_KEYPOINTS))
    flat, with_dr = [s for s in settings if s.terrain == "flat"], [s for s in settings if s.dr and not s.noise_only]
    push_note = (f"+DR: dynamics psi and sensor noise (envs.DR) on every checkpoint; pushes: a root-velocity kick of "
                 f"up to {envs.DR().push_vel_mps} m/s every U{list(envs.DR().push_interval_s)} s of episode time.\n\n")
    parts = [f"# HoRD evaluation\n\nsuccess = max_t GTE_t < {SUCCESS_THRESHOLD_M} m (GTE_t: the bodies' mean "
             f"position error), the episode ends when it fails; success_strict: every body within "
             f"{SUCCESS_THRESHOLD_M} m. Cells: mean [95 % interval]: rates Wilson over independent episodes (+DR), "
             f"other metrics Student t; several runs of a label: over the runs. Settings without DR or noise play "
             f"near-identical starts: no interval. `*`: p < {alpha} against {labels[0]} (McNemar for rates, paired t "
             f"otherwise; over runs: t); every pair of labels: the paired comparisons at the end.\n"]
    if notes:
        parts.append("**Notes**\n\n" + "".join(f"- {n}\n" for n in notes))
    if robot:
        parts.append(f"Robot motions (SSJR packets): {_counts(robot, settings)}.\n")
        if flat:
            parts.append("## Table 1: tracking across engines\n\n" + table1_markdown(robot, labels, flat, alpha))
        if sloped := [s for s in settings if s.terrain != "flat"]:
            terrain = [s for s in flat if s.name in {t.name.partition("@")[0] for t in sloped}] + sloped
            parts.append("## Terrain\n\n" + table1_markdown(robot, labels, terrain, alpha))
        if len(labels) < len({r["ckpt"] for r in rows}):  # several runs of a label: a row per checkpoint
            by_run, columns = group(robot, "ckpt", "setting"), TABLE1_METRICS[:2]
            head = ["Method", "checkpoint"] + [f"{s.title} {name}" for s in settings for _, name in columns]
            body = [[label, f"`{ckpt}`"] + [_cell(by_run.get((ckpt, s.name), []), m, s.dr) for s in settings
                                             for m, _ in columns] for ckpt, label in group(robot, "ckpt", "label")]
            parts.append("## Runs\n\n" + _md(head, body))
        if with_dr:
            parts.append("## Push recovery\n\n" + push_note + push_markdown(robot, labels, with_dr))
        by = group(robot, "label", "setting")
        for s in settings:  # the paper's App. table 'comprehensive metrics'
            body = [[(m + " (%)" if m in PERCENT else m) + (" ↓" if m in LOWER_IS_BETTER else " ↑")]
                    + [_cell(by.get((label, s.name), []), m, s.dr) for label in labels] for m in ALL_METRICS]
            parts.append(f"## All metrics: {s.title}\n\n" + _md(["Metric"] + labels, body))
        parts += [f"## Per motion: {s.title}\n\n" + per_motion_markdown(robot, labels, s) for s in settings]
        if len(labels) > 1:
            parts.append("## Paired comparisons: robot motions\n\n" + comparison_markdown(
                robot, labels, settings, alpha, ("success", "success_strict", "steps", "g_mpjpe_mm", "mpjpe_mm")))
    if human:
        parts.append(f"## Human keypoint commands\n\n{_counts(human, settings)}. Only the SSJR keypoint bodies are "
                     f"commanded, so these are scored by the keypoint error and the falls instead of the full-body "
                     f"metrics.\n\n" + table1_markdown(human, labels, settings, alpha, KEYPOINT_TABLE))
        if with_dr:
            parts.append("## Push recovery: human keypoint commands\n\n" + push_note
                         + push_markdown(human, labels, with_dr, "fell", "falls of pushed episodes (%)↓"))
        parts += [f"## Per command: {s.title}\n\n" + per_motion_markdown(human, labels, s, KEYPOINT_TABLE)
                  for s in settings]
        if len(labels) > 1:
            parts.append("## Paired comparisons: human keypoint commands\n\n"
                         + comparison_markdown(human, labels, settings, alpha, KEYPOINT_METRICS))
    return "\n".join(parts)


def write_outputs(out_dir, rows: list[dict], labels: list[str], settings: list[Setting], alpha: float,
                  notes: tuple[str, ...] = ()) -> dict:
    """table.md, episodes.csv and summary.json into out_dir; prints the report, returns the summary."""
    out = pathlib.Path(out_dir)
    report = report_markdown(rows, labels, settings, alpha, notes)
    ssjr.write_atomic(out / "table.md", lambda tmp: tmp.write_text(report))
    episodes = io.StringIO()  # one line per episode; columns: the union of the row keys in first-seen order
    w = csv.DictWriter(episodes, list(dict.fromkeys(k for r in rows for k in r)), lineterminator="\n")
    w.writeheader()
    w.writerows(r for r in rows if not r["setting"].startswith("grid_mean"))  # the grid cells' rows again
    ssjr.write_atomic(out / "episodes.csv", lambda tmp: tmp.write_text(episodes.getvalue(), newline=""))
    kinds = {command: [r for r in rows if r["command"] == command] for command in (ROBOT, HUMAN_KEYPOINTS)}

    def estimates(command: str, key: str, metrics) -> dict:  # {label or ckpt: {setting: {metric: estimate(...)}}}
        by = group(kinds[command], key, "setting")
        names = labels if key == "label" else dict.fromkeys(r["ckpt"] for r in kinds[command])
        return {name: {s.name: {m: estimate(by.get((name, s.name), []), m, s.dr) for m in metrics} for s in settings}
                for name in names}
    summary = {"labels": labels, "checkpoints": {r["ckpt"]: r["label"] for r in rows},
               "settings": [dataclasses.asdict(s) for s in settings],
               "clips": list(dict.fromkeys(r["clip"] for r in rows)), "reward_c": REWARD_C,
               "success_threshold_m": SUCCESS_THRESHOLD_M, "alpha": alpha, "notes": list(notes),
               "results": estimates(ROBOT, "label", ALL_METRICS),
               "results_keypoint_commands": estimates(HUMAN_KEYPOINTS, "label", KEYPOINT_METRICS),
               "runs": estimates(ROBOT, "ckpt", ALL_METRICS),
               "runs_keypoint_commands": estimates(HUMAN_KEYPOINTS, "ckpt", KEYPOINT_METRICS),
               "comparisons": {command: comparison_rows(sel, labels, settings, alpha)
                               for command, sel in kinds.items() if sel}}
    strict = json.loads(json.dumps(summary), parse_constant=lambda _: None)  # NaN, inf -> null (strict JSON)
    ssjr.write_atomic(out / "summary.json", lambda tmp: tmp.write_text(json.dumps(strict, indent=1, allow_nan=False)))
    print(report)
    return summary


# --- 4. Settings, motions, checkpoints, envs. ---
@dataclasses.dataclass(frozen=True)
class Setting:
    name: str  # canonical: <engine>[+dr|+noise][<k>][@<terrain>]
    sim: str
    dr: bool  # randomized episodes: +dr or +noise
    terrain: str
    in_domain: bool
    deploy_drift_mps: float | None = None  # played by deploy.py from the ONNX, with this root-estimate drift
    noise_only: bool = False  # +noise: envs.DR.noise_only()
    noise_scale: float = 1.0  # <k>: the sensor noise times k
    cells: tuple[str, ...] = ()  # GRID cells and M_T_PROBES

    @property
    def title(self) -> str:
        if (drift := self.deploy_drift_mps) is not None:
            return "deploy.py ONNX, MuJoCo" + (f", root drift {drift:g} m/s" if drift else "")
        terrain = "" if self.terrain == "flat" else f" {self.terrain.replace('_', ' ')}"
        dr = "+noise" if self.noise_only else "+DR" if self.dr else ""
        dr += f" x{self.noise_scale:g}" if self.noise_scale != 1 else ""
        cells = "".join(f" {c}" for c in self.cells)
        return f"{ENGINES[self.sim]}{dr}{terrain}{cells} ({'ID' if self.in_domain else 'OOD'})"


def parse_setting(token: str, train_sim: str) -> Setting:
    """'<engine>[+dr|+noise][<k>][@<terrain>][:<cell>...]' (the module docstring's Settings) -> Setting."""
    token, *cells = token.lower().split(":")
    spec, _, terrain = token.partition("@")
    engine, plus, dr = spec.partition("+")
    terrain = terrain or "flat"
    sim = {"in_domain": train_sim, "zero_shot": ZERO_SHOT[train_sim]}.get(engine, engine)
    kind, k = m.groups() if (m := re.fullmatch(r"(dr|noise)(\d+\.?\d*|\.\d+)?", dr)) else (None, None)
    if sim not in ENGINES or (plus and not kind) or terrain not in envs.TERRAIN_TYPES:
        raise ssjr.InputError("--settings", f"bad setting {token!r}: use <engine>[+dr|+noise][<k>][@<terrain>], engine "
                              f"in {tuple(ENGINES) + ('in_domain', 'zero_shot')}, k a number, terrain in "
                              f"{envs.TERRAIN_TYPES}")
    if cells and (len(set(cells)) < len(cells) or not set(cells) <= {*GRID, *M_T_PROBES, CLIPPED}
                  or kind != "dr" and set(cells) != {CLIPPED} or sim == "isaaclab" and "contact0.04" in cells):
        raise ssjr.InputError("--settings", f"bad cells in {token!r}: distinct ones of {[*GRID, *M_T_PROBES]} after "
                              f"+dr, or {CLIPPED} (Isaac Lab has one contact time constant)")
    scale = float(k or 1)
    name = (sim + plus + (kind or "") + (f"{scale:g}" if scale != 1 else "")
            + ("" if terrain == "flat" else f"@{terrain}") + "".join(f":{c}" for c in cells))
    return Setting(name, sim, bool(plus), terrain, sim == train_sim, noise_only=kind == "noise", noise_scale=scale,
                   cells=tuple(cells))


def parse_settings(tokens, train_sim: str) -> list[Setting]:
    """--settings: `grid` as a cell is every GRID cell (`mujoco+dr:grid:mt_shuffled`); alone, `in_domain+dr:grid`."""
    out = []
    for token in (t.lower() for t in tokens):
        head, grid, tail = ("in_domain+dr:" + token if token.partition(":")[0] == "grid" else token).partition(":grid")
        out += [parse_setting(f"{head}:{c}{tail}", train_sim) for c in GRID] if grid else [
            parse_setting(token, train_sim)]
    return out


def motion_name(clip: str) -> str:
    """The source motion of a packet: its name without the _segNN suffix of a 2-10 s segment."""
    return re.sub(r"_seg\d+$", "", clip)


def resolve_motions(motions: str, packet_dir: str) -> list[pathlib.Path]:
    """'' -> the test split under packet_dir (ssjr.TEST_CLIPS: <clip>.npz or its segments <clip>_segNN.npz)."""
    if motions:
        return envs.resolve_motions(motions)
    _, test = ssjr.train_test_split(sorted(pathlib.Path(packet_dir).rglob("*.npz")))
    if missing := [c for c in ssjr.TEST_CLIPS if c not in {motion_name(p.stem) for p in test}]:
        raise ssjr.InputError(packet_dir, f"test-split packets missing: {missing}; build them with `python ssjr.py "
                                          f"convert ...` or pass --packet-dir / --motions")
    return sorted(test, key=lambda p: (ssjr.TEST_CLIPS.index(motion_name(p.stem)), p.stem))


def load_policy(path, device: str):
    """(policy, checkpoint): model.load_teacher or student.load_policy, by the checkpoint's kind."""
    teacher = model.load_checkpoint(path)["kind"] == "teacher"
    return (model.load_teacher if teacher else student.load_policy)(path, device)


def opened_env(env_cfg: dict, setting: Setting, motion_paths: list[pathlib.Path], num_envs: int, device: str,
               seed: int) -> contextlib.closing:
    """The checkpoint's env with the setting's overrides, closed on exit or error (Isaac Lab: one env per process)."""
    dr = envs.DR.noise_only() if setting.noise_only else envs.DR() if setting.dr else None
    psi = {k: v for c in setting.cells for k, v in GRID.get(c, {}).items()}  # on Genesis, contact is the scene's
    contact = psi["contact_timeconst_s"][0] if "contact_timeconst_s" in psi and setting.sim != "mujoco" else None
    return contextlib.closing(envs.make_env(**{
        **env_cfg, "sim": setting.sim, "terrain": setting.terrain, "contact_timeconst_s": contact,
        "dr": None if dr is None else dataclasses.replace(dr, noise_scale=setting.noise_scale, **psi),
        "motions": [str(p) for p in motion_paths], "num_envs": num_envs, "device": device, "seed": seed,
        "start": "frame0", "exclude_test": False, "termination": "mean",
        "clamp_targets": env_cfg.get("clamp_targets", False) or CLIPPED in setting.cells}))


# --- 5. Rollouts. ---
def episode_plan(num_envs: int, num_clips: int, episodes_per_clip: int) -> list[list[tuple[int, int]]]:
    """Which episodes to keep: with start='frame0', env i plays clips i, i+N, i+2N, ... (mod clips) whatever the
    outcomes, so plan[i][k] = (clip, episode index) of env i's k-th episode: each clip's first episodes_per_clip."""
    return [[(j % num_clips, j // num_clips) for j in range(i, num_clips * episodes_per_clip, num_envs)]
            for i in range(num_envs)]


def history_probe(obs: dict, cells, gen: torch.Generator) -> dict:
    """What the policy reads under the m_t diagnostics in `cells` (M_T_PROBES); mt_shuffled rolls anew each step."""
    if "mt_empty" in cells:
        obs = {**obs, "history_mask": torch.zeros_like(obs["history_mask"])}
    if "mt_shuffled" in cells:
        shift = int(torch.randint(1, len(obs["history"]), (), generator=gen))
        obs = {**obs, **{k: obs[k].roll(shift, 0) for k in ("history", "history_mask")}}
    return obs


def run_episodes(env, obs: dict, policy, plan: list[list[tuple[int, int]]], max_steps: int = 0, cells=()):
    """Roll `policy` in `env` (start='frame0'; `obs` from its first reset or env.reseed(seed): a second reset would
    skip clips) and yield each planned episode as `record` builds it; cells: the setting's (history_probe, CLIPPED)."""
    n, gen = env.num_envs, torch.Generator().manual_seed(env.seed) if "mt_shuffled" in cells else None
    lower, upper = env.joint_range_rad
    k, start = [0] * n, [0] * n  # current episode of each env, and the step it started at
    steps, base, step = [], 0, 0  # steps: per control step, CPU copies of the [N,...] arrays; steps[0] is step `base`

    def record(i: int, end: int, truncated: bool) -> dict:
        clip, episode = plan[i][k[i]]
        window = steps[start[i] - base:end - base]
        col = lambda key: torch.stack([s[key][i] for s in window])  # noqa: E731
        last = window[-1]
        return {"clip": clip, "episode": episode, "steps": len(window), "truncated": truncated,
                "failed": bool(last["failed"][i]), "time_out": bool(last["time_out"][i]), "nan": bool(last["nan"][i]),
                "pushes": int(col("pushed").sum()), "psi": {key: float(v[i]) for key, v in last["psi"].items()},
                **{key: col(key).numpy() for key in RECORDED + JOINT_RECORDED}}
    while any(k[i] < len(plan[i]) for i in range(n)):
        if max_steps and step >= max_steps:
            yield from (record(i, step, True) for i in range(n) if k[i] < len(plan[i]) and step > start[i])
            return
        q = env.sim.dof_state()[0]
        stop_gap = torch.minimum(q - lower, upper - q).cpu()  # before the step moves the engine's joints
        with torch.no_grad():  # not inference_mode: the env keeps the actions in its state, and reseed writes there
            alpha = policy.act(history_probe(obs, cells, gen))
            obs, _, done, info = env.step(alpha)
            alpha = alpha.clamp(lower, upper) if env.clamp_targets else alpha  # what the env played
        steps.append({**{key: getattr(env, key).detach().to("cpu", torch.float32).clone() for key in RECORDED},
                      "target_excess_rad": torch.maximum(lower - alpha, alpha - upper).cpu(), "stop_gap_rad": stop_gap,
                      "joint_torque_nm": env.substep_tau[0].cpu().clone(),
                      **{key: info[key].cpu() for key in ("failed", "time_out", "nan", "pushed")},
                      "psi": {key: v.cpu() for key, v in info["psi"].items()}})
        step += 1
        for i in done.nonzero().flatten().tolist():
            if k[i] < len(plan[i]):
                yield record(i, step, False)
                k[i], start[i] = k[i] + 1, step
        keep_from = min([start[i] for i in range(n) if k[i] < len(plan[i])], default=step)
        del steps[:keep_from - base]
        base = keep_from


def evaluate_seed(env, policy, ckpt: dict, path, label: str, setting: Setting, seed: int, clips: list[str],
                  kinds: list[str], plan, max_steps: int = 0):
    """Restart the setting's env with `seed` (env.reseed), roll the policy and yield (CSV row, recorded episode).
    clips, kinds: name and ssjr.packet_kind of each motion file, in the env's clip order."""
    obs = env.reseed(seed)
    reads = policy.actor_obs if ckpt["kind"] == "teacher" else student.STUDENT_OBS  # its policy's inputs
    model.check_layout(path, ckpt["obs_layout"], env.obs_layout, reads)
    for rec in run_episodes(env, obs, policy, plan, max_steps, setting.cells):
        yield episode_row(rec, label, path, ckpt["kind"], setting, seed, clips[rec["clip"]], kinds[rec["clip"]]), rec


def episode_row(rec: dict, label: str, path, kind: str, setting: Setting, seed: int, clip: str, command: str) -> dict:
    """The episodes.csv row of an episode as run_episodes records it; an early end is never a success."""
    metrics = episode_metrics(rec, command=command)
    if rec["failed"]:
        metrics.update({k: 0.0 for k in ("success", "success_strict") if math.isfinite(metrics[k])})
    return {"label": label, "ckpt": str(path), "kind": kind, "setting": setting.name, "sim": setting.sim,
            "dr": int(setting.dr), "terrain": setting.terrain, "seed": seed, "command": command,
            "motion": motion_name(clip), "clip": clip, "episode": rec["episode"], "steps": rec["steps"],
            "duration_s": rec["steps"] * envs.CONTROL_DT_S, **metrics, "fell": float(rec["failed"]),
            "time_out": int(rec["time_out"]), "nan": int(rec["nan"]), "truncated": int(rec["truncated"]),
            "pushes": rec["pushes"], **{f"psi_{k}": v for k, v in rec["psi"].items()}}


def deploy_rows(onnx_path, label: str, setting: Setting, seeds, motion_paths: list[pathlib.Path], kinds: list[str]):
    """deploy.py's episodes of an exported student on the robot motions (a keypoint command has no start state), scored
    against envs.MotionLib's 50 Hz reference: one per clip, and per seed (the drift's direction) with drift."""
    import deploy
    robot = deploy.Robot(policy := deploy.Policy(onnx_path))
    for path in (p for p, kind in zip(motion_paths, kinds) if kind == ROBOT):
        command, reference = deploy.Command(path, policy), envs.MotionLib([path], "cpu")
        for seed in seeds if setting.deploy_drift_mps else seeds[:1]:
            rec = deploy.run_episode(policy, command, robot, setting.deploy_drift_mps, seed)
            steps = len(rec["body_pos_w"])
            ticks = torch.arange(1, steps + 1)  # the states after steps 1..T
            ref = reference.at_tick(torch.zeros_like(ticks), ticks)
            failed = steps < command.num_ticks - 1  # deploy.py stops at the failure test
            rec.update(ref_body_pos_w=ref["body_pos"].numpy(), ref_body_quat_w=ref["body_quat"].numpy(), episode=0,
                       steps=steps, failed=failed, time_out=not failed, nan=not np.isfinite(rec["body_pos_w"]).all(),
                       truncated=False, pushes=0, psi={})
            yield episode_row(rec, label, onnx_path, "student_onnx", setting, seed, path.stem, ROBOT)


# parity: deploy.py's float64 inputs vs the env's float32 observations (m, rad, rad/s); ONNX vs torch alpha (rad)
PARITY_TOLERANCE = {"inputs": 1e-4, "alpha": 1e-3}
PROPRIO_FIELDS = ([f"joint {q} {n}" for q in ("pos", "vel") for n in ssjr.DOF_NAMES] + [f"gyro[{k}]" for k in range(3)]
                  + [f"gravity[{k}]" for k in range(3)] + [f"alpha {n}" for n in ssjr.DOF_NAMES])  # a proprio row


def parity(args: Args) -> str:
    """See Args.parity. Returns the verdict line (also printed)."""
    import deploy
    if len(args.ckpt) != 1 or len(args.onnx) != 1:
        raise ssjr.InputError("--parity", "give one student checkpoint (--ckpt) and its export (--onnx)")
    torch_policy, ckpt = load_policy(args.ckpt[0], "cpu")
    if ckpt["kind"] != "student":
        raise ssjr.InputError(args.ckpt[0], "--parity compares a student with its ONNX export: this is a teacher")
    onnx_policy, path = deploy.Policy(args.onnx[0]), resolve_motions(args.motions, args.packet_dir)[0]
    worst = {}
    with opened_env(ckpt["env_cfg"], parse_setting("mujoco", "mujoco"), [path], 1, "cpu", seed=0) as env:
        obs, command = env.reseed(0), deploy.Command(path, onnx_policy)
        command.keypoints_w = command.keypoints_w + env.ref_offset[0].numpy()  # the env places the clip on a tile
        robot, data = deploy.Robot(onnx_policy), env.sim.datas[0]  # deploy's readings of the env's own MuJoCo state
        reading = robot.read(data)
        controller = deploy.Controller(onnx_policy, reading, command.start_q)
        for t in range(args.max_steps or command.num_ticks - 1):
            inputs = controller.inputs(reading, command)
            (alpha_onnx, y_onnx), alpha = onnx_policy(inputs), torch_policy.act(obs)
            alpha = alpha.clamp(*env.joint_range_rad) if env.clamp_targets else alpha  # what the env plays
            pos, quat = (x[0, 0] for x in env.sim.body_state()[:2])
            window = env.reference(env.window_steps)["body_pos"][0, :len(onnx_policy.keypoint_steps)]
            terms = [(k, obs[k][0]) for k in ("student_proprio", "history", "history_mask", "terrain")] + [
                ("root_pos_w", pos), ("root_quat_w", quat), ("keypoints_w", window[:, env.keypoint_ids]),
                ("student_keypoints (Y_t in the graph)", obs["student_keypoints"][0]), ("alpha", alpha[0])]
            mine = {**inputs, "student_keypoints (Y_t in the graph)": y_onnx, "alpha": alpha_onnx}
            for name, theirs in terms:
                err = np.abs(np.asarray(mine[name], np.float64) - theirs.double().numpy())
                worst[name] = max(worst.get(name, 0.0), float(err.max()))
                if err.max() > (tol := PARITY_TOLERANCE["alpha" if name == "alpha" else "inputs"]):
                    index = [int(i) for i in np.unravel_index(err.argmax(), err.shape)]
                    field = f" ({PROPRIO_FIELDS[index[-1]]})" if name in ("student_proprio", "history") else ""
                    verdict = f"step {t}: {name}{index}{field} differs: max error {err.max():.3g} (tolerance {tol:g})"
                    print(verdict)
                    return verdict
            obs, _, done, _ = env.step(alpha)
            before, reading = reading, robot.read(data)
            controller.advance(alpha[0].double().numpy(), before, reading)
            if done[0]:
                break
    verdict = f"all inputs match: {t + 1} steps of {path.stem}; max errors " + ", ".join(
        f"{k} {v:.1e}" for k, v in worst.items())
    print(verdict)
    return verdict


def ridge_r2(x: torch.Tensor, y: torch.Tensor, split: torch.Tensor) -> float:
    """R² on the rows split == 2 of a ridge regression of y on x fitted on the rows split == 0, its penalty picked
    on the rows split == 1 (features standardized on the fitted rows)."""
    fit, val, test = (split == k for k in range(3))
    x = (x - x[fit].mean(0)) / (x[fit].std(0) + 1e-6)
    y_mean, gram, eye = y[fit].mean(), x[fit].T @ x[fit], torch.eye(x.shape[1], dtype=x.dtype)

    def r2(w, rows):
        return float(1 - (y[rows] - y_mean - x[rows] @ w).pow(2).sum() / (y[rows] - y[rows].mean()).pow(2).sum())
    weights = [torch.linalg.solve(gram + lam * int(fit.sum()) * eye, x[fit].T @ (y[fit] - y_mean))
               for lam in (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)]
    return r2(max(weights, key=lambda w: r2(w, val)), test)


def probe(args: Args, labels: list[str], setting: Setting, motion) -> dict:
    """See Args.probe: per checkpoint and psi term, R² from m_t, s_t and H_t; written to probe.md and printed. Rows:
    steps PROBE_STEPS of each env's first episode (frame 0) per seed; episodes split by env index mod 4 (2 fit, 1 picks
    the penalty, 1 tests), so no episode is on both sides."""
    if not setting.dr:
        raise ssjr.InputError("--settings", "--probe needs a setting with +dr (psi varies over the episodes)")
    table = {}
    for path, label in zip(args.ckpt, labels):
        policy, ckpt = load_policy(path, args.device)
        actor, rows = policy.actor, {"m_t": [], "s_t": [], "H_t": [], "psi": [], "split": []}
        with opened_env(ckpt["env_cfg"], setting, [motion], args.num_envs, args.device, args.seeds[0]) as env:
            split = torch.tensor([(0, 0, 1, 2)[i % 4] for i in range(env.num_envs)], device=env.device)
            for seed in args.seeds:
                obs, alive = env.reseed(seed), torch.ones(env.num_envs, dtype=torch.bool, device=env.device)
                gen = torch.Generator().manual_seed(seed)  # the m_t probes' draws (history_probe)
                for t in range(PROBE_STEPS[1] + 1):
                    seen = history_probe(obs, setting.cells, gen)
                    if t >= PROBE_STEPS[0] and alive.any():
                        with torch.no_grad():
                            m_t = (actor.hcdr(actor.history_norm(seen["history"]), seen["history_mask"])
                                   if actor.hcdr is not None else torch.full((env.num_envs, 1), math.nan))
                        for key, x in (("m_t", m_t), ("s_t", obs["student_proprio"][:, -1, :envs.SPARSE_STATE_DIM]),
                                       ("H_t", obs["history"].flatten(1)), ("psi", obs["psi"][:, 0]), ("split", split)):
                            rows[key].append(x[alive].double().cpu())
                    with torch.no_grad():
                        obs, _, done, _ = env.step(policy.act(seen))
                    alive &= ~done
        data = {k: torch.cat(v) for k, v in rows.items()}
        table[label] = {name: {src: ridge_r2(data[src], data["psi"][:, j], data["split"])
                               if data["psi"][:, j].std() > 0 and data[src].isfinite().all() else math.nan
                               for src in ("m_t", "s_t", "H_t")} for j, name in enumerate(envs.PSI_KEYS)}
        table[label]["samples"] = len(data["split"])
    keys = [k for k in envs.PSI_KEYS if any(math.isfinite(t[k]["H_t"]) for t in table.values())]
    body = [[label, str(t["samples"])] + [" / ".join(f"{t[k][src]:.2f}" for src in ("m_t", "s_t", "H_t"))
                                          for k in keys] for label, t in table.items()]
    report = (f"# psi probes: R² (held-out episodes) from m_t / s_t / H_t, {setting.title}, "
              f"{pathlib.Path(motion).stem}, seeds {list(args.seeds)}, steps {PROBE_STEPS[0]}-{PROBE_STEPS[1]}\n\n"
              + _md(["Policy", "samples"] + keys, body))
    ssjr.write_atomic(pathlib.Path(args.out_dir) / "probe.md", lambda tmp: tmp.write_text(report))
    print(report)
    return table


# --- 6. Main. ---
def main(args: Args) -> dict:
    from tqdm import tqdm
    stems = [pathlib.Path(p).stem for p in args.ckpt]
    ckpt_labels = list(args.labels) or (stems if len(set(stems)) == len(stems) else list(args.ckpt))
    if len(ckpt_labels) != len(args.ckpt):
        raise ssjr.InputError("--labels", f"one name per checkpoint: {ckpt_labels} for {list(args.ckpt)}")
    if not ((args.ckpt or args.onnx) and args.seeds and min(args.seeds) >= 0 and min(args.num_envs, args.episodes) > 0
            and len({*args.seeds}) == len(args.seeds) and len({*args.ckpt}) == len(args.ckpt)):
        raise ssjr.InputError("--ckpt/--seeds/--num-envs/--episodes",
                              "give distinct checkpoints, distinct seeds >= 0, >= 1 env and episode")
    onnx_labels = list(args.onnx_labels) or [pathlib.Path(p).stem for p in args.onnx]
    if len(onnx_labels) != len(args.onnx):
        raise ssjr.InputError("--onnx-labels", f"one name per ONNX file: {onnx_labels} for {list(args.onnx)}")
    if args.parity:
        return {"parity": parity(args)}
    labels = list(dict.fromkeys(ckpt_labels + onnx_labels))
    checkpoints = [model.load_checkpoint(p) for p in args.ckpt]  # every one is checked before the first rollout
    settings = parse_settings(args.settings, checkpoints[0]["env_cfg"]["sim"]) if checkpoints else []
    if any("mt_shuffled" in s.cells for s in settings) and min(args.num_envs, args.episodes) < 2:
        raise ssjr.InputError("--num-envs", "mt_shuffled gives each env another env's history: use 2 or more envs")
    motion_paths = resolve_motions(args.motions, args.packet_dir)
    if args.probe:
        return probe(args, ckpt_labels, settings[0], motion_paths[0])
    deploy_settings = [Setting("deploy" + (f"+drift{v:g}" if v else ""), "mujoco", False, "flat", False, v)
                       for v in args.root_drift_mps] if args.onnx else []
    clips, kinds = [p.stem for p in motion_paths], [ssjr.packet_kind(p) for p in motion_paths]
    episodes = {s.name: args.episodes if s.dr else 1 for s in settings}  # without DR: near-identical starts
    planned = {name: len(args.seeds) * len(clips) * n for name, n in episodes.items()}  # per checkpoint
    rows, bar = [], tqdm(total=len(args.ckpt) * sum(planned.values()), unit="episode")
    for path, label in zip(args.ckpt, ckpt_labels):
        policy, ckpt = load_policy(path, args.device)
        for setting in settings:
            n = episodes[setting.name]
            plan = episode_plan(min(args.num_envs, len(clips) * n), len(clips), n)
            bar.set_description(f"{label} | {setting.name} | building the env")
            with opened_env(ckpt["env_cfg"], setting, motion_paths, len(plan), args.device, args.seeds[0]) as env:
                for seed in args.seeds:
                    bar.set_description(f"{label} | {setting.name} | seed {seed}")
                    for row, rec in evaluate_seed(env, policy, ckpt, path, label, setting, seed, clips, kinds, plan,
                                                  args.max_steps):
                        rows.append(row)
                        bar.update(1)
                        if args.render and len(rows) == 1:
                            ssjr.render_motion(rec["body_pos_w"], args.render, 1 / envs.CONTROL_DT_S,
                                               rec["ref_body_pos_w"][:, ssjr.KEYPOINT_BODY_IDS],
                                               title=f"{label} | {setting.name} | {row['clip']}")
    for path, label in zip(args.onnx, onnx_labels):
        for setting in deploy_settings:
            bar.set_description(f"{label} | {setting.name}")
            rows.extend(deploy_rows(path, label, setting, args.seeds, motion_paths, kinds))
    bar.close()
    notes = coverage_notes(rows, list(args.ckpt), settings, planned, args.max_steps)
    settings += deploy_settings
    ckpts, names = [*args.ckpt, *args.onnx], [s.name for s in settings]  # episodes finish in any order
    rows.sort(key=lambda r: (ckpts.index(r["ckpt"]), names.index(r["setting"]), r["seed"], clips.index(r["clip"]),
                             r["episode"]))
    for note in notes:
        warnings.warn(note)
    grids = group([{"probes": tuple(c for c in s.cells if c not in GRID), "s": s} for s in settings
                   if set(s.cells) & set(GRID)], "probes")
    for (probes,), cells in grids.items():  # the primary endpoint: success over the grid (per m_t probe)
        grid = Setting(":".join(("grid_mean", *probes)), cells[0]["s"].sim, True, "flat", cells[0]["s"].in_domain,
                       cells=("grid mean", *probes))
        rows += [{**r, "setting": grid.name, "clip": f"{r['setting']}/{r['clip']}"} for r in rows
                 if r["setting"] in {c["s"].name for c in cells}]
        settings.append(grid)
    return write_outputs(args.out_dir, rows, labels, settings, args.alpha, tuple(notes))


def coverage_notes(rows: list[dict], ckpts: list[str], settings: list[Setting], planned: dict[str, int],
                   max_steps: int) -> list[str]:
    """Blown-up (NaN) episodes, and planned episodes never reached (--max-steps caps each whole rollout)."""
    notes, by = [], group(rows, "ckpt", "setting")
    for ckpt in ckpts:
        for s in settings:
            sel, planned_here = by.get((str(ckpt), s.name), []), planned[s.name]
            if blown_up := sum(r["nan"] for r in sel):
                notes.append(f"{ckpt} | {s.name}: {blown_up} of {len(sel)} episodes blew up (NaN state); they count "
                             f"as failures and are left out of the error means")
            if len(sel) < planned_here:
                notes.append(f"{ckpt} | {s.name}: {planned_here - len(sel)} of {planned_here} planned episodes not "
                             f"reached within --max-steps {max_steps}")
    return notes


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except ssjr.InputError as e:
        sys.exit(f"error: {e}")
