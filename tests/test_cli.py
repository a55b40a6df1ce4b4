"""What users see when they get something wrong: one line `error: <file or flag>: <problem>`, exit 1, no traceback,
from every script (each case runs the script as a user would, in a subprocess)."""
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]


def run(*argv, cwd=REPO):
    start = time.perf_counter()
    out = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=300)
    return out, time.perf_counter() - start


def one_line_error(out, *fragments):
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-2000:]
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("script", ["teacher.py", "student.py"])
def test_paper_preset_without_cuda_stops_at_once(script):
    out, seconds = run(script, "--num-envs", "4096", "--teacher-ckpt", "t.pt") if script == "student.py" else \
        run(script, "--num-envs", "4096")
    line = one_line_error(out, "CUDA is not available", "--device cpu", "--preset cpu")
    assert seconds < 60, seconds  # import time only: nothing is built
    print(f"\n{script}: {line} ({seconds:.1f} s)")


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    torch.save({"kind": "teacher", "model": {}}, d / "ok.pt")
    (d / "truncated.pt").write_bytes((d / "ok.pt").read_bytes()[:40])
    torch.save([1, 2, 3], d / "list.pt")
    torch.save({"kind": "student", "args": {}, "obs_layout": {}, "model": {}}, d / "student.pt")
    torch.save({"kind": "teacher", "args": {}, "obs_layout": {}, "model": {}, "env_cfg": {"sim": "genesis"}, "rng": []},
               d / "teacher.pt")
    (d / "keypoints").mkdir()
    np.savez(d / "keypoints" / "131_01_seg00.npz", kind=np.array("human_keypoints"))
    return d


@pytest.mark.parametrize("argv, fragments", [
    (["teacher.py", "--preset", "cpu", "--resume", "{d}/truncated.pt"], ["truncated.pt: not a readable checkpoint"]),
    (["teacher.py", "--preset", "cpu", "--resume", "{d}/list.pt"],
     ["list.pt: expected a teacher checkpoint, found 'list'"]),
    (["teacher.py", "--preset", "cpu", "--resume", "{d}/student.pt"],
     ["student.pt: expected a teacher checkpoint, found 'student'"]),
    (["teacher.py", "--preset", "bogus"], ["--preset: unknown preset 'bogus'"]),
    (["teacher.py", "--preset", "cpu", "--motions", "{d}/missing.npz"], ["missing.npz: no such motion"]),
    (["teacher.py", "--preset", "cpu", "--minibatch-size", "999999"],
     ["--minibatch-size: 999999 is larger than a rollout"]),
    (["teacher.py", "--preset", "cpu", "--motions", "{d}/keypoints"], ["keypoints: only human keypoint commands"]),
    (["teacher.py", "--preset", "cpu", "--motions", "{d}/keypoints/131_01_seg00.npz"],
     ["131_01_seg00.npz: only human keypoint commands"]),
    (["teacher.py", "--preset", "cpu", "--amp"], ["--amp: bf16 autocast is for CUDA devices"]),
    (["envs.py", "bench", "--sim", "physx"], ["--sim: unknown sim 'physx'"]),
    (["student.py", "--preset", "cpu", "--teacher-ckpt", "{d}/truncated.pt"], ["truncated.pt: not a readable"]),
    (["student.py", "--preset", "cpu", "--teacher-ckpt", "{d}/student.pt"],
     ["student.pt: expected a teacher checkpoint, found 'student'"]),
    (["student.py", "--preset", "cpu", "--resume", "{d}/teacher.pt", "--teacher-ckpt", "x"],
     ["teacher.pt: expected a student checkpoint, found 'teacher'"]),
    (["export.py", "--ckpt", "{d}/list.pt"], ["list.pt: expected a student checkpoint, found 'list'"]),
    (["student.py", "--preset", "cpu", "--teacher-ckpt", "x", "--buffer-iterations", "0"],
     ["--buffer-iterations: must be at least 1"]),
    (["evaluate.py", "--ckpt", "{d}/teacher.pt", "--seeds", "-1"], ["--seeds", "distinct seeds >= 0"]),
    (["evaluate.py", "--ckpt", "{d}/truncated.pt"], ["truncated.pt: not a readable"]),
    (["evaluate.py", "--ckpt", "{d}/list.pt"], ["list.pt: expected a teacher or student checkpoint, found 'list'"]),
    (["evaluate.py", "--ckpt", "{d}/teacher.pt", "--settings", "physx"], ["--settings: bad setting 'physx'"]),
    (["evaluate.py", "--ckpt", "{d}/teacher.pt", "--parity"],
     ["--parity: give one student checkpoint (--ckpt) and its export (--onnx)"]),
    (["evaluate.py", "--ckpt", "{d}/ok.pt"], ["ok.pt: teacher checkpoint without ['args', 'obs_layout', 'env_cfg'"]),
])
def test_user_errors_are_one_line(bad_files, argv, fragments):
    out, _ = run(*(a.format(d=bad_files) for a in argv))
    one_line_error(out, *fragments)
