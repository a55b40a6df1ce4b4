"""evaluate.py: known-answer tests of the metrics (they are the product), the statistics, the reports, the rollout
loop (on a scripted fake env) and, marked slow, a real short evaluation on both engines."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
import sys

import numpy as np
import pytest
import torch
from scipy import stats

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import envs  # noqa: E402
import evaluate as ev  # noqa: E402
import model  # noqa: E402
import ssjr  # noqa: E402
import teacher  # noqa: E402

DT = envs.CONTROL_DT_S


# ---------------------------------------------------------------------------------------------------------------------
# Synthetic episodes from the real G1 kinematic tree (so local rotations and joint velocities are meaningful).
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fk():
    return ssjr.G1Kinematics()


def motion(fk, T=40, dof_fn=None, root_fn=None, yaw_rate=0.0):
    """A smooth dance-like G1 motion: returns body_pos [T,30,3], body_quat [T,30,4] (float64)."""
    t = torch.arange(T, dtype=torch.float64)[:, None] * DT
    dof = 0.3 * torch.sin(2.0 * t + torch.arange(29, dtype=torch.float64)[None])
    if dof_fn is not None:
        dof = dof_fn(dof, t)
    root = torch.tensor([0.0, 0.0, 0.79], dtype=torch.float64).repeat(T, 1)
    if root_fn is not None:
        root = root_fn(root, t)
    yaw = yaw_rate * t[:, 0]
    quat = torch.stack([torch.cos(yaw / 2), 0 * yaw, 0 * yaw, torch.sin(yaw / 2)], -1)
    pos, q = fk.forward(root.float(), quat.float(), dof.float())
    return pos.double(), q.double()


def rec(pos, quat, ref_pos, ref_quat):
    return {"body_pos_w": pos, "body_quat_w": quat, "ref_body_pos_w": ref_pos, "ref_body_quat_w": ref_quat}


def rotate_about_root_z(pos, quat, angle):
    """The whole pose turned by `angle` about the vertical through the root (a heading change)."""
    q = torch.tensor([math.cos(angle / 2), 0, 0, math.sin(angle / 2)], dtype=torch.float64)
    root = pos[:, :1]
    return root + ssjr.quat_apply(q, pos - root), ssjr.quat_mul(q.expand_as(quat), quat)


def test_identical_trajectories_are_perfect(fk):
    pos, quat = motion(fk)
    m = ev.episode_metrics(rec(pos, quat, pos.clone(), quat.clone()))
    assert m["success"] == 1.0
    for k in ("g_mpjpe_mm", "mpjpe_mm", "gr_err_rad", "gr_err_deg", "max_gte_m"):
        assert m[k] == pytest.approx(0.0, abs=1e-4), k
    for k in ("dv_rew", "kb_rew", "lr_rew", "rv_rew", "rav_rew"):
        assert m[k] == pytest.approx(1.0, abs=1e-6), k


@pytest.mark.parametrize("offset_m, success", [(0.6, 0.0), (0.4, 1.0)])
def test_constant_offset(fk, offset_m, success):
    pos, quat = motion(fk)
    shifted = pos + torch.tensor([0.0, offset_m, 0.0], dtype=torch.float64)
    m = ev.episode_metrics(rec(shifted, quat, pos, quat))
    assert m["success"] == success
    assert m["success_strict"] == success
    assert m["g_mpjpe_mm"] == pytest.approx(1000 * offset_m, abs=1e-6)
    assert m["max_gte_m"] == pytest.approx(offset_m, abs=1e-9)
    assert m["mpjpe_mm"] == pytest.approx(0.0, abs=1e-6)  # a rigid translation keeps the local pose
    assert m["kb_rew"] == pytest.approx(math.exp(-ev.REWARD_C["kb"] * offset_m ** 2), rel=1e-9)
    assert m["rv_rew"] == pytest.approx(1.0) and m["gr_err_rad"] == pytest.approx(0.0, abs=1e-6)


def test_moving_rigid_translation_mpjpe_zero_gmpjpe_positive(fk):
    pos, quat = motion(fk, T=50)
    drift = torch.tensor([0.3, -0.4, 0.0], dtype=torch.float64)  # 0.5 m/s
    t = torch.arange(50, dtype=torch.float64)[:, None, None] * DT
    m = ev.episode_metrics(rec(pos + t * drift, quat, pos, quat))
    assert m["mpjpe_mm"] == pytest.approx(0.0, abs=1e-6)
    assert m["g_mpjpe_mm"] == pytest.approx(1000 * 0.5 * DT * 49 / 2, rel=1e-9)  # mean of 0.5 m/s * t
    assert m["success"] == 1.0
    assert m["rv_rew"] == pytest.approx(math.exp(-ev.REWARD_C["rv"] * 0.25), rel=1e-9)
    for k in ("rav_rew", "lr_rew", "dv_rew"):
        assert m[k] == pytest.approx(1.0), k


def test_one_body_1m_off_succeeds_by_the_papers_gte_and_fails_the_strict_test(fk):
    pos, quat = motion(fk)
    moved = pos.clone()
    moved[:, 22, 2] += 1.0  # left wrist 1 m off, the rest exact: GTE_t = 1 m / 30 bodies
    m = ev.episode_metrics(rec(moved, quat, pos, quat))
    assert m["success"] == 1.0 and m["success_strict"] == 0.0
    assert m["max_gte_m"] == pytest.approx(1.0 / 30, rel=1e-9)
    assert m["g_mpjpe_mm"] == pytest.approx(1000.0 / 30, rel=1e-9)
    assert m["steps"] == len(pos)
    moved[:, :16] += torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)  # half the bodies 1 m off: GTE_t > 0.5 m
    assert ev.episode_metrics(rec(moved, quat, pos, quat))["success"] == 0.0


def test_heading_rotation_gives_expected_gr_err_and_zero_mpjpe(fk):
    pos, quat = motion(fk)
    angle = math.radians(30)
    turned_pos, turned_quat = rotate_about_root_z(pos, quat, angle)
    m = ev.episode_metrics(rec(turned_pos, turned_quat, pos, quat))
    assert m["gr_err_rad"] == pytest.approx(angle, abs=1e-5)
    assert m["gr_err_deg"] == pytest.approx(30.0, abs=1e-3)
    assert m["mpjpe_mm"] == pytest.approx(0.0, abs=1e-3)  # local frame = heading-aligned root frame
    assert m["g_mpjpe_mm"] > 10.0
    assert m["lr_rew"] == pytest.approx(1.0, abs=1e-6) and m["dv_rew"] == pytest.approx(1.0, abs=1e-6)


def test_tilt_of_every_body_gives_its_angle(fk):
    pos, quat = motion(fk)
    tilt = ssjr.quat_from_axis_angle(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64),
                                     torch.tensor(math.radians(40), dtype=torch.float64))
    m = ev.episode_metrics(rec(pos, ssjr.quat_mul(tilt.expand_as(quat), quat), pos, quat))
    assert m["gr_err_deg"] == pytest.approx(40.0, abs=1e-3)
    assert ev.episode_metrics(rec(pos, -quat, pos, quat))["gr_err_rad"] == pytest.approx(0.0, abs=1e-6)  # q ~ -q


def test_joint_offset_and_joint_velocity_rewards(fk):
    knee = ssjr.DOF_NAMES.index("left_knee_joint")
    pos, quat = motion(fk, T=30)
    offset = 0.5
    bent_pos, bent_quat = motion(fk, T=30, dof_fn=lambda d, t: d + offset * (torch.arange(29) == knee))
    m = ev.episode_metrics(rec(bent_pos, bent_quat, pos, quat))
    assert m["lr_rew"] == pytest.approx(math.exp(-ev.REWARD_C["lr"] * offset / 29), rel=1e-4)
    assert m["dv_rew"] == pytest.approx(1.0, abs=1e-4)  # a constant offset has no velocity error
    omega = 2.0  # rad/s extra on the knee
    fast_pos, fast_quat = motion(fk, T=30, dof_fn=lambda d, t: d + omega * t * (torch.arange(29) == knee))
    m = ev.episode_metrics(rec(fast_pos, fast_quat, pos, quat))
    assert m["dv_rew"] == pytest.approx(math.exp(-ev.REWARD_C["dv"] * omega ** 2), rel=1e-4)


def test_root_angular_velocity_reward(fk):
    pos, quat = motion(fk, T=30)
    spin_pos, spin_quat = motion(fk, T=30, yaw_rate=1.5)
    m = ev.episode_metrics(rec(spin_pos, spin_quat, pos, quat))
    assert m["rav_rew"] == pytest.approx(math.exp(-ev.REWARD_C["rav"] * 1.5 ** 2), rel=1e-5)
    assert m["rv_rew"] == pytest.approx(1.0, abs=1e-9)  # the root itself does not move


def test_blown_up_and_one_step_episodes():
    pos = torch.zeros(5, 30, 3, dtype=torch.float64)
    quat = torch.zeros(5, 30, 4, dtype=torch.float64)
    quat[..., 0] = 1
    bad = pos.clone()
    bad[3] = math.nan
    assert ev.episode_metrics(rec(bad, quat, pos, quat))["success"] == 0.0
    one = ev.episode_metrics(rec(pos[:1], quat[:1], pos[:1], quat[:1]))
    assert one["success"] == 1.0 and math.isnan(one["dv_rew"]) and one["kb_rew"] == 1.0


def test_numpy_float32_records_work(fk):
    pos, quat = motion(fk)
    m = ev.episode_metrics({k: v.float().numpy() for k, v in rec(pos, quat, pos + 0.1, quat).items()})
    assert m["g_mpjpe_mm"] == pytest.approx(1000 * 0.1 * math.sqrt(3), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------------
def test_paired_ttest_textbook_sleep_data():
    # Student (1908) / Cushny & Peebles sleep data; R: t.test(extra ~ group, sleep, paired=TRUE): t=-4.0621, p=0.002833
    g1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
    g2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]
    t, p, df = ev.paired_ttest(g1, g2)
    assert (round(t, 4), df) == (-4.0621, 9)
    assert p == pytest.approx(0.002833, abs=5e-7)


def test_paired_ttest_degenerate_cases():
    assert ev.paired_ttest([1, 2, 3], [1, 2, 3]) == (0.0, 1.0, 2)  # no difference at all
    t, p, _ = ev.paired_ttest([2, 3, 4], [1, 2, 3])  # a constant difference
    assert t == math.inf and p == 0.0
    assert math.isnan(ev.paired_ttest([1.0], [2.0])[1])
    t, p, df = ev.paired_ttest([1, 2, math.nan, 4, 9], [0, 2, 5, 1, 1])  # NaN pairs dropped
    assert df == 3


def test_pairs_match_episodes_by_clip_seed_and_episode():
    ref = [{"clip": c, "seed": s, "episode": e, "x": float(10 * c + s + e)} for c in range(3) for s in (0, 1)
           for e in (0, 1)]
    other = [dict(r, x=r["x"] + 1.0 + 0.1 * r["seed"]) for r in reversed(ref)]  # same episodes, in another order
    other.append({"clip": 9, "seed": 0, "episode": 0, "x": 1e6})  # no partner: left out
    a, b = ev.pairs(other, ref, "x")
    assert len(a) == 12 and np.allclose(np.sort(a - b), [1.0] * 6 + [1.1] * 6)


def test_wilson_interval_textbook_values():
    # Newcombe (1998), Table I: 81/263 -> 0.2553, 0.3662; 15/148 -> 0.0624, 0.1605; 0/20 -> 0, 0.1611
    for (k, n), (lo, hi) in {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605),
                             (0, 20): (0.0, 0.1611)}.items():
        assert ev.wilson(k, n) == pytest.approx((lo, hi), abs=1e-4)
    assert ev.wilson(20, 20)[1] == 1.0 and ev.wilson(20, 20)[0] == pytest.approx(1 - 0.1611, abs=1e-4)


def test_mcnemar_exact_test():
    # 10 pairs discordant 9 to 1: two-sided binomial p = 2 * (1 + 10) / 2^10
    a = [1] * 9 + [0] * 1 + [1] * 20
    b = [0] * 9 + [1] * 1 + [1] * 20
    assert ev.mcnemar(a, b) == pytest.approx(22 / 1024)
    assert ev.mcnemar([1, 0, 1], [1, 0, 1]) == 1.0  # no discordant pair


def test_paired_rate_difference_newcombe_interval():
    a = np.array([1] * 30 + [0] * 10, bool)
    same = ev.paired_rate_difference(a, a)  # no discordant pair: 0, but not a certainty
    assert same[0] == 0.0 and same[1] < -0.02 and same[2] > 0.02
    b = a.copy()
    b[:10] = False  # 10 of a's successes lost
    d, lo, hi = ev.paired_rate_difference(b, a)
    assert d == pytest.approx(-0.25) and -0.45 < lo < -0.25 < hi < -0.1
    assert ev.paired_rate_difference(a, b) == pytest.approx((0.25, -hi, -lo))  # symmetric
    wide = ev.paired_rate_difference(b[:8], a[:8])  # fewer pairs: a wider interval
    assert wide[2] - wide[1] > hi - lo


def row(ckpt, clip, episode, success, steps=100.0, seed=0):
    return {"ckpt": ckpt, "clip": clip, "seed": seed, "episode": episode, "success": float(success),
            "steps": float(steps)}


def test_estimate_one_run_independent_nominal_and_several_runs():
    one = [row("a", 0, e, e < 30) for e in range(40)]
    e = ev.estimate(one, "success", independent=True)
    assert e["mean"] == 75.0 and e["n"] == 40 and e["runs"] == 1
    assert (e["lo"], e["hi"]) == pytest.approx(tuple(100 * x for x in ev.wilson(30, 40)))
    nominal = ev.estimate(one, "success", independent=False)
    assert nominal["mean"] == 75.0 and math.isnan(nominal["lo"])  # near-identical starts: no interval
    runs = [row(c, 0, e, e < k) for c, k in (("a", 4), ("b", 6), ("c", 8)) for e in range(10)]
    e = ev.estimate(runs, "success", independent=True)  # the run is the unit: 40 %, 60 %, 80 %
    half = stats.t.ppf(0.975, 2) * 20.0 / math.sqrt(3)
    assert e["runs"] == 3 and e["mean"] == pytest.approx(60.0)
    assert (e["lo"], e["hi"]) == pytest.approx((60 - half, 100.0))  # 60 + 49.7: a rate stays below 100 %
    assert "(3 runs)" in ev._cell(runs, "success", True) and "near-identical" in ev._cell(one, "success", False)


def test_compare_paired_episodes_and_runs():
    teacher = [row("t", 0, e, e < 30) for e in range(40)]
    student = [row("s", 0, e, e < 20) for e in range(40)]  # fails 10 of the teacher's successes, no other change
    c = ev.compare(student, teacher, "success", independent=True)
    assert c["diff"] == pytest.approx(-25.0) and c["n"] == 40 and c["test"] == "McNemar"
    assert c["p"] == pytest.approx(2 / 1024)
    assert (c["lo"], c["hi"]) == pytest.approx(tuple(100 * x for x in ev.paired_rate_difference(
        [r["success"] for r in student], [r["success"] for r in teacher])[1:]))
    assert math.isnan(ev.compare(student, teacher, "success", independent=False)["p"])
    runs = [row(f"s{k}", 0, e, e < 30 - k) for k in (0, 2, 4) for e in range(40)]  # -0, -5, -10 points
    c = ev.compare(runs, teacher, "success", independent=True)
    assert c["runs"] == 3 and c["diff"] == pytest.approx(-5.0) and c["test"] == "t over 3 runs (vs one run)"
    half = stats.t.ppf(0.975, 2) * 5.0 / math.sqrt(3)
    assert (c["lo"], c["hi"]) == pytest.approx((-5 - half, -5 + half))
    assert ev.compare(teacher, runs, "success", True)["diff"] == pytest.approx(5.0)  # one run vs three: the same pairs
    spread = [row(f"w{k}", 0, e, e < 40 * k) for k in (0, 1) for e in range(40)]  # 0 % and 100 %: t-interval +-635
    c = ev.compare(spread, [row("v", 0, e, False) for e in range(40)], "success", True)
    assert c["diff"] == 50.0 and (c["lo"], c["hi"]) == (-100.0, 100.0)  # a rate difference stays within +-100
    other = [row(f"o{k}", 0, e, e < 30) for k in (0, 1) for e in range(40)]
    assert ev.compare(runs, other, "success", True)["test"] == "runs not pairable"  # 3 runs vs 2
    assert ev.compare([], teacher, "success", True)["n"] == 0


# ---------------------------------------------------------------------------------------------------------------------
# Settings, checkpoints, aggregation, reports
# ---------------------------------------------------------------------------------------------------------------------
def test_parse_setting():
    s = ev.parse_setting("zero_shot+dr@rough_slope", "isaaclab")
    assert (s.name, s.sim, s.dr, s.terrain, s.in_domain) == ("genesis+dr@rough_slope", "genesis", True,
                                                            "rough_slope", False)
    assert s.title == "Genesis+DR rough slope (OOD)"
    assert ev.parse_setting("in_domain", "genesis").name == "genesis"
    assert ev.parse_setting("isaaclab", "isaaclab").title == "IsaacLab (ID)"
    assert ev.parse_setting("zero_shot", "mujoco").name == "genesis"
    assert ev.parse_setting("mujoco+dr", "genesis").title == "MuJoCo+DR (OOD)"
    s = ev.parse_setting("mujoco+noise", "genesis")
    assert (s.name, s.dr, s.noise_only, s.title) == ("mujoco+noise", True, True, "MuJoCo+noise (OOD)")
    s = ev.parse_setting("genesis+noise0.1", "genesis")
    assert (s.name, s.noise_only, s.noise_scale, s.title) == ("genesis+noise0.1", True, 0.1, "Genesis+noise x0.1 (ID)")
    assert ev.parse_setting("isaaclab+dr1.0", "genesis").name == "isaaclab+dr"
    for bad in ("physx", "genesis+push", "genesis+dr+noise", "genesis@stairs", "genesis+", "genesis+noise0.1.2",
                "genesis+0.1"):
        with pytest.raises(ValueError, match="bad setting"):
            ev.parse_setting(bad, "isaaclab")
    # the grid of unseen dynamics and the m_t diagnostics: +dr cells, in order; `grid` is every cell in domain
    s = ev.parse_setting("mujoco+dr:delay8:mt_shuffled", "mujoco")
    assert (s.name, s.cells, s.title) == ("mujoco+dr:delay8:mt_shuffled", ("delay8", "mt_shuffled"),
                                          "MuJoCo+DR delay8 mt_shuffled (ID)")
    assert [s.name for s in ev.parse_settings(["grid:mt_empty", "genesis_aligned", "Genesis+dr:grid"], "mujoco")] == [
        f"mujoco+dr:{c}:mt_empty" for c in ev.GRID] + ["genesis_aligned"] + [f"genesis+dr:{c}" for c in ev.GRID]
    for bad in ("mujoco:delay8", "mujoco+noise:delay8", "mujoco+dr:delay7", "mujoco+dr:mt_empty:mt_empty",
                "isaaclab+dr:contact0.04"):
        with pytest.raises(ValueError, match="bad cells"):
            ev.parse_setting(bad, "mujoco")


def test_bad_flags_and_checkpoints_are_input_errors(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ssjr.InputError, match="junk.pt: not a readable"):
        ev.main(ev.Args(ckpt=(str(junk),)))
    incomplete = tmp_path / "incomplete.pt"
    torch.save({"kind": "student", "args": {}, "model": {}}, incomplete)
    with pytest.raises(ssjr.InputError, match=r"incomplete.pt: student checkpoint without \['obs_layout', 'env_cfg'\]"):
        ev.main(ev.Args(ckpt=(str(incomplete),)))
    # would never finish / build an empty env / count episodes twice
    for bad in (dict(num_envs=0), dict(episodes=0), dict(seeds=()), dict(seeds=(0, 0)), dict(ckpt=())):
        with pytest.raises(ssjr.InputError, match="distinct seeds"):
            ev.main(ev.Args(**{"ckpt": (str(junk),), **bad}))
    with pytest.raises(ssjr.InputError, match="--labels"):
        ev.main(ev.Args(ckpt=(str(junk), str(incomplete)), labels=("HoRD",)))


@pytest.mark.parametrize("n, clips, eps", [(8, 8, 1), (8, 8, 2), (3, 8, 2), (16, 8, 2), (5, 7, 3), (1, 4, 1)])
def test_episode_plan_keeps_each_clip_exactly_episodes_times(n, clips, eps):
    plan = ev.episode_plan(n, clips, eps)
    kept = [e for p in plan for e in p if e is not None]
    assert sorted(kept) == sorted((c, r) for c in range(clips) for r in range(eps))
    for i, p in enumerate(plan):  # the env plays clips i, i+n, ... : the plan follows that schedule
        for k, e in enumerate(p):
            assert e is None or e[0] == (i + k * n) % clips
        assert not p or p[-1] is not None


def test_a_push_table_without_pushed_episodes_says_why():
    rows = [dict(r, pushes=0) for r in fake_rows(settings=("genesis+dr",))]
    table = ev.push_markdown(rows, ["HoRD", "w/o HCDR"], [ev.parse_setting("genesis+dr", "genesis")])
    assert "| HoRD | n/a: every episode ended before its first push [0/12] |" in table


def fake_rows(labels=("HoRD", "w/o HCDR"), settings=("isaaclab", "genesis+dr"), seeds=(0, 1),
              clips=("a_seg00", "a_seg01", "b"), episodes=2, command=ev.ROBOT):
    """Episode rows as evaluate_seed makes them: the ablation (second label) fails (falls in) every episode 1 and
    has 300 mm more error; with +dr episode 1 is the pushed one."""
    rng = np.random.default_rng(1)
    rows = []
    for li, label in enumerate(labels):
        for setting in settings:
            for seed in seeds:
                for clip in clips:
                    for e in range(episodes):
                        g = 100.0 + 300.0 * li + 10 * seed + rng.normal()
                        full = {"success": float(li == 0 or e == 0), "success_strict": float(li == 0 and e == 0),
                                "g_mpjpe_mm": g, "mpjpe_mm": g / 2,
                                "gr_err_rad": 0.1, "gr_err_deg": math.degrees(0.1), "dv_rew": 0.9, "kb_rew": 0.8,
                                "lr_rew": 0.7, "rv_rew": 0.6, "rav_rew": 0.5}
                        if command == ev.HUMAN_KEYPOINTS:
                            full = dict.fromkeys(full, math.nan)
                        rows.append({"label": label, "ckpt": f"{label}.pt", "setting": setting, "seed": seed,
                                     "command": command, "motion": clip[0], "clip": clip, "episode": e, **full,
                                     "keypoint_err_mm": g / 3, "fell": float(li == 1 and e == 1),
                                     "steps": 100.0 - 60.0 * (li == 1 and e == 1),
                                     "pushes": int(e == 1 and "dr" in setting), "truncated": 0})
    return rows


def test_table1_shape_and_significance_flags():
    rows = fake_rows()
    settings = [ev.parse_setting(s, "isaaclab") for s in ("isaaclab", "genesis+dr")]
    md = ev.table1_markdown(rows, ["HoRD", "w/o HCDR"], settings, 0.05)
    lines = md.strip().splitlines()
    assert len(lines) == 4  # header, rule, one row per checkpoint
    assert all(line.count("|") == 1 + 4 * 2 + 1 for line in lines)
    assert "IsaacLab (ID) Succ. (%)↑" in lines[0] and "Genesis+DR (OOD) mpjpe (mm)↓" in lines[0]
    hord, ablation = ([c.strip() for c in line.split("|")[1:-1]] for line in lines[2:])
    assert hord[1] == "100.0 (12 near-identical starts)" and "*" not in "".join(hord)  # nominal: no interval
    lo, hi = (f"{100 * x:.1f}" for x in ev.wilson(6, 12))
    assert ablation[5] == f"50.0 [{lo}, {hi}] *"  # +DR: Wilson; 6 discordant pairs: McNemar p = 2/64 < 0.05
    assert ablation[1] == "50.0 (12 near-identical starts)"  # no test on near-identical starts
    assert ablation[6].startswith("70 [") and ablation[6].endswith("*")  # steps: 100 or 40
    assert ablation[7].endswith("*")  # g-mpjpe +300 mm


def test_comparisons_cover_every_pair_of_labels():
    labels = ["teacher", "student", "w/o HCDR"]
    settings = [ev.parse_setting("genesis+dr", "genesis")]
    cs = ev.comparison_rows(fake_rows(labels=labels, settings=("genesis+dr",)), labels, settings, 0.01, ("success",))
    assert [(c["label"], c["reference"]) for c in cs] == [("student", "teacher"), ("w/o HCDR", "teacher"),
                                                          ("w/o HCDR", "student")]
    assert [c["diff"] for c in cs] == [-50.0, -50.0, 0.0]  # fake_rows: every label after the first fails episode 1


def test_report_csv_and_files(tmp_path):
    rows = fake_rows(settings=("isaaclab", "genesis", "genesis+dr", "genesis@rough_slope"))
    labels = ["HoRD", "w/o HCDR"]
    settings = [ev.parse_setting(s, "isaaclab") for s in ("isaaclab", "genesis", "genesis+dr", "genesis@rough_slope")]
    summary = ev.write_outputs(tmp_path, rows, labels, settings, 0.01)
    report = (tmp_path / "table.md").read_text()
    for title in ("## Table 1", "## Terrain", "## Push recovery", "## All metrics: Genesis+DR (OOD)",
                  "## Per motion: IsaacLab (ID)", "## Paired comparisons: robot motions"):
        assert title in report
    assert "## Runs" not in report  # one checkpoint per label
    push = report.split("## Push recovery")[1].split("##")[0]
    lo, hi = (f"{100 * x:.1f}" for x in ev.wilson(6, 6))
    assert f"| HoRD | 100.0 [{lo}, {hi}] [6/12] |" in push  # pushed = episode 1 of 3 clips x 2 seeds
    assert "| w/o HCDR | 0.0 [0.0, " in push and "[6/12] |" in push  # it fails exactly its pushed episodes
    assert "2 motions (3 clips), 2 seed(s); per checkpoint: isaaclab 12 near-identical starts, genesis 12 " \
           "near-identical starts, genesis+dr 12 independent episodes" in report
    assert "Human keypoint commands" not in report
    all_metrics = report.split("## All metrics: Genesis+DR (OOD)")[1].split("##")[0]
    assert "| keypoint_err_mm ↓ |" in all_metrics and "| fell (%) ↓ | 0.0 [0.0, 24.2] | 50.0 [25.4, 74.6] |" in \
        all_metrics
    assert "| success_strict (%) ↑ | 50.0 [25.4, 74.6] | 0.0 [0.0, 24.2] |" in all_metrics
    per_motion = report.split("## Per motion: IsaacLab (ID)")[1].split("##")[0]
    assert [line.split("|")[1].strip() for line in per_motion.strip().splitlines()[2:]] == ["a", "b"]
    lines = (tmp_path / "episodes.csv").read_text().splitlines()
    assert len(lines) == 1 + len(rows) and lines[0].startswith("label,ckpt,setting,seed,command,motion,clip,episode")
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["results"]["HoRD"]["isaaclab"]["success"]["mean"] == 100
    assert saved["results"]["w/o HCDR"]["genesis+dr"]["success"]["lo"] == pytest.approx(100 * ev.wilson(6, 12)[0])
    assert saved["runs"]["w/o HCDR.pt"]["genesis+dr"]["success"]["n"] == 12
    comparisons = summary["comparisons"][ev.ROBOT]
    assert comparisons and all(c["reference"] == "HoRD" for c in comparisons)
    dr_success = next(c for c in comparisons if c["setting"] == "genesis+dr" and c["metric"] == "success")
    assert dr_success["test"] == "McNemar" and dr_success["diff"] == -50.0 and dr_success["n"] == 12
    assert not [p for p in tmp_path.rglob(".tmp-*")]


def test_keypoint_command_report_shows_keypoint_error_and_falls_only(tmp_path):
    rows = fake_rows(settings=("genesis", "genesis+dr"), clips=("131_01_seg00", "131_02_seg00"),
                     command=ev.HUMAN_KEYPOINTS)
    labels = ["HoRD", "w/o HCDR"]
    settings = [ev.parse_setting(s, "isaaclab") for s in ("genesis", "genesis+dr")]
    summary = ev.write_outputs(tmp_path, rows, labels, settings, 0.01)
    report = (tmp_path / "table.md").read_text()
    assert "## Table 1" not in report and "## All metrics" not in report and "## Per motion" not in report
    section = report.split("## Human keypoint commands")[1].split("##")[0]
    assert "instead of the full-body metrics" in section and "Genesis (OOD) keypoint err (mm)↓" in section
    assert "| HoRD | 35 | 0.0 (8 near-identical starts) | 100 |" in section  # nominal: means only
    assert "| w/o HCDR | 135 | 50.0 (8 near-identical starts) | 70 | 135 [133, 137] * | 50.0 [21.5, 78.5] |" in section
    push = report.split("## Push recovery: human keypoint commands")[1].split("##")[0]
    assert "| w/o HCDR | 100.0 [51.0, 100.0] [4/8] |" in push  # the ablation falls in every pushed episode
    tests = report.split("## Paired comparisons: human keypoint commands")[1]
    assert {line.split("|")[4].strip() for line in tests.strip().splitlines()[2:]} == {"keypoint_err_mm", "fell",
                                                                                       "steps"}
    assert summary["results_keypoint_commands"]["w/o HCDR"]["genesis"]["fell"]["mean"] == 50.0
    assert summary["results"]["HoRD"]["genesis"]["g_mpjpe_mm"]["n"] == 0  # no robot-motion episodes


def test_mixed_robot_and_keypoint_commands_are_reported_apart(tmp_path):
    rows = fake_rows(settings=("isaaclab",)) + fake_rows(settings=("isaaclab",), clips=("c",),
                                                         command=ev.HUMAN_KEYPOINTS)
    report = ev.report_markdown(rows, ["HoRD", "w/o HCDR"], [ev.parse_setting("isaaclab", "isaaclab")], 0.01)
    assert "Robot motions (SSJR packets): 2 motions (3 clips), 2 seed(s); per checkpoint: isaaclab 12 " in report
    assert "## Human keypoint commands\n\n1 motions (1 clips), 2 seed(s); per checkpoint: isaaclab 4 " in report
    per_motion = report.split("## Per motion: IsaacLab (ID)")[1].split("##")[0]
    assert [line.split("|")[1].strip() for line in per_motion.strip().splitlines()[2:]] == ["a", "b"]
    per_command = report.split("## Per command: IsaacLab (ID)")[1].split("##")[0]
    assert [line.split("|")[1].strip() for line in per_command.strip().splitlines()[2:]] == ["c"]


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    """Every report file goes through ssjr.write_atomic: a failed write leaves the previous file whole."""
    path = ssjr.write_atomic(tmp_path / "t.md", lambda tmp: tmp.write_text("old"))

    def broken(tmp):
        tmp.write_text("half")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        ssjr.write_atomic(path, broken)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["t.md"]


def test_resolve_motions(tmp_path):
    (tmp_path / "g1_moves").mkdir()
    (tmp_path / "g1_moves" / "B_DadDance_seg00.npz").write_bytes(b"")  # a training clip: never evaluated
    for clip in ssjr.TEST_CLIPS[1:]:
        (tmp_path / "g1_moves" / f"{clip}.npz").write_bytes(b"")
    with pytest.raises(ssjr.InputError, match=f"test-split packets missing.*{ssjr.TEST_CLIPS[0]}"):
        ev.resolve_motions("", str(tmp_path))
    for seg in (1, 0):
        (tmp_path / "g1_moves" / f"{ssjr.TEST_CLIPS[0]}_seg0{seg}.npz").write_bytes(b"")
    stems = [p.stem for p in ev.resolve_motions("", str(tmp_path))]
    assert stems == [f"{ssjr.TEST_CLIPS[0]}_seg00", f"{ssjr.TEST_CLIPS[0]}_seg01"] + list(ssjr.TEST_CLIPS[1:])
    assert [ev.motion_name(s) for s in stems[1:]] == list(ssjr.TEST_CLIPS)
    assert len(ev.resolve_motions(str(tmp_path / "g1_moves"), "")) == len(ssjr.TEST_CLIPS) + 2
    with pytest.raises(ssjr.InputError):
        ev.resolve_motions(str(tmp_path / "missing.npz"), "")


# ---------------------------------------------------------------------------------------------------------------------
# The rollout loop on a scripted env (same clip schedule and step API as envs.TrackingEnv with start='frame0')
# ---------------------------------------------------------------------------------------------------------------------
class ScriptedEnv:
    """Clip c lasts lengths[c] steps; env i fails at step fail_at[(i, k)] of its k-th episode; every env is pushed at
    step 2 of its episodes. Every body of env i is 0.1 * (clip + 1) m above its reference, so the recorded arrays
    identify the clip. reseed/close as envs.TrackingEnv; raise_at_step: step() raises there (an engine error)."""

    def __init__(self, num_envs, lengths, fail_at=None, raise_at_step=None):
        self.num_envs, self.lengths, self.fail_at = num_envs, lengths, fail_at or {}
        self.raise_at_step = raise_at_step
        self.obs_layout = {"proprio": [5, 3]}
        self.seeds, self.closed, self.steps = [], False, 0
        self.device, self.clamp_targets, self.joint_range_rad = "cpu", False, envs.joint_range_rad()
        self.substep_tau = torch.full((4, num_envs, 29), -7.0)
        self.sim = type("Sim", (), {"dof_state": lambda _: (torch.zeros(num_envs, 29), torch.zeros(num_envs, 29))})()

    def reseed(self, seed):
        self.seeds.append(seed)
        n = self.num_envs
        self.clip = torch.arange(n) % len(self.lengths)
        self.t = torch.zeros(n, dtype=torch.long)
        self.k = torch.zeros(n, dtype=torch.long)
        return self.obs()

    def obs(self):
        n = self.num_envs
        return {"proprio": torch.zeros(n, 5, 3), "history": torch.zeros(n, 16, 93),
                "history_mask": torch.ones(n, 16, dtype=torch.bool)}

    def close(self):
        assert not self.closed, "closed twice"
        self.closed = True

    def step(self, alpha):
        assert not self.closed, "stepped after close()"
        self.steps += 1
        if self.steps == self.raise_at_step:
            raise RuntimeError("engine exploded")
        n = self.num_envs
        self.t += 1
        lengths = torch.tensor(self.lengths)[self.clip]
        fail = torch.tensor([self.t[i].item() == self.fail_at.get((i, self.k[i].item()), -1) for i in range(n)])
        time_out = (self.t >= lengths) & ~fail
        done = fail | time_out
        self.ref_body_pos_w = torch.zeros(n, 30, 3)
        self.body_pos_w = self.ref_body_pos_w + 0.1 * (self.clip + 1).float()[:, None, None] * torch.tensor([0, 0, 1.])
        self.body_quat_w = self.ref_body_quat_w = torch.tensor([1.0, 0, 0, 0]).repeat(n, 30, 1)
        err = 0.1 * (self.clip + 1).float()
        info = {"clip": self.clip.clone(), "failed": fail, "time_out": time_out, "nan": torch.zeros(n, dtype=bool),
                "metrics": {"max_body_err_m": err, "keypoint_err_m": err, "max_keypoint_err_m": err},
                "pushed": self.t == 2,
                "psi": {"mass_scale": torch.full((n,), 1.05)}}
        for i in done.nonzero().flatten().tolist():
            self.clip[i] = (self.clip[i] + n) % len(self.lengths)
            self.t[i] = 0
            self.k[i] += 1
        return self.obs(), torch.zeros(n), done, info


class ZeroPolicy:
    actor_obs = ("proprio", "future", "ref_dof_pos", "terrain", "history", "history_mask")  # a teacher's inputs

    def act(self, obs):
        return torch.zeros(len(obs["proprio"]), 29)


def test_run_episodes_records_each_planned_episode():
    lengths = [5, 3, 7, 4]
    env = ScriptedEnv(3, lengths, fail_at={(0, 0): 2, (1, 1): 1})
    plan = ev.episode_plan(3, len(lengths), 2)
    recs = list(ev.run_episodes(env, env.reseed(0), ZeroPolicy(), plan))
    assert sorted((r["clip"], r["episode"]) for r in recs) == [(c, e) for c in range(4) for e in range(2)]
    fail_step = {plan[i][k]: step for (i, k), step in env.fail_at.items()}  # (clip, episode) -> the step it fails at
    assert len(fail_step) == 2 and None not in fail_step  # both scripted failures fall on planned episodes
    for r in recs:
        failed_here = (r["clip"], r["episode"]) in fail_step
        assert r["failed"] == failed_here and r["time_out"] == (not failed_here)
        assert r["steps"] == fail_step.get((r["clip"], r["episode"]), lengths[r["clip"]])  # its fall, or the clip end
        assert r["body_pos_w"].shape == (r["steps"], 30, 3) and r["ref_body_quat_w"].shape == (r["steps"], 30, 4)
        np.testing.assert_allclose(r["body_pos_w"][..., 2], 0.1 * (r["clip"] + 1), rtol=1e-6)
        assert r["psi"] == {"mass_scale": pytest.approx(1.05)} and not r["truncated"]
        assert r["pushes"] == int(r["steps"] >= 2)  # pushed at step 2 of an episode, if it lasts that long


def test_run_episodes_truncates_at_max_steps():
    env = ScriptedEnv(2, [10, 10, 10])
    recs = list(ev.run_episodes(env, env.reseed(0), ZeroPolicy(), ev.episode_plan(2, 3, 1), max_steps=4))
    assert sorted(r["clip"] for r in recs) == [0, 1] and all(r["truncated"] and r["steps"] == 4 for r in recs)
    assert all(r["pushes"] == 1 for r in recs)


def test_joint_range_metrics():
    """Shares of the steps, the mean excess of the targets outside, the torque of the joint-steps at a stop."""
    excess, gap = torch.full((4, 29), -1.0), torch.full((4, 29), 0.5)
    excess[0, 3], excess[2, 5], excess[2, 6] = 0.1, 0.2, 0.3  # steps 0 and 2 have a target outside
    gap[1, 0], gap[1, 1], gap[3, 2] = 0.005, 0.02, -0.001  # a joint within 0.01 rad of its stop at steps 1 and 3
    tau = torch.arange(4 * 29, dtype=torch.float64).reshape(4, 29) - 60
    pos = torch.zeros(4, 30, 3, dtype=torch.float64)
    quat = torch.tensor([1.0, 0, 0, 0], dtype=torch.float64).repeat(4, 30, 1)
    m = ev.episode_metrics({**rec(pos, quat, pos, quat), "target_excess_rad": excess, "stop_gap_rad": gap,
                            "joint_torque_nm": tau})
    assert m["targets_outside_pct"] == m["at_stop_pct"] == 50.0
    assert m["target_excess_deg"] == pytest.approx(math.degrees(0.2))
    assert m["stop_torque_nm"] == pytest.approx((abs(29 - 60) + abs(3 * 29 + 2 - 60)) / 2)
    assert all(math.isnan(ev.episode_metrics(rec(pos, quat, pos, quat))[k]) for k in ev.JOINT_METRICS)  # deploy.py's


def test_clipped_setting_plays_targets_within_the_joint_ranges(monkeypatch):
    """`:clipped` builds the env with clamp_targets (the env clamps: test_envs); run_episodes records the targets the
    env played against the ranges, the joints' gaps to their stops and the torque there."""
    kin = ssjr.G1Kinematics()
    torch.testing.assert_close(envs.joint_range_rad(), torch.stack([kin.dof_lower_rad, kin.dof_upper_rad]))
    built = []
    monkeypatch.setattr(envs, "make_env", lambda **k: built.append(k["clamp_targets"]) or ScriptedEnv(1, [3]))
    for token in ("mujoco", "mujoco:clipped", "mujoco+dr:clipped"):
        with ev.opened_env({"sim": "mujoco"}, ev.parse_setting(token, "mujoco"), [], 1, "cpu", 0):
            pass
    assert built == [False, True, True]
    beyond = (kin.dof_upper_rad + 0.1).clone()
    beyond[0] = kin.dof_lower_rad[0] - 0.2  # one target below its range, the others above

    class Beyond(ZeroPolicy):
        def act(self, obs):
            return beyond.expand(len(obs["proprio"]), -1)
    for clamp, outside in ((False, True), (True, False)):
        env = ScriptedEnv(2, [3, 3])
        env.clamp_targets = clamp
        q = torch.zeros(2, 29)
        q[:, 0] = kin.dof_lower_rad[0] + 0.005  # joint 0 at its stop, the others off theirs
        env.sim = type("Sim", (), {"dof_state": lambda _: (q, torch.zeros(2, 29))})()
        r = next(ev.run_episodes(env, env.reseed(0), Beyond(), ev.episode_plan(2, 2, 1)))
        excess = r["target_excess_rad"]
        assert bool((excess > 0).all()) == outside and bool((excess <= 0).all()) == (not outside)
        np.testing.assert_allclose(r["target_excess_rad"][:, 0], 0.2 if outside else 0.0, atol=1e-6)
        m = ev.episode_metrics(r)
        assert (m["targets_outside_pct"], m["at_stop_pct"], m["stop_torque_nm"]) == (100.0 * outside, 100.0, 7.0)
    assert ev.parse_setting("mujoco:clipped", "mujoco").cells == (ev.CLIPPED,)  # with or without +dr
    assert ev.parse_setting("mujoco+dr:delay8:clipped", "mujoco").title == "MuJoCo+DR delay8 clipped (ID)"
    with pytest.raises(ssjr.InputError, match="--settings: bad cells in 'mujoco': .* after \\+dr, or clipped"):
        ev.parse_setting("mujoco:delay8", "mujoco")


