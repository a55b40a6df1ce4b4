"""Evaluate HoRD checkpoints the way the paper does (App. D metrics, Table 1 layout) with one command.

    python evaluate.py --ckpt runs/<run>/teacher.pt                               # teacher or student
    python evaluate.py --ckpt hord.pt no_hcdr.pt no_dr.pt --labels HoRD "HoRD w/o HCDR" "HoRD w/o DR"
    python evaluate.py --ckpt s.pt --motions data/keypoints/cmu_bvh --settings genesis   # human keypoint commands
    python evaluate.py --ckpt s.pt --settings genesis --seeds 0 --episodes 1 --max-steps 100   # smoke run

    python evaluate.py --ckpt t.pt s0.pt s1.pt s2.pt --labels teacher student student student   # training runs

Settings: `<engine>[+dr][@<terrain>]`; engine = isaaclab | genesis | mujoco | in_domain (the first checkpoint's
env_cfg["sim"]) | zero_shot (ZERO_SHOT: Genesis for Isaac Lab or MuJoCo, Isaac Lab for Genesis); +dr = envs.DR()
(paper Table 5: dynamics psi, pushes, sensor noise); terrain = flat | smooth_slope | rough_slope. --onnx adds the
settings deploy[+drift<v>]: the exported student played by deploy.py in MuJoCo from its ONNX contract alone. One env
per (checkpoint, setting): the checkpoint's env_cfg with these overrides and frame-0 starts (env i plays clips i, i+N,
...), restarted by env.reseed(seed) for every seed, closed before the next is built (Isaac Lab: one live env per
process).

Episodes. Under +dr every episode draws its own psi (body terms included), tile, pushes and sensor noise from a stream
seeded by (seed, clip, episode) alone (envs.START_MODES): the episodes are independent samples, and the episodes of two
checkpoints with the same key met the same draws (pairs). Without DR an episode is fixed by its clip and tile, and the
deterministic policy plays it the same way every time: one episode per clip and seed is played, reported as
near-identical starts, without an interval. Checkpoints that share a label are training runs of one method (e.g.
training seeds): the run is the unit there (mean and interval over the runs).

Motions: the test split (ssjr.TEST_CLIPS) or a folder/file of SSJR packets and/or human keypoint commands. A keypoint
command commands only the SSJR keypoint bodies: it is scored by the keypoint error and the falls in its own report
section, and its full-body metrics are NaN.

An episode runs from frame 0 until its clip ends, its simulation blows up, or GTE_t > 0.5 m (for a keypoint command:
the mean keypoint error; env termination="mean"): an early end is never a success. env.body_pos_w, ref_body_pos_w
[N,30,3], body_quat_w, ref_body_quat_w [N,30,4] are recorded right after every env.step() (the states the env judged).
Per episode of T steps (50 Hz), B=30 bodies:

  GTE_t        = mean_b ||p_ref_tb - p_tb||  (the per-frame g-mpjpe)         (world frame, m)
  success      = max_t GTE_t < 0.5 m and every error finite                   (the paper's success, %)
  success_strict = max_t max_b ||p_ref_tb - p_tb|| < 0.5 m                    (every body within 0.5 m: the training
                                                                               termination; stricter, %)
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
  Velocities are one-step finite differences (dt = envs.CONTROL_DT_S), the same for robot and reference:
  v_t = (p_t+1,0 - p_t,0)/dt, w_t = rotvec(q_t+1,0 q_t,0^-1)/dt, |qdot - qdot_ref| = angle(lr_t^-1 lr_t+1,
  lr_ref_t^-1 lr_ref_t+1)/dt (exact for hinges); NaN if T < 2.

Aggregation (a blown-up episode fails and its errors are left out of the means): one checkpoint: the mean over its
episodes with a 95 % interval over the independent ones (rates: Wilson; other metrics: Student t); several runs: the
mean of the runs' means, Student-t interval over the runs. Push recovery (+dr): the success rate of the episodes pushed
at least once. Comparisons against the first label, per setting and metric: the paired difference (episodes paired by
(clip, seed, episode)), McNemar's exact test for the 0/1 metrics and scipy.stats.ttest_rel for the others; for runs,
the per-run paired differences (runs paired in the order given; one reference run serves them all), their mean,
t-interval and one-sample t-test over the runs. p < --alpha is flagged `*`.
Outputs in --out-dir: table.md, episodes.csv (one row per episode), summary.json. Pictures of a motion:
`python ssjr.py show <packet>`.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import pathlib
import re
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import tyro
from scipy import stats

import envs
import ssjr
import student
import teacher
from ssjr import InputError

SUCCESS_THRESHOLD_M = 0.5  # paper: an episode fails once the global translation error exceeds 0.5 m
REWARD_C = {"dv": 0.002, "kb": 10.0, "lr": 0.2, "rv": 0.5, "rav": 0.1}  # c of exp(-c * err); ProtoMotions' values
METRICS = ("success", "success_strict", "g_mpjpe_mm", "mpjpe_mm", "gr_err_rad", "gr_err_deg",
           "dv_rew", "kb_rew", "lr_rew", "rv_rew", "rav_rew")  # full body: NaN for human keypoint commands
KEYPOINT_METRICS = ("keypoint_err_mm", "fell", "steps")  # every command
ALL_METRICS = METRICS + KEYPOINT_METRICS
PERCENT = {"success", "success_strict", "fell"}  # 0/1 per episode, reported in % (McNemar's test)
LOWER_IS_BETTER = {"g_mpjpe_mm", "mpjpe_mm", "gr_err_rad", "gr_err_deg", "keypoint_err_mm", "fell"}
TABLE1_METRICS = (("success", "Succ. (%)↑"), ("steps", "steps↑"), ("g_mpjpe_mm", "g-mpjpe (mm)↓"),
                  ("mpjpe_mm", "mpjpe (mm)↓"))
KEYPOINT_TABLE = (("keypoint_err_mm", "keypoint err (mm)↓"), ("fell", "falls (%)↓"), ("steps", "steps↑"))
ROBOT, HUMAN_KEYPOINTS = "robot", "human_keypoints"  # the packet kinds (ssjr.packet_kind)
ENGINES = {"isaaclab": "IsaacLab", "genesis": "Genesis", "mujoco": "MuJoCo"}
# zero_shot: the engine least like the training one (Isaac Lab 3.0 steps MuJoCo-Warp: MuJoCo and Isaac Lab are twins)
ZERO_SHOT = {"isaaclab": "genesis", "genesis": "isaaclab", "mujoco": "genesis"}
RECORDED = ("body_pos_w", "ref_body_pos_w", "body_quat_w", "ref_body_quat_w")


@dataclass
class Args:
    ckpt: tuple[str, ...] = ()
    """checkpoint(s) of teacher.py / student.py; several give an ablation table, the first label is the reference"""
    labels: tuple[str, ...] = ()
    """table row names, one per checkpoint (default: file stems); checkpoints sharing a label are runs of one method"""
    settings: tuple[str, ...] = ("isaaclab", "isaaclab+dr", "genesis", "genesis+dr",
                                 "zero_shot@smooth_slope", "zero_shot@rough_slope")
    """evaluation settings, `<engine>[+dr][@<terrain>]` (see the module docstring)"""
    motions: str = ""
    """'' = the test split (ssjr.TEST_CLIPS in packet_dir); else a folder/file of packets and/or keypoint commands"""
    packet_dir: str = str(ssjr.REPO / "data" / "packets" / "g1_moves")
    """folder searched (recursively) for the test-split packets written by `ssjr.py convert`"""
    seeds: tuple[int, ...] = (0, 1, 2)
    """evaluation seeds: with the clip and the episode index they seed each episode's psi, tile, pushes and noise"""
    episodes: int = 2
    """episodes per clip and seed under +dr (without DR one: they would be near-identical)"""
    num_envs: int = 16
    """parallel envs (capped at clips x episodes)"""
    device: str = "cpu"
    """torch / simulation device"""
    max_steps: int = 0
    """stop each rollout after this many control steps, recording unfinished episodes as truncated (0 = no cap)"""
    out_dir: str = "results/eval"
    """where table.md, episodes.csv and summary.json go"""
    alpha: float = 0.01
    """significance level of the paired tests"""
    onnx: tuple[str, ...] = ()
    """exported students (export.py), played by deploy.py in MuJoCo from their contract alone: setting
    'deploy' (and 'deploy+drift<v>' for each non-zero --root-drift-mps)"""
    onnx_labels: tuple[str, ...] = ()
    """row names of the ONNX files (default: file stems); a checkpoint's label puts the export beside it"""
    root_drift_mps: tuple[float, ...] = (0.0,)
    """deploy settings: drift speed of the root position estimate (a random horizontal direction per seed)"""
    render: str = ""
    """draw the first episode (of the first checkpoint, setting and seed) to this .png (8 frames), .gif or .mp4: the
    robot's bodies in blue, the reference's keypoints in orange"""
    parity: bool = False
    """instead of evaluating: step the MuJoCo env with the student (--ckpt) on the first motion and compare, term by
    term, the inputs deploy.py builds from the same MuJoCo states with the env's observations, and the ONNX (--onnx)
    actions with the torch student's; print the first term beyond tolerance or 'all inputs match'"""


