"""Evaluate HoRD checkpoints the way the paper does (App. D metrics, Table 1 layout) with one command.

    python evaluate.py --ckpt runs/<run>/teacher.pt                               # teacher or student
    python evaluate.py --ckpt hord.pt no_hcdr.pt no_dr.pt --labels HoRD "HoRD w/o HCDR" "HoRD w/o DR"
    python evaluate.py --ckpt s.pt --motions data/keypoints/cmu_bvh --settings genesis   # human keypoint commands
    python evaluate.py --ckpt s.pt --settings genesis --seeds 0 --episodes 1 --max-steps 100   # smoke run

Settings: `<engine>[+dr][@<terrain>]`; engine = isaaclab | genesis | in_domain (the first checkpoint's env_cfg["sim"]) |
zero_shot (the other engine); +dr = envs.DR() (paper Table 5: dynamics psi, pushes, sensor noise); terrain = flat |
smooth_slope | rough_slope. One env per (checkpoint, setting): the checkpoint's env_cfg with these overrides and frame-0
starts (env i plays clips i, i+N, ...), restarted by env.reseed(seed) for every seed, closed before the next is built
(Isaac Lab: one live env per process). psi and pushes follow the seed: t-tests pair episodes by (clip, seed, episode).

Motions: the test split (ssjr.TEST_CLIPS) or a folder/file of SSJR packets and/or human keypoint commands. A keypoint
command commands only the SSJR keypoint bodies: it is scored by the keypoint error and the falls in its own report
section, and its full-body metrics are NaN.

An episode runs from frame 0 until its clip ends or the env terminates it (a body, for a keypoint command a keypoint
body, > 0.5 m from the reference); env.body_pos_w, ref_body_pos_w [N,30,3], body_quat_w, ref_body_quat_w [N,30,4] are
recorded right after every env.step() (the states the env judged). Per episode of T steps (50 Hz), B=30 bodies:

  GTE_t        = max_b ||p_ref_tb - p_tb||                                    (world frame, m)
  success      = max_t GTE_t < 0.5 m and every error finite                   (strict success, %)
  g-mpjpe      = mean_t mean_b ||p_ref_tb - p_tb||                            (world frame, mm)
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

Aggregation: the mean over the episodes of each (checkpoint, setting, seed), then mean ± std (ddof 1) over seeds; a
blown-up episode fails and its errors are left out of the means. Push recovery (+dr): the success rate of the episodes
pushed at least once. Significance: scipy.stats.ttest_rel of each checkpoint against the first, p < --alpha flagged `*`.
Outputs in --out-dir: table.md, episodes.csv (one row per episode), summary.json. Pictures of a motion:
`python ssjr.py show <packet>`.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib
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
import teacher
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
ROBOT, HUMAN_KEYPOINTS = "robot", "human_keypoints"  # the packet kinds (ssjr.packet_kind)
ENGINES = {"isaaclab": "IsaacLab", "genesis": "Genesis"}
RECORDED = ("body_pos_w", "ref_body_pos_w", "body_quat_w", "ref_body_quat_w")


@dataclass
class Args:
    ckpt: tuple[str, ...]
    """checkpoint(s) of teacher.py / student.py; several give an ablation table, the first is the t-test reference"""
    labels: tuple[str, ...] = ()
    """table row names, one per checkpoint (default: file stems), e.g. HoRD 'HoRD w/o HCDR' 'HoRD w/o DR'"""
    settings: tuple[str, ...] = ("isaaclab", "isaaclab+dr", "genesis", "genesis+dr",
                                 "zero_shot@smooth_slope", "zero_shot@rough_slope")
    """evaluation settings, `<engine>[+dr][@<terrain>]` (see the module docstring)"""
    motions: str = ""
    """'' = the test split (ssjr.TEST_CLIPS in packet_dir); else a folder/file of packets and/or keypoint commands"""
    packet_dir: str = str(ssjr.REPO / "data" / "packets" / "g1_moves")
    """folder searched (recursively) for the test-split packets written by `ssjr.py convert`"""
    seeds: tuple[int, ...] = (0, 1, 2)
    """env seeds (dynamics psi, pushes, spawn tile); mean ± std is taken over them"""
    episodes: int = 2
    """episodes per clip and seed"""
    num_envs: int = 16
    """parallel envs (capped at clips x episodes)"""
    device: str = "cpu"
    """torch / simulation device"""
    max_steps: int = 0
    """stop each rollout after this many control steps, recording unfinished episodes as truncated (0 = no cap)"""
    out_dir: str = "results/eval"
    """where table.md, episodes.csv and summary.json go"""
    alpha: float = 0.01
    """significance level of the paired t-tests"""


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
    (the env's failure tests compare these maxima with 0.5 m; `fell`, their verdict, comes with the rollout)."""
    pos, ref_pos, quat, ref_quat = (torch.as_tensor(np.asarray(rec[k]), dtype=torch.float64) for k in RECORDED)
    err = envs.body_error_metrics(pos, ref_pos)  # per step [T]; the env's info["metrics"] are the same functions
    gte = err["max_body_err_m"]
    local = ssjr.root_relative(pos, pos[:, 0], quat[:, 0])  # each pose in its own heading frame
    ref_local = ssjr.root_relative(ref_pos, ref_pos[:, 0], ref_quat[:, 0])
    gr = float(ssjr.quat_angle(quat, ref_quat).mean())
    out = {"success": float(bool(torch.isfinite(gte).all() and gte.max() < SUCCESS_THRESHOLD_M)),
           "max_gte_m": float(gte.max()), "g_mpjpe_mm": 1000.0 * float(err["gt_err_m"].mean()),
           "mpjpe_mm": 1000.0 * float((ref_local - local).norm(dim=-1).mean()), "gr_err_rad": gr,
           "gr_err_deg": math.degrees(gr)}
    out.update(reward_terms(pos, quat, ref_pos, ref_quat, dt_s, ssjr.BODY_PARENTS, ssjr.KEYPOINT_BODY_IDS))
    if command == HUMAN_KEYPOINTS:
        out.update(dict.fromkeys((*METRICS, "max_gte_m"), math.nan))
    out["keypoint_err_mm"] = 1000.0 * float(err["keypoint_err_m"].mean())
    out["max_keypoint_err_m"] = float(err["max_keypoint_err_m"].max())
    return out


