"""deploy.py: the robot side of the ONNX contract, its imports, and the parity check against the MuJoCo training env
(a student with random weights: parity is about inputs, not skill)."""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import deploy  # noqa: E402
import evaluate as ev  # noqa: E402
import export as onnx_export  # noqa: E402
from test_student import make_student_ckpt  # noqa: E402

pytestmark = pytest.mark.slow
REPO = pathlib.Path(__file__).resolve().parents[1]
# Isaac Lab's breadth-first joint order, as MuJoCo indices (FACTS.md): a deployer's classic mistake
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


def test_the_contract_states_every_choice(export):
    import onnx
    meta = {p.key: json.loads(p.value) for p in onnx.load(str(export[1])).metadata_props}
    assert meta["contract"] == json.loads(json.dumps(onnx_export.DEPLOY_CONTRACT))
    for choice in ("history", "proprio_rows", "gravity_direction", "terrain_grid", "keypoint_resampling", "pd_law"):
        assert len(meta["contract"][choice]) > 40, choice
    assert meta["contract"]["keypoint_steps"] == list(range(-7, 5))


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
    assert out.returncode == 0 and "steps" in out.stdout, out.stderr
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    out = run("--onnx", bad, "--motion", train_packet)
    assert out.returncode != 0 and out.stderr.strip().startswith(f"error: {bad}:") and "Traceback" not in out.stderr
    keypoints = tmp_path / "k.npz"
    np.savez(keypoints, kind="human_keypoints")
    out = run("--onnx", export[1], "--motion", keypoints)
    assert out.returncode != 0 and "human keypoint command" in out.stderr and "Traceback" not in out.stderr
