"""`python -m partitions cleanup` (run from tests/, as root): remove every namespace,
link, nft table, node and data directory the partition harness made; `leftovers` lists
them without removing anything; `netem` says whether `tc ... netem` works here."""

from __future__ import annotations

import sys

from .cluster import cleanup_all, leftovers, netem_available


def main(argv: list[str]) -> int:
    verb = argv[0] if argv else ""
    if verb == "cleanup":
        removed = cleanup_all()
        print("removed: " + (", ".join(removed) or "nothing"))
        left = leftovers()
        if left:
            print("still present: " + ", ".join(left), file=sys.stderr)
            return 1
        return 0
    if verb == "netem":
        ok = netem_available()
        print("tc netem works here" if ok else "tc netem does not work here (no sch_netem)")
        return 0 if ok else 1
    if verb == "leftovers":
        left = leftovers()
        print("\n".join(left) or "none")
        return 1 if left else 0
    print("usage: python -m partitions cleanup | leftovers | netem", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
