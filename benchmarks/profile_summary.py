"""Summarize py-spy raw profiles (`py-spy record -f raw --subprocesses`): per process, its busiest
frames (inclusive samples), so two configurations' host time can be compared line by line.

Usage: python3 benchmarks/profile_summary.py prof_relay.txt prof_noprefix-relay.txt [--top 25]
"""

import argparse
import collections


def summarize(path: str, top: int) -> str:
    procs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        try:
            n = int(n)
        except ValueError:
            continue
        frames = stack.split(";")
        named = [f for f in frames if f.startswith("process ")]
        body = [f for f in frames if not f.startswith("process ")]
        label = named[-1][:70] if named else "?"
        totals[label] += n
        for f in set(body):
            procs[label][f] += n
    lines = [f"== {path}"]
    for label, total in totals.most_common():
        if total < 50:
            continue
        lines.append(f"-- {label}: {total} samples")
        lines += [f"{n:8d} {100 * n / total:5.1f}%  {f}" for f, n in procs[label].most_common(top)]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    for path in args.files:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