# --- 2. Aggregation and statistics over episode rows (dicts: label, setting, seed, clip, episode, metrics...). ---
def group(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    """Rows by the values of `keys`."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def seed_stats(rows: list[dict], metric: str) -> tuple[float, float, int]:
    """Mean over episodes per seed, then (mean, std ddof=1 (0 for one seed), number of seeds); PERCENT metrics in %."""
    scale = 100.0 if metric in PERCENT else 1.0
    per_seed = [scale * sum(xs) / len(xs) for _, sel in sorted(group(rows, "seed").items())
                if (xs := [r[metric] for r in sel if math.isfinite(r[metric])])]
    if not per_seed:
        return math.nan, math.nan, 0
    return float(np.mean(per_seed)), float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else 0.0, len(per_seed)


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


def paired_comparison(by_label_setting: dict[tuple, list[dict]], metric: str, setting: str, label: str,
                      ref_label: str) -> tuple[float, float, int]:
    """paired_ttest of `label` against `ref_label` in `setting` (rows grouped by label, setting), pairing episodes by
    (clip, seed, episode)."""
    key = lambda r: (r["clip"], r["seed"], r["episode"])  # noqa: E731
    ref = {key(r): r[metric] for r in by_label_setting.get((ref_label, setting), [])}
    pairs = [(r[metric], ref[key(r)]) for r in by_label_setting.get((label, setting), []) if key(r) in ref]
    return paired_ttest([p[0] for p in pairs], [p[1] for p in pairs])


def ttest_rows(rows: list[dict], labels: list[str], settings: list[str], alpha: float) -> list[dict]:
    """Every checkpoint after the first against the first, per setting and metric (but those NaN in every row)."""
    out, by = [], group(rows, "label", "setting")
    metrics = [m for m in ALL_METRICS if any(math.isfinite(r[m]) for r in rows)]
    for label in labels[1:]:
        for setting in settings:
            for metric in metrics:
                t, p, df = paired_comparison(by, metric, setting, label, labels[0])
                out.append({"label": label, "reference": labels[0], "setting": setting, "metric": metric,
                            "t": t, "p": p, "df": df, "significant": bool(p < alpha)})
    return out


# --- 3. Reports: markdown tables, CSV, JSON (every file through ssjr.write_atomic). ---
def _cell(rows: list[dict], metric: str) -> str:
    """mean ± std over seeds (mean alone for one seed)."""
    mean, std, n = seed_stats(rows, metric)
    d = 1 if metric in PERCENT else 0 if metric.endswith("_mm") else 3
    return "n/a" if n == 0 else f"{mean:.{d}f} ± {std:.{d}f}" if n > 1 else f"{mean:.{d}f}"


def _md(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body]) + "\n"


def table1_markdown(rows: list[dict], labels: list[str], settings: list[Setting], alpha: float,
                    columns=TABLE1_METRICS) -> str:
    """Paper Table 1: one row per checkpoint, the `columns` per setting; `*` = p < alpha against the first row."""
    by = group(rows, "label", "setting")
    star = lambda label, s, m: label != labels[0] and paired_comparison(by, m, s, label, labels[0])[1] < alpha  # noqa
    body = [[label] + [_cell(by.get((label, s.name), []), m) + (" *" if star(label, s.name, m) else "")
                       for s in settings for m, _ in columns] for label in labels]
    return _md(["Method"] + [f"{s.title} {name}" for s in settings for _, name in columns], body)


def per_motion_markdown(rows: list[dict], labels: list[str], setting: Setting, motions: list[str],
                        columns=TABLE1_METRICS) -> str:
    """Per motion (all segments of one source clip) or per keypoint command: the `columns` per checkpoint."""
    by = group(rows, "label", "setting", "motion")
    body = [[motion] + [_cell(by.get((label, setting.name, motion), []), m) for label in labels for m, _ in columns]
            for motion in motions]
    return _md(["Motion"] + [f"{label} {name}" for label in labels for _, name in columns], body)


def push_markdown(rows: list[dict], labels: list[str], settings: list[Setting], metric: str = "success",
                  name: str = "push succ. (%)↑") -> str:
    """Push recovery: `metric` over the episodes pushed at least once, [pushed / all episodes] after each cell."""
    by = group(rows, "label", "setting")

    def cell(sel: list[dict]) -> str:
        pushed = [r for r in sel if r["pushes"] > 0]
        return f"{_cell(pushed, metric)} [{len(pushed)}/{len(sel)}]"
    body = [[label] + [cell(by.get((label, s.name), [])) for s in settings] for label in labels]
    return _md(["Method"] + [f"{s.title} {name} [pushed/all episodes]" for s in settings], body)


def _counts(rows: list[dict]) -> str:
    eps, truncated = {(r["clip"], r["seed"], r["episode"]) for r in rows}, sum(r["truncated"] for r in rows)
    cut = (f"; {truncated} of all {len(rows)} recorded episodes were cut short by --max-steps (a success there only "
           f"means no failure so far)") if truncated else ""
    return (f"{len({r['motion'] for r in rows})} motions ({len({r['clip'] for r in rows})} clips), "
            f"{len({r['seed'] for r in rows})} seed(s), {len(eps)} episodes per checkpoint and setting{cut}")


PUSH_NOTE = (f"+DR: dynamics psi and sensor noise (envs.DR) on every checkpoint; pushes: a root-velocity kick of up "
             f"to {envs.DR().push_vel_mps} m/s every U{list(envs.DR().push_interval_s)} s of episode time.\n\n")


def report_markdown(rows: list[dict], labels: list[str], settings: list[Setting], alpha: float,
                    notes: tuple[str, ...] = ()) -> str:
    """table.md: the paper's tables over the robot-motion episodes, keypoint error and falls over the human keypoint
    command episodes, the t-tests over both; `notes` first."""
    robot, human = ([r for r in rows if r["command"] == c] for c in (ROBOT, HUMAN_KEYPOINTS))
    flat, with_dr = [s for s in settings if s.terrain == "flat"], [s for s in settings if s.dr]
    parts = [f"# HoRD evaluation\n\nMean ± std over seeds; success = max_t GTE_t < {SUCCESS_THRESHOLD_M} m; falls = "
             f"episodes the env ended early (a body, or keypoint body, > {envs.TERMINATION_ERR_M} m from the "
             f"reference, or a blown-up simulation). `*`: paired t-test against {labels[0]} with p < {alpha}.\n"]
    if notes:
        parts.append("**Notes**\n\n" + "".join(f"- {n}\n" for n in notes))
    if robot:
        parts.append(f"Robot motions (SSJR packets): {_counts(robot)}.\n")
        if flat:
            parts.append("## Table 1: tracking across engines\n\n" + table1_markdown(robot, labels, flat, alpha))
        sloped = [s for s in settings if s.terrain != "flat"]
        if sloped:
            terrain = [s for s in flat if any((s.sim, s.dr) == (t.sim, t.dr) for t in sloped)] + sloped
            parts.append("## Terrain\n\n" + table1_markdown(robot, labels, terrain, alpha))
        if with_dr:
            parts.append("## Push recovery\n\n" + PUSH_NOTE + push_markdown(robot, labels, with_dr))
        by = group(robot, "label", "setting")  # the paper's App. table 'comprehensive metrics'
        parts += [f"## All metrics: {s.title}\n\n" + _md(["Metric"] + labels, [
            [(m + " (%)" if m in PERCENT else m) + (" ↓" if m in LOWER_IS_BETTER else " ↑")]
            + [_cell(by.get((label, s.name), []), m) for label in labels] for m in ALL_METRICS]) for s in settings]
        motions = list(dict.fromkeys(r["motion"] for r in robot))
        parts += [f"## Per motion: {s.title}\n\n" + per_motion_markdown(robot, labels, s, motions) for s in settings]
    if human:
        parts.append(f"## Human keypoint commands\n\n{_counts(human)}. Only the SSJR keypoint bodies are commanded, "
                     f"so these are scored by the keypoint error and the falls instead of the full-body metrics.\n\n"
                     + table1_markdown(human, labels, settings, alpha, KEYPOINT_TABLE))
        if with_dr:
            parts.append("## Push recovery: human keypoint commands\n\n" + PUSH_NOTE
                         + push_markdown(human, labels, with_dr, "fell", "falls of pushed episodes (%)↓"))
        commands = list(dict.fromkeys(r["motion"] for r in human))
        parts += [f"## Per command: {s.title}\n\n" + per_motion_markdown(human, labels, s, commands, KEYPOINT_TABLE)
                  for s in settings]
    if len(labels) > 1:
        body = [[t["label"], t["reference"], t["setting"], t["metric"], f"{t['t']:.3f}", f"{t['p']:.2e}", str(t["df"]),
                 "yes" if t["significant"] else "no"] for t in ttest_rows(rows, labels, [s.name for s in settings],
                                                                          alpha)]
        parts.append("## Paired t-tests\n\n" + _md(["Method", "vs", "Setting", "Metric", "t", "p", "df",
                                                    f"p < {alpha}"], body))
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
    by = group(rows, "label", "setting", "command")
    results = lambda command, metrics: {label: {s.name: {m: dict(zip(("mean", "std", "n_seeds"), seed_stats(  # noqa
        by.get((label, s.name, command), []), m))) for m in metrics} for s in settings} for label in labels}
    summary = {"labels": labels, "settings": [dataclasses.asdict(s) for s in settings],
               "clips": list(dict.fromkeys(r["clip"] for r in rows)), "reward_c": REWARD_C,
               "success_threshold_m": SUCCESS_THRESHOLD_M, "alpha": alpha, "notes": list(notes),
               "results": results(ROBOT, ALL_METRICS),
               "results_keypoint_commands": results(HUMAN_KEYPOINTS, KEYPOINT_METRICS),
               "ttests": ttest_rows(rows, labels, [s.name for s in settings], alpha) if len(labels) > 1 else []}
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
    """(policy, checkpoint) from teacher.load_policy or student.load_policy, by the checkpoint's kind."""
    return importlib.import_module(teacher.load_checkpoint(path)["kind"]).load_policy(path, device)


def opened_env(env_cfg: dict, setting: Setting, motion_paths: list[pathlib.Path], num_envs: int, device: str,
               seed: int) -> contextlib.closing:
    """The checkpoint's env (teacher.build_env) with the setting's engine, DR and terrain, the evaluated motions and
    frame-0 starts; closed on exit, also on an error (Isaac Lab allows one live env per process)."""
    return contextlib.closing(teacher.build_env(
        env_cfg, num_envs, device, seed, sim=setting.sim, dr="default" if setting.dr else None, terrain=setting.terrain,
        motions=[str(p) for p in motion_paths], start="frame0", exclude_test=False))


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
    teacher.check_layout(path, ckpt["obs_layout"], env.obs_layout, ckpt["obs_layout"])
    for rec in run_episodes(env, obs, policy, plan, max_steps):
        clip, command = clips[rec["clip"]], kinds[rec["clip"]]
        row = {"label": label, "ckpt": str(path), "kind": ckpt["kind"], "setting": setting.name, "sim": setting.sim,
               "dr": int(setting.dr), "terrain": setting.terrain, "seed": seed, "command": command,
               "motion": motion_name(clip), "clip": clip, "episode": rec["episode"], "steps": rec["steps"],
               "duration_s": rec["steps"] * envs.CONTROL_DT_S, **episode_metrics(rec, command=command),
               "fell": float(rec["failed"]), "time_out": int(rec["time_out"]), "nan": int(rec["nan"]),
               "truncated": int(rec["truncated"]), "pushes": rec["pushes"],
               **{f"psi_{k}": v for k, v in rec["psi"].items()}}
        yield row, rec


# --- 6. Main. ---
def main(args: Args) -> dict:
    from tqdm import tqdm
    stems = [pathlib.Path(p).stem for p in args.ckpt]
    labels = list(args.labels) or (stems if len(set(stems)) == len(stems) else list(args.ckpt))
    if len(labels) != len(args.ckpt) or len(set(labels)) != len(labels):
        raise InputError("--labels", f"one distinct name per checkpoint: {labels} for {list(args.ckpt)}")
    if not (args.ckpt and args.seeds and min(args.num_envs, args.episodes) > 0) or len({*args.seeds}) < len(args.seeds):
        raise InputError("--ckpt/--seeds/--num-envs/--episodes", "give checkpoints, distinct seeds, >= 1 env, episode")
    train_sim = [teacher.load_checkpoint(p) for p in args.ckpt][0]["env_cfg"]["sim"]  # bad files fail here
    settings = [parse_setting(t, train_sim) for t in args.settings]
    motion_paths = resolve_motions(args.motions, args.packet_dir)
    clips, kinds = [p.stem for p in motion_paths], [ssjr.packet_kind(p) for p in motion_paths]
    plan = episode_plan(min(args.num_envs, len(clips) * args.episodes), len(clips), args.episodes)
    rows = []
    bar = tqdm(total=len(args.ckpt) * len(settings) * len(args.seeds) * len(clips) * args.episodes, unit="episode")
    for path, label in zip(args.ckpt, labels):
        policy, ckpt = load_policy(path, args.device)
        for setting in settings:
            bar.set_description(f"{label} | {setting.name} | building the env")
            with opened_env(ckpt["env_cfg"], setting, motion_paths, len(plan), args.device, args.seeds[0]) as env:
                for seed in args.seeds:
                    bar.set_description(f"{label} | {setting.name} | seed {seed}")
                    for row, _ in evaluate_seed(env, policy, ckpt, path, label, setting, seed, clips, kinds, plan,
                                                args.max_steps):
                        rows.append(row)
                        bar.update(1)
    bar.close()
    order = {"label": labels, "setting": [s.name for s in settings], "clip": clips}
    rows.sort(key=lambda r: (order["label"].index(r["label"]), order["setting"].index(r["setting"]), r["seed"],
                             order["clip"].index(r["clip"]), r["episode"]))  # episodes finish in any order
    notes = coverage_notes(rows, labels, settings, len(clips) * args.episodes * len(args.seeds), args.max_steps)
    for note in notes:
        warnings.warn(note)
    return write_outputs(args.out_dir, rows, labels, settings, args.alpha, tuple(notes))


def coverage_notes(rows: list[dict], labels: list[str], settings: list[Setting], planned: int,
                   max_steps: int) -> list[str]:
    """Blown-up (NaN) episodes, and planned episodes never reached (--max-steps caps each whole rollout)."""
    notes, by = [], group(rows, "label", "setting")
    for label in labels:
        for s in settings:
            sel = by.get((label, s.name), [])
            if blown_up := sum(r["nan"] for r in sel):
                notes.append(f"{label} | {s.name}: {blown_up} of {len(sel)} episodes blew up (NaN state); they count "
                             f"as failures and are left out of the error means")
            if len(sel) < planned:
                notes.append(f"{label} | {s.name}: {planned - len(sel)} of {planned} planned episodes not reached "
                             f"within --max-steps {max_steps}")
    return notes


if __name__ == "__main__":
    try:
        main(tyro.cli(Args))
    except InputError as e:
        sys.exit(f"error: {e}")