# --- 1. Metrics: pure functions over one episode's arrays, positions [T,B,3] (m), quaternions [T,B,4] (wxyz). ---
def local_rotations(quat: torch.Tensor, parents: tuple[int, ...]) -> torch.Tensor:
    """Rotation of each non-root body in its parent's frame: [T,B,4] -> [T,B-1,4]."""
    return ssjr.quat_mul(ssjr.quat_conj(quat[:, list(parents[1:])]), quat[:, 1:])


def root_velocities(pos: torch.Tensor, quat: torch.Tensor, dt_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Finite-difference root linear and angular velocity in the world frame, [T-1,3] each."""
    lin = (pos[1:, 0] - pos[:-1, 0]) / dt_s
    ang = ssjr.quat_to_rotvec(ssjr.quat_mul(quat[1:, 0], ssjr.quat_conj(quat[:-1, 0]))) / dt_s
    return lin, ang


def reward_terms(pos: torch.Tensor, quat: torch.Tensor, ref_pos: torch.Tensor, ref_quat: torch.Tensor,
                 dt_s: float, parents: tuple[int, ...], keybody_ids: tuple[int, ...]) -> dict[str, float]:
    """The reward-aligned terms dv/kb/lr/rv/rav_rew = mean_t exp(-REWARD_C * err_t) (errors: module docstring)."""
    lr, ref_lr = local_rotations(quat, parents), local_rotations(ref_quat, parents)
    kb = list(keybody_ids)
    err = {"kb": (pos[:, kb] - ref_pos[:, kb]).pow(2).sum(-1).mean(-1),
           "lr": ssjr.quat_angle(lr, ref_lr).mean(-1)}
    if len(pos) > 1:
        step = ssjr.quat_mul(ssjr.quat_conj(lr[:-1]), lr[1:])
        ref_step = ssjr.quat_mul(ssjr.quat_conj(ref_lr[:-1]), ref_lr[1:])
        err["dv"] = (ssjr.quat_angle(step, ref_step) / dt_s).pow(2).sum(-1)
        (v, w), (v_ref, w_ref) = root_velocities(pos, quat, dt_s), root_velocities(ref_pos, ref_quat, dt_s)
        err["rv"] = (v - v_ref).pow(2).sum(-1)
        err["rav"] = (w - w_ref).pow(2).sum(-1)
    return {f"{k}_rew": float(torch.exp(-REWARD_C[k] * err[k]).mean()) if k in err else math.nan for k in REWARD_C}


def episode_metrics(rec: dict, dt_s: float = envs.CONTROL_DT_S, command: str = ROBOT) -> dict[str, float]:
    """The metrics of a recorded episode (rec: RECORDED arrays [T,B,.], numpy or torch): METRICS and max_gte_m (NaN for
    a human keypoint command, whose non-keypoint reference bodies are filler), keypoint_err_mm, max_keypoint_err_m
    (the env's failure test compares the mean keypoint error with 0.5 m; `fell`, its verdict, comes with the
    rollout)."""
    pos, ref_pos, quat, ref_quat = (torch.as_tensor(np.asarray(rec[k]), dtype=torch.float64) for k in RECORDED)
    err = envs.body_error_metrics(pos, ref_pos)  # per step [T]; the env's info["metrics"] are the same functions
    gte = err["gt_err_m"]  # GTE_t: the mean over the bodies
    within = lambda e: float(bool(torch.isfinite(e).all() and e.max() < SUCCESS_THRESHOLD_M))  # noqa: E731
    local = ssjr.root_relative(pos, pos[:, 0], quat[:, 0])  # each pose in its own heading frame
    ref_local = ssjr.root_relative(ref_pos, ref_pos[:, 0], ref_quat[:, 0])
    gr = float(ssjr.quat_angle(quat, ref_quat).mean())
    out = {"success": within(gte), "success_strict": within(err["max_body_err_m"]), "max_gte_m": float(gte.max()),
           "g_mpjpe_mm": 1000.0 * float(gte.mean()),
           "mpjpe_mm": 1000.0 * float((ref_local - local).norm(dim=-1).mean()), "gr_err_rad": gr,
           "gr_err_deg": math.degrees(gr)}
    out.update(reward_terms(pos, quat, ref_pos, ref_quat, dt_s, ssjr.BODY_PARENTS, ssjr.KEYPOINT_BODY_IDS))
    if command == HUMAN_KEYPOINTS:
        out.update(dict.fromkeys((*METRICS, "max_gte_m"), math.nan))
    out["keypoint_err_mm"] = 1000.0 * float(err["keypoint_err_m"].mean())
    out["steps"] = float(len(pos))
    out["max_keypoint_err_m"] = float(err["max_keypoint_err_m"].max())
    return out


# --- 2. Statistics over episode rows (dicts: label, ckpt, setting, seed, clip, episode, metrics...). ---
def group(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    """Rows by the values of `keys`."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


Z95 = stats.norm.ppf(0.975)


def wilson(k: float, n: int) -> tuple[float, float]:
    """95 % Wilson score interval of a rate, k successes in n independent trials."""
    if n == 0:
        return math.nan, math.nan
    p, z2 = k / n, Z95 ** 2
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_rate_difference(a, b) -> tuple[float, float, float]:
    """(mean(a) - mean(b), 95 % interval) of paired 0/1 outcomes: Newcombe's hybrid score interval (method 10 of
    Newcombe 1998, Stat. Med. 17:2635), built from the two Wilson intervals and the pairs' correlation phi."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    n = len(a)
    if n == 0:
        return math.nan, math.nan, math.nan
    both, only_a, only_b, neither = ((a & b).sum(), (a & ~b).sum(), (~a & b).sum(), (~a & ~b).sum())
    p1, p2 = a.mean(), b.mean()
    (l1, u1), (l2, u2) = wilson(int(a.sum()), n), wilson(int(b.sum()), n)
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


def per_run(rows: list[dict], metric: str) -> list[list[float]]:
    """The finite values of `metric`, one list per checkpoint (training run), in the order the runs were given."""
    return [xs for sel in group(rows, "ckpt").values() if (xs := [r[metric] for r in sel if math.isfinite(r[metric])])]


def estimate(rows: list[dict], metric: str, independent: bool) -> dict:
    """`metric` over the rows of one label and setting: {mean, lo, hi (95 % interval), n (episodes), runs}; PERCENT
    metrics in %. One run: over its episodes (rates: Wilson, others: t), no interval if they are not independent.
    Several runs: the mean of the run means and a t-interval over the runs."""
    runs, scale = per_run(rows, metric), 100.0 if metric in PERCENT else 1.0
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
    """`rows` - `ref_rows` of one setting: {diff, lo, hi (95 % interval), p, test, n (pairs), runs}; PERCENT metrics in
    points. One run each: the mean paired difference over the episodes, for 0/1 metrics with Newcombe's interval and
    McNemar's test, else with a t-interval and the paired t-test; no interval or test for episodes that are not
    independent. Several runs (paired in the order given, or each with the other side's single run): the per-pair
    differences, their mean, t-interval and one-sample t-test (with one reference run it leaves out that run's own
    spread: the test says so)."""
    scale = 100.0 if metric in PERCENT else 1.0
    runs, ref_runs = list(group(rows, "ckpt").values()), list(group(ref_rows, "ckpt").values())
    if not runs or not ref_runs or 1 not in (len(runs), len(ref_runs)) and len(runs) != len(ref_runs):
        return {"diff": math.nan, "lo": math.nan, "hi": math.nan, "p": math.nan, "test": "runs not pairable", "n": 0,
                "runs": 0}
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
            lo = hi = p = math.nan
            test = "near-identical starts"
    return {"diff": scale * diff, "lo": scale * lo, "hi": scale * hi, "p": p, "test": test, "n": n, "runs": len(runs)}


def comparison_rows(rows: list[dict], labels: list[str], settings: list[Setting], alpha: float,
                    metrics=ALL_METRICS) -> list[dict]:
    """Every label against every label before it (e.g. student vs teacher, w/o HCDR vs teacher and vs student), per
    setting and metric (but those NaN in every row)."""
    out, by = [], group(rows, "label", "setting")
    metrics = [m for m in metrics if any(math.isfinite(r[m]) for r in rows)]
    for j, label in enumerate(labels):
        for reference in labels[:j]:
            for s in settings:
                for metric in metrics:
                    c = compare(by.get((label, s.name), []), by.get((reference, s.name), []), metric, s.dr)
                    out.append({"label": label, "reference": reference, "setting": s.name, "metric": metric, **c,
                                "significant": bool(c["p"] < alpha)})
    return out


# --- 3. Reports: markdown tables, CSV, JSON (every file through ssjr.write_atomic). ---
def _fmt(x: float, metric: str) -> str:
    return f"{x:.{1 if metric in PERCENT else 0 if metric.endswith('_mm') or metric == 'steps' else 3}f}"


def _cell(rows: list[dict], metric: str, independent: bool) -> str:
    """mean [95 % interval]; for several runs also their number; a rate of near-identical starts says so."""
    e = estimate(rows, metric, independent)
    if e["n"] == 0:
        return "n/a"
    text = _fmt(e["mean"], metric)
    if math.isfinite(e["lo"]):
        text += f" [{_fmt(e['lo'], metric)}, {_fmt(e['hi'], metric)}]"
    if e["runs"] > 1:
        return text + f" ({e['runs']} runs)"
    return text + (f" ({e['n']} near-identical starts)" if metric in PERCENT and not independent else "")


def _md(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body]) + "\n"


def table1_markdown(rows: list[dict], labels: list[str], settings: list[Setting], alpha: float,
                    columns=TABLE1_METRICS) -> str:
    """Paper Table 1: one row per label, the `columns` per setting; `*` = p < alpha against the first label."""
    by = group(rows, "label", "setting")
    star = {(c["label"], c["setting"], c["metric"]) for c in comparison_rows(rows, labels, settings, alpha, [
        m for m, _ in columns]) if c["significant"] and c["reference"] == labels[0]}
    body = [[label] + [_cell(by.get((label, s.name), []), m, s.dr) + (" *" if (label, s.name, m) in star else "")
                       for s in settings for m, _ in columns] for label in labels]
    return _md(["Method"] + [f"{s.title} {name}" for s in settings for _, name in columns], body)


def runs_markdown(rows: list[dict], settings: list[Setting], columns=TABLE1_METRICS[:2]) -> str:
    """One row per checkpoint (training run): the `columns` per setting."""
    by = group(rows, "ckpt", "setting")
    body = [[sel[0]["label"], f"`{ckpt}`"] + [_cell(by.get((ckpt, s.name), []), m, s.dr) for s in settings
                                              for m, _ in columns] for (ckpt,), sel in group(rows, "ckpt").items()]
    return _md(["Method", "checkpoint"] + [f"{s.title} {name}" for s in settings for _, name in columns], body)


def per_motion_markdown(rows: list[dict], labels: list[str], setting: Setting, motions: list[str],
                        columns=TABLE1_METRICS) -> str:
    """Per motion (all segments of one source clip) or per keypoint command: the `columns` per label."""
    by = group(rows, "label", "setting", "motion")
    body = [[motion] + [_cell(by.get((label, setting.name, motion), []), m, setting.dr) for label in labels
                        for m, _ in columns] for motion in motions]
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


def comparison_markdown(rows: list[dict], labels: list[str], settings: list[Setting], alpha: float,
                        metrics=ALL_METRICS) -> str:
    """comparison_rows as a table: method - reference [95 % interval], the test, p, pairs of episodes, runs."""
    def interval(c):
        return f"[{_fmt(c['lo'], c['metric'])}, {_fmt(c['hi'], c['metric'])}]" if math.isfinite(c["lo"]) else ""
    body = [[c["label"], c["reference"], c["setting"], c["metric"], f"{_fmt(c['diff'], c['metric'])} {interval(c)}",
             c["test"], f"{c['p']:.2e}" if math.isfinite(c["p"]) else "", str(c["n"]), str(c["runs"]),
             "yes" if c["significant"] else "no"] for c in comparison_rows(rows, labels, settings, alpha, metrics)]
    return _md(["Method", "vs", "Setting", "Metric", "difference [95 % interval]", "test", "p", "pairs", "runs",
                f"p < {alpha}"], body)


def _counts(rows: list[dict], settings: list[Setting]) -> str:
    truncated = sum(r["truncated"] for r in rows)
    cut = (f"; {truncated} of all {len(rows)} recorded episodes were cut short by --max-steps (a success there only "
           f"means no failure so far)") if truncated else ""
    per = group(rows, "ckpt", "setting")
    counts = ", ".join(f"{s.name} {max((len(v) for (_, name), v in per.items() if name == s.name), default=0)} "
                       f"{'independent episodes' if s.dr else 'near-identical starts'}" for s in settings)
    return (f"{len({r['motion'] for r in rows})} motions ({len({r['clip'] for r in rows})} clips), "
            f"{len({r['seed'] for r in rows})} seed(s); per checkpoint: {counts}{cut}")


PUSH_NOTE = (f"+DR: dynamics psi and sensor noise (envs.DR) on every checkpoint; pushes: a root-velocity kick of up "
             f"to {envs.DR().push_vel_mps} m/s every U{list(envs.DR().push_interval_s)} s of episode time.\n\n")


def report_markdown(rows: list[dict], labels: list[str], settings: list[Setting], alpha: float,
                    notes: tuple[str, ...] = ()) -> str:
    """table.md: the paper's tables over the robot-motion episodes, keypoint error and falls over the human keypoint
    command episodes, the comparisons of both; `notes` first."""
    robot, human = ([r for r in rows if r["command"] == c] for c in (ROBOT, HUMAN_KEYPOINTS))
    flat, with_dr = [s for s in settings if s.terrain == "flat"], [s for s in settings if s.dr]
    parts = [f"# HoRD evaluation\n\nsuccess = max_t GTE_t < {SUCCESS_THRESHOLD_M} m (GTE_t: the bodies' mean "
             f"position error), the episode ends when it fails; success_strict: every body within "
             f"{SUCCESS_THRESHOLD_M} m. Cells: mean [95 % interval]: rates Wilson over independent episodes (+DR), "
             f"other metrics Student t; several runs of a label: over the runs. Settings without DR play "
             f"near-identical starts: no interval. `*`: p < {alpha} against {labels[0]} (McNemar for rates, paired t "
             f"otherwise; over runs: t); every pair of labels: the paired comparisons at the end.\n"]
    if notes:
        parts.append("**Notes**\n\n" + "".join(f"- {n}\n" for n in notes))
    several_runs = len(labels) < len({r["ckpt"] for r in rows})
    if robot:
        parts.append(f"Robot motions (SSJR packets): {_counts(robot, settings)}.\n")
        if flat:
            parts.append("## Table 1: tracking across engines\n\n" + table1_markdown(robot, labels, flat, alpha))
        sloped = [s for s in settings if s.terrain != "flat"]
        if sloped:
            terrain = [s for s in flat if any((s.sim, s.dr) == (t.sim, t.dr) for t in sloped)] + sloped
            parts.append("## Terrain\n\n" + table1_markdown(robot, labels, terrain, alpha))
        if several_runs:
            parts.append("## Runs\n\n" + runs_markdown(robot, settings))
        if with_dr:
            parts.append("## Push recovery\n\n" + PUSH_NOTE + push_markdown(robot, labels, with_dr))
        by = group(robot, "label", "setting")  # the paper's App. table 'comprehensive metrics'
        parts += [f"## All metrics: {s.title}\n\n" + _md(["Metric"] + labels, [
            [(m + " (%)" if m in PERCENT else m) + (" ↓" if m in LOWER_IS_BETTER else " ↑")]
            + [_cell(by.get((label, s.name), []), m, s.dr) for label in labels] for m in ALL_METRICS])
            for s in settings]
        motions = list(dict.fromkeys(r["motion"] for r in robot))
        parts += [f"## Per motion: {s.title}\n\n" + per_motion_markdown(robot, labels, s, motions) for s in settings]
        if len(labels) > 1:
            parts.append("## Paired comparisons: robot motions\n\n" + comparison_markdown(
                robot, labels, settings, alpha, ("success", "success_strict", "steps", "g_mpjpe_mm", "mpjpe_mm")))
    if human:
        parts.append(f"## Human keypoint commands\n\n{_counts(human, settings)}. Only the SSJR keypoint bodies are "
                     f"commanded, so these are scored by the keypoint error and the falls instead of the full-body "
                     f"metrics.\n\n" + table1_markdown(human, labels, settings, alpha, KEYPOINT_TABLE))
        if with_dr:
            parts.append("## Push recovery: human keypoint commands\n\n" + PUSH_NOTE
                         + push_markdown(human, labels, with_dr, "fell", "falls of pushed episodes (%)↓"))
        commands = list(dict.fromkeys(r["motion"] for r in human))
        parts += [f"## Per command: {s.title}\n\n" + per_motion_markdown(human, labels, s, commands, KEYPOINT_TABLE)
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

    def write_csv(tmp):  # one line per episode; columns: the union of the row keys in first-seen order
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, list(dict.fromkeys(k for r in rows for k in r)), lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
    ssjr.write_atomic(out / "episodes.csv", write_csv)
    kinds = {command: [r for r in rows if r["command"] == command] for command in (ROBOT, HUMAN_KEYPOINTS)}
    by = {command: group(sel, "label", "setting") for command, sel in kinds.items()}
    by_run = {command: group(sel, "ckpt", "setting") for command, sel in kinds.items()}
    results = lambda command, metrics: {label: {s.name: {m: estimate(by[command].get((label, s.name), []), m,  # noqa
        s.dr) for m in metrics} for s in settings} for label in labels}
    runs = lambda command, metrics: {ckpt: {s.name: {m: estimate(by_run[command].get((ckpt, s.name), []), m,  # noqa
        s.dr) for m in metrics} for s in settings} for ckpt in dict.fromkeys(r["ckpt"] for r in kinds[command])}
    summary = {"labels": labels, "checkpoints": {r["ckpt"]: r["label"] for r in rows},
               "settings": [dataclasses.asdict(s) for s in settings],
               "clips": list(dict.fromkeys(r["clip"] for r in rows)), "reward_c": REWARD_C,
               "success_threshold_m": SUCCESS_THRESHOLD_M, "alpha": alpha, "notes": list(notes),
               "results": results(ROBOT, ALL_METRICS),
               "results_keypoint_commands": results(HUMAN_KEYPOINTS, KEYPOINT_METRICS),
               "runs": runs(ROBOT, ALL_METRICS), "runs_keypoint_commands": runs(HUMAN_KEYPOINTS, KEYPOINT_METRICS),
               "comparisons": {command: comparison_rows(sel, labels, settings, alpha) if len(labels) > 1 else []
                               for command, sel in kinds.items() if sel}}
    strict = json.loads(json.dumps(summary), parse_constant=lambda _: None)  # NaN, inf -> null (strict JSON)
    ssjr.write_atomic(out / "summary.json", lambda tmp: tmp.write_text(json.dumps(strict, indent=1, allow_nan=False)))
    print(report)
    return summary


# --- 4. Settings, motions, checkpoints, envs. ---
@dataclass(frozen=True)
class Setting:
    name: str  # canonical: <engine>[+dr][@<terrain>]
    sim: str
    dr: bool
    terrain: str
    in_domain: bool
    deploy_drift_mps: float | None = None  # played by deploy.py from the ONNX, with this root-estimate drift

    @property
    def title(self) -> str:
        if self.deploy_drift_mps is not None:
            return "deploy.py ONNX, MuJoCo" + (f", root drift {self.deploy_drift_mps:g} m/s" if self.deploy_drift_mps
                                                else "")
        terrain = "" if self.terrain == "flat" else f" {self.terrain.replace('_', ' ')}"
        return f"{ENGINES[self.sim]}{'+DR' if self.dr else ''}{terrain} ({'ID' if self.in_domain else 'OOD'})"


def parse_setting(token: str, train_sim: str) -> Setting:
    """'<engine>[+dr][@<terrain>]' -> Setting; engine isaaclab | genesis | mujoco | in_domain | zero_shot."""
    spec, _, terrain = token.lower().partition("@")
    engine, plus, dr = spec.partition("+")
    terrain = terrain or "flat"
    sim = {"in_domain": train_sim, "zero_shot": ZERO_SHOT[train_sim]}.get(engine, engine)
    if sim not in ENGINES or (plus and dr != "dr") or terrain not in envs.TERRAIN_TYPES:
        raise InputError("--settings", f"bad setting {token!r}: use <engine>[+dr][@<terrain>], engine in "
                         f"{tuple(ENGINES) + ('in_domain', 'zero_shot')}, terrain in {envs.TERRAIN_TYPES}")
    name = sim + ("+dr" if plus else "") + ("" if terrain == "flat" else f"@{terrain}")
    return Setting(name, sim, bool(plus), terrain, sim == train_sim)


def motion_name(clip: str) -> str:
    """The source motion of a packet: its name without the _segNN suffix of a 2-10 s segment."""
    return re.sub(r"_seg\d+$", "", clip)


def resolve_motions(motions: str, packet_dir: str) -> list[pathlib.Path]:
    """'' -> the test split: the packets of ssjr.TEST_CLIPS (<clip>.npz or its segments <clip>_segNN.npz) under
    packet_dir; else a folder (every *.npz in it: SSJR packets and/or human keypoint commands) or one such file."""
    if motions:
        return envs.resolve_motions(motions)
    _, test = ssjr.train_test_split(sorted(pathlib.Path(packet_dir).rglob("*.npz")))
    missing = [c for c in ssjr.TEST_CLIPS if c not in {motion_name(p.stem) for p in test}]
    if missing:
        raise InputError(packet_dir, f"test-split packets missing: {missing}; build them with `python ssjr.py "
                                     f"convert ...` or pass --packet-dir / --motions")
    return sorted(test, key=lambda p: (ssjr.TEST_CLIPS.index(motion_name(p.stem)), p.stem))


def load_policy(path, device: str):
    """(policy, checkpoint): teacher.load_policy or student.load_policy, by the checkpoint's kind."""
    if teacher.load_checkpoint(path)["kind"] == "teacher":
        return teacher.load_policy(path, device)
    return student.load_policy(path, device)


def opened_env(env_cfg: dict, setting: Setting, motion_paths: list[pathlib.Path], num_envs: int, device: str,
               seed: int) -> contextlib.closing:
    """The checkpoint's env with the setting's engine, DR and terrain, the evaluated motions, frame-0 starts
    (independent, paired episodes) and the paper's failure test (the bodies' mean error); closed on exit, also on an
    error (Isaac Lab allows one live env per process)."""
    return contextlib.closing(envs.make_env(**{
        **env_cfg, "sim": setting.sim, "dr": "default" if setting.dr else None, "terrain": setting.terrain,
        "motions": [str(p) for p in motion_paths], "num_envs": num_envs, "device": device, "seed": seed,
        "start": "frame0", "exclude_test": False, "termination": "mean"}))


# --- 5. Rollouts. ---
def episode_plan(num_envs: int, num_clips: int, episodes_per_clip: int) -> list[list[tuple[int, int] | None]]:
    """Which episodes to keep. With start='frame0', env i plays clips i, i+N, i+2N, ... (mod clips) whatever the
    outcomes, so the plan is fixed in advance: plan[i][k] = (clip, episode index) for env i's k-th episode, or None
    (played, not kept). Each clip is kept episodes_per_clip times, earliest first."""
    counts = [0] * num_clips
    plan: list[list[tuple[int, int] | None]] = [[] for _ in range(num_envs)]
    k = 0
    while min(counts) < episodes_per_clip:
        for i in range(num_envs):
            c = (i + k * num_envs) % num_clips
            plan[i].append((c, counts[c]) if counts[c] < episodes_per_clip else None)
            counts[c] += plan[i][-1] is not None
        k += 1
    for p in plan:
        while p and p[-1] is None:
            p.pop()
    return plan


def run_episodes(env, obs: dict, policy, plan: list[list[tuple[int, int] | None]], max_steps: int = 0):
    """Roll `policy` in `env` (start='frame0'; `obs` from its first reset or env.reseed(seed): a second reset would
    skip clips) and yield each planned episode as a dict: clip, episode, steps, RECORDED arrays [T,...] (numpy),
    failed, time_out, nan, truncated, pushes (steps of the episode that applied a push) and psi (its dynamics)."""
    n = env.num_envs
    k, start = [0] * n, [0] * n  # current episode of each env, and the step it started at
    steps: list[dict] = []  # per control step: CPU copies of the [N,...] arrays; steps[0] is step `base`
    base = 0

    def record(i: int, end: int, truncated: bool) -> dict:
        clip, episode = plan[i][k[i]]
        window = steps[start[i] - base:end - base]
        col = lambda key: torch.stack([s[key][i] for s in window])  # noqa: E731
        last = window[-1]
        return {"clip": clip, "episode": episode, "steps": len(window), "truncated": truncated,
                "failed": bool(last["failed"][i]), "time_out": bool(last["time_out"][i]), "nan": bool(last["nan"][i]),
                "pushes": int(col("pushed").sum()), "psi": {key: float(v[i]) for key, v in last["psi"].items()},
                **{key: col(key).numpy() for key in RECORDED}}

    step = 0
    while any(k[i] < len(plan[i]) for i in range(n)):
        if max_steps and step >= max_steps:
            for i in range(n):
                if k[i] < len(plan[i]) and plan[i][k[i]] is not None and step > start[i]:
                    yield record(i, step, True)
            return
        with torch.no_grad():  # not inference_mode: the env keeps the actions in its state, and reseed writes there
            obs, _, done, info = env.step(policy.act(obs))
        entry = {key: getattr(env, key).detach().to("cpu", torch.float32).clone() for key in RECORDED}
        entry.update({key: info[key].cpu() for key in ("clip", "failed", "time_out", "nan", "pushed")},
                     psi={key: v.cpu() for key, v in info["psi"].items()})
        steps.append(entry)
        step += 1
        for i in done.nonzero().flatten().tolist():
            if k[i] < len(plan[i]):
                if plan[i][k[i]] is not None:
                    yield record(i, step, False)
                k[i] += 1
                start[i] = step
        keep_from = min([start[i] for i in range(n) if k[i] < len(plan[i])], default=step)
        del steps[:keep_from - base]
        base = keep_from


def evaluate_seed(env, policy, ckpt: dict, path, label: str, setting: Setting, seed: int, clips: list[str],
                  kinds: list[str], plan, max_steps: int = 0):
    """Restart the setting's env with `seed` (env.reseed), roll the policy and yield (CSV row, recorded episode).
    clips, kinds: name and ssjr.packet_kind of each motion file, in the env's clip order."""
    obs = env.reseed(seed)
    reads = {"teacher": student.TEACHER_ACTOR_OBS, "student": student.STUDENT_OBS}[ckpt["kind"]]  # its policy's inputs
    teacher.check_layout(path, ckpt["obs_layout"], env.obs_layout, reads)
    for rec in run_episodes(env, obs, policy, plan, max_steps):
        clip, command = clips[rec["clip"]], kinds[rec["clip"]]
        metrics = episode_metrics(rec, command=command)
        if rec["failed"]:  # an early end (the env's failure test or a blow-up) is never a success
            metrics.update({k: 0.0 for k in ("success", "success_strict") if math.isfinite(metrics[k])})
        row = {"label": label, "ckpt": str(path), "kind": ckpt["kind"], "setting": setting.name, "sim": setting.sim,
               "dr": int(setting.dr), "terrain": setting.terrain, "seed": seed, "command": command,
               "motion": motion_name(clip), "clip": clip, "episode": rec["episode"], "steps": rec["steps"],
               "duration_s": rec["steps"] * envs.CONTROL_DT_S, **metrics,
               "fell": float(rec["failed"]), "time_out": int(rec["time_out"]), "nan": int(rec["nan"]),
               "truncated": int(rec["truncated"]), "pushes": rec["pushes"],
               **{f"psi_{k}": v for k, v in rec["psi"].items()}}
        yield row, rec


def deploy_setting(drift_mps: float) -> Setting:
    return Setting("deploy" + (f"+drift{drift_mps:g}" if drift_mps else ""), "mujoco", False, "flat", False, drift_mps)


def deploy_rows(onnx_path, label: str, setting: Setting, seeds, motion_paths: list[pathlib.Path], kinds: list[str]):
    """deploy.py's episodes of an exported student (robot motions: a keypoint command has no robot start state), each
    scored against the env's own 50 Hz reference (envs.MotionLib) like every other setting. Without drift the physics
    is deterministic: one episode per clip; with drift one per clip and seed (its direction)."""
    import deploy
    policy = deploy.Policy(onnx_path)
    robot = deploy.Robot(policy)
    for path, kind in zip(motion_paths, kinds):
        if kind != ROBOT:
            continue
        command, reference = deploy.Command(path, policy), envs.MotionLib([path], "cpu")
        for seed in seeds if setting.deploy_drift_mps else seeds[:1]:
            rec = deploy.run_episode(policy, command, robot, setting.deploy_drift_mps, seed)
            steps = len(rec["body_pos_w"])
            ticks = torch.arange(1, steps + 1)  # the states after steps 1..T
            ref = reference.at_tick(torch.zeros_like(ticks), ticks)
            rec.update(ref_body_pos_w=ref["body_pos"].numpy(), ref_body_quat_w=ref["body_quat"].numpy())
            metrics = episode_metrics(rec)
            failed = steps < command.num_ticks - 1
            if failed:
                metrics.update(success=0.0, success_strict=0.0)
            yield {"label": label, "ckpt": str(onnx_path), "kind": "student_onnx", "setting": setting.name,
                   "sim": "mujoco", "dr": 0, "terrain": "flat", "seed": seed, "command": kind,
                   "motion": motion_name(path.stem), "clip": path.stem, "episode": 0, "steps": steps,
                   "duration_s": steps * envs.CONTROL_DT_S, **metrics, "fell": float(failed),
                   "time_out": int(not failed), "nan": int(not np.isfinite(rec["body_pos_w"]).all()), "truncated": 0,
                   "pushes": 0}


# The parity check: the inputs deploy.py builds vs the env's observations of the same MuJoCo state (float64 readings
# vs the env's float32), and the ONNX graph's alpha vs the torch student's.
PARITY_TOLERANCE = {"inputs": 1e-4, "alpha": 1e-3}  # m, rad, rad/s; rad


def proprio_field(i: int) -> str:
    """The name of entry i of a student_proprio / history row (DEPLOY_INPUTS)."""
    fields = ([f"joint pos {n}" for n in ssjr.DOF_NAMES] + [f"joint vel {n}" for n in ssjr.DOF_NAMES]
              + [f"gyro[{k}]" for k in range(3)] + [f"gravity[{k}]" for k in range(3)]
              + [f"alpha {n}" for n in ssjr.DOF_NAMES])
    return fields[i]


def parity(args: Args) -> str:
    """See Args.parity. Returns the verdict line (also printed)."""
    import deploy
    if len(args.ckpt) != 1 or len(args.onnx) != 1:
        raise InputError("--parity", "give one student checkpoint (--ckpt) and its export (--onnx)")
    torch_policy, ckpt = load_policy(args.ckpt[0], "cpu")
    if ckpt["kind"] != "student":
        raise InputError(args.ckpt[0], "--parity compares a student with its ONNX export: this is a teacher")
    onnx_policy = deploy.Policy(args.onnx[0])
    path = resolve_motions(args.motions, args.packet_dir)[0]
    verdict, worst = "", {}
    with opened_env(ckpt["env_cfg"], parse_setting("mujoco", "mujoco"), [path], 1, "cpu", seed=0) as env:
        obs = env.reseed(0)
        command = deploy.Command(path, onnx_policy)
        command.keypoints_w = command.keypoints_w + env.ref_offset[0].numpy()  # the env places the clip on a tile
        robot, data = deploy.Robot(onnx_policy), env.sim.datas[0]  # deploy's readings of the env's own MuJoCo state
        reading = robot.read(data)
        controller = deploy.Controller(onnx_policy, reading, command.start_q)
        for t in range(args.max_steps or command.num_ticks - 1):
            inputs = controller.inputs(reading, command)
            alpha_onnx, y_onnx = onnx_policy(inputs)
            alpha = torch_policy.act(obs)
            pos, quat = (x[0, 0] for x in env.sim.body_state()[:2])
            window = env.reference(env.window_steps)["body_pos"][0, :len(onnx_policy.keypoint_steps)]
            terms = [("student_proprio", obs["student_proprio"][0]), ("history", obs["history"][0]),
                     ("history_mask", obs["history_mask"][0]), ("terrain", obs["terrain"][0]),
                     ("root_pos_w", pos), ("root_quat_w", quat), ("keypoints_w", window[:, env.keypoint_ids]),
                     ("student_keypoints (Y_t in the graph)", obs["student_keypoints"][0]), ("alpha", alpha[0])]
            for name, theirs in terms:
                mine = {"student_keypoints (Y_t in the graph)": y_onnx, "alpha": alpha_onnx}.get(name, inputs.get(name))
                err = np.abs(np.asarray(mine, np.float64) - theirs.double().numpy())
                worst[name] = max(worst.get(name, 0.0), float(err.max()))
                tolerance = PARITY_TOLERANCE["alpha" if name == "alpha" else "inputs"]
                if err.max() > tolerance:
                    index = [int(i) for i in np.unravel_index(err.argmax(), err.shape)]
                    field = f" ({proprio_field(index[-1])})" if name in ("student_proprio", "history") else ""
                    verdict = (f"step {t}: {name}{index}{field} differs: max error {err.max():.3g} "
                               f"(tolerance {tolerance:g})")
                    break
            if verdict:
                break
            obs, _, done, _ = env.step(alpha)
            before, reading = reading, robot.read(data)
            controller.advance(alpha[0].double().numpy(), before, reading)
            if done[0]:
                break
    verdict = verdict or (f"all inputs match: {t + 1} steps of {path.stem}; max errors "
                          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    print(verdict)
    return verdict


# --- 6. Main. ---
def main(args: Args) -> dict:
    from tqdm import tqdm
    stems = [pathlib.Path(p).stem for p in args.ckpt]
    ckpt_labels = list(args.labels) or (stems if len(set(stems)) == len(stems) else list(args.ckpt))
    if len(ckpt_labels) != len(args.ckpt):
        raise InputError("--labels", f"one name per checkpoint: {ckpt_labels} for {list(args.ckpt)}")
    if not ((args.ckpt or args.onnx) and args.seeds and min(args.seeds) >= 0 and min(args.num_envs, args.episodes) > 0
            and len({*args.seeds}) == len(args.seeds) and len({*args.ckpt}) == len(args.ckpt)):
        raise InputError("--ckpt/--seeds/--num-envs/--episodes", "give distinct checkpoints, distinct seeds >= 0, >= 1 "
                                                                 "env and episode")
    onnx_labels = list(args.onnx_labels) or [pathlib.Path(p).stem for p in args.onnx]
    if len(onnx_labels) != len(args.onnx):
        raise InputError("--onnx-labels", f"one name per ONNX file: {onnx_labels} for {list(args.onnx)}")
    if args.parity:
        return {"parity": parity(args)}
    labels = list(dict.fromkeys(ckpt_labels + onnx_labels))
    train_sim = [teacher.load_checkpoint(p) for p in args.ckpt][0]["env_cfg"]["sim"] if args.ckpt else "genesis"
    settings = [parse_setting(t, train_sim) for t in args.settings] if args.ckpt else []
    deploy_settings = [deploy_setting(v) for v in args.root_drift_mps] if args.onnx else []
    motion_paths = resolve_motions(args.motions, args.packet_dir)
    clips, kinds = [p.stem for p in motion_paths], [ssjr.packet_kind(p) for p in motion_paths]
    episodes = {s.name: args.episodes if s.dr else 1 for s in settings}  # without DR: near-identical starts
    rows = []
    bar = tqdm(total=len(args.ckpt) * len(args.seeds) * len(clips) * sum(episodes.values()), unit="episode")
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
    notes = coverage_notes(rows, list(args.ckpt), settings, {k: len(clips) * n * len(args.seeds)
                                                             for k, n in episodes.items()}, args.max_steps)
    settings += deploy_settings
    order = {"ckpt": list(args.ckpt) + list(args.onnx), "setting": [s.name for s in settings], "clip": clips}
    rows.sort(key=lambda r: (order["ckpt"].index(r["ckpt"]), order["setting"].index(r["setting"]), r["seed"],
                             order["clip"].index(r["clip"]), r["episode"]))  # episodes finish in any order
    for note in notes:
        warnings.warn(note)
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
    except InputError as e:
        sys.exit(f"error: {e}")
