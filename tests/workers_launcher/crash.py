"""Exit at once with the code given as the first argument (a crash loop)."""

import sys

if __name__ == "__main__":
    sys.exit(int(sys.argv[1]))
