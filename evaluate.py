"""Evaluate HoRD checkpoints the way the paper does (App. D metrics, Table 1 layout) with one command.

    python evaluate.py --ckpt runs/<run>/teacher.pt                               # teacher or student
    python evaluate.py --ckpt hord.pt no_hcdr.pt no_dr.pt --labels HoRD "HoRD w/o HCDR" "HoRD w/o DR"
    python evaluate.py --ckpt s.pt --settings genesis --seeds 0 --episodes 1 --max-steps 100   # smoke run

Settings: `<engine>[+dr][@<terrain>]`, engine = isaaclab | genesis | in_domain | zero_shot (in_domain is the engine
the first checkpoint was trained on, env_cfg["sim"]; zero_shot the other one), +dr = envs.DR() (paper Table 5,
pushes and sensor noise on every method's observations included), terrain = flat (default) | smooth_slope | rough_slope. The env of a (checkpoint, setting) is
make_env(**ckpt["env_cfg"]) with sim, dr, terrain, start="frame0", exclude_test=False set by the setting; it is built
once (with the first seed) and `env.reseed(seed)` restarts it for every seed (so the rough-slope heightfield noise is
the first seed's; psi, pushes and spawn tiles follow each seed, from one generator that every reset and push draws
from: two checkpoints see the same psi only in each env's first episode, and the paired t-tests below pair episodes
by clip, seed and episode index, not by dynamics). It is closed (env.close()) before the next one is
built, also on errors: Isaac Lab allows one live env per process. Push recovery (+dr settings) is the success rate of
the episodes that received at least one push (info["pushed"]); pushes come every U[5, 10] s of episode time, so
episodes shorter than 5 s are never pushed.

Motions: the held-out test split (ssjr.TEST_CLIPS) by default, or any packet folder/file. Human keypoint command files
(kind='human_keypoints', e.g. data/keypoints/cmu_bvh/*.npz) are accepted too: the env's reference bodies are then the
default stance at the command's root with only the SSJR keypoint bodies commanded, so for them the full-body metrics
are left empty (NaN) and they are scored by the keypoint error and the falls, in their own report section.

Every episode starts at frame 0 of its clip (reference-state init; make_env(start="frame0")), runs until the clip
ends or the env terminates it (max body error > 0.5 m; max keypoint error for a keypoint command), and is recorded
per control step (50 Hz): env.body_pos_w, env.ref_body_pos_w [N,30,3], env.body_quat_w, env.ref_body_quat_w [N,30,4],
read right after env.step() (the pre-reset states the env's reward and termination were computed from). Metrics per
episode of T steps, B=30 bodies:

  GTE_t        = max_b ||p_ref_tb - p_tb||                                    (world frame, m)
  success      = max_t GTE_t < 0.5 m  (and every error finite)                (strict success)
  g-mpjpe      = mean_t mean_b ||p_ref_tb - p_tb||                            (world frame; reported in mm)
  mpjpe        = mean_t mean_b ||L_ref_t (p_ref_tb - p_ref_t,root) - L_t (p_tb - p_t,root)||   (mm)
                 root = body 0 (pelvis) at the same step t; L_t = inverse heading (yaw-only) rotation of the robot's
                 root at t, L_ref_t that of the reference root. This is ProtoMotions' cartesian_err: each pose in its
                 own heading-aligned root frame (ssjr.root_relative), so a rigid translation or a turn about the
                 vertical gives 0 while tilts and limb errors count. (envs' info mpjpe_m skips the heading alignment.)
  gr_err       = mean_t mean_b angle(q_tb, q_ref_tb)   (geodesic, rad; also degrees)
  reward-aligned terms, each mean_t exp(-c * err_t), c in REWARD_C (ProtoMotions' mimic coefficients):
    dv_rew   err_t = sum_j (qdot_tj - qdot_ref_tj)^2       joint velocity (rad/s), j = the 29 hinges
    kb_rew   err_t = mean_k ||b_tk - b_ref_tk||^2          key bodies = ssjr.KEYPOINT_BODY_IDS, world frame
    lr_rew   err_t = mean_j angle(lr_tj, lr_ref_tj)        local rotation of body j+1 in its parent's frame
    rv_rew   err_t = ||v_t - v_ref_t||^2                   root linear velocity, world frame (m/s)
    rav_rew  err_t = ||w_t - w_ref_t||^2                   root angular velocity, world frame (rad/s)
  keypoint_err = mean_t mean_k ||b_tk - b_ref_tk||, k = the SSJR keypoint bodies   (world frame, mm; every command)
  fell         = the env ended the episode early: its failure test (a body > 0.5 m from the reference; for a human
                 keypoint command a keypoint body > 0.5 m from its keypoint; a fall always triggers it) or a blown-up
                 simulation                                                    (every command; reported in %)
  Velocities are finite differences of the recorded states over one control step (dt = envs.CONTROL_DT_S),
  identical for robot and reference: v_t = (p_root,t+1 - p_root,t)/dt, w_t = rotvec(q_root,t+1 q_root,t^-1)/dt,
  and the joint-velocity error |qdot - qdot_ref| = angle(lr_t^-1 lr_t+1, lr_ref_t^-1 lr_ref_t+1)/dt, exact for hinge
  joints (the MJCF's fixed body offset cancels). These three use the T-1 step pairs of an episode (NaN if T < 2).

Aggregation: per (checkpoint, setting, seed) the mean over its episodes; tables show mean +- std (ddof 1) over seeds.
A blown-up episode fails; its error metrics are NaN and left out of the means, and the report's notes count it.
Significance: paired t-test (own Student-t CDF via the regularized incomplete beta function, no scipy) of each
checkpoint against the first one, pairing episodes by (clip, seed, episode); p < alpha (0.01) is flagged.

Outputs in --out-dir (each written atomically): table.md (Table 1 shape, terrain, push recovery, all metrics,
per-motion, keypoint commands, t-tests), episodes.csv (one row per episode), summary.json, plots/*.png, videos/*.mp4.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib
import inspect
import io
import json
import math
import os
import pathlib
import re
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import tyro

import envs
import ssjr
from ssjr import InputError

SUCCESS_THRESHOLD_M = 0.5  # paper: an episode fails once the global translation error exceeds 0.5 m
REWARD_C = {"dv": 0.002, "kb": 10.0, "lr": 0.2, "rv": 0.5, "rav": 0.1}  # c of exp(-c * err); ProtoMotions' values
METRICS = ("success", "g_mpjpe_mm", "mpjpe_mm", "gr_err_rad", "gr_err_deg",
           "dv_rew", "kb_rew", "lr_rew", "rv_rew", "rav_rew")  # full body: NaN for human keypoint commands
KEYPOINT_METRICS = ("keypoint_err_mm", "fell")  # every command
ALL_METRICS = METRICS + KEYPOINT_METRICS
PERCENT = {"success", "fell"}  # 0/1 per episode, reported in %
LOWER_IS_BETTER = {"g_mpjpe_mm", "mpjpe_mm", "gr_err_rad", "gr_err_deg", "keypoint_err_mm", "fell"}
TABLE1_METRICS = (("success", "Succ. (%)↑"), ("g_mpjpe_mm", "g-mpjpe (mm)↓"), ("mpjpe_mm", "mpjpe (mm)↓"))
KEYPOINT_TABLE = (("keypoint_err_mm", "keypoint err (mm)↓"), ("fell", "falls (%)↓"))
ROBOT, HUMAN_KEYPOINTS = "robot", "human_keypoints"  # the packet kinds (ssjr.save_packet)
ENGINES = {"isaaclab": "IsaacLab", "genesis": "Genesis"}
RECORDED = ("body_pos_w", "ref_body_pos_w", "body_quat_w", "ref_body_quat_w")
ENV_METRICS = ("max_body_err_m", "keypoint_err_m", "max_keypoint_err_m")  # info["metrics"] recorded per step


@dataclass
class Args:
    ckpt: tuple[str, ...]
    """checkpoint(s) written by teacher.py / student.py; several give an ablation table, the first is the t-test
    reference"""
    labels: tuple[str, ...] = ()
    """table row names, one per checkpoint (default: file stems), e.g. HoRD 'HoRD w/o HCDR' 'HoRD w/o DR'"""
    settings: tuple[str, ...] = ("isaaclab", "isaaclab+dr", "genesis", "genesis+dr",
                                 "zero_shot@smooth_slope", "zero_shot@rough_slope")
    """evaluation settings, `<engine>[+dr][@<terrain>]` (see the module docstring)"""
    motions: str = ""
    """'' = the held-out test split (ssjr.TEST_CLIPS, looked up in packet_dir); else a folder or a file of SSJR packets
    and/or human keypoint commands (e.g. data/keypoints/cmu_bvh)"""
    packet_dir: str = str(ssjr.REPO / "data" / "packets" / "g1_moves")
    """folder searched (recursively) for the test-split packets written by `ssjr.py convert`"""
    seeds: tuple[int, ...] = (0, 1, 2)
    """env seeds (episode-level dynamics psi, pushes, spawn tile); mean +- std is taken over them. One env per
    (checkpoint, setting) is built with the first seed and restarted with env.reseed(seed) for each"""
    episodes: int = 2
    """episodes per clip and seed"""
    num_envs: int = 16
    """parallel envs (capped at clips x episodes)"""
    device: str = "cpu"
    """torch / simulation device"""
    max_steps: int = 0
    """stop each rollout after this many control steps, recording unfinished episodes as truncated (0 = no cap)"""
    out_dir: str = "results/eval"
    """where table.md, episodes.csv, summary.json, plots and videos go"""
    video_clips: tuple[str, ...] = ()
    """clips (packet names, or motion names = all their segments) to render as mp4 (robot + reference keypoints),
    first seed, first episode"""
    video_setting: str = ""
    """setting of the videos (default: the first one)"""
    alpha: float = 0.01
    """significance level of the paired t-tests"""


# ---------------------------------------------------------------------------------------------------------------------
# 1. Metrics: small pure functions over one episode's arrays, positions [T,B,3] (m), quaternions [T,B,4] (wxyz).
# ---------------------------------------------------------------------------------------------------------------------
def body_errors_m(pos: torch.Tensor, ref_pos: torch.Tensor) -> torch.Tensor:
    """||p_ref - p|| per step and body, world frame: [T,B]."""
    return (ref_pos - pos).norm(dim=-1)


def gte_m(pos: torch.Tensor, ref_pos: torch.Tensor) -> torch.Tensor:
    """GTE_t, the global translation error of a step: the largest body error, [T]."""
    return body_errors_m(pos, ref_pos).amax(dim=-1)


def strict_success(gte: torch.Tensor) -> bool:
    """max_t GTE_t < 0.5 m; an episode with a non-finite error (a blown-up simulation) fails."""
    return bool(torch.isfinite(gte).all() and gte.max() < SUCCESS_THRESHOLD_M)


def g_mpjpe_m(pos: torch.Tensor, ref_pos: torch.Tensor) -> float:
    """mean_t mean_b ||p_ref - p|| (world frame)."""
    return float(body_errors_m(pos, ref_pos).mean())


def mpjpe_m(pos: torch.Tensor, quat: torch.Tensor, ref_pos: torch.Tensor, ref_quat: torch.Tensor) -> float:
    """mean_t mean_b of the error of body positions relative to the root, each pose in its own heading frame."""
    local = ssjr.root_relative(pos, pos[:, 0], quat[:, 0])
    ref_local = ssjr.root_relative(ref_pos, ref_pos[:, 0], ref_quat[:, 0])
    return float((ref_local - local).norm(dim=-1).mean())


def gr_err_rad(quat: torch.Tensor, ref_quat: torch.Tensor) -> float:
    """mean_t mean_b geodesic angle between the executed and the reference body orientations."""
    return float(ssjr.quat_angle(quat, ref_quat).mean())


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


def keypoint_err_m(pos: torch.Tensor, ref_pos: torch.Tensor) -> torch.Tensor:
    """Mean distance of the SSJR keypoint bodies to their commanded positions per step (world frame), [T]."""
    kb = list(ssjr.KEYPOINT_BODY_IDS)
    return body_errors_m(pos[:, kb], ref_pos[:, kb]).mean(dim=-1)


def episode_metrics(rec: dict, dt_s: float = envs.CONTROL_DT_S, command: str = ROBOT) -> dict[str, float]:
    """The per-episode metrics computable from a recorded episode (rec: RECORDED arrays [T,B,.], numpy or torch):
    METRICS and max_gte_m (NaN for a human keypoint command, whose non-keypoint reference bodies are filler),
    keypoint_err_mm and max_keypoint_err_m. The largest of max_gte_m (robot motion) / max_keypoint_err_m (keypoint
    command) is what the env's failure test compares with 0.5 m; `fell`, its verdict, comes with the rollout."""
    pos, ref_pos, quat, ref_quat = (torch.as_tensor(np.asarray(rec[k]), dtype=torch.float64) for k in RECORDED)
    if pos.ndim != 3 or pos.shape[0] == 0 or pos.shape != ref_pos.shape or quat.shape != ref_quat.shape:
        raise ValueError(f"episode arrays must be [T>0,B,3] / [T,B,4] and match: {tuple(pos.shape)} "
                         f"{tuple(ref_pos.shape)} {tuple(quat.shape)} {tuple(ref_quat.shape)}")
    gte = gte_m(pos, ref_pos)
    gr = gr_err_rad(quat, ref_quat)
    out = {"success": float(strict_success(gte)), "max_gte_m": float(gte.max()),
           "g_mpjpe_mm": 1000.0 * g_mpjpe_m(pos, ref_pos), "mpjpe_mm": 1000.0 * mpjpe_m(pos, quat, ref_pos, ref_quat),
           "gr_err_rad": gr, "gr_err_deg": math.degrees(gr)}
    out.update(reward_terms(pos, quat, ref_pos, ref_quat, dt_s, ssjr.BODY_PARENTS, ssjr.KEYPOINT_BODY_IDS))
    if command == HUMAN_KEYPOINTS:
        out.update(dict.fromkeys((*METRICS, "max_gte_m"), math.nan))
    elif command != ROBOT:
        raise ValueError(f"unknown command kind {command!r}: expected {ROBOT!r} or {HUMAN_KEYPOINTS!r}")
    kb = list(ssjr.KEYPOINT_BODY_IDS)
    out["keypoint_err_mm"] = 1000.0 * float(keypoint_err_m(pos, ref_pos).mean())
    out["max_keypoint_err_m"] = float(body_errors_m(pos[:, kb], ref_pos[:, kb]).max())
    return out


