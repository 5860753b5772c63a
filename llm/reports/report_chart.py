"""The report card's chart (report.png, beside report.md): each task's accuracy with its standard error as a
bar, chance as a mark on it, and the reference models' figures as points. Drawn where matplotlib is installed
(requirements-extra.txt); the Markdown table says everything without it."""

import io

CHART = "report.png"


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def png(scores: list, chances: dict, references: dict, title: str) -> bytes:
    """The chart as PNG bytes: scores are scoring.TaskScore (those with items), references model -> task ->
    acc."""
    import matplotlib
    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt
    done = [s for s in scores if s.items]
    rows = range(len(done))
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(done) + 1.6), dpi=110)
    try:
        ax.barh(rows, [100 * s.acc for s in done], xerr=[100 * (s.acc_stderr or 0) for s in done],
                color="#4c78a8", capsize=3, label="this model (acc ± standard error)")
        guess = [(i, chances.get(s.task)) for i, s in enumerate(done) if chances.get(s.task) is not None]
        if guess:
            ax.scatter([100 * c for _, c in guess], [i for i, _ in guess], marker="|", s=300, color="black",
                       label="chance", zorder=3)
        for (model, results), marker in zip(references.items(), "osD^v"):
            points = [(i, results[s.task]) for i, s in enumerate(done) if s.task in results]
            if points:
                ax.scatter([100 * v for _, v in points], [i for i, _ in points], marker=marker,
                           color="#f58518", label=model, zorder=4)
        ax.set_yticks(list(rows), [f"{s.task} {s.shots}-shot" if s.shots else s.task for s in done])
        ax.invert_yaxis()  # the table's order, top to bottom
        ax.set_xlim(0, 100)
        ax.set_xlabel("accuracy, %")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png")
        return out.getvalue()
    finally:
        plt.close(fig)
