"""``python -m jaxserve`` is ``python -m jaxserve.serve``."""

import sys

if __name__ == "__main__":
    from jaxserve.serve import main

    sys.exit(main())