# ---------------------------------------------------------------------------------------------------------------------
# 2. Statistics: paired t-test with a self-contained Student-t distribution.
# ---------------------------------------------------------------------------------------------------------------------
def betainc_reg(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b), by its continued fraction (modified Lentz), a, b > 0, 0 <= x <= 1."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc_reg: x={x} outside [0, 1]")
    if x in (0.0, 1.0):
        return x
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast only below the mean: use the symmetry
        return 1.0 - betainc_reg(b, a, 1.0 - x)
    log_front = a * math.log(x) + b * math.log1p(-x) - math.log(a) - (math.lgamma(a) + math.lgamma(b)
                                                                         - math.lgamma(a + b))
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    frac = d
    for m in range(1, 10_000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            frac *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * frac


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc_reg(0.5 * df, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def paired_ttest(a, b) -> tuple[float, float, int]:
    """Two-sided paired t-test of a vs b (pairs with a NaN dropped) -> (t, p, df). Identical samples give t=0, p=1
    (scipy gives NaN there); a constant non-zero difference gives t=+-inf, p=0; fewer than 2 pairs give NaN."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    d = d[np.isfinite(d)]
    n = len(d)
    if n < 2:
        return math.nan, math.nan, max(n - 1, 0)
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0.0:
        return (0.0, 1.0, n - 1) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0, n - 1)
    t = mean / (sd / math.sqrt(n))
    return t, betainc_reg(0.5 * (n - 1), 0.5, (n - 1) / (n - 1 + t * t)), n - 1


# ---------------------------------------------------------------------------------------------------------------------
# 3. Aggregation and reports over episode rows (dicts: label, setting, seed, clip, episode, metrics...).
# ---------------------------------------------------------------------------------------------------------------------
def _mean(xs) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def group(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    """Rows by the values of `keys` (one pass; the reports index their rows with it)."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def seed_stats(rows: list[dict], metric: str) -> tuple[float, float, int]:
    """Mean over episodes per seed, then (mean, std ddof=1 (0 for one seed), number of seeds); PERCENT metrics in %."""
    scale = 100.0 if metric in PERCENT else 1.0
    per_seed = [scale * _mean([r[metric] for r in sel]) for _, sel in sorted(group(rows, "seed").items())]
    per_seed = [x for x in per_seed if math.isfinite(x)]
    if not per_seed:
        return math.nan, math.nan, 0
    return float(np.mean(per_seed)), float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else 0.0, len(per_seed)


def paired_comparison(by_label_setting: dict[tuple, list[dict]], metric: str, setting: str, label: str,
                      ref_label: str) -> tuple[float, float, int]:
    """Paired t-test of `label` against `ref_label` in `setting` (rows grouped by label, setting), pairing episodes
    by (clip, seed, episode)."""
    key = lambda r: (r["clip"], r["seed"], r["episode"])  # noqa: E731
    ref = {key(r): r[metric] for r in by_label_setting.get((ref_label, setting), [])}
    pairs = [(r[metric], ref[key(r)]) for r in by_label_setting.get((label, setting), []) if key(r) in ref]
    return paired_ttest([p[0] for p in pairs], [p[1] for p in pairs])


def ttest_rows(rows: list[dict], labels: list[str], settings: list[str], alpha: float) -> list[dict]:
    """Every checkpoint after the first against the first, per setting and metric (metrics that are NaN in every
    row, e.g. the full-body ones of a keypoint-command-only run, are left out)."""
    out, by = [], group(rows, "label", "setting")
    metrics = [m for m in ALL_METRICS if any(math.isfinite(r[m]) for r in rows)]
    for label in labels[1:]:
        for setting in settings:
            for metric in metrics:
                t, p, df = paired_comparison(by, metric, setting, label, labels[0])
                out.append({"label": label, "reference": labels[0], "setting": setting, "metric": metric,
                            "t": t, "p": p, "df": df, "significant": bool(p < alpha)})
    return out


def _fmt(mean: float, std: float, n: int, digits: int) -> str:
    if n == 0:
        return "n/a"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if n > 1 else f"{mean:.{digits}f}"


def _digits(metric: str) -> int:
    return 1 if metric in PERCENT else 0 if metric.endswith("_mm") else 3


def _md(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body]) + "\n"


def table1_markdown(rows: list[dict], labels: list[str], settings: list["Setting"], alpha: float,
                    columns=TABLE1_METRICS) -> str:
    """Paper Table 1: one row per checkpoint, the `columns` (Succ. / g-mpjpe / mpjpe) per setting, mean ± std over
    seeds; `*` = paired t-test against the first row with p < alpha."""
    header = ["Method"] + [f"{s.title} {name}" for s in settings for _, name in columns]
    body, by = [], group(rows, "label", "setting")
    for label in labels:
        cells = [label]
        for s in settings:
            for metric, _ in columns:
                cell = _fmt(*seed_stats(by.get((label, s.name), []), metric), _digits(metric))
                if label != labels[0] and paired_comparison(by, metric, s.name, label, labels[0])[1] < alpha:
                    cell += " *"
                cells.append(cell)
        body.append(cells)
    return _md(header, body)


def metrics_markdown(rows: list[dict], labels: list[str], setting: "Setting") -> str:
    """Paper App. Table 'comprehensive metrics': one row per metric, one column per checkpoint."""
    by = group(rows, "label", "setting")
    body = [[(m + " (%)" if m in PERCENT else m) + (" ↓" if m in LOWER_IS_BETTER else " ↑")]
            + [_fmt(*seed_stats(by.get((label, setting.name), []), m), _digits(m)) for label in labels]
            for m in ALL_METRICS]
    return _md(["Metric"] + labels, body)


def per_motion_markdown(rows: list[dict], labels: list[str], setting: "Setting", motions: list[str],
                        columns=TABLE1_METRICS) -> str:
    """Per-motion breakdown (a motion = all segments of one source clip): the `columns` per checkpoint."""
    header = ["Motion"] + [f"{label} {name}" for label in labels for _, name in columns]
    by = group(rows, "label", "setting", "motion")
    body = [[motion] + [_fmt(*seed_stats(by.get((label, setting.name, motion), []), m), _digits(m))
                        for label in labels for m, _ in columns] for motion in motions]
    return _md(header, body)


def push_markdown(rows: list[dict], labels: list[str], settings: list["Setting"], metric: str = "success",
                  name: str = "push succ. (%)↑") -> str:
    """Push recovery: `metric` (success) over the episodes that were pushed at least once, per +DR setting;
    [pushed episodes / all episodes] after each cell."""
    header = ["Method"] + [f"{s.title} {name} [pushed/all episodes]" for s in settings]
    body, by = [], group(rows, "label", "setting")
    for label in labels:
        cells = [label]
        for s in settings:
            sel = by.get((label, s.name), [])
            pushed = [r for r in sel if r["pushes"] > 0]
            cell = _fmt(*seed_stats(pushed, metric), _digits(metric)) if pushed else "n/a"
            cells.append(f"{cell} [{len(pushed)}/{len(sel)}]")
        body.append(cells)
    return _md(header, body)


def ttest_markdown(tests: list[dict], alpha: float) -> str:
    body = [[t["label"], t["reference"], t["setting"], t["metric"], f"{t['t']:.3f}", f"{t['p']:.2e}", str(t["df"]),
             "yes" if t["significant"] else "no"] for t in tests]
    return _md(["Method", "vs", "Setting", "Metric", "t", "p", "df", f"p < {alpha}"], body)


def _counts(rows: list[dict]) -> str:
    motions, clips = {r["motion"] for r in rows}, {r["clip"] for r in rows}
    seeds, eps = {r["seed"] for r in rows}, {(r["clip"], r["seed"], r["episode"]) for r in rows}
    truncated = sum(r["truncated"] for r in rows)
    cut = (f"; {truncated} of all {len(rows)} recorded episodes were cut short by --max-steps (scored on what was "
           f"played: a success there only means no failure so far)") if truncated else ""
    return (f"{len(motions)} motions ({len(clips)} clips), {len(seeds)} seed(s), {len(eps)} episodes per checkpoint "
            f"and setting{cut}")


def push_note() -> str:
    dr = envs.DR()
    lo, hi = dr.push_interval_s
    return (f"+DR settings: episode-level dynamics psi (envs.DR), the same for every checkpoint, and sensor noise on "
            f"every method's observations (gaussian, one draw per reading: joint pos {dr.noise_dof_pos_rad} rad, joint "
            f"vel {dr.noise_dof_vel_rad_s} rad/s, IMU angular velocity {dr.noise_ang_vel_rad_s} rad/s, gravity "
            f"{dr.noise_gravity}, command keypoints {dr.noise_keypoint_m} m). Pushes: a root-velocity kick of up to "
            f"{dr.push_vel_mps} m/s every U[{lo:g}, {hi:g}] s of episode time; episodes shorter than {lo:g} s are never "
            f"pushed.\n\n")


def report_markdown(rows: list[dict], labels: list[str], settings: list["Setting"], alpha: float,
                    notes: tuple[str, ...] = ()) -> str:
    """The full markdown report (what is printed and saved as table.md): the paper's tables over the robot-motion
    episodes, a keypoint error / falls section over the human keypoint command episodes, the t-tests over both.
    notes: lines shown first (e.g. planned episodes that --max-steps cut off)."""
    robot = [r for r in rows if r["command"] == ROBOT]
    human = [r for r in rows if r["command"] == HUMAN_KEYPOINTS]
    flat = [s for s in settings if s.terrain == "flat"]
    with_dr = [s for s in settings if s.dr]
    parts = [f"# HoRD evaluation\n\nMean ± std over seeds; success = max_t GTE_t < {SUCCESS_THRESHOLD_M} m; falls = "
             f"episodes the env ended early (a body > {envs.TERMINATION_ERR_M} m from the reference, a keypoint body "
             f"for human keypoint commands, or a blown-up "
             f"simulation). `*`: paired t-test against {labels[0]} with p < {alpha}.\n"]
    if notes:
        parts.append("**Notes**\n\n" + "".join(f"- {n}\n" for n in notes))
    if robot:
        motions = list(dict.fromkeys(r["motion"] for r in robot))
        parts.append(f"Robot motions (SSJR packets): {_counts(robot)}.\n")
        if flat:
            parts.append("## Table 1: tracking across engines\n\n" + table1_markdown(robot, labels, flat, alpha))
        sloped = [s for s in settings if s.terrain != "flat"]
        if sloped:
            terrain = [s for s in flat if any((s.sim, s.dr) == (t.sim, t.dr) for t in sloped)] + sloped
            parts.append("## Terrain\n\n" + table1_markdown(robot, labels, terrain, alpha))
        if with_dr:
            parts.append("## Push recovery\n\n" + push_note() + push_markdown(robot, labels, with_dr))
        for s in settings:
            parts.append(f"## All metrics: {s.title}\n\n" + metrics_markdown(robot, labels, s))
        for s in settings:
            parts.append(f"## Per motion: {s.title}\n\n" + per_motion_markdown(robot, labels, s, motions))
    if human:
        commands = list(dict.fromkeys(r["motion"] for r in human))
        parts.append(f"## Human keypoint commands\n\n{_counts(human)}. Only the SSJR keypoint bodies are commanded "
                     f"(the other reference bodies are a default stance), so these episodes are scored by the keypoint "
                     f"error and the falls instead of the full-body metrics.\n\n"
                     + table1_markdown(human, labels, settings, alpha, KEYPOINT_TABLE))
        if with_dr:
            parts.append("## Push recovery: human keypoint commands\n\n" + push_note()
                         + push_markdown(human, labels, with_dr, "fell", "falls of pushed episodes (%)↓"))
        for s in settings:
            parts.append(f"## Per command: {s.title}\n\n"
                         + per_motion_markdown(human, labels, s, commands, KEYPOINT_TABLE))
    if len(labels) > 1:
        parts.append("## Paired t-tests\n\n" + ttest_markdown(ttest_rows(rows, labels, [s.name for s in settings],
                                                                         alpha), alpha))
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------------------------
# 4. Files: atomic writes, CSV, plots, videos.
# ---------------------------------------------------------------------------------------------------------------------
def atomic_path(path: pathlib.Path) -> pathlib.Path:
    """A temporary sibling of path with the same suffix (so writers that go by the suffix still work)."""
    return path.with_name(f".tmp-{os.getpid()}-{path.name}")


def write_atomic(path: str | os.PathLike, writer) -> pathlib.Path:
    """writer(tmp_path) writes the file; it then replaces `path` in one step (readers never see half a file)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic_path(path)
    try:
        writer(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path, text: str) -> pathlib.Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def csv_text(rows: list[dict]) -> str:
    """One line per episode; columns: the union of the row keys in first-seen order."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _axis_label(metric: str) -> str:
    return {"success": "strict success (%)", "fell": "falls (%)", "g_mpjpe_mm": "g-mpjpe (mm)",
            "mpjpe_mm": "mpjpe (mm)", "keypoint_err_mm": "keypoint error (mm)"}.get(metric, metric)


def plot_per_motion(rows: list[dict], labels: list[str], setting: "Setting", path,
                    metrics: tuple[str, ...] = ("g_mpjpe_mm", "mpjpe_mm"), what: str = "motion") -> pathlib.Path:
    """Grouped bars of `metrics` per motion and checkpoint, one panel each (error bars: std over seeds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    motions = list(dict.fromkeys(r["motion"] for r in rows))
    fig, axes = plt.subplots(len(metrics), 1, figsize=(min(40.0, max(6.0, 0.9 * len(motions) * len(labels))), 7),
                             sharex=True)
    x = np.arange(len(motions))
    width = 0.8 / len(labels)
    by = group(rows, "label", "setting", "motion")
    for ax, metric in zip(axes, metrics):
        for i, label in enumerate(labels):
            stats = [seed_stats(by.get((label, setting.name, m), []), metric) for m in motions]
            ax.bar(x + (i - (len(labels) - 1) / 2) * width, [s[0] for s in stats], width,
                   yerr=[s[1] for s in stats], label=label, capsize=2)
        ax.set_ylabel(_axis_label(metric))
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_title(f"Per-{what} tracking: {setting.title}")
    axes[0].legend()
    axes[-1].set_xticks(x, motions, rotation=30, ha="right")
    fig.tight_layout()
    out = write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)
    return out


def plot_rate(rows: list[dict], labels: list[str], settings: list["Setting"], path,
              metric: str = "success") -> pathlib.Path:
    """Grouped bars of a rate (success or falls, %) per setting and checkpoint (error bars: std over seeds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(settings) * max(1, len(labels))), 4))
    x = np.arange(len(settings))
    width = 0.8 / len(labels)
    by = group(rows, "label", "setting")
    for i, label in enumerate(labels):
        stats = [seed_stats(by.get((label, s.name), []), metric) for s in settings]
        ax.bar(x + (i - (len(labels) - 1) / 2) * width, [s[0] for s in stats], width, yerr=[s[1] for s in stats],
               label=label, capsize=2)
    ax.set_xticks(x, [s.title for s in settings], rotation=20, ha="right")
    ax.set_ylabel(_axis_label(metric))
    ax.set_ylim(0, 105)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)
    return out


