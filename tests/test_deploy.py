"""deploy.py: the robot side of the ONNX contract, its imports, and the parity check against the MuJoCo training env
(a student with random weights: parity is about inputs, not skill)."""
import json
import math
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import deploy  # noqa: E402
import envs  # noqa: E402
import evaluate as ev  # noqa: E402
import export as onnx_export  # noqa: E402
import ssjr  # noqa: E402
from test_student import make_student_ckpt  # noqa: E402

pytestmark = pytest.mark.slow
REPO = pathlib.Path(__file__).resolve().parents[1]
# A breadth-first joint order over the G1's tree (by depth, then MuJoCo order), as MuJoCo indices: the order PhysX-based
# Isaac Lab lists the joints in (the Newton backend of envs.IsaacLabSim keeps MuJoCo's), a deployer's classic mistake
ISAAC_FROM_MUJOCO = [0, 6, 12, 1, 7, 13, 2, 8, 14, 3, 9, 15, 22, 4, 10, 16, 23, 5, 11, 17, 24, 18, 25, 19, 26, 20, 27,
                     21, 28]


def test_deploy_imports_only_numpy_mujoco_and_onnxruntime():
    code = "import sys, deploy; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.split())
    third_party = {m for m in loaded if m not in sys.stdlib_module_names and not m.startswith("_")}
    mujocos_own = {"glfw", "cffi", "pycparser", "typing_extensions"}  # imported by mujoco itself
    assert third_party <= {"deploy", "numpy", "mujoco", "onnxruntime"} | mujocos_own, third_party


