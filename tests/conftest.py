"""Shared fixtures: SSJR packets converted once per test session from the real data in ../shared/data."""
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import ssjr  # noqa: E402

torch.set_num_threads(1)  # small batched tensors: extra threads only contend with the simulators on 2 cores

TRAIN_CLIP = "karate/M_ShortMove14.csv"  # a calm 6.5 s clip (FACTS.md, CPU learning calibration)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: builds a simulator or trains (minutes); CI runs them too")


@pytest.fixture(scope="session")
def packets(tmp_path_factory) -> pathlib.Path:
    """Two real G1 Moves clips (one training, one held-out test clip) as SSJR packets."""
    src = ssjr.DATA_ROOT / "g1_moves"
    if not src.exists():
        pytest.skip(f"G1 Moves data not found at {src} (set HORD_DATA)")
    out = tmp_path_factory.mktemp("packets")
    ssjr.convert(ssjr.Convert(src=(src / TRAIN_CLIP, src / "bonus" / "B_HandsUp.csv"), out=out))
    return out


@pytest.fixture(scope="session")
def train_packet(packets) -> pathlib.Path:
    return packets / "M_ShortMove14_seg00.npz"