def write_video(rec: dict, path, title: str = "", dt_s: float = envs.CONTROL_DT_S) -> pathlib.Path:
    """mp4 of a recorded episode: the robot's bodies with the reference SSJR keypoints drawn with them."""
    keypoints = np.asarray(rec["ref_body_pos_w"])[:, list(ssjr.KEYPOINT_BODY_IDS)]
    return write_atomic(path, lambda tmp: ssjr.render_motion(np.asarray(rec["body_pos_w"]), tmp, round(1.0 / dt_s),
                                                             extra_points=keypoints, title=title))


# ---------------------------------------------------------------------------------------------------------------------
# 5. Settings, motions, checkpoints.
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    name: str  # canonical: <engine>[+dr][@<terrain>]
    sim: str
    dr: bool
    terrain: str
    in_domain: bool

    @property
    def title(self) -> str:
        terrain = "" if self.terrain == "flat" else f" {self.terrain.replace('_', ' ')}"
        return f"{ENGINES[self.sim]}{'+DR' if self.dr else ''}{terrain} ({'ID' if self.in_domain else 'OOD'})"


def parse_setting(token: str, train_sim: str) -> Setting:
    """'<engine>[+dr][@<terrain>]' -> Setting; engine isaaclab | genesis | in_domain | zero_shot."""
    spec, _, terrain = token.lower().partition("@")
    engine, plus, dr = spec.partition("+")
    terrain = terrain or "flat"
    sim = {"in_domain": train_sim, "zero_shot": next(e for e in ENGINES if e != train_sim)}.get(engine, engine)
    if sim not in ENGINES or (plus and dr != "dr") or terrain not in envs.TERRAIN_TYPES:
        raise InputError("--settings", f"bad setting {token!r}: use <engine>[+dr][@<terrain>], engine in "
                         f"{tuple(ENGINES) + ('in_domain', 'zero_shot')}, terrain in {envs.TERRAIN_TYPES}")
    name = sim + ("+dr" if plus else "") + ("" if terrain == "flat" else f"@{terrain}")
    return Setting(name, sim, bool(plus), terrain, sim == train_sim)


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