def test_keypoint_command_metrics():
    pos = torch.zeros(4, 30, 3, dtype=torch.float64)
    quat = torch.tensor([1.0, 0, 0, 0], dtype=torch.float64).repeat(4, 30, 1)
    moved = pos.clone()
    moved[:, list(ssjr.KEYPOINT_BODY_IDS), 0] += 0.05  # every keypoint body 5 cm off
    moved[:, 1, 2] += 0.3  # a filler body (left_hip_pitch_link) far off: not a keypoint
    assert 1 not in ssjr.KEYPOINT_BODY_IDS
    robot = ev.episode_metrics(rec(moved, quat, pos, quat))
    human = ev.episode_metrics(rec(moved, quat, pos, quat), command=ev.HUMAN_KEYPOINTS)
    assert robot["keypoint_err_mm"] == human["keypoint_err_mm"] == pytest.approx(50.0)
    assert robot["g_mpjpe_mm"] > 0 and all(math.isnan(human[m]) for m in ev.METRICS)
    gte = (len(ssjr.KEYPOINT_BODY_IDS) * 0.05 + 0.3) / 30  # the bodies' mean: the filler body counts
    assert robot["max_gte_m"] == pytest.approx(gte) and math.isnan(human["max_gte_m"])
    assert robot["max_keypoint_err_m"] == human["max_keypoint_err_m"] == pytest.approx(0.05)  # the env's test there


