"""Figure plumbing shared by every *_plots.py module: a headless pyplot and one way to save a PNG.

The figures live beside their idea's machinery: eval_plots.py, probe_plots.py, scaling_report.py, train_plots.py.
"""
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), imported only when a figure is drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path, dpi: int = 120, tight: bool = True, paths: list | None = None) -> str:
    """Write `fig` to `path` (its folder made if missing), close it; the path as a string, appended to `paths`."""
    if tight:
        fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    if paths is not None:
        paths.append(str(path))
    return str(path)


ARM_COLORS = {"baseline": "tab:blue", "smelt": "tab:red"}   # every figure's arm colours; other arms: OTHER_COLORS
OTHER_COLORS = ("tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def arm_colors(arms) -> dict[str, str]:
    """{arm: colour} for arms in plan order: the Baseline and SMELT fixed, any other the next of OTHER_COLORS."""
    others = iter(OTHER_COLORS * (len(arms) // len(OTHER_COLORS) + 1))
    return {a: ARM_COLORS.get(a) or next(others) for a in arms}