def motion_name(clip: str) -> str:
    """The source motion of a packet: its name without the _segNN suffix of a 2-10 s segment."""
    return re.sub(r"_seg\d+$", "", clip)


CKPT_KEYS = ("kind", "env_cfg", "obs_layout", "model")


def read_checkpoint(path: str | os.PathLike) -> dict:
    """Load and sanity-check a checkpoint dict; clear errors for a missing, unreadable or foreign file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise InputError(path, "checkpoint not found")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or non-torch file: say which file, keep the cause
        raise InputError(path, f"not a readable torch checkpoint ({type(e).__name__}: "
                               f"{(str(e).splitlines() or [''])[0][:200]})") from e
    missing = [k for k in CKPT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise InputError(path, f"not a HoRD checkpoint, missing {missing} (expected the dict saved by teacher.py "
                               f"or student.py)")
    if ckpt["kind"] not in ("teacher", "student"):
        raise InputError(path, f"unknown checkpoint kind {ckpt['kind']!r}, expected 'teacher' or 'student'")
    return ckpt


def load_policy(path, device: str):
    """(policy, ckpt) from teacher.load_policy or student.load_policy, by the checkpoint's kind."""
    kind = read_checkpoint(path)["kind"]
    return importlib.import_module(kind).load_policy(path, device)