@pytest.fixture(scope="module")
def export(train_packet, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deploy")
    path, _ = make_student_ckpt(tmp / "s.pt")
    ckpt = torch.load(path, weights_only=False)
    ckpt["env_cfg"]["motions"] = str(train_packet)
    torch.save(ckpt, path)
    return path, onnx_export.export(onnx_export.Args(ckpt=str(path), onnx=str(tmp / "s.onnx")))


def parity(export, train_packet) -> str:
    ckpt, onnx = export
    return ev.parity(ev.Args(ckpt=(str(ckpt),), onnx=(str(onnx),), motions=str(train_packet), max_steps=25))


def test_the_contract_states_every_choice(export, train_packet):
    """The export's metadata holds the contract deploy.py is written from, and what each choice states agrees with
    what the training env computes: row widths and window lengths, the terrain grid's points, the IMU sensors it
    names, the PD law's lists and rates, the keypoint resampling's tick count."""
    import mujoco
    import onnx
    meta = {p.key: json.loads(p.value) for p in onnx.load(str(export[1])).metadata_props}
    contract = meta["contract"]
    assert contract == json.loads(json.dumps(onnx_export.DEPLOY_CONTRACT))
    layout = torch.load(export[0], weights_only=False)["obs_layout"]
    # proprio rows: s = the listed fields, then alpha (29); as many rows as the student reads
    s_fields = [int(w) for w in re.findall(r"\((\d+)\)", contract["proprio_rows"].split(";")[0])]
    assert s_fields == [29, 29, 3, 3] and sum(s_fields) == envs.SPARSE_STATE_DIM
    assert [contract["proprio_steps"], sum(s_fields) + 29] == layout["student_proprio"] == [8, 93]
    # the history: K entries, padding marked by the mask
    assert contract["history_len"] == layout["history"][0] == layout["history_mask"][0] == 16
    assert "history_mask False" in contract["history"] and "oldest first" in contract["history"]
    # the keypoint window: one step per row of the command the env builds
    assert contract["keypoint_steps"] == list(range(-7, 5)) and len(contract["keypoint_steps"]) == \
        layout["student_keypoints"][0]
    # the terrain grid as stated is the env's scan: index n i + j is the point (x0 + dx i, y0 + dy j)
    grid = re.search(r"index (\d+) i \+ j: the point \(([-\d.]+) \+ ([\d.]+) i, ([-\d.]+) \+ ([\d.]+) j\)",
                     contract["terrain_grid"])
    assert grid, contract["terrain_grid"]
    n, (x0, dx, y0, dy) = int(grid[1]), map(float, grid.groups()[1:])
    stated = torch.tensor([[x0 + dx * i, y0 + dy * j] for i in range(n) for j in range(n)])
    assert torch.allclose(stated, envs.SCAN_XY_M, atol=1e-6)
    assert n * n == meta["terrain_points"] == layout["terrain"][0]
    # the IMU sensors named are the scene's: the world z axis in the pelvis frame (gravity: (0, 0, -1) upright), a gyro
    scene = mujoco.MjModel.from_xml_path(str(deploy.SCENE_XML))
    up_sensor, gyro_sensor = re.findall(r"sensor (\w+)", contract["gravity_direction"])
    assert {up_sensor, gyro_sensor} == set(envs.IMU_SENSORS), contract["gravity_direction"]
    assert scene.sensor(gyro_sensor).type == mujoco.mjtSensor.mjSENS_GYRO
    assert scene.sensor(up_sensor).type == mujoco.mjtSensor.mjSENS_FRAMEZAXIS
    data = mujoco.MjData(scene)  # qpos0: the pelvis upright
    mujoco.mj_forward(scene, data)
    assert "(0, 0, -1) when upright" in contract["gravity_direction"]
    np.testing.assert_allclose(-data.sensor(up_sensor).data, [0.0, 0.0, -1.0], atol=1e-6)
    # the PD law: its lists, one entry per joint in dof_names order (the G1's motor limits), held for decimation
    # physics steps of physics_dt_s: one control step
    assert "tau = clip(kp (alpha - q) - kd qdot, -effort_limit_nm, effort_limit_nm)" in contract["pd_law"]
    g1_limits = [88.0 if ("hip_pitch" in n or "hip_yaw" in n or "waist_yaw" in n) else
                 139.0 if ("hip_roll" in n or "knee" in n) else 50.0 if ("ankle" in n or "waist" in n) else
                 5.0 if ("wrist_pitch" in n or "wrist_yaw" in n) else 25.0 for n in ssjr.DOF_NAMES]
    assert meta["effort_limit_nm"] == g1_limits and meta["dof_names"] == list(ssjr.DOF_NAMES)
    assert len(meta["kp"]) == len(meta["kd"]) == 29 and min(meta["kp"]) > 0 and min(meta["kd"]) > 0
    assert contract["physics_dt_s"] * contract["decimation"] == pytest.approx(meta["control_dt_s"]) == 0.02
    # keypoint resampling: n frames at fps give ticks 0 .. floor((n - 1) / (fps control_dt_s) + 1e-4), as the env's
    packet = ssjr.load_packet(train_packet)
    frames, fps = len(packet["dof_pos"]), float(packet["fps"])
    assert "floor((n - 1) / (fps control_dt_s) + 1e-4)" in contract["keypoint_resampling"]
    ticks = math.floor((frames - 1) / (fps * meta["control_dt_s"]) + 1e-4) + 1
    assert ticks == int(envs.MotionLib([train_packet], "cpu").num_ticks[0]) == 327  # M_ShortMove14: 326 steps


def test_a_good_export_matches_the_env_term_by_term(export, train_packet):
    assert parity(export, train_packet).startswith("all inputs match: 25 steps")


def test_parity_names_a_gyro_read_in_the_world_frame(export, train_packet, monkeypatch):
    read = deploy.Robot.read

    def world_frame_gyro(self, data=None):
        reading = read(self, data)
        d = self.data if data is None else data
        reading["gyro"] = d.xmat[1].reshape(3, 3) @ reading["gyro"]  # pelvis frame -> world frame
        return reading
    monkeypatch.setattr(deploy.Robot, "read", world_frame_gyro)
    verdict = parity(export, train_packet)
    assert "student_proprio" in verdict and "(gyro[" in verdict, verdict


def test_parity_names_joints_in_isaac_labs_order(export, train_packet, monkeypatch):
    depth = [0] * len(ssjr.BODY_PARENTS)  # body b >= 1 hangs on joint b - 1
    for b in range(1, len(depth)):
        depth[b] = depth[ssjr.BODY_PARENTS[b]] + 1
    assert ISAAC_FROM_MUJOCO == [b - 1 for b in sorted(range(1, len(depth)), key=lambda b: (depth[b], b))]
    read = deploy.Robot.read

    def isaac_order(self, data=None):
        reading = read(self, data)
        reading["q"], reading["qd"] = reading["q"][ISAAC_FROM_MUJOCO], reading["qd"][ISAAC_FROM_MUJOCO]
        return reading
    monkeypatch.setattr(deploy.Robot, "read", isaac_order)
    verdict = parity(export, train_packet)
    assert verdict.startswith("step 0: student_proprio") and "(joint pos" in verdict, verdict


def test_evaluate_scores_the_onnx_in_mujoco_beside_the_torch_student(export, train_packet, tmp_path):
    """The same student as a checkpoint (MuJoCo env) and as an export (deploy.py): same physics, same contract, so
    the same episode: equal survival and g-mpjpe within 1 mm."""
    ckpt, onnx = export
    summary = ev.main(ev.Args(ckpt=(str(ckpt),), onnx=(str(onnx),), labels=("student",), onnx_labels=("student",),
                              motions=str(train_packet), settings=("mujoco",), seeds=(0,), out_dir=str(tmp_path)))
    torch_run, onnx_run = (summary["results"]["student"][s] for s in ("mujoco", "deploy"))
    assert onnx_run["steps"]["mean"] == torch_run["steps"]["mean"]
    assert abs(onnx_run["g_mpjpe_mm"]["mean"] - torch_run["g_mpjpe_mm"]["mean"]) < 1.0
    assert "deploy.py ONNX, MuJoCo" in (tmp_path / "table.md").read_text()


def test_deploy_cli_runs_and_bad_files_are_one_line_errors(export, train_packet, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "deploy.py", *map(str, a)], cwd=REPO, capture_output=True,  # noqa
                                    text=True)
    out = run("--onnx", export[1], "--motion", train_packet)
    assert out.returncode == 0, out.stderr
    # one line: the clip, the steps played of the clip's (the env's tick table: 327 ticks, 326 steps), the verdict
    line = re.fullmatch(r"M_ShortMove14_seg00: (\d+) of (\d+) steps, (success|failed) \(max GTE ([\d.]+) m, "
                        r"g-mpjpe (\d+) mm\)", out.stdout.strip().splitlines()[-1])
    assert line, out.stdout
    played, total = int(line[1]), int(line[2])
    assert total == int(envs.MotionLib([train_packet], "cpu").num_ticks[0]) - 1 and 1 <= played <= total
    # the verdict follows the numbers: success = the whole clip within failure_m (0.5 m)
    assert (line[3] == "success") == (played == total and float(line[4]) < envs.TERMINATION_ERR_M), line[0]

    def one_line_error(out, path, problem):
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and problem in lines[0], lines
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    one_line_error(run("--onnx", bad, "--motion", train_packet), bad, "not a readable ONNX model")
    keypoints = tmp_path / "k.npz"
    np.savez(keypoints, kind="human_keypoints")
    one_line_error(run("--onnx", export[1], "--motion", keypoints), keypoints,
                   "a human keypoint command has no robot start state")