def write_motion(path, kind=None):
    """A stand-in motion file: evaluate.py only reads its 'kind' (the scripted env does not play it)."""
    np.savez(path, fps=np.float32(30), **({} if kind is None else {"kind": np.array(kind)}))
    return path


def test_packet_kind(tmp_path):
    assert ssjr.packet_kind(write_motion(tmp_path / "a.npz", "robot")) == ev.ROBOT
    assert ssjr.packet_kind(write_motion(tmp_path / "b.npz")) == ev.ROBOT  # older packets have no kind
    assert ssjr.packet_kind(write_motion(tmp_path / "c.npz", "human_keypoints")) == ev.HUMAN_KEYPOINTS
    with pytest.raises(ValueError, match="d.npz: unknown motion kind 'smpl'"):
        ssjr.packet_kind(write_motion(tmp_path / "d.npz", "smpl"))
    (tmp_path / "e.npz").write_bytes(b"junk")
    with pytest.raises(ValueError, match="e.npz: not a readable motion file"):
        ssjr.packet_kind(tmp_path / "e.npz")


def test_opened_env_is_the_checkpoint_env_cfg_with_the_setting_overrides(monkeypatch):
    made = []

    class Env:
        closed = False

        def close(self):
            self.closed = True

    def make_env(**kw):
        made.append((kw, Env()))
        return made[-1][1]
    monkeypatch.setattr(envs, "make_env", make_env)
    cfg = {"sim": "isaaclab", "motions": "data/packets/g1_moves", "terrain": "mix", "dr": "default", "start": "random"}
    for token, dr in (("zero_shot+dr@rough_slope", envs.DR()), ("in_domain", None),
                      ("genesis+noise", envs.DR.noise_only()),
                      ("genesis+noise0.3", dataclasses.replace(envs.DR.noise_only(), noise_scale=0.3)),
                      ("mujoco+dr:delay5-6:mt_empty", dataclasses.replace(envs.DR(), delay_steps=(5, 6))),
                      ("mujoco+dr:contact0.04", dataclasses.replace(envs.DR(), contact_timeconst_s=(0.04, 0.04))),
                      ("genesis+dr:contact0.04", dataclasses.replace(envs.DR(), contact_timeconst_s=(0.04, 0.04)))):
        setting = ev.parse_setting(token, "isaaclab")
        with ev.opened_env(cfg, setting, [pathlib.Path("x.npz")], 3, "cpu", 7) as env:
            assert not env.closed
        contact = 0.04 if token == "genesis+dr:contact0.04" else None  # Genesis: one value per scene
        assert made[-1] == ({"sim": setting.sim, "motions": ["x.npz"], "terrain": setting.terrain, "dr": dr,
                             "num_envs": 3, "device": "cpu", "seed": 7, "start": "frame0", "exclude_test": False,
                             "termination": "mean", "contact_timeconst_s": contact, "clamp_targets": False}, env)
        assert env.closed
    with ev.opened_env({**cfg, "clamp_targets": True}, ev.parse_setting("mujoco", "isaaclab"), [], 3, "cpu", 7):
        assert made[-1][0]["clamp_targets"]  # a clamp-trained checkpoint's env clamps in every setting
    with pytest.raises(RuntimeError, match="boom"), ev.opened_env(cfg, setting, [], 3, "cpu", 7):
        raise RuntimeError("boom")
    assert made[-1][1].closed  # closed on an error too: Isaac Lab allows one live env per process