def check_obs_layout(env_layout: dict, ckpt_layout: dict, path) -> None:
    """Every observation the checkpoint was trained on must exist in the env with the same shape."""
    bad = [f"{k}: checkpoint {list(v)} vs env {env_layout.get(k)}" for k, v in ckpt_layout.items()
           if list(env_layout.get(k, [])) != list(v)]
    if bad:
        raise InputError(path, "checkpoint does not match the env built from its env_cfg: " + "; ".join(bad))


def build_env(ckpt: dict, path, setting: Setting, motion_paths: list[pathlib.Path], num_envs: int, device: str,
              seed: int):
    """make_env with the checkpoint's env_cfg (teacher.env_kwargs: sim, motions, terrain, dr = 'default' | None),
    overridden by the setting (sim, dr, terrain), the evaluated motions and frame-0 starts of every clip."""
    cfg = dict(ckpt["env_cfg"])
    cfg.update(sim=setting.sim, num_envs=num_envs, device=device, motions=[str(p) for p in motion_paths],
               dr=envs.DR() if setting.dr else None, terrain=setting.terrain, seed=seed, start="frame0",
               exclude_test=False)
    unknown = set(cfg) - set(inspect.signature(envs.make_env).parameters)
    if unknown:
        raise InputError(path, f"env_cfg has keys envs.make_env does not take: {sorted(unknown)}")
    return envs.make_env(**cfg)


