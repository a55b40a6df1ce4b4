"""Shared fixtures: SSJR packets converted once per test session from the sample motions in data/samples."""
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import ssjr  # noqa: E402

torch.set_num_threads(1)  # small batched tensors: extra threads only contend with the simulators on 2 cores

TRAIN_CLIP = "karate/M_ShortMove14.csv"  # a calm 6.5 s clip: the README's one-clip recipe and the shipped models'
# clip (README "Shipped models"; docs/experiments.md, CPU learning calibration)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: builds a simulator or trains (minutes); CI runs them too")
    config.addinivalue_line("markers", "cuda: the paper-scale GPU path (pytest -m cuda); skipped without CUDA")


@pytest.fixture(scope="session")
def packets(tmp_path_factory) -> pathlib.Path:
    """Two real G1 Moves clips (one training, one held-out test clip) as SSJR packets."""
    src = ssjr.SAMPLES / "g1_moves"
    out = tmp_path_factory.mktemp("packets")
    ssjr.convert(ssjr.Convert(src=(src / TRAIN_CLIP, src / "bonus" / "B_HandsUp.csv"), out=out))
    return out


@pytest.fixture(scope="session")
def train_packet(packets) -> pathlib.Path:
    return packets / "M_ShortMove14_seg00.npz"


class FakeEnv:
    """The TrackingEnv interface on random observations of a given layout (no simulator), for the trainers' loops;
    step number `crash_at` raises, as a dying engine would."""

    def __init__(self, layout: dict, num_envs: int, crash_at: int = 0):
        import envs
        self.layout, self.num_envs, self.crash_at, self.steps = layout, num_envs, crash_at, 0
        self.obs_layout = {k: list(v) for k, v in layout.items()}
        self.gen = torch.Generator().manual_seed(0)
        self.psi = {k: torch.ones(num_envs) for k in envs.PSI_KEYS}
        self.nan_resets = torch.zeros((), dtype=torch.long)
        self.reward_terms = tuple(envs.REWARD_COEFFS)
        self.motions = type("Motions", (), {"mean_dof_pos": torch.zeros(29), "__len__": lambda self: 1})()
        self.dr = self.clip_weights = None
        self.physics_s = 0.0

    def _obs(self):
        obs = {k: torch.randn(self.num_envs, *s, generator=self.gen) for k, s in self.layout.items()}
        obs["history_mask"] = obs["history_mask"] > -1.0
        return obs

    def reset(self):
        return self._obs()

    def step(self, alpha):
        self.steps += 1
        if self.steps == self.crash_at:
            raise RuntimeError("the engine died")
        n = self.num_envs
        done = torch.rand(n, generator=self.gen) < 0.1
        info = {"metrics": {"gt_err_m": torch.rand(n, generator=self.gen), "mpjpe_m": torch.rand(n)},
                "reward_terms": {k: torch.rand(n) for k in self.reward_terms}, "time_out": done & (alpha[:, 0] > 0),
                "clip": torch.zeros(n, dtype=torch.long)}
        info["failed"] = done & ~info["time_out"]
        return self._obs(), torch.rand(n, generator=self.gen), done, info

    def close(self):
        pass


def read_log(run_dir) -> dict[str, list[float]]:
    """A run's per-iteration TensorBoard scalars (a resumed run's too) as lists keyed by tag, with the env-steps of each
    iteration as 'global_step'; {} before the first iteration."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0}).Reload()  # 0: keep every iteration
    log = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    return {"global_step": [e.step for e in events.Scalars("iteration")], **log} if log else {}