def test_load_policy_dispatches_on_the_checkpoint_kind(tmp_path, monkeypatch):
    import student
    calls = []
    for module, name in ((model, "load_teacher"), (student, "load_policy")):
        monkeypatch.setattr(module, name, lambda path, device, m=name: calls.append(m) or m)
    for kind, loader in (("teacher", "load_teacher"), ("student", "load_policy")):
        torch.save({"kind": kind, "args": {}, "env_cfg": {}, "obs_layout": {}, "model": {}}, tmp_path / f"{kind}.pt")
        assert ev.load_policy(tmp_path / f"{kind}.pt", "cpu") == loader
    assert calls == ["load_teacher", "load_policy"]


def scripted_main(tmp_path, monkeypatch, fail_label="nohcdr", raise_at_step=None, kinds=None):
    """Patch evaluate.py's env builder and policy loader with scripted ones; returns (Args, built envs)."""
    folder = tmp_path / "packets"
    folder.mkdir()
    kinds = kinds or {"a_seg00": "robot", "a_seg01": "robot", "b": "robot"}
    for clip, kind in kinds.items():
        write_motion(folder / f"{clip}.npz", kind)
    paths = []
    for name in ("hord", "nohcdr"):  # env_cfg["run"]: which checkpoint the scripted env is built for
        paths.append(str(tmp_path / f"{name}.pt"))
        torch.save({"kind": "teacher", "args": {}, "env_cfg": {"sim": "isaaclab", "run": name},
                    "obs_layout": {"proprio": [5, 3]}, "model": {}}, paths[-1])
    built = []

    def make_env(**cfg):
        assert not built or built[-1].closed, "a second env was built before the first was closed"
        assert cfg["start"] == "frame0" and not cfg["exclude_test"]
        built.append(ScriptedEnv(cfg["num_envs"], [4, 6, 5][:len(cfg["motions"])], fail_at={(0, 0): 2} if
                                 cfg["run"] == fail_label else None, raise_at_step=raise_at_step))
        built[-1].build_seed = cfg["seed"]
        return built[-1]
    monkeypatch.setattr(envs, "make_env", make_env)
    monkeypatch.setattr(ev, "load_policy", lambda path, device: (ZeroPolicy(), model.load_checkpoint(path)))
    args = ev.Args(ckpt=tuple(paths), labels=("HoRD", "HoRD w/o HCDR"), settings=("in_domain", "zero_shot+dr"),
                   motions=str(folder), seeds=(3, 5), episodes=2, out_dir=str(tmp_path / "out"))
    return args, built