@contextlib.contextmanager
def opened_env(ckpt: dict, path, setting: Setting, motion_paths: list[pathlib.Path], num_envs: int, device: str,
               seed: int):
    """build_env for a with-block that always closes the env (env.close()), also on an error: Isaac Lab allows one
    live env per process, so the next setting's env can only be built after this one is closed."""
    env = build_env(ckpt, path, setting, motion_paths, num_envs, device, seed)
    try:
        yield env
    finally:
        env.close()


# ---------------------------------------------------------------------------------------------------------------------
# 6. Rollouts.
# ---------------------------------------------------------------------------------------------------------------------
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
    """Roll `policy` in `env` (made with start='frame0'; `obs` from its first reset or env.reseed(seed), a second
    reset would skip clips) and yield each planned episode as a dict: clip, episode, steps, RECORDED arrays [T,...]
    (numpy), env_<ENV_METRICS> [T] (the env's own per-step metrics), failed, time_out, nan, truncated,
    pushes (how many steps of the episode applied a push, info["pushed"]) and psi (the episode's dynamics)."""
    n = env.num_envs
    if len(plan) != n:
        raise ValueError(f"plan is for {len(plan)} envs, env has {n}")
    k, start = [0] * n, [0] * n  # current episode of each env, and the step it started at
    steps: list[dict] = []  # per control step: CPU copies of the [N,...] arrays; steps[0] is step `base`
    base = 0

    def record(i: int, end: int, truncated: bool, info: dict) -> dict:
        clip, episode = plan[i][k[i]]
        window = steps[start[i] - base:end - base]
        col = lambda key: torch.stack([s[key][i] for s in window])  # noqa: E731
        clips = col("clip")
        if not bool((clips == clip).all()):
            raise RuntimeError(f"env {i} played clip(s) {clips.unique().tolist()} where the frame0 schedule "
                               f"says clip {clip}: evaluate.py needs make_env(start='frame0') (clips i, i+N, ...)")
        rec = {"clip": clip, "episode": episode, "steps": len(window), "truncated": truncated,
               "failed": bool(window[-1]["failed"][i]), "time_out": bool(window[-1]["time_out"][i]),
               "nan": bool(window[-1]["nan"][i]), "pushes": int(col("pushed").sum()),
               "psi": {key: float(v[i]) for key, v in info["psi"].items()},
               **{f"env_{key}": col(key).numpy() for key in ENV_METRICS}}
        rec.update({key: col(key).numpy() for key in RECORDED})
        return rec

    step = 0
    while any(k[i] < len(plan[i]) for i in range(n)):
        if max_steps and step >= max_steps:
            for i in range(n):
                if k[i] < len(plan[i]) and plan[i][k[i]] is not None and step > start[i]:
                    yield record(i, step, True, info)
            return
        with torch.no_grad():  # not inference_mode: the env keeps the actions in its state, and reseed writes there
            obs, _, done, info = env.step(policy.act(obs))
        entry = {key: getattr(env, key).detach().to("cpu", torch.float32).clone() for key in RECORDED}
        entry.update(clip=info["clip"].cpu(), failed=info["failed"].cpu(), time_out=info["time_out"].cpu(),
                     nan=info["nan"].cpu(), pushed=info["pushed"].cpu(),
                     **{key: info["metrics"][key].float().cpu() for key in ENV_METRICS})
        steps.append(entry)
        step += 1
        for i in done.nonzero().flatten().tolist():
            if k[i] < len(plan[i]):
                if plan[i][k[i]] is not None:
                    yield record(i, step, False, info)
                k[i] += 1
                start[i] = step
        keep_from = min([start[i] for i in range(n) if k[i] < len(plan[i])], default=step)
        del steps[:keep_from - base]
        base = keep_from


