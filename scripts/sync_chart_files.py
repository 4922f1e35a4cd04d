"""Copy the monitoring files into the Helm chart, which can read only its own files.

    python scripts/sync_chart_files.py           # copy (and drop copies whose source is gone)
    python scripts/sync_chart_files.py --check   # exit 1, naming each file, if a copy differs

The Grafana dashboard and the Prometheus rules have one source each, under deploy/;
the chart's templates read the copies under deploy/helm/pdserve/files/ through
`.Files.Get` (a chart cannot reach outside its directory, and `helm package` would
not follow a symlink out of it). tests/deploy/test_helm_chart.py runs the check.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHART_FILES = Path("deploy/helm/pdserve/files")
# source (repository-relative) -> copy (relative to the chart's files/)
COPIES = {
    Path("deploy/grafana/pdserve.json"): Path("grafana/pdserve.json"),
    Path("deploy/prometheus/pdserve-rules.yaml"): Path("prometheus/pdserve-rules.yaml"),
}


def stale(repo: Path = REPO) -> list[str]:
    """Each copy that does not match its source: differs, is missing, or outlives it."""
    problems = []
    for source, copy in COPIES.items():
        src, dst = repo / source, repo / CHART_FILES / copy
        if src.is_file() and (not dst.is_file() or dst.read_bytes() != src.read_bytes()):
            problems.append(f"{CHART_FILES / copy}: differs from {source}")
        elif not src.is_file() and dst.exists():
            problems.append(f"{CHART_FILES / copy}: {source} does not exist")
    return problems


def sync(repo: Path = REPO) -> list[str]:
    """Bring every copy in line with its source; returns what changed."""
    changed = []
    for problem in stale(repo):
        path = problem.split(":", 1)[0]
        source = next(s for s, c in COPIES.items() if CHART_FILES / c == Path(path))
        dst = repo / path
        if (repo / source).is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(repo / source, dst)
        else:
            dst.unlink()
            for folder in dst.parents:  # leave no empty folders behind in the chart
                if folder == repo / CHART_FILES.parent or any(folder.iterdir()):
                    break
                folder.rmdir()
        changed.append(problem)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="report stale copies, change nothing")
    parser.add_argument("--repo", type=Path, default=REPO, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    problems = stale(args.repo) if args.check else sync(args.repo)
    for problem in problems:
        print(problem, file=sys.stderr if args.check else sys.stdout)
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