def test_main_end_to_end_on_scripted_envs(tmp_path, monkeypatch):
    """The whole command (checkpoints -> settings -> seeds -> episodes -> files) with the env and policy scripted."""
    args, built = scripted_main(tmp_path, monkeypatch)
    summary = ev.main(dataclasses.replace(args, render=str(tmp_path / "first.png")))
    assert (tmp_path / "first.png").stat().st_size > 10_000  # the first episode, drawn
    # one env per (checkpoint, setting), built with the first seed, reseeded for every seed, closed after
    assert len(built) == 4 and all(e.closed and e.seeds == [3, 5] and e.build_seed == 3 for e in built)
    assert summary["labels"] == ["HoRD", "HoRD w/o HCDR"] and summary["clips"] == ["a_seg00", "a_seg01", "b"]
    assert [s["name"] for s in summary["settings"]] == ["isaaclab", "genesis+dr"]
    csv_lines = (tmp_path / "out" / "episodes.csv").read_text().splitlines()
    # header + ckpts x seeds x clips x (1 episode without DR + 2 with)
    assert len(csv_lines) == 1 + 2 * 2 * 3 * (1 + 2)
    # clip "a_seg00" episode 0 is the one env 0 fails at step 2 for the ablation; its body error is 0.1 m, but an
    # early end is never a success
    assert summary["results"]["HoRD w/o HCDR"]["isaaclab"]["success"]["mean"] == pytest.approx(400 / 6)
    assert summary["results"]["HoRD w/o HCDR"]["isaaclab"]["fell"]["mean"] == pytest.approx(200 / 6)
    assert summary["results"]["HoRD w/o HCDR"]["genesis+dr"]["success"]["n"] == 12
    report = (tmp_path / "out" / "table.md").read_text()
    assert "| HoRD w/o HCDR |" in report
    lo, hi = (f"{100 * x:.1f}" for x in ev.wilson(12, 12))
    assert f"| HoRD | 100.0 [{lo}, {hi}] [12/12] |" in report.split("## Push recovery")[1]  # all last >= 2 steps
    assert "cut short" not in report


