"""The benchmark scripts' reports (scripts/bench-*.sh, through bench_report in scripts/bench-lib.sh): reading
the lines each run appended to its file (one a round, in round order), medians over rounds, and Markdown
tables. The Python twins' own helpers are in pyutil.py."""
import fnmatch
import os
import statistics

median = statistics.median


def _prefixes(p):
    return (p,) if isinstance(p, str) else tuple(p)


class Runs:
    """The run files of one benchmark (its $out folder), by name."""

    def __init__(self, folder):
        self.folder = folder

    def names(self, pattern="*"):
        """The names of the run files that match the shell pattern, sorted."""
        return sorted(n for n in os.listdir(self.folder)
                      if fnmatch.fnmatch(n, pattern) and os.path.isfile(os.path.join(self.folder, n)))

    def rows(self, name, skip=(), only=()):
        """The lines of run file NAME split into words: blank lines, lines that start with one of `skip`
        and, when `only` is given, lines that start with none of it, left out."""
        skip, only = _prefixes(skip), _prefixes(only)
        with open(os.path.join(self.folder, name)) as f:
            return [line.split() for line in f
                    if line.strip() and not line.startswith(skip) and (not only or line.startswith(only))]

    def column(self, name, i=0, skip=(), only=()):
        """Column i of NAME's rows as floats: one a round."""
        return [float(r[i]) for r in self.rows(name, skip, only)]

    def median(self, name, i=0, skip=(), only=()):
        """The median over rounds of column i of NAME's rows."""
        return median(self.column(name, i, skip, only))


def medians(rows):
    """The median of each column of `rows` (as floats)."""
    return [median(float(x) for x in c) for c in zip(*rows)]


def ratios(ours, theirs):
    """Each round's own ratio ours / theirs (the two ran back to back in that round)."""
    return [a / b for a, b in zip(ours, theirs)]


def paired_ratio(ours, theirs):
    """The median of the rounds' own ratios: slow drifts of a shared machine cancel, which they do not in
    the ratio of the medians."""
    return median(ratios(ours, theirs))


def table_row(*cells):
    """One row of a Markdown table; an empty cell prints as "| |"."""
    print("|" + "".join(f" {c} |" if c != "" else " |" for c in cells))


def table_head(*cols, align="l"):
    """A Markdown table's header row and rule; `align` gives each column "l" (left) or "r" (right), and the
    columns it does not reach are right-aligned."""
    table_row(*cols)
    align = align.ljust(len(cols), "r")
    print("|" + "".join("---|" if a == "l" else "---:|" for a in align))