def test_a_clamped_students_export_says_so_and_deploy_clamps_as_the_env_does(export, train_packet, tmp_path):
    """A student of a --clamp-targets teacher: its export's contract names the ranges (None otherwise), deploy.py
    sends alpha within them, and parity holds while its raw targets lie beyond them (alpha_0 moved out)."""
    import onnx
    ckpt = torch.load(export[0], weights_only=False)
    ckpt["env_cfg"]["clamp_targets"] = True
    ckpt["model"]["alpha_0"] = ckpt["model"]["alpha_0"] + 3.0  # every raw target beyond its range
    torch.save(ckpt, path := tmp_path / "clamped.pt")
    out = onnx_export.export(onnx_export.Args(ckpt=str(path), onnx=str(tmp_path / "clamped.onnx")))
    metas = [{p.key: json.loads(p.value) for p in onnx.load(str(f)).metadata_props} for f in (export[1], out)]
    kin = ssjr.G1Kinematics()
    assert metas[0]["alpha_clamp_rad"] is None
    assert metas[1]["alpha_clamp_rad"] == envs.joint_range_rad().tolist()
    np.testing.assert_allclose(metas[1]["alpha_clamp_rad"], [kin.dof_lower_rad, kin.dof_upper_rad], atol=1e-6)
    policy = deploy.Policy(out)
    inputs = {i.name: np.zeros([1 if d == "batch" else d for d in i.shape][1:], bool if i.type == "tensor(bool)"
                               else np.float32) for i in policy.session.get_inputs()}
    alpha, _ = policy(inputs)
    assert (alpha <= kin.dof_upper_rad.numpy() + 1e-6).all() and (alpha >= kin.dof_lower_rad.numpy() - 1e-6).all()
    verdict = ev.parity(ev.Args(ckpt=(str(path),), onnx=(str(out),), motions=str(train_packet), max_steps=10))
    assert verdict.startswith("all inputs match")