def test_the_grid_mean_pools_its_cells_per_m_t_probe(tmp_path, monkeypatch):
    """Grid cells get a `grid_mean` setting (one per m_t probe): its episodes are the cells' episodes, kept apart."""
    args, built = scripted_main(tmp_path, monkeypatch)
    cells = ("in_domain+dr:delay8", "in_domain+dr:mass0.8", "in_domain+dr:delay8:mt_empty")
    summary = ev.main(dataclasses.replace(args, settings=cells))
    names = [s["name"] for s in summary["settings"]]
    assert names == ["isaaclab+dr:delay8", "isaaclab+dr:mass0.8", "isaaclab+dr:delay8:mt_empty", "grid_mean",
                     "grid_mean:mt_empty"]
    ablation = summary["results"]["HoRD w/o HCDR"]
    assert ablation["grid_mean"]["success"]["n"] == 24 and ablation["grid_mean:mt_empty"]["success"]["n"] == 12
    per_cell = [ablation[c]["success"]["mean"] for c in names[:2]]
    assert ablation["grid_mean"]["success"]["mean"] == pytest.approx(sum(per_cell) / 2) and min(per_cell) < 100.0
    paired = [c for c in summary["comparisons"]["robot"] if c["setting"] == "grid_mean" and c["metric"] == "success"]
    assert paired[0]["n"] == 24  # the cells' episodes stay distinct pairs (clip keys carry the cell)
    with open(tmp_path / "out" / "episodes.csv") as f:  # checkpoints x cells x seeds x clips x episodes, once each
        assert sorted({r["setting"] for r in csv.DictReader(f)}) == sorted(names[:3])
    assert len((tmp_path / "out" / "episodes.csv").read_text().splitlines()) == 1 + 2 * 3 * 2 * 3 * 2


