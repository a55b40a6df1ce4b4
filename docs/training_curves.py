"""Training curves of teacher.py runs from their TensorBoard logs: a table of the env-steps and iterations at which a
moving mean (20 iterations) of training success first reaches each threshold, and one figure of all runs against
env-steps (top) and iterations (bottom).

    python docs/training_curves.py --runs NAME=DIR ... --out docs/training_curves.png
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import tyro
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


@dataclasses.dataclass
class Args:
    runs: list[str]  # NAME=RUN_DIR (a label and a teacher.py run folder); several runs may share a name (seeds)
    out: str = ""  # figure path (.png); '' prints the table only
    window: int = 20  # iterations of the moving mean
    thresholds: tuple[float, ...] = (0.5, 0.9)  # training success levels to report
    tags: tuple[str, ...] = ("charts/success_rate", "charts/episode_length", "losses/approx_kl", "losses/actor_lr")


def scalars(run_dir: str, tag: str) -> tuple[np.ndarray, np.ndarray]:
    """(env-steps, values) of one tag over every event file of a run (a resumed run's later file wins)."""
    points = {}
    for f in sorted(pathlib.Path(run_dir).glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            points.update({e.step: e.value for e in acc.Scalars(tag)})
    steps = np.array(sorted(points))
    return steps, np.array([points[s] for s in steps])


def moving_mean(x: np.ndarray, window: int) -> np.ndarray:
    x = np.nan_to_num(x)  # an iteration with no ended episode logs NaN
    c = np.cumsum(np.insert(x, 0, 0.0))
    return np.array([(c[i + 1] - c[max(0, i + 1 - window)]) / min(window, i + 1) for i in range(len(x))])


def main(args: Args):
    runs = [r.split("=", 1) for r in args.runs]
    print(f"| run | iterations | env-steps | success (last {args.window} its) | final KL | final actor lr | "
          + " | ".join(f"env-steps (its) to {t:.0%}" for t in args.thresholds) + " |")
    print("|---" * (6 + len(args.thresholds)) + "|")
    curves = {}
    for name, run_dir in runs:
        steps, success = scalars(run_dir, "charts/success_rate")
        smooth = moving_mean(success, args.window)
        reach = []
        for t in args.thresholds:
            hit = np.flatnonzero(smooth >= t)
            reach.append(f"{steps[hit[0]] / 1e6:.2f} M ({hit[0] + 1})" if len(hit) else "not reached")
        kl, lr = scalars(run_dir, "losses/approx_kl")[1], scalars(run_dir, "losses/actor_lr")[1]
        print(f"| {name} | {len(steps)} | {steps[-1] / 1e6:.2f} M | {smooth[-1]:.2f} | {kl[-1]:.4f} | {lr[-1]:.1e} | "
              + " | ".join(reach) + " |")
        curves.setdefault(name, []).append((run_dir, steps, smooth))
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(2, len(args.tags), figsize=(4.5 * len(args.tags), 7), squeeze=False)
        for color, (name, members) in zip(plt.cm.tab10.colors, curves.items()):
            for i, (run_dir, _, _) in enumerate(members):
                for col, tag in enumerate(args.tags):
                    steps, values = scalars(run_dir, tag)
                    smooth = moving_mean(values, args.window)
                    for row, x in enumerate((steps / 1e6, np.arange(1, len(steps) + 1))):
                        axes[row, col].plot(x, smooth, color=color, label=name if i == 0 else None)
        for col, tag in enumerate(args.tags):
            for row, xlabel in enumerate(("env-steps (M)", "iterations (policy updates)")):
                axes[row, col].set(xlabel=xlabel, title=f"{tag} ({args.window}-it mean)" if row == 0 else None)
                axes[row, col].set_yscale("log" if tag.startswith("losses/") else "linear")
        axes[0, 0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out, dpi=100)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main(tyro.cli(Args))
