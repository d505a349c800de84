"""`lmforge report RUN`: its options, and the glue to lmforge/train/run_report.py."""

from lmforge.cli.arguments import RAW, add_run


def add_report(report) -> None:
    report.description = (
        "Write RUN/report.md, the page to share about a run: its config, the data, the cost (tokens, FLOPs, "
        "time, MFU, the plan's predictions beside what was measured), the loss curves, the evaluation scores "
        "over training and at the end, and the sample. See docs/evaluation.md.")
    report.epilog, report.formatter_class = "examples:\n  lmforge report runs/<name>", RAW
    add_run(report, "run folder")


def cmd_report(args) -> int:
    from lmforge.train.run_report import write_report

    print(f"wrote {write_report(args.run)}")
    return 0
