"""``python -m proxy.bench ...``: the same program as the ``shmproxy-bench`` console script."""
import sys

from proxy.bench import main

if __name__ == "__main__":
    sys.exit(main())