def test_history_probes_empty_or_roll_the_history_across_the_envs():
    obs = {"history": torch.arange(5.0)[:, None, None].expand(5, 16, 93), "history_mask": torch.ones(5, 16, dtype=bool),
           "proprio": torch.zeros(5, 5, 3)}
    assert ev.history_probe(obs, (), None) is obs
    empty = ev.history_probe(obs, ("delay8", "mt_empty"), None)
    assert not empty["history_mask"].any() and empty["history"] is obs["history"] and empty["proprio"] is obs["proprio"]
    for seed in range(20):  # a nonzero roll: every env reads another env's history, the mask moves with it
        rolled = ev.history_probe(obs, ("mt_shuffled",), torch.Generator().manual_seed(seed))
        source = rolled["history"][:, 0, 0].long()
        assert sorted(source.tolist()) == list(range(5)) and (source != torch.arange(5)).all()


def test_ridge_probe_r2_recovers_a_linear_term_and_not_noise():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 40, generator=gen, dtype=torch.float64)
    split = torch.arange(2000) % 4 % 3  # 0, 1, 2, 0: fit, penalty, test
    y = x[:, 3] - 0.5 * x[:, 7] + 0.1 * torch.randn(2000, generator=gen, dtype=torch.float64)
    assert ev.ridge_r2(x, y, split) > 0.95
    assert ev.ridge_r2(x, torch.randn(2000, generator=gen, dtype=torch.float64), split) < 0.05


def test_main_notes_the_episodes_max_steps_cut_off(tmp_path, monkeypatch):
    args, built = scripted_main(tmp_path, monkeypatch)
    args = dataclasses.replace(args, num_envs=2, episodes=1, max_steps=5)
    summary = ev.main(args)  # 3 clips on 2 envs: env 0 plays a_seg00 (4 steps), then b (1 step); env 1 a_seg01
    assert summary["notes"] == []
    assert len((tmp_path / "out" / "episodes.csv").read_text().splitlines()) == 1 + 2 * 2 * 2 * 3
    args = dataclasses.replace(args, max_steps=3, out_dir=str(tmp_path / "out3"))
    with pytest.warns(UserWarning, match="not reached"):
        summary = ev.main(args)  # nothing ends within 3 steps: clip b (env 0's second episode) is never reached
    hord, ablation = args.ckpt
    assert summary["notes"][0] == f"{hord} | isaaclab: 2 of 6 planned episodes not reached within --max-steps 3"
    assert not any(n.startswith(f"{ablation} | isaaclab") for n in summary["notes"])  # env 0 fails at step 2
    report = (tmp_path / "out3" / "table.md").read_text()
    assert "**Notes**" in report and "; 16 of all 20 recorded episodes were cut short by --max-steps" in report


def test_blown_up_episodes_are_counted_in_the_notes():
    settings = [ev.parse_setting(s, "genesis") for s in ("genesis", "genesis+dr")]
    rows = [{"label": "HoRD", "ckpt": "hord.pt", "setting": s.name, "clip": "a", "motion": "a", "seed": 0,
             "episode": e, "nan": int(s.dr and e == 1)} for s in settings for e in range(2)]
    notes = ev.coverage_notes(rows, ["hord.pt"], settings, planned={s.name: 2 for s in settings}, max_steps=0)
    assert notes == ["hord.pt | genesis+dr: 1 of 2 episodes blew up (NaN state); they count as failures and are left "
                     "out of the error means"]


def test_main_closes_the_env_when_a_rollout_fails(tmp_path, monkeypatch):
    args, built = scripted_main(tmp_path, monkeypatch, raise_at_step=3)
    with pytest.raises(RuntimeError, match="engine exploded"):
        ev.main(args)
    assert len(built) == 1 and built[0].closed


def test_main_on_human_keypoint_commands(tmp_path, monkeypatch):
    args, built = scripted_main(tmp_path, monkeypatch, kinds={"131_01_seg00": "human_keypoints", "a": "robot"})
    summary = ev.main(args)
    rows = (tmp_path / "out" / "episodes.csv").read_text().splitlines()
    header = rows[0].split(",")
    commands = {r.split(",")[header.index("clip")]: r.split(",")[header.index("command")] for r in rows[1:]}
    assert commands == {"131_01_seg00": "human_keypoints", "a": "robot"}
    keypoint_rows = [r.split(",") for r in rows[1:] if "human_keypoints" in r]
    for r in keypoint_rows:  # 0.1 m off: clip 0 of the scripted env
        assert r[header.index("g_mpjpe_mm")] == "nan"
        assert float(r[header.index("keypoint_err_mm")]) == pytest.approx(100)
    assert summary["results_keypoint_commands"]["HoRD"]["isaaclab"]["keypoint_err_mm"]["mean"] == pytest.approx(100)
    assert summary["results"]["HoRD"]["isaaclab"]["g_mpjpe_mm"]["mean"] == pytest.approx(200)  # clip 1: 0.2 m
    # the ablation's env 0 falls at step 2 of its first episode after each reseed: command 131_01_seg00, episode 0
    assert summary["results_keypoint_commands"]["HoRD w/o HCDR"]["isaaclab"]["fell"]["mean"] == pytest.approx(100)
    report = (tmp_path / "out" / "table.md").read_text()
    assert "## Human keypoint commands" in report
    per_command = report.split("## Per command: IsaacLab (ID)")[1].split("##")[0].strip().splitlines()
    assert per_command[0] == ("| Motion | HoRD keypoint err (mm)↓ | HoRD falls (%)↓ | HoRD steps↑ | HoRD w/o "
                              "HCDR keypoint err (mm)↓ | HoRD w/o HCDR falls (%)↓ | HoRD w/o HCDR steps↑ |")
    assert per_command[2:] == ["| 131_01 | 100 | 0.0 (2 near-identical starts) | 4 | 100 | 100.0 (2 near-identical "
                               "starts) | 2 |"]


# ---------------------------------------------------------------------------------------------------------------------
# Real short evaluations on CPU, both engines (slow: engine start-up and kernel compilation).
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def handsup_packets(tmp_path_factory):
    """The shortest test-split clip (B_HandsUp, 7.4 s: one segment) converted to an SSJR packet."""
    out = tmp_path_factory.mktemp("packets")
    ssjr.convert(ssjr.Convert(src=(ssjr.SAMPLES / "g1_moves" / "bonus" / "B_HandsUp.csv",), out=out))
    return sorted(out.glob("*.npz"))