def check_env_metrics(rec: dict, tol_m: float = 1e-3) -> str:
    """'' if this file's per-step errors agree with the env's own info['metrics'] (ENV_METRICS) at every step, else
    a description (a disagreement means the recorded states are not the ones the env judged)."""
    pos, ref_pos = (torch.as_tensor(np.asarray(rec[k]), dtype=torch.float64) for k in ("body_pos_w", "ref_body_pos_w"))
    kb = list(ssjr.KEYPOINT_BODY_IDS)
    ours_by_name = {"max_body_err_m": gte_m(pos, ref_pos), "keypoint_err_m": keypoint_err_m(pos, ref_pos),
                    "max_keypoint_err_m": body_errors_m(pos[:, kb], ref_pos[:, kb]).amax(dim=-1)}
    problems = []
    for name, ours in ours_by_name.items():
        diff = np.abs(np.asarray(rec[f"env_{name}"], np.float64) - ours.numpy())
        if np.any(diff > tol_m):
            problems.append(f"{name} differs from info['metrics']['{name}'] by up to {np.nanmax(diff):.4f} m "
                            f"(largest value here {float(ours.max()):.3f} m)")
    return "; ".join(problems)


# ---------------------------------------------------------------------------------------------------------------------
# 7. Main.
# ---------------------------------------------------------------------------------------------------------------------
def default_labels(paths: list[str]) -> list[str]:
    stems = [pathlib.Path(p).stem for p in paths]
    return stems if len(set(stems)) == len(stems) else [str(p) for p in paths]


def finite_or_none(x):
    """NaN/inf -> None, recursively (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_none(v) for v in x]
    return x


def write_outputs(out_dir, rows: list[dict], labels: list[str], settings: list[Setting], alpha: float,
                  notes: tuple[str, ...] = ()) -> dict:
    """table.md, episodes.csv, summary.json and plots into out_dir; returns the summary."""
    out = pathlib.Path(out_dir)
    report = report_markdown(rows, labels, settings, alpha, notes)
    write_text_atomic(out / "table.md", report)
    write_text_atomic(out / "episodes.csv", csv_text(rows))
    by = group(rows, "label", "setting", "command")
    commands = [c for c in (ROBOT, HUMAN_KEYPOINTS) if any(r["command"] == c for r in rows)]
    summary = {"labels": labels, "settings": [dataclasses.asdict(s) for s in settings],
               "clips": list(dict.fromkeys(r["clip"] for r in rows)),
               "reward_c": REWARD_C, "success_threshold_m": SUCCESS_THRESHOLD_M, "alpha": alpha, "notes": list(notes),
               "results": {label: {s.name: {m: dict(zip(("mean", "std", "n_seeds"),
                                                          seed_stats(by.get((label, s.name, ROBOT), []), m)))
                                            for m in ALL_METRICS} for s in settings} for label in labels},
               "results_keypoint_commands": {label: {s.name: {m: dict(zip(("mean", "std", "n_seeds"), seed_stats(
                   by.get((label, s.name, HUMAN_KEYPOINTS), []), m))) for m in KEYPOINT_METRICS} for s in settings}
                   for label in labels},
               "ttests": ttest_rows(rows, labels, [s.name for s in settings], alpha) if len(labels) > 1 else []}
    write_text_atomic(out / "summary.json", json.dumps(finite_or_none(summary), indent=1, allow_nan=False))
    for command in commands:
        sel = [r for r in rows if r["command"] == command]
        if command == ROBOT:
            plot_rate(sel, labels, settings, out / "plots" / "success_vs_setting.png")
        else:
            plot_rate(sel, labels, settings, out / "plots" / "keypoint_commands_falls_vs_setting.png", "fell")
        for s in settings:
            name = s.name.replace("@", "_")
            if command == ROBOT:
                plot_per_motion(sel, labels, s, out / "plots" / f"per_motion_{name}.png")
            else:
                plot_per_motion(sel, labels, s, out / "plots" / f"per_command_{name}.png", KEYPOINT_METRICS, "command")
    print(report)
    return summary


def evaluate_seed(env, policy, ckpt: dict, path, label: str, setting: Setting, seed: int, clips: list[str],
                  kinds: list[str], plan, max_steps: int = 0):
    """Restart the setting's env with `seed` (env.reseed), roll the policy and yield (CSV row, recorded episode).
    clips, kinds: name and ssjr.packet_kind of each motion file, in the env's clip order."""
    obs = env.reseed(seed)
    check_obs_layout(env.obs_layout, ckpt["obs_layout"], path)
    warned = False
    for rec in run_episodes(env, obs, policy, plan, max_steps):
        command = kinds[rec["clip"]]
        metrics = episode_metrics(rec, command=command)
        problem = check_env_metrics(rec)
        if problem and not warned:
            warned = True
            warnings.warn(f"{label} {setting.name} seed {seed}: {problem}")
        clip = clips[rec["clip"]]
        row = {"label": label, "ckpt": str(path), "kind": ckpt["kind"], "setting": setting.name, "sim": setting.sim,
               "dr": int(setting.dr), "terrain": setting.terrain, "seed": seed, "command": command,
               "motion": motion_name(clip), "clip": clip, "episode": rec["episode"], "steps": rec["steps"],
               "duration_s": rec["steps"] * envs.CONTROL_DT_S, **metrics, "fell": float(rec["failed"]),
               "time_out": int(rec["time_out"]), "nan": int(rec["nan"]), "truncated": int(rec["truncated"]),
               "pushes": rec["pushes"], **{f"psi_{k}": v for k, v in rec["psi"].items()}}
        yield row, rec


