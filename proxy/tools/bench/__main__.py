"""``python -m shmproxy.tools.bench ...``: the same program as the ``shmproxy-bench`` console script."""
import sys

from shmproxy.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