@pytest.fixture(scope="module")
def keypoint_command(tmp_path_factory):
    """A human keypoint command (CMU BVH 131_02, first segment) as `ssjr.py convert` writes it."""
    out = tmp_path_factory.mktemp("keypoints")
    ssjr.convert(ssjr.Convert(src=(ssjr.SAMPLES / "cmu_bvh" / "131_02.bvh",), out=out))
    return out / "131_02_seg00.npz"


def assert_no_live_isaaclab_sim():
    """Every env evaluate.py builds is closed when it is done (Isaac Lab allows one per process)."""
    import isaaclab.sim as sim_utils
    assert sim_utils.SimulationContext.instance() is None


class JudgedStates:
    """A real env whose step() checks that the states evaluate.py records right after it (env.body_pos_w,
    env.ref_body_pos_w) are the ones the env judged: their errors are the env's own info['metrics']."""

    def __init__(self, env):
        self.env, self.steps = env, 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, action):
        out = self.env.step(action)
        ours = envs.body_error_metrics(self.env.body_pos_w, self.env.ref_body_pos_w)
        for name, value in ours.items():
            torch.testing.assert_close(value, out[3]["metrics"][name], rtol=0, atol=1e-3, msg=name)
        self.steps += 1
        return out


class ReferencePolicy:
    """PD targets = the next reference joint angles: no learning, but a deterministic, meaningful actor."""
    actor_obs = ZeroPolicy.actor_obs

    def act(self, obs):
        return obs["ref_dof_pos"]


@pytest.mark.slow
@pytest.mark.parametrize("sim", ["genesis", "isaaclab"])
def test_real_rollout_metrics_on_both_engines(tmp_path, sim, handsup_packets, keypoint_command):
    """One env for the setting, reseeded for seeds 0, 1 and 0 again; a robot clip and a human keypoint command."""
    ckpt = {"kind": "teacher", "args": {}, "env_cfg": {"sim": "isaaclab"}}
    setting = ev.parse_setting(f"{sim}+dr", "isaaclab")
    motions = [handsup_packets[0], keypoint_command]
    clips, kinds = [p.stem for p in motions], [ssjr.packet_kind(p) for p in motions]
    assert kinds == [ev.ROBOT, ev.HUMAN_KEYPOINTS]
    plan = ev.episode_plan(2, len(motions), 1)
    runs = []
    with ev.opened_env(ckpt["env_cfg"], setting, motions, len(plan), "cpu", 0) as env:
        env.reset()
        ckpt["obs_layout"] = env.obs_layout  # a checkpoint of this env's layout
        checked = JudgedStates(env)
        for seed in (0, 1, 0):
            runs.append(list(ev.evaluate_seed(checked, ReferencePolicy(), ckpt, "ref.pt", "reference", setting, seed,
                                              clips, kinds, plan, max_steps=40)))
        assert checked.steps >= 3  # at least one step per seed was checked
    if sim == "isaaclab":
        assert_no_live_isaaclab_sim()
    for out in runs:
        assert sorted(row["clip"] for row, _ in out) == ["131_02_seg00", "B_HandsUp_seg00"]
        for row, rec in out:
            assert 1 <= row["steps"] <= 40 and row["truncated"] == int(row["steps"] == 40 and not row["fell"])
            assert rec["body_pos_w"].shape == (row["steps"], 30, 3)
            assert 0 <= row["keypoint_err_mm"] < 500 and row["pushes"] == 0  # first push after >= 5 s
            if row["command"] == ev.ROBOT:
                assert row["success"] == 1.0 - row["fell"]  # env terminates on the same 0.5 m rule
                assert 0 <= row["g_mpjpe_mm"] < 600 and 0 <= row["mpjpe_mm"] <= row["g_mpjpe_mm"] + 200
                assert all(0 < row[k] <= 1 for k in ("dv_rew", "kb_rew", "lr_rew", "rv_rew", "rav_rew"))
            else:  # the env judges a keypoint command by its keypoints alone
                assert all(math.isnan(row[m]) for m in ev.METRICS)
                last = envs.body_error_metrics(*(torch.as_tensor(rec[k][-1]) for k in ("body_pos_w",
                                                                                         "ref_body_pos_w")))
                assert row["fell"] == float(last["keypoint_err_m"] > envs.TERMINATION_ERR_M)  # the mean test
    # reseed(0) replays seed 0: same psi, same trajectories; seed 1 draws other dynamics
    first, other, again = ({row["clip"]: (row, rec) for row, rec in out} for out in runs)
    for clip, (row, rec) in first.items():
        assert again[clip][0]["psi_mass_scale"] == row["psi_mass_scale"] != other[clip][0]["psi_mass_scale"]
        assert again[clip][0]["steps"] == row["steps"]
        np.testing.assert_allclose(again[clip][1]["body_pos_w"], rec["body_pos_w"], atol=1e-4)
    rows = [row for out in runs[:2] for row, _ in out]
    summary = ev.write_outputs(tmp_path, rows, ["reference"], [setting], 0.01)
    assert summary["results"]["reference"][setting.name]["success"]["n"] == 2  # 1 episode x 2 seeds
    assert summary["results_keypoint_commands"]["reference"][setting.name]["keypoint_err_mm"]["n"] == 2
    report = (tmp_path / "table.md").read_text()
    assert report.count("| reference |") >= 4 and "## Human keypoint commands" in report


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory, handsup_packets):
    """An untrained teacher and student of the 'cpu' preset sizes in teacher.py's / student.py's checkpoint format;
    the teacher was 'trained' on isaaclab, the student's env_cfg is the teacher's (as student.py makes it)."""
    import student
    import teacher
    args = dataclasses.replace(teacher.PRESETS["cpu"], sim="isaaclab", motions=str(handsup_packets[0].parent),
                               terrain="flat", num_envs=1)
    env_cfg = {"sim": args.sim, "motions": args.motions, "terrain": args.terrain, "dr": "default"}  # as teacher.main
    env = envs.make_env(**{**env_cfg, "sim": "genesis"}, num_envs=1, exclude_test=False)  # layout only
    try:
        env.reset()
        layout = env.obs_layout
    finally:
        env.close()
    folder = tmp_path_factory.mktemp("ckpt")
    paths = folder / "tiny_teacher.pt", folder / "tiny_student.pt"
    torch.save({"kind": "teacher", "args": dataclasses.asdict(args), "env_cfg": env_cfg, "rng": [],
                "obs_layout": layout, "model": model.Agent(layout, args).state_dict()}, paths[0])
    student_args = dataclasses.replace(student.PRESETS["cpu"], teacher_ckpt=str(paths[0]),
                                       **{k: getattr(args, k) for k in student.MODEL_SIZES})  # as student.train does
    torch.save({"kind": "student", "args": dataclasses.asdict(student_args), "env_cfg": env_cfg,
                "rng": [], "obs_layout": layout, "model": student.StudentPolicy(layout, student_args).state_dict()},
               paths[1])
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("sim", ["genesis", "isaaclab"])
def test_main_with_tiny_teacher_and_student_checkpoints(tmp_path, sim, tiny_checkpoints, handsup_packets):
    """The command on real envs: 2 checkpoints (one env each, closed before the next), 2 seeds, 2 envs, 40 steps."""
    args = ev.Args(ckpt=tuple(map(str, tiny_checkpoints)), settings=(sim,), motions=str(handsup_packets[0].parent),
                   seeds=(0, 1), episodes=2, num_envs=2, max_steps=40, out_dir=str(tmp_path))
    summary = ev.main(args)
    if sim == "isaaclab":
        assert_no_live_isaaclab_sim()
    assert summary["settings"][0]["in_domain"] == (sim == "isaaclab")
    for label in ("tiny_teacher", "tiny_student"):
        assert summary["results"][label][sim]["g_mpjpe_mm"]["n"] == 2
    lines = (tmp_path / "episodes.csv").read_text().splitlines()
    assert len(lines) == 1 + 2 * 2 * 1  # checkpoints x seeds x one episode of the one clip (no DR: near-identical)
    assert {line.split(",")[lines[0].split(",").index("kind")] for line in lines[1:]} == {"teacher", "student"}
    comparisons = summary["comparisons"][ev.ROBOT]  # the student against the teacher (the first label), in the cell
    assert {(c["label"], c["reference"], c["setting"]) for c in comparisons} == {("tiny_student", "tiny_teacher", sim)}
    assert {"success", "g_mpjpe_mm"} <= {c["metric"] for c in comparisons} and all(c["n"] == 2 for c in comparisons)
    assert "## Paired comparisons" in (tmp_path / "table.md").read_text()