def main(args: Args) -> dict:
    from tqdm import tqdm
    if not args.ckpt:
        raise InputError("--ckpt", "give at least one checkpoint")
    labels = list(args.labels) or default_labels(list(args.ckpt))
    if len(labels) != len(args.ckpt) or len(set(labels)) != len(labels):
        raise InputError("--labels", f"one distinct name per checkpoint: {labels} for {list(args.ckpt)}")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        raise InputError("--seeds", f"one or more distinct seeds: {list(args.seeds)}")
    if args.num_envs < 1 or args.episodes < 1:
        raise InputError("--num-envs/--episodes", f"must be at least 1 (got {args.num_envs}, {args.episodes})")
    ckpts = [read_checkpoint(p) for p in args.ckpt]  # fail on a bad file before any simulation
    train_sim = ckpts[0]["env_cfg"].get("sim")
    if train_sim not in ENGINES:
        raise InputError(args.ckpt[0], f"env_cfg['sim'] = {train_sim!r}: expected one of {tuple(ENGINES)}")
    settings = [parse_setting(t, train_sim) for t in args.settings]
    motion_paths = resolve_motions(args.motions, args.packet_dir)
    clips = [p.stem for p in motion_paths]
    kinds = [ssjr.packet_kind(p) for p in motion_paths]
    unknown = set(args.video_clips) - set(clips) - {motion_name(c) for c in clips}
    if unknown:
        raise InputError("--video-clips", f"{sorted(unknown)} not among the evaluated clips {clips}")
    video_setting = parse_setting(args.video_setting, train_sim).name if args.video_setting else settings[0].name
    plan = episode_plan(min(args.num_envs, len(clips) * args.episodes), len(clips), args.episodes)
    rows = []
    bar = tqdm(total=len(args.ckpt) * len(settings) * len(args.seeds) * len(clips) * args.episodes, unit="episode")
    for path, label in zip(args.ckpt, labels):
        policy, ckpt = load_policy(path, args.device)
        for setting in settings:
            bar.set_description(f"{label} | {setting.name} | building the env")
            with opened_env(ckpt, path, setting, motion_paths, len(plan), args.device, args.seeds[0]) as env:
                for seed in args.seeds:
                    bar.set_description(f"{label} | {setting.name} | seed {seed}")
                    for row, rec in evaluate_seed(env, policy, ckpt, path, label, setting, seed, clips, kinds, plan,
                                                  args.max_steps):
                        rows.append(row)
                        if ({row["clip"], row["motion"]} & set(args.video_clips) and setting.name == video_setting
                                and seed == args.seeds[0] and row["episode"] == 0):
                            name = re.sub(r"[^A-Za-z0-9._+-]", "_", f"{label}_{setting.name}_{row['clip']}.mp4")
                            write_video(rec, pathlib.Path(args.out_dir) / "videos" / name,
                                        title=f"{label} | {setting.title} | {row['clip']} | seed {seed}")
                        bar.update(1)
    bar.close()
    order = {"label": labels, "setting": [s.name for s in settings], "clip": clips}
    rows.sort(key=lambda r: (order["label"].index(r["label"]), order["setting"].index(r["setting"]), r["seed"],
                             order["clip"].index(r["clip"]), r["episode"]))  # episodes finish in any order
    notes = coverage_notes(rows, labels, settings, args, clips, len(plan), video_setting)
    for note in notes:
        warnings.warn(note)
    return write_outputs(args.out_dir, rows, labels, settings, args.alpha, tuple(notes))


def coverage_notes(rows: list[dict], labels: list[str], settings: list[Setting], args: Args, clips: list[str],
                   num_envs: int, video_setting: str) -> list[str]:
    """What --max-steps (a cap on each whole rollout, not on each episode) left unplayed: env i plays clips i, i+N,
    ... one after the other, so with more clips than envs the later ones are only reached if the earlier ones end
    in time. Also counts blown-up (NaN) episodes, and names --video-clips that were never recorded."""
    notes, by = [], group(rows, "label", "setting")
    planned = len(clips) * args.episodes * len(args.seeds)
    for label in labels:
        for s in settings:
            sel = by.get((label, s.name), [])
            blown_up = sum(r["nan"] for r in sel)
            if blown_up:
                notes.append(f"{label} | {s.name}: {blown_up} of {len(sel)} episodes blew up (NaN state); they count "
                             f"as failures and are left out of the error means")
            if len(sel) < planned:
                unreached = [c for c in clips if not any(r["clip"] == c for r in sel)]
                notes.append(f"{label} | {s.name}: {planned - len(sel)} of {planned} planned episodes not reached "
                             f"within --max-steps {args.max_steps} (a cap on each rollout of {num_envs} envs); clips "
                             f"never reached: {', '.join(unreached) or 'none'}")
    for label in labels:
        recorded = {c for r in by.get((label, video_setting), []) if (r["seed"], r["episode"]) == (args.seeds[0], 0)
                    for c in (r["clip"], r["motion"])}
        missing_videos = [c for c in args.video_clips if c not in recorded]
        if missing_videos:
            notes.append(f"--video-clips {', '.join(missing_videos)}: not reached for {label} in {video_setting}, "
                         f"seed {args.seeds[0]}: no video")
    return notes


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except InputError as e:
        sys.exit(f"error: {e}")
